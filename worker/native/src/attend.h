// Attention of rows over a slab's float16 keys and values, the body of
// kernels.h's AttendFn, and the narrowing that stores them (NarrowFn):
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
  static constexpr bool ONE_REGISTER = true;  // AVX-512's: 32 of them
  static constexpr int LANES = 16;
  v16 v;
  static Wide load(const float* p) {
    Wide w;
    std::memcpy(&w.v, p, sizeof w.v);
    return w;
  }
  void store(float* p) const { std::memcpy(p, &v, sizeof v); }
  static Wide halves(const uint16_t* p) {  // 16 float16s, widened (exactly) by the file's V
    float f[16];
    V::halves16(p, f);
    return load(f);
  }
  static Wide splat(float f) { return {v16{f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}}; }  // `v16{} + f` adds 0
  Wide operator+(const Wide& o) const { return {v + o.v}; }
  Wide operator*(const Wide& o) const { return {v * o.v}; }
  static Wide max(const Wide& a, const Wide& b) { return {b.v > a.v ? b.v : a.v}; }
  static Wide masked(const Wide& s, const Wide& m) {  // s + m, or exactly m (-inf) where m is -inf
    return {m.v == -__builtin_inff() ? m.v : s.v + m.v};
  }
  template <class W>
  static Wide fma(const Wide& a, const Wide& b, const Wide& c) {
    return {W::fma16(a.v, b.v, c.v)};
  }
  v8 folded() const {  // lane l + lane l + 8
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // sums16's steps (see there): lanes of a and b, added in pairs; each
  // one instruction or two (vpermt2ps, vshufps) a side.
  static Wide fold8(const Wide& a, const Wide& b) {
    return {__builtin_shufflevector(a.v, b.v, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a.v, b.v, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)};
  }
  static Wide fold4(const Wide& a, const Wide& b) {
    return {__builtin_shufflevector(a.v, b.v, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(a.v, b.v, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)};
  }
  static Wide fold2(const Wide& a, const Wide& b) {
    return {__builtin_shufflevector(a.v, b.v, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(a.v, b.v, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)};
  }
  static Wide fold1(const Wide& a, const Wide& b) {
    return {__builtin_shufflevector(a.v, b.v, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
            __builtin_shufflevector(a.v, b.v, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31)};
  }
};

// 16 lanes as two vectors of 8.
struct Halves {
  static constexpr bool ONE_REGISTER = false;  // two of AVX2's 16
  static constexpr int LANES = 16;
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
  static Halves halves(const uint16_t* p) {
    float f[16];
    V::halves16(p, f);
    return load(f);
  }
  static Halves splat(float f) {
    const v8 v{f, f, f, f, f, f, f, f};
    return {v, v};
  }
  Halves operator+(const Halves& o) const { return {lo + o.lo, hi + o.hi}; }
  Halves operator*(const Halves& o) const { return {lo * o.lo, hi * o.hi}; }
  static Halves max(const Halves& a, const Halves& b) { return {b.lo > a.lo ? b.lo : a.lo, b.hi > a.hi ? b.hi : a.hi}; }
  static Halves masked(const Halves& s, const Halves& m) {
    return {m.lo == -__builtin_inff() ? m.lo : s.lo + m.lo, m.hi == -__builtin_inff() ? m.hi : s.hi + m.hi};
  }
  template <class W>
  static Halves fma(const Halves& a, const Halves& b, const Halves& c) {
    return {W::fma8(a.lo, b.lo, c.lo), W::fma8(a.hi, b.hi, c.hi)};
  }
  v8 folded() const { return lo + hi; }
  // Lanes l of x and l + 4 (then + 2, + 1) added, x's four sums then y's
  // in each 128-bit half (score_halves): vperm2f128 or vshufps, and an
  // add, on AVX2.
  static v8 f4(v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  static v8 f2(v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  static v8 f1(v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  }
};

// 8 lanes as one vector: AVX2's register, for a prefill chunk's queries
// (attend_chunk), where an item of 8 rows' 24 queries fill 3 of them and
// would take 32 lanes of 16-lane vectors, and for weigh_values' sums
// where a 16-lane vector is two registers.
struct Narrow {
  static constexpr bool ONE_REGISTER = true;  // one of AVX2's 16
  static constexpr int LANES = 8;
  v8 v;
  static Narrow load(const float* p) {
    Narrow n;
    std::memcpy(&n.v, p, sizeof n.v);
    return n;
  }
  void store(float* p) const { std::memcpy(p, &v, sizeof v); }
  static Narrow splat(float f) { return {v8{f, f, f, f, f, f, f, f}}; }
  Narrow operator+(const Narrow& o) const { return {v + o.v}; }
  static Narrow max(const Narrow& a, const Narrow& b) { return {b.v > a.v ? b.v : a.v}; }
  template <class W>
  static Narrow fma(const Narrow& a, const Narrow& b, const Narrow& c) {
    return {W::fma8(a.v, b.v, c.v)};
  }
};

// a * b + c in each lane, one rounding (the file's V::fma16 or fma8: the
// same bits on every instruction set).
template <class L>
inline L fma(const L& a, const L& b, const L& c) {
  return L::template fma<V>(a, b, c);
}

// The first n < 16 floats of p (float16s of h), the rest 0.
template <class L>
inline L load_tail(const float* p, int n) {
  float lanes[16] = {};
  std::memcpy(lanes, p, sizeof(float) * n);
  return L::load(lanes);
}
template <class L>
inline L load_tail(const uint16_t* h, int n) {
  float lanes[16] = {};
  for (int i = 0; i < n; ++i) lanes[i] = V::half(h[i]);
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

// Σ a[i] * b[i] over D (b: float16s) in 16 lanes (lane l takes i = 16c + l, the tail's
// lanes past D adding 0), then the lanes' tree. DC: D / 16 where known
// here (then D is a multiple of 16), else 0.
template <class L, int DC>
inline float dot16(const float* a, const uint16_t* b, int D) {
  L lanes = L::splat(0.0f);
  const int whole = DC ? DC * 16 : D / 16 * 16;
#pragma GCC unroll 16
  for (int i = 0; i < whole; i += 16) lanes = lanes + L::load(a + i) * L::halves(b + i);
  if (!DC && whole < D) lanes = lanes + load_tail<L>(a + whole, D - whole) * load_tail<L>(b + whole, D - whole);
  return tree16(lanes);
}

// The lanes of 16 vectors summed in tree16's order, 16 sums in one
// vector: x(i) gives the lanes of sum SUM_OF[i], and each fold adds
// lanes l and l + 8 (then + 4, + 2, + 1) of two vectors at once, so a
// score costs no horizontal sum of its own. Built up as it goes (x(i)
// called once per i, in order): few vectors live at once.
constexpr int SUM_OF[16] = {0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15};  // the folds' lane order

template <class L, class F>
inline L sums16(F x) {
  L w[2];
  for (int h = 0; h < 2; ++h) {
    L z[2];
    for (int k = 0; k < 2; ++k) {
      const int i = 8 * h + 4 * k;
      const L y0 = L::fold8(x(i), x(i + 1));
      const L y1 = L::fold8(x(i + 2), x(i + 3));
      z[k] = L::fold4(y0, y1);
    }
    w[h] = L::fold2(z[0], z[1]);
  }
  return L::fold1(w[0], w[1]);
}

// Slots read from memory while the slots before them are computed: the
// hardware's own prefetch left a row's pass over a full slab waiting on
// memory for more than half its time. PREFETCH_SLOTS ahead of slot j, 16
// slots' lines at a time.
constexpr int PREFETCH_SLOTS = 32;

// Slots [from, to) of `slots` (D float16s each) read in, a cache line at
// a time (none where to <= from).
inline void read_in(const uint16_t* slots, int from, int to, int D) {
  const char* p = reinterpret_cast<const char*>(slots + size_t(from) * D);
  const char* end = reinterpret_cast<const char*>(slots + size_t(to) * D);
  for (; p < end; p += 64) __builtin_prefetch(p);
}

inline void ahead(const uint16_t* slots, int j, int n, int D) {
  const int from = j + PREFETCH_SLOTS;
  read_in(slots, from, from + 16 < n ? from + 16 : n, D);
}

// N vectors folded as one (sums16 over N queries at once).
template <class L, int N>
struct Many {
  L x[N];
  static Many fold8(const Many& a, const Many& b) { return apply(a, b, [](const L& u, const L& v) { return L::fold8(u, v); }); }
  static Many fold4(const Many& a, const Many& b) { return apply(a, b, [](const L& u, const L& v) { return L::fold4(u, v); }); }
  static Many fold2(const Many& a, const Many& b) { return apply(a, b, [](const L& u, const L& v) { return L::fold2(u, v); }); }
  static Many fold1(const Many& a, const Many& b) { return apply(a, b, [](const L& u, const L& v) { return L::fold1(u, v); }); }
  template <class F>
  static Many apply(const Many& a, const Many& b, F f) {
    Many r;
    for (int i = 0; i < N; ++i) r.x[i] = f(a.x[i], b.x[i]);
    return r;
  }
};

// How many query heads a pass over a part's keys (and then its values)
// serves at once: each key and value is widened once for them all where
// the registers hold their sums (AVX-512's 32 at head size 64; on AVX2,
// some spilled, still 1.4x faster than a head at a time). Each query's
// arithmetic is the same however many share a pass.
template <class L, int DC>
constexpr int batch_of() {
  return sizeof(L) == 64 && DC <= 4 ? 3 : 1;
}

// score_slots where a 16-lane vector is two registers (AVX2's, the
// portable kernel's): sums16's folds keep each partial sum in two
// registers, and three heads' needed ~26 of AVX2's 16 (GCC kept most on
// the stack). The same sums 8 slots at a time: each slot's halves added
// at once (tree16's l + 8), then 8 slots' lanes folded by f4, f2, f1 (l +
// 4, + 2, + 1) in an order that leaves slot j + i in lane i, one
// register a partial sum: a full window's attention ~15 % faster alone
// (docs/design.md).
template <int DC, int N>
void score_halves(const Halves (*q)[DC], const uint16_t* keys, const float* mask, int n, float* s, size_t stride) {
  for (int j = 0; j < n; j += 8) {
    if (j % 16 == 0) ahead(keys, j, n, DC * 16);
    // Slot j + i's lanes (0 past n), its halves added, for each head.
    auto lanes_of = [&](int i, v8 (&out)[N]) {
      const int slot = j + i;
      if (slot >= n) {
        for (int b = 0; b < N; ++b) out[b] = v8{};
        return;
      }
      const uint16_t* k = keys + size_t(slot) * DC * 16;
      Halves r[N];
      for (int c = 0; c < DC; ++c) {
        const Halves kc = Halves::halves(k + 16 * c);
        for (int b = 0; b < N; ++b) r[b] = c ? fma(q[b][c], kc, r[b]) : q[b][0] * kc;
      }
      for (int b = 0; b < N; ++b) out[b] = r[b].folded();
    };
    // f1(f2(f4(0, 4), f4(1, 5)), f2(f4(2, 6), f4(3, 7))).
    v8 sums[2][N];
    for (int h = 0; h < 2; ++h) {
      v8 pairs[2][N], first[N], second[N];
      for (int p = 0; p < 2; ++p) {
        lanes_of(2 * h + p, first);
        lanes_of(2 * h + p + 4, second);
        for (int b = 0; b < N; ++b) pairs[p][b] = Halves::f4(first[b], second[b]);
      }
      for (int b = 0; b < N; ++b) sums[h][b] = Halves::f2(pairs[0][b], pairs[1][b]);
    }
    const int m = n - j < 8 ? n - j : 8;
    for (int b = 0; b < N; ++b) {
      v8 out = Halves::f1(sums[0][b], sums[1][b]);
      float* sj = s + size_t(b) * stride + j;
      if (mask) {
        v8 mj;
        if (m == 8) {
          std::memcpy(&mj, mask + j, sizeof mj);
        } else {
          float lanes[8] = {};
          std::memcpy(lanes, mask + j, sizeof(float) * m);
          std::memcpy(&mj, lanes, sizeof mj);
        }
        out = mj == -__builtin_inff() ? mj : out + mj;
      }
      if (m == 8) {
        std::memcpy(sj, &out, sizeof out);
      } else {
        float lanes[8];
        std::memcpy(lanes, &out, sizeof lanes);
        std::memcpy(sj, lanes, sizeof(float) * m);
      }
    }
  }
}

// score_slots where a vector is one register (AVX-512's), 16 slots at a
// time by sums16.
template <class L, int DC, int N>
void score_wide(const L (*q)[DC], const uint16_t* keys, const float* mask, int n, float* s, size_t stride) {
  for (int j = 0; j < n; j += 16) {
    ahead(keys, j, n, DC * 16);
    const Many<L, N> sums = sums16<Many<L, N>>([&](int i) {
      Many<L, N> r;
      const int slot = j + SUM_OF[i];
      if (slot >= n) {
        for (int b = 0; b < N; ++b) r.x[b] = L::splat(0.0f);
        return r;
      }
      const uint16_t* k = keys + size_t(slot) * DC * 16;
      L kc[DC];
      for (int c = 0; c < DC; ++c) kc[c] = L::halves(k + 16 * c);
      for (int b = 0; b < N; ++b) {
        r.x[b] = q[b][0] * kc[0];
#pragma GCC unroll 16
        for (int c = 1; c < DC; ++c) r.x[b] = fma(q[b][c], kc[c], r.x[b]);
      }
      return r;
    });
    const int m = n - j < 16 ? n - j : 16;
    for (int b = 0; b < N; ++b) {
      float* sj = s + size_t(b) * stride + j;
      if (m == 16) {
        (mask ? L::masked(sums.x[b], L::load(mask + j)) : sums.x[b]).store(sj);
        continue;
      }
      float lanes[16];
      sums.x[b].store(lanes);
      const float* mj = mask ? mask + j : nullptr;
      for (int l = 0; l < m; ++l) sj[l] = !mj ? lanes[l] : mj[l] == -__builtin_inff() ? mj[l] : lanes[l] + mj[l];
    }
  }
}

// The scores of N query heads (q: N x DC chunks of 16) against the keys
// of slots [0, n), into s[b * stride + j] (masked: -inf): per slot, lane
// l of each chunk's products (fused) summed over the chunks, then the
// lanes in tree16's order.
template <class L, int DC, int N>
void score_slots(const L (*q)[DC], const uint16_t* keys, const float* mask, int n, float* s, size_t stride) {
  if constexpr (L::ONE_REGISTER)
    score_wide<L, DC, N>(q, keys, mask, n, s, stride);
  else
    score_halves<DC, N>(q, keys, mask, n, s, stride);
}

// Σ_j w[b * stride + j] * values[j] over slots [0, n) for N query heads,
// into o[b * (D + 2) ...]: each value widened once for them all, each
// head's sums one chain of fused multiply-adds in slot order (a second
// chain for odd slots spilled AVX2's 16 registers).
template <class L, int DC, int N>
void weigh_values(const float* w, size_t stride, const uint16_t* values, int n, float* o) {
  if constexpr (!L::ONE_REGISTER && DC > 1) {
    // AVX2 (a vector two of its 16 registers): the sums of N heads by DC
    // chunks are 2 * N * DC registers (24 at head size 64), and GCC kept
    // all but two on the stack, a load and a store in each sum's chain
    // every slot. A few of the head's 8-lane eighths at a time instead
    // (GROUP: 9 sums at N = 3, enough chains to keep both multiply-add
    // units busy through each one's latency), over VALUE_BLOCK slots that
    // stay in L1 for the next eighths: the same sums in the same order.
    constexpr int VALUE_BLOCK = 64, E = 2 * DC, GROUP = std::max(1, std::min(E, 9 / N));
    Narrow keep[N][E];
    for (int b = 0; b < N; ++b)
      for (int e = 0; e < E; ++e) keep[b][e] = Narrow::splat(0.0f);
    for (int j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
      const int j1 = n - j0 < VALUE_BLOCK ? n : j0 + VALUE_BLOCK;
#pragma GCC unroll 16
      for (int e0 = 0; e0 < E; e0 += GROUP) {
        Narrow acc[N][GROUP];
        for (int b = 0; b < N; ++b)
          for (int g = 0; g < GROUP && e0 + g < E; ++g) acc[b][g] = keep[b][e0 + g];
        // The next block's values are read in while this block's passes
        // compute, a share in each pass (the first block's own
        // PREFETCH_SLOTS ahead, as the keys). Read in by the first pass
        // alone, they left it waiting on memory while the others ran
        // from L1: a full window's attention alone (30 layers of one row,
        // 2 threads) 2.12-2.25 against 2.30-2.40 ms, a decode step at a
        // full window 10.2-10.6 against 10.6-10.9 ms (AMD EPYC Zen 3).
        constexpr int PASSES = (E + GROUP - 1) / GROUP, SHARE = (VALUE_BLOCK + PASSES - 1) / PASSES;
        const int from = j1 + e0 / GROUP * SHARE, to = std::min({from + SHARE, j1 + VALUE_BLOCK, n});
        for (int j = j0; j < j1; ++j) {
          if (j0 == 0 && e0 == 0 && j % 16 == 0) ahead(values, j, n, DC * 16);
          if (const int t = from + (j - j0); t < to) read_in(values, t, t + 1, DC * 16);
          const uint16_t* v = values + size_t(j) * DC * 16;
          for (int g = 0; g < GROUP && e0 + g < E; ++g) {
            const int e = e0 + g;
            const Halves chunk = Halves::halves(v + 16 * (e / 2));
            const Narrow vc{e % 2 ? chunk.hi : chunk.lo};
            for (int b = 0; b < N; ++b) acc[b][g] = fma(Narrow::splat(w[size_t(b) * stride + j]), vc, acc[b][g]);
          }
        }
        for (int b = 0; b < N; ++b)
          for (int g = 0; g < GROUP && e0 + g < E; ++g) keep[b][e0 + g] = acc[b][g];
      }
    }
    for (int b = 0; b < N; ++b)
      for (int e = 0; e < E; ++e) keep[b][e].store(o + size_t(b) * (DC * 16 + 2) + 8 * e);
    return;
  }
  L acc[N][DC];
  for (int b = 0; b < N; ++b)
    for (int c = 0; c < DC; ++c) acc[b][c] = L::splat(0.0f);
  for (int j = 0; j < n; ++j) {
    if (j % 16 == 0) ahead(values, j, n, DC * 16);
    const uint16_t* v = values + size_t(j) * DC * 16;
    L vc[DC];
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) vc[c] = L::halves(v + 16 * c);
#pragma GCC unroll 4
    for (int b = 0; b < N; ++b) {
      const L p = L::splat(w[size_t(b) * stride + j]);
#pragma GCC unroll 16
      for (int c = 0; c < DC; ++c) acc[b][c] = fma(p, vc[c], acc[b][c]);
    }
  }
  for (int b = 0; b < N; ++b)
    for (int c = 0; c < DC; ++c) acc[b][c].store(o + size_t(b) * (DC * 16 + 2) + 16 * c);
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
  L most = L::splat(-__builtin_inff());  // lane l: tops[l] (a lanes array here, the compiler took it a lane at a time)
  for (int j = 0; j < whole; j += 16) most = L::max(most, L::load(s + j));
  most.store(tops);
  for (int j = whole; j < n; ++j) tops[j - whole] = s[j] > tops[j - whole] ? s[j] : tops[j - whole];
  top = tops[0];
  for (int l = 1; l < 16; ++l) top = tops[l] > top ? tops[l] : top;
  L sum = L::splat(0.0f);
  for (int j = 0; j < whole; j += 16) {
    float p[16];
    for (int l = 0; l < 16; ++l) p[l] = exp_nonpositive(s[j + l] - top);  // -inf: 0
    const L w = L::load(p);  // in registers: the compiler kept a lanes array in memory, a lane at a time
    w.store(s + j);
    sum = sum + w;
  }
  for (int j = whole; j < n; ++j) {
    const float p = exp_nonpositive(s[j] - top);
    s[j] = p;
    lanes[j - whole] = p;
  }
  return tree16(sum + L::load(lanes));
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
  const uint16_t* keys = a.keys + size_t(kv) * a.kv_stride;
  const uint16_t* values = a.values + size_t(kv) * a.kv_stride;
  const float* mask = a.mask ? a.mask + size_t(row) * a.mask_stride : nullptr;
  // Masked slots past the last seen one add nothing to any sum: stop there.
  while (mask && j1 > j0 && mask[j1 - 1] == -__builtin_inff()) --j1;
  const int n = j1 - j0;
  if constexpr (DC > 0) {  // 16 slots' scores at a time, batch_of query heads at once
    constexpr int B = batch_of<L, DC>();
    for (int g = 0; g < G;) {
      L qc[B][DC];
      const int b = G - g >= B ? B : 1;
      for (int i = 0; i < b; ++i)
        for (int c = 0; c < DC; ++c) qc[i][c] = L::load(q + size_t(g + i) * D + 16 * c);
      const uint16_t* k = keys + size_t(j0) * D;
      const float* m = mask ? mask + j0 : nullptr;
      if (b == B)
        score_slots<L, DC, B>(qc, k, m, n, scores + size_t(g) * n, n);
      else
        score_slots<L, DC, 1>(qc, k, m, n, scores + size_t(g) * n, n);
      g += b;
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const uint16_t* k = keys + size_t(j0 + j) * D;
      const float m = mask ? mask[j0 + j] : 0.0f;
      if (m == -__builtin_inff()) {
        for (int g = 0; g < G; ++g) scores[size_t(g) * n + j] = m;
        continue;
      }
      for (int g = 0; g < G; ++g) scores[size_t(g) * n + j] = dot16<L, DC>(q + size_t(g) * D, k, D) + m;
    }
  }
  // Per query head: the weights (weigh), then the weighted sum of values,
  // slot by slot.
  for (int g = 0; g < G; ++g) {
    float* o = part + size_t(g) * (D + 2);
    o[D + 1] = weigh<L>(scores + size_t(g) * n, n, o[D]);
  }
  if constexpr (DC > 0) {  // the sums in registers, batch_of query heads at once
    constexpr int B = batch_of<L, DC>();
    for (int g = 0; g < G;) {
      const int b = G - g >= B ? B : 1;
      const uint16_t* v = values + size_t(j0) * D;
      if (b == B)
        weigh_values<L, DC, B>(scores + size_t(g) * n, n, v, n, part + size_t(g) * (D + 2));
      else
        weigh_values<L, DC, 1>(scores + size_t(g) * n, n, v, n, part + size_t(g) * (D + 2));
      g += b;
    }
  } else {
    for (int g = 0; g < G; ++g) {
      const float* s = scores + size_t(g) * n;
      float* o = part + size_t(g) * (D + 2);
      for (int d = 0; d < D; ++d) o[d] = 0.0f;
      for (int j = 0; j < n; ++j) {
        const float p = s[j];
        if (p == 0.0f) continue;
        const uint16_t* v = values + size_t(j0 + j) * D;
        for (int d = 0; d < D; ++d) o[d] += p * V::half(v[d]);
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

// A prefill chunk's rows (kernels.h's ChunkFn): an item's queries (its
// rows by their query heads) are the lanes, 16 a vector, so its scores
// and its weighted sums of values are two small matrix products with no
// horizontal sums (AVX-512's weighted sums take a value's floats as the
// lanes instead: weigh_tile). Per query and 16 slots a decode row's path spends 15
// lane folds and its keys' widening beside the multiply-adds; here a
// key's float16s are widened once for every query of the item. Each
// query's arithmetic is its own, in a fixed order, whatever lane it
// takes: a score is one chain of fused multiply-adds over d, a weight's
// sum and a value's sum chains over the slots in order.

// C[i][q] = Σ_k A[i * as + k * ks] * B[k * ldb + q] over k in order (from
// C as it stands where `more`, else from 0), for MR rows i and NV vectors
// of 16 lanes q: the tile's sums stay in registers over k.
template <class L, int MR, int NV>
inline void lane_tile(const float* A, size_t as, size_t ks, const float* B, size_t ldb, float* C, size_t ldc, int K,
                      bool more) {
  L acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = more ? L::load(C + i * ldc + L::LANES * v) : L::splat(0.0f);
  for (int k = 0; k < K; ++k) {
    L b[NV];
    for (int v = 0; v < NV; ++v) b[v] = L::load(B + k * ldb + L::LANES * v);
    for (int i = 0; i < MR; ++i) {
      const L a = L::splat(A[i * as + k * ks]);
      for (int v = 0; v < NV; ++v) acc[i][v] = fma(a, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v].store(C + i * ldc + L::LANES * v);
}

// lane_tile over MR rows and QV vectors: several vectors at a time where
// a vector is one register (AVX-512's 32 hold 8 x 3 or 4 x 4 sums,
// AVX2's 16 hold 4 x 3 of 8 lanes), one at a time where it is two
// (AVX2's 16 hold 6 x 1, lane_product's; 2 x 2 measured 2x slower).
template <class L, int MR>
void lane_tiles(const float* A, size_t as, size_t ks, const float* B, size_t ldb, float* C, size_t ldc, int K, int QV,
                bool more) {
  constexpr int NV = !L::ONE_REGISTER ? 1 : L::LANES == 16 ? (MR > 4 ? 3 : 4) : (MR > 4 ? 2 : 3);
  for (int v = 0; v < QV;) {
    const int w = QV - v < NV ? QV - v : NV;
    const float* b = B + L::LANES * v;
    float* c = C + L::LANES * v;
    if (w == 4) lane_tile<L, MR, NV == 4 ? 4 : 1>(A, as, ks, b, ldb, c, ldc, K, more);
    if (w == 3) lane_tile<L, MR, NV >= 3 ? 3 : 1>(A, as, ks, b, ldb, c, ldc, K, more);
    if (w == 2) lane_tile<L, MR, NV >= 2 ? 2 : 1>(A, as, ks, b, ldb, c, ldc, K, more);
    if (w == 1) lane_tile<L, MR, 1>(A, as, ks, b, ldb, c, ldc, K, more);
    v += w;
  }
}

// C (M x W QV) = A (M x K, strides as, ks) times B (K x W QV), vectors
// of W = L::LANES, ROWS rows of C at a time, then 4, then the rest one by
// one. AVX2 takes 6 by 16 lanes (12 sums in its 16 registers beside B's
// vector and A's broadcast: a 16-row chunk's item 5-9 % faster than at
// 4; 7 and 8 spill, and were slower), 4 by 3 vectors of 8 (an 8-row
// item's 24 queries: 35 against 46 us as 32 lanes; 6 x 2 37); AVX-512 8
// (a 16-row item's scores 8 x 3 sums at a time, 7-11 % faster than 4 x
// 3: a key's broadcast serves more queries' vectors).
template <class L>
void lane_product(const float* A, size_t as, size_t ks, const float* B, size_t ldb, float* C, size_t ldc, int M, int K,
                  int QV, bool more) {
  constexpr int ROWS = L::LANES == 8 ? 4 : L::ONE_REGISTER ? 8 : 6;
  int i = 0;
  if constexpr (ROWS != 4)
    for (; i + ROWS <= M; i += ROWS)
      lane_tiles<L, ROWS>(A + i * as, as, ks, B, ldb, C + i * ldc, ldc, K, QV, more);
  for (; i + 4 <= M; i += 4) lane_tiles<L, 4>(A + i * as, as, ks, B, ldb, C + i * ldc, ldc, K, QV, more);
  for (; i < M; ++i) lane_tiles<L, 1>(A + i * as, as, ks, B, ldb, C + i * ldc, ldc, K, QV, more);
}

// out[q][d] += Σ_k w[k * lanes + q] * wide[k * D + d] over a block's m
// slots in order (from 0 where not `more`), for MR queries from q0, their
// D sums (DC vectors each) in registers over the block: the same chain
// per sum as lane_product's with the values as A, but a weight is
// broadcast and a value's 16 floats are one vector, so no lane waits for
// a query past the item's last and the sums land where the part keeps
// them.
template <class L, int DC, int MR>
inline void weigh_tile(const float* wide, const float* w, size_t lanes, int m, int q0, float* const* out, bool more) {
  L acc[MR][DC];
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < DC; ++c) acc[i][c] = more ? L::load(out[q0 + i] + 16 * c) : L::splat(0.0f);
  for (int k = 0; k < m; ++k) {
    L v[DC];
    for (int c = 0; c < DC; ++c) v[c] = L::load(wide + size_t(k) * DC * 16 + 16 * c);
    for (int i = 0; i < MR; ++i) {
      const L p = L::splat(w[size_t(k) * lanes + q0 + i]);
      for (int c = 0; c < DC; ++c) acc[i][c] = fma(p, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < DC; ++c) acc[i][c].store(out[q0 + i] + 16 * c);
}

// weigh_tile over all `queries`, 24 / DC at a time (AVX-512's 32
// registers: 24 sums, a block's DC value vectors and the broadcast),
// then the rest one by one.
template <class L, int DC>
void weigh_queries_of(const float* wide, const float* w, size_t lanes, int m, int queries, float* const* out, bool more) {
  constexpr int MR = 24 / DC;
  int q = 0;
  for (; q + MR <= queries; q += MR) weigh_tile<L, DC, MR>(wide, w, lanes, m, q, out, more);
  for (; q < queries; ++q) weigh_tile<L, DC, 1>(wide, w, lanes, m, q, out, more);
}

template <class L>
void weigh_queries(const float* wide, int D, const float* w, size_t lanes, int m, int queries, float* const* out, bool more) {
  if (D == 64) return weigh_queries_of<L, 4>(wide, w, lanes, m, queries, out, more);
  if (D == 128) return weigh_queries_of<L, 8>(wide, w, lanes, m, queries, out, more);
  return weigh_queries_of<L, 16>(wide, w, lanes, m, queries, out, more);
}

// The mask where it is not 0 (as `masked`) on the scores of slots
// [from, to) of `rows` rows (mask: the first row's, then by stride): a
// chunk's rows differ from 0 only where the window drops a slot, and
// causally over its own keys.
inline void mask_block(const float* mask, size_t stride, int rows, int G, int from, int to, float* s, size_t lanes) {
  for (int r = 0; r < rows; ++r, mask += stride)
    for (int i = from; i < to; i += 16) {
      const int end = to - i < 16 ? to : i + 16;
      uint32_t any = 0;  // 16 at a time, -0 as 0: a loop the vector unit runs
      for (int j = i; j < end; ++j) any |= __builtin_bit_cast(uint32_t, mask[j]) << 1;
      if (!any) continue;
      for (int j = i; j < end; ++j) {
        if (mask[j] == 0.0f) continue;
        for (int g = 0; g < G; ++g) {
          float& x = s[size_t(j) * lanes + r * G + g];
          x = mask[j] == -__builtin_inff() ? mask[j] : x + mask[j];
        }
      }
    }
}

// Slots [j, j + m) of `slots` (D float16s each, consecutive) widened
// (exactly) into out (m x D floats).
inline void widen(const uint16_t* slots, int j, int m, int D, float* out) {
  const uint16_t* p = slots + size_t(j) * D;
  const int count = m * D;
  int i = 0;
  for (; i + 16 <= count; i += 16) V::halves16(p + i, out + i);
  for (; i < count; ++i) out[i] = V::half(p[i]);
}

// kernels.h's ChunkFn, as above.
template <class L>
void attend_chunk(const kvmux_native::Attention& a, int r0, int r1, int kv, int j0, int j1, float* scratch, float* part,
                  size_t part_stride) {
  constexpr int KS = kvmux_native::KEY_SLOTS, VS = kvmux_native::VALUE_SLOTS;
  const int D = a.D, G = a.heads / a.kv_heads, rows = r1 - r0, span = j1 - j0, queries = rows * G;
  constexpr int W = L::LANES;
  const int QV = (queries + W - 1) / W, lanes = W * QV;  // query q: row r0 + q / G, head kv * G + q % G
  // Masked slots past every row's last seen one add nothing: stop there.
  int most = 0;
  for (int r = r0; r < r1; ++r) {
    const float* mask = a.mask ? a.mask + size_t(r) * a.mask_stride : nullptr;
    int last = j1;
    while (mask && last > j0 && mask[last - 1] == -__builtin_inff()) --last;
    most = last - j0 > most ? last - j0 : most;
  }
  float* qt = scratch;  // D x lanes: the queries, transposed (lanes past them 0)
  float* s = qt + size_t(D) * lanes;  // span x lanes: scores, then weights
  float* ot = s + size_t(span) * lanes;  // D x lanes: the weighted sums of values, where lanes (AVX2)
  float* top = ot + size_t(D) * lanes;  // lanes: each query's max score
  float* shift = top + lanes;  // lanes: what its scores are less (its max, or 0 where that is -inf)
  float* sum = shift + lanes;  // lanes: the sum of its weights
  float* wide = sum + lanes;  // VS x D: a block of keys or values, widened
  for (int q = 0; q < lanes; ++q) {
    const float* from = q < queries ? a.q + (size_t(r0 + q / G) * a.heads + size_t(kv) * G + q % G) * D : nullptr;
    for (int d = 0; d < D; ++d) qt[size_t(d) * lanes + q] = from ? from[d] : 0.0f;
  }
  const uint16_t* keys = a.keys + size_t(kv) * a.kv_stride + size_t(j0) * D;
  const uint16_t* values = a.values + size_t(kv) * a.kv_stride + size_t(j0) * D;
  // Scores a block of slots at a time, masked and their max taken while
  // the block is in L1.
  for (int v = 0; v < QV; ++v) L::splat(-__builtin_inff()).store(top + W * v);
  for (int j = 0; j < most; j += KS) {
    const int m = most - j < KS ? most - j : KS;
    ahead(keys, j, most, D);
    widen(keys, j, m, D, wide);
    lane_product<L>(wide, D, 1, qt, lanes, s + size_t(j) * lanes, lanes, m, D, QV, false);
    if (a.mask) mask_block(a.mask + size_t(r0) * a.mask_stride + j0, a.mask_stride, rows, G, j, j + m, s, lanes);
    for (int v = 0; v < QV; ++v) {  // four chains of max (one stalled on its latency)
      const L before = L::load(top + W * v);
      L t[4] = {before, before, before, before};
      int k = j;
      for (; k + 4 <= j + m; k += 4)
        for (int u = 0; u < 4; ++u) t[u] = L::max(t[u], L::load(s + size_t(k + u) * lanes + W * v));
      for (; k < j + m; ++k) t[0] = L::max(t[0], L::load(s + size_t(k) * lanes + W * v));
      L::max(L::max(t[0], t[1]), L::max(t[2], t[3])).store(top + W * v);
    }
  }
  for (int q = 0; q < lanes; ++q) {  // a query that sees none of these slots: weights exp(-inf) = 0, its max still -inf
    shift[q] = top[q] == -__builtin_inff() ? 0.0f : top[q];
    sum[q] = 0.0f;
  }
  // Then a block at a time: its weights exp(score - max) in place (-inf:
  // exactly 0), each lane's sum of them in slot order, and the weighted
  // sum of its values.
  thread_local std::vector<float*> outs;  // query q's part
  outs.resize(queries);
  for (int q = 0; q < queries; ++q) outs[q] = part + size_t(q / G) * part_stride + size_t(q % G) * (D + 2);
  const bool by_query = L::ONE_REGISTER && L::LANES == 16 && (D == 64 || D == 128 || D == 256);
  for (int j = 0; j < most; j += VS) {
    const int m = most - j < VS ? most - j : VS;
    read_in(values, j, j + m, D);  // while the weights are computed
    for (int v = 0; v < QV; ++v) {
      L total = L::load(sum + W * v);
      for (int k = j; k < j + m; ++k) {
        float* sk = s + size_t(k) * lanes + W * v;
        float p[W];
        for (int l = 0; l < W; ++l) p[l] = exp_nonpositive(sk[l] - shift[W * v + l]);
        const L w = L::load(p);
        w.store(sk);
        total = total + w;
      }
      total.store(sum + W * v);
    }
    widen(values, j, m, D, wide);
    if (by_query)
      weigh_queries<L>(wide, D, s + size_t(j) * lanes, lanes, m, queries, outs.data(), j > 0);
    else
      lane_product<L>(wide, 1, D, s + size_t(j) * lanes, lanes, ot, lanes, D, m, QV, j > 0);
  }
  for (int q = 0; q < queries; ++q) {
    float* o = outs[q];
    if (!by_query || !most)
      for (int d = 0; d < D; ++d) o[d] = most ? ot[size_t(d) * lanes + q] : 0.0f;
    o[D] = top[q];
    o[D + 1] = sum[q];
  }
}

// n floats to float16 bits: 16 at a time by the file's V, the rest one by one.
inline void narrow(const float* x, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) V::narrow16(x + i, out + i);
  for (; i < n; ++i) out[i] = float_to_half(x[i]);
}

}  // namespace
