// CUDA backend of the streamed float64 co-moment state (docs/MATH.md, streaming estimator).
//
// The same state and Chan merge as the CPU backend (../cpu/cpu_moments.hpp), held in
// device memory. A batch is validated on the host (shapes, dtypes: no data is
// read there); everything that reads data runs on the caller's stream:
//   one pass over the batch (center_partials): float64 column means and
//   checks, rows centered on their 256-row chunk's mean and narrowed to the
//   product type -> cuBLAS products into scratch -> float64 merge adding the
//   chunks' offsets and Chan's term (merge_groups) -> mean/n update.
// Non-finite values, out-of-range labels and values whose co-moments would
// overflow float64 (or whose spread's squares underflow the products; the
// CPU backend's rules) are counted on the device; the merge kernels read that
// count and skip the batch, and the error is raised at
// the next synchronising call (n, get_state, merge, reset). So update() never
// waits for the device, labels included: without num_classes the class arrays
// have a host-known capacity (set from the first labelled batch, which
// allocates anyway), rows whose label is past it are copied on the device into
// a deferral buffer, and the next synchronising call grows the capacity and
// adds them (see defer_rows and settle_classes).
//
// Staging (opt-in, set_stack): instead of one product and one merge per batch,
// update() centers the batch on its own float64 mean and copies the narrowed
// rows into a device buffer of `stack_rows` rows, recording the batch's count
// and mean on the device. The staged rows are reduced with one product over
// all of them (flush_stage) when the next batch would not fit, and before
// anything reads or merges the state. The multi-batch Chan correction is
// exact (see flush_stage). Whether to flush depends only on host-known row
// counts, so update() still never waits for the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../common/moments.hpp"  // the Moments interface
#include "../common/state.hpp"    // State (data only)
#include "../common/types.hpp"  // DType, Precision, Matrix

typedef struct cublasContext* cublasHandle_t;

namespace richness {
namespace cuda {

// How the p x p product X^T X is formed. Only its lower triangle is read.
enum class Product : int {
  automatic = 0,  // measured per shape (see Timing); until measured, default_product()
  syrk = 1,       // cublas{S,D}syrk (tf32: Ssyrk under TF32 math mode)
  gemm = 2,       // one cublasGemmEx over the full square
  block_rows = 3, // one cublasGemmEx per block-row of the lower triangle
  tiles = 4,      // cublasGemmBatchedEx over the lower bs x bs tiles (p % bs == 0)
};

// "auto", "syrk", "gemm", "block_rows", "tiles" (invalid_argument otherwise).
Product product_from_name(const std::string& name);
const char* product_name(Product p);
// The algorithm used before a shape has been measured (benchmarks/gpu_check.py, H200).
Product default_product(Precision prec);

// Products chosen by measurement so far in this process (all objects share
// them), for `richness info`-style reports and benchmarks.
struct MeasuredProduct {
  int device;
  Precision precision;
  int64_t n, rows;  // product width, rows per product
  int block;
  Product product;
  std::vector<std::pair<Product, double>> ms;  // each candidate's best time of two runs
};
std::vector<MeasuredProduct> measured_products();
void clear_measured_products();  // the next product of each shape is measured again

// Most batches held in the stage at once (the float64 means and counts are
// sized for this many; a stage that reaches it is flushed).
constexpr int kMaxStackBatches = 256;

// Device-side bookkeeping, read by the kernels (never by the host in update).
// Error kinds (kBad* below): non-finite features/outputs/targets, labels out
// of range, labels past the class capacity in more rows than the deferral
// buffer holds, co-moments that would overflow (features/outputs/targets) and
// spreads whose squares would underflow the products (same three), as the
// CPU backend refuses them (docs/MATH.md, precision).
constexpr int kBadNonFinite = 0, kBadLabels = 3, kBadDeferral = 4, kBadOverflow = 5, kBadUnderflow = 8;
constexpr int kBadKinds = 11;
struct Header {
  long long n;                     // samples merged
  long long batch_bad[kBadKinds];  // this batch
  double batch_magnitude[3];       // this batch: largest |value| of features, outputs, targets
  double batch_range[3];           // this batch: largest column max - min of each
  long long total_bad[kBadKinds];  // since the last synchronising call
  long long skipped;               // batches skipped since the last synchronising call
  double total_magnitude[3];       // the largest batch_magnitude of the batches skipped for overflow
  double total_range[3];           // the largest batch_range of the batches skipped for underflow
  long long k_seen;                // one past the largest label of the batches added
  long long batch_max;             // this batch: largest label (-1: none)
  long long batch_over;            // this batch: rows whose label is past the class capacity
  long long defer_used;            // rows in the deferral buffer
  long long defer_cursor;          // next deferral row of this batch
  // The class arrays and the deferral buffer, read by the kernels from here
  // (not from launch arguments) so that a captured update follows their
  // growth at a synchronising call. Written by the host only at such calls.
  double* class_sums;
  long long* class_counts;
  long long cap;           // classes allocated; labels past it are deferred
  double* defer_rows;      // defer_cap rows of p float64 values
  long long* defer_labels; // defer_cap labels
  long long defer_cap;
};

// The element type an array of the state has on the device: the kernels'
// atomics take long long, which int64_t (long) is not on every platform.
template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<int64_t> {
  using type = long long;
};
template <typename T>
using device_t = typename DeviceType<T>::type;
static_assert(sizeof(long long) == sizeof(int64_t), "class counts are 64-bit on the device and the host");

// The state's arrays on the device, one per RICHNESS_STATE_ARRAYS entry (sizes
// as in State; symmetric blocks hold their lower triangle column-major, i >= j;
// class_sums rows are allocated for the class capacity, not just k).
struct DeviceState {
  Header* hdr = nullptr;
#define RICHNESS_DEVICE_ARRAY(name, type, rows, cols, sym) device_t<type>* name = nullptr;
  RICHNESS_STATE_ARRAYS(RICHNESS_DEVICE_ARRAY)
#undef RICHNESS_DEVICE_ARRAY
  // By stream and by co-moment index (common/state.hpp).
  double* stream_mean(int q) const { return q == 0 ? mean : q == 1 ? out_mean : tgt_mean; }
  double* comoment(int i) const {
    double* const all[] = {
#define RICHNESS_DEVICE_COMOMENT(name, rows, cols) name,
        RICHNESS_COMOMENTS(RICHNESS_DEVICE_COMOMENT)
#undef RICHNESS_DEVICE_COMOMENT
    };
    return all[i];
  }
};

// A Moments (common/moments.hpp) whose state lives on a CUDA device.
class CudaMoments : public Moments {
 public:
  CudaMoments(int64_t num_classes, int device);
  ~CudaMoments() override;
  CudaMoments(const CudaMoments&) = delete;
  CudaMoments& operator=(const CudaMoments&) = delete;

  // Enqueues one batch on `stream` (cudaStream_t; 0 = legacy default stream).
  void update(const Matrix& features, const Matrix* outputs, const Matrix* labels, const Matrix* targets,
              Precision precision, cudaStream_t stream);

  // Moments (common/moments.hpp). merge_from synchronises both.
  const char* backend() const override { return "cuda"; }
  void reset() override;
  // Synchronising accessors: each raises a pending device-side error first.
  int64_t n() override;
  Widths widths() override;
  State get_state() override { return download(); }

  State download();                 // float64 host copy (symmetric matrices filled)
  void upload(const State& s);      // replaces the state (consistent: set_state checks it)
  // Copies the state into caller-allocated device buffers (symmetric matrices
  // filled); keys as in State. Returns after the copies have completed.
  // A null target is skipped.
  struct Targets {
#define RICHNESS_TARGET_ARRAY(name, type, rows, cols, sym) device_t<type>* name = nullptr;
    RICHNESS_STATE_ARRAYS(RICHNESS_TARGET_ARRAY)
#undef RICHNESS_TARGET_ARRAY
  };
  void export_to(const Targets& t);

  // Shape facts known on the host without synchronising.
  int64_t p() const { return p_; }
  int64_t c() const { return c_; }
  int64_t t() const { return t_; }
  int64_t k() const { return k_; }  // as of the last synchronising call
  int64_t num_classes() const { return num_classes_; }
  Precision precision() const { return precision_; }
  int device() const { return device_; }

  void set_product(Product algo, int block);
  Product product() const { return algo_; }

  // Most rows one fp32 product accumulates in float32 (0 = no limit): longer
  // row blocks are split, the parts added in float64. Float32
  // accumulation over k rows loses accuracy as k grows: 4,096 rows of mean
  // 1e4 and spread 1e-2 moved the fp32 DLR by 2e-6 on an H200, where the
  // contract (docs/MATH.md, precision) is 1e-6. tf32/bf16 are not split:
  // their input rounding dominates.
  void set_row_cap(int64_t rows);
  int64_t row_cap() const { return row_cap_; }

  // Staging of up to `rows` rows before one product (0 = off: one product
  // per batch). `joint`: with outputs/targets streamed, one product over the
  // concatenated [X | F | T] rows gives M, B, A (and Bt, At) at once; else
  // one product per block, as without staging. Pending rows are flushed first
  // (this call synchronises).
  void set_stack(int64_t rows, bool joint);
  int64_t stack_rows() const { return stack_rows_; }
  bool stack_joint() const { return stack_joint_; }
  int64_t staged_rows() const { return st_rows_; }      // host-known, not yet merged
  int staged_batches() const { return st_batches_; }

 private:
  int device_;
  int64_t num_classes_;
  int64_t p_ = -1, c_ = -1, t_ = -1, k_ = -1;
  // k of a loaded or merged state (which may end in empty classes): the
  // labels seen on the device raise k above it, never below.
  int64_t k_floor_ = -1;
  // Rows allocated in the class arrays (>= k_). Without num_classes, labels
  // past it are deferred (defer_ holds defer_cap_ rows of p float64 values,
  // then defer_cap_ int64 labels) until settle_classes.
  int64_t cap_ = 0;
  int64_t defer_cap_ = 0;
  int64_t widest_labelled_ = 0;  // most rows in one labelled batch (sizes the deferral buffer)
  Precision precision_ = Precision::fp64;
  Product algo_ = Product::automatic;
  int block_ = 512;
  int64_t row_cap_ = 1024;

  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  cudaStream_t last_stream_ = nullptr;
  bool have_last_stream_ = false;
  cudaEvent_t order_event_ = nullptr;

  DeviceState s_;
  // Scratch, grown on demand (growth allocates, so it synchronises; warm up
  // with the largest batch before capturing a CUDA graph).
  struct Buf {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  Buf xs_, fs_, ts_, mu_, nu_, tau_, partial_, defer_, part_;
  Buf prod_[kNumComoments];  // a batch's products, by co-moment (common/state.hpp)
  Buf dev_;  // the per-batch path's chunk deviations: (chunks + 1) rows of p + c + t doubles
  // Pointer arrays of the batched lower-tile product, valid for `key`
  // (source, destination, sizes): recomputed on the device when it changes.
  struct TileCache {
    Buf ptrs;
    const void* table = nullptr;  // ptrs.ptr when the pointers were written (a regrown table holds nothing)
    const void* src = nullptr;
    const void* dst = nullptr;
    int64_t n = -1, lda = -1, ldc = -1, bs = -1;
    size_t es = 0;
  };
  TileCache tiles_, st_tiles_;

  // Staging (see set_stack). Host-known: rows and batches staged, and the
  // product precision they were narrowed to. Device: the rows (st_x_,
  // row width st_width_ = p + c + t rounded up to 8 elements), the float64
  // means (st_means_: row 0 is scratch for the state's deviation, row 1 + b
  // batch b's means), the counts (st_counts_: 0 for a bad batch) and the
  // product (st_prod_).
  int64_t stack_rows_ = 0;
  bool stack_joint_ = true;
  int64_t st_rows_ = 0;
  int st_batches_ = 0;
  Precision st_prec_ = Precision::fp32;
  int64_t st_width_ = 0;
  Buf st_x_, st_means_, st_counts_, st_prod_;

  void ensure(Buf& b, size_t bytes);
  void free_all();
  void free_state();
  void shape(int64_t p, int64_t c, int64_t t, int64_t k);
  // Elements along a dimension of the state (a stream not present counts 0).
  int64_t extent(Dim d) const {
    State w;
    w.p = p_, w.c = c_, w.t = t_, w.k = k_;
    return w.size(d);
  }
  void grow_classes(int64_t cap);  // capacity of the class arrays (synchronises)
  // Without num_classes: the first labelled batch's capacity (this call
  // synchronises, as the first batch's allocation does), and the deferral buffer.
  void prepare_classes(const Matrix& labels, int64_t nb);
  // At a synchronising call: k from the device, capacity grown to it, deferred rows added.
  void settle_classes();
  void class_part(const Matrix& x, const Matrix& labels, cudaStream_t stream);
  void publish_classes();  // the header's copy of the class arrays' and deferral buffer's addresses
  void sync_and_check();  // flushes the stage, waits for the device; raises and clears pending errors
  void order_after_last(cudaStream_t stream);
  // The algorithm a product of width n over k rows uses now: the explicit
  // choice, else the measured one, else default_product (adjusted to what
  // applies at n: tiles need p % block == 0 and two tiles, bf16 has no syrk).
  Product resolve(Precision prec, int64_t n, int64_t k) const;
  Product applicable(Product algo, Precision prec, int64_t n) const;
  bool tiles_apply(Precision prec, int64_t n) const { return applicable(Product::tiles, prec, n) == Product::tiles; }
  // One product by the given algorithm (no split, no measurement).
  void run_product(Product algo, Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst,
                   int64_t ldc, TileCache& tc, bool capturing, cudaStream_t stream);
  // Measurement (Product::automatic): the first product of a new (device,
  // precision, width, rows, block) runs every applicable algorithm twice on
  // the caller's stream between timing events, the default last (so its
  // result is the one kept); the events are read without waiting (a later
  // update asks cudaEventQuery) or after the next synchronisation, and the
  // fastest is kept for that shape in a table all objects share. Never under
  // a graph capture; until a shape's times are read its default is used.
  struct Timing {
    int64_t n = 0, k = 0;
    Precision prec = Precision::fp32;
    int block = 0;
    std::vector<Product> candidates;  // run in this order, twice
    std::vector<cudaEvent_t> events;  // 2 * candidates + 1: before, then after each run
  };
  std::vector<Timing> timings_;
  void measure(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst, int64_t ldc,
               TileCache& tc, cudaStream_t stream);
  // Reads the finished measurements (never waits); `drop`: abandons the rest.
  void collect_timings(bool drop);
  void means_and_checks(const Matrix& x, const Matrix* outputs, const Matrix* labels, const Matrix* targets,
                        Precision prec, double* mu, double* nu, double* tau, bool fuse, cudaStream_t stream);
  void prepare_batch_scratch(Precision prec, int64_t nb, int64_t c, int64_t t);
  // Lower triangle of C = S^T S, S a k x n row-major block (row stride lda)
  // = column-major n x k; C column-major n x n with leading dimension ldc.
  void product_lower(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst, int64_t ldc,
                     TileCache& tc, cudaStream_t stream);
  // One cuBLAS product (no split).
  void product_lower_once(Precision prec, int64_t n, int64_t k, const void* src, int64_t lda, void* dst, int64_t ldc,
                          TileCache& tc, cudaStream_t stream);
  int64_t rows_per_product(Precision prec, int64_t k) const;
  // Whether a product over k rows is split: its result is then float64 (else out_size(prec) bytes per element).
  bool splits(Precision prec, int64_t k) const { return rows_per_product(prec, k) < k; }
  size_t product_size(Precision prec, int64_t k) const;
  // B_g = X^T G (w x p column-major, ld w) and the lower triangle of A_g =
  // G^T G (ld w) over k rows; G and X row-major with row strides ldg, ldx.
  void product_cross(Precision prec, int64_t k, int64_t w, const void* gs, int64_t ldg, const void* xs, int64_t ldx,
                     void* Bg, void* Ag, cudaStream_t stream);
  void stage_batch(const Matrix& x, const Matrix* outputs, const Matrix* labels, const Matrix* targets,
                   Precision prec, cudaStream_t stream);
  void flush_stage(cudaStream_t stream);  // enqueues the reduction of the staged rows on `stream`
  void flush_pending();                   // outside update: waits for the device, flushes, leaves it queued
  void merge_state_device(const CudaMoments& other, int64_t other_n);

 protected:
  void replace_state(State s) override { upload(s); }
  void merge_same(Moments& other) override;
};

// "NVIDIA H200 (sm_90), driver 13.0, runtime 13.0, cuBLAS 130100"
std::string device_info(int device);
// Never raises: what was built, and the GPU if one is usable (for `richness info`).
std::string backend_info();

}  // namespace cuda
}  // namespace richness
