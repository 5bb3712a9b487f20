// Rates of SGEMM, SSYRK and tilings of the lower triangle of C = A^T A (A: k x p,
// row-major float32), each tile one single-threaded OpenBLAS call, tiles taken
// largest first by 1 or 2 threads from a shared counter. "bands+syrk" is the
// core's own layout (csrc/cpu/products.hpp, shared_products); the others are
// the alternatives it was chosen against. Best and median of `reps`
// interleaved repetitions; rates in multiply-adds per second of the
// triangle's p^2 k / 2 (the full SGEMM's row also of its own p^2 k).
//
// Build (from the repository root, in the environment with scipy-openblas32):
//   SOB=$(python -c "import scipy_openblas32 as s, os; print(os.path.dirname(s.get_lib_dir()))")
//   g++ -O2 -std=c++17 benchmarks/blas_tilings.cpp -Icsrc -I$SOB/include -L$SOB/lib -lscipy_openblas
//       -Wl,-rpath,$SOB/lib -pthread -o blas_tilings   (one line)
//   ./blas_tilings 2048 4096 5 [name filter]   (on an otherwise idle machine)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cpu/products.hpp"

extern "C" void scipy_openblas_set_num_threads(int);
extern "C" char* scipy_openblas_get_corename();

namespace {

using richness::gemm_tn;
using richness::syrk_lower;

struct Tile {
  int64_t r0, r1, c0, c1;
  bool syrk;  // SYRK of a diagonal block, else a GEMM of the rectangle
  double cost;
};

int64_t P, K;
float *A, *C;

void run_tiles(std::vector<Tile> tiles, int workers) {
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  auto body = [&] {
    for (size_t i = next++; i < tiles.size(); i = next++) {
      const Tile& t = tiles[i];
      float* out = C + t.r0 * P + t.c0;
      if (t.syrk) syrk_lower(t.r1 - t.r0, K, A + t.r0, P, out, P);
      else gemm_tn(t.r1 - t.r0, t.c1 - t.c0, K, A + t.r0, P, A + t.c0, P, out, P);
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(body);
  body();
  for (auto& t : pool) t.join();
}

// Row panels of height T. diag: 0 the diagonal block a GEMM of the square,
// 1 a SYRK, 2 the whole panel (left part and diagonal square) one GEMM.
std::vector<Tile> panels(int64_t T, int diag) {
  std::vector<Tile> t;
  for (int64_t r0 = 0; r0 < P; r0 += T) {
    const int64_t r1 = std::min(P, r0 + T), h = r1 - r0;
    if (diag == 2) {
      t.push_back({r0, r1, 0, r1, false, double(h) * r1});
      continue;
    }
    if (r0 > 0) t.push_back({r0, r1, 0, r0, false, double(h) * r0});
    t.push_back({r0, r1, r0, r1, diag == 1, double(h) * h * (diag == 1 ? 0.5 : 1.0)});
  }
  return t;
}

// Square T x T tiles of the lower triangle, diagonal squares as GEMMs.
std::vector<Tile> squares(int64_t T) {
  std::vector<Tile> t;
  for (int64_t r0 = 0; r0 < P; r0 += T) {
    const int64_t r1 = std::min(P, r0 + T);
    for (int64_t c0 = 0; c0 < r0; c0 += T) t.push_back({r0, r1, c0, c0 + T, false, double(r1 - r0) * T});
    t.push_back({r0, r1, r0, r1, false, double(r1 - r0) * (r1 - r0)});
  }
  return t;
}

// The full square in `bands` row bands (both triangles: twice the arithmetic).
std::vector<Tile> full_gemm(int bands) {
  std::vector<Tile> t;
  for (int b = 0; b < bands; ++b) t.push_back({P * b / bands, P * (b + 1) / bands, 0, P, false, 1.0});
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s p k [reps] [name filter]\n", argv[0]);
    return 2;
  }
  P = std::atoll(argv[1]);
  K = std::atoll(argv[2]);
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  scipy_openblas_set_num_threads(1);
  std::vector<float> a((size_t)(P * K)), c((size_t)(P * P));
  for (auto& v : a) v = (float)std::rand() / (float)RAND_MAX - 0.5f;
  A = a.data();
  C = c.data();
  struct Case {
    std::string name;
    std::vector<Tile> tiles;  // empty: the core's shared_products
    int workers;
    double macs;
  };
  const double tri = 0.5 * (double)P * (double)P * (double)K;
  std::vector<Case> cases;
  for (int w : {1, 2}) {
    const std::string s = " w" + std::to_string(w);
    cases.push_back({"full sgemm" + s, full_gemm(w), w, 2 * tri});
    cases.push_back({"bands+syrk (core)" + s, {}, w, tri});
    for (int64_t T : {128, 256, 384, 512}) {
      const std::string n = std::to_string(T);
      cases.push_back({"panels" + n + "+syrk" + s, panels(T, 1), w, tri});
      cases.push_back({"panels" + n + "+gemm diag" + s, panels(T, 0), w, tri});
      cases.push_back({"panels" + n + " one gemm" + s, panels(T, 2), w, tri});
      cases.push_back({"squares" + n + s, squares(T), w, tri});
    }
  }
  if (argc > 4) {
    std::vector<Case> keep;
    for (auto& cs : cases)
      if (cs.name.find(argv[4]) != std::string::npos || cs.name.rfind("full", 0) == 0) keep.push_back(cs);
    cases.swap(keep);
  }
  auto run = [&](const Case& cs) {
    if (!cs.tiles.empty()) return run_tiles(cs.tiles, cs.workers);
    const std::vector<richness::Product<float>> pr{{A, A, P, P, P, P, true, C, P}};
    richness::shared_products(pr, K, cs.workers);
  };
  std::printf("OpenBLAS core %s, p=%lld k=%lld, best / median of %d\n", scipy_openblas_get_corename(),
              (long long)P, (long long)K, reps);
  std::vector<std::vector<double>> t(cases.size());
  for (const auto& cs : cases) run(cs);  // warm up
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run(cases[i]);
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<double> v = t[i];
    std::sort(v.begin(), v.end());
    std::printf("%-26s best %8.2f ms  median %8.2f ms  %6.1f G/s of the triangle", cases[i].name.c_str(), v[0] * 1e3,
                v[v.size() / 2] * 1e3, tri / v[0] / 1e9);
    if (cases[i].macs != tri) std::printf("  (%6.1f G/s of its own)", cases[i].macs / v[0] / 1e9);
    std::printf("\n");
  }
  return 0;
}
