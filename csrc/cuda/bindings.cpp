// pybind11 surface of the CUDA backend (module richness._cuda). Same calling
// convention as _core.CpuMoments, plus the caller's stream as an integer
// (torch.cuda.current_stream().cuda_stream) and device export for compute().
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <optional>
#include <tuple>

#include "../state_dict.hpp"
#include "cuda_moments.hpp"

namespace py = pybind11;
using namespace richness;
using richness::cuda::CudaMoments;
using richness::cuda::Product;
using namespace richness::pystate;

namespace {

Product product_of(const std::string& name) {
  if (name == "auto") return Product::automatic;
  if (name == "syrk") return Product::syrk;
  if (name == "gemm") return Product::gemm;
  if (name == "block_rows") return Product::block_rows;
  if (name == "tiles") return Product::tiles;
  throw std::invalid_argument("product must be auto, syrk, gemm, block_rows or tiles, got " + name);
}

// One lock per object, as in the CPU backend (CpuMoments): every bound method
// holds it, so several Python threads may update, merge and read one object.
// Each method releases the GIL before taking it (a thread waiting for the lock
// never holds the GIL; the holder never needs it).
struct LockedCudaMoments : CudaMoments {
  using CudaMoments::CudaMoments;
  std::mutex mu;
};

// Runs fn(self) with the GIL released and the object's lock held.
template <typename Fn>
auto locked(LockedCudaMoments& self, Fn&& fn) {
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(self.mu);
  return fn(static_cast<CudaMoments&>(self));
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "richness CUDA backend: streamed float64 co-moments on the device, cuBLAS products";
  py::register_exception<type_error>(m, "DTypeError", PyExc_TypeError);

  py::class_<LockedCudaMoments>(m, "CudaMoments",
                                "Streamed float64 co-moments on a CUDA device. Thread-safe: one object may be "
                                "updated, merged and read from several threads.")
      .def(py::init<int64_t, int>(), py::arg("num_classes") = -1, py::arg("device") = 0)
      .def(
          "update",
          [](LockedCudaMoments& self, const MatrixArg& features, std::optional<MatrixArg> outputs,
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
            locked(self, [&](CudaMoments& s) {
              s.update(x, po, pl, pt, static_cast<Precision>(precision), reinterpret_cast<cudaStream_t>(stream));
            });
          },
          py::arg("features"), py::arg("outputs") = py::none(), py::arg("labels") = py::none(),
          py::arg("targets") = py::none(), py::arg("precision") = 1, py::arg("stream") = 0,
          "Enqueue one batch on `stream`; returns without waiting for the device.")
      .def(
          "merge",
          [](LockedCudaMoments& self, LockedCudaMoments& other) {
            py::gil_scoped_release release;
            if (&other == &self) {
              std::lock_guard<std::mutex> lock(self.mu);
              self.merge(other);
              return;
            }
            std::scoped_lock lock(self.mu, other.mu);  // std::lock order: a.merge(b) beside b.merge(a) is safe
            self.merge(other);
          },
          py::arg("other"))
      .def("reset", [](LockedCudaMoments& self) { locked(self, [](CudaMoments& s) { s.reset(); }); })
      .def("get_state",
           [](LockedCudaMoments& self) {
             State s = locked(self, [](CudaMoments& c) { return c.download(); });
             return export_state(s);
           })
      .def("set_state",
           [](LockedCudaMoments& self, const py::dict& d) {
             const State s = import_state(d);
             locked(self, [&](CudaMoments& c) { c.upload(s); });
           })
      .def(
          "export_to",
          [](LockedCudaMoments& self, const py::dict& ptrs) {
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
            locked(self, [&](CudaMoments& c) { c.export_to(t); });
          },
          py::arg("ptrs"))
      .def("shape", [](LockedCudaMoments& self) {
        // Host-known facts (no synchronisation): widths, class count, precision.
        int64_t v[5];
        Precision prec = locked(self, [&](CudaMoments& c) {
          v[0] = c.p(), v[1] = c.c(), v[2] = c.t(), v[3] = c.k(), v[4] = c.num_classes();
          return c.precision();
        });
        py::dict d;
        d["p"] = v[0];
        d["c"] = v[1];
        d["t"] = v[2];
        d["k"] = v[3];
        d["num_classes"] = v[4];
        d["precision"] = precision_name(prec);
        return d;
      })
      .def(
          "set_product",
          [](LockedCudaMoments& self, const std::string& algo, int block) {
            const Product product = product_of(algo);
            locked(self, [&](CudaMoments& c) { c.set_product(product, block); });
          },
          py::arg("algo") = "auto", py::arg("block") = 512,
          "How X^T X is formed: auto, syrk, gemm, block_rows or tiles (benchmarks).")
      .def("set_row_cap", &CudaMoments::set_row_cap, py::arg("rows"),
           "Most rows one fp32 product accumulates in float32 (0 = no limit); default 1024.")
      .def_property_readonly("row_cap", &CudaMoments::row_cap)
      .def(
          "set_stack",
          [](LockedCudaMoments& self, int64_t rows, bool joint) {
            locked(self, [&](CudaMoments& c) { c.set_stack(rows, joint); });
          },
          py::arg("rows"), py::arg("joint") = true,
          "Stage up to `rows` centered rows before one product and one float64 merge (0 = off: one per batch).\n"
          "joint: with outputs/targets streamed, one product over the rows [X | F | T] (else one per block).\n"
          "Flushes pending rows first (synchronises).")
      .def_property_readonly("stack_rows",
                             [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.stack_rows(); }); })
      .def_property_readonly("stack_joint",
                             [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.stack_joint(); }); })
      .def_property_readonly("staged_rows",
                             [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.staged_rows(); }); },
                             "Rows staged and not yet merged (host-known; no synchronisation).")
      .def_property_readonly("staged_batches",
                             [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.staged_batches(); }); })
      .def_property_readonly("n", [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.n(); }); })
      .def_property_readonly("p", [](LockedCudaMoments& self) { return locked(self, [](CudaMoments& c) { return c.p(); }); })
      .def_property_readonly("device", [](LockedCudaMoments& self) { return self.device(); });

  m.def("device_info", &richness::cuda::device_info, py::arg("device") = 0);
  m.def("info", &richness::cuda::backend_info, "What was built and which GPU is usable; never raises.");
}
