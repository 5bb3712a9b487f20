// Staging (set_stack): batches centered on their own means and copied into a
// device buffer, reduced by one product per stage (flush_stage) and merged
// into the state with the exact multi-group correction (stack_deviations,
// merge_groups, stack_commit).
#include "kernels.cuh"

#include <limits>

namespace richness {
namespace cuda {

namespace {

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
    count_skipped(h);
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

// Last step of a flush: n grows by the staged good rows.
__global__ void stack_commit(Header* h, const long long* counts, int m) {
  long long nst = 0;
  for (int b = 0; b < m; ++b) nst += counts[b];
  h->n += nst;
}
}  // namespace

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
  // The flush's tile table, for the width it multiplies (a candidate when measuring, whatever is chosen now).
  const int64_t flush_n = stack_joint_ ? joint_n : p;
  if (tiles_apply(prec, flush_n)) {
    const long long nbt = flush_n / block_;
    ensure(st_tiles_.ptrs, (size_t)(nbt * (nbt + 1) / 2) * 3 * sizeof(void*));
  }

  if (st_batches_ == 0) st_prec_ = prec;
  const int slot = st_batches_;
  const int64_t row0 = st_rows_;
  Header* h = s_.hdr;
  double* means = static_cast<double*>(st_means_.ptr) + (int64_t)(1 + slot) * width;  // [mu | nu | tau]
  char* rows = static_cast<char*>(st_x_.ptr) + (size_t)row0 * width * ies;

  // Staged rows are centered on the batch's mean (a second pass): the
  // stage's merge takes one mean per batch.
  means_and_checks(x, outputs, labels, targets, prec, means, means + p, means + p + c, false, stream);
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
  // tests in tests/engine/test_cuda.py (same DLR tolerances as unstaged).
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
    launch_merge_groups(S, lds, Sb, oes == 8, ldb, nf, ns, Df, Ds, W, groups, lower, nullptr, stream);
  };
  // (f, s) entries: M column-major lower (i, j) = (f, s); B row-major p x c
  // with the output index fast.
  const void* part[kNumComoments] = {Mp, Bp, Ap, Btp, Atp};  // in RICHNESS_COMOMENTS order
  const int64_t ld[kNumComoments] = {ldM, ldB, ldA, ldBt, ldAt};
  const long long width[kStreams] = {p, c, t}, offset[kStreams] = {0, p, p + c};
  for (int i = 0; i < kNumComoments; ++i) {
    const int rq = kComoments[i].rows, cq = kComoments[i].cols;
    if (width[rq] == 0 || width[cq] == 0) continue;
    merge(s_.comoment(i), width[cq], part[i], ld[i], width[cq], width[rq], means + offset[cq], means + offset[rq],
          kComoments[i].symmetric());
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

}  // namespace cuda
}  // namespace richness
