// The portable kernel: 16 float lanes as an array, std::fma per lane. Any
// CPU (Linux aarch64 among them) runs it; on x86 it is the fallback.

#include <cmath>

#include <cstring>
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
};

#include "block.h"
#include "attend.h"
#include "swiglu.h"
#include "exps.h"

}  // namespace scalar

IsaKernels kernels_scalar() {
  return {&scalar::attend_part<scalar::Halves>, &scalar::attend_chunk<scalar::Halves>, &scalar::narrow,
          &scalar::swiglu, &scalar::exps};
}
BlockFn block_scalar() { return &scalar::block<scalar::V, DIRECT_SCALAR, TILE_SCALAR, DIRECT_SCALAR>; }

}  // namespace kvmux_native
