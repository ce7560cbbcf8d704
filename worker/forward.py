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

from .attention import attend_all
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
    tokens = mx.concatenate([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
    h = model.model.embed_tokens(tokens[None])
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        parts = []
        for segment, start, n in zip(segments, starts, lengths, strict=True):
            cache = segment.slab[index]

            def heads(a: mx.array, count: int, start=start, n=n) -> mx.array:
                return a[:, start : start + n].reshape(1, n, count, -1).transpose(0, 2, 1, 3)

            q = attn.rope(heads(queries, attn.n_heads), offset=cache.offset)
            k = attn.rope(heads(keys, attn.n_kv_heads), offset=cache.offset)
            parts.append((q, k, heads(values, attn.n_kv_heads), cache))
        outs = [o.transpose(0, 2, 1, 3).reshape(1, o.shape[2], -1) for o in attend_all(parts, attn.scale)]
        h = h + attn.o_proj(mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = mx.array([start + n - 1 for start, n in zip(starts, lengths, strict=True)])
    h = model.model.norm(h[:, last])
    logits = model.model.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return [logits[:, i] for i in range(len(segments))]
