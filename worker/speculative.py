"""Speculative decoding's pieces: how many tokens a session drafts, and how
a verify pass's logits decide which drafts stand.

Greedy: the longest prefix of the drafts equal to the verifier's own
choices stands, then the verifier's next token. Sampling: the rejection
scheme of Leviathan et al. / Chen et al. (arXiv 2211.17192, 2302.01318): a
draft d drawn from q stands with probability min(1, p(d) / q(d)); on the
first rejection the next token is drawn from norm(max(p - q, 0)). The
tokens that come out are distributed exactly as plain sampling from p. A
lookup draft is a point mass (q(d) = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

MAX_DRAFT = 16  # drafted tokens per verify pass; the slab keeps as many spare slots
FIRST_DRAFT = 4
LONGEST_REST = 64  # decode steps a session that keeps missing goes without drafting


@dataclass
class Proposal:
    tokens: list[int]
    q: np.ndarray | None = None  # (k, vocab) the distributions they were drawn from; None: point masses
    drafted: bool = False  # by the draft model (whose cache ran them)

    def cut(self, n: int) -> Proposal | None:
        """The first `n` drafts (None for none); the draft cache ran them
        all, and settles by what stands."""
        if n == len(self.tokens):
            return self
        return Proposal(self.tokens[:n], None if self.q is None else self.q[:n], self.drafted) if n else None


@dataclass
class DraftLength:
    """A session's draft length, following its recent acceptance: longer
    after a run that was taken whole, shorter after a partial one, and a
    rest of 4, 8, ... 64 decode steps after repeated misses, so a session
    whose drafts keep failing costs nothing to plain decoding."""

    length: int = FIRST_DRAFT
    misses: int = 0
    rest: int = 0

    def allowed(self) -> int:
        """Tokens to draft at this step (0: resting)."""
        if self.rest:
            self.rest -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.length, self.misses = min(MAX_DRAFT, self.length * 2), 0
        elif accepted == 0:
            self.misses += 1
            self.length = max(1, self.length // 2)
            if self.misses >= 2:
                self.rest = min(LONGEST_REST, 4 << (self.misses - 2))
        else:
            self.length, self.misses = max(1, accepted + 1), 0


def accept_greedy(choices: list[int], drafts: list[int]) -> int:
    """How many drafts equal the verifier's choices, from the first."""
    accepted = 0
    while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


def argmax(logits: mx.array, native=None) -> mx.array:
    """Each row's first highest logit (mx.argmax's token): kvmux_native's
    op where it runs the model (MLX's CPU argmax is a scalar loop, ~60 us a
    row of SmolLM2's 49,152 logits, serial over a pass's sessions)."""
    return mx.argmax(logits, axis=-1) if native is None else native.sample(logits, 0.0, 1.0, 0, [])


def distributions(logits: mx.array, temperature: float, top_p: float, top_k: int, native=None) -> np.ndarray:
    """(rows, vocab) float64: the distribution plain sampling draws each
    row's token from (mlx-lm's sampler chain: top-p, top-k, temperature);
    kvmux_native's where it samples (`native`, decoding.Choice)."""
    if native is not None:
        probs = np.asarray(native.distribution(logits, temperature, top_p, top_k), dtype=np.float64)
        return probs / probs.sum(axis=-1, keepdims=True)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    scaled = np.asarray(logprobs * (1 / temperature), dtype=np.float64)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    return probs / probs.sum(axis=-1, keepdims=True)


def accept_sampled(p: np.ndarray, proposal: Proposal, rng: np.random.Generator) -> tuple[int, int]:
    """(drafts that stand, the token after them) for target distributions
    `p` (k + 1 rows) and the proposal's drafts."""
    for i, draft in enumerate(proposal.tokens):
        q = proposal.q[i] if proposal.q is not None else None
        q_draft = 1.0 if q is None else q[draft]
        if rng.random() * q_draft < p[i, draft]:
            continue
        residual = p[i].copy()
        if q is None:
            residual[draft] = 0.0
        else:
            residual = np.maximum(residual - q, 0.0)
        total = residual.sum()
        token = int(rng.choice(len(residual), p=residual / total)) if total > 0 else int(np.argmax(p[i]))
        return i, token
    last = len(proposal.tokens)
    return last, int(rng.choice(p.shape[1], p=p[last]))
