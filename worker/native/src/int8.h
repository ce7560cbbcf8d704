// The int8 products' body (kernels.h, "int8 products"), written once over
// an instruction set's `Q` and included by its file after block.h, as
// attend.h is.
//
// A vector's lanes are W weight rows (16, or 8 on AVX2: half a packed
// block of rows), so a weight row's sums never cross lanes: each row of
// x meets a 32-weight block's codes as 4-byte broadcasts. Q provides W,
// MB (rows of x at a time), fvec (W floats) with zero(), set1(f), load(p),
// store(p, v), fma(a, b, c) and mul(a, b); codes<BITS> with
// load<BITS>(p) (a block's codes of the W rows, packed: 64 bytes from p
// per 4 bytes of a row) and dot<BITS>(codes, x, start) (per weight row:
// start + the exact sum of its block's codes times x's 32 int8s, as
// floats).

namespace {

// Codes read from memory this far ahead of the block at hand (and the
// scales a quarter as far): the hardware's prefetch alone left a decode
// step's int8 products waiting on memory (one session's step 7.0 -> 5.5-6.3
// ms at 4 KB; 1 and 2 KB ahead gained less, 8 and 16 KB no more).
constexpr int PREFETCH = 4096;

// MB rows of x from m0 against W weight rows (`codes` and `scales`: their
// packed block's, `half` of it on AVX2), written to out's columns nb..nb + nn.
template <class Q, int BITS, kvmux_native::ScaleType ST, int MB>
void int8_rows(const kvmux_native::Problem& p, const kvmux_native::Quantized& q, const uint8_t* codes,
               const void* scales, int half, int nb, int nn, int m0) {
  constexpr int W = Q::W, SCALE_BYTES = ST == kvmux_native::ScaleType::float32 ? 4 : 2;
  const int blocks = p.K / 32, per_group = p.group / 32, groups = p.K / p.group;
  typename Q::fvec acc[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i] = Q::zero();
  typename Q::fvec s = Q::zero(), bias = Q::zero();
  for (int b = 0; b < blocks; ++b) {
    const int g = b / per_group;
    if (b % per_group == 0) {  // the group's scales, and biases plus the codes' middle (less, in dot)
      __builtin_prefetch(static_cast<const uint8_t*>(scales) + size_t(g) * 32 * SCALE_BYTES + PREFETCH / 4);
      float floats[2][W];
      to_floats<Q, ST>(scales, size_t(g) * 32 + W * half, W, floats[0]);
      to_floats<Q, ST>(scales, size_t(g) * 32 + 16 + W * half, W, floats[1]);
      s = Q::load(floats[0]);
      bias = Q::fma(s, Q::set1(float(1 << (BITS - 1))), Q::load(floats[1]));
    }
    const uint8_t* block_codes = codes + size_t(b) * BITS * 64;
    for (int line = 0; line < BITS * 64; line += 64) __builtin_prefetch(block_codes + PREFETCH + line);
    const auto block = Q::template load<BITS>(block_codes);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const size_t row = size_t(m0 + i), at = row * blocks + b;
      const auto sum = Q::template dot<BITS>(block, q.x + row * p.K + 32 * b, q.start[at]);
      acc[i] = Q::fma(sum, Q::mul(s, Q::set1(q.dx[at])), acc[i]);
    }
    if ((b + 1) % per_group == 0)  // the group's biases times x's sum over it
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) acc[i] = Q::fma(bias, Q::set1(q.sums[size_t(m0 + i) * groups + g]), acc[i]);
  }
  for (int i = 0; i < MB; ++i) {
    float* out = p.out + size_t(m0 + i) * p.N + nb;
    if (nn == W) {
      Q::store(out, acc[i]);
    } else {
      float lanes[W];
      Q::store(lanes, acc[i]);
      std::memcpy(out, lanes, sizeof(float) * nn);
    }
  }
}

template <class Q, int BITS, kvmux_native::ScaleType ST, int MB>
inline void int8_pass(int take, const kvmux_native::Problem& p, const kvmux_native::Quantized& q,
                      const uint8_t* codes, const void* scales, int half, int nb, int nn, int m0) {
  if constexpr (MB > 1)
    if (take < MB) return int8_pass<Q, BITS, ST, MB - 1>(take, p, q, codes, scales, half, nb, nn, m0);
  int8_rows<Q, BITS, ST, MB>(p, q, codes, scales, half, nb, nn, m0);
}

// Rows m0..m1 of x (quantized: q) by weight rows n0..n1 (n0 a packed
// block's first), W at a time, each W rows' codes meeting every row of x
// while they are in L1.
template <class Q, int BITS, kvmux_native::ScaleType ST>
void int8_typed(const kvmux_native::Problem& p, const kvmux_native::Quantized& q, int n0, int n1, int m0, int m1) {
  using kvmux_native::PACKED_ROWS;
  constexpr int W = Q::W, SCALE_BYTES = ST == kvmux_native::ScaleType::float32 ? 4 : 2;
  const size_t block_bytes = size_t(PACKED_ROWS) * p.K * BITS / 8;
  const size_t block_scales = size_t(p.K / p.group) * 2 * PACKED_ROWS * SCALE_BYTES;
  for (int nb = n0; nb < n1; nb += W) {
    const int r = nb / PACKED_ROWS, half = nb % PACKED_ROWS / W, nn = std::min(W, n1 - nb);
    const uint8_t* codes = p.packed + r * block_bytes + 4 * W * half;
    const void* scales = static_cast<const uint8_t*>(p.packed_scales) + r * block_scales;
    even_passes(m0, m1, Q::MB, [&](int m, int take) {
      int8_pass<Q, BITS, ST, Q::MB>(take, p, q, codes, scales, half, nb, nn, m);
    });
  }
}

template <class Q, int BITS>
void int8_bits(const kvmux_native::Problem& p, const kvmux_native::Quantized& q, int n0, int n1, int m0, int m1) {
  using kvmux_native::ScaleType;
  switch (p.scale_type) {
    case ScaleType::float16:
      return int8_typed<Q, BITS, ScaleType::float16>(p, q, n0, n1, m0, m1);
    case ScaleType::bfloat16:
      return int8_typed<Q, BITS, ScaleType::bfloat16>(p, q, n0, n1, m0, m1);
    default:
      return int8_typed<Q, BITS, ScaleType::float32>(p, q, n0, n1, m0, m1);
  }
}

// One row of x (K floats, in the kernel's order) quantized (kernels.h's
// QuantizeFn): a loop the compiler vectorises under the file's target,
// each lane's operations the scalar loop's (the max and the rounding
// exact either way); the group sums in double, in one order on every set.
inline void quantize(const float* x, int K, int group, int bits, int8_t* out, float* dx, int32_t* start,
                     float* sums) {
  const int middle = 1 << (bits - 1);
  for (int b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    uint32_t most = 0;  // the largest |x| as its bits: ordered as the floats are, and a max that vectorises
    for (int k = 0; k < 32; ++k) {
      uint32_t bits;
      std::memcpy(&bits, v + k, 4);
      bits &= 0x7FFFFFFFu;
      most = bits > most ? bits : most;
    }
    float largest;
    std::memcpy(&largest, &most, 4);
    int32_t sum = 0;
    if (!(largest <= __FLT_MAX__)) {  // an inf or a NaN: the block's products are NaN
      std::memset(out + 32 * b, 0, 32);
      dx[b] = __builtin_nanf("");
    } else {
      const float d = largest / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
      for (int k = 0; k < 32; ++k) {  // |x| / d <= 127: no clamp
        const int8_t q = int8_t(int(__builtin_roundevenf(v[k] * inverse)));
        out[32 * b + k] = q;
        sum += q;
      }
      dx[b] = d;
    }
    start[b] = -middle * sum;
  }
  for (int g = 0; g < K / group; ++g) {  // 8 sums in flight (one would wait on each add), then in pairs
    double part[8] = {};
    for (int k = g * group; k < (g + 1) * group; k += 8)
      for (int j = 0; j < 8; ++j) part[j] += x[k + j];
    sums[g] = float(((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7])));
  }
}

template <class Q>
void int8(const kvmux_native::Problem& p, const kvmux_native::Quantized& q, int n0, int n1, int m0, int m1) {
  if (p.bits == 4) return int8_bits<Q, 4>(p, q, n0, n1, m0, m1);
  int8_bits<Q, 8>(p, q, n0, n1, m0, m1);
}

}  // namespace
