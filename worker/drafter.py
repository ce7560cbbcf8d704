"""The draft model: a second, smaller (or cheaper) model that proposes the
next tokens for the verifier to check (`kvmux serve --draft-model`).

Each session has its own draft cache, a bounded slab like the verifier's
(same sink and window), that follows the session's history: before a draft
it is caught up on the tokens it has not seen, and after a verify pass the
drafts the verifier rejected are taken back out. A restored session's draft
cache starts empty and is caught up on the history its slab holds (the sink
and the window): the draft only proposes, so what it saw does not change
what the verifier outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import cpu_kernel, forward
from .model import LoadedModel
from .slab import SlabCache, rewind, widest
from .speculative import MAX_DRAFT, Proposal, argmax, distributions

CATCH_UP_CHUNK = 256


class DraftRefused(ValueError):
    """The draft model cannot serve this verifier (the worker exits 2: a
    configuration to fix, not a crash to retry)."""


def check_tokenizers(verifier: LoadedModel, draft: LoadedModel) -> None:
    """Drafts are token ids: the two vocabularies must be the same."""
    if verifier.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftRefused(
            f"draft model {draft.model_id}'s tokenizer differs from {verifier.model_id}'s: drafts would be other tokens"
        )


@dataclass
class DraftCache:
    slab: list[SlabCache]
    synced: int = 0  # history tokens the cache has followed
    fed: int = 0  # tokens run through it by the last proposal (`last` and all drafts but the final one)


class Drafter:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.batched = forward.supported(self.model)
        self.native = cpu_kernel.native_of(self.model)  # its argmax and sampler's distributions
        self.floors = forward.Floors()  # draft rows need not be row-invariant

    def new_cache(self, sink: int, window: int) -> DraftCache:
        return DraftCache(self.loaded.make_slab(sink, window, MAX_DRAFT))

    def _run(self, cache: DraftCache, tokens: list[int]) -> mx.array:
        """Logits after the last of `tokens`, run through the draft cache."""
        if self.batched:
            logits = forward.forward(self.model, [forward.Segment(mx.array(tokens), cache.slab)], self.floors)[0]
        else:
            logits = self.model(mx.array(tokens)[None], cache=cache.slab)[:, -1, :]
        return logits

    def propose(
        self, cache: DraftCache, history: list[int], last: int, k: int, sampling: tuple | None, rng
    ) -> Proposal:
        """Draft `k` tokens after history + [last]. `sampling` (temperature,
        top_p, top_k) draws them from the draft's distributions (kept for the
        verifier's rejection test); None takes its argmax."""
        bound = widest(cache.slab)
        if cache.synced == 0 and len(history) > bound.max_size:
            missing = history[: bound.keep] + history[-bound.window :]  # a restored session: what its slab holds
        else:
            missing = history[cache.synced :]
        cache.synced = len(history)
        missing = [*missing, last]
        for at in range(0, len(missing) - 1, CATCH_UP_CHUNK):
            self._run(cache, missing[at : min(at + CATCH_UP_CHUNK, len(missing) - 1)])
        logits = self._run(cache, missing[-1:])
        tokens, q = [], []
        cache.fed = k
        for i in range(k):
            if sampling is None:
                token = int(argmax(logits, self.native).item())
            else:
                dist = distributions(logits, *sampling, self.native)[0]
                q.append(dist)
                token = int(rng.choice(len(dist), p=dist))
            tokens.append(token)
            if i + 1 < k:
                logits = self._run(cache, [token])
        return Proposal(tokens, np.stack(q) if q else None, drafted=True)

    def settle(self, cache: DraftCache, kept: int) -> None:
        """After a verify pass, `kept` tokens from the last proposal's `last`
        on are in the history: take the rest of what was run back out."""
        valid = min(kept, cache.fed)
        rewind(cache.slab, cache.fed - valid)
        cache.synced += valid
        cache.fed = 0
