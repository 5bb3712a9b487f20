// What every translation unit of the CUDA backend shares: status checks, the
// device guard, element conversions, dispatch on element types, launch
// geometry and product element sizes. Header-only (inline), no kernels.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "../common/msg.hpp"
#include "cuda_moments.hpp"

namespace richness {
namespace cuda {

// ---- status checks ----------------------------------------------------------

inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  Msg os;
  os << "CUDA error in " << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ") at "
     << file << ":" << line;
  throw std::runtime_error(os.str());
}
inline void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  Msg os;
  os << "cuBLAS error in " << what << ": " << cublasGetStatusName(s) << " (" << cublasGetStatusString(s)
     << ") at " << file << ":" << line;
  throw std::runtime_error(os.str());
}
#define CUDA_CHECK(x) ::richness::cuda::check_cuda((x), #x, __FILE__, __LINE__)
#define CUBLAS_CHECK(x) ::richness::cuda::check_cublas((x), #x, __FILE__, __LINE__)
#define LAUNCH_CHECK(name) ::richness::cuda::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)

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

inline void* allocate(size_t bytes) {
  void* p = nullptr;
  if (bytes) CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

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

// Whether any device check marked the batch in progress bad.
__device__ __forceinline__ bool batch_is_bad(const Header* h) {
  long long any = 0;
#pragma unroll
  for (int q = 0; q < kBadKinds; ++q) any |= h->batch_bad[q];
  return any != 0;
}

// A bad batch's error counts (and its magnitude and range, for the message)
// join the totals reported at the next synchronising call. One thread.
__device__ __forceinline__ void count_skipped(Header* h) {
  for (int q = 0; q < kBadKinds; ++q) h->total_bad[q] += h->batch_bad[q];
  for (int q = 0; q < 3; ++q) {
    if (h->batch_bad[kBadOverflow + q]) h->total_magnitude[q] = fmax(h->total_magnitude[q], h->batch_magnitude[q]);
    if (h->batch_bad[kBadUnderflow + q]) h->total_range[q] = fmax(h->total_range[q], h->batch_range[q]);
  }
  h->skipped += 1;
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

// ---- product element types ------------------------------------------------------

// From the precision table (common/precision.hpp).
inline size_t in_size(Precision p) { return traits(p).input_bytes(); }
inline size_t out_size(Precision p) { return traits(p).product_bytes(); }

// Calls fn(T()) with T the device type of a precision's centered rows.
template <typename Fn>
void dispatch_input(Precision p, Fn&& fn) {
  switch (traits(p).input) {
    case DType::f64: fn(double()); break;
    case DType::bf16: fn(__nv_bfloat16()); break;
    case DType::f32: fn(float()); break;
    default: throw std::logic_error("precision table: no device type for this input type");
  }
}

// ---- classes ----------------------------------------------------------------------

// Capacity for k classes: doubling room, a power of two, within the cap.
inline int64_t class_capacity(int64_t k, int64_t p) {
  int64_t c = 64;
  while (c < 2 * k) c *= 2;
  return std::max(k, std::min(c, class_growth_cap(p)));
}

}  // namespace cuda
}  // namespace richness
