#include "layer.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace kvmux_native {

namespace {

// Checks the residual stream and norm and the layer's projections
// (`count` of them, each taking `inputs[i]` features); returns h's width.
int check_layer(const std::string& op, const mx::array& h, const mx::array& norm, const Projections& ps, int count,
                const std::vector<int>& inputs) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument("[kvmux_native." + op + "] " + what); };
  if (h.ndim() < 1 || !mx::issubdtype(h.dtype(), mx::floating)) fail("h must be a floating-point array");
  const int hidden = h.shape(-1);
  if (norm.ndim() != 1 || norm.shape(0) != hidden) fail("norm must be 1-D with h's last dimension");
  if (int(ps.arrays.size()) != 3 * count || int(ps.groups.size()) != count || int(ps.bits.size()) != count ||
      (!ps.modes.empty() && int(ps.modes.size()) != count))
    fail("expected " + std::to_string(count) +
         " projections (codes, scales, biases each) and their groups and bits (and modes, or none)");
  for (int i = 0; i < count; ++i) {
    const auto& w = ps.arrays[3 * i];
    const Mode mode = ps.modes.empty() ? Mode::affine : ps.modes[i];
    check_quantized(w, ps.arrays[3 * i + 1], ps.arrays[3 * i + 2], ps.groups[i], ps.bits[i], mode, op);
    if (w.shape(1) * 32 / ps.bits[i] != inputs[i]) fail("projection " + std::to_string(i) + " has the wrong inputs");
  }
  if (!ps.packed.empty()) {
    if (int(ps.packed.size()) != 2 * count) fail("packed must be each projection's pack(), two arrays each");
    for (int i = 0; i < count; ++i)
      if (ps.packed[2 * i].size() > 0) {  // empty: this one's exact products
        if (!ps.modes.empty() && ps.modes[i] == Mode::iq4_nl)
          fail("the int8 products take affine and symmetric codes, not iq4_nl");
        check_packed(ps.arrays[3 * i], ps.arrays[3 * i + 1], ps.groups[i], ps.bits[i], ps.packed[2 * i],
                     ps.packed[2 * i + 1], op);
      }
  }
  return hidden;
}

// The projections' problems from inputs[first...]; with `packed`, each
// one's pack() from the inputs' last 2 * count (empty arrays: its exact
// products).
std::vector<Problem> problems_of(const std::vector<mx::array>& inputs, int first, const std::vector<int>& groups,
                                 const std::vector<int>& bits, const std::vector<Mode>& modes, bool packed) {
  std::vector<Problem> ps;
  const size_t tail = inputs.size() - 2 * groups.size();
  for (size_t i = 0; i < groups.size(); ++i) {
    ps.push_back(problem(inputs[first + 3 * i], inputs[first + 3 * i + 1], inputs[first + 3 * i + 2], groups[i], bits[i],
                         modes.empty() ? Mode::affine : modes[i]));
    if (packed && inputs[tail + 2 * i].size() > 0) attach_packed(ps.back(), inputs[tail + 2 * i], inputs[tail + 2 * i + 1]);
  }
  return ps;
}

// x's T rows into each product of ps (reordered per its bits into
// `ordered`, once for products of the same bits: compute then also
// quantizes them once for the int8 products).
void feed(std::vector<Problem>& ps, const float* x, int T, std::vector<std::vector<float>>& ordered) {
  ordered.resize(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].M = T;
    size_t same = 0;
    while (same < i && ps[same].bits != ps[i].bits) ++same;
    ps[i].x = same < i ? ps[same].x : kernel_rows(x, T, ps[i].K, ps[i].bits, ordered[i]);
  }
}

}  // namespace

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
    const std::optional<mx::array>& freqs) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[kvmux_native.attention_in] " + what); };
  const int hidden = h.ndim() ? h.shape(-1) : 0;
  check_layer("attention_in", h, norm, qkv, 3, {hidden, hidden, hidden});
  if (heads < 1 || kv_heads < 1 || heads % kv_heads) fail("heads must be a multiple of the kv heads");
  const int D = qkv.arrays[0].shape(0) / heads;
  if (D * heads != qkv.arrays[0].shape(0) || qkv.arrays[3].shape(0) != kv_heads * D ||
      qkv.arrays[6].shape(0) != kv_heads * D)
    fail("q must have heads * D outputs, k and v kv_heads * D");
  if (dims <= 0 || dims % 2 || dims > D) fail("dims must be even, positive and at most the head size");
  const int T = int(h.size() / hidden);
  if (positions.ndim() != 1 || int(positions.size()) != T || !mx::issubdtype(positions.dtype(), mx::integer))
    fail("positions must be one integer per token");
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)) fail("freqs must be 1-D with dims / 2 values");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{as_float32(h, s), as_float32(norm, s)};
  inputs.insert(inputs.end(), qkv.arrays.begin(), qkv.arrays.end());
  inputs.push_back(mx::astype(positions, mx::int32, s));
  if (freqs) inputs.push_back(as_float32(*freqs, s));
  inputs.insert(inputs.end(), qkv.packed.begin(), qkv.packed.end());
  return mx::array::make_arrays(
      {{T, heads, 1, D}, {1, kv_heads, T, D}, {1, kv_heads, T, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<AttentionIn>(s, eps, qkv.groups, qkv.bits, qkv.modes, !qkv.packed.empty(), heads, kv_heads,
                                    q_scale, dims, traditional, base, scale),
      inputs);
}

void AttentionIn::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto ps = problems_of(inputs, 2, groups_, bits_, modes_, packed_);
  const bool freqs = inputs.size() > (packed_ ? 18u : 12u);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  const Rotation r{dims_, traditional_, base_, scale_, nullptr};
  encoder.dispatch([ps, inputs, r, freqs, eps = eps_, H = heads_, KV = kv_heads_, q_scale = q_scale_,
                    queries = outputs[0].data<float>(), keys = outputs[1].data<float>(),
                    values = outputs[2].data<float>()]() mutable {
    thread_local std::vector<float> hs, ns, x, q, k, v, rows, rotated;
    thread_local std::vector<std::vector<float>> ordered;
    const auto& h = inputs[0];
    const int hidden = h.shape(-1), T = int(h.size() / hidden), D = ps[0].N / H;
    if (T == 0) return;
    x.resize(size_t(T) * hidden);
    rms_rows(contiguous_rows(h, hs), contiguous_rows(inputs[1], ns), eps, T, hidden, x.data());
    feed(ps, x.data(), T, ordered);
    q.resize(size_t(T) * H * D);
    k.resize(size_t(T) * KV * D);
    v.resize(size_t(T) * KV * D);
    ps[0].out = q.data();
    ps[1].out = k.data();
    ps[2].out = v.data();
    compute(ps);
    // Each token's scaled queries then its keys, (T, H + KV, 1, D), as
    // rope takes them; rotated, then the keys and values laid out as a
    // slab holds them, (KV, T, D).
    const size_t width = size_t(H + KV) * D;
    rows.resize(size_t(T) * width);
    rotated.resize(size_t(T) * width);
    for (int t = 0; t < T; ++t) {
      float* dst = rows.data() + t * width;
      const float* qt = q.data() + size_t(t) * H * D;
      for (size_t i = 0; i < size_t(H) * D; ++i) dst[i] = qt[i] * q_scale;
      std::memcpy(dst + size_t(H) * D, k.data() + size_t(t) * KV * D, sizeof(float) * KV * D);
    }
    const auto& positions = inputs[11];
    Rotation with = r;
    if (freqs) with.freqs = inputs[12].data<float>();
    rope_rows(rows.data(), positions.data<int32_t>(), positions.size() > 1, T, H + KV, 1, D, with, rotated.data());
    for (int t = 0; t < T; ++t) {
      const float* src = rotated.data() + t * width;
      std::memcpy(queries + size_t(t) * H * D, src, sizeof(float) * H * D);
      for (int j = 0; j < KV; ++j) {
        std::memcpy(keys + (size_t(j) * T + t) * D, src + size_t(H + j) * D, sizeof(float) * D);
        std::memcpy(values + (size_t(j) * T + t) * D, v.data() + (size_t(t) * KV + j) * D, sizeof(float) * D);
      }
    }
  });
}

void AttentionIn::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[kvmux_native.attention_in] runs on the CPU only");
}

bool AttentionIn::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AttentionIn&>(other);
  return eps_ == o.eps_ && groups_ == o.groups_ && bits_ == o.bits_ && modes_ == o.modes_ && packed_ == o.packed_ &&
         heads_ == o.heads_ &&
         kv_heads_ == o.kv_heads_ &&
         q_scale_ == o.q_scale_ && dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
         scale_ == o.scale_;
}

mx::array mlp(const mx::array& h, const mx::array& norm, float eps, const Projections& gate_up_down) {
  const int hidden = h.ndim() ? h.shape(-1) : 0;
  const int inner = gate_up_down.arrays.size() == 9 ? gate_up_down.arrays[0].shape(0) : 0;
  check_layer("mlp", h, norm, gate_up_down, 3, {hidden, hidden, inner});
  if (gate_up_down.arrays[3].shape(0) != inner || gate_up_down.arrays[6].shape(0) != hidden)
    throw std::invalid_argument("[kvmux_native.mlp] gate and up must have one output per down input, down h's width");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{as_float32(h, s), as_float32(norm, s)};
  inputs.insert(inputs.end(), gate_up_down.arrays.begin(), gate_up_down.arrays.end());
  inputs.insert(inputs.end(), gate_up_down.packed.begin(), gate_up_down.packed.end());
  auto out = mx::array(
      h.shape(), mx::float32,
      std::make_shared<MLP>(s, eps, gate_up_down.groups, gate_up_down.bits, gate_up_down.modes,
                            !gate_up_down.packed.empty()),
      inputs);
  return h.dtype() == mx::float32 ? out : mx::astype(out, h.dtype(), s);
}

void MLP::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto ps = problems_of(inputs, 2, groups_, bits_, modes_, packed_);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([ps, inputs, eps = eps_, o = out.data<float>()]() mutable {
    thread_local std::vector<float> hs, ns, x, gate, up;
    thread_local std::vector<std::vector<float>> ordered;
    const auto& h = inputs[0];
    const int hidden = h.shape(-1), T = int(h.size() / hidden), inner = ps[0].N;
    if (T == 0) return;
    const float* hv = contiguous_rows(h, hs);
    x.resize(size_t(T) * hidden);
    rms_rows(hv, contiguous_rows(inputs[1], ns), eps, T, hidden, x.data());
    std::vector<Problem> gate_up{ps[0], ps[1]};
    feed(gate_up, x.data(), T, ordered);
    gate.resize(size_t(T) * inner);
    up.resize(size_t(T) * inner);
    gate_up[0].out = gate.data();
    gate_up[1].out = up.data();
    compute(gate_up);
    isa_kernels().swiglu(gate.data(), up.data(), size_t(T) * inner);
    std::vector<Problem> down{ps[2]};
    feed(down, gate.data(), T, ordered);
    down[0].out = o;
    compute(down);
    for (size_t i = 0; i < size_t(T) * hidden; ++i) o[i] = hv[i] + o[i];
  });
}

void MLP::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.mlp] runs on the CPU only");
}

bool MLP::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MLP&>(other);
  return eps_ == o.eps_ && groups_ == o.groups_ && bits_ == o.bits_ && modes_ == o.modes_ && packed_ == o.packed_;
}

}  // namespace kvmux_native
