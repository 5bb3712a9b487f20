// pybind11 surface of the CUDA backend (module richness._cuda). Same calling
// convention as _core.CpuMoments, plus the caller's stream as an integer
// (torch.cuda.current_stream().cuda_stream) and device export for compute().
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "cuda_moments.hpp"

namespace py = pybind11;
using namespace richness;
using richness::cuda::CudaMoments;
using richness::cuda::Product;

using MatrixArg = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int>;

namespace {

const char* kPrecisionNames[4] = {"fp64", "fp32", "tf32", "bf16"};

Matrix to_matrix(const MatrixArg& a) {
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

py::array_t<double> array_of(const std::vector<double>& v, std::vector<int64_t> shape) {
  py::array_t<double> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// Same keys and layout as _core.CpuMoments.get_state (symmetric matrices full).
py::dict export_state(const State& s) {
  const int64_t p = std::max<int64_t>(s.p, 0), c = std::max<int64_t>(s.c, 0), t = std::max<int64_t>(s.t, 0),
                k = std::max<int64_t>(s.k, 0);
  py::dict d;
  d["n"] = s.n;
  d["p"] = s.p;
  d["c"] = s.c;
  d["t"] = s.t;
  d["k"] = s.k;
  d["num_classes"] = s.num_classes;
  d["precision"] = kPrecisionNames[static_cast<int>(s.precision)];
  d["mean"] = array_of(s.mean, {p});
  d["M"] = array_of(s.M, {p, p});
  d["out_mean"] = array_of(s.out_mean, {c});
  d["B"] = array_of(s.B, {p, c});
  d["A"] = array_of(s.A, {c, c});
  d["tgt_mean"] = array_of(s.tgt_mean, {t});
  d["Bt"] = array_of(s.Bt, {p, t});
  d["At"] = array_of(s.At, {t, t});
  py::array_t<int64_t> counts(k);
  std::copy(s.class_counts.begin(), s.class_counts.end(), counts.mutable_data());
  d["class_counts"] = counts;
  d["class_sums"] = array_of(s.class_sums, {k, p});
  return d;
}

std::vector<double> take(const py::dict& d, const char* key, int64_t size) {
  auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(d[key]);
  if (!a) throw std::invalid_argument(std::string("state key '") + key + "' is not a float array");
  if (a.size() != size)
    throw std::invalid_argument(std::string("state key '") + key + "' has " + std::to_string(a.size()) +
                                " values, expected " + std::to_string(size));
  return std::vector<double>(a.data(), a.data() + a.size());
}

State import_state(const py::dict& d) {
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
    if (prec == kPrecisionNames[code]) {
      s.precision = static_cast<Precision>(code);
      known = true;
    }
  if (!known) throw std::invalid_argument("state key 'precision' is not a known precision: " + prec);
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("inconsistent state: ") + what);
  };
  need(s.n >= 0, "n is negative");
  need(s.n == 0 || s.p >= 1, "feature width must be positive");
  need(s.c == -1 || s.c >= 1, "output width");
  need(s.t == -1 || s.t >= 1, "target width");
  need(s.k >= -1, "class count");
  need(s.num_classes < 0 || s.k <= s.num_classes, "more classes than num_classes");
  const int64_t p = std::max<int64_t>(s.p, 0), c = std::max<int64_t>(s.c, 0), t = std::max<int64_t>(s.t, 0),
                k = std::max<int64_t>(s.k, 0);
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
  int64_t total = 0;
  for (int64_t v : s.class_counts) {
    need(v >= 0, "negative class count");
    total += v;
  }
  need(s.k < 0 || total == s.n, "class counts do not add up to n");
  return s;
}

Product product_of(const std::string& name) {
  if (name == "auto") return Product::automatic;
  if (name == "syrk") return Product::syrk;
  if (name == "gemm") return Product::gemm;
  if (name == "block_rows") return Product::block_rows;
  if (name == "tiles") return Product::tiles;
  throw std::invalid_argument("product must be auto, syrk, gemm, block_rows or tiles, got " + name);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "richness CUDA backend: streamed float64 co-moments on the device, cuBLAS products";
  py::register_exception<type_error>(m, "DTypeError", PyExc_TypeError);

  py::class_<CudaMoments>(m, "CudaMoments")
      .def(py::init<int64_t, int>(), py::arg("num_classes") = -1, py::arg("device") = 0)
      .def(
          "update",
          [](CudaMoments& self, const MatrixArg& features, std::optional<MatrixArg> outputs,
             std::optional<MatrixArg> labels, std::optional<MatrixArg> targets, int precision, uintptr_t stream) {
            Matrix x = to_matrix(features), mo, ml, mt;
            const Matrix* po = nullptr;
            const Matrix* pl = nullptr;
            const Matrix* pt = nullptr;
            if (outputs) { mo = to_matrix(*outputs); po = &mo; }
            if (labels) { ml = to_matrix(*labels); pl = &ml; }
            if (targets) { mt = to_matrix(*targets); pt = &mt; }
            if (precision < 0 || precision > 3)
              throw std::invalid_argument("unknown precision code " + std::to_string(precision));
            py::gil_scoped_release release;
            self.update(x, po, pl, pt, static_cast<Precision>(precision), reinterpret_cast<cudaStream_t>(stream));
          },
          py::arg("features"), py::arg("outputs") = py::none(), py::arg("labels") = py::none(),
          py::arg("targets") = py::none(), py::arg("precision") = 1, py::arg("stream") = 0,
          "Enqueue one batch on `stream`; returns without waiting for the device.")
      .def("merge", &CudaMoments::merge, py::arg("other"), py::call_guard<py::gil_scoped_release>())
      .def("reset", &CudaMoments::reset)
      .def("get_state", [](CudaMoments& self) {
        State s;
        {
          py::gil_scoped_release release;
          s = self.download();
        }
        return export_state(s);
      })
      .def("set_state", [](CudaMoments& self, const py::dict& d) { self.upload(import_state(d)); })
      .def(
          "export_to",
          [](CudaMoments& self, const py::dict& ptrs) {
            // ptrs: key -> device pointer (int) of caller-allocated float64
            // (int64 for class_counts) buffers with the state's shapes.
            CudaMoments::Targets t;
            auto get = [&](const char* key) -> uintptr_t {
              return ptrs.contains(key) ? ptrs[key].cast<uintptr_t>() : 0;
            };
            t.mean = reinterpret_cast<double*>(get("mean"));
            t.M = reinterpret_cast<double*>(get("M"));
            t.out_mean = reinterpret_cast<double*>(get("out_mean"));
            t.B = reinterpret_cast<double*>(get("B"));
            t.A = reinterpret_cast<double*>(get("A"));
            t.tgt_mean = reinterpret_cast<double*>(get("tgt_mean"));
            t.Bt = reinterpret_cast<double*>(get("Bt"));
            t.At = reinterpret_cast<double*>(get("At"));
            t.class_sums = reinterpret_cast<double*>(get("class_sums"));
            t.class_counts = reinterpret_cast<long long*>(get("class_counts"));
            py::gil_scoped_release release;
            self.export_to(t);
          },
          py::arg("ptrs"))
      .def("shape", [](CudaMoments& self) {
        // Host-known facts (no synchronisation): widths, class count, precision.
        py::dict d;
        d["p"] = self.p();
        d["c"] = self.c();
        d["t"] = self.t();
        d["k"] = self.k();
        d["num_classes"] = self.num_classes();
        d["precision"] = kPrecisionNames[static_cast<int>(self.precision())];
        return d;
      })
      .def(
          "set_product",
          [](CudaMoments& self, const std::string& algo, int block) { self.set_product(product_of(algo), block); },
          py::arg("algo") = "auto", py::arg("block") = 512,
          "How X^T X is formed: auto, syrk, gemm, block_rows or tiles (benchmarks).")
      .def_property_readonly("n", [](CudaMoments& self) {
        py::gil_scoped_release release;
        return self.n();
      })
      .def_property_readonly("p", &CudaMoments::p)
      .def_property_readonly("device", &CudaMoments::device);

  m.def("device_info", &richness::cuda::device_info, py::arg("device") = 0);
  m.def("info", &richness::cuda::backend_info, "What was built and which GPU is usable; never raises.");
}
