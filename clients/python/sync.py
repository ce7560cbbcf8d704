"""The blocking client.

One DEALER socket per `Client`, owned by a background I/O thread: callers
queue frames for it and wait on a per-request queue it fills, so replies of
many sessions and interleaved streams are demultiplexed by request id, and a
`Client` (with its sessions) may be shared between threads. A stream should
be consumed by one thread at a time.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
from typing import Any

import zmq

from kvmux import paths
from kvmux import protocol as p

from . import errors, wire


class Client:
    """Connection to a kvmux broker. `timeout` (seconds) bounds every call;
    for a stream it bounds the wait for each frame."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = wire.DEFAULT_TIMEOUT_S,
        context: zmq.Context | None = None,
    ):
        self.endpoint = endpoint or paths.default_frontend()
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._calls: dict[int, queue.SimpleQueue] = {}
        self._outbox: collections.deque = collections.deque()
        self._sessions: dict[str, Session] = {}
        self._closed = False
        # A pipe wakes the I/O thread: writing to it is safe from any thread,
        # even from a finalizer, unlike a ZeroMQ socket.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)
        self._thread = threading.Thread(target=self._io, name="kvmux-client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API

    def open_session(self, system: str | None = None, *, timeout: float | None = None, **options: Any) -> Session:
        """Open a session (takes a slab). Options: sink, window, sampling
        defaults (max_tokens, temperature, top_p, top_k, seed, stop, or
        `sampling=`), admission, queue_wait_s, client_name."""
        body = wire.open_body(system, **options)
        # A queued open may legitimately wait queue_wait_s before its answer.
        wait = (timeout or self.timeout) + (body.queue_wait_s or 0.0)
        opened = self._call(p.Op.OPEN, "", body, wait)
        session = Session(self, opened)
        self._sessions[session.id] = session
        return session

    def stats(self, *, timeout: float | None = None) -> p.BrokerStats:
        return self._call(p.Op.STATS, "", p.Stats(), timeout)

    def ping(self, *, timeout: float | None = None) -> p.Pong:
        return self._call(p.Op.PING, "", p.Ping(), timeout)

    def drain(self, grace_s: float | None = None, *, timeout: float | None = None) -> p.Ack:
        """Ask the broker to stop admitting sessions and shut down gracefully."""
        return self._call(p.Op.DRAIN, "", p.Drain(grace_s=grace_s), timeout)

    def close(self) -> None:
        """Close this client's open sessions (best effort), then the socket."""
        if self._closed:
            return
        for session in list(self._sessions.values()):
            try:
                session.close(timeout=min(self.timeout, 2.0))
            except errors.KvmuxError:
                pass
        self._closed = True
        self._post(None)
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals

    def _post(self, parts: list[bytes] | None) -> None:
        self._outbox.append(parts)
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # pipe full (the thread wakes anyway), or closed under a late finalizer
            pass

    def _request(self, op: str, session_id: str, body: Any) -> tuple[int, queue.SimpleQueue]:
        if self._closed:
            raise errors.KvmuxError("client is closed")
        rid = next(self._ids)
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._calls[rid] = replies
        self._post(wire.frames(op, rid, session_id, body))
        return rid, replies

    def _send(self, parts_for_id) -> None:
        """Send a frame that expects no reply we wait for (cancel, credit)."""
        if not self._closed:
            self._post(parts_for_id(next(self._ids)))

    def _wait(
        self, rid: int, replies: queue.SimpleQueue, timeout: float | None, what: str, session_id: str = ""
    ) -> wire.Reply:
        timeout = self.timeout if timeout is None else timeout
        try:
            return replies.get(timeout=timeout)
        except queue.Empty:
            self._calls.pop(rid, None)
            raise wire.timeout_error(what, timeout, rid, session_id) from None

    def _call(self, op: str, session_id: str, body: Any, timeout: float | None) -> Any:
        rid, replies = self._request(op, session_id, body)
        return wire.unwrap(self._wait(rid, replies, timeout, op, session_id))

    def _io(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._socket:
                        self._receive()
                    else:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                while self._outbox:
                    parts = self._outbox.popleft()
                    if parts is None:
                        return
                    self._transmit(parts)
        finally:
            self._socket.close()

    def _transmit(self, parts: list[bytes]) -> None:
        try:
            self._socket.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:
            rid = p.decode_envelope(parts[0]).request_id
            replies = self._calls.pop(rid, None)
            if replies is not None:
                replies.put(
                    wire.Reply(
                        p.Op.ERROR, rid, "", errors.Timeout("send queue full: is the broker running?", request_id=rid)
                    )
                )

    def _receive(self) -> None:
        while True:
            try:
                parts = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = wire.parse(parts)
            if reply is None:
                continue
            replies = self._calls.pop(reply.request_id, None) if reply.last else self._calls.get(reply.request_id)
            if replies is None:
                wire.log.debug("reply to unknown request %d dropped (timed out or cancelled)", reply.request_id)
                continue
            replies.put(reply)


class Session:
    """A chat session bound to one worker's slab. Use it as a context manager
    to close it on exit. At most one append/generate runs at a time; starting
    one while an earlier stream is unfinished cancels and drains that stream."""

    def __init__(self, client: Client, opened: p.SessionOpened):
        self.client = client
        self.opened = opened
        self.id = opened.session_id
        self._feed: _Feed | None = None
        self._closed = False

    def chat(self, text: str, *, timeout: float | None = None, **options: Any) -> Stream:
        """Append a user message and generate the reply (one round trip)."""
        return self.generate(messages=[p.ChatMessage(role="user", content=text)], timeout=timeout, **options)

    def generate(self, *, timeout: float | None = None, **options: Any) -> Stream:
        """Stream a generation. Options: max_tokens, temperature, top_p, top_k,
        seed, stop, messages (appended first), credit (0 = no flow control)."""
        self._settle()
        body = wire.generate_body(**options)
        rid, replies = self.client._request(p.Op.GENERATE, self.id, body)
        self._feed = _Feed(self.client, wire.StreamState(rid, self.id, body.credit), replies, timeout)
        return Stream(self._feed)

    def append(
        self,
        messages: wire.MessagesLike | None = None,
        *,
        token_ids: list[int] | None = None,
        timeout: float | None = None,
    ) -> p.Appended:
        """Append chat messages (rendered with the chat template) or raw token ids."""
        self._settle()
        return self.client._call(p.Op.APPEND, self.id, wire.append_body(messages, token_ids), timeout)

    def cancel(self, *, timeout: float | None = None) -> p.Ack:
        """Cancel the running append/generate; the stream ends with stop_reason
        "cancelled" and the session stays usable."""
        return self.client._call(p.Op.CANCEL, self.id, p.Cancel(), timeout)

    def info(self, token_ids: bool = False, *, timeout: float | None = None) -> p.SessionInfo:
        return self.client._call(p.Op.INFO, self.id, p.Info(token_ids=token_ids), timeout)

    def close(self, *, timeout: float | None = None) -> p.Closed | None:
        """Free the session's slab (None if it was already closed here)."""
        if self._closed:
            return None
        self._settle()
        self._closed = True
        self.client._sessions.pop(self.id, None)
        return self.client._call(p.Op.CLOSE, self.id, p.Close(), timeout)

    def _settle(self) -> None:
        if self._closed:
            raise errors.SessionNotFound(f"session {self.id} was closed", session_id=self.id)
        if self._feed is not None:
            feed, self._feed = self._feed, None
            try:
                feed.close()
            except errors.KvmuxError:
                pass  # how an abandoned stream ended is nobody's concern now

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r}, worker={self.opened.worker_id!r})"


class _Feed:
    """The consuming side of one generate stream. The session keeps it (not
    the user's `Stream`) so it can drain a stream its user dropped."""

    def __init__(self, client: Client, state: wire.StreamState, replies: queue.SimpleQueue, timeout: float | None):
        self.client = client
        self.state = state
        self.replies = replies
        self.timeout = timeout

    def next(self) -> p.Chunk | None:
        state = self.state
        if state.done:
            return None
        try:
            reply = self.client._wait(state.request_id, self.replies, self.timeout, "generate", state.session_id)
        except errors.Timeout:
            state.done = True
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

    def close(self) -> None:
        if self.state.done:
            return
        self.cancel()
        while self.next() is not None:
            pass


class Stream:
    """Iterator of `Chunk`s (`.text`, `.token_ids`); after it is exhausted,
    `.result` is the final `GenerateResult`. Breaking out of the loop (once
    the stream is dropped) or `close()` cancels the generation."""

    def __init__(self, feed: _Feed):
        self._feed = feed

    @property
    def result(self) -> p.GenerateResult | None:
        return self._feed.state.result

    @property
    def request_id(self) -> int:
        return self._feed.state.request_id

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> p.Chunk:
        chunk = self._feed.next()
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        """Cancel the generation if it still runs and wait for its end, so the
        session is ready for the next turn."""
        self._feed.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unfinished (a `break`): tell the worker to stop now; the
        # session drains what is left before its next operation.
        feed = getattr(self, "_feed", None)
        if feed is not None and not feed.state.done:
            feed.cancel()
