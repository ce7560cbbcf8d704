"""Durability and restore on the compute thread: a session's record written
after its work (a superseded placement's copy dropped: the request gets
worker_lost), the sessions a restart would replay snapshotted on the way
out, a session this worker does not hold restored from the store when a
request needs it live (or answered from its record when it does not), and
a slab freed with its record kept or deleted."""

from __future__ import annotations

import time

import mlx.core as mx

from kvmux import logs, tracing
from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op, ProtocolError
from kvmux.sessions import Fenced, SessionStore, StoreError, StoreFull, durable

from . import restore
from .engine import Engine, LiveSession
from .job import Job
from .slab import SlabPool

log = logs.get("worker.durability")
STORE_FULL = p.OverloadReason.STORE_FULL.value


class Durability:
    """The scheduler's sessions beyond its slabs (worker/scheduler.py's
    Scheduler is one: these read its state, and answer through its `send`)."""

    engine: Engine
    pool: SlabPool
    store: SessionStore
    sessions: dict[str, LiveSession]
    jobs: dict[str, Job]
    draining: bool

    def save(self, session: LiveSession, *, snapshot: bool = False) -> int:
        """Write the session's durable record: after this, a crash of this
        worker loses nothing the session has done. A copy whose placement
        was superseded (this worker was declared lost, the session placed
        again elsewhere) is dropped, and the request gets `worker_lost`.
        When the store has no room, the live copy is dropped too: the
        session stays as its record last stood (its next request restores
        it from there), and the request gets `overloaded` (store_full)."""
        try:
            return durable.save(self.store, session, self.engine.loaded.model_id, snapshot_now=snapshot)
        except StoreFull as exc:
            if session.session_id in self.sessions:
                self.drop(session)
            raise _no_room(session, exc) from None
        except Fenced as exc:
            log.warning("session_fenced", session=session.session_id, why=str(exc))
            stale = ProtocolError(
                ErrorCode.WORKER_LOST, f"this worker's copy of session {session.session_id} is stale: {exc}"
            )
            job = self.jobs.get(session.session_id)
            if job is not None:  # closes waiting on it: the session lives elsewhere now, its record is not ours
                for route, request_id, _ in job.close_after:
                    self.error(route, request_id, session.session_id, stale.code, stale.message)
                job.close_after.clear()
            if session.session_id in self.sessions:
                self.drop(session)
            raise stale from None

    def claim(self, session: LiveSession) -> int:
        """A new placement of the session in the store (its epoch)."""
        try:
            return self.store.claim(session.session_id)
        except StoreFull as exc:
            raise _no_room(session, exc) from None

    def save_all(self) -> None:
        """On the way out (a drain): snapshot what a restart would replay."""
        for session in list(self.sessions.values()):
            if session.replay:
                try:
                    self.save(session, snapshot=True)
                except (OSError, StoreError, ProtocolError) as exc:
                    log.error("session_save_failed", session=session.session_id, error=str(exc))

    def dormant(self, route: bytes, env: p.Envelope, body) -> LiveSession | None:
        """A request for a session this worker does not hold: restore it from
        the store when the request needs it live; None when answered here."""
        if env.op == Op.CREDIT:
            return None
        if env.op == Op.CANCEL:
            self.send(route, Op.FINAL, env.request_id, env.session_id, p.Ack())  # nothing runs on it here
            return None
        if env.op == Op.CLOSE:
            self.close_stored(route, env.request_id, env.session_id, body.keep)
            return None
        if env.op == Op.HIBERNATE:
            raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"session {env.session_id!r} is not live here")
        if env.op == Op.INFO:  # the broker's question about a record in our store it does not read
            record = durable.stored(self.store, env.session_id)
            slab_bytes = self.engine.slab_bytes(record.sink, record.window)
            idle_s = max(0.0, time.time() - record.updated)
            info = durable.hibernated_info(record, slab_bytes, idle_s, body)
            self.send(route, Op.FINAL, env.request_id, env.session_id, info)
            return None
        return self.restore(env.session_id, getattr(body, "traceparent", None))  # (APPEND's and GENERATE's)

    def restore(self, session_id: str, traceparent: str | None = None) -> LiveSession:
        """The session, from its record into a free slab (`traceparent`: the
        request that needs it, where that one is traced)."""
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "worker is draining", reason=p.OverloadReason.DRAINING.value)
        if not self.pool.take():
            raise ProtocolError(ErrorCode.OVERLOADED, "no free slab", reason=p.OverloadReason.NO_SLAB.value)
        started, began = time.perf_counter(), time.time_ns()
        try:
            session, replayed = restore.restore(self.store, self.engine, session_id)
        except StoreFull as exc:  # its new placement could not be written: it stays stored as it was
            self.pool.give_back()
            log.error("session_not_restored", session=session_id, why=str(exc))
            raise ProtocolError(
                ErrorCode.OVERLOADED, f"session {session_id} could not be restored: {exc}", reason=STORE_FULL
            ) from None
        except BaseException:
            self.pool.give_back()
            raise
        seconds = time.perf_counter() - started
        session.restores += 1
        session.last_restore_s = seconds
        self.sessions[session_id] = session
        log.info("session_restored", session=session_id, seconds=round(seconds, 4), replayed_tokens=replayed)
        tracing.record("kvmux.restore", traceparent, began, replayed_tokens=replayed)
        restored = p.Restored(session_id=session_id, seconds=seconds, replayed_tokens=replayed)
        self.send(b"", Op.RESTORED, 0, session_id, restored)
        return session

    def close(self, session: LiveSession, closes: list[tuple[bytes, int, bool]]) -> None:
        """Free the slab and, unless every close says `keep` (the broker's,
        when another worker holds the session), the stored record; answer
        each close (route, request id, keep)."""
        keep = all(k for _, _, k in closes)
        self.drop(session)
        if not keep:
            self.store.delete(session.session_id)
        log.info("session_closed", session=session.session_id, kept=keep)
        for route, request_id, _ in closes:
            self.send(route, Op.FINAL, request_id, session.session_id, p.Closed(session_id=session.session_id))

    def close_stored(self, route: bytes, request_id: int, session_id: str, keep: bool) -> None:
        """A close of a session that has no slab here: its record deleted
        (unless `keep`: another worker may hold it)."""
        if not self.store.exists(session_id):
            raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id!r}")
        if not keep:
            self.store.delete(session_id)
        self.send(route, Op.FINAL, request_id, session_id, p.Closed(session_id=session_id))

    def drop(self, session: LiveSession) -> None:
        """Forget a live session and free its slab (its record stays)."""
        self.jobs.pop(session.session_id, None)
        del self.sessions[session.session_id]
        self.pool.give_back()
        mx.clear_cache()


def _no_room(session: LiveSession, exc: StoreFull) -> ProtocolError:
    """The store had no room for the session: `overloaded` (store_full), said and logged with its owner."""
    log.error("session_not_stored", session=session.session_id, owner=session.owner, why=str(exc))
    return ProtocolError(
        ErrorCode.OVERLOADED,
        f"session {session.session_id} was not stored, and stays as it last was: {exc}",
        reason=STORE_FULL,
    )
