#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "fused.h"
#include "layer.h"
#include "qmm.h"
#include "sample.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// A layer op's modes by name (none: all affine).
std::vector<kvmux_native::Mode> modes_of(const std::vector<std::string>& names, const std::string& op) {
  std::vector<kvmux_native::Mode> modes;
  for (const auto& name : names) modes.push_back(kvmux_native::mode_of(name, op));
  return modes;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "kvmux's CPU quantized matmul for MLX";
  m.def("qmatmul", &kvmux_native::qmatmul, "x"_a, "w"_a, "scales"_a, "biases"_a.none(), "group_size"_a, "bits"_a,
        "residual"_a = nb::none(), "packed"_a = std::vector<mx::array>{}, "mode"_a = "affine",
        "x @ W.T for W in MLX's affine quantized layout (nn.QuantizedLinear's weight, scales, biases), plus "
        "`residual` where given; float32 arithmetic, each row's sum in a fixed order; runs on the CPU stream. "
        "With `packed` (pack()'s arrays of W): the int8 products, as llama.cpp computes them (src/kernels.h). "
        "mode \"iq4_nl\": 4-bit codes index IQ4_NL's 16 values, w = level * scale, biases None; \"symmetric\": "
        "w = (q - 2^(bits - 1)) * scale, biases None.");
  m.def("pack", &kvmux_native::pack, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "W (4 or 8 bits) packed for the int8 products: its codes and its scales and biases, two arrays "
        "(a symmetric W's: its biases -2^(bits - 1) * scales).");
  m.def(
      "attention_in",
      [](const mx::array& h, const mx::array& norm, float eps, const std::vector<mx::array>& arrays,
         const std::vector<int>& groups, const std::vector<int>& bits, int heads, int kv_heads, float q_scale,
         const mx::array& positions, int dims, bool traditional, float base, float scale,
         const std::optional<mx::array>& freqs, const std::vector<mx::array>& packed,
         const std::vector<std::string>& modes) {
        return kvmux_native::attention_in(h, norm, eps, {arrays, groups, bits, packed, modes_of(modes, "attention_in")},
                                          heads, kv_heads, q_scale, positions, dims, traditional, base, scale, freqs);
      },
      "h"_a, "norm"_a, "eps"_a, "arrays"_a, "groups"_a, "bits"_a, "heads"_a, "kv_heads"_a, "q_scale"_a,
      "positions"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "freqs"_a = nb::none(),
      "packed"_a = std::vector<mx::array>{}, "modes"_a = std::vector<std::string>{},
      "A llama-style layer's attention inputs as one CPU op (see layer.h): rows (queries, keys) and values.");
  m.def(
      "mlp",
      [](const mx::array& h, const mx::array& norm, float eps, const std::vector<mx::array>& arrays,
         const std::vector<int>& groups, const std::vector<int>& bits, const std::vector<mx::array>& packed,
         const std::vector<std::string>& modes) {
        return kvmux_native::mlp(h, norm, eps, {arrays, groups, bits, packed, modes_of(modes, "mlp")});
      },
      "h"_a, "norm"_a, "eps"_a, "arrays"_a, "groups"_a, "bits"_a, "packed"_a = std::vector<mx::array>{},
      "modes"_a = std::vector<std::string>{},
      "A llama-style layer's MLP with its norm and residual as one CPU op (see layer.h).");
  m.def("rms_norm", &kvmux_native::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "mx.fast.rms_norm as one CPU op (MLX's CPU runs it as six).");
  m.def("rope", &kvmux_native::rope, "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "freqs"_a = nb::none(), "mx.fast.rope (forward) as one CPU op (MLX's CPU runs it as ~20).");
  m.def("attend", &kvmux_native::attend, "q"_a, "keys"_a, "values"_a, "slabs"_a, "writes"_a, "reads"_a, "masks"_a,
        "chunks"_a, "Attention at one layer for every session of a pass (decode rows and prefill chunks), their "
        "slabs' float16 writes included, as one CPU op (see fused.h): the attended rows, then each slab's keys and "
        "values.");
  m.def("sample", &kvmux_native::sample, "logits"_a, "temperature"_a, "top_p"_a, "top_k"_a, "uniforms"_a,
        "Tokens drawn from logits (..., V) as mlx-lm's sampler chain draws them (top-p, then top-k, at temperature "
        "1, then the temperature), each row's by one uniform number in [0, 1); temperature 0: the argmax (see "
        "sample.h).");
  m.def("distribution", &kvmux_native::distribution, "logits"_a, "temperature"_a, "top_p"_a, "top_k"_a,
        "The distribution `sample` draws each row's token from (float32, logits' shape).");
  m.def("built_with", [] { return std::string(KVMUX_MLX_VERSION); }, "The mlx release this module was built against.");
  m.def("isa", &kvmux_native::isa, "The instruction set the kernel runs: avx512, avx2 or scalar.");
  m.def("isas", &kvmux_native::isas, "Every instruction set this CPU runs the kernel in, best first.");
  m.def("set_isa", &kvmux_native::set_isa, "name"_a, "Run the kernel in this instruction set.");
  m.def("threads", &kvmux_native::threads, "Threads a product's rows are split over, the caller's included.");
  m.def("set_threads", &kvmux_native::set_threads, "n"_a);
}
