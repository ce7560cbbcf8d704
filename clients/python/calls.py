"""Requests in flight: the table that routes each reply to the queue of its
request, and the `Wait` through which core.py's steps ask their shell for
the next reply (see core.py)."""

from __future__ import annotations

import asyncio
import itertools
import queue
from collections.abc import Generator
from typing import Any, NamedTuple

from . import errors, wire

# A request's replies as they arrive: the sync shell's queue or the asyncio one's.
Replies = queue.SimpleQueue[wire.Reply] | asyncio.Queue[wire.Reply]


class Calls:
    """Requests in flight by id, each with the queue its replies go to."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._queues: dict[int, Replies] = {}
        self.heard = False  # anything from the broker yet: a silent one may have refused our keys

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, rid: int, replies: Replies) -> None:
        self._queues[rid] = replies

    def pop(self, rid: int) -> Replies | None:
        """Forget a request (answered, timed out or unsendable); its queue or None."""
        return self._queues.pop(rid, None)

    def deliver(self, frames: list[bytes]) -> bool:
        """Put a reply on its request's queue: a PARTIAL keeps the request,
        the last reply (FINAL or ERROR) forgets it. Unreadable replies, and
        replies to forgotten requests, are dropped. True for the broker's
        heartbeat: the shell answers it with wire.HEARTBEAT."""
        self.heard = True
        reply = wire.parse(frames)
        if reply is wire.PROBE:
            return True
        if reply is None:
            return False
        rid = reply.request_id
        replies = self._queues.pop(rid, None) if reply.last else self._queues.get(rid)
        if replies is None:
            wire.log.debug("reply to unknown request %d dropped (timed out or cancelled)", rid)
        else:
            replies.put_nowait(reply)
        return False


class Wait(NamedTuple):
    """What steps ask of their shell: the next reply on `replies` within
    `timeout` seconds, or else `expired()` thrown back in."""

    replies: Replies
    timeout: float
    what: str
    request_id: int
    session_id: str
    hint: str = ""  # why the broker may be silent, for the timeout's message

    def expired(self) -> errors.Timeout:
        return wire.timeout_error(self.what, self.timeout, self.request_id, self.session_id, self.hint)


# Yields Waits, is sent each one's Reply, returns the call's result.
Steps = Generator[Wait, wire.Reply, Any]


def resume(steps: Steps, outcome: wire.Reply | BaseException) -> Wait:
    """Hand steps the outcome of their wait; their next Wait (their result
    comes as StopIteration's value, their error is raised)."""
    if isinstance(outcome, BaseException):
        return steps.throw(outcome)
    return steps.send(outcome)
