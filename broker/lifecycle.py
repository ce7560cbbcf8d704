"""The broker's side of durable sessions: the store loaded at start, idle
sessions hibernated when a slab is wanted (or after `hibernate_after_s`),
a worker's kept sessions adopted when it registers, restores followed to
their first answer, sessions the broker ends, and what the broker answers
for a hibernated session from its record (INFO, CLOSE, RESUME, SESSIONS)
without waking it.

`Lifecycle` is held by the broker: it changes sessions' states through the
registry (broker/registry.py: `State`), reads and deletes records through
the store (kvmux/sessions), and sends through the few broker operations
named in `Sends`. No MLX.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

import msgspec

from kvmux import logs
from kvmux.protocol import (
    Ack,
    Close,
    Closed,
    ErrorCode,
    Hibernate,
    Op,
    ProtocolError,
    Restored,
    SessionList,
    SessionOpened,
    SessionSummary,
    decode_body,
    decode_reply,
)
from kvmux.sessions import RecordHead, SessionRecord, SessionStore, StoreError, StoreUnavailable, durable, is_session_id

from .admission import Admission, Pending, percentiles, priority
from .client_frame import ClientFrame
from .config import BrokerConfig
from .metrics import Metrics
from .registry import Registry, Request, SessionEntry, State, WorkerEntry

log = logs.get("broker")

_RESTORE_SAMPLES = 4096  # restore times kept for the p50/p99 in stats


class Sends(Protocol):
    """What the lifecycle asks of the broker: answers, requests of its own
    to workers, and placing a call on a slab."""

    def reply(self, route: bytes, env, body: msgspec.Struct) -> None: ...
    def error(self, route: bytes, request_id: int, session_id: str, code: ErrorCode, message: str) -> None: ...
    def own_request(self, worker: WorkerEntry, op: str, session_id: str, body: msgspec.Struct) -> None: ...
    def place(self, pending: Pending, request, now: float) -> None: ...
    def forward(self, frame: ClientFrame) -> None: ...
    def to_worker(self, worker: WorkerEntry, route: bytes, env_raw: bytes, body: bytes) -> None: ...
    def check_unique(self, route: bytes, request_id: int) -> None: ...


class Lifecycle:
    def __init__(
        self,
        cfg: BrokerConfig,
        registry: Registry,
        admission: Admission,
        store: SessionStore,
        sends: Sends,
        metrics: Metrics,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.registry = registry
        self.admission = admission
        self.store = store
        self.sends = sends
        self.hibernations = self.restores = 0
        self.restore_times: deque[float] = deque(maxlen=_RESTORE_SAMPLES)
        self._store_bytes = 0  # the store's count when last read
        self.over_budget = False  # the store is past max_store_bytes with nothing left to expire
        # Sessions lost with a worker whose store no other process reads, by
        # that store: deleted there when a worker reading it registers.
        self.stranded: dict[str, set[str]] = {}

    def load(self, now: float) -> None:
        """Every session the store holds, hibernated until a worker holds it;
        those whose record is unreadable answer `session_corrupt`."""
        count = corrupt = 0
        for session_id in self.store.session_ids():
            try:
                head = self.store.head(session_id)
            except StoreUnavailable:
                raise  # the store went away mid-scan: no session is to blame
            except StoreError as exc:
                why = f"session {session_id} is corrupt: {exc}"
                self.registry.drop_session(session_id, ErrorCode.SESSION_CORRUPT, why)
                log.warning("session_corrupt", session=session_id, why=str(exc))
                corrupt += 1
                continue
            last = now - max(0.0, time.time() - head.updated)  # its wall-clock time on our monotonic clock
            opened = _opened_from(head)
            session = self.registry.add_session(
                head.session_id, None, b"", head.owner, last, opened, store=self.store.store_id
            )
            session.opened_at = head.created
            self.registry.name(session, head.marks)
            count += 1
        log.info("store_loaded", store=self.store.store_id, sessions=count, corrupt=corrupt)

    # ----------------------------------------------- calls on a hibernated one

    def dormant(self, frame: ClientFrame, session: SessionEntry) -> None:
        """A call on a hibernated session: INFO and CLOSE are answered from
        the store (by a worker reading it, when the broker does not);
        APPEND and GENERATE wait for a slab to restore it in."""
        env, route = frame.env, frame.route
        if env.op in (Op.INFO, Op.CLOSE) and session.store != self.store.store_id:
            reader = self.registry.reader(session.store)
            if reader is None:
                why = f"session {session.session_id} is stored where no worker registered now reads ({session.store})"
                raise ProtocolError(ErrorCode.WORKER_LOST, why)
            self.sends.check_unique(route, env.request_id)
            self.registry.track(route, env.request_id, env.op, reader, session.session_id)
            return self.sends.to_worker(reader, route, frame.env_raw, frame.body)
        if env.op == Op.INFO:
            info = decode_body(Op.INFO, frame.body)
            try:
                record = self.store.load(session.session_id)
            except StoreUnavailable as exc:
                raise ProtocolError(ErrorCode.INTERNAL, str(exc)) from None
            except StoreError as exc:
                raise ProtocolError(
                    ErrorCode.SESSION_CORRUPT, f"session {session.session_id} is corrupt: {exc}"
                ) from None
            idle = frame.now - session.last_active
            return self.sends.reply(route, env, durable.hibernated_info(record, self._slab_bytes(record), idle, info))
        if env.op == Op.CLOSE:
            decode_body(Op.CLOSE, frame.body)
            try:
                self.store.delete(session.session_id)
            except StoreUnavailable as exc:
                raise ProtocolError(ErrorCode.INTERNAL, f"{exc}; the session stays: close it again later") from None
            self.registry.drop_session(
                session.session_id, ErrorCode.SESSION_NOT_FOUND, f"session {session.session_id} was closed"
            )
            log.info("session_closed", session=session.session_id, state="hibernated")
            return self.sends.reply(route, env, Closed(session_id=session.session_id))
        if env.op == Op.CANCEL:
            return self.sends.reply(route, env, Ack())  # nothing runs on it
        if env.op == Op.CREDIT:
            return
        self.sends.check_unique(route, env.request_id)
        pending = Pending(route, env.request_id, frame.body, session.owner, frame.now, frame.now)
        pending.session_id, pending.env_raw, pending.store = session.session_id, frame.env_raw, session.store
        pending.model = session.model  # restored only where its model runs (durable.restorable checks it too)
        request = decode_body(env.op, frame.body)  # its priority, or its session's
        pending.priority = priority(request if env.op == Op.GENERATE else None, session.priority)
        pending.traceparent = getattr(request, "traceparent", None)  # (APPEND's and GENERATE's)
        self.sends.place(pending, None, frame.now)

    def _slab_bytes(self, record: SessionRecord) -> int:
        """slab_bytes of a hibernated session: as a worker with its model reports it."""
        for worker in self.registry.workers.values():
            if worker.ready.model == record.model and worker.ready.sink + worker.ready.max_window:
                per_token = worker.ready.slab_bytes // (worker.ready.sink + worker.ready.max_window)
                return per_token * (record.sink + record.window)
        return 0

    def resume(self, frame: ClientFrame, session: SessionEntry) -> None:
        decode_body(Op.RESUME, frame.body)
        worker_id = session.worker.worker_id if session.worker is not None else ""
        self.sends.reply(frame.route, frame.env, msgspec.structs.replace(session.opened, worker_id=worker_id))

    def list_sessions(self, frame: ClientFrame) -> None:
        decode_body(Op.SESSIONS, frame.body)
        rows = [
            SessionSummary(
                session_id=s.session_id,
                state="live" if s.live else "hibernated",
                owner=s.owner,
                worker_id=s.worker.worker_id if s.worker is not None else "",
                history_tokens=self._stored_tokens(s.session_id),
                idle_s=round(frame.now - s.last_active, 3),
                bytes_on_disk=self.store.bytes_stored(s.session_id),
                created=s.opened_at,
            )
            for s in self.registry.sessions.values()
            if s.ending is None and frame.owns(s)
        ]
        self.sends.reply(frame.route, frame.env, SessionList(sessions=rows))

    def _stored_tokens(self, session_id: str) -> int:
        try:
            return self.store.head(session_id).tokens
        except StoreError:
            return 0

    # ----------------------------------------------------- workers' answers

    def strand(self, store: str, session_ids: list[str]) -> None:
        """These sessions are lost with the only worker reading `store`."""
        self.stranded.setdefault(store, set()).update(session_ids)

    def clean_stranded(self, worker: WorkerEntry) -> None:
        """A worker reading a store whose sessions were lost registered: they
        were reported lost, so their records there go."""
        stranded = sorted(self.stranded.pop(worker.ready.store, ()))
        for n, session_id in enumerate(stranded):
            if not self.registry.holds(worker):  # lost on the way (unreachable): the rest wait for the next
                self.strand(worker.ready.store, stranded[n:])
                return
            log.info("stranded_session_deleted", session=session_id, worker=worker.worker_id)
            self.sends.own_request(worker, Op.CLOSE, session_id, Close())

    def adopt_stored(self, worker: WorkerEntry, head: RecordHead, now: float) -> None:
        """A hibernated session in the worker's store that the broker does not
        know (its store is not ours: a broker restarted, or on another
        host): hibernated there, restored on a worker reading that store."""
        store = worker.ready.store
        known = head.session_id in self.registry.sessions or head.session_id in self.stranded.get(store, ())
        if store == self.store.store_id or known or not is_session_id(head.session_id):
            return
        last = now - max(0.0, time.time() - head.updated)
        session = self.registry.add_session(head.session_id, None, b"", head.owner, last, _opened_from(head), store)
        session.opened_at = head.created
        self.registry.name(session, head.marks)

    def adopt(self, worker: WorkerEntry, session_id: str, now: float) -> None:
        """A session the worker kept (across our restart, or its
        re-registering): live there, unless another worker holds it already
        or it was reported lost (then clean_stranded closes it)."""
        if not is_session_id(session_id):
            log.warning("bad_session_id_from_worker", worker=worker.worker_id, session=repr(session_id)[:80])
            return
        if session_id in self.stranded.get(worker.ready.store, ()):
            worker.foreign = max(0, worker.foreign - 1)  # freed by the close that clean_stranded sends first
            return
        session = self.registry.sessions.get(session_id)
        if session is not None and session.worker is not None and session.worker is not worker:
            log.warning("session_claimed_twice", session=session_id, holder=session.worker.worker_id)
            worker.foreign += 1  # until the close below frees it
            return self.sends.own_request(worker, Op.CLOSE, session_id, Close(keep=True))
        worker.foreign = max(0, worker.foreign - 1)  # READY counted it as taken
        if session is None:
            owner = ""
            try:
                head = self.store.head(session_id)
                owner, opened, created = head.owner, _opened_from(head), head.created
            except StoreError:  # a store we do not read: the owner its record names, as the worker tells it
                owner = worker.ready.owners.get(session_id, "")
                opened, created = _opened_from(_unknown_head(session_id, worker)), time.time()
            session = self.registry.add_session(session_id, worker, b"", owner, now, opened)
            session.opened_at = created
        else:
            self.registry.adopted(session, worker)

    def first_answer(self, session: SessionEntry, op: str, body: bytes) -> None:
        """The first answer about a session placed for a restore: it is live,
        or its record failed it (then it is gone, with the worker's reason)."""
        self.registry.stays_live(session)
        if op != Op.ERROR:
            return
        error = decode_reply(body)
        if error.code in (ErrorCode.SESSION_CORRUPT, ErrorCode.SESSION_NOT_FOUND):
            log.warning("restore_failed", session=session.session_id, code=error.code.value, why=error.message)
            self.registry.drop_session(session.session_id, error.code, error.message)

    def restored(self, restored: Restored, worker: WorkerEntry) -> None:
        """A worker's RESTORED: counted for stats."""
        self.restores += 1
        self.restore_times.append(restored.seconds)
        self.metrics.restore.labels(worker.ready.model).observe(restored.seconds)
        log.info(
            "session_restored",
            session=restored.session_id,
            worker=worker.worker_id,
            seconds=round(restored.seconds, 4),
            replayed_tokens=restored.replayed_tokens,
        )

    def restore_percentiles(self) -> tuple[float, float]:
        return percentiles(self.restore_times)

    def hibernated(self, req: Request, op: str, body: bytes) -> None:
        """The answer to a HIBERNATE; then the calls that came meanwhile are
        served as they would have been."""
        session = self.registry.sessions.get(req.session_id)
        if session is None:
            return
        if op == Op.FINAL:
            reply = decode_reply(body)
            self.registry.hibernated(session)
            self.hibernations += 1
            self.metrics.hibernate.labels(req.worker.ready.model).observe(reply.seconds)
            log.info(
                "session_hibernated", session=session.session_id, bytes=reply.bytes, seconds=round(reply.seconds, 4)
            )
        else:
            log.info("hibernate_refused", session=session.session_id, why=decode_reply(body).message)
            if session.state is State.HIBERNATING:
                self.registry.stays_live(session)
        self.release(session)

    def release(self, session: SessionEntry) -> None:
        """The calls held while the session was leaving its slab (for the
        store, or with its worker's exit): served as they would have been
        (a session lost with its worker answers them why)."""
        held, session.held = session.held, []
        for frame in held:
            try:
                self.sends.forward(frame)
            except ProtocolError as exc:
                self.sends.error(frame.route, frame.env.request_id, frame.env.session_id, exc.code, exc.message)

    def closed(self, req: Request, op: str, body: bytes) -> None:
        """The answer to a CLOSE (the client's or the broker's own)."""
        session = self.registry.sessions.get(req.session_id)
        if session is None:
            return
        if op == Op.ERROR and decode_reply(body).code is not ErrorCode.SESSION_NOT_FOUND:
            if session.state is State.CLOSING:  # not closed (a bad CLOSE body, say): the session stays
                self.registry.stays_live(session)
            return
        ending = session.ending
        why = (
            "closed by the broker: idle timeout or session TTL"
            if ending is ErrorCode.SESSION_EXPIRED
            else f"session {req.session_id} was closed"
        )
        self.registry.drop_session(req.session_id, ending, why)

    # --------------------------------------------------- the broker's own acts

    def end(self, session: SessionEntry, why: ErrorCode) -> None:
        """Close a session on the broker's own account (its record goes too).
        A live one's worker cancels what runs on it first, then frees the slab."""
        if session.worker is None:
            try:
                self.store.delete(session.session_id)
            except StoreUnavailable as exc:  # it stays ended here; the next broker's expiry deletes it
                log.warning("record_not_deleted", session=session.session_id, why=str(exc))
            self.registry.drop_session(session.session_id, why, f"session {session.session_id} ended ({why.value})")
        elif session.state is not State.CLOSING:
            self.registry.closing(session, why)
            self.sends.own_request(session.worker, Op.CLOSE, session.session_id, Close())

    def hibernate(self, now: float, sweep: bool, draining: bool) -> None:
        """Free slabs for what waits in the queue, and hibernate sessions
        idle past `hibernate_after_s` (on a `sweep` tick, not while
        draining): least recently used first."""
        sessions = self.registry.sessions.values()
        wanted = [p for p in self.admission.queue if self.registry.place(p.store, model=p.model) is None]
        for model in dict.fromkeys(p.model for p in wanted) if self.registry.workers else ():
            mine = [p for p in wanted if p.model == model]
            in_flight = sum(1 for s in sessions if s.state is State.HIBERNATING and model in (None, s.model))
            idle = self.registry.idle_live(mine[0].store, model)
            for session, waiting in zip(idle, mine[in_flight:], strict=False):
                self._send_hibernate(session, waiting.traceparent)
        limit = self.cfg.hibernate_after_s
        if sweep and limit and not draining:
            for session in self.registry.idle_live():
                if now - session.last_active < limit:
                    break  # least recently used first: the rest are fresher
                self._send_hibernate(session)

    def _send_hibernate(self, session: SessionEntry, traceparent: str | None = None) -> None:
        """`traceparent`: the request waiting for its slab, where that one is traced."""
        self.registry.hibernating(session)
        self.sends.own_request(session.worker, Op.HIBERNATE, session.session_id, Hibernate(traceparent=traceparent))

    def store_size(self) -> int:
        """The store's bytes as it counts them (the last count while it cannot be read)."""
        try:
            self._store_bytes = self.store.bytes_total()
        except StoreError as exc:
            log.debug("store_bytes_unread", why=str(exc))  # the lease renewal says so each second
        return self._store_bytes

    def keep_budget(self) -> None:
        """Past `max_store_bytes`, expire the least recently used idle
        hibernated sessions (nothing running, waiting or held on them) until
        the store is back within it; a live session never. Each is logged
        with its owner; its next call gets `session_expired`."""
        budget = self.cfg.max_store_bytes
        if not budget:
            return
        total = self.store_size()
        if total <= budget:
            self.over_budget = False
            return
        waiting = {p.session_id for p in self.admission.queue}
        idle = [
            s
            for s in self.registry.sessions.values()
            if s.state is State.HIBERNATED
            and s.ending is None
            and s.store == self.store.store_id
            and not s.held
            and s.session_id not in waiting
        ]
        for session in sorted(idle, key=lambda s: s.last_active):
            if total <= budget:
                break
            freed = self.store.bytes_stored(session.session_id)
            log.info(
                "session_expired",
                session=session.session_id,
                owner=session.owner,
                reason="store_budget",
                bytes=freed,
                store_bytes=total,
                budget=budget,
            )
            self.admission.expired += 1
            self.metrics.expired.labels("store_budget").inc()
            self.end(session, ErrorCode.SESSION_EXPIRED)
            total -= freed
        if total > budget and not self.over_budget:
            log.warning(
                "store_over_budget", store_bytes=total, budget=budget, why="only live or busy sessions are left"
            )
        self.over_budget = total > budget


def _opened_from(head: RecordHead) -> SessionOpened:
    """RESUME's answer for a session known only from the store."""
    return SessionOpened(
        session_id=head.session_id, worker_id="", model=head.model, sink=head.sink, window=head.window, slab_bytes=0
    )


def _unknown_head(session_id: str, worker: WorkerEntry) -> RecordHead:
    """What a worker's session is known as when no record of it is readable here."""
    return RecordHead(
        session_id=session_id,
        model=worker.ready.model,
        owner="",
        created=0.0,
        updated=0.0,
        sink=worker.ready.sink,
        window=worker.ready.max_window,
    )
