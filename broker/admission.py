"""Admission: which slab a new session (or a hibernated one called again)
gets, or exactly why it gets none.

Slabs are a cache of sessions: when none is free but some live session is
idle, that one is hibernated (the broker's job) and the request waits for
its slab, whatever the policy. Only when every slab is busy with running
work does the policy decide (per daemon, with a per-session override the
daemon may allow): `reject` answers `overloaded` at once; `queue` holds the
request in a queue bounded in depth and in wait, served by priority: the
highest `priority + waited / priority_aging_s` first (each
`priority_aging_s` seconds waited count as one level, so nothing waits
behind higher priorities for ever), the earliest first among equals. While the daemon's own
workers are still starting, requests wait for them. A per-client quota and
`max_sessions` bound the sessions (live and hibernated), and the idle
timeout picks sessions to close. Each model is admitted on its own: its
workers' slabs, its place in the queue (depth and order count per model)
and the client quota count per model, so one model's backlog never blocks
another's sessions. Nothing here touches a socket."""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass

from kvmux.protocol import PRIORITIES, ErrorCode, OpenSession, OverloadReason, ProtocolError, Sampling

from .config import BrokerConfig
from .registry import Registry, SessionEntry, State, WorkerEntry

_WAIT_SAMPLES = 4096  # queue waits kept for the p50/p99 in stats


@dataclass(eq=False)
class Pending:
    """An OPEN, or a call on a hibernated session, waiting for a slab."""

    route: bytes
    request_id: int
    body: bytes  # forwarded untouched once admitted
    owner: str
    enqueued: float
    deadline: float
    session_id: str = ""  # a hibernated session's ("" for an OPEN)
    env_raw: bytes = b""  # its request's envelope, forwarded untouched
    store: str | None = None  # the store its record is in: only workers reading it may restore it
    prefer: WorkerEntry | None = None  # a fork's: the worker holding its session, when it has a slab
    priority: int = 0  # Sampling.priority: the queue serves higher first
    traceparent: str | None = None  # its request's trace, while the broker traces (kvmux/tracing.py)
    opening: str | None = None  # an OPEN's opening (broker/openings.py): its worker is preferred
    model: str | None = None  # the model it runs on: only its workers take it (None: any, before one registers)

    @property
    def is_open(self) -> bool:
        return not self.session_id


@dataclass(frozen=True)
class Refusal:
    reason: OverloadReason
    message: str
    retry_after_s: float | None


class Admission:
    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.queue: deque[Pending] = deque()
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
        self,
        registry: Registry,
        pending: Pending,
        request: OpenSession | None,
        now: float,
        *,
        workers_starting: bool = False,
    ) -> WorkerEntry | Pending | Refusal:
        """Admit on a worker, queue (returns `pending`, now queued) or refuse.
        `request` is the OPEN's body (None for a hibernated session's call);
        `workers_starting`: the daemon's own workers of its model will
        register (starting, or loading it on demand)."""
        if request is not None:
            admission, wait = self.policy(request)
            refusal = self._bounds(registry, pending.owner, pending.model)
            if refusal is not None:
                return refusal
        else:
            admission, wait = self.cfg.admission, self.cfg.queue_wait_s
        model = pending.model
        worker = registry.place(pending.store, pending.prefer, model)
        ahead = self.waiting(model)
        if worker is not None and not ahead:  # never jump the queue (of its model)
            return worker
        hibernating = any(s.state is State.HIBERNATING and model in (None, s.model) for s in registry.sessions.values())
        runs = any(w.runs(model) for w in registry.workers.values())
        serving = any(w.runs(model) and not w.draining for w in registry.workers.values())
        if not serving and workers_starting:  # the daemon's own, starting, or loading its model (or unloading it)
            wait, admission = self.cfg.worker_wait_s, "queue"
        elif registry.idle_live(pending.store, model) or hibernating:
            admission = "queue"  # a slab frees as soon as an idle session is hibernated
        if admission == "reject":
            if not runs:
                return self.refuse(OverloadReason.NO_WORKER, f"no worker{_of(model)} is registered")
            slabs = sum(w.ready.slabs for w in registry.workers.values() if w.runs(model))
            return self.refuse(OverloadReason.NO_SLAB, f"all {slabs} slabs{_of(model)} are busy running requests")
        if len(ahead) >= self.cfg.queue_depth:
            return self.refuse(OverloadReason.QUEUE_FULL, f"the admission queue is full ({len(ahead)} waiting)")
        pending.enqueued, pending.deadline = now, now + wait
        self.queue.append(pending)
        return pending

    def _bounds(self, registry: Registry, owner: str, model: str | None) -> Refusal | None:
        quota = self.cfg.client_quota
        if quota and registry.live_sessions_of(owner, model) + self.queued_for(owner, model) >= quota:
            return self.refuse(
                OverloadReason.QUOTA, f"client {owner!r} already holds its quota of {quota} sessions{_of(model)}"
            )
        total = len(registry.sessions) + sum(1 for r in registry.requests.values() if r.op == "open")
        if total + sum(1 for p in self.queue if p.is_open) >= self.cfg.max_sessions:
            return self.refuse(
                OverloadReason.QUOTA, f"the daemon holds its maximum of {self.cfg.max_sessions} sessions"
            )
        return None

    def refuse(self, reason: OverloadReason, message: str) -> Refusal:
        """The one way to say `overloaded`: counted by reason for stats."""
        self.refused[reason] += 1
        retry = None if reason is OverloadReason.DRAINING else self.cfg.retry_after_s
        return Refusal(reason, message, retry)

    @property
    def rejected(self) -> int:
        return sum(self.refused.values())

    def queued_for(self, owner: str, model: str | None = None) -> int:
        return sum(1 for p in self.waiting(model) if p.owner == owner and p.is_open)

    def waiting(self, model: str | None) -> list[Pending]:
        """What waits for a slab of `model` (None: all; one waiting for any
        model, before a worker registered, waits for each)."""
        return [p for p in self.queue if None in (model, p.model) or p.model == model]

    def next_admitted(self, registry: Registry, now: float) -> tuple[Pending, WorkerEntry] | None:
        """Take a model's first in the queue (by priority, aged) if a slab of
        its model is free for it; each model's first is tried, so a model
        without a free slab holds back only its own."""
        aging = self.cfg.priority_aging_s
        tried: set[str | None] = set()
        order = sorted(self.queue, key=lambda p: (p.priority + (now - p.enqueued) / aging, -p.enqueued), reverse=True)
        for pending in order:
            if pending.model in tried:
                continue
            tried.add(pending.model)
            worker = registry.place(pending.store, pending.prefer, pending.model)
            if worker is not None:
                self.queue.remove(pending)
                self.waits.append(now - pending.enqueued)
                return pending, worker
        return None

    def timed_out(self, now: float) -> list[Pending]:
        """Remove and return the opens that waited their longest (the caller
        refuses each)."""
        out = [p for p in self.queue if p.deadline <= now]
        if out:
            self.queue = deque(p for p in self.queue if p.deadline > now)
        return out

    def is_queued(self, route: bytes, request_id: int) -> bool:
        return any(p.route == route and p.request_id == request_id for p in self.queue)

    def remove(self, route: bytes, request_id: int | None = None) -> list[Pending]:
        """Take a client's queued opens out (one by request id, or all)."""
        out = [p for p in self.queue if p.route == route and request_id in (None, p.request_id)]
        if out:
            self.queue = deque(p for p in self.queue if p not in out)
        return out

    def flush(self) -> list[Pending]:
        """Empty the queue (drain; the caller refuses each open)."""
        out, self.queue = list(self.queue), deque()
        return out

    def idle(self, registry: Registry, now: float) -> list[SessionEntry]:
        """Sessions to close: idle past the idle timeout (when set) or past
        the session TTL, nothing running on them."""
        limits = [t for t in (self.cfg.idle_timeout_s, self.cfg.session_ttl_s) if t]
        if not limits:
            return []
        limit = min(limits)
        return [
            s
            for s in registry.sessions.values()
            if s.ending is None
            and s.in_flight == 0
            and s.state is not State.HIBERNATING
            and now - s.last_active > limit
        ]

    def wait_percentiles(self) -> tuple[float, float]:
        """(p50, p99) of recent queue waits in seconds; 0 when none queued."""
        return percentiles(self.waits)


def _of(model: str | None) -> str:
    return f" of {model}" if model else ""


def priority(sampling: Sampling | None, default: int = 0) -> int:
    """A request's priority: its own, else `default`; one out of bounds is refused."""
    given = sampling.priority if sampling is not None else None
    if given is None:
        return default
    if given not in PRIORITIES:
        raise ProtocolError(
            ErrorCode.INVALID_ARGUMENT, f"priority must be within {PRIORITIES[0]}..{PRIORITIES[-1]}, not {given}"
        )
    return given


def percentiles(samples) -> tuple[float, float]:
    data = list(samples)
    if len(data) < 2:
        return (data[0], data[0]) if data else (0.0, 0.0)
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    return cuts[49], cuts[98]
