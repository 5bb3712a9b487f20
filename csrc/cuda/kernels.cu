// The backend's data kernels: column means and the non-finite count, centering
// and narrowing, the float64 Chan merges, label checks and class sums, the
// symmetric export. Each has a host launcher (kernels.cuh) that enqueues it on
// a stream; nothing here waits for the device. The products' kernels are in
// products.cu, the stage's in staging.cu.
#include "kernels.cuh"

#include <cfloat>

namespace richness {
namespace cuda {

namespace {

// One chunk's block reduction, shared by column_partials and center_partials:
// the per-thread sums (s, ds, dq) and extremes (lo, hi) of column col are
// reduced over the block's row lanes and written to the partial planes; with
// chunk_mean, the chunk's mean of each column goes there too (as column_means
// derives it). Every thread of the block calls it (it synchronises), and on
// return sh and chunk_mean may be rewritten by the caller's next chunk only
// after the caller's own reads of chunk_mean and a barrier.
template <typename Tin>
__device__ void store_chunk(double (&sh)[3][kRowLanes][kColTile + 1], double* chunk_mean, double s, double ds,
                            double dq, double lo, double hi, const Tin* __restrict__ x, long long ld, long long r0,
                            long long r1, long long col, long long cols, long long chunk, long long plane,
                            double* __restrict__ partial) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  sh[0][ty][tx] = s;
  sh[1][ty][tx] = ds;
  sh[2][ty][tx] = dq;
  __syncthreads();
  if (ty == 0 && col < cols) {
    double acc[3] = {0.0, 0.0, 0.0};
#pragma unroll
    for (int k = 0; k < kRowLanes; ++k)
      for (int a = 0; a < 3; ++a) acc[a] += sh[a][k][tx];
    partial[kSum * plane + chunk * cols + col] = acc[0];
    partial[kShiftedSum * plane + chunk * cols + col] = acc[1];
    partial[kShiftedSquares * plane + chunk * cols + col] = acc[2];
    partial[kShift * plane + chunk * cols + col] = to_double(x[r0 * ld + col]);
    if (chunk_mean) chunk_mean[tx] = acc[0] / (double)(r1 - r0);
  }
  __syncthreads();  // sh is rewritten below
  sh[0][ty][tx] = lo;
  sh[1][ty][tx] = hi;
  __syncthreads();
  if (ty == 0 && col < cols) {
    double mn = INFINITY, mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < kRowLanes; ++k) {
      mn = fmin(mn, sh[0][k][tx]);
      mx = fmax(mx, sh[1][k][tx]);
    }
    partial[kMin * plane + chunk * cols + col] = mn;
    partial[kMax * plane + chunk * cols + col] = mx;
  }
  __syncthreads();  // sh is rewritten by the caller's next chunk
}

// Per row chunk and column, float64: the sum (the mean's), the sum and sum of
// squares of the values less the chunk's first one (a shift inside the data,
// so the chunk's co-moment diagonal comes out without cancellation), the
// minimum and the maximum; and the count of non-finite values (the device's
// version of the CPU's finiteness check). Fixed order (partials, then
// column_means) keeps the mean deterministic. `partial` holds kPartials
// arrays of chunks x cols, in the order of the Partial enum.
template <typename Tin>
__global__ void column_partials(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                                double* __restrict__ partial, unsigned long long* bad) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long col = (long long)blockIdx.x * kColTile + tx;
  const long long chunks = (rows + kChunkRows - 1) / kChunkRows;
  const long long plane = chunks * cols;
  __shared__ double sh[3][kRowLanes][kColTile + 1];
  unsigned long long nbad = 0;
  // grid.y is capped at 65535: a block takes every gridDim.y-th chunk (one
  // chunk per block below 16.7M rows). The loop bounds are block-uniform.
  for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const long long r0 = chunk * kChunkRows;
    const long long r1 = min(rows, r0 + kChunkRows);
    double s = 0.0, ds = 0.0, dq = 0.0, lo = INFINITY, hi = -INFINITY;
    if (col < cols) {
      const double shift = to_double(x[r0 * ld + col]);
      for (long long r = r0 + ty; r < r1; r += kRowLanes) {
        const double v = to_double(x[r * ld + col]);
        s += v;
        ds += v - shift;
        dq += (v - shift) * (v - shift);
        lo = fmin(lo, v);
        hi = fmax(hi, v);
        nbad += !isfinite(v);
      }
    }
    store_chunk(sh, nullptr, s, ds, dq, lo, hi, x, ld, r0, r1, col, cols, chunk, plane, partial);
  }
  if (nbad) atomicAdd(bad, nbad);
}

// column_partials fused with the centering (the per-batch path: one read of
// the batch). Each thread keeps its rows of the chunk in registers, so the
// chunk's mean is known before anything is written: rows are centered on
// their chunk's mean (in float64, then narrowed to Tout, row stride ldo) and
// the chunks' offsets from the batch mean are added back in float64 at the
// merge (column_means writes them, merge_groups adds them). Same partials,
// same order of additions as column_partials.
template <typename Tin, typename Tout>
__global__ void center_partials(const Tin* __restrict__ x, long long rows, long long cols, long long ld,
                                double* __restrict__ partial, unsigned long long* bad, Tout* __restrict__ out,
                                long long ldo) {
  constexpr int kPer = kChunkRows / kRowLanes;  // rows per thread and chunk
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long col = (long long)blockIdx.x * kColTile + tx;
  const long long chunks = (rows + kChunkRows - 1) / kChunkRows;
  const long long plane = chunks * cols;
  __shared__ double sh[3][kRowLanes][kColTile + 1];
  __shared__ double chunk_mean[kColTile];
  unsigned long long nbad = 0;
  for (long long chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const long long r0 = chunk * kChunkRows;
    const long long r1 = min(rows, r0 + kChunkRows);
    double v[kPer];
    double s = 0.0, ds = 0.0, dq = 0.0, lo = INFINITY, hi = -INFINITY;
    if (col < cols) {
      const double shift = to_double(x[r0 * ld + col]);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const long long r = r0 + ty + (long long)i * kRowLanes;
        v[i] = 0.0;
        if (r < r1) {
          v[i] = to_double(x[r * ld + col]);
          s += v[i];
          ds += v[i] - shift;
          dq += (v[i] - shift) * (v[i] - shift);
          lo = fmin(lo, v[i]);
          hi = fmax(hi, v[i]);
          nbad += !isfinite(v[i]);
        }
      }
    }
    store_chunk(sh, chunk_mean, s, ds, dq, lo, hi, x, ld, r0, r1, col, cols, chunk, plane, partial);
    if (col < cols) {
      const double m = chunk_mean[tx];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const long long r = r0 + ty + (long long)i * kRowLanes;
        if (r < r1) out[r * ldo + col] = from_double<Tout>(v[i] - m);
      }
    }
    __syncthreads();  // sh and chunk_mean are rewritten by the next chunk
  }
  if (nbad) atomicAdd(bad, nbad);
}

// The batch's float64 column means, and its scale checks (the CPU's rules,
// csrc/cpu: overflow_of and the underflow check): the batch's co-moment
// diagonal d_j = sum_r (x_rj - mean_j)^2, from the chunks' shifted sums
// without cancellation, must fit the product type (part_max: a quarter of its
// largest value), and the merged diagonal state_j + d_j + f (mean_j -
// state_mean_j)^2 a quarter of float64's. By Cauchy-Schwarz the diagonals
// bound every entry, cross blocks included. A column that breaks a rule makes
// the batch bad (kind kBadOverflow + q); the largest |value| and column range
// go to the header for the message and the underflow verdict. Skipped for a
// stream with non-finite values (already bad, as on the CPU).
__global__ void column_means(const double* __restrict__ partial, long long chunks, long long cols, long long rows,
                             double* __restrict__ mean, Header* h, int q, const unsigned long long* bad,
                             const double* __restrict__ state_mean, const double* __restrict__ state_S,
                             double part_max, double* __restrict__ D, long long ldd) {
  const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const long long plane = chunks * cols;
  double acc = 0.0;
  for (long long c = 0; c < chunks; ++c) acc += partial[kSum * plane + c * cols + col];
  const double m = acc * (1.0 / (double)rows);
  mean[col] = m;
  if (D) {
    // Rows centered on their chunks' means (center_partials): the merge adds
    // sum_g D_g D_g^T with D_0 = sqrt(f) (mean - state mean) (Chan's term)
    // and D_c = sqrt(n_c) (chunk mean - mean) (parallel axes).
    const double na = (double)h->n, nb = (double)rows;
    D[col] = na > 0 ? sqrt(na * nb / (na + nb)) * (m - state_mean[col]) : 0.0;
    for (long long c = 0; c < chunks; ++c) {
      const long long nc = min((long long)kChunkRows, rows - c * kChunkRows);
      D[(1 + c) * ldd + col] = sqrt((double)nc) * (partial[kSum * plane + c * cols + col] / (double)nc - m);
    }
  }
  if (*bad) return;
  double diag = 0.0, lo = INFINITY, hi = -INFINITY;
  for (long long c = 0; c < chunks; ++c) {
    const double nc = (double)min((long long)kChunkRows, rows - c * kChunkRows);
    const double ds = partial[kShiftedSum * plane + c * cols + col];
    const double mc = partial[kShift * plane + c * cols + col] + ds / nc;  // the chunk's mean
    // the chunk's own co-moment, then its mean's offset from the batch's (parallel axes)
    diag += (partial[kShiftedSquares * plane + c * cols + col] - ds * ds / nc) + nc * (mc - m) * (mc - m);
    lo = fmin(lo, partial[kMin * plane + c * cols + col]);
    hi = fmax(hi, partial[kMax * plane + c * cols + col]);
  }
  const double na = (double)h->n, nb = (double)rows;
  const double f = na > 0 ? na * nb / (na + nb) : 0.0;
  const double d = na > 0 ? m - state_mean[col] : 0.0;
  const double merged = (na > 0 ? state_S[col * cols + col] : 0.0) + diag + f * d * d;
  if (!(diag <= part_max) || !(merged <= DBL_MAX / 4))
    atomicAdd(reinterpret_cast<unsigned long long*>(&h->batch_bad[kBadOverflow + q]), 1ull);
  // non-negative doubles order as their bit patterns
  atomicMax(reinterpret_cast<long long*>(&h->batch_magnitude[q]), __double_as_longlong(fmax(fabs(lo), fabs(hi))));
  atomicMax(reinterpret_cast<long long*>(&h->batch_range[q]), __double_as_longlong(hi - lo));
}

// After every stream's means: a spread whose squares fall below the product
// type's normal range (0 < largest column range < tiny) would be lost in the
// products; the batch is refused, as on the CPU.
__global__ void scale_verdict(Header* h, double tiny) {
  for (int q = 0; q < 3; ++q) {
    if (h->batch_bad[kBadNonFinite + q] || h->batch_bad[kBadOverflow + q]) continue;
    const double r = h->batch_range[q];
    if (r > 0.0 && r < tiny) h->batch_bad[kBadUnderflow + q] = 1;
  }
}

// Centered copy in the product type (row stride ldo). The subtraction is in
// float64, before the narrowing (docs/MATH.md, precision: mean 1e4 with spread 1e-2 survives
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
    if (threadIdx.x == 0) count_skipped(h);
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
// S += Sb + sum_g Df_g Ds_g^T over 32 x 32 tiles, g = 0..groups-1 (float64).
// S[s * lds + f] is the entry (f, s) (f the fast, coalesced index); Sb the
// product at the same entry with stride ldb; Df/Ds rows of stride ldd.
// `lower`: only f >= s (symmetric blocks, column-major lower triangle).
// `skip_if_bad` (nullable): the header whose verdict on the batch is read.
template <typename Tb>
__global__ void merge_groups(double* __restrict__ S, long long lds, const Tb* __restrict__ Sb, long long ldb,
                             long long nfast, long long nslow, const double* __restrict__ Df,
                             const double* __restrict__ Ds, long long ldd, int groups, bool lower,
                             const Header* skip_if_bad) {
  if (skip_if_bad && batch_is_bad(skip_if_bad)) return;
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

}  // namespace

// ---- launchers ----------------------------------------------------------------

void launch_means(const Matrix& m, double* partial, double* mean, Header* h, int q, const double* state_mean,
                  const double* state_S, double part_max, const ChunkCentering* fuse, cudaStream_t s) {
  const long long chunks = (m.rows + kChunkRows - 1) / kChunkRows;
  unsigned long long* bad = reinterpret_cast<unsigned long long*>(&h->batch_bad[kBadNonFinite + q]);
  dim3 grid((unsigned)((m.cols + kColTile - 1) / kColTile), grid_y(chunks)), block(kColTile, kRowLanes);
  dispatch_float(m.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(m.ptr);
    if (!fuse) {
      column_partials<T><<<grid, block, 0, s>>>(x, m.rows, m.cols, m.ld, partial, bad);
      return;
    }
    dispatch_input(fuse->prec, [&](auto out_tag) {
      using Out = decltype(out_tag);
      center_partials<T, Out><<<grid, block, 0, s>>>(x, m.rows, m.cols, m.ld, partial, bad,
                                                      static_cast<Out*>(fuse->out), fuse->ldo);
    });
  });
  LAUNCH_CHECK(fuse ? "center_partials" : "column_partials");
  column_means<<<(unsigned)((m.cols + 255) / 256), 256, 0, s>>>(partial, chunks, m.cols, m.rows, mean, h, q, bad,
                                                                state_mean, state_S, part_max,
                                                                fuse ? fuse->D : nullptr, fuse ? fuse->ldd : 0);
  LAUNCH_CHECK("column_means");
}

void launch_scale_verdict(Header* h, double tiny, cudaStream_t s) {
  scale_verdict<<<1, 1, 0, s>>>(h, tiny);
  LAUNCH_CHECK("scale_verdict");
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


void launch_center(const Matrix& m, const double* mean, Precision prec, void* out, long long ldo,
                   const Header* zero_if_bad, cudaStream_t s) {
  dim3 grid((unsigned)((m.cols + 255) / 256), grid_y(m.rows));
  dispatch_float(m.dtype, [&](auto tag) {
    using Tin = decltype(tag);
    const Tin* x = static_cast<const Tin*>(m.ptr);
    dispatch_input(prec, [&](auto out_tag) {
      using Out = decltype(out_tag);
      center<Tin, Out><<<grid, 256, 0, s>>>(x, m.rows, m.cols, m.ld, mean, static_cast<Out*>(out), ldo,
                                           zero_if_bad);
    });
  });
  LAUNCH_CHECK("center");
}


void launch_label_checks(const Matrix& labels, long long limit, Header* h, cudaStream_t s) {
  const long long nb = labels.rows;
  dispatch_int(labels.dtype, [&](auto tag) {
    using Ti = decltype(tag);
    check_labels<Ti><<<(unsigned)std::min<long long>(1024, (nb + 255) / 256), 256, 0, s>>>(
        static_cast<const Ti*>(labels.ptr), nb, labels.ld, limit, h);
  });
  LAUNCH_CHECK("check_labels");
  defer_reserve<<<1, 1, 0, s>>>(h);  // last: reads every check's verdict
  LAUNCH_CHECK("defer_reserve");
}

void launch_defer_rows(const Matrix& x, const Matrix& labels, Header* h, cudaStream_t s) {
  dispatch_float(x.dtype, [&](auto xt) {
    using Tin = decltype(xt);
    dispatch_int(labels.dtype, [&](auto yt) {
      using Ti = decltype(yt);
      defer_rows<Tin, Ti><<<dim3(1, grid_y(x.rows)), 256, 0, s>>>(static_cast<const Tin*>(x.ptr), x.rows, x.cols,
                                                                  x.ld, static_cast<const Ti*>(labels.ptr),
                                                                  labels.ld, h);
    });
  });
  LAUNCH_CHECK("defer_rows");
}

void launch_max_label(const Matrix& labels, Header* h, cudaStream_t s) {
  const long long nb = labels.rows;
  dispatch_int(labels.dtype, [&](auto tag) {
    using Ti = decltype(tag);
    max_label<Ti><<<(unsigned)std::min<long long>(1024, (nb + 255) / 256), 256, 0, s>>>(
        static_cast<const Ti*>(labels.ptr), nb, labels.ld, h);
  });
  LAUNCH_CHECK("max_label");
}

void launch_merge_sym(double* S, const void* Sb, bool wide, long long n, const double* mean_a, const double* mean_b,
                      const Header* h, long long nb, bool check, cudaStream_t s) {
  const unsigned tiles = (unsigned)((n + 31) / 32);
  if (wide)
    merge_sym<double><<<dim3(tiles, tiles), dim3(32, 8), 0, s>>>(S, static_cast<const double*>(Sb), n, mean_a, mean_b,
                                                                h, nb, check);
  else
    merge_sym<float><<<dim3(tiles, tiles), dim3(32, 8), 0, s>>>(S, static_cast<const float*>(Sb), n, mean_a, mean_b,
                                                               h, nb, check);
  LAUNCH_CHECK("merge_sym");
}

void launch_merge_cross(double* B, const void* Bb, bool wide, long long p, long long w, const double* mu_a,
                        const double* mu_b, const double* nu_a, const double* nu_b, const Header* h, long long nb,
                        bool check, cudaStream_t s) {
  dim3 grid((unsigned)((w + 127) / 128), grid_y(p));
  if (wide)
    merge_cross<double><<<grid, 128, 0, s>>>(B, static_cast<const double*>(Bb), p, w, mu_a, mu_b, nu_a, nu_b, h, nb,
                                             check);
  else
    merge_cross<float><<<grid, 128, 0, s>>>(B, static_cast<const float*>(Bb), p, w, mu_a, mu_b, nu_a, nu_b, h, nb,
                                            check);
  LAUNCH_CHECK("merge_cross");
}

void launch_finalize(Header* h, long long nb, double* mean, const double* mb, long long p, double* om,
                     const double* ob, long long c, double* tm, const double* tb, long long t, bool check,
                     cudaStream_t s) {
  finalize<<<1, 1024, 0, s>>>(h, nb, mean, mb, p, om, ob, c, tm, tb, t, check);
  LAUNCH_CHECK("finalize");
}

void launch_add_classes(double* sums, long long* counts, const double* osums, const long long* ocounts, long long ko,
                        long long p, cudaStream_t s) {
  add_classes<<<1024, 256, 0, s>>>(sums, counts, osums, ocounts, ko, p);
  LAUNCH_CHECK("add_classes");
}

void launch_symmetrize(const double* lower, long long n, double* out, cudaStream_t s) {
  if (n <= 0 || !out) return;
  const unsigned tiles = (unsigned)((n + 31) / 32);
  symmetrize<<<dim3(tiles, tiles), dim3(32, 8), 0, s>>>(lower, n, out);
  LAUNCH_CHECK("symmetrize");
}

void launch_merge_groups(double* S, long long lds, const void* Sb, bool wide, long long ldb, long long nfast,
                         long long nslow, const double* Df, const double* Ds, long long ldd, int groups, bool lower,
                         const Header* skip_if_bad, cudaStream_t s) {
  dim3 grid((unsigned)((nfast + 31) / 32), (unsigned)((nslow + 31) / 32));
  if (wide)
    merge_groups<double><<<grid, dim3(32, 8), 0, s>>>(S, lds, static_cast<const double*>(Sb), ldb, nfast, nslow, Df,
                                                      Ds, ldd, groups, lower, skip_if_bad);
  else
    merge_groups<float><<<grid, dim3(32, 8), 0, s>>>(S, lds, static_cast<const float*>(Sb), ldb, nfast, nslow, Df, Ds,
                                                     ldd, groups, lower, skip_if_bad);
  LAUNCH_CHECK("merge_groups");
}

}  // namespace cuda
}  // namespace richness
