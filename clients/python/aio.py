"""The asyncio client: core.py's steps awaited on zmq.asyncio, with the same
surface as the sync one.

One DEALER per `AsyncClient`, read by one task that demultiplexes replies to
per-request queues. Use it from one event loop. Cancelling the task that
iterates a stream, or breaking out of `async for`, cancels the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvmux import protocol as p

from . import calls, core, errors, wire


class AsyncStream(core.StreamBase):
    """Async iterator of `Chunk`s; `.result` holds the `GenerateResult` after
    it ends. The request goes out on the first `__anext__` (`request_id` is
    None until then)."""

    def __init__(self, link: core.Link, start: Callable[[], calls.Steps]):
        self._link = link
        self._start = start  # the steps that send the request and return its reader

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> p.Chunk:
        if self._reader is None:
            self._reader = await self._link.run(self._start())
        chunk = await self._link.run(self._reader.next())
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        """Cancel the generation if it runs and wait for its end."""
        if self._reader is not None:
            await self._link.run(self._reader.drain())

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSession(core.SessionCore):
    """See `Session`; every call is a coroutine except `chat`/`generate`,
    which return an `AsyncStream` to iterate with `async for`."""

    client: AsyncClient

    def chat(self, text: str, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        return self.generate(timeout=timeout, **core.chat_options(text, options))

    def generate(self, *, timeout: float | None = None, **options: Any) -> AsyncStream:
        body = self._generate_body(options)
        return AsyncStream(self._link, lambda: self._start(body, timeout))

    async def append(
        self,
        messages: wire.MessagesLike | None = None,
        *,
        token_ids: list[int] | None = None,
        timeout: float | None = None,
    ) -> p.Appended:
        return await self._link.run(self._append(messages, token_ids, timeout))

    async def cancel(self, *, timeout: float | None = None) -> p.Ack:
        return await self._link.run(self._cancel(timeout))

    async def rewind(self, messages: int, *, timeout: float | None = None) -> p.Rewound:
        """Take the session back to the end of the turn where its conversation
        held `messages` messages (regenerate: the count before the last reply;
        edit the last message: before it). Its slab keeps what it can: the
        next generate prefills only `Rewound.pending_tokens` and the new messages."""
        return await self._link.run(self._rewind(messages, timeout))

    async def fork(self, messages: int | None = None, *, timeout: float | None = None, **options: Any) -> AsyncSession:
        """A new session: a copy of this one taken back to the end of the
        turn where its conversation held `messages` messages (None: as it is
        now), sharing nothing with it afterwards. A branch of the
        conversation that prefills nothing again: the copy starts from this
        session's slab. Options: admission, queue_wait_s, client_name."""
        return await self._link.run(self._fork(messages, timeout, options))

    async def mark(
        self,
        marks: dict[str, int],
        notes: dict[str, str] | None = None,
        drop: Iterable[str] = (),
        *,
        from_end: bool = False,
        timeout: float | None = None,
    ) -> p.Marked:
        """Name points of the conversation: `marks` maps a name to the
        message count where it points (one the conversation has reached),
        `notes` keeps your own data beside a name, `drop` forgets names;
        with `from_end` the counts go back from the conversation's end.
        They live in the session's record; `Client.find` finds the session
        by them. A rewind forgets the names past the point it goes back to."""
        return await self._link.run(self._mark(marks, notes, drop, from_end, timeout))

    async def info(
        self, token_ids: bool = False, marks: Iterable[str] = (), *, timeout: float | None = None
    ) -> p.SessionInfo:
        """The session's state; `marks`: also these names' points and notes (those it has)."""
        return await self._link.run(self._info(token_ids, marks, timeout))

    async def close(self, *, timeout: float | None = None) -> p.Closed | None:
        return await self._link.run(self._close(timeout))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncClient(core.ClientCore):
    """`async with AsyncClient(endpoint) as client:`; `timeout` (seconds)
    bounds every call and, for a stream, the wait for each frame. For a tcp
    broker with CURVE: `server_key` (its public key, z85 or its .key file)
    and `secret_key` (ours: a NAME.key_secret file or a z85 secret)."""

    _session_class = AsyncSession
    _queue_class = asyncio.Queue

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = wire.DEFAULT_TIMEOUT_S,
        server_key: str | os.PathLike | None = None,
        secret_key: str | os.PathLike | None = None,
        context: zmq.asyncio.Context | None = None,
    ):
        super().__init__(endpoint, timeout, server_key, secret_key)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first call
        self._receiver: asyncio.Task | None = None
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._connect(self._socket)

    # ------------------------------------------------------------ public API

    async def open_session(
        self, system: str | None = None, *, timeout: float | None = None, **options: Any
    ) -> AsyncSession:
        """See `Client.open_session`."""
        return await self._run(self._open(system, timeout, options))

    async def resume_session(self, session_id: str, *, timeout: float | None = None) -> AsyncSession:
        """See `Client.resume_session`."""
        return await self._run(self._resume(session_id, timeout))

    async def list_sessions(self, *, timeout: float | None = None) -> list[p.SessionSummary]:
        return (await self._call(*core.list_sessions_request(), timeout)).sessions

    async def find(self, names: Iterable[str], *, timeout: float | None = None) -> p.Found | None:
        """Your session that has one of `names` (Session.mark), the first of
        them any has: Found(name, session_id); None when none has any."""
        try:
            return await self._call(*core.find_request(list(names)), timeout)
        except errors.SessionNotFound:
            return None

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
        await self._run(self._close_sessions())
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
        self._socket.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------- internals

    async def _run(self, steps: calls.Steps) -> Any:
        """Run steps to their result, awaiting each reply they wait for."""
        try:
            wait = next(steps)
            while True:
                try:
                    outcome = await asyncio.wait_for(wait.replies.get(), wait.timeout)
                except asyncio.TimeoutError:
                    outcome = wait.expired()
                except BaseException as exc:  # a cancelled task: the steps clean up and re-raise it
                    outcome = exc
                wait = calls.resume(steps, outcome)
        except StopIteration as stop:
            return stop.value

    async def _call(self, op: str, session_id: str, body: msgspec.Struct, timeout: float | None) -> Any:
        return await self._run(self._ask(op, session_id, body, timeout))

    def _post(self, frames: list[bytes]) -> None:
        # The send is scheduled on the loop, so this works from a finalizer
        # or another thread, and a send blocked at the HWM is bounded by the
        # caller's wait like any other.
        if self._loop is None:  # the first request, from a coroutine
            self._loop = asyncio.get_running_loop()
            self._receiver = self._loop.create_task(self._receive())
            self._loop.call_soon(self._socket.send_multipart, wire.HEARTBEAT)  # we answer heartbeats
        try:
            self._loop.call_soon_threadsafe(self._socket.send_multipart, frames)
        except RuntimeError:  # the loop is closed (a late finalizer)
            pass

    async def _receive(self) -> None:
        while True:
            if self._calls.deliver(await self._socket.recv_multipart()):
                with contextlib.suppress(zmq.Again):  # a full pipe: the broker is not reading us either
                    await self._socket.send_multipart(wire.HEARTBEAT, flags=zmq.NOBLOCK)
