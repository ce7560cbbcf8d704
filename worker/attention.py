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
its group (no repeated keys). On MLX's CPU backend the softmax over many
scores runs in NumPy: MLX's CPU `exp` is scalar, ~25x slower than NumPy's
vectorised one on the same cores, and it was most of the cost of attending
over a full window (docs/design.md). `attend_all` evaluates the scores of
every segment of a forward pass at once, so that costs one synchronisation
per layer, not one per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .slab import SlabCache

# On a GPU the softmax stays in MLX (and in the lazy graph); on a CPU too
# while every segment's scores are few (a decode step over a short cache),
# where NumPy would cost more in synchronisation than it saves.
NUMPY_SOFTMAX = mx.default_device() == mx.cpu
NUMPY_FROM = 8192  # score elements of one segment


@dataclass
class _Pending:
    """One segment's attention at one layer, between scores and output."""

    scores: list[mx.array]  # per block: (1, kv heads, group * n, slots)
    values: list[mx.array]  # per block: (1, kv heads, slots, head dim)
    mask: np.ndarray | None  # additive (n, slots of every block), 0 or -inf
    n: int
    write: tuple[SlabCache, mx.array, mx.array] | None = None  # new tokens to store once read


def additive_mask(cache: SlabCache, n: int) -> np.ndarray | None:
    """The additive mask (0 or -inf) of `n` new tokens over the slab as it
    stands and themselves; None for a decode step, which sees every slot.
    The same for every layer of a slab, so a pass makes it once."""
    if n == 1:
        return None
    return np.where(cache.visible(n), np.float32(0), np.float32(-np.inf))


def _plan(rows: mx.array, values: mx.array, cache: SlabCache, mask: np.ndarray | None, n_heads: int) -> _Pending:
    """Scores of one segment's rows on one layer of its slab. `rows` is (n,
    heads + kv heads, 1, D): scaled, rotated queries then keys, a token per
    row; `values` is (n, kv heads, 1, D)."""
    n, _, _, head_dim = rows.shape
    kv_heads = values.shape[1]
    if n == 1:  # a decode step: the row's layout already groups heads by KV head
        grouped = rows[0, :n_heads].reshape(1, kv_heads, -1, head_dim)
        ring_k, ring_v = cache.update_and_fetch(
            rows[0, n_heads:].reshape(1, kv_heads, 1, head_dim), values.reshape(1, kv_heads, 1, head_dim)
        )
        return _Pending([grouped @ ring_k.swapaxes(-1, -2)], [ring_v], None, 1)
    # Heads h*g .. h*g+g-1 share KV head h: a (g*n, D) block of queries per KV head.
    grouped = rows[:, :n_heads].transpose(2, 1, 0, 3).reshape(1, kv_heads, -1, head_dim)
    keys = rows[:, n_heads:].transpose(2, 1, 0, 3)
    values = values.transpose(2, 1, 0, 3)
    blocks_k, blocks_v = [keys], [values]
    if cache.keys is not None:  # the slab as it stands, then the new tokens
        blocks_k.insert(0, cache.keys)
        blocks_v.insert(0, cache.values)
    scores = [grouped @ k.swapaxes(-1, -2) for k in blocks_k]
    return _Pending(scores, blocks_v, mask, n, (cache, keys, values))


def _softmax(pending: _Pending, numpy: bool) -> list[mx.array]:
    """Probabilities per block, in NumPy or in MLX."""
    edges = np.cumsum([b.shape[-1] for b in pending.scores])[:-1].tolist()
    if not numpy:
        s = mx.concatenate(pending.scores, axis=-1) if len(pending.scores) > 1 else pending.scores[0]
        if pending.mask is not None:
            s = (s.reshape(*s.shape[:2], -1, pending.n, s.shape[-1]) + mx.array(pending.mask)).reshape(s.shape)
        p = mx.softmax(s, axis=-1, precise=True)
        return mx.split(p, edges, axis=-1) if edges else [p]
    blocks = [np.asarray(s) for s in pending.scores]
    s = np.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0].copy()  # ours to write in place
    if pending.mask is not None:
        s.reshape(*s.shape[:2], -1, pending.n, s.shape[-1])[...] += pending.mask
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s *= 1 / s.sum(axis=-1, keepdims=True)
    # One copy into MLX per block, contiguous for the value product.
    return [mx.array(b) for b in np.split(s, edges, axis=-1)]


def attend_all(
    rows: mx.array, values: mx.array, segments: list[tuple[int, int, SlabCache, np.ndarray | None]], n_heads: int
) -> mx.array:
    """The attention output (1, tokens, heads * D) of a pass: `rows` (tokens,
    heads + kv heads, 1, D) holds every token's scaled, rotated query and
    key, `values` (tokens, kv heads, 1, D) its value, and each (start, n,
    cache, mask) segment attends over its own slab, which gets its new
    tokens."""
    pending = [
        _plan(rows[start : start + n], values[start : start + n], cache, m, n_heads) for start, n, cache, m in segments
    ]
    numpy = NUMPY_SOFTMAX and any(sum(s.size for s in p.scores) >= NUMPY_FROM for p in pending)
    if numpy:
        mx.eval([p.scores for p in pending])
    outputs = []
    for p in pending:
        probs = _softmax(p, numpy)
        out = probs[0] @ p.values[0]
        for w, v in zip(probs[1:], p.values[1:], strict=True):
            out = out + w @ v
        if p.write:
            # Store the new tokens only after the slab was read: MLX updates
            # the slab's buffer in place, and would otherwise overwrite slots
            # this output still reads.
            cache, keys, new_values = p.write
            cache.write(*mx.depends([keys, new_values], [out]))
        # (1, kv heads, group * n, D) -> (1, n, heads * D)
        head_dim = out.shape[-1]
        outputs.append(out.reshape(n_heads, p.n, head_dim).transpose(1, 0, 2).reshape(1, p.n, -1))
    return mx.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
