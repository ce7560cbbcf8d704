"""The broker: one poll loop over three ROUTER sockets.

Clients (DEALER) talk to the frontend, workers (DEALER) to the backend, and
the operator's tools to the admin endpoint (ipc in the private runtime dir),
where every op is allowed; on the frontend, ops that change the daemon need
an admin key (broker/auth.py), and with CURVE a session answers only the key
that opened it.
Requests for a session go to the worker holding its slab; replies go back
to the client route they came from. Sessions outlive every process: an idle
one is hibernated to the session store when its slab is needed (or after
`hibernate_after_s`), and restored on whichever worker sharing the store
gets it next; a lost worker's sessions hibernate; a vanished client's
generations are cancelled and its sessions stay resumable. Both ROUTERs are
ROUTER_MANDATORY, so a frame to a vanished peer raises instead of vanishing.
Sends never block (broker/outbox.py). Every client op has its handler in
`_handlers`; every `overloaded` answer goes through `Admission.refuse` and is
counted by reason."""

from __future__ import annotations

import itertools
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import zmq

from kvmux import logs, tracing
from kvmux.protocol import (
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    REPLY_OPS,
    Ack,
    Appended,
    BrokerStats,
    Cancel,
    Disconnect,
    Endpoint,
    Envelope,
    ErrorCode,
    Found,
    GenerateResult,
    Op,
    OverloadReason,
    Pong,
    ProtocolError,
    Refused,
    WorkerStats,
    decode_body,
    decode_envelope,
    decode_reply,
    encode,
    envelope,
    error_body,
)
from kvmux.sessions import StoreError, StoreUnavailable, open_store

from . import auth, endpoints
from .admission import Admission, Pending, Refusal, priority
from .client_frame import ClientFrame
from .config import BrokerConfig
from .heap import HeapTrimmer
from .lifecycle import Lifecycle
from .liveness import Liveness
from .metrics import Metrics
from .models import Models
from .openings import Openings
from .outbox import ADMIN, Outbox, Sent
from .registry import Registry, Request, SessionEntry, State, WorkerEntry

log = logs.get("broker")

_BATCH = 256  # frames read from one socket per loop turn, so neither starves
_POLL_MS = 50
_POLL_BACKLOG_MS = 5  # while some client's backlog waits to be flushed
_SWEEP_S = 1.0  # how often expiry and idle hibernation look at every session
LEASE_S = 10.0  # the store lease's life: renewed every sweep; a broker that dies frees it this much later
_EMPTY_MAP = encode({})
_STREAMING = (Op.APPEND, Op.GENERATE)
KEY_DIRS = frozenset({"client_keys", "worker_keys", "admin_keys"})  # with CURVE on: reloadable
# What SIGHUP changes in a running daemon: the rest needs a restart.
RELOADABLE = KEY_DIRS | {
    "admission",
    "queue_depth",
    "queue_wait_s",
    "priority_aging_s",
    "client_quota",
    "idle_timeout_s",
    "hibernate_after_s",
    "max_sessions",
    "max_store_bytes",
    "session_ttl_s",
    "worker_wait_s",
    "allow_session_override",
    "retry_after_s",
    "drain_grace_s",
}


Handler = Callable[["Broker", ClientFrame], None]


class StoreRefused(StoreError):
    """This broker may not serve the session store: another one holds its lease."""


@dataclass
class _Drain:
    grace_until: float
    cancel_until: float | None = None  # cancels sent; the streams' ends awaited until then
    force: bool = False


class Broker:
    def __init__(self, cfg: BrokerConfig, on_tick: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.on_tick = on_tick  # watching local worker processes: False = give up
        self.reload_from: Callable[[], BrokerConfig] = lambda: cfg  # the config SIGHUP reads again (`kvmux serve`'s)
        self._reload_request = False  # set from a signal handler
        self.exit_code = 0
        # First the store and its lease: a broker that may not serve it
        # (unreachable, or another broker's) stops before it binds anything.
        self.store = open_store(cfg.store, cfg.state_dir)
        self.lease_holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._take_lease()
        self.heap = HeapTrimmer()  # first: its malloc setting is in place before libzmq's threads allocate
        self.ctx = zmq.Context.instance()
        self.auth = auth.Auth(cfg.curve_secret, cfg.client_keys, cfg.worker_keys, cfg.admin_keys) if cfg.curve else None
        if self.auth is not None:
            self.auth.start(self.ctx)  # before any CURVE socket binds
        self.frontend = self._router(cfg.frontend_hwm, max_msg=4 * cfg.max_frame_bytes)
        self.backend = self._router(cfg.backend_hwm)
        self.admin = self._router(cfg.frontend_hwm, max_msg=4 * cfg.max_frame_bytes)
        self.curve_frontend = self.auth is not None and cfg.frontend.startswith("tcp://")
        if self.curve_frontend:
            self.auth.secure(self.frontend, auth.FRONTEND)
        if self.auth is not None and cfg.backend.startswith("tcp://"):
            self.auth.secure(self.backend, auth.BACKEND)
        # A worker re-registering reconnects under the same routing id: let
        # the new connection take it over from the dead one.
        self.backend.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.models = Models(cfg)  # its local workers' models, the default first, and which are resident
        self.registry = Registry()
        self.admission = Admission(cfg)
        self.openings = Openings()
        self.outbox = Outbox(
            self.frontend, self.admin, self.backend, cfg.client_backlog, self._client_gone, self._overrun
        )
        self.liveness = Liveness(cfg.client_liveness_s)
        self.started = time.monotonic()
        self.frames_forwarded = 0
        self.drain: _Drain | None = None
        self.store_error = ""  # the store's last failure (its lease not renewed), for stats and /ready
        self._drain_request: float | None = None  # set from a signal handler
        self._own_ids = itertools.count(1)
        self._next_heartbeat = self._next_sweep = 0.0
        self._last_tick = 0.0  # when the loop last ran its timers (run() starts it)
        self.frontend_endpoint = self.backend_endpoint = self.admin_endpoint = ""
        self.endpoints: list[Endpoint] = []  # each with who can reach it, for stats and `kvmux doctor`
        self.metrics = Metrics()  # counted always; served with --metrics-port
        self.lifecycle = Lifecycle(cfg, self.registry, self.admission, self.store, self, self.metrics)
        self.lifecycle.load(time.monotonic())

    def _router(self, hwm: int, max_msg: int = -1) -> zmq.Socket:
        # Options before bind: set later they do not apply to accepted peers.
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)  # far past max_frame_bytes: cut the peer off
        sock.setsockopt(zmq.LINGER, 1000)
        # No ZMQ_HEARTBEAT_IVL: libzmq aborts with it under a flood (broker/liveness.py).
        return sock

    def bind(self) -> None:
        cfg = self.cfg
        for endpoint in (cfg.frontend, cfg.backend, cfg.admin_endpoint):
            endpoints.prepare(endpoint)
        self.frontend.bind(cfg.frontend)
        self.backend.bind(cfg.backend)
        self.admin.bind(cfg.admin_endpoint)
        endpoints.restrict(cfg.admin_endpoint)
        self.frontend_endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.admin_endpoint = self.admin.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints = [
            Endpoint(name, endpoint, endpoints.protection(endpoint, curve=curve), curve)
            for name, endpoint, curve in (
                ("frontend", self.frontend_endpoint, bool(self.frontend.curve_server)),
                ("backend", self.backend_endpoint, bool(self.backend.curve_server)),
                ("admin", self.admin_endpoint, False),
            )
        ]
        log.info(
            "listening", **{e.name: f"{e.endpoint} ({e.protection})" for e in self.endpoints}, admission=cfg.admission
        )

    def close(self) -> None:
        try:
            self.store.release(self.lease_holder)
        except StoreError as exc:
            log.warning("store_lease_not_released", why=str(exc))
        for sock in (self.frontend, self.backend, self.admin):
            sock.close()
        for endpoint in (self.frontend_endpoint, self.backend_endpoint, self.admin_endpoint):
            endpoints.remove(endpoint)
        if self.auth is not None:
            self.auth.stop()

    # ------------------------------------------------------------ the loop

    def request_drain(self, grace_s: float | None = None) -> None:
        """Ask the loop to drain (safe to call from a signal handler); asked
        again while draining, stop waiting for the grace period."""
        if self._drain_request is not None or self.drain is not None:
            if self.drain is not None:
                self.drain.force = True
            return
        self._drain_request = self.cfg.drain_grace_s if grace_s is None else grace_s

    def request_reload(self) -> None:
        """Ask the loop to read its config again (safe to call from a signal handler)."""
        self._reload_request = True

    def _reload(self) -> None:
        """SIGHUP: what can change while the daemon runs (admission and the
        session store's limits, the key directories) takes the config's new
        values, logged; a change to anything else is logged as needing a
        restart and not made; a config that does not load changes nothing."""
        try:
            new = self.reload_from()
        except ValueError as exc:  # ConfigError: the file's problem, named
            log.error("reload_refused", why=str(exc))
            return
        changed = {
            name: [getattr(self.cfg, name), getattr(new, name)]
            for name in self.cfg.__struct_fields__
            if getattr(self.cfg, name) != getattr(new, name)
        }
        later = sorted(name for name in changed if name not in RELOADABLE or (name in KEY_DIRS and not self.auth))
        now = {name: values for name, values in changed.items() if name not in later}
        for name, (_, value) in now.items():
            setattr(self.cfg, name, value)
        if self.auth is not None and KEY_DIRS & now.keys():
            self.auth.use_keys(self.cfg.client_keys, self.cfg.worker_keys, self.cfg.admin_keys)
        log.info("reloaded", changed=now)
        if later:
            log.warning("reload_needs_restart", settings=later, why="these change only when the daemon starts")

    def run(self) -> int:
        poller = zmq.Poller()
        for sock in (self.frontend, self.backend, self.admin):
            poller.register(sock, zmq.POLLIN)
        self._last_tick = time.monotonic()  # a slow start (a large store loaded) is no stall
        while True:
            events = dict(poller.poll(_POLL_BACKLOG_MS if self.outbox.backlog else _POLL_MS))
            if not events:
                self.heap.quiet()
            if self._drain_request is not None:  # a signal came during the poll: before any frame
                self._start_drain(self._drain_request, time.monotonic())
                self._drain_request = None
            if self._reload_request:
                self._reload_request = False
                self._reload()
            if self.backend in events:
                self._read(self.backend, self._on_worker_frames)
            if self.frontend in events:
                self._read(self.frontend, self._on_frontend_frames, copy=not self.curve_frontend)
            if self.admin in events:
                self._read(self.admin, self._on_admin_frames)
            if self._tick(time.monotonic()):
                break
        self.outbox.flush()
        return self.exit_code

    def _read(self, sock: zmq.Socket, handle: Callable[[list, float], None], copy: bool = True) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            self.heap.frames += 1
            try:
                handle(frames, time.monotonic())
            except Exception:  # one bad frame must never stop the loop
                log.exception("frame_handling_failed", parts=len(frames))

    def _discount_own_stall(self, now: float) -> None:
        """Time the broker spent away from its sockets (an fsync behind a
        disk's writeback, a paused VM) is not a worker's silence: its
        heartbeats waited in the socket meanwhile, unread. Beyond a
        heartbeat interval between two ticks, the excess is credited to
        every worker's last frame; a worker dead meanwhile is found a
        deadline of listening later."""
        away = now - self._last_tick - self.cfg.heartbeat_s
        self._last_tick = now
        if away <= 0:
            return
        log.warning("broker_stalled", seconds=round(away + self.cfg.heartbeat_s, 1))
        for worker in self.registry.workers.values():
            worker.last_seen = min(now, worker.last_seen + away)

    def _tick(self, now: float) -> bool:
        """Timers: heartbeats, liveness, queue deadlines, expiry, admission
        from the queue, hibernation, drain. True when the broker is done."""
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.cfg.heartbeat_s
            for worker in list(self.registry.workers.values()):
                self.to_worker(worker, b"", envelope(Op.HEARTBEAT), _EMPTY_MAP)
            self._probe_quiet_clients(now)
        self._discount_own_stall(now)
        deadline = self.cfg.heartbeat_s * self.cfg.heartbeat_liveness
        for worker in list(self.registry.workers.values()):
            if now - worker.last_seen > deadline:
                self._lose_worker(worker, f"silent for {now - worker.last_seen:.1f}s")
        for pending in self.admission.timed_out(now):
            if any(w.runs(pending.model) for w in self.registry.workers.values()):
                why = f"no slab freed within {pending.deadline - pending.enqueued:g}s"
                self._refuse(pending.route, pending.request_id, OverloadReason.QUEUE_TIMEOUT, why, pending.session_id)
            else:
                of = f" of {pending.model}" if pending.model else ""
                why = f"no worker{of} registered within {pending.deadline - pending.enqueued:g}s"
                self._refuse(pending.route, pending.request_id, OverloadReason.NO_WORKER, why, pending.session_id)
        sweep = now >= self._next_sweep  # scans of every session: once a second, not every tick
        if sweep:
            self._next_sweep = now + _SWEEP_S
            if not self._renew_lease():
                self.exit_code = 1
                return True
            self.lifecycle.keep_budget()
            self.models.sweep(now, self.registry, self.admission)
        for session in self.admission.idle(self.registry, now) if sweep else ():
            self.admission.expired += 1
            self.metrics.expired.labels("idle").inc()
            log.info("session_expired", session=session.session_id, idle_s=round(now - session.last_active, 1))
            self.lifecycle.end(session, ErrorCode.SESSION_EXPIRED)
        while (admitted := self.admission.next_admitted(self.registry, now)) is not None:
            self.metrics.queue_wait.observe(now - admitted[0].enqueued)
            self._admit(*admitted, queued=True)
        self.lifecycle.hibernate(now, sweep, self.drain is not None)
        self.metrics.publish(lambda: self.stats(now))
        self.outbox.flush()
        if self.auth is not None and not self.auth.alive():
            log.error("zap_handler_died")  # libzmq refuses every CURVE peer now: let the service manager restart us
            self.exit_code = 1
            return True
        if self.on_tick is not None and not self.on_tick():
            self.exit_code = 1  # the local workers keep crashing: let the service manager see it
            return True
        return self.drain is not None and self._drain_step(now)

    def _take_lease(self) -> None:
        """The store's lease, waited for while a broker that died may still
        hold it (up to LEASE_S); refused while a live one renews it."""
        deadline = time.monotonic() + LEASE_S + 1.0
        while (holder := self.store.lease(self.lease_holder, LEASE_S)) != self.lease_holder:
            if time.monotonic() > deadline:
                raise StoreRefused(f"another broker serves the session store {self.store.store_id}: {holder}")
            log.info("store_lease_waiting", store=self.store.store_id, holder=holder)
            time.sleep(0.5)

    def _renew_lease(self) -> bool:
        """Keep the store's lease; False once another broker holds it (this
        one was cut off long enough for the lease to lapse)."""
        try:
            holder = self.store.lease(self.lease_holder, LEASE_S)
        except StoreUnavailable as exc:
            log.warning("store_unavailable", why=str(exc))
            self.store_error = str(exc)
            return True
        self.store_error = ""
        if holder != self.lease_holder:
            log.error("store_lease_lost", store=self.store.store_id, holder=holder)
            return False
        return True

    # ------------------------------------------------------------- clients

    def _on_frontend_frames(self, frames: list, now: float) -> None:
        key = ""
        if self.curve_frontend:  # zmq.Frame parts: the ZAP handler's User-Id is the client's public key
            key = _user_id(frames[-1])
            frames = [f.bytes for f in frames]
        admin = bool(key) and self.auth.is_admin(key)
        self._on_client_frames(frames, now, key, admin)

    def _on_admin_frames(self, frames: list[bytes], now: float) -> None:
        frames[0] = ADMIN + frames[0]
        self._on_client_frames(frames, now, "", admin=True)

    def _on_client_frames(self, frames: list[bytes], now: float, key: str, admin: bool) -> None:
        route = frames[0]
        if len(frames) != 3:
            request_id, session_id = _salvage_ids(frames[1] if len(frames) > 1 else b"")
            why = f"expected [envelope, body], got {len(frames) - 1} parts"
            return self.error(route, request_id, session_id, ErrorCode.MALFORMED_FRAME, why)
        env_raw, body = frames[1], frames[2]
        if len(env_raw) + len(body) > self.cfg.max_frame_bytes:
            request_id, session_id = _salvage_ids(env_raw)
            why = f"frame of {len(env_raw) + len(body)} bytes exceeds {self.cfg.max_frame_bytes}"
            return self.error(route, request_id, session_id, ErrorCode.FRAME_TOO_LARGE, why)
        try:
            env = decode_envelope(env_raw)
        except ProtocolError as exc:
            request_id, session_id = _salvage_ids(env_raw)
            return self.error(route, request_id, session_id, exc.code, exc.message)
        handler = self._handlers.get(env.op)
        if handler is None:
            return self.error(route, env.request_id, env.session_id, ErrorCode.UNKNOWN_OP, f"unknown op {env.op!r}")
        try:
            handler(self, ClientFrame(route, env, env_raw, body, now, key, admin))
        except ProtocolError as exc:
            self.error(route, env.request_id, env.session_id, exc.code, exc.message)

    def _open(self, frame: ClientFrame) -> None:
        request = decode_body(Op.OPEN, frame.body)
        route, request_id = frame.route, frame.env.request_id
        self.check_unique(route, request_id)
        if self.drain is not None:
            return self._refuse(route, request_id, OverloadReason.DRAINING, "the broker is draining")
        # The owner decides quota and (with CURVE) who may use the session;
        # the worker keeps it in the session's record.
        owner = frame.key or request.client_name or route.hex()
        body = encode(msgspec.structs.replace(request, client_name=owner))
        pending = Pending(route, request_id, body, owner, frame.now, frame.now, priority=priority(request.sampling))
        pending.traceparent = request.traceparent
        pending.model = self.models.resolve(request.model, self.registry)
        if request.fork is not None:  # on a worker that reads its session's record, its own when it has a slab
            source = self.registry.sessions.get(request.fork.session_id)
            if source is None or source.ending is not None or not frame.owns(source):
                raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {request.fork.session_id} to fork")
            if request.model is not None and pending.model != source.model:
                why = f"session {source.session_id} runs {source.model}: its fork cannot run {pending.model}"
                raise ProtocolError(ErrorCode.INVALID_ARGUMENT, why)
            pending.store, pending.prefer, pending.model = source.store, source.worker, source.model
        else:  # beside the sessions that opened as it does: the worker holds that opening's prefix
            pending.opening = self.openings.key(request, pending.model)
            peers = [w for w in self.registry.workers.values() if w.runs(pending.model)]
            pending.prefer = self.openings.worker(pending.opening, peers)
        self.place(pending, request, frame.now)

    def place(self, pending: Pending, request, now: float) -> None:
        """An OPEN, or a call on a hibernated session: onto a worker's free
        slab now, into the queue (a slab frees soon), or refused."""
        self.models.want(pending.model, now, self.registry, self.admission)  # loaded on demand
        starting = self.models.starting(pending.model)  # the daemon's own workers of it will register
        decision = self.admission.decide(self.registry, pending, request, now, workers_starting=starting)
        if isinstance(decision, Refusal):
            self._send_refusal(pending.route, pending.request_id, decision, pending.session_id)
        elif isinstance(decision, WorkerEntry):
            self._admit(pending, decision)
        else:
            log.debug("queued", request_id=pending.request_id, depth=len(self.admission.queue))

    def _admit(self, pending: Pending, worker: WorkerEntry, queued: bool = False) -> None:
        self._trace_admission(pending, worker, queued)
        self.models.touch(worker.ready.model, time.monotonic())
        if pending.is_open:
            session_id = uuid.uuid4().hex
            self.admission.admitted += 1
            self.openings.placed(pending.opening, worker)
            req = self.registry.track(pending.route, pending.request_id, Op.OPEN, worker, session_id, pending.owner)
            req.priority = pending.priority
            self.to_worker(worker, pending.route, envelope(Op.OPEN, pending.request_id, session_id), pending.body)
            return
        session = self.registry.sessions.get(pending.session_id)
        if session is None or session.ending is not None:
            why = f"session {pending.session_id} was closed while it waited for a slab"
            return self.error(pending.route, pending.request_id, pending.session_id, ErrorCode.SESSION_NOT_FOUND, why)
        if session.worker is None:
            self.registry.place_session(session, worker)
        env = decode_envelope(pending.env_raw)
        req = self.registry.track(pending.route, pending.request_id, env.op, session.worker, session.session_id)
        req.started = pending.enqueued
        self.to_worker(session.worker, pending.route, pending.env_raw, pending.body)

    def _trace_admission(self, pending: Pending, worker: WorkerEntry, queued: bool) -> None:
        """Its request's admission spans, where it is traced: from its arrival
        to its placement (its wait in the queue, when it waited there)."""
        if not (pending.traceparent and tracing.enabled()):
            return
        arrived = tracing.wall_ns(pending.enqueued)
        op = "open" if pending.is_open else decode_envelope(pending.env_raw).op
        tracing.record("kvmux.admission", pending.traceparent, arrived, op=op, queued=queued)
        if queued:
            tracing.record("kvmux.queue_wait", pending.traceparent, arrived, priority=pending.priority)
        session = self.registry.sessions.get(pending.session_id)
        restore = session is not None and session.worker is None  # placed now, restored by the worker
        tracing.record("kvmux.placement", pending.traceparent, time.time_ns(), worker=worker.worker_id, restore=restore)

    def forward(self, frame: ClientFrame) -> None:
        """APPEND, GENERATE, INFO, CLOSE, CREDIT, REWIND, MARK: to the worker holding the
        session's slab, untouched; for a hibernated session see Lifecycle.dormant."""
        env = frame.env
        session = self._session(frame)
        if self.drain is not None and env.op in _STREAMING:
            return self._refuse(
                frame.route, env.request_id, OverloadReason.DRAINING, "the broker is draining", env.session_id
            )
        session.last_active = frame.now
        session.route = frame.route
        self.models.touch(session.model, frame.now)
        if session.state is State.HIBERNATING:  # it is on its way to the store: this waits for the answer
            session.held.append(frame)
            return
        if session.worker is not None and session.worker.draining and env.op in _STREAMING:
            session.held.append(frame)  # its worker exits (an unload): restored where its model runs next
            return
        if session.worker is None:
            return self.lifecycle.dormant(frame, session)
        if env.op != Op.CREDIT:  # CREDIT has no reply of its own: nothing to track
            self.check_unique(frame.route, env.request_id)
            req = self.registry.track(frame.route, env.request_id, env.op, session.worker, session.session_id)
            req.started = frame.now
            if env.op in _STREAMING and (traceparent := tracing.of(frame.body)):
                worker = session.worker.worker_id
                tracing.record("kvmux.admission", traceparent, tracing.wall_ns(frame.now), op=env.op, worker=worker)
        self.to_worker(session.worker, frame.route, frame.env_raw, frame.body)

    def _cancel(self, frame: ClientFrame) -> None:
        """CANCEL naming a queued or opening OPEN is the broker's; any other
        goes to the session's worker."""
        route, env = frame.route, frame.env
        target = decode_body(Op.CANCEL, frame.body).request_id
        if target is not None:
            queued = self.admission.remove(route, target)
            opening = self.registry.requests.get((route, target))
            if queued:
                self.error(route, target, "", ErrorCode.CANCELLED, "open cancelled while queued")
                return self.reply(route, env, Ack())
            if opening is not None and opening.op == Op.OPEN:
                opening.cancel_on_open = True
                return self.reply(route, env, Ack())
        if not env.session_id:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, f"nothing to cancel: request {target} is not a queued or opening session"
            )
        self.forward(frame)

    def _stats(self, frame: ClientFrame) -> None:
        decode_body(Op.STATS, frame.body)
        self.reply(frame.route, frame.env, self.stats(frame.now))

    def _heartbeat(self, frame: ClientFrame) -> None:
        """A client's heartbeat: its answer to ours, or its first frame
        (saying it answers them). Never answered."""
        if frame.body != _EMPTY_MAP:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, "a heartbeat's body is an empty map")
        self.liveness.heard(frame.route)

    def _ping(self, frame: ClientFrame) -> None:
        decode_body(Op.PING, frame.body)
        self.reply(frame.route, frame.env, Pong(time=time.time()))

    def _drain_op(self, frame: ClientFrame) -> None:
        if not frame.admin:
            raise ProtocolError(
                ErrorCode.FORBIDDEN, "drain is an admin op: use the admin endpoint (`kvmux drain`) or an admin key"
            )
        grace = decode_body(Op.DRAIN, frame.body).grace_s
        if grace is not None and grace < 0:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "grace_s must be >= 0")
        self.reply(frame.route, frame.env, Ack())
        self._start_drain(self.cfg.drain_grace_s if grace is None else grace, frame.now)

    def _resume(self, frame: ClientFrame) -> None:
        self.lifecycle.resume(frame, self._session(frame))

    def _list_sessions(self, frame: ClientFrame) -> None:
        self.lifecycle.list_sessions(frame)

    def _mark(self, frame: ClientFrame) -> None:
        """MARK goes to the session's worker (its record keeps the names);
        the broker learns the names on the way, for FIND."""
        session = self._session(frame)
        body = decode_body(Op.MARK, frame.body)
        self.forward(frame)
        self.registry.unname(session, body.drop)
        self.registry.name(session, body.marks)

    def _find(self, frame: ClientFrame) -> None:
        """The caller's session that has the first of the names one has."""
        for name in decode_body(Op.FIND, frame.body).names:
            session = self.registry.sessions.get(self.registry.names.get(name, ""))
            if session is not None and session.ending is None and frame.owns(session):
                return self.reply(frame.route, frame.env, Found(name=name, session_id=session.session_id))
        raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, "no session has any of these names")

    # Every client op, by the handler that serves it.
    _handlers: ClassVar[dict[str, Handler]] = {
        Op.OPEN: _open,
        Op.APPEND: forward,
        Op.GENERATE: forward,
        Op.CANCEL: _cancel,
        Op.CREDIT: forward,
        Op.INFO: forward,
        Op.CLOSE: forward,
        Op.STATS: _stats,
        Op.PING: _ping,
        Op.HEARTBEAT: _heartbeat,
        Op.DRAIN: _drain_op,
        Op.RESUME: _resume,
        Op.SESSIONS: _list_sessions,
        Op.REWIND: forward,
        Op.MARK: _mark,
        Op.FIND: _find,
    }

    def _session(self, frame: ClientFrame) -> SessionEntry:
        """The frame's session, if it exists and the caller may use it: to a
        key that does not own it, it does not exist (no oracle)."""
        session_id = frame.env.session_id
        if not session_id:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "this op needs a session id")
        session = self.registry.sessions.get(session_id)
        if session is not None and not frame.owns(session):
            session = None
        elif session is not None and session.ending is None:
            return session
        elif session is not None:
            raise ProtocolError(
                session.ending, f"session {session_id} is being closed by the broker ({session.ending.value})"
            )
        gone = self.registry.gone.get(session_id)
        if gone is None or (frame.key and not frame.admin and gone.owner != frame.key):
            raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {session_id}")
        raise ProtocolError(gone.code, gone.why)

    def check_unique(self, route: bytes, request_id: int) -> None:
        if (route, request_id) in self.registry.requests or self.admission.is_queued(route, request_id):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"request id {request_id} is already in flight")

    # ------------------------------------------------------------- workers

    def _on_worker_frames(self, frames: list[bytes], now: float) -> None:
        identity = frames[0]
        worker = self.registry.workers.get(identity)
        if worker is not None:
            worker.last_seen = now  # any frame counts as a heartbeat
        if len(frames) != 4:
            log.warning("malformed_worker_frame", worker=identity.hex(), parts=len(frames))
            return
        route, env_raw, body = frames[1:]
        try:
            env = decode_envelope(env_raw)
        except ProtocolError as exc:
            log.warning("bad_worker_envelope", worker=identity.hex(), error=exc.message)
            return
        try:
            self._on_worker_op(identity, worker, route, env, env_raw, body, now)
        except ProtocolError as exc:  # an unreadable body: one line, and the client waiting on it is told
            log.warning("bad_worker_frame", worker=identity.hex(), op=env.op, error=exc.message)
            req = self.registry.requests.get((route, env.request_id))
            if worker is not None and req is not None and req.worker is worker and env.op != Op.PARTIAL:
                self.registry.finish(req)
                if route and not req.orphaned:
                    why = f"worker {worker.worker_id} sent an unreadable reply: {exc.message}"
                    self.error(route, req.request_id, req.session_id, ErrorCode.INTERNAL, why)

    def _on_worker_op(
        self,
        identity: bytes,
        worker: WorkerEntry | None,
        route: bytes,
        env: Envelope,
        env_raw: bytes,
        body: bytes,
        now: float,
    ) -> None:
        if env.op == Op.READY:
            return self._on_ready(identity, worker, body, now)
        if worker is None:
            # Not registered (or forgotten as dead): make it register again.
            log.info("unknown_worker_reregister", worker=identity.hex(), op=env.op)
            self.outbox.to_worker(identity, b"", envelope(Op.DISCONNECT), encode(Disconnect(reason="not registered")))
            return
        if env.op == Op.HEARTBEAT:
            beat = decode_body(Op.HEARTBEAT, body)
            # A worker drains only on its way out: a heartbeat sent before
            # it saw the broker's SIGTERM does not undo the broker's mark.
            worker.running, worker.draining = beat.running, worker.draining or beat.draining
            worker.drafted, worker.accepted, worker.link_bytes = beat.drafted, beat.accepted, beat.link_bytes
            worker.kv_bytes = beat.kv_bytes
            worker.prefixes = beat.prefixes
        elif env.op == Op.DISCONNECT:
            self._lose_worker(worker, f"disconnected: {decode_body(Op.DISCONNECT, body).reason or 'clean exit'}")
        elif env.op == Op.RESTORED:
            self.lifecycle.restored(decode_body(Op.RESTORED, body), worker)
        elif env.op in REPLY_OPS:
            self._on_reply(worker, route, env, env_raw, body, now)
        else:
            log.warning("unexpected_worker_op", worker=worker.worker_id, op=env.op)

    def _on_ready(self, identity: bytes, known: WorkerEntry | None, body: bytes, now: float) -> None:
        ready = decode_body(Op.READY, body)
        if known is not None:  # it registers anew: what it still holds, its READY says
            self._lose_worker(known, "re-registered", returning=True)
        if ready.version != PROTOCOL_VERSION:
            log.error("worker_version_mismatch", worker=identity.hex(), version=ready.version)
            return
        if not 0 <= ready.free_slabs <= ready.slabs or ready.slab_bytes < 0 or len(ready.sessions) > ready.slabs:
            log.warning("bad_worker_ready", worker=identity.hex(), slabs=ready.slabs, free=ready.free_slabs)
            return
        worker = self.registry.add_worker(identity, ready, now)
        self.models.registered(ready.model, now)
        # A send below may find it unreachable (it left after its READY): then
        # it is lost, and holds nothing more of ours.
        for session_id in ready.sessions:
            if self.registry.holds(worker):
                self.lifecycle.adopt(worker, session_id, now)
        for head in ready.stored:
            if self.registry.holds(worker):
                self.lifecycle.adopt_stored(worker, head, now)
        self.lifecycle.clean_stranded(worker)
        log.info(
            "worker_ready",
            worker=worker.worker_id,
            model=ready.model,
            slabs=ready.slabs,
            free=ready.free_slabs,
            host=ready.host,
            pid=ready.pid,
        )

    def _on_reply(
        self, worker: WorkerEntry, route: bytes, env: Envelope, env_raw: bytes, body: bytes, now: float
    ) -> None:
        self.models.touch(worker.ready.model, now)  # idle counts from its last reply
        req = self.registry.requests.get((route, env.request_id))
        if req is None or req.worker is not worker:
            # A late reply to a request already failed (its worker was lost
            # and came back), or CREDIT's: pass it on, nothing to account.
            if route:
                self._to_client(route, [env_raw, body])
            return
        final = env.op != Op.PARTIAL
        if final:
            self.registry.finish(req)
        if req.route:
            self._measure(req, env.op, body, now)
        session = self.registry.sessions.get(req.session_id)
        if session is not None:
            session.last_active = now
        if session is not None and session.state is State.RESTORING:
            self.lifecycle.first_answer(session, env.op, body)
        if req.op == Op.OPEN and final:
            env_raw, body = self._opened(req, env.op == Op.FINAL, env_raw, body, now)
        elif req.op == Op.CLOSE and final:
            self.lifecycle.closed(req, env.op, body)
        elif req.op == Op.HIBERNATE and final:
            self.lifecycle.hibernated(req, env.op, body)
        if route and not req.orphaned:
            if req.overrun:
                if not final:
                    req.dropped += 1
                    return
                env_raw = envelope(Op.ERROR, req.request_id, req.session_id)
                body = error_body(
                    ErrorCode.CANCELLED,
                    f"stream cancelled: the client fell {self.cfg.client_backlog} frames behind ({req.dropped} chunks not sent); read faster or use Generate.credit",
                )
            self._to_client(route, [env_raw, body])
            req.last_sent = now
            worker.frames_forwarded += 1
            self.frames_forwarded += 1

    def _measure(self, req: Request, op: str, body: bytes, now: float) -> None:
        """A client request's reply, for the metrics: a generate's tokens and
        their timing, every request's outcome."""
        model = req.worker.ready.model
        if op == Op.PARTIAL:
            if req.op == Op.GENERATE:
                if req.last_token:
                    self.metrics.itl.labels(model).observe(now - req.last_token)
                else:
                    self.metrics.ttft.labels(model).observe(now - req.started)
                req.last_token = now
            return
        reply = decode_reply(body)
        self.metrics.requests.labels(req.op, "ok" if op == Op.FINAL else str(reply.code)).inc()
        labels = (req.worker.worker_id, model)
        if isinstance(reply, GenerateResult):
            self.metrics.prefilled.labels(*labels).inc(reply.prompt_tokens)
            self.metrics.generated.labels(*labels).inc(reply.completion_tokens)
            self.metrics.cached.labels(*labels, "session").inc(reply.reused_tokens)
            self.metrics.cached.labels(*labels, "prefix").inc(reply.cached_tokens)
        elif isinstance(reply, Appended):
            self.metrics.prefilled.labels(*labels).inc(reply.new_tokens - reply.cached_tokens)
            self.metrics.cached.labels(*labels, "prefix").inc(reply.cached_tokens)

    def _opened(self, req: Request, ok: bool, env_raw: bytes, body: bytes, now: float) -> tuple[bytes, bytes]:
        if not ok:
            return env_raw, body
        opened = decode_reply(body)
        session = self.registry.add_session(req.session_id, req.worker, req.route, req.owner, now, opened)
        session.opened_at, session.priority = time.time(), req.priority
        if req.orphaned:
            self.lifecycle.end(session, ErrorCode.SESSION_NOT_FOUND)
        elif req.cancel_on_open:
            self.lifecycle.end(session, ErrorCode.SESSION_NOT_FOUND)
            return envelope(Op.ERROR, req.request_id, req.session_id), error_body(
                ErrorCode.CANCELLED, "open cancelled; the session was closed"
            )
        return env_raw, body

    def _lose_worker(self, worker: WorkerEntry, why: str, returning: bool = False) -> None:
        """Forget a worker. Its sessions hibernate where another process
        reads its store (ours, another worker's, or its own when it is
        `returning`: registering anew); otherwise they are lost with it and
        their records, on its host, deleted when it comes back."""
        if not self.registry.holds(worker):
            return
        store = worker.ready.store
        shared = store == self.store.store_id or any(
            w is not worker and w.ready.store == store for w in self.registry.workers.values()
        )
        sessions = [self.registry.sessions[s] for s in worker.sessions]
        if not (shared or returning):
            self.lifecycle.strand(store, [s.session_id for s in self.registry.sessions.values() if s.store == store])
        lost = self.registry.remove_worker(worker, why, stored=shared or returning)
        self.metrics.workers_lost.labels(worker.ready.model).inc()
        log.warning("worker_lost", worker=worker.worker_id, why=why, requests=len(lost), sessions=len(sessions))
        self._tell_lost(worker, lost, why)
        for session in sessions:
            self.lifecycle.release(session)

    def _tell_lost(self, worker: WorkerEntry, failed: list[Request], why: str) -> None:
        for req in failed:
            if req.route and not req.orphaned:
                self.error(
                    req.route,
                    req.request_id,
                    req.session_id,
                    ErrorCode.WORKER_LOST,
                    f"worker {worker.worker_id} lost ({why})",
                )

    # ------------------------------------------------- the broker's requests

    def own_request(self, worker: WorkerEntry, op: str, session_id: str, body) -> None:
        request_id = next(self._own_ids)
        self.registry.track(b"", request_id, op, worker, session_id)
        self.to_worker(worker, b"", envelope(op, request_id, session_id), encode(body))

    def _client_gone(self, route: bytes) -> None:
        """ROUTER_MANDATORY said the client vanished: cancel its running
        generations and drop its queued requests and backlog. Its sessions
        stay, resumable by id (an idle one pins no slab: it hibernates when
        the slab is needed)."""
        self.liveness.forget(route)
        dropped = self.admission.remove(route)
        cancelled = 0
        for req in [r for r in self.registry.requests.values() if r.route == route and not r.orphaned]:
            req.orphaned = True
            if req.op in _STREAMING and req.session_id in self.registry.sessions:
                self.own_request(req.worker, Op.CANCEL, req.session_id, Cancel(request_id=req.request_id))
                cancelled += 1
        log.info("client_gone", client=route.hex(), cancelled=cancelled, queued=len(dropped))

    def _probe_quiet_clients(self, now: float) -> None:
        """A vanished client is found when a frame to it fails. One whose
        requests send it nothing (a stream paused on its credit, a long
        prefill, a queued open) would never be found, and its stream would
        hold the session and its slab for good: a heartbeat to each such
        client, every interval, finds it; one that answers heartbeats and
        leaves them unanswered is gone too (broker/liveness.py)."""
        quiet_for = self.cfg.heartbeat_s
        routes = {
            r.route
            for r in self.registry.requests.values()
            if r.route and not r.orphaned and now - max(r.started, r.last_sent) >= quiet_for
        }
        routes.update(q.route for q in self.admission.queue if now - q.enqueued >= quiet_for)
        silent = self.liveness.asking(routes, now)
        for route in silent:  # its connection open, nobody behind it (broker/liveness.py)
            log.info("client_silent", client=route.hex(), seconds=self.cfg.client_liveness_s)
            self.outbox.forget(route)
            self._client_gone(route)
        for route in routes.difference(silent):
            self.outbox.probe(route, [envelope(Op.HEARTBEAT), _EMPTY_MAP])

    # --------------------------------------------------------------- sends

    def to_worker(self, worker: WorkerEntry, route: bytes, env_raw: bytes, body: bytes) -> None:
        if not self.registry.holds(worker):
            # Forgotten while this was on its way to it (lost as it
            # registered, say): nothing goes to it, and the request fails
            # as its others did, rather than wait on it for ever.
            return self._tell_lost(worker, self.registry.fail_requests(worker), "gone")
        sent = self.outbox.to_worker(worker.identity, route, env_raw, body)
        if sent is Sent.UNREACHABLE:
            self._lose_worker(worker, "unreachable")
        elif sent is Sent.FULL:
            # Its pipe holds backend_hwm frames: it is not reading; heartbeats
            # will tell if it is dead. This request cannot be sent.
            env = decode_envelope(env_raw)
            req = self.registry.requests.get((route, env.request_id))
            if req is not None:
                self.registry.finish(req)
            if route:
                why = f"worker {worker.worker_id} is not reading its socket"
                self._refuse(route, env.request_id, OverloadReason.WORKER_STALLED, why, env.session_id)
        elif route:
            worker.frames_forwarded += 1
            self.frames_forwarded += 1

    def _to_client(self, route: bytes, parts: list[bytes]) -> None:
        self.outbox.to_client(route, parts)

    def _overrun(self, route: bytes) -> None:
        """A client this far behind: cancel its streams rather than buffer on."""
        for req in list(self.registry.requests.values()):
            if req.route == route and req.op == Op.GENERATE and not (req.overrun or req.orphaned):
                req.overrun = True
                log.warning("client_too_slow", client=route.hex(), request_id=req.request_id)
                self.own_request(req.worker, Op.CANCEL, req.session_id, Cancel())

    def reply(self, route: bytes, env: Envelope, body: msgspec.Struct) -> None:
        self._to_client(route, [envelope(Op.FINAL, env.request_id, env.session_id), encode(body)])

    def error(self, route: bytes, request_id: int, session_id: str, code: ErrorCode, message: str, **extra) -> None:
        if code is not ErrorCode.OVERLOADED:  # those are refusals, counted by reason
            log.info("error_reply", code=code.value, message=message, request_id=request_id)
            self.metrics.errors.labels(code.value).inc()
        self._to_client(route, [envelope(Op.ERROR, request_id, session_id), error_body(code, message, **extra)])

    def _refuse(
        self, route: bytes, request_id: int, reason: OverloadReason, message: str, session_id: str = ""
    ) -> None:
        """Answer `overloaded` (counted in stats by reason)."""
        self._send_refusal(route, request_id, self.admission.refuse(reason, message), session_id)

    def _send_refusal(self, route: bytes, request_id: int, refusal: Refusal, session_id: str = "") -> None:
        self.error(
            route,
            request_id,
            session_id,
            ErrorCode.OVERLOADED,
            refusal.message,
            reason=refusal.reason.value,
            retry_after_s=refusal.retry_after_s,
            queue_depth=len(self.admission.queue),
        )

    # ---------------------------------------------------------------- drain

    def _start_drain(self, grace_s: float, now: float) -> None:
        if self.drain is not None:
            return
        self.drain = _Drain(grace_until=now + grace_s)
        running = sum(1 for r in self.registry.requests.values() if r.route and r.op in _STREAMING)
        log.info(
            "draining",
            grace_s=grace_s,
            running=running,
            sessions=len(self.registry.sessions),
            queued=len(self.admission.queue),
        )
        for pending in self.admission.flush():
            self._refuse(pending.route, pending.request_id, OverloadReason.DRAINING, "the broker is draining")

    def _drain_step(self, now: float) -> bool:
        """Let running generations finish within the grace period, then
        cancel what still runs; True when done. Sessions are not closed:
        their records stay in the store for the next daemon."""
        drain = self.drain
        if drain.force:
            return True
        running = [r for r in self.registry.requests.values() if r.route and r.op in _STREAMING]
        if running and now < drain.grace_until:
            return False
        if drain.cancel_until is None:
            # Time for cancelled generations to reach a token boundary and
            # for their ends to come back.
            drain.cancel_until = now + max(5.0, 5 * self.cfg.heartbeat_s)
            log.info("cancelling", running=len(running), sessions=len(self.registry.sessions))
            for req in running:
                self.own_request(req.worker, Op.CANCEL, req.session_id, Cancel(request_id=req.request_id))
        if any(r.route for r in self.registry.requests.values()) and now < drain.cancel_until:
            return False
        # Whatever is still unanswered ends here, so no client waits on a
        # broker that is gone.
        for req in list(self.registry.requests.values()):
            if req.route and not req.orphaned:
                self.registry.finish(req)
                self.error(
                    req.route,
                    req.request_id,
                    req.session_id,
                    ErrorCode.CANCELLED,
                    "the broker stopped before the worker answered",
                )
        return True

    def disconnect_workers(self) -> None:
        """Tell every worker the broker is going: it re-registers with the next."""
        for worker in list(self.registry.workers.values()):
            # A worker already gone needs no telling: the outcome does not matter.
            self.outbox.to_worker(
                worker.identity, b"", envelope(Op.DISCONNECT), encode(Disconnect(reason="broker stopping"))
            )

    # ---------------------------------------------------------------- stats

    def stats(self, now: float) -> BrokerStats:
        reg = self.registry
        p50, p99 = self.admission.wait_percentiles()
        workers = [
            WorkerStats(
                worker_id=w.worker_id,
                model=w.ready.model,
                host=w.ready.host,
                pid=w.ready.pid,
                slabs_total=w.ready.slabs,
                slabs_used=w.ready.slabs - w.free_slabs,
                running=w.running,
                in_flight=w.in_flight,
                sessions=len(w.sessions),
                frames_forwarded=w.frames_forwarded,
                last_seen_s=round(now - w.last_seen, 3),
                drafted=w.drafted,
                accepted=w.accepted,
                link_bytes=w.link_bytes,
                kv_bytes=w.kv_bytes,
                compute=w.ready.compute,
                prefixes=w.prefixes,
            )
            for w in reg.workers.values()
        ]
        total = reg.slabs_total()
        live = sum(1 for s in reg.sessions.values() if s.worker is not None)
        restore_p50, restore_p99 = self.lifecycle.restore_percentiles()
        return BrokerStats(
            version=PROTOCOL_VERSION,
            uptime_s=round(now - self.started, 3),
            workers=workers,
            sessions=len(reg.sessions),
            in_flight=len(reg.requests),
            frames_forwarded=self.frames_forwarded,
            slabs_total=total,
            slabs_used=total - reg.slabs_free(),
            queue_depth=len(self.admission.queue),
            admitted=self.admission.admitted,
            rejected=self.admission.rejected,
            expired=self.admission.expired,
            queue_wait_p50_s=p50,
            queue_wait_p99_s=p99,
            draining=self.drain is not None,
            refused=[Refused(reason=r.value, count=n) for r, n in sorted(self.admission.refused.items())],
            sessions_live=live,
            sessions_hibernated=len(reg.sessions) - live,
            hibernations=self.lifecycle.hibernations,
            restores=self.lifecycle.restores,
            restore_p50_s=restore_p50,
            restore_p99_s=restore_p99,
            store_bytes=self.lifecycle.store_size(),
            models=self.models.stats(reg, now),
            max_resident_bytes=self.models.budget if self.models.declared else 0,
            model_loads=self.models.loads,
            model_unloads=self.models.unloads,
            store_error=self.store_error,
            endpoints=self.endpoints,
        )


def _user_id(frame: zmq.Frame) -> str:
    """The User-Id the ZAP handler gave the connection: its z85 public key."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


def _salvage_ids(raw: bytes) -> tuple[int, str]:
    """Request and session id from an envelope that failed to decode, so the
    error still reaches the caller's pending request when they are readable."""
    try:
        head = msgspec.msgpack.decode(raw)
    except DECODE_ERRORS:
        return 0, ""
    if not isinstance(head, list):
        return 0, ""
    request_id = head[2] if len(head) > 2 and isinstance(head[2], int) else 0
    session_id = head[3] if len(head) > 3 and isinstance(head[3], str) else ""
    return request_id, session_id
