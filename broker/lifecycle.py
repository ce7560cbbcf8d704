"""The broker's side of durable sessions: the store loaded at start, idle
sessions hibernated when a slab is wanted (or after `hibernate_after_s`),
a worker's kept sessions adopted when it registers, restores followed to
their first answer, and what the broker answers for a hibernated session
from its record (INFO, CLOSE, RESUME, SESSIONS) without waking it.

A mixin of `Broker`: it works on the broker's registry, store and sends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

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
    SessionList,
    SessionSummary,
    decode_body,
    decode_reply,
)
from kvmux.store import RecordHead, StoreError, is_session_id

from . import stored
from .admission import Pending
from .registry import Request, Session, Worker

if TYPE_CHECKING:
    from .broker import ClientFrame

log = logs.get("broker")

STORE_BYTES_EVERY_S = 10.0  # summing the store's file sizes is not free


class SessionLifecycle:
    def _load_store(self, now: float) -> None:
        """Every session the store holds, hibernated until a worker holds it."""
        heads, corrupt = stored.scan(self.store)
        for head in heads:
            last = stored.idle_since(head.updated, now)
            session = self.registry.add_session(head.session_id, None, b"", head.owner, last, stored.opened_from(head))
            session.opened_at = head.created
        for session_id, why in corrupt.items():
            self.registry.drop_session(session_id, ErrorCode.SESSION_CORRUPT, f"session {session_id} is corrupt: {why}")
            log.warning("session_corrupt", session=session_id, why=why)
        log.info("store_loaded", path=str(self.store.root), sessions=len(heads), corrupt=len(corrupt))

    def _dormant(self, frame: ClientFrame, session: Session) -> None:
        """A call on a hibernated session: INFO and CLOSE are answered from
        the store; APPEND and GENERATE wait for a slab to restore it in."""
        env, route = frame.env, frame.route
        if env.op == Op.INFO:
            token_ids = decode_body(Op.INFO, frame.body).token_ids
            try:
                record = self.store.load(session.session_id)
            except StoreError as exc:
                raise ProtocolError(
                    ErrorCode.SESSION_CORRUPT, f"session {session.session_id} is corrupt: {exc}"
                ) from None
            idle = frame.now - session.last_active
            return self._reply(route, env, stored.info(record, self._slab_bytes(record), idle, token_ids))
        if env.op == Op.CLOSE:
            decode_body(Op.CLOSE, frame.body)
            self.store.delete(session.session_id)
            self.registry.drop_session(
                session.session_id, ErrorCode.SESSION_NOT_FOUND, f"session {session.session_id} was closed"
            )
            log.info("session_closed", session=session.session_id, state="hibernated")
            return self._reply(route, env, Closed(session_id=session.session_id))
        if env.op == Op.CANCEL:
            return self._reply(route, env, Ack())  # nothing runs on it
        if env.op == Op.CREDIT:
            return
        self._check_unique(route, env.request_id)
        pending = Pending(route, env.request_id, frame.body, session.owner, frame.now, frame.now)
        pending.session_id, pending.env_raw, pending.store = session.session_id, frame.env_raw, self.store_id
        self._place(pending, None, frame.now)

    def _slab_bytes(self, record) -> int:
        """slab_bytes of a hibernated session: as a worker with its model reports it."""
        for worker in self.registry.workers.values():
            if worker.ready.model == record.model and worker.ready.sink + worker.ready.max_window:
                per_token = worker.ready.slab_bytes // (worker.ready.sink + worker.ready.max_window)
                return per_token * (record.sink + record.window)
        return 0

    def _stored_tokens(self, session_id: str) -> int:
        try:
            return self.store.head(session_id).tokens
        except StoreError:
            return 0

    def _resume(self, frame: ClientFrame) -> None:
        decode_body(Op.RESUME, frame.body)
        session = self._session(frame)
        opened = session.opened
        if session.worker is not None:
            opened = msgspec.structs.replace(opened, worker_id=session.worker.worker_id)
        else:
            opened = msgspec.structs.replace(opened, worker_id="")
        self._reply(frame.route, frame.env, opened)

    def _list_sessions(self, frame: ClientFrame) -> None:
        decode_body(Op.SESSIONS, frame.body)
        rows = [
            SessionSummary(
                session_id=s.session_id,
                state=s.state,
                owner=s.owner,
                worker_id=s.worker.worker_id if s.worker is not None else "",
                history_tokens=self._stored_tokens(s.session_id),
                idle_s=round(frame.now - s.last_active, 3),
                bytes_on_disk=self.store.bytes_on_disk(s.session_id),
                created=s.opened_at,
            )
            for s in self.registry.sessions.values()
            if s.ending is None and frame.owns(s)
        ]
        self._reply(frame.route, frame.env, SessionList(sessions=rows))

    def _adopt(self, worker: Worker, session_id: str, now: float) -> None:
        """A session the worker kept (across our restart, or its
        re-registering): live there, unless another worker holds it already."""
        if not is_session_id(session_id):
            log.warning("bad_session_id_from_worker", worker=worker.worker_id, session=repr(session_id)[:80])
            return
        session = self.registry.sessions.get(session_id)
        if session is not None and session.worker is not None and session.worker is not worker:
            log.warning("session_claimed_twice", session=session_id, holder=session.worker.worker_id)
            worker.foreign += 1  # until the close below frees it
            return self._own_request(worker, Op.CLOSE, session_id, Close(keep=True))
        worker.foreign = max(0, worker.foreign - 1)  # READY counted it as taken
        if session is None:
            owner = ""
            try:
                head = self.store.head(session_id)
                owner, opened, created = head.owner, stored.opened_from(head), head.created
            except StoreError:
                opened, created = stored.opened_from(_unknown_head(session_id, worker)), time.time()
            session = self.registry.add_session(session_id, worker, b"", owner, now, opened)
            session.opened_at = created
        else:
            session.worker = worker
            worker.sessions.add(session_id)

    def _restored(self, session: Session, op: str, body: bytes) -> None:
        """The first answer about a session placed for a restore: it is live,
        or its record failed it (then it is gone, with the worker's reason)."""
        session.restoring = False
        if op != Op.ERROR:
            return
        error = decode_reply(body)
        if error.code in (ErrorCode.SESSION_CORRUPT, ErrorCode.SESSION_NOT_FOUND):
            log.warning("restore_failed", session=session.session_id, code=error.code.value, why=error.message)
            self.registry.drop_session(session.session_id, error.code, error.message)

    def _hibernated(self, req: Request, op: str, body: bytes, now: float) -> None:
        session = self.registry.sessions.get(req.session_id)
        if session is None:
            return
        session.hibernating = False
        if op == Op.FINAL:
            reply = decode_reply(body)
            self.registry.hibernated(session)
            self.hibernations += 1
            log.info(
                "session_hibernated", session=session.session_id, bytes=reply.bytes, seconds=round(reply.seconds, 4)
            )
        else:
            log.info("hibernate_refused", session=session.session_id, why=decode_reply(body).message)
        held, session.held = session.held, []
        for frame in held:  # calls that came meanwhile, now served as they would have been
            self._on_held(frame, now)

    def _on_held(self, frame: ClientFrame, now: float) -> None:
        try:
            self._forward(frame)
        except ProtocolError as exc:
            self._error(frame.route, frame.env.request_id, frame.env.session_id, exc.code, exc.message)

    def _hibernate(self, now: float, sweep: bool) -> None:
        """Free slabs for what waits in the queue, and hibernate sessions
        idle past `hibernate_after_s` (on a `sweep` tick): least recently used first."""
        sessions = self.registry.sessions.values()
        in_flight = sum(1 for s in sessions if s.hibernating)
        wanted = [p for p in self.admission.queue if self.registry.place(p.store) is None]
        if len(wanted) > in_flight and self.registry.workers:
            for session in self.registry.idle_live(wanted[0].store)[: len(wanted) - in_flight]:
                self._send_hibernate(session)
        limit = self.cfg.hibernate_after_s
        if sweep and limit and self.drain is None:
            for session in self.registry.idle_live():
                if now - session.last_active < limit:
                    break  # least recently used first: the rest are fresher
                self._send_hibernate(session)

    def _send_hibernate(self, session: Session) -> None:
        session.hibernating = True
        self._own_request(session.worker, Op.HIBERNATE, session.session_id, Hibernate())

    def _store_size(self, now: float) -> int:
        size, when = self._store_bytes
        if now - when >= STORE_BYTES_EVERY_S:
            size = sum(self.store.bytes_on_disk(session_id) for session_id in self.registry.sessions)
            self._store_bytes = (size, now)
        return size


def _unknown_head(session_id: str, worker: Worker) -> RecordHead:
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
