"""A small random-weight Llama 3.1 GGUF, written as llama.cpp's
convert_hf_to_gguf.py writes a real one: q and k permuted into the
interleaved rope layout, the rope scaling as a `rope_freqs` tensor of
per-frequency factors (no metadata says it), Llama 3.1 Instruct's chat
template, and a byte-level BPE tokenizer that holds Llama 3's special tokens
whole. The vocabulary is the embedded SmolLM2 model's, with those special
tokens appended (Llama 3's own has 128k tokens): text tokenizes as SmolLM2's
does, `<|eot_id|>` and the rest as one token each.

The weights come from `reference_model()`, transformers' LlamaForCausalLM
with `rope_type: llama3`, so a test can compare the two."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

# Llama 3.1's real rope: base and scaling. With 16-dim heads, frequencies
# 0-3 keep their period, 4 is smoothed (x2.7) and 5-7 are slowed x8: the
# scaling shows within a few hundred positions.
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# The real Llama 3.1 Instruct template (tools, the ipython role), kept with
# the other families' in tests/data/templates (its README says where from).
TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "llama3.1.jinja"
CONTROL = 3  # llama.cpp's token type of a special token
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}


@functools.cache
def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges: the embedded model's, and the
    special tokens after them."""
    import gguf

    from kvmux.paths import default_model_path

    fields = gguf.GGUFReader(default_model_path()).fields
    tokens, types, merges = (fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "token_type", "merges"))
    return tokens + list(SPECIAL_TOKENS), types + [CONTROL] * len(SPECIAL_TOKENS), merges


def reference_model(seed: int = 0, rope_scaling: bool = True):
    """transformers' Llama 3.1 of DIMS over `vocabulary()`, every parameter
    random (norms too); `rope_scaling=False`: the same model's config with
    the plain rope, to load the same weights into."""
    import torch
    import transformers

    rope = {"rope_type": "llama3", "rope_theta": ROPE_THETA, **ROPE_SCALING}
    config = transformers.LlamaConfig(
        **DIMS,
        vocab_size=len(vocabulary()[0]),
        tie_word_embeddings=False,
        rope_parameters=rope if rope_scaling else {"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    model = transformers.LlamaForCausalLM(config).eval()
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def rope_factors(head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` for ROPE_SCALING (LlamaModel's
    generate_extra_tensors), transcribed: 1 for the fast frequencies,
    `factor` for the slow ones, smoothed between."""
    freqs = 1.0 / (ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = ROPE_SCALING["factor"], ROPE_SCALING["low_freq_factor"], ROPE_SCALING["high_freq_factor"]
    old_context = ROPE_SCALING["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotated
    halves interleaved (llama.cpp's rope pairs adjacent dimensions)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_llama3_gguf(path: str | Path, model=None) -> Path:
    """Write `model` (default: `reference_model()`) to `path` as a Llama 3.1
    GGUF in float32; returns the path."""
    import gguf

    path = Path(path)
    model = reference_model() if model is None else model
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    tokens, types, merges = vocabulary()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Llama 3.1 random test")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # the merges' own splitting
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|eot_id|>"))  # Llama 3.1 Instruct's files end on a turn's end
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE.read_text())

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors(head_dim))
    for name, tensor in model.state_dict().items():
        data = tensor.detach().numpy()
        if name.endswith("q_proj.weight"):
            data = _permute(data, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
