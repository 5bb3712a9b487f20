// The products: X^T X (lower triangle) and the cross blocks by cuBLAS, the
// algorithm for each (resolve, and its measurement: measure, collect_timings), the fp32 row-block split with its float64 sum,
// and the pointer tables of the batched lower-tile product.
#include "device_common.cuh"

#include <map>
#include <mutex>
#include <tuple>

namespace richness {
namespace cuda {

namespace {

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

void add_part(double* dst, const float* part, long long m, long long n, long long ld, bool lower, bool first,
              cudaStream_t s) {
  add_part_kernel<<<dim3((unsigned)((m + 255) / 256), grid_y(n)), 256, 0, s>>>(dst, part, m, n, ld, lower, first);
  LAUNCH_CHECK("add_part");
}

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::f64: return CUDA_R_64F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}
cudaDataType_t in_type(Precision p) { return cuda_type(traits(p).input); }
cudaDataType_t out_type(Precision p) { return cuda_type(traits(p).product); }
// From the precision table. fp32: no tensor cores (the handle stays in
// CUBLAS_DEFAULT_MATH, which never picks TF32 for CUBLAS_COMPUTE_32F). tf32:
// tensor cores with fp32 accumulation, bounded by the tf32 tests (DLR within
// 1e-3). bf16: bf16 inputs, fp32 accumulation (DLR within 5e-3).
cublasComputeType_t compute_type(Precision p) {
  switch (traits(p).accumulate) {
    case Accumulate::f64: return CUBLAS_COMPUTE_64F;
    case Accumulate::tf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case Accumulate::f32: return CUBLAS_COMPUTE_32F;
  }
  return CUBLAS_COMPUTE_32F;
}

void gemm_nt(cublasHandle_t hd, Precision prec, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
             const void* B, int64_t ldb, void* C, int64_t ldc) {
  const double one_d = 1.0, zero_d = 0.0;
  const float one_f = 1.0f, zero_f = 0.0f;
  const bool d = traits(prec).accumulate == Accumulate::f64;  // alpha and beta in the compute type
  CUBLAS_CHECK(cublasGemmEx(hd, CUBLAS_OP_N, CUBLAS_OP_T, (int)m, (int)n, (int)k, d ? (const void*)&one_d : &one_f, A,
                            in_type(prec), (int)lda, B, in_type(prec), (int)ldb, d ? (const void*)&zero_d : &zero_f,
                            C, out_type(prec), (int)ldc, compute_type(prec), CUBLAS_GEMM_DEFAULT));
}

// Lower triangle (column-major, ldc) of C = A A^T, A n x k column-major (lda).
void syrk_lower(cublasHandle_t hd, Precision prec, int64_t n, int64_t k, const void* A, int64_t lda, void* C,
                int64_t ldc) {
  const PrecisionTraits& tr = traits(prec);
  if (tr.input == DType::f64) {
    const double one = 1.0, zero = 0.0;
    CUBLAS_CHECK(cublasDsyrk(hd, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)n, (int)k, &one,
                             static_cast<const double*>(A), (int)lda, &zero, static_cast<double*>(C), (int)ldc));
  } else if (tr.input != DType::f32) {
    gemm_nt(hd, prec, n, n, k, A, lda, A, lda, C, ldc);  // no bf16 syrk in cuBLAS
  } else {
    const float one = 1.0f, zero = 0.0f;
    const bool tf32 = tr.accumulate == Accumulate::tf32;
    if (tf32) CUBLAS_CHECK(cublasSetMathMode(hd, CUBLAS_TF32_TENSOR_OP_MATH));
    const cublasStatus_t st = cublasSsyrk(hd, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)n, (int)k, &one,
                                          static_cast<const float*>(A), (int)lda, &zero, static_cast<float*>(C),
                                          (int)ldc);
    if (tf32) CUBLAS_CHECK(cublasSetMathMode(hd, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(st);
  }
}

}  // namespace

Product default_product(Precision prec) {
  // From benchmarks/gpu_check.py on an H200 (2026-11-30, p = 2048, batch 4096, head mode):
  // fp32 syrk 0.153 s vs gemm 0.234 s; tf32 gemm 0.065 s (tiles, block rows within 3%);
  // bf16 batched lower tiles of 512 0.031 s vs gemm 0.035 s.
  return (prec == Precision::fp64 || prec == Precision::fp32) ? Product::syrk
         : prec == Precision::bf16                            ? Product::tiles
                                                              : Product::gemm;
}

namespace {

constexpr std::pair<Product, const char*> kProductNames[] = {
    {Product::automatic, "auto"}, {Product::syrk, "syrk"}, {Product::gemm, "gemm"},
    {Product::block_rows, "block_rows"}, {Product::tiles, "tiles"}};

// The process-wide table of measured choices. An entry without `done` is a
// measurement in flight (claimed by one object; others use the default).
struct ShapeKey {
  int device;
  int prec;
  int64_t n, k;
  int block;
  bool operator<(const ShapeKey& o) const {
    return std::tie(device, prec, n, k, block) < std::tie(o.device, o.prec, o.n, o.k, o.block);
  }
};
struct Measured {
  bool done = false;
  Product product = Product::automatic;
  std::vector<std::pair<Product, double>> ms;
};
std::mutex g_table_mu;
std::map<ShapeKey, Measured> g_table;

}  // namespace

Product product_from_name(const std::string& name) {
  for (const auto& [p, n] : kProductNames)
    if (name == n) return p;
  throw std::invalid_argument("product must be auto, syrk, gemm, block_rows or tiles, got " + name);
}

const char* product_name(Product p) {
  for (const auto& [q, n] : kProductNames)
    if (p == q) return n;
  return "?";
}

std::vector<MeasuredProduct> measured_products() {
  std::lock_guard<std::mutex> lock(g_table_mu);
  std::vector<MeasuredProduct> out;
  for (const auto& [key, m] : g_table)
    if (m.done) out.push_back({key.device, (Precision)key.prec, key.n, key.k, key.block, m.product, m.ms});
  return out;
}

void clear_measured_products() {
  std::lock_guard<std::mutex> lock(g_table_mu);
  g_table.clear();
}

Product CudaMoments::applicable(Product algo, Precision prec, int64_t n) const {
  const int64_t bs = block_;
  if (algo == Product::tiles && (prec == Precision::fp64 || n % bs != 0 || n / bs < 2)) algo = Product::block_rows;
  if (algo == Product::syrk && prec == Precision::bf16) algo = Product::gemm;
  return algo;
}

Product CudaMoments::resolve(Precision prec, int64_t n, int64_t k) const {
  Product algo = algo_;
  if (algo == Product::automatic) {
    algo = default_product(prec);
    std::lock_guard<std::mutex> lock(g_table_mu);
    const auto it = g_table.find({device_, (int)prec, n, k, block_});
    if (it != g_table.end() && it->second.done) algo = it->second.product;
  }
  return applicable(algo, prec, n);
}

void CudaMoments::measure(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst,
                          int64_t ldc, TileCache& tc, cudaStream_t stream) {
  Timing t;
  t.n = n, t.k = k, t.prec = prec, t.block = block_;
  const Product last = applicable(default_product(prec), prec, n);
  for (Product c : {Product::syrk, Product::gemm, Product::block_rows, Product::tiles}) {
    const Product a = applicable(c, prec, n);
    if (a != last && std::find(t.candidates.begin(), t.candidates.end(), a) == t.candidates.end())
      t.candidates.push_back(a);
  }
  t.candidates.push_back(last);
  try {
    t.events.resize(2 * t.candidates.size() + 1, nullptr);
    for (cudaEvent_t& e : t.events) CUDA_CHECK(cudaEventCreate(&e));
    size_t e = 0;
    CUDA_CHECK(cudaEventRecord(t.events[e++], stream));
    for (int round = 0; round < 2; ++round)
      for (Product c : t.candidates) {
        run_product(c, prec, n, k, src, lda, dst, ldc, tc, false, stream);
        CUDA_CHECK(cudaEventRecord(t.events[e++], stream));
      }
  } catch (...) {
    for (cudaEvent_t e : t.events)
      if (e) cudaEventDestroy(e);
    std::lock_guard<std::mutex> lock(g_table_mu);
    g_table.erase({device_, (int)prec, n, k, t.block});
    throw;
  }
  timings_.push_back(std::move(t));
}

void CudaMoments::collect_timings(bool drop) {
  for (size_t i = 0; i < timings_.size();) {
    Timing& t = timings_[i];
    const ShapeKey key{device_, (int)t.prec, t.n, t.k, t.block};
    const cudaError_t ready = cudaEventQuery(t.events.back());  // the last event: every run before it is done
    if (ready == cudaErrorNotReady && !drop) {
      ++i;
      continue;
    }
    Measured m;
    if (ready == cudaSuccess) {
      const size_t nc = t.candidates.size();
      m.done = true;
      double best = 0.0;
      // The default (last) wins ties: go backwards, replace only when faster.
      for (size_t c = nc; c-- > 0;) {
        double ms = 0.0;
        for (size_t r = 0; r < 2; ++r) {
          float v = 0.0f;
          if (cudaEventElapsedTime(&v, t.events[r * nc + c], t.events[r * nc + c + 1]) != cudaSuccess) m.done = false;
          ms = r == 0 ? v : std::min(ms, (double)v);
        }
        m.ms.insert(m.ms.begin(), {t.candidates[c], ms});
        if (c == nc - 1 || ms < best) {
          best = ms;
          m.product = t.candidates[c];
        }
      }
    }
    for (cudaEvent_t e : t.events) cudaEventDestroy(e);
    {
      std::lock_guard<std::mutex> lock(g_table_mu);
      if (m.done) g_table[key] = m;
      else g_table.erase(key);  // abandoned or failed: a later product measures again
    }
    timings_.erase(timings_.begin() + i);
  }
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
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  if (algo_ == Product::automatic && !capturing) {
    bool claimed = false;
    {
      std::lock_guard<std::mutex> lock(g_table_mu);
      claimed = g_table.emplace(ShapeKey{device_, (int)prec, n, k, block_}, Measured()).second;
    }
    if (claimed) {
      measure(prec, n, k, src, lda, dst, ldc, tc, stream);
      return;
    }
  }
  run_product(resolve(prec, n, k), prec, n, k, src, lda, dst, ldc, tc, capturing, stream);
}

void CudaMoments::run_product(Product algo, Precision prec, int64_t n, int64_t k, const void* src, int64_t lda,
                              void* dst, int64_t ldc, TileCache& tc, bool capturing, cudaStream_t stream) {
  const size_t ies = in_size(prec), oes = out_size(prec);
  const char* xs = static_cast<const char*>(src);
  char* Mb = static_cast<char*>(dst);
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
      const bool valid = tc.table == tc.ptrs.ptr && tc.src == src && tc.dst == dst && tc.n == n && tc.lda == lda &&
                         tc.ldc == ldc && tc.bs == bs && tc.es == ies;
      if (!valid) {
        tile_pointers<<<1, 256, 0, stream>>>(xs, Mb, ldc, bs, (long long)ies, (long long)oes, nbt, A, B, C);
        LAUNCH_CHECK("tile_pointers");
        if (!capturing) {
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

}  // namespace cuda
}  // namespace richness
