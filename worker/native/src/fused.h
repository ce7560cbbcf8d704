// Fused CPU ops for what MLX's CPU backend runs as a graph of small ops:
// mx.fast.rms_norm (6 ops there) and mx.fast.rope (~20, its cos and sin
// tables made again each call). On a CPU a decode step is ~100 ops per
// layer, each costing microseconds of dispatch whatever its size: one op
// each instead. The same arithmetic as MLX's fallbacks, in float32, each
// row on its own (a row's result never depends on the others).

#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace kvmux_native {

namespace mx = mlx::core;

// The CPU stream every op of this extension runs on, and an array as
// float32 there (itself where it is).
mx::Stream cpu_stream();
mx::array as_float32(const mx::array& a, mx::Stream s);

// x * rsqrt(mean(x^2) + eps) * weight over the last axis (float32).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps);

// rms_norm's arithmetic on `rows` rows of D floats.
void rms_rows(const float* x, const float* w, float eps, size_t rows, int D, float* out);

// A rotary embedding's parameters (see rope); `freqs` null: base's.
struct Rotation {
  int dims;
  bool traditional;
  float base, scale;
  const float* freqs;
};

// rope's arithmetic on x (B, N, T, D) as floats (N: the axes between),
// positions offsets[b] + t (offsets[0] + t unless per_b).
void rope_rows(const float* x, const int32_t* offsets, bool per_b, int B, size_t N, int T, int D, const Rotation& r,
               float* out);

// Rotary embedding of x (B, ..., T, D) at positions offset[b] + t (offset a
// scalar or one per B), as mx.fast.rope forward: the first `dims` features,
// paired (2i, 2i + 1) if `traditional` else (i, i + dims / 2), at
// frequencies base^(-2i / dims) or 1 / freqs[i], positions times `scale`.
mx::array rope(
    const mx::array& x,
    const mx::array& offset,
    int dims,
    bool traditional,
    float base,
    float scale,
    const std::optional<mx::array>& freqs);

// Decode rows' attention over one layer of a slab, one op: q (rows, heads,
// 1, D) or (rows, heads, D), already scaled and rotated; keys and values
// the slab's (1, kv heads, slots, D), read at slots [0, length) (the new
// rows' keys already written there); mask an additive (rows, >= length)
// mask or none. Returns (1, rows, heads * D): per row and head the scores,
// a precise softmax (max subtracted) and the weighted sum of values, in a
// fixed order per query, so a row's output is the same in any pass.
mx::array attend(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    int length,
    const std::optional<mx::array>& mask);

class Attend : public mx::UnaryPrimitive {
 public:
  Attend(mx::Stream stream, int length) : mx::UnaryPrimitive(stream), length_(length) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return length_ == static_cast<const Attend&>(other).length_;
  }

 private:
  int length_;
};

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

class RoPE : public mx::UnaryPrimitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

}  // namespace kvmux_native
