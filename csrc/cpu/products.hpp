// A batch's co-moment products on the CPU: each formed once, from tiles that
// the worker threads share, each tile one single-threaded BLAS call.
//
// A symmetric product C = A^T A (A: k x n, row-major, centered) is needed in
// its lower triangle only: half a GEMM's arithmetic. The triangle is cut into
// one row band per worker, of equal area; a band is a GEMM (its part left of
// the diagonal) and a SYRK (its diagonal block), each a single-threaded BLAS
// call on the whole batch. With one worker that is one SYRK. The cross
// products (A^T B) are GEMMs cut into row bands of equal height.
//
// Why SYRK on the diagonal blocks and bands this large: OpenBLAS packs both
// operands of every call, so small tiles pay the packing many times (a 256 x
// 1024 GEMM tile over k = 4096 rows ran at 0.72x the rate of one SYRK of the
// whole triangle, single-threaded, SkylakeX and Haswell kernels alike), and
// OpenBLAS 0.3.34's SYRK runs its GEMM kernel over the triangle's blocks at
// about the GEMM's rate on these kernels (benchmarks/RESULTS.md, "CPU
// products at the BLAS limit"). The same holds on an AMD EPYC (Zen 4, where
// OpenBLAS picks its SkylakeX kernels): at p = 2048, k = 4096 these bands ran
// the triangle at 49 G multiply-adds/s on one thread (SGEMM: 51 G/s on the
// full square) and 98 G/s on two, where GEMM tilings (row panels with GEMM
// or SYRK diagonal blocks, square tiles, 128 to 512 rows) reached 69-91 G/s
// on two (RESULTS.md, "Tilings on an AMD EPYC"). So one rule serves both
// processors and nothing is chosen per machine.
//
// The workers take tiles largest first from one shared counter and write
// disjoint parts of one product, so there is one p x p product a batch
// (earlier, each worker formed a p x p partial over half the rows, and the
// merge added the partials: twice the scratch, and a second p x p read).
//
// Precision: each entry is one float32 (or float64) BLAS sum over all k rows
// of the batch, where the per-worker partials summed k / workers rows each
// and were added in float64. The float32 rounding of a k-term sum grows
// about like sqrt(k) eps32 relative to the sum of |terms|; the float32
// contract (DLR within 1e-6 of float64) is bounded by
// tests/finish/test_known_values.py, tests/finish/test_invariance.py and tests/engine/test_merge.py
// (float32 products against float64 references), and at batches of 4096 rows
// benchmarks/cpu_side_by_side.py prints |DLR - float64 reference|.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include <cblas.h>

#include "../common/parallel.hpp"

namespace richness {

// BLAS calls go through these wrappers. The scipy-openblas32 wheel's symbols
// carry a scipy_ prefix (CMakeLists.txt), hence scipy_cblas_*.

// C (m x n, row stride ldc) = A^T B for row-major A (k x m, stride lda) and
// B (k x n, stride ldb).
inline void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb,
                    0.0f, c, (int)ldc);
}
inline void gemm_tn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb,
                    double* c, int64_t ldc) {
  scipy_cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb,
                    0.0, c, (int)ldc);
}

// C (m x n, row stride ldc) = A B^T for row-major A (m x k) and B (n x k),
// strides lda and ldb: products of rows.
inline void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb,
                    0.0f, c, (int)ldc);
}
inline void gemm_nt(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb,
                    double* c, int64_t ldc) {
  scipy_cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1.0, a, (int)lda, b, (int)ldb,
                    0.0, c, (int)ldc);
}

// C (m x n) = A B for contiguous row-major A (m x k) and B (k x n).
inline void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, a, (int)k, b, (int)n,
                    0.0f, c, (int)n);
}
inline void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* c) {
  scipy_cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0, a, (int)k, b, (int)n,
                    0.0, c, (int)n);
}

// C (n x n, lower, row-major, row stride ldc) = A A^T for row-major A (n x k,
// stride lda): the Gram of rows.
inline void syrk_rows(int64_t n, int64_t k, const float* a, int64_t lda, float* c, int64_t ldc) {
  scipy_cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, (int)n, (int)k, 1.0f, a, (int)lda, 0.0f, c, (int)ldc);
}
inline void syrk_rows(int64_t n, int64_t k, const double* a, int64_t lda, double* c, int64_t ldc) {
  scipy_cblas_dsyrk(CblasRowMajor, CblasLower, CblasNoTrans, (int)n, (int)k, 1.0, a, (int)lda, 0.0, c, (int)ldc);
}

// One product to form: out (rows x cols, row-major, row stride ldc) = a^T b,
// where a holds rows columns and b cols columns of k row-major rows, lda and
// ldb elements apart; symmetric: b == a and only the lower triangle is needed.
template <typename T>
struct Product {
  const T* a;
  const T* b;
  int64_t lda, ldb;
  int64_t rows, cols;
  bool symmetric;
  T* out;
  int64_t ldc;
};

inline void syrk_lower(int64_t n, int64_t k, const float* a, int64_t lda, float* c, int64_t ldc) {
  scipy_cblas_ssyrk(CblasRowMajor, CblasLower, CblasTrans, (int)n, (int)k, 1.0f, a, (int)lda, 0.0f, c, (int)ldc);
}
inline void syrk_lower(int64_t n, int64_t k, const double* a, int64_t lda, double* c, int64_t ldc) {
  scipy_cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)n, (int)k, 1.0, a, (int)lda, 0.0, c, (int)ldc);
}

// Row bands of a rows-row product for `bands` workers' shares: equal areas
// of the lower triangle (band b starts at row rows sqrt(b / bands)) or of the
// rectangle, on multiples of 16 rows (64-byte aligned float columns).
inline int64_t band_start(int64_t rows, int64_t b, int64_t bands, bool symmetric) {
  if (b >= bands) return rows;
  const double share = (double)b / (double)bands;
  const int64_t r = (int64_t)std::llround((double)rows * (symmetric ? std::sqrt(share) : share) / 16.0) * 16;
  return std::min(rows, r);
}

// Forms every product over the k rows with up to `workers` threads.
template <typename T>
void shared_products(const std::vector<Product<T>>& products, int64_t k, int64_t workers) {
  struct Tile {
    const Product<T>* pr;
    int64_t r0, r1, c0, c1;
    bool syrk;
    double cost;
  };
  std::vector<Tile> tiles;
  const int64_t bands = std::max<int64_t>(1, workers);
  for (const Product<T>& pr : products) {
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t r0 = band_start(pr.rows, b, bands, pr.symmetric);
      const int64_t r1 = band_start(pr.rows, b + 1, bands, pr.symmetric);
      if (r1 <= r0) continue;
      if (!pr.symmetric) {
        tiles.push_back({&pr, r0, r1, 0, pr.cols, false, (double)(r1 - r0) * (double)pr.cols});
        continue;
      }
      if (r0 > 0) tiles.push_back({&pr, r0, r1, 0, r0, false, (double)(r1 - r0) * (double)r0});
      tiles.push_back({&pr, r0, r1, r0, r1, true, 0.5 * (double)(r1 - r0) * (double)(r1 - r0 + 1)});
    }
  }
  // Largest first, so the last tiles taken are small (the threads end together).
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& x, const Tile& y) { return x.cost > y.cost; });
  std::atomic<size_t> next{0};
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, (int64_t)tiles.size()));
  run_split(workers, [](int64_t w) { return w; }, [&](int64_t, int64_t, int64_t) {
    for (size_t i = next++; i < tiles.size(); i = next++) {
      const Tile& t = tiles[i];
      const Product<T>& pr = *t.pr;
      T* out = pr.out + t.r0 * pr.ldc + t.c0;
      if (t.syrk) syrk_lower(t.r1 - t.r0, k, pr.a + t.r0, pr.lda, out, pr.ldc);
      else gemm_tn(t.r1 - t.r0, t.c1 - t.c0, k, pr.a + t.r0, pr.lda, pr.b + t.c0, pr.ldb, out, pr.ldc);
    }
  });
}

}  // namespace richness
