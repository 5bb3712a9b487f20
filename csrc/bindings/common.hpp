// What the CPU (_core) and CUDA (_cuda) bindings share: batches as named
// (pointer, rows, cols, row stride, dtype name) tuples, precisions by name,
// and the state as a dict of numpy arrays (the keys and shapes of
// RICHNESS_STATE_ARRAYS; python/richness/_state.py validates the same).
// Names rather than integer codes cross the boundary: the state dict and the
// saved file store names too, so no order is serialised.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../common/merge.hpp"
#include "../common/moments.hpp"
#include "../common/parallel.hpp"
#include "../common/state.hpp"
#include "../common/types.hpp"

namespace richness {
namespace pystate {

namespace py = pybind11;

// (pointer, rows, cols, row stride in elements, dtype name as numpy spells it)
using MatrixArg = std::tuple<uintptr_t, int64_t, int64_t, int64_t, std::string>;

inline DType dtype_of(const std::string& name) {
#define RICHNESS_MATCH(code, dname) \
  if (name == #dname) return DType::code;
  RICHNESS_DTYPES(RICHNESS_MATCH)
#undef RICHNESS_MATCH
  throw type_error("unknown dtype " + name);
}

inline Precision precision_of(const std::string& name) {
  for (int i = 0; i < kNumPrecisions; ++i)
    if (name == kPrecisions[i].name) return (Precision)i;
  throw std::invalid_argument("unknown precision " + name);
}

inline std::vector<std::string> precision_names() {
  std::vector<std::string> out;
  for (const PrecisionTraits& t : kPrecisions) out.push_back(t.name);
  return out;
}

// The precision table (common/precision.hpp) as Python reads it: one dict a
// mode, finest to coarsest.
inline py::list precision_table() {
  static const char* accumulate[] = {"float64", "float32", "tf32"};
  py::list out;
  for (int i = 0; i < kNumPrecisions; ++i) {
    const PrecisionTraits& t = kPrecisions[i];
    py::dict d;
    d["name"] = t.name;
    d["coarseness"] = i;
    d["input"] = dtype_name(t.input);
    d["product"] = dtype_name(t.product);
    d["input_bytes"] = t.input_bytes();
    d["product_bytes"] = t.product_bytes();
    d["accumulate"] = accumulate[(int)t.accumulate];
    d["cuda_only"] = t.cuda_only;
    d["rtol"] = t.rtol;
    d["resolves_nc1"] = t.resolves_nc1;
    out.append(d);
  }
  return out;
}

// Raises an instance of the exception class `cls` with message `what` and
// the attributes stream, row and limit (None where empty or negative). If
// making it fails (out of memory), that error is what is raised.
inline void raise_input_error(py::handle cls, const char* what, const std::string& stream, int64_t row,
                              const std::string& limit) {
  PyObject* e = PyObject_CallFunction(cls.ptr(), "s", what);
  if (!e) return;
  auto none = [] {
    Py_INCREF(Py_None);  // (Py_NewRef is Python 3.10 on)
    return Py_None;
  };
  PyObject* values[3] = {stream.empty() ? none() : PyUnicode_FromString(stream.c_str()),
                         row < 0 ? none() : PyLong_FromLongLong((long long)row),
                         limit.empty() ? none() : PyUnicode_FromString(limit.c_str())};
  const char* names[3] = {"stream", "row", "limit"};
  bool ok = true;
  for (int i = 0; i < 3; ++i) {
    ok = ok && values[i] && PyObject_SetAttrString(e, names[i], values[i]) == 0;
    Py_XDECREF(values[i]);
  }
  if (ok) PyErr_SetObject(cls.ptr(), e);
  else if (!PyErr_Occurred()) PyErr_NoMemory();
  Py_DECREF(e);
}

// The exceptions for refused inputs, both with the attributes stream
// ("features", "outputs", "labels", "targets" or None for the batch as a
// whole), row (the row where known, else None) and limit (the limit broken,
// common/types.hpp's input_error, or None): InputError (a ValueError) and
// DTypeError (a TypeError: an element type; row and limit None). _core
// defines them (`define`); _cuda takes _core's, so one class is caught
// whichever backend refused. Registered at import, with the translator that
// fills the attributes.
inline void register_input_errors(py::module_& m, bool define) {
  static py::handle input, dtype;
  if (define) {
    input = py::register_local_exception<input_error>(m, "InputError", PyExc_ValueError);
    dtype = py::register_local_exception<type_error>(m, "DTypeError", PyExc_TypeError);
    for (py::handle cls : {input, dtype}) {
      cls.attr("stream") = py::none();
      cls.attr("row") = py::none();
      cls.attr("limit") = py::none();
    }
    input.attr("__doc__") =
        "An input the core refuses (a ValueError): stream names the input it lies in ('features', 'outputs', "
        "'labels', 'targets'; None for the batch as a whole), row the row where known, limit the limit it "
        "breaks ('finite', 'overflow', 'underflow', 'num_classes', 'non-negative', 'class growth', 'int64'; "
        "None for a shape or a stream).";
  } else {
    const py::module_ core = py::module_::import("richness._core");
    input = py::object(core.attr("InputError")).release();  // held for the life of the process, as the translator is
    dtype = py::object(core.attr("DTypeError")).release();
    m.attr("InputError") = input;
    m.attr("DTypeError") = dtype;
  }
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const input_error& e) {
      raise_input_error(input, e.what(), e.stream, e.row, e.limit);
    } catch (const type_error& e) {
      raise_input_error(dtype, e.what(), e.stream, -1, "");
    }
  });
}

// A constructor's num_classes: -1 (the classes grow with the labels) or a
// count from 1 to 2**63 - 1. Anything else is refused by name and range
// rather than left to pybind11's "incompatible constructor arguments".
inline int64_t num_classes_of(const py::handle& v) {
  auto refuse = [&]() {
    throw std::invalid_argument("num_classes must be an integer from 1 to 2**63 - 1 (or None), got " +
                                py::repr(v).cast<std::string>());
  };
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) refuse();
  py::int_ i = py::reinterpret_steal<py::int_>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0 || (n < 1 && n != -1)) refuse();
  return (int64_t)n;
}

// Completes a new Python object around `obj` inside the constructor call,
// where pybind11 turns a std::bad_alloc into MemoryError. Left to pybind11,
// the instance would be registered after the constructor returned, outside
// its exception handling, and an allocation failure there (under a memory
// limit) would end the process. On failure obj is deleted here and the
// object holds nothing. Use with py::detail::is_new_style_constructor().
template <typename T>
void adopt(py::detail::value_and_holder& v_h, std::unique_ptr<T> obj) {
  v_h.value_ptr() = obj.get();
  try {
    v_h.type->init_instance(v_h.inst, &obj);  // registers the instance, then moves obj into its holder
  } catch (...) {
    v_h.value_ptr() = nullptr;
    throw;
  }
}

// pybind11's tp_new uses the memory tp_alloc returns without checking it, so
// a Python out of memory would crash there. This one allocates and frees an
// instance first: when that fails it returns with MemoryError set, and when it
// succeeds pybind11's own allocation reuses the block just freed.
inline PyObject* checked_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* probe = type->tp_alloc(type, 0);
  if (!probe) return nullptr;
  if (PyType_IS_GC(type)) PyObject_GC_UnTrack(probe);
  type->tp_free(probe);
  if (type->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(type);  // tp_alloc took a reference to a heap type
  return py::detail::pybind11_object_new(type, args, kwargs);
}

// Installs checked_new on a bound class (before any instance exists).
inline void check_allocation_in_new(const py::handle& cls) {
  reinterpret_cast<PyTypeObject*>(cls.ptr())->tp_new = checked_new;
}

inline Matrix to_matrix(const MatrixArg& a) {
  Matrix m;
  m.ptr = reinterpret_cast<const void*>(std::get<0>(a));
  m.rows = std::get<1>(a);
  m.cols = std::get<2>(a);
  m.ld = std::get<3>(a);
  m.dtype = dtype_of(std::get<4>(a));
  return m;
}

// A batch's matrices and the Batch that points at them (keep this object
// alive while the Batch is used).
struct BatchArgs {
  Matrix features, outputs, labels, targets;
  bool has_outputs = false, has_labels = false, has_targets = false;

  BatchArgs(const MatrixArg& x, const std::optional<MatrixArg>& o, const std::optional<MatrixArg>& y,
            const std::optional<MatrixArg>& t)
      : features(to_matrix(x)) {
    if (o) { outputs = to_matrix(*o); has_outputs = true; }
    if (y) { labels = to_matrix(*y); has_labels = true; }
    if (t) { targets = to_matrix(*t); has_targets = true; }
  }
  BatchArgs(const BatchArgs&) = delete;

  Batch batch() const {
    Batch b;
    b.features = features;
    b.outputs = has_outputs ? &outputs : nullptr;
    b.labels = has_labels ? &labels : nullptr;
    b.targets = has_targets ? &targets : nullptr;
    return b;
  }
};

// The named batch arguments every update-like binding takes.
#define RICHNESS_BATCH_ARGS                                                                     \
  py::arg("features"), py::arg("outputs") = py::none(), py::arg("labels") = py::none(),        \
      py::arg("targets") = py::none()

// Writes a row-major lower triangle as a full symmetric n x n array at `o`
// (o and l do not overlap), split over `workers` threads by area: each
// copies its rows' lower part as it lies, then mirrors them (mirror_lower).
inline void fill_symmetric(const double* __restrict l, int64_t n, double* __restrict o, int64_t workers = 1) {
  // (below about 1,500 x 1,500 a second thread costs more than it saves, measured at p = 512 and 1,024)
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, n * n / (int64_t(1) << 21) + 1));
  auto first_row = [&](int64_t w) {  // row i holds i + 1 entries: equal areas at sqrt(w / W)
    return std::min(n, (int64_t)std::llround((double)n * std::sqrt((double)w / (double)workers)));
  };
  run_split(workers, first_row, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) std::copy(l + i * n, l + i * n + i + 1, o + i * n);
    mirror_lower(o, n, r0, r1);
  });
}

// Copies a row-major lower triangle into a new full symmetric array.
inline py::array_t<double> symmetric(const std::vector<double>& lower, int64_t n) {
  py::array_t<double> out({n, n});
  fill_symmetric(lower.data(), n, out.mutable_data());
  return out;
}

template <typename T>
py::array_t<T> array_of(const std::vector<T>& v, int64_t rows, int64_t cols, bool vector) {
  py::array_t<T> out = vector ? py::array_t<T>(std::vector<int64_t>{cols})
                              : py::array_t<T>(std::vector<int64_t>{rows, cols});
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// One state array as numpy: symmetric matrices (kept as their lower triangle)
// filled, vectors 1-D.
inline py::object export_array(const std::vector<double>& v, int64_t rows, int64_t cols, bool sym, bool vec) {
  if (sym) return symmetric(v, rows);
  return array_of(v, rows, cols, vec);
}
inline py::object export_array(const std::vector<int64_t>& v, int64_t rows, int64_t cols, bool, bool vec) {
  return array_of(v, rows, cols, vec);
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

inline py::dict export_state(const State& s) {
  py::dict d = shape_of(s);
  d["n"] = s.n;
#define RICHNESS_EXPORT(name, type, rows, cols, sym) \
  d[#name] = export_array(s.name, s.size(rows), s.size(cols), sym, rows == Dim::one);
  RICHNESS_STATE_ARRAYS(RICHNESS_EXPORT)
#undef RICHNESS_EXPORT
  return d;
}

template <typename T>
std::pair<T*, int64_t> target_array(const py::dict& d, const char* key, const char* what = "export_into") {
  if (!d.contains(key)) throw std::invalid_argument(std::string(what) + ": no array for '" + key + "'");
  const py::object o = d[key];
  const bool ok = py::isinstance<py::array_t<T>>(o);
  const auto a = ok ? py::reinterpret_borrow<py::array>(o) : py::array();
  if (!ok || !(a.flags() & py::array::c_style) || !a.writeable())
    throw std::invalid_argument(std::string(what) + ": '" + key + "' must be a writable C-contiguous " +
                                (std::is_same<T, double>::value ? "float64" : "int64") + " array");
  return {static_cast<T*>(const_cast<void*>(a.data())), (int64_t)a.size()};
}
inline void fill_symmetric_of(const std::vector<double>& l, int64_t n, double* o, int64_t workers) {
  fill_symmetric(l.data(), n, o, workers);
}
inline void fill_symmetric_of(const std::vector<int64_t>&, int64_t, int64_t*, int64_t) {}

// The caller's arrays of a state (export_into writes one there, merge_into
// merges one into them): one writable, C-contiguous array a field, of the
// field's element type, read with the GIL held; their sizes are checked
// against the state under its lock.
inline StateArrays state_arrays(const py::dict& d, const char* what = "export_into") {
  StateArrays out;
#define RICHNESS_TARGET(name, type, rows, cols, sym) \
  std::tie(out.name, out.name##_size) = target_array<type>(d, #name, what);
  RICHNESS_STATE_ARRAYS(RICHNESS_TARGET)
#undef RICHNESS_TARGET
  return out;
}

// Throws, before anything is written, unless every array has the state's
// exported size; else writes the state there (symmetric matrices filled).
inline void export_state_into(const State& s, const StateArrays& out, int64_t workers) {
  if (const char* name = out.misfit(s)) {
    Msg os;
    os << "export_into: '" << name << "' does not have the state's size";
    throw std::invalid_argument(os.str());
  }
#define RICHNESS_TARGET(name, type, rows, cols, sym) \
  if (sym)                                           \
    fill_symmetric_of(s.name, s.size(rows), out.name, workers); \
  else                                               \
    std::copy(s.name.begin(), s.name.end(), out.name);
  RICHNESS_STATE_ARRAYS(RICHNESS_TARGET)
#undef RICHNESS_TARGET
}

template <typename T>
std::vector<T> take(const py::dict& d, const char* key, int64_t size) {
  auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(d[key]);
  if (!a) throw std::invalid_argument(std::string("state key '") + key + "' is not a numeric array");
  if (a.size() != size)
    throw std::invalid_argument(std::string("state key '") + key + "' has " + std::to_string(a.size()) +
                                " values, expected " + std::to_string(size));
  return std::vector<T>(a.data(), a.data() + a.size());
}

// The state's arrays as RICHNESS_STATE_ARRAYS lists them: (name, numpy
// element type, axes by width name, symmetric).
inline py::list state_field_table() {
  auto axis = [](Dim d) { return d == Dim::p ? "p" : d == Dim::c ? "c" : d == Dim::t ? "t" : d == Dim::k ? "k" : ""; };
  py::list out;
#define RICHNESS_FIELD(name, type, rows, cols, sym)                                                   \
  {                                                                                                   \
    py::list axes;                                                                                    \
    if (rows != Dim::one) axes.append(axis(rows));                                                    \
    axes.append(axis(cols));                                                                          \
    out.append(py::make_tuple(#name, std::is_same<type, double>::value ? "float64" : "int64",        \
                              py::tuple(axes), sym));                                                 \
  }
  RICHNESS_STATE_ARRAYS(RICHNESS_FIELD)
#undef RICHNESS_FIELD
  return out;
}

// The widths of a dict with the keys p, c, t, k, num_classes (and n, where
// `with_n`; else n is 0).
inline Widths widths_of(const py::dict& d, bool with_n = true) {
  return Widths{with_n ? d["n"].cast<int64_t>() : 0, d["p"].cast<int64_t>(), d["c"].cast<int64_t>(),
                d["t"].cast<int64_t>(), d["k"].cast<int64_t>(), d["num_classes"].cast<int64_t>()};
}

// A state dict's scalars (n, widths, num_classes, precision) into s (a State or StateArrays).
template <typename S>
void import_scalars(const py::dict& d, S& s) {
  s.n = d["n"].cast<int64_t>();
  s.p = d["p"].cast<int64_t>();
  s.c = d["c"].cast<int64_t>();
  s.t = d["t"].cast<int64_t>();
  s.k = d["k"].cast<int64_t>();
  s.num_classes = d["num_classes"].cast<int64_t>();
  s.precision = precision_of(d["precision"].cast<std::string>());
}

// A state dict as a State (each array of the size its widths give; its
// consistency is Moments::set_state's to check).
inline State import_state(const py::dict& d) {
  State s;
  import_scalars(d, s);
  // Symmetric matrices arrive full; the lower half is what is read.
#define RICHNESS_IMPORT(name, type, rows, cols, sym) s.name = take<type>(d, #name, s.size(rows) * s.size(cols));
  RICHNESS_STATE_ARRAYS(RICHNESS_IMPORT)
#undef RICHNESS_IMPORT
  return s;  // Moments::set_state checks it (State::check_consistent)
}

}  // namespace pystate
}  // namespace richness
