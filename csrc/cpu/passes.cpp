// The batch passes in vector instructions (passes.hpp). The bodies are
// written once, on GCC/Clang vector types, and compiled twice: into an
// AVX-512 and an AVX2 function (target attributes), so the module itself
// still runs on any x86-64 and elsewhere falls back to the plain loops.
#include "passes.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace richness {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RICHNESS_VECTOR_PASSES 1
#endif

#ifdef RICHNESS_VECTOR_PASSES
namespace {

// Helpers and bodies carry the instruction sets both kernels have, so they
// inline into either (the code is then generated for the caller's set).
#define RICHNESS_INLINE __attribute__((always_inline, target("avx2,fma,f16c"))) inline

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

constexpr int kBlock = 8;  // rows a column's accumulator takes in registers before it is stored

// Unaligned loads and stores (memcpy of a vector compiles to one instruction).
RICHNESS_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RICHNESS_INLINE v8f load8(const uint16_t* p) {  // float16 bits, widened exactly (F16C)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
RICHNESS_INLINE v8d loadd(const double* p) {
  v8d v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RICHNESS_INLINE void store(double* p, v8d v) { std::memcpy(p, &v, sizeof v); }
RICHNESS_INLINE void store(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
RICHNESS_INLINE v8d widen(v8f v) { return __builtin_convertvector(v, v8d); }
RICHNESS_INLINE v8f narrow(v8d v) { return __builtin_convertvector(v, v8f); }

RICHNESS_INLINE float scalar(const float* p) { return *p; }
RICHNESS_INLINE float scalar(const uint16_t* p) { return _cvtsh_ss(*p); }

// Min and max as std::min(a, v) / std::max(a, v) with a the running value: a
// NaN v leaves it (a NaN also makes the column's sum NaN, which the caller
// refuses).
RICHNESS_INLINE v8f vmin(v8f a, v8f v) { return v < a ? v : a; }
RICHNESS_INLINE v8f vmax(v8f a, v8f v) { return v > a ? v : a; }
RICHNESS_INLINE v8d vmin(v8d a, v8d v) { return v < a ? v : a; }
RICHNESS_INLINE v8d vmax(v8d a, v8d v) { return v > a ? v : a; }

// R rows from x (stride ld) into s, lo, hi (Stats) or s alone.
template <bool Stats, int R, typename In>
RICHNESS_INLINE void stats_block(const In* x, int64_t ld, int64_t cols, double* s, double* lo, double* hi) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    v8d acc = loadd(s + j);
    v8f mn = load8(x + j), mx = mn;
    acc += widen(mn);
    for (int r = 1; r < R; ++r) {
      const v8f v = load8(x + r * ld + j);
      if (Stats) {
        mn = vmin(mn, v);
        mx = vmax(mx, v);
      }
      acc += widen(v);
    }
    store(s + j, acc);
    if (Stats) {
      store(lo + j, vmin(loadd(lo + j), widen(mn)));
      store(hi + j, vmax(loadd(hi + j), widen(mx)));
    }
  }
  for (; j < cols; ++j)
    for (int r = 0; r < R; ++r) {
      const double v = scalar(x + r * ld + j);
      s[j] += v;
      if (Stats) {
        lo[j] = std::min(lo[j], v);
        hi[j] = std::max(hi[j], v);
      }
    }
}

// R rows: sums, minima, maxima, and the rows centered on c with their
// float64 squares.
template <int R, typename In>
RICHNESS_INLINE void shifted_block(const In* x, int64_t ld, int64_t cols, double* s, double* lo, double* hi,
                                   double* sq, const double* c, float* out, int64_t out_ld) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    v8d acc = loadd(s + j), acc2 = loadd(sq + j);
    const v8d cj = loadd(c + j);
    v8f mn = load8(x + j), mx = mn;
    for (int r = 0; r < R; ++r) {
      const v8f v = r == 0 ? mn : load8(x + r * ld + j);
      mn = vmin(mn, v);
      mx = vmax(mx, v);
      const v8d wv = widen(v), d = wv - cj;
      acc += wv;
      store(out + r * out_ld + j, narrow(d));
      acc2 += d * d;
    }
    store(s + j, acc);
    store(sq + j, acc2);
    store(lo + j, vmin(loadd(lo + j), widen(mn)));
    store(hi + j, vmax(loadd(hi + j), widen(mx)));
  }
  for (; j < cols; ++j)
    for (int r = 0; r < R; ++r) {
      const double v = scalar(x + r * ld + j), d = v - c[j];
      s[j] += v;
      lo[j] = std::min(lo[j], v);
      hi[j] = std::max(hi[j], v);
      out[r * out_ld + j] = (float)d;
      sq[j] += d * d;
    }
}

template <typename In>
RICHNESS_INLINE void shifted_body(const In* base, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s,
                                  double* lo, double* hi, double* sq, const double* c, float* out, int64_t out_ld) {
  int64_t i = r0;
  for (; i + kBlock <= r1; i += kBlock)
    shifted_block<kBlock>(base + i * ld, ld, cols, s, lo, hi, sq, c, out + i * out_ld, out_ld);
  for (; i < r1; ++i) shifted_block<1>(base + i * ld, ld, cols, s, lo, hi, sq, c, out + i * out_ld, out_ld);
}

template <bool Stats, typename In>
RICHNESS_INLINE void stats_body(const In* base, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s,
                                double* lo, double* hi) {
  int64_t i = r0;
  for (; i + kBlock <= r1; i += kBlock) stats_block<Stats, kBlock>(base + i * ld, ld, cols, s, lo, hi);
  for (; i < r1; ++i) stats_block<Stats, 1>(base + i * ld, ld, cols, s, lo, hi);
}

template <typename In>
RICHNESS_INLINE void center_body(const In* base, int64_t ld, int64_t cols, int64_t r0, int64_t r1, const double* mu,
                                 float* out, int64_t out_ld) {
  for (int64_t i = r0; i < r1; ++i) {
    const In* x = base + i * ld;
    float* o = out + i * out_ld;
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) store(o + j, narrow(widen(load8(x + j)) - loadd(mu + j)));
    for (; j < cols; ++j) o[j] = (float)((double)scalar(x + j) - mu[j]);
  }
}

// Rows given by pointers, R at a time; Fresh: the sums start from 0.0 (the
// bits of zeroing them first: 0.0 + v, not v, which differs for -0.0).
template <int R, bool Fresh, typename In>
RICHNESS_INLINE void add_block(const In* const* rows, int64_t cols, double* s) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    v8d acc = Fresh ? v8d{} : loadd(s + j);
    for (int r = 0; r < R; ++r) acc += widen(load8(rows[r] + j));
    store(s + j, acc);
  }
  for (; j < cols; ++j) {
    double acc = Fresh ? 0.0 : s[j];
    for (int r = 0; r < R; ++r) acc += scalar(rows[r] + j);
    s[j] = acc;
  }
}

template <typename In>
RICHNESS_INLINE void add_body(const void* const* rows, int64_t count, int64_t cols, double* s, bool fresh) {
  const In* const* r = reinterpret_cast<const In* const*>(rows);
  int64_t k = 0;
  if (count == 0) {
    if (fresh) std::fill(s, s + cols, 0.0);
    return;
  }
  if (fresh) {  // the first block starts the sums
    const int64_t first = std::min<int64_t>(count, kBlock);
    if (first == kBlock) add_block<kBlock, true>(r, cols, s);
    else add_block<1, true>(r, cols, s);
    k = first == kBlock ? kBlock : 1;
  }
  for (; k + kBlock <= count; k += kBlock) add_block<kBlock, false>(r + k, cols, s);
  for (; k < count; ++k) add_block<1, false>(r + k, cols, s);
}

// One set of entry points per instruction set.
struct Kernels {
  void (*stats_f32)(const float*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*);
  void (*stats_f16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*);
  void (*sums_f32)(const float*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*);
  void (*sums_f16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*);
  void (*center_f32)(const float*, int64_t, int64_t, int64_t, int64_t, const double*, float*, int64_t);
  void (*center_f16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, const double*, float*, int64_t);
  void (*shifted_f32)(const float*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*, double*,
                      const double*, float*, int64_t);
  void (*shifted_f16)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, double*, double*, double*, double*,
                      const double*, float*, int64_t);
  void (*add_f32)(const void* const*, int64_t, int64_t, double*, bool);
  void (*add_f16)(const void* const*, int64_t, int64_t, double*, bool);
};

#define RICHNESS_KERNELS(NAME, TARGET)                                                                              \
  TARGET void NAME##_stats_f32(const float* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s, double* lo,  \
                               double* hi) {                                                                        \
    stats_body<true>(b, ld, c, r0, r1, s, lo, hi);                                                                  \
  }                                                                                                                 \
  TARGET void NAME##_stats_f16(const uint16_t* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s,          \
                               double* lo, double* hi) {                                                            \
    stats_body<true>(b, ld, c, r0, r1, s, lo, hi);                                                                  \
  }                                                                                                                 \
  TARGET void NAME##_sums_f32(const float* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s, double* lo,   \
                              double* hi) {                                                                         \
    stats_body<false>(b, ld, c, r0, r1, s, lo, hi);                                                                 \
  }                                                                                                                 \
  TARGET void NAME##_sums_f16(const uint16_t* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s,           \
                              double* lo, double* hi) {                                                             \
    stats_body<false>(b, ld, c, r0, r1, s, lo, hi);                                                                 \
  }                                                                                                                 \
  TARGET void NAME##_center_f32(const float* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, const double* mu,      \
                                float* out, int64_t out_ld) {                                                       \
    center_body(b, ld, c, r0, r1, mu, out, out_ld);                                                                 \
  }                                                                                                                 \
  TARGET void NAME##_center_f16(const uint16_t* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, const double* mu,   \
                                float* out, int64_t out_ld) {                                                       \
    center_body(b, ld, c, r0, r1, mu, out, out_ld);                                                                 \
  }                                                                                                                 \
  TARGET void NAME##_shifted_f32(const float* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s,           \
                                 double* lo, double* hi, double* sq, const double* sh, float* out, int64_t out_ld) { \
    shifted_body(b, ld, c, r0, r1, s, lo, hi, sq, sh, out, out_ld);                                                 \
  }                                                                                                                 \
  TARGET void NAME##_shifted_f16(const uint16_t* b, int64_t ld, int64_t c, int64_t r0, int64_t r1, double* s,        \
                                 double* lo, double* hi, double* sq, const double* sh, float* out, int64_t out_ld) { \
    shifted_body(b, ld, c, r0, r1, s, lo, hi, sq, sh, out, out_ld);                                                 \
  }                                                                                                                 \
  TARGET void NAME##_add_f32(const void* const* rows, int64_t count, int64_t c, double* s, bool fresh) {             \
    add_body<float>(rows, count, c, s, fresh);                                                                      \
  }                                                                                                                 \
  TARGET void NAME##_add_f16(const void* const* rows, int64_t count, int64_t c, double* s, bool fresh) {             \
    add_body<uint16_t>(rows, count, c, s, fresh);                                                                   \
  }                                                                                                                 \
  const Kernels NAME##_kernels = {NAME##_stats_f32, NAME##_stats_f16, NAME##_sums_f32,   NAME##_sums_f16,            \
                                  NAME##_center_f32, NAME##_center_f16, NAME##_shifted_f32, NAME##_shifted_f16,    \
                                  NAME##_add_f32,    NAME##_add_f16};

RICHNESS_KERNELS(avx512, __attribute__((target("avx512f,avx512vl,avx2,fma,f16c"))))
RICHNESS_KERNELS(avx2, __attribute__((target("avx2,fma,f16c"))))

const Kernels* const kLevels[3] = {nullptr, &avx2_kernels, &avx512_kernels};

int detect() {
  __builtin_cpu_init();  // this runs among the static initialisers
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) return 2;
  return avx2 ? 1 : 0;
}
const int kAvailable = detect();
std::atomic<int> g_level{kAvailable};

const Kernels* kernels() { return kLevels[g_level.load(std::memory_order_relaxed)]; }

}  // namespace

int simd_available() { return kAvailable; }
int simd_level() { return g_level.load(); }
int set_simd_level(int level) {
  g_level.store(std::max(0, std::min(level, kAvailable)));
  return g_level.load();
}

bool fast_column_stats(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s,
                       double* lo, double* hi) {
  const Kernels* k = kernels();
  if (!k) return false;
  if (f16) k->stats_f16(static_cast<const uint16_t*>(base), ld, cols, r0, r1, s, lo, hi);
  else k->stats_f32(static_cast<const float*>(base), ld, cols, r0, r1, s, lo, hi);
  return true;
}

bool fast_column_stats_shifted(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1,
                               double* s, double* lo, double* hi, double* sq, const double* shift, float* out,
                               int64_t out_ld) {
  const Kernels* k = kernels();
  if (!k) return false;
  if (f16) k->shifted_f16(static_cast<const uint16_t*>(base), ld, cols, r0, r1, s, lo, hi, sq, shift, out, out_ld);
  else k->shifted_f32(static_cast<const float*>(base), ld, cols, r0, r1, s, lo, hi, sq, shift, out, out_ld);
  return true;
}

bool fast_column_sums(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s) {
  const Kernels* k = kernels();
  if (!k) return false;
  if (f16) k->sums_f16(static_cast<const uint16_t*>(base), ld, cols, r0, r1, s, nullptr, nullptr);
  else k->sums_f32(static_cast<const float*>(base), ld, cols, r0, r1, s, nullptr, nullptr);
  return true;
}

bool fast_center_rows(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, const double* mu,
                      float* out, int64_t out_ld) {
  const Kernels* k = kernels();
  if (!k) return false;
  if (f16) k->center_f16(static_cast<const uint16_t*>(base), ld, cols, r0, r1, mu, out, out_ld);
  else k->center_f32(static_cast<const float*>(base), ld, cols, r0, r1, mu, out, out_ld);
  return true;
}

bool fast_add_rows(const void* const* rows, bool f16, int64_t count, int64_t cols, double* s, bool fresh) {
  const Kernels* k = kernels();
  if (!k) return false;
  (f16 ? k->add_f16 : k->add_f32)(rows, count, cols, s, fresh);
  return true;
}

#else  // no vector passes on this compiler or processor family: the plain loops

int simd_available() { return 0; }
int simd_level() { return 0; }
int set_simd_level(int) { return 0; }
bool fast_column_stats(const void*, bool, int64_t, int64_t, int64_t, int64_t, double*, double*, double*) {
  return false;
}
bool fast_column_stats_shifted(const void*, bool, int64_t, int64_t, int64_t, int64_t, double*, double*, double*,
                               double*, const double*, float*, int64_t) {
  return false;
}
bool fast_column_sums(const void*, bool, int64_t, int64_t, int64_t, int64_t, double*) { return false; }
bool fast_center_rows(const void*, bool, int64_t, int64_t, int64_t, int64_t, const double*, float*, int64_t) {
  return false;
}
bool fast_add_rows(const void* const*, bool, int64_t, int64_t, double*, bool) { return false; }

#endif

}  // namespace richness
