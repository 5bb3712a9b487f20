// The host class (CudaMoments): lifecycle and buffers, a batch's way through
// update (checks, means, centering, products, float64 merge, all enqueued on
// the caller's stream; nothing in update waits for the device), the class
// arrays and their deferral, the synchronising calls (error reports,
// download/upload/export) and the merge of two states. The kernels are in
// kernels.cu, the products in products.cu, staging in staging.cu.
#include "kernels.cuh"

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

namespace richness {
namespace cuda {

// ---- lifecycle ----------------------------------------------------------------

CudaMoments::CudaMoments(int64_t num_classes, int device) : device_(device), num_classes_(num_classes) {
  // RICHNESS_CUDA_PRODUCT=name[:block] (benchmarks): the product every
  // object starts with; set_product still overrides it.
  if (const char* env = std::getenv("RICHNESS_CUDA_PRODUCT"); env && *env) {
    const std::string v(env);
    const size_t colon = v.find(':');
    try {
      int block = block_;
      if (colon != std::string::npos) {
        size_t used = 0;
        block = std::stoi(v.substr(colon + 1), &used);
        if (used != v.size() - colon - 1) throw std::invalid_argument("block is not an integer");
      }
      set_product(product_from_name(v.substr(0, colon)), block);
    } catch (const std::exception& e) {
      throw std::invalid_argument("RICHNESS_CUDA_PRODUCT=" + v + " (name or name:block): " + e.what());
    }
  }
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
  try {
    collect_timings(false);  // the device is idle: finished measurements are kept
    collect_timings(true);
  } catch (...) {
  }
  free_all();
  if (workspace_) cudaFree(workspace_);
  if (order_event_) cudaEventDestroy(order_event_);
  if (handle_) cublasDestroy(handle_);
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}

void CudaMoments::free_state() {
  if (s_.hdr) cudaFree(s_.hdr);
#define RICHNESS_FREE(name, type, rows, cols, sym) \
  if (s_.name) cudaFree(s_.name);
  RICHNESS_STATE_ARRAYS(RICHNESS_FREE)
#undef RICHNESS_FREE
  s_ = DeviceState();
  cap_ = 0;
}

void CudaMoments::free_all() {
  free_state();
  for (Buf& b : prod_) {
    if (b.ptr) cudaFree(b.ptr);
    b = Buf();
  }
  for (Buf* b : {&xs_, &fs_, &ts_, &mu_, &nu_, &tau_, &partial_, &dev_, &defer_, &tiles_.ptrs,
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
  s_.hdr = static_cast<Header*>(zeros(1, sizeof(Header)));
#define RICHNESS_ALLOCATE(name, type, rows, cols, sym) \
  s_.name = static_cast<decltype(s_.name)>(zeros((size_t)(extent(rows) * extent(cols)), sizeof(type)));
  RICHNESS_STATE_ARRAYS(RICHNESS_ALLOCATE)
#undef RICHNESS_ALLOCATE
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
    launch_max_label(labels, h, 0);
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
  launch_defer_rows(x, labels, h, stream);
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
  ensure(partial_, (size_t)kPartials * chunks * widest * 8);
  ensure(dev_, (size_t)(chunks + 1) * (p + c + t) * 8);
  ensure(mu_, (size_t)p * 8);
  ensure(xs_, (size_t)nb * p * ies);
  const int64_t width[kStreams] = {p, c, t};
  for (int i = 0; i < kNumComoments; ++i)
    if (width[kComoments[i].rows] > 0 && width[kComoments[i].cols] > 0)
      ensure(prod_[i], (size_t)width[kComoments[i].rows] * width[kComoments[i].cols] * oes);
  if (c > 0) {
    ensure(nu_, (size_t)c * 8);
    ensure(fs_, (size_t)nb * c * ies);
  }
  if (t > 0) {
    ensure(tau_, (size_t)t * 8);
    ensure(ts_, (size_t)nb * t * ies);
  }
  if (tiles_apply(prec, p)) {  // a candidate when measuring, whatever is chosen now
    const long long nbt = p / block_;
    ensure(tiles_.ptrs, (size_t)(nbt * (nbt + 1) / 2) * 3 * sizeof(void*));
  }
}

// A batch's float64 column means (features, outputs, targets) and its device
// checks (non-finite values, labels out of range), counted in the header's
// batch_bad for the kernels after them to read.
void CudaMoments::means_and_checks(const Matrix& x, const Matrix* outputs, const Matrix* labels,
                                   const Matrix* targets, Precision prec, double* mu, double* nu, double* tau,
                                   bool fuse, cudaStream_t stream) {
  Header* h = s_.hdr;
  double* partial = static_cast<double*>(partial_.ptr);
  // batch_bad, batch_magnitude and batch_range, contiguous
  static_assert(offsetof(Header, total_bad) - offsetof(Header, batch_bad) ==
                    sizeof(Header::batch_bad) + sizeof(Header::batch_magnitude) + sizeof(Header::batch_range),
                "the per-batch verdict is one block of the header");
  CUDA_CHECK(cudaMemsetAsync(h->batch_bad, 0, offsetof(Header, total_bad) - offsetof(Header, batch_bad), stream));
  if (labels) {
    CUDA_CHECK(cudaMemsetAsync(&h->batch_max, 0xff, sizeof(long long), stream));
    CUDA_CHECK(cudaMemsetAsync(&h->batch_over, 0, sizeof(long long), stream));
  }
  // The products' type bounds them (a quarter of its largest value, as on the
  // CPU), and its smallest normal bounds the spread's squares from below.
  const bool fp64 = traits(prec).product == DType::f64;
  const double part_max = fp64 ? DBL_MAX / 4 : (double)FLT_MAX / 4;
  const double tiny = 64.0 * std::sqrt(fp64 ? DBL_MIN : (double)FLT_MIN);
  // fused: centered rows into xs_/fs_/ts_, the chunks' deviations into dev_ ([features | outputs | targets])
  const long long c = outputs ? outputs->cols : 0, t = targets ? targets->cols : 0, W = p_ + c + t;
  double* D = static_cast<double*>(dev_.ptr);
  const ChunkCentering cx{prec, xs_.ptr, p_, D, W}, cf{prec, fs_.ptr, c, D + p_, W}, ct{prec, ts_.ptr, t, D + p_ + c, W};
  launch_means(x, partial, mu, h, 0, s_.mean, s_.M, part_max, fuse ? &cx : nullptr, stream);
  if (outputs) launch_means(*outputs, partial, nu, h, 1, s_.out_mean, s_.A, part_max, fuse ? &cf : nullptr, stream);
  if (targets) launch_means(*targets, partial, tau, h, 2, s_.tgt_mean, s_.At, part_max, fuse ? &ct : nullptr, stream);
  launch_scale_verdict(h, tiny, stream);
  if (labels) {
    const long long limit = num_classes_ >= 0 ? num_classes_ : class_growth_cap(p_);
    launch_label_checks(*labels, limit, h, stream);
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
  if (!timings_.empty()) {  // measurements whose events have completed (never waits; not while capturing)
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) collect_timings(false);
  }
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
  // One pass over the batch: means, checks and the rows centered on their chunks' means.
  means_and_checks(x, outputs, labels, targets, prec, mu, nu, tau, true, stream);

  CUBLAS_CHECK(cublasSetStream(handle_, stream));
  CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, workspace_bytes_));
  // Each stream's products (indices of RICHNESS_COMOMENTS): M; B and A; Bt and At.
  product_lower(prec, p, nb, xs_.ptr, p, prod_[0].ptr, p, tiles_, stream);
  if (outputs) product_cross(prec, nb, c, fs_.ptr, c, xs_.ptr, p, prod_[1].ptr, prod_[2].ptr, stream);
  if (targets) product_cross(prec, nb, t, ts_.ptr, t, xs_.ptr, p, prod_[3].ptr, prod_[4].ptr, stream);

  // float64 merge (of float64 products: fp64, or split); every kernel reads the device's error counts and leaves
  // the state untouched for a bad batch.
  // float64 merge (of float64 products: fp64, or split), with the chunks' offsets and Chan's term
  // (the deviations D); every merge reads the device's verdict and leaves the state untouched for a bad batch.
  const bool wide = product_size(prec, nb) == 8;
  const long long W = p + c + t;
  const int groups = (int)((nb + kChunkRows - 1) / kChunkRows) + 1;
  const double* D = static_cast<const double*>(dev_.ptr);
  const int64_t width[kStreams] = {p, c, t}, offset[kStreams] = {0, p, p + c};  // columns of D by stream
  for (int i = 0; i < kNumComoments; ++i) {
    const int rq = kComoments[i].rows, cq = kComoments[i].cols;
    if (width[rq] == 0 || width[cq] == 0) continue;
    launch_merge_groups(s_.comoment(i), width[cq], prod_[i].ptr, wide, width[cq], width[cq], width[rq],
                        D + offset[cq], D + offset[rq], W, groups, kComoments[i].symmetric(), h, stream);
  }
  if (labels) class_part(x, *labels, stream);
  launch_finalize(h, nb, s_.mean, mu, p, s_.out_mean, nu, outputs ? c : 0, s_.tgt_mean, tau, targets ? t : 0, true,
                  stream);
  precision_ = std::max(precision_, prec);
}

// ---- synchronising calls ----------------------------------------------------------

void CudaMoments::sync_and_check() {
  DeviceGuard g(device_);
  flush_pending();  // staged rows join the state before anything reads it
  CUDA_CHECK(cudaDeviceSynchronize());
  collect_timings(false);  // every event has completed: measured shapes get their choice
  if (!s_.hdr) return;
  settle_classes();  // rows of batches that were added, whatever else failed
  Header hh;
  CUDA_CHECK(cudaMemcpy(&hh, s_.hdr, sizeof(Header), cudaMemcpyDeviceToHost));
  if (hh.skipped == 0) return;
  // Clear the pending error first: the state itself is intact (bad batches
  // were skipped), so the object stays usable after the exception.
  CUDA_CHECK(cudaMemset(&s_.hdr->total_bad, 0, offsetof(Header, total_range) + sizeof(hh.total_range) -
                                                   offsetof(Header, total_bad)));
  CUDA_CHECK(cudaDeviceSynchronize());
  Msg os;
  os << hh.skipped << (hh.skipped == 1 ? " batch was" : " batches were") << " not added (checked on the device): ";
  const char* names[3] = {"features", "outputs", "targets"};
  bool first = true;
  // The first refusal named gives the error's structured fields (InputError.stream, .limit), as the CPU
  // backend's one refusal does.
  const char* stream = "";
  const char* limit = "";
  auto first_is = [&](const char* s, const char* l) {
    if (first) stream = s, limit = l;
  };
  for (int q = 0; q < 3; ++q)
    if (hh.total_bad[q]) {
      first_is(names[q], "finite");
      os << (first ? "" : "; ") << names[q] << " contain " << hh.total_bad[q] << " non-finite value"
         << (hh.total_bad[q] == 1 ? "" : "s") << " (NaN or Inf)";
      first = false;
    }
  for (int q = 0; q < 3; ++q)
    if (hh.total_bad[kBadOverflow + q]) {
      first_is(names[q], "overflow");
      // as the CPU backend words it (csrc/cpu/cpu_moments.cpp)
      const bool fp64 = traits(precision_).product == DType::f64;
      os << (first ? "" : "; ") << names[q] << " are too large: their co-moments overflow "
         << (fp64 ? "float64" : "the float32 products or float64") << " (largest magnitude in the batch "
         << Sci{hh.total_magnitude[q]} << "); rescale them (DLR does not depend on the scale)"
         << (fp64 ? "" : " or use precision='fp64'");
      first = false;
    }
  for (int q = 0; q < 3; ++q)
    if (hh.total_bad[kBadUnderflow + q]) {
      first_is(names[q], "underflow");
      const bool fp64 = traits(precision_).product == DType::f64;
      os << (first ? "" : "; ") << names[q] << " vary by at most " << Sci{hh.total_range[q]} << ", too little for "
         << precision_name(precision_) << " products: their squares underflow " << (fp64 ? "float64" : "float32")
         << "; rescale them (DLR does not depend on the scale)" << (fp64 ? "" : " or use precision='fp64'");
      first = false;
    }
  if (hh.total_bad[3]) {
    first_is("labels", num_classes_ >= 0 ? "num_classes" : "class growth");
    os << (first ? "" : "; ") << "labels out of range: " << hh.total_bad[3] << " label"
       << (hh.total_bad[3] == 1 ? "" : "s");
    first = false;
    if (num_classes_ >= 0) os << " outside 0.." << num_classes_ - 1 << " (num_classes=" << num_classes_ << ")";
    else
      os << " negative or past " << class_growth_cap(p_) - 1
         << " (labels must be >= 0; without num_classes the class sums stop at 1 GiB)";
  }
  if (hh.total_bad[4]) {
    first_is("labels", "class growth");
    os << (first ? "" : "; ") << hh.total_bad[4] << " row" << (hh.total_bad[4] == 1 ? "" : "s")
       << " labelled past the class capacity did not fit the deferral buffer (" << defer_cap_
       << " rows between synchronising calls); pass num_classes to Moments";
  }
  throw input_error(os.str(), stream, -1, limit);
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
  collect_timings(false);
  free_state();  // scratch is kept: it grows to fit whatever comes next
  st_rows_ = 0;  // staged rows are forgotten with the rest
  st_batches_ = 0;
  p_ = c_ = t_ = k_ = k_floor_ = -1;
  precision_ = Precision::fp64;
  have_last_stream_ = false;
}

namespace {

// One array of the state, device -> host; a symmetric one (column-major lower
// triangle on the device) comes back full.
template <typename T, bool Sym>
std::vector<T> download_array(const void* d, int64_t rows, int64_t cols) {
  std::vector<T> v((size_t)(rows * cols));
  if (!v.empty()) CUDA_CHECK(cudaMemcpy(v.data(), d, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  if constexpr (Sym)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < i; ++j) v[j * rows + i] = v[i * rows + j] = v[j * rows + i];
  return v;
}

// One array of the state, host -> device; a symmetric one is read from its
// row-major lower triangle (host State) into the device's column-major lower.
template <typename T, bool Sym>
void upload_array(void* d, const std::vector<T>& v, int64_t rows) {
  if (v.empty()) return;
  if constexpr (Sym) {
    std::vector<T> t(v.size(), T(0));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j <= i; ++j) t[j * rows + i] = v[i * rows + j];
    CUDA_CHECK(cudaMemcpy(d, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
  } else {
    CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
}

// One array of the state into a caller's device buffer (null: skipped);
// symmetric ones are written full.
template <bool Sym, typename T>
void export_array(T* dst, const T* src, int64_t rows, int64_t cols) {
  if (!dst || rows * cols == 0) return;
  if constexpr (Sym) launch_symmetrize(src, rows, dst, 0);
  else CUDA_CHECK(cudaMemcpy(dst, src, (size_t)(rows * cols) * sizeof(T), cudaMemcpyDeviceToDevice));
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
#define RICHNESS_DOWNLOAD(name, type, rows, cols, sym) \
  s.name = download_array<type, sym>(s_.name, extent(rows), extent(cols));
  RICHNESS_STATE_ARRAYS(RICHNESS_DOWNLOAD)
#undef RICHNESS_DOWNLOAD
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
  collect_timings(false);
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
#define RICHNESS_UPLOAD(name, type, rows, cols, sym) upload_array<type, sym>(s_.name, s.name, extent(rows));
  RICHNESS_STATE_ARRAYS(RICHNESS_UPLOAD)
#undef RICHNESS_UPLOAD
  CUDA_CHECK(cudaDeviceSynchronize());
}

void CudaMoments::export_to(const Targets& o) {
  sync_and_check();
  if (p_ < 0) return;
  DeviceGuard g(device_);
#define RICHNESS_EXPORT(name, type, rows, cols, sym) \
  export_array<sym>(o.name, static_cast<const device_t<type>*>(s_.name), extent(rows), extent(cols));
  RICHNESS_STATE_ARRAYS(RICHNESS_EXPORT)
#undef RICHNESS_EXPORT
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- merge of two states --------------------------------------------------------

Widths CudaMoments::widths() {
  const int64_t here = n();  // synchronises: raises a pending error, settles the classes
  return Widths{here, p_, c_, t_, k_, num_classes_};
}

void CudaMoments::merge_same(Moments& from) {
  CudaMoments& other = static_cast<CudaMoments&>(from);
  if (&other == this) {
    State s = download();
    CudaMoments tmp(num_classes_, device_);
    tmp.upload(s);
    merge_same(tmp);
    return;
  }
  sync_and_check();
  const Widths theirs = other.widths();  // raises the other's pending error, if any
  const Widths mine = widths();
  check_compatible_for_merge(mine, theirs);  // the merge rule, before anything changes
  const int64_t on = theirs.n, here = mine.n;
  if (other.p_ < 0 || on == 0) return;
  if (other.device_ != device_) {
    CudaMoments tmp(other.num_classes_, device_);
    tmp.upload(other.download());
    merge_same(tmp);
    return;
  }
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
  const long long width[kStreams] = {p, std::max<int64_t>(c_, 0), std::max<int64_t>(t_, 0)};
  for (int i = 0; i < kNumComoments; ++i) {
    const int rq = kComoments[i].rows, cq = kComoments[i].cols;
    if (width[rq] == 0 || width[cq] == 0) continue;
    if (kComoments[i].symmetric())
      launch_merge_sym(s_.comoment(i), o.s_.comoment(i), true, width[rq], s_.stream_mean(rq), o.s_.stream_mean(rq), h,
                       on, false, s);
    else
      launch_merge_cross(s_.comoment(i), o.s_.comoment(i), true, width[rq], width[cq], s_.stream_mean(rq),
                         o.s_.stream_mean(rq), s_.stream_mean(cq), o.s_.stream_mean(cq), h, on, false, s);
  }
  if (o.k_ > 0) {
    launch_add_classes(s_.class_sums, s_.class_counts, o.s_.class_sums, o.s_.class_counts, o.k_, p, s);
  }
  launch_finalize(h, on, s_.mean, o.s_.mean, p, s_.out_mean, o.s_.out_mean, std::max<int64_t>(c_, 0), s_.tgt_mean,
                  o.s_.tgt_mean, std::max<int64_t>(t_, 0), false, s);
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
