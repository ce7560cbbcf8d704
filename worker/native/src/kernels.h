// The CPU kernels of `x @ W.T` on MLX's affine quantized layout.
//
// W (N x K) is stored as MLX's nn.QuantizedLinear keeps it: `bits`-wide
// codes packed little-end into uint32 words (weight j of a word at bits
// j*bits..), and per `group` weights of a row one scale and one bias, so
// that w = q * scale + bias.
//
// Every kernel computes the same numbers, on every instruction set:
//  - each weight is q * scale + bias as one fused multiply-add in float32
//    (exactly the float32 value a dequantized copy holds: q * scale is
//    exact for float16 or bfloat16 scales);
//  - out[m][n] = sum over k of x[m][k] * w[n][k] is accumulated in 16
//    lanes, one fused multiply-add each, then the lanes are summed in a
//    fixed tree (l + 8, l + 4, l + 2, l + 1). The 32 weights from k = 32c
//    are two steps: with 4 bits lane l takes k = 32c + 2l, then 32c + 2l + 1
//    (a byte's low and high nibbles; x is put in that order once per call,
//    `x_order`); with other widths k = 32c + l, then 32c + 16 + l.
// So a row's result never depends on how many rows the call has, where
// the row sits, how the work is split over threads, or which of the
// AVX-512, AVX2 and scalar kernels ran.
//
// Two modes store no biases. Mode::iq4_nl (GGUF's IQ4_NL and IQ4_XS) is
// the same but for the value a code stands for: its 4-bit code indexes
// IQ4_LEVELS, a table of 16 int8s, and w = level * scale, in the same
// order and sums as 4-bit affine codes. Mode::symmetric (GGUF's Q3_K,
// Q4_0, Q5_0, Q6_K and Q8_0: 3 to 8 bits, not 2) centres the codes:
// w = (q - 2^(bits - 1)) * scale, one rounding (fma(q, scale, bias) with
// the bias -2^(bits - 1) * scale, exact).

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvmux_native {

enum class ScaleType { float16, bfloat16, float32 };

enum class Mode { affine, iq4_nl, symmetric };

// IQ4_NL's values (llama.cpp's kvalues_iq4nl), IQ4_XS's too.
alignas(16) constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// The first N (2, 4, 6 or 8) bytes at p, little-endian, loaded 8, 4 or
// 2 at a time (the codes of 2, 3, 5 and 6 bits: block.h's codes_any,
// AVX2's V::codes_bits): no load reads past them, and none meets
// narrower stores (a memcpy of 6 bytes went through the stack: two
// stores, then a load of 8 they could not forward to).
template <int N>
inline uint64_t bytes_at(const uint8_t* p) {
  uint64_t v = 0;
  if constexpr (N == 8) {
    std::memcpy(&v, p, 8);
  } else {
    if constexpr (N >= 4) {
      uint32_t a;
      std::memcpy(&a, p, 4);
      v = a;
    }
    if constexpr (N % 4 == 2) {
      uint16_t b;
      std::memcpy(&b, p + N - 2, 2);
      v |= uint64_t(b) << (8 * (N - 2));
    }
  }
  return v;
}

struct Problem {
  const float* x;  // M x K, rows contiguous
  const uint8_t* w;  // N rows of K * bits / 8 bytes
  const void* scales;  // N x K / group
  const void* biases;  // N x K / group; null where the mode has none
  ScaleType scale_type;
  Mode mode = Mode::affine;
  float* out;  // M x N
  int M, N, K, bits, group;
  // W packed for the int8 products (`pack`, below), or null: the exact
  // products.
  const uint8_t* packed = nullptr;
  const void* packed_scales = nullptr;
};

// float16 bits and float32, through the compiler's _Float16 (F16C or
// libgcc's on x86, one instruction on aarch64; the same values on each):
// a float16 to a float exactly (where the CPU has no F16C), a float to
// the nearest float16, ties to even (a slab's keys and values as stored).
inline float half_to_float(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

inline uint16_t float_to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// Rows' attention over keys and values of one layer (attend.h): q (rows,
// heads, D), keys and values as float16 bits (kv heads, slots with
// kv_stride between heads, D) read at slots [0, length), an additive mask
// (rows, mask_stride) or none; out (rows, heads, D). A slab stores its
// keys and values in float16: a token reads them, and half the bytes
// read is most of the time at a full window.
struct Attention {
  const float* q;
  const uint16_t* keys;
  const uint16_t* values;
  const float* mask;
  float* out;
  int rows, heads, kv_heads, D, length;
  size_t kv_stride, mask_stride;
};

// A row's attention over a run of slots is split into parts of at most
// PART_SLOTS slots, fixed by the slots it reads alone (so a row's parts,
// and its bits, are the same in any pass), spread over the threads and
// combined in order: one row over a full window is then more items than
// the threads (its KV heads alone are 3 items for 2 threads).
constexpr int PART_SLOTS = 512;

// One row against one KV head of an Attention over slots [j0, j1) (its
// query heads together): `scores` holds (heads / kv_heads) * (j1 - j0)
// floats, `part` gets per query head D + 2: the weighted sum of values
// by exp(score - max), the max, the sum of the weights (attend.h).
using AttendFn = void (*)(const Attention&, int row, int kv, int j0, int j1, float* scores, float* part);

// A prefill chunk's rows [r0, r1) (at most CHUNK_ROWS) against one KV
// head over slots [j0, j1), their query heads together: AttendFn's
// results, each row's at part + (r - r0) * part_stride. `scratch` holds
// chunk_scratch(...) floats. Each query's sums in a fixed order of its
// own (attend.h's attend_chunk): a row's result never depends on the rows
// beside it in the item, and is the same on every instruction set (not
// the bits a decode row at its position gets).
using ChunkFn = void (*)(const Attention&, int r0, int r1, int kv, int j0, int j1, float* scratch, float* part,
                         size_t part_stride);

// Rows of a chunk's read an item takes together, and the slots a block
// of keys, then of values, widens at a time into L1 (4 and 16 KB at head
// size 64): a value block's sums are loaded and stored once a block
// (attend.h's weigh_tile), so its blocks are longer.
constexpr int CHUNK_ROWS = 16, KEY_SLOTS = 16, VALUE_SLOTS = 64;

// ChunkFn's scratch for `rows` rows of `G` query heads over `span` slots.
inline size_t chunk_scratch(int rows, int G, int span, int D) {
  const size_t lanes = (size_t(rows) * G + 15) / 16 * 16;
  return lanes * (2 * size_t(D) + span + 3) + size_t(VALUE_SLOTS) * D;
}

// n floats to float16 bits (float_to_half's), 16 at a time where the CPU can.
using NarrowFn = void (*)(const float* x, size_t n, uint16_t* out);

// silu(gate) * up into gate, n values (swiglu.h).
using SwigluFn = void (*)(float* gate, const float* up, size_t n);

// exp((x - shift) * scale) of n values into out (exps.h).
using ExpsFn = void (*)(const float* x, size_t n, float shift, float scale, float* out);

// An instruction set's kernels besides the products (BlockFn).
struct IsaKernels {
  AttendFn attend;
  ChunkFn chunk;
  NarrowFn narrow;
  SwigluFn swiglu;
  ExpsFn exps;
};

IsaKernels kernels_scalar();
IsaKernels kernels_avx2();
IsaKernels kernels_avx512();

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

// x's rows as the kernel reads them (see above), into `out` (rows x K).
void x_order(const float* x, int rows, int K, int bits, float* out);

// Rows n0..n1 of W dequantized into `scratch` (n1 - n0 rows of K floats),
// then the products of x's rows m0..m1 with them written to out.
using BlockFn = void (*)(const Problem&, int n0, int n1, int m0, int m1, float* scratch);

BlockFn block_scalar();
BlockFn block_avx2();
BlockFn block_avx512();

// Rows of x each kernel computes straight from the codes (more go through
// a scratch of dequantized rows): its registers hold the accumulators of
// 6 rows of x by 4 weight rows on AVX-512 (9 by 3 for passes of 7 to 9
// rows) and 2 by 2 on AVX2 (V::CHUNK, V::IN_FLIGHT, V::WIDE_CHUNK,
// V::WIDE_IN_FLIGHT; one row of x by 4 weight rows on both, ONE_ROW_IN_FLIGHT:
// on AVX2 a decode step's products 7.2 against 11.5 ms with one weight
// row, whose two chains of multiply-adds bound the loop, and whose row
// of 576 weights paid its set-up for 18 groups), and a block of weight
// rows meets every row of x in turn while its codes are in L1, so its
// bytes are read once (block.h's direct). On AVX2 3 to 8 rows go one
// 8-lane half of the vector at a time (block.h's halves: each weight
// made once for up to 8 rows of x, 8 sums in 8 registers; 3 and 4 rows
// two weight rows at a time), 2 rows by direct's 2 by 2.
// On AVX-512 a verify pass (up to 17 rows) and 32 sessions' step stay
// direct: 49.9 against 37.8 GMAC/s for 17 rows through the scratch (one
// thread, a 64 x 1536 block in L2, Intel Xeon with AVX-512).
//
// Widths other than 4 and 8 bits are not halves': on AVX2 more than one
// row of x goes through the scratch, where each code is unpacked once for
// all rows (1,536 x 576 6-bit weights, two threads: 3 or 4 rows 0.35-0.45
// ms against 0.68 in direct's passes of 2, each unpacking the codes again;
// 2 rows the same either way; measured before V::codes_bits made their
// unpacking ~5x cheaper).
//
// One value per instruction set, read by block.h's `block` (which path
// each width compiles to) and qmm.cpp's items_of (which items get a
// scratch): the two must agree, or a scratch item finds none.
struct DirectRows {
  int codes48, other;  // 4- and 8-bit codes; 2, 3, 5 and 6 bits
  constexpr int of(int bits) const { return bits == 4 || bits == 8 ? codes48 : other; }
};
constexpr DirectRows DIRECT_AVX512{32, 32}, DIRECT_AVX2{8, 1}, DIRECT_SCALAR{1, 1};

// Weight rows of a tile of the scratch path (block.h's tile, NB): a
// thread's item there is a whole number of tiles (qmm.cpp's items_of), so
// that none runs part empty. On AVX2 an item of 4 rows of 1536 weights
// (down_proj's, at 8192 floats an item) ran as a tile of 3 and one of 1:
// 8 rows of x 1.23x slower than in items of 3 (one thread, Intel Xeon).
constexpr int TILE_AVX512 = 4, TILE_AVX2 = 3, TILE_SCALAR = 1;

// The int8 products (opt-in: a product given W packed by `pack`; the
// default is the exact float32 arithmetic above): llama.cpp's arithmetic
// for 4- and 8-bit weights. Each row of x is quantized per 32 weights to
// int8 (scale = max |x| / 127, q = round(x / scale), ties to even) and
// each weight row's codes less their middle (8 for 4 bits, 128 for 8:
// weights about 0, half the error of the codes as they are) multiply
// those int8s in integer arithmetic, exactly. out[m][n] sums, block by
// block of 32 weights in order, one fused multiply-add each: the block's
// integer sum times (weight scale * x scale), and at each group's end
// (bias + middle * scale) times x's float sum over the group. So a row's
// result is row-invariant and the same on every instruction set, but not
// the exact path's: x's rounding to int8 costs ~0.5 % of a product's size
// (tests/test_native.py measures it).
//
// The packed layout puts a vector's lanes on weight rows (no horizontal
// sums): W's rows in blocks of 16 (the last padded with zero rows); per
// block of rows and per 32 weights, for each 4 bytes of a row's codes
// (4 with 4 bits, 8 with 8) those bytes of the 16 rows, 64 bytes; per
// block of rows and per group, the 16 rows' scales, then their biases,
// in the scales' dtype. The same bytes as MLX's layout, padding aside.
constexpr int PACKED_ROWS = 16;

struct Quantized {
  const int8_t* x;  // M x K, in the kernel's order (x_order)
  const float* dx;  // M x K / 32: each block's x scale
  const int32_t* start;  // M x K / 32: -middle * the sum of the block's int8s
  const float* sums;  // M x K / group: x's sum over each group
};

// 4 int8s as one int32, to broadcast to every lane.
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The int8 products of x's rows m0..m1 (quantized: q) with W's rows n0..n1.
using Int8Fn = void (*)(const Problem&, const Quantized& q, int n0, int n1, int m0, int m1);

// One row of x (K floats, in the kernel's order) quantized into its
// Quantized row: K int8s, K / 32 scales and starts, K / group sums.
using QuantizeFn = void (*)(const float* x, int K, int group, int bits, int8_t* out, float* dx, int32_t* start,
                            float* sums);

struct Int8Kernels {
  Int8Fn products;
  QuantizeFn quantize;
};

Int8Kernels int8_scalar();
Int8Kernels int8_avx2();
Int8Kernels int8_avx512();  // AVX-512 VNNI (vpdpbusd); where the CPU has none, AVX2's

// W (N x K codes of `bits`, MLX's layout) with its scales and biases (N x
// groups of `scale_bytes` each) in the packed layout: `codes` gets
// ceil(N / 16) * 16 * K * bits / 8 bytes, `scales` ceil(N / 16) * groups *
// 32 values.
void pack_codes(const Problem& p, int scale_bytes, uint8_t* codes, uint8_t* scales);

// Whether the CPU runs the kernel of `isa`.
bool supported(Isa isa);

}  // namespace kvmux_native
