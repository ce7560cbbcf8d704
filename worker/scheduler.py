"""The compute thread: owns the model, the slab pool and the sessions, serves
requests that the I/O thread passes over the inproc pipe (worker/control.py),
and steps every running job one token (or prefill chunk) at a time, round
robin, so sessions progress together and a cancel lands at the next
boundary. The decode steps of a round run as one batched forward pass.

This module is the loop; the requests' handlers are worker/requests.py's,
the sessions' records and restores worker/durability.py's."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import zmq

from kvmux import logs
from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op, ProtocolError
from kvmux.sessions import SessionStore, StoreError

from . import control
from .durability import Durability
from .engine import PREFILL_CHUNK, Engine, LiveSession, NewToken, Step
from .job import Job
from .pace import Pace
from .prefixes import Prefixes
from .requests import Requests
from .slab import SlabPool

log = logs.get("worker.scheduler")

IDLE_POLL_MS = 100
KV_BYTES_EVERY_S = 0.5  # summing every slab's arrays is not free: the heartbeat's figure at most this old


@dataclass
class Scheduler(Requests, Durability):
    engine: Engine
    pool: SlabPool
    worker_id: str
    pipe: zmq.Socket  # PAIR to the I/O thread
    store: SessionStore
    sessions: dict[str, LiveSession] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    draining: bool = False
    stopping: bool = False
    reported: control.Status | None = None  # the last STATUS sent to the I/O thread
    chunk: int = PREFILL_CHUNK  # prefill tokens per step in this round
    pace: Pace = field(default_factory=lambda: Pace(most=PREFILL_CHUNK))
    kv_bytes: tuple[int, float] = (0, 0.0)  # (the live sessions' KV bytes, when summed)
    prefixes: Prefixes | None = None  # shared prefixes (None: a worker group's, which keeps none)

    def send(self, route: bytes, op: str, request_id: int, session_id: str, body) -> None:
        self.pipe.send_multipart([route, p.envelope(op, request_id, session_id), p.encode(body)])

    def error(self, route: bytes, request_id: int, session_id: str, code: ErrorCode, message: str, **extra) -> None:
        self.pipe.send_multipart(
            [route, p.envelope(Op.ERROR, request_id, session_id), p.error_body(code, message, **extra)]
        )

    def report_status(self) -> None:
        """Tell the I/O thread when slabs, jobs or sessions changed: it
        reads nothing of ours but what comes over the pipe."""
        engine = self.engine
        now = time.monotonic()
        if now - self.kv_bytes[1] >= KV_BYTES_EVERY_S:
            self.kv_bytes = (sum(session.kv_live_bytes for session in self.sessions.values()), now)
        status = control.Status(
            self.pool.free,
            len(self.jobs),
            {session_id: session.owner for session_id, session in self.sessions.items()},
            self.draining,
            engine.drafted,
            engine.accepted,
            engine.loaded.stages.link.bytes if engine.loaded.stages else 0,
            self.kv_bytes[0],
            self.prefixes.report() if self.prefixes else None,
        )
        if status != self.reported:
            self.pipe.send_multipart([control.STATUS, control.encode_status(status)])
            self.reported = status

    def run(self) -> None:
        """Serve until the I/O thread says STOP."""
        while not self.stopping:
            runnable = sorted((job for job in self.jobs.values() if job.runnable), key=lambda j: -j.priority)
            timeout = 0 if runnable else IDLE_POLL_MS
            while self.pipe.poll(timeout):
                self.dispatch(self.pipe.recv_multipart())
                timeout = 0
            # Prefill chunks shrink while other sessions decode: they share
            # the pass, and a long history must not stall the streams. Of a
            # higher priority than every stream, a prefill takes whole chunks:
            # the lower streams wait for it instead.
            streams = [job.priority for job in runnable if job.decoding]
            decoding = bool(streams)
            started = time.perf_counter()
            asking = []
            for job in runnable:  # higher priority first
                self.chunk = self.pace.share if streams and max(streams) >= job.priority else PREFILL_CHUNK
                if self.jobs.get(job.session.session_id) is job and self.step(job):
                    asking.append(job)
            if asking:
                self.forward_pass(asking)
                prefill = sum(job.ask.tokens.shape[0] for job in asking if not job.ask.rows)
                self.pace.observe(time.perf_counter() - started, decoding, prefill)
            self.report_status()

    def forward_pass(self, jobs: list[Job]) -> None:
        """One forward pass for every job's step: decode tokens and prefill
        chunks together."""
        try:
            steps = self.engine.forward_batch([job.ask for job in jobs])
            for job, logits in zip(jobs, steps, strict=True):
                job.logits = logits
        except Exception as exc:
            log.exception("forward_pass_failed", sessions=len(jobs))
            for job in jobs:
                self.finish(job)
                self.error(
                    job.route,
                    job.request_id,
                    job.session.session_id,
                    ErrorCode.INTERNAL,
                    f"{type(exc).__name__}: {exc}",
                )

    def step(self, job: Job) -> bool:
        """Resume a job up to its next boundary, sending what it decoded on
        the way; True if it asks for a Step."""
        job.ask = None
        try:
            out = job.steps.send(None if job.logits is None else (job.logits, job.cancelled))
            job.logits = None
            while isinstance(out, NewToken):
                self.emit(job, out)
                out = job.steps.send(job.stopping)
            if isinstance(out, Step):
                job.ask, job.decoding = out, out.rows
                return True
        except StopIteration:
            self.finish(job)
        except ProtocolError as exc:
            self.finish(job)
            self.error(job.route, job.request_id, job.session.session_id, exc.code, exc.message, **exc.extra)
        except Exception as exc:  # one bad request must not kill the compute loop
            log.exception("job_failed", session=job.session.session_id)
            self.finish(job)
            self.error(
                job.route, job.request_id, job.session.session_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            )
        return False

    def emit(self, job: Job, decoded: NewToken) -> None:
        job.outstanding += bool(job.credit)
        text, calls = job.calls.push(decoded.text) if job.calls else (decoded.text, [])
        chunk = p.Chunk(token_ids=[decoded.token], text=text, tool_calls=calls)
        if decoded.logprobs is not None:
            chunk.logprobs = [decoded.logprobs]
        self.send(job.route, Op.PARTIAL, job.request_id, job.session.session_id, chunk)

    def finish(self, job: Job) -> None:
        self.jobs.pop(job.session.session_id, None)
        if self.prefixes is not None and self.prefixes.writes:
            self.prefixes.flush()  # after the reply: its tokens did not wait for the store
        if job.session.session_id not in self.sessions:
            # Dropped on the way: its placement superseded (save answered
            # the closes waiting on the job) or no room to save it (the
            # record stands as it last was: they close that).
            session_id = job.session.session_id
            for route, request_id, keep in job.close_after:
                try:
                    self.close_stored(route, request_id, session_id, keep)
                except ProtocolError as exc:
                    self.error(route, request_id, session_id, exc.code, exc.message)
                except StoreError as exc:
                    self.error(route, request_id, session_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        job.session.last_used = time.monotonic()
        if job.close_after:
            self.close(job.session, job.close_after)
        elif not job.saved:  # cancelled or failed: the record still says what the slab holds
            with contextlib.suppress(ProtocolError):  # superseded: the job's own error is the answer
                self.save(job.session)

    def complete(self, job: Job, body) -> None:
        """A job's final reply, sent once the session's record holds what
        the job did: the client never hears of a turn a crash could lose."""
        job.saved = True
        self.save(job.session)
        if self.prefixes is not None and any(pinned for *_, pinned in self.prefixes.writes):
            self.prefixes.flush()  # a pin is answered once it is stored
        self.send(job.route, Op.FINAL, job.request_id, job.session.session_id, body)

    def start(
        self, route: bytes, env: p.Envelope, session: LiveSession, steps, credit: int = 0, priority: int = 0
    ) -> None:
        job = Job(session=session, route=route, request_id=env.request_id, credit=credit, priority=priority)
        job.steps = steps(job)
        self.jobs[session.session_id] = job

    def prefill_chunk(self) -> int:
        return self.chunk

    def dispatch(self, frames: list[bytes]) -> None:
        if len(frames) == 1:
            self.on_control(frames[0])
            return
        route, raw_env, raw_body = frames
        try:
            env = p.decode_envelope(raw_env)
        except ProtocolError as exc:
            self.error(route, 0, "", exc.code, exc.message)
            return
        try:
            body = p.decode_body(env.op, raw_body)
            handler = self.HANDLERS.get(env.op)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, f"a worker does not serve {env.op!r}")
            if env.op == Op.OPEN:
                handler(self, route, env, body)
                return
            session = self.sessions.get(env.session_id)
            if session is None:
                session = self.dormant(route, env, body)
                if session is None:
                    return
            handler(self, route, env, body, session)
        except ProtocolError as exc:
            self.error(route, env.request_id, env.session_id, exc.code, exc.message, **exc.extra)
        except Exception as exc:
            log.exception("request_failed", op=env.op)
            self.error(route, env.request_id, env.session_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def on_control(self, name: bytes) -> None:
        if name == control.DRAIN:
            self.draining = True
        elif name == control.CANCEL_ALL:
            for job in self.jobs.values():
                job.cancelled = True
        elif name == control.STOP:
            self.stopping = True
