"""One decode step for several sessions at once.

On a CPU (and a GPU) a single-token step is bound by reading the weights;
running B sessions' tokens through one pass reads them once. Projections,
MLP and head run batched; attention runs per session on its own slab, so
slabs stay separate (no merge/extract copies) and sessions of any length,
sink and window batch together.

Written against mlx-lm's llama module (the embedded model's); other
architectures decode one session at a time.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention

from .slab import SlabCache


def supports_batching(model: nn.Module) -> bool:
    return type(model) is llama.Model and not any(layer.use_sliding for layer in model.model.layers)


def forward(model: llama.Model, tokens: mx.array, slabs: list[list[SlabCache]]) -> mx.array:
    """Logits (B, vocab) after running tokens[b] through slabs[b], for b < B."""
    batch = len(slabs)
    h = model.model.embed_tokens(tokens.reshape(batch, 1))
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        queries = attn.q_proj(x).reshape(batch, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
        keys = attn.k_proj(x).reshape(batch, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = attn.v_proj(x).reshape(batch, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        outputs = []
        for b, slab in enumerate(slabs):
            cache = slab[index]
            q = attn.rope(queries[b : b + 1], offset=cache.offset)
            k = attn.rope(keys[b : b + 1], offset=cache.offset)
            k, v = cache.update_and_fetch(k, values[b : b + 1])
            # One query row never needs a mask: the slab holds exactly what it may see.
            outputs.append(scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=None))
        out = mx.concatenate(outputs, axis=0).transpose(0, 2, 1, 3).reshape(batch, 1, -1)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.model.norm(h)
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)[:, -1, :]
    return model.lm_head(h)[:, -1, :]
