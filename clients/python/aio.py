"""The asyncio client: the same surface as the sync one, on zmq.asyncio.

One DEALER per `AsyncClient`, read by one task that demultiplexes replies to
per-request queues. Use it from one event loop. Cancelling the task that
iterates a stream, or breaking out of `async for`, cancels the generation.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq
import zmq.asyncio

from kvmux import paths
from kvmux import protocol as p

from . import errors, wire


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
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Queue] = {}
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
        body = wire.open_body(system, **options)
        wait = (timeout or self.timeout) + (body.queue_wait_s or 0.0)
        opened = await self._call(p.Op.OPEN, "", body, wait)
        session = AsyncSession(self, opened)
        self._sessions[session.id] = session
        return session

    async def stats(self, *, timeout: float | None = None) -> p.BrokerStats:
        return await self._call(p.Op.STATS, "", p.Stats(), timeout)

    async def ping(self, *, timeout: float | None = None) -> p.Pong:
        return await self._call(p.Op.PING, "", p.Ping(), timeout)

    async def drain(self, grace_s: float | None = None, *, timeout: float | None = None) -> p.Ack:
        return await self._call(p.Op.DRAIN, "", p.Drain(grace_s=grace_s), timeout)

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

    async def _request(self, op: str, session_id: str, body: Any) -> tuple[int, asyncio.Queue]:
        if self._closed:
            raise errors.KvmuxError("client is closed")
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = self._loop.create_task(self._read())
        rid = next(self._ids)
        replies: asyncio.Queue = asyncio.Queue()
        self._calls[rid] = replies
        await self._socket.send_multipart(wire.frames(op, rid, session_id, body))
        return rid, replies

    def _send(self, parts_for_id) -> None:
        """Send a frame that expects no reply we wait for (cancel, credit);
        callable from a finalizer, so it only schedules the send."""
        if self._closed or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._socket.send_multipart, parts_for_id(next(self._ids)))
        except RuntimeError:  # the loop is closed
            pass

    async def _wait(
        self, rid: int, replies: asyncio.Queue, timeout: float | None, what: str, session_id: str = ""
    ) -> wire.Reply:
        timeout = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(replies.get(), timeout)
        except asyncio.TimeoutError:
            self._calls.pop(rid, None)
            raise wire.timeout_error(what, timeout, rid, session_id) from None

    async def _call(self, op: str, session_id: str, body: Any, timeout: float | None) -> Any:
        rid, replies = await self._request(op, session_id, body)
        try:
            return wire.unwrap(await self._wait(rid, replies, timeout, op, session_id))
        finally:
            self._calls.pop(rid, None)

    async def _read(self) -> None:
        while True:
            reply = wire.parse(await self._socket.recv_multipart())
            if reply is None:
                continue
            replies = self._calls.pop(reply.request_id, None) if reply.last else self._calls.get(reply.request_id)
            if replies is None:
                wire.log.debug("reply to unknown request %d dropped (timed out or cancelled)", reply.request_id)
                continue
            replies.put_nowait(reply)


class AsyncSession:
    """See `Session`; every call is a coroutine except `chat`/`generate`,
    which return an `AsyncStream` to iterate with `async for`."""

    def __init__(self, client: AsyncClient, opened: p.SessionOpened):
        self.client = client
        self.opened = opened
        self.id = opened.session_id
        self._feed: _AsyncFeed | None = None
        self._closed = False

    def chat(self, text: str, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        return self.generate(messages=[p.ChatMessage(role="user", content=text)], timeout=timeout, **options)

    def generate(self, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        return AsyncStream(self, wire.generate_body(**options), timeout)

    async def append(
        self,
        messages: wire.MessagesLike | None = None,
        *,
        token_ids: list[int] | None = None,
        timeout: float | None = None,
    ) -> p.Appended:
        await self._settle()
        return await self.client._call(p.Op.APPEND, self.id, wire.append_body(messages, token_ids), timeout)

    async def cancel(self, *, timeout: float | None = None) -> p.Ack:
        return await self.client._call(p.Op.CANCEL, self.id, p.Cancel(), timeout)

    async def info(self, token_ids: bool = False, *, timeout: float | None = None) -> p.SessionInfo:
        return await self.client._call(p.Op.INFO, self.id, p.Info(token_ids=token_ids), timeout)

    async def close(self, *, timeout: float | None = None) -> p.Closed | None:
        if self._closed:
            return None
        await self._settle()
        self._closed = True
        self.client._sessions.pop(self.id, None)
        return await self.client._call(p.Op.CLOSE, self.id, p.Close(), timeout)

    async def _start(self, body: p.Generate, timeout: float | None) -> _AsyncFeed:
        await self._settle()
        rid, replies = await self.client._request(p.Op.GENERATE, self.id, body)
        self._feed = _AsyncFeed(self.client, wire.StreamState(rid, self.id, body.credit), replies, timeout)
        return self._feed

    async def _settle(self) -> None:
        if self._closed:
            raise errors.SessionNotFound(f"session {self.id} was closed", session_id=self.id)
        if self._feed is not None:
            feed, self._feed = self._feed, None
            try:
                await feed.close()
            except errors.KvmuxError:
                pass  # how an abandoned stream ended is nobody's concern now

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r}, worker={self.opened.worker_id!r})"


class _AsyncFeed:
    """The consuming side of one stream, kept by the session so it can drain
    a stream its user dropped or whose task was cancelled."""

    def __init__(self, client: AsyncClient, state: wire.StreamState, replies: asyncio.Queue, timeout: float | None):
        self.client = client
        self.state = state
        self.replies = replies
        self.timeout = timeout

    async def next(self) -> p.Chunk | None:
        state = self.state
        if state.done:
            return None
        try:
            reply = await self.client._wait(state.request_id, self.replies, self.timeout, "generate", state.session_id)
        except errors.Timeout:
            state.done = True
            self.cancel()
            raise
        except asyncio.CancelledError:
            self.cancel()
            raise
        chunk = state.feed(reply)
        n = state.grant()
        if n:
            self.client._send(lambda rid: state.credit_frames(n, rid))
        return chunk

    def cancel(self) -> None:
        if not self.state.cancel_sent:
            self.client._send(self.state.cancel_frames)

    async def close(self) -> None:
        if self.state.done:
            return
        self.cancel()
        while await self.next() is not None:
            pass


class AsyncStream:
    """Async iterator of `Chunk`s; `.result` holds the `GenerateResult` after
    it ends. The request goes out on the first `__anext__`."""

    def __init__(self, session: AsyncSession, body: p.Generate, timeout: float | None):
        self.session = session
        self._body = body
        self._timeout = timeout
        self._feed: _AsyncFeed | None = None

    @property
    def result(self) -> p.GenerateResult | None:
        return self._feed.state.result if self._feed else None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> p.Chunk:
        if self._feed is None:
            self._feed = await self.session._start(self._body, self._timeout)
        chunk = await self._feed.next()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        """Cancel the generation if it runs and wait for its end."""
        if self._feed is not None:
            await self._feed.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        feed = getattr(self, "_feed", None)
        if feed is not None and not feed.state.done:
            feed.cancel()
