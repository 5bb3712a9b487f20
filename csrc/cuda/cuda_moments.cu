// Where a batch enters the GPU (CudaMoments::update), is reduced to float64
// means (column_partials/column_means), centered and narrowed (center),
// multiplied (product_lower/product_cross, cuBLAS) and merged into the float64
// state (merge_sym/merge_cross/finalize). All of it is enqueued on the
// caller's stream; nothing in update waits for the device. With staging on
// (set_stack), update stops after centering (stage_batch) and the products and
// merge run once per stage (flush_stage: stack_deviations, merge_groups,
// stack_commit).
#include "cuda_moments.hpp"
#include "../common/msg.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>


namespace richness {
namespace cuda {

namespace {

// ---- status checks ----------------------------------------------------------

void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  Msg os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ") at "
     << file << ":" << line;
  throw std::runtime_error(os.str());
}
void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  Msg os;
  os << "cuBLAS error in " << what << ": " << cublasGetStatusName(s) << " (" << cublasGetStatusString(s)
     << ") at " << file << ":" << line;
  throw std::runtime_error(os.str());
}
#define CUDA_CHECK(x) check_cuda((x), #x, __FILE__, __LINE__)
#define CUBLAS_CHECK(x) check_cublas((x), #x, __FILE__, __LINE__)
#define LAUNCH_CHECK(name) check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)

// Makes `device` current for the scope of a call and restores the caller's.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != device) CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev && prev >= 0) cudaSetDevice(prev);
  }
};



// ---- element conversion -----------------------------------------------------

__device__ __forceinline__ double to_double(float v) { return (double)v; }
__device__ __forceinline__ double to_double(double v) { return v; }
__device__ __forceinline__ double to_double(__half v) { return (double)__half2float(v); }
__device__ __forceinline__ double to_double(__nv_bfloat16 v) { return (double)__bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_double(double v);
template <>
__device__ __forceinline__ float from_double<float>(double v) { return (float)v; }
template <>
__device__ __forceinline__ double from_double<double>(double v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v) { return __double2bfloat16(v); }

__device__ __forceinline__ bool batch_is_bad(const Header* h) {
  long long any = 0;
#pragma unroll
  for (int q = 0; q < kBadKinds; ++q) any |= h->batch_bad[q];
  return any != 0;
}

// ---- kernels ----------------------------------------------------------------

constexpr int kColTile = 32;    // columns per block (one warp across)
constexpr int kRowLanes = 8;    // warps per block, striding the rows
constexpr int kChunkRows = 256; // rows per block; partial sums per chunk

// Float64 column sums of one row chunk, and the count of non-finite values
// (the device's version of the CPU's finiteness check). Two passes with fixed
// order (partials, then column_means) keep the mean deterministic.
template <typename Tin>
__global__ void column_partials(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                                double* __restrict__ partial, unsigned long long* bad) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long col = (long long)blockIdx.x * kColTile + tx;
  const long long chunks = (rows + kChunkRows - 1) / kChunkRows;
  __shared__ double sh[kRowLanes][kColTile + 1];
  unsigned long long nbad = 0;
  // grid.y is capped at 65535: a block takes every gridDim.y-th chunk (one
  // chunk per block below 16.7M rows). The loop bounds are block-uniform.
  for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const long long r0 = chunk * kChunkRows;
    const long long r1 = min(rows, r0 + kChunkRows);
    double s = 0.0;
    if (col < cols) {
      for (long long r = r0 + ty; r < r1; r += kRowLanes) {
        const double v = to_double(x[r * ld + col]);
        s += v;
        nbad += !isfinite(v);
      }
    }
    sh[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && col < cols) {
      double acc = 0.0;
#pragma unroll
      for (int k = 0; k < kRowLanes; ++k) acc += sh[k][tx];
      partial[chunk * cols + col] = acc;
    }
    __syncthreads();  // sh is rewritten by the next chunk
  }
  if (nbad) atomicAdd(bad, nbad);
}

__global__ void column_means(const double* __restrict__ partial, long long chunks, long long cols, double inv_rows,
                             double* __restrict__ mean) {
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  double acc = 0.0;
  for (long long c = 0; c < chunks; ++c) acc += partial[c * cols + col];
  mean[col] = acc * inv_rows;
}

// Centered copy in the product type (row stride ldo). The subtraction is in
// float64, before the narrowing (SPEC.md: mean 1e4 with spread 1e-2 survives
// fp32; bf16 keeps 8 bits of the centered value, bounded by the bf16 tests).
// `zero_if_bad` (staging): a bad batch writes zeros, so that its rows add
// nothing to the stage's product (NaN * 0 would still be NaN).
template <typename Tin, typename Tout>
__global__ void center(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                       const double* __restrict__ mean, Tout* __restrict__ out, long long ldo,
                       const Header* zero_if_bad) {
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  if (zero_if_bad && batch_is_bad(zero_if_bad)) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) out[r * ldo + col] = from_double<Tout>(0.0);
    return;
  }
  const double m = mean[col];
  for (long long r = blockIdx.y; r < rows; r += gridDim.y)
    out[r * ldo + col] = from_double<Tout>(to_double(x[r * ld + col]) - m);
}

// Chan merge of a symmetric block, lower triangle only (column-major i >= j):
//   S += Sb + f d d^T,  f = na nb / (na + nb),  d = mean_b - mean_a.
// `bad` (nullable) holds the batch's error counts: a bad batch is skipped.
template <typename Tb>
__global__ void merge_sym(double* __restrict__ S, const Tb* __restrict__ Sb, long long n,
                          const double* __restrict__ mean_a, const double* __restrict__ mean_b, const Header* h,
                          long long nb, bool check) {
  if (check && batch_is_bad(h)) return;
  const long long i0 = (long long)blockIdx.x * 32, j0 = (long long)blockIdx.y * 32;
  if (i0 + 31 < j0) return;  // tile entirely above the diagonal
  const double na = (double)h->n, nbd = (double)nb;
  const double f = na * nbd / (na + nbd);
  const long long i = i0 + threadIdx.x;
  if (i >= n) return;
  const double di = mean_b[i] - mean_a[i];
  for (long long j = j0 + threadIdx.y; j < min(j0 + 32, i + 1); j += blockDim.y) {
    const long long idx = j * n + i;
    S[idx] += (double)Sb[idx] + f * di * (mean_b[j] - mean_a[j]);
  }
}

// Cross block B (p x w row-major): B += Bb + f d_phi e^T.
template <typename Tb>
__global__ void merge_cross(double* __restrict__ B, const Tb* __restrict__ Bb, long long p, long long w,
                            const double* __restrict__ mu_a, const double* __restrict__ mu_b,
                            const double* __restrict__ nu_a, const double* __restrict__ nu_b, const Header* h,
                            long long nb, bool check) {
  if (check && batch_is_bad(h)) return;
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= w) return;
  const double na = (double)h->n, nbd = (double)nb;
  const double f = na * nbd / (na + nbd);
  const double ej = nu_b[j] - nu_a[j];
  for (long long i = blockIdx.y; i < p; i += gridDim.y) {
    const long long idx = i * w + j;
    B[idx] += (double)Bb[idx] + f * (mu_b[i] - mu_a[i]) * ej;
  }
}

// Last step of a merge: means move toward the block's, n grows; a bad batch
// only adds its counts to the pending error (the state is untouched).
__global__ void finalize(Header* h, long long nb, double* mean, const double* mb, long long p, double* om,
                         const double* ob, long long c, double* tm, const double* tb, long long t, bool check) {
  if (check && batch_is_bad(h)) {
    if (threadIdx.x == 0) {
      for (int q = 0; q < kBadKinds; ++q) h->total_bad[q] += h->batch_bad[q];
      h->skipped += 1;
    }
    return;
  }
  const double na = (double)h->n, w = (double)nb / (na + (double)nb);
  for (long long j = threadIdx.x; j < p; j += blockDim.x) mean[j] += (mb[j] - mean[j]) * w;
  for (long long j = threadIdx.x; j < c; j += blockDim.x) om[j] += (ob[j] - om[j]) * w;
  for (long long j = threadIdx.x; j < t; j += blockDim.x) tm[j] += (tb[j] - tm[j]) * w;
  __syncthreads();  // every thread has read n before it changes
  if (threadIdx.x == 0) h->n += nb;
}

// Labels outside 0..limit-1 make the batch bad; labels in cap..limit-1 (past
// the class arrays' capacity, without num_classes) are counted for deferral.
// The batch's largest label goes to batch_max (header preset to -1).
template <typename Ti>
__global__ void check_labels(const Ti* __restrict__ y, long long rows, long long ld, long long limit, Header* h) {
  const long long cap = h->cap;
  unsigned long long bad = 0, over = 0;
  long long mx = -1;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long long)gridDim.x * blockDim.x) {
    const long long v = (long long)y[r * ld];
    bad += (v < 0 || v >= limit);
    over += (v >= cap && v < limit);
    mx = max(mx, v);
  }
  if (bad) atomicAdd(reinterpret_cast<unsigned long long*>(&h->batch_bad[3]), bad);
  if (over) atomicAdd(reinterpret_cast<unsigned long long*>(&h->batch_over), over);
  atomicMax(&h->batch_max, mx);
}

// After every check of a labelled batch: a good batch raises k_seen and
// reserves its deferred rows; one whose deferred rows do not fit in the
// deferral buffer (defer_cap rows) is not added at all (error kind 4).
__global__ void defer_reserve(Header* h) {
  if (batch_is_bad(h)) return;
  if (h->batch_over > 0) {
    if (h->defer_used + h->batch_over > h->defer_cap) {
      h->batch_bad[4] = h->batch_over;
      return;
    }
    h->defer_cursor = h->defer_used;
    h->defer_used += h->batch_over;
  }
  if (h->batch_max + 1 > h->k_seen) h->k_seen = h->batch_max + 1;
}

// Rows whose label is past the capacity, copied in float64 into the deferral
// buffer (rows of p values, then the labels), in any order: their class sums
// are added at the next synchronising call (settle_classes). One block per
// row; thread 0 takes the row's slot.
template <typename Tin, typename Ti>
__global__ void defer_rows(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                           const Ti* __restrict__ y, long long yld, Header* h) {
  if (batch_is_bad(h) || h->batch_over == 0) return;
  const long long cap = h->cap;
  double* dst = h->defer_rows;
  long long* dst_labels = h->defer_labels;
  __shared__ long long slot;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const long long k = (long long)y[r * yld];
    if (k < cap) continue;  // uniform across the block
    if (threadIdx.x == 0) slot = (long long)atomicAdd(reinterpret_cast<unsigned long long*>(&h->defer_cursor), 1ull);
    __syncthreads();
    for (long long col = threadIdx.x; col < cols; col += blockDim.x) dst[slot * cols + col] = to_double(x[r * ld + col]);
    if (threadIdx.x == 0) dst_labels[slot] = k;
    __syncthreads();  // slot is rewritten for the next row
  }
}

// Largest label of a batch (the first labelled batch without num_classes sizes the class arrays from it).
template <typename Ti>
__global__ void max_label(const Ti* __restrict__ y, long long rows, long long ld, Header* h) {
  long long mx = -1;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long long)gridDim.x * blockDim.x)
    mx = max(mx, (long long)y[r * ld]);
  atomicMax(&h->batch_max, mx);
}

// Raw float64 class sums and counts (docs/MATH.md, class means: the one place
// relying on float64 range). Atomics: the order of additions, and so the last
// bits, may vary. The arrays are the header's; rows labelled past its
// capacity are deferred (defer_rows). `check`: the header whose verdict on
// the batch is read (null: rows already checked, the deferred ones).
template <typename Tin, typename Ti>
__global__ void class_sums(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                           const Ti* __restrict__ y, long long yld, const Header* h, bool check) {
  if (check && batch_is_bad(h)) return;
  double* sums = h->class_sums;
  long long* counts = h->class_counts;
  const long long cap = h->cap;
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const long long k = (long long)y[r * yld];
    if (k >= cap) continue;
    atomicAdd(&sums[k * cols + col], to_double(x[r * ld + col]));
    if (col == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&counts[k]), 1ull);
  }
}

// Adds another state's class arrays (k_other <= k).
__global__ void add_classes(double* sums, long long* counts, const double* osums, const long long* ocounts,
                            long long ko, long long p) {
  const long long total = ko * p;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    sums[i] += osums[i];
    if (i < ko) counts[i] += ocounts[i];
  }
}

// Full symmetric row-major copy of a column-major lower triangle, by 32 x 32
// tiles through shared memory (reads and writes coalesced). A tile of the
// lower region (bi >= bj) writes itself and its mirror; t[a][b] holds the
// value at (bi + b, bj + a), valid where bi + b >= bj + a.
__global__ void symmetrize(const double* __restrict__ lower, long long n, double* __restrict__ out) {
  __shared__ double t[32][33];
  const long long bi = (long long)blockIdx.x * 32, bj = (long long)blockIdx.y * 32;
  if (bi < bj) return;
  const int tx = threadIdx.x;
  for (int ty = threadIdx.y; ty < 32; ty += blockDim.y) {
    const long long i = bi + tx, j = bj + ty;
    t[ty][tx] = (i < n && j < n) ? lower[j * n + i] : 0.0;
  }
  __syncthreads();
  for (int ty = threadIdx.y; ty < 32; ty += blockDim.y) {
    const long long i = bi + ty, j = bj + tx;  // out[i, j], coalesced along j
    if (i < n && j < n) out[i * n + j] = (i >= j) ? t[tx][ty] : t[ty][tx];
    const long long i2 = bi + tx, j2 = bj + ty;  // the mirror out[j2, i2], coalesced along i2
    if (i2 < n && j2 < n) out[j2 * n + i2] = (i2 >= j2) ? t[ty][tx] : t[tx][ty];
  }
}

// Pointer arrays for the lower tiles of X X^T (column-major, bs x bs tiles;
// the product's leading dimension is ldc, its elements out_es bytes).
__global__ void tile_pointers(const char* xs, char* Mb, long long ldc, long long bs, long long in_es,
                              long long out_es, long long nbt, const void** A, const void** B, void** C) {
  long long t = 0;
  for (long long bi = 0; bi < nbt; ++bi)
    for (long long bj = 0; bj <= bi; ++bj, ++t) {
      if (t % blockDim.x != threadIdx.x) continue;
      A[t] = xs + bi * bs * in_es;
      B[t] = xs + bj * bs * in_es;
      C[t] = Mb + (bj * bs * ldc + bi * bs) * out_es;
    }
}

// dst (+)= part over an m x n column-major block (leading dimension ld; only
// i >= j if `lower`): the float64 sum of a split product's row-block parts.
__global__ void add_part_kernel(double* __restrict__ dst, const float* __restrict__ part, long long m, long long n,
                                long long ld, bool lower, bool first) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m) return;
  for (long long j = blockIdx.y; j < n; j += gridDim.y) {
    if (lower && i < j) continue;
    const long long idx = j * ld + i;
    dst[idx] = first ? (double)part[idx] : dst[idx] + (double)part[idx];
  }
}

// ---- staging kernels (set_stack) ----------------------------------------------
//
// A stage holds m batches: batch b has n_b rows (0 if it was bad), a float64
// mean mu_b, and its centered rows. The state has n_a samples, mean mu_a and
// co-moment M_a. With N = sum n_b and mu = (n_a mu_a + sum n_b mu_b) / (n_a + N),
// the exact merge of all of them (the parallel-axis identity over the m + 1
// groups; for m = 1 it is Chan's pairwise formula) is
//   M = M_a + sum_b X_b^T X_b + sum_{g in {a, 1..m}} n_g (mu_g - mu)(mu_g - mu)^T.
// The within-batch sum is one product over all staged rows (each batch was
// centered on its own mean); the group sum is done in float64 in merge_groups
// from D_g = sqrt(n_g) (mu_g - mu). Cross blocks (B) take sum_g D_g^phi D_g^f^T.

// After a staged batch's checks: its weight, or, for a bad batch, zero weight
// and the error counts moved to the pending totals (as finalize does).
__global__ void stage_record(Header* h, long long* count, long long nb) {
  if (batch_is_bad(h)) {
    for (int q = 0; q < kBadKinds; ++q) h->total_bad[q] += h->batch_bad[q];
    h->skipped += 1;
    *count = 0;
  } else {
    *count = nb;
  }
}

// One thread per column of [features | outputs | targets] (width p + c + t):
// the merged mean mu, then, in place over the staged means (row 0: the state,
// row 1 + b: batch b), D_g = sqrt(n_g) (mu_g - mu); the state's mean becomes
// mu. h->n is only read here (stack_commit adds N after every column is done).
__global__ void stack_deviations(double* __restrict__ means, long long ldm, int m, const long long* __restrict__ counts,
                                 const Header* h, double* mean, long long p, double* om, long long c, double* tm,
                                 long long t) {
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= p + c + t) return;
  double* sm = col < p ? mean + col : (col < p + c ? om + (col - p) : tm + (col - p - c));
  long long nst = 0;
  for (int b = 0; b < m; ++b) nst += counts[b];
  if (nst == 0) {  // every staged batch was bad: nothing changes
    for (int g = 0; g <= m; ++g) means[g * ldm + col] = 0.0;
    return;
  }
  const double na = (double)h->n, ntot = na + (double)nst, ma = *sm;
  // mu = mu_a + sum_b n_b (mu_b - mu_a) / (n_a + N): the shift form keeps the
  // state's digits when n_a >> N. A bad batch's mean (maybe NaN) is never read.
  double shift = 0.0;
  for (int b = 0; b < m; ++b)
    if (counts[b] > 0) shift += (double)counts[b] * (means[(1 + b) * ldm + col] - ma);
  const double mu = ma + shift / ntot;
  means[col] = sqrt(na) * (ma - mu);
  for (int b = 0; b < m; ++b) {
    double* v = means + (1 + b) * ldm + col;
    *v = counts[b] > 0 ? sqrt((double)counts[b]) * (*v - mu) : 0.0;
  }
  *sm = mu;
}

// S += Sb + sum_g Df_g Ds_g^T over 32 x 32 tiles, g = 0..groups-1 (float64).
// S[s * lds + f] is the entry (f, s) (f the fast, coalesced index); Sb the
// product at the same entry with stride ldb; Df/Ds rows of stride ldd.
// `lower`: only f >= s (symmetric blocks, column-major lower triangle).
template <typename Tb>
__global__ void merge_groups(double* __restrict__ S, long long lds, const Tb* __restrict__ Sb, long long ldb,
                             long long nfast, long long nslow, const double* __restrict__ Df,
                             const double* __restrict__ Ds, long long ldd, int groups, bool lower) {
  const long long f0 = (long long)blockIdx.x * 32, s0 = (long long)blockIdx.y * 32;
  if (lower && f0 + 31 < s0) return;  // tile entirely above the diagonal
  __shared__ double df[32][33], ds[32][33];  // [group][index]
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x 8
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int g0 = 0; g0 < groups; g0 += 32) {
    for (int q = ty; q < 32; q += 8) {
      const int g = g0 + q;
      df[q][tx] = (g < groups && f0 + tx < nfast) ? Df[(long long)g * ldd + f0 + tx] : 0.0;
      ds[q][tx] = (g < groups && s0 + tx < nslow) ? Ds[(long long)g * ldd + s0 + tx] : 0.0;
    }
    __syncthreads();
    const int gn = min(32, groups - g0);
    for (int q = 0; q < gn; ++q) {
      const double a = df[q][tx];
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r] += a * ds[q][ty + 8 * r];
    }
    __syncthreads();
  }
  const long long f = f0 + tx;
  if (f >= nfast) return;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const long long sidx = s0 + ty + 8 * r;
    if (sidx < nslow && (!lower || f >= sidx)) S[sidx * lds + f] += (double)Sb[sidx * ldb + f] + acc[r];
  }
}

// Last step of a flush: n grows by the staged good rows.
__global__ void stack_commit(Header* h, const long long* counts, int m) {
  long long nst = 0;
  for (int b = 0; b < m; ++b) nst += counts[b];
  h->n += nst;
}

// ---- launch helpers -----------------------------------------------------------

// Blocks along y (the hardware allows 65535): kernels launched with grid_y
// stride over rows (or row chunks) by gridDim.y. The CPU emulator's build
// (tests/cuda_emu) lowers the cap so that every stride loop runs more than once.
#ifndef RICHNESS_GRID_Y_MAX
#define RICHNESS_GRID_Y_MAX 65535
#endif
inline unsigned grid_y(long long rows) {
  return (unsigned)std::max<long long>(1, std::min<long long>(rows, RICHNESS_GRID_Y_MAX));
}

template <typename Fn>
void dispatch_float(DType d, Fn&& fn) {
  switch (d) {
    case DType::f32: fn(float()); break;
    case DType::f64: fn(double()); break;
    case DType::f16: fn(__half()); break;
    case DType::bf16: fn(__nv_bfloat16()); break;
    default: throw type_error("internal: not a float matrix");
  }
}

template <typename Fn>
void dispatch_int(DType d, Fn&& fn) {
  if (d == DType::i32) fn(int32_t());
  else fn(int64_t());
}

// Float64 column means of m into mean (partials: scratch of chunks * cols).
void launch_means(const Matrix& m, double* partial, double* mean, unsigned long long* bad, cudaStream_t s) {
  const long long chunks = (m.rows + kChunkRows - 1) / kChunkRows;
  dispatch_float(m.dtype, [&](auto tag) {
    using T = decltype(tag);
    dim3 grid((unsigned)((m.cols + kColTile - 1) / kColTile), grid_y(chunks));
    column_partials<T><<<grid, dim3(kColTile, kRowLanes), 0, s>>>(static_cast<const T*>(m.ptr), m.rows, m.cols,
                                                                  m.ld, partial, bad);
  });
  LAUNCH_CHECK("column_partials");
  column_means<<<(unsigned)((m.cols + 255) / 256), 256, 0, s>>>(partial, chunks, m.cols, 1.0 / (double)m.rows, mean);
  LAUNCH_CHECK("column_means");
}

// Float64 class sums and counts of a batch's features into the header's
// arrays (skipped for a batch the checks marked bad, if `check`); rows
// labelled past the capacity are left out.
void launch_class_sums(const Matrix& x, const Matrix& labels, const Header* h, bool check, cudaStream_t s) {
  dim3 grid((unsigned)((x.cols + 255) / 256), grid_y(x.rows));
  dispatch_float(x.dtype, [&](auto xt) {
    using Tin = decltype(xt);
    dispatch_int(labels.dtype, [&](auto yt) {
      using Ti = decltype(yt);
      class_sums<Tin, Ti><<<grid, 256, 0, s>>>(static_cast<const Tin*>(x.ptr), x.rows, x.cols, x.ld,
                                                static_cast<const Ti*>(labels.ptr), labels.ld, h, check);
    });
  });
  LAUNCH_CHECK("class_sums");
}

// Labels past this many classes are refused without num_classes (as on the
// CPU): a stray huge label must not allocate gigabytes of class sums.
int64_t class_growth_cap(int64_t p) { return std::max<int64_t>((int64_t(1) << 27) / std::max<int64_t>(p, 1), 1024); }

// Capacity for k classes: doubling room, a power of two, within the cap.
int64_t class_capacity(int64_t k, int64_t p) {
  int64_t c = 64;
  while (c < 2 * k) c *= 2;
  return std::max(k, std::min(c, class_growth_cap(p)));
}

// Centered rows of m into out (row stride ldo; packed: ldo = m.cols).
void launch_center(const Matrix& m, const double* mean, Precision prec, void* out, long long ldo,
                   const Header* zero_if_bad, cudaStream_t s) {
  dim3 grid((unsigned)((m.cols + 255) / 256), grid_y(m.rows));
  dispatch_float(m.dtype, [&](auto tag) {
    using Tin = decltype(tag);
    const Tin* x = static_cast<const Tin*>(m.ptr);
    if (prec == Precision::fp64)
      center<Tin, double><<<grid, 256, 0, s>>>(x, m.rows, m.cols, m.ld, mean, static_cast<double*>(out), ldo,
                                              zero_if_bad);
    else if (prec == Precision::bf16)
      center<Tin, __nv_bfloat16><<<grid, 256, 0, s>>>(x, m.rows, m.cols, m.ld, mean,
                                                       static_cast<__nv_bfloat16*>(out), ldo, zero_if_bad);
    else
      center<Tin, float><<<grid, 256, 0, s>>>(x, m.rows, m.cols, m.ld, mean, static_cast<float*>(out), ldo,
                                             zero_if_bad);
  });
  LAUNCH_CHECK("center");
}

void add_part(double* dst, const float* part, long long m, long long n, long long ld, bool lower, bool first,
              cudaStream_t s) {
  add_part_kernel<<<dim3((unsigned)((m + 255) / 256), grid_y(n)), 256, 0, s>>>(dst, part, m, n, ld, lower, first);
  LAUNCH_CHECK("add_part");
}

size_t in_size(Precision p) { return p == Precision::fp64 ? 8 : (p == Precision::bf16 ? 2 : 4); }
size_t out_size(Precision p) { return p == Precision::fp64 ? 8 : 4; }
cudaDataType_t in_type(Precision p) {
  return p == Precision::fp64 ? CUDA_R_64F : (p == Precision::bf16 ? CUDA_R_16BF : CUDA_R_32F);
}
cudaDataType_t out_type(Precision p) { return p == Precision::fp64 ? CUDA_R_64F : CUDA_R_32F; }
// fp32: no tensor cores (the handle stays in CUBLAS_DEFAULT_MATH, which never
// picks TF32 for CUBLAS_COMPUTE_32F). tf32: tensor cores with fp32
// accumulation, bounded by the tf32 tests (DLR within 1e-3). bf16: bf16
// inputs, fp32 accumulation (DLR within 5e-3).
cublasComputeType_t compute_type(Precision p) {
  switch (p) {
    case Precision::fp64: return CUBLAS_COMPUTE_64F;
    case Precision::tf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    default: return CUBLAS_COMPUTE_32F;
  }
}

void* allocate(size_t bytes) {
  void* p = nullptr;
  if (bytes) CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

}  // namespace

// ---- lifecycle ----------------------------------------------------------------

CudaMoments::CudaMoments(int64_t num_classes, int device) : device_(device), num_classes_(num_classes) {
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    Msg os;
    os << "CUDA device " << device << " does not exist (" << count << " visible)";
    throw std::invalid_argument(os.str());
  }
  DeviceGuard g(device_);
  CUBLAS_CHECK(cublasCreate(&handle_));
  CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  CUBLAS_CHECK(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
  // Our own workspace: cublasSetStream resets it to the default pool, which
  // may allocate inside a CUDA graph capture.
  workspace_bytes_ = 32u << 20;
  workspace_ = allocate(workspace_bytes_);
  CUDA_CHECK(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
}

CudaMoments::~CudaMoments() {
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // pending work may still write the buffers
  free_all();
  if (workspace_) cudaFree(workspace_);
  if (order_event_) cudaEventDestroy(order_event_);
  if (handle_) cublasDestroy(handle_);
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}

void CudaMoments::free_state() {
  for (void* p : {(void*)s_.hdr, (void*)s_.mean, (void*)s_.M, (void*)s_.out_mean, (void*)s_.B, (void*)s_.A,
                  (void*)s_.tgt_mean, (void*)s_.Bt, (void*)s_.At, (void*)s_.class_counts, (void*)s_.class_sums})
    if (p) cudaFree(p);
  s_ = DeviceState();
  cap_ = 0;
}

void CudaMoments::free_all() {
  free_state();
  for (Buf* b : {&xs_, &fs_, &ts_, &Mb_, &Bb_, &Ab_, &Btb_, &Atb_, &mu_, &nu_, &tau_, &partial_, &defer_, &tiles_.ptrs,
                 &st_tiles_.ptrs, &st_x_, &st_means_, &st_counts_, &st_prod_}) {
    if (b->ptr) cudaFree(b->ptr);
    *b = Buf();
  }
  tiles_ = TileCache();
  st_tiles_ = TileCache();
  defer_cap_ = 0;
  st_rows_ = 0;  // staged rows belonged to the state just freed
  st_batches_ = 0;
}

void CudaMoments::ensure(Buf& b, size_t bytes) {
  if (b.bytes >= bytes) return;
  // Growing frees memory a pending kernel may read: wait for the device first.
  if (b.ptr) {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaFree(b.ptr));
    b = Buf();
  }
  b.ptr = allocate(bytes);
  b.bytes = bytes;
}

void CudaMoments::shape(int64_t p, int64_t c, int64_t t, int64_t k) {
  p_ = p;
  c_ = c;
  t_ = t;
  k_ = k;
  cap_ = std::max<int64_t>(k, 0);
  auto zeros = [](size_t count, size_t es) {
    void* ptr = allocate(count * es);
    if (ptr) CUDA_CHECK(cudaMemset(ptr, 0, count * es));
    return ptr;
  };
  const size_t P = p, C = c > 0 ? c : 0, T = t > 0 ? t : 0, K = k > 0 ? k : 0;
  s_.hdr = static_cast<Header*>(zeros(1, sizeof(Header)));
  s_.mean = static_cast<double*>(zeros(P, 8));
  s_.M = static_cast<double*>(zeros(P * P, 8));
  s_.out_mean = static_cast<double*>(zeros(C, 8));
  s_.B = static_cast<double*>(zeros(P * C, 8));
  s_.A = static_cast<double*>(zeros(C * C, 8));
  s_.tgt_mean = static_cast<double*>(zeros(T, 8));
  s_.Bt = static_cast<double*>(zeros(P * T, 8));
  s_.At = static_cast<double*>(zeros(T * T, 8));
  s_.class_counts = static_cast<long long*>(zeros(K, 8));
  s_.class_sums = static_cast<double*>(zeros(K * P, 8));
  CUDA_CHECK(cudaDeviceSynchronize());  // memsets are done before any stream uses the buffers
  publish_classes();
}

void CudaMoments::publish_classes() {
  Header hh;
  CUDA_CHECK(cudaMemcpy(&hh, s_.hdr, sizeof(Header), cudaMemcpyDeviceToHost));
  hh.class_sums = s_.class_sums;
  hh.class_counts = s_.class_counts;
  hh.cap = num_classes_ >= 0 ? num_classes_ : cap_;
  hh.defer_rows = static_cast<double*>(defer_.ptr);
  hh.defer_labels = defer_.ptr ? reinterpret_cast<long long*>(hh.defer_rows + defer_cap_ * p_) : nullptr;
  hh.defer_cap = defer_cap_;
  CUDA_CHECK(cudaMemcpy(s_.hdr, &hh, sizeof(Header), cudaMemcpyHostToDevice));
}

void CudaMoments::grow_classes(int64_t cap) {
  if (cap <= cap_) return;
  CUDA_CHECK(cudaDeviceSynchronize());
  const size_t K = cap, P = p_, K0 = cap_;
  long long* counts = static_cast<long long*>(allocate(K * 8));
  double* sums = static_cast<double*>(allocate(K * P * 8));
  CUDA_CHECK(cudaMemset(counts, 0, K * 8));
  CUDA_CHECK(cudaMemset(sums, 0, K * P * 8));
  if (K0) {
    CUDA_CHECK(cudaMemcpy(counts, s_.class_counts, K0 * 8, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaMemcpy(sums, s_.class_sums, K0 * P * 8, cudaMemcpyDeviceToDevice));
  }
  if (s_.class_counts) CUDA_CHECK(cudaFree(s_.class_counts));
  if (s_.class_sums) CUDA_CHECK(cudaFree(s_.class_sums));
  s_.class_counts = counts;
  s_.class_sums = sums;
  cap_ = cap;
  CUDA_CHECK(cudaDeviceSynchronize());
  publish_classes();
}

void CudaMoments::prepare_classes(const Matrix& labels, int64_t nb) {
  widest_labelled_ = std::max(widest_labelled_, nb);
  if (cap_ == 0) {
    // The first labelled batch: the state was just allocated (a synchronising
    // step already), so reading its largest label costs one more wait, once.
    Header* h = s_.hdr;
    CUDA_CHECK(cudaMemset(&h->batch_max, 0xff, sizeof(long long)));
    dispatch_int(labels.dtype, [&](auto tag) {
      using Ti = decltype(tag);
      max_label<Ti><<<(unsigned)std::min<long long>(1024, (nb + 255) / 256), 256>>>(
          static_cast<const Ti*>(labels.ptr), nb, labels.ld, h);
    });
    LAUNCH_CHECK("max_label");
    long long mx = -1;
    CUDA_CHECK(cudaMemcpy(&mx, &h->batch_max, sizeof(long long), cudaMemcpyDeviceToHost));
    const int64_t growth_cap = class_growth_cap(p_);
    if (mx >= growth_cap) {
      Msg os;
      os << "label " << mx << " would grow the class sums past 1 GiB (" << growth_cap << " classes at p=" << p_
         << "); pass num_classes to Moments if this many classes is intended";
      throw std::invalid_argument(os.str());
    }
    grow_classes(class_capacity(std::max<long long>(mx + 1, 1), p_));
  }
  if (!defer_.ptr) {
    // Allocated outside any capture (the first labelled batch); regrown only
    // at a synchronising call, when it is empty (settle_classes).
    const int64_t rows = std::max<int64_t>(widest_labelled_, 1024);
    ensure(defer_, (size_t)rows * ((size_t)p_ + 1) * 8);
    defer_cap_ = rows;
    publish_classes();
  }
}

void CudaMoments::class_part(const Matrix& x, const Matrix& labels, cudaStream_t stream) {
  Header* h = s_.hdr;
  launch_class_sums(x, labels, h, true, stream);
  if (num_classes_ >= 0) return;
  dispatch_float(x.dtype, [&](auto xt) {
    using Tin = decltype(xt);
    dispatch_int(labels.dtype, [&](auto yt) {
      using Ti = decltype(yt);
      defer_rows<Tin, Ti><<<dim3(1, grid_y(x.rows)), 256, 0, stream>>>(static_cast<const Tin*>(x.ptr), x.rows, x.cols,
                                                                       x.ld, static_cast<const Ti*>(labels.ptr),
                                                                       labels.ld, h);
    });
  });
  LAUNCH_CHECK("defer_rows");
}

void CudaMoments::settle_classes() {
  // Called with the device idle. With num_classes, k is fixed.
  if (num_classes_ >= 0 || k_ < 0 || !s_.hdr) return;
  Header hh;
  CUDA_CHECK(cudaMemcpy(&hh, s_.hdr, sizeof(Header), cudaMemcpyDeviceToHost));
  const int64_t k = std::max<int64_t>(k_floor_, hh.k_seen);
  if (k > cap_) grow_classes(class_capacity(k, p_));
  if (hh.defer_used > 0) {
    const double* rows = static_cast<const double*>(defer_.ptr);
    Matrix x{(void*)rows, hh.defer_used, p_, p_, DType::f64};
    Matrix y{(void*)(rows + defer_cap_ * p_), hh.defer_used, 1, 1, DType::i64};
    launch_class_sums(x, y, s_.hdr, false, 0);
    CUDA_CHECK(cudaMemset(&s_.hdr->defer_used, 0, sizeof(long long)));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  k_ = k;
  if (defer_.ptr && defer_cap_ < widest_labelled_) {  // empty now: room for the widest batch
    ensure(defer_, (size_t)widest_labelled_ * ((size_t)p_ + 1) * 8);
    defer_cap_ = widest_labelled_;
    publish_classes();
  }
}

void CudaMoments::set_product(Product algo, int block) {
  if (block < 16) throw std::invalid_argument("block size must be at least 16");
  algo_ = algo;
  block_ = block;
}

void CudaMoments::set_row_cap(int64_t rows) {
  if (rows < 0) throw std::invalid_argument("row cap must be 0 (none) or positive, got " + std::to_string(rows));
  row_cap_ = rows;
}

void CudaMoments::order_after_last(cudaStream_t stream) {
  // Successive updates on different streams write the same state: the new
  // stream waits (on the device) for the work queued on the previous one.
  // While `stream` is being captured into a CUDA graph, touching another
  // stream would break the capture: the graph's replays are ordered by the
  // caller, who warmed up (and so last used) the state on the capture stream.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (have_last_stream_ && last_stream_ != stream && capture == cudaStreamCaptureStatusNone) {
    CUDA_CHECK(cudaEventRecord(order_event_, last_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream, order_event_, 0));
  }
  last_stream_ = stream;
  have_last_stream_ = true;
}

// ---- validation (host: shapes and dtypes only; data is checked on the device) --

namespace {


}  // namespace

// ---- update -------------------------------------------------------------------

void CudaMoments::prepare_batch_scratch(Precision prec, int64_t nb, int64_t c, int64_t t) {
  // Scratch of the per-batch path, sized for a batch of nb rows. With staging
  // on it is sized too (by eager updates): a captured update takes the
  // per-batch path and must not allocate inside the capture.
  const size_t ies = in_size(prec), oes = product_size(prec, nb);
  const int64_t p = p_;
  const int64_t widest = std::max<int64_t>(p, std::max<int64_t>(c, t));
  if (splits(prec, nb)) ensure(part_, (size_t)widest * widest * 4);
  const long long chunks = (nb + kChunkRows - 1) / kChunkRows;
  ensure(partial_, (size_t)chunks * widest * 8);
  ensure(mu_, (size_t)p * 8);
  ensure(xs_, (size_t)nb * p * ies);
  ensure(Mb_, (size_t)p * p * oes);
  if (c > 0) {
    ensure(nu_, (size_t)c * 8);
    ensure(fs_, (size_t)nb * c * ies);
    ensure(Bb_, (size_t)p * c * oes);
    ensure(Ab_, (size_t)c * c * oes);
  }
  if (t > 0) {
    ensure(tau_, (size_t)t * 8);
    ensure(ts_, (size_t)nb * t * ies);
    ensure(Btb_, (size_t)p * t * oes);
    ensure(Atb_, (size_t)t * t * oes);
  }
  if (resolve(prec, p) == Product::tiles) {
    const long long nbt = p / block_;
    ensure(tiles_.ptrs, (size_t)(nbt * (nbt + 1) / 2) * 3 * sizeof(void*));
  }
}

// A batch's float64 column means (features, outputs, targets) and its device
// checks (non-finite values, labels out of range), counted in the header's
// batch_bad for the kernels after them to read.
void CudaMoments::means_and_checks(const Matrix& x, const Matrix* outputs, const Matrix* labels,
                                   const Matrix* targets, double* mu, double* nu, double* tau, cudaStream_t stream) {
  Header* h = s_.hdr;
  unsigned long long* bad = reinterpret_cast<unsigned long long*>(h->batch_bad);
  double* partial = static_cast<double*>(partial_.ptr);
  const long long nb = x.rows;
  CUDA_CHECK(cudaMemsetAsync(h->batch_bad, 0, sizeof(h->batch_bad), stream));
  if (labels) {
    CUDA_CHECK(cudaMemsetAsync(&h->batch_max, 0xff, sizeof(long long), stream));
    CUDA_CHECK(cudaMemsetAsync(&h->batch_over, 0, sizeof(long long), stream));
  }
  launch_means(x, partial, mu, bad + 0, stream);
  if (outputs) launch_means(*outputs, partial, nu, bad + 1, stream);
  if (targets) launch_means(*targets, partial, tau, bad + 2, stream);
  if (labels) {
    const long long limit = num_classes_ >= 0 ? num_classes_ : class_growth_cap(p_);
    dispatch_int(labels->dtype, [&](auto tag) {
      using Ti = decltype(tag);
      check_labels<Ti><<<(unsigned)std::min<long long>(1024, (nb + 255) / 256), 256, 0, stream>>>(
          static_cast<const Ti*>(labels->ptr), nb, labels->ld, limit, h);
    });
    LAUNCH_CHECK("check_labels");
    defer_reserve<<<1, 1, 0, stream>>>(h);  // last: reads every check's verdict
    LAUNCH_CHECK("defer_reserve");
  }
}

void CudaMoments::update(const Matrix& x, const Matrix* outputs, const Matrix* labels, const Matrix* targets,
                         Precision prec, cudaStream_t stream) {
  Batch batch;
  batch.features = x;
  batch.outputs = outputs;
  batch.labels = labels;
  batch.targets = targets;
  validate_batch({0, p_, c_, t_, k_, num_classes_}, batch);  // widths and shapes only (n unread): no sync
  const bool started = p_ >= 0;
  if (x.rows == 0) return;

  DeviceGuard g(device_);
  const int64_t nb = x.rows, p = x.cols;
  if (!started)
    shape(p, outputs ? outputs->cols : -1, targets ? targets->cols : -1,
          labels ? std::max<int64_t>(num_classes_, 0) : -1);
  order_after_last(stream);
  Header* h = s_.hdr;

  if (labels && num_classes_ < 0) prepare_classes(*labels, nb);  // synchronises on the first labelled batch only

  if (stack_rows_ > 0 && nb <= stack_rows_) {
    // A graph replay re-runs a captured update with the same host-side stage
    // offsets, so a captured update never stages: it takes the per-batch
    // path below (whose scratch stage_batch keeps sized). Rows staged before
    // the capture stay staged and are flushed by a later eager call.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) {
      stage_batch(x, outputs, labels, targets, prec, stream);
      return;
    }
  }

  // Scratch (sizes in bytes, by product precision).
  const int64_t c = outputs ? outputs->cols : 0, t = targets ? targets->cols : 0;
  prepare_batch_scratch(prec, nb, c, t);

  double* mu = static_cast<double*>(mu_.ptr);
  double* nu = static_cast<double*>(nu_.ptr);
  double* tau = static_cast<double*>(tau_.ptr);
  means_and_checks(x, outputs, labels, targets, mu, nu, tau, stream);

  launch_center(x, mu, prec, xs_.ptr, p, nullptr, stream);
  if (outputs) launch_center(*outputs, nu, prec, fs_.ptr, c, nullptr, stream);
  if (targets) launch_center(*targets, tau, prec, ts_.ptr, t, nullptr, stream);

  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, workspace_bytes_));
  product_lower(prec, p, nb, xs_.ptr, p, Mb_.ptr, p, tiles_, stream);
  if (outputs) product_cross(prec, nb, c, fs_.ptr, c, xs_.ptr, p, Bb_.ptr, Ab_.ptr, stream);
  if (targets) product_cross(prec, nb, t, ts_.ptr, t, xs_.ptr, p, Btb_.ptr, Atb_.ptr, stream);

  // float64 merge (of float64 products: fp64, or split); every kernel reads the device's error counts and leaves
  // the state untouched for a bad batch.
  const bool wide = product_size(prec, nb) == 8;
  auto sym = [&](double* S, const void* Sb, long long n, const double* ma, const double* mb) {
    const unsigned tiles = (unsigned)((n + 31) / 32);
    if (wide)
      merge_sym<double><<<dim3(tiles, tiles), dim3(32, 8), 0, stream>>>(S, static_cast<const double*>(Sb), n, ma, mb,
                                                                       h, nb, true);
    else
      merge_sym<float><<<dim3(tiles, tiles), dim3(32, 8), 0, stream>>>(S, static_cast<const float*>(Sb), n, ma, mb,
                                                                      h, nb, true);
    LAUNCH_CHECK("merge_sym");
  };
  auto cross = [&](double* Bs, const void* Bg, long long w, const double* ga, const double* gb) {
    dim3 grid((unsigned)((w + 127) / 128), grid_y(p));
    if (wide)
      merge_cross<double><<<grid, 128, 0, stream>>>(Bs, static_cast<const double*>(Bg), p, w, s_.mean, mu, ga, gb,
                                                    h, nb, true);
    else
      merge_cross<float><<<grid, 128, 0, stream>>>(Bs, static_cast<const float*>(Bg), p, w, s_.mean, mu, ga, gb, h,
                                                   nb, true);
    LAUNCH_CHECK("merge_cross");
  };
  sym(s_.M, Mb_.ptr, p, s_.mean, mu);
  if (outputs) {
    cross(s_.B, Bb_.ptr, c, s_.out_mean, nu);
    sym(s_.A, Ab_.ptr, c, s_.out_mean, nu);
  }
  if (targets) {
    cross(s_.Bt, Btb_.ptr, t, s_.tgt_mean, tau);
    sym(s_.At, Atb_.ptr, t, s_.tgt_mean, tau);
  }
  if (labels) class_part(x, *labels, stream);
  finalize<<<1, 1024, 0, stream>>>(h, nb, s_.mean, mu, p, s_.out_mean, nu, outputs ? c : 0, s_.tgt_mean, tau,
                                    targets ? t : 0, true);
  LAUNCH_CHECK("finalize");
  precision_ = std::max(precision_, prec);
}

// ---- staging ----------------------------------------------------------------------

void CudaMoments::set_stack(int64_t rows, bool joint) {
  if (rows < 0 || rows > (int64_t)std::numeric_limits<int>::max()) {
    Msg os;
    os << "stack_rows must be between 0 (off) and " << std::numeric_limits<int>::max() << ", got " << rows;
    throw std::invalid_argument(os.str());
  }
  flush_pending();
  DeviceGuard g(device_);
  CUDA_CHECK(cudaDeviceSynchronize());
  stack_rows_ = rows;
  stack_joint_ = joint;
}

void CudaMoments::stage_batch(const Matrix& x, const Matrix* outputs, const Matrix* labels, const Matrix* targets,
                              Precision prec, cudaStream_t stream) {
  const int64_t nb = x.rows, p = p_;
  const int64_t c = std::max<int64_t>(c_, 0), t = std::max<int64_t>(t_, 0);
  // Flush decisions from host-known facts only.
  if (st_batches_ > 0 && (st_prec_ != prec || st_rows_ + nb > stack_rows_ || st_batches_ >= kMaxStackBatches))
    flush_stage(stream);

  // Allocations happen here, outside any capture (growth waits for the
  // device: the first staged update, or a wider precision, pays it once).
  prepare_batch_scratch(prec, nb, c, t);
  const int64_t width = (p + c + t + 7) / 8 * 8;  // rows 16-byte aligned for the tensor-core kernels
  st_width_ = width;
  const size_t ies = in_size(prec), oes = product_size(prec, stack_rows_);  // the most rows a flush multiplies
  if (splits(prec, stack_rows_)) ensure(part_, (size_t)width * width * 4);
  ensure(st_x_, (size_t)stack_rows_ * width * ies);
  ensure(st_means_, (size_t)(kMaxStackBatches + 1) * width * 8);
  ensure(st_counts_, (size_t)kMaxStackBatches * 8);
  ensure(st_prod_, (size_t)width * width * oes);
  const int64_t joint_n = p + c + t;
  if (stack_joint_ && resolve(prec, joint_n) == Product::tiles) {
    const long long nbt = joint_n / block_;
    ensure(st_tiles_.ptrs, (size_t)(nbt * (nbt + 1) / 2) * 3 * sizeof(void*));
  } else if (resolve(prec, p) == Product::tiles) {
    const long long nbt = p / block_;
    ensure(st_tiles_.ptrs, (size_t)(nbt * (nbt + 1) / 2) * 3 * sizeof(void*));
  }

  if (st_batches_ == 0) st_prec_ = prec;
  const int slot = st_batches_;
  const int64_t row0 = st_rows_;
  Header* h = s_.hdr;
  double* means = static_cast<double*>(st_means_.ptr) + (int64_t)(1 + slot) * width;  // [mu | nu | tau]
  char* rows = static_cast<char*>(st_x_.ptr) + (size_t)row0 * width * ies;

  means_and_checks(x, outputs, labels, targets, means, means + p, means + p + c, stream);
  // Every check above has run (stream order) before the centering reads the
  // verdict: a bad batch's rows are staged as zeros.
  launch_center(x, means, prec, rows, width, h, stream);
  if (outputs) launch_center(*outputs, means + p, prec, rows + p * ies, width, h, stream);
  if (targets) launch_center(*targets, means + p + c, prec, rows + (p + c) * ies, width, h, stream);
  // class sums stay per batch (raw float64 sums: nothing to stage)
  if (labels) class_part(x, *labels, stream);
  stage_record<<<1, 1, 0, stream>>>(h, static_cast<long long*>(st_counts_.ptr) + slot, nb);
  LAUNCH_CHECK("stage_record");
  st_rows_ += nb;
  st_batches_ += 1;
  precision_ = std::max(precision_, prec);
}

void CudaMoments::flush_stage(cudaStream_t stream) {
  if (st_batches_ == 0) return;
  DeviceGuard g(device_);
  const Precision prec = st_prec_;
  const int64_t R = st_rows_, W = st_width_, p = p_;
  const int64_t c = std::max<int64_t>(c_, 0), t = std::max<int64_t>(t_, 0);
  const int m = st_batches_;
  // Cleared first: should a call below raise, the stage is dropped rather
  // than merged twice by a later flush.
  st_rows_ = 0;
  st_batches_ = 0;
  const size_t ies = in_size(prec), oes = product_size(prec, R);
  const char* rows = static_cast<const char*>(st_x_.ptr);
  char* prod = static_cast<char*>(st_prod_.ptr);
  double* means = static_cast<double*>(st_means_.ptr);
  const long long* counts = static_cast<const long long*>(st_counts_.ptr);
  Header* h = s_.hdr;

  // Within-batch products over all R staged rows (bad batches are zero rows).
  // Precision traded for speed: the product accumulates R rows (not one
  // batch) in its precision before the float64 merge; bounded by the staged
  // tests in tests/test_cuda.py (same DLR tolerances as unstaged).
  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, workspace_bytes_));
  const void *Mp, *Bp = nullptr, *Ap = nullptr, *Btp = nullptr, *Atp = nullptr;
  int64_t ldM, ldB = 0, ldA = 0, ldBt = 0, ldAt = 0;
  if (stack_joint_ || (c == 0 && t == 0)) {
    // Lower triangle of [X | F | T]^T [X | F | T]: M top left, B^T below it,
    // A on the diagonal after it (same arithmetic as the three products).
    product_lower(prec, p + c + t, R, rows, W, prod, W, st_tiles_, stream);
    Mp = prod;
    ldM = W;
    Bp = prod + p * oes;
    Ap = prod + (p * W + p) * oes;
    Btp = prod + (p + c) * oes;
    Atp = prod + ((p + c) * W + p + c) * oes;
    ldB = ldA = ldBt = ldAt = W;
  } else {
    product_lower(prec, p, R, rows, W, prod, p, st_tiles_, stream);
    Mp = prod;
    ldM = p;
    char* next = prod + p * p * oes;
    if (c > 0) {
      Bp = next;
      Ap = next + p * c * oes;
      ldB = ldA = c;
      product_cross(prec, R, c, rows + p * ies, W, rows, W, (void*)Bp, (void*)Ap, stream);
      next += (p * c + c * c) * oes;
    }
    if (t > 0) {
      Btp = next;
      Atp = next + p * t * oes;
      ldBt = ldAt = t;
      product_cross(prec, R, t, rows + (p + c) * ies, W, rows, W, (void*)Btp, (void*)Atp, stream);
    }
  }

  // Between-batch scatter and merge into the state, float64.
  stack_deviations<<<(unsigned)((p + c + t + 255) / 256), 256, 0, stream>>>(means, W, m, counts, h, s_.mean, p,
                                                                            s_.out_mean, c, s_.tgt_mean, t);
  LAUNCH_CHECK("stack_deviations");
  const int groups = m + 1;
  auto merge = [&](double* S, long long lds, const void* Sb, long long ldb, long long nf, long long ns,
                   const double* Df, const double* Ds, bool lower) {
    dim3 grid((unsigned)((nf + 31) / 32), (unsigned)((ns + 31) / 32));
    if (oes == 8)
      merge_groups<double><<<grid, dim3(32, 8), 0, stream>>>(S, lds, static_cast<const double*>(Sb), ldb, nf, ns,
                                                             Df, Ds, W, groups, lower);
    else
      merge_groups<float><<<grid, dim3(32, 8), 0, stream>>>(S, lds, static_cast<const float*>(Sb), ldb, nf, ns, Df,
                                                            Ds, W, groups, lower);
    LAUNCH_CHECK("merge_groups");
  };
  // (f, s) entries: M column-major lower (i, j) = (f, s); B row-major p x c
  // with the output index fast.
  merge(s_.M, p, Mp, ldM, p, p, means, means, true);
  if (c > 0) {
    merge(s_.B, c, Bp, ldB, c, p, means + p, means, false);
    merge(s_.A, c, Ap, ldA, c, c, means + p, means + p, true);
  }
  if (t > 0) {
    merge(s_.Bt, t, Btp, ldBt, t, p, means + p + c, means, false);
    merge(s_.At, t, Atp, ldAt, t, t, means + p + c, means + p + c, true);
  }
  stack_commit<<<1, 1, 0, stream>>>(h, counts, m);
  LAUNCH_CHECK("stack_commit");
}

void CudaMoments::flush_pending() {
  if (st_batches_ == 0) return;
  DeviceGuard g(device_);
  // The staged rows were written on the callers' streams (maybe several,
  // maybe gone by now): wait for all of them, then reduce on the legacy
  // default stream; every caller waits for the device afterwards.
  CUDA_CHECK(cudaDeviceSynchronize());
  flush_stage(0);
}

// ---- products -------------------------------------------------------------------

namespace {

void gemm_nt(cublasHandle_t hd, Precision prec, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
             const void* B, int64_t ldb, void* C, int64_t ldc) {
  const double one_d = 1.0, zero_d = 0.0;
  const float one_f = 1.0f, zero_f = 0.0f;
  const bool d = prec == Precision::fp64;
  CUBLAS_CHECK(cublasGemmEx(hd, CUBLAS_OP_N, CUBLAS_OP_T, (int)m, (int)n, (int)k, d ? (const void*)&one_d : &one_f, A,
                            in_type(prec), (int)lda, B, in_type(prec), (int)ldb, d ? (const void*)&zero_d : &zero_f,
                            C, out_type(prec), (int)ldc, compute_type(prec), CUBLAS_GEMM_DEFAULT));
}

// Lower triangle (column-major, ldc) of C = A A^T, A n x k column-major (lda).
void syrk_lower(cublasHandle_t hd, Precision prec, int64_t n, int64_t k, const void* A, int64_t lda, void* C,
                int64_t ldc) {
  if (prec == Precision::fp64) {
    const double one = 1.0, zero = 0.0;
    CUBLAS_CHECK(cublasDsyrk(hd, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)n, (int)k, &one,
                             static_cast<const double*>(A), (int)lda, &zero, static_cast<double*>(C), (int)ldc));
  } else if (prec == Precision::bf16) {
    gemm_nt(hd, prec, n, n, k, A, lda, A, lda, C, ldc);  // no bf16 syrk in cuBLAS
  } else {
    const float one = 1.0f, zero = 0.0f;
    if (prec == Precision::tf32) CUBLAS_CHECK(cublasSetMathMode(hd, CUBLAS_TF32_TENSOR_OP_MATH));
    const cublasStatus_t st = cublasSsyrk(hd, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)n, (int)k, &one,
                                          static_cast<const float*>(A), (int)lda, &zero, static_cast<float*>(C),
                                          (int)ldc);
    if (prec == Precision::tf32) CUBLAS_CHECK(cublasSetMathMode(hd, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(st);
  }
}

}  // namespace

Product CudaMoments::resolve(Precision prec, int64_t n) const {
  Product algo = algo_;
  // Defaults from benchmarks/gpu_check.py on an H200 (2026-11-30, p = 2048, batch 4096, head mode):
  // fp32 syrk 0.153 s vs gemm 0.234 s; tf32 gemm 0.065 s (tiles, block rows within 3%);
  // bf16 batched lower tiles of 512 0.031 s vs gemm 0.035 s.
  if (algo == Product::automatic)
    algo = (prec == Precision::fp64 || prec == Precision::fp32) ? Product::syrk
           : prec == Precision::bf16                            ? Product::tiles
                                                                : Product::gemm;
  const int64_t bs = block_;
  if (algo == Product::tiles && (prec == Precision::fp64 || n % bs != 0 || n / bs < 2)) algo = Product::block_rows;
  if (algo == Product::syrk && prec == Precision::bf16) algo = Product::gemm;
  return algo;
}

int64_t CudaMoments::rows_per_product(Precision prec, int64_t k) const {
  return (prec == Precision::fp32 && row_cap_ > 0) ? std::min<int64_t>(row_cap_, std::max<int64_t>(k, 1))
                                                   : std::max<int64_t>(k, 1);
}

size_t CudaMoments::product_size(Precision prec, int64_t k) const { return splits(prec, k) ? 8 : out_size(prec); }

void CudaMoments::product_lower(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst,
                                int64_t ldc, TileCache& tc, cudaStream_t stream) {
  const int64_t step = rows_per_product(prec, k);
  if (step >= k) {
    product_lower_once(prec, n, k, src, lda, dst, ldc, tc, stream);
    return;
  }
  // Row blocks of at most `step` rows, each multiplied into part_ and added
  // in float64 into dst (a double buffer: see splits()).
  const char* rows = static_cast<const char*>(src);
  for (int64_t r0 = 0; r0 < k; r0 += step) {
    product_lower_once(prec, n, std::min(step, k - r0), rows + r0 * lda * in_size(prec), lda, part_.ptr, ldc, tc,
                       stream);
    add_part(static_cast<double*>(dst), static_cast<const float*>(part_.ptr), n, n, ldc, true, r0 == 0, stream);
  }
}

void CudaMoments::product_lower_once(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst,
                                     int64_t ldc, TileCache& tc, cudaStream_t stream) {
  const size_t ies = in_size(prec), oes = out_size(prec);
  const char* xs = static_cast<const char*>(src);
  char* Mb = static_cast<char*>(dst);
  const Product algo = resolve(prec, n);
  const int64_t bs = block_;

  switch (algo) {
    case Product::syrk:
      syrk_lower(handle_, prec, n, k, xs, lda, Mb, ldc);
      break;
    case Product::gemm:
      gemm_nt(handle_, prec, n, n, k, xs, lda, xs, lda, Mb, ldc);
      break;
    case Product::block_rows:
      // Block-row i of the lower triangle: rows [r0, r0+rows), columns [0, r0+rows).
      for (int64_t r0 = 0; r0 < n; r0 += bs) {
        const int64_t rows = std::min(bs, n - r0);
        gemm_nt(handle_, prec, rows, r0 + rows, k, xs + r0 * ies, lda, xs, lda, Mb + r0 * oes, ldc);
      }
      break;
    case Product::tiles: {
      const long long nbt = n / bs, count = nbt * (nbt + 1) / 2;
      ensure(tc.ptrs, (size_t)count * 3 * sizeof(void*));
      const void** A = static_cast<const void**>(tc.ptrs.ptr);
      const void** B = A + count;
      void** C = const_cast<void**>(B + count);
      // Under a capture the kernel below is only recorded: it writes the
      // pointers when the graph runs, so the host cache is not marked valid
      // (an eager call before the first replay recomputes them). With
      // staging, the first per-batch product may well be a captured one.
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      const bool valid = tc.table == tc.ptrs.ptr && tc.src == src && tc.dst == dst && tc.n == n && tc.lda == lda &&
                         tc.ldc == ldc && tc.bs == bs && tc.es == ies;
      if (!valid) {
        tile_pointers<<<1, 256, 0, stream>>>(xs, Mb, ldc, bs, (long long)ies, (long long)oes, nbt, A, B, C);
        LAUNCH_CHECK("tile_pointers");
        if (capture == cudaStreamCaptureStatusNone) {
          tc.table = tc.ptrs.ptr;
          tc.src = src;
          tc.dst = dst;
          tc.n = n;
          tc.lda = lda;
          tc.ldc = ldc;
          tc.bs = bs;
          tc.es = ies;
        } else {
          tc.table = nullptr;
        }
      }
      const float one = 1.0f, zero = 0.0f;
      CUBLAS_CHECK(cublasGemmBatchedEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, (int)bs, (int)bs, (int)k, &one, A,
                                       in_type(prec), (int)lda, B, in_type(prec), (int)lda, &zero, C, out_type(prec),
                                       (int)ldc, (int)count, compute_type(prec), CUBLAS_GEMM_DEFAULT));
      break;
    }
    default:
      throw std::invalid_argument("unknown product algorithm");
  }
}

void CudaMoments::product_cross(Precision prec, int64_t k, int64_t w, const void* gs, int64_t ldg, const void* xs,
                                int64_t ldx, void* Bg, void* Ag, cudaStream_t s) {
  // B_g (p x w row-major = w x p column-major) = G_c^T X_c. Split into row
  // blocks as product_lower (Bg, Ag then double buffers).
  const int64_t step = rows_per_product(prec, k);
  const bool split = step < k;
  const size_t ies = in_size(prec);
  for (int64_t r0 = 0; r0 < k; r0 += step) {
    const int64_t kk = std::min(step, k - r0);
    const char* g = static_cast<const char*>(gs) + r0 * ldg * ies;
    const char* x = static_cast<const char*>(xs) + r0 * ldx * ies;
    gemm_nt(handle_, prec, w, p_, kk, g, ldg, x, ldx, split ? part_.ptr : Bg, w);
    if (split) add_part(static_cast<double*>(Bg), static_cast<const float*>(part_.ptr), w, p_, w, false, r0 == 0, s);
    void* a = split ? part_.ptr : Ag;
    // A_g by GEMM except in fp64: on an H200 cublasSsyrk took 360 us for a
    // 4096 x 1000 x 1000 product that a full GEMM does in about 165 us
    // (benchmarks/gpu_check.py, outputs mode, 2026-11-30).
    if (prec == Precision::fp64) syrk_lower(handle_, prec, w, kk, g, ldg, a, w);
    else gemm_nt(handle_, prec, w, w, kk, g, ldg, g, ldg, a, w);
    if (split) add_part(static_cast<double*>(Ag), static_cast<const float*>(part_.ptr), w, w, w, true, r0 == 0, s);
  }
}

// ---- synchronising calls ----------------------------------------------------------

void CudaMoments::sync_and_check() {
  DeviceGuard g(device_);
  flush_pending();  // staged rows join the state before anything reads it
  CUDA_CHECK(cudaDeviceSynchronize());
  if (!s_.hdr) return;
  settle_classes();  // rows of batches that were added, whatever else failed
  Header hh;
  CUDA_CHECK(cudaMemcpy(&hh, s_.hdr, sizeof(Header), cudaMemcpyDeviceToHost));
  if (hh.skipped == 0) return;
  // Clear the pending error first: the state itself is intact (bad batches
  // were skipped), so the object stays usable after the exception.
  CUDA_CHECK(cudaMemset(&s_.hdr->total_bad, 0, sizeof(hh.total_bad) + sizeof(hh.skipped)));
  CUDA_CHECK(cudaDeviceSynchronize());
  Msg os;
  os << hh.skipped << (hh.skipped == 1 ? " batch was" : " batches were") << " not added (checked on the device): ";
  const char* names[3] = {"features", "outputs", "targets"};
  bool first = true;
  for (int q = 0; q < 3; ++q)
    if (hh.total_bad[q]) {
      os << (first ? "" : "; ") << names[q] << " contain " << hh.total_bad[q] << " non-finite value"
         << (hh.total_bad[q] == 1 ? "" : "s") << " (NaN or Inf)";
      first = false;
    }
  if (hh.total_bad[3]) {
    os << (first ? "" : "; ") << "labels out of range: " << hh.total_bad[3] << " label"
       << (hh.total_bad[3] == 1 ? "" : "s");
    first = false;
    if (num_classes_ >= 0) os << " outside 0.." << num_classes_ - 1 << " (num_classes=" << num_classes_ << ")";
    else
      os << " negative or past " << class_growth_cap(p_) - 1
         << " (labels must be >= 0; without num_classes the class sums stop at 1 GiB)";
  }
  if (hh.total_bad[4]) {
    os << (first ? "" : "; ") << hh.total_bad[4] << " row" << (hh.total_bad[4] == 1 ? "" : "s")
       << " labelled past the class capacity did not fit the deferral buffer (" << defer_cap_
       << " rows between synchronising calls); pass num_classes to Moments";
  }
  throw std::invalid_argument(os.str());
}

int64_t CudaMoments::n() {
  sync_and_check();
  if (!s_.hdr) return 0;
  long long n = 0;
  DeviceGuard g(device_);
  CUDA_CHECK(cudaMemcpy(&n, &s_.hdr->n, sizeof(long long), cudaMemcpyDeviceToHost));
  return n;
}

void CudaMoments::reset() {
  DeviceGuard g(device_);
  CUDA_CHECK(cudaDeviceSynchronize());
  free_state();  // scratch is kept: it grows to fit whatever comes next
  st_rows_ = 0;  // staged rows are forgotten with the rest
  st_batches_ = 0;
  p_ = c_ = t_ = k_ = k_floor_ = -1;
  precision_ = Precision::fp64;
  have_last_stream_ = false;
}

namespace {

std::vector<double> fetch(const double* d, size_t count) {
  std::vector<double> v(count);
  if (count) CUDA_CHECK(cudaMemcpy(v.data(), d, count * 8, cudaMemcpyDeviceToHost));
  return v;
}

// Column-major lower triangle (device layout) -> full symmetric.
std::vector<double> fetch_symmetric(const double* d, int64_t n) {
  std::vector<double> raw = fetch(d, (size_t)(n * n));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) raw[j * n + i] = raw[i * n + j] = raw[j * n + i];
  return raw;
}

void put(double* d, const std::vector<double>& v) {
  if (!v.empty()) CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * 8, cudaMemcpyHostToDevice));
}

// Row-major lower triangle (host State) -> column-major lower (device).
void put_symmetric(double* d, const std::vector<double>& rowmajor_lower, int64_t n) {
  std::vector<double> t((size_t)(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) t[j * n + i] = rowmajor_lower[i * n + j];
  put(d, t);
}

}  // namespace

State CudaMoments::download() {
  sync_and_check();
  DeviceGuard g(device_);
  State s;
  s.num_classes = num_classes_;
  s.precision = precision_;
  if (p_ < 0) return s;
  Header hh;
  CUDA_CHECK(cudaMemcpy(&hh, s_.hdr, sizeof(Header), cudaMemcpyDeviceToHost));
  s.n = hh.n;
  s.p = p_;
  s.c = c_;
  s.t = t_;
  s.k = k_;
  const int64_t C = std::max<int64_t>(c_, 0), T = std::max<int64_t>(t_, 0), K = std::max<int64_t>(k_, 0);
  s.mean = fetch(s_.mean, p_);
  s.M = fetch_symmetric(s_.M, p_);
  s.out_mean = fetch(s_.out_mean, C);
  s.B = fetch(s_.B, p_ * C);
  s.A = fetch_symmetric(s_.A, C);
  s.tgt_mean = fetch(s_.tgt_mean, T);
  s.Bt = fetch(s_.Bt, p_ * T);
  s.At = fetch_symmetric(s_.At, T);
  s.class_counts.resize(K);
  if (K) CUDA_CHECK(cudaMemcpy(s.class_counts.data(), s_.class_counts, K * 8, cudaMemcpyDeviceToHost));
  s.class_sums = fetch(s_.class_sums, K * p_);
  if (hh.n == 0) {  // shaped by a batch that was skipped: report an empty state, as the CPU does
    State e;
    e.num_classes = num_classes_;
    return e;
  }
  return s;
}

void CudaMoments::upload(const State& s) {
  DeviceGuard g(device_);
  CUDA_CHECK(cudaDeviceSynchronize());
  free_all();
  p_ = c_ = t_ = k_ = k_floor_ = -1;
  have_last_stream_ = false;
  num_classes_ = s.num_classes;
  precision_ = s.precision;
  if (s.p < 0 || s.n == 0) return;
  shape(s.p, s.c, s.t, s.k);
  k_floor_ = k_;
  const long long n = s.n;
  CUDA_CHECK(cudaMemcpy(&s_.hdr->n, &n, sizeof(long long), cudaMemcpyHostToDevice));
  put(s_.mean, s.mean);
  put_symmetric(s_.M, s.M, s.p);
  put(s_.out_mean, s.out_mean);
  put(s_.B, s.B);
  if (s.c > 0) put_symmetric(s_.A, s.A, s.c);
  put(s_.tgt_mean, s.tgt_mean);
  put(s_.Bt, s.Bt);
  if (s.t > 0) put_symmetric(s_.At, s.At, s.t);
  if (s.k > 0) {
    CUDA_CHECK(cudaMemcpy(s_.class_counts, s.class_counts.data(), s.k * 8, cudaMemcpyHostToDevice));
    put(s_.class_sums, s.class_sums);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

void CudaMoments::export_to(const Targets& o) {
  sync_and_check();
  if (p_ < 0) return;
  DeviceGuard g(device_);
  auto copy = [](double* dst, const double* src, size_t count) {
    if (count && dst) CUDA_CHECK(cudaMemcpy(dst, src, count * 8, cudaMemcpyDeviceToDevice));
  };
  auto sym = [](double* dst, const double* src, int64_t n) {
    if (n <= 0 || !dst) return;
    const unsigned tiles = (unsigned)((n + 31) / 32);
    symmetrize<<<dim3(tiles, tiles), dim3(32, 8)>>>(src, n, dst);
    LAUNCH_CHECK("symmetrize");
  };
  const int64_t C = std::max<int64_t>(c_, 0), T = std::max<int64_t>(t_, 0), K = std::max<int64_t>(k_, 0);
  copy(o.mean, s_.mean, p_);
  sym(o.M, s_.M, p_);
  copy(o.out_mean, s_.out_mean, C);
  copy(o.B, s_.B, p_ * C);
  sym(o.A, s_.A, C);
  copy(o.tgt_mean, s_.tgt_mean, T);
  copy(o.Bt, s_.Bt, p_ * T);
  sym(o.At, s_.At, T);
  if (K && o.class_counts) CUDA_CHECK(cudaMemcpy(o.class_counts, s_.class_counts, K * 8, cudaMemcpyDeviceToDevice));
  copy(o.class_sums, s_.class_sums, K * p_);
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- merge of two states --------------------------------------------------------

void CudaMoments::merge(CudaMoments& other) {
  if (&other == this) {
    State s = download();
    CudaMoments tmp(num_classes_, device_);
    tmp.upload(s);
    merge(tmp);
    return;
  }
  sync_and_check();
  const int64_t on = other.n();  // raises the other's pending error, if any
  if (other.p_ < 0 || on == 0) return;
  if (other.device_ != device_) {
    CudaMoments tmp(other.num_classes_, device_);
    tmp.upload(other.download());
    merge(tmp);
    return;
  }
  const int64_t here = n();
  check_mergeable({here, p_, c_, t_, k_, num_classes_}, {on, other.p_, other.c_, other.t_, other.k_, other.num_classes_});
  if (p_ < 0 || here == 0) {
    DeviceGuard g(device_);
    CUDA_CHECK(cudaDeviceSynchronize());
    free_all();
    shape(other.p_, other.c_, other.t_, other.k_ < 0 ? -1 : std::max<int64_t>(other.k_, num_classes_));
  }
  merge_state_device(other, on);
}

void CudaMoments::merge_state_device(const CudaMoments& o, int64_t on) {
  DeviceGuard g(device_);
  cudaStream_t s = 0;
  if (o.k_ > cap_) grow_classes(o.k_);
  k_ = std::max(k_, o.k_);
  Header* h = s_.hdr;
  const long long p = p_;
  auto sym = [&](double* S, const double* Sb, long long n, const double* ma, const double* mb) {
    const unsigned tiles = (unsigned)((n + 31) / 32);
    merge_sym<double><<<dim3(tiles, tiles), dim3(32, 8), 0, s>>>(S, Sb, n, ma, mb, h, on, false);
    LAUNCH_CHECK("merge_sym");
  };
  auto cross = [&](double* Bs, const double* Bg, long long w, const double* ga, const double* gb) {
    merge_cross<double><<<dim3((unsigned)((w + 127) / 128), grid_y(p)), 128, 0, s>>>(Bs, Bg, p, w, s_.mean,
                                                                                      o.s_.mean, ga, gb, h, on, false);
    LAUNCH_CHECK("merge_cross");
  };
  sym(s_.M, o.s_.M, p, s_.mean, o.s_.mean);
  if (c_ > 0) {
    cross(s_.B, o.s_.B, c_, s_.out_mean, o.s_.out_mean);
    sym(s_.A, o.s_.A, c_, s_.out_mean, o.s_.out_mean);
  }
  if (t_ > 0) {
    cross(s_.Bt, o.s_.Bt, t_, s_.tgt_mean, o.s_.tgt_mean);
    sym(s_.At, o.s_.At, t_, s_.tgt_mean, o.s_.tgt_mean);
  }
  if (o.k_ > 0) {
    add_classes<<<1024, 256, 0, s>>>(s_.class_sums, s_.class_counts, o.s_.class_sums, o.s_.class_counts, o.k_, p);
    LAUNCH_CHECK("add_classes");
  }
  finalize<<<1, 1024, 0, s>>>(h, on, s_.mean, o.s_.mean, p, s_.out_mean, o.s_.out_mean, std::max<int64_t>(c_, 0),
                              s_.tgt_mean, o.s_.tgt_mean, std::max<int64_t>(t_, 0), false);
  LAUNCH_CHECK("finalize");
  CUDA_CHECK(cudaDeviceSynchronize());
  precision_ = std::max(precision_, o.precision_);
  have_last_stream_ = false;
  k_floor_ = std::max(k_floor_, k_);
}

// ---- facts ------------------------------------------------------------------------

std::string device_info(int device) {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int drv = 0, rt = 0;
  CUDA_CHECK(cudaDriverGetVersion(&drv));
  CUDA_CHECK(cudaRuntimeGetVersion(&rt));
  int cublas_version = 0;
  cublasHandle_t h = nullptr;
  {
    DeviceGuard g(device);
    CUBLAS_CHECK(cublasCreate(&h));
    cublasGetVersion(h, &cublas_version);
    cublasDestroy(h);
  }
  Msg os;
  os << prop.name << " (sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount << " SMs, "
     << (prop.totalGlobalMem >> 20) << " MiB), CUDA driver " << drv / 1000 << "." << (drv % 1000) / 10 << ", runtime "
     << rt / 1000 << "." << (rt % 1000) / 10 << ", cuBLAS " << cublas_version;
  return os.str();
}

std::string backend_info() {
  Msg os;
#ifndef RICHNESS_CUDA_ARCHS
#define RICHNESS_CUDA_ARCHS "?"
#endif
  os << "built for " << RICHNESS_CUDA_ARCHS << " with cuBLAS " << CUBLAS_VER_MAJOR << "." << CUBLAS_VER_MINOR << "."
     << CUBLAS_VER_PATCH << "; ";
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    os << "no usable GPU (" << (e != cudaSuccess ? cudaGetErrorString(e) : "no device") << ")";
    cudaGetLastError();
    return os.str();
  }
  try {
    os << count << " GPU" << (count == 1 ? "" : "s") << "; GPU 0: " << device_info(0);
  } catch (const std::exception& ex) {
    os << "GPU 0 unusable: " << ex.what();
  }
  return os.str();
}

}  // namespace cuda
}  // namespace richness
