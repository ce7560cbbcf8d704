// Attention of decode rows over a slab, the body of kernels.h's AttendFn:
// written as plain loops over 16 lanes, compiled by each instruction
// set's file (after its #pragma GCC target, as block.h) so the compiler
// vectorises them there; -ffp-contract=off keeps every product and sum
// the same on each. Each (row, head) pair is computed on its own, in a
// fixed order: a row's output never depends on the others.

namespace {

// Σ a[i] * b[i] over D in 16 lanes (lane l takes i = 16c + l), then the
// lanes' tree.
inline float dot16(const float* a, const float* b, int D) {
  float lanes[16] = {};
  const int whole = D / 16 * 16;
  for (int i = 0; i < whole; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int i = whole; i < D; ++i) lanes[i - whole] += a[i] * b[i];
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#include "expf.h"

// One row against one KV head: the query heads that share it (grouped-
// query attention) scored as each key is read, so a key is read once for
// them all; masked where mask[j] is -inf (those weigh exactly nothing),
// softmax, weighted sum. Each query's sums run in the same order as alone.
void attend_group(const kvmux_native::Attention& a, int row, int kv, float* scores) {
  const int D = a.D, length = a.length, G = a.heads / a.kv_heads;
  const float* q = a.q + (size_t(row) * a.heads + size_t(kv) * G) * D;
  const float* keys = a.keys + size_t(kv) * a.kv_stride;
  const float* values = a.values + size_t(kv) * a.kv_stride;
  const float* mask = a.mask ? a.mask + size_t(row) * a.mask_stride : nullptr;
  float* out = a.out + (size_t(row) * a.heads + size_t(kv) * G) * D;
  for (int j = 0; j < length; ++j) {
    const float* k = keys + size_t(j) * D;
    const float m = mask ? mask[j] : 0.0f;
    for (int g = 0; g < G; ++g) scores[size_t(g) * (length + 1) + j] = dot16(q + size_t(g) * D, k, D) + m;
  }
  for (int g = 0; g < G; ++g) {
    float* s = scores + size_t(g) * (length + 1);
    float top = -__builtin_inff();
    for (int j = 0; j < length; ++j) top = s[j] > top ? s[j] : top;
    float total = 0.0f;
    for (int j = 0; j < length; ++j) {
      const float p = s[j] == -__builtin_inff() ? 0.0f : exp_nonpositive(s[j] - top);
      s[j] = p;
      total += p;
    }
    s[length] = 1.0f / total;  // the slot past the last: this head's normaliser
    for (int d = 0; d < D; ++d) out[size_t(g) * D + d] = 0.0f;
  }
  for (int j = 0; j < length; ++j) {
    const float* v = values + size_t(j) * D;
    for (int g = 0; g < G; ++g) {
      const float p = scores[size_t(g) * (length + 1) + j];
      if (p == 0.0f) continue;
      float* o = out + size_t(g) * D;
      for (int d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = scores[size_t(g) * (length + 1) + length];
    for (int d = 0; d < D; ++d) out[size_t(g) * D + d] *= inv;
  }
}

}  // namespace
