#include "fused.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

#include "expf.h"

// A row's attention at one KV head from its parts (attend.h's attend_part, in
// slot order): each part's weights rescaled to the largest max, summed in
// order, the values' sum divided by the weights'. One part: its sum times
// 1 / its weights, a single pass's arithmetic.
void combine(const float* parts, int count, int G, int D, float* out) {
  for (int g = 0; g < G; ++g) {
    float top = -__builtin_inff();
    for (int c = 0; c < count; ++c) top = std::max(top, parts[(size_t(c) * G + g) * (D + 2) + D]);
    float total = 0.0f;
    float* o = out + size_t(g) * D;
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int c = 0; c < count; ++c) {
      const float* part = parts + (size_t(c) * G + g) * (D + 2);
      if (part[D + 1] == 0.0f) continue;  // every slot masked
      const float w = exp_nonpositive(part[D] - top);
      total += w * part[D + 1];
      for (int d = 0; d < D; ++d) o[d] += w * part[d];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < D; ++d) o[d] *= inv;
  }
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

std::vector<mx::array> attend(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const std::vector<mx::array>& slabs,
    const std::vector<std::vector<int>>& writes,
    const std::vector<std::vector<int>>& reads,
    const std::vector<mx::array>& masks,
    const std::vector<bool>& chunks) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[kvmux_native.attend] " + what); };
  if (q.ndim() != 3 && !(q.ndim() == 4 && q.shape(2) == 1)) fail("q must be (rows, heads, D) or (rows, heads, 1, D)");
  const int T = q.shape(0), heads = q.shape(1), D = q.shape(-1);
  if (keys.ndim() != 4 || keys.shape(0) != 1 || keys.shape(2) != T || keys.shape(3) != D || keys.shape() != values.shape())
    fail("keys and values must be (1, kv heads, q's rows, D) alike");
  const int kv = keys.shape(1);
  if (kv < 1 || heads % kv) fail("heads must be a multiple of the kv heads");
  if (slabs.size() != 2 * writes.size() || reads.size() != writes.size() || chunks.size() != writes.size())
    fail("each session needs its slab's keys and values, its writes, its reads and whether it is a chunk");
  int rows = 0;
  for (size_t i = 0; i < writes.size(); ++i) {
    const auto& k = slabs[2 * i];
    if (k.ndim() != 4 || k.shape(0) != 1 || k.shape(1) != kv || k.shape(3) != D || k.shape() != slabs[2 * i + 1].shape())
      fail("a slab's keys and values must be (1, kv heads, slots, D) alike");
    const int slots = k.shape(2);
    if (writes[i].size() % 3) fail("writes are (slot, row, count) triples");
    for (size_t w = 0; w < writes[i].size(); w += 3) {
      const int slot = writes[i][w], row = writes[i][w + 1], count = writes[i][w + 2];
      if (count < 1 || slot < 0 || slot + count > slots || row < 0 || row + count > T)
        fail("a write must fit the slab's slots and the pass's rows");
    }
    if (reads[i].size() % 4) fail("reads are (first, last, length, mask) quadruples");
    for (size_t r = 0; r < reads[i].size(); r += 4) {
      const int first = reads[i][r], last = reads[i][r + 1], length = reads[i][r + 2], m = reads[i][r + 3];
      if (first < 0 || last <= first || last > T) fail("a read's rows must be within the pass's");
      if (length < (chunks[i] ? 0 : 1) || length > slots) fail("length must be within the slab's slots");
      if (m >= int(masks.size())) fail("a read's mask index is out of range");
      if (chunks[i] && (m < 0 || masks[m].ndim() != 2 || masks[m].shape(0) != last - first ||
                        masks[m].shape(1) != length + last - first))
        fail("a chunk's read needs a mask of (its rows, length + its rows)");
      if (m >= 0 && (masks[m].ndim() != 2 || masks[m].shape(0) != last - first || masks[m].shape(1) < length))
        fail("a mask must be (the read's rows, at least length)");
      rows += last - first;
    }
  }
  for (const auto* a : {&q, &keys, &values})
    if (a->dtype() != mx::float32) fail("q, keys and values must be float32");
  for (const auto& a : slabs)
    if (a.dtype() != mx::float16) fail("slabs must be float16");
  auto s = cpu_stream();
  std::vector<mx::array> inputs{q, keys, values};
  std::vector<mx::Shape> shapes{{1, rows, heads * D}};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (const auto& a : slabs) {
    inputs.push_back(a);
    shapes.push_back(a.shape());
    dtypes.push_back(mx::float16);
  }
  for (const auto& m : masks) inputs.push_back(as_float32(m, s));
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::make_shared<Attend>(s, writes, reads, chunks),
                                inputs);
}

namespace {

// A run of rows reading one session's slab: a source, or two for a chunk
// (the slab as it stands, then the chunk's own keys and values).
struct Run {
  Attention slab, own;
  int slab_parts = 0, own_parts = 0;
  int parts() const { return slab_parts + own_parts; }
  bool chunk() const { return own_parts > 0; }
};

int parts_of(int slots) { return (slots + PART_SLOTS - 1) / PART_SLOTS; }

// The pass's new keys (part 0) or values (part 1) of `rows` rows from
// `row` into a slab's slots from `slot` (float16s, kv heads of `slots`).
void write_rows(uint16_t* slab, const uint16_t* narrowed, int kv, int slots, int T, int D, int slot, int row, int rows) {
  for (int h = 0; h < kv; ++h)
    std::memcpy(slab + (size_t(h) * slots + slot) * D, narrowed + (size_t(h) * T + row) * D,
                sizeof(uint16_t) * rows * D);
}

}  // namespace

void Attend::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const size_t sessions = writes_.size();
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  // A slab's buffer is updated in place where this op holds the only
  // reference to it (the session's slab now points at the output), as
  // MLX's slice_update does; else it is copied first. make_arrays gave
  // each output its own copy of the inputs, so every input is held once
  // per output and is_donatable never holds: the siblings' copies, which
  // eval drops once this op is done (it detaches them), go now.
  if (!outputs[0].is_tracer())
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
  std::vector<bool> copied(2 * sessions);
  for (size_t i = 0; i < 2 * sessions; ++i) {
    const auto& in = inputs[3 + i];
    if (in.is_donatable() && in.flags().row_contiguous) {
      outputs[1 + i].copy_shared_buffer(in);
    } else {
      outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
      copied[i] = true;
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  std::vector<uint16_t*> slab_data;
  for (size_t i = 0; i < 2 * sessions; ++i) slab_data.push_back(outputs[1 + i].data<uint16_t>());
  encoder.dispatch([inputs, o = outputs[0].data<float>(), slab_data, copied, writes = writes_, reads = reads_,
                    chunks = chunks_]() {
    thread_local std::vector<float> qs, ks, vs;
    thread_local std::vector<uint16_t> copy, narrowed[2];
    const auto& q = inputs[0];
    const auto& keys = inputs[1];
    const int heads = q.shape(1), D = q.shape(-1), kv = keys.shape(1), T = keys.shape(2);
    const IsaKernels kernels = isa_kernels();
    const float* qv = contiguous_rows(q, qs);
    const float* new_kv[2] = {contiguous_rows(keys, ks), contiguous_rows(inputs[2], vs)};
    for (int part = 0; part < 2; ++part) {  // as the slab stores them, and a chunk reads its own
      narrowed[part].resize(size_t(kv) * T * D);
      kernels.narrow(new_kv[part], narrowed[part].size(), narrowed[part].data());
    }
    std::vector<std::vector<float>> mask_copies(inputs.size() - 3 - 2 * writes.size());
    std::vector<Run> runs;
    std::vector<float*> run_out;
    int out_row = 0;
    for (size_t i = 0; i < writes.size(); ++i) {
      const int slots = inputs[3 + 2 * i].shape(2);
      for (int part = 0; part < 2; ++part) {
        if (!copied[2 * i + part]) continue;
        const auto& in = inputs[3 + 2 * i + part];
        std::memcpy(slab_data[2 * i + part], contiguous_rows(in, copy), in.nbytes());
      }
      // Decode rows write first and read their own keys in the slab; a
      // chunk reads first (its later slots may be ones its first rows
      // still see) and writes after every read (below).
      if (!chunks[i])
        for (size_t w = 0; w < writes[i].size(); w += 3)
          for (int part = 0; part < 2; ++part)
            write_rows(slab_data[2 * i + part], narrowed[part].data(), kv, slots, T, D, writes[i][w],
                       writes[i][w + 1], writes[i][w + 2]);
      for (size_t r = 0; r < reads[i].size(); r += 4) {
        const int first = reads[i][r], last = reads[i][r + 1], m = reads[i][r + 3];
        Run run{};
        Attention& a = run.slab;
        a.q = qv + size_t(first) * heads * D;
        a.keys = slab_data[2 * i];
        a.values = slab_data[2 * i + 1];
        if (m >= 0) {
          const auto& mask = inputs[3 + 2 * writes.size() + m];
          a.mask = contiguous_rows(mask, mask_copies[m]);
          a.mask_stride = mask.shape(1);
        }
        a.out = o + size_t(out_row) * heads * D;
        a.rows = last - first;
        a.heads = heads;
        a.D = D;
        a.kv_heads = kv;
        a.length = reads[i][r + 2];
        a.kv_stride = size_t(slots) * D;
        run.slab_parts = parts_of(a.length);
        if (chunks[i]) {  // the chunk's own keys and values: the mask's columns after the slab's
          run.own = a;
          run.own.keys = narrowed[0].data() + size_t(first) * D;
          run.own.values = narrowed[1].data() + size_t(first) * D;
          run.own.mask = a.mask + a.length;
          run.own.length = a.rows;
          run.own.kv_stride = size_t(T) * D;
          run.own_parts = parts_of(a.rows);
        }
        runs.push_back(run);
        out_row += a.rows;
      }
    }
    // Items by run, KV head, part, then row (a chunk's: CHUNK_ROWS rows
    // at a time): a thread's next item reads the same keys and values (a
    // part's 128 KB or less), still in its cache, for the next rows. Each
    // row's partial sits by (row, KV head), then part, for combine.
    const int G = heads / kv;
    std::vector<int> first_item(runs.size() + 1), first_part(runs.size() + 1), per_item(runs.size());
    size_t most = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      const int rows = runs[r].slab.rows, span = std::min(std::max(runs[r].slab.length, runs[r].own.length), PART_SLOTS);
      per_item[r] = runs[r].chunk() ? std::min(rows, CHUNK_ROWS) : 1;
      first_item[r + 1] = first_item[r] + (rows + per_item[r] - 1) / per_item[r] * kv * runs[r].parts();
      first_part[r + 1] = first_part[r] + rows * kv * runs[r].parts();
      most = std::max(most, runs[r].chunk() ? chunk_scratch(per_item[r], G, span, D) : size_t(G) * span);
    }
    thread_local std::vector<float> partial_buffer;  // this (the stream's) thread's: the pool writes through `partials`
    partial_buffer.resize(size_t(first_part.back()) * G * (D + 2));
    float* partials = partial_buffer.data();
    parallel_for(first_item.back(), [&](int item) {
      thread_local std::vector<float> scratch;
      if (scratch.size() < most) scratch.resize(most);
      const size_t r = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const Run& run = runs[r];
      const int local = item - first_item[r], rows = run.slab.rows, parts = run.parts(), per = per_item[r];
      const int groups = (rows + per - 1) / per, group = local % groups, at = local / groups % parts;
      const int head = local / (groups * parts), r0 = group * per, r1 = std::min(rows, r0 + per);
      const Attention& a = at < run.slab_parts ? run.slab : run.own;
      const int part = at < run.slab_parts ? at : at - run.slab_parts;
      const int j0 = part * PART_SLOTS, j1 = std::min(a.length, j0 + PART_SLOTS);
      float* out = partials + (size_t(first_part[r]) + size_t(head * rows + r0) * parts + at) * G * (D + 2);
      if (run.chunk())
        kernels.chunk(a, r0, r1, head, j0, j1, scratch.data(), out, size_t(parts) * G * (D + 2));
      else
        kernels.attend(a, r0, head, j0, j1, scratch.data(), out);
    });
    for (size_t r = 0; r < runs.size(); ++r) {
      const Attention& a = runs[r].slab;
      for (int pair = 0; pair < a.rows * kv; ++pair) {
        const int row = pair % a.rows, head = pair / a.rows;
        combine(partials + (size_t(first_part[r]) + size_t(pair) * runs[r].parts()) * G * (D + 2), runs[r].parts(),
                G, D, a.out + (size_t(row) * heads + size_t(head) * G) * D);
      }
    }
    for (size_t i = 0; i < writes.size(); ++i) {
      if (!chunks[i]) continue;
      const int slots = inputs[3 + 2 * i].shape(2);
      for (size_t w = 0; w < writes[i].size(); w += 3)
        for (int part = 0; part < 2; ++part)
          write_rows(slab_data[2 * i + part], narrowed[part].data(), kv, slots, T, D, writes[i][w], writes[i][w + 1],
                     writes[i][w + 2]);
    }
  });
}

void Attend::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[kvmux_native.attend] runs on the CPU only");
}

}  // namespace kvmux_native
