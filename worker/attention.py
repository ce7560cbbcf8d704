"""Attention over a session's slab, for any number of new tokens, without
reordering or copying the slab.

A query at position P sees the sink and the last `window` positions up to
P, itself included, whether its token came alone or inside a chunk: the
rule a single decode step has always followed, so how a history was chunked
does not change what any token attends to.

- One new token: it is written into the slab in place first (mlx-lm's
  RotatingKVCache does that), then attends over every live slot, in slot
  order, with no mask.
- Several new tokens: their queries attend over two blocks, the slab as it
  stands (slots in ring order, masked by the position each slot holds) and
  the new keys (causal); the new keys are written into the ring after. The
  stock path instead put the ring in temporal order, concatenated the new
  keys and trimmed back: three copies of the slab per layer per chunk.

Grouped-query attention runs as one matmul per KV head over the queries of
its group (no repeated keys). On MLX's CPU backend the softmax runs in NumPy:
MLX's CPU `exp` is scalar, ~25x slower than NumPy's vectorised one on the
same cores, and it was most of the cost of attending over a full window
(bench/results/engine.json). `attend_all` evaluates the scores of every
segment of a forward pass at once, so that costs one synchronisation per
layer, not one per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .slab import SlabCache

# On a GPU the softmax stays in MLX (and in the lazy graph).
NUMPY_SOFTMAX = mx.default_device() == mx.cpu


@dataclass
class _Pending:
    """One segment's attention at one layer, between scores and output."""

    n_heads: int
    scores: list[mx.array]  # per block: (1, kv heads, group * n, slots)
    values: list[mx.array]  # per block: (1, kv heads, slots, head dim)
    mask: np.ndarray | None  # additive (n, slots of every block), 0 or -inf
    n: int
    write: tuple[SlabCache, mx.array, mx.array] | None = None  # new tokens to store once read


def _plan(queries: mx.array, keys: mx.array, values: mx.array, cache: SlabCache, scale: float) -> _Pending:
    """Scores for new tokens (rope applied) on one layer of a slab; writes
    the new keys and values into the slab."""
    _, n_heads, n, head_dim = queries.shape
    kv_heads = keys.shape[1]
    # Heads h*g .. h*g+g-1 share KV head h: a (g*n, D) block of queries per KV head.
    grouped = (queries * scale).reshape(1, kv_heads, -1, head_dim)
    if n == 1:
        ring_k, ring_v = cache.update_and_fetch(keys, values)
        return _Pending(n_heads, [grouped @ ring_k.swapaxes(-1, -2)], [ring_v], None, 1)
    mask = np.where(cache.visible(n), np.float32(0), np.float32(-np.inf))
    blocks_k, blocks_v = [keys], [values]
    if cache.keys is not None:  # the slab as it stands, then the new tokens
        blocks_k.insert(0, cache.keys)
        blocks_v.insert(0, cache.values)
    scores = [grouped @ k.swapaxes(-1, -2) for k in blocks_k]
    return _Pending(n_heads, scores, blocks_v, mask, n, (cache, keys, values))


def _softmax(pending: _Pending) -> list[mx.array]:
    """Probabilities per block, in NumPy on a CPU."""
    if not NUMPY_SOFTMAX:
        s = mx.concatenate(pending.scores, axis=-1) if len(pending.scores) > 1 else pending.scores[0]
        if pending.mask is not None:
            s = (s.reshape(*s.shape[:2], -1, pending.n, s.shape[-1]) + mx.array(pending.mask)).reshape(s.shape)
        p = mx.softmax(s, axis=-1, precise=True)
    else:
        blocks = [np.asarray(s) for s in pending.scores]
        s = np.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0].copy()
        if pending.mask is not None:
            shape = s.shape
            s = (s.reshape(*shape[:2], -1, pending.n, shape[-1]) + pending.mask).reshape(shape)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        p = mx.array(s)
    if len(pending.scores) == 1:
        return [p]
    edges = np.cumsum([b.shape[-1] for b in pending.scores])[:-1].tolist()
    return mx.split(p, edges, axis=-1)


def attend_all(segments: list[tuple[mx.array, mx.array, mx.array, SlabCache]], scale: float) -> list[mx.array]:
    """Attention output (1, heads, n, head dim) for each (queries, keys,
    values, cache) with rope applied; every cache gets its new keys."""
    pending = [_plan(q, k, v, cache, scale) for q, k, v, cache in segments]
    if NUMPY_SOFTMAX:
        mx.eval([p.scores for p in pending])
    outputs = []
    for p in pending:
        probs = _softmax(p)
        out = probs[0] @ p.values[0]
        for w, v in zip(probs[1:], p.values[1:], strict=True):
            out = out + w @ v
        outputs.append(out.reshape(1, p.n_heads, p.n, out.shape[-1]))
        if p.write:
            # Store the new tokens only after the slab was read: MLX updates
            # the slab's buffer in place, and would otherwise overwrite slots
            # this output still reads.
            cache, keys, values = p.write
            cache.write(*mx.depends([keys, values], [out]))
    return outputs
