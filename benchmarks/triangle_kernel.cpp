// A register-blocked AVX-512 kernel for the lower triangle of C = A^T A
// (A: k x p, row-major float32), measured beside the core's OpenBLAS layout
// (csrc/cpu/products.hpp, shared_products) and a full SGEMM in the same run.
// It is a measurement of the alternative to the BLAS, not code the package
// uses: it answers how far an own kernel would move the symmetric product on
// this processor (benchmarks/RESULTS.md, "The FMA peak and an own triangle
// kernel").
//
// The kernel: C tiles of 12 rows x 32 columns held in 24 zmm accumulators;
// for each of the k rows, two vector loads of the 32 columns' values and
// twelve broadcasts of the 12 rows' values (the layout of BLIS's AVX-512
// SGEMM). Per slab of kc rows, the slab's columns are packed into 32-wide
// and 12-wide panels; tiles on the diagonal go through a scratch tile so that
// nothing above the diagonal is written. With two workers each takes a row
// band of equal triangle area. "packed once" packs the first slab only and
// reuses it for the others: its values are wrong on purpose, and its rate is
// the kernel's alone, as if packing were free (fused into the centering
// pass, say).
//
// Build (from the repository root, in the environment with scipy-openblas32;
// needs AVX-512F):
//   SOB=$(python -c "import scipy_openblas32 as s, os; print(os.path.dirname(s.get_lib_dir()))")
//   g++ -O3 -std=c++17 -mavx512f -mfma benchmarks/triangle_kernel.cpp -Icsrc -I$SOB/include -L$SOB/lib
//       -lscipy_openblas -Wl,-rpath,$SOB/lib -pthread -o triangle_kernel   (one line)
//   ./triangle_kernel 2048 4096 5   (p, k, interleaved repetitions; on an otherwise idle machine)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cpu/products.hpp"

extern "C" void scipy_openblas_set_num_threads(int);
extern "C" char* scipy_openblas_get_corename();

namespace {

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

void register_kernel(int64_t p, int64_t k, const float* a, float* c, int workers, bool pack_once) {
  static Panels panels[2];
  if (workers == 1) return band(p, k, a, c, 0, p, panels[0], pack_once);
  const int64_t mid = std::min(p, (int64_t)std::llround((double)p * std::sqrt(0.5) / MR) * MR);
  std::thread other([&] { band(p, k, a, c, mid, p, panels[1], pack_once); });
  band(p, k, a, c, 0, mid, panels[0], pack_once);
  other.join();
}

void full_sgemm(int64_t p, int64_t k, const float* a, float* c, int workers) {
  auto rows = [&](int64_t r0, int64_t r1) { richness::gemm_tn(r1 - r0, p, k, a + r0, p, a, p, c + r0 * p, p); };
  if (workers == 1) return rows(0, p);
  std::thread other([&] { rows(p / 2, p); });
  rows(0, p / 2);
  other.join();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s p k [reps]\n", argv[0]);
    return 2;
  }
  const int64_t p = std::atoll(argv[1]), k = std::atoll(argv[2]);
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  scipy_openblas_set_num_threads(1);
  std::vector<float> a((size_t)(p * k)), ref((size_t)(p * p)), out((size_t)(p * p));
  std::srand(1);
  for (auto& v : a) v = (float)std::rand() / (float)RAND_MAX - 0.5f;
  const double tri = 0.5 * (double)p * (double)p * (double)k;
  struct Case {
    std::string name;
    int workers;
    int kind;  // 0 full SGEMM, 1 the core's bands+syrk, 2 the register kernel, 3 the kernel packed once
  };
  std::vector<Case> cases;
  for (int w : {1, 2}) {
    const std::string s = " w" + std::to_string(w);
    cases.push_back({"full sgemm" + s, w, 0});
    cases.push_back({"bands+syrk (core)" + s, w, 1});
    cases.push_back({"register kernel" + s, w, 2});
    cases.push_back({"kernel, packed once" + s, w, 3});
  }
  auto run = [&](const Case& cs, float* c) {
    if (cs.kind == 0) return full_sgemm(p, k, a.data(), c, cs.workers);
    if (cs.kind == 1) {
      const std::vector<richness::Product<float>> pr{{a.data(), a.data(), p, p, p, p, true, c, p}};
      return richness::shared_products(pr, k, cs.workers);
    }
    register_kernel(p, k, a.data(), c, cs.workers, cs.kind == 3);
  };
  // The kernel's triangle against the core's (both float32 sums over the k rows).
  run(cases[1], ref.data());
  double err = 0.0, scale = 0.0;
  for (int w : {1, 2}) {
    run({"", w, 2}, out.data());
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        err = std::max(err, (double)std::fabs(out[i * p + j] - ref[i * p + j]));
        scale = std::max(scale, (double)std::fabs(ref[i * p + j]));
      }
  }
  std::printf("OpenBLAS core %s, p=%lld k=%lld, best / median of %d; kernel vs core: max |diff| %.2g of max %.3g\n",
              scipy_openblas_get_corename(), (long long)p, (long long)k, reps, err, scale);
  std::vector<std::vector<double>> t(cases.size());
  for (const auto& cs : cases) run(cs, out.data());  // warm up
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run(cases[i], out.data());
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<double> v = t[i];
    std::sort(v.begin(), v.end());
    std::printf("%-26s best %8.2f ms  median %8.2f ms  %6.1f G/s of the triangle", cases[i].name.c_str(), v[0] * 1e3,
                v[v.size() / 2] * 1e3, tri / v[0] / 1e9);
    if (cases[i].kind == 0) std::printf("  (%6.1f G/s of its own)", 2 * tri / v[0] / 1e9);
    std::printf("\n");
  }
  return 0;
}
