// The streamed float64 co-moment state (docs/MATH.md, "Streaming estimator")
// and the rules for merging two of them. Its arrays are declared once, in
// RICHNESS_STATE_ARRAYS; python/richness/_state.py holds the same list.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "msg.hpp"
#include "precision.hpp"
#include "types.hpp"

namespace richness {

// Refuses, before anything changes, an update that would take the sample
// count n past int64 (class counts add up to n, so they cannot wrap first).
// `unchanged` ends the message: what was left as it was. (A merge's bound is
// part of the merge rule, Moments::check_compatible_for_merge.)
inline void check_count_fits(int64_t n, int64_t more, const char* unchanged) {
  if (more <= std::numeric_limits<int64_t>::max() - n) return;
  Msg os;
  os << "the sample count would pass 2**63 - 1 (" << n << " + " << more << "), the largest an int64 holds; "
     << unchanged;
  throw input_error(os.str(), "", -1, "int64");
}

// Without num_classes the class arrays grow to the largest label; a stray
// huge label would silently allocate gigabytes of class sums, so labels from
// this count on (class sums past 1 GiB at width p) need num_classes to be
// given. Both backends refuse them.
inline int64_t class_growth_cap(int64_t p) {
  return std::max<int64_t>((int64_t(1) << 27) / std::max<int64_t>(p, 1), 1024);
}

// The widths an array of the state is measured in.
enum class Dim { one, p, c, t, k };

// The state's arrays, the one list the C++ side reads (bindings export and
// import them, check_consistent and shape() size them): name, element type,
// rows, columns, symmetric. Symmetric matrices are kept in their lower
// triangle (row-major, i >= j) and exported full. python/richness/_state.py
// (FIELDS) lists the same arrays in the same order; a test compares the two.
// Adding an array: one line here, one there, and its arithmetic in the
// backends' update and merge.
#define RICHNESS_STATE_ARRAYS(X)                    \
  X(mean, double, Dim::one, Dim::p, false)          \
  X(M, double, Dim::p, Dim::p, true)                \
  X(out_mean, double, Dim::one, Dim::c, false)      \
  X(B, double, Dim::p, Dim::c, false)               \
  X(A, double, Dim::c, Dim::c, true)                \
  X(tgt_mean, double, Dim::one, Dim::t, false)      \
  X(Bt, double, Dim::p, Dim::t, false)              \
  X(At, double, Dim::t, Dim::t, true)               \
  X(class_counts, int64_t, Dim::one, Dim::k, false) \
  X(class_sums, double, Dim::k, Dim::p, false)  // raw sums: float64 range (docs/MATH.md, "NC1")

// The streams a state may hold, by index: 0 features (width p, mean),
// 1 outputs (c, out_mean), 2 targets (t, tgt_mean).
inline constexpr int kStreams = 3;
inline const char* stream_name(int q) { return q == 0 ? "features" : q == 1 ? "outputs" : "targets"; }

// The co-moments, one line a pair of streams: the array (in
// RICHNESS_STATE_ARRAYS), its row stream and its column stream. A pair of a
// stream with itself is symmetric (its lower triangle is kept). Scratch,
// products, overflow checks and merges loop over this list.
#define RICHNESS_COMOMENTS(X) X(M, 0, 0) X(B, 0, 1) X(A, 1, 1) X(Bt, 0, 2) X(At, 2, 2)

struct Comoment {
  int rows, cols;  // streams
  bool symmetric() const { return rows == cols; }
};
inline constexpr Comoment kComoments[] = {
#define RICHNESS_PAIR(name, rows, cols) {rows, cols},
    RICHNESS_COMOMENTS(RICHNESS_PAIR)
#undef RICHNESS_PAIR
};
inline constexpr int kNumComoments = (int)(sizeof(kComoments) / sizeof(kComoments[0]));

// The float64 state at rest.
struct State {
  int64_t n = 0;
  int64_t p = -1;            // feature width, fixed by the first update
  int64_t c = -1;            // output width, -1 = outputs not streamed
  int64_t t = -1;            // float-target width, -1 = not streamed
  int64_t k = -1;            // classes, -1 = labels not streamed
  int64_t num_classes = -1;  // fixed class count, -1 = grows with the labels
  Precision precision = Precision::fp64;  // coarsest product precision so far

#define RICHNESS_DECLARE(name, type, rows, cols, sym) std::vector<type> name;
  RICHNESS_STATE_ARRAYS(RICHNESS_DECLARE)
#undef RICHNESS_DECLARE

  // The size of a dimension (a stream not present counts 0).
  int64_t size(Dim d) const {
    switch (d) {
      case Dim::one: return 1;
      case Dim::p: return p < 0 ? 0 : p;
      case Dim::c: return c < 0 ? 0 : c;
      case Dim::t: return t < 0 ? 0 : t;
      case Dim::k: return k < 0 ? 0 : k;
    }
    return 0;
  }

  int64_t width(int stream) const { return size(stream == 0 ? Dim::p : stream == 1 ? Dim::c : Dim::t); }
  std::vector<double>& stream_mean(int q) { return q == 0 ? mean : q == 1 ? out_mean : tgt_mean; }
  const std::vector<double>& stream_mean(int q) const { return q == 0 ? mean : q == 1 ? out_mean : tgt_mean; }
  std::vector<double>& comoment(int i);  // the i-th of RICHNESS_COMOMENTS
  const std::vector<double>& comoment(int i) const;

  State scalars() const;               // n, the widths and precision, without the arrays
  void reset();                        // forget samples; keep num_classes
  void check_consistent() const;       // sizes agree with p, c, t, k
  // Chan et al. pairwise merge of another state into this one (exact up to
  // rounding; merge order changes results only at rounding level), the
  // largest co-moment split over `workers` threads (common/merge.hpp).
  void merge(const State& other, int64_t workers = 1);
  // ||M||_F from M's lower triangle, in float64 (a batch's own DLR reads it).
  double norm_m() const;
};

inline constexpr std::vector<double> State::*kComomentArrays[] = {
#define RICHNESS_MEMBER(name, rows, cols) &State::name,
    RICHNESS_COMOMENTS(RICHNESS_MEMBER)
#undef RICHNESS_MEMBER
};
inline std::vector<double>& State::comoment(int i) { return this->*kComomentArrays[i]; }
inline const std::vector<double>& State::comoment(int i) const { return this->*kComomentArrays[i]; }

inline State State::scalars() const {
  State w;
  w.n = n, w.p = p, w.c = c, w.t = t, w.k = k, w.num_classes = num_classes, w.precision = precision;
  return w;
}

// Header-inline so that the device backend (which does not link the CPU
// core) validates imported states with the same rules. The structural rules
// of a state (widths in range, array sizes, class counts adding up to n):
// python/richness/_state.py's validator (`checked`) refuses every state this
// refuses, and adds the rules on values (finite, symmetric, semi-definite,
// class sums against the mean) that only Python checks; tests/engine/test_core_rules.py
// generates states and checks the two agree on these rules.
inline void State::check_consistent() const {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("inconsistent state: ") + what);
  };
  need(n >= 0, "n is negative");
  need(p == -1 || p >= 1, "feature width must be -1 (not yet known) or positive");
  need(n == 0 || p >= 1, "samples without a feature width");
  need(c == -1 || c >= 1, "output width");
  need(t == -1 || t >= 1, "target width");
  need(k >= -1, "class count");
  need(num_classes == -1 || num_classes >= 1, "num_classes must be -1 (not fixed) or positive");
#define RICHNESS_CHECK_SIZE(name, type, rows, cols, sym) \
  need((int64_t)name.size() == size(rows) * size(cols), #name " does not match the widths");
  RICHNESS_STATE_ARRAYS(RICHNESS_CHECK_SIZE)
#undef RICHNESS_CHECK_SIZE
  need(num_classes < 0 || k <= num_classes, "more classes than num_classes");
  int64_t total = 0;
  for (int64_t v : class_counts) {
    need(v >= 0, "negative class count");
    need(v <= n - total, "class counts do not add up to n");  // total + v, without wrapping past int64
    total += v;
  }
  need(k < 0 || total == n, "class counts do not add up to n");
}

}  // namespace richness
