// Host launchers of the data kernels (kernels.cu). Each enqueues on stream
// `s` and returns at once; kernels given a Header read the batch's verdict
// from it (batch_bad) and leave the state alone for a bad batch where `check`.
#pragma once

#include "device_common.cuh"

namespace richness {
namespace cuda {

constexpr int kColTile = 32;    // columns per block (one warp across)
constexpr int kRowLanes = 8;    // warps per block, striding the rows
constexpr int kChunkRows = 256; // rows per block; partial sums per chunk

// The column partials (column_partials in kernels.cu): kPartials planes of
// chunks x cols doubles, chunks = ceil(rows / kChunkRows).
enum Partial { kSum = 0, kShiftedSum, kShiftedSquares, kShift, kMin, kMax, kPartials };

// Float64 column means of stream q (0 features, 1 outputs, 2 targets) of a
// batch m into mean, with its device checks: non-finite values (kind
// kBadNonFinite + q) and co-moments that would overflow the product type
// (part_max) or the merged float64 state (state_mean, state_S: the stream's
// state mean and symmetric block), kind kBadOverflow + q; its largest
// magnitude and column range into the header. partial: kPartials * chunks * cols doubles.
// With `fuse` (the per-batch path), the same pass also writes the rows centered
// on their chunk's mean, narrowed to fuse->prec, and column_means the chunks'
// deviations D for merge_groups (rows: 0 the state's, 1 + c chunk c's).
struct ChunkCentering {
  Precision prec;
  void* out;    // centered rows, row stride ldo
  long long ldo;
  double* D;    // (chunks + 1) rows of stride ldd
  long long ldd;
};
void launch_means(const Matrix& m, double* partial, double* mean, Header* h, int q, const double* state_mean,
                  const double* state_S, double part_max, const ChunkCentering* fuse, cudaStream_t s);
// After the means of every stream: spreads too small for the products (kind kBadUnderflow + q).
void launch_scale_verdict(Header* h, double tiny, cudaStream_t s);
// Centered rows of m in the product type into out (row stride ldo); a batch
// `zero_if_bad` marks bad is written as zeros (staging).
void launch_center(const Matrix& m, const double* mean, Precision prec, void* out, long long ldo,
                   const Header* zero_if_bad, cudaStream_t s);
// Float64 class sums and counts into the header's arrays (skipped for a bad
// batch if `check`); rows labelled past the capacity are left out.
void launch_class_sums(const Matrix& x, const Matrix& labels, const Header* h, bool check, cudaStream_t s);
// Labels outside 0..limit-1 make the batch bad; then the deferral reservation.
void launch_label_checks(const Matrix& labels, long long limit, Header* h, cudaStream_t s);
// Rows labelled past the capacity, copied into the deferral buffer.
void launch_defer_rows(const Matrix& x, const Matrix& labels, Header* h, cudaStream_t s);
// The largest label into h->batch_max (preset to -1 by the caller).
void launch_max_label(const Matrix& labels, Header* h, cudaStream_t s);
// Chan merges: S += Sb + f d d^T (lower triangle), B += Bb + f d e^T. `wide`:
// Sb/Bb are float64 (else float32).
void launch_merge_sym(double* S, const void* Sb, bool wide, long long n, const double* mean_a, const double* mean_b,
                      const Header* h, long long nb, bool check, cudaStream_t s);
void launch_merge_cross(double* B, const void* Bb, bool wide, long long p, long long w, const double* mu_a,
                        const double* mu_b, const double* nu_a, const double* nu_b, const Header* h, long long nb,
                        bool check, cudaStream_t s);
// S += Sb + sum_g Df_g Ds_g^T (float64), g < groups: entry (f, s) at
// S[s * lds + f] (f the fast index), Sb the product at Sb[s * ldb + f]
// (float64 if `wide`, else float32), Df/Ds rows of stride ldd; `lower`: only
// f >= s. Skipped for a batch `skip_if_bad` (nullable) marks bad.
void launch_merge_groups(double* S, long long lds, const void* Sb, bool wide, long long ldb, long long nfast,
                         long long nslow, const double* Df, const double* Ds, long long ldd, int groups, bool lower,
                         const Header* skip_if_bad, cudaStream_t s);
// Means and n after the merges (a bad batch only adds its error counts).
void launch_finalize(Header* h, long long nb, double* mean, const double* mb, long long p, double* om,
                     const double* ob, long long c, double* tm, const double* tb, long long t, bool check,
                     cudaStream_t s);
void launch_add_classes(double* sums, long long* counts, const double* osums, const long long* ocounts, long long ko,
                        long long p, cudaStream_t s);
// Full symmetric row-major copy of a column-major lower triangle (nothing for n <= 0 or no out).
void launch_symmetrize(const double* lower, long long n, double* out, cudaStream_t s);

}  // namespace cuda
}  // namespace richness
