"""The GGUF architectures served, each onto mlx-lm's own model class: its
ModelArgs from the file's metadata, and llama.cpp's tensor names onto the
class's parameter names, with what llama.cpp's convert_hf_to_gguf.py did to
the weights undone (transformers' GGUF loader does the same on its side).

- llama: q and k are stored permuted into the interleaved rope layout:
  mlx-lm's traditional rope computes on them as they are. Llama 3.1's rope
  scaling is no metadata but a tensor, `rope_freqs`: a factor per frequency
  (`_FactoredRoPE`).
- qwen2 (q/k/v biases), qwen3 (q/k norms): stored as trained, NeoX rope.
- gemma3: norm weights are stored as 1 + w (llama.cpp's RMSNorm has no
  offset), mlx-lm's Gemma RMSNorm adds the 1 itself. What the file does not
  say is what llama.cpp hard-codes too: every 6th layer global, the others a
  sliding window with a rope base of 10000, queries scaled by the head
  size's root (the 27B, 62 layers, by hidden_size / heads').
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx import nn

Meta = dict[str, object]

# llama.cpp's names of the dense llama layout, and mlx-lm's.
_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_up": "mlp.up_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    module: str  # mlx_lm.models.<module>
    args: Callable[[Meta, str], dict]  # ModelArgs fields from the metadata (and the arch's key prefix)
    layer_names: dict[str, str] = field(default_factory=lambda: _LLAMA_NAMES)
    norm_shift: float = 0.0  # what the file adds to every norm weight


def _get(meta: Meta, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return value


def _common(meta: Meta, arch: str) -> dict:
    """What every architecture's file says alike (ModelArgs.from_dict drops
    the fields a class has not: qwen2's head_dim)."""
    heads = _get(meta, f"{arch}.attention.head_count")
    args = {
        "model_type": arch,
        "hidden_size": _get(meta, f"{arch}.embedding_length"),
        "num_hidden_layers": _get(meta, f"{arch}.block_count"),
        "intermediate_size": _get(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "rms_norm_eps": _get(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _get(meta, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _get(meta, f"{arch}.context_length"),
        "head_dim": meta.get(f"{arch}.attention.key_length"),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        args["rope_scaling"] = {"type": "linear", "factor": _get(meta, f"{arch}.rope.scaling.factor")}
    elif scaling != "none":
        raise ValueError(f"{arch} rope scaling {scaling!r} is not supported (linear only)")
    return args


def _llama(meta: Meta, arch: str) -> dict:
    return {**_common(meta, arch), "rope_traditional": True}


def _qwen3(meta: Meta, arch: str) -> dict:
    args = _common(meta, arch)
    args["head_dim"] = args["head_dim"] or args["hidden_size"] // args["num_attention_heads"]
    return args


def _gemma3(meta: Meta, arch: str) -> dict:
    args = {**_common(meta, arch), "head_dim": _get(meta, f"{arch}.attention.key_length")}
    if f"{arch}.final_logit_softcapping" in meta:
        raise ValueError("gemma3 with final logit softcapping is not supported (mlx-lm's gemma3_text has none)")
    window = meta.get(f"{arch}.attention.sliding_window")  # absent: every layer global
    wide = args["num_hidden_layers"] == 62  # the 27B
    return {
        **args,
        "model_type": "gemma3_text",
        "sliding_window": window or args["max_position_embeddings"],
        "sliding_window_pattern": 6 if window else 1,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": args["hidden_size"] // args["num_attention_heads"] if wide else args["head_dim"],
    }


ARCHITECTURES = {
    "llama": Architecture("llama", _llama),
    "qwen2": Architecture("qwen2", _common),
    "qwen3": Architecture("qwen3", _qwen3, {**_LLAMA_NAMES, **_QK_NORMS}),
    "gemma3": Architecture(
        "gemma3_text",
        _gemma3,
        {
            **_LLAMA_NAMES,
            **_QK_NORMS,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_shift=1.0,
    ),
}


class _FactoredRoPE(nn.Module):
    """A rope with llama.cpp's per-frequency factors (the file's `rope_freqs`,
    which convert_hf_to_gguf.py computes from Llama 3.1's rope_scaling):
    frequency i turns by pos * scale / (base^(2i/d) * factors[i]) radians.
    mx.fast.rope takes those periods as `freqs`, as mlx-lm's Llama3RoPE
    does with its own; the model's rope gives base, dims, layout and the
    linear scaling's scale, which llama.cpp applies on top of the factors."""

    def __init__(self, rope: nn.RoPE, factors: mx.array):
        super().__init__()
        if factors.shape != (rope.dims // 2,):
            raise ValueError(f"GGUF tensor rope_freqs has shape {factors.shape}, not ({rope.dims // 2},)")
        self.dims, self.traditional, self.scale = rope.dims, rope.traditional, rope.scale
        periods = rope.base ** (mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)
        self._freqs = periods * factors.astype(mx.float32)  # "_": not a parameter load_weights expects

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=self.scale, offset=offset, freqs=self._freqs
        )


def _renamer(arch: Architecture) -> Callable[[str], str]:
    layer = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(\w+)$")
    top = re.compile(r"^([a-z_]+)\.(\w+)$")

    def rename(name: str) -> str:
        if m := layer.match(name):
            if m[2] in arch.layer_names:
                return f"model.layers.{m[1]}.{arch.layer_names[m[2]]}.{m[3]}"
        elif (m := top.match(name)) and m[1] in _TOP_NAMES:
            return f"{_TOP_NAMES[m[1]]}.{m[2]}"
        raise ValueError(f"GGUF tensor {name} has no place in mlx-lm's {arch.module} model")

    return rename


def find(meta: Meta) -> Architecture:
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported ({', '.join(ARCHITECTURES)}); "
            "an mlx-lm model directory of it may be (mlx_lm.convert)"
        )
    return ARCHITECTURES[name]


def build(meta: Meta, weights: dict[str, mx.array]) -> tuple[nn.Module, dict[str, mx.array]]:
    """The mlx-lm model for the file's architecture (weights not loaded yet),
    and the file's tensors under the model's parameter names."""
    name = meta["general.architecture"]
    arch = find(meta)
    rename = _renamer(arch)
    factors = weights.pop("rope_freqs.weight", None)  # one tensor for every layer's rope
    weights = {rename(k): v for k, v in weights.items()}
    if arch.norm_shift:
        weights = {k: v - arch.norm_shift if k.endswith("norm.weight") else v for k, v in weights.items()}
    module = importlib.import_module(f"mlx_lm.models.{arch.module}")
    args = arch.args(meta, name)
    args["vocab_size"] = weights["model.embed_tokens.weight"].shape[0]
    args["tie_word_embeddings"] = "lm_head.weight" not in weights
    model = module.Model(module.ModelArgs.from_dict(args))
    if factors is not None:
        for layer in model.layers:
            layer.self_attn.rope = _FactoredRoPE(layer.self_attn.rope, factors)
    return model, model.sanitize(weights)
