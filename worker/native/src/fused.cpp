#include "fused.h"

#include <cmath>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace kvmux_native {

mx::Stream cpu_stream() { return mx::to_stream({}, mx::Device::cpu); }

mx::array as_float32(const mx::array& a, mx::Stream s) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
}

namespace {

// Σ v[i]^2 in 16 lanes, then the lanes' fixed tree (as the matmul's sums).
float sum_of_squares(const float* v, int n) {
  float lanes[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += v[i + l] * v[i + l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += v[i] * v[i];
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

}  // namespace

void rms_rows(const float* x, const float* w, float eps, size_t rows, int D, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * D;
    const float inv = 1.0f / std::sqrt(sum_of_squares(row, D) * (1.0f / D) + eps);
    for (int i = 0; i < D; ++i) out[r * D + i] = (row[i] * inv) * w[i];
  }
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("[kvmux_native.rms_norm] weight must be 1-D with x's last dimension");
  if (!mx::issubdtype(x.dtype(), mx::floating)) throw std::invalid_argument("[kvmux_native.rms_norm] x must be floating");
  auto s = cpu_stream();
  auto out = mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(s, eps), {as_float32(x, s), as_float32(weight, s)});
  return x.dtype() == mx::float32 ? out : mx::astype(out, x.dtype(), s);
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  encoder.dispatch([x, w, o = out.data<float>(), eps = eps_]() {
    thread_local std::vector<float> xs, ws;
    const float* xv = contiguous_rows(x, xs);
    const float* wv = contiguous_rows(w, ws);
    const int D = x.shape(-1);
    rms_rows(xv, wv, eps, x.size() / D, D, o);
  });
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.rms_norm] runs on the CPU only");
}

bool RMSNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RMSNorm&>(other).eps_;
}

mx::array rope(
    const mx::array& x,
    const mx::array& offset,
    int dims,
    bool traditional,
    float base,
    float scale,
    const std::optional<mx::array>& freqs) {
  if (x.ndim() < 3) throw std::invalid_argument("[kvmux_native.rope] x must have at least 3 dimensions");
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("[kvmux_native.rope] dims must be even, positive and at most x's last dimension");
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != size_t(x.shape(0))))
    throw std::invalid_argument("[kvmux_native.rope] offset must be a scalar or one per x's first dimension");
  if (!mx::issubdtype(offset.dtype(), mx::integer)) throw std::invalid_argument("[kvmux_native.rope] offset must be integer");
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2))
    throw std::invalid_argument("[kvmux_native.rope] freqs must be 1-D with dims / 2 values");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{as_float32(x, s), mx::astype(offset, mx::int32, s)};
  if (freqs) inputs.push_back(as_float32(*freqs, s));
  auto out = mx::array(x.shape(), mx::float32, std::make_shared<RoPE>(s, dims, traditional, base, scale), inputs);
  return x.dtype() == mx::float32 ? out : mx::astype(out, x.dtype(), s);
}

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, o = out.data<float>(), dims = dims_, traditional = traditional_, base = base_,
                    scale = scale_]() {
    const auto& x = inputs[0];
    thread_local std::vector<float> xs;
    const Rotation r{dims, traditional, base, scale, inputs.size() > 2 ? inputs[2].data<float>() : nullptr};
    const int B = x.shape(0), T = x.shape(-2), D = x.shape(-1);
    rope_rows(contiguous_rows(x, xs), inputs[1].data<int32_t>(), inputs[1].size() > 1, B,
              x.size() / (size_t(B) * T * D), T, D, r, o);
  });
}

void rope_rows(const float* xv, const int32_t* offsets, bool per_b, int B, size_t N, int T, int D, const Rotation& r,
               float* o) {
  const int half = r.dims / 2;
  std::vector<float> inv(half), cs(size_t(T) * half), sn(size_t(T) * half);
  for (int i = 0; i < half; ++i)
    inv[i] = r.freqs ? 1.0f / r.freqs[i] : std::exp(float(-i) * float(std::log(r.base) / half));
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const float pos = (float(t) + float(offsets[per_b ? b : 0])) * r.scale;
      for (int i = 0; i < half; ++i) {
        const float theta = pos * inv[i];
        cs[size_t(t) * half + i] = std::cos(theta);
        sn[size_t(t) * half + i] = std::sin(theta);
      }
    }
    for (size_t n = 0; n < N; ++n) {
      for (int t = 0; t < T; ++t) {
        const size_t at = ((size_t(b) * N + n) * T + t) * D;
        const float* c = cs.data() + size_t(t) * half;
        const float* sv = sn.data() + size_t(t) * half;
        for (int i = 0; i < half; ++i) {
          const size_t i1 = at + (r.traditional ? 2 * i : i), i2 = at + (r.traditional ? 2 * i + 1 : i + half);
          const float x1 = xv[i1], x2 = xv[i2];
          o[i1] = x1 * c[i] - x2 * sv[i];
          o[i2] = x1 * sv[i] + x2 * c[i];
        }
        for (int i = r.dims; i < D; ++i) o[at + i] = xv[at + i];
      }
    }
  }
}

void RoPE::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.rope] runs on the CPU only");
}

bool RoPE::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
}

mx::array attend(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    int length,
    const std::optional<mx::array>& mask) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[kvmux_native.attend] " + what); };
  if (q.ndim() != 3 && !(q.ndim() == 4 && q.shape(2) == 1)) fail("q must be (rows, heads, D) or (rows, heads, 1, D)");
  if (keys.ndim() != 4 || keys.shape(0) != 1 || keys.shape() != values.shape())
    fail("keys and values must be (1, kv heads, slots, D) alike");
  const int rows = q.shape(0), heads = q.shape(1), D = q.shape(-1), kv = keys.shape(1);
  if (keys.shape(3) != D) fail("keys' D must be q's");
  if (kv < 1 || heads % kv) fail("heads must be a multiple of the kv heads");
  if (length < 1 || length > keys.shape(2)) fail("length must be within the slab's slots");
  if (mask && (mask->ndim() != 2 || mask->shape(0) != rows || mask->shape(1) < length))
    fail("mask must be (rows, at least length)");
  for (const auto* a : {&q, &keys, &values})
    if (a->dtype() != mx::float32) fail("q, keys and values must be float32");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{q, keys, values};
  if (mask) inputs.push_back(as_float32(*mask, s));
  return mx::array({1, rows, heads * D}, mx::float32, std::make_shared<Attend>(s, length), inputs);
}

void Attend::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, o = out.data<float>(), length = length_]() {
    thread_local std::vector<float> qs, ks, vs, ms;
    const auto& q = inputs[0];
    const auto& keys = inputs[1];
    Attention a{};
    a.q = contiguous_rows(q, qs);
    a.keys = contiguous_rows(keys, ks);
    a.values = contiguous_rows(inputs[2], vs);
    a.mask = inputs.size() > 3 ? contiguous_rows(inputs[3], ms) : nullptr;
    a.mask_stride = inputs.size() > 3 ? inputs[3].shape(1) : 0;
    a.out = o;
    a.rows = q.shape(0);
    a.heads = q.shape(1);
    a.D = q.shape(-1);
    a.kv_heads = keys.shape(1);
    a.length = length;
    a.kv_stride = size_t(keys.shape(2)) * a.D;
    const AttendFn one = attend_kernel();
    // Items by KV head, then row: a thread's next item mostly reads the
    // same keys and values, still in its cache.
    const size_t need = size_t(a.heads / a.kv_heads) * (length + 1);
    parallel_for(a.kv_heads * a.rows, [&](int item) {
      thread_local std::vector<float> scores;
      if (scores.size() < need) scores.resize(need);
      one(a, item % a.rows, item / a.rows, scores.data());
    });
  });
}

void Attend::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.attend] runs on the CPU only");
}

}  // namespace kvmux_native
