// State's methods: reset, the merge of two states and of a state into the
// caller's arrays (one merge, common/merge.hpp), the feature co-moment's norm.
#include "merge.hpp"
#include "moments.hpp"
#include "msg.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace richness {

void State::reset() {
  // An empty state that keeps the arrays' memory: the next first batch sizes
  // them again without new pages (a batch state reset for every batch, as the
  // torchmetrics metric's, would otherwise map its p x p arrays each time).
  State empty;
  empty.num_classes = num_classes;
#define RICHNESS_KEEP(name, type, rows, cols, sym) \
  name.clear();                                  \
  empty.name.swap(name);
  RICHNESS_STATE_ARRAYS(RICHNESS_KEEP)
#undef RICHNESS_KEEP
  *this = std::move(empty);
}

namespace {
// A state as a block to merge (its co-moments centered on its own means).
Block<double> block_of(const State& o) {
  Block<double> b;
  b.n = o.n;
  for (int q = 0; q < kStreams; ++q) {
    b.width[q] = o.width(q);
    b.mean[q] = o.stream_mean(q).data();
  }
  for (int i = 0; i < kNumComoments; ++i) {
    b.part[i] = o.comoment(i).data();
    b.ld[i] = o.width(kComoments[i].cols);
  }
  return b;
}

// The merge rule (Moments::check_compatible_for_merge), asked before a state
// without samples is skipped.
template <typename S>
void check_compatible(const S& s, const State& o) {
  Moments::check_compatible_for_merge(Widths{s.n, s.p, s.c, s.t, s.k, s.num_classes},
                                      Widths{o.n, o.p, o.c, o.t, o.k, o.num_classes});
}

template <typename S>
void check_overflow(const S& s, const Block<double>& b) {
  const int which = overflow_of(s, b);
  if (which >= 0)
    throw std::invalid_argument(std::string("cannot merge: the merged ") + stream_name(which) +
                                " moments would overflow float64; rescale the data; nothing was merged");
}
}  // namespace

void State::merge(const State& o, int64_t workers) {
  check_compatible(*this, o);
  if (o.p < 0 || o.n == 0) return;
  const Block<double> b = block_of(o);
  check_overflow(*this, b);
  Target target(*this, o.p, o.c, o.t, o.k < 0 ? -1 : std::max<int64_t>(o.k, num_classes));
  MergeWork work(b.width);
  target.grow();
  State& s = target.state();
  merge_block(s, b, work, workers);
  for (int64_t i = 0; i < o.k; ++i) s.class_counts[i] += o.class_counts[i];
  for (size_t i = 0; i < o.class_sums.size(); ++i) s.class_sums[i] += o.class_sums[i];
  s.precision = std::max(s.precision, o.precision);
  target.commit();
}

void merge_into(StateArrays& s, const State& o, int64_t workers) {
  check_compatible(s, o);
  if (o.p < 0 || o.n == 0) return;
  const Block<double> b = block_of(o);
  check_overflow(s, b);
  State merged;  // the merged widths, as State::merge's Target sizes them
  if (s.n == 0 || s.p < 0) {
    merged = o.scalars();
    merged.k = o.k < 0 ? -1 : std::max<int64_t>(o.k, s.num_classes);
    merged.num_classes = s.num_classes;
  } else {
    merged.p = s.p, merged.c = s.c, merged.t = s.t, merged.k = std::max(s.k, o.k);
  }
  if (const char* name = s.misfit(merged)) {
    Msg os;
    os << "merge_into: '" << name << "' does not have the merged state's size; nothing was merged";
    throw std::invalid_argument(os.str());
  }
  if (s.n == 0 || s.p < 0) {  // an empty state: zeros of the merged widths
#define RICHNESS_ZERO(name, type, rows, cols, sym) std::fill(s.name, s.name + s.name##_size, type(0));
    RICHNESS_STATE_ARRAYS(RICHNESS_ZERO)
#undef RICHNESS_ZERO
    s.n = 0;
    s.p = merged.p, s.c = merged.c, s.t = merged.t, s.precision = o.precision;
  }
  s.k = merged.k;
  MergeWork work(b.width);
  merge_block(s, b, work, workers);
  for (int64_t i = 0; i < o.k; ++i) s.class_counts[i] += o.class_counts[i];
  for (size_t i = 0; i < o.class_sums.size(); ++i) s.class_sums[i] += o.class_sums[i];
  s.precision = std::max(s.precision, o.precision);
}

double State::norm_m() const {
  // Eight running sums over the lower triangle, so that the additions need
  // not wait on each other; the diagonal once, the rest twice.
  double diag = 0.0, off[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t w = size(Dim::p);
  for (int64_t i = 0; i < w; ++i) {
    const double* row = M.data() + i * w;
    for (int64_t j = 0; j < i; ++j) off[j & 7] += row[j] * row[j];
    diag += row[i] * row[i];
  }
  double total = 0.0;
  for (double o : off) total += o;
  return std::sqrt(2.0 * total + diag);
}

}  // namespace richness
