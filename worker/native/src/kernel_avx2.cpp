// AVX2 + FMA: a 16-lane vector as two 256-bit registers (lanes 0-7, 8-15),
// so the sums are the AVX-512 kernel's, bit for bit.

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace kvmux_native {
namespace avx2 {

struct V {
  static constexpr bool TABLE4 = false;  // a 16-entry lookup takes two 8-lane permutes and a blend here
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static void halves16(const uint16_t* p, float* out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
  }
  static void narrow16(const float* x, uint16_t* out) {  // nearest, ties to even
    for (int h = 0; h < 2; ++h)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * h), _mm256_cvtps_ph(_mm256_loadu_ps(x + 8 * h), _MM_FROUND_TO_NEAREST_INT));
  }
  struct vec {
    __m256 lo, hi;
  };
  static constexpr int PARTS = 2;
  // block.h's direct: weight rows by rows of x at a time, each weight
  // row's vectors used as they are made (16 registers: 2 x 2 sums of two
  // registers each, beside a row's weights). A pass of 2 rows 9.5-11.9
  // against 13.3-15.4 ms for a step's products with one weight row by
  // up to 4 rows of x; 3 and 4 rows as fast either way; 2 weight rows by
  // 3 or 4 rows of x spilled sums to the stack and ran ~1.5x longer.
  static constexpr int IN_FLIGHT = 2, CHUNK = 2;
  static constexpr int WIDE_IN_FLIGHT = 2, WIDE_CHUNK = 2;  // no other shape for more rows
  // From 3 rows of x up to DIRECT_AVX2, block.h's halves (4- and 8-bit codes).
  static constexpr int HALVES_FROM = 3;
  // One row of x (a decode step): four weight rows, their sums 8
  // registers (kernels.h).
  static constexpr int ONE_ROW_IN_FLIGHT = 4;
  using part = __m256;
  // In a register: the compiler would fold the load into each FMA that
  // uses it (one load per weight row), and the loads bound the loop.
  static part load_part(const float* p) {
    part v = _mm256_loadu_ps(p);
    asm("" : "+x"(v));
    return v;
  }
  static part fma_part(part a, part b, part c) { return _mm256_fmadd_ps(a, b, c); }
  static part mul_part(part a, part b) { return _mm256_mul_ps(a, b); }
  static part zero_part() { return _mm256_setzero_ps(); }
  static __m256 fma8(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }  // attend.h's
  static part& part_of(vec& v, int h) { return h ? v.hi : v.lo; }
  static vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static vec set1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
  static vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static vec load_once(const float* p) { return {load_part(p), load_part(p + 8)}; }
  static void store(float* p, const vec& a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  static vec fma(const vec& a, const vec& b, const vec& c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static vec mul(const vec& a, const vec& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static float hsum(const vec& a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);  // lane i: i + (i + 8)
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // i + (i + 4)
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // i + (i + 2)
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
  // block.h's halves: 8 lanes of codes4's (from p + 8h for lanes 8h..)
  // and codes8's.
  static void codes4_part(const uint8_t* p, part& even, part& odd) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  static part codes8_part(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void codes4(const uint8_t* p, vec& even, vec& odd) {
    codes4_part(p, even.lo, odd.lo);
    codes4_part(p + 8, even.hi, odd.hi);
  }
  static vec codes8(const uint8_t* p) { return {codes8_part(p), codes8_part(p + 8)}; }
  // codes4_part's codes as their IQ4_LEVELS (block.h's LEVELS): each
  // byte's nibbles looked up by one byte shuffle, then widened.
  static void levels4_part(const uint8_t* p, part& even, part& odd) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    const __m128i levels = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)), nibbles);
    even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(levels));
    odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(levels, levels)));
  }
  // 32 at once: two byte shuffles, not levels4_part's four half-empty ones.
  static void levels4(const uint8_t* p, vec& even, vec& odd) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0F);
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS));
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, nibble));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    even = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)))};
    odd = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)))};
  }
  static part set1_part(float f) { return _mm256_set1_ps(f); }
  static part loadu_part(const float* p) { return _mm256_loadu_ps(p); }  // folded into the multiply-add that uses it
  static void store_part(float* p, part v) { _mm256_storeu_ps(p, v); }
  // block.h's codes of 2, 3, 5 and 6 bits: the 16 codes of MLX's
  // little-endian bit stream at p (its 2 x BITS bytes, kernels.h's
  // bytes_at: none past them), each lane's two bytes picked by one
  // shuffle, then shifted and masked by per-lane constants. Through
  // block.h's codes_any (a float each, stored and loaded again) one row
  // of x by 1,536 x 576 5-bit weights took 0.50 ms, twice float32's.
  template <int BITS>
  static vec codes_bits(const uint8_t* p) {
    constexpr int N = 2 * BITS;
    const uint64_t low = bytes_at<(N < 8 ? N : 8)>(p);
    uint64_t high = 0;
    if constexpr (N > 8) high = bytes_at<N - 8>(p + 8);
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_set_epi64x(int64_t(high), int64_t(low)));
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    static constexpr Lanes<BITS> lanes{};
    const auto part = [&](int h) {
      const __m256i pick = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes.pick[h]));
      const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes.shift[h]));
      return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, pick), shift), mask));
    };
    return {part(0), part(1)};
  }

 private:
  // codes_bits' constants: for code i = 8h + l (lane l of part h), at bit
  // BITS x i, its two bytes into the lane's low 16 bits (0x80: zero) and
  // the shift that brings its bits down.
  template <int BITS>
  struct Lanes {
    alignas(32) int8_t pick[2][32]{};
    alignas(32) int32_t shift[2][8]{};
    constexpr Lanes() {
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 8; ++l) {
          const int bit = BITS * (8 * h + l);
          for (int b = 0; b < 4; ++b) pick[h][4 * l + b] = b < 2 ? int8_t(bit / 8 + b) : int8_t(-128);
          shift[h][l] = bit % 8;
        }
    }
  };
};

#include "block.h"
#include "attend.h"
#include "swiglu.h"
#include "exps.h"

// int8.h's Q: 8 weight rows a register (the sums of 4 rows of x beside a
// block's 8 or 16 registers of codes). Codes times int8s by
// vpmaddubsw (unsigned by signed bytes, pairs summed in 16 bits: a 4-bit
// block's 8 of them at most 8 x 2 x 15 x 127), then vpmaddwd. An 8-bit
// code is taken as its two nibbles (16 x high + low): vpmaddubsw would
// saturate on whole bytes.
struct Q : V {
  static constexpr int W = 8, MB = 4;
  using fvec = __m256;
  static fvec zero() { return _mm256_setzero_ps(); }
  static fvec set1(float f) { return _mm256_set1_ps(f); }
  static fvec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, fvec a) { _mm256_storeu_ps(p, a); }
  static fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
  static fvec fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
  template <int BITS>
  struct codes {
    __m256i lo[BITS], hi[BITS];  // each dword's low and high nibbles: 4 dwords a row for 4 bits, 8 for 8
  };
  template <int BITS>
  static codes<BITS> load(const uint8_t* p) {  // packed: register t from p + 64t, 4 bytes of each of 8 rows
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    codes<BITS> c;
    for (int t = 0; t < BITS; ++t) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t));
      c.lo[t] = _mm256_and_si256(d, nibble);
      c.hi[t] = _mm256_and_si256(_mm256_srli_epi16(d, 4), nibble);
    }
    return c;
  }
  static __m256i bytes4(const int8_t* x) { return _mm256_set1_epi32(four_bytes(x)); }
  template <int BITS>
  static fvec dot(const codes<BITS>& c, const int8_t* x, int32_t start) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
    for (int t = 0; t < BITS; ++t) {
      if constexpr (BITS == 4) {  // dword t's low nibbles meet x[4t..], its high ones x[16 + 4t..]
        low = _mm256_add_epi16(low, _mm256_maddubs_epi16(c.lo[t], bytes4(x + 4 * t)));
        high = _mm256_add_epi16(high, _mm256_maddubs_epi16(c.hi[t], bytes4(x + 16 + 4 * t)));
      } else {
        const __m256i xs = bytes4(x + 4 * t);
        low = _mm256_add_epi16(low, _mm256_maddubs_epi16(c.lo[t], xs));
        high = _mm256_add_epi16(high, _mm256_maddubs_epi16(c.hi[t], xs));
      }
    }
    const __m256i weight = _mm256_set1_epi16(BITS == 4 ? 1 : 16);
    const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, weight));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_set1_epi32(start), sum));
  }
};

#include "int8.h"

namespace {

// A chunk's item in vectors of 16 lanes (two registers) where its
// queries fill them, else of 8 (one register: an item of 8 rows' 24
// queries take 3, not 32 lanes): the same sums either way, lane by lane.
void attend_chunk_of(const Attention& a, int r0, int r1, int kv, int j0, int j1, float* scratch, float* part,
                     size_t part_stride) {
  if ((r1 - r0) * (a.heads / a.kv_heads) % 16 == 0)
    return attend_chunk<Halves>(a, r0, r1, kv, j0, j1, scratch, part, part_stride);
  attend_chunk<Narrow>(a, r0, r1, kv, j0, j1, scratch, part, part_stride);
}

}  // namespace

}  // namespace avx2

IsaKernels kernels_avx2() {
  return {&avx2::attend_part<avx2::Halves>, &avx2::attend_chunk_of, &avx2::narrow,
          &avx2::swiglu, &avx2::exps};
}
BlockFn block_avx2() { return &avx2::block<avx2::V, DIRECT_AVX2, TILE_AVX2, 4>; }
Int8Kernels int8_avx2() { return {&avx2::int8<avx2::Q>, &avx2::quantize}; }

}  // namespace kvmux_native
#pragma GCC pop_options

#else
namespace kvmux_native {
BlockFn block_avx2() { return nullptr; }
Int8Kernels int8_avx2() { return {}; }
IsaKernels kernels_avx2() { return {}; }
}  // namespace kvmux_native
#endif
