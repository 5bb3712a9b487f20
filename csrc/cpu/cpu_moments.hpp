// The CPU backend: centers each batch on its float64 mean, multiplies with
// BLAS, merges into the float64 state (common/state.hpp).
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/merge.hpp"
#include "../common/moments.hpp"
#include "../common/state.hpp"
#include "../common/types.hpp"

namespace richness {

// Float64 column means of a batch's float inputs (the CPU computes them
// while checking finiteness).
struct BatchMeans {
  std::vector<double> mean[kStreams];  // by stream (common/state.hpp)
  // Largest column range (max - min) and largest magnitude of each input,
  // exact in float64: they tell overflow and underflow from the data.
  double range[3] = {0, 0, 0}, magnitude[3] = {0, 0, 0};
};

// Scratch reused across a CpuMoments's batches: centered blocks and their
// products in the product type T.
template <typename T>
struct Scratch {
  std::vector<T> centered;  // the batch's centered rows (form_products: where each stream lies)
  std::vector<T> products;  // the co-moments' products (the workers share them)
  std::vector<double> class_sums;  // the batch's float64 sums of each class it holds
};

// Raised when a state or a batch's scratch cannot fit in this machine's
// memory (checked before allocating); bindings map it to MemoryError.
struct memory_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bytes this process can still allocate now: the memory the system reports
// available (MemAvailable; physical memory where /proc does not say) and,
// under a limit on the address space (ulimit -v), what is left of it (the
// limit less VmSize). The one memory model of richness: every update checks
// its state and scratch against it before allocating, and Python's
// _engine/bounded_io.check_memory (files of unknown origin) asks it through
// _core.available_memory.
double available_memory();

// CPU backend (a Moments, common/moments.hpp): centers each batch on its
// float64 mean, multiplies with BLAS (GEMM tiles shared by the workers,
// cpu/products.hpp), merges with State::merge.
//
// Thread-safe: every public method holds the object's mutex for its whole
// call, so several threads may update, merge into and read one CpuMoments;
// each call sees (and leaves) a state between whole batches. Bindings release
// the GIL before calling (a waiting thread never holds it).
//
// Fork-safe: a fork waits for the calls in progress on every CpuMoments to
// finish (pthread_atfork holds all their mutexes across the fork), so the
// child gets each object unlocked, with a state between whole batches.
class CpuMoments final : public Moments {
 public:
  explicit CpuMoments(int64_t num_classes = -1);
  ~CpuMoments() override;
  CpuMoments(const CpuMoments&) = delete;
  CpuMoments& operator=(const CpuMoments&) = delete;

  // precision: fp64 multiplies in double; fp32 in float (float16/bfloat16
  // inputs are widened to float after centering). tf32/bf16 are GPU modes.
  // On any error (bad input, overflow, out of memory) the state is unchanged.
  void update(const Batch& b, Precision precision);

  // Moments (common/moments.hpp)
  const char* backend() const override { return "cpu"; }
  Widths widths() override;
  int64_t n() override;
  void reset() override;
  State get_state() override { return snapshot(); }

  State snapshot() const;      // a consistent copy of the state
  // fn(state) under the object's lock: reads the state in place (no copy).
  template <typename Fn>
  void read(Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    fn(static_cast<const State&>(state_));
  }
  State scalars() const;       // its scalar fields only (n, widths, precision), no arrays
  int64_t p() const;

 protected:
  void replace_state(State s) override;
  void merge_same(Moments& other) override;  // State::merge, under both objects' locks

 private:
  mutable std::mutex mu_;  // guards state_ and the scratch
  State state_;
  Scratch<float> scratch_f_;
  Scratch<double> scratch_d_;
  void update_locked(const Batch& b, Precision precision);
  template <typename T>
  void update_typed(const Batch& b, const std::vector<int64_t>& labels, Precision precision, Scratch<T>& sc);
};

// Gram matrices of consecutive blocks of `per` rows of x, each block centered
// on its own float64 column means before narrowing (as in an update): out holds
// rows / per full symmetric per x per matrices, row-major, in double for fp64
// and float otherwise; norms their Frobenius norms (float64). Non-finite
// inputs propagate (no check). Runs on the worker threads, one block per BLAS
// call.
void centered_grams(const Matrix& x, int64_t per, Precision precision, void* out, double* norms);

// out (m x n) = a (m x k) b (k x n), or a b^T with b (n x k) when trans_b;
// row-major, contiguous; one single-threaded BLAS call on the calling thread.
void matmul_here(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* out, bool trans_b);
void matmul_here(int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* out, bool trans_b);

// BLAS facts for `richness info`, and the number of worker threads an update
// uses (each calls BLAS single-threaded; see CpuMoments::update_typed).
std::string blas_info();
int blas_get_num_threads();
void blas_set_num_threads(int n);

}  // namespace richness
