"""Sending on the broker's ROUTERs without ever blocking the loop.

Every socket is ROUTER_MANDATORY: a frame to a vanished peer raises
EHOSTUNREACH instead of vanishing, and a full pipe raises EAGAIN (we send
with NOBLOCK). To a client, a full pipe means a slow reader: its frames wait
in a bounded backlog, flushed every loop turn; past the bound the broker
cancels its streams (`on_overrun`). A vanished client is reported once
(`on_client_gone`). To a worker, the outcome is returned and the broker
decides (a full pipe fails that one request; an unreachable worker is lost).

Clients reach the broker on the frontend or on the admin endpoint; a client
route is one bytes value either way (it travels to the worker and back), the
admin socket's marked with the `ADMIN` prefix. No peer's routing id can start
with it: libzmq's own are 5 bytes, and it refuses ids that peers choose
starting with a zero byte.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

import zmq

ADMIN = b"\x00kvmux-admin\x00"


class Sent(enum.Enum):
    OK = "ok"
    FULL = "full"  # the peer's pipe holds HWM frames: it is not reading
    UNREACHABLE = "unreachable"  # the peer is gone


class Outbox:
    def __init__(
        self,
        frontend: zmq.Socket,
        admin: zmq.Socket,
        backend: zmq.Socket,
        client_backlog: int,
        on_client_gone: Callable[[bytes], None],
        on_overrun: Callable[[bytes], None],
    ) -> None:
        self.frontend = frontend
        self.admin = admin
        self.backend = backend
        self.client_backlog = client_backlog
        self.on_client_gone = on_client_gone
        self.on_overrun = on_overrun
        self.backlog: dict[bytes, deque[list[bytes]]] = {}

    def to_worker(self, identity: bytes, route: bytes, env_raw: bytes, body: bytes) -> Sent:
        return _send(self.backend, [identity, route, env_raw, body])

    def to_client(self, route: bytes, parts: list[bytes]) -> None:
        queue = self.backlog.get(route)
        if queue is None:
            sent = self._to(route, parts)
            if sent is Sent.OK:
                return
            if sent is Sent.UNREACHABLE:
                self._gone(route)
                return
            queue = self.backlog[route] = deque()
        queue.append(parts)
        if len(queue) > self.client_backlog:
            self.on_overrun(route)

    def flush(self) -> None:
        """Send what waits in the backlogs, as far as each client reads."""
        for route, queue in list(self.backlog.items()):
            while queue:
                sent = self._to(route, queue[0])
                if sent is not Sent.OK:
                    break
                queue.popleft()
            else:
                del self.backlog[route]
                continue
            if sent is Sent.UNREACHABLE:
                self._gone(route)

    def _to(self, route: bytes, parts: list[bytes]) -> Sent:
        if route.startswith(ADMIN):
            return _send(self.admin, [route[len(ADMIN) :], *parts])
        return _send(self.frontend, [route, *parts])

    def probe(self, route: bytes, parts: list[bytes]) -> None:
        """Send `parts` (a heartbeat) only to learn whether the client is
        still there. Frames waiting in its backlog will tell already, and a
        full pipe means it is there."""
        if route not in self.backlog and self._to(route, parts) is Sent.UNREACHABLE:
            self._gone(route)

    def forget(self, route: bytes) -> None:
        self.backlog.pop(route, None)

    def _gone(self, route: bytes) -> None:
        self.backlog.pop(route, None)
        self.on_client_gone(route)


def _send(sock: zmq.Socket, parts: list[bytes]) -> Sent:
    try:
        sock.send_multipart(parts, zmq.NOBLOCK)
    except zmq.Again:
        return Sent.FULL
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        return Sent.UNREACHABLE
    return Sent.OK
