"""What the sync and asyncio clients share, written once: the logic of every
call (its request, the session's settle-before-next-call, a stream's
reading, credit and cancel), over calls.py's table of requests in flight.

That logic is written as *steps*: generators that yield a `Wait` whenever
they need a reply and are sent the reply, or thrown the exception that ended
the wait (a timeout, a cancelled task, Ctrl-C) to clean up after. A shell
supplies only its transport and how it waits: sync.py blocks on a
`queue.SimpleQueue` its I/O thread fills, aio.py awaits an `asyncio.Queue`
its zmq.asyncio task fills. Each public method is one line that runs steps.
Sessions and streams use their client only through its `Link`.

The two differ only where the event loop forces it: `AsyncSession.generate()`
is not a coroutine, so it can neither drain the previous stream nor send; its
request goes out on the stream's first `__anext__` (until then the stream's
`request_id` is None). The sync `generate()` sends at once. Both check the
session and the client in `generate()`, so a closed one raises there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import zmq

from kvmux import keys, paths
from kvmux import protocol as p

from . import errors, wire
from .calls import Calls, Replies, Steps, Wait

# A request before it has an id: its op, the session it addresses ("" for
# none) and its body.
Request = tuple[str, str, msgspec.Struct]

# ------------------------------------------------------------------ client


class Link(NamedTuple):
    """A client as its sessions and streams use it, and all they may use of
    it. The client fills it with its private methods: public ones would join
    its API."""

    run: Callable[[Steps], Any]  # the shell's: the steps' result, or (asyncio) an awaitable of it
    check_open: Callable[[], None]  # raises once the client is closed
    request: Callable[[str, str, msgspec.Struct], tuple[int, Replies]]  # sends; its id and its replies' queue
    ask: Callable[[str, str, msgspec.Struct, float | None], Steps]  # a request, then its reply unwrapped
    send: Callable[[Callable[[int], list[bytes]]], None]  # frames for a fresh id, no reply awaited
    wait: Callable[[Replies, float | None, str, int, str], Wait]  # with the client's default timeout and hint
    forget: Callable[[int], Replies | None]  # a request whose replies nobody reads any more
    detach: Callable[[str], None]  # a session the client's close leaves open


class ClientCore:
    """A client's state and the steps of its calls. A shell sets
    `_session_class` and `_queue_class`, and supplies `_post` and `_run`."""

    _session_class: type[SessionCore]
    _queue_class: Callable[[], Replies]

    def __init__(
        self,
        endpoint: str | None,
        timeout: float,
        server_key: str | os.PathLike | None,
        secret_key: str | os.PathLike | None,
    ):
        self.endpoint = endpoint or paths.default_frontend()
        # Several, comma-separated: a broker and its standbys on a shared
        # session store, one serving at a time; requests go to whichever
        # is connected (ZMQ_IMMEDIATE) and wait while none is.
        self.endpoints = [e.strip() for e in self.endpoint.split(",") if e.strip()]
        self.failover = len(self.endpoints) > 1
        self.timeout = timeout
        self._calls = Calls()
        self._sessions: dict[str, SessionCore] = {}
        self._closed = False
        self._server_key, self._secret_key = server_key, secret_key
        self.link = Link(
            run=self._run,
            check_open=self._check_open,
            request=self._request,
            ask=self._ask,
            send=self._send,
            wait=self._wait,
            forget=self._calls.pop,
            detach=self._detach,
        )

    def _connect(self, sock: zmq.Socket) -> None:
        """With `server_key`, CURVE: the broker is authenticated and the
        link encrypted; the broker admits `secret_key`'s public key or not."""
        sock.setsockopt(zmq.LINGER, 0)
        if self._server_key is not None:
            try:
                keys.secure_client(sock, self._server_key, self._secret_key)
            except keys.BadKey as exc:
                sock.close()
                raise errors.InvalidArgument(str(exc)) from None
        if self.failover:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        for endpoint in self.endpoints:
            sock.connect(endpoint)

    def _hint(self) -> str:
        """Why a broker that never answered may be silent: a CURVE handshake
        that failed looks, from here, just like a broker that is not there."""
        if self._calls.heard:
            return ""
        if self._server_key is not None:
            return f"no answer from {self.endpoint}: is the server key right, and is our key allowed?"
        if self.endpoint.startswith("tcp://"):
            return f"no answer from {self.endpoint}: is it running, and does it require CURVE keys (server_key=)?"
        return f"no answer from {self.endpoint}: is the broker running?"

    def _post(self, frames: list[bytes]) -> None:
        """Hand frames to the socket, without blocking, from any thread or
        from a finalizer (a dropped stream's cancel)."""
        raise NotImplementedError

    def _run(self, steps: Steps) -> Any:
        """Run steps to their result, waiting for each reply they ask for
        (asyncio: a coroutine)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise errors.KvmuxError("client is closed")

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _request(self, op: str, session_id: str, body: msgspec.Struct) -> tuple[int, Replies]:
        """Send a request; its replies arrive on the returned queue."""
        self._check_open()
        rid = self._calls.next_id()
        frames = wire.request_frames(op, rid, session_id, body)  # before listing it: a body may fail to encode
        replies = self._queue_class()
        self._calls.add(rid, replies)
        self._post(frames)
        return rid, replies

    def _send(self, frames_for: Callable[[int], list[bytes]]) -> None:
        """Send a request whose reply nobody waits for (cancel, credit)."""
        if not self._closed:
            self._post(frames_for(self._calls.next_id()))

    def _wait(self, replies: Replies, timeout: float | None, what: str, rid: int, session_id: str) -> Wait:
        return Wait(replies, self._timeout(timeout), what, rid, session_id, self._hint())

    def _answer(self, rid: int, replies: Replies, timeout: float | None, what: str, session_id: str = "") -> Steps:
        """The reply to a request, unwrapped; the request is forgotten
        however the wait ends."""
        try:
            return wire.unwrap((yield self._wait(replies, timeout, what, rid, session_id)))
        finally:
            self._calls.pop(rid)

    def _ask(self, op: str, session_id: str, body: msgspec.Struct, timeout: float | None) -> Steps:
        rid, replies = self._request(op, session_id, body)
        return (yield from self._answer(rid, replies, timeout, op, session_id))

    def _open(self, system: str | None, timeout: float | None, options: dict) -> Steps:
        body = wire.open_body(system, **options)
        # a queued open may wait queue_wait_s on top of the call's timeout
        timeout = self._timeout(timeout) + (body.queue_wait_s or 0.0)
        return self._session((yield from self._ask(p.Op.OPEN, "", body, timeout)))

    def _resume(self, session_id: str, timeout: float | None) -> Steps:
        return self._session((yield from self._ask(p.Op.RESUME, session_id, p.Resume(), timeout)))

    def _session(self, opened: p.SessionOpened) -> SessionCore:
        session = self._sessions.get(opened.session_id)
        if session is None:
            session = self._sessions[opened.session_id] = self._session_class(self, opened)
        return session

    def _detach(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _close_sessions(self) -> Steps:
        """Close this client's sessions (best effort), then refuse new calls."""
        for session in list(self._sessions.values()):
            try:
                yield from session._close(min(self.timeout, 2.0))
            except errors.KvmuxError:
                pass
        self._closed = True


def stats_request() -> Request:
    return p.Op.STATS, "", p.Stats()


def ping_request() -> Request:
    return p.Op.PING, "", p.Ping()


def drain_request(grace_s: float | None) -> Request:
    return p.Op.DRAIN, "", p.Drain(grace_s=grace_s)


def list_sessions_request() -> Request:
    return p.Op.SESSIONS, "", p.ListSessions()


def find_request(names: list[str]) -> Request:
    return p.Op.FIND, "", p.Find(names=list(names))


# ----------------------------------------------------------------- session


class SessionCore:
    """A session's state and the steps of its calls."""

    def __init__(self, client: ClientCore, opened: p.SessionOpened):
        self.client = client
        self.opened = opened
        self.id = opened.session_id
        self.closed = False
        self._link = client.link
        self._reader: StreamReader | None = None  # the last stream, drained before the next call

    def detach(self) -> None:
        """Keep the session in the daemon when this client closes (a client's
        close() closes the sessions it opened or resumed); resume it later
        by its id, from any client."""
        self._link.detach(self.id)

    def _check_open(self) -> None:
        if self.closed:
            raise errors.SessionNotFound(f"session {self.id} was closed", session_id=self.id)
        self._link.check_open()

    def _generate_body(self, options: dict) -> p.Generate:
        self._check_open()
        return wire.generate_body(**options)

    def _settle(self) -> Steps:
        """Cancel and drain the last stream if it is unfinished, so the next
        call finds the session idle."""
        self._check_open()
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                yield from reader.drain()
            except errors.KvmuxError:
                pass  # how an abandoned stream ended is nobody's concern now

    def _start(self, body: p.Generate, timeout: float | None) -> Steps:
        """Send a GENERATE; returns its StreamReader."""
        yield from self._settle()
        rid, replies = self._link.request(p.Op.GENERATE, self.id, body)
        self._reader = StreamReader(self.client, rid, self.id, body.credit, replies, timeout)
        return self._reader

    def _append(self, messages: wire.MessagesLike | None, token_ids: list[int] | None, timeout: float | None) -> Steps:
        yield from self._settle()
        return (yield from self._link.ask(p.Op.APPEND, self.id, wire.append_body(messages, token_ids), timeout))

    def _cancel(self, timeout: float | None) -> Steps:
        return self._link.ask(p.Op.CANCEL, self.id, p.Cancel(), timeout)

    def _rewind(self, messages: int, timeout: float | None) -> Steps:
        yield from self._settle()
        return (yield from self._link.ask(p.Op.REWIND, self.id, p.Rewind(messages=messages), timeout))

    def _fork(self, messages: int | None, timeout: float | None, options: dict) -> Steps:
        yield from self._settle()
        fork = p.Fork(session_id=self.id, messages=messages)
        return (yield from self.client._open(None, timeout, {**options, "fork": fork}))

    def _mark(self, marks: dict[str, int], notes: dict[str, str] | None, drop, from_end: bool, timeout) -> Steps:
        yield from self._settle()
        body = p.Mark(marks=dict(marks), notes=dict(notes or {}), drop=list(drop), from_end=from_end)
        return (yield from self._link.ask(p.Op.MARK, self.id, body, timeout))

    def _info(self, token_ids: bool, marks, timeout: float | None) -> Steps:
        return self._link.ask(p.Op.INFO, self.id, p.Info(token_ids=token_ids, marks=list(marks)), timeout)

    def _close(self, timeout: float | None) -> Steps:
        if self.closed:
            return None
        yield from self._settle()
        self.closed = True
        self._link.detach(self.id)
        return (yield from self._link.ask(p.Op.CLOSE, self.id, p.Close(), timeout))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, worker={self.opened.worker_id!r})"


def chat_options(text: str, options: dict) -> dict:
    return {**options, "messages": [p.ChatMessage(role="user", content=text)]}


# ------------------------------------------------------------------ stream


class StreamReader:
    """The consuming side of one generate stream. The session keeps it (not
    the user's stream object) so it can drain a stream its user dropped."""

    def __init__(
        self,
        client: ClientCore,
        request_id: int,
        session_id: str,
        credit: int,
        replies: Replies,
        timeout: float | None,
    ):
        self.link = client.link
        self.state = wire.StreamState(request_id, session_id, credit)
        self.replies = replies
        self.timeout = timeout

    def next(self) -> Steps:
        """The next chunk (None at the end), granting credit back as chunks
        are read. A timeout abandons the stream (nobody drains it); any other
        interruption cancels it and leaves the rest for the session to drain."""
        state = self.state
        if state.done:
            return None
        wait = self.link.wait(self.replies, self.timeout, "generate", state.request_id, state.session_id)
        try:
            reply = yield wait
        except errors.Timeout:
            state.done = True
            self.link.forget(state.request_id)
            self.cancel()
            raise
        except BaseException:
            self.cancel()
            raise
        chunk = state.take(reply)
        n = state.grant()
        if n:
            self.link.send(lambda rid: state.credit_frames(n, rid))
        return chunk

    def drain(self) -> Steps:
        """Cancel the generation if it still runs and read it to its end."""
        if not self.state.done:
            self.cancel()
        while (yield from self.next()) is not None:
            pass

    def cancel(self) -> None:
        if not self.state.cancel_sent:
            self.link.send(self.state.cancel_frames)


class StreamBase:
    """What Stream and AsyncStream share."""

    _reader: StreamReader | None = None  # an AsyncStream's, until it starts

    @property
    def result(self) -> p.GenerateResult | None:
        """The final `GenerateResult`, once the stream has ended."""
        return self._reader.state.result if self._reader is not None else None

    @property
    def request_id(self) -> int | None:
        """The GENERATE's request id (an AsyncStream's: None until it starts)."""
        return self._reader.state.request_id if self._reader is not None else None

    def __del__(self) -> None:
        # Dropped unfinished (a `break`): tell the worker to stop now; the
        # session drains what is left before its next call.
        if self._reader is not None and not self._reader.state.done:
            self._reader.cancel()
