"""What the broker knows: registered workers, live sessions (session ->
worker affinity) and requests in flight ((client route, request id) ->
worker). Free slabs are derived from these, never counted on the side, so
they cannot drift: free = slabs - foreign - sessions - opens in flight."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvmux.protocol import ErrorCode, Op, WorkerReady

# Ids of sessions that ended without the client closing them, kept so a late
# call learns why (expired vs. worker lost) instead of a bare "not found".
_GONE_MEMORY = 4096


@dataclass(eq=False)
class Worker:
    identity: bytes  # its DEALER routing id on the backend
    ready: WorkerReady
    foreign: int  # slabs its READY said were taken by sessions this broker never opened
    last_seen: float
    sessions: set[str] = field(default_factory=set)
    opening: int = 0  # OPENs forwarded and not answered yet (their slab is reserved)
    in_flight: int = 0
    running: int = 0  # from its heartbeat
    draining: bool = False  # from its heartbeat: it takes no new sessions
    frames_forwarded: int = 0

    @property
    def worker_id(self) -> str:
        return (
            self.identity.decode("utf-8", "backslashreplace") if self.identity[:1] != b"\x00" else self.identity.hex()
        )

    @property
    def free_slabs(self) -> int:
        return max(0, self.ready.slabs - self.foreign - len(self.sessions) - self.opening)


@dataclass(eq=False)
class Session:
    session_id: str
    worker: Worker
    route: bytes  # the client that opened it
    owner: str  # its identity for the per-client quota
    last_active: float
    in_flight: int = 0
    ending: ErrorCode | None = None  # set when the broker decided to close it (why)
    closing: bool = False  # a CLOSE is on its way to the worker


@dataclass(eq=False)
class Request:
    route: bytes  # b"" for the broker's own requests
    request_id: int
    op: str
    worker: Worker
    session_id: str
    owner: str = ""  # OPEN: quota identity of the future session
    orphaned: bool = False  # its client vanished: replies are consumed, not sent
    overrun: bool = False  # its client fell behind: the stream was cancelled
    dropped: int = 0  # chunks not sent after the overrun
    cancel_on_open: bool = False  # OPEN cancelled by the client while the worker opened it


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, Worker] = {}
        self.sessions: dict[str, Session] = {}
        self.requests: dict[tuple[bytes, int], Request] = {}
        self.gone: OrderedDict[str, tuple[ErrorCode, str]] = OrderedDict()

    # ------------------------------------------------------------ workers

    def add_worker(self, identity: bytes, ready: WorkerReady, now: float) -> Worker:
        foreign = max(0, ready.slabs - ready.free_slabs)
        worker = Worker(identity=identity, ready=ready, foreign=foreign, last_seen=now)
        self.workers[identity] = worker
        return worker

    def remove_worker(self, worker: Worker, why: str) -> list[Request]:
        """Forget `worker`; return its requests in flight (now failed). Its
        sessions are remembered as lost."""
        self.workers.pop(worker.identity, None)
        lost = [req for req in self.requests.values() if req.worker is worker]
        for req in lost:
            del self.requests[(req.route, req.request_id)]
        for session_id in list(worker.sessions):
            self.drop_session(
                session_id,
                ErrorCode.SESSION_NOT_FOUND,
                f"session {session_id} was on worker {worker.worker_id}, which was lost ({why})",
            )
        return lost

    def place(self) -> Worker | None:
        """The worker with the most free slabs that takes new sessions."""
        candidates = [w for w in self.workers.values() if not w.draining and w.free_slabs > 0]
        return max(candidates, key=lambda w: w.free_slabs, default=None)

    def slabs_total(self) -> int:
        return sum(w.ready.slabs for w in self.workers.values())

    def slabs_free(self) -> int:
        return sum(w.free_slabs for w in self.workers.values())

    # ----------------------------------------------------------- sessions

    def add_session(self, session_id: str, worker: Worker, route: bytes, owner: str, now: float) -> Session:
        session = Session(session_id, worker, route, owner, now)
        self.sessions[session_id] = session
        worker.sessions.add(session_id)
        return session

    def drop_session(self, session_id: str, code: ErrorCode | None = None, why: str = "") -> None:
        """Forget a session (its slab is free). With `code`, a later call on it
        gets that error and `why` rather than a bare not-found."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.worker.sessions.discard(session_id)
        if code is not None:
            self.gone[session_id] = (code, why)
            while len(self.gone) > _GONE_MEMORY:
                self.gone.popitem(last=False)

    def live_sessions_of(self, owner: str) -> int:
        """Sessions and opens in flight counted against `owner`'s quota."""
        opening = sum(1 for r in self.requests.values() if r.op == Op.OPEN and r.owner == owner and not r.orphaned)
        return opening + sum(1 for s in self.sessions.values() if s.owner == owner and s.ending is None)

    # ----------------------------------------------------------- requests

    def track(
        self, route: bytes, request_id: int, op: str, worker: Worker, session_id: str, owner: str = ""
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
