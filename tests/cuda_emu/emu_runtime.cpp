// The emulator's runtime: device memory, stream queues, the kernel scheduler
// (blocks one at a time, threads as fibers where they synchronise) and the
// cuBLAS reference. See cuda_emu.hpp for the model.
#include "cuda_emu.hpp"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace emu {
namespace {

// ---- bookkeeping --------------------------------------------------------------------

std::string g_errors;
void record(const std::string& s) {
  g_errors += s;
  g_errors += '\n';
}
std::map<std::string, long long> g_counts;
long long g_host_syncs = 0;
cudaError_t g_last_error = cudaSuccess;
int g_mode = 1;  // 0: fifo, 1: random
std::mt19937 g_rng(12345);

std::string hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

// ---- device memory ------------------------------------------------------------------

struct Alloc {
  char* base;
  size_t size, rounded;
  char* map;
  size_t map_len;
  bool external;
};
std::map<uintptr_t, Alloc> g_allocs;  // by base address
constexpr unsigned char kCanary = 0xA5;

size_t page_size() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}
bool guard_at_start() {
  static const bool s = [] {
    const char* v = std::getenv("EMU_GUARD");
    return v && std::string(v) == "start";
  }();
  return s;
}

const Alloc* find_alloc(const void* p) {
  const uintptr_t a = (uintptr_t)p;
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  const Alloc& al = it->second;
  if (a >= (uintptr_t)al.base && a < (uintptr_t)al.base + std::max<size_t>(al.size, 1)) return &al;
  return nullptr;
}

// [p, p + bytes) inside one allocation (device memory as the emulator knows it).
bool check_range(const void* p, size_t bytes, const std::string& what) {
  if (bytes == 0) return true;
  const Alloc* a = find_alloc(p);
  if (!a) {
    record(what + ": " + hex(p) + " (" + std::to_string(bytes) + " bytes) is not in any device allocation");
    return false;
  }
  const size_t off = (size_t)((const char*)p - a->base);
  if (off + bytes > a->size) {
    record(what + ": " + std::to_string(bytes) + " bytes at offset " + std::to_string(off) +
           " of an allocation of " + std::to_string(a->size) + " bytes (past its end by " +
           std::to_string(off + bytes - a->size) + ")");
    return false;
  }
  return true;
}

void check_canaries() {
  for (auto& [k, a] : g_allocs) {
    if (a.external) continue;
    for (size_t i = a.size; i < a.rounded; ++i)
      if ((unsigned char)a.base[i] != kCanary) {
        record("write past the end of an allocation of " + std::to_string(a.size) + " bytes (byte " +
               std::to_string(i) + " of its 256-byte rounding changed)");
        std::memset(a.base + a.size, kCanary, a.rounded - a.size);
        break;
      }
  }
}

// ---- stream queues ------------------------------------------------------------------

struct Op {
  uint64_t seq;
  std::vector<uint64_t> deps;
  std::function<void()> fn;
};
std::map<uint64_t, Op> g_pending;
uint64_t g_seq = 1;
std::map<uintptr_t, uint64_t> g_last_in_stream;
std::map<uintptr_t, std::vector<uint64_t>> g_waits;  // event waits for the stream's next op
bool g_running = false;

uintptr_t stream_id(cudaStream_t s) {
  const uintptr_t v = (uintptr_t)s;
  return v == 1 ? 0 : v;  // cudaStreamLegacy is the legacy default stream
}

// Graph capture (global mode, as torch.cuda.graph): work enqueued on the
// capturing stream is recorded, not run; emu_replay enqueues it again.
bool g_capturing = false;
uintptr_t g_capture_stream = 0;
std::vector<std::function<void()>> g_graph;

}  // namespace

// Calls that are illegal while a stream is captured in global mode (they
// synchronise or allocate): recorded as errors, and they fail as in CUDA.
bool capture_forbids(const char* what) {
  if (!g_capturing) return false;
  record(std::string(what) + " during a CUDA graph capture (global mode): cudaErrorStreamCaptureUnsupported");
  return true;
}

// Streams other than the legacy default one are taken to be non-blocking (as
// torch's are): nothing orders them against stream 0 but events and syncs.
uint64_t enqueue(cudaStream_t st, std::function<void()> fn) {
  const uintptr_t s = stream_id(st);
  if (g_capturing && s == g_capture_stream) {
    g_graph.push_back(std::move(fn));
    return 0;
  }
  if (g_capturing && s == 0) record("work on the legacy default stream during a graph capture (cudaErrorStreamCaptureImplicit)");
  Op op;
  op.seq = g_seq++;
  op.fn = std::move(fn);
  auto add = [&](uint64_t d) {
    if (d && g_pending.count(d)) op.deps.push_back(d);
  };
  auto it = g_last_in_stream.find(s);
  if (it != g_last_in_stream.end()) add(it->second);
  auto w = g_waits.find(s);
  if (w != g_waits.end()) {
    for (uint64_t d : w->second) add(d);
    g_waits.erase(w);
  }
  g_last_in_stream[s] = op.seq;
  const uint64_t seq = op.seq;
  g_pending.emplace(seq, std::move(op));
  return seq;
}

namespace {

// Runs the pending operations in `closure` (all of them if null), each after
// its dependencies, otherwise in random (or fifo) order.
void drain(const std::set<uint64_t>* closure) {
  if (g_running) {
    std::fprintf(stderr, "emu: a synchronising call inside a running operation\n");
    std::abort();
  }
  g_running = true;
  for (;;) {
    std::vector<uint64_t> ready;
    for (auto& [seq, op] : g_pending) {
      if (closure && !closure->count(seq)) continue;
      bool ok = true;
      for (uint64_t d : op.deps)
        if (g_pending.count(d)) {
          ok = false;
          break;
        }
      if (ok) ready.push_back(seq);
    }
    if (ready.empty()) break;
    const uint64_t pick = g_mode == 0 ? ready.front() : ready[g_rng() % ready.size()];
    auto it = g_pending.find(pick);
    std::function<void()> fn = std::move(it->second.fn);
    g_pending.erase(it);
    fn();
  }
  g_running = false;
  check_canaries();
}

void drain_all() { drain(nullptr); }

void drain_until(uint64_t target) {
  std::set<uint64_t> closure;
  std::vector<uint64_t> todo{target};
  while (!todo.empty()) {
    const uint64_t q = todo.back();
    todo.pop_back();
    auto it = g_pending.find(q);
    if (it == g_pending.end() || !closure.insert(q).second) continue;
    for (uint64_t d : it->second.deps) todo.push_back(d);
  }
  drain(&closure);
}

void drain_stream(cudaStream_t s) {
  auto it = g_last_in_stream.find(stream_id(s));
  if (it != g_last_in_stream.end()) drain_until(it->second);
}

// ---- kernels ------------------------------------------------------------------------

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  bool done, waiting;
  int line;
};
ucontext_t g_sched;
std::vector<Fiber> g_fibers;
std::vector<char*> g_stacks;
constexpr size_t kStack = 64 << 10;
int g_cur = -1;
bool g_in_fiber = false;
const std::function<void()>* g_body = nullptr;
const char* g_kernel = "";

void fiber_entry() {
  (*g_body)();
  g_fibers[g_cur].done = true;
  // returns to g_sched through uc_link
}

void run_block_fibers(unsigned nthreads) {
  while (g_stacks.size() < nthreads) {
    void* m = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      std::perror("emu: fiber stack");
      std::abort();
    }
    g_stacks.push_back(static_cast<char*>(m));
  }
  g_fibers.resize(nthreads);
  for (unsigned i = 0; i < nthreads; ++i) {
    Fiber& f = g_fibers[i];
    f.tid = dim3(i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y));
    f.done = f.waiting = false;
    f.line = -1;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks[i];
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g_sched;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  g_in_fiber = true;
  for (;;) {
    const bool reverse = g_mode == 1 && (g_rng() & 1);
    for (unsigned q = 0; q < nthreads; ++q) {
      const unsigned i = reverse ? nthreads - 1 - q : q;
      Fiber& f = g_fibers[i];
      if (f.done) continue;
      f.waiting = false;
      g_cur = (int)i;
      threadIdx = f.tid;
      swapcontext(&g_sched, &f.ctx);
    }
    int line = -1;
    bool any = false;
    for (unsigned i = 0; i < nthreads; ++i) {
      Fiber& f = g_fibers[i];
      if (f.done) continue;
      if (!f.waiting) {
        std::fprintf(stderr, "emu: fiber neither done nor waiting in %s\n", g_kernel);
        std::abort();
      }
      if (any && f.line != line) {
        std::fprintf(stderr, "emu: divergent __syncthreads in kernel %s (lines %d and %d)\n", g_kernel, line,
                     f.line);
        std::abort();
      }
      any = true;
      line = f.line;
    }
    if (!any) break;  // every thread returned (threads that returned early counted as arrived)
  }
  g_in_fiber = false;
  g_cur = -1;
}

}  // namespace

void syncthreads(int line) {
  if (!g_in_fiber) {
    std::fprintf(stderr,
                 "emu: __syncthreads (line %d) reached in kernel %s, which translate.py ran as plain calls "
                 "(no __syncthreads found in its body)\n",
                 line, g_kernel);
    std::abort();
  }
  Fiber& f = g_fibers[g_cur];
  f.waiting = true;
  f.line = line;
  swapcontext(&f.ctx, &g_sched);
}

void run_grid(const char* name, bool sync, dim3 grid, dim3 block, const std::function<void()>& body) {
  const unsigned nthreads = block.x * block.y * block.z;
  const size_t nblocks = (size_t)grid.x * grid.y * grid.z;
  std::vector<size_t> order(nblocks);
  for (size_t i = 0; i < nblocks; ++i) order[i] = i;
  if (g_mode == 1) std::shuffle(order.begin(), order.end(), g_rng);
  gridDim = grid;
  blockDim = block;
  g_kernel = name;
  g_body = &body;
  for (size_t b : order) {
    blockIdx = dim3((unsigned)(b % grid.x), (unsigned)((b / grid.x) % grid.y), (unsigned)(b / ((size_t)grid.x * grid.y)));
    if (sync) {
      run_block_fibers(nthreads);
    } else {
      const bool reverse = g_mode == 1 && (g_rng() & 1);
      for (unsigned q = 0; q < nthreads; ++q) {
        const unsigned i = reverse ? nthreads - 1 - q : q;
        threadIdx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
        body();
      }
    }
  }
  g_body = nullptr;
}

void enqueue_kernel(const char* name, bool sync, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                    std::function<void()> grid_fn) {
  ++g_counts[name];
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  const bool ok = block.x >= 1 && block.y >= 1 && block.z >= 1 && block.x <= 1024 && block.y <= 1024 &&
                  block.z <= 64 && threads <= 1024 && grid.x >= 1 && grid.y >= 1 && grid.z >= 1 &&
                  grid.x <= 2147483647u && grid.y <= 65535 && grid.z <= 65535 && shmem <= 48 * 1024;
  if (!ok) {
    g_last_error = cudaErrorInvalidConfiguration;
    record(std::string("kernel ") + name + ": invalid launch configuration grid (" + std::to_string(grid.x) + ", " +
           std::to_string(grid.y) + ", " + std::to_string(grid.z) + ") block (" + std::to_string(block.x) + ", " +
           std::to_string(block.y) + ", " + std::to_string(block.z) + ")");
    return;
  }
  enqueue(stream, std::move(grid_fn));
}

}  // namespace emu

using namespace emu;

// ---- CUDA runtime -------------------------------------------------------------------

// An event is the set of operations it waits for. A timing event (created
// without cudaEventDisableTiming) also enqueues a marker that stamps the host
// clock when the stream reaches it, so elapsed times are real (CPU) durations.
struct CUevent_st {
  std::vector<uint64_t> deps;
  bool timing = true;
  bool recorded = false;
  double stamp_ms = 0.0;
};

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (capture_forbids("cudaMalloc")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  const size_t pg = page_size();
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  const size_t body = (rounded + pg - 1) / pg * pg;
  const size_t len = body + pg;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return g_last_error = cudaErrorMemoryAllocation;
  char* map = static_cast<char*>(m);
  char* base;
  if (guard_at_start()) {
    mprotect(map, pg, PROT_NONE);
    base = map + pg;
  } else {
    mprotect(map + body, pg, PROT_NONE);
    base = map + body - rounded;
  }
  std::memset(base, 0xFF, bytes);  // uninitialised: NaN for floats, -1 for integers
  std::memset(base + bytes, kCanary, rounded - bytes);
  g_allocs[(uintptr_t)base] = Alloc{base, bytes, rounded, map, len, false};
  *p = base;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  if (capture_forbids("cudaFree")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  ++g_host_syncs;
  drain_all();  // cudaFree waits for the device
  auto it = g_allocs.find((uintptr_t)p);
  if (it == g_allocs.end() || it->second.external) {
    record("cudaFree of " + hex(p) + ", not the start of a device allocation");
    return g_last_error = cudaErrorInvalidValue;
  }
  munmap(it->second.map, it->second.map_len);
  g_allocs.erase(it);
  return cudaSuccess;
}

namespace {

bool is_device(const void* p) { return find_alloc(p) != nullptr; }

bool check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what) {
  bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) {
    dst_dev = is_device(dst);
    src_dev = is_device(src);
  }
  bool ok = true;
  if (dst_dev) ok = check_range(dst, bytes, std::string(what) + " destination") && ok;
  if (src_dev) ok = check_range(src, bytes, std::string(what) + " source") && ok;
  return ok;
}

bool src_is_host(const void* src, cudaMemcpyKind kind) {
  return kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost ||
         (kind == cudaMemcpyDefault && !is_device(src));
}
bool dst_is_host(const void* dst, cudaMemcpyKind kind) {
  return kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost ||
         (kind == cudaMemcpyDefault && !is_device(dst));
}

}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (capture_forbids("cudaMemcpy")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  if (!check_copy(dst, src, bytes, kind, "cudaMemcpy")) return g_last_error = cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  if (kind == cudaMemcpyHostToHost) {
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  if (src_is_host(src, kind)) {
    // Pageable source: the legacy stream's earlier work completes, the bytes
    // are staged at once; the device write may still be in flight on return.
    ++g_host_syncs;
    drain_stream(0);
    auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    enqueue(0, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  const uint64_t op = enqueue(0, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  if (dst_is_host(dst, kind)) {  // device to host: returns when the copy is done
    ++g_host_syncs;
    drain_until(op);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (!check_copy(dst, src, bytes, kind, "cudaMemcpyAsync")) return g_last_error = cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  if (src_is_host(src, kind)) {  // pageable source: staged now
    auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    enqueue(s, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  } else {
    enqueue(s, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  }
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t s) {
  if (!check_range(dst, bytes, "cudaMemset")) return g_last_error = cudaErrorInvalidValue;
  if (bytes) enqueue(s, [dst, value, bytes] { std::memset(dst, value, bytes); });
  return cudaSuccess;
}
// Device memory: asynchronous with respect to the host, on the legacy stream.
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (capture_forbids("cudaMemset")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  return cudaMemsetAsync(dst, value, bytes, 0);
}

cudaError_t cudaDeviceSynchronize() {
  if (capture_forbids("cudaDeviceSynchronize")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  ++g_host_syncs;
  drain_all();
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (capture_forbids("cudaStreamSynchronize")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  ++g_host_syncs;
  drain_stream(s);
  check_canaries();
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  *status = g_capturing && stream_id(s) == g_capture_stream ? cudaStreamCaptureStatusActive
                                                             : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  *e = new CUevent_st();
  (*e)->timing = !(flags & cudaEventDisableTiming);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!e) return g_last_error = cudaErrorInvalidValue;
  if (g_capturing && stream_id(s) == g_capture_stream) {
    record("cudaEventRecord on the capturing stream (not modelled by the emulator)");
    return cudaSuccess;
  }
  e->deps.clear();
  e->recorded = true;
  if (e->timing) {  // the marker follows the stream's earlier work; the event waits for it
    e->deps.push_back(enqueue(s, [e] {
      e->stamp_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
                        .count();
    }));
    return cudaSuccess;
  }
  auto it = g_last_in_stream.find(stream_id(s));
  if (it != g_last_in_stream.end() && g_pending.count(it->second)) e->deps.push_back(it->second);
  return cudaSuccess;
}
// Never waits: whether everything the event waits for has run.
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return g_last_error = cudaErrorInvalidValue;
  if (capture_forbids("cudaEventQuery")) return g_last_error = cudaErrorStreamCaptureUnsupported;
  ++g_counts["cudaEventQuery"];
  for (uint64_t d : e->deps)
    if (g_pending.count(d)) return cudaErrorNotReady;  // not an error: the sticky error is left alone
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start || !end || !ms) return g_last_error = cudaErrorInvalidValue;
  if (!start->timing || !end->timing || !start->recorded || !end->recorded) {
    record("cudaEventElapsedTime on an event without timing or never recorded");
    return g_last_error = cudaErrorInvalidResourceHandle;
  }
  for (cudaEvent_t e : {start, end})
    for (uint64_t d : e->deps)
      if (g_pending.count(d)) return cudaErrorNotReady;
  *ms = (float)(end->stamp_ms - start->stamp_ms);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  if (!e) return g_last_error = cudaErrorInvalidValue;
  if (g_capturing && stream_id(s) == g_capture_stream && !e->deps.empty()) {
    record("cudaStreamWaitEvent on the capturing stream for an event recorded outside the capture "
           "(cudaErrorStreamCaptureIsolation)");
    return g_last_error = cudaErrorStreamCaptureUnsupported;
  }
  auto& w = g_waits[stream_id(s)];
  w.insert(w.end(), e->deps.begin(), e->deps.end());
  return cudaSuccess;
}
namespace {
int g_device = 0;
}
cudaError_t cudaGetDevice(int* d) {
  *d = g_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d != 0) return g_last_error = cudaErrorInvalidDevice;
  g_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return g_last_error = cudaErrorInvalidDevice;
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "CPU emulator (tests/cuda_emu)");
  prop->totalGlobalMem = (size_t)1 << 37;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return g_last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "unknown error";
  }
}

// ---- cuBLAS -------------------------------------------------------------------------

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_DEFAULT_MATH && mode != CUBLAS_TENSOR_OP_MATH && mode != CUBLAS_PEDANTIC_MATH &&
      mode != CUBLAS_TF32_TENSOR_OP_MATH)
    return CUBLAS_STATUS_INVALID_VALUE;
  h->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  h->workspace = nullptr;  // as cuBLAS: back to the default workspace pool
  h->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* ws, size_t bytes) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes && ((uintptr_t)ws % 256 != 0 || !check_range(ws, bytes, "cublasSetWorkspace")))
    return CUBLAS_STATUS_INVALID_VALUE;
  h->workspace = ws;
  h->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetVersion(cublasHandle_t h, int* v) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  *v = CUBLAS_VER_MAJOR * 10000 + CUBLAS_VER_MINOR * 100 + CUBLAS_VER_PATCH;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
const char* cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "cuBLAS error";
  }
}

namespace {

size_t elem_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_64F: return 8;
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
  }
  return 0;
}

float to_tf32(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
  b = (b + 0x1000u) & ~0x1fffu;                      // 10-bit mantissa, ties away from zero (cvt.rna.tf32)
  std::memcpy(&f, &b, 4);
  return f;
}

// Element `idx` of a matrix of type t, as the accumulation type sees it.
template <typename Acc>
Acc load(const void* p, cudaDataType_t t, size_t idx, bool tf32) {
  switch (t) {
    case CUDA_R_64F: return (Acc) static_cast<const double*>(p)[idx];
    case CUDA_R_32F: {
      const float v = static_cast<const float*>(p)[idx];
      return (Acc)(tf32 ? to_tf32(v) : v);
    }
    case CUDA_R_16BF: return (Acc)__bfloat162float(static_cast<const __nv_bfloat16*>(p)[idx]);
    case CUDA_R_16F: return (Acc)__half2float(static_cast<const __half*>(p)[idx]);
  }
  return 0;
}

template <typename Acc>
void store(void* p, cudaDataType_t t, size_t idx, Acc v) {
  switch (t) {
    case CUDA_R_64F: static_cast<double*>(p)[idx] = (double)v; break;
    case CUDA_R_32F: static_cast<float*>(p)[idx] = (float)v; break;
    case CUDA_R_16BF: static_cast<__nv_bfloat16*>(p)[idx] = __float2bfloat16((float)v); break;
    default: break;
  }
}

// op(X) as a dense rows x k matrix of Acc, row-major: op(X)(i, l).
template <typename Acc>
std::vector<Acc> dense_op(const void* X, cudaDataType_t t, cublasOperation_t op, int rows, int k, int ld, bool tf32) {
  std::vector<Acc> out((size_t)rows * k);
  for (int i = 0; i < rows; ++i)
    for (int l = 0; l < k; ++l)
      out[(size_t)i * k + l] =
          load<Acc>(X, t, op == CUBLAS_OP_N ? (size_t)i + (size_t)l * ld : (size_t)l + (size_t)i * ld, tf32);
  return out;
}

// C = alpha op(A) op(B) + beta C; `tri`: 0 full, 1 lower only (i >= j), 2 upper only.
template <typename Acc>
void gemm_ref(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, Acc alpha, const void* A,
              cudaDataType_t At, int lda, const void* B, cudaDataType_t Bt, int ldb, Acc beta, void* C,
              cudaDataType_t Ct, int ldc, bool tf32, int tri) {
  const std::vector<Acc> a = dense_op<Acc>(A, At, ta, m, k, lda, tf32);
  // op(B) is k x n; op(B)^T (n x k) = op'(B) with the other transposition.
  const std::vector<Acc> b = dense_op<Acc>(B, Bt, tb == CUBLAS_OP_N ? CUBLAS_OP_T : CUBLAS_OP_N, n, k, ldb, tf32);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      if ((tri == 1 && i < j) || (tri == 2 && i > j)) continue;
      Acc acc = 0;
      const Acc* ai = a.data() + (size_t)i * k;
      const Acc* bj = b.data() + (size_t)j * k;
      // One fused multiply-add per term, accumulated in Acc along k, as a
      // GPU GEMM thread does for its element: float32 products lose accuracy
      // with long k as cuBLAS's do (the fp32 row cap is tested against it).
      for (int l = 0; l < k; ++l) acc = std::fma(ai[l], bj[l], acc);
      const size_t idx = (size_t)i + (size_t)j * ldc;
      Acc v = alpha * acc;
      if (beta != (Acc)0) v += beta * load<Acc>(C, Ct, idx, false);  // beta == 0: C is not read
      store<Acc>(C, Ct, idx, v);
    }
}

bool matrix_inside(const void* p, int rows, int cols, int ld, size_t es, const std::string& what) {
  if (rows <= 0 || cols <= 0) return true;
  const size_t bytes = ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * es;
  return check_range(p, bytes, what);
}

// Supported (A/B type, C type, compute type) triples of cublasGemmEx that we use.
// acc: 0 double, 1 float; tf32: inputs rounded.
cublasStatus_t gemm_types(cudaDataType_t At, cudaDataType_t Bt, cudaDataType_t Ct, cublasComputeType_t ct,
                          cublasMath_t math, int* acc, bool* tf32) {
  if (At != Bt) return CUBLAS_STATUS_NOT_SUPPORTED;
  *tf32 = false;
  switch (ct) {
    case CUBLAS_COMPUTE_64F:
      if (At != CUDA_R_64F || Ct != CUDA_R_64F) return CUBLAS_STATUS_NOT_SUPPORTED;
      *acc = 0;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
      *acc = 1;
      if (At == CUDA_R_32F && Ct == CUDA_R_32F) {
        *tf32 = ct == CUBLAS_COMPUTE_32F && math == CUBLAS_TF32_TENSOR_OP_MATH;
        return CUBLAS_STATUS_SUCCESS;
      }
      if ((At == CUDA_R_16BF || At == CUDA_R_16F) && (Ct == At || Ct == CUDA_R_32F)) return CUBLAS_STATUS_SUCCESS;
      return CUBLAS_STATUS_NOT_SUPPORTED;
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      if (At != CUDA_R_32F || Ct != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
      *acc = 1;
      *tf32 = true;
      return CUBLAS_STATUS_SUCCESS;
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

bool bad_op(cublasOperation_t op) { return op != CUBLAS_OP_N && op != CUBLAS_OP_T && op != CUBLAS_OP_C; }

cublasStatus_t gemm_args(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc) {
  if (bad_op(ta) || bad_op(tb) || m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const int rows_a = ta == CUBLAS_OP_N ? m : k, rows_b = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, rows_a) || ldb < std::max(1, rows_b) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

// Scalars: in host pointer mode read now, in device mode when the call runs.
struct Scalars {
  double ad = 0, bd = 0;
  float af = 0, bf = 0;
};

}  // namespace

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
  ++g_counts["cublasGemmEx"];
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (cublasStatus_t s = gemm_args(ta, tb, m, n, k, lda, ldb, ldc)) {
    record("cublasGemmEx: invalid value (m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" +
           std::to_string(k) + " lda=" + std::to_string(lda) + " ldb=" + std::to_string(ldb) + " ldc=" +
           std::to_string(ldc) + ")");
    return s;
  }
  int acc;
  bool tf32;
  if (cublasStatus_t s = gemm_types(Atype, Btype, Ctype, compute, h->math, &acc, &tf32)) return s;
  if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const size_t ea = elem_size(Atype), ec = elem_size(Ctype);
  bool ok = true;
  if (k > 0) {
    ok = matrix_inside(A, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda, ea, "cublasGemmEx A") && ok;
    ok = matrix_inside(B, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb, ea, "cublasGemmEx B") && ok;
  }
  ok = matrix_inside(C, m, n, ldc, ec, "cublasGemmEx C") && ok;
  if (!ok) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (h->pointer_mode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;  // not used here
  Scalars sc;
  if (acc == 0) {
    sc.ad = *static_cast<const double*>(alpha);
    sc.bd = *static_cast<const double*>(beta);
  } else {
    sc.af = *static_cast<const float*>(alpha);
    sc.bf = *static_cast<const float*>(beta);
  }
  enqueue(h->stream, [=] {
    if (acc == 0)
      gemm_ref<double>(ta, tb, m, n, k, sc.ad, A, Atype, lda, B, Btype, ldb, sc.bd, C, Ctype, ldc, false, 0);
    else
      gemm_ref<float>(ta, tb, m, n, k, sc.af, A, Atype, lda, B, Btype, ldb, sc.bf, C, Ctype, ldc, tf32, 0);
  });
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* const A[], cudaDataType_t Atype, int lda,
                                   const void* const B[], cudaDataType_t Btype, int ldb, const void* beta,
                                   void* const C[], cudaDataType_t Ctype, int ldc, int batchCount,
                                   cublasComputeType_t compute, cublasGemmAlgo_t) {
  ++g_counts["cublasGemmBatchedEx"];
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (cublasStatus_t s = gemm_args(ta, tb, m, n, k, lda, ldb, ldc)) {
    record("cublasGemmBatchedEx: invalid value");
    return s;
  }
  if (batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
  int acc;
  bool tf32;
  if (cublasStatus_t s = gemm_types(Atype, Btype, Ctype, compute, h->math, &acc, &tf32)) return s;
  if (m == 0 || n == 0 || batchCount == 0) return CUBLAS_STATUS_SUCCESS;
  bool ok = check_range(A, batchCount * sizeof(void*), "cublasGemmBatchedEx A array");
  ok = check_range(B, batchCount * sizeof(void*), "cublasGemmBatchedEx B array") && ok;
  ok = check_range(C, batchCount * sizeof(void*), "cublasGemmBatchedEx C array") && ok;
  if (!ok) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (h->pointer_mode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;
  Scalars sc;
  if (acc == 0) {
    sc.ad = *static_cast<const double*>(alpha);
    sc.bd = *static_cast<const double*>(beta);
  } else {
    sc.af = *static_cast<const float*>(alpha);
    sc.bf = *static_cast<const float*>(beta);
  }
  const size_t ea = elem_size(Atype), ec = elem_size(Ctype);
  enqueue(h->stream, [=] {
    // The pointer arrays are device memory, read when the call runs.
    for (int q = 0; q < batchCount; ++q) {
      const std::string w = "cublasGemmBatchedEx[" + std::to_string(q) + "] ";
      bool in = true;
      if (k > 0) {
        in = matrix_inside(A[q], ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda, ea, w + "A") && in;
        in = matrix_inside(B[q], tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb, ea, w + "B") && in;
      }
      in = matrix_inside(C[q], m, n, ldc, ec, w + "C") && in;
      if (!in) continue;
      if (acc == 0)
        gemm_ref<double>(ta, tb, m, n, k, sc.ad, A[q], Atype, lda, B[q], Btype, ldb, sc.bd, C[q], Ctype, ldc, false,
                         0);
      else
        gemm_ref<float>(ta, tb, m, n, k, sc.af, A[q], Atype, lda, B[q], Btype, ldb, sc.bf, C[q], Ctype, ldc, tf32,
                        0);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

template <typename T>
cublasStatus_t syrk(const char* name, cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                    const T* alpha, const T* A, int lda, const T* beta, T* C, int ldc) {
  ++g_counts[name];
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  const int rows_a = trans == CUBLAS_OP_N ? n : k;
  if ((uplo != CUBLAS_FILL_MODE_LOWER && uplo != CUBLAS_FILL_MODE_UPPER) || bad_op(trans) || n < 0 || k < 0 ||
      lda < std::max(1, rows_a) || ldc < std::max(1, n)) {
    record(std::string(name) + ": invalid value (n=" + std::to_string(n) + " k=" + std::to_string(k) + " lda=" +
           std::to_string(lda) + " ldc=" + std::to_string(ldc) + ")");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (n == 0) return CUBLAS_STATUS_SUCCESS;
  bool ok = true;
  if (k > 0)
    ok = matrix_inside(A, rows_a, trans == CUBLAS_OP_N ? k : n, lda, sizeof(T), std::string(name) + " A") && ok;
  ok = matrix_inside(C, n, n, ldc, sizeof(T), std::string(name) + " C") && ok;
  if (!ok) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (h->pointer_mode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;
  const T a = *alpha, b = *beta;
  const cudaDataType_t t = sizeof(T) == 8 ? CUDA_R_64F : CUDA_R_32F;
  const bool tf32 = sizeof(T) == 4 && h->math == CUBLAS_TF32_TENSOR_OP_MATH;
  const cublasOperation_t other = trans == CUBLAS_OP_N ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int tri = uplo == CUBLAS_FILL_MODE_LOWER ? 1 : 2;
  enqueue(h->stream, [=] { gemm_ref<T>(trans, other, n, n, k, a, A, t, lda, A, t, lda, b, C, t, ldc, tf32, tri); });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasDsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                           const double* alpha, const double* A, int lda, const double* beta, double* C, int ldc) {
  return syrk<double>("cublasDsyrk", h, uplo, trans, n, k, alpha, A, lda, beta, C, ldc);
}
cublasStatus_t cublasSsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                           const float* alpha, const float* A, int lda, const float* beta, float* C, int ldc) {
  return syrk<float>("cublasSsyrk", h, uplo, trans, n, k, alpha, A, lda, beta, C, ldc);
}

// ---- inspection ---------------------------------------------------------------------

extern "C" {
const char* emu_errors() {
  check_canaries();
  return g_errors.c_str();
}
void emu_clear_errors() { g_errors.clear(); }
long long emu_count(const char* name) {
  auto it = g_counts.find(name);
  return it == g_counts.end() ? 0 : it->second;
}
void emu_reset_counts() {
  g_counts.clear();
  g_host_syncs = 0;
}
long long emu_pending() { return (long long)g_pending.size(); }
long long emu_host_syncs() { return g_host_syncs; }
void emu_set_schedule(int mode, unsigned seed) {
  g_mode = mode;
  g_rng.seed(seed);
}
void emu_register(void* p, size_t bytes) {
  g_allocs[(uintptr_t)p] = Alloc{static_cast<char*>(p), bytes, bytes, nullptr, 0, true};
}
void emu_unregister(void* p) {
  auto it = g_allocs.find((uintptr_t)p);
  if (it != g_allocs.end() && it->second.external) g_allocs.erase(it);
}
long long emu_live_allocations() {
  long long n = 0;
  for (auto& [k, a] : g_allocs) n += !a.external;
  return n;
}
// Graph capture of one stream (global mode), and replays of the captured work.
void emu_begin_capture(uintptr_t stream) {
  g_capturing = true;
  g_capture_stream = stream == 1 ? 0 : stream;
  g_graph.clear();
}
long long emu_end_capture() {
  g_capturing = false;
  return (long long)g_graph.size();
}
void emu_replay() {
  for (auto& fn : g_graph) enqueue((cudaStream_t)g_capture_stream, fn);
}
// The conversions, for bit-exact tests against numpy.
unsigned emu_double2bfloat16(double d) { return __double2bfloat16(d).x; }
float emu_half2float(unsigned bits) { return __half2float(__half{(unsigned short)bits}); }
}
