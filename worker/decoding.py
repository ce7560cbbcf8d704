"""One generation's tokens, for the engine's decode loop (Engine.decode):
its settings (`GenerationParams`), how each token is chosen (`Choice`:
greedy or seeded sampling, the grammar's masks, a verify pass's acceptance
of drafts) and how it goes out (`Emission`: its text once it is safe to
send, the stop it makes, its logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from kvmux.protocol import Format, Logprobs, NamedTool, SpeculativeMode, StopReason, TokenLogprob, ToolChoice

from .constraint import Constraint, masked
from .speculative import Proposal, accept_greedy, accept_sampled, argmax, distributions
from .stops import StopMatcher

# The sampler's uniform numbers come from NumPy generators seeded by (seed,
# step, SAMPLE_STREAM): apart from those of a verify pass's acceptance
# (`Choice.rng`, seeded by (seed, step)).
SAMPLE_STREAM = 1


@dataclass
class GenerationParams:
    """A generation's settings: the request's over the session's defaults (Engine.params)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    speculative: SpeculativeMode
    format: Format | None = None
    tool_choice: str | NamedTool = ToolChoice.AUTO
    parallel_tool_calls: bool = True
    logprobs: int | None = None  # top alternatives per token (0: the token's own only); None: none
    priority: int = 0  # higher first in the worker's passes (Sampling.priority)
    constraint: Constraint | None = None  # the grammar this generation follows (Engine.constrain)


class Choice:
    """Choosing a generation's tokens from the model's logits: greedy, or
    sampled with a seed per step (a seed must give the same tokens however
    sessions interleave), within the grammar's masks where it has one.

    Where kvmux_native runs the model (`native`), its sampler draws each
    token, in the lazy graph, by one uniform number from (seed, step): the
    distribution of mlx-lm's chain, whose MLX ops (a sort, exps over the
    vocabulary) cost a CPU step 1.9-9 ms a token. Elsewhere mlx-lm's
    sampler draws it from MLX's global PRNG, reseeded from (seed, step)."""

    def __init__(self, params: GenerationParams, native=None):
        self.params = params
        self.grammar = params.constraint
        self.native = native
        self.sampling = (params.temperature, params.top_p, params.top_k) if params.temperature else None
        if native is None:
            top_p = params.top_p if params.top_p < 1 else 0.0
            self._sampler = make_sampler(params.temperature, top_p=top_p, top_k=params.top_k)

    def sample(self, logits: mx.array, step: int) -> mx.array:
        if not self.sampling:
            return argmax(logits, self.native)  # on the logits as they are: the verify pass's choice too
        if self.native is not None:
            uniforms = np.random.default_rng([self.params.seed & 0xFFFFFFFF, step, SAMPLE_STREAM])
            rows = logits.size // logits.shape[-1]
            return self.native.sample(logits, *self.sampling, uniforms.random(rows).tolist())
        mx.random.seed((self.params.seed * 1_000_003 + step) & 0xFFFFFFFF)
        return self._sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def first(self, row: mx.array) -> mx.array:
        """The first token, from the logits after the prompt."""
        return self.sample(masked(row, self.grammar.allowed([])[1]) if self.grammar else row, 0)

    def rng(self, emitted: int) -> np.random.Generator | None:
        """The step's generator for drafting and accepting sampled drafts."""
        return np.random.default_rng([self.params.seed & 0xFFFFFFFF, emitted]) if self.sampling else None

    def drafts(self, y: mx.array, proposal: Proposal | None) -> tuple[Proposal | None, mx.array | None]:
        """`y` stands (the grammar takes it): the drafts to verify after it,
        those the grammar allows, and the pass's masks (None: no grammar)."""
        if not self.grammar:
            return proposal, None
        self.grammar.advance([y.item()])
        drafts, masks = self.grammar.allowed(proposal.tokens if proposal else [])
        return (proposal.cut(len(drafts)) if proposal else None), masks

    def next(
        self, logits: mx.array, masks: mx.array | None, proposal: Proposal | None, rng, emitted: int
    ) -> tuple[int, mx.array, int | None]:
        """After a pass: how many drafts stood, the token that follows them,
        and its value where it is known already (a verify pass chose it);
        without drafts it is sampled asynchronously, while the step's token
        is sent (as mlx-lm's generate_step does)."""
        choosing = masked(logits, masks) if self.grammar else logits
        if proposal is None:
            following = self.sample(choosing, emitted + 1)
            mx.async_eval(following)
            return 0, following, None
        if self.sampling:
            kept, token = accept_sampled(distributions(choosing, *self.sampling, self.native), proposal, rng)
        else:
            choices = argmax(choosing, self.native).tolist()
            kept = accept_greedy(choices, proposal.tokens)
            token = choices[kept]
        if self.grammar:
            self.grammar.advance(proposal.tokens[:kept])
        return kept, mx.array([token]), token


class Emission:
    """Sending a generation's tokens: the text each makes safe to send (a
    stop string may still be matching), the reason it ends the reply, and
    its logprobs where asked for."""

    def __init__(self, tokenizer, params: GenerationParams, eos: set[int]):
        self.detok = tokenizer.detokenizer
        self.decode = tokenizer.decode
        self.stops = StopMatcher(params.stop)
        self.max_tokens, self.logprobs = params.max_tokens, params.logprobs
        self.eos = eos

    def token(
        self, token: int, emitted: int, cancelled: bool, row: mx.array
    ) -> tuple[str, StopReason | None, Logprobs | None]:
        """The `emitted`th token, drawn from the logits `row`: its text, the
        reason the reply ends with it (None: it goes on), its logprobs."""
        is_eos = token in self.eos
        if not is_eos:
            self.detok.add_token(token)
        reason = None
        if is_eos:
            reason = StopReason.EOS
        elif emitted == self.max_tokens:
            reason = StopReason.MAX_TOKENS
        elif cancelled:
            reason = StopReason.CANCELLED
        if reason:
            self.detok.finalize()
        text, hit = self.stops.push(self.detok.last_segment)
        if hit:
            reason = StopReason.STOP
        elif reason:
            text += self.stops.flush()  # nothing more can complete a stop string
        chances = self._logprobs(row, token, self.logprobs) if self.logprobs is not None else None
        return text, reason, chances

    @property
    def text(self) -> str:
        """The whole reply's text."""
        return self.detok.text

    def _logprobs(self, row: mx.array, token: int, top: int) -> Logprobs:
        """`token`'s log-probability under the model's distribution `row`
        (its logits, before temperature, top-p or a grammar), and the `top`
        most likely tokens there. In NumPy, its sum in float64: MLX's CPU
        logsumexp and argpartition over a vocabulary took 0.8-1.7 ms a
        token (a scalar exp), NumPy's 0.2-0.5."""
        logits = np.asarray(row[0].astype(mx.float32))
        high = logits.max()
        logprobs = logits - np.float32(high + np.log(np.exp(logits - high).sum(dtype=np.float64)))
        best = []
        if top:
            ids = np.argpartition(-logprobs, top - 1)[:top].tolist()
            best = sorted(
                (TokenLogprob(t, float(logprobs[t]), self.decode([t])) for t in ids), key=lambda e: -e.logprob
            )
        return Logprobs(token=token, logprob=float(logprobs[token]), text=self.decode([token]), top=best)
