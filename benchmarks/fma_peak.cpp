// The processor's float32 multiply-add peak: twelve independent AVX-512 FMA
// chains in registers (no memory traffic), one thread per core, so that the
// rates of the products (torch's MKL GEMM, OpenBLAS, the core) can be read as
// fractions of what the cores can do at all. Rates in multiply-adds per
// second (16 per FMA instruction), best of five runs of each thread count.
//
// Build and run (from the repository root; needs AVX-512F):
//   g++ -O2 -std=c++17 -mavx512f -mfma -pthread benchmarks/fma_peak.cpp -o fma_peak && ./fma_peak 2
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr int kChains = 12;  // more than FMA latency x ports (4 x 2), so the ports never wait

float chains(long iters) {
  __m512 a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(1.0f + (float)i * 1e-7f);
  const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-8f);
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  float sum = 0.0f;
  for (float v : lanes) sum += v;
  return sum;  // returned, so the chains are not optimised away
}

}  // namespace

int main(int argc, char** argv) {
  const int most = argc > 1 ? std::atoi(argv[1]) : 2;
  const long iters = argc > 2 ? std::atol(argv[2]) : 100000000L;
  for (int threads = 1; threads <= most; ++threads) {
    double best = 0.0;
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<std::thread> pool;
      std::vector<float> sink((size_t)threads);
      const auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[(size_t)t] = chains(iters); });
      for (auto& t : pool) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, (double)threads * (double)iters * kChains * 16 / s);
      if (sink[0] == 0.0f) std::printf("(unexpected sum)\n");
    }
    std::printf("%d thread%s: %.1f G multiply-adds/s (%.1f per thread)\n", threads, threads > 1 ? "s" : "",
                best / 1e9, best / 1e9 / threads);
  }
  return 0;
}
