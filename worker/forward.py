"""One forward pass for several sessions at once: each brings its own new
tokens (a decode step's one token, a verify pass's last token and drafts,
or a prefill chunk) and its own slab.

On a CPU (and a GPU) a pass is bound by reading the weights: running every
session's tokens through one pass reads them once. Embedding, projections,
MLP and head run on all the pass's tokens together; attention runs per
session on its own slab (worker/attention.py), so slabs stay separate and
sessions of any length, sink and window share a pass, a prefill chunk
included. Where kvmux_native runs the model (worker/cpu_kernel.py), a
llama-style layer is three of its ops around the slab (`cpu_kernel.fused`).

Decode rows can be row-invariant: a row's logits need not depend on what
else is in the pass. Attention makes them so by construction. The
projections are matmuls, and BLAS picks its kernel by the matrix's shape:
OpenBLAS sums a row of a 1-row product in another order than the same row
of a 7-row one (AVX-512 kernels, some shapes), or by where the row sits
(AVX2 kernels). `calibrate` finds, per projection, the fewest rows from
which every row count gives identical rows, and a pass given those
`Floors` pads each projection's rows to its floor; where no row count
does (rows depend on where they sit), a pass given `rows_alone` runs each
decode row's products alone. worker/padding.py decides whether a worker
does either (docs/design.md, "Batch invariance").

Written against mlx-lm's llama, qwen2, qwen3 and gemma3_text modules
(`supported`): the same block with q/k norms where the model has them, and
Gemma 3's four norms per layer, GELU and scaled embeddings. A model with
sliding-window layers (Gemma 3) has two kinds of slab cache, the session's
sink and window and the layer's own window: each kind gets its masks
(worker/slab.py `make_slab`). Other architectures run through their own
mlx-lm module, a session at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
from mlx import nn
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu

from . import cpu_kernel
from .attention import additive_mask, attend_all, native_masks, row_masks
from .slab import SlabCache


@dataclass
class Segment:
    """A session's share of a pass: its new tokens and its slab. `rows`
    (decode rows: one token, or a verify pass's tokens) gives the logits
    after every token, else (a prefill chunk) after the last only."""

    tokens: mx.array | None  # (n,) token ids (None on a worker group's later ranks: they get the residual stream)
    slab: list[SlabCache]
    rows: bool = False


@dataclass
class Floors:
    """Rows each projection is padded to (see `calibrate`); `rows_alone`:
    the kernels' rows depend on where they sit in a product, which no
    padding mends, so decode rows run their products one row at a time."""

    q: int = 1
    k: int = 1
    v: int = 1
    o: int = 1
    gate: int = 1
    up: int = 1
    down: int = 1
    head: int = 1
    rows_alone: bool = False


_MODELS = (llama.Model, qwen2.Model, qwen3.Model, gemma3_text.Model)


def supported(model: nn.Module) -> bool:
    if type(model) is llama.Model:  # llama's own sliding layers would need its layer_types here
        return not any(layer.use_sliding for layer in model.model.layers)
    return type(model) in _MODELS


def _gemma(model: nn.Module) -> bool:
    return type(model) is gemma3_text.Model


Runs = list[tuple[int, int]] | None  # a pass's rows as products of their own (None: one product)


def _padded(f: Callable[[mx.array], mx.array], x: mx.array, floor: int, runs: Runs = None) -> mx.array:
    """f over x's rows (axis 1), run on at least `floor` rows, or run by run."""
    if runs is not None:
        return mx.concatenate([f(x[:, start:end]) for start, end in runs], axis=1)
    rows = x.shape[1]
    if rows >= floor:
        return f(x)
    pad = mx.zeros((x.shape[0], floor - rows, *x.shape[2:]), x.dtype)
    return f(mx.concatenate([x, pad], axis=1))[:, :rows]


def _floor(f: Callable[[mx.array], mx.array], width: int, counts: list[int]) -> int | None:
    """The fewest rows from which `f` gives every row the same bits for
    every row count in `counts`, wherever the row sits; None where a row's
    bits depend on where it sits (no row count mends that)."""
    most = max(counts)
    x = mx.random.normal((1, most, width), key=mx.random.key(most + width))
    whole = f(x)
    shifted = f(mx.roll(x, 3, axis=1))
    mx.eval(whole, shifted)
    if not mx.array_equal(shifted, mx.roll(whole, 3, axis=1)).item():
        return None
    floor = 1
    for n in counts:
        if not mx.array_equal(f(x[:, :n]), whole[:, :n]).item():
            floor = n + 1
    return floor


def calibrate(model: nn.Module, most_rows: int) -> Floors:
    """Floors for a pass of up to `most_rows` rows (~1 s of small matmuls at
    load). Every layer's projections have the first layer's shapes, and BLAS
    picks its kernel by shape: the first layer's stand for all."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    counts = [*range(1, 33), 48, 64, 96, 128, 192, 256, most_rows]
    counts = sorted({n for n in counts if n <= most_rows})
    head_counts = [n for n in counts if n <= min(most_rows, 64)]  # the head's rows: decode rows and chunk ends
    linears = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
    linears |= {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
    floors = {name: _floor(linear, _width(linear), counts) for name, linear in linears.items()}
    floors["head"] = _floor(partial(_head, model), model.args.hidden_size, head_counts)
    if None in floors.values():
        return Floors(rows_alone=True)
    return Floors(**floors)


def _width(linear: nn.Module) -> int:
    """Input features of a Linear or a QuantizedLinear."""
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[1] * 32 // linear.bits
    return linear.weight.shape[1]


def _head(model: nn.Module, h: mx.array) -> mx.array:
    # A tied head has no lm_head (gemma3_text's sanitize pops it; it keeps
    # no tie_word_embeddings in its args).
    return model.lm_head(h) if "lm_head" in model else model.model.embed_tokens.as_linear(h)


def _embed(model: nn.Module, tokens: mx.array) -> mx.array:
    h = model.model.embed_tokens(tokens[None])
    if _gemma(model):  # as gemma3_text scales them, through bfloat16
        h = h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    return h


def _mlp(model: nn.Module, layer: nn.Module, h: mx.array, floors: Floors, runs: Runs) -> mx.array:
    """The residual stream after the layer's MLP, its projections padded one by one."""
    mlp = layer.mlp
    if _gemma(model):
        x = layer.pre_feedforward_layernorm(h)
        gate, up = _padded(mlp.gate_proj, x, floors.gate, runs), _padded(mlp.up_proj, x, floors.up, runs)
        return gemma3_text.clip_residual(
            h, layer.post_feedforward_layernorm(_padded(mlp.down_proj, nn.gelu_approx(gate) * up, floors.down, runs))
        )
    x = layer.post_attention_layernorm(h)
    gated = swiglu(_padded(mlp.gate_proj, x, floors.gate, runs), _padded(mlp.up_proj, x, floors.up, runs))
    return h + _padded(mlp.down_proj, gated, floors.down, runs)


def _runs(segments: list[Segment], lengths: list[int]) -> list[tuple[int, int]]:
    """A pass's rows as products of their own where rows depend on where
    they sit: each decode row alone (as a lone decode step's), prefill
    chunks together (their rows are compared with nothing)."""
    runs, at = [], 0
    for s, n in zip(segments, lengths, strict=True):
        if s.rows or n == 1:
            runs += [(i, i + 1) for i in range(at, at + n)]
        elif runs and runs[-1][1] == at and runs[-1][1] - runs[-1][0] > 1:
            runs[-1] = (runs[-1][0], at + n)
        else:
            runs.append((at, at + n))
        at += n
    return runs


def _plan(cache: SlabCache, segment: Segment, n: int, native: bool):
    """A segment's attention plan on layers with `cache`'s kind of slab;
    with kvmux_native, its masks as mx arrays (made once a pass)."""
    if segment.rows or n == 1:
        runs = row_masks(cache, n)
        return native_masks(runs) if native else runs
    mask = additive_mask(cache, n)
    return mx.array(mask) if native else mask


def forward(model: nn.Module, segments: list[Segment], floors: Floors) -> list[mx.array]:
    """Per segment, the logits (rows, vocab) after each of its tokens (decode
    rows) or after its last (a prefill chunk); lazy. Slabs longer than the
    model's layers end in layers another rank of a worker group holds
    (worker/group.py): the pass goes on there, and its last rank sends back
    the wanted rows."""
    lengths = [s.tokens.shape[0] for s in segments]
    tokens = mx.concatenate([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
    h = run_layers(model, _embed(model, tokens), segments, lengths, floors)
    wanted = [
        i
        for start, n, s in zip(_starts(lengths), lengths, segments, strict=True)
        for i in (range(start, start + n) if s.rows else [start + n - 1])
    ]
    held = len(model.model.layers)
    if len(segments[0].slab) > held:
        h = segments[0].slab[held].stages.run(h, segments, lengths, floors, wanted)
    else:
        h = h[:, mx.array(wanted)]
    alone = [(i, i + 1) for i in range(len(wanted))] if floors.rows_alone else None
    logits = _padded(partial(_head, model), model.model.norm(h), floors.head, alone)[0]
    out, at = [], 0
    for n, s in zip(lengths, segments, strict=True):
        count = n if s.rows else 1
        out.append(logits[at : at + count])
        at += count
    return out


def _starts(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths))]


def run_layers(model: nn.Module, h: mx.array, segments: list[Segment], lengths: list[int], floors: Floors) -> mx.array:
    """The residual stream (1, tokens, hidden) through the layers this
    process holds (`model.model.layers`, each segment's slab's first ones)."""
    starts, total = _starts(lengths), sum(lengths)
    layers = model.model.layers
    offsets = [segment.slab[0].offset for segment in segments]  # every layer's, before this pass
    positions = mx.array([offset + i for offset, n in zip(offsets, lengths, strict=True) for i in range(n)])
    # Masks depend on the slab's positions only: made once per kind of
    # layer cache (its sink and window), before any layer writes.
    native = cpu_kernel.native_of(model)
    plans: list[dict[tuple[int, int], object]] = [{} for _ in segments]
    for s, n, kinds in zip(segments, lengths, plans, strict=True):
        for cache in s.slab[: len(layers)]:
            if (cache.keep, cache.max_size) not in kinds:
                kinds[cache.keep, cache.max_size] = _plan(cache, s, n, native is not None)
    gemma = _gemma(model)
    runs = _runs(segments, lengths) if floors.rows_alone else None
    fusing = native is not None and floors == Floors()
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        here = []
        for start, n, s, kinds in zip(starts, lengths, segments, plans, strict=True):
            cache = s.slab[index]
            here.append((start, n, cache, kinds[cache.keep, cache.max_size]))
        if fusing and cpu_kernel.fused(layer):  # the same arithmetic in three ops instead of ~30
            h = cpu_kernel.attention_out(
                layer, h, attend_all(*cpu_kernel.attention_in(layer, h, positions), here, native)
            )
            h = cpu_kernel.mlp(layer, h)
            continue
        x = layer.input_layernorm(h)
        q = _padded(attn.q_proj, x, floors.q, runs).reshape(total, attn.n_heads, 1, -1)
        k = _padded(attn.k_proj, x, floors.k, runs).reshape(total, attn.n_kv_heads, 1, -1)
        v = _padded(attn.v_proj, x, floors.v, runs)
        if hasattr(attn, "q_norm"):  # qwen3, gemma3: over each head's vector
            q, k = attn.q_norm(q), attn.k_norm(k)
        # Queries scaled here, once for the pass (rope is linear), then
        # queries and keys of every token rotated in one rope call: MLX's
        # CPU rope costs ~0.13 ms a call whatever its size.
        rows = attn.rope(mx.concatenate([q * attn.scale, k], axis=1), offset=positions)
        queries, keys = rows[:, : attn.n_heads], rows[:, attn.n_heads :].transpose(2, 1, 0, 3)
        values = v.reshape(total, attn.n_kv_heads, 1, -1).transpose(2, 1, 0, 3)
        out = _padded(attn.o_proj, attend_all(queries, keys, values, here, native), floors.o, runs)
        h = gemma3_text.clip_residual(h, layer.post_attention_layernorm(out)) if gemma else h + out
        h = _mlp(model, layer, h, floors, runs)
    return h
