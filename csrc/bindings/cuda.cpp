// pybind11 surface of the CUDA backend (module richness._cuda). The methods of
// _core.CpuMoments (bindings/core.cpp) with the same arguments, plus the
// caller's stream as an integer (torch.cuda.current_stream().cuda_stream),
// device export for compute(), and the product and staging switches.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <optional>
#include <tuple>

#include "../cuda/cuda_moments.hpp"
#include "common.hpp"

namespace py = pybind11;
using namespace richness;
using richness::cuda::CudaMoments;
using richness::cuda::Product;
using namespace richness::pystate;

namespace {

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
  // Module-local translators: registering one creates pybind11's per-module
  // tables now, at import. Created lazily, they would be allocated while the
  // first exception is translated, and a std::bad_alloc there (under a memory
  // limit) would end the process instead of raising MemoryError.
  register_input_errors(m, /*define=*/false);

  py::class_<LockedCudaMoments>(m, "CudaMoments",
                                "Streamed float64 co-moments on a CUDA device. Thread-safe: one object may be "
                                "updated, merged and read from several threads.")
      .def(
          "__init__",
          [](py::detail::value_and_holder& v_h, const py::object& num_classes, int device) {
            adopt(v_h, std::make_unique<LockedCudaMoments>(num_classes_of(num_classes), device));
          },
          py::detail::is_new_style_constructor(), py::arg("num_classes") = -1, py::arg("device") = 0)
      .def(
          "update",
          [](LockedCudaMoments& self, const MatrixArg& features, std::optional<MatrixArg> outputs,
             std::optional<MatrixArg> labels, std::optional<MatrixArg> targets, const std::string& precision,
             uintptr_t stream) {
            const BatchArgs args(features, outputs, labels, targets);
            const Batch b = args.batch();
            const Precision prec = precision_of(precision);
            locked(self, [&](CudaMoments& s) {
              s.update(b.features, b.outputs, b.labels, b.targets, prec, reinterpret_cast<cudaStream_t>(stream));
            });
          },
          RICHNESS_BATCH_ARGS, py::arg("precision") = "fp32", py::arg("stream") = 0,
          "Enqueue one batch on `stream`; returns without waiting for the device.")
      .def(
          "merge",
          [](LockedCudaMoments& self, LockedCudaMoments& other) {
            py::gil_scoped_release release;
            if (&other == &self) {
              std::lock_guard<std::mutex> lock(self.mu);
              self.merge_from(other);
              return;
            }
            std::scoped_lock lock(self.mu, other.mu);  // std::lock order: a.merge(b) beside b.merge(a) is safe
            self.merge_from(other);
          },
          py::arg("other"))
      .def("reset", [](LockedCudaMoments& self) { locked(self, [](CudaMoments& s) { s.reset(); }); })
      .def("get_state",
           [](LockedCudaMoments& self) {
             State s = locked(self, [](CudaMoments& c) { return c.get_state(); });
             return export_state(s);
           })
      .def("set_state",
           [](LockedCudaMoments& self, const py::dict& d) {
             State s = import_state(d);
             locked(self, [&](CudaMoments& c) { c.set_state(std::move(s)); });
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
#define RICHNESS_TARGET(name, type, rows, cols, sym) t.name = reinterpret_cast<decltype(t.name)>(get(#name));
            RICHNESS_STATE_ARRAYS(RICHNESS_TARGET)
#undef RICHNESS_TARGET
            locked(self, [&](CudaMoments& c) { c.export_to(t); });
          },
          py::arg("ptrs"))
      .def("shape", [](LockedCudaMoments& self) {
        // Host-known facts (no synchronisation): widths, class count, precision.
        State head;  // widths only
        locked(self, [&](CudaMoments& c) {
          head.p = c.p(), head.c = c.c(), head.t = c.t(), head.k = c.k(), head.num_classes = c.num_classes();
          head.precision = c.precision();
        });
        return shape_of(head);
      })
      .def(
          "set_product",
          [](LockedCudaMoments& self, const std::string& algo, int block) {
            const Product product = richness::cuda::product_from_name(algo);
            locked(self, [&](CudaMoments& c) { c.set_product(product, block); });
          },
          py::arg("algo") = "auto", py::arg("block") = 512,
          "How X^T X is formed: auto (measured once per shape, fastest kept), syrk, gemm, block_rows or tiles.\n"
          "Overrides RICHNESS_CUDA_PRODUCT=name[:block], read when the object is made.")
      .def_property_readonly("product",
                             [](LockedCudaMoments& self) {
                               return locked(self, [](CudaMoments& c) {
                                 return std::string(richness::cuda::product_name(c.product()));
                               });
                             })
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

  m.attr("PRECISIONS") = precision_names();
  check_allocation_in_new(m.attr("CudaMoments"));
  m.def("device_info", &richness::cuda::device_info, py::arg("device") = 0);
  m.def(
      "measured_products",
      [] {
        py::list out;
        for (const auto& m : richness::cuda::measured_products()) {
          py::dict times;
          for (const auto& [p, ms] : m.ms) times[richness::cuda::product_name(p)] = ms;
          py::dict d;
          d["device"] = m.device;
          d["precision"] = precision_names()[(size_t)m.precision];
          d["n"] = m.n;
          d["rows"] = m.rows;
          d["block"] = m.block;
          d["product"] = richness::cuda::product_name(m.product);
          d["ms"] = times;
          out.append(d);
        }
        return out;
      },
      "Products chosen by measurement in this process: device, precision, n (width), rows, block, the product\n"
      "kept and each candidate's time in ms (best of two runs).");
  m.def("clear_measured_products", &richness::cuda::clear_measured_products,
        "Forget the measured choices: the next product of each shape is measured again.");
  m.def("info", &richness::cuda::backend_info, "What was built and which GPU is usable; never raises.");
}
