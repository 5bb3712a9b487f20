// The streamed float64 co-moment state of SPEC.md and its CPU backend.
//
// Framework-agnostic: a batch arrives as raw pointers with shapes, row strides
// and dtype codes (see Matrix). Python adapts numpy / torch / DLPack objects.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "msg.hpp"

namespace richness {

// Element types a batch may come in. Codes are shared with the Python adapter.
enum class DType : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3, i32 = 4, i64 = 5 };

// Precision of the products (SPEC.md: it sets the rank cut). Larger = coarser.
enum class Precision : int { fp64 = 0, fp32 = 1, tf32 = 2, bf16 = 3 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "unknown";
}

inline const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp64: return "fp64";
    case Precision::fp32: return "fp32";
    case Precision::tf32: return "tf32";
    case Precision::bf16: return "bf16";
  }
  return "unknown";
}

// A row-major matrix view: element (i, j) lives at ptr[i * ld + j].
// A vector (labels) is a Matrix with cols == 1 and ld its element stride.
struct Matrix {
  const void* ptr = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  DType dtype = DType::f32;
};

// Raised for inputs of the wrong element type; bindings map it to TypeError.
struct type_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Widths of a state, for the merge compatibility rules both backends share.
struct Widths {
  int64_t n, p, c, t, k, num_classes;
};

// Throws unless a state of widths `a` may absorb one of widths `b` (b is not
// empty). An empty `a` takes b's widths, within its own num_classes.
inline void check_mergeable(const Widths& a, const Widths& b) {
  auto differ = [](const char* what, int64_t x, int64_t y) {
    Msg os;
    os << "cannot merge: " << what << " differ (" << x << " here, " << y << " in the other)";
    throw std::invalid_argument(os.str());
  };
  if (a.p >= 0 && a.n > 0) {
    if (b.p != a.p) differ("feature widths", a.p, b.p);
    if ((b.c < 0) != (a.c < 0)) throw std::invalid_argument("cannot merge: only one side streamed outputs");
    if ((b.t < 0) != (a.t < 0)) throw std::invalid_argument("cannot merge: only one side streamed targets");
    if ((b.k < 0) != (a.k < 0)) throw std::invalid_argument("cannot merge: only one side streamed labels");
    if (a.c >= 0 && b.c != a.c) differ("output widths", a.c, b.c);
    if (a.t >= 0 && b.t != a.t) differ("target widths", a.t, b.t);
    if (a.k >= 0 && a.num_classes >= 0 && b.k > a.num_classes) differ("class counts", a.num_classes, b.k);
  } else if (a.num_classes >= 0 && b.k > a.num_classes) {
    Msg os;
    os << "cannot merge: the other state has " << b.k << " classes, more than num_classes=" << a.num_classes;
    throw std::invalid_argument(os.str());
  }
}

// The float64 state at rest. Symmetric matrices (M, A, At) are kept in their
// lower triangle (row-major, i >= j); export_symmetric fills the rest.
struct State {
  int64_t n = 0;
  int64_t p = -1;            // feature width, fixed by the first update
  int64_t c = -1;            // output width, -1 = outputs not streamed
  int64_t t = -1;            // float-target width, -1 = not streamed
  int64_t k = -1;            // classes, -1 = labels not streamed
  int64_t num_classes = -1;  // fixed class count, -1 = grows with the labels
  Precision precision = Precision::fp64;  // coarsest product precision so far

  std::vector<double> mean;       // p
  std::vector<double> M;          // p x p, lower
  std::vector<double> out_mean;   // c
  std::vector<double> B;          // p x c
  std::vector<double> A;          // c x c, lower
  std::vector<double> tgt_mean;   // t
  std::vector<double> Bt;         // p x t
  std::vector<double> At;         // t x t, lower
  std::vector<int64_t> class_counts;  // k
  std::vector<double> class_sums;     // k x p, raw sums (SPEC: float64 range)

  bool empty() const { return n == 0; }
  void reset();                        // forget samples; keep num_classes
  void check_consistent() const;       // sizes agree with p, c, t, k
  // Chan et al. pairwise merge of another state into this one (exact up to
  // rounding; merge order changes results only at rounding level).
  void merge(const State& other);
};

// Header-inline so that the device backend (which does not link the CPU
// core) validates imported states with the same rules.
inline void State::check_consistent() const {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("inconsistent state: ") + what);
  };
  need(n >= 0, "n is negative");
  if (n == 0 && p < 0) return;
  need(p >= 1, "feature width must be positive");
  need((int64_t)mean.size() == p && (int64_t)M.size() == p * p, "mean/M do not match the feature width");
  const int64_t cc = c < 0 ? 0 : c, tt = t < 0 ? 0 : t, kk = k < 0 ? 0 : k;
  need(c == -1 || c >= 1, "output width");
  need(t == -1 || t >= 1, "target width");
  need(k == -1 || k >= 0, "class count");
  need((int64_t)out_mean.size() == cc && (int64_t)B.size() == p * cc && (int64_t)A.size() == cc * cc,
       "output moments do not match the output width");
  need((int64_t)tgt_mean.size() == tt && (int64_t)Bt.size() == p * tt && (int64_t)At.size() == tt * tt,
       "target moments do not match the target width");
  need((int64_t)class_counts.size() == kk && (int64_t)class_sums.size() == kk * p,
       "class sums do not match the class count");
  need(num_classes < 0 || k <= num_classes, "more classes than num_classes");
  int64_t total = 0;
  for (int64_t v : class_counts) {
    need(v >= 0, "negative class count");
    total += v;
  }
  need(k < 0 || total == n, "class counts do not add up to n");
}

// One batch as the CPU backend sees it.
struct Batch {
  Matrix features;
  const Matrix* outputs = nullptr;
  const Matrix* labels = nullptr;
  const Matrix* targets = nullptr;
};

inline bool is_float(DType d) {
  return d == DType::f32 || d == DType::f64 || d == DType::f16 || d == DType::bf16;
}

inline void check_float_shape(const Matrix& m, const char* name, int64_t rows, int64_t width) {
  if (!is_float(m.dtype)) {
    Msg os;
    os << name << " must be float32, float64, float16 or bfloat16, got " << dtype_name(m.dtype);
    throw type_error(os.str());
  }
  if (m.cols < 1) {
    Msg os;
    os << name << " must have at least one column, got shape (" << m.rows << ", " << m.cols << ")";
    throw std::invalid_argument(os.str());
  }
  if (m.rows != rows) {
    Msg os;
    os << name << " has " << m.rows << " rows but features have " << rows;
    throw std::invalid_argument(os.str());
  }
  if (width >= 0 && m.cols != width) {
    Msg os;
    os << name << " have " << m.cols << " columns but earlier updates had " << width;
    throw std::invalid_argument(os.str());
  }
  if (m.rows > 1 && m.ld < m.cols) {
    Msg os;
    os << name << ": row stride " << m.ld << " is smaller than the width " << m.cols;
    throw std::invalid_argument(os.str());
  }
  if (m.rows > 0 && m.ptr == nullptr) throw std::invalid_argument(std::string(name) + ": null pointer");
}

// Validates a batch's shapes, widths, dtypes and streams against a state's
// widths, reading no data, so the device backend uses it without a sync.
// Throws with a message naming the offending input. Values (finiteness, label
// range) are each backend's to check before anything is merged.
inline void validate_batch(const Widths& s, const Batch& b) {
  const Matrix& x = b.features;
  if (!is_float(x.dtype)) {
    Msg os;
    os << "features must be float32, float64, float16 or bfloat16, got " << dtype_name(x.dtype);
    throw type_error(os.str());
  }
  if (x.rows < 0) throw std::invalid_argument("features: negative row count");
  const bool started = s.p >= 0;
  if (started) {
    auto stream = [](bool had, bool has, const char* name) {
      if (had && !has)
        throw std::invalid_argument(std::string("this Moments streamed ") + name + " before; pass " + name +
                                    "= on every update");
      if (!had && has)
        throw std::invalid_argument(std::string("this Moments was started without ") + name +
                                    "; a stream cannot be added later (use a new Moments)");
    };
    stream(s.c >= 0, b.outputs != nullptr, "outputs");
    stream(s.t >= 0, b.targets != nullptr, "targets");
    stream(s.k >= 0, b.labels != nullptr, "labels");
  }
  check_float_shape(x, "features", x.rows, started ? s.p : -1);
  if (b.outputs) check_float_shape(*b.outputs, "outputs", x.rows, started ? s.c : -1);
  if (b.targets) check_float_shape(*b.targets, "targets", x.rows, started ? s.t : -1);
  if (b.labels) {
    const Matrix& y = *b.labels;
    if (y.dtype != DType::i32 && y.dtype != DType::i64) {
      Msg os;
      os << "labels must be integers (int32 or int64), got " << dtype_name(y.dtype);
      throw type_error(os.str());
    }
    if (y.rows != x.rows) {
      Msg os;
      os << "labels has " << y.rows << " rows but features have " << x.rows;
      throw std::invalid_argument(os.str());
    }
    if (y.rows > 0 && y.ptr == nullptr) throw std::invalid_argument("labels: null pointer");
  }
}


// Float64 column means of a batch's float inputs (the CPU computes them
// while checking finiteness).
struct BatchMeans {
  std::vector<double> features, outputs, targets;
  // Largest column range (max - min) and largest magnitude of each input,
  // exact in float64: they tell overflow and underflow from the data.
  double range[3] = {0, 0, 0}, magnitude[3] = {0, 0, 0};
};

// Raised when a state or a batch's scratch cannot fit in this machine's
// memory (checked before allocating); bindings map it to MemoryError.
struct memory_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// CPU backend: centers each batch on its float64 mean, multiplies with BLAS
// (ssyrk/dsyrk for M and A, gemm for B), merges with State::merge semantics.
//
// Thread-safe: every public method holds the object's mutex for its whole
// call, so several threads may update, merge into and read one CpuMoments;
// each call sees (and leaves) a state between whole batches. Bindings release
// the GIL before calling (a waiting thread never holds it).
class CpuMoments {
 public:
  explicit CpuMoments(int64_t num_classes = -1) { state_.num_classes = num_classes; }

  // precision: fp64 multiplies in double; fp32 in float (float16/bfloat16
  // inputs are widened to float after centering). tf32/bf16 are GPU modes.
  // On any error (bad input, overflow, out of memory) the state is unchanged.
  void update(const Batch& b, Precision precision);
  void merge(const CpuMoments& other);
  void reset();

  State snapshot() const;      // a consistent copy of the state
  State widths() const;        // its scalar fields only (n, widths, precision), no arrays
  void set_state(State s);     // replaces the state (s already validated)
  int64_t n() const;
  int64_t p() const;

 private:
  mutable std::mutex mu_;  // guards state_ and the scratch
  State state_;
  // Scratch reused across batches: centered blocks and their products.
  template <typename T>
  struct Scratch {
    std::vector<T> x, f, t;                       // centered blocks, rows split among workers
    std::vector<std::vector<T>> M, B, A, Bt, At;  // one partial product per worker
  };
  Scratch<float> scratch_f_;
  Scratch<double> scratch_d_;
  void update_locked(const Batch& b, Precision precision);
  template <typename T>
  void update_typed(const Batch& b, const BatchMeans& means, Precision precision, Scratch<T>& sc);
};

// Gram matrices of consecutive blocks of `per` rows of x, each block centered
// on its own float64 column means before narrowing (as in an update): out holds
// rows / per full symmetric per x per matrices, row-major, in double for fp64
// and float otherwise; norms their Frobenius norms (float64). Non-finite
// inputs propagate (no check). Runs on the worker threads, one block per BLAS
// call.
void centered_grams(const Matrix& x, int64_t per, Precision precision, void* out, double* norms);

// BLAS facts for `richness info`, and the number of worker threads an update
// uses (each calls BLAS single-threaded; see CpuMoments::update_typed).
std::string blas_info();
int blas_get_num_threads();
void blas_set_num_threads(int n);

}  // namespace richness
