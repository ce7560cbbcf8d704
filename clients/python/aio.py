"""The asyncio client: core.py's logic on zmq.asyncio, with the same surface
as the sync one.

One DEALER per `AsyncClient`, read by one task that demultiplexes replies to
per-request queues. Use it from one event loop. Cancelling the task that
iterates a stream, or breaking out of `async for`, cancels the generation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from kvmux import paths
from kvmux import protocol as p

from . import core, errors, wire


class AsyncClient:
    """`async with AsyncClient(endpoint) as client:`; `timeout` (seconds)
    bounds every call and, for a stream, the wait for each frame."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = wire.DEFAULT_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
    ):
        self.endpoint = endpoint or paths.default_frontend()
        self.timeout = timeout
        self._calls = core.Calls()
        self._sessions: dict[str, AsyncSession] = {}
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)

    # ------------------------------------------------------------ public API

    async def open_session(
        self, system: str | None = None, *, timeout: float | None = None, **options: Any
    ) -> AsyncSession:
        """See `Client.open_session`."""
        *request, wait = core.open_request(system, timeout, self.timeout, options)
        return self._session(await self._call(*request, wait))

    async def resume_session(self, session_id: str, *, timeout: float | None = None) -> AsyncSession:
        """See `Client.resume_session`."""
        return self._session(await self._call(*core.resume_request(session_id), timeout))

    async def list_sessions(self, *, timeout: float | None = None) -> list[p.SessionSummary]:
        return (await self._call(*core.list_sessions_request(), timeout)).sessions

    async def stats(self, *, timeout: float | None = None) -> p.BrokerStats:
        return await self._call(*core.stats_request(), timeout)

    async def ping(self, *, timeout: float | None = None) -> p.Pong:
        return await self._call(*core.ping_request(), timeout)

    async def drain(self, grace_s: float | None = None, *, timeout: float | None = None) -> p.Ack:
        return await self._call(*core.drain_request(grace_s), timeout)

    async def close(self) -> None:
        """Close this client's open sessions (best effort), then the socket."""
        if self._closed:
            return
        for session in list(self._sessions.values()):
            try:
                await session.close(timeout=min(self.timeout, 2.0))
            except errors.KvmuxError:
                pass
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self._socket.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------- internals

    def _session(self, opened: p.SessionOpened) -> AsyncSession:
        session = self._sessions.get(opened.session_id)
        if session is None:
            session = self._sessions[opened.session_id] = AsyncSession(self, opened)
        return session

    async def _request(self, op: str, session_id: str, body: Any) -> tuple[int, asyncio.Queue]:
        if self._closed:
            raise errors.KvmuxError("client is closed")
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = self._loop.create_task(self._read())
        replies: asyncio.Queue = asyncio.Queue()
        rid = self._calls.add(replies)
        await self._socket.send_multipart(wire.frames(op, rid, session_id, body))
        return rid, replies

    def _send(self, parts_for_id) -> None:
        """Send a frame that expects no reply we wait for (cancel, credit);
        callable from a finalizer, so it only schedules the send."""
        if self._closed or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._socket.send_multipart, parts_for_id(self._calls.next_id()))
        except RuntimeError:  # the loop is closed
            pass

    async def _wait(self, rid: int, replies: asyncio.Queue, timeout: float | None, what: str, session_id: str = ""):
        timeout = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(replies.get(), timeout)
        except asyncio.TimeoutError:
            raise wire.timeout_error(what, timeout, rid, session_id) from None

    async def _call(self, op: str, session_id: str, body: Any, timeout: float | None) -> Any:
        rid, replies = await self._request(op, session_id, body)
        try:
            return wire.unwrap(await self._wait(rid, replies, timeout, op, session_id))
        finally:
            self._calls.pop(rid)

    async def _read(self) -> None:
        while True:
            routed = self._calls.route(await self._socket.recv_multipart())
            if routed is not None:
                replies, reply = routed
                replies.put_nowait(reply)


class AsyncSession(core.SessionCore):
    """See `Session`; every call is a coroutine except `chat`/`generate`,
    which return an `AsyncStream` to iterate with `async for`."""

    client: AsyncClient

    def chat(self, text: str, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        return self.generate(timeout=timeout, **core.chat_options(text, options))

    def generate(self, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        self.check_open()
        return AsyncStream(self, wire.generate_body(**options), timeout)

    async def append(
        self,
        messages: wire.MessagesLike | None = None,
        *,
        token_ids: list[int] | None = None,
        timeout: float | None = None,
    ) -> p.Appended:
        await self._settle()
        return await self.client._call(*self.append_request(messages, token_ids), timeout)

    async def cancel(self, *, timeout: float | None = None) -> p.Ack:
        return await self.client._call(*self.cancel_request(), timeout)

    async def info(self, token_ids: bool = False, *, timeout: float | None = None) -> p.SessionInfo:
        return await self.client._call(*self.info_request(token_ids), timeout)

    async def close(self, *, timeout: float | None = None) -> p.Closed | None:
        if self.closed:
            return None
        await self._settle()
        return await self.client._call(*self.close_request(), timeout)

    async def _start(self, body: p.Generate, timeout: float | None) -> core.StreamCore:
        await self._settle()
        rid, replies = await self.client._request(p.Op.GENERATE, self.id, body)
        self.reader = core.StreamCore(self.client, rid, self.id, body.credit, replies, timeout)
        return self.reader

    async def _settle(self) -> None:
        reader = self.take_reader()
        if reader is not None:
            try:
                await _drain(reader)
            except errors.KvmuxError:
                pass  # how an abandoned stream ended is nobody's concern now

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _next(reader: core.StreamCore) -> p.Chunk | None:
    state = reader.state
    if state.done:
        return None
    try:
        reply = await reader.client._wait(
            state.request_id, reader.replies, reader.timeout, "generate", state.session_id
        )
    except errors.Timeout:
        state.done = True
        reader.client._calls.pop(state.request_id)
        reader.cancel()
        raise
    except asyncio.CancelledError:
        reader.cancel()
        raise
    return reader.take(reply)


async def _drain(reader: core.StreamCore) -> None:
    if reader.state.done:
        return
    reader.cancel()
    while await _next(reader) is not None:
        pass


class AsyncStream:
    """Async iterator of `Chunk`s; `.result` holds the `GenerateResult` after
    it ends. The request goes out on the first `__anext__` (`request_id` is
    None until then)."""

    def __init__(self, session: AsyncSession, body: p.Generate, timeout: float | None):
        self.session = session
        self._body = body
        self._timeout = timeout
        self._reader: core.StreamCore | None = None

    @property
    def result(self) -> p.GenerateResult | None:
        return self._reader.state.result if self._reader else None

    @property
    def request_id(self) -> int | None:
        return self._reader.state.request_id if self._reader else None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> p.Chunk:
        if self._reader is None:
            self._reader = await self.session._start(self._body, self._timeout)
        chunk = await _next(self._reader)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        """Cancel the generation if it runs and wait for its end."""
        if self._reader is not None:
            await _drain(self._reader)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None and not reader.state.done:
            reader.cancel()
