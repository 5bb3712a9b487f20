// Row ranges on threads, with no exception left on a thread.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace richness {

// Worker threads kept from one call to the next, one pool per process and
// module. A thread started per call cost system time (its stack mapped and
// unmapped, clone, exit): about 0.3-0.5 ms of a 2.7 ms update of 1,280 x 512
// rows on two workers, which starts six (benchmarks/RESULTS.md, "A pool of
// workers"). Idle threads poll for a few tens of microseconds, then sleep on
// a condition variable: the cores are a training step's soon after the call
// returns.
//
// One caller at a time holds the pool; a second caller (another thread's
// update, or a job that itself splits) starts threads of its own instead. A
// child process after fork() gets a pool of its own (its parent's threads do
// not exist there): the parent's is left as it was, never used again.
class WorkerPool {
 public:
  // The process's pool, made on first use (and again in a forked child)
  // when `make`; nullptr if there is none or it cannot be made now.
  static WorkerPool* get(bool make = true) noexcept {
    static std::mutex made_mu;
    static WorkerPool* pool = nullptr;
    std::unique_lock<std::mutex> lock(made_mu, std::try_to_lock);
    if (!lock.owns_lock()) return nullptr;
    if (pool == nullptr || pool->pid_ != getpid()) {
      if (!make) return nullptr;
      try {
        pool = new WorkerPool();  // never deleted: its threads live as long as the process
      } catch (...) {
        return nullptr;
      }
    }
    return pool;
  }

  // Idle workers sleep now instead of polling for the next step: the end of
  // a call that may have split work (ParkWorkers).
  static void park() noexcept {
    if (WorkerPool* pool = get(false)) pool->parked_.store(true, std::memory_order_relaxed);
  }

  // Runs job(w) for 1 <= w < workers on the pool's threads and job(0) on the
  // calling thread, and returns when all have finished; false, having run
  // nothing, when the pool is held by another caller or cannot grow to
  // workers - 1 threads. job must not throw.
  bool run(int64_t workers, const std::function<void(int64_t)>& job) noexcept {
    std::unique_lock<std::mutex> held(busy_, std::try_to_lock);
    if (!held.owns_lock()) return false;
    try {
      for (; started_ < workers - 1; ++started_) {
        const int64_t index = started_;
        std::thread([this, index] { loop(index); }).detach();  // lives as long as the process
      }
    } catch (...) {
      return false;  // the threads started so far wait for the next call
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      parked_.store(false, std::memory_order_relaxed);
      job_ = &job;
      active_ = workers - 1;
      pending_.store(workers - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    start_.notify_all();
    job(0);
    if (!spin([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    std::lock_guard<std::mutex> lock(mu_);
    job_ = nullptr;  // a thread started by a later call never sees this job
    active_ = 0;
    return true;
  }

 private:
  WorkerPool() : pid_(getpid()) {}

  // Polls ready() for 100 microseconds; whether it became true. The phases of
  // one update follow each other closer than a sleeping thread wakes (a futex
  // wake and a context switch each way), so workers and the caller look for
  // the next step a little before sleeping; park() at the end of a call sends
  // the workers to sleep at once.
  template <typename Ready>
  static bool spin(Ready&& ready) noexcept {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
    for (;;) {
      for (int i = 0; i < 32; ++i) {
        if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  // A worker: polls, then sleeps, until a new job; takes each job's
  // generation, width and function together under mu_ (so a job that starts
  // while it looks is never mistaken for the one before), runs its share if
  // its index is within the job's width, and counts itself done.
  void loop(int64_t index) noexcept {
    uint64_t seen = 0;
    for (;;) {
      spin([&] {
        return generation_.load(std::memory_order_acquire) != seen || parked_.load(std::memory_order_relaxed);
      });
      std::unique_lock<std::mutex> lock(mu_);
      start_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      const int64_t active = active_;
      const std::function<void(int64_t)>* job = job_;
      lock.unlock();
      if (index >= active || job == nullptr) continue;
      (*job)(index + 1);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller is waiting or about to look again
        done_.notify_one();
      }
    }
  }

  const pid_t pid_;
  std::mutex busy_;  // held by the caller whose job runs
  std::mutex mu_;    // pairs with the condition variables (sleepers)
  std::condition_variable start_, done_;
  int64_t started_ = 0;  // threads started (under busy_)
  std::atomic<uint64_t> generation_{0};  // written under mu_; read without it while polling
  std::atomic<int64_t> pending_{0};      // workers of the current job not yet done
  std::atomic<bool> parked_{false};
  int64_t active_ = 0;                               // the current job's pool workers (under mu_)
  const std::function<void(int64_t)>* job_ = nullptr;  // the current job (under mu_)
};

// Parks the pool's workers when it goes out of scope (an entry point's end).
struct ParkWorkers {
  ParkWorkers() = default;
  ParkWorkers(const ParkWorkers&) = delete;
  ParkWorkers& operator=(const ParkWorkers&) = delete;
  ~ParkWorkers() { WorkerPool::park(); }
};

// Runs fn(w, r0, r1) for w < workers over the row ranges [range_of(w),
// range_of(w + 1)), worker 0 on the calling thread and the others on the
// pool's threads (WorkerPool), or on threads of their own when the pool is
// busy. No exception leaves a thread (that would end the process): one
// thrown by a worker (std::bad_alloc) is rethrown here once every worker has
// finished, and a range whose thread cannot be started runs here. When fn
// itself cannot throw, neither can this: a merge that has begun completes.
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
  bool ran = false;
  if (WorkerPool* shared = WorkerPool::get()) {
    try {
      const std::function<void(int64_t)> job(std::cref(guarded));
      ran = shared->run(workers, job);
    } catch (...) {  // the job's wrapper could not be made: threads of our own below
    }
  }
  if (!ran) {
    for (int64_t w = 1; w < workers; ++w) {
      try {
        pool.emplace_back(guarded, w);
      } catch (...) {
        guarded(w);
      }
    }
    guarded(0);
    for (auto& t : pool) t.join();
  }
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
