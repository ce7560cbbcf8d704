"""The compute thread: owns the model, the slab pool and the sessions, serves
requests that the I/O thread passes over the inproc pipe (worker/control.py),
and steps every running job one token (or prefill chunk) at a time, round
robin, so sessions progress together and a cancel lands at the next
boundary. The decode steps of a round run as one batched forward pass."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import mlx.core as mx
import zmq

from kvmux import logs
from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op, ProtocolError, StopReason
from kvmux.sessions import Fenced, SessionStore, StoreError, Turn, durable

from . import control, fork, restore
from .engine import PREFILL_CHUNK, Engine, GenerationEnd, LiveSession, NewToken, Step
from .pace import Pace
from .rewind import rewind_to, turn_at
from .slab import SlabPool
from .tool_calls import ToolCallStream, message_dict

# OpenSession fields a fork takes from its session instead.
_FORK_TAKES = ("system", "tools", "chat_template_kwargs", "sink", "window", "sampling")

log = logs.get("worker.scheduler")

IDLE_POLL_MS = 100


@dataclass
class Job:
    """A running append or generate on one session."""

    session: LiveSession
    route: bytes
    request_id: int
    steps: Generator | None = None
    ask: Step | None = None  # what the job asked for at its last boundary
    decoding: bool = False  # its last ask was a decode step
    logits: mx.array | None = None  # the answer, sent into `steps` when it resumes
    cancelled: bool = False
    credit: int = 0  # Generate.credit: chunks that may be unacknowledged; 0 = no flow control
    outstanding: int = 0  # chunks sent minus credits returned
    # the closes (route, request id, keep) waiting for this job: each gets its answer
    close_after: list[tuple[bytes, int, bool]] = field(default_factory=list)
    saved: bool = False  # the session's record was written after this job's work
    calls: ToolCallStream | None = None  # a generate whose reply is read for tool calls

    @property
    def runnable(self) -> bool:
        return self.cancelled or not self.credit or self.outstanding < self.credit

    @property
    def stopping(self) -> bool:
        """Cancelled, or its reply's last tool call is in (parallel calls off)."""
        return self.cancelled or (self.calls is not None and self.calls.finished)


class Undo(NamedTuple):
    """Where a session stood before a generate added its messages and
    prompt: put back when the template refuses them."""

    conversation: tuple[int, str]  # Conversation.mark()
    pending: int
    raw: bool
    turns: int

    @classmethod
    def of(cls, session: LiveSession) -> Undo:
        return cls(session.conversation.mark(), len(session.pending), session.raw, len(session.turns))

    def apply(self, session: LiveSession) -> None:
        session.conversation.rollback(self.conversation)
        del session.pending[self.pending :]
        session.raw = self.raw
        del session.turns[self.turns :]


@dataclass
class Scheduler:
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

    # ------------------------------------------------------------ plumbing

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
        status = control.Status(
            self.pool.free,
            len(self.jobs),
            {session_id: session.owner for session_id, session in self.sessions.items()},
            self.draining,
            engine.drafted,
            engine.accepted,
            engine.loaded.stages.link.bytes if engine.loaded.stages else 0,
        )
        if status != self.reported:
            self.pipe.send_multipart([control.STATUS, control.encode_status(status)])
            self.reported = status

    def run(self) -> None:
        """Serve until the I/O thread says STOP."""
        while not self.stopping:
            runnable = [job for job in self.jobs.values() if job.runnable]
            timeout = 0 if runnable else IDLE_POLL_MS
            while self.pipe.poll(timeout):
                self.dispatch(self.pipe.recv_multipart())
                timeout = 0
            # Prefill chunks shrink while other sessions decode: they share
            # the pass, and a long history must not stall the streams.
            decoding = any(job.decoding for job in runnable)
            self.chunk = self.pace.share if decoding else PREFILL_CHUNK
            started = time.perf_counter()
            asking = [job for job in runnable if self.jobs.get(job.session.session_id) is job and self.step(job)]
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
        if job.session.session_id not in self.sessions:
            return  # dropped on the way: its placement was superseded (save)
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
        self.send(job.route, Op.FINAL, job.request_id, job.session.session_id, body)

    def save(self, session: LiveSession, *, snapshot: bool = False) -> int:
        """Write the session's durable record: after this, a crash of this
        worker loses nothing the session has done. A copy whose placement
        was superseded (this worker was declared lost, the session placed
        again elsewhere) is dropped, and the request gets `worker_lost`."""
        try:
            return durable.save(self.store, session, self.engine.loaded.model_id, snapshot_now=snapshot)
        except Fenced as exc:
            log.warning("session_fenced", session=session.session_id, why=str(exc))
            if session.session_id in self.sessions:
                self.drop(session)
            raise ProtocolError(
                ErrorCode.WORKER_LOST, f"this worker's copy of session {session.session_id} is stale: {exc}"
            ) from None

    def save_all(self) -> None:
        """On the way out (a drain): snapshot what a restart would replay."""
        for session in list(self.sessions.values()):
            if session.replay:
                try:
                    self.save(session, snapshot=True)
                except (OSError, StoreError, ProtocolError) as exc:
                    log.error("session_save_failed", session=session.session_id, error=str(exc))

    def prefill_chunk(self) -> int:
        return self.chunk

    # ------------------------------------------------------------ requests

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

    def dormant(self, route: bytes, env: p.Envelope, body) -> LiveSession | None:
        """A request for a session this worker does not hold: restore it from
        the store when the request needs it live; None when answered here."""
        if env.op == Op.CREDIT:
            return None
        if env.op == Op.CANCEL:
            self.send(route, Op.FINAL, env.request_id, env.session_id, p.Ack())  # nothing runs on it here
            return None
        if env.op == Op.CLOSE:
            if not self.store.exists(env.session_id):
                raise ProtocolError(ErrorCode.SESSION_NOT_FOUND, f"no session {env.session_id!r}")
            self.store.delete(env.session_id)
            self.send(route, Op.FINAL, env.request_id, env.session_id, p.Closed(session_id=env.session_id))
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
        return self.restore(env.session_id)

    def restore(self, session_id: str) -> LiveSession:
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "worker is draining", reason=p.OverloadReason.DRAINING.value)
        if not self.pool.take():
            raise ProtocolError(ErrorCode.OVERLOADED, "no free slab", reason=p.OverloadReason.NO_SLAB.value)
        started = time.perf_counter()
        try:
            session, replayed = restore.restore(self.store, self.engine, session_id)
        except BaseException:
            self.pool.give_back()
            raise
        seconds = time.perf_counter() - started
        session.restores += 1
        session.last_restore_s = seconds
        self.sessions[session_id] = session
        log.info("session_restored", session=session_id, seconds=round(seconds, 4), replayed_tokens=replayed)
        restored = p.Restored(session_id=session_id, seconds=seconds, replayed_tokens=replayed)
        self.send(b"", Op.RESTORED, 0, session_id, restored)
        return session

    def on_control(self, name: bytes) -> None:
        if name == control.DRAIN:
            self.draining = True
        elif name == control.CANCEL_ALL:
            for job in self.jobs.values():
                job.cancelled = True
        elif name == control.STOP:
            self.stopping = True

    def open(self, route: bytes, env: p.Envelope, body: p.OpenSession) -> None:
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "worker is draining", reason=p.OverloadReason.DRAINING.value)
        if not env.session_id or env.session_id in self.sessions:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "open needs a new session id")
        if not self.pool.take():
            raise ProtocolError(ErrorCode.OVERLOADED, "no free slab", reason=p.OverloadReason.NO_SLAB.value)
        try:
            if body.fork is not None:
                session = self.open_fork(env.session_id, body)
            else:
                session = self.engine.new_session(
                    env.session_id,
                    body.sink,
                    body.window,
                    body.system,
                    body.sampling,
                    body.chat_template_kwargs,
                    body.tools,
                )
        except BaseException:
            self.pool.give_back()
            raise
        session.owner = body.client_name or ""
        self.sessions[session.session_id] = session
        try:
            session.epoch = self.store.claim(session.session_id)
            self.save(session, snapshot=body.fork is not None)  # a fork's slab is in no file of its own yet
        except BaseException:
            self.drop(session)
            raise
        log.info("session_opened", session=session.session_id, sink=session.sink, window=session.window)
        self.send(
            route,
            Op.FINAL,
            env.request_id,
            session.session_id,
            p.SessionOpened(
                session_id=session.session_id,
                worker_id=self.worker_id,
                model=self.engine.loaded.model_id,
                sink=session.sink,
                window=session.window,
                slab_bytes=self.engine.slab_bytes(session.sink, session.window),
            ),
        )

    def open_fork(self, session_id: str, body: p.OpenSession) -> LiveSession:
        """A copy of the fork's session (worker/fork.py), whose settings it takes."""
        given = [name for name in _FORK_TAKES if getattr(body, name) not in (None, [], {})]
        if given:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, f"a fork takes its session's settings: {', '.join(given)} may not be set"
            )
        if body.fork.session_id in self.jobs:
            raise ProtocolError(ErrorCode.BUSY, f"session {body.fork.session_id} is running a request: fork it after")
        session = fork.fork(self.engine, self.store, self.sessions, session_id, body.fork)
        log.info("session_forked", session=session_id, source=body.fork.session_id, kept=len(session.history))
        return session

    def ensure_idle(self, session: LiveSession) -> None:
        """Refuse a new append/generate before it changes anything."""
        if session.session_id in self.jobs:
            raise ProtocolError(ErrorCode.BUSY, "an append or generate is already running on this session")
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "worker is draining", reason=p.OverloadReason.DRAINING.value)

    def start(self, route: bytes, env: p.Envelope, session: LiveSession, steps, credit: int = 0) -> None:
        job = Job(session=session, route=route, request_id=env.request_id, credit=credit)
        job.steps = steps(job)
        self.jobs[session.session_id] = job

    def queue_messages(self, session: LiveSession, messages: list[p.ChatMessage]) -> None:
        conversation = session.conversation
        mark = conversation.mark()
        fmt = self.engine.tool_format
        tokens = self.engine.encode(conversation.extend([message_dict(m, fmt) for m in messages]))
        if len(tokens) > self.engine.max_append_tokens:
            conversation.rollback(mark)
            self._too_long(len(tokens))
        session.pending.extend(tokens)
        session.raw = False
        self.turn_ends(session)

    @staticmethod
    def turn_ends(session: LiveSession) -> None:
        """Note where the conversation stands: a rewind may come back here."""
        conversation = session.conversation
        tokens = len(session.history) + len(session.pending)
        session.turns.append(Turn(len(conversation.messages), len(conversation.rendered), tokens))

    def _too_long(self, tokens: int) -> None:
        raise ProtocolError(
            ErrorCode.INVALID_ARGUMENT,
            f"one append of {tokens} tokens; this worker takes at most {self.engine.max_append_tokens}"
            " (--max-append-tokens): send it in parts",
        )

    def append(self, route: bytes, env: p.Envelope, body: p.Append, session: LiveSession) -> None:
        if bool(body.messages) == bool(body.token_ids):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "append takes either messages or token_ids")
        self.ensure_idle(session)
        if body.messages:
            self.queue_messages(session, body.messages)
        else:
            if len(body.token_ids) > self.engine.max_append_tokens:
                self._too_long(len(body.token_ids))
            self.engine.check_token_ids(body.token_ids)
            session.pending.extend(body.token_ids)
            session.raw = True
        new_tokens = len(session.pending)

        def steps(job: Job):
            started = time.perf_counter()
            cancelled = yield from self.engine.prefill(session, self.prefill_chunk)
            if cancelled or job.cancelled:
                raise ProtocolError(
                    ErrorCode.CANCELLED,
                    f"append cancelled; {len(session.pending)} tokens stay queued for the next call",
                )
            self.complete(
                job,
                p.Appended(
                    new_tokens=new_tokens,
                    history_tokens=len(session.history),
                    prefill_s=time.perf_counter() - started,
                    truncated_tokens=session.dropped,
                ),
            )

        self.start(route, env, session, steps)

    def generate(self, route: bytes, env: p.Envelope, body: p.Generate, session: LiveSession) -> None:
        self.ensure_idle(session)
        params = self.engine.params(body, session.sampling)
        if body.credit < 0:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "credit must be >= 0")
        self.engine.constrain(session, params)
        conversation, undo = session.conversation, Undo.of(session)
        try:
            if body.messages:
                self.queue_messages(session, body.messages)
            chat = not session.raw and bool(conversation.messages)
            if chat:
                session.pending.extend(self.engine.encode(conversation.generation_prompt()))
        except ProtocolError:  # a generate the template refuses appends nothing either
            undo.apply(session)
            raise
        if session.logits is None and not session.pending:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "nothing to continue from: append something first")
        tools = chat and self.engine.calls_tools(session, params)

        def steps(job: Job):
            queued = len(session.pending)
            started = time.perf_counter()
            cancelled = yield from self.engine.prefill(session, self.prefill_chunk)
            prefill_s = time.perf_counter() - started
            prompt_tokens = queued - len(session.pending)
            decoding, decode_s = GenerationEnd(StopReason.CANCELLED, ""), 0.0
            before = len(session.history)
            if not (cancelled or job.cancelled):
                started = time.perf_counter()
                decoding = yield from self.engine.decode(session, params)
                decode_s = time.perf_counter() - started
            completion = len(session.history) - before
            reason, text = decoding.reason, decoding.text
            content, calls = job.calls.finish() if job.calls else ("", [])
            if calls and reason is not StopReason.MAX_TOKENS and not job.cancelled:  # (not the client's cancel)
                reason = StopReason.TOOL_CALLS
            if chat and not job.close_after:
                # Close the assistant turn as the template closes one
                # (pointless when a close waits); the reply stays the ids
                # generated. The closing tokens stay pending: the next append
                # or generate prefills them with its own tokens, in the same
                # pass, instead of this reply waiting a pass for them.
                decode = self.engine.tokenizer.decode
                end = decode(session.history[-1:]) if reason is StopReason.EOS else ""
                closing = conversation.close_turn(text, decode(session.history[before:]), end)
                session.pending.extend(self.engine.encode(closing))
                self.turn_ends(session)
            self.complete(
                job,
                p.GenerateResult(
                    stop_reason=reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion,
                    prefill_s=prefill_s,
                    decode_s=decode_s,
                    truncated_tokens=session.dropped,
                    history_tokens=len(session.history) + len(session.pending),
                    drafted_tokens=decoding.drafted,
                    accepted_tokens=decoding.accepted,
                    content=content,
                    tool_calls=calls,
                ),
            )

        self.start(route, env, session, steps, credit=body.credit)
        if tools:
            self.jobs[session.session_id].calls = ToolCallStream(self.engine.tool_format, params.parallel_tool_calls)

    def cancel(self, route: bytes, env: p.Envelope, body: p.Cancel, session: LiveSession) -> None:
        job = self.jobs.get(session.session_id)
        if job is not None and (body.request_id is None or body.request_id == job.request_id):
            job.cancelled = True
        self.send(route, Op.FINAL, env.request_id, session.session_id, p.Ack())

    def credit(self, route: bytes, env: p.Envelope, body: p.Credit, session: LiveSession) -> None:
        # No reply: credits flow with the stream, and a reply per grant would
        # double the frames of a long generation.
        job = self.jobs.get(session.session_id)
        if job is not None and job.request_id == body.request_id:
            job.outstanding = max(0, job.outstanding - body.n)

    def info(self, route: bytes, env: p.Envelope, body: p.Info, session: LiveSession) -> None:
        self.send(
            route,
            Op.FINAL,
            env.request_id,
            session.session_id,
            p.SessionInfo(
                session_id=session.session_id,
                worker_id=self.worker_id,
                history_tokens=len(session.history) + len(session.pending),
                cached_tokens=session.cached,
                kv_live_bytes=session.kv_live_bytes,
                slab_bytes=self.engine.slab_bytes(session.sink, session.window),
                truncated_tokens=session.dropped,
                idle_s=0.0 if session.session_id in self.jobs else time.monotonic() - session.last_used,
                sink=session.sink,
                window=session.window,
                busy=session.session_id in self.jobs,
                messages=len(session.conversation.messages),
                token_ids=session.history + session.pending if body.token_ids else None,
                restores=session.restores,
                last_restore_s=session.last_restore_s,
                pending_tokens=len(session.pending),
                **durable.marked(session, body.marks),
            ),
        )

    def mark(self, route: bytes, env: p.Envelope, body: p.Mark, session: LiveSession) -> None:
        if session.session_id in self.jobs:  # its record is written when the request ends, not in between
            raise ProtocolError(ErrorCode.BUSY, "an append or generate is running on this session: mark it after")
        durable.mark(session, body, len(session.conversation.messages))
        self.save(session)
        self.send(route, Op.FINAL, env.request_id, session.session_id, p.Marked(marks=len(session.marks)))

    def rewind(self, route: bytes, env: p.Envelope, body: p.Rewind, session: LiveSession) -> None:
        self.ensure_idle(session)
        turn = turn_at(session, body.messages)
        stale = rewind_to(self.engine, self.store, session, turn)
        self.save(session, snapshot=stale)
        log.info("session_rewound", session=session.session_id, messages=turn.messages, kept=len(session.history))
        self.send(
            route,
            Op.FINAL,
            env.request_id,
            session.session_id,
            p.Rewound(
                messages=turn.messages,
                history_tokens=len(session.history) + len(session.pending),
                kept_tokens=len(session.history),
                pending_tokens=len(session.pending),
            ),
        )

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

    def close_request(self, route: bytes, env: p.Envelope, body: p.Close, session: LiveSession) -> None:
        job = self.jobs.get(session.session_id)
        if job is None:
            self.close(session, [(route, env.request_id, body.keep)])
        else:  # stop the running job at its next boundary, then close
            job.cancelled = True
            job.close_after.append((route, env.request_id, body.keep))

    def hibernate(self, route: bytes, env: p.Envelope, body: p.Hibernate, session: LiveSession) -> None:
        """Snapshot the session to the store and free its slab (the broker
        picked it as idle; a job started since makes it `busy`)."""
        if session.session_id in self.jobs:
            raise ProtocolError(ErrorCode.BUSY, "a request runs on this session")
        started = time.perf_counter()
        written = self.save(session, snapshot=True)
        self.drop(session)
        seconds = time.perf_counter() - started
        log.info("session_hibernated", session=session.session_id, bytes=written, seconds=round(seconds, 4))
        self.send(
            route,
            Op.FINAL,
            env.request_id,
            session.session_id,
            p.Hibernated(session_id=session.session_id, bytes=written, seconds=seconds),
        )

    def drop(self, session: LiveSession) -> None:
        """Forget a live session and free its slab (its record stays)."""
        self.jobs.pop(session.session_id, None)
        del self.sessions[session.session_id]
        self.pool.give_back()
        mx.clear_cache()

    HANDLERS: ClassVar = {
        Op.OPEN: open,
        Op.APPEND: append,
        Op.GENERATE: generate,
        Op.CANCEL: cancel,
        Op.CREDIT: credit,
        Op.INFO: info,
        Op.CLOSE: close_request,
        Op.HIBERNATE: hibernate,
        Op.REWIND: rewind,
        Op.MARK: mark,
    }
