// kvmux's quantized matmul as an MLX primitive: `x @ W.T` for W in MLX's
// affine quantized layout (nn.QuantizedLinear's weight, scales, biases),
// computed on the CPU by the kernels of kernels.h, rows split over a pool
// of threads of its own. It runs inside MLX's lazy graph like any op.

#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace kvmux_native {

namespace mx = mlx::core;

// x (..., K) @ W.T -> (..., N), W given as MLX's packed uint32 codes (N,
// K * bits / 32) with scales and biases (N, K / group_size; for
// "iq4_nl" and "symmetric", no biases: none or an empty array); plus
// `residual` (..., N) where given (a layer's residual stream: one op).
// With `packed` (pack()'s two arrays of W), the int8 products
// (kernels.h). `mode`: "affine", "iq4_nl" or "symmetric" (kernels.h's
// Mode).
mx::array qmatmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const std::optional<mx::array>& residual = std::nullopt,
    const std::vector<mx::array>& packed = {},
    const std::string& mode = "affine");

// The Mode named `name`; throws std::invalid_argument (naming `op`) for
// any other name.
Mode mode_of(const std::string& name, const std::string& op);

// W in the int8 products' packed layout (kernels.h): its codes (uint8,
// (N rounded up to 16, K * bits / 8)) and scales and biases (scales'
// dtype, (N / 16 rounded up, 32 per group)). 4- and 8-bit weights; a
// symmetric W's is its affine twin's (biases -2^(bits - 1) * scales).
std::vector<mx::array> pack(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits);

// Throws std::invalid_argument (naming `op`) unless `codes` and
// `packed_scales` are pack()'s arrays of a matrix of w's and scales' shapes.
void check_packed(const mx::array& w, const mx::array& scales, int group_size, int bits, const mx::array& codes,
                  const mx::array& packed_scales, const std::string& op);

// p computed by the int8 products from the packed arrays (evaluated).
void attach_packed(Problem& p, const mx::array& codes, const mx::array& scales);

// Throws std::invalid_argument (naming `op`) unless w, scales and biases
// are a quantized matrix of `bits`, `group_size` and `mode` (iq4_nl's
// and symmetric's biases: an empty array).
void check_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     Mode mode, const std::string& op);

// A product's weights (row-contiguous arrays of a checked matrix); the
// caller sets x, out and M.
Problem problem(const mx::array& w, const mx::array& scales, const mx::array& biases, int group, int bits,
                Mode mode);

// x's rows as the kernel of `bits` reads them: x itself where its order
// is the kernel's and it starts a cache line, else copied into `ordered`
// from a cache line's start (reordered for 4 bits: kernels.h, x_order).
const float* kernel_rows(const float* x, int rows, int K, int bits, std::vector<float>& ordered);

// Every product of `ps` in one job over the kernel's threads (from an
// op's eval task, on the CPU stream).
void compute(const std::vector<Problem>& ps);

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, Mode mode, bool packed)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), mode_(mode), packed_(packed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  Mode mode_;
  bool packed_;  // the inputs end in pack()'s arrays
};

// x's elements (T: float for float32, uint16_t for float16's bits) in
// row-major order: its own data where it is row-contiguous, else gathered
// into `copy` (a broadcast mx.zeros, a slice).
template <class T>
const T* contiguous_rows(const mx::array& x, std::vector<T>& copy) {
  if (x.flags().row_contiguous) return x.data<T>();
  copy.resize(x.size());
  const T* src = x.data<T>();
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  for (size_t i = 0; i < copy.size(); ++i) {
    size_t rest = i;
    int64_t at = 0;
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      at += int64_t(rest % shape[d]) * strides[d];
      rest /= shape[d];
    }
    copy[i] = src[at];
  }
  return copy.data();
}

// items(i) for every i in [0, count), over the kernel's threads.
void parallel_for(int count, const std::function<void(int)>& items);

// The kernels besides the products of the instruction set in use.
IsaKernels isa_kernels();

// The instruction set the kernel runs ("avx512", "avx2", "scalar"), and
// every one this CPU can run, best first.
std::string isa();
std::vector<std::string> isas();
void set_isa(const std::string& name);  // throws std::invalid_argument for one this CPU cannot run

// Threads the kernel splits its rows over (the calling thread included).
int threads();
void set_threads(int n);

}  // namespace kvmux_native
