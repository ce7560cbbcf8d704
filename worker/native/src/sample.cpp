#include "sample.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "fused.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace kvmux_native {

namespace {

// Σ v[i] in double: eight running sums over i mod 8, then theirs in order.
// A fixed order, and eight chains of additions where one would wait on
// each sum before it.
double sum_of(const float* v, size_t n) {
  double s[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += v[i + j];
  for (; i < n; ++i) s[i % 8] += v[i];
  double total = 0;
  for (double x : s) total += x;
  return total;
}

// The weight q of the tokens whose logit is at least `floor`, and their
// count: loops without a branch, for the candidates' span.
double weight_from(const float* l, const float* q, int V, float floor) {
  double s[8] = {};
  int i = 0;
  for (; i + 8 <= V; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += l[i + j] >= floor ? double(q[i + j]) : 0.0;
  for (; i < V; ++i) s[i % 8] += l[i] >= floor ? double(q[i]) : 0.0;
  double total = 0;
  for (double x : s) total += x;
  return total;
}

size_t count_from(const float* l, int V, float floor) {
  size_t n = 0;
  for (int i = 0; i < V; ++i) n += l[i] >= floor;
  return n;
}

// The first highest logit's index (mx.argmax's choice); a row of -inf: 0.
int first_max(const float* l, int V) {
  int best = 0;
  for (int i = 1; i < V; ++i)
    if (l[i] > l[best]) best = i;
  return best;
}

// The first candidates for what top-p and top-k keep are the tokens within
// SPAN of the row's highest logit, the span doubled until they hold it.
constexpr float SPAN = 8.0f;

// Top-p's candidates are bucketed by logit, BUCKETS over the span: only
// the bucket where the kept weight reaches the bound is sorted, not the
// vocabulary (mlx-lm's apply_top_p sorts it: 4-7 ms here).
constexpr int BUCKETS = 256;

bool higher(const float* l, int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); }

// Of candidates c (the highest logits, weighing at least `bound` unless
// they are every token) those top-p keeps: a token stays while the weight
// above it is under the bound (mlx-lm: mass_above < top_p * total), and
// so does each tie of the last one. The buckets' weights are summed from
// the top to the bucket that reaches the bound, whose tokens are then
// taken in order.
std::vector<int> nucleus(const float* l, float top, float span, const std::vector<int>& c, const float* q,
                         double bound) {
  const float per = BUCKETS / span;
  const auto bucket_of = [&](int i) {
    const float f = (top - l[i]) * per;
    return f < BUCKETS ? int(f) : BUCKETS - 1;  // -inf: the last
  };
  double weight[BUCKETS] = {};
  std::vector<uint8_t> at(c.size());
  for (size_t j = 0; j < c.size(); ++j) {
    at[j] = uint8_t(bucket_of(c[j]));
    weight[at[j]] += q[c[j]];
  }
  double above = 0;
  int edge = 0;
  while (edge < BUCKETS - 1 && above + weight[edge] < bound) above += weight[edge++];
  std::vector<int> keep, last;
  for (size_t j = 0; j < c.size(); ++j) {
    if (at[j] < edge) keep.push_back(c[j]);
    if (at[j] == edge) last.push_back(c[j]);
  }
  std::sort(last.begin(), last.end(), [l](int a, int b) { return higher(l, a, b); });
  size_t n = 0;
  while (n < last.size() && above < bound) above += q[last[n++]];
  while (n > 0 && n < last.size() && l[last[n]] == l[last[n - 1]]) ++n;
  keep.insert(keep.end(), last.begin(), last.begin() + n);
  return keep;
}

// The tokens a row keeps under top-p, then top-k (mlx-lm's apply_top_p
// and apply_top_k: on the logits at temperature 1), in a fixed order;
// empty: every token. `top`: the row's highest logit.
std::vector<int> kept(const float* l, int V, float top, const Sampling& s, std::vector<float>& weights) {
  const bool by_p = s.top_p > 0 && s.top_p < 1, by_k = s.top_k > 0 && s.top_k < V;
  std::vector<int> c;
  if (!by_p && !by_k) return c;
  double bound = 0;  // top-p's share of the row's weight at temperature 1
  const float* q = nullptr;  // a plain pointer: `weights` is thread-local, its address a call away
  if (by_p) {
    weights.resize(V);
    isa_kernels().exps(l, V, top, 1.0f, weights.data());
    q = weights.data();
    bound = s.top_p * sum_of(q, V);
  }
  // Candidates hold what is kept once they weigh the bound (top-p's tokens
  // are the highest that do) or number k (top-k's): either bounds the rest.
  float span = SPAN;
  for (;; span *= 2) {
    if (span > 1e6f) {  // wider than any logits' spread: every token, -inf included
      span = INFINITY;
      break;
    }
    if (by_p && weight_from(l, q, V, top - span) >= bound) break;
    if (by_k && count_from(l, V, top - span) >= size_t(s.top_k)) break;
  }
  for (int i = 0; i < V; ++i)
    if (l[i] >= top - span) c.push_back(i);
  if (by_p) c = nucleus(l, top, span, c, q, bound);
  if (by_k && c.size() > size_t(s.top_k)) {  // the k highest of them, ties by index
    std::partial_sort(c.begin(), c.begin() + s.top_k, c.end(), [l](int a, int b) { return higher(l, a, b); });
    c.resize(s.top_k);
  }
  return c;
}

// The kept tokens' weights exp((l - top) / T) into w, in `keep`'s order
// (every token's, in order, where it is empty); returns their total.
double weigh(const float* l, int V, float top, float T, const std::vector<int>& keep, std::vector<float>& w,
             std::vector<float>& gathered) {
  const float* x = l;
  size_t n = V;
  if (!keep.empty()) {
    gathered.resize(keep.size());
    for (size_t j = 0; j < keep.size(); ++j) gathered[j] = l[keep[j]];
    x = gathered.data();
    n = keep.size();
  }
  w.resize(n);
  isa_kernels().exps(x, n, top, 1.0f / T, w.data());
  return sum_of(w.data(), n);
}

// Weights walked a block at a time (its sum first), then one at a time in
// the block where the running sum passes the target.
constexpr size_t WALK_BLOCK = 256;

// The index into w where the running sum of the weights first passes
// u * total; a u near 1 that rounding leaves unpassed takes the last
// weighed one.
size_t pick(const std::vector<float>& w, double total, double u) {
  const double target = u * total;
  double run = 0;
  size_t j = 0, last = 0;
  for (; j + WALK_BLOCK <= w.size(); j += WALK_BLOCK) {
    const double block = sum_of(w.data() + j, WALK_BLOCK);
    if (run + block > target) break;
    run += block;
  }
  for (; j < w.size(); ++j) {
    if (w[j] == 0) continue;
    run += w[j];
    last = j;
    if (run > target) return j;
  }
  return last;
}

mx::array sampling_op(const mx::array& logits, Sampling s, std::vector<double> uniforms, bool distribution) {
  const std::string op = distribution ? "[kvmux_native.distribution] " : "[kvmux_native.sample] ";
  auto fail = [&op](const std::string& what) { throw std::invalid_argument(op + what); };
  if (logits.ndim() < 1 || logits.shape(-1) < 1) fail("logits must have a last axis of at least one token");
  if (!mx::issubdtype(logits.dtype(), mx::floating)) fail("logits must be floating-point");
  if (!(s.temperature >= 0) || std::isinf(s.temperature)) fail("temperature must be finite and >= 0");
  const size_t rows = logits.size() / logits.shape(-1);
  if (!distribution && s.temperature > 0) {
    if (uniforms.size() != rows) fail("needs one uniform number per row (" + std::to_string(rows) + ")");
    for (double u : uniforms)
      if (!(u >= 0 && u < 1)) fail("uniform numbers must be in [0, 1)");
  }
  auto stream = cpu_stream();
  auto shape = logits.shape();
  if (!distribution) shape.pop_back();
  return mx::array(shape, distribution ? mx::float32 : mx::uint32,
                   std::make_shared<Sample>(stream, s, std::move(uniforms), distribution),
                   {as_float32(logits, stream)});
}

}  // namespace

mx::array sample(const mx::array& logits, float temperature, float top_p, int top_k, std::vector<double> uniforms) {
  return sampling_op(logits, {temperature, top_p, top_k}, std::move(uniforms), false);
}

mx::array distribution(const mx::array& logits, float temperature, float top_p, int top_k) {
  return sampling_op(logits, {temperature, top_p, top_k}, {}, true);
}

void Sample::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& logits = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(logits);
  encoder.set_output_array(out);
  float* probs = distribution_ ? out.data<float>() : nullptr;
  uint32_t* tokens = distribution_ ? nullptr : out.data<uint32_t>();
  encoder.dispatch([logits, probs, tokens, s = sampling_, uniforms = uniforms_]() {
    thread_local std::vector<float> copy, q, w, gathered;
    const float* all = contiguous_rows(logits, copy);
    const int V = logits.shape(-1);
    const size_t rows = logits.size() / V;
    for (size_t r = 0; r < rows; ++r) {
      const float* l = all + r * V;
      const int best = first_max(l, V);
      const float top = l[best];
      if (s.temperature == 0 || top == -INFINITY) {  // the argmax
        if (tokens) tokens[r] = best;
        if (probs) {
          std::fill(probs + r * V, probs + (r + 1) * V, 0.0f);
          probs[r * V + best] = 1.0f;
        }
        continue;
      }
      const auto keep = kept(l, V, top, s, q);
      const double total = weigh(l, V, top, s.temperature, keep, w, gathered);
      if (tokens) {
        const size_t j = pick(w, total, uniforms[r]);
        tokens[r] = keep.empty() ? j : keep[j];
        continue;
      }
      float* p = probs + r * V;
      if (keep.empty()) {
        for (int i = 0; i < V; ++i) p[i] = float(w[i] / total);
      } else {
        std::fill(p, p + V, 0.0f);
        for (size_t j = 0; j < keep.size(); ++j) p[keep[j]] = float(w[j] / total);
      }
    }
  });
}

void Sample::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.sample] runs on the CPU only (on a GPU, mlx-lm's sampler)");
}

bool Sample::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Sample&>(other);
  return sampling_.temperature == o.sampling_.temperature && sampling_.top_p == o.sampling_.top_p &&
         sampling_.top_k == o.sampling_.top_k && uniforms_ == o.uniforms_ && distribution_ == o.distribution_;
}

}  // namespace kvmux_native
