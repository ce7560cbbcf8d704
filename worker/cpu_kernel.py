"""kvmux's native CPU ops (worker/native, the `kvmux_native` extension):
chosen once per worker process, and the model's layers made to use them.

MLX's CPU backend has no fast quantized matmul on x86 (its kernel is
scalar and single-threaded there), so without this kernel a CPU worker
multiplies float32 copies of the weights: 5.6x the bytes a token reads
for a Q4_1 GGUF. With it the weights stay as the file stores them and
`x @ W.T` reads them so, on every x86 CPU (AVX-512, AVX2, or scalar) and
on Linux aarch64 (scalar). Its sums are row-invariant by construction
(a row's logits do not depend on what shares its pass: no padding). The
model's RMS norms and rotary embeddings become one op each too (MLX's CPU
runs each as a graph of 6 and ~20 small ops, and a decode step's time
there is as much the ops' count as their work).

Attention (worker/attention.py) becomes one op per layer too for an
adopted model (`native_of`), for every session of a pass (decode rows and
prefill chunks) and their slabs' writes, the slabs in float16, and a
llama-style layer's two halves around it one op each (`fused`: its norms,
seven products, rope, swiglu and residual adds, ~30 ops of MLX's
otherwise).

Layers in kvmux_native's modes iq4_nl (GGUF's IQ4_NL and IQ4_XS,
worker/gguf_file.py: 4-bit codes indexing a table of 16 values, scales,
no biases) and symmetric (Q3_K, Q4_0, Q5_0, Q6_K and Q8_0: codes centred
on 2^(bits - 1), no biases; worker/model.py's `_mode`) exist only where
this kernel runs; MLX has neither mode.

`select` says which kernel runs, or why none does (not built, built for
another mlx, a GPU, `off`); the worker then falls back to MLX's own
quantized layers on a GPU and float32 copies on a CPU, and `describe`
says so in Compute.

`--cpu-products int8` (`adopt(model, int8=True)`) opts into llama.cpp's
arithmetic: each 4- or 8-bit affine or symmetric weight matrix (in groups
of 32 or more: `_packable`) is packed once at load (`kvmux_native.pack`:
its rows interleaved by 16, its scales and biases beside them) and x is
quantized to int8 per 32 weights in every product
(worker/native/src/kernels.h, "int8 products"). Still row-invariant and
the same on every instruction set, but ~0.5 % off each product: tokens
differ from the exact products' wherever a choice was that close.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
from gguf.quants import IQ4_NL
from mlx import nn

from kvmux import logs

from .preload import CPU_THREADS_ENV, openblas_path, preloaded

try:
    import kvmux_native
except ImportError as exc:  # not built here, or built against another mlx
    kvmux_native, UNAVAILABLE = None, str(exc)
else:
    UNAVAILABLE = ""

log = logs.get("worker.cpu_kernel")

CHOICES = ("auto", "avx512", "avx2", "scalar", "off")
PRODUCTS = ("exact", "int8")
MODES = ("affine", "iq4_nl", "symmetric")  # the quantized layers' modes kvmux_native multiplies
SYMMETRIC_BITS = (3, 4, 5, 6, 8)  # the widths its symmetric mode takes
IQ4_LEVELS = mx.array(IQ4_NL.kvalues, mx.float32)  # what an iq4_nl code stands for


@dataclass(frozen=True)
class Kernel:
    """The kernel a worker runs (`isa` None: none, for `reason`) and its
    products' arithmetic (PRODUCTS)."""

    isa: str | None
    threads: int = 0
    reason: str = ""
    products: str = "exact"

    def describe(self) -> str:
        if self.isa is None:
            return f"none ({self.reason})"
        products = ", int8 products" if self.products == "int8" else ""
        return f"kvmux_native {self.isa}, {self.threads} threads{products}"


@cache
def select(choice: str = "auto") -> Kernel:
    """The kernel for `choice` (one of CHOICES), set up for this process:
    its instruction set and threads; OpenBLAS then keeps one thread (the
    kernel's ops compute a pass, attention included, and OpenBLAS's
    spinning threads would take the cores the kernel's threads need)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_kernel must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "off":
        return Kernel(None, reason="off")
    if mx.default_device() != mx.cpu:
        return Kernel(None, reason="a GPU: MLX's own quantized kernels")
    if kvmux_native is None:
        log.warning("cpu_kernel_unavailable", error=UNAVAILABLE)
        return Kernel(None, reason=f"not available: {UNAVAILABLE}")
    isa = kvmux_native.isas()[0] if choice == "auto" else choice
    if isa not in kvmux_native.isas():
        raise ValueError(f"cpu_kernel {isa}: this CPU runs {', '.join(kvmux_native.isas())}")
    kvmux_native.set_isa(isa)
    threads = int(os.environ.get(CPU_THREADS_ENV) or len(os.sched_getaffinity(0)))
    kvmux_native.set_threads(max(1, threads))
    _one_blas_thread()
    return Kernel(isa, kvmux_native.threads())


def _one_blas_thread() -> None:
    lib = openblas_path()
    if lib and preloaded():
        ctypes.CDLL(lib).openblas_set_num_threads(1)


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is kvmux_native's."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(self, x)
        return y + self["bias"] if "bias" in self else y


def product(module: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """x @ W.T (+ residual) by kvmux_native for an adopted quantized module."""
    return kvmux_native.qmatmul(
        x,
        module["weight"],
        module["scales"],
        module.get("biases"),
        module.group_size,
        module.bits,
        residual=residual,
        packed=packed(module),
        mode=module.mode,
    )


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose rows come out in float32 (as the float32
    copy's: q * scale + bias is exact there) and whose use as the head
    (a tied embedding) is kvmux_native's product."""

    def __call__(self, x: mx.array) -> mx.array:
        scales = self["scales"][x].astype(mx.float32)
        if self.mode == "affine" and self.group_size >= 32:
            biases = self["biases"][x].astype(mx.float32)
            return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits)
        # What mx.dequantize does not take, groups of 16 (GGUF's Q6_K, Q3_K,
        # Q2_K) and the other modes: the codes, then q * scale + bias,
        # level * scale or (q - 2^(bits - 1)) * scale, the same values (a
        # code or a level times such a scale is exact: worker/gguf_file.py).
        ones = mx.ones((*scales.shape[:-1], scales.shape[-1] * self.group_size // 32), mx.float32)
        q = mx.dequantize(self["weight"][x], ones, mx.zeros_like(ones), group_size=32, bits=self.bits)
        q, s = q.reshape(*scales.shape, self.group_size), scales[..., None]
        if self.mode == "iq4_nl":
            w = IQ4_LEVELS[q.astype(mx.int32)] * s
        elif self.mode == "symmetric":
            w = (q - 2 ** (self.bits - 1)) * s
        else:
            w = q * s + self["biases"][x].astype(mx.float32)[..., None]
        return w.reshape(*scales.shape[:-1], -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return product(self, x)


class RMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return kvmux_native.rms_norm(x, self["weight"], self.eps)


class RoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        offset = offset if isinstance(offset, mx.array) else mx.array(offset)
        return kvmux_native.rope(x, offset, self.dims, self.traditional, self.base, self.scale)


def native_of(model: nn.Module):
    """The kvmux_native module where `model` was adopted (`adopt`), else None."""
    return kvmux_native if model.__dict__.get(_ADOPTED_MARK) else None


_ADOPTED_MARK = "kvmux_native"
_ADOPTED = {
    nn.QuantizedLinear: QuantizedLinear,
    nn.QuantizedEmbedding: QuantizedEmbedding,
    nn.RMSNorm: RMSNorm,
    nn.RoPE: RoPE,
}


def adopt(model: nn.Module, int8: bool = False) -> None:
    """Make the model's affine quantized layers, RMS norms and (plain)
    rotary embeddings compute with kvmux_native (their parameters stay as
    they are: only the ops change); its other floats float32, what MLX's
    CPU computes fastest. `int8`: its 4- and 8-bit products take the int8
    products (each matrix packed once here, beside its parameters)."""
    model.__dict__[_ADOPTED_MARK] = True  # what forward.py asks (native_of): its attention goes native too
    for _, module in model.named_modules():
        kind = _ADOPTED.get(type(module))
        mode = getattr(module, "mode", "affine")
        if kind is not None and mode in MODES:
            module.__class__ = kind
            if int8 and kind in (QuantizedLinear, QuantizedEmbedding) and _packable(module):
                module.__dict__[_PACKED_MARK] = kvmux_native.pack(
                    module["weight"], module["scales"], _biases(module), module.group_size, module.bits
                )
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            floats = {k: v.astype(mx.float32) for k, v in module.items() if _is_float(v)}
            if floats:
                module.update(floats)
    for layer in getattr(getattr(model, "model", None), "layers", []):
        if _fusable(layer):
            attn, mlp = layer.self_attn, layer.mlp
            layer.__dict__[_FUSED_MARK] = (
                _projections(attn.q_proj, attn.k_proj, attn.v_proj),
                _projections(mlp.gate_proj, mlp.up_proj, mlp.down_proj),
            )


def _packable(module: nn.Module) -> bool:
    """Whether the int8 products take the module: 4 or 8 bits, affine or
    symmetric, a scale per 32 weights or more."""
    return module.bits in (4, 8) and module.mode != "iq4_nl" and module.group_size >= 32


def _biases(module: nn.Module) -> mx.array:
    """An affine or symmetric module's biases: a symmetric one's made from
    its scales (exactly: a power of two times each)."""
    if module.mode == "symmetric":
        return module["scales"] * -(2 ** (module.bits - 1))
    return module["biases"]


# A fused layer's projections as kvmux_native's layer ops take them, made
# once (a decode step would otherwise rebuild them for every layer).
_FUSED_MARK = "kvmux_native_layer"
# A quantized module's kvmux_native.pack, where it takes the int8 products.
_PACKED_MARK = "kvmux_native_packed"


def packed(module: nn.Module) -> list[mx.array]:
    """The module's kvmux_native.pack where it takes the int8 products, else []."""
    return module.__dict__.get(_PACKED_MARK, [])


def _fusable(layer: nn.Module) -> bool:
    """A llama-style block on adopted modules: RMS norms, plain rope, q, k,
    v, o and a swiglu MLP of quantized projections without biases, no
    q/k norms (llama's, and qwen2's and qwen3's where they have none)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or hasattr(attn, "q_norm") or type(getattr(attn, "rope", None)) is not RoPE:
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    projections = [getattr(attn, f"{n}_proj", None) for n in "qkvo"]
    projections += [getattr(mlp, f"{n}_proj", None) for n in ("gate", "up", "down")]
    return all(type(n) is RMSNorm for n in norms) and all(
        type(p) is QuantizedLinear and "bias" not in p for p in projections
    )


def fused(layer: nn.Module) -> bool:
    """Whether `layer` runs as kvmux_native's layer ops (`attention_in`,
    `attention_out`, `mlp`)."""
    return _FUSED_MARK in layer.__dict__


def _projections(
    *linears: QuantizedLinear,
) -> tuple[list[mx.array], list[int], list[int], list[mx.array], list[str]]:
    """Their arrays (biases an empty array where a mode has none), groups and
    bits, where any has a pack each one's (two empty arrays for one
    without: its exact products), and their modes."""
    arrays = [a for p in linears for a in (p["weight"], p["scales"], p.get("biases", _NONE))]
    packs = [a for p in linears for a in packed(p) or _UNPACKED] if any(packed(p) for p in linears) else []
    return arrays, [p.group_size for p in linears], [p.bits for p in linears], packs, [p.mode for p in linears]


_NONE = mx.array([], mx.uint8)
_UNPACKED = [_NONE, _NONE]


def attention_in(layer: nn.Module, h: mx.array, positions: mx.array) -> list[mx.array]:
    """A fused layer's normed, projected, scaled and rotated queries
    (tokens, heads, 1, D), and its rotated keys and its values as a slab
    holds them (1, kv heads, tokens, D), from the residual stream h (1,
    tokens, hidden)."""
    attn, norm, rope = layer.self_attn, layer.input_layernorm, layer.self_attn.rope
    arrays, groups, bits, packs, modes = layer.__dict__[_FUSED_MARK][0]
    return kvmux_native.attention_in(
        h,
        norm["weight"],
        norm.eps,
        arrays,
        groups,
        bits,
        attn.n_heads,
        attn.n_kv_heads,
        attn.scale,
        positions,
        rope.dims,
        rope.traditional,
        rope.base,
        rope.scale,
        packed=packs,
        modes=modes,
    )


def attention_out(layer: nn.Module, h: mx.array, attended: mx.array) -> mx.array:
    """h + the attention's output projection, one op."""
    return product(layer.self_attn.o_proj, attended, residual=h)


def mlp(layer: nn.Module, h: mx.array) -> mx.array:
    """h + the layer's MLP of its normed h, one op."""
    norm = layer.post_attention_layernorm
    arrays, groups, bits, packs, modes = layer.__dict__[_FUSED_MARK][1]
    return kvmux_native.mlp(h, norm["weight"], norm.eps, arrays, groups, bits, packed=packs, modes=modes)


def _is_float(value: object) -> bool:
    return isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32
