"""Sessions and the compute they need: chunked prefill, and decode (a token
per pass, or a speculative verify pass of drafted tokens) on a session's
own slab.

Both are coroutines that yield explicit events: a `Step` (tokens to run
through the slab; the scheduler answers with the logits, from one pass
shared by every session with work) and, while decoding, a `NewToken` token
(the scheduler sends it, and answers whether the job was cancelled). The
scheduler owns sending, flow control and cancel; the engine owns what is
computed and what it means.
A session's invariant: its slab holds every history token, and `logits` are
the model's output after the last one, so a generate may start sampling at
once and a cancelled or finished generation leaves slab and logits in step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import msgspec

from kvmux import logs
from kvmux.protocol import (
    DEFAULT_MAX_APPEND_TOKENS,
    DEFAULT_MAX_TOKENS_LIMIT,
    PRIORITIES,
    ErrorCode,
    Logprobs,
    ProtocolError,
    Sampling,
    SpeculativeMode,
    StopReason,
    Tool,
    ToolChoice,
)
from kvmux.sessions import SessionState

from . import cpu_kernel, forward, padding, tool_calls
from .constraint import Grammars
from .conversation import Conversation
from .decoding import Choice, Emission, GenerationParams
from .drafter import DraftCache, Drafter
from .lookup import SEPARATOR, Lookup
from .model import LoadedModel
from .slab import SlabCache, live_bytes, rewind, widest
from .speculative import MAX_DRAFT, DraftLength, Proposal

log = logs.get("worker.engine")

DEFAULT_MAX_TOKENS = 256
PREFILL_CHUNK = 128  # tokens per prefill step when no other session is decoding (else worker/pace.py)
RECENT_TOKENS = 1 << 16  # replies of all sessions the worker-wide lookup keeps
MOST_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


class LiveSession(SessionState, kw_only=True, eq=False):
    """A session in a slab: its durable state (kvmux/sessions/record.py,
    written to its record after every request) and what lives only here."""

    slab: list[SlabCache]
    conversation: Conversation
    logits: mx.array | None = None
    epoch: int = 0  # this placement's, from the store (SessionStore.claim): its record writes carry it
    last_used: float = msgspec.field(default_factory=time.monotonic)
    # speculative decoding (worker/speculative.py)
    lookup: Lookup = msgspec.field(default_factory=Lookup)  # follows `history`
    drafting: DraftLength = msgspec.field(default_factory=DraftLength)
    draft: DraftCache | None = None  # the draft model's cache, when the worker has one
    prefix: str = "auto"  # what its opening does with shared prefixes (OpenSession.prefix)

    @property
    def dropped(self) -> int:
        return widest(self.slab).dropped

    @property
    def cached(self) -> int:
        return widest(self.slab).cached

    @property
    def kv_live_bytes(self) -> int:
        return live_bytes(self.slab) + (live_bytes(self.draft.slab) if self.draft else 0)


@dataclass
class Step:
    """Compute: run `tokens` through the session's slab. Decode rows (a
    decode step's one token, or a verify pass's last token and drafts) are
    answered with the logits after each, a prefill chunk with those after
    its last; the scheduler runs every job's step in one pass and resumes
    the job with (logits, cancelled)."""

    session: LiveSession
    tokens: mx.array
    rows: bool


@dataclass
class NewToken:
    """A decoded token and the text now safe to send; the scheduler sends
    it and resumes the job with whether it was cancelled."""

    token: int
    text: str
    logprobs: Logprobs | None = None


@dataclass
class GenerationEnd:
    """How a generation ended."""

    reason: StopReason
    text: str
    drafted: int = 0  # tokens proposed to the verifier
    accepted: int = 0  # of them, the ones that stood


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_sink: int,
        max_window: int,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        max_append_tokens: int = DEFAULT_MAX_APPEND_TOKENS,
        draft: LoadedModel | None = None,
        most_rows: int = 4 * (MAX_DRAFT + 1) + PREFILL_CHUNK,
        batch_invariant: bool = False,
    ):
        """`draft`: a draft model (its tokenizer already checked against the
        verifier's); `most_rows`: the most tokens one pass runs (slabs times
        a verify pass, plus a prefill chunk), for the row calibration;
        `batch_invariant`: pad passes whatever it costs (worker/padding.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_sink = max_sink
        self.max_window = max_window
        # Limits that keep one request from holding the worker for hours.
        self.max_tokens_limit = max_tokens_limit
        self.max_append_tokens = max_append_tokens
        self.eos = set(self.tokenizer.eos_token_ids)
        self.shared_passes = forward.supported(self.model)  # sessions share forward passes
        # Speculative decoding verifies drafts in a pass of decode rows (worker/forward.py).
        self.speculative = self.shared_passes
        self.padding = (
            padding.decide(
                self.model,
                most_rows,
                batch_invariant,
                lambda: self.make_slab(max_sink, padding.HISTORY),
                f"{loaded.model_id} {loaded.kernel.describe()} {loaded.model.args} {loaded.layout}",
            )
            if self.shared_passes
            else None
        )
        self.floors = self.padding.floors if self.padding else forward.Floors()
        self.drafter = Drafter(draft) if draft and self.speculative else None
        self.recent = Lookup(bound=RECENT_TOKENS)  # replies of every session, for greedy lookups
        self.grammars = Grammars(self.tokenizer, self.model.args.vocab_size, self.eos)
        self.tool_format = tool_calls.format_of(self.tokenizer.chat_template)
        self.drafted = self.accepted = 0  # over the worker's life, for stats

    # ------------------------------------------------------------ sessions

    @property
    def spare(self) -> int:
        """Slots a slab keeps beyond its window, for a verify pass's drafts."""
        return MAX_DRAFT if self.speculative else 0

    def slab_bytes(self, sink: int, window: int) -> int:
        """A session's KV memory when full: its slab, and its draft cache."""
        draft = self.drafter.loaded.slab_bytes(sink, window, MAX_DRAFT) if self.drafter else 0
        return self.loaded.slab_bytes(sink, window, self.spare) + draft

    def make_slab(self, sink: int, window: int) -> list[SlabCache]:
        return self.loaded.make_slab(sink, window, self.spare)

    def new_session(
        self,
        session_id: str,
        sink: int | None,
        window: int | None,
        system: str | None,
        sampling: Sampling | None,
        chat_template_kwargs: dict | None = None,
        tools: list[Tool] | None = None,
    ) -> LiveSession:
        sink = self.max_sink if sink is None else sink
        window = self.max_window if window is None else window
        if not 0 <= sink <= self.max_sink:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"sink must be within 0..{self.max_sink}")
        if not 1 <= window <= self.max_window:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"window must be within 1..{self.max_window}")
        sampling = sampling or Sampling()
        tools = tools or []
        tool_calls.check_tools(tools)
        session = LiveSession(
            session_id=session_id,
            sink=sink,
            window=window,
            created=time.time(),
            sampling=sampling,
            tools=tools,
            slab=self.make_slab(sink, window),
            layout=str(self.loaded.layout),
            conversation=Conversation.open(self.tokenizer, system, chat_template_kwargs, tools, self.tool_format),
            draft=self.drafter.new_cache(sink, window) if self.drafter else None,
        )
        self.constrain(session, self.params(Sampling(), sampling))  # the defaults checked now, not at a generate
        return session

    def params(self, request: Sampling, defaults: Sampling) -> GenerationParams:
        def pick(name, fallback):
            value = getattr(request, name)
            if value is None:
                value = getattr(defaults, name)
            return fallback if value is None else value

        params = GenerationParams(
            max_tokens=pick("max_tokens", DEFAULT_MAX_TOKENS),
            temperature=pick("temperature", 0.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            seed=pick("seed", int.from_bytes(os.urandom(4), "little")),
            stop=pick("stop", []),
            speculative=pick("speculative", SpeculativeMode.AUTO.value),
            format=pick("format", None),
            tool_choice=pick("tool_choice", ToolChoice.AUTO.value),
            parallel_tool_calls=pick("parallel_tool_calls", True),
            logprobs=pick("logprobs", None),
            priority=pick("priority", 0),
        )
        problems = []
        if isinstance(params.tool_choice, str):
            try:
                params.tool_choice = ToolChoice(params.tool_choice)
            except ValueError:
                problems.append("tool_choice must be auto, none, required or a function ({name})")
        else:  # a named function: exactly one call of it (as vLLM constrains it)
            params.parallel_tool_calls = False
        if params.logprobs is not None and not 0 <= params.logprobs <= MOST_TOP_LOGPROBS:
            problems.append(f"logprobs must be within 0..{MOST_TOP_LOGPROBS}")
        try:
            params.speculative = SpeculativeMode(params.speculative)
        except ValueError:
            problems.append(f"speculative must be one of {', '.join(m.value for m in SpeculativeMode)}")
        else:
            if params.speculative in (SpeculativeMode.LOOKUP, SpeculativeMode.DRAFT) and not self.speculative:
                problems.append(f"speculative={params.speculative.value}: this model decodes one token per pass")
            elif params.speculative is SpeculativeMode.DRAFT and not self.drafter:
                problems.append("speculative=draft: this worker has no draft model (kvmux serve --draft-model)")
        if not 1 <= params.max_tokens <= self.max_tokens_limit:
            problems.append(f"max_tokens must be within 1..{self.max_tokens_limit} (the worker's --max-tokens-limit)")
        if params.priority not in PRIORITIES:
            problems.append(f"priority must be within {PRIORITIES[0]}..{PRIORITIES[-1]}")
        if params.temperature < 0:
            problems.append("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if params.top_k < 0:
            problems.append("top_k must be >= 0")
        elif params.top_k >= self.model.args.vocab_size:
            params.top_k = 0  # the whole vocabulary: no top-k (mlx-lm's apply_top_k would raise)
        if any(not s for s in params.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "; ".join(problems))
        return params

    def calls_tools(self, session: LiveSession, params: GenerationParams) -> bool:
        """Whether this generation's reply is read for tool calls."""
        return bool(session.tools) and params.tool_choice != ToolChoice.NONE

    def constrain(self, session: LiveSession, params: GenerationParams) -> None:
        """Give a generation its grammar (params.constraint): the calls of
        tool_choice required or a named function (a format then holds the
        answer a later turn gives); else the format's, which beside tools
        the model may call lets through calls or the formatted answer.
        invalid_argument for a grammar llguidance refuses or a choice of no
        tool."""
        params.constraint = None
        if not session.tools and params.tool_choice not in (ToolChoice.AUTO, ToolChoice.NONE):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "tool_choice: the session has no tools")
        answer = self.grammars.of_format(params.format) if params.format is not None else None
        calls, parallel = self.calls_tools(session, params), params.parallel_tool_calls
        marker, fmt = self.grammars.marker, self.tool_format
        forced = tool_calls.grammar(session.tools, params.tool_choice, parallel, fmt, marker) if calls else None
        if forced is not None:
            params.constraint = self.grammars.constraint(forced, "tool_choice")
        elif answer is not None:
            if calls:  # auto
                answer = self.grammars.either(tool_calls.calls_rules(session.tools, parallel, fmt, marker), answer)
            params.constraint = self.grammars.constraint(answer, "format")

    # ------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"token ids must be within 0..{vocab - 1}")

    # ------------------------------------------------------------ compute

    def _forward(self, session: LiveSession, tokens: mx.array, rows: bool) -> mx.array:
        if self.shared_passes:
            return forward.forward(self.model, [forward.Segment(tokens, session.slab, rows)], self.floors)[0]
        return self.model(tokens[None], cache=session.slab)[:, -1, :]

    def prefill(
        self,
        session: LiveSession,
        chunk: Callable[[], int],
        block: int = 0,
        at: tuple[int, Callable[[], None]] | None = None,
    ):
        """Run the session's pending tokens through its slab, `chunk()`
        tokens per step (the scheduler's pace), until done or cancelled.
        What a cancel leaves pending goes in with the next append or
        generate. Returns whether it was cancelled. `block`: no chunk
        crosses a multiple of it (an opening's shared prefixes end there,
        worker/prefixes.py); `at` (tokens, then): a chunk ends there, and
        then() is called once the slab holds that many tokens."""
        while session.pending:
            n = chunk()
            if block:
                n = min(n, block - len(session.history) % block)
            if at is not None and len(session.history) < at[0]:
                n = min(n, at[0] - len(session.history))
            tokens = session.pending[:n]
            logits, cancelled = yield Step(session, mx.array(tokens), rows=False)
            mx.eval(logits, [layer.state for layer in session.slab])
            session.logits = logits
            session.history.extend(tokens)
            session.replay.append(len(tokens))
            del session.pending[: len(tokens)]
            if at is not None and len(session.history) == at[0]:
                at[1]()
            if cancelled:
                return True
        return False

    def run_chunk(self, session: LiveSession, tokens: list[int]) -> mx.array:
        """Run tokens through the slab as one chunk (a single token as a
        decode step); the logits after the last."""
        logits = self._forward(session, mx.array(tokens), rows=len(tokens) == 1)
        mx.eval(logits, [layer.state for layer in session.slab])
        return logits

    def decode(self, session: LiveSession, params: GenerationParams):
        """Sample up to max_tokens tokens, each run through the slab; a
        coroutine of `Step`s and `NewToken`s that returns a `GenerationEnd`.

        Each step runs the token to feed (and, when speculating, the drafts
        after it) as decode rows; the pass's logits choose what stands and
        what follows (worker/decoding.py's Choice), the rest is taken back
        out of the slab, and each token that stands goes out (Emission).
        Every exit leaves the slab holding exactly the tokens sent and
        `logits` after the last of them.
        """
        if session.logits is None:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "nothing to continue from: append something first")
        choice = Choice(params, cpu_kernel.native_of(self.model))
        emission = Emission(self.tokenizer, params, self.eos)
        result = GenerationEnd(StopReason.CANCELLED, "")
        emitted, known = 0, None
        row = session.logits  # the logits `y` is drawn from (for its logprobs)
        y = choice.first(row)
        while True:
            rng = choice.rng(emitted)
            if choice.grammar and known is None:
                known = y.item()  # the grammar needs it now anyway: the lookup may as well use it
            offered = self._propose(session, params, y, known, params.max_tokens - emitted - 1, choice.sampling, rng)
            proposal, masks = choice.drafts(y, offered)  # `offered`: what was drafted (a draft cache settles by it)
            tokens = mx.concatenate([y, mx.array(proposal.tokens)]) if proposal else y
            logits, cancelled = yield Step(session, tokens, rows=True)
            kept, y_next, known = choice.next(logits, masks, proposal, rng, emitted)
            if proposal:
                session.drafting.update(len(proposal.tokens), kept)
                result.drafted += len(proposal.tokens)
                result.accepted += kept
                self.drafted += len(proposal.tokens)
                self.accepted += kept
            new = [y.item(), *(proposal.tokens[:kept] if proposal else [])]
            for i, token in enumerate(new):
                emitted += 1
                session.history.append(token)
                session.replay.append(1)
                # token i of `new` was drawn from the row before it
                text, reason, chances = emission.token(token, emitted, cancelled, row if i == 0 else logits[i - 1 : i])
                cancelled = yield NewToken(token, text, chances)
                if reason:
                    self._settle(session, len(tokens), i + 1, offered)
                    session.logits = logits[i : i + 1]
                    mx.eval(session.logits, [layer.state for layer in session.slab])
                    result.reason, result.text = reason, emission.text
                    self._remember(session, params, emitted)
                    return result
            self._settle(session, len(tokens), len(new), offered)
            y, row = y_next, logits[kept : kept + 1]

    def _propose(
        self,
        session: LiveSession,
        params: GenerationParams,
        y: mx.array,
        known: int | None,
        room: int,
        sampling: tuple | None,
        rng,
    ) -> Proposal | None:
        """Drafts to verify after `y` (its value `known` when a verify pass
        chose it, else still being computed), at most `room` of them; None to
        decode `y` alone. Lookup first (free), then the draft model."""
        mode = params.speculative
        if mode is SpeculativeMode.OFF or not self.speculative or room < 1:
            return None
        k = min(session.drafting.allowed(), room)
        if not k:
            return None
        sources = [] if mode is SpeculativeMode.DRAFT else [session.lookup]
        if mode is not SpeculativeMode.DRAFT and not params.temperature:
            # Other sessions' replies; greedy only: a sampled reply must
            # repeat from its seed, whatever the worker saw since.
            sources.append(self.recent)
        session.lookup.follow(session.history)
        drafter = self.drafter if mode is not SpeculativeMode.LOOKUP else None
        # Waiting for `y` would stall the pipelined decode: without a draft
        # model, only where the history so far already matches something.
        if known is None and not drafter and not any(source.propose(session.history[-32:], 1) for source in sources):
            return None
        last = y.item() if known is None else known
        context = [*session.history[-32:], last]
        for source in sources:
            drafts = source.propose(context, k)
            if drafts:
                return Proposal(drafts)
        if drafter:
            return drafter.propose(session.draft, session.history, last, k, sampling, rng)
        return None

    def _settle(self, session: LiveSession, ran: int, kept: int, proposal: Proposal | None) -> None:
        """After a step: of the `ran` tokens run through the slab, `kept`
        are in the history; take the rest back out (of the draft cache too)."""
        rewind(session.slab, ran - kept)
        if proposal and proposal.drafted:
            self.drafter.settle(session.draft, kept)

    def _remember(self, session: LiveSession, params: GenerationParams, emitted: int) -> None:
        """A finished reply goes into the worker-wide lookup."""
        if self.speculative and params.speculative is not SpeculativeMode.OFF:
            self.recent.extend([*session.history[-emitted:], SEPARATOR])

    def forward_batch(self, steps: list[Step]) -> list[mx.array]:
        """The logits of each step's tokens (see `Step`), in one shared pass
        where the model allows it (lazy: computed when a session reads them)."""
        if len(steps) > 1 and self.loaded.stages:
            # A worker group: a pass per rank, in flight together, so that its stages overlap.
            with self.loaded.stages.overlapped():
                return [
                    logits
                    for batch in _split(steps, self.loaded.stages.layout.ranks)
                    for logits in forward.forward(self.model, _segments(batch), self.floors)
                ]
        if len(steps) > 1 and self.shared_passes:
            return forward.forward(self.model, _segments(steps), self.floors)
        return [self._forward(s.session, s.tokens, s.rows) for s in steps]


def _segments(steps: list[Step]) -> list[forward.Segment]:
    return [forward.Segment(s.tokens, s.session.slab, s.rows) for s in steps]


def _split(steps: list[Step], parts: int) -> list[list[Step]]:
    """`steps` in at most `parts` runs of about as many tokens each."""
    total = sum(s.tokens.shape[0] for s in steps)
    batches, done = [[]], 0
    for step in steps:
        if batches[-1] and done >= total * len(batches) / parts:
            batches.append([])
        batches[-1].append(step)
        done += step.tokens.shape[0]
    return batches
