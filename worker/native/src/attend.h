// Attention of decode rows over a slab, the body of kernels.h's AttendFn:
// written with GCC's vector extensions over 16 lanes, compiled by each
// instruction set's file (after its #pragma GCC target, as block.h) into
// that set's registers: `Wide` (one 16-lane vector) on AVX-512, `Halves`
// (two of 8) on AVX2 and in the scalar file (SSE or NEON there), where a
// 16-lane vector would live on the stack; -ffp-contract=off keeps every
// product and sum the same on each. Each (row, head) pair is computed on
// its own, in a fixed order: a row's output never depends on the others.

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));

// 16 lanes as one vector.
struct Wide {
  v16 v;
  static Wide load(const float* p) {
    Wide w;
    std::memcpy(&w.v, p, sizeof w.v);
    return w;
  }
  void store(float* p) const { std::memcpy(p, &v, sizeof v); }
  static Wide splat(float f) { return {v16{} + f}; }
  Wide operator+(const Wide& o) const { return {v + o.v}; }
  Wide operator*(const Wide& o) const { return {v * o.v}; }
  v8 folded() const {  // lane l + lane l + 8
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  }
};

// 16 lanes as two vectors of 8.
struct Halves {
  v8 lo, hi;
  static Halves load(const float* p) {
    Halves h;
    std::memcpy(&h.lo, p, sizeof h.lo);
    std::memcpy(&h.hi, p + 8, sizeof h.hi);
    return h;
  }
  void store(float* p) const {
    std::memcpy(p, &lo, sizeof lo);
    std::memcpy(p + 8, &hi, sizeof hi);
  }
  static Halves splat(float f) { return {v8{} + f, v8{} + f}; }
  Halves operator+(const Halves& o) const { return {lo + o.lo, hi + o.hi}; }
  Halves operator*(const Halves& o) const { return {lo * o.lo, hi * o.hi}; }
  v8 folded() const { return lo + hi; }
};

// The first n < 16 floats of p, the rest 0.
template <class L>
inline L load_tail(const float* p, int n) {
  float lanes[16] = {};
  std::memcpy(lanes, p, sizeof(float) * n);
  return L::load(lanes);
}

// The 16 lanes' sum in a fixed tree (l + 8, l + 4, l + 2, l + 1).
template <class L>
inline float tree16(const L& lanes) {
  const v8 s8 = lanes.folded();
  const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  const v2 s2 = __builtin_shufflevector(s4, s4, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3);
  return s2[0] + s2[1];
}

// Σ a[i] * b[i] over D in 16 lanes (lane l takes i = 16c + l, the tail's
// lanes past D adding 0), then the lanes' tree. DC: D / 16 where known
// here (then D is a multiple of 16), else 0.
template <class L, int DC>
inline float dot16(const float* a, const float* b, int D) {
  L lanes = L::splat(0.0f);
  const int whole = DC ? DC * 16 : D / 16 * 16;
#pragma GCC unroll 16
  for (int i = 0; i < whole; i += 16) lanes = lanes + L::load(a + i) * L::load(b + i);
  if (!DC && whole < D) lanes = lanes + load_tail<L>(a + whole, D - whole) * load_tail<L>(b + whole, D - whole);
  return tree16(lanes);
}

#include "expf.h"

// Scores s[0, n) in place to their weights exp(score - max) (-inf: exactly
// 0), `top` set to the max; returns the weights' sum. 16 slots at a time
// (lane l takes j = 16c + l, then the lanes' tree): a fixed order, and
// loops the vector unit runs.
template <class L>
float weigh(float* s, int n, float& top) {
  const int whole = n / 16 * 16;
  float tops[16], lanes[16] = {};
  for (int l = 0; l < 16; ++l) tops[l] = -__builtin_inff();
  for (int j = 0; j < whole; j += 16)
    for (int l = 0; l < 16; ++l) tops[l] = s[j + l] > tops[l] ? s[j + l] : tops[l];
  for (int j = whole; j < n; ++j) tops[j - whole] = s[j] > tops[j - whole] ? s[j] : tops[j - whole];
  top = tops[0];
  for (int l = 1; l < 16; ++l) top = tops[l] > top ? tops[l] : top;
  for (int j = 0; j < whole; j += 16) {
    float p[16];
    for (int l = 0; l < 16; ++l) p[l] = exp_nonpositive(s[j + l] - top);
    for (int l = 0; l < 16; ++l) {
      p[l] = s[j + l] == -__builtin_inff() ? 0.0f : p[l];
      s[j + l] = p[l];
      lanes[l] += p[l];
    }
  }
  for (int j = whole; j < n; ++j) {
    const float p = s[j] == -__builtin_inff() ? 0.0f : exp_nonpositive(s[j] - top);
    s[j] = p;
    lanes[j - whole] += p;
  }
  return tree16(L::load(lanes));
}

// One row against one KV head over slots [j0, j1): the query heads that
// share it (grouped-query attention) scored as each key is read, so a key
// is read once for them all; masked where mask[j] is -inf (those weigh
// exactly nothing, so they are not read: a row reads its slots up to a
// whole growth step of the slab, most of them masked while it grows).
// Per query head g, part[g * (D + 2) ...] gets the weighted sum of values
// by exp(score - max) (unnormalised), then the max, then the sum of those
// weights (kernels.h's PART_SLOTS). Each query's sums run in the same
// order as alone. DC: D / 16 where the caller knows it (the sums then in
// registers), else 0.
template <class L, int DC>
void attend_part_of(const kvmux_native::Attention& a, int row, int kv, int j0, int j1, float* scores, float* part) {
  const int D = DC ? DC * 16 : a.D, G = a.heads / a.kv_heads;
  const float* q = a.q + (size_t(row) * a.heads + size_t(kv) * G) * D;
  const float* keys = a.keys + size_t(kv) * a.kv_stride;
  const float* values = a.values + size_t(kv) * a.kv_stride;
  const float* mask = a.mask ? a.mask + size_t(row) * a.mask_stride : nullptr;
  // Masked slots past the last seen one add nothing to any sum: stop there.
  while (mask && j1 > j0 && mask[j1 - 1] == -__builtin_inff()) --j1;
  const int n = j1 - j0;
  for (int j = 0; j < n; ++j) {
    const float* k = keys + size_t(j0 + j) * D;
    const float m = mask ? mask[j0 + j] : 0.0f;
    if (m == -__builtin_inff()) {
      for (int g = 0; g < G; ++g) scores[size_t(g) * n + j] = m;
      continue;
    }
    for (int g = 0; g < G; ++g) scores[size_t(g) * n + j] = dot16<L, DC>(q + size_t(g) * D, k, D) + m;
  }
  // Per query head: the weights (weigh), then the weighted sum of values,
  // slot by slot.
  for (int g = 0; g < G; ++g) {
    float* s = scores + size_t(g) * n;
    float* o = part + size_t(g) * (D + 2);
    o[D + 1] = weigh<L>(s, n, o[D]);
    if constexpr (DC > 0) {  // the sums in registers
      L acc[DC];
      for (int c = 0; c < DC; ++c) acc[c] = L::splat(0.0f);
      for (int j = 0; j < n; ++j) {
        if (s[j] == 0.0f) continue;
        const L p = L::splat(s[j]);
        const float* v = values + size_t(j0 + j) * D;
#pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) acc[c] = acc[c] + p * L::load(v + 16 * c);
      }
      for (int c = 0; c < DC; ++c) acc[c].store(o + 16 * c);
    } else {
      for (int d = 0; d < D; ++d) o[d] = 0.0f;
      for (int j = 0; j < n; ++j) {
        const float p = s[j];
        if (p == 0.0f) continue;
        const float* v = values + size_t(j0 + j) * D;
        for (int d = 0; d < D; ++d) o[d] += p * v[d];
      }
    }
  }
}

template <class L>
void attend_part(const kvmux_native::Attention& a, int row, int kv, int j0, int j1, float* scores, float* part) {
  switch (a.D) {
    case 64:
      return attend_part_of<L, 4>(a, row, kv, j0, j1, scores, part);
    case 128:
      return attend_part_of<L, 8>(a, row, kv, j0, j1, scores, part);
    case 256:
      return attend_part_of<L, 16>(a, row, kv, j0, j1, scores, part);
    default:
      return attend_part_of<L, 0>(a, row, kv, j0, j1, scores, part);
  }
}

// kvmux_native.softmax_rows' arithmetic on one row of n scores plus its
// mask row (or none): the body of kernels.h's SoftmaxFn.
template <class L>
void softmax_row(const float* s, const float* mask, int n, float* out) {
  for (int j = 0; j < n; ++j) out[j] = mask ? s[j] + mask[j] : s[j];
  float top;
  const float inv = 1.0f / weigh<L>(out, n, top);
  for (int j = 0; j < n; ++j) out[j] *= inv;
}

}  // namespace
