#include "qmm.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "fused.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KVMUX_PAUSE() _mm_pause()
#else
#define KVMUX_PAUSE() std::this_thread::yield()
#endif

namespace kvmux_native {

bool supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
#else
  return isa == Isa::scalar;
#endif
}

namespace {

const char* const ISA_NAMES[] = {"scalar", "avx2", "avx512"};

Isa best_isa() {
  for (Isa isa : {Isa::avx512, Isa::avx2})
    if (supported(isa)) return isa;
  return Isa::scalar;
}

std::atomic<Isa> current_isa{best_isa()};

BlockFn block_for(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return block_avx512();
    case Isa::avx2:
      return block_avx2();
    default:
      return block_scalar();
  }
}

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Threads that share a product's items with the caller. Items are claimed
// from one atomic word holding the job's generation (high half) and its
// next item (low half), so a thread that wakes late claims nothing of a
// later job, and the caller waits for the items, never for a thread: when
// the cores are busy with other work (Python building the next step, other
// processes), the caller runs every item itself instead of waiting out a
// descheduled thread's time slice. Idle threads spin a while (~100 us
// on the AMD EPYC, ~43 us on the Intel Xeon with its 10.7 ns pause:
// the next product of a pass comes after the caller's norms, rope and
// attention set-up, tens of microseconds; a thread woken from its sleep
// joins a product late), then sleep on a condition variable, costing
// nothing.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(sleep_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return int(workers_.size()) + 1; }

  // items(i) for every i in [0, count), over the pool and the caller.
  template <class F>
  void run(int count, F&& items) {
    if (workers_.empty() || count == 1) {
      for (int i = 0; i < count; ++i) items(i);
      return;
    }
    Task task = [&items](int i) { items(i); };
    const uint64_t job = (word_.load() >> 32) + 1;
    tasks_[job & 1].store(&task, std::memory_order_relaxed);
    counts_[job & 1].store(count, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    word_.store(job << 32);
    if (sleeping_.load() > 0) {  // seq_cst with the sleeper's increment: it sees the job or is told
      { std::lock_guard<std::mutex> lock(sleep_); }
      wake_.notify_all();
    }
    work(job);
    for (int spin = 0; finished_.load(std::memory_order_acquire) < count; ++spin) {
      if (spin % 256 == 255) std::this_thread::yield();  // let a descheduled claimant finish its item
      KVMUX_PAUSE();
    }
  }

 private:
  using Task = std::function<void(int)>;
  static constexpr int SPIN = 4000;  // pauses before sleeping (26 ns each on the AMD EPYC, 10.7 on the Intel Xeon)

  // Claim and run items of `job` until none is left. A job's task and
  // count sit in the slot of its generation's parity: the next job's
  // caller fills the other slot before it publishes, so a thread still
  // holding this job's word never reads the next job's count against it
  // (with one slot, a claim past this job's last item could succeed on
  // the unchanged word and run the next job's item before it was
  // published, its finish counted against the next job: a job ended with
  // an item still running, and that item's task gone).
  void work(uint64_t job) {
    const auto& task = tasks_[job & 1];
    const auto& count = counts_[job & 1];
    uint64_t word = word_.load(std::memory_order_acquire);
    while ((word >> 32) == job && int(word & 0xFFFFFFFF) < count.load(std::memory_order_relaxed)) {
      if (!word_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) continue;
      (*task.load(std::memory_order_relaxed))(int(word & 0xFFFFFFFF));
      finished_.fetch_add(1, std::memory_order_release);
      word = word_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    uint64_t seen = word_.load() >> 32;
    while (true) {
      for (int spin = 0; (word_.load(std::memory_order_acquire) >> 32) == seen && !stop_; ++spin) {
        if (spin < SPIN) {
          KVMUX_PAUSE();
          continue;
        }
        // A mutex and condition variable, not std::atomic::wait: libstdc++ 12
        // waits on 64-bit atomics through a shared proxy that can lose a wake-up.
        std::unique_lock<std::mutex> lock(sleep_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return (word_.load() >> 32) != seen || stop_; });
        sleeping_.fetch_sub(1);
      }
      if (stop_) return;
      seen = word_.load(std::memory_order_acquire) >> 32;
      work(seen);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> word_{0};  // job generation << 32 | next item
  std::atomic<int> finished_{0}, sleeping_{0};
  std::atomic<const Task*> tasks_[2] = {nullptr, nullptr};  // by the generation's parity (see work)
  std::atomic<int> counts_[2] = {0, 0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_;
  std::condition_variable wake_;
};

std::mutex pool_mutex;  // one product at a time (MLX runs a stream's tasks in order anyway)
std::unique_ptr<Pool> pool = std::make_unique<Pool>(cores());

ScaleType scale_type(mx::Dtype dtype) {
  if (dtype == mx::float16) return ScaleType::float16;
  if (dtype == mx::bfloat16) return ScaleType::bfloat16;
  if (dtype == mx::float32) return ScaleType::float32;
  throw std::invalid_argument("[kvmux_native] scales and biases must be float16, bfloat16 or float32");
}

// Items of a job of products (one op's: a layer's q, k and v, say):
// weight rows by rows of x. Decode rows (as many rows of x as the kernel
// computes straight from the codes, kernels.h's DIRECT_*) are
// computed straight from the codes, each weight row read once: an item is
// a contiguous run of weight rows, about a quarter of a thread's share of
// the job's bytes, so a thread streams long runs (the prefetchers follow
// them) and claims few items. More rows of x go through a thread's
// scratch: weight rows dequantized (~32 KB, whole tiles: they stay in
// L1/L2 while every row of x passes them) by up to XROWS rows of x (~256
// KB, held in L2 while the weight rows are computed).
struct Item {
  int problem, n0, n1, m0, m1;
};

constexpr int XROWS = 64, ITEMS_PER_THREAD = 4;

// An instruction set's rows of x computed straight from the codes, per
// width, and its scratch path's weight rows a tile (kernels.h).
struct Shape {
  DirectRows direct;
  int tile;
};

Shape shape_of(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return {DIRECT_AVX512, TILE_AVX512};
    case Isa::avx2:
      return {DIRECT_AVX2, TILE_AVX2};
    default:
      return {DIRECT_SCALAR, TILE_SCALAR};
  }
}

// The int8 products (packed W) take all of their rows of x straight from
// the codes, XROWS at a time, and whole packed blocks of weight rows.
std::vector<Item> items_of(const std::vector<Problem>& ps, int threads, Shape shape) {
  std::vector<Item> items;
  size_t direct_bytes = 0;
  for (const auto& p : ps)
    if (p.M <= shape.direct.of(p.bits) || p.packed) direct_bytes += size_t(p.N) * p.K * p.bits / 8;
  const size_t share = std::max<size_t>(16 << 10, direct_bytes / (size_t(threads) * ITEMS_PER_THREAD));
  for (int i = 0; i < int(ps.size()); ++i) {
    const auto& p = ps[i];
    if (p.M == 0) continue;
    if (p.M <= shape.direct.of(p.bits) || p.packed) {
      const size_t row_bytes = size_t(p.K) * p.bits / 8;
      const int step = p.packed ? PACKED_ROWS : 4, x_rows = p.packed ? XROWS : p.M;
      const int rows = std::max<int>(step, int(share / row_bytes) / step * step);
      for (int n0 = 0; n0 < p.N; n0 += rows)
        for (int m0 = 0; m0 < p.M; m0 += x_rows)
          items.push_back({i, n0, std::min(p.N, n0 + rows), m0, std::min(p.M, m0 + x_rows)});
      continue;
    }
    const int rows = std::max(shape.tile, (8192 / p.K) / shape.tile * shape.tile);
    for (int n0 = 0; n0 < p.N; n0 += rows)
      for (int m0 = 0; m0 < p.M; m0 += XROWS)
        items.push_back({i, n0, std::min(p.N, n0 + rows), m0, std::min(p.M, m0 + XROWS)});
  }
  return items;
}

Int8Kernels int8_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
    return int8_avx512();
#endif
  return isa == Isa::scalar ? int8_scalar() : int8_avx2();
}

// A product's rows of x quantized for the int8 products (kernels.h's
// Quantized, over these buffers).
struct QuantizedRows {
  std::vector<int8_t> x;
  std::vector<float> dx, sums;
  std::vector<int32_t> start;
  Quantized q{};
};

void shape_rows(const Problem& p, QuantizedRows& r) {
  const size_t blocks = size_t(p.M) * (p.K / 32);
  r.x.resize(size_t(p.M) * p.K);
  r.dx.resize(blocks);
  r.start.resize(blocks);
  r.sums.resize(size_t(p.M) * (p.K / p.group));
  r.q = {r.x.data(), r.dx.data(), r.start.data(), r.sums.data()};
}

}  // namespace

void compute(const std::vector<Problem>& ps) {
  const Isa isa = current_isa.load();
  const BlockFn block = block_for(isa);
  const Int8Kernels int8 = int8_for(isa);
  const Shape shape = shape_of(isa);
  std::lock_guard<std::mutex> lock(pool_mutex);
  // The int8 products' rows of x quantized first, a row an item.
  // This (the stream's) thread's buffers, reused from op to op; the pool
  // reaches them through the references.
  thread_local std::vector<QuantizedRows> buffers;
  thread_local std::vector<std::pair<int, int>> row_buffer;
  thread_local std::vector<int> source_buffer;
  buffers.resize(ps.size());
  source_buffer.assign(ps.size(), 0);
  row_buffer.clear();
  auto& quantized = buffers;
  auto& rows = row_buffer;
  auto& source = source_buffer;  // the product whose quantized rows each one reads
  for (int i = 0; i < int(ps.size()); ++i) {
    const Problem& p = ps[i];
    if (!p.packed) continue;
    source[i] = i;
    for (int j = 0; j < i && source[i] == i; ++j)
      if (ps[j].packed && ps[j].x == p.x && ps[j].K == p.K && ps[j].group == p.group && ps[j].bits == p.bits)
        source[i] = source[j];
    if (source[i] != i) continue;
    shape_rows(p, quantized[i]);
    for (int m = 0; m < p.M; ++m) rows.emplace_back(i, m);
  }
  if (!rows.empty())
    pool->run(int(rows.size()), [&](int at) {
      const auto [i, m] = rows[at];
      const Problem& p = ps[i];
      const size_t blocks = size_t(m) * (p.K / 32);
      auto& r = quantized[i];
      int8.quantize(p.x + size_t(m) * p.K, p.K, p.group, p.bits, r.x.data() + size_t(m) * p.K, r.dx.data() + blocks,
                    r.start.data() + blocks, r.sums.data() + size_t(m) * (p.K / p.group));
    });
  const auto items = items_of(ps, pool->size(), shape);
  pool->run(int(items.size()), [&](int at) {
    const Item& item = items[at];
    const Problem& p = ps[item.problem];
    if (p.packed) return int8.products(p, quantized[source[item.problem]].q, item.n0, item.n1, item.m0, item.m1);
    thread_local std::vector<float> scratch;
    if (item.m1 - item.m0 > shape.direct.of(p.bits) && scratch.size() < size_t(item.n1 - item.n0) * p.K)
      scratch.resize(size_t(item.n1 - item.n0) * p.K);
    block(p, item.n0, item.n1, item.m0, item.m1, scratch.data());
  });
}

const float* kernel_rows(const float* x, int rows, int K, int bits, std::vector<float>& ordered) {
  // Rows at a cache line's start: the kernel loads each 16 floats of x
  // again for every block of weight rows, and a load across two lines
  // costs two (an 8-row pass's products 3-8 % slower from a misaligned x:
  // MLX's arrays start 8 bytes past a line).
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 64 == 0;
  if (bits != 4 && aligned) return x;
  ordered.resize(size_t(rows) * K + 15);
  float* out = ordered.data();
  out += (16 - reinterpret_cast<uintptr_t>(out) / sizeof(float) % 16) % 16;
  x_order(x, rows, K, bits, out);
  return out;
}

Problem problem(const mx::array& w, const mx::array& scales, const mx::array& biases, int group, int bits,
                Mode mode) {
  for (const auto* a : {&w, &scales, &biases})
    if (!a->flags().row_contiguous)
      throw std::invalid_argument("[kvmux_native] w, scales and biases must be row-contiguous");
  Problem p{};
  p.w = w.data<uint8_t>();
  p.scales = scales.data<void>();
  p.biases = mode == Mode::affine ? biases.data<void>() : nullptr;
  p.scale_type = scale_type(scales.dtype());
  p.mode = mode;
  p.N = w.shape(0);
  p.K = w.shape(1) * 32 / bits;
  p.bits = bits;
  p.group = group;
  return p;
}

void pack_codes(const Problem& p, int scale_bytes, uint8_t* codes, uint8_t* scales) {
  const int blocks = p.K / 32, groups = p.K / p.group, rows = (p.N + PACKED_ROWS - 1) / PACKED_ROWS;
  const size_t row_bytes = size_t(p.K) * p.bits / 8, block_bytes = size_t(32) * p.bits / 8;
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < p.bits; ++t)  // a block's 4-byte pieces: 4 with 4 bits, 8 with 8
        for (int j = 0; j < PACKED_ROWS; ++j) {
          const int n = r * PACKED_ROWS + j;
          uint8_t* to = codes + ((size_t(r) * blocks + b) * p.bits + t) * 64 + 4 * j;
          if (n < p.N)
            std::memcpy(to, p.w + n * row_bytes + b * block_bytes + 4 * t, 4);
          else
            std::memset(to, 0, 4);
        }
    for (int g = 0; g < groups; ++g)
      for (int j = 0; j < PACKED_ROWS; ++j) {
        const int n = r * PACKED_ROWS + j;
        uint8_t* to = scales + ((size_t(r) * groups + g) * 32 + j) * scale_bytes;
        const size_t from = (size_t(n) * groups + g) * scale_bytes;
        for (int part = 0; part < 2; ++part, to += 16 * scale_bytes) {
          if (n < p.N)
            std::memcpy(to, static_cast<const uint8_t*>(part ? p.biases : p.scales) + from, scale_bytes);
          else
            std::memset(to, 0, scale_bytes);
        }
      }
  }
}

std::vector<mx::array> pack(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits) {
  check_quantized(w, scales, biases, group_size, bits, Mode::affine, "pack");
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("[kvmux_native.pack] the int8 products take 4- and 8-bit weights, not " +
                                std::to_string(bits));
  if (group_size == 16) throw std::invalid_argument("[kvmux_native.pack] the int8 products take groups of 32 or more");
  auto ws = mx::contiguous(w), ss = mx::contiguous(scales), bs = mx::contiguous(biases);
  mx::eval({ws, ss, bs});
  const Problem p = problem(ws, ss, bs, group_size, bits, Mode::affine);
  const int rows = (p.N + PACKED_ROWS - 1) / PACKED_ROWS * PACKED_ROWS, scale_bytes = int(scales.itemsize());
  auto codes = mx::allocator::malloc(size_t(rows) * p.K * bits / 8);
  auto packed_scales = mx::allocator::malloc(size_t(rows) * (p.K / group_size) * 2 * scale_bytes);
  pack_codes(p, scale_bytes, static_cast<uint8_t*>(codes.buffer().raw_ptr()),
             static_cast<uint8_t*>(packed_scales.buffer().raw_ptr()));
  std::vector<mx::array> out;
  out.emplace_back(std::move(codes), mx::Shape{rows, p.K * bits / 8}, mx::uint8);
  out.emplace_back(std::move(packed_scales), mx::Shape{rows / PACKED_ROWS, (p.K / group_size) * 2 * PACKED_ROWS},
                   scales.dtype());
  return out;
}

void check_packed(const mx::array& w, const mx::array& scales, int group_size, int bits, const mx::array& codes,
                  const mx::array& packed_scales, const std::string& op) {
  const int N = w.shape(0), K = w.shape(1) * 32 / bits, rows = (N + PACKED_ROWS - 1) / PACKED_ROWS * PACKED_ROWS;
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("[kvmux_native." + op + "] the int8 products take 4- and 8-bit weights, not " +
                                std::to_string(bits));
  if (codes.dtype() != mx::uint8 || codes.ndim() != 2 || codes.shape(0) != rows || codes.shape(1) != K * bits / 8 ||
      packed_scales.dtype() != scales.dtype() || packed_scales.ndim() != 2 ||
      packed_scales.shape(0) != rows / PACKED_ROWS || packed_scales.shape(1) != (K / group_size) * 2 * PACKED_ROWS)
    throw std::invalid_argument("[kvmux_native." + op + "] packed must be pack()'s codes and scales of these weights");
}

void attach_packed(Problem& p, const mx::array& codes, const mx::array& scales) {
  if (!codes.flags().row_contiguous || !scales.flags().row_contiguous)
    throw std::invalid_argument("[kvmux_native] packed codes and scales must be row-contiguous");
  p.packed = codes.data<uint8_t>();
  p.packed_scales = scales.data<void>();
}

Mode mode_of(const std::string& name, const std::string& op) {
  if (name == "affine") return Mode::affine;
  if (name == "iq4_nl") return Mode::iq4_nl;
  if (name == "symmetric") return Mode::symmetric;
  throw std::invalid_argument("[kvmux_native." + op + "] mode must be affine, iq4_nl or symmetric, not " + name);
}

void check_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     Mode mode, const std::string& op) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument("[kvmux_native." + op + "] " + what); };
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    fail("bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  if (mode == Mode::iq4_nl && bits != 4) fail("iq4_nl codes are 4 bits, not " + std::to_string(bits));
  if (mode == Mode::symmetric && bits == 2) fail("symmetric codes are 3, 4, 5, 6 or 8 bits, not 2");
  // 16 (GGUF's Q6_K, Q3_K, Q2_K, IQ2_XS, IQ2_S and IQ1_M) for the widths
  // whose kernels take a scale per 16 weights; 4 bits' (TABLE4, codes4's
  // lane order) take one per 32 at most, and so do the int8 products (pack).
  const bool sixteen = group_size == 16 && bits != 4;
  if (!sixteen && group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 32, 64 or 128 (or 16 with 2, 3, 5, 6 or 8 bits), not " + std::to_string(group_size));
  if (w.dtype() != mx::uint32 || w.ndim() != 2) fail("w must be a 2-D uint32 array of packed codes");
  if (mode != Mode::affine) {
    if (biases.size() != 0)
      fail(mode == Mode::iq4_nl ? "iq4_nl takes no biases (w = level * scale)"
                                : "symmetric takes no biases (w = (q - 2^(bits - 1)) * scale)");
    if (scales.ndim() != 2) fail("scales must be a 2-D array");
  } else if (scales.ndim() != 2 || scales.shape() != biases.shape() || scales.dtype() != biases.dtype()) {
    fail("scales and biases must be 2-D arrays of one shape and dtype");
  }
  scale_type(scales.dtype());
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (scales.shape(0) != N || scales.shape(1) * group_size != K)
    fail("scales and biases must have one value per group of each row of w");
}


void x_order(const float* x, int rows, int K, int bits, float* out) {
  if (bits != 4) {
    std::memcpy(out, x, sizeof(float) * size_t(rows) * K);
    return;
  }
  for (size_t at = 0; at < size_t(rows) * K; at += 32)
    for (int l = 0; l < 16; ++l) {
      out[at + l] = x[at + 2 * l];
      out[at + 16 + l] = x[at + 2 * l + 1];
    }
}

mx::array qmatmul(
    const mx::array& x_in,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases_in,
    int group_size,
    int bits,
    const std::optional<mx::array>& residual,
    const std::vector<mx::array>& packed,
    const std::string& mode_name) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[kvmux_native.qmatmul] " + what); };
  const Mode mode = mode_of(mode_name, "qmatmul");
  const mx::array biases = biases_in ? *biases_in : mx::zeros({0}, scales.dtype());
  check_quantized(w, scales, biases, group_size, bits, mode, "qmatmul");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (x_in.ndim() < 1 || x_in.shape(-1) != K)
    fail("x's last dimension (" + std::to_string(x_in.ndim() ? x_in.shape(-1) : 0) + ") must be w's " +
         std::to_string(K) + " inputs");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail("x must be a floating-point array");
  auto stream = cpu_stream();
  auto x = as_float32(x_in, stream);
  auto shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs{x, w, scales, biases};
  if (residual) {
    if (residual->shape() != shape) fail("residual must have the product's shape");
    inputs.push_back(as_float32(*residual, stream));
  }
  if (!packed.empty()) {
    if (packed.size() != 2) fail("packed must be pack()'s two arrays");
    if (mode == Mode::iq4_nl) fail("the int8 products take affine and symmetric codes, not iq4_nl");
    check_packed(w, scales, group_size, bits, packed[0], packed[1], "qmatmul");
    inputs.insert(inputs.end(), packed.begin(), packed.end());
  }
  auto out = mx::array(shape, mx::float32,
                       std::make_shared<QuantizedMatmul>(stream, group_size, bits, mode, !packed.empty()), inputs);
  return x_in.dtype() == mx::float32 ? out : mx::astype(out, x_in.dtype(), stream);
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  Problem p = problem(inputs[1], inputs[2], inputs[3], group_size_, bits_, mode_);
  const bool residual = inputs.size() > (packed_ ? 6u : 4u);
  if (packed_) attach_packed(p, inputs[inputs.size() - 2], inputs.back());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  p.out = out.data<float>();
  p.M = int(inputs[0].size() / p.K);
  encoder.dispatch([p, inputs, residual]() mutable {
    if (p.M == 0) return;
    thread_local std::vector<float> copy, ordered, rest;  // the stream thread's, reused
    p.x = kernel_rows(contiguous_rows(inputs[0], copy), p.M, p.K, p.bits, ordered);
    compute({p});
    if (residual) {  // out = residual + x @ W.T, the sum MLX's add would make
      const float* r = contiguous_rows(inputs[4], rest);
      for (size_t i = 0; i < size_t(p.M) * p.N; ++i) p.out[i] = r[i] + p.out[i];
    }
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[kvmux_native.qmatmul] runs on the CPU only (on a GPU, MLX's own quantized_matmul)");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && mode_ == o.mode_ && packed_ == o.packed_;
}

void parallel_for(int count, const std::function<void(int)>& items) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool->run(count, items);
}

IsaKernels isa_kernels() {
  switch (current_isa.load()) {
    case Isa::avx512:
      return kernels_avx512();
    case Isa::avx2:
      return kernels_avx2();
    default:
      return kernels_scalar();
  }
}

std::string isa() { return ISA_NAMES[int(current_isa.load())]; }

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::scalar})
    if (supported(isa)) names.push_back(ISA_NAMES[int(isa)]);
  return names;
}

void set_isa(const std::string& name) {
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::scalar}) {
    if (name != ISA_NAMES[int(isa)]) continue;
    if (!supported(isa)) throw std::invalid_argument("[kvmux_native] this CPU cannot run the " + name + " kernel");
    current_isa = isa;
    return;
  }
  throw std::invalid_argument("[kvmux_native] no kernel named " + name + " (avx512, avx2, scalar)");
}

int threads() { return pool->size(); }

void set_threads(int n) {
  if (n < 1) throw std::invalid_argument("[kvmux_native] threads must be at least 1");
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool->size() != n) {
    pool.reset();
    pool = std::make_unique<Pool>(n);
  }
}

}  // namespace kvmux_native
