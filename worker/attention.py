"""Attention over a session's slab, for any number of new tokens, without
reordering or copying the slab.

A query at position P sees the sink and the last `window` positions up to
P, itself included, whether its token came alone, in a prefill chunk or in
a speculative verify pass (worker/slab.py).

- Rows (a decode step's one token, or a verify pass's last token and its
  drafts): the new keys are written into the ring first, then each row
  attends over the slots a one-token step at its position reads (those up
  to P's, rounded up to the slab's growth step: all of them once it is
  full), masked by the position each slot holds.
  A row's scores, softmax and weighted sum are computed by the same calls
  with the same shapes whether it came alone or with k others (a matmul
  per row and KV head), so a verify pass gives each position the logits a
  one-token step gives it, bit for bit where the projections are padded
  too (worker/padding.py; docs/design.md, "Speculative decoding").
- A prefill chunk: its queries attend over two blocks, the slab as it
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

Where kvmux_native runs the model, every segment of a pass attends in one
op a layer by the same rules (`_attend_native`), over slabs that keep their
keys and values in float16 (SLAB_DTYPE; docs/design.md, "Float16 slabs").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .slab import SlabCache

# What kvmux_native's attention keeps in a slab: float16 keys and values,
# half the bytes a token reads at a full window (float32 products).
SLAB_DTYPE = mx.float16

# On a GPU the softmax stays in MLX (and in the lazy graph); on a CPU too
# while every segment's scores are few (a decode step over a short cache),
# where NumPy would cost more in synchronisation than it saves.
NUMPY_SOFTMAX = mx.default_device() == mx.cpu
NUMPY_FROM = 8192  # score elements of one segment


@dataclass
class _Block:
    """Scores of some queries of one segment at one layer, and the values
    they weigh, between the score matmul and the weighted sum."""

    scores: list[mx.array]  # per part of the slab: (batch, kv heads, group * rows, slots)
    values: list[mx.array]  # per part: (1, kv heads, slots, head dim)
    mask: np.ndarray | None  # additive 0 / -inf: (rows, slots of every part)
    rows: int
    numpy: bool  # softmax in NumPy
    per_row: bool  # scores laid out (rows, kv, group, slots), else (1, kv, group * rows, slots)


@dataclass
class _Pending:
    """One segment's attention at one layer."""

    blocks: list[_Block]
    write: tuple[SlabCache, mx.array, mx.array] | None = None  # new tokens to store once read


def additive_mask(cache: SlabCache, n: int) -> np.ndarray:
    """The additive mask (0 or -inf) of a prefill chunk of `n` tokens over
    the slab as it stands and themselves. The same for every layer of a
    slab, so a pass makes it once."""
    return _additive(cache.visible(n))


def _additive(visible: np.ndarray) -> np.ndarray:
    return np.where(visible, np.float32(0), np.float32(-np.inf))


def row_masks(cache: SlabCache, n: int) -> list[tuple[int, int, int, np.ndarray | None]]:
    """For `n` rows about to be written at the slab's end: runs of rows
    (first, last + 1, slots they read, additive mask or None where every
    slot is seen). A row at P reads the slots up to P's, rounded up to the
    slab's growth step, as a one-token step at P does. Made before the
    write, once for every layer."""
    queries = cache.offset + np.arange(n)
    # Whole growth steps: the rows of a verify pass mostly read the same
    # slots (one block, not one per row); the slots past P are masked.
    reads = np.minimum(-(-(queries + 1) // cache.step) * cache.step, cache.max_size)
    positions = cache.positions(int(reads[-1]), ahead=n)
    runs, first = [], 0
    for i in range(1, n + 1):
        if i == n or reads[i] != reads[first]:
            slots = int(reads[first])
            sees = cache.sees(queries[first:i], positions[:slots])
            runs.append((first, i, slots, None if sees.all() else _additive(sees)))
            first = i
    return runs


def _plan_rows(queries: mx.array, keys: mx.array, values: mx.array, cache: SlabCache, runs) -> _Pending:
    """Scores of decode rows on one layer: their keys written first, then
    each run of rows against the slots it reads."""
    n_heads, head_dim = queries.shape[1], queries.shape[-1]
    kv_heads = keys.shape[1]
    cache.write(keys, values)
    blocks = []
    for first, last, length, mask in runs:
        # (rows, kv heads, group, D) @ (1, kv heads, D, slots): one (group x
        # D) @ (D x slots) product per row and KV head, whatever the rows.
        grouped = queries[first:last].reshape(last - first, kv_heads, -1, head_dim)
        blocks.append(
            _Block(
                [grouped @ cache.keys[..., :length, :].swapaxes(-1, -2)],
                [cache.values[..., :length, :]],
                mask,
                last - first,
                NUMPY_SOFTMAX and n_heads * length >= NUMPY_FROM,
                per_row=True,
            )
        )
    return _Pending(blocks)


def _attend_native(native, queries: mx.array, keys: mx.array, values: mx.array, segments: list[tuple]) -> mx.array:
    """Every segment of a pass (`segments`: (start, n, cache, plan with mx
    masks)) in one kvmux_native op: decode rows' keys written then read in
    their slabs, a chunk's rows over its slab as it stands and its own
    keys, its keys written after; the slabs in float16 (SLAB_DTYPE)."""
    slabs, writes, reads, masks, chunks = [], [], [], [], []
    for start, n, cache, plan in segments:
        _hold_as(cache, SLAB_DTYPE)
        chunk = not isinstance(plan, list)
        runs = [(0, n, plan.shape[1] - n, plan)] if chunk else plan  # a chunk's mask: the slab's columns, then its own
        claims = cache.claim(n, keys, SLAB_DTYPE)
        slabs += [cache.keys, cache.values]
        writes.append([x for slot, done, run in claims for x in (slot, start + done, run)])
        read = []
        for first, last, length, mask in runs:
            read += [start + first, start + last, length, -1 if mask is None else len(masks)]
            if mask is not None:
                masks.append(mask)
        reads.append(read)
        chunks.append(chunk)
    out, *updated = native.attend(queries, keys, values, slabs, writes, reads, masks, chunks)
    for (_, _, cache, _), k, v in zip(segments, updated[::2], updated[1::2], strict=True):
        cache.keys, cache.values = k, v
    return out


def _hold_as(cache: SlabCache, dtype: mx.Dtype) -> None:
    """The slab's arrays in `dtype`, converted once where they arrive in
    another (a snapshot or a prefix written by a worker on the other path:
    float16 where kvmux_native runs the model, the model's floats else)."""
    if cache.keys is not None and cache.keys.dtype != dtype:
        cache.keys, cache.values = cache.keys.astype(dtype), cache.values.astype(dtype)


def _plan_chunk(
    queries: mx.array, keys: mx.array, values: mx.array, cache: SlabCache, mask: np.ndarray | mx.array
) -> _Pending:
    """Scores of a prefill chunk's rows on one layer of its slab."""
    n, _, _, head_dim = queries.shape
    kv_heads = keys.shape[1]
    # Heads h*g .. h*g+g-1 share KV head h: a (g*n, D) block of queries per KV head.
    grouped = queries.transpose(2, 1, 0, 3).reshape(1, kv_heads, -1, head_dim)
    parts_k, parts_v = [keys], [values]
    if cache.keys is not None:  # the slab as it stands, then the new tokens
        parts_k.insert(0, cache.keys)
        parts_v.insert(0, cache.values)
    scores = [grouped @ k.swapaxes(-1, -2) for k in parts_k]
    numpy = NUMPY_SOFTMAX and sum(s.size for s in scores) >= NUMPY_FROM
    return _Pending([_Block(scores, parts_v, mask, n, numpy, per_row=False)], (cache, keys, values))


def _softmax(block: _Block) -> list[mx.array]:
    """Probabilities per part, in NumPy or MLX. Rows are independent: each
    is masked, maxed, exponentiated and summed on its own."""
    edges = np.cumsum([b.shape[-1] for b in block.scores])[:-1].tolist()
    if not block.numpy:
        s = mx.concatenate(block.scores, axis=-1) if len(block.scores) > 1 else block.scores[0]
        p = mx.softmax(s if block.mask is None else _masked(block, s, mx.array(block.mask)), axis=-1, precise=True)
        return mx.split(p, edges, axis=-1) if edges else [p]
    parts = [np.asarray(s) for s in block.scores]
    s = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0].copy()  # ours to write in place
    if block.mask is not None:
        _masked(block, s, block.mask)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s *= 1 / s.sum(axis=-1, keepdims=True)
    # One copy into MLX per part, contiguous for the value product.
    return [mx.array(b) for b in np.split(s, edges, axis=-1)]


def _masked(block: _Block, s, mask):
    """Scores plus the block's additive (rows, slots) mask; NumPy scores in
    place."""
    if block.per_row:
        if isinstance(s, np.ndarray):
            s += mask.reshape(block.rows, 1, 1, -1)
            return s
        return s + mask.reshape(block.rows, 1, 1, -1)
    if isinstance(s, np.ndarray):
        s.reshape(*s.shape[:2], -1, block.rows, s.shape[-1])[...] += mask
        return s
    return (s.reshape(*s.shape[:2], -1, block.rows, s.shape[-1]) + mask).reshape(s.shape)


def attend_all(queries: mx.array, keys: mx.array, values: mx.array, segments: list[tuple], native=None) -> mx.array:
    """The attention output (1, tokens, heads * D) of a pass: `queries`
    (tokens, heads, 1, D) holds every token's scaled, rotated query,
    `keys` and `values` (1, kv heads, tokens, D) its rotated key and its
    value as a slab stores them, and each (start, n, cache, plan) segment
    attends over its own slab, which gets its new tokens; `plan` is
    `row_masks(...)` for decode rows, `additive_mask(...)` for a prefill
    chunk. `native`: the kvmux_native module where the model runs on it
    (worker/cpu_kernel.py): every segment attends in one op (their plans'
    masks as mx arrays: `native_masks`, forward.py's plan)."""
    if native is not None:
        return _attend_native(native, queries, keys, values, segments)
    total, n_heads = queries.shape[:2]
    pending = []
    for start, n, cache, plan in segments:
        _hold_as(cache, keys.dtype)
        part = (queries, keys, values)
        if (start, n) != (0, total):  # a shared pass: this segment's tokens
            part = (queries[start : start + n], keys[..., start : start + n, :], values[..., start : start + n, :])
        if isinstance(plan, list):
            pending.append(_plan_rows(*part, cache, plan))
        else:
            pending.append(_plan_chunk(*part, cache, plan))
    numpy = [b.scores for p in pending for b in p.blocks if b.numpy]
    if numpy:
        mx.eval(numpy)
    outputs = []
    for p in pending:
        for block in p.blocks:
            probs = _softmax(block)
            out = probs[0] @ block.values[0]
            for w, v in zip(probs[1:], block.values[1:], strict=True):
                out = out + w @ v
            if p.write:
                # Store a chunk's tokens only after the slab was read: MLX
                # updates the slab's buffer in place, and would otherwise
                # overwrite slots this output still reads.
                cache, keys, new_values = p.write
                cache.write(*mx.depends([keys, new_values], [out]))
            # -> (1, rows, heads * D)
            if block.per_row:  # (rows, kv heads, group, D): a row's heads in order already
                outputs.append(out.reshape(1, block.rows, -1))
            else:
                head_dim = out.shape[-1]
                outputs.append(out.reshape(n_heads, block.rows, head_dim).transpose(1, 0, 2).reshape(1, block.rows, -1))
    return mx.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]


def native_masks(runs: list[tuple[int, int, int, np.ndarray | None]]) -> list[tuple[int, int, int, mx.array | None]]:
    """`row_masks`' runs with their masks as mx arrays, for kvmux_native
    (made once a pass, not once a layer)."""
    return [(first, last, length, None if mask is None else mx.array(mask)) for first, last, length, mask in runs]
