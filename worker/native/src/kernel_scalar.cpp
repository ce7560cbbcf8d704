// The portable kernel: 16 float lanes as an array, std::fma per lane. Any
// CPU (Linux aarch64 among them) runs it; on x86 it is the fallback.

#include <algorithm>
#include <cmath>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace kvmux_native {
namespace scalar {

struct V {
  static constexpr int PARTS = 1;  // one register a vector
  static constexpr int IN_FLIGHT = 1, CHUNK = 1;  // block.h's direct: weight rows by rows of x at a time
  static constexpr int WIDE_IN_FLIGHT = 1, WIDE_CHUNK = 1;
  static constexpr int ONE_ROW_IN_FLIGHT = 1;
  static constexpr bool TABLE4 = false;
  static float half(uint16_t h) { return kvmux_native::half_to_float(h); }
  static void halves16(const uint16_t* p, float* out) {
    for (int i = 0; i < 16; ++i) out[i] = kvmux_native::half_to_float(p[i]);
  }
  static void narrow16(const float* x, uint16_t* out) {
    for (int i = 0; i < 16; ++i) out[i] = kvmux_native::float_to_half(x[i]);
  }
  struct vec {
    float v[16];
  };
  static vec zero() { return set1(0.0f); }
  static vec set1(float f) {
    vec r;
    for (float& x : r.v) x = f;
    return r;
  }
  static vec load(const float* p) {
    vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static vec load_once(const float* p) { return load(p); }
  static void store(float* p, const vec& a) {
    for (int i = 0; i < 16; ++i) p[i] = a.v[i];
  }
  typedef float f8 __attribute__((vector_size(32)));
  static f8 fma8(f8 a, f8 b, f8 c) {  // attend.h's
    for (int i = 0; i < 8; ++i) a[i] = std::fma(a[i], b[i], c[i]);
    return a;
  }
  static vec fma(const vec& a, const vec& b, const vec& c) {
    vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  static vec mul(const vec& a, const vec& b) {
    vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static float hsum(const vec& a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; ++i) s8[i] = a.v[i] + a.v[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
  static void codes4(const uint8_t* p, vec& even, vec& odd) {
    for (int i = 0; i < 16; ++i) {
      even.v[i] = float(p[i] & 0xF);
      odd.v[i] = float(p[i] >> 4);
    }
  }
  static vec codes8(const uint8_t* p) {
    vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = float(p[i]);
    return r;
  }
  static void levels4(const uint8_t* p, vec& even, vec& odd) {
    for (int i = 0; i < 16; ++i) {
      even.v[i] = float(IQ4_LEVELS[p[i] & 0xF]);
      odd.v[i] = float(IQ4_LEVELS[p[i] >> 4]);
    }
  }
};

#include "block.h"
#include "attend.h"
#include "swiglu.h"
#include "exps.h"

// int8.h's Q: 16 weight rows as arrays, each one's integer sum a loop.
struct Q : V {
  static constexpr int W = 16, MB = 1;
  using fvec = vec;
  using V::load;  // beside load<BITS> below
  static vec mul(const vec& a, const vec& b) {
    vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  template <int BITS>
  struct codes {
    uint8_t b[16][32];  // each row's block, as MLX stores it
  };
  template <int BITS>
  static codes<BITS> load(const uint8_t* p) {  // packed: 64 bytes (4 of each row) per 4 bytes of a row
    codes<BITS> c;
    for (int t = 0; t < BITS; ++t)
      for (int r = 0; r < 16; ++r) std::memcpy(c.b[r] + 4 * t, p + 64 * t + 4 * r, 4);
    return c;
  }
  template <int BITS>
  static vec dot(const codes<BITS>& c, const int8_t* x, int32_t start) {
    vec out;
    for (int r = 0; r < 16; ++r) {
      int32_t sum = start;
      for (int j = 0; j < 4 * BITS; ++j)
        sum += BITS == 4 ? (c.b[r][j] & 0xF) * x[j] + (c.b[r][j] >> 4) * x[16 + j] : c.b[r][j] * x[j];
      out.v[r] = float(sum);
    }
    return out;
  }
};

#include "int8.h"

}  // namespace scalar

IsaKernels kernels_scalar() {
  return {&scalar::attend_part<scalar::Halves>, &scalar::attend_chunk<scalar::Halves>, &scalar::narrow,
          &scalar::swiglu, &scalar::exps};
}
BlockFn block_scalar() { return &scalar::block<scalar::V, DIRECT_SCALAR, TILE_SCALAR, 1>; }
Int8Kernels int8_scalar() { return {&scalar::int8<scalar::Q>, &scalar::quantize}; }

}  // namespace kvmux_native
