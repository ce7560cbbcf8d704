"""Which clients are still there, told by the protocol's own heartbeats.

The broker sends a heartbeat to each client whose requests sent it nothing
for an interval (a stream paused on its credit, a long prefill, an open in
the queue). A client gone with its connection closed is found by that send
failing (ROUTER_MANDATORY). One whose connection stays open with nobody
behind it (its host died, its network went, its process stopped) is found
here: kvmux's clients answer every heartbeat, and say so with a heartbeat
of their own as their first frame. A client that answers and then leaves
heartbeats unanswered for `silent_after_s` is gone. A client that never
sent one (a bare socket) is never judged by its silence.

Not ZeroMQ's own heartbeats (ZMQ_HEARTBEAT_IVL): with them libzmq 4.3.5
aborts the whole process when a peer disconnects while its queue at the
broker is full (`!_io_error`, stream_engine_base.cpp): any client could
take the broker down by flooding it and leaving.
"""

from __future__ import annotations

from collections import OrderedDict

_MEMORY = 65536  # clients remembered as answering, the least recently heard forgotten first


class Liveness:
    """The clients that answer heartbeats, and how long each asked one has
    left them unanswered. Nothing here touches a socket."""

    def __init__(self, silent_after_s: float) -> None:
        self.silent_after_s = silent_after_s  # 0: never judge by silence
        self.answering: OrderedDict[bytes, None] = OrderedDict()  # routes that answer heartbeats
        self.asked: dict[bytes, float] = {}  # route -> when its oldest unanswered heartbeat went

    def heard(self, route: bytes) -> None:
        """A heartbeat from the client: it answers them, and is there now."""
        self.answering[route] = None
        self.answering.move_to_end(route)
        if len(self.answering) > _MEMORY:
            self.answering.popitem(last=False)
        self.asked.pop(route, None)

    def asking(self, routes: set[bytes], now: float) -> list[bytes]:
        """Heartbeats go to `routes` now: those of them silent too long."""
        for route in [r for r in self.asked if r not in routes]:
            del self.asked[route]  # not asked any more: its requests ended
        if not self.silent_after_s:
            return []
        silent = []
        for route in routes:
            if route in self.answering and now - self.asked.setdefault(route, now) > self.silent_after_s:
                silent.append(route)
        return silent

    def forget(self, route: bytes) -> None:
        self.answering.pop(route, None)
        self.asked.pop(route, None)
