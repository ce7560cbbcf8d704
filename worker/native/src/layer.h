// A llama-style decoder layer as three CPU ops around the slab: what
// MLX's CPU backend runs as ~30 ops a layer (norms, seven products, the
// query's scale, a concatenation, rope, swiglu, residual adds), each
// costing microseconds of dispatch whatever its size. The arithmetic is
// the separate ops' (rms_rows, the quantized products, rope_rows, the
// residual add) in the same order, so a row's result is the same as
// theirs and never depends on the other rows of the pass. swiglu's
// sigmoid uses expf.h's exp (MLX's own differs in the last bits), in
// the instruction set's own loop (swiglu.h).

#pragma once

#include <optional>
#include <vector>

#include "fused.h"
#include "kernels.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace kvmux_native {

namespace mx = mlx::core;

// A layer's quantized projections: per projection its codes, scales and
// biases (three arrays each, in order: an iq4_nl or symmetric one's
// biases empty) and
// its group size, bits and mode (none: all affine); and for the int8
// products, each one's pack() (two arrays each: empty ones for a
// projection they do not take), or none.
struct Projections {
  std::vector<mx::array> arrays;
  std::vector<int> groups, bits;
  std::vector<mx::array> packed;
  std::vector<Mode> modes;
};

// The attention's inputs from the residual stream h (1, T, hidden):
// x = rms_norm(h), then q, k, v = x's products with the layer's three
// projections (one job over the threads); queries scaled by `q_scale`;
// queries and keys rotated at `positions` (T,). Returns the queries (T,
// heads, 1, D), and the keys and values as a slab holds them (1,
// kv_heads, T, D).
std::vector<mx::array> attention_in(
    const mx::array& h,
    const mx::array& norm,
    float eps,
    const Projections& qkv,
    int heads,
    int kv_heads,
    float q_scale,
    const mx::array& positions,
    int dims,
    bool traditional,
    float base,
    float scale,
    const std::optional<mx::array>& freqs);

// h + down(silu(gate(x)) * up(x)), x = rms_norm(h): the layer's MLP with
// its residual, h (1, T, hidden).
mx::array mlp(const mx::array& h, const mx::array& norm, float eps, const Projections& gate_up_down);

class AttentionIn : public mx::Primitive {
 public:
  AttentionIn(mx::Stream stream, float eps, std::vector<int> groups, std::vector<int> bits, std::vector<Mode> modes,
              bool packed, int heads, int kv_heads, float q_scale, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream),
        eps_(eps),
        groups_(std::move(groups)),
        bits_(std::move(bits)),
        modes_(std::move(modes)),
        packed_(packed),
        heads_(heads),
        kv_heads_(kv_heads),
        q_scale_(q_scale),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmuxAttentionIn"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  std::vector<int> groups_, bits_;
  std::vector<Mode> modes_;
  bool packed_;  // the inputs end in each projection's pack()
  int heads_, kv_heads_;
  float q_scale_;
  int dims_;
  bool traditional_;
  float base_, scale_;
};

class MLP : public mx::UnaryPrimitive {
 public:
  MLP(mx::Stream stream, float eps, std::vector<int> groups, std::vector<int> bits, std::vector<Mode> modes,
      bool packed)
      : mx::UnaryPrimitive(stream),
        eps_(eps),
        groups_(std::move(groups)),
        bits_(std::move(bits)),
        modes_(std::move(modes)),
        packed_(packed) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxMLP"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  std::vector<int> groups_, bits_;
  std::vector<Mode> modes_;
  bool packed_;
};

}  // namespace kvmux_native
