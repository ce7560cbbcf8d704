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

// Attention at one layer for every session of a pass, one op: decode
// rows (a step's token, a verify pass's) and prefill chunks alike. q (T,
// heads, 1, D) or (T, heads, D): the pass's queries, scaled and rotated;
// keys and values (1, kv heads, T, D): the pass's new ones, float32,
// stored in the slabs as float16 (nearest, ties to even). Per session:
// `slabs` holds its slab's keys then values (1, kv heads, slots, D,
// float16); `writes` its (slot, pass row, count) runs (rows into
// consecutive slots); `reads` its runs of rows (first pass row, last + 1,
// slots read [0, length), index into `masks` or -1: an additive (rows of
// the run, >= length) mask, or none); `chunks` whether it is a prefill
// chunk. Decode rows' keys are written first and each row reads slots
// [0, length) of its slab; a chunk's rows read the slab as it stands,
// then the chunk's own keys (its mask is (rows, length + rows), the
// slab's columns then its own), and its keys are written after every
// read: a chunk longer than the ring's spare slots overwrites slots its
// first rows still see. Returns the attended rows (1, R, heads * D), R
// the rows of every read in order, then each slab's keys and values
// after the writes: the slab's own buffers updated in place where
// nothing else holds them (MLX's slice_update rule), else copies. Per
// row and head: the scores, a precise softmax (max subtracted) and the
// weighted sum of values over parts of kernels.h's PART_SLOTS slots
// (fixed by the slots it reads), combined in order: a fixed order per
// query, so a decode row's output is the same in any pass. A chunk's
// rows, 16 at a time, are lanes of two small matrix products (their own
// fixed order: attend.h's attend_chunk).
std::vector<mx::array> attend(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const std::vector<mx::array>& slabs,
    const std::vector<std::vector<int>>& writes,
    const std::vector<std::vector<int>>& reads,
    const std::vector<mx::array>& masks,
    const std::vector<bool>& chunks);

class Attend : public mx::Primitive {
 public:
  Attend(mx::Stream stream, std::vector<std::vector<int>> writes, std::vector<std::vector<int>> reads,
         std::vector<bool> chunks)
      : mx::Primitive(stream), writes_(std::move(writes)), reads_(std::move(reads)), chunks_(std::move(chunks)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmuxAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attend&>(other);
    return writes_ == o.writes_ && reads_ == o.reads_ && chunks_ == o.chunks_;
  }

 private:
  std::vector<std::vector<int>> writes_, reads_;
  std::vector<bool> chunks_;
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
