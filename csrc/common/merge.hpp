// Chan's merge of a block of co-moments (a batch's products, or another
// state) into a float64 State, with the checks and allocations that come
// before it. One implementation for the CPU backend's updates and for
// State::merge; the device backend runs the same formulas as kernels
// (cuda/kernels.cu). Everything loops over RICHNESS_COMOMENTS.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.hpp"
#include "state.hpp"

namespace richness {

// One block of co-moments to merge: its sample count, each stream's width
// (0 when absent) and float64 mean, and each co-moment as a row-major matrix
// of element type T with row stride ld (its width, or wider when the
// co-moments are blocks of one product), centered on the block's mean.
template <typename T>
struct Block {
  int64_t n = 0;
  int64_t width[kStreams] = {0, 0, 0};
  const double* mean[kStreams] = {nullptr, nullptr, nullptr};
  const T* part[kNumComoments] = {};
  int64_t ld[kNumComoments] = {};
  // The parts are centered on the state's means before the merge instead of
  // the block's own (merge_block takes the difference out).
  bool on_state_mean = false;
};

// Float64 vectors a merge needs (each stream's mean shift), allocated before
// the state changes.
struct MergeWork {
  std::vector<double> d[kStreams];
  explicit MergeWork(const int64_t* width) {
    for (int q = 0; q < kStreams; ++q) d[q].resize((size_t)std::max<int64_t>(width[q], 0));
  }
};

// Mirrors rows [r0, r1) of the lower triangle of the row-major n x n matrix o
// into its upper triangle (o[j][i] = o[i][j] for j < i): writes columns
// [r0, r1) of the rows above, so row ranges mirror independently. In square
// blocks: a row-by-row mirror would touch a new cache line with each write.
inline void mirror_lower(double* o, int64_t n, int64_t r0, int64_t r1) noexcept {
  constexpr int64_t kb = 32;
  for (int64_t i0 = r0; i0 < r1; i0 += kb) {
    const int64_t i1 = std::min(r1, i0 + kb);
    for (int64_t j0 = 0; j0 < i1; j0 += kb) {
      const int64_t j1 = std::min(i1, j0 + kb);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = std::max(i0, j + 1); i < i1; ++i) o[j * n + i] = o[i * n + j];
    }
  }
}

// A state held in the caller's memory: its scalars and one array a field, in
// the exported layout (symmetric matrices full), each with its size.
// export_into writes a State there; merge_into merges a State into it in
// place (the torchmetrics metric's state tensors are such arrays).
struct StateArrays {
  int64_t n = 0, p = -1, c = -1, t = -1, k = -1, num_classes = -1;
  Precision precision = Precision::fp64;
#define RICHNESS_ARRAY(name, type, rows, cols, sym) \
  type* name = nullptr;                          \
  int64_t name##_size = 0;
  RICHNESS_STATE_ARRAYS(RICHNESS_ARRAY)
#undef RICHNESS_ARRAY

  int64_t size(Dim d) const {
    const int64_t w = d == Dim::one ? 1 : d == Dim::p ? p : d == Dim::c ? c : d == Dim::t ? t : k;
    return w < 0 ? 0 : w;
  }
  int64_t width(int q) const { return size(q == 0 ? Dim::p : q == 1 ? Dim::c : Dim::t); }
  // The first array whose size is not that of a state of widths w, or nullptr.
  const char* misfit(const State& w) const {
#define RICHNESS_ARRAY(name, type, rows, cols, sym) \
  if (name##_size != w.size(rows) * w.size(cols)) return #name;
    RICHNESS_STATE_ARRAYS(RICHNESS_ARRAY)
#undef RICHNESS_ARRAY
    return nullptr;
  }
  double* comoment(int i) const {
    double* const all[] = {
#define RICHNESS_MEMBER(name, rows, cols) name,
        RICHNESS_COMOMENTS(RICHNESS_MEMBER)
#undef RICHNESS_MEMBER
    };
    return all[i];
  }
  double* stream_mean(int q) const { return q == 0 ? mean : q == 1 ? out_mean : tgt_mean; }
};

// Chan's merge of `o` into the state held in `s` (State::merge's merge, in
// the caller's memory): the arrays sized for the merged state (class arrays
// grown, an empty state's arrays of the merged widths), else nothing is
// written (std::invalid_argument naming the array); the refusals of
// State::merge, in its words. Updates s's scalars. Defined in state.cpp.
void merge_into(StateArrays& s, const State& o, int64_t workers);

// Merge destinations: a State keeps the lower triangle of a symmetric
// co-moment; arrays in the exported layout hold it full.
inline double* data_of(std::vector<double>& v) { return v.data(); }
inline const double* data_of(const std::vector<double>& v) { return v.data(); }
inline double* data_of(double* v) { return v; }
inline constexpr bool holds_full(const State&) { return false; }
inline constexpr bool holds_full(const StateArrays&) { return true; }

// X += part + f dl dr^T over a rows x cols co-moment (its lower triangle when
// symmetric; part's rows ld apart), split over the workers by area: a
// triangle's row i holds i + 1 entries, so worker w starts at rows sqrt(w / W).
//
// With `full` (X holds a symmetric co-moment full, not its lower triangle),
// each worker mirrors its rows above the diagonal once it has merged them:
// the other workers read and write only their rows' lower triangles.
template <typename T>
void add_comoment(double* X, const T* part, int64_t ld, int64_t rows, int64_t cols, bool sym, double f,
                  const double* dl, const double* dr, int64_t workers, bool full = false) noexcept {
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, rows * cols / (int64_t(1) << 18) + 1));
  auto first_row = [&](int64_t w) {
    const double share = (double)w / (double)workers;
    return std::min(rows, (int64_t)std::llround((double)rows * (sym ? std::sqrt(share) : share)));
  };
  run_split(workers, first_row, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      double* xi = X + i * cols;
      const double fdi = f * dl[i];
      const int64_t end = sym ? i + 1 : cols;
      const T* q = part + i * ld;
      for (int64_t j = 0; j < end; ++j) xi[j] += (double)q[j] + fdi * dr[j];
    }
    if (full && sym) mirror_lower(X, cols, r0, r1);
  });
}

// Chan et al.: with d = mean_b - mean_a and f = na nb / n, each co-moment
//   X = Xa + Xb + f d_rows d_cols^T,  and each mean += d nb / n.
// Only lower triangles of the symmetric ones are read and written. Neither
// allocates nor throws: callers check overflow_of and allocate `work` first.
//
// Parts centered on the state's means a instead (Block::on_state_mean) are
// Xb + nb d d^T, so the same merge is X = Xa + part - (nb^2 / n) d d^T.
//
// S: a State, or a state in the caller's arrays (StateArrays, sized for the
// merged state); class arrays are the caller's.
template <typename T, typename S>
void merge_block(S& s, const Block<T>& b, MergeWork& work, int64_t workers) noexcept {
  const double na = (double)s.n, nb = (double)b.n, n = na + nb;
  const double f = b.on_state_mean ? -(nb * nb / n) : na * nb / n, w = nb / n;
  for (int q = 0; q < kStreams; ++q) {
    const double* mean = data_of(s.stream_mean(q));
    for (int64_t j = 0; j < s.width(q); ++j) work.d[q][j] = b.mean[q][j] - mean[j];
  }
  for (int i = 0; i < kNumComoments; ++i) {
    const Comoment& cm = kComoments[i];
    add_comoment(data_of(s.comoment(i)), b.part[i], b.ld[i], s.width(cm.rows), s.width(cm.cols), cm.symmetric(), f,
                 work.d[cm.rows].data(), work.d[cm.cols].data(), workers, holds_full(s));
  }
  for (int q = 0; q < kStreams; ++q) {
    double* mean = data_of(s.stream_mean(q));
    for (int64_t j = 0; j < s.width(q); ++j) mean[j] += work.d[q][j] * w;
  }
  s.n += b.n;
}

// Which stream's merged moments would overflow (0 features, 1 outputs,
// 2 targets), or -1. The moment matrices are Gram matrices, so by
// Cauchy-Schwarz no entry exceeds the largest diagonal (up to rounding): the
// diagonals of the state, of each product (in its own type T) and the
// mean-shift term f |d|^2 bound every merged entry, the cross co-moments'
// included. A margin of 4 covers the rounding. Reads O(p) values; changes
// nothing. S: a State or StateArrays.
template <typename T, typename S>
int overflow_of(const S& s, const Block<T>& b) {
  const double part_max = (double)std::numeric_limits<T>::max() / 4;
  const double state_max = std::numeric_limits<double>::max() / 4;
  const bool started = s.n > 0 && s.p >= 0;
  const double f = started ? (double)s.n * (double)b.n / ((double)s.n + (double)b.n) : 0.0;
  for (int i = 0; i < kNumComoments; ++i) {
    const int q = kComoments[i].rows;
    if (!kComoments[i].symmetric() || b.width[q] <= 0) continue;
    const int64_t w = b.width[q];
    double bound = 0.0;
    for (int64_t j = 0; j < w; ++j) {
      double diag = (double)b.part[i][j * b.ld[i] + j];
      if (!(diag <= part_max)) return q;  // Inf or NaN from the product itself
      double shift = 0.0;  // parts centered on the state's means hold it already (and more)
      if (started) {
        const double dj = b.mean[q][j] - s.stream_mean(q)[j];
        diag += s.comoment(i)[j * w + j];
        shift = b.on_state_mean ? 0.0 : f * dj * dj;
      }
      bound = std::max(bound, diag + shift);
    }
    if (!(bound <= state_max)) return q;  // also for Inf and NaN
  }
  return -1;
}

// Sizes the state for its first samples (p, c, t, k fixed from then on).
inline void shape_state(State& s, int64_t p, int64_t c, int64_t t, int64_t k) {
  s.p = p;
  s.c = c;
  s.t = t;
  s.k = k;
#define RICHNESS_SHAPE(name, type, rows, cols, sym) s.name.assign((size_t)(s.size(rows) * s.size(cols)), type(0));
  RICHNESS_STATE_ARRAYS(RICHNESS_SHAPE)
#undef RICHNESS_SHAPE
}

// Where a merge writes: the state itself, or (for its first samples) a fresh
// state sized in advance; with class arrays grown in advance. Everything is
// allocated in the constructor; commit() only swaps, so a failed allocation
// leaves the state as it was.
struct Target {
  State& s;
  State fresh;
  bool is_fresh = false;
  int64_t grow_to = -1;
  std::vector<int64_t> counts;
  std::vector<double> sums;

  Target(State& state, int64_t p, int64_t c, int64_t t, int64_t k) : s(state) {
    if (s.p < 0 || s.n == 0) {
      fresh.num_classes = s.num_classes;
      fresh.precision = s.precision;
      if (s.p < 0) {  // an unshaped state's arrays are empty: reuse their memory (State::reset keeps it)
#define RICHNESS_TAKE(name, type, rows, cols, sym) fresh.name.swap(s.name);
        RICHNESS_STATE_ARRAYS(RICHNESS_TAKE)
#undef RICHNESS_TAKE
      }
      shape_state(fresh, p, c, t, k);
      is_fresh = true;
    } else if (k > s.k) {  // labels streamed without num_classes: grow to k classes
      counts.reserve((size_t)k);
      counts.assign(s.class_counts.begin(), s.class_counts.end());
      counts.resize((size_t)k, 0);
      sums.reserve((size_t)(k * s.p));
      sums.assign(s.class_sums.begin(), s.class_sums.end());
      sums.resize((size_t)(k * s.p), 0.0);
      grow_to = k;
    }
  }
  State& state() { return is_fresh ? fresh : s; }
  void grow() noexcept {
    if (grow_to < 0) return;
    s.class_counts.swap(counts);
    s.class_sums.swap(sums);
    s.k = grow_to;
  }
  void commit() noexcept {
    if (is_fresh) s = std::move(fresh);
  }
};

}  // namespace richness
