// State's methods: reset, and the merge of two states (common/merge.hpp).
#include "merge.hpp"

#include <stdexcept>
#include <string>

namespace richness {

void State::reset() {
  const int64_t nc = num_classes;
  *this = State();
  num_classes = nc;
}

void State::merge(const State& o, int64_t workers) {
  if (o.p < 0 || o.n == 0) return;
  check_mergeable({n, p, c, t, k, num_classes}, {o.n, o.p, o.c, o.t, o.k, o.num_classes});
  check_count_fits(n, o.n, "nothing was merged");
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
  const int which = overflow_of(*this, b);
  if (which >= 0)
    throw std::invalid_argument(std::string("cannot merge: the merged ") + stream_name(which) +
                                " moments would overflow float64; rescale the data; nothing was merged");
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

}  // namespace richness
