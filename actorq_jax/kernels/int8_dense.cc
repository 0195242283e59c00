// Int8 dense layers for CPU actor inference, exposed as XLA FFI handlers.
//
//   y[m, n] = sum_k x[m, k] * Wq[k, n] * scale[n] + bias[n]
//
// followed by an optional activation fused into the epilogue (relu, elu or
// tanh: one pass less over the output, and one XLA op less between layers).
//
// Three variants:
//   W8A32  float activations.
//   W8A8   activations quantized per row to int8 (+-127, round half to even),
//          int32 accumulation.
//   W4A8   as W8A8 with 4-bit weights (-8..7), two per byte (layout above W4A8Scalar).
// Weights are int8, repacked once in Python at load time into 16-column
// panels (layout described above W8A32Panel).

// Instruction-set paths (chosen per call, never by compile flags, so the
// library loads on any x86-64 CPU): portable scalar C++, AVX2+FMA, AVX-512
// (F+BW, plus VNNI for W8A8), and AMX (AVX-512 with AMX-INT8 tiles for the
// W8A8 and W4A8 products of a dozen rows or more; see AmxPanels). Every SIMD
// function carries its own target attribute. Elsewhere (or with
// -DACTORQ_PORTABLE_ONLY) only the scalar path is compiled.

#if (defined(__x86_64__) || defined(__i386__)) && !defined(ACTORQ_PORTABLE_ONLY)
#define ACTORQ_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define ACTORQ_X86 0
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;

enum Path : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };
enum Activation : int64_t { kNone = 0, kRelu = 1, kElu = 2, kTanh = 3 };

// Bumped whenever the handlers' attributes change, so Python can refuse a stale library.
constexpr int64_t kAbiVersion = 8;

#if ACTORQ_X86
bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

// AMX-INT8 needs the CPU's tile instructions (CPUID leaf 7: EDX bit 24 AMX-TILE,
// bit 25 AMX-INT8) and the OS's support of the tile state (XCR0 bits 17-18).
bool CpuHasAmx() {
  static const bool ok = [] {
    if (!CpuHasAvx512()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17);
  }();
  return ok;
}

// On Linux a process must also ask for the 8 KB tile state once
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without the grant the first
// tile instruction faults. Asked only when a product is about to use tiles, so a
// process that never multiplies a batch that large (a one-environment actor) keeps
// its signal frames and thread state as they were; refused, the VNNI code runs.
bool AmxGranted() {
  static const bool ok = [] {
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return CpuHasAmx() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// pause: lets the sibling hyperthread run and saves power while spinning.
inline void CpuRelax() { _mm_pause(); }
#else
bool CpuHasAvx2() { return false; }
bool CpuHasAvx512() { return false; }
bool CpuHasAmx() { return false; }
bool AmxGranted() { return false; }
inline void CpuRelax() {}
#endif

int64_t BestPath() {
  static const int64_t best =
      CpuHasAmx() ? kAmx : (CpuHasAvx512() ? kAvx512 : (CpuHasAvx2() ? kAvx2 : kScalar));
  return best;
}

bool PathSupported(int64_t path) {
  switch (path) {
    case kAuto:
    case kScalar:
      return true;
    case kAvx2:
      return CpuHasAvx2();
    case kAvx512:
      return CpuHasAvx512();
    case kAmx:
      return CpuHasAmx();
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------
// Thread pool. A job is a generation number plus tasks 0..n-1, claimed one at
// a time with a compare-and-swap on a ticket holding (generation, next task),
// so a worker can only ever run a task of the job it read the function of.
// The caller waits for its tasks to be done, not for every worker to show up:
// on a busy machine a descheduled worker costs nothing, the caller (and any
// worker that is running) simply takes its share.
class Pool {
 public:
  ~Pool() { Resize(0); }

  int Workers() const { return static_cast<int>(threads_.size()); }

  void Resize(int workers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_.store(false);
    // The generation is read here, not in the new thread: a thread that starts
    // after the first Run() would otherwise take that job's generation as
    // already seen and never help with it.
    const uint64_t start_generation = generation_.load();
    for (int i = 0; i < workers; ++i)
      threads_.emplace_back([this, start_generation] { WorkerLoop(start_generation); });
  }

  // Runs fn(0..ntasks-1) on the calling thread and the workers; returns when all are done.
  void Run(int64_t ntasks, const std::function<void(int64_t)>& fn) {
    if (threads_.empty() || ntasks <= 1) {
      for (int64_t i = 0; i < ntasks; ++i) fn(i);
      return;
    }
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = generation_.load() + 1;
      fn_ = &fn;
      ntasks_ = ntasks;
      done_.store(0);
      ticket_.store((gen & 0xffffffffu) << 32);
      generation_.store(gen);
    }
    work_cv_.notify_all();
    Drain(gen, fn, ntasks);
    // Layers run back to back and tasks are short: spin briefly before sleeping.
    for (int spin = 0; spin < kSpin && done_.load() != ntasks; ++spin) CpuRelax();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_.load() == ntasks; });
  }

 private:
  static constexpr int kSpin = 4000;  // roughly 50-100 us of pause instructions

  // Claims and runs tasks of generation `gen` until none are left (or a newer job replaced it).
  void Drain(uint64_t gen, const std::function<void(int64_t)>& fn, int64_t ntasks) {
    const uint64_t tag = (gen & 0xffffffffu) << 32;
    uint64_t t = ticket_.load();
    for (;;) {
      if ((t & ~uint64_t{0xffffffffu}) != tag) return;
      const int64_t i = static_cast<int64_t>(t & 0xffffffffu);
      if (i >= ntasks) return;
      if (!ticket_.compare_exchange_weak(t, t + 1)) continue;  // t was reloaded
      fn(i);
      if (done_.fetch_add(1) + 1 == ntasks) {
        // Under the lock, so Run() cannot test done_ and then miss this notify.
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_one();
      }
      t = ticket_.load();
    }
  }

  void WorkerLoop(uint64_t seen) {
    for (;;) {
      // The next layer's job often follows at once: spin before sleeping.
      for (int spin = 0; spin < kSpin && generation_.load() == seen && !stop_.load(); ++spin)
        CpuRelax();
      const std::function<void(int64_t)>* fn;
      int64_t ntasks;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        if (stop_.load()) return;
        seen = generation_.load();
        fn = fn_;
        ntasks = ntasks_;
      }
      // fn may already be gone if the caller finished without us; Drain only
      // calls it after claiming a task of generation `seen`, which keeps the
      // caller waiting until that task is done.
      Drain(seen, *fn, ntasks);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t)>* fn_ = nullptr;  // guarded by mu_
  int64_t ntasks_ = 0;                                // guarded by mu_
  std::atomic<uint64_t> ticket_{0};  // (generation & 0xffffffff) << 32 | next task
  std::atomic<int64_t> done_{0};
};

std::mutex g_pool_mu;  // serialises calls that use the pool, and resizing
std::atomic<int> g_num_threads{1};

Pool& GlobalPool() {
  static Pool* pool = new Pool();  // leaked on purpose: no join at process exit
  return *pool;
}

// Work below this many multiply-adds runs on the calling thread only: waking
// a worker costs more than it saves.
constexpr int64_t kParallelMinMacs = int64_t{1} << 21;

// Splits the panels [0, P) into contiguous ranges and runs body(p0, p1) on them.
void ForPanels(int64_t P, int64_t macs, const std::function<void(int64_t, int64_t)>& body) {
  const int threads = g_num_threads.load();
  if (threads <= 1 || macs < kParallelMinMacs || P < 2) {
    body(0, P);
    return;
  }
  std::lock_guard<std::mutex> lock(g_pool_mu);
  Pool& pool = GlobalPool();
  if (pool.Workers() != threads - 1) pool.Resize(threads - 1);
  // More tasks than threads: whoever is running takes the next chunk.
  const int64_t ntasks = std::min<int64_t>(4 * threads, P);
  pool.Run(ntasks, [&](int64_t t) {
    const int64_t p0 = P * t / ntasks, p1 = P * (t + 1) / ntasks;
    if (p1 > p0) body(p0, p1);
  });
}

// ---------------------------------------------------------------------------
// Shared geometry of one call.
struct Geometry {
  int64_t M, K, N, P;
  int64_t act;  // Activation applied to every output
};

// ---------------------------------------------------------------------------
// Activations. The SIMD versions use exp(r) * 2^n with a degree-6 polynomial for
// exp(r), |r| <= ln2 / 2 (Cephes' expf coefficients, about 1 ulp): elu is
// exp(v) - 1 and tanh(|v|) is (1 - e) / (1 + e) with e = exp(-2|v|), both
// within 1e-6 absolute of libm, far inside the kernel's 1e-5 tolerance.
inline float ActScalar(float v, int64_t act) {
  switch (act) {
    case kRelu: return v > 0.f ? v : 0.f;
    case kElu: return v > 0.f ? v : std::expm1(v);
    case kTanh: return std::tanh(v);
    default: return v;
  }
}

constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365478515625f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
// Loads scale and bias for the 16 columns of panel p into padded arrays.
inline void PanelEpilogueParams(const float* scale, const float* bias, int64_t n0, int64_t N,
                                float* s16, float* b16) {
  for (int64_t c = 0; c < kPanel; ++c) {
    const int64_t n = n0 + c;
    s16[c] = n < N ? scale[n] : 0.f;
    b16[c] = n < N ? bias[n] : 0.f;
  }
}

inline int64_t ValidCols(int64_t n0, int64_t N) { return std::min<int64_t>(kPanel, N - n0); }

// Weights arrive as one int8 buffer of exactly K * N bytes (the [K, N] shape
// flax expects of a kernel): panel p (columns 16p .. 16p + width - 1, width =
// min(16, N - 16p)) starts at byte 16 * p * K. Inside a panel:
//   W8A32: [K, width], k-major.
//   W8A8:  [K / 4, width, 4] (4 consecutive k per column contiguous: the
//          operand layout of maddubs / vpdpbusd), then [K % 4, width].
// Full panels are used in place; only the narrow last panel, and the last
// partial group of 4 k, are copied zero-padded to 16 columns per call.

// Panel p of a W8A32 weight as [K, 16].
const int8_t* W8A32Panel(const int8_t* w, const Geometry& g, int64_t p,
                         std::vector<int8_t>& scratch) {
  const int8_t* base = w + p * kPanel * g.K;
  const int64_t width = ValidCols(p * kPanel, g.N);
  if (width == kPanel) return base;
  scratch.assign(static_cast<size_t>(g.K * kPanel), 0);
  for (int64_t k = 0; k < g.K; ++k) std::memcpy(&scratch[k * kPanel], base + k * width, width);
  return scratch.data();
}

// A W8A8 panel as up to two runs of `groups` groups of 16 columns x 4 k; a
// group is 64 bytes except in the in-place narrow panel of the VNNI path,
// whose groups are 4 * width bytes, read with `mask` (zeroing the rest).
struct Segments {
  const int8_t* ptr[2];
  int64_t groups[2];
  int64_t stride[2];
  uint64_t mask[2];
  int count;
};

// Panel p of a W8A8 weight for the VNNI path: a narrow panel is read in place
// (masked loads), only its last partial group of 4 k goes through `tail` (64 bytes).
Segments W8A8PanelInPlace(const int8_t* w, const Geometry& g, int64_t p, int8_t* tail) {
  const int8_t* base = w + p * kPanel * g.K;
  const int64_t width = ValidCols(p * kPanel, g.N);
  const int64_t G = g.K / 4, rem = g.K % 4;
  const uint64_t full = ~uint64_t{0};
  const uint64_t mask = width == kPanel ? full : (uint64_t{1} << (4 * width)) - 1;
  Segments s{{base, nullptr}, {G, 0}, {4 * width, 4 * kPanel}, {mask, full}, 1};
  if (rem) {
    std::memset(tail, 0, 4 * kPanel);
    for (int64_t j = 0; j < rem; ++j)
      for (int64_t c = 0; c < width; ++c) tail[c * 4 + j] = base[G * 4 * width + j * width + c];
    s.ptr[1] = tail;
    s.groups[1] = 1;
    s.count = 2;
  }
  return s;
}

// Panel p of a W8A8 weight as full 64-byte groups (the AVX2 and scalar paths):
// a narrow panel is copied zero-padded into `scratch`.
Segments W8A8Panel(const int8_t* w, const Geometry& g, int64_t p, std::vector<int8_t>& scratch,
                   int8_t* tail) {
  const int64_t width = ValidCols(p * kPanel, g.N);
  if (width == kPanel) return W8A8PanelInPlace(w, g, p, tail);
  const int8_t* base = w + p * kPanel * g.K;
  const int64_t G = g.K / 4, rem = g.K % 4, K4 = G + (rem ? 1 : 0);
  scratch.assign(static_cast<size_t>(K4 * 4 * kPanel), 0);
  for (int64_t gi = 0; gi < G; ++gi)
    std::memcpy(&scratch[gi * 4 * kPanel], base + gi * 4 * width, 4 * width);
  for (int64_t j = 0; j < rem; ++j)
    for (int64_t c = 0; c < width; ++c) scratch[G * 4 * kPanel + c * 4 + j] = base[G * 4 * width + j * width + c];
  const uint64_t full = ~uint64_t{0};
  return Segments{{scratch.data(), nullptr}, {K4, 0}, {4 * kPanel, 4 * kPanel}, {full, full}, 1};
}

// ---------------------------------------------------------------------------
// W8A32, scalar.
void W8A32Scalar(const Geometry& g, const float* x, const int8_t* w, const float* scale,
                 const float* bias, float* y, int64_t p0, int64_t p1) {
  thread_local std::vector<int8_t> scratch;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* wp = W8A32Panel(w, g, p, scratch);
    const int64_t n0 = p * kPanel, nc = ValidCols(n0, g.N);
    for (int64_t m = 0; m < g.M; ++m) {
      const float* xr = x + m * g.K;
      float acc[kPanel] = {0.f};
      for (int64_t k = 0; k < g.K; ++k) {
        const float xv = xr[k];
        const int8_t* wk = wp + k * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) acc[c] += xv * static_cast<float>(wk[c]);
      }
      for (int64_t c = 0; c < nc; ++c)
        y[m * g.N + n0 + c] = ActScalar(acc[c] * scale[n0 + c] + bias[n0 + c], g.act);
    }
  }
}

#if ACTORQ_X86
__attribute__((target("avx2,fma"))) inline __m256 Exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline __m256 Act256(__m256 v, int64_t act) {
  switch (act) {
    case kRelu: return _mm256_max_ps(v, _mm256_setzero_ps());
    case kElu: {
      const __m256 em1 = _mm256_sub_ps(Exp256(_mm256_min_ps(v, _mm256_setzero_ps())), _mm256_set1_ps(1.f));
      return _mm256_blendv_ps(em1, v, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ));
    }
    case kTanh: {
      const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.f));
      const __m256 e = Exp256(_mm256_mul_ps(_mm256_andnot_ps(sign, v), _mm256_set1_ps(-2.f)));
      const __m256 one = _mm256_set1_ps(1.f);
      return _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), sign);
    }
    default: return v;
  }
}

__attribute__((target("avx512f,avx2,fma"))) inline __m512 Exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f,avx2,fma"))) inline __m512 Act512(__m512 v, int64_t act) {
  switch (act) {
    case kRelu: return _mm512_max_ps(v, _mm512_setzero_ps());
    case kElu: {
      const __m512 em1 = _mm512_sub_ps(Exp512(_mm512_min_ps(v, _mm512_setzero_ps())), _mm512_set1_ps(1.f));
      return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), em1, v);
    }
    case kTanh: {
      // Sign-bit logic on integer lanes: the float forms need AVX-512 DQ.
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
      const __m512 av = _mm512_castsi512_ps(_mm512_xor_si512(bits, sign));
      const __m512 e = Exp512(_mm512_mul_ps(av, _mm512_set1_ps(-2.f)));
      const __m512 one = _mm512_set1_ps(1.f);
      const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
      return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    }
    default: return v;
  }
}

// The activation runs as a second pass over a tile's stored rows, in functions
// of their own: inlined into the tile's epilogue it kept GCC from holding the
// accumulators in registers (2-3x slower at batch 8-64).
__attribute__((target("avx2,fma"), noinline)) void ActRows256(float* y, int64_t ldy, int64_t rows,
                                                               int64_t cols, int64_t act) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(yr + c, Act256(_mm256_loadu_ps(yr + c), act));
    if (c < cols) {  // through a padded buffer, so every column sees the same approximation
      alignas(32) float tmp[8] = {0.f};
      std::memcpy(tmp, yr + c, (cols - c) * sizeof(float));
      _mm256_store_ps(tmp, Act256(_mm256_load_ps(tmp), act));
      std::memcpy(yr + c, tmp, (cols - c) * sizeof(float));
    }
  }
}

__attribute__((target("avx512f,avx2,fma"), noinline)) void ActRows512(float* y, int64_t ldy, int64_t rows,
                                                                       int64_t cols, int64_t act) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = static_cast<__mmask16>(cols - c >= 16 ? 0xffffu : (1u << (cols - c)) - 1u);
      _mm512_mask_storeu_ps(yr + c, m, Act512(_mm512_maskz_loadu_ps(m, yr + c), act));
    }
  }
}

template <int V>
using Int = std::integral_constant<int, V>;

// Every AVX-512 function's target; the tile lambdas need it too, or their tiles are not inlined.
#define kAvx512Target "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"

// The AVX-512 paths' row loop: calls tile(m0, Int<R>, Int<U>) on blocks of up to
// 8 rows (U accumulator sets per row hide the dot-product latency when there are
// few rows), then applies the activation to the block's outputs.
template <typename Tile>
void ForRowBlocks8(const Geometry& g, int64_t n0, float* y, Tile&& tile) {
  for (int64_t m0 = 0; m0 < g.M; m0 += 8) {
    const int64_t rows = std::min<int64_t>(8, g.M - m0);
    switch (rows) {
      case 8: tile(m0, Int<8>{}, Int<1>{}); break;
      case 7: tile(m0, Int<7>{}, Int<1>{}); break;
      case 6: tile(m0, Int<6>{}, Int<1>{}); break;
      case 5: tile(m0, Int<5>{}, Int<1>{}); break;
      case 4: tile(m0, Int<4>{}, Int<1>{}); break;
      case 3: tile(m0, Int<3>{}, Int<2>{}); break;
      case 2: tile(m0, Int<2>{}, Int<2>{}); break;
      default: tile(m0, Int<1>{}, Int<4>{}); break;
    }
    if (g.act != kNone) ActRows512(y + m0 * g.N + n0, g.N, rows, ValidCols(n0, g.N), g.act);
  }
}

// Stores one row of a 16-column panel held as o0 (columns 0-7) and o1 (8-15); nc columns are valid.
__attribute__((target("avx2,fma"))) inline void StoreRow256(float* yr, __m256 o0, __m256 o1, int64_t nc) {
  if (nc == kPanel) {
    _mm256_storeu_ps(yr, o0);
    _mm256_storeu_ps(yr + 8, o1);
  } else {
    alignas(32) float tmp[kPanel];
    _mm256_store_ps(tmp, o0);
    _mm256_store_ps(tmp + 8, o1);
    std::memcpy(yr, tmp, nc * sizeof(float));
  }
}

// Stores (acc - offset) * sx * scale + bias for one row of int32 accumulators (the A8 paths' epilogue).
__attribute__((target("avx2,fma"))) inline void StoreIntRow256(float* yr, __m256i a0, __m256i a1, int32_t offset,
                                                              float sx, const float* s16, const float* b16,
                                                              int64_t nc) {
  const __m256i off = _mm256_set1_epi32(offset);
  const __m256 rs = _mm256_set1_ps(sx);
  const __m256 o0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a0, off)),
                                    _mm256_mul_ps(rs, _mm256_loadu_ps(s16)), _mm256_loadu_ps(b16));
  const __m256 o1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a1, off)),
                                    _mm256_mul_ps(rs, _mm256_loadu_ps(s16 + 8)), _mm256_loadu_ps(b16 + 8));
  StoreRow256(yr, o0, o1, nc);
}

// W8A32, AVX2 + FMA: R rows x 16 columns per tile; U independent accumulator
// sets over k hide the FMA latency when R is small.
template <int R, int U>
__attribute__((target("avx2,fma"))) void W8A32Avx2Tile(const Geometry& g, const float* x,
                                                      const int8_t* wp, const float* s16,
                                                      const float* b16, float* y, int64_t n0) {
  __m256 acc[U][R][2];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
  const int64_t K = g.K;
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      const int8_t* wk = wp + (k + u) * kPanel;
      const __m256 w0 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk))));
      const __m256 w1 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + 8))));
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k + u);
        acc[u][r][0] = _mm256_fmadd_ps(xb, w0, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xb, w1, acc[u][r][1]);
      }
    }
  }
  for (; k < K; ++k) {
    const int8_t* wk = wp + k * kPanel;
    const __m256 w0 = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk))));
    const __m256 w1 = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + 8))));
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      acc[0][r][0] = _mm256_fmadd_ps(xb, w0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(xb, w1, acc[0][r][1]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(s16), s1 = _mm256_loadu_ps(s16 + 8);
  const __m256 b0 = _mm256_loadu_ps(b16), b1 = _mm256_loadu_ps(b16 + 8);
  const int64_t nc = ValidCols(n0, g.N);
  for (int r = 0; r < R; ++r) {
    __m256 a0 = acc[0][r][0], a1 = acc[0][r][1];
    for (int u = 1; u < U; ++u) {
      a0 = _mm256_add_ps(a0, acc[u][r][0]);
      a1 = _mm256_add_ps(a1, acc[u][r][1]);
    }
    StoreRow256(y + r * g.N + n0, _mm256_fmadd_ps(a0, s0, b0), _mm256_fmadd_ps(a1, s1, b1), nc);
  }
}

__attribute__((target("avx2,fma"))) void W8A32Avx2(const Geometry& g, const float* x,
                                                  const int8_t* w, const float* scale,
                                                  const float* bias, float* y, int64_t p0,
                                                  int64_t p1) {
  thread_local std::vector<int8_t> scratch;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* wp = W8A32Panel(w, g, p, scratch);
    const int64_t n0 = p * kPanel;
    float s16[kPanel], b16[kPanel];
    PanelEpilogueParams(scale, bias, n0, g.N, s16, b16);
    for (int64_t m0 = 0; m0 < g.M; m0 += 6) {
      const float* xt = x + m0 * g.K;
      float* yt = y + m0 * g.N;
      switch (std::min<int64_t>(6, g.M - m0)) {
        case 6: W8A32Avx2Tile<6, 1>(g, xt, wp, s16, b16, yt, n0); break;
        case 5: W8A32Avx2Tile<5, 1>(g, xt, wp, s16, b16, yt, n0); break;
        case 4: W8A32Avx2Tile<4, 1>(g, xt, wp, s16, b16, yt, n0); break;
        case 3: W8A32Avx2Tile<3, 1>(g, xt, wp, s16, b16, yt, n0); break;
        case 2: W8A32Avx2Tile<2, 2>(g, xt, wp, s16, b16, yt, n0); break;
        default: W8A32Avx2Tile<1, 4>(g, xt, wp, s16, b16, yt, n0); break;
      }
      if (g.act != kNone)
        ActRows256(yt + n0, g.N, std::min<int64_t>(6, g.M - m0), ValidCols(n0, g.N), g.act);
    }
  }
}

// Multi-panel AVX-512 blocks (W8A8 and W4A8 with VNNI, W8A32 with FMA) for the
// full 16-column panels: R rows x C panels of accumulators per block, so each
// weight vector loaded serves R rows and each broadcast activation serves C
// panels (one panel at a time ran out of load slots at batch 8-64: 9 loads per
// 8 dot products).
// Row blocks run inside a column block of C panels, whose weights stay in L2,
// so every weight is fetched from memory once per call whatever the batch.
// Integer accumulation is exact, so the blocking changes no result: the
// epilogue is the one-panel tiles' (StoreIntRows512), operation for operation.
enum BlockKind { kBlockW8A8 = 0, kBlockW4A8 = 1, kBlockW8A32 = 2 };

struct BlockArgs {
  int64_t steps;    // W8A8: K / 4 groups of 4 k; W4A8: K8 / 8 blocks of 8 k; W8A32: K
  const uint8_t* q; // activations (W8A8: offset by +128; W4A8: signed), rows of ldq bytes
  const float* xf;  // W8A32: float activations, rows of ldq floats
  int64_t ldq;
  const float* sx;
  const int32_t* qsum;  // W4A8: row sums of q (for the +8 nibble offset)
  const int8_t* w;      // panel 0 of the weights; panel p starts at w + p * wstride
  int64_t wstride;
  const int8_t* tails;  // W8A8 with K % 4 != 0: the last partial group, 64 bytes per panel from panel tail0
  int64_t tail0;
  const float* scale;
  const float* bias;
  const int32_t* colsum;
  float* y;
  int64_t ldy;
};

// acc += u8 a . s8 b, in place. As an intrinsic, GCC 12 copied every
// accumulator to a fresh register and back around each vpdpbusd of a block.
__attribute__((target(kAvx512Target), always_inline)) inline void Dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// One step of k (4 for W8A8, 8 for W4A8) for R rows x C panels; w and q point at the step's data.
template <bool kW4, int R, int C>
__attribute__((target(kAvx512Target), always_inline)) inline void VnniStep(__m512i (&acc)[R][C], const int8_t* w,
                                                                          int64_t wstride, const uint8_t* q,
                                                                          int64_t ldq) {
  if constexpr (kW4) {
    const __m512i nib = _mm512_set1_epi8(15);
    __m512i lo[C], hi[C];
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(w + c * wstride);
      lo[c] = _mm512_and_si512(v, nib);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t x0, x1;
      std::memcpy(&x0, q + r * ldq, 4);
      std::memcpy(&x1, q + r * ldq + 4, 4);
      const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        Dpbusd(acc[r][c], lo[c], b0);
        Dpbusd(acc[r][c], hi[c], b1);
      }
    }
  } else {
    __m512i wv[C];
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * wstride);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t xv;
      std::memcpy(&xv, q + r * ldq, 4);
      const __m512i xb = _mm512_set1_epi32(xv);
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c) Dpbusd(acc[r][c], xb, wv[c]);
    }
  }
}

template <typename V, int R, int C>
__attribute__((target(kAvx512Target), always_inline)) inline void Fill(V (&acc)[R][C], V value) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = value;
}

// W8A32: rows m0 .. m0 + R - 1 times panels pb .. pb + C - 1 (all full), stored with the bias.
template <int R, int C>
__attribute__((target(kAvx512Target))) void W8A32Block(const BlockArgs& a, int64_t m0, int64_t pb) {
  const int64_t K = a.steps, ldq = a.ldq, wstride = a.wstride;
  const float* x = a.xf + m0 * ldq;
  const int8_t* w = a.w + pb * wstride;
  __m512 acc[R][C];
  Fill(acc, _mm512_setzero_ps());
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      wv[c] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * wstride + k * kPanel))));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldq + k]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const int64_t n = (pb + c) * kPanel;
    const __m512 sc = _mm512_loadu_ps(a.scale + n), b = _mm512_loadu_ps(a.bias + n);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a.y + (m0 + r) * a.ldy + n, _mm512_fmadd_ps(acc[r][c], sc, b));
  }
}

// W8A8 / W4A8: rows m0 .. m0 + R - 1 times panels pb .. pb + C - 1 (all full), stored with the bias.
// One loop over k with the accumulators in one local array: with a second
// (remainder) loop GCC kept the array in memory and stored it every step.
template <bool kW4, int R, int C>
__attribute__((target(kAvx512Target))) void VnniBlock(const BlockArgs& a, int64_t m0, int64_t pb) {
  constexpr int64_t kStepBytes = kW4 ? 8 : 4;
  const int64_t steps = a.steps + (!kW4 && a.tails != nullptr ? 1 : 0), ldq = a.ldq, wstride = a.wstride;
  const uint8_t* q = a.q + m0 * ldq;
  const int8_t* w = a.w + pb * wstride;
  const int8_t* tail = kW4 || a.tails == nullptr ? nullptr : a.tails + (pb - a.tail0) * 64;
  __m512i acc[R][C];
  Fill(acc, _mm512_setzero_si512());
  for (int64_t s = 0; s < steps; ++s) {
    if (R <= 2) {
      // Few rows: the call streams weights from L3 or memory; prefetch well ahead of the hardware's guess.
      // 4 KB ahead per panel for W8A8 (whose 4096-wide layers come from DRAM), 1 KB for the
      // L3-resident W4A8 (measured: each distance is 10-20% slower for the other).
      constexpr int64_t kAhead = kW4 ? 16 : 64;
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + c * wstride + (s + kAhead) * 64), _MM_HINT_T0);
    }
    const bool in_tail = !kW4 && s == a.steps;  // W8A8's last partial group of 4 k, zero-padded
    VnniStep<kW4, R, C>(acc, in_tail ? tail : w + s * 64, in_tail ? 64 : wstride, q + s * kStepBytes, ldq);
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const int64_t n = (pb + c) * kPanel;
    const __m512 sc = _mm512_loadu_ps(a.scale + n), b = _mm512_loadu_ps(a.bias + n);
    const __m512i off = kW4 ? _mm512_setzero_si512() : _mm512_slli_epi32(_mm512_loadu_si512(a.colsum + n), 7);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i v = _mm512_sub_epi32(acc[r][c], off);
      if (kW4) v = _mm512_sub_epi32(v, _mm512_set1_epi32(8 * a.qsum[m0 + r]));
      const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(a.sx[m0 + r]), sc);
      _mm512_storeu_ps(a.y + (m0 + r) * a.ldy + n, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), rs, b));
    }
  }
}

template <int kKind, int R, int C>
void Block(const BlockArgs& a, int64_t m0, int64_t pb) {
  if constexpr (kKind == kBlockW8A32)
    W8A32Block<R, C>(a, m0, pb);
  else
    VnniBlock<kKind == kBlockW4A8, R, C>(a, m0, pb);
}

constexpr int kBlockRows = 8, kBlockPanels = 4;
using BlockFn = void (*)(const BlockArgs&, int64_t, int64_t);

template <int kKind, int C, size_t... R>
constexpr std::array<BlockFn, kBlockRows> BlockRowTable(std::index_sequence<R...>) {
  return {&Block<kKind, static_cast<int>(R) + 1, C>...};
}

template <int kKind, size_t... C>
constexpr std::array<std::array<BlockFn, kBlockRows>, kBlockPanels> BlockTable(std::index_sequence<C...>) {
  return {BlockRowTable<kKind, static_cast<int>(C) + 1>(std::make_index_sequence<kBlockRows>())...};
}

// Full panels [p0, p1): column blocks of C panels, row blocks of up to 8 rows, then the activation.
template <int kKind>
__attribute__((target(kAvx512Target))) void BlockPanels(const Geometry& g, const BlockArgs& a, int64_t p0,
                                                         int64_t p1) {
  static constexpr auto table = BlockTable<kKind>(std::make_index_sequence<kBlockPanels>());
  // Accumulators, weights and broadcasts must fit the 32 zmm registers: R x C plus C (W4A8: 2C) plus 1-2.
  const int C = g.M >= 4 ? (kKind == kBlockW4A8 ? 2 : 3) : 4;
  for (int64_t pb = p0; pb < p1; pb += C) {
    const int64_t c = std::min<int64_t>(C, p1 - pb);
    for (int64_t m0 = 0; m0 < g.M; m0 += kBlockRows) {
      const int64_t r = std::min<int64_t>(kBlockRows, g.M - m0);
      table[c - 1][r - 1](a, m0, pb);
      if (g.act != kNone) ActRows512(a.y + m0 * a.ldy + pb * kPanel, a.ldy, r, c * kPanel, g.act);
    }
  }
}

// W8A32, AVX-512: one zmm holds a whole 16-column panel row.
// A narrow last panel (width w < 16, rows of w bytes) is read in place with
// masked loads, which zero the missing columns: no per-call copy.
// Masked loads only where needed: with them in every panel's loop, batches of
// 8-64 ran 2.5x slower.
template <bool kNarrow>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) inline __m512 LoadW8A32Row(
    const int8_t* p, __mmask16 wmask) {
  const __m128i v =
      kNarrow ? _mm_maskz_loadu_epi8(wmask, p) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

template <int R, int U, bool kNarrow>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void W8A32Avx512Tile(
    const Geometry& g, const float* x, const int8_t* wp, int64_t ldw, __mmask16 wmask,
    const float* scale, const float* bias, float* y, int64_t n0) {
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const int64_t K = g.K;
  if (!kNarrow) ldw = kPanel;
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      const __m512 wv = LoadW8A32Row<kNarrow>(wp + (k + u) * ldw, wmask);
      for (int r = 0; r < R; ++r)
        acc[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + u]), wv, acc[u][r]);
    }
  }
  for (; k < K; ++k) {
    const __m512 wv = LoadW8A32Row<kNarrow>(wp + k * ldw, wmask);
    for (int r = 0; r < R; ++r)
      acc[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, acc[0][r]);
  }
  const int64_t nc = ValidCols(n0, g.N);
  const __mmask16 mask = static_cast<__mmask16>((1u << nc) - 1u);
  const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
  const __m512 b = _mm512_maskz_loadu_ps(mask, bias + n0);
  for (int r = 0; r < R; ++r) {
    __m512 a = acc[0][r];
    for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][r]);
    _mm512_mask_storeu_ps(y + r * g.N + n0, mask, _mm512_fmadd_ps(a, s, b));
  }
}

template <bool kNarrow>
void W8A32Avx512Panel(const Geometry& g, const float* x, const int8_t* wp, int64_t ldw, __mmask16 wmask,
                      const float* scale, const float* bias, float* y, int64_t n0) {
  ForRowBlocks8(g, n0, y, [&](int64_t m0, auto R, auto U) __attribute__((target(kAvx512Target))) {
    W8A32Avx512Tile<R(), U(), kNarrow>(g, x + m0 * g.K, wp, ldw, wmask, scale, bias, y + m0 * g.N, n0);
  });
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void W8A32Avx512(
    const Geometry& g, const float* x, const int8_t* w, const float* scale, const float* bias,
    float* y, int64_t p0, int64_t p1) {
  const int64_t full_end = std::max(p0, std::min(p1, g.N / kPanel));
  const BlockArgs a{g.K, nullptr, x, g.K, nullptr, nullptr, w, kPanel * g.K, nullptr, 0, scale, bias, nullptr, y, g.N};
  BlockPanels<kBlockW8A32>(g, a, p0, full_end);
  for (int64_t p = full_end; p < p1; ++p) {  // the narrow last panel
    const int8_t* wp = w + p * kPanel * g.K;
    const int64_t n0 = p * kPanel, ldw = ValidCols(n0, g.N);
    const __mmask16 wmask = static_cast<__mmask16>((1u << ldw) - 1u);
    if (ldw == kPanel)
      W8A32Avx512Panel<false>(g, x, wp, ldw, wmask, scale, bias, y, n0);
    else
      W8A32Avx512Panel<true>(g, x, wp, ldw, wmask, scale, bias, y, n0);
  }
}

#endif  // ACTORQ_X86

// ---------------------------------------------------------------------------
// W8A8 activation quantization, shared by every path so that all of them
// (and the jnp reference) see bit-identical int8 activations:
//   amax = max|x|, inv = 127 / amax (0 if amax == 0), q = clip(rne(x * inv)),
//   row scale sx = amax / 127.
// Rounding uses the 1.5 * 2^23 trick (exact round-half-to-even for |v| < 2^22
// in the default rounding mode), which avoids a libm call per element.
void QuantizeValues(const float* x, int64_t n, float inv, int8_t* q) {
  const float kMagic = 12582912.0f;
  for (int64_t k = 0; k < n; ++k) {
    float v = x[k] * inv;
    v = std::min(127.f, std::max(-127.f, v));
    v = (v + kMagic) - kMagic;
    q[k] = static_cast<int8_t>(v);
  }
}

// 127 / amax (0 for an all-zero row), and the row scale amax / 127 into *sx.
inline float RowInverse(float amax, float* sx) {
  *sx = amax / 127.0f;
  return amax > 0.f ? 127.0f / amax : 0.f;
}

void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t K4, int8_t* q, float* sx) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    int8_t* qr = q + m * K4 * 4;
    QuantizeValues(xr, K, RowInverse(amax, sx + m), qr);
    for (int64_t k = K; k < K4 * 4; ++k) qr[k] = 0;
  }
}

#if ACTORQ_X86
// QuantizeRows with AVX-512, bit for bit (max is exact in any order; cvtps
// rounds half to even like the magic-number trick), each byte XORed with
// `flip` (0x80 gives the VNNI path's unsigned activations). Scalar, it cost
// more than the matrix product itself at batch 64 and small layers.
__attribute__((target(kAvx512Target))) void QuantizeRowsAvx512(const float* x, int64_t M, int64_t K, int64_t K4,
                                                               uint8_t flip, int8_t* q, float* sx) {
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m128i flip16 = _mm_set1_epi8(static_cast<char>(flip));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = static_cast<__mmask16>(K - k >= 16 ? 0xffffu : (1u << (K - k)) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(mk, xr + k);
      vmax = _mm512_max_ps(vmax, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask)));
    }
    const __m512 vinv = _mm512_set1_ps(RowInverse(_mm512_reduce_max_ps(vmax), sx + m));
    int8_t* qr = q + m * K4 * 4;
    for (int64_t k = 0; k < K4 * 4; k += 16) {
      const int64_t left = std::min<int64_t>(16, K - k);
      const __mmask16 mk = static_cast<__mmask16>(left >= 16 ? 0xffffu : left <= 0 ? 0u : (1u << left) - 1u);
      const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k), vinv)));
      const __m128i b = _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)), flip16);
      const int64_t width = std::min<int64_t>(16, K4 * 4 - k);  // the padding (zeros) is written too
      _mm_mask_storeu_epi8(qr + k, static_cast<__mmask16>(width >= 16 ? 0xffffu : (1u << width) - 1u), b);
    }
  }
}


// The same for AVX2 (no flip: its W8A8 tiles take signed activations).
__attribute__((target("avx2,fma"))) void QuantizeRowsAvx2(const float* x, int64_t M, int64_t K, int64_t K4, int8_t* q,
                                                          float* sx) {
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m256 vmax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xr + k), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.f;
    for (float v : lanes) amax = std::max(amax, v);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float inv = RowInverse(amax, sx + m);
    const __m256 vinv = _mm256_set1_ps(inv);
    int8_t* qr = q + m * K4 * 4;
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv)));
      const __m256i i = _mm256_cvtps_epi32(v);  // round half to even, as the scalar trick
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(w, w));
    }
    QuantizeValues(xr + k, K - k, inv, qr + k);
    for (k = K; k < K4 * 4; ++k) qr[k] = 0;
  }
}
#endif

// Quantizes x [M, K] per row into this thread's scratch, rows padded with zeros
// to `ld` bytes (a multiple of 4); returns q and sets *sx. On the AVX-512 path
// every byte is XORed with `flip`. The buffer holds `rows` >= M rows (the AMX
// path loads whole 16-row tiles; the rows past M are never stored). Thread-local:
// concurrent executions each run on their own calling thread.
int8_t* QuantizeToScratch(const float* x, int64_t M, int64_t K, int64_t ld, int64_t path, uint8_t flip,
                          const float** sx, int64_t rows = 0) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales;
  q.resize(static_cast<size_t>(std::max(M, rows) * ld));
  scales.resize(static_cast<size_t>(M));
  *sx = scales.data();
#if ACTORQ_X86
  if (path == kAvx512) {
    QuantizeRowsAvx512(x, M, K, ld / 4, flip, q.data(), scales.data());
    return q.data();
  }
  if (path == kAvx2) {
    QuantizeRowsAvx2(x, M, K, ld / 4, q.data(), scales.data());
    return q.data();
  }
#endif
  QuantizeRows(x, M, K, ld / 4, q.data(), scales.data());
  return q.data();
}

// W8A8, scalar: exact int32 accumulation.
void W8A8Scalar(const Geometry& g, int64_t K4, const int8_t* q, const float* sx, const int8_t* w,
                const float* scale, const float* bias, float* y, int64_t p0, int64_t p1) {
  thread_local std::vector<int8_t> scratch;
  for (int64_t p = p0; p < p1; ++p) {
    alignas(64) int8_t tail[4 * kPanel];
    const Segments s = W8A8Panel(w, g, p, scratch, tail);
    const int64_t n0 = p * kPanel, nc = ValidCols(n0, g.N);
    for (int64_t m = 0; m < g.M; ++m) {
      const int8_t* qr = q + m * K4 * 4;
      int32_t acc[kPanel] = {0};
      for (int si = 0, gi0 = 0; si < s.count; gi0 += s.groups[si], ++si) {
        for (int64_t gi = 0; gi < s.groups[si]; ++gi) {
          const int8_t* wg = s.ptr[si] + gi * 4 * kPanel;
          const int8_t* xg = qr + (gi0 + gi) * 4;
          for (int64_t c = 0; c < kPanel; ++c)
            for (int j = 0; j < 4; ++j) acc[c] += int32_t{xg[j]} * int32_t{wg[c * 4 + j]};
        }
      }
      for (int64_t c = 0; c < nc; ++c) {
        const float rs = sx[m] * scale[n0 + c];
        y[m * g.N + n0 + c] = ActScalar(static_cast<float>(acc[c]) * rs + bias[n0 + c], g.act);
      }
    }
  }
}

#if ACTORQ_X86
// W8A8, AVX2: maddubs(|w|, sign(x, w)) equals w * x pairwise and cannot
// saturate (|w| <= 128, |x| <= 127: 2 * 128 * 127 < 32767), so weights of
// -128 are handled too; madd with ones widens pairs to int32.
template <int R>
__attribute__((target("avx2,fma"))) void W8A8Avx2Tile(const Geometry& g, int64_t K4,
                                                     const int8_t* q, const float* sx,
                                                     const Segments& s, const float* s16,
                                                     const float* b16, float* y, int64_t n0) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t ldq = K4 * 4;
  for (int si = 0, gi0 = 0; si < s.count; gi0 += s.groups[si], ++si) {
    const int8_t* wp = s.ptr[si];
    const int8_t* qs = q + gi0 * 4;
    for (int64_t gi = 0; gi < s.groups[si]; ++gi) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + gi * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + gi * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, qs + r * ldq + gi * 4, 4);
        const __m256i xb = _mm256_set1_epi32(xv);
        const __m256i p0 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones);
        const __m256i p1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones);
        acc[r][0] = _mm256_add_epi32(acc[r][0], p0);
        acc[r][1] = _mm256_add_epi32(acc[r][1], p1);
      }
    }
  }
  const int64_t nc = ValidCols(n0, g.N);
  for (int r = 0; r < R; ++r) StoreIntRow256(y + r * g.N + n0, acc[r][0], acc[r][1], 0, sx[r], s16, b16, nc);
}

__attribute__((target("avx2,fma"))) void W8A8Avx2(const Geometry& g, int64_t K4, const int8_t* q,
                                                 const float* sx, const int8_t* w,
                                                 const float* scale, const float* bias, float* y,
                                                 int64_t p0, int64_t p1) {
  thread_local std::vector<int8_t> scratch;
  for (int64_t p = p0; p < p1; ++p) {
    alignas(64) int8_t tail[4 * kPanel];
    const Segments s = W8A8Panel(w, g, p, scratch, tail);
    const int64_t n0 = p * kPanel;
    float s16[kPanel], b16[kPanel];
    PanelEpilogueParams(scale, bias, n0, g.N, s16, b16);
    for (int64_t m0 = 0; m0 < g.M; m0 += 4) {
      const int8_t* qt = q + m0 * K4 * 4;
      float* yt = y + m0 * g.N;
      switch (std::min<int64_t>(4, g.M - m0)) {
        case 4: W8A8Avx2Tile<4>(g, K4, qt, sx + m0, s, s16, b16, yt, n0); break;
        case 3: W8A8Avx2Tile<3>(g, K4, qt, sx + m0, s, s16, b16, yt, n0); break;
        case 2: W8A8Avx2Tile<2>(g, K4, qt, sx + m0, s, s16, b16, yt, n0); break;
        default: W8A8Avx2Tile<1>(g, K4, qt, sx + m0, s, s16, b16, yt, n0); break;
      }
      if (g.act != kNone)
        ActRows256(yt + n0, g.N, std::min<int64_t>(4, g.M - m0), ValidCols(n0, g.N), g.act);
    }
  }
}

// The VNNI paths' epilogue for one row block: the sum of the U accumulator sets
// of each row, minus `col_offset` and (when qsum is given) 8 * qsum[row], times
// sx * scale, plus bias, stored (nc columns).
template <int R, int U>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) inline void StoreIntRows512(
    const __m512i (&acc)[U][R], __m512i col_offset, const int32_t* qsum, const float* sx, const float* scale,
    const float* bias, float* y, int64_t ldy, int64_t n0, int64_t nc) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nc) - 1u);
  const __m512 sc = _mm512_maskz_loadu_ps(mask, scale + n0);
  const __m512 b = _mm512_maskz_loadu_ps(mask, bias + n0);
  for (int r = 0; r < R; ++r) {
    __m512i a = acc[0][r];
    for (int u = 1; u < U; ++u) a = _mm512_add_epi32(a, acc[u][r]);
    a = _mm512_sub_epi32(a, col_offset);
    if (qsum != nullptr) a = _mm512_sub_epi32(a, _mm512_set1_epi32(8 * qsum[r]));
    const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(sx[r]), sc);
    _mm512_mask_storeu_ps(y + r * ldy + n0, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), rs, b));
  }
}

// W8A8, AVX-512 VNNI: vpdpbusd takes unsigned activations, so rows are
// offset by +128 (qu = q ^ 0x80) and 128 * colsum(W) is subtracted at the end.
template <int R, int U>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) void W8A8VnniTile(
    const Geometry& g, int64_t K4, const uint8_t* qu, const float* sx, const Segments& s,
    const float* scale, const float* bias, const int32_t* colsum, float* y, int64_t n0) {
  __m512i acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_si512();
  const int64_t ldq = K4 * 4;
  for (int si = 0, gi0 = 0; si < s.count; gi0 += s.groups[si], ++si) {
    const int8_t* wp = s.ptr[si];
    const uint8_t* qs = qu + gi0 * 4;
    const int64_t G = s.groups[si], stride = s.stride[si];
    const __mmask64 wmask = s.mask[si];
    int64_t gi = 0;
    for (; gi + U <= G; gi += U) {
      for (int u = 0; u < U; ++u) {
        const __m512i wv = _mm512_maskz_loadu_epi8(wmask, wp + (gi + u) * stride);
        for (int r = 0; r < R; ++r) {
          int32_t xv;
          std::memcpy(&xv, qs + r * ldq + (gi + u) * 4, 4);
          acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], _mm512_set1_epi32(xv), wv);
        }
      }
    }
    for (; gi < G; ++gi) {
      const __m512i wv = _mm512_maskz_loadu_epi8(wmask, wp + gi * stride);
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, qs + r * ldq + gi * 4, 4);
        acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], _mm512_set1_epi32(xv), wv);
      }
    }
  }
  const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(colsum + n0), 7);
  StoreIntRows512<R, U>(acc, offset, nullptr, sx, scale, bias, y, g.N, n0, ValidCols(n0, g.N));
}

__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) void W8A8Vnni(
    const Geometry& g, int64_t K4, const uint8_t* qu, const float* sx, const int8_t* w,
    const float* scale, const float* bias, const int32_t* colsum, float* y, int64_t p0,
    int64_t p1) {
  const int64_t full_end = std::max(p0, std::min(p1, g.N / kPanel));
  if (full_end > p0) {
    // The last partial group of 4 k of each full panel, zero-padded (the panels are read in place).
    const int64_t G = g.K / 4, rem = g.K % 4;
    thread_local std::vector<int8_t> tails;
    if (rem) {
      tails.assign(static_cast<size_t>((full_end - p0) * 4 * kPanel), 0);
      for (int64_t p = p0; p < full_end; ++p)
        for (int64_t j = 0; j < rem; ++j)
          for (int64_t c = 0; c < kPanel; ++c)
            tails[(p - p0) * 4 * kPanel + c * 4 + j] = w[p * kPanel * g.K + G * 4 * kPanel + j * kPanel + c];
    }
    const BlockArgs a{G, qu, nullptr, K4 * 4, sx, nullptr, w, kPanel * g.K, rem ? tails.data() : nullptr, p0,
                      scale, bias, colsum, y, g.N};
    BlockPanels<kBlockW8A8>(g, a, p0, full_end);
  }
  for (int64_t p = full_end; p < p1; ++p) {  // the narrow last panel, read in place with masked loads
    alignas(64) int8_t tail[4 * kPanel];
    const Segments s = W8A8PanelInPlace(w, g, p, tail);
    const int64_t n0 = p * kPanel;
    // Not ForRowBlocks8: through its lambda this tile ran 2x slower at batch 8-64
    // (measured), presumably as the Segments reads were no longer hoisted.
    for (int64_t m0 = 0; m0 < g.M; m0 += 8) {
      const uint8_t* qt = qu + m0 * K4 * 4;
      float* yt = y + m0 * g.N;
      const float* st = sx + m0;
      switch (std::min<int64_t>(8, g.M - m0)) {
        case 8: W8A8VnniTile<8, 1>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 7: W8A8VnniTile<7, 1>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 6: W8A8VnniTile<6, 1>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 5: W8A8VnniTile<5, 1>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 4: W8A8VnniTile<4, 1>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 3: W8A8VnniTile<3, 2>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        case 2: W8A8VnniTile<2, 2>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
        default: W8A8VnniTile<1, 4>(g, K4, qt, st, s, scale, bias, colsum, yt, n0); break;
      }
      if (g.act != kNone)
        ActRows512(yt + n0, g.N, std::min<int64_t>(8, g.M - m0), ValidCols(n0, g.N), g.act);
    }
  }
}

#endif  // ACTORQ_X86

// ---------------------------------------------------------------------------
// W4A8. K is padded to K8 (a multiple of 8) and N to whole panels, both with
// the value 0. Panel p (16 columns) starts at byte 8 * K8 * p and holds K8 / 8
// blocks of 64 bytes; in block b, byte c * 4 + j packs two weights of column c
// as unsigned nibbles (value + 8): k = 8b + j in the low nibble, k = 8b + 4 + j
// in the high one. Unsigned nibbles times signed activations is exactly the
// operand order of vpdpbusd and maddubs (no offset trick on the activations);
// the +8 comes off at the end: sum (w + 8) q - 8 sum q = sum w q, the same
// integer as W8A8 computes for the same weights.
void W4A8Scalar(const Geometry& g, int64_t K8, const int8_t* q, const int32_t* qsum, const float* sx,
                const uint8_t* w, const float* scale, const float* bias, float* y, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * 8 * K8;
    const int64_t n0 = p * kPanel, nc = ValidCols(n0, g.N);
    for (int64_t m = 0; m < g.M; ++m) {
      const int8_t* qr = q + m * K8;
      int32_t acc[kPanel] = {0};
      for (int64_t b = 0; b < K8 / 8; ++b) {
        const uint8_t* wb = wp + b * 64;
        const int8_t* xb = qr + b * 8;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int j = 0; j < 4; ++j)
            acc[c] += int32_t{wb[c * 4 + j] & 15} * xb[j] + int32_t{wb[c * 4 + j] >> 4} * xb[4 + j];
      }
      for (int64_t c = 0; c < nc; ++c) {
        const float rs = sx[m] * scale[n0 + c];
        y[m * g.N + n0 + c] =
            ActScalar(static_cast<float>(acc[c] - 8 * qsum[m]) * rs + bias[n0 + c], g.act);
      }
    }
  }
}

#if ACTORQ_X86
template <int R>
__attribute__((target("avx2,fma"))) void W4A8Avx2Tile(const Geometry& g, int64_t K8, const int8_t* q,
                                                     const int32_t* qsum, const float* sx, const uint8_t* wp,
                                                     const float* s16, const float* b16, float* y, int64_t n0) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < K8 / 8; ++b) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + b * 64));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + b * 64 + 32));
    const __m256i lo0 = _mm256_and_si256(v0, nib), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
    const __m256i lo1 = _mm256_and_si256(v1, nib), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
    for (int r = 0; r < R; ++r) {
      int32_t x0, x1;
      std::memcpy(&x0, q + r * K8 + b * 8, 4);
      std::memcpy(&x1, q + r * K8 + b * 8 + 4, 4);
      const __m256i xb0 = _mm256_set1_epi32(x0), xb1 = _mm256_set1_epi32(x1);
      // |15 * 127 * 2| < 32767: maddubs cannot saturate.
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(lo0, xb0), ones));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(hi0, xb1), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(lo1, xb0), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(hi1, xb1), ones));
    }
  }
  const int64_t nc = ValidCols(n0, g.N);
  for (int r = 0; r < R; ++r)
    StoreIntRow256(y + r * g.N + n0, acc[r][0], acc[r][1], 8 * qsum[r], sx[r], s16, b16, nc);
}

__attribute__((target("avx2,fma"))) void W4A8Avx2(const Geometry& g, int64_t K8, const int8_t* q,
                                                 const int32_t* qsum, const float* sx, const uint8_t* w,
                                                 const float* scale, const float* bias, float* y, int64_t p0,
                                                 int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * 8 * K8;
    const int64_t n0 = p * kPanel;
    float s16[kPanel], b16[kPanel];
    PanelEpilogueParams(scale, bias, n0, g.N, s16, b16);
    for (int64_t m0 = 0; m0 < g.M; m0 += 4) {
      const int8_t* qt = q + m0 * K8;
      float* yt = y + m0 * g.N;
      const int32_t* st = qsum + m0;
      switch (std::min<int64_t>(4, g.M - m0)) {
        case 4: W4A8Avx2Tile<4>(g, K8, qt, st, sx + m0, wp, s16, b16, yt, n0); break;
        case 3: W4A8Avx2Tile<3>(g, K8, qt, st, sx + m0, wp, s16, b16, yt, n0); break;
        case 2: W4A8Avx2Tile<2>(g, K8, qt, st, sx + m0, wp, s16, b16, yt, n0); break;
        default: W4A8Avx2Tile<1>(g, K8, qt, st, sx + m0, wp, s16, b16, yt, n0); break;
      }
      if (g.act != kNone)
        ActRows256(yt + n0, g.N, std::min<int64_t>(4, g.M - m0), ValidCols(n0, g.N), g.act);
    }
  }
}

template <int R, int U>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) void W4A8VnniTile(
    const Geometry& g, int64_t K8, const int8_t* q, const int32_t* qsum, const float* sx,
    const uint8_t* wp, const float* scale, const float* bias, float* y, int64_t n0) {
  __m512i acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_si512();
  const __m512i nib = _mm512_set1_epi8(15);
  const int64_t B = K8 / 8;
  int64_t b = 0;
  for (; b + U <= B; b += U) {
    for (int u = 0; u < U; ++u) {
      const __m512i v = _mm512_loadu_si512(wp + (b + u) * 64);
      const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, q + r * K8 + (b + u) * 8, 4);
        std::memcpy(&x1, q + r * K8 + (b + u) * 8 + 4, 4);
        acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], lo, _mm512_set1_epi32(x0));
        acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], hi, _mm512_set1_epi32(x1));
      }
    }
  }
  for (; b < B; ++b) {
    const __m512i v = _mm512_loadu_si512(wp + b * 64);
    const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    for (int r = 0; r < R; ++r) {
      int32_t x0, x1;
      std::memcpy(&x0, q + r * K8 + b * 8, 4);
      std::memcpy(&x1, q + r * K8 + b * 8 + 4, 4);
      acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], lo, _mm512_set1_epi32(x0));
      acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], hi, _mm512_set1_epi32(x1));
    }
  }
  StoreIntRows512<R, U>(acc, _mm512_setzero_si512(), qsum, sx, scale, bias, y, g.N, n0, ValidCols(n0, g.N));
}

__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) void W4A8Vnni(
    const Geometry& g, int64_t K8, const int8_t* q, const int32_t* qsum, const float* sx, const uint8_t* w,
    const float* scale, const float* bias, float* y, int64_t p0, int64_t p1) {
  const int64_t full_end = std::max(p0, std::min(p1, g.N / kPanel));
  const BlockArgs a{K8 / 8, reinterpret_cast<const uint8_t*>(q), nullptr, K8, sx, qsum,
                    reinterpret_cast<const int8_t*>(w), 8 * K8, nullptr, 0, scale, bias, nullptr, y, g.N};
  BlockPanels<kBlockW4A8>(g, a, p0, full_end);
  for (int64_t p = full_end; p < p1; ++p) {  // the narrow last panel: masked epilogue
    const uint8_t* wp = w + p * 8 * K8;
    const int64_t n0 = p * kPanel;
    ForRowBlocks8(g, n0, y, [&](int64_t m0, auto R, auto U) __attribute__((target(kAvx512Target))) {
      W4A8VnniTile<R(), U()>(g, K8, q + m0 * K8, qsum + m0, sx + m0, wp, scale, bias, y + m0 * g.N, n0);
    });
  }
}
#endif  // ACTORQ_X86

// ---------------------------------------------------------------------------
// AMX. One tile multiply adds a [16 rows x 64 k] byte tile of activations times
// a [64 k x 16 columns] weight tile stored as 16 rows of (16 columns x 4
// consecutive k): exactly the W8A8 layout's 16 groups of 4 k of one panel, so a
// full panel's weights load in place, 1 KB per 64 k. The tiles add the same
// int32 products as vpdpbusd, and the operands and epilogue are the VNNI paths'
// (W8A8: unsigned activations q + 128 times signed weights, minus 128 * colsum,
// with tdpbusd; W4A8: signed activations times unsigned nibbles w + 8, minus
// 8 * qsum, with tdpbsud), so the outputs equal theirs bit for bit.
// Activation rows are padded with zeros to whole 64-byte chunks and the
// activation buffer to whole 16-row tiles; weight chunks that are not whole
// (the last 64 k when K % 64 != 0, a narrow panel, every W4A8 panel) are
// copied zero-padded into a scratch buffer once per call and panel.
// Fewer rows run the VNNI code instead: a tile multiply costs the same whatever
// rows it holds, and W4A8 pays for unpacking every weight. Measured one layer at
// a time (K = N = 256, 1024, 2048; Xeon with AMX, one and two threads): W8A8
// tiles were slower at 1-4 rows, level at 8 and 1.1-1.5x faster from 12 rows;
// W4A8 tiles 0.2-0.9x at 1-12 rows, 0.85-1.1x at 16 and 1.04-1.3x from 24.
// Layers of fewer than 64 inputs (an observation layer) fill a fraction of a
// tile and were 10-20% slower on tiles at 32-64 rows: they stay on VNNI too.
constexpr int64_t kAmxMinRowsW8A8 = 12, kAmxMinRowsW4A8 = 24;
constexpr int64_t kAmxChunk = 64;        // k per tile multiply
constexpr int64_t kAmxTileBytes = 1024;  // 16 rows x 64 bytes

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

struct AmxArgs {
  int64_t N, act, chunks;
  const uint8_t* q;  // activations, rows of ldq >= 64 * chunks bytes, RoundUp(M, 16) rows
  int64_t ldq;
  const float* sx;
  const int32_t* qsum;    // W4A8
  const int32_t* colsum;  // W8A8
  const float* scale;
  const float* bias;
  float* y;
};

#if ACTORQ_X86
#define kAmxTarget kAvx512Target ",amx-tile,amx-int8"

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes. 0-3: int32 accumulators (row tile r, panel
// c -> 2r + c); 4-5: activations of rows 0-15 and 16-31; 6-7: two panels' weights.
__attribute__((target(kAmxTarget))) void AmxConfigure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // ldtilecfg's builtin does not tell GCC that it reads cfg: without this, the stores above can go.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Chunk c (64 k) of panel p of a W8A8 weight (layout above W8A32Panel) as one
// weight tile: in place where the panel is full and the chunk whole, else
// copied zero-padded into `tile` (1 KB). A narrow panel's group holds column j
// at bytes 4j .. 4j + 3 as a tile row does; the rest of the row stays zero.
const int8_t* W8A8AmxTile(const int8_t* w, const Geometry& g, int64_t p, int64_t c, int8_t* tile) {
  const int8_t* base = w + p * kPanel * g.K;
  const int64_t width = ValidCols(p * kPanel, g.N), G = g.K / 4, rem = g.K % 4, g0 = 16 * c;
  if (width == kPanel && g0 + 16 <= G) return base + g0 * 64;
  std::memset(tile, 0, kAmxTileBytes);
  for (int64_t gi = g0; gi < std::min<int64_t>(G, g0 + 16); ++gi)
    std::memcpy(tile + (gi - g0) * 64, base + gi * 4 * width, static_cast<size_t>(4 * width));
  if (rem && G >= g0 && G < g0 + 16)  // the last, partial group of 4 k
    for (int64_t j = 0; j < rem; ++j)
      for (int64_t col = 0; col < width; ++col) tile[(G - g0) * 64 + col * 4 + j] = base[G * 4 * width + j * width + col];
  return tile;
}

// Chunk c of panel p of a W4A8 weight (layout above W4A8Scalar) unpacked into
// `tile` as unsigned nibbles w + 8: block b of 8 k gives tile rows 2b (k = 8b ..
// 8b + 3, the low nibbles) and 2b + 1 (the high ones); rows past K8 / 4 are zero.
__attribute__((target(kAmxTarget))) const int8_t* W4A8AmxTile(const uint8_t* w, int64_t K8, int64_t p, int64_t c,
                                                              int8_t* tile) {
  const uint8_t* wp = w + p * 8 * K8;
  const __m512i nib = _mm512_set1_epi8(15);
  const int64_t b0 = 8 * c, b1 = std::min<int64_t>(K8 / 8, b0 + 8);
  for (int64_t b = b0; b < b1; ++b) {
    const __m512i v = _mm512_loadu_si512(wp + b * 64);
    _mm512_storeu_si512(tile + 2 * (b - b0) * 64, _mm512_and_si512(v, nib));
    _mm512_storeu_si512(tile + (2 * (b - b0) + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
  }
  std::memset(tile + 2 * (b1 - b0) * 64, 0, static_cast<size_t>(kAmxTileBytes - 2 * (b1 - b0) * 64));
  return tile;
}

// tdpbusd (u8 activations x s8 weights) for W8A8, tdpbsud (s8 x u8 nibbles) for W4A8.
#define ACTORQ_TDP(kW4, c, a, b) \
  do {                           \
    if constexpr (kW4)           \
      _tile_dpbsud(c, a, b);     \
    else                         \
      _tile_dpbusd(c, a, b);     \
  } while (0)

// The epilogue of one pair of panels whose accumulators are in memory: the VNNI
// paths' epilogue and the activation, one (row, panel) at a time, so that it can
// run in slices between the tile products of the next pair (the vector units
// work while the tile unit does; the epilogue after each pair left it idle).
struct AmxEpilogue {
  const AmxArgs* a = nullptr;
  const int32_t* acc = nullptr;  // [row tile][panel of the pair][16 x 16]
  int64_t pb = 0, cols = 0, next = 0, units = 0;  // unit u: row u / cols, panel u % cols

  __attribute__((target(kAmxTarget))) void Run(int64_t count) {
    for (const int64_t end = std::min(units, next + count); next < end; ++next) {
      const int64_t m = next / cols, ct = next % cols;
      const int64_t n0 = (pb + ct) * kPanel, nc = ValidCols(n0, a->N);
      const __mmask16 mask = static_cast<__mmask16>((1u << nc) - 1u);
      const __m512 sc = _mm512_maskz_loadu_ps(mask, a->scale + n0), b = _mm512_maskz_loadu_ps(mask, a->bias + n0);
      __m512i v = _mm512_load_si512(acc + ((m / 16) * 2 + ct) * 256 + (m % 16) * 16);
      if (a->qsum != nullptr)  // W4A8: the +8 of the nibbles times the row's sum
        v = _mm512_sub_epi32(v, _mm512_set1_epi32(8 * a->qsum[m]));
      else  // W8A8: the +128 of the activations times the column sums
        v = _mm512_sub_epi32(v, _mm512_slli_epi32(_mm512_loadu_si512(a->colsum + n0), 7));
      const __m512 rs = _mm512_mul_ps(_mm512_set1_ps(a->sx[m]), sc);
      // Act512 of the stored value, lane by lane: what ActRows512 gives on the other paths.
      const __m512 out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), rs, b);
      _mm512_mask_storeu_ps(a->y + m * a->N + n0, mask, a->act == kNone ? out : Act512(out, a->act));
    }
  }
};

// Rows m0 .. m0 + 16 RT - 1 times the CT panels whose weight tiles `bt` lists
// ([panel][chunk], n chunks each): the tile products over every chunk into the
// accumulator tiles `acc` (1 KB each: row tile r, panel c at acc + (2r + c) * 256),
// running `per_chunk` units of the previous pair's epilogue after each chunk.
template <bool kW4, int RT, int CT>
__attribute__((target(kAmxTarget))) void AmxBlock(const AmxArgs& a, int64_t m0, const int8_t* const* bt, int64_t n,
                                                  int32_t* acc, AmxEpilogue& previous, int64_t per_chunk) {
  // The tile instructions' asm names no memory: keep every write to the operands before them.
  asm volatile("" ::: "memory");
  _tile_zero(0);
  if constexpr (CT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  const uint8_t* q0 = a.q + m0 * a.ldq;
  const uint8_t* q1 = q0 + 16 * a.ldq;
  for (int64_t j = 0; j < n; ++j) {
    _tile_loadd(4, q0 + j * kAmxChunk, a.ldq);
    _tile_loadd(6, bt[j], 64);
    ACTORQ_TDP(kW4, 0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, bt[n + j], 64);
      ACTORQ_TDP(kW4, 1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, q1 + j * kAmxChunk, a.ldq);
      ACTORQ_TDP(kW4, 2, 5, 6);
      if constexpr (CT == 2) ACTORQ_TDP(kW4, 3, 5, 7);
    }
    previous.Run(per_chunk);
  }
  _tile_stored(0, acc, 64);
  if constexpr (CT == 2) _tile_stored(1, acc + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, acc + 512, 64);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, acc + 768, 64);
  // ... and every read of the accumulators after them.
  asm volatile("" ::: "memory");
}

// Panels [p0, p1) (full or narrow), two at a time: their weight tiles (in place
// or copied) and the tile products of all rows, while the previous pair's
// epilogue runs in slices; the last pair's epilogue after the loop.
template <bool kW4>
__attribute__((target(kAmxTarget))) void AmxPanels(const Geometry& g, const AmxArgs& a, const int8_t* w, int64_t K8,
                                                   int64_t p0, int64_t p1) {
  const int64_t row_tiles = (g.M + 15) / 16, n = a.chunks, acc_ints = row_tiles * 2 * 256;
  thread_local std::vector<int32_t> accs;    // two pairs' [row tile][panel of the pair][16 x 16], 64-byte aligned
  thread_local std::vector<int8_t> scratch;  // the pair's weight tiles that are not in place: [panel][chunk]
  thread_local std::vector<const int8_t*> bt;  // the pair's weight tiles: [panel][chunk]
  accs.resize(static_cast<size_t>(2 * acc_ints) + 16);
  scratch.resize(static_cast<size_t>(2 * n * kAmxTileBytes));
  bt.resize(static_cast<size_t>(2 * n));
  int32_t* acc0 = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(accs.data()) + 63) & ~uintptr_t{63});
  AmxEpilogue previous;  // nothing to do before the first pair
  AmxConfigure();
  for (int64_t pb = p0, i = 0; pb < p1; pb += 2, ++i) {
    const int64_t cols = std::min<int64_t>(2, p1 - pb);
    int32_t* acc = acc0 + (i % 2) * acc_ints;
    for (int64_t ct = 0; ct < cols; ++ct)
      for (int64_t j = 0; j < n; ++j) {
        int8_t* tile = scratch.data() + (ct * n + j) * kAmxTileBytes;
        bt[ct * n + j] = kW4 ? W4A8AmxTile(reinterpret_cast<const uint8_t*>(w), K8, pb + ct, j, tile)
                             : W8A8AmxTile(w, g, pb + ct, j, tile);
      }
    // The previous pair's epilogue, spread over this pair's chunks (all of it by the last).
    const int64_t passes = (row_tiles + 1) / 2, steps = passes * n;
    const int64_t per_chunk = (previous.units - previous.next + steps - 1) / steps;
    // Row blocks inside the pair: the pair's weight tiles (2 x K bytes) stay in L2 for the second.
    for (int64_t rt = 0; rt < row_tiles; rt += 2) {
      int32_t* at = acc + rt * 2 * 256;
      if (cols == 2)
        rt + 1 < row_tiles ? AmxBlock<kW4, 2, 2>(a, rt * 16, bt.data(), n, at, previous, per_chunk)
                           : AmxBlock<kW4, 1, 2>(a, rt * 16, bt.data(), n, at, previous, per_chunk);
      else
        rt + 1 < row_tiles ? AmxBlock<kW4, 2, 1>(a, rt * 16, bt.data(), n, at, previous, per_chunk)
                           : AmxBlock<kW4, 1, 1>(a, rt * 16, bt.data(), n, at, previous, per_chunk);
    }
    previous.Run(previous.units);  // whatever rounding left
    previous = AmxEpilogue{&a, acc, pb, cols, 0, g.M * cols};
  }
  // Hands the tile state back: a thread holding it makes every context switch save 8 KB more.
  _tile_release();
  previous.Run(previous.units);
}
#undef ACTORQ_TDP
#endif  // ACTORQ_X86

// ---------------------------------------------------------------------------
// Layer norm (+ activation) over the last axis, as flax.linen.LayerNorm computes
// it: var = max(0, E[x^2] - E[x]^2), y = (x - E[x]) * scale / sqrt(var + eps) + bias.
// The D4PG policy normalises its first layer; as one call it costs a few
// microseconds, where XLA:CPU's fusions around the int8 calls cost tens.
void LayerNormRow(const float* x, const float* scale, const float* bias, float* y, int64_t N,
                  float eps, int64_t act, float* mean_out, float* inv_out) {
  double sum = 0.0, sum2 = 0.0;  // double: exact enough for any N an actor uses
  for (int64_t n = 0; n < N; ++n) {
    sum += x[n];
    sum2 += static_cast<double>(x[n]) * x[n];
  }
  const float mean = static_cast<float>(sum / N);
  const float var = std::max(0.f, static_cast<float>(sum2 / N - (sum / N) * (sum / N)));
  const float inv = 1.f / std::sqrt(var + eps);
  *mean_out = mean;
  *inv_out = inv;
  if (y == nullptr) return;
  for (int64_t n = 0; n < N; ++n) y[n] = ActScalar((x[n] - mean) * (scale[n] * inv) + bias[n], act);
}

#if ACTORQ_X86
__attribute__((target("avx512f,avx2,fma"))) void LayerNormRowAvx512(const float* x, const float* scale,
                                                                    const float* bias, float* y, int64_t N,
                                                                    float eps, int64_t act) {
  float mean, inv;
  LayerNormRow(x, scale, bias, nullptr, N, eps, act, &mean, &inv);
  const __m512 vm = _mm512_set1_ps(mean), vi = _mm512_set1_ps(inv);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = static_cast<__mmask16>(N - n >= 16 ? 0xffffu : (1u << (N - n)) - 1u);
    const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + n), vm);
    const __m512 sc = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scale + n), vi);
    _mm512_mask_storeu_ps(y + n, m, Act512(_mm512_fmadd_ps(v, sc, _mm512_maskz_loadu_ps(m, bias + n)), act));
  }
}

__attribute__((target("avx2,fma"))) void LayerNormRowAvx2(const float* x, const float* scale,
                                                          const float* bias, float* y, int64_t N,
                                                          float eps, int64_t act) {
  float mean, inv;
  LayerNormRow(x, scale, bias, nullptr, N, eps, act, &mean, &inv);
  const __m256 vm = _mm256_set1_ps(mean), vi = _mm256_set1_ps(inv);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + n), vm);
    const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(scale + n), vi);
    _mm256_storeu_ps(y + n, Act256(_mm256_fmadd_ps(v, sc, _mm256_loadu_ps(bias + n)), act));
  }
  for (; n < N; ++n) y[n] = ActScalar((x[n] - mean) * (scale[n] * inv) + bias[n], act);
}
#endif

// ---------------------------------------------------------------------------
// FFI entry points. The per-layer handlers and the fused MLP handler check
// their operands the same way and then run the same cores (RunDense,
// RunLayerNorm), so a fused forward equals the per-layer one bit for bit.

enum Op : int64_t { kOpW8A32 = 0, kOpW8A8 = 1, kOpW4A8 = 2, kOpLayerNorm = 3 };

const char* OpName(int64_t op) {
  switch (op) {
    case kOpW8A32: return "actorq int8_dense w8a32";
    case kOpW8A8: return "actorq int8_dense w8a8";
    case kOpW4A8: return "actorq int8_dense w4a8";
    default: return "actorq layer_norm";
  }
}

ffi::Error Invalid(int64_t op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(OpName(op)) + ": " + what);
}

ffi::Error CheckPathAndActivation(int64_t op, int64_t path, int64_t act) {
  if (act < kNone || act > kTanh) return Invalid(op, "activation " + std::to_string(act) + " is unknown");
  if (!PathSupported(path))
    return Invalid(op, "path " + std::to_string(path) + " is unknown or not supported by this CPU");
  return ffi::Error::Success();
}

int64_t Resolve(int64_t path) { return path == kAuto ? BestPath() : path; }

// One dense layer's operands (already checked): packed weights and per-column parameters.
struct DenseOperands {
  int64_t op;  // kOpW8A32, kOpW8A8 or kOpW4A8
  const int8_t* w;
  const float* scale;
  const float* bias;
  const int32_t* colsum;
};

// The shape the packed weights of a dense layer with K inputs and N outputs must have.
void PackedShape(int64_t op, int64_t K, int64_t N, int64_t* rows, int64_t* cols) {
  if (op == kOpW4A8) {
    *rows = (K + 7) / 8 * 4;
    *cols = (N + kPanel - 1) / kPanel * kPanel;
  } else {
    *rows = K;
    *cols = N;
  }
}

ffi::Error CheckDense(int64_t op, int64_t K, int64_t N, ffi::Span<const int64_t> wd, size_t scale_len,
                      size_t bias_len, size_t colsum_len, int64_t path, int64_t act) {
  if (N < 1 || K < 1) return Invalid(op, "expected K >= 1 inputs and N >= 1 outputs");
  int64_t rows, cols;
  PackedShape(op, K, N, &rows, &cols);
  if (wd.size() != 2 || wd[0] != rows || wd[1] != cols)
    return Invalid(op, "expected packed weights of shape [" + std::to_string(rows) + ", " +
                           std::to_string(cols) + "] for K=" + std::to_string(K) + ", N=" + std::to_string(N));
  if (static_cast<int64_t>(scale_len) != N || static_cast<int64_t>(bias_len) != N)
    return Invalid(op, "scale/bias length != out_features");
  if (static_cast<int64_t>(colsum_len) != (N + kPanel - 1) / kPanel * kPanel)
    return Invalid(op, "colsum length != 16 * panels");
  return CheckPathAndActivation(op, path, act);
}

// y [M, N] = act(x [M, K] @ W + bias) on the resolved path `p`.
void RunDense(const Geometry& g, int64_t p, const float* x, const DenseOperands& d, float* y) {
  // The AMX path is the AVX-512 one with tile products for W8A8 and W4A8 from a dozen or two rows on.
  const bool amx = p == kAmx && g.K >= kAmxChunk &&
                   ((d.op == kOpW8A8 && g.M >= kAmxMinRowsW8A8) || (d.op == kOpW4A8 && g.M >= kAmxMinRowsW4A8)) &&
                   AmxGranted();
  if (p == kAmx) p = kAvx512;
  if (d.op == kOpW8A32) {
    ForPanels(g.P, g.M * g.K * g.N, [&](int64_t p0, int64_t p1) {
#if ACTORQ_X86
      if (p == kAvx512) return W8A32Avx512(g, x, d.w, d.scale, d.bias, y, p0, p1);
      if (p == kAvx2) return W8A32Avx2(g, x, d.w, d.scale, d.bias, y, p0, p1);
#endif
      W8A32Scalar(g, x, d.w, d.scale, d.bias, y, p0, p1);
    });
    return;
  }
  // AMX loads whole tiles: activation rows of 64-byte chunks, whole 16-row tiles. The row stride is
  // an odd number of cache lines: at a power of two (K = 1024, 2048) a tile's 16 rows fell into two
  // L1 sets and evicted each other.
  const int64_t chunks = (g.K + kAmxChunk - 1) / kAmxChunk, amx_ld = (chunks | 1) * kAmxChunk;
  const int64_t tile_rows = amx ? RoundUp(g.M, 16) : g.M;
  if (d.op == kOpW4A8) {
    const int64_t K8 = (g.K + 7) / 8 * 8, ldq = amx ? amx_ld : K8;
    const float* sx;
    const int8_t* q = QuantizeToScratch(x, g.M, g.K, ldq, p, 0, &sx, tile_rows);
    thread_local std::vector<int32_t> qsum;
    qsum.resize(static_cast<size_t>(g.M));
    for (int64_t m = 0; m < g.M; ++m) {
      int32_t total = 0;
      for (int64_t k = 0; k < g.K; ++k) total += q[m * ldq + k];
      qsum[m] = total;
    }
    const uint8_t* w = reinterpret_cast<const uint8_t*>(d.w);
    const int32_t* qs = qsum.data();
    const AmxArgs a{g.N, g.act, chunks, reinterpret_cast<const uint8_t*>(q), ldq, sx, qs, nullptr,
                    d.scale, d.bias, y};
    ForPanels(g.P, g.M * g.K * g.N / 2, [&](int64_t p0, int64_t p1) {
#if ACTORQ_X86
      if (amx) return AmxPanels<true>(g, a, d.w, K8, p0, p1);
      if (p == kAvx512) return W4A8Vnni(g, K8, q, qs, sx, w, d.scale, d.bias, y, p0, p1);
      if (p == kAvx2) return W4A8Avx2(g, K8, q, qs, sx, w, d.scale, d.bias, y, p0, p1);
#endif
      W4A8Scalar(g, K8, q, qs, sx, w, d.scale, d.bias, y, p0, p1);
    });
    return;
  }
  const int64_t K4 = (g.K + 3) / 4, ldq = amx ? amx_ld : K4 * 4;
  const float* sx;
  // The VNNI and AMX paths take unsigned activations: q + 128, corrected by 128 * colsum (see W8A8VnniTile).
  const int8_t* qc = QuantizeToScratch(x, g.M, g.K, ldq, p, p == kAvx512 ? 0x80 : 0, &sx, tile_rows);
  const uint8_t* qu = reinterpret_cast<const uint8_t*>(qc);
  const AmxArgs a{g.N, g.act, chunks, qu, ldq, sx, nullptr, d.colsum, d.scale, d.bias, y};
  ForPanels(g.P, g.M * g.K * g.N, [&](int64_t p0, int64_t p1) {
#if ACTORQ_X86
    if (amx) return AmxPanels<false>(g, a, d.w, 0, p0, p1);
    if (p == kAvx512) return W8A8Vnni(g, K4, qu, sx, d.w, d.scale, d.bias, d.colsum, y, p0, p1);
    if (p == kAvx2) return W8A8Avx2(g, K4, qc, sx, d.w, d.scale, d.bias, y, p0, p1);
#endif
    W8A8Scalar(g, K4, qc, sx, d.w, d.scale, d.bias, y, p0, p1);
  });
}

ffi::Error CheckLayerNorm(int64_t N, size_t scale_len, size_t bias_len, float eps, int64_t path, int64_t act) {
  if (N < 1) return Invalid(kOpLayerNorm, "expected x [M, N] with N >= 1");
  if (static_cast<int64_t>(scale_len) != N || static_cast<int64_t>(bias_len) != N)
    return Invalid(kOpLayerNorm, "scale/bias length != N");
  if (!(eps >= 0.f)) return Invalid(kOpLayerNorm, "epsilon must be >= 0");
  return CheckPathAndActivation(kOpLayerNorm, path, act);
}

void RunLayerNorm(int64_t M, int64_t N, int64_t p, const float* x, const float* scale, const float* bias, float* y,
                  float eps, int64_t act) {
  if (p == kAmx) p = kAvx512;  // no tile work in a layer norm
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * N;
    float* yr = y + m * N;
#if ACTORQ_X86
    if (p == kAvx512) {
      LayerNormRowAvx512(xr, scale, bias, yr, N, eps, act);
      continue;
    }
    if (p == kAvx2) {
      LayerNormRowAvx2(xr, scale, bias, yr, N, eps, act);
      continue;
    }
#endif
    float mean, inv;
    LayerNormRow(xr, scale, bias, yr, N, eps, act, &mean, &inv);
  }
}

using F32 = ffi::Buffer<ffi::F32>;

// One handler for the three dense modes: they take the same operands (W8A32 ignores colsum).
template <int64_t kOp>
ffi::Error DenseImpl(F32 x, ffi::Buffer<ffi::S8> w, F32 scale, F32 bias, ffi::Buffer<ffi::S32> colsum,
                     ffi::Result<F32> y, int64_t n_attr, int64_t path, int64_t act) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return Invalid(kOp, "expected x [M, K]");
  if (ffi::Error e = CheckDense(kOp, xd[1], n_attr, w.dimensions(), scale.element_count(), bias.element_count(),
                                colsum.element_count(), path, act);
      e.failure())
    return e;
  const Geometry g{xd[0], xd[1], n_attr, (n_attr + kPanel - 1) / kPanel, act};
  const DenseOperands d{kOp, w.typed_data(), scale.typed_data(), bias.typed_data(), colsum.typed_data()};
  RunDense(g, Resolve(path), x.typed_data(), d, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error LayerNormImpl(F32 x, F32 scale, F32 bias, ffi::Result<F32> y, float eps, int64_t act, int64_t path) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return Invalid(kOpLayerNorm, "expected x [M, N] with N >= 1");
  if (ffi::Error e = CheckLayerNorm(xd[1], scale.element_count(), bias.element_count(), eps, path, act); e.failure())
    return e;
  RunLayerNorm(xd[0], xd[1], Resolve(path), x.typed_data(), scale.typed_data(), bias.typed_data(),
               y->typed_data(), eps, act);
  return ffi::Error::Success();
}

// A whole MLP forward in one call. `program` holds three integers per layer,
// (op, out_features, activation); its operands follow x in `args`: a dense
// layer takes 4 (packed weights, scale, bias, colsum), a layer norm 2 (scale,
// bias) and the next of `epsilons`. Intermediate activations live in this
// thread's scratch; the last layer writes y.
constexpr int64_t kProgramStride = 3;

struct MlpLayer {
  int64_t op, K, N, act;
  DenseOperands dense;
  const float* ln_scale;
  const float* ln_bias;
  float eps;
};

ffi::Error MlpImpl(F32 x, ffi::RemainingArgs args, ffi::Result<F32> y, ffi::Span<const int64_t> program,
                   ffi::Span<const float> epsilons, int64_t path) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || program.size() % kProgramStride != 0 || program.size() == 0)
    return ffi::Error::InvalidArgument("actorq mlp: expected x [M, K] and 3 program entries per layer");
  const int64_t M = xd[0];
  std::vector<MlpLayer> layers;
  size_t arg = 0, ln = 0;
  int64_t K = xd[1], widest = 0;
  for (size_t i = 0; i < program.size(); i += kProgramStride) {
    MlpLayer L{program[i], K, program[i + 1], program[i + 2], {}, nullptr, nullptr, 0.f};
    if (L.op < kOpW8A32 || L.op > kOpLayerNorm)
      return ffi::Error::InvalidArgument("actorq mlp: layer op " + std::to_string(L.op) + " is unknown");
    const size_t need = L.op == kOpLayerNorm ? 2 : 4;
    if (arg + need > args.size()) return ffi::Error::InvalidArgument("actorq mlp: too few operands for the program");
    auto f32 = [&](size_t j) { return args.get<F32>(arg + j); };
    if (L.op == kOpLayerNorm) {
      auto scale = f32(0), bias = f32(1);
      if (!scale.has_value() || !bias.has_value() || ln >= epsilons.size())
        return ffi::Error::InvalidArgument("actorq mlp: layer norm operands must be float32 (and one epsilon each)");
      L.N = K;
      L.eps = epsilons[ln++];
      if (ffi::Error e = CheckLayerNorm(K, scale->element_count(), bias->element_count(), L.eps, path, L.act);
          e.failure())
        return e;
      L.ln_scale = scale->typed_data();
      L.ln_bias = bias->typed_data();
    } else {
      auto w = args.get<ffi::Buffer<ffi::S8>>(arg);
      auto scale = f32(1), bias = f32(2);
      auto colsum = args.get<ffi::Buffer<ffi::S32>>(arg + 3);
      if (!w.has_value() || !scale.has_value() || !bias.has_value() || !colsum.has_value())
        return ffi::Error::InvalidArgument("actorq mlp: dense operands must be int8, float32, float32, int32");
      if (ffi::Error e = CheckDense(L.op, K, L.N, w->dimensions(), scale->element_count(), bias->element_count(),
                                    colsum->element_count(), path, L.act);
          e.failure())
        return e;
      L.dense = DenseOperands{L.op, w->typed_data(), scale->typed_data(), bias->typed_data(), colsum->typed_data()};
    }
    arg += need;
    K = L.N;
    widest = std::max(widest, L.N);
    layers.push_back(L);
  }
  const auto yd = y->dimensions();
  if (arg != args.size() || yd.size() != 2 || yd[0] != M || yd[1] != K)
    return ffi::Error::InvalidArgument("actorq mlp: operands or output shape do not match the program");
  thread_local std::vector<float> ping, pong;
  ping.resize(static_cast<size_t>(M * widest));
  pong.resize(static_cast<size_t>(M * widest));
  const int64_t p = Resolve(path);
  const float* in = x.typed_data();
  for (size_t i = 0; i < layers.size(); ++i) {
    const MlpLayer& L = layers[i];
    float* out = i + 1 == layers.size() ? y->typed_data() : (i % 2 == 0 ? ping.data() : pong.data());
    if (L.op == kOpLayerNorm)
      RunLayerNorm(M, L.N, p, in, L.ln_scale, L.ln_bias, out, L.eps, L.act);
    else
      RunDense(Geometry{M, L.K, L.N, (L.N + kPanel - 1) / kPanel, L.act}, p, in, L.dense, out);
    in = out;
  }
  return ffi::Error::Success();
}

// The dense handlers' signature: x, packed weights, scale, bias, colsum; out_features, path, activation.
auto DenseBinding() {
  return ffi::Ffi::Bind()
      .Arg<F32>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<F32>()
      .Arg<F32>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<F32>()
      .Attr<int64_t>("out_features")
      .Attr<int64_t>("path")
      .Attr<int64_t>("activation");
}

}  // namespace

#define ACTORQ_DENSE_HANDLER(symbol, op) XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, DenseImpl<op>, DenseBinding())
ACTORQ_DENSE_HANDLER(ActorqInt8DenseW8A32, kOpW8A32);
ACTORQ_DENSE_HANDLER(ActorqInt8DenseW8A8, kOpW8A8);
ACTORQ_DENSE_HANDLER(ActorqInt8DenseW4A8, kOpW4A8);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActorqLayerNorm, LayerNormImpl,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>().Attr<float>("epsilon")
                                  .Attr<int64_t>("activation").Attr<int64_t>("path"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActorqMlp, MlpImpl,
                              ffi::Ffi::Bind().Arg<F32>().RemainingArgs().Ret<F32>()
                                  .Attr<ffi::Span<const int64_t>>("program").Attr<ffi::Span<const float>>("epsilons")
                                  .Attr<int64_t>("path"));

// Plain C helpers for ctypes.
extern "C" {

// Repacks row-major int8 weights [K, N] into a kernel layout (mode 0: W8A32,
// 1: W8A8, both described above W8A32Panel, K * N bytes; 2: W4A8, described
// above W4A8Scalar, 8 * K8 * panels bytes, values in -8..7) and writes their
// zero-padded column sums (16 * ceil(N / 16) entries). One pass in place of
// numpy's transposes: actors repack at every variable refresh.
void actorq_pack_panels(const int8_t* src, int64_t K, int64_t N, int64_t mode, int8_t* dst,
                        int32_t* colsum) {
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / 4, K8 = (K + 7) / 8 * 8;
  const bool w8a8 = mode == 1;
  std::memset(colsum, 0, sizeof(int32_t) * P * kPanel);
  if (mode == 2) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) colsum[n] += src[k * N + n];
    // Written in output order, one 64-byte block at a time; padding is the value 0 (nibble 8).
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    auto nibble = [&](int64_t k, int64_t n) -> uint8_t {
      return k < K && n < N ? static_cast<uint8_t>(src[k * N + n] + 8) : uint8_t{8};
    };
    for (int64_t p = 0; p < P; ++p)
      for (int64_t b = 0; b < K8 / 8; ++b, out += 64)
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t j = 0; j < 4; ++j)
            out[c * 4 + j] = static_cast<uint8_t>(nibble(8 * b + j, p * kPanel + c) |
                                                  (nibble(8 * b + 4 + j, p * kPanel + c) << 4));
    return;
  }
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = src + k * N;
    for (int64_t n = 0; n < N; ++n) colsum[n] += row[n];
    for (int64_t p = 0; p < P; ++p) {
      const int64_t n0 = p * kPanel, width = ValidCols(n0, N);
      int8_t* base = dst + n0 * K;
      if (!w8a8) {
        std::memcpy(base + k * width, row + n0, width);
      } else if (k < 4 * G) {
        int8_t* out = base + (k / 4) * 4 * width + (k % 4);
        for (int64_t c = 0; c < width; ++c) out[c * 4] = row[n0 + c];
      } else {
        std::memcpy(base + G * 4 * width + (k - 4 * G) * width, row + n0, width);
      }
    }
  }
}

// Version of the handlers' signatures (see kAbiVersion).
int64_t actorq_abi_version() { return kAbiVersion; }

// The fewest rows (batch) from which the AMX path uses tiles for op 1 (W8A8) or 2 (W4A8); 0 for other ops.
int64_t actorq_amx_min_rows(int64_t op) {
  return op == kOpW8A8 ? kAmxMinRowsW8A8 : (op == kOpW4A8 ? kAmxMinRowsW4A8 : 0);
}

// Best path this CPU supports: 1 scalar, 2 avx2, 3 avx512, 4 amx.
int64_t actorq_best_path() { return BestPath(); }

int64_t actorq_path_supported(int64_t path) { return PathSupported(path) ? 1 : 0; }

void actorq_set_num_threads(int64_t n) { g_num_threads.store(static_cast<int>(std::max<int64_t>(1, n))); }

int64_t actorq_get_num_threads() { return g_num_threads.load(); }

}  // extern "C"
