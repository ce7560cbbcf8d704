"""kvmux's native CPU ops for MLX, each one MLX primitive in the lazy graph:

- `qmatmul(x, w, scales, biases, group_size, bits)`: `x @ W.T` for W in
  MLX's affine quantized layout, reading the weights as stored (4 and 8
  bits fast, AVX-512 / AVX2 / scalar; src/kernels.h says how it sums),
  in exact float32, or with `packed` (`pack(...)`'s arrays of W) in
  llama.cpp's int8 arithmetic;
- `rms_norm` and `rope`: mx.fast's, as one op each (MLX's CPU backend runs
  them as graphs of small ops);
- `attend`: attention at one layer for every session of a pass (decode
  rows and prefill chunks), their slabs' float16 writes included, one op;
- `attention_in` and `mlp`: a llama-style layer's halves around the slab
  (its norms, seven products, rope, swiglu, residual adds), one op each;
- `sample` and `distribution`: tokens drawn from logits as mlx-lm's
  sampler chain draws them (top-p, top-k, temperature), and the
  distribution they are drawn from.

Built against one mlx release: under another, the compiled module would
crash or refuse every call, so importing it then fails here instead."""

import mlx.core as mx  # first: the extension's types are MLX's

from ._ext import (
    attend,
    attention_in,
    built_with,
    distribution,
    isa,
    isas,
    mlp,
    pack,
    qmatmul,
    rms_norm,
    rope,
    sample,
    set_isa,
    set_threads,
    threads,
)

if built_with() != mx.__version__:
    raise ImportError(
        f"kvmux_native was built against mlx {built_with()}, this is mlx {mx.__version__}: make setup rebuilds it"
    )

__all__ = [
    "attend",
    "attention_in",
    "distribution",
    "isa",
    "isas",
    "mlp",
    "pack",
    "qmatmul",
    "rms_norm",
    "rope",
    "sample",
    "set_isa",
    "set_threads",
    "threads",
]
