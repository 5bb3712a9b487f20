// The memory-bound passes over a batch's float32 and float16 rows, in the
// widest vector instructions the processor has (AVX-512 or AVX2 on x86-64,
// chosen once when the module loads), row blocks at a time.
//
// Each gives the same bits as the plain loops of cpu_moments.cpp whatever the
// vector width: every column's float64 sum adds its rows one at a time, in
// their order; minima and maxima are exact; a centered value is the float64
// difference rounded once to float32. Only the columns are processed side by
// side. tests/engine/test_adapt.py compares every level against the plain loops.
#pragma once

#include <cstdint>

namespace richness {

// 0: the plain loops; 1: AVX2 (with F16C and FMA); 2: AVX-512 (F, VL).
int simd_level();
int simd_available();
// Lowers (or restores, up to simd_available()) the level used from now on;
// returns the level in force. For tests and benchmarks.
int set_simd_level(int level);

// Rows r0 <= i < r1 of a row-major float32 (f16 false) or float16 (f16 true)
// matrix at `base` with row stride ld elements, columns 0 <= j < cols:
// s[j] += x[i][j] in row order, lo[j] and hi[j] lowered and raised to the
// column's minimum and maximum. False (nothing done) at level 0.
bool fast_column_stats(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s,
                       double* lo, double* hi);

// The same, and the rows centered on `shift` into out (row i at out + i *
// out_ld): out = (float)((double)x - shift[j]) and sq[j] += that float64
// difference squared.
bool fast_column_stats_shifted(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1,
                               double* s, double* lo, double* hi, double* sq, const double* shift, float* out,
                               int64_t out_ld);

// The same sums without minima and maxima.
bool fast_column_sums(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, double* s);

// out[i * out_ld + j] = (float)((double)x[i][j] - mu[j]) for r0 <= i < r1.
bool fast_center_rows(const void* base, bool f16, int64_t ld, int64_t cols, int64_t r0, int64_t r1, const double* mu,
                      float* out, int64_t out_ld);

// s[j] += rows[k][j] for 0 <= k < count in that order, 0 <= j < cols (each
// row a pointer to its first column): a class's rows into its sums. fresh:
// s starts from 0.0 (its old contents are neither read nor kept).
bool fast_add_rows(const void* const* rows, bool f16, int64_t count, int64_t cols, double* s, bool fresh);

}  // namespace richness
