// The precision modes of the products, as one table that both backends, the
// guards and Python (through the compiled core, _core.precisions()) read.
#pragma once

#include <cstddef>
#include <string>

#include "types.hpp"

namespace richness {

// What cuBLAS accumulates the products in: CUBLAS_COMPUTE_64F, _32F, or
// _32F_FAST_TF32 (tensor cores, inputs rounded to tf32, fp32 accumulation).
enum class Accumulate : int { f64, f32, tf32 };

// One line a mode, finest to coarsest: a state that saw several keeps the
// coarsest, the largest. Columns: name; element type the centered rows are
// narrowed to; element type of the products; what the products accumulate
// in; CUDA only (the CPU refuses it); the default rank cut, about the
// products' relative noise (docs/MATH.md, "Rank cut"); whether the class
// means are fine enough for NC1 by subtraction (docs/MATH.md, "NC1").
// Adding a mode: one line here, and its products in each backend that runs it.
#define RICHNESS_PRECISIONS(X)                                             \
  X(fp64, DType::f64, DType::f64, Accumulate::f64, false, 1e-10, true)    \
  X(fp32, DType::f32, DType::f32, Accumulate::f32, false, 1e-5, true)     \
  X(tf32, DType::f32, DType::f32, Accumulate::tf32, true, 1e-3, false)    \
  X(bf16, DType::bf16, DType::f32, Accumulate::f32, true, 1e-2, false)

enum class Precision : int {
#define RICHNESS_ENUM(name, ...) name,
  RICHNESS_PRECISIONS(RICHNESS_ENUM)
#undef RICHNESS_ENUM
};

struct PrecisionTraits {
  const char* name;
  DType input;    // centered rows, as the products read them
  DType product;  // the products' elements
  Accumulate accumulate;
  bool cuda_only;
  double rtol;
  bool resolves_nc1;

  constexpr size_t input_bytes() const { return dtype_size(input); }
  constexpr size_t product_bytes() const { return dtype_size(product); }
};

inline constexpr PrecisionTraits kPrecisions[] = {
#define RICHNESS_ROW(name, input, product, accumulate, cuda_only, rtol, nc1) \
  {#name, input, product, accumulate, cuda_only, rtol, nc1},
    RICHNESS_PRECISIONS(RICHNESS_ROW)
#undef RICHNESS_ROW
};
inline constexpr int kNumPrecisions = (int)(sizeof(kPrecisions) / sizeof(kPrecisions[0]));

constexpr const PrecisionTraits& traits(Precision p) { return kPrecisions[(int)p]; }
inline const char* precision_name(Precision p) { return traits(p).name; }

// The one refusal of a CUDA-only mode off the GPU, on every route: the CPU
// backend, the Moments constructor (through _core.check_cpu_precision).
inline void check_runs_on_cpu(Precision p) {
  if (!traits(p).cuda_only) return;
  std::string cpu;
  for (const PrecisionTraits& t : kPrecisions) {
    if (t.cuda_only) continue;
    cpu += cpu.empty() ? "" : " or ";
    cpu += t.name;
  }
  throw std::invalid_argument(std::string("precision '") + traits(p).name + "' needs device='cuda'; the CPU multiplies in " + cpu);
}

}  // namespace richness
