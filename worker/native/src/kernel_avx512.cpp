// AVX-512F: a 16-lane vector is one 512-bit register.

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

namespace kvmux_native {
namespace avx512 {

struct V {
  static constexpr int PARTS = 1;  // one register a vector
  // block.h's direct: weight rows by rows of x at a time. Up to 6 rows
  // (24 sums leave the weights' 8 vectors a few spills) 4 weight rows;
  // passes of 7 to 9 rows 3 (27 sums; 8 sessions, a 9-row verify pass):
  // each 32 weights' dequantizing (a table, a widening, a shift and two
  // permutes) then serves 8 or 9 rows, not 4 + 4 or 5 + 4 (products of 8 rows
  // ~20 % faster, 9 rows ~12 %, 17 rows ~7 %; one thread, Intel Xeon).
  static constexpr int IN_FLIGHT = 4, CHUNK = 6;
  static constexpr int WIDE_IN_FLIGHT = 3, WIDE_CHUNK = 9;
  static constexpr int ONE_ROW_IN_FLIGHT = 4;
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static void halves16(const uint16_t* p, float* out) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void narrow16(const float* x, uint16_t* out) {  // nearest, ties to even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(_mm512_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT));
  }
  using vec = __m512;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float f) { return _mm512_set1_ps(f); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec load_once(const float* p) {
    vec v = _mm512_loadu_ps(p);
    asm("" : "+v"(v));
    return v;
  }
  static void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 fma16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }  // attend.h's
  static constexpr bool TABLE4 = true;
  template <bool LEVELS>
  static vec table(vec s, vec b) {
    const vec q = LEVELS ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS))))
                         : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return LEVELS ? _mm512_mul_ps(q, s) : _mm512_fmadd_ps(q, s, b);
  }
  // vpermps reads an index's low 4 bits: the byte's high nibble needs no mask.
  static void lookup4(const uint8_t* p, vec table, vec& even, vec& odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = _mm512_permutexvar_ps(bytes, table);
    odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
  static float hsum(vec a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi);  // lane i: i + (i + 8)
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // i + (i + 4)
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // i + (i + 2)
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
  static void codes4(const uint8_t* p, vec& even, vec& odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
  static vec codes8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

#include "block.h"
#include "attend.h"
#include "swiglu.h"
#include "exps.h"

// AVX-512 VNNI: the int8 products (int8.h) with 16 weight rows a
// register, codes times int8s by vpdpbusd (4 unsigned by 4 signed bytes
// into each 32-bit lane), two chains of them a block. Under a target of
// its own, after the float kernels: those run on AVX-512F CPUs without
// BW and VNNI.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")

struct Q : V {
  static constexpr int W = 16, MB = 8;
  using fvec = __m512;
  using V::load;  // beside load<BITS> below
  static fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
  template <int BITS>
  struct codes {
    __m512i d[8];  // 4 bits: dwords 0-3's low nibbles, then their high ones; 8 bits: dwords 0-7
  };
  template <int BITS>
  static codes<BITS> load(const uint8_t* p) {  // packed: register t from p + 64t, 4 bytes of each of 16 rows
    codes<BITS> c;
    if constexpr (BITS == 4) {
      const __m512i nibble = _mm512_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        const __m512i d = _mm512_loadu_si512(p + 64 * t);
        c.d[t] = _mm512_and_si512(d, nibble);
        c.d[4 + t] = _mm512_and_si512(_mm512_srli_epi16(d, 4), nibble);
      }
    } else {
      for (int t = 0; t < 8; ++t) c.d[t] = _mm512_loadu_si512(p + 64 * t);
    }
    return c;
  }
  static __m512i bytes4(const int8_t* x) { return _mm512_set1_epi32(four_bytes(x)); }
  // Register t + 4 meets x[16 + 4t..] either way: 4 bits' high nibbles
  // are the odd weights, x_order's second 16. Two chains of vpdpbusd.
  template <int BITS>
  static fvec dot(const codes<BITS>& c, const int8_t* x, int32_t start) {
    __m512i a = _mm512_set1_epi32(start), b = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      a = _mm512_dpbusd_epi32(a, c.d[t], bytes4(x + 4 * t));
      b = _mm512_dpbusd_epi32(b, c.d[4 + t], bytes4(x + 16 + 4 * t));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
  }
};

#include "int8.h"

#pragma GCC pop_options

}  // namespace avx512

IsaKernels kernels_avx512() {
  return {&avx512::attend_part<avx512::Wide>, &avx512::attend_chunk<avx512::Wide>, &avx512::narrow,
          &avx512::swiglu, &avx512::exps};
}
BlockFn block_avx512() { return &avx512::block<avx512::V, DIRECT_AVX512, TILE_AVX512, 4>; }
Int8Kernels int8_avx512() { return {&avx512::int8<avx512::Q>, &avx512::quantize}; }

}  // namespace kvmux_native
#pragma GCC pop_options

#else
namespace kvmux_native {
BlockFn block_avx512() { return nullptr; }
Int8Kernels int8_avx512() { return {}; }
IsaKernels kernels_avx512() { return {}; }
}  // namespace kvmux_native
#endif
