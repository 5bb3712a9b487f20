// pybind11 surface of the CPU core (module richness._core). The same methods
// as the CUDA backend's (bindings/cuda.cpp), which adds a stream argument.
// Batches arrive as named (pointer, rows, cols, row stride, dtype name)
// tuples (common.hpp); the Python adapter keeps the memory alive for the call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
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
  register_input_errors(m, /*define=*/true);

  py::register_local_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const memory_error& err) {
      PyErr_SetString(PyExc_MemoryError, err.what());
    } catch (const std::bad_alloc&) {
      // The memory model (available_memory) passed the call, yet an allocation failed: a limit it
      // does not read (ulimit -d, a cgroup) or memory taken meanwhile by others.
      PyErr_SetString(PyExc_MemoryError,
                      "the core could not allocate memory although the memory check passed: a limit of this "
                      "process (ulimit -d, a cgroup) or memory taken by others since; a refused update leaves "
                      "the state as it was");
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
          RICHNESS_BATCH_ARGS, py::arg("precision") = "fp32", "Add a batch.")
      .def(
          "merge", [](CpuMoments& self, CpuMoments& other) { self.merge_from(other); }, py::arg("other"), release(),
          "Chan's merge of another state into this one (the merge rule first: "
          "check_compatible_for_merge).")
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
      .def(
          "export_into",
          [](const CpuMoments& self, const py::dict& out) {
            const StateArrays targets = state_arrays(out);
            State head;
            {
              py::gil_scoped_release release;
              const ParkWorkers park;
              self.read([&](const State& s) {
                export_state_into(s, targets, blas_get_num_threads());
                head = s.scalars();
              });
            }
            py::dict d = shape_of(head);
            d["n"] = head.n;
            return d;
          },
          py::arg("out"),
          "Write the state's arrays into the caller's arrays (a dict by field name: writable C-contiguous float64 "
          "or int64 arrays of the sizes get_state exports, symmetric matrices full) and return its widths, "
          "class count, precision and n. Checks every size first; writes nothing on a mismatch.")
      .def(
          "merge_into",
          [](const CpuMoments& self, const py::dict& arrays, const py::dict& widths) {
            StateArrays into = state_arrays(arrays, "merge_into");
            import_scalars(widths, into);
            {
              py::gil_scoped_release release;
              const ParkWorkers park;
              self.read([&](const State& s) { merge_into(into, s, blas_get_num_threads()); });
            }
            State head;
            head.n = into.n, head.p = into.p, head.c = into.c, head.t = into.t, head.k = into.k;
            head.num_classes = into.num_classes, head.precision = into.precision;
            py::dict d = shape_of(head);
            d["n"] = head.n;
            return d;
          },
          py::arg("arrays"), py::arg("widths"),
          "Chan's merge of this state into the one held in the caller's arrays (as export_into takes them, "
          "symmetric matrices full), in place: `widths` gives that state's n, p, c, t, k, num_classes and "
          "precision, the arrays have the merged state's sizes (class arrays grown; an empty state's arrays "
          "any content, of the merged widths). The merge of `merge`, refused in its words; on a refusal or a "
          "size mismatch nothing is written. Returns the merged state's widths, class count, precision and n.")
      .def(
          "norm_m",
          [](const CpuMoments& self) {
            py::gil_scoped_release release;
            double v = 0.0;
            self.read([&](const State& s) { v = s.norm_m(); });
            return v;
          },
          "||M||_F, the Frobenius norm of the feature co-moment, in float64 from its lower triangle.")
      .def(
          "get_fields",
          [](const CpuMoments& self, const std::vector<std::string>& keys) {
            py::dict d;
            State s;
            {
              py::gil_scoped_release release;
              self.read([&](const State& st) {
                s = st.scalars();
#define RICHNESS_PICK(name, type, rows, cols, sym) \
  if (std::find(keys.begin(), keys.end(), #name) != keys.end()) s.name = st.name;
                RICHNESS_STATE_ARRAYS(RICHNESS_PICK)
#undef RICHNESS_PICK
              });
            }
            for (const std::string& key : keys) {
              bool known = false;
#define RICHNESS_EXPORT(name, type, rows, cols, sym) \
  if (key == #name) {                                \
    d[#name] = export_array(s.name, s.size(rows), s.size(cols), sym, rows == Dim::one); \
    known = true;                                    \
  }
              RICHNESS_STATE_ARRAYS(RICHNESS_EXPORT)
#undef RICHNESS_EXPORT
              if (!known) throw std::invalid_argument("get_fields: unknown state array '" + key + "'");
            }
            return d;
          },
          py::arg("keys"), "Copies of the named state arrays (as get_state exports them), without the others.")
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
              head = self.scalars();
            }
            return shape_of(head);
          },
          "Widths, class count and precision (the same keys as the CUDA backend's shape()).")
      .def_property_readonly("n",
                             [](CpuMoments& self) {
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
        const BatchArgs args(features, outputs, labels, targets);
        validate_batch(widths_of(widths, false), args.batch());
      },
      py::arg("widths"), RICHNESS_BATCH_ARGS,
      "Raise unless the batch fits a state of these widths (shapes and streams; reads no data).");
  m.def(
      "check_compatible_for_merge",
      [](const std::vector<py::dict>& metas) {
        std::vector<Widths> all;
        for (const py::dict& d : metas) all.push_back(widths_of(d));
        Moments::check_compatible_for_merge(all);
      },
      py::arg("widths"),
      "Raise ValueError unless states of these widths (dicts of n, p, c, t, k, num_classes) merge: the merge "
      "rule of every merge (python/richness/_state.py's check_compatible calls it).");
  m.def(
      "check_state",
      [](const py::dict& d) { import_state(d).check_consistent(); }, py::arg("state"),
      "Raise ValueError unless the state dict is one the core imports (widths, sizes, class counts: "
      "State::check_consistent).");
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
  m.def(
      "matmul",
      [](const py::array& a, const py::array& b, py::array& out, bool trans_b) {
        auto need = [](bool ok, const std::string& what) {
          if (!ok) throw std::invalid_argument("matmul: " + what);
        };
        need(a.ndim() == 2 && b.ndim() == 2 && out.ndim() == 2, "a, b and out must be 2-D");
        need((a.flags() & py::array::c_style) && (b.flags() & py::array::c_style) &&
                 (out.flags() & py::array::c_style) && out.writeable(),
             "a, b and out must be C-contiguous, out writable");
        const bool f32 = py::isinstance<py::array_t<float>>(a), f64 = py::isinstance<py::array_t<double>>(a);
        need(f32 || f64, "a must be float32 or float64");
        need(a.dtype().is(b.dtype()) && a.dtype().is(out.dtype()), "a, b and out must share one dtype");
        const int64_t m = a.shape(0), k = a.shape(1), kb = trans_b ? b.shape(1) : b.shape(0),
                      n = trans_b ? b.shape(0) : b.shape(1);
        need(kb == k && out.shape(0) == m && out.shape(1) == n, "shapes do not match");
        void* o = out.mutable_data();
        py::gil_scoped_release release;
        if (f32)
          matmul_here(m, n, k, static_cast<const float*>(a.data()), static_cast<const float*>(b.data()),
                      static_cast<float*>(o), trans_b);
        else
          matmul_here(m, n, k, static_cast<const double*>(a.data()), static_cast<const double*>(b.data()),
                      static_cast<double*>(o), trans_b);
      },
      py::arg("a"), py::arg("b"), py::arg("out"), py::arg("trans_b") = false,
      "out = a @ b (or a @ b.T with trans_b) for C-contiguous float32 or float64 matrices of one dtype, by "
      "the core's BLAS on the calling thread alone (no thread pool wakes): for products too small to be "
      "worth threads (the torchmetrics metric's per-batch value).");
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
  m.def("available_memory", &available_memory,
        "Bytes this process can still allocate now: MemAvailable (physical memory where /proc does not say) "
        "and, under an address-space limit, the limit less VmSize (the check every update makes before "
        "allocating; python/richness/_engine/bounded_io.py asks it too).");
  m.def("blas_info", &blas_info);
  m.def("blas_get_num_threads", &blas_get_num_threads);
  m.def("blas_set_num_threads", &blas_set_num_threads, py::arg("n"));
  // The vector level of the batch passes (0 plain loops, 1 AVX2, 2 AVX-512):
  // tests compare the levels; set_simd_level lowers it (up to what the processor has).
  m.def("simd_level", &simd_level);
  m.def("simd_available", &simd_available);
  m.def("set_simd_level", &set_simd_level, py::arg("level"));
}
