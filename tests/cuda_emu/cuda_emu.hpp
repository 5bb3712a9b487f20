// A CPU emulation of the parts of CUDA and cuBLAS that csrc/cuda uses, so
// that the CUDA backend compiles with g++ as host code and runs in the tests
// (tests/engine/test_cuda_emu.py). Never used for a real build.
//
// Model (stricter than a GPU where it is cheap to be, never looser):
//   - Device memory is host memory from mmap: poisoned with 0xFF on
//     allocation (NaN for floats, -1 for integers), its end against an
//     inaccessible guard page (a kernel writing past an allocation crashes),
//     slack up to the 256-byte rounding filled with a canary that is checked.
//   - Streams are queues. Kernels, memsets, async copies and cuBLAS calls are
//     enqueued, not run; they run at synchronising calls (cudaDeviceSynchronize,
//     cudaStreamSynchronize, cudaMemcpy to the host, cudaFree), in an order
//     that respects stream order, events and the legacy default stream's
//     implicit ordering, and is otherwise chosen at random (seeded): work on
//     two streams without an ordering interleaves. So the host sees a result
//     only after it synchronised, as on a GPU.
//   - A kernel runs its blocks one at a time (in random order); threads of a
//     block run as ucontext fibers with __syncthreads a real barrier when the
//     kernel contains __syncthreads (translate.py knows which), else as plain
//     calls, where a __syncthreads aborts. Atomics are plain read-modify-writes.
//   - cuBLAS: reference loops with column-major semantics, cuBLAS's argument
//     checks (CUBLAS_STATUS_INVALID_VALUE), and a check that every matrix lies
//     inside one allocation (recorded as an emulator error).
// Problems the emulator detects are recorded; the tests read them through the
// extern "C" functions at the end (ctypes on the built module).
#pragma once

#include <cmath>
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>

// ---- language -------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;

// One OS thread runs all emulated threads (the tests do not call the module
// from several threads at once), so these are plain globals set by the
// scheduler before each emulated thread runs.
inline dim3 threadIdx(0, 0, 0), blockIdx(0, 0, 0), blockDim(1, 1, 1), gridDim(1, 1, 1);

namespace emu {
void syncthreads(int line);  // barrier (fibers) or abort (plain calls)
}
#define __syncthreads() ::emu::syncthreads(__LINE__)

inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

inline double atomicAdd(double* p, double v) {
  const double old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline long long __double_as_longlong(double v) {
  long long r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
inline long long atomicMax(long long* p, long long v) {
  const long long old = *p;
  if (v > old) *p = v;
  return old;
}

// ---- half and bfloat16 (bit-exact storage and conversions) --------------------------

struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};

inline float __half2float(__half h) {
  const uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16;
  const uint32_t exp = (h.x >> 10) & 0x1f, man = h.x & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp((float)man, -24);  // zero or subnormal: exact
    uint32_t b;
    std::memcpy(&b, &f, 4);
    b |= sign;
    std::memcpy(&f, &b, 4);
    return f;
  }
  uint32_t b = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &b, 4);
  return f;
}

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t b = (uint32_t)h.x << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// float -> bfloat16, round to nearest even (NaN stays NaN).
inline __nv_bfloat16 emu_float2bfloat16_rn(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  __nv_bfloat16 r;
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    r.x = (unsigned short)((b >> 16) | 0x40);  // quiet NaN
    return r;
  }
  b += 0x7fffu + ((b >> 16) & 1u);
  r.x = (unsigned short)(b >> 16);
  return r;
}

// double -> bfloat16 in one rounding (round to nearest even), as CUDA's
// __double2bfloat16: via float rounded to odd (at least two extra bits, so
// the second rounding is correct), never via float rounded to nearest.
inline __nv_bfloat16 __double2bfloat16(double d) {
  if (std::isnan(d)) return emu_float2bfloat16_rn(std::numeric_limits<float>::quiet_NaN());
  float f = (float)d;
  if ((double)f != d && !std::isinf(d)) {
    if (std::fabs((double)f) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // truncation toward zero
    uint32_t b;
    std::memcpy(&b, &f, 4);
    b |= 1u;  // round to odd
    std::memcpy(&f, &b, 4);
  }
  return emu_float2bfloat16_rn(f);
}
inline __nv_bfloat16 __float2bfloat16(float f) { return emu_float2bfloat16_rn(f); }

// ---- CUDA runtime -------------------------------------------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotReady = 600,
  cudaErrorInvalidResourceHandle = 400,
};
typedef cudaError_t cudaError;

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int major, minor;
  int multiProcessorCount;
};

cudaError_t cudaMalloc(void** p, size_t bytes);
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t s = 0);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDriverGetVersion(int* v);
cudaError_t cudaRuntimeGetVersion(int* v);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);

// ---- cuBLAS -------------------------------------------------------------------------

#define CUBLAS_VER_MAJOR 13
#define CUBLAS_VER_MINOR 1
#define CUBLAS_VER_PATCH 0

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum cublasFillMode_t { CUBLAS_FILL_MODE_LOWER = 0, CUBLAS_FILL_MODE_UPPER = 1, CUBLAS_FILL_MODE_FULL = 2 };
enum cublasPointerMode_t { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 };
enum cublasMath_t {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
};
enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_16BF = 14,
};
typedef cudaDataType_t cudaDataType;
enum cublasComputeType_t {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
};
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 };

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t* h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode);
cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* ws, size_t bytes);
cublasStatus_t cublasGetVersion(cublasHandle_t h, int* v);
const char* cublasGetStatusName(cublasStatus_t s);
const char* cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* const A[], cudaDataType_t Atype, int lda,
                                   const void* const B[], cudaDataType_t Btype, int ldb, const void* beta,
                                   void* const C[], cudaDataType_t Ctype, int ldc, int batchCount,
                                   cublasComputeType_t compute, cublasGemmAlgo_t algo);
cublasStatus_t cublasDsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                           const double* alpha, const double* A, int lda, const double* beta, double* C, int ldc);
cublasStatus_t cublasSsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                           const float* alpha, const float* A, int lda, const float* beta, float* C, int ldc);

// ---- kernel launches (translate.py rewrites kernel<<<cfg>>>(args) into these) ---------

namespace emu {

// Runs `body` (one emulated thread: reads threadIdx etc.) for every thread of
// every block of the grid; `sync`: the kernel contains __syncthreads.
void run_grid(const char* name, bool sync, dim3 grid, dim3 block, const std::function<void()>& body);
// Validates the launch configuration (as the driver does) and enqueues the
// grid on `stream`; an invalid one sets the error cudaGetLastError returns.
void enqueue_kernel(const char* name, bool sync, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                    std::function<void()> grid_fn);

struct Launch {
  const char* name;
  bool sync;
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
  Launch(const char* name_, bool sync_, dim3 grid_, dim3 block_, size_t shmem_ = 0, cudaStream_t stream_ = 0)
      : name(name_), sync(sync_), grid(grid_), block(block_), shmem(shmem_), stream(stream_) {}
  // The arguments are evaluated and copied now (as a launch does); the
  // kernel runs when the stream gets to it.
  template <typename F, typename... A>
  void run(F f, A... args) {
    auto tup = std::make_tuple(args...);
    const char* nm = name;
    const bool sy = sync;
    const dim3 g = grid, b = block;
    enqueue_kernel(name, sync, grid, block, shmem, stream, [f, tup, nm, sy, g, b]() {
      run_grid(nm, sy, g, b, [&]() { std::apply(f, tup); });
    });
  }
};

}  // namespace emu

// ---- emulator inspection (for the tests, through ctypes) ------------------------------

extern "C" {
const char* emu_errors();         // problems detected so far, one per line ("" if none)
void emu_clear_errors();
long long emu_count(const char* name);  // launches of a kernel / calls of a cuBLAS function
void emu_reset_counts();
long long emu_pending();           // operations enqueued and not yet run
long long emu_host_syncs();        // calls that made the host wait for the device
void emu_set_schedule(int mode, unsigned seed);  // 0 fifo, 1 random (default)
void emu_register(void* p, size_t bytes);        // host memory the tests pass as device memory
void emu_unregister(void* p);
long long emu_live_allocations();
void emu_begin_capture(uintptr_t stream);  // work on `stream` is recorded from now
long long emu_end_capture();                // number of operations captured
void emu_replay();                          // enqueues the captured work once more
unsigned emu_double2bfloat16(double d);
float emu_half2float(unsigned bits);
}
