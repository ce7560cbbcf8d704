"""Admission: where a new session goes, or exactly why it does not.

Policies (per daemon, with a per-session override the daemon may allow):
`reject` answers `overloaded` at once when no slab is free; `queue` holds the
open in a FIFO bounded in depth and in wait, admitting it the moment a slab
frees. A per-client quota caps live sessions per client identity, and the
idle timeout picks sessions to close. Nothing here touches a socket."""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass

from kvmux.protocol import ErrorCode, OpenSession, OverloadReason, ProtocolError

from .config import BrokerConfig
from .registry import Registry, Session, Worker

_WAIT_SAMPLES = 4096  # queue waits kept for the p50/p99 in stats


@dataclass(eq=False)
class PendingOpen:
    route: bytes
    request_id: int
    body: bytes  # the OpenSession body, forwarded untouched once admitted
    owner: str
    enqueued: float
    deadline: float


@dataclass(frozen=True)
class Refusal:
    reason: OverloadReason
    message: str
    retry_after_s: float | None


class Admission:
    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.queue: deque[PendingOpen] = deque()
        self.waits: deque[float] = deque(maxlen=_WAIT_SAMPLES)
        self.admitted = 0
        self.refused: Counter[OverloadReason] = Counter()  # every `overloaded` answer, by reason
        self.expired = 0

    def policy(self, request: OpenSession) -> tuple[str, float]:
        """The (admission, queue wait) this open runs under."""
        cfg = self.cfg
        if request.admission is None and request.queue_wait_s is None:
            return cfg.admission, cfg.queue_wait_s
        if not cfg.allow_session_override:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, "this daemon does not allow per-session admission overrides"
            )
        admission = request.admission or cfg.admission
        if admission not in ("reject", "queue"):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"admission must be 'reject' or 'queue', not {admission!r}")
        wait = cfg.queue_wait_s if request.queue_wait_s is None else request.queue_wait_s
        if not 0 < wait <= cfg.queue_wait_s:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT,
                f"queue_wait_s must be in (0, {cfg.queue_wait_s}] on this daemon, not {wait}",
            )
        return admission, wait

    def decide(
        self, registry: Registry, pending: PendingOpen, request: OpenSession, now: float
    ) -> Worker | PendingOpen | Refusal:
        """Admit on a worker, queue (returns `pending`, now queued) or refuse."""
        admission, wait = self.policy(request)
        quota = self.cfg.client_quota
        if quota and registry.live_sessions_of(pending.owner) + self.queued_for(pending.owner) >= quota:
            return self.refuse(
                OverloadReason.QUOTA, f"client {pending.owner!r} already holds its quota of {quota} sessions"
            )
        worker = registry.place()
        if worker is not None and not self.queue:  # never jump the queue
            return worker
        if admission == "reject":
            if not registry.workers:
                return self.refuse(OverloadReason.NO_WORKER, "no worker is registered")
            return self.refuse(OverloadReason.NO_SLAB, f"all {registry.slabs_total()} slabs are taken")
        if len(self.queue) >= self.cfg.queue_depth:
            return self.refuse(OverloadReason.QUEUE_FULL, f"the admission queue is full ({len(self.queue)} waiting)")
        pending.enqueued, pending.deadline = now, now + wait
        self.queue.append(pending)
        return pending

    def refuse(self, reason: OverloadReason, message: str) -> Refusal:
        """The one way to say `overloaded`: counted by reason for stats."""
        self.refused[reason] += 1
        retry = None if reason is OverloadReason.DRAINING else self.cfg.retry_after_s
        return Refusal(reason, message, retry)

    @property
    def rejected(self) -> int:
        return sum(self.refused.values())

    def queued_for(self, owner: str) -> int:
        return sum(1 for p in self.queue if p.owner == owner)

    def next_admitted(self, registry: Registry, now: float) -> tuple[PendingOpen, Worker] | None:
        """Pop the queue's head if a slab is free for it."""
        if not self.queue:
            return None
        worker = registry.place()
        if worker is None:
            return None
        pending = self.queue.popleft()
        self.waits.append(now - pending.enqueued)
        return pending, worker

    def timed_out(self, now: float) -> list[PendingOpen]:
        """Remove and return the opens that waited their longest (the caller
        refuses each)."""
        out = [p for p in self.queue if p.deadline <= now]
        if out:
            self.queue = deque(p for p in self.queue if p.deadline > now)
        return out

    def is_queued(self, route: bytes, request_id: int) -> bool:
        return any(p.route == route and p.request_id == request_id for p in self.queue)

    def remove(self, route: bytes, request_id: int | None = None) -> list[PendingOpen]:
        """Take a client's queued opens out (one by request id, or all)."""
        out = [p for p in self.queue if p.route == route and request_id in (None, p.request_id)]
        if out:
            self.queue = deque(p for p in self.queue if p not in out)
        return out

    def flush(self) -> list[PendingOpen]:
        """Empty the queue (drain; the caller refuses each open)."""
        out, self.queue = list(self.queue), deque()
        return out

    def idle(self, registry: Registry, now: float) -> list[Session]:
        """Sessions idle past the timeout, nothing running on them."""
        limit = self.cfg.idle_timeout_s
        if not limit:
            return []
        return [
            s
            for s in registry.sessions.values()
            if s.ending is None and s.in_flight == 0 and now - s.last_active > limit
        ]

    def wait_percentiles(self) -> tuple[float, float]:
        """(p50, p99) of recent queue waits in seconds; 0 when none queued."""
        return percentiles(self.waits)


def percentiles(samples) -> tuple[float, float]:
    data = list(samples)
    if len(data) < 2:
        return (data[0], data[0]) if data else (0.0, 0.0)
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    return cuts[49], cuts[98]
