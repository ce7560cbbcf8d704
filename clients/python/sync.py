"""The blocking client: core.py's steps run over a background I/O thread.

One DEALER socket per `Client`, owned by that thread: callers queue frames
for it and wait on a per-request queue it fills, so replies of many sessions
and interleaved streams are demultiplexed by request id, and a `Client` (with
its sessions) may be shared between threads. A stream should be consumed by
one thread at a time.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq

from kvmux import protocol as p

from . import calls, core, errors, wire


class Stream(core.StreamBase):
    """Iterator of `Chunk`s (`.text`, `.token_ids`); after it is exhausted,
    `.result` is the final `GenerateResult`. Breaking out of the loop (once
    the stream is dropped) or `close()` cancels the generation."""

    def __init__(self, reader: core.StreamReader):
        self._reader = reader

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> p.Chunk:
        chunk = self._reader.link.run(self._reader.next())
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        """Cancel the generation if it still runs and wait for its end, so the
        session is ready for the next turn."""
        self._reader.link.run(self._reader.drain())

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(core.SessionCore):
    """A chat session. Its history lives in the daemon (in a slab, or in the
    session store while idle) until it is closed; use it as a context manager
    to close it on exit. At most one append/generate runs at a time; starting
    one while an earlier stream is unfinished cancels and drains that
    stream."""

    client: Client

    def chat(self, text: str, *, timeout: float | None = None, **options: Any) -> Stream:
        """Append a user message and generate the reply (one round trip)."""
        return self.generate(timeout=timeout, **core.chat_options(text, options))

    def generate(self, *, timeout: float | None = None, **options: Any) -> Stream:
        """Stream a generation. Options: max_tokens, temperature, top_p, top_k,
        seed, stop, speculative (auto | off | lookup | draft), priority
        (-100..100, higher first), messages (appended first), credit (0 = no
        flow control). Where the program uses OpenTelemetry, its current span
        goes with the request (traceparent)."""
        return Stream(self._link.run(self._start(self._generate_body(options), timeout)))

    def append(
        self,
        messages: wire.MessagesLike | None = None,
        *,
        token_ids: list[int] | None = None,
        timeout: float | None = None,
    ) -> p.Appended:
        """Append chat messages (rendered with the chat template) or raw token ids."""
        return self._link.run(self._append(messages, token_ids, timeout))

    def cancel(self, *, timeout: float | None = None) -> p.Ack:
        """Cancel the running append/generate; the stream ends with stop_reason
        "cancelled" and the session stays usable."""
        return self._link.run(self._cancel(timeout))

    def rewind(self, messages: int, *, timeout: float | None = None) -> p.Rewound:
        """Take the session back to the end of the turn where its conversation
        held `messages` messages (regenerate: the count before the last reply;
        edit the last message: before it). Its slab keeps what it can: the
        next generate prefills only `Rewound.pending_tokens` and the new messages."""
        return self._link.run(self._rewind(messages, timeout))

    def fork(self, messages: int | None = None, *, timeout: float | None = None, **options: Any) -> Session:
        """A new session: a copy of this one taken back to the end of the
        turn where its conversation held `messages` messages (None: as it is
        now), sharing nothing with it afterwards. A branch of the
        conversation that prefills nothing again: the copy starts from this
        session's slab. Options: admission, queue_wait_s, client_name."""
        return self._link.run(self._fork(messages, timeout, options))

    def mark(
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
        return self._link.run(self._mark(marks, notes, drop, from_end, timeout))

    def info(
        self, token_ids: bool = False, marks: Iterable[str] = (), *, timeout: float | None = None
    ) -> p.SessionInfo:
        """The session's state; `marks`: also these names' points and notes (those it has)."""
        return self._link.run(self._info(token_ids, marks, timeout))

    def close(self, *, timeout: float | None = None) -> p.Closed | None:
        """Free the session, its slab and its stored record (None if it was
        already closed here)."""
        return self._link.run(self._close(timeout))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(core.ClientCore):
    """Connection to a kvmux broker. `timeout` (seconds) bounds every call;
    for a stream it bounds the wait for each frame. For a tcp broker with
    CURVE: `server_key` (its public key, z85 or its .key file) and
    `secret_key` (ours: a NAME.key_secret file or a z85 secret)."""

    _session_class = Session
    _queue_class = queue.SimpleQueue

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = wire.DEFAULT_TIMEOUT_S,
        server_key: str | os.PathLike | None = None,
        secret_key: str | os.PathLike | None = None,
        context: zmq.Context | None = None,
    ):
        super().__init__(endpoint, timeout, server_key, secret_key)
        self._outbox: collections.deque = collections.deque()
        # A pipe wakes the I/O thread: writing to it is safe from any thread,
        # even from a finalizer, unlike a ZeroMQ socket.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._connect(self._socket)
        self._thread = threading.Thread(target=self._io, name="kvmux-client-io", daemon=True)
        self._thread.start()
        self._post(wire.HEARTBEAT)  # we answer heartbeats (see wire.HEARTBEAT)

    # ------------------------------------------------------------ public API

    def open_session(self, system: str | None = None, *, timeout: float | None = None, **options: Any) -> Session:
        """Open a session (takes a slab). Options: sink, window, sampling
        defaults (max_tokens, temperature, top_p, top_k, seed, stop, speculative,
        priority, or `sampling=`; priority also places the open in the queue), chat_template_kwargs (variables for the model's chat
        template, e.g. {"enable_thinking": False}), admission, queue_wait_s,
        client_name, prefix (shared prefixes: "auto", "pin" or "off"), model (a
        model the daemon runs, by id or alias; default: its default model)."""
        return self._run(self._open(system, timeout, options))

    def resume_session(self, session_id: str, *, timeout: float | None = None) -> Session:
        """A session object for an existing session id (from any connection);
        raises SessionNotFound or SessionExpired."""
        return self._run(self._resume(session_id, timeout))

    def list_sessions(self, *, timeout: float | None = None) -> list[p.SessionSummary]:
        """Every session the daemon keeps, live and hibernated."""
        return self._call(*core.list_sessions_request(), timeout).sessions

    def find(self, names: Iterable[str], *, timeout: float | None = None) -> p.Found | None:
        """Your session that has one of `names` (Session.mark), the first of
        them any has: Found(name, session_id); None when none has any."""
        try:
            return self._call(*core.find_request(list(names)), timeout)
        except errors.SessionNotFound:
            return None

    def stats(self, *, timeout: float | None = None) -> p.BrokerStats:
        return self._call(*core.stats_request(), timeout)

    def ping(self, *, timeout: float | None = None) -> p.Pong:
        return self._call(*core.ping_request(), timeout)

    def drain(self, grace_s: float | None = None, *, timeout: float | None = None) -> p.Ack:
        """Ask the broker to stop admitting sessions and shut down gracefully."""
        return self._call(*core.drain_request(grace_s), timeout)

    def close(self) -> None:
        """Close this client's open sessions (best effort), then the socket."""
        if self._closed:
            return
        self._run(self._close_sessions())
        self._post(None)
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals

    def _run(self, steps: calls.Steps) -> Any:
        """Run steps to their result, blocking for each reply they wait for."""
        try:
            wait = next(steps)
            while True:
                try:
                    outcome = wait.replies.get(timeout=wait.timeout)
                except queue.Empty:
                    outcome = wait.expired()
                except BaseException as exc:  # Ctrl-C: the steps clean up and re-raise it
                    outcome = exc
                wait = calls.resume(steps, outcome)
        except StopIteration as stop:
            return stop.value

    def _call(self, op: str, session_id: str, body: msgspec.Struct, timeout: float | None) -> Any:
        return self._run(self._ask(op, session_id, body, timeout))

    def _post(self, frames: list[bytes] | None) -> None:
        self._outbox.append(frames)  # None stops the I/O thread
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # pipe full (the thread wakes anyway), or closed under a late finalizer
            pass

    def _io(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        held: collections.deque[list[bytes]] = collections.deque()  # waiting for a broker (failover)
        try:
            while True:
                poller.modify(self._socket, zmq.POLLIN | (zmq.POLLOUT if held else 0))
                for sock, event in poller.poll():
                    if sock is not self._socket:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif event & zmq.POLLIN:
                        self._receive()
                while held and self._transmit(held[0]):
                    held.popleft()
                while self._outbox:
                    frames = self._outbox.popleft()
                    if frames is None:
                        return
                    if held or not self._transmit(frames):
                        held.append(frames)
        finally:
            self._socket.close()

    def _transmit(self, frames: list[bytes]) -> bool:
        """Send without blocking; False when the frames must wait for a
        broker to connect (several endpoints), which a wait's timeout bounds."""
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            if self.failover:
                return False
            # This thread must not block: fail the request now, not at its timeout
            rid = p.decode_envelope(frames[0]).request_id
            replies = self._calls.pop(rid)
            if replies is not None:
                why = self._hint() or "is the broker reading?"  # e.g. a CURVE handshake that never completed
                error = errors.Timeout(f"send queue full: {why}", request_id=rid)
                replies.put_nowait(wire.Reply(p.Op.ERROR, rid, "", error))
        return True

    def _receive(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._calls.deliver(frames):
                with contextlib.suppress(zmq.Again):  # a full pipe: the broker is not reading us either
                    self._socket.send_multipart(wire.HEARTBEAT, flags=zmq.NOBLOCK)
