"""What the sync and asyncio clients share, written once: the request table
and reply demultiplexing, the request each public call makes, the session's
bookkeeping, and a stream's reading logic. The shells (sync.py, aio.py) add
only their transport (an I/O thread, or zmq.asyncio) and how they wait (a
`queue.SimpleQueue`, or an `asyncio.Queue`).

Where the two differ it is for a reason the event loop imposes: an
`AsyncSession.generate()` is not a coroutine, so its request goes out on the
stream's first `__anext__` (the sync one goes out at once); until then the
async stream's `request_id` is None.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvmux import protocol as p

from . import errors, wire


class Calls:
    """Requests in flight by id, each with the queue its replies go to.
    A PARTIAL keeps the entry; the last reply (FINAL or ERROR) removes it."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._queues: dict[int, Any] = {}

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, replies: Any) -> int:
        rid = self.next_id()
        self._queues[rid] = replies
        return rid

    def pop(self, rid: int) -> Any:
        """Forget a request (answered, timed out or unsendable); its queue or None."""
        return self._queues.pop(rid, None)

    def route(self, parts: list[bytes]) -> tuple[Any, wire.Reply] | None:
        """The queue a reply frame belongs to, with the parsed reply; None
        when it is unreadable or its request is gone (timed out, cancelled)."""
        reply = wire.parse(parts)
        if reply is None:
            return None
        queue = self._queues.pop(reply.request_id, None) if reply.last else self._queues.get(reply.request_id)
        if queue is None:
            wire.log.debug("reply to unknown request %d dropped (timed out or cancelled)", reply.request_id)
            return None
        return queue, reply


# ----------------------------------------------------- the calls themselves


def open_request(system: str | None, timeout: float | None, default_timeout: float, options: dict) -> tuple:
    """(op, session id, body, wait) of an OPEN: a queued open may wait
    queue_wait_s on top of the call's timeout."""
    body = wire.open_body(system, **options)
    return p.Op.OPEN, "", body, (timeout or default_timeout) + (body.queue_wait_s or 0.0)


def stats_request() -> tuple:
    return p.Op.STATS, "", p.Stats()


def ping_request() -> tuple:
    return p.Op.PING, "", p.Ping()


def drain_request(grace_s: float | None) -> tuple:
    return p.Op.DRAIN, "", p.Drain(grace_s=grace_s)


def resume_request(session_id: str) -> tuple:
    return p.Op.RESUME, session_id, p.Resume()


def list_sessions_request() -> tuple:
    return p.Op.SESSIONS, "", p.ListSessions()


class SessionCore:
    """A session's state and the request of each of its calls; the shells'
    Session/AsyncSession add the waiting."""

    def __init__(self, client: Any, opened: p.SessionOpened):
        self.client = client
        self.opened = opened
        self.id = opened.session_id
        self.reader: StreamCore | None = None  # the last stream, drained before the next call
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise errors.SessionNotFound(f"session {self.id} was closed", session_id=self.id)

    def take_reader(self) -> StreamCore | None:
        """The unfinished stream to drain before the next call, if any."""
        self.check_open()
        reader, self.reader = self.reader, None
        return reader

    def detach(self) -> None:
        """Keep the session in the daemon when this client closes (a client's
        close() closes the sessions it opened or resumed); resume it later
        by its id, from any client."""
        self.client._sessions.pop(self.id, None)

    def append_request(self, messages: wire.MessagesLike | None, token_ids: list[int] | None) -> tuple:
        return p.Op.APPEND, self.id, wire.append_body(messages, token_ids)

    def cancel_request(self) -> tuple:
        return p.Op.CANCEL, self.id, p.Cancel()

    def info_request(self, token_ids: bool) -> tuple:
        return p.Op.INFO, self.id, p.Info(token_ids=token_ids)

    def close_request(self) -> tuple:
        self.closed = True
        self.client._sessions.pop(self.id, None)
        return p.Op.CLOSE, self.id, p.Close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, worker={self.opened.worker_id!r})"


def chat_options(text: str, options: dict) -> dict:
    return {**options, "messages": [p.ChatMessage(role="user", content=text)]}


class StreamCore:
    """The consuming side of one generate stream. The session keeps it (not
    the user's stream object) so it can drain a stream its user dropped."""

    def __init__(self, client: Any, request_id: int, session_id: str, credit: int, replies: Any, timeout: float | None):
        self.client = client
        self.state = wire.StreamState(request_id, session_id, credit)
        self.replies = replies
        self.timeout = timeout

    def take(self, reply: wire.Reply) -> p.Chunk | None:
        """The chunk a reply carries (None at the end), granting credit back
        to the worker as chunks are consumed."""
        chunk = self.state.take(reply)
        n = self.state.grant()
        if n:
            self.client._send(lambda rid: self.state.credit_frames(n, rid))
        return chunk

    def cancel(self) -> None:
        if not self.state.cancel_sent:
            self.client._send(self.state.cancel_frames)
