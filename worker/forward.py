"""One forward pass for several sessions at once: each brings its own new
tokens (one for a decode step, a chunk for a prefill) and its own slab.

On a CPU (and a GPU) a pass is bound by reading the weights: running every
session's tokens through one pass reads them once. Embedding, projections,
MLP and head run on all the pass's tokens together; attention runs per
session on its own slab (worker/attention.py), so slabs stay separate and
sessions of any length, sink and window share a pass, a prefill chunk
included.

Written against mlx-lm's llama module (the embedded model's); other
architectures run through their own mlx-lm module, a session at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama

from .attention import additive_mask, attend_all
from .slab import SlabCache


@dataclass
class Segment:
    """A session's share of a pass: its new tokens and its slab."""

    tokens: mx.array  # (n,) token ids
    slab: list[SlabCache]


def supported(model: nn.Module) -> bool:
    return type(model) is llama.Model and not any(layer.use_sliding for layer in model.model.layers)


def forward(model: llama.Model, segments: list[Segment]) -> list[mx.array]:
    """The logits (1, vocab) after each segment's last token (lazy)."""
    lengths = [s.tokens.shape[0] for s in segments]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    tokens = mx.concatenate([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
    h = model.model.embed_tokens(tokens[None])
    offsets = [segment.slab[0].offset for segment in segments]  # every layer's, before this pass
    positions = mx.array([offset + i for offset, n in zip(offsets, lengths, strict=True) for i in range(n)])
    masks = [additive_mask(segment.slab[0], n) for segment, n in zip(segments, lengths, strict=True)]
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        # Queries scaled here, once for the pass (rope is linear), then
        # queries and keys of every token rotated in one rope call: MLX's
        # CPU rope costs ~0.13 ms a call whatever its size.
        rows = mx.concatenate(
            [
                (attn.q_proj(x) * attn.scale).reshape(total, attn.n_heads, 1, -1),
                attn.k_proj(x).reshape(total, attn.n_kv_heads, 1, -1),
            ],
            axis=1,
        )
        rows = attn.rope(rows, offset=positions)
        values = attn.v_proj(x).reshape(total, attn.n_kv_heads, 1, -1)
        here = [(start, n, s.slab[index], m) for start, n, s, m in zip(starts, lengths, segments, masks, strict=True)]
        h = h + attn.o_proj(attend_all(rows, values, here, attn.n_heads))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = mx.array([start + n - 1 for start, n in zip(starts, lengths, strict=True)])
    h = model.model.norm(h[:, last])
    logits = model.model.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return [logits[:, i] for i in range(len(segments))]
