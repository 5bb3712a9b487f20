// The Python-facing state dict and batch tuples, shared by the CPU (_core)
// and CUDA (_cuda) bindings: same keys, shapes and validation in both.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "moments.hpp"

namespace richness {
namespace pystate {

namespace py = pybind11;

using MatrixArg = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int>;


inline Matrix to_matrix(const MatrixArg& a) {
  Matrix m;
  m.ptr = reinterpret_cast<const void*>(std::get<0>(a));
  m.rows = std::get<1>(a);
  m.cols = std::get<2>(a);
  m.ld = std::get<3>(a);
  const int code = std::get<4>(a);
  if (code < 0 || code > 5) throw type_error("unknown dtype code " + std::to_string(code));
  m.dtype = static_cast<DType>(code);
  return m;
}

inline Precision to_precision(int code) {
  if (code < 0 || code > 3) throw std::invalid_argument("unknown precision code " + std::to_string(code));
  return static_cast<Precision>(code);
}

// Copies a row-major lower triangle into a full symmetric array.
inline py::array_t<double> symmetric(const std::vector<double>& lower, int64_t n) {
  py::array_t<double> out({n, n});
  double* o = out.mutable_data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) o[i * n + j] = o[j * n + i] = lower[i * n + j];
  return out;
}

inline py::array_t<double> vector_of(const std::vector<double>& v, std::vector<int64_t> shape) {
  py::array_t<double> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

inline py::dict export_state(const State& s) {
  const int64_t p = std::max<int64_t>(s.p, 0), c = std::max<int64_t>(s.c, 0),
                t = std::max<int64_t>(s.t, 0), k = std::max<int64_t>(s.k, 0);
  py::dict d;
  d["n"] = s.n;
  d["p"] = s.p;
  d["c"] = s.c;
  d["t"] = s.t;
  d["k"] = s.k;
  d["num_classes"] = s.num_classes;
  d["precision"] = precision_name(s.precision);
  d["mean"] = vector_of(s.mean, {p});
  d["M"] = symmetric(s.M, p);
  d["out_mean"] = vector_of(s.out_mean, {c});
  d["B"] = vector_of(s.B, {p, c});
  d["A"] = symmetric(s.A, c);
  d["tgt_mean"] = vector_of(s.tgt_mean, {t});
  d["Bt"] = vector_of(s.Bt, {p, t});
  d["At"] = symmetric(s.At, t);
  py::array_t<int64_t> counts(k);
  std::copy(s.class_counts.begin(), s.class_counts.end(), counts.mutable_data());
  d["class_counts"] = counts;
  d["class_sums"] = vector_of(s.class_sums, {k, p});
  return d;
}

// Host-known facts of a state: widths, class count, precision.
inline py::dict shape_of(const State& s) {
  py::dict d;
  d["p"] = s.p;
  d["c"] = s.c;
  d["t"] = s.t;
  d["k"] = s.k;
  d["num_classes"] = s.num_classes;
  d["precision"] = precision_name(s.precision);
  return d;
}

inline std::vector<double> take(const py::dict& d, const char* key, int64_t size) {
  auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(d[key]);
  if (!a) throw std::invalid_argument(std::string("state key '") + key + "' is not a float array");
  if (a.size() != size)
    throw std::invalid_argument(std::string("state key '") + key + "' has " + std::to_string(a.size()) +
                                " values, expected " + std::to_string(size));
  return std::vector<double>(a.data(), a.data() + a.size());
}

inline State import_state(const py::dict& d) {
  State s;
  s.n = d["n"].cast<int64_t>();
  s.p = d["p"].cast<int64_t>();
  s.c = d["c"].cast<int64_t>();
  s.t = d["t"].cast<int64_t>();
  s.k = d["k"].cast<int64_t>();
  s.num_classes = d["num_classes"].cast<int64_t>();
  const std::string prec = d["precision"].cast<std::string>();
  bool known = false;
  for (int code = 0; code <= 3; ++code)
    if (prec == precision_name(static_cast<Precision>(code))) {
      s.precision = static_cast<Precision>(code);
      known = true;
    }
  if (!known) throw std::invalid_argument("state key 'precision' is not a known precision: " + prec);
  const int64_t p = std::max<int64_t>(s.p, 0), c = std::max<int64_t>(s.c, 0),
                t = std::max<int64_t>(s.t, 0), k = std::max<int64_t>(s.k, 0);
  s.mean = take(d, "mean", p);
  s.M = take(d, "M", p * p);  // full symmetric; the lower half is what is read
  s.out_mean = take(d, "out_mean", c);
  s.B = take(d, "B", p * c);
  s.A = take(d, "A", c * c);
  s.tgt_mean = take(d, "tgt_mean", t);
  s.Bt = take(d, "Bt", p * t);
  s.At = take(d, "At", t * t);
  s.class_sums = take(d, "class_sums", k * p);
  auto counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(d["class_counts"]);
  if (!counts || counts.size() != k)
    throw std::invalid_argument("state key 'class_counts' must hold " + std::to_string(k) + " integers");
  s.class_counts.assign(counts.data(), counts.data() + k);
  s.check_consistent();
  return s;
}

}  // namespace pystate
}  // namespace richness
