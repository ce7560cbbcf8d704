"""The compute thread's request handlers, one per op that names a session:
each checks its request, changes the session or starts a job on it (a
coroutine the scheduler steps: worker/scheduler.py), and answers."""

from __future__ import annotations

import time
from typing import ClassVar, NamedTuple

from kvmux import logs, tracing
from kvmux import protocol as p
from kvmux.protocol import ErrorCode, Op, ProtocolError, StopReason
from kvmux.sessions import Turn, durable

from . import fork
from .engine import Engine, GenerationEnd, LiveSession
from .job import Job
from .prefixes import Prefixes
from .rewind import rewind_to, turn_at
from .slab import SlabPool
from .tool_calls import ToolCallStream, message_dict

# OpenSession fields a fork takes from its session instead.
_FORK_TAKES = ("system", "tools", "chat_template_kwargs", "sink", "window", "sampling", "prefix")

log = logs.get("worker.requests")


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


class Requests:
    """The handlers (worker/scheduler.py's Scheduler is one: these read its
    state, and start jobs, save and answer through it), by op in HANDLERS."""

    engine: Engine
    pool: SlabPool
    worker_id: str
    sessions: dict[str, LiveSession]
    jobs: dict[str, Job]
    draining: bool
    prefixes: Prefixes | None

    def open(self, route: bytes, env: p.Envelope, body: p.OpenSession) -> None:
        if self.draining:
            raise ProtocolError(ErrorCode.OVERLOADED, "worker is draining", reason=p.OverloadReason.DRAINING.value)
        if not env.session_id or env.session_id in self.sessions:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "open needs a new session id")
        prefix = self.prefix_mode(body.prefix)
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
        session.prefix = prefix
        self.sessions[session.session_id] = session
        try:
            session.epoch = self.claim(session)
            self.save(session, snapshot=body.fork is not None)  # a fork's slab is in no file of its own yet
        except BaseException:
            if session.session_id in self.sessions:  # (a save that found no room dropped it)
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

    def prefix_mode(self, given: str | None) -> str:
        """OpenSession.prefix, checked: a PrefixMode value."""
        try:
            mode = p.PrefixMode(given or p.PrefixMode.AUTO.value)
        except ValueError:
            raise ProtocolError(
                ErrorCode.INVALID_ARGUMENT, f"prefix must be one of {', '.join(m.value for m in p.PrefixMode)}"
            ) from None
        if mode is p.PrefixMode.PIN and (self.prefixes is None or self.prefixes.store is None):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "prefix=pin: this worker keeps no shared prefixes")
        return mode.value

    def opening(self, session: LiveSession) -> tuple[int, dict]:
        """A fresh session's first prefill: the longest shared prefix taken
        now (worker/prefixes.py); (tokens it restored, what the prefill
        needs to keep the opening's own)."""
        if self.prefixes is None or session.history or session.logits is not None:
            return 0, {}
        opening = self.prefixes.open(session, session.prefix)
        if opening is None:
            return 0, {}
        options: dict = {"block": self.prefixes.aligned}
        # A copy of a new opening (or a pinned one) at its end; one that took a prefix keeps
        # none (what it shares is kept already; its own last blocks seldom are shared).
        if opening.end > opening.cached and (not opening.cached or opening.pin):
            options["at"] = (opening.end, lambda: self.prefixes.capture(session, opening))
        return opening.cached, options

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
        cached, prefill = self.opening(session)

        def steps(job: Job):
            started, began = time.perf_counter(), time.time_ns()
            cancelled = yield from self.engine.prefill(session, self.prefill_chunk, **prefill)
            tracing.record("kvmux.prefill", body.traceparent, began, tokens=new_tokens, cached_tokens=cached)
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
                    cached_tokens=cached,
                ),
            )

        defaults = session.sampling
        self.start(route, env, session, steps, priority=(defaults.priority if defaults else None) or 0)

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
        cached, prefill = self.opening(session)

        def steps(job: Job):
            queued, reused = len(session.pending), len(session.history)
            started, began = time.perf_counter(), time.time_ns()
            cancelled = yield from self.engine.prefill(session, self.prefill_chunk, **prefill)
            prefill_s = time.perf_counter() - started
            prompt_tokens = queued - len(session.pending)
            tracing.record(
                "kvmux.prefill",
                body.traceparent,
                began,
                tokens=prompt_tokens,
                reused_tokens=reused,
                cached_tokens=cached,
            )
            decoding, decode_s = GenerationEnd(StopReason.CANCELLED, ""), 0.0
            before = len(session.history)
            if not (cancelled or job.cancelled):
                started, began = time.perf_counter(), time.time_ns()
                decoding = yield from self.engine.decode(session, params)
                decode_s = time.perf_counter() - started
                tracing.record(
                    "kvmux.decode",
                    body.traceparent,
                    began,
                    tokens=len(session.history) - before,
                    drafted_tokens=decoding.drafted,
                    accepted_tokens=decoding.accepted,
                )
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
                    reused_tokens=reused,
                    content=content,
                    tool_calls=calls,
                    cached_tokens=cached,
                ),
            )

        self.start(route, env, session, steps, credit=body.credit, priority=params.priority)
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
        started, began = time.perf_counter(), time.time_ns()
        written = self.save(session, snapshot=True)
        self.drop(session)
        seconds = time.perf_counter() - started
        tracing.record("kvmux.hibernate", body.traceparent, began, bytes=written)
        log.info("session_hibernated", session=session.session_id, bytes=written, seconds=round(seconds, 4))
        self.send(
            route,
            Op.FINAL,
            env.request_id,
            session.session_id,
            p.Hibernated(session_id=session.session_id, bytes=written, seconds=seconds),
        )

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
