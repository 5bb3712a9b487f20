// pybind11 surface of the CPU core (module richness._core). The same methods
// as the CUDA backend's (bindings/cuda.cpp), which adds a stream argument.
// Batches arrive as named (pointer, rows, cols, row stride, dtype name)
// tuples (common.hpp); the Python adapter keeps the memory alive for the call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "../cpu/cpu_moments.hpp"
#include "../cpu/passes.hpp"
#include "common.hpp"

namespace py = pybind11;
using namespace richness;
using namespace richness::pystate;

PYBIND11_MODULE(_core, m) {
  m.doc() = "richness CPU core: streamed float64 co-moments (docs/MATH.md), BLAS products";
  // Module-local translators: registering one creates pybind11's per-module
  // tables now, at import. Created lazily, they would be allocated while the
  // first exception is translated, and a std::bad_alloc there (under a memory
  // limit) would end the process instead of raising MemoryError.
  py::register_local_exception<type_error>(m, "DTypeError", PyExc_TypeError);

  py::register_local_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const memory_error& err) {
      PyErr_SetString(PyExc_MemoryError, err.what());
    }
  });

  // Every method that takes the object's mutex first releases the GIL, so a
  // thread waiting for the mutex never blocks the Python threads (nor the one
  // holding the mutex, which never needs the GIL while it holds it).
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<CpuMoments>(m, "CpuMoments",
                         "Streamed float64 co-moments on the CPU. Thread-safe: one object may be updated, merged "
                         "and read from several threads; each call sees whole batches only.")
      .def(
          "__init__",
          [](py::detail::value_and_holder& v_h, const py::object& num_classes) {
            adopt(v_h, std::make_unique<CpuMoments>(num_classes_of(num_classes)));
          },
          py::detail::is_new_style_constructor(), py::arg("num_classes") = -1)
      .def(
          "update",
          [](CpuMoments& self, const MatrixArg& features, std::optional<MatrixArg> outputs,
             std::optional<MatrixArg> labels, std::optional<MatrixArg> targets, const std::string& precision) {
            const BatchArgs args(features, outputs, labels, targets);
            const Precision prec = precision_of(precision);
            py::gil_scoped_release release;
            self.update(args.batch(), prec);
          },
          RICHNESS_BATCH_ARGS, py::arg("precision") = "fp32")
      .def("merge", &CpuMoments::merge, py::arg("other"), release())
      .def("reset", &CpuMoments::reset, release())
      .def("get_state",
           [](const CpuMoments& self) {
             State s;
             {
               py::gil_scoped_release release;
               s = self.snapshot();
             }
             return export_state(s);
           })
      .def("set_state",
           [](CpuMoments& self, const py::dict& d) {
             State s = import_state(d);
             py::gil_scoped_release release;
             self.set_state(std::move(s));
           })
      .def(
          "shape",
          [](const CpuMoments& self) {
            State head;
            {
              py::gil_scoped_release release;
              head = self.widths();
            }
            return shape_of(head);
          },
          "Widths, class count and precision (the same keys as the CUDA backend's shape()).")
      .def_property_readonly("n",
                             [](const CpuMoments& self) {
                               py::gil_scoped_release release;
                               return self.n();
                             })
      .def_property_readonly("p", [](const CpuMoments& self) {
        py::gil_scoped_release release;
        return self.p();
      });

  check_allocation_in_new(m.attr("CpuMoments"));

  m.def(
      "check_batch",
      [](const py::dict& widths, const MatrixArg& features, std::optional<MatrixArg> outputs,
         std::optional<MatrixArg> labels, std::optional<MatrixArg> targets) {
        Widths w{0, widths["p"].cast<int64_t>(), widths["c"].cast<int64_t>(), widths["t"].cast<int64_t>(),
                 widths["k"].cast<int64_t>(), widths["num_classes"].cast<int64_t>()};
        const BatchArgs args(features, outputs, labels, targets);
        validate_batch(w, args.batch());
      },
      py::arg("widths"), RICHNESS_BATCH_ARGS,
      "Raise unless the batch fits a state of these widths (shapes and streams; reads no data).");
  m.def(
      "centered_grams",
      [](const MatrixArg& x, int64_t per, const std::string& precision, uintptr_t out, uintptr_t norms) {
        const Matrix mx = to_matrix(x);
        const Precision prec = precision_of(precision);
        py::gil_scoped_release release;
        centered_grams(mx, per, prec, reinterpret_cast<void*>(out), reinterpret_cast<double*>(norms));
      },
      py::arg("x"), py::arg("per"), py::arg("precision"), py::arg("out"), py::arg("norms"),
      "Centered Gram matrices of blocks of `per` rows into the caller's contiguous buffer at `out` "
      "((rows / per) x per x per, float64 for precision fp64, float32 otherwise) and their "
      "Frobenius norms into the float64 buffer at `norms` (rows / per). Internal: the Monitor's "
      "one-batch windows.");
  m.attr("PRECISIONS") = precision_names();  // finest to coarsest
  m.def("precisions", &precision_table,
        "The precision modes, finest to coarsest: name, coarseness, input and product element types and "
        "bytes, accumulation, cuda_only, the default rank cut rtol, resolves_nc1 (python/richness/_state.py "
        "reads them from here).");
  m.def(
      "check_cpu_precision", [](const std::string& name) { check_runs_on_cpu(precision_of(name)); },
      py::arg("precision"), "Raise ValueError unless the CPU backend runs this precision mode.");
  m.def("state_fields", &state_field_table,
        "The state's arrays in order: name, element type, row and column widths, symmetric "
        "(python/richness/_state.py lists the same; a test compares the two).");
  m.def("blas_info", &blas_info);
  m.def("blas_get_num_threads", &blas_get_num_threads);
  m.def("blas_set_num_threads", &blas_set_num_threads, py::arg("n"));
  // The vector level of the batch passes (0 plain loops, 1 AVX2, 2 AVX-512):
  // tests compare the levels; set_simd_level lowers it (up to what the processor has).
  m.def("simd_level", &simd_level);
  m.def("simd_available", &simd_available);
  m.def("set_simd_level", &set_simd_level, py::arg("level"));
}
