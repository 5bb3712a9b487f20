// The interface both backends implement (CpuMoments, cpu/cpu_moments.hpp;
// cuda::CudaMoments, cuda/cuda_moments.hpp), in the manner of faiss's Index:
// the surface they share (widths, n, reset, state export and import,
// merge_from) and the rules that are not a backend's to decide, which live
// here once: which states merge (check_compatible_for_merge) and which states
// may be imported (State::check_consistent, run by set_state).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "msg.hpp"
#include "state.hpp"
#include "types.hpp"

namespace richness {

namespace detail {
// Distinct values, sorted, as Python prints a list of ints: "[3, 4]".
inline std::string int_list(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  Msg os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

inline std::string decimal(unsigned __int128 v) {
  std::string s;
  do {
    s.insert(s.begin(), char('0' + (int)(v % 10)));
    v /= 10;
  } while (v != 0);
  return s;
}
}  // namespace detail

class Moments {
 public:
  virtual ~Moments() = default;

  // The merge rule of richness: throws std::invalid_argument, before anything
  // changes, unless states of these widths (n included) merge into one.
  // Every merge asks it: both backends' merge_from, State::merge and
  // merge_into (common/state.cpp), and Python's _state.check_compatible (the
  // many-state, distributed, file and dask merges) through the binding
  // _core.check_compatible_for_merge. States that fix num_classes must fix
  // the same one, and hold no more classes than it; states with samples hold
  // the same feature, output and target widths and all or none of them
  // labels (states without samples merge with anything else); the merged
  // sample count fits int64.
  static void check_compatible_for_merge(const std::vector<Widths>& states) {
    std::vector<int64_t> fixed;
    for (const Widths& w : states)
      if (w.num_classes >= 0) fixed.push_back(w.num_classes);
    if (!fixed.empty() && *std::min_element(fixed.begin(), fixed.end()) != *std::max_element(fixed.begin(), fixed.end()))
      throw std::invalid_argument("cannot merge: states fix different num_classes " + detail::int_list(fixed));
    std::vector<const Widths*> live;
    for (const Widths& w : states)
      if (w.n > 0) live.push_back(&w);
    const std::pair<int64_t Widths::*, const char*> streams[] = {
        {&Widths::p, "feature widths"}, {&Widths::c, "output widths"}, {&Widths::t, "target widths"}};
    for (const auto& [width, what] : streams) {
      std::vector<int64_t> vals;
      for (const Widths* w : live) vals.push_back(w->*width);
      if (vals.empty() || std::count(vals.begin(), vals.end(), vals.front()) == (ptrdiff_t)vals.size()) continue;
      throw std::invalid_argument(std::string("cannot merge: states hold different ") + what + " " +
                                  detail::int_list(vals) + " (-1 = not streamed)");
    }
    for (const Widths* w : live)
      if ((w->k >= 0) != (live.front()->k >= 0))
        throw std::invalid_argument("cannot merge: some states streamed labels and others did not");
    if (!fixed.empty()) {
      int64_t k = -1;
      for (const Widths& w : states) k = std::max(k, w.k);
      if (k > fixed.front()) {
        Msg os;
        os << "cannot merge: a state has " << k << " classes, more than num_classes=" << fixed.front();
        throw std::invalid_argument(os.str());
      }
    }
    unsigned __int128 total = 0;
    for (const Widths* w : live) total += (unsigned __int128)w->n;
    if (total > (unsigned __int128)std::numeric_limits<int64_t>::max())
      throw std::invalid_argument("the sample count would pass 2**63 - 1 (" + detail::decimal(total) +
                                  "), the largest an int64 holds; nothing was merged");
  }
  // The same rule for the state `into` absorbing `from` (a pairwise merge).
  static void check_compatible_for_merge(const Widths& into, const Widths& from) {
    check_compatible_for_merge(std::vector<Widths>{into, from});
  }

  // "cpu" or "cuda": states merge only within a backend (across, through
  // get_state and set_state).
  virtual const char* backend() const = 0;
  // n and the widths (a device backend synchronises for n).
  virtual Widths widths() = 0;
  virtual int64_t n() = 0;
  // Forgets the samples; keeps num_classes.
  virtual void reset() = 0;
  // A float64 host copy of the state (symmetric matrices in the exported layout of each backend).
  virtual State get_state() = 0;

  // Replaces the state with `s`, refused (std::invalid_argument) unless it is
  // consistent (State::check_consistent), before anything changes.
  void set_state(State s) {
    s.check_consistent();
    replace_state(std::move(s));
  }

  // Chan's merge of other's state into this one (other unchanged; other may
  // be this object). Refused by check_compatible_for_merge before anything
  // changes; states of another backend are refused by name.
  void merge_from(Moments& other) {
    if (std::string(backend()) != other.backend())
      throw std::invalid_argument(std::string("cannot merge: a ") + other.backend() + " state into a " + backend() +
                                  " one (move it with get_state and set_state)");
    merge_same(other);
  }

 protected:
  // The state replaced by a consistent one.
  virtual void replace_state(State s) = 0;
  // other is of this backend. Each backend reads both states' widths where
  // they are stable (under its locks, after its synchronisation) and asks
  // check_compatible_for_merge before anything changes.
  virtual void merge_same(Moments& other) = 0;
};

}  // namespace richness
