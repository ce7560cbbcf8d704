// Attention of decode rows over a slab, the body of kernels.h's AttendFn:
// written as plain loops over 16 lanes, compiled by each instruction
// set's file (after its #pragma GCC target, as block.h) so the compiler
// vectorises them there; -ffp-contract=off keeps every product and sum
// the same on each. Each (row, head) pair is computed on its own, in a
// fixed order: a row's output never depends on the others.

namespace {

// The 16 lanes' sum in a fixed tree (l + 8, l + 4, l + 2, l + 1).
inline float tree16(const float* lanes) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Σ a[i] * b[i] over D in 16 lanes (lane l takes i = 16c + l), then the
// lanes' tree.
inline float dot16(const float* a, const float* b, int D) {
  float lanes[16] = {};
  const int whole = D / 16 * 16;
  for (int i = 0; i < whole; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int i = whole; i < D; ++i) lanes[i - whole] += a[i] * b[i];
  return tree16(lanes);
}

#include "expf.h"

// One row against one KV head over slots [j0, j1): the query heads that
// share it (grouped-query attention) scored as each key is read, so a key
// is read once for them all; masked where mask[j] is -inf (those weigh
// exactly nothing, so they are not read: a row reads its slots up to a
// whole growth step of the slab, most of them masked while it grows).
// Per query head g, part[g * (D + 2) ...] gets the weighted sum of values
// by exp(score - max) (unnormalised), then the max, then the sum of those
// weights (kernels.h's Part). Each query's sums run in the same order as
// alone.
void attend_part(const kvmux_native::Attention& a, int row, int kv, int j0, int j1, float* scores, float* part) {
  const int D = a.D, G = a.heads / a.kv_heads;
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
    for (int g = 0; g < G; ++g) scores[size_t(g) * n + j] = dot16(q + size_t(g) * D, k, D) + m;
  }
  // The max, then the weights exp(score - max) and their sum, 16 slots at
  // a time (lane l takes j = 16c + l, then the lanes' tree: a fixed
  // order, and a loop the vector unit runs).
  const int whole = n / 16 * 16;
  for (int g = 0; g < G; ++g) {
    float* s = scores + size_t(g) * n;
    float tops[16], lanes[16] = {};
    for (int l = 0; l < 16; ++l) tops[l] = -__builtin_inff();
    for (int j = 0; j < whole; j += 16)
      for (int l = 0; l < 16; ++l) tops[l] = s[j + l] > tops[l] ? s[j + l] : tops[l];
    for (int j = whole; j < n; ++j) tops[j - whole] = s[j] > tops[j - whole] ? s[j] : tops[j - whole];
    float top = tops[0];
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
    const float total = tree16(lanes);
    float* o = part + size_t(g) * (D + 2);
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    o[D] = top;
    o[D + 1] = total;
  }
  for (int j = 0; j < n; ++j) {
    const float* v = values + size_t(j0 + j) * D;
    for (int g = 0; g < G; ++g) {
      const float p = scores[size_t(g) * n + j];
      if (p == 0.0f) continue;
      float* o = part + size_t(g) * (D + 2);
      for (int d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
}

}  // namespace
