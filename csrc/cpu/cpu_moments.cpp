// Where a batch enters (CpuMoments::update), is validated (validate_batch),
// multiplied (update_typed) and merged into the float64 state (merge_block).
#include "cpu_moments.hpp"
#include "../common/merge.hpp"
#include "../common/msg.hpp"
#include "../common/parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <type_traits>
#include <atomic>
#include <chrono>
#include <limits>
#include <optional>
#include <set>
#include <thread>

#include <pthread.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "passes.hpp"
#include "products.hpp"

namespace richness {

namespace {

// ---- element access -------------------------------------------------------

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n float16 values widened to float32 (exactly), with the F16C instructions
// where the processor has them: 8 values an instruction instead of a
// branchy decode of each.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx,f16c"))) void widen_halves_f16c(const uint16_t* h, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < n; ++j) out[j] = half_to_float(h[j]);
}
const bool kHasF16c = [] {
  __builtin_cpu_init();  // this runs among the static initialisers
  return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
}();
#endif

void widen_halves(const uint16_t* h, int64_t n, float* out) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (kHasF16c) return widen_halves_f16c(h, n, out);
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = half_to_float(h[j]);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Calls fn(i, get) for the rows i = row(k), r0 <= k < r1, where get(j) reads
// element (i, j) as double.
template <typename Row, typename Fn>
void for_each_row(const Matrix& m, int64_t r0, int64_t r1, Row&& row, Fn&& fn) {
  switch (m.dtype) {
    case DType::f32: {
      const float* base = static_cast<const float*>(m.ptr);
      for (int64_t k = r0; k < r1; ++k) {
        const int64_t i = row(k);
        const float* r = base + i * m.ld;
        fn(i, [r](int64_t j) { return (double)r[j]; });
      }
      break;
    }
    case DType::f64: {
      const double* base = static_cast<const double*>(m.ptr);
      for (int64_t k = r0; k < r1; ++k) {
        const int64_t i = row(k);
        const double* r = base + i * m.ld;
        fn(i, [r](int64_t j) { return r[j]; });
      }
      break;
    }
    case DType::f16: {  // each row widened once, into a row that stays in L1, as it is read
      const uint16_t* base = static_cast<const uint16_t*>(m.ptr);
      std::vector<float> buffer((size_t)m.cols);
      float* w = buffer.data();
      for (int64_t k = r0; k < r1; ++k) {
        const int64_t i = row(k);
        widen_halves(base + i * m.ld, m.cols, w);
        fn(i, [w](int64_t j) { return (double)w[j]; });
      }
      break;
    }
    case DType::bf16: {
      const uint16_t* base = static_cast<const uint16_t*>(m.ptr);
      for (int64_t k = r0; k < r1; ++k) {
        const int64_t i = row(k);
        const uint16_t* r = base + i * m.ld;
        fn(i, [r](int64_t j) { return (double)bf16_to_float(r[j]); });
      }
      break;
    }
    default:
      throw type_error("internal: not a float matrix");
  }
}

// Rows r0 <= i < r1 in their order.
template <typename Fn>
void for_each_row(const Matrix& m, int64_t r0, int64_t r1, Fn&& fn) {
  for_each_row(m, r0, r1, [](int64_t k) { return k; }, fn);
}

template <typename Fn>
void for_each_row(const Matrix& m, Fn&& fn) {
  for_each_row(m, 0, m.rows, fn);
}

// The memory-bound passes (means, centering, class sums) split over the
// threads once a batch is big enough to pay for a thread start: one worker
// per 2^16 values, up to the thread count.
inline int64_t pass_workers(int64_t rows, int64_t cols) {
  return std::min<int64_t>(blas_get_num_threads(), rows * cols / (1 << 16) + 1);
}

template <typename Fn>
void parallel_rows(int64_t rows, int64_t cols, Fn&& fn) {
  run_workers(pass_workers(rows, cols), rows, fn);
}

inline int64_t label_at(const Matrix& y, int64_t i) {
  if (y.dtype == DType::i32) return static_cast<const int32_t*>(y.ptr)[i * y.ld];
  return static_cast<const int64_t*>(y.ptr)[i * y.ld];
}

// Whether the vector passes (passes.hpp) read m: float32 and float16 rows.
inline bool vector_rows(const Matrix& m) { return m.dtype == DType::f32 || m.dtype == DType::f16; }

// Adds rows r0..r1 of m into float64 column sums s (docs/MATH.md, "Streaming
// estimator": the batch mean is never formed in a narrower type).
void add_column_sums(const Matrix& m, int64_t r0, int64_t r1, double* s) {
  if (vector_rows(m) && fast_column_sums(m.ptr, m.dtype == DType::f16, m.ld, m.cols, r0, r1, s)) return;
  for_each_row(m, r0, r1, [&](int64_t, auto get) {
    for (int64_t j = 0; j < m.cols; ++j) s[j] += get(j);
  });
}

// Column sums with each column's exact minimum and maximum (as float64).
void add_column_stats(const Matrix& m, int64_t r0, int64_t r1, double* s, double* lo, double* hi) {
  if (vector_rows(m) && fast_column_stats(m.ptr, m.dtype == DType::f16, m.ld, m.cols, r0, r1, s, lo, hi)) return;
  for_each_row(m, r0, r1, [&](int64_t, auto get) {
    for (int64_t j = 0; j < m.cols; ++j) {
      const double v = get(j);
      s[j] += v;
      lo[j] = std::min(lo[j], v);
      hi[j] = std::max(hi[j], v);
    }
  });
}

// Float64 column means, each kept within its column's [min, max]: the mean is
// sum * (1 / n), whose rounding would otherwise center a constant column on a
// value it never takes and leave a false covariance (docs/MATH.md, constant
// features). range and magnitude: the largest max - min and |value|.
//
// With a ShiftedCopy the same read also writes the rows centered on the
// given shift, (float)(x - shift) computed in float64, and sums (x - shift)^2
// in float64 (update_typed: centering on the state's means).
struct ShiftedCopy {
  const double* shift;
  float* out;
  int64_t ld;
  std::vector<double>* squares;  // the column sums of (x - shift)^2
};

// Rows r0..r1 into sums, minima, maxima, squares of x - c and the centered copy.
void add_column_stats_shifted(const Matrix& m, int64_t r0, int64_t r1, double* s, double* lo, double* hi, double* sq,
                              const ShiftedCopy& copy) {
  if (vector_rows(m) && fast_column_stats_shifted(m.ptr, m.dtype == DType::f16, m.ld, m.cols, r0, r1, s, lo, hi, sq,
                                                  copy.shift, copy.out, copy.ld))
    return;
  for_each_row(m, r0, r1, [&](int64_t i, auto get) {
    float* o = copy.out + i * copy.ld;
    for (int64_t j = 0; j < m.cols; ++j) {
      const double v = get(j);
      s[j] += v;
      lo[j] = std::min(lo[j], v);
      hi[j] = std::max(hi[j], v);
      const double d = v - copy.shift[j];
      o[j] = (float)d;
      sq[j] += d * d;
    }
  });
}

void column_means(const Matrix& m, std::vector<double>& out, double& range, double& magnitude,
                  const ShiftedCopy* copy = nullptr) {
  const int64_t w = m.cols;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> sum(std::max(1, blas_get_num_threads())), lo(sum.size()), hi(sum.size()),
      sq(copy ? sum.size() : 0);
  parallel_rows(m.rows, w, [&](int64_t t, int64_t r0, int64_t r1) {
    sum[t].assign(w, 0.0);
    lo[t].assign(w, inf);
    hi[t].assign(w, -inf);
    if (!copy) return add_column_stats(m, r0, r1, sum[t].data(), lo[t].data(), hi[t].data());
    sq[t].assign(w, 0.0);
    add_column_stats_shifted(m, r0, r1, sum[t].data(), lo[t].data(), hi[t].data(), sq[t].data(), *copy);
  });
  out.assign(w, 0.0);
  std::vector<double> mn(w, inf), mx(w, -inf);
  if (copy) copy->squares->assign(w, 0.0);
  for (size_t t = 0; t < sum.size(); ++t)
    for (int64_t j = 0; j < (int64_t)sum[t].size(); ++j) {
      out[j] += sum[t][j];
      mn[j] = std::min(mn[j], lo[t][j]);
      mx[j] = std::max(mx[j], hi[t][j]);
      if (copy) (*copy->squares)[j] += sq[t][j];
    }
  const double inv = 1.0 / (double)m.rows;
  range = magnitude = 0.0;
  for (int64_t j = 0; j < w; ++j) {
    out[j] *= inv;
    if (std::isfinite(out[j])) out[j] = std::min(std::max(out[j], mn[j]), mx[j]);
    range = std::max(range, mx[j] - mn[j]);
    magnitude = std::max({magnitude, std::fabs(mn[j]), std::fabs(mx[j])});
  }
}

int64_t count_nonfinite(const Matrix& m) {
  int64_t bad = 0;
  for_each_row(m, [&](int64_t, auto get) {
    for (int64_t j = 0; j < m.cols; ++j) bad += !std::isfinite(get(j));
  });
  return bad;
}

// Float64 column means, which double as the finiteness check: a finite sum
// of finite values is finite, so only a non-finite sum needs the count.
void means_checked(const Matrix& m, const char* name, std::vector<double>& mu, double& range, double& magnitude,
                   const ShiftedCopy* copy = nullptr) {
  column_means(m, mu, range, magnitude, copy);
  bool finite = true;
  for (double v : mu) finite = finite && std::isfinite(v);
  if (finite) return;
  const int64_t bad = count_nonfinite(m);
  Msg os;
  if (bad > 0)
    os << name << " contain " << bad << " non-finite value" << (bad == 1 ? "" : "s")
       << " (NaN or Inf); the batch was not added";
  else
    os << name << " overflow float64 when summed; rescale them; the batch was not added";
  throw input_error(os.str(), name, -1, bad > 0 ? "finite" : "overflow");
}

// ---- products -------------------------------------------------------------

// Centered copy in the product type: the subtraction happens in float64,
// before the narrowing (docs/MATH.md, "Streaming estimator": mean 1e4, spread 1e-2 survives in float32).
// Row i goes to out + i * ld.
template <typename T>
void center_rows(const Matrix& m, const std::vector<double>& mu, T* out, int64_t ld, int64_t r0, int64_t r1) {
  const double* u = mu.data();
  const int64_t w = m.cols;
  if constexpr (std::is_same<T, float>::value) {
    if (vector_rows(m) && fast_center_rows(m.ptr, m.dtype == DType::f16, m.ld, w, r0, r1, u, out, ld)) return;
  }
  for_each_row(m, r0, r1, [&](int64_t i, auto get) {
    T* r = out + i * ld;
    for (int64_t j = 0; j < w; ++j) r[j] = (T)(get(j) - u[j]);
  });
}


// OpenBLAS maps a 32 MiB buffer (BUFFER_SIZE on x86-64) for each thread the
// first time it calls BLAS (freed when the thread ends), and ends the process
// when the map fails (under a ulimit -v): no exception comes back from it. So
// before BLAS runs, the address space for the buffers (one per worker thread,
// started anew for each batch, and one for the calling thread if it has not
// called BLAS before) and for the scratch still to be allocated is mapped and
// unmapped: fewer workers are used when it is short, and a MemoryError is
// raised when even the calling thread alone cannot run.
constexpr double kBlasBuffer = double(32 << 20) + double(1 << 16);
thread_local bool t_has_blas_buffer = false;

bool address_space_limited() {
  struct rlimit rl;
  return getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
}

// Whether `bytes` of address space can still be mapped (under a ulimit -v).
bool address_space_for(double bytes) {
  if (!(bytes > 0.0)) return true;
  if (bytes >= (double)std::numeric_limits<size_t>::max() / 2) return false;
  void* p = mmap(nullptr, (size_t)bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  munmap(p, (size_t)bytes);
  return true;
}

// The number of BLAS-calling workers (at most `wanted`) the address space
// allows, given the scratch bytes each count of workers still needs.
template <typename ScratchOf>
int64_t blas_workers(int64_t wanted, ScratchOf&& scratch_of) {
  const int64_t own = t_has_blas_buffer ? 0 : 1;
  if (!address_space_limited()) {  // without a ulimit -v a map this size does not fail
    t_has_blas_buffer = true;
    return std::max<int64_t>(wanted, 1);
  }
  for (int64_t w = std::max<int64_t>(wanted, 1); w >= 1; --w) {
    if (!address_space_for((double)(w - 1 + own) * kBlasBuffer + scratch_of(w))) continue;
    t_has_blas_buffer = true;
    return w;
  }
  Msg os;
  os << "not enough address space left in this process for the products (" << Sci{scratch_of(1)}
     << " bytes of scratch" << (own ? " and a 32 MiB BLAS buffer" : "")
     << "); raise the memory limit (ulimit -v) or reduce the batch; the batch was not added";
  throw memory_error(os.str());
}

}  // namespace

// ---- memory -----------------------------------------------------------------

namespace {
// A "Field:  N kB" line of a /proc file, in bytes (negative where unreadable).
double proc_kib(const char* path, const char* field) {
  FILE* f = std::fopen(path, "r");
  if (!f) return -1.0;
  char line[256];
  const size_t len = std::strlen(field);
  double out = -1.0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, field, len) == 0 && line[len] == ':') {
      char* end = nullptr;
      const double kib = std::strtod(line + len + 1, &end);
      if (end != line + len + 1) out = kib * 1024.0;
      break;
    }
  }
  std::fclose(f);
  return out;
}

// MemAvailable, read at most every 50 ms (reading /proc/meminfo takes about
// 10 us, which a small batch's update would notice; the system's figure moves
// with other processes anyway).
double system_available() {
  static std::atomic<int64_t> read_at{-1};  // -1: never read
  static std::atomic<double> value{0.0};
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const int64_t at = read_at.load(std::memory_order_acquire);
  if (at >= 0 && now - at < 50) return value.load(std::memory_order_relaxed);
  double avail = proc_kib("/proc/meminfo", "MemAvailable");
  if (avail < 0.0) avail = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE);
  value.store(avail, std::memory_order_relaxed);
  read_at.store(now, std::memory_order_release);
  return avail;
}
// The process's address space in bytes (the first field of /proc/self/statm, in pages), read on
// every call: it moves with each allocation. statm is one line the kernel forms cheaply, where
// /proc/self/status's VmSize (the same number) costs about 15 us a read, which doubled the update of
// a small batch under a ulimit -v. -1 when it cannot be read.
double address_space_used() {
  const int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1.0;
  char buf[64];
  const ssize_t got = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (got <= 0) return -1.0;
  buf[got] = '\0';
  char* end = nullptr;
  const double pages = std::strtod(buf, &end);
  return end == buf ? -1.0 : pages * (double)sysconf(_SC_PAGE_SIZE);
}
}  // namespace

double available_memory() {
  double avail = system_available();
  struct rlimit rl;
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const double used = address_space_used();
    avail = std::min(avail, (double)rl.rlim_cur - std::max(used, 0.0));
  }
  return std::max(avail, 0.0);
}

// ---- labels -----------------------------------------------------------------

// A batch's labels, read from the caller's memory once: the range check, the
// class arrays' size and the class counts and sums all use this copy, so a
// label changed by another thread during the update cannot pass the check and
// then index past the class arrays.
std::vector<int64_t> read_labels(const Matrix& y) {
  std::vector<int64_t> out((size_t)y.rows);
  for (int64_t i = 0; i < y.rows; ++i) out[(size_t)i] = label_at(y, i);
  return out;
}

// Labels in 0..num_classes-1 (or >= 0 and within the class growth cap,
// common/state.hpp, without num_classes).
void check_labels(const std::vector<int64_t>& y, int64_t num_classes, int64_t p) {
  const int64_t growth_cap = class_growth_cap(p);
  for (size_t i = 0; i < y.size(); ++i) {
    const int64_t v = y[i];
    if (v < 0 || (num_classes >= 0 && v >= num_classes)) {
      Msg os;
      os << "labels out of range: label " << v << " at row " << i;
      if (num_classes >= 0) os << " (num_classes=" << num_classes << ")";
      else os << " (labels must be >= 0)";
      throw input_error(os.str(), "labels", (int64_t)i, num_classes >= 0 ? "num_classes" : "non-negative");
    }
    if (num_classes < 0 && v >= growth_cap) {
      Msg os;
      os << "label " << v << " at row " << i << " would grow the class sums past 1 GiB (" << growth_cap
         << " classes at p=" << p << "); pass num_classes to Moments if this many classes is intended";
      throw input_error(os.str(), "labels", (int64_t)i, "class growth");
    }
  }
}

// A batch's float64 class sums for the classes it holds (classes[i] owns
// sums[i * p ..]), formed before the state changes and checked there: the
// features are read again for them, after the checks of the first read, so
// a value another thread turned into NaN (or a class sum past float64) is
// refused here rather than merged. Rows are added in their order.
//
// The sums live in scratch kept across batches (at 1,000 classes and p =
// 2,048 they are 16 MB, which a fresh allocation would fault in page by page
// each batch). Rows are read class by class (in the stable sort's order, so
// each class's rows still in theirs), so a class's sums stay in cache while
// its rows are added and checked against the state's, and the workers take
// column ranges: each reads every row's part in its range, so each sum adds
// its rows in their order whatever the number of workers. Each sum starts
// from 0.0 in a register, so the scratch is neither cleared nor read first.
struct BatchClasses {
  std::vector<int64_t> classes;
  std::vector<double>& sums;
  int64_t p = 0;  // the batch's width (the state's is -1 before its first batch)
  int64_t parts = 1, step = 0;  // the workers' column ranges: [w * step, (w + 1) * step)

  // Throws unless every class sum, alone and added to the state's, is finite.
  BatchClasses(const Matrix& x, const std::vector<int64_t>& y, const State& state, std::vector<double>& scratch)
      : sums(scratch) {
    std::vector<int64_t> order(y.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = (int64_t)i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return y[a] < y[b]; });
    std::vector<int64_t> first{0};  // class g's rows are order[first[g] .. first[g + 1])
    for (size_t k = 0; k < order.size(); ++k) {
      if (classes.empty() || classes.back() != y[order[k]]) {
        if (!classes.empty()) first.push_back((int64_t)k);
        classes.push_back(y[order[k]]);
      }
    }
    first.push_back((int64_t)order.size());
    p = x.cols;
    sums.resize(classes.size() * (size_t)p);
    parts = pass_workers(x.rows, p);
    step = ((p + parts - 1) / parts + 15) / 16 * 16;  // whole cache lines of float rows
    const size_t es = dtype_size(x.dtype);
    run_split(parts, [&](int64_t w) { return std::min(p, w * step); }, [&](int64_t, int64_t j0, int64_t j1) {
      if (j1 <= j0) return;
      std::vector<const void*> rows(vector_rows(x) ? order.size() : 0);
      for (size_t k = 0; k < rows.size(); ++k)
        rows[k] = static_cast<const char*>(x.ptr) + ((size_t)order[k] * (size_t)x.ld + (size_t)j0) * es;
      Matrix part = x;
      part.ptr = static_cast<const char*>(x.ptr) + (size_t)j0 * es;
      part.cols = j1 - j0;
      for (size_t g = 0; g < classes.size(); ++g) {
        double* sg = sums.data() + g * p + j0;
        const int64_t k0 = first[g], k1 = first[g + 1];
        if (rows.empty() || !fast_add_rows(rows.data() + k0, x.dtype == DType::f16, k1 - k0, j1 - j0, sg, true)) {
          std::fill(sg, sg + (j1 - j0), 0.0);
          for_each_row(part, k0, k1, [&](int64_t k) { return order[k]; }, [&](int64_t, auto get) {
            for (int64_t j = 0; j < j1 - j0; ++j) sg[j] += get(j);
          });
        }
        check(state, g, j0, j1);
      }
    });
  }

  void check(const State& s, size_t g, int64_t j0, int64_t j1) const {
    const bool old = s.n > 0 && classes[g] < s.k;
    const double* state_row = old ? s.class_sums.data() + classes[g] * p : nullptr;
    for (int64_t j = j0; j < j1; ++j) {
      const double v = sums[g * p + j] + (state_row ? state_row[j] : 0.0);
      if (std::isfinite(v)) continue;
      Msg os;
      os << "features: the sums of class " << classes[g] << " are not finite (a value changed to NaN or Inf "
         << "while the batch was read, or the sums overflow float64); the batch was not added";
      throw input_error(os.str(), "features", -1, "finite");
    }
  }

  void add_to(State& s, const std::vector<int64_t>& y) const noexcept {
    for (int64_t v : y) ++s.class_counts[v];
    run_split(parts, [&](int64_t w) { return std::min(p, w * step); }, [&](int64_t, int64_t j0, int64_t j1) noexcept {
      for (size_t g = 0; g < classes.size(); ++g) {
        double* sk = s.class_sums.data() + classes[g] * p;
        for (int64_t j = j0; j < j1; ++j) sk[j] += sums[g * p + j];
      }
    });
  }
};

// ---- fork -------------------------------------------------------------------

namespace {
// Every live CpuMoments's mutex. Around a fork the registry and all of them are
// held (prepare waits for the updates, merges and reads in progress), then
// released in both the parent and the child: a mutex copied locked into the
// child, whose owner thread does not exist there, would block it for ever.
struct ForkRegistry {
  std::mutex mu;
  std::set<std::mutex*> live;
};
ForkRegistry& fork_registry() {
  static ForkRegistry* r = new ForkRegistry;  // never destroyed: a fork may come during exit
  return *r;
}
void fork_prepare() {
  ForkRegistry& r = fork_registry();
  r.mu.lock();
  for (std::mutex* m : r.live) m->lock();  // a merge's std::scoped_lock backs off, so no lock-order deadlock
}
void fork_release() {
  ForkRegistry& r = fork_registry();
  for (std::mutex* m : r.live) m->unlock();
  r.mu.unlock();
}
void register_at_fork() {
  static const int once = pthread_atfork(fork_prepare, fork_release, fork_release);
  if (once != 0) throw std::runtime_error("pthread_atfork failed: the core cannot be made fork-safe");
}
}  // namespace

CpuMoments::CpuMoments(int64_t num_classes) {
  state_.num_classes = num_classes;
  register_at_fork();
  ForkRegistry& r = fork_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.insert(&mu_);  // may throw std::bad_alloc: the object is then not built
}

CpuMoments::~CpuMoments() {
  ForkRegistry& r = fork_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.erase(&mu_);
}

void CpuMoments::update(const Batch& b, Precision precision) {
  const ParkWorkers park;  // the pool's workers sleep once the update is done
  std::lock_guard<std::mutex> lock(mu_);
  update_locked(b, precision);
}

void CpuMoments::merge_same(Moments& from) {
  const CpuMoments& other = static_cast<const CpuMoments&>(from);
  const ParkWorkers park;
  if (&other == this) {  // merging with itself doubles it: read a copy first
    const State copy = snapshot();
    std::lock_guard<std::mutex> lock(mu_);
    state_.merge(copy, blas_get_num_threads());  // the merge rule first (Moments::check_compatible_for_merge)
    return;
  }
  std::scoped_lock lock(mu_, other.mu_);  // std::lock order: no deadlock between a.merge(b) and b.merge(a)
  state_.merge(other.state_, blas_get_num_threads());
}

void CpuMoments::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  state_.reset();
}

State CpuMoments::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

State CpuMoments::scalars() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.scalars();
}

Widths CpuMoments::widths() {
  std::lock_guard<std::mutex> lock(mu_);
  return Widths{state_.n, state_.p, state_.c, state_.t, state_.k, state_.num_classes};
}

void CpuMoments::replace_state(State s) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = std::move(s);
}

int64_t CpuMoments::n() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.n;
}

int64_t CpuMoments::p() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.p;
}

namespace {

// A spread whose squares fall below the product type's normal range would be
// lost (or kept at a few bits) in the products: refuse it rather than report
// a constant or a wrong value.
void check_spread(const Batch& b, const BatchMeans& means, Precision precision) {
  const bool fp64 = traits(precision).product == DType::f64;
  const double tiny = 64.0 * std::sqrt(fp64 ? std::numeric_limits<double>::min() : (double)std::numeric_limits<float>::min());
  const Matrix* inputs[3] = {&b.features, b.outputs, b.targets};
  for (int i = 0; i < 3; ++i) {
    if (!inputs[i] || !(means.range[i] > 0.0 && means.range[i] < tiny)) continue;
    Msg os;
    os << stream_name(i) << " vary by at most " << Sci{means.range[i]} << ", too little for "
       << precision_name(precision) << " products: their squares underflow "
       << (fp64 ? "float64" : "float32") << "; rescale them (DLR does not depend on the scale)"
       << (fp64 ? "" : " or use precision='fp64'") << "; the batch was not added";
    throw input_error(os.str(), stream_name(i), -1, "underflow");
  }
}

// Elements of all co-moments at widths p, c, t (0 where a stream is absent).
double comoment_elems(int64_t p, int64_t c, int64_t t) {
  const double w[kStreams] = {(double)p, (double)c, (double)t};
  double e = 0.0;
  for (const Comoment& cm : kComoments) e += w[cm.rows] * w[cm.cols];
  return e;
}

// Elements of a batch's products (form_products): the square of the
// features' buffer (with the outputs when stacked), then for each other
// stream of width c its p x c cross product and c x c square.
double product_elems(int64_t p, int64_t c, int64_t t, bool stack_outputs) {
  const double P = (double)p, C = (double)c, Tt = (double)t, W = stack_outputs ? P + C : P;
  return W * W + P * Tt + Tt * Tt + (stack_outputs ? 0.0 : P * C + C * C);
}

// Bytes of scratch a batch of nb rows takes: centered rows and the products
// (whatever the number of workers) in the product type (elem bytes, 4: the
// outputs stacked with the features), plus, with labels (k >= 0), the
// labels' copy and the batch's class sums.
double scratch_bytes(int64_t nb, int64_t p, int64_t c, int64_t t, int64_t k, double elem) {
  const double P = (double)p, C = (double)c, Tt = (double)t;
  return elem * ((double)nb * (P + C + Tt) + product_elems(p, c, t, elem == 4.0)) +
         (k >= 0 ? 8.0 * (double)nb * (P + 3) : 0.0);
}

// Refuses what cannot fit before allocating any of it (counted in double:
// the products of the widths may pass int64). elem: the product type's size;
// held: the bytes of scratch this object already holds from earlier batches,
// which the available memory no longer counts and which a batch reuses, so
// only the scratch beyond it is new.
void check_fits(const State& st, int64_t nb, int64_t p, int64_t c, int64_t t, int64_t k, double elem,
                double held) {
  const double P = (double)p, C = (double)c, Tt = (double)t, K = (double)std::max<int64_t>(k, 0);
  const double per_part = comoment_elems(p, c, t);
  const double scratch = std::max(scratch_bytes(nb, p, c, t, k, elem) - held, 0.0);
  const bool first = st.p < 0 || st.n == 0;
  const double square = 8.0 * P * P;
  const double state = first ? 8.0 * (P + C + Tt + per_part + K * (P + 1)) : 0.0;
  const double classes = !first && K > (double)st.k ? 8.0 * K * (P + 1) : 0.0;
  const double need = scratch + state + classes, limit = available_memory();
  if (need <= limit) return;
  Msg os;
  os << "this batch needs " << Sci{need} << " bytes";
  if (first) os << ": the state at p=" << p << " holds a p x p float64 matrix of " << Sci{square} << " bytes";
  if (K * P * 8.0 > square) os << " and class sums for " << (int64_t)K << " classes of " << Sci{K * P * 8.0} << " bytes";
  os << ", plus " << Sci{scratch} << " bytes of products; this process can have at most " << Sci{limit}
     << " bytes. Reduce the feature width (pool or project the features)"
     << (K * P * 8.0 > square ? " or num_classes" : "") << "; the batch was not added";
  throw memory_error(os.str());
}

// Centers the batch in the product type T (rows split over the workers),
// then forms each co-moment once, in scratch, from tiles the workers share
// (products.hpp); the state is not touched. Points a Block at the products.
//
// Float32 products: the outputs and the features are centered side by side
// into one buffer, outputs first, and one symmetric product of its c + p
// columns holds A (outputs x outputs), B (features x outputs) and M
// (features x features) as blocks of its lower triangle. The same arithmetic
// as three products, but the BLAS packs the features once instead of twice
// and the cross product runs in the triangle's large tiles rather than as a
// narrow GEMM of its own (benchmarks/RESULTS.md, "One product for features
// and outputs"). Float64 products keep one product per co-moment: M then
// comes from the same tiles with or without outputs, so head mode and
// streamed outputs agree to float64 rounding (tests/finish/test_curves.py). The
// targets always have a buffer and products of their own, so the outputs x
// targets block, which no co-moment needs, is never formed.
// Where each stream's centered columns lie in the scratch (sized here).
template <typename T>
struct Layout {
  bool stack_outputs;
  int64_t width[kStreams];
  T* column[kStreams];  // each stream's first column
  int64_t ld[kStreams];  // and its row stride
};

template <typename T>
Layout<T> centered_layout(const Batch& b, Scratch<T>& sc) {
  constexpr bool stack_outputs = std::is_same<T, float>::value;
  const int64_t nb = b.features.rows;
  const Matrix* in[kStreams] = {&b.features, b.outputs, b.targets};
  Layout<T> L;
  L.stack_outputs = stack_outputs;
  for (int q = 0; q < kStreams; ++q) L.width[q] = in[q] ? in[q]->cols : 0;
  const int64_t p = L.width[0];
  const int64_t lead = stack_outputs ? L.width[1] : 0, w = lead + p;  // the features' buffer: [outputs |] features
  sc.centered.resize((size_t)(nb * (L.width[0] + L.width[1] + L.width[2])));
  sc.products.resize((size_t)product_elems(p, L.width[1], L.width[2], stack_outputs));
  // The features' buffer, then one buffer for each other stream.
  T* next = sc.centered.data();
  L.column[0] = next + lead;
  L.ld[0] = w;
  if (stack_outputs) {
    L.column[1] = next;
    L.ld[1] = w;
  }
  next += nb * w;
  for (int q = stack_outputs ? 2 : 1; q < kStreams; ++q) {
    L.column[q] = next;
    L.ld[q] = L.width[q];
    next += nb * L.width[q];
  }
  return L;
}

// centered: the rows are already in the layout (centered on the state's
// means by the first read); else they are centered here on the batch's.
template <typename T>
Block<T> form_products(const Batch& b, const BatchMeans& means, int64_t workers, Scratch<T>& sc, const Layout<T>& L,
                       bool centered) {
  const bool stack_outputs = L.stack_outputs;
  const int64_t nb = b.features.rows;
  const Matrix* in[kStreams] = {&b.features, b.outputs, b.targets};
  Block<T> blk;
  blk.n = nb;
  blk.on_state_mean = centered;
  for (int q = 0; q < kStreams; ++q) {
    blk.width[q] = L.width[q];
    blk.mean[q] = means.mean[q].data();
  }
  const int64_t p = blk.width[0], w = L.ld[0];
  T* const* column = L.column;
  const int64_t* ld = L.ld;
  if (!centered)
    run_workers(workers, nb, [&](int64_t, int64_t r0, int64_t r1) {
      for (int q = 0; q < kStreams; ++q)
        if (in[q]) center_rows<T>(*in[q], means.mean[q], column[q], ld[q], r0, r1);
    });
  // The triangle of the features' buffer, then each other stream's cross
  // product with the features and its own triangle.
  T* out = sc.products.data();
  const T* buffer = sc.centered.data();
  std::vector<Product<T>> products{{buffer, buffer, w, w, w, w, true, out, w}};
  T* cross[kStreams] = {nullptr, nullptr, nullptr};
  T* square[kStreams] = {nullptr, nullptr, nullptr};
  out += w * w;
  for (int q = stack_outputs ? 2 : 1; q < kStreams; ++q) {
    const int64_t c = blk.width[q];
    if (c == 0) continue;
    cross[q] = out;
    square[q] = out + p * c;
    out += p * c + c * c;
    products.push_back({column[0], column[q], w, c, p, c, false, cross[q], c});
    products.push_back({column[q], column[q], c, c, c, c, true, square[q], c});
  }
  for (int i = 0; i < kNumComoments; ++i) {
    const int rq = kComoments[i].rows, cq = kComoments[i].cols;
    if (rq <= 1 && cq <= 1 && (stack_outputs || cq == 0)) {  // a block of the features' triangle
      blk.part[i] = sc.products.data() + (column[rq] - buffer) * w + (column[cq] - buffer);
      blk.ld[i] = w;
    } else {  // a product of its own (features x stream, or the stream's square)
      blk.part[i] = rq == cq ? square[cq] : cross[cq];
      blk.ld[i] = blk.width[cq];
    }
  }
  shared_products(products, nb, workers);
  return blk;
}

}  // namespace

void CpuMoments::update_locked(const Batch& b, Precision precision) {
  check_runs_on_cpu(precision);
  const State& s = state_;
  validate_batch({s.n, s.p, s.c, s.t, s.k, s.num_classes}, b);
  if (b.features.rows == 0) return;
  check_count_fits(s.n, b.features.rows, "the batch was not added");
  std::vector<int64_t> labels;
  if (b.labels) {
    labels = read_labels(*b.labels);
    check_labels(labels, state_.num_classes, b.features.cols);
  }
  // The product type from the table (a CPU mode multiplies in float64 or float32).
  if (traits(precision).product == DType::f64)
    return update_typed<double>(b, labels, precision, scratch_d_);
  return update_typed<float>(b, labels, precision, scratch_f_);
}

namespace {
// The smallest batch (bytes of its centered rows) centered on the state's
// means: a second read of a batch within a core's L2 cache costs little.
constexpr double kShiftedBytes = double(1 << 20);

// Whether rows centered on the state's means c keep the float32 products'
// precision: for every column, n (m - c)^2 <= n var, where the float64 sum of
// squares of x - c is n var + n (m - c)^2. The products then round values at
// most sqrt(2) times the column's spread, against the spread itself when the
// rows are centered on the batch's own means m; the merge takes the shift
// out exactly in float64 (common/merge.hpp). A column constant in the batch
// passes only when c is its value (its centered rows are then exactly zero).
bool shift_keeps_precision(int64_t nb, const std::vector<double>& mean, const std::vector<double>& c,
                           const std::vector<double>& squares) {
  for (size_t j = 0; j < mean.size(); ++j) {
    const double d = mean[j] - c[j];
    if (!(2.0 * (double)nb * d * d <= squares[j])) return false;
  }
  return true;
}
}  // namespace

template <typename T>
void CpuMoments::update_typed(const Batch& b, const std::vector<int64_t>& labels, Precision precision,
                              Scratch<T>& sc) {
  const Matrix& x = b.features;
  const int64_t nb = x.rows, p = x.cols;
  const int64_t c = b.outputs ? b.outputs->cols : 0, t = b.targets ? b.targets->cols : 0;
  // Our own workers, each running single-threaded BLAS over its rows: OpenBLAS's
  // thread pool busy-waits, and on shared cores (a training step beside us)
  // its 2-thread ssyrk was measured 4-16x slower than one thread. Parts of at
  // least 256 rows and 2^22 multiply-adds keep each BLAS call efficient.
  const int64_t wanted = std::max<int64_t>(
      1, std::min<int64_t>({(int64_t)blas_get_num_threads(), nb / 256, nb * p * p / (int64_t(1) << 22)}));
  int64_t k_needed = -1;
  if (b.labels) {
    k_needed = state_.num_classes;
    for (int64_t v : labels) k_needed = std::max(k_needed, v + 1);
  }
  const double held = (double)sizeof(T) * (double)(sc.centered.capacity() + sc.products.capacity()) +
                      8.0 * (double)sc.class_sums.capacity();
  check_fits(state_, nb, p, c, t, k_needed, (double)sizeof(T), held);
  const int64_t workers =
      blas_workers(wanted, [&](int64_t) {
        return std::max(scratch_bytes(nb, p, c, t, k_needed, (double)sizeof(T)) - held, 0.0);  // held: reused
      });
  // All products go to scratch first: nothing below can leave the state half
  // updated (an allocation failure throws before the merge starts).
  const Layout<T> layout = centered_layout(b, sc);
  // Value checks read the data once; their float64 means are the batch means.
  // With float32 products and a state that has samples, that read also
  // centers the rows on the state's means (one pass over the batch instead of
  // two), kept when shift_keeps_precision holds; else the rows are centered
  // again on the batch's means. Only for batches whose centered rows pass
  // kShiftedBytes: a smaller one is read again from the cache, and keeps the
  // bits of a batch state merged on its own (as the torchmetrics metric merges each batch).
  bool on_state_mean = false;
  BatchMeans means;
  const Matrix* in[kStreams] = {&b.features, b.outputs, b.targets};
  if constexpr (std::is_same<T, float>::value)
    on_state_mean = state_.n > 0 && (double)nb * (double)(p + c + t) * sizeof(T) >= kShiftedBytes;
  std::vector<double> squares[kStreams];
  for (int q = 0; q < kStreams; ++q) {
    if (!in[q]) continue;
    ShiftedCopy copy{nullptr, nullptr, 0, &squares[q]};
    if constexpr (std::is_same<T, float>::value) copy = {state_.stream_mean(q).data(), layout.column[q], layout.ld[q],
                                                         &squares[q]};
    means_checked(*in[q], stream_name(q), means.mean[q], means.range[q], means.magnitude[q],
                  on_state_mean ? &copy : nullptr);
  }
  check_spread(b, means, precision);
  for (int q = 0; q < kStreams && on_state_mean; ++q)
    if (in[q]) on_state_mean = shift_keeps_precision(nb, means.mean[q], state_.stream_mean(q), squares[q]);
  const Block<T> blk = form_products(b, means, workers, sc, layout, on_state_mean);
  const int which = overflow_of(state_, blk);
  if (which >= 0) {
    Msg os;
    os << stream_name(which) << " are too large: their co-moments overflow "
       << (std::is_same<T, float>::value ? "the float32 products" : "float64")
       << " (largest magnitude in the batch " << Sci{means.magnitude[which]}
       << "); rescale them (DLR does not depend on the scale)"
       << (std::is_same<T, float>::value ? " or use precision='fp64'" : "") << "; the batch was not added";
    throw input_error(os.str(), stream_name(which), -1, "overflow");
  }
  std::optional<BatchClasses> classes;
  if (b.labels) classes.emplace(x, labels, state_, sc.class_sums);
  Target target(state_, p, b.outputs ? c : -1, b.targets ? t : -1, b.labels ? std::max<int64_t>(k_needed, 0) : -1);
  MergeWork work(blk.width);
  // Nothing below allocates or throws.
  target.grow();
  State& s = target.state();
  merge_block(s, blk, work, blas_get_num_threads());
  if (classes) classes->add_to(s, labels);
  s.precision = std::max(s.precision, precision);
  target.commit();
}

// ---- Gram matrices of row blocks (the Monitor's one-batch windows) ----------

namespace {

// The lower triangle of the Gram of the rows of xc (per x p) into c (row
// stride per). Split: two workers share one Gram, the first forming the two
// diagonal triangles of its halves, the second the block between them (each
// half the multiply-adds); every entry is still one dot product of two rows.
template <typename T>
void gram_lower(const T* xc, int64_t per, int64_t p, T* c, bool split) {
  if (!split) {
    syrk_rows(per, p, xc, p, c, per);
    return;
  }
  const int64_t h = per / 2;
  run_split(2, [](int64_t w) { return w; }, [&](int64_t w, int64_t, int64_t) {
    if (w == 0) {
      syrk_rows(h, p, xc, p, c, per);
      syrk_rows(per - h, p, xc + h * p, p, c + h * per + h, per);
    } else {
      gemm_nt(per - h, h, p, xc + h * p, p, xc, p, c + h * per, per);
    }
  });
}

template <typename T>
void grams_typed(const Matrix& x, int64_t per, T* out, double* norms) {
  const int64_t blocks = x.rows / per, p = x.cols;
  const size_t es = dtype_size(x.dtype);
  const int64_t workers =
      blas_workers(std::min<int64_t>(blas_get_num_threads(), blocks),
                   [&](int64_t w) { return (double)w * (double)(per * p * sizeof(T) + p * sizeof(double)); });
  // Fewer blocks than threads (one batch's Gram): the two halves of each
  // Gram on two threads, where the product outweighs a thread's start.
  const bool split = workers < 2 && blocks < blas_get_num_threads() && per >= 64 && per * per * p >= (1 << 22);
  run_workers(workers, blocks, [&](int64_t, int64_t g0, int64_t g1) {
    std::vector<double> mu((size_t)p);
    std::vector<T> xc((size_t)(per * p));
    for (int64_t g = g0; g < g1; ++g) {
      Matrix b = x;
      b.ptr = static_cast<const char*>(x.ptr) + (size_t)(g * per * x.ld) * es;
      b.rows = per;
      std::fill(mu.begin(), mu.end(), 0.0);
      add_column_sums(b, 0, per, mu.data());
      for (double& v : mu) v /= (double)per;
      center_rows<T>(b, mu, xc.data(), p, 0, per);
      T* c = out + g * per * per;
      gram_lower(xc.data(), per, p, c, split);
      double sq = 0.0;  // ||G||_F^2 from the lower triangle, in float64
      for (int64_t i = 0; i < per; ++i) {
        const double d = (double)c[i * per + i];
        sq += d * d;
        for (int64_t j = i + 1; j < per; ++j) {
          const double v = (double)c[j * per + i];
          sq += 2.0 * v * v;
          c[i * per + j] = c[j * per + i];
        }
      }
      norms[g] = std::sqrt(sq);
    }
  });
}
}  // namespace

void centered_grams(const Matrix& x, int64_t per, Precision precision, void* out, double* norms) {
  const ParkWorkers park;
  check_float_shape(x, "features", x.rows, -1);
  if (per < 1 || x.rows % per != 0) {
    Msg os;
    os << "centered_grams: " << x.rows << " rows do not split into blocks of " << per;
    throw std::invalid_argument(os.str());
  }
  if (traits(precision).product == DType::f64)
    grams_typed<double>(x, per, static_cast<double*>(out), norms);
  else
    grams_typed<float>(x, per, static_cast<float*>(out), norms);
}

// ---- small products on the calling thread ---------------------------------

namespace {
template <typename T>
void matmul_typed(int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* out, bool trans_b) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(out, out + m * n, T(0));
    return;
  }
  if (trans_b)
    gemm_nt(m, n, k, a, k, b, k, out, n);
  else
    gemm_nn(m, n, k, a, b, out);
}
}  // namespace

void matmul_here(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* out, bool trans_b) {
  matmul_typed(m, n, k, a, b, out, trans_b);
}
void matmul_here(int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* out, bool trans_b) {
  matmul_typed(m, n, k, a, b, out, trans_b);
}

// ---- BLAS facts -------------------------------------------------------------

std::string blas_info() {
  Msg os;
  os << "scipy-openblas32 ";
  os << scipy_openblas_get_config() << " (core: " << scipy_openblas_get_corename() << "; "
     << blas_get_num_threads()
     << " richness worker threads, each calling BLAS single-threaded; batch passes in "
     << (simd_level() == 2 ? "AVX-512" : simd_level() == 1 ? "AVX2" : "plain loops") << ")";
  return os.str();
}

namespace {
// OpenBLAS's own count (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS or the cores)
// becomes ours; OpenBLAS itself then runs in the calling thread.
int initial_threads() {
  const int n = std::max(1, scipy_openblas_get_num_threads());
  scipy_openblas_set_num_threads(1);
  return n;
}
std::atomic<int> g_threads{initial_threads()};
}  // namespace

int blas_get_num_threads() { return g_threads.load(); }
void blas_set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("the thread count must be at least 1, got " + std::to_string(n));
  g_threads.store(n);
}

}  // namespace richness
