// Row ranges on threads, with no exception left on a thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace richness {

// Runs fn(w, r0, r1) for w < workers over the row ranges [range_of(w),
// range_of(w + 1)), worker 0 on the calling thread and the others on threads
// of their own. No exception leaves a thread (that would end the process):
// one thrown by a worker (std::bad_alloc) is rethrown here once every worker
// has finished, and a range whose thread cannot be started runs here. When
// fn itself cannot throw, neither can this: a merge that has begun completes.
template <typename Range, typename Fn>
void run_split(int64_t workers, Range&& range_of, Fn&& fn) {
  if (workers <= 1) {  // the common case: no thread, no bookkeeping
    fn(0, range_of(0), range_of(1));
    return;
  }
  std::vector<std::exception_ptr> errors;
  std::vector<std::thread> pool;
  try {
    errors.resize((size_t)std::max<int64_t>(workers, 1));
    pool.reserve((size_t)std::max<int64_t>(workers - 1, 0));
  } catch (...) {  // no room for the threads' bookkeeping: run every range here
    for (int64_t w = 0; w < workers; ++w) fn(w, range_of(w), range_of(w + 1));
    return;
  }
  auto guarded = [&](int64_t w) noexcept {
    try {
      fn(w, range_of(w), range_of(w + 1));
    } catch (...) {
      errors[(size_t)w] = std::current_exception();
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(guarded, w);
    } catch (...) {
      guarded(w);
    }
  }
  guarded(0);
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Runs fn(w, r0, r1) on `workers` threads over contiguous row ranges. The
// split depends only on the worker count, so results are reproducible.
template <typename Fn>
void run_workers(int64_t workers, int64_t rows, Fn&& fn) {
  workers = std::max<int64_t>(workers, 1);
  const int64_t step = (rows + workers - 1) / workers;
  run_split(workers, [&](int64_t w) { return std::min(rows, w * step); }, fn);
}

}  // namespace richness
