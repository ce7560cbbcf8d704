"""Sessions and the compute they need: chunked prefill and token-by-token
decode on a session's own slab.

Both are generators that yield at every chunk or token boundary, so the
scheduler can interleave sessions, batch their decode steps, and honour a
cancel at the next boundary.
A session's invariant: its slab holds every history token, and `logits` are
the model's output after the last one, so a generate may start sampling at
once and a cancelled or finished generation leaves slab and logits in step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from kvmux.protocol import (
    DEFAULT_MAX_APPEND_TOKENS,
    DEFAULT_MAX_TOKENS_LIMIT,
    ErrorCode,
    ProtocolError,
    Sampling,
    StopReason,
)

from . import forward
from .conversation import Conversation
from .model import LoadedModel
from .slab import SlabCache, live_bytes, make_slab
from .stops import StopMatcher

DEFAULT_MAX_TOKENS = 256
PREFILL_CHUNK = 128  # tokens per prefill step when no other session is decoding (else worker/pace.py)


@dataclass
class Session:
    id: str
    sink: int
    window: int
    slab: list[SlabCache]
    conversation: Conversation
    defaults: Sampling
    history: list[int] = field(default_factory=list)  # tokens in the slab (and dropped from it)
    pending: list[int] = field(default_factory=list)  # appended, not yet prefilled
    raw: bool = False  # last append was raw token ids: generate continues them, no template
    logits: mx.array | None = None
    last_used: float = field(default_factory=time.monotonic)
    # durable state (worker/durable.py)
    owner: str = ""
    created: float = field(default_factory=time.time)
    snapshot: str | None = None  # slab file in the store holding history[:snapshot_tokens]
    snapshot_tokens: int = 0
    replay: list[int] = field(default_factory=list)  # sizes of the chunks run since the snapshot
    restores: int = 0
    last_restore_s: float = 0.0

    @property
    def dropped(self) -> int:
        return self.slab[0].dropped

    @property
    def kv_live_bytes(self) -> int:
        return live_bytes(self.slab)


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]


@dataclass
class Step:
    """A job's ask at a boundary: run `tokens` (a decode step's one lazy
    token, or a prefill chunk) through the session's slab and send back the
    logits after the last; the scheduler runs every job's step in one pass."""

    session: Session
    tokens: mx.array
    decode: bool


@dataclass
class Decoded:
    """What one decode step produced: the token and the text now safe to send."""

    token: int
    text: str


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_sink: int,
        max_window: int,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        max_append_tokens: int = DEFAULT_MAX_APPEND_TOKENS,
    ):
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

    # ------------------------------------------------------------ sessions

    def slab_bytes(self, sink: int, window: int) -> int:
        return (sink + window) * self.loaded.kv_bytes_per_token

    def new_session(
        self, session_id: str, sink: int | None, window: int | None, system: str | None, defaults: Sampling | None
    ) -> Session:
        sink = self.max_sink if sink is None else sink
        window = self.max_window if window is None else window
        if not 0 <= sink <= self.max_sink:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"sink must be within 0..{self.max_sink}")
        if not 1 <= window <= self.max_window:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"window must be within 1..{self.max_window}")
        defaults = defaults or Sampling()
        self.params(Sampling(), defaults)  # validate the defaults now, not at the first generate
        return Session(
            id=session_id,
            sink=sink,
            window=window,
            slab=make_slab(len(self.model.layers), sink, window),
            conversation=Conversation(self.tokenizer, system),
            defaults=defaults,
        )

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
        )
        problems = []
        if not 1 <= params.max_tokens <= self.max_tokens_limit:
            problems.append(f"max_tokens must be within 1..{self.max_tokens_limit} (the worker's --max-tokens-limit)")
        if params.temperature < 0:
            problems.append("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if params.top_k < 0:
            problems.append("top_k must be >= 0")
        if any(not s for s in params.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "; ".join(problems))
        return params

    # ------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"token ids must be within 0..{vocab - 1}")

    # ------------------------------------------------------------ compute

    def _forward(self, session: Session, tokens: mx.array) -> mx.array:
        if self.shared_passes:
            return forward.forward(self.model, [forward.Segment(tokens, session.slab)])[0]
        return self.model(tokens[None], cache=session.slab)[:, -1, :]

    def prefill(self, session: Session, chunk: Callable[[], int], should_stop: Callable[[], bool]):
        """Run the session's pending tokens through its slab, `chunk()`
        tokens per step (a coroutine like `decode`). What a stop leaves
        pending goes in with the next append or generate."""
        while session.pending and not should_stop():
            tokens = session.pending[: chunk()]
            logits = yield Step(session, mx.array(tokens), decode=False)
            mx.eval(logits, [layer.state for layer in session.slab])
            session.logits = logits
            session.history.extend(tokens)
            session.replay.append(len(tokens))
            del session.pending[: len(tokens)]

    def run_chunk(self, session: Session, tokens: list[int]) -> mx.array:
        """Run tokens through the slab as one chunk; the logits after the last."""
        logits = self._forward(session, mx.array(tokens))
        mx.eval(logits, [layer.state for layer in session.slab])
        return logits

    def decode(
        self,
        session: Session,
        params: GenerationParams,
        emit: Callable[[Decoded], None],
        should_stop: Callable[[], bool],
    ):
        """Sample up to max_tokens tokens, each run through the slab.

        A coroutine: it yields a `Step` per token and is sent back the
        logits that follow it, so the scheduler can run one forward pass for
        every session with work at that moment (`forward_batch`). Returns
        (StopReason, generated text). As in mlx-lm's generate_step, the next token is
        computed asynchronously while this one is detokenized and sent.
        """
        if session.logits is None:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, "nothing to continue from: append something first")
        sampler = make_sampler(params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0, top_k=params.top_k)

        def sample(logits: mx.array, step: int) -> mx.array:
            # Reseed per step: sessions interleave on one global PRNG, and a
            # seed must give the same tokens however they interleave.
            if params.temperature:
                mx.random.seed((params.seed * 1_000_003 + step) & 0xFFFFFFFF)
            return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

        detok = self.tokenizer.detokenizer
        stops = StopMatcher(params.stop)
        y = sample(session.logits, 0)
        for step in range(params.max_tokens):
            logits = yield Step(session, y, decode=True)
            y_next = sample(logits, step + 1)
            mx.async_eval(y_next)
            token = y.item()
            session.history.append(token)
            session.replay.append(1)
            is_eos = token in self.eos
            if not is_eos:
                detok.add_token(token)
            reason = None
            if is_eos:
                reason = StopReason.EOS
            elif step + 1 == params.max_tokens:
                reason = StopReason.MAX_TOKENS
            elif should_stop():
                reason = StopReason.CANCELLED
            if reason:
                detok.finalize()
            text, hit = stops.push(detok.last_segment)
            if hit:
                reason = StopReason.STOP
            elif reason:
                text += stops.flush()  # nothing more can complete a stop string
            emit(Decoded(token, text))
            if reason:
                mx.eval(logits, [layer.state for layer in session.slab])
                session.logits = logits
                return reason, detok.text
            y = y_next

    def forward_batch(self, steps: list[Step]) -> list[mx.array]:
        """The logits after each step's tokens, in one shared pass where the
        model allows it (lazy: computed when a session reads them)."""
        if len(steps) > 1 and self.shared_passes:
            return forward.forward(self.model, [forward.Segment(s.tokens, s.session.slab) for s in steps])
        return [self._forward(s.session, s.tokens) for s in steps]
