"""What the broker knows: registered workers, every session (live on a
worker, i.e. in one of its slabs, or hibernated in the session store) and
requests in flight ((client route, request id) -> worker). Free slabs are
derived from these, never counted on the side, so they cannot drift:
free = slabs - foreign - live sessions - opens in flight."""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmux.protocol import ErrorCode, Op, PrefixCounts, SessionOpened, WorkerReady

# Ids of sessions that ended without the client closing them, kept so a late
# call learns why (expired vs. worker lost) instead of a bare "not found".
_GONE_MEMORY = 4096


@dataclass(eq=False)
class WorkerEntry:
    identity: bytes  # its DEALER routing id on the backend
    ready: WorkerReady
    foreign: int  # slabs its READY said were taken by sessions this broker never opened
    last_seen: float
    sessions: set[str] = field(default_factory=set)
    opening: int = 0  # OPENs forwarded and not answered yet (their slab is reserved)
    in_flight: int = 0
    running: int = 0  # from its heartbeat
    draining: bool = False  # from its heartbeat, or the broker's unload: it takes no new work and exits
    drafted: int = 0  # from its heartbeat: speculative tokens drafted and accepted
    accepted: int = 0
    link_bytes: int = 0  # from its heartbeat: a worker group's traffic between its ranks
    kv_bytes: int = 0  # from its heartbeat: KV cache its live sessions hold
    prefixes: PrefixCounts | None = None  # from its heartbeat: shared prefixes
    frames_forwarded: int = 0

    @property
    def worker_id(self) -> str:
        return (
            self.identity.decode("utf-8", "backslashreplace") if self.identity[:1] != b"\x00" else self.identity.hex()
        )

    @property
    def free_slabs(self) -> int:
        return max(0, self.ready.slabs - self.foreign - len(self.sessions) - self.opening)

    def runs(self, model: str | None) -> bool:
        """It runs `model` (None: any)."""
        return model is None or model == self.ready.model


class State(enum.Enum):
    """Where a session is, as the broker knows it. Every change is a
    Registry method below, along `_MOVES`:

        HIBERNATED --place--> RESTORING --first answer--> LIVE
        HIBERNATED --a worker's READY lists it--> LIVE
        LIVE --HIBERNATE sent--> HIBERNATING --its FINAL--> HIBERNATED
                                             (refused: back to LIVE)
        LIVE, HIBERNATING, RESTORING --the broker ends it--> CLOSING
                                             (the CLOSE refused: back to LIVE)
        LIVE, HIBERNATING, RESTORING --its worker lost, store shared--> HIBERNATED

    A session leaves the registry (`drop_session`) from any state."""

    LIVE = "live"  # in a slab on its worker
    HIBERNATING = "hibernating"  # a HIBERNATE is on its way to the worker
    HIBERNATED = "hibernated"  # in the store only
    RESTORING = "restoring"  # placed on a worker that has not answered for it yet
    CLOSING = "closing"  # a CLOSE the broker sent is on its way to the worker


_MOVES: dict[State, frozenset[State]] = {
    State.LIVE: frozenset({State.HIBERNATING, State.CLOSING, State.HIBERNATED}),
    State.HIBERNATING: frozenset({State.HIBERNATED, State.LIVE, State.CLOSING}),
    State.HIBERNATED: frozenset({State.RESTORING, State.LIVE}),
    State.RESTORING: frozenset({State.LIVE, State.CLOSING, State.HIBERNATED}),
    State.CLOSING: frozenset({State.LIVE}),
}


class IllegalMove(RuntimeError):
    """A transition `_MOVES` does not allow: a bug in the broker, logged by its loop."""


@dataclass(eq=False)
class SessionEntry:
    session_id: str
    worker: WorkerEntry | None  # None while hibernated (in the store only)
    route: bytes  # the client that last used it
    owner: str  # its identity for the per-client quota
    last_active: float
    opened: SessionOpened  # what OPEN answered: RESUME answers it again
    state: State = State.LIVE
    store: str = ""  # the store its record is in (a worker's READY.store): only workers reading it restore it
    opened_at: float = 0.0  # wall-clock seconds
    in_flight: int = 0
    ending: ErrorCode | None = None  # why the broker decided to close it (its calls are refused with it)
    held: list[Any] = field(default_factory=list)  # ClientFrames that came while it hibernated
    names: set[str] = field(default_factory=set)  # its named points (Mark), in Registry.names
    priority: int = 0  # its open's Sampling.priority: its calls' default in the admission queue

    @property
    def model(self) -> str:
        """The model it runs on: only workers running it hold or restore it."""
        return self.opened.model

    @property
    def live(self) -> bool:
        """In a slab (or on its way into one): what SESSIONS lists as live."""
        return self.worker is not None

    def move(self, to: State) -> None:
        if to is not self.state and to not in _MOVES[self.state]:
            raise IllegalMove(f"session {self.session_id}: {self.state.value} -> {to.value}")
        self.state = to


class Gone(NamedTuple):
    """Why a forgotten session is gone, told to its owner's later calls."""

    code: ErrorCode
    why: str
    owner: str


@dataclass(eq=False)
class Request:
    route: bytes  # b"" for the broker's own requests
    request_id: int
    op: str
    worker: WorkerEntry
    session_id: str
    owner: str = ""  # OPEN: quota identity of the future session
    orphaned: bool = False  # its client vanished: replies are consumed, not sent
    overrun: bool = False  # its client fell behind: the stream was cancelled
    dropped: int = 0  # chunks not sent after the overrun
    cancel_on_open: bool = False  # OPEN cancelled by the client while the worker opened it
    started: float = 0.0  # when the client's frame came (metrics: time to first token)
    priority: int = 0  # an OPEN's: the session's default priority
    last_token: float = 0.0  # when its stream's last chunk passed (0: none yet)
    last_sent: float = 0.0  # when a reply of it last went to its client (0: none yet)


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerEntry] = {}
        self.sessions: dict[str, SessionEntry] = {}
        self.requests: dict[tuple[bytes, int], Request] = {}
        self.gone: OrderedDict[str, Gone] = OrderedDict()
        # A session's named points (Mark) -> the session: what FIND looks up.
        # Learnt from the records at start and from the MARKs passing through;
        # the worker's record is the truth (a rewind forgets names there).
        self.names: dict[str, str] = {}

    # ------------------------------------------------------------ workers

    def add_worker(self, identity: bytes, ready: WorkerReady, now: float) -> WorkerEntry:
        foreign = max(0, ready.slabs - ready.free_slabs)
        worker = WorkerEntry(identity=identity, ready=ready, foreign=foreign, last_seen=now)
        self.workers[identity] = worker
        return worker

    def holds(self, worker: WorkerEntry) -> bool:
        """Whether `worker` is registered (not forgotten, not replaced by its re-registering)."""
        return self.workers.get(worker.identity) is worker

    def fail_requests(self, worker: WorkerEntry) -> list[Request]:
        """Its requests in flight, now failed."""
        failed = [req for req in self.requests.values() if req.worker is worker]
        for req in failed:
            self.finish(req)
        return failed

    def remove_worker(self, worker: WorkerEntry, why: str, stored: bool) -> list[Request]:
        """Forget `worker`; return its requests in flight (now failed). Its
        sessions hibernate when their records are in a store another
        process reads (`stored`); otherwise they are lost with it, as are
        the sessions hibernated in its store, and told so (`worker_lost`)."""
        self.workers.pop(worker.identity, None)
        lost = self.fail_requests(worker)
        for session_id in list(worker.sessions):
            session = self.sessions[session_id]
            if stored:
                self.hibernated(session)
            else:
                lost_why = f"session {session_id} was on worker {worker.worker_id}, which was lost ({why})"
                self.drop_session(session_id, ErrorCode.WORKER_LOST, lost_why)
        if not stored:
            for session in [s for s in self.sessions.values() if s.worker is None and s.store == worker.ready.store]:
                lost_why = (
                    f"session {session.session_id} was stored on worker {worker.worker_id}, which was lost ({why})"
                )
                self.drop_session(session.session_id, ErrorCode.WORKER_LOST, lost_why)
        return lost

    def place(
        self, store: str | None = None, prefer: WorkerEntry | None = None, model: str | None = None
    ) -> WorkerEntry | None:
        """`prefer` if it can take it, else the worker of `model` with the
        most free slabs that takes sessions (and reads `store`, for a restore)."""
        candidates = [
            w
            for w in self.workers.values()
            if not w.draining and w.free_slabs > 0 and store in (None, w.ready.store) and w.runs(model)
        ]
        if prefer in candidates:
            return prefer
        return max(candidates, key=lambda w: w.free_slabs, default=None)

    def reader(self, store: str) -> WorkerEntry | None:
        """A worker that reads `store` (for a record the broker does not)."""
        return next((w for w in self.workers.values() if w.ready.store == store), None)

    def models(self) -> list[str]:
        """The models its workers run, the first registered first: that one is the default."""
        return list(dict.fromkeys(w.ready.model for w in self.workers.values()))

    def idle_live(self, store: str | None = None, model: str | None = None) -> list[SessionEntry]:
        """Live sessions (of `model`) with nothing running or on its way,
        least recently used first: the ones to hibernate when a slab is needed."""
        idle = [
            s
            for s in self.sessions.values()
            if s.state is State.LIVE
            and s.in_flight == 0
            and not s.ending
            and store in (None, s.worker.ready.store)
            and model in (None, s.model)
        ]
        return sorted(idle, key=lambda s: s.last_active)

    def slabs_total(self) -> int:
        return sum(w.ready.slabs for w in self.workers.values())

    def slabs_free(self) -> int:
        return sum(w.free_slabs for w in self.workers.values())

    # ----------------------------------------------------------- sessions

    def add_session(
        self,
        session_id: str,
        worker: WorkerEntry | None,
        route: bytes,
        owner: str,
        now: float,
        opened: SessionOpened,
        store: str = "",
    ) -> SessionEntry:
        """A session live on `worker`, or (None) hibernated in `store`."""
        state = State.LIVE if worker is not None else State.HIBERNATED
        store = worker.ready.store if worker is not None else store
        session = SessionEntry(session_id, worker, route, owner, now, opened, state, store)
        self.sessions[session_id] = session
        if worker is not None:
            worker.sessions.add(session_id)
        return session

    def name(self, session: SessionEntry, names) -> None:
        """The session has these names now (the last to take a name has it)."""
        for name in names:
            previous = self.sessions.get(self.names.get(name, ""))
            if previous is not None and previous is not session:
                previous.names.discard(name)
            self.names[name] = session.session_id
            session.names.add(name)

    def unname(self, session: SessionEntry, names) -> None:
        for name in list(names):
            if self.names.get(name) == session.session_id:
                del self.names[name]
            session.names.discard(name)

    # Every change of a session's state (State's docstring has the map).

    def hibernating(self, session: SessionEntry) -> None:
        """A HIBERNATE is on its way to its worker."""
        session.move(State.HIBERNATING)

    def hibernated(self, session: SessionEntry) -> None:
        """The session's slab is free; it lives in the store now (a CLOSE on
        its way stays on its way)."""
        if session.worker is not None:
            session.worker.sessions.discard(session.session_id)
            session.store = session.worker.ready.store
        session.worker = None
        if session.state is not State.CLOSING:
            session.move(State.HIBERNATED)

    def stays_live(self, session: SessionEntry) -> None:
        """Its worker refused to hibernate or close it, or answered for it
        after a restore."""
        session.move(State.LIVE)

    def place_session(self, session: SessionEntry, worker: WorkerEntry) -> None:
        """A hibernated session takes a slab on `worker`, which restores it
        when the request that follows reaches it."""
        session.move(State.RESTORING)
        session.worker = worker
        session.store = worker.ready.store
        worker.sessions.add(session.session_id)

    def adopted(self, session: SessionEntry, worker: WorkerEntry) -> None:
        """`worker`'s READY says it holds the session (it kept it across a
        restart): live there."""
        session.worker, session.store = worker, worker.ready.store
        worker.sessions.add(session.session_id)
        if session.state is not State.CLOSING:
            session.move(State.LIVE)

    def closing(self, session: SessionEntry, why: ErrorCode) -> None:
        """The broker ends the session for `why`: its calls are refused with
        it from now on; a CLOSE goes to its worker."""
        session.ending = session.ending or why
        session.move(State.CLOSING)

    def drop_session(self, session_id: str, code: ErrorCode | None = None, why: str = "") -> None:
        """Forget a session (its slab is free). With `code`, a later call on it
        gets that error and `why` rather than a bare not-found."""
        session = self.sessions.pop(session_id, None)
        if session is not None and session.worker is not None:
            session.worker.sessions.discard(session_id)
        if session is not None:
            self.unname(session, session.names)
        if code is not None:
            self.gone[session_id] = Gone(code, why, session.owner if session is not None else "")
            while len(self.gone) > _GONE_MEMORY:
                self.gone.popitem(last=False)

    def live_sessions_of(self, owner: str, model: str | None = None) -> int:
        """Sessions (live and hibernated) and opens in flight of `model`
        (None: every model) counted against `owner`'s quota."""
        opening = sum(
            1
            for r in self.requests.values()
            if r.op == Op.OPEN and r.owner == owner and not r.orphaned and r.worker.runs(model)
        )
        return opening + sum(
            1 for s in self.sessions.values() if s.owner == owner and s.ending is None and model in (None, s.model)
        )

    # ----------------------------------------------------------- requests

    def track(
        self, route: bytes, request_id: int, op: str, worker: WorkerEntry, session_id: str, owner: str = ""
    ) -> Request:
        req = Request(route, request_id, op, worker, session_id, owner)
        self.requests[(route, request_id)] = req
        worker.in_flight += 1
        if op == Op.OPEN:
            worker.opening += 1
        elif session_id in self.sessions:
            self.sessions[session_id].in_flight += 1
        return req

    def finish(self, req: Request) -> None:
        """The request got its last reply (or failed): undo what track() counted."""
        if self.requests.pop((req.route, req.request_id), None) is None:
            return
        req.worker.in_flight -= 1
        if req.op == Op.OPEN:
            req.worker.opening -= 1
        elif req.session_id in self.sessions:
            self.sessions[req.session_id].in_flight -= 1
