// The kernel's body, written once over a 16-lane vector type `V` and
// included by each instruction set's file after its `#pragma GCC target`
// (so every function here is compiled for that set, and inlined there).
// Each file wraps it in a namespace of its own: nothing here is shared
// between instruction sets at link time.
//
// V provides: vec, PARTS (registers a vec is made of: where more than one,
// part, zero_part(), load_part(p), fma_part(a, b, c) and part_of(v, h), a reference to
// its h-th register), IN_FLIGHT and CHUNK (direct's weight rows and rows
// of x at a time: what its registers hold), WIDE_IN_FLIGHT and WIDE_CHUNK
// (the same for passes of more than CHUNK rows), ONE_ROW_IN_FLIGHT (its
// weight rows at a time for one row of x), zero(), set1(f), load(p),
// load_once(p) (a load kept in a register, not folded into each
// multiply-add that uses it), store(p, v), fma(a, b, c)
// (a * b + c, one rounding), hsum(v) (the fixed tree of kernels.h),
// codes4(p, even, odd) (32 4-bit codes from 16 bytes), codes8(p) (16 8-bit codes) and
// half(h) (a float16's bits to float), halves16(p, out) (16 of them).
// Where it has no TABLE4, levels4(p, even, odd): codes4's codes as their
// IQ4_LEVELS (Mode::iq4_nl) and mul(a, b), and where PARTS > 1
// levels4_part and mul_part too.
// Where PARTS > 1, for halves: HALVES_FROM (its fewest rows of x),
// codes4_part and codes8_part (8 lanes of codes4's and codes8's),
// set1_part, loadu_part (a load the compiler may fold into a multiply-add)
// and store_part.
// TABLE4 (bool): whether it has table<LEVELS>(s, b) (the 16 values
// fma(q, s, b), q = 0..15, or with LEVELS q * s, q IQ4_LEVELS' values)
// and lookup4(p, table, even, odd) (32 4-bit codes' values).
//
// MODE, a template parameter from here down: the codes' Mode (kernels.h).
// Mode::iq4_nl's 4-bit codes stand for IQ4_LEVELS, and a weight is
// level * scale, one rounding (fma(level, scale, 0)'s value but for a
// zero's sign, the same on every instruction set); Mode::symmetric's
// bias is -2^(BITS - 1) times the scale, made from it (exactly) where a
// stored one is read.
// The including file has <cstring>, <type_traits> and kernels.h included
// before.

namespace {

// Whether a Mode's 4-bit codes stand for IQ4_LEVELS.
template <kvmux_native::Mode MODE>
constexpr bool LEVELS = MODE == kvmux_native::Mode::iq4_nl;

// The bias of a group of `scale` where a Mode stores none.
template <kvmux_native::Mode MODE, int BITS>
constexpr float bias_of(float scale) {
  return LEVELS<MODE> ? 0.0f : scale * -float(1 << (BITS - 1));
}

template <class V, kvmux_native::ScaleType ST>
inline float scale_at(const void* base, size_t i) {
  if constexpr (ST == kvmux_native::ScaleType::float16) {
    return V::half(static_cast<const uint16_t*>(base)[i]);
  } else if constexpr (ST == kvmux_native::ScaleType::bfloat16) {
    uint32_t bits = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<const float*>(base)[i];
  }
}

// `count` scales (or biases) from `first` on, as floats: 16 float16 at a
// time where the instruction set converts them (V::halves16), a row's
// last few as its last 16 (those before them converted again, to the
// same values: a row of 576 weights has 18 groups of 32), not one by one.
template <class V, kvmux_native::ScaleType ST>
inline void to_floats(const void* base, size_t first, int count, float* out) {
  int i = 0;
  if constexpr (ST == kvmux_native::ScaleType::float16) {
    const uint16_t* from = static_cast<const uint16_t*>(base) + first;
    for (; i + 16 <= count; i += 16) V::halves16(from + i, out + i);
    if (i < count && count >= 16) {
      V::halves16(from + count - 16, out + count - 16);
      return;
    }
  }
  for (; i < count; ++i) out[i] = scale_at<V, ST>(base, first + i);
}

// 16 codes of any width from k (a multiple of 16): a little-endian bit
// stream (MLX packs 2, 3, 5 and 6 bits so). The 16 codes are 2 * BITS
// whole bytes, loaded at once; each code is then a shift and a mask by
// constants. A memcpy of each code's own bytes (a call per code) ran one
// row of x by 1,536 x 576 6-bit weights in 4.2 ms against 0.35 now, 3-
// and 5-bit ones alike (two threads, AVX2; 2 bits, whose code never
// straddles a byte, 0.25 ms either way).
template <int BITS>
inline void codes_any(const uint8_t* row, int k, float* out) {
  constexpr int N = 2 * BITS;
  const uint8_t* from = row + size_t(k) * BITS / 8;
  using Word = std::conditional_t<(N > 8), unsigned __int128, uint64_t>;
  Word bits = bytes_at<(N < 8 ? N : 8)>(from);
  if constexpr (N > 8) bits |= Word(bytes_at<N - 8>(from + 8)) << 64;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) out[i] = float(uint32_t(bits >> (i * BITS)) & ((1u << BITS) - 1));
}

// The 32 codes of a row from weight k on, as floats, in the kernel's
// order (kernels.h): 4 bits even k then odd k (LEVELS: their levels),
// other widths as stored.
template <class V, int BITS, kvmux_native::Mode MODE>
inline void codes(const uint8_t* row, int k, typename V::vec& a, typename V::vec& b) {
  if constexpr (BITS == 4 && LEVELS<MODE>) {
    V::levels4(row + k / 2, a, b);
  } else if constexpr (BITS == 4) {
    V::codes4(row + k / 2, a, b);
  } else if constexpr (BITS == 8) {
    a = V::codes8(row + k);
    b = V::codes8(row + k + 16);
  } else if constexpr (requires { V::template codes_bits<BITS>(row); }) {
    a = V::template codes_bits<BITS>(row + k * BITS / 8);
    b = V::template codes_bits<BITS>(row + (k + 16) * BITS / 8);
  } else {
    alignas(64) float out[32];
    codes_any<BITS>(row, k, out);
    codes_any<BITS>(row, k + 16, out + 16);
    a = V::load(out);
    b = V::load(out + 16);
  }
}

// The 32 weights of a row from k on, `q * scale + bias` each, in the
// kernel's order: the first 16 by s and b, the last 16 by s_hi and b_hi
// (the same, but where a group is 16 weights). With 4 bits where the
// instruction set permutes a register by index (V::TABLE4), the group's
// 16 possible weights are made once (`table`, V::table: the same fused
// multiply-add per code) and the codes look them up: the same values,
// fewer operations.
template <class V, int BITS, kvmux_native::Mode MODE>
inline void weights32(const uint8_t* row, int k, const typename V::vec& s, const typename V::vec& b,
                      const typename V::vec& s_hi, const typename V::vec& b_hi, const typename V::vec& table,
                      typename V::vec& lo, typename V::vec& hi) {
  if constexpr (BITS == 4 && V::TABLE4) {
    V::lookup4(row + k / 2, table, lo, hi);
  } else {
    codes<V, BITS, MODE>(row, k, lo, hi);
    if constexpr (LEVELS<MODE>) {  // no bias: level * scale, fma(level, scale, 0)'s value
      lo = V::mul(lo, s);
      hi = V::mul(hi, s_hi);
    } else {
      lo = V::fma(lo, s, b);
      hi = V::fma(hi, s_hi, b_hi);
    }
  }
}

template <class V, int BITS, kvmux_native::Mode MODE>
inline typename V::vec table_of(const typename V::vec& s, const typename V::vec& b) {
  if constexpr (BITS == 4 && V::TABLE4) {
    return V::template table<LEVELS<MODE>>(s, b);
  } else {
    return s;  // unused
  }
}

// A group's 32-weight steps (its size / 32) as a type: by_group's. HALF:
// a group is half a step (16 weights), each half of a step has its own
// scale and bias.
template <int N, bool HALF = false>
struct Steps {
  static constexpr int value = N;
  static constexpr bool half = HALF;
};

// f(Steps<group / 32>{}) for the model's group size (32, 64 or 128, and
// 16 for widths other than 4 bits, as check_quantized allows, where the
// caller takes it: SIXTEEN): the loops over groups take their steps as a
// constant, so a group of 32 is one step with no inner loop to run.
template <int BITS, bool SIXTEEN = BITS != 4, class F>
inline void by_group(int group, F&& f) {
  if constexpr (SIXTEEN)
    if (group == 16) return f(Steps<1, true>{});
  switch (group) {
    case 32:
      return f(Steps<1>{});
    case 64:
      return f(Steps<2>{});
    default:
      return f(Steps<4>{});
  }
}

// f(m, rows) over rows m0..m1 of x in passes of at most `most` rows, as
// even as they go (9 rows in 3, 3 and 3 where `most` is 4, not 4, 4 and
// 1: a pass dequantizes its block again, or loads its weight vectors
// again, and one of a single row pays that for little).
template <class F>
inline void even_passes(int m0, int m1, int most, F&& f) {
  for (int m = m0, left = (m1 - m0 + most - 1) / most; m < m1; --left) {
    const int rows = (m1 - m + left - 1) / left;
    f(m, rows);
    m += rows;
  }
}

// Group i's bias, its scale `scale`: affine's as stored, iq4_nl's 0,
// symmetric's -2^(BITS - 1) times the scale (exact).
template <class V, kvmux_native::ScaleType ST, kvmux_native::Mode MODE, int BITS>
inline float bias_at(const void* base, size_t i, float scale) {
  if constexpr (MODE == kvmux_native::Mode::affine)
    return scale_at<V, ST>(base, i);
  else
    return bias_of<MODE, BITS>(scale);
}

// A weight row's `count` biases from group `first` on as floats (bias_at's,
// affine's through to_floats), its scales there already floats (`scale`).
template <class V, kvmux_native::ScaleType ST, kvmux_native::Mode MODE, int BITS>
inline void biases_to_floats(const void* base, size_t first, int count, const float* scale, float* out) {
  if constexpr (MODE == kvmux_native::Mode::affine)
    to_floats<V, ST>(base, first, count, out);
  else
    for (int i = 0; i < count; ++i) out[i] = bias_of<MODE, BITS>(scale[i]);
}

// Row n of W dequantized into dst (K floats, in the kernel's order);
// STEPS and HALF: by_group's.
template <class V, int BITS, kvmux_native::ScaleType ST, int STEPS, bool HALF, kvmux_native::Mode MODE>
void dequantize_row(const kvmux_native::Problem& p, int n, float* dst) {
  const int K = p.K, groups = K / p.group;
  const uint8_t* row = p.w + size_t(n) * K * BITS / 8;
  const size_t first = size_t(n) * groups;
  for (int g = 0; g < groups; g += HALF ? 2 : 1) {
    const float scale = scale_at<V, ST>(p.scales, first + g);
    const float scale_hi = HALF ? scale_at<V, ST>(p.scales, first + g + 1) : scale;
    const auto s = V::set1(scale), s_hi = V::set1(scale_hi);
    const auto b = V::set1(bias_at<V, ST, MODE, BITS>(p.biases, first + g, scale));
    const auto b_hi = HALF ? V::set1(bias_at<V, ST, MODE, BITS>(p.biases, first + g + 1, scale_hi)) : b;
    const auto table = table_of<V, BITS, MODE>(s, b);
#pragma GCC unroll 4
    for (int c = 0; c < STEPS; ++c) {
      const int k = HALF ? g * 16 : (g * STEPS + c) * 32;
      typename V::vec lo, hi;
      weights32<V, BITS, MODE>(row, k, s, b, s_hi, b_hi, table, lo, hi);
      V::store(dst + k, lo);
      V::store(dst + k + 16, hi);
    }
  }
}

// Every accumulator of a block of sums to 0.
template <class V, int MB, int NB>
inline void zero_all(typename V::vec (&acc)[MB][NB]) {
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      acc[i][j] = V::zero();
}

// Few rows of x (a decode step, a verify pass, a shared pass): NB weight
// rows dequantized in registers as they are read, each multiplied into
// MB rows of x at once; the same products and sums as the scratch path
// below.
constexpr int AHEAD = 1;

// MB rows of x from m0 against the NB weight rows `rows` (their scales
// and biases as floats, `groups` apart), written to out's columns nb..nb + nn.
// STEPS and HALF: by_group's.
//
// Where a vector is two registers (AVX2), its 16 hold the sums (8 of
// them, 4 weight rows by one row of x or 2 by 2) only if nothing else
// stays in them (TIGHT): a weight row's scale and bias are loaded where
// its weights are made, not all rows' at a group's start; x's vectors
// are loaded by each multiply-add that uses them (through a pointer the
// compiler cannot see is the same, or it keeps the 4 vectors of a row of
// x in registers for every weight row); and every sum's index is a
// constant (the last block's missing rows skipped by a condition, not a
// loop to nn, whose index put them all in memory). Before, GCC kept 6 of
// a decode row's 8 sums on the stack, a store and a load each a group:
// one thread, 1,536 x 576 in cache, 1 row of x 13.0 -> 13.7 multiply-adds
// a ns, 2 and 4 rows 15.1 -> 19.2 and 15.9 -> 20.3 (AMD EPYC, Zen 3).
// AVX-512's 32 registers held a decode row's sums already: its loops stay
// as they were (not measured otherwise: that host had no AVX-512).
template <class V, int BITS, int STEPS, bool HALF, kvmux_native::Mode MODE, int NB, int MB>
inline void direct_rows(const kvmux_native::Problem& p, const uint8_t* const* rows, const float* scale,
                        const float* bias, int nb, int nn, int m0) {
  constexpr bool TIGHT = V::PARTS > 1;
  const int K = p.K, groups = K / p.group;
  const size_t row_bytes = size_t(K) * BITS / 8;
  const float* x = p.x + size_t(m0) * K;
  typename V::vec acc[MB][NB];
  zero_all<V>(acc);
  for (int g = 0; g < groups; g += HALF ? 2 : 1) {
    typename V::vec s[NB], b[NB], s_hi[NB], b_hi[NB], table[NB];
    const auto scale_row = [&](int j) {
      s[j] = V::set1(scale[size_t(j) * groups + g]);
      b[j] = V::set1(bias[size_t(j) * groups + g]);
      s_hi[j] = HALF ? V::set1(scale[size_t(j) * groups + g + 1]) : s[j];
      b_hi[j] = HALF ? V::set1(bias[size_t(j) * groups + g + 1]) : b[j];
      table[j] = table_of<V, BITS, MODE>(s[j], b[j]);
    };
    if constexpr (!TIGHT) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) scale_row(j);
    }
#pragma GCC unroll 4
    for (int c = 0; c < STEPS; ++c) {
      const int k = HALF ? g * 16 : (g * STEPS + c) * 32;
      // The rows AHEAD blocks on, a cache line at a time: the
      // prefetchers follow a row's stream, not the jump to the next rows.
      if ((k * BITS / 8) % 64 == 0)
        for (int j = 0; j < NB; ++j) __builtin_prefetch(rows[j] + AHEAD * NB * row_bytes + k * BITS / 8);
      if constexpr (MB == 1 || V::PARTS > 1) {
        // Each weight row's vectors used as they are made, each x vector
        // loaded where it is used (from L1): AVX2's 16 registers then hold
        // several weight rows' sums beside one row's weights, so that a
        // decode step has four chains of multiply-adds in flight, not one.
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
          if constexpr (TIGHT) scale_row(j);
          typename V::vec lo, hi;
          weights32<V, BITS, MODE>(rows[j], k, s[j], b[j], s_hi[j], b_hi[j], table[j], lo, hi);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const float* xi = x + size_t(i) * K + k;
            if constexpr (TIGHT) asm volatile("" : "+r"(xi));
            acc[i][j] = V::fma(V::load(xi), lo, acc[i][j]);
            acc[i][j] = V::fma(V::load(xi + 16), hi, acc[i][j]);
          }
        }
        continue;
      }
      // Each x vector loaded once for the NB weight rows: folded into each
      // multiply-add instead, its NB loads bound the loop.
      typename V::vec lo[NB], hi[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        weights32<V, BITS, MODE>(rows[j], k, s[j], b[j], s_hi[j], b_hi[j], table[j], lo[j], hi[j]);
#pragma GCC unroll 9
      for (int i = 0; i < MB; ++i) {
        const auto xlo = V::load_once(x + size_t(i) * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j)
          acc[i][j] = V::fma(xlo, lo[j], acc[i][j]);
        const auto xhi = V::load_once(x + size_t(i) * K + k + 16);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j)
          acc[i][j] = V::fma(xhi, hi[j], acc[i][j]);
      }
    }
  }
  if constexpr (TIGHT) {
#pragma GCC unroll 9
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        if (j < nn) p.out[size_t(m0 + i) * p.N + nb + j] = V::hsum(acc[i][j]);
  } else {
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < nn; ++j) p.out[size_t(m0 + i) * p.N + nb + j] = V::hsum(acc[i][j]);
  }
}

// direct_rows of `take` (1..MB) rows of x.
template <class V, int BITS, kvmux_native::Mode MODE, int NB, int MB>
inline void direct_pass(int take, const kvmux_native::Problem& p, const uint8_t* const* rows, const float* scale,
                        const float* bias, int nb, int nn, int m0) {
  if constexpr (MB > 1)
    if (take < MB) return direct_pass<V, BITS, MODE, NB, MB - 1>(take, p, rows, scale, bias, nb, nn, m0);
  by_group<BITS>(p.group, [&](auto steps) {
    using S = decltype(steps);
    direct_rows<V, BITS, S::value, S::half, MODE, NB, MB>(p, rows, scale, bias, nb, nn, m0);
  });
}

// Where a vector is two registers (AVX2), passes of a few rows of x
// (V::HALVES_FROM to DIRECT: a shared step of several sessions, a short
// verify pass) straight from the codes, one 8-lane half of the vector at
// a time: a lane's sum never meets another lane's before V::hsum, so the
// halves run one after the other, the same sums in the same order. A
// half's 16 weights, made once, meet up to HALF_ROWS rows of x: their
// sums, the two weight registers, the scale and the bias fill AVX2's 16
// registers. direct's 2 weight rows by 2 rows of x made each weight
// again for every 2 rows, and the scratch path stores every weight and
// loads it again: 8 rows of x by gate_proj's and down_proj's 1,536 x
// 576 weights 61.7 and 55.0 against 53.3 and 43.5 GMAC/s, the tied
// head's 8-bit 49,152 x 576 55.5 against 41-45 (two threads, AMD EPYC
// Zen 3). The rows' sums over K in blocks whose rows of x (XBLOCK bytes,
// packed by pack_pass) stay in L1 while HALF_WEIGHT_ROWS weight rows
// pass them.
constexpr int HALF_ROWS = 8, HALF_WEIGHT_ROWS = 8, XBLOCK = 20 << 10;
// Up to PAIR_ROWS rows of x take two weight rows at a time: one weight
// row's 3 or 4 sums were too few chains of multiply-adds for the units'
// latency (3 rows 43-48 against 34-36 GMAC/s, 4 rows 49-51 against 42-45,
// the same shapes and threads).
constexpr int PAIR_ROWS = 4;

// MB rows of x (packed at xp) by NB weight rows from `row` (row_bytes
// apart; their scales and biases `groups` apart) over weights k0..k1,
// half h of the vector, into acc.
template <class V, int BITS, int STEPS, kvmux_native::Mode MODE, int MB, int NB>
inline void half_rows(const uint8_t* row, size_t row_bytes, const float* scale, const float* bias, int groups,
                      const float* xp, int k0, int k1, int h, typename V::part (&acc)[NB][MB]) {
  constexpr int W = 16 / V::PARTS;
  for (int g = k0 / (32 * STEPS), k = k0; k < k1; k += 32 * STEPS, ++g) {
#pragma GCC unroll 4
    for (int c = 0; c < STEPS; ++c, xp += 2 * V::PARTS * MB * W) {
      const int kc = k + 32 * c;
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) {
        const auto s = V::set1_part(scale[j * groups + g]), b = V::set1_part(bias[j * groups + g]);
        typename V::part lo, hi;
        const uint8_t* r = row + j * row_bytes;
        if constexpr (BITS == 4 && LEVELS<MODE>) {
          V::levels4_part(r + kc / 2 + W * h, lo, hi);
        } else if constexpr (BITS == 4) {
          V::codes4_part(r + kc / 2 + W * h, lo, hi);
        } else {
          lo = V::codes8_part(r + kc + W * h);
          hi = V::codes8_part(r + kc + 16 + W * h);
        }
        if constexpr (LEVELS<MODE>) {
          lo = V::mul_part(lo, s);
          hi = V::mul_part(hi, s);
        } else {
          lo = V::fma_part(lo, s, b);
          hi = V::fma_part(hi, s, b);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) {
          acc[j][i] = V::fma_part(V::loadu_part(xp + W * i), lo, acc[j][i]);
          acc[j][i] = V::fma_part(V::loadu_part(xp + W * (MB + i)), hi, acc[j][i]);
        }
      }
    }
  }
}

// A pass's `take` rows of x from m packed for half_rows: per 32 weights,
// per half h, the rows' h-th 8 lanes of the first 16, then of the last
// 16, so that every load in its loop is one pointer and a constant.
template <class V>
inline void pack_pass(const kvmux_native::Problem& p, int m, int take, float* out) {
  constexpr int W = 16 / V::PARTS;
  for (int k = 0; k < p.K; k += 32)
    for (int h = 0; h < V::PARTS; ++h)
      for (int t = 0; t < 2; ++t)
        for (int i = 0; i < take; ++i, out += W) std::memcpy(out, p.x + size_t(m + i) * p.K + k + 16 * t + W * h, W * 4);
}

// half_rows' pass of `take` (1..MB) rows of x over weights k0..k1 of NB
// weight rows, its sums (per weight row and row of x 16 floats, weight
// rows sum_stride apart) carried in `sums` from the block of K before.
template <class V, int BITS, int STEPS, kvmux_native::Mode MODE, int MB, int NB>
inline void half_pass(int take, const uint8_t* row, size_t row_bytes, const float* scale, const float* bias,
                      int groups, const float* xp, int k0, int k1, float* sums, size_t sum_stride) {
  if constexpr (MB > 1)
    if (take < MB)
      return half_pass<V, BITS, STEPS, MODE, MB - 1, NB>(take, row, row_bytes, scale, bias, groups, xp, k0, k1, sums,
                                                         sum_stride);
  constexpr int W = 16 / V::PARTS;
#pragma GCC unroll 2
  for (int h = 0; h < V::PARTS; ++h) {
    typename V::part acc[NB][MB];
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) acc[j][i] = k0 ? V::loadu_part(sums + j * sum_stride + 16 * i + W * h) : V::zero_part();
    half_rows<V, BITS, STEPS, MODE, MB, NB>(row, row_bytes, scale, bias, groups,
                                            xp + size_t(k0 / 32) * 2 * V::PARTS * MB * W + h * 2 * MB * W, k0, k1, h, acc);
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) V::store_part(sums + j * sum_stride + 16 * i + W * h, acc[j][i]);
  }
}

// Rows m0..m1 of x by weight rows n0..n1 by half_rows, 4- or 8-bit codes:
// up to PAIR_ROWS rows of x two weight rows at a time (their sums 2 x 4
// chains of multiply-adds, as many as 8 rows of x by one give).
template <class V, int BITS, kvmux_native::ScaleType ST, kvmux_native::Mode MODE>
void halves(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1) {
  const int K = p.K, groups = K / p.group, rows = m1 - m0;
  const size_t row_bytes = size_t(K) * BITS / 8;
  const int blocks = int((size_t(K) * rows * 4 + XBLOCK - 1) / XBLOCK);
  const int span = (K / blocks + p.group - 1) / p.group * p.group;
  // Floats, not vectors: a std::vector of AVX registers would be
  // instantiated outside this file's target pragma.
  thread_local std::vector<float> sums, converted, packed;
  sums.resize(size_t(HALF_WEIGHT_ROWS) * rows * 16);
  converted.resize(size_t(4) * groups + 16);
  packed.resize(size_t(rows) * K + 16);
  // At a cache line's start: a load across two lines costs two.
  float* xp = packed.data() + (16 - reinterpret_cast<uintptr_t>(packed.data()) / sizeof(float) % 16) % 16;
  even_passes(m0, m1, HALF_ROWS, [&](int m, int take) { pack_pass<V>(p, m, take, xp + size_t(m - m0) * K); });
  float* scale = converted.data();  // two weight rows' scales, then their biases
  float* bias = scale + 2 * groups;
  const bool pairs = rows <= PAIR_ROWS;
  by_group<BITS, false>(p.group, [&](auto steps) {  // never groups of 16 (block_typed)
    constexpr int STEPS = decltype(steps)::value;
    for (int nb = n0; nb < n1; nb += HALF_WEIGHT_ROWS) {
      const int ne = n1 - nb < HALF_WEIGHT_ROWS ? n1 : nb + HALF_WEIGHT_ROWS;
      for (int k0 = 0; k0 < K; k0 += span) {
        const int k1 = K - k0 < span ? K : k0 + span, g0 = k0 / p.group, count = (k1 - k0) / p.group;
        for (int n = nb; n < ne;) {
          const int pair = pairs && n + 1 < ne ? 2 : 1;
          for (int j = 0; j < pair; ++j) {
            to_floats<V, ST>(p.scales, size_t(n + j) * groups + g0, count, scale + j * groups + g0);
            biases_to_floats<V, ST, MODE, BITS>(p.biases, size_t(n + j) * groups + g0, count, scale + j * groups + g0,
                                                bias + j * groups + g0);
          }
          float* s = sums.data() + size_t(n - nb) * rows * 16;
          even_passes(m0, m1, HALF_ROWS, [&](int m, int take) {
            if (pair == 2)
              half_pass<V, BITS, STEPS, MODE, PAIR_ROWS, 2>(take, p.w + n * row_bytes, row_bytes, scale, bias, groups,
                                                            xp + size_t(m - m0) * K, k0, k1, s + size_t(m - m0) * 16,
                                                            size_t(rows) * 16);
            else
              half_pass<V, BITS, STEPS, MODE, HALF_ROWS, 1>(take, p.w + n * row_bytes, row_bytes, scale, bias, groups,
                                                            xp + size_t(m - m0) * K, k0, k1, s + size_t(m - m0) * 16,
                                                            size_t(rows) * 16);
          });
          n += pair;
        }
      }
      for (int n = nb; n < ne; ++n)
        for (int i = 0; i < rows; ++i)
          p.out[size_t(m0 + i) * p.N + n] = V::hsum(V::load(sums.data() + (size_t(n - nb) * rows + i) * 16));
    }
  });
}

// Rows m0..m1 of x by weight rows n0..n1, NB weight rows at a time, each
// block's rows of x CHUNK at a time while its codes are in L1 (its bytes
// are read from memory once, whatever the rows).
template <class V, int BITS, kvmux_native::ScaleType ST, kvmux_native::Mode MODE, int NB, int CHUNK>
void direct(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1) {
  const int K = p.K, groups = K / p.group;
  const size_t row_bytes = size_t(K) * BITS / 8;
  // The block's scales and biases as floats, converted 16 at a time (one
  // broadcast load each in the loop below, not a conversion).
  thread_local std::vector<float> converted;
  converted.resize(size_t(2) * NB * groups + 16);
  float* scale = converted.data();
  float* bias = scale + size_t(NB) * groups;
  for (int nb = n0; nb < n1; nb += NB) {
    const int nn = n1 - nb < NB ? n1 - nb : NB;
    const uint8_t* rows[NB];
    for (int j = 0; j < NB; ++j) {
      const int n = nb + (j < nn ? j : 0);  // past the end: row nb again, its results dropped
      rows[j] = p.w + n * row_bytes;
      to_floats<V, ST>(p.scales, size_t(n) * groups, groups, scale + size_t(j) * groups);
      biases_to_floats<V, ST, MODE, BITS>(p.biases, size_t(n) * groups, groups, scale + size_t(j) * groups,
                                          bias + size_t(j) * groups);
    }
    even_passes(m0, m1, CHUNK, [&](int m, int take) {
      direct_pass<V, BITS, MODE, NB, CHUNK>(take, p, rows, scale, bias, nb, nn, m);
    });
  }
}

// MB rows of x against NB dequantized rows of W: one accumulator each.
// Where a vector is two registers (V::PARTS, AVX2), each half's sums run
// on their own, then the other half's (a lane's sum never meets another
// lane's before V::hsum): only half of the sums are held at once, so that
// 16 registers hold 3 weight rows by 4 rows of x (the same sums, in the
// same order either way). A half reads half of each cache line, so the
// halves take turns over KBLOCK weights at a time, the other half's sums
// kept in memory meanwhile: the block's lines, read by the first half,
// are still in L1 for the second. Over all of K a row of down_proj's 1,536
// weights (7 rows of 6 KB a tile) fell out of L1 between the halves: its
// tiles ran at 5.5-6.5 multiply-adds a cycle against 8-9 in blocks (one
// thread, AMD EPYC with AVX2).
constexpr int KBLOCK = 512;

template <class V, int NB, int MB>
void tile(const float* x, int ldx, const float* w, int K, float* out, int ldo) {
  typename V::vec acc[MB][NB];
  if constexpr (V::PARTS > 1) {
    constexpr int W = 16 / V::PARTS;
    zero_all<V>(acc);
    for (int k0 = 0; k0 < K; k0 += KBLOCK) {
      const int k1 = K - k0 < KBLOCK ? K : k0 + KBLOCK;
#pragma GCC unroll 2
      for (int h = 0; h < V::PARTS; ++h) {
        typename V::part a[MB][NB];
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) a[i][j] = V::part_of(acc[i][j], h);
        for (int k = k0 + W * h; k < k1; k += 16) {
          typename V::part wv[NB];
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) wv[j] = V::load_part(w + size_t(j) * K + k);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const auto xv = V::load_part(x + size_t(i) * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < NB; ++j) a[i][j] = V::fma_part(xv, wv[j], a[i][j]);
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) V::part_of(acc[i][j], h) = a[i][j];
      }
    }
  } else {
    zero_all<V>(acc);
    for (int k = 0; k < K; k += 16) {
      typename V::vec wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        wv[j] = V::load(w + size_t(j) * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const auto xv = V::load(x + size_t(i) * ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j)
          acc[i][j] = V::fma(xv, wv[j], acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      out[size_t(i) * ldo + j] = V::hsum(acc[i][j]);
}

// tile of NB weight rows by `rows` (1..MB) rows of x: a last block of
// fewer rows still shares each weight vector among all of them.
template <class V, int NB, int MB>
void tile_rows(int rows, const float* x, int ldx, const float* w, int K, float* out, int ldo) {
  if constexpr (MB > 1)
    if (rows < MB) return tile_rows<V, NB, MB - 1>(rows, x, ldx, w, K, out, ldo);
  tile<V, NB, MB>(x, ldx, w, K, out, ldo);
}

template <class V, int BITS, kvmux_native::ScaleType ST, kvmux_native::Mode MODE, int NB, int MB>
void scratch_block(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1, float* scratch) {
  const int K = p.K;
  by_group<BITS>(p.group, [&](auto steps) {
    using S = decltype(steps);
    for (int n = n0; n < n1; ++n)
      dequantize_row<V, BITS, ST, S::value, S::half, MODE>(p, n, scratch + size_t(n - n0) * K);
  });
  for (int nb = n0; nb < n1; nb += NB) {
    const float* w = scratch + size_t(nb - n0) * K;
    even_passes(m0, m1, MB, [&](int mb, int rows) {
      const float* x = p.x + size_t(mb) * K;
      float* out = p.out + size_t(mb) * p.N + nb;
      if (nb + NB <= n1) {
        tile_rows<V, NB, MB>(rows, x, K, w, K, out, p.N);
        return;
      }
      for (int j = 0; nb + j < n1; ++j)  // the last weight rows, fewer than NB
        tile_rows<V, 1, MB>(rows, x, K, w + size_t(j) * K, K, out + j, p.N);
    });
  }
}

// Rows m0..m1 of x by rows n0..n1 of W: up to DIRECT rows of x straight
// from the codes (V::IN_FLIGHT weight rows by V::CHUNK rows of x at a time,
// V::WIDE_IN_FLIGHT by V::WIDE_CHUNK where every such pass would take
// more than CHUNK rows, V::ONE_ROW_IN_FLIGHT weight rows where x is one
// row), more through the scratch (the weights dequantized once for all of
// them) in tiles of NB weight rows by MB rows of x: the same products and
// sums either way.
template <class V, int BITS, kvmux_native::ScaleType ST, kvmux_native::Mode MODE, int DIRECT, int NB, int MB>
void block_typed(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1, float* scratch) {
  const int rows = m1 - m0;
  if (rows == 1) return direct<V, BITS, ST, MODE, V::ONE_ROW_IN_FLIGHT, 1>(p, n0, n1, m0, m1);
  if constexpr (V::WIDE_CHUNK > V::CHUNK) {
    const int passes = (rows + V::WIDE_CHUNK - 1) / V::WIDE_CHUNK;
    if (rows <= DIRECT && rows >= passes * (V::CHUNK + 1))
      return direct<V, BITS, ST, MODE, V::WIDE_IN_FLIGHT, V::WIDE_CHUNK>(p, n0, n1, m0, m1);
  }
  if constexpr (V::PARTS > 1 && (BITS == 4 || BITS == 8))  // a half's scale is per 32 weights at least
    if (rows >= V::HALVES_FROM && rows <= DIRECT && p.group != 16) return halves<V, BITS, ST, MODE>(p, n0, n1, m0, m1);
  if (rows <= DIRECT) return direct<V, BITS, ST, MODE, V::IN_FLIGHT, V::CHUNK>(p, n0, n1, m0, m1);
  scratch_block<V, BITS, ST, MODE, NB, MB>(p, n0, n1, m0, m1, scratch);
}

template <class V, int BITS, kvmux_native::Mode MODE, int DIRECT, int NB, int MB>
void block_bits(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1, float* scratch) {
  using kvmux_native::ScaleType;
  switch (p.scale_type) {
    case ScaleType::float16:
      return block_typed<V, BITS, ScaleType::float16, MODE, DIRECT, NB, MB>(p, n0, n1, m0, m1, scratch);
    case ScaleType::bfloat16:
      return block_typed<V, BITS, ScaleType::bfloat16, MODE, DIRECT, NB, MB>(p, n0, n1, m0, m1, scratch);
    default:
      return block_typed<V, BITS, ScaleType::float32, MODE, DIRECT, NB, MB>(p, n0, n1, m0, m1, scratch);
  }
}

// The codes' width: MODE's block_bits for p.bits (symmetric codes are
// never 2 bits: check_quantized refuses them, so none is compiled).
template <class V, kvmux_native::Mode MODE, kvmux_native::DirectRows D, int NB, int MB>
void block_width(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1, float* scratch) {
  switch (p.bits) {
    case 4:
      return block_bits<V, 4, MODE, D.of(4), NB, MB>(p, n0, n1, m0, m1, scratch);
    case 8:
      return block_bits<V, 8, MODE, D.of(8), NB, MB>(p, n0, n1, m0, m1, scratch);
    case 2:
      if constexpr (MODE == kvmux_native::Mode::affine)
        return block_bits<V, 2, MODE, D.of(2), NB, MB>(p, n0, n1, m0, m1, scratch);
      return;
    case 3:
      return block_bits<V, 3, MODE, D.of(3), NB, MB>(p, n0, n1, m0, m1, scratch);
    case 5:
      return block_bits<V, 5, MODE, D.of(5), NB, MB>(p, n0, n1, m0, m1, scratch);
    default:
      return block_bits<V, 6, MODE, D.of(6), NB, MB>(p, n0, n1, m0, m1, scratch);
  }
}

// D: the rows of x each width takes straight from the codes (kernels.h).
template <class V, kvmux_native::DirectRows D, int NB, int MB>
void block(const kvmux_native::Problem& p, int n0, int n1, int m0, int m1, float* scratch) {
  using kvmux_native::Mode;
  if (p.mode == Mode::iq4_nl) return block_bits<V, 4, Mode::iq4_nl, D.of(4), NB, MB>(p, n0, n1, m0, m1, scratch);
  if (p.mode == Mode::symmetric) return block_width<V, Mode::symmetric, D, NB, MB>(p, n0, n1, m0, m1, scratch);
  return block_width<V, Mode::affine, D, NB, MB>(p, n0, n1, m0, m1, scratch);
}

}  // namespace
