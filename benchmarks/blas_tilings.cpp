// Rates of SGEMM, SSYRK and tilings of the lower triangle of C = A^T A (A: k x p,
// row-major float32), each tile one single-threaded OpenBLAS call, tiles taken
// largest first by 1 or 2 threads from a shared counter. "bands+syrk" is the
// core's own layout (csrc/cpu/products.hpp, shared_products); the others are
// the alternatives it was chosen against. Best and median of `reps`
// interleaved repetitions; rates in multiply-adds per second of the
// triangle's p^2 k / 2 (the full SGEMM's row also of its own p^2 k).
//
// Built for AVX-512 (-mavx512f -mfma), it also runs an own kernel for the
// triangle, a measurement of the alternative to the BLAS and not code the
// package uses (benchmarks/RESULTS.md, "The FMA peak and an own triangle
// kernel"): C tiles of 12 rows x 32 columns held in 24 zmm accumulators; for
// each of the k rows, two vector loads of the 32 columns' values and twelve
// broadcasts of the 12 rows' values (the layout of BLIS's AVX-512 SGEMM). Per
// slab of 256 rows, the slab's columns are packed into 32-wide and 12-wide
// panels; tiles on the diagonal go through a scratch tile so that nothing
// above the diagonal is written. With two workers each takes a row band of
// equal triangle area. "packed once" packs the first slab only and reuses it
// for the others: its values are wrong on purpose, and its rate is the
// kernel's alone, as if packing were free (written by the centering pass,
// say). The kernel's triangle is checked against the core's before timing.
//
// Build (from the repository root, in the environment with scipy-openblas32):
//   SOB=$(python -c "import scipy_openblas32 as s, os; print(os.path.dirname(s.get_lib_dir()))")
//   g++ -O3 -std=c++17 [-mavx512f -mfma] benchmarks/blas_tilings.cpp -Icsrc -I$SOB/include -L$SOB/lib
//       -lscipy_openblas -Wl,-rpath,$SOB/lib -pthread -o blas_tilings   (one line)
//   ./blas_tilings 2048 4096 5 [name filter]   (on an otherwise idle machine; the filter keeps the
//   rows whose name holds it, and always the full SGEMM and the core's bands)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cpu/products.hpp"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

#ifdef __AVX512F__
constexpr int64_t MR = 12, NR = 32, KC = 256;

// c (MR x NR, row stride ldc) += sum over r < kc of ip[r][m] * jp[r][0:NR].
inline void kernel(int64_t kc, const float* __restrict ip, const float* __restrict jp, float* c, int64_t ldc) {
  __m512 acc[MR][2];
  for (int64_t m = 0; m < MR; ++m) {
    acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    _mm_prefetch((const char*)(c + m * ldc), _MM_HINT_T0);
    _mm_prefetch((const char*)(c + m * ldc + 16), _MM_HINT_T0);
  }
  for (int64_t r = 0; r < kc; ++r) {
    _mm_prefetch((const char*)(jp + (r + 8) * NR), _MM_HINT_T0);
    _mm_prefetch((const char*)(jp + (r + 8) * NR + 16), _MM_HINT_T0);
    const __m512 b0 = _mm512_load_ps(jp + r * NR), b1 = _mm512_load_ps(jp + r * NR + 16);
#pragma GCC unroll 12
    for (int64_t m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(ip[r * MR + m]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    _mm512_storeu_ps(c + m * ldc, _mm512_add_ps(_mm512_loadu_ps(c + m * ldc), acc[m][0]));
    _mm512_storeu_ps(c + m * ldc + 16, _mm512_add_ps(_mm512_loadu_ps(c + m * ldc + 16), acc[m][1]));
  }
}

__mmask16 first(int64_t w) { return w >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << std::max<int64_t>(w, 0)) - 1); }

struct Panels {
  std::vector<float> ip, jp;
};

// Rows [b0, b1) of the triangle (b0 a multiple of MR) over all k rows of a.
void band(int64_t p, int64_t k, const float* a, float* c, int64_t b0, int64_t b1, Panels& pk, bool pack_once) {
  const int64_t nI = (b1 - b0 + MR - 1) / MR, nJ = (b1 + NR - 1) / NR;
  pk.ip.resize((size_t)(nI * MR * KC + 16));
  pk.jp.resize((size_t)(nJ * NR * KC + 16));
  float* IP = (float*)(((uintptr_t)pk.ip.data() + 63) & ~(uintptr_t)63);
  float* JP = (float*)(((uintptr_t)pk.jp.data() + 63) & ~(uintptr_t)63);
  alignas(64) float tile[MR * NR];
  for (int64_t s0 = 0; s0 < k; s0 += KC) {
    const int64_t kb = std::min(KC, k - s0);
    if (!(pack_once && s0 > 0)) {
      const float* row = a + s0 * p;
      for (int64_t r = 0; r < kb; ++r, row += p) {
        float* d = JP + r * NR;
        for (int64_t J = 0; J < nJ; ++J, d += KC * NR) {
          const int64_t j0 = J * NR;
          _mm512_store_ps(d, _mm512_maskz_loadu_ps(first(p - j0), row + j0));
          _mm512_store_ps(d + 16, _mm512_maskz_loadu_ps(first(p - j0 - 16), row + j0 + 16));
        }
        float* e = IP + r * MR;
        for (int64_t I = 0; I < nI; ++I, e += KC * MR) {
          const int64_t i0 = b0 + I * MR;
          _mm512_mask_storeu_ps(e, 0xFFF, _mm512_maskz_loadu_ps(first(std::min(MR, p - i0)), row + i0));
        }
      }
    }
    for (int64_t I = 0; I < nI; ++I) {
      const int64_t i0 = b0 + I * MR, ih = std::min(MR, b1 - i0);
      for (int64_t J = 0; J * NR <= i0 + ih - 1; ++J) {
        const int64_t j0 = J * NR;
        const float* ip = IP + I * KC * MR;
        const float* jp = JP + J * KC * NR;
        if (ih == MR && j0 + NR - 1 <= i0 && j0 + NR <= p) {  // wholly on or below the diagonal
          if (s0 == 0)
            for (int64_t m = 0; m < MR; ++m) std::fill(c + (i0 + m) * p + j0, c + (i0 + m) * p + j0 + NR, 0.0f);
          kernel(kb, ip, jp, c + i0 * p + j0, p);
          continue;
        }
        std::fill(tile, tile + MR * NR, 0.0f);
        kernel(kb, ip, jp, tile, NR);
        for (int64_t m = 0; m < ih; ++m) {
          const int64_t i = i0 + m, end = std::min({i + 1, j0 + NR, p});
          for (int64_t j = j0; j < end; ++j) c[i * p + j] = (s0 == 0 ? 0.0f : c[i * p + j]) + tile[m * NR + j - j0];
        }
      }
    }
  }
}

void own_kernel(int64_t p, int64_t k, const float* a, float* c, int workers, bool pack_once) {
  static Panels panels[2];
  if (workers == 1) return band(p, k, a, c, 0, p, panels[0], pack_once);
  const int64_t mid = std::min(p, (int64_t)std::llround((double)p * std::sqrt(0.5) / MR) * MR);
  std::thread other([&] { band(p, k, a, c, mid, p, panels[1], pack_once); });
  band(p, k, a, c, 0, mid, panels[0], pack_once);
  other.join();
}
#endif

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
    std::vector<Tile> tiles;  // empty: the core's shared_products (own == 0)
    int workers;
    double macs;
    int own = 0;  // 1 the own kernel, 2 the own kernel packed once
  };
  const double tri = 0.5 * (double)P * (double)P * (double)K;
  std::vector<Case> cases;
  for (int w : {1, 2}) {
    const std::string s = " w" + std::to_string(w);
    cases.push_back({"full sgemm" + s, full_gemm(w), w, 2 * tri});
    cases.push_back({"bands+syrk (core)" + s, {}, w, tri});
#ifdef __AVX512F__
    cases.push_back({"own kernel" + s, {}, w, tri, 1});
    cases.push_back({"own kernel, packed once" + s, {}, w, tri, 2});
#endif
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
      if (cs.name.find(argv[4]) != std::string::npos || cs.name.rfind("full", 0) == 0 ||
          cs.name.rfind("bands+syrk (core)", 0) == 0)
        keep.push_back(cs);
    cases.swap(keep);
  }
  auto run = [&](const Case& cs) {
    if (!cs.tiles.empty()) return run_tiles(cs.tiles, cs.workers);
#ifdef __AVX512F__
    if (cs.own) return own_kernel(P, K, A, C, cs.workers, cs.own == 2);
#endif
    const std::vector<richness::Product<float>> pr{{A, A, P, P, P, P, true, C, P}};
    richness::shared_products(pr, K, cs.workers);
  };
  std::printf("OpenBLAS core %s, p=%lld k=%lld, best / median of %d\n", scipy_openblas_get_corename(),
              (long long)P, (long long)K, reps);
#ifdef __AVX512F__
  {  // the own kernel's triangle against the core's (both float32 sums over the k rows)
    run({"", {}, 2, tri});
    const std::vector<float> ref = c;
    double err = 0.0, scale = 0.0;
    for (int w : {1, 2}) {
      run({"", {}, w, tri, 1});
      for (int64_t i = 0; i < P; ++i)
        for (int64_t j = 0; j <= i; ++j) {
          err = std::max(err, (double)std::fabs(c[i * P + j] - ref[i * P + j]));
          scale = std::max(scale, (double)std::fabs(ref[i * P + j]));
        }
    }
    std::printf("own kernel against the core's bands: max |difference| %.2g, entries up to %.3g\n", err, scale);
  }
#endif
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
