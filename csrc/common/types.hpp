// What a batch is made of, as the core sees it: element types, row-major
// matrix views, and the checks every backend runs on a batch
// before reading its data. Framework-agnostic: raw pointers, shapes, row
// strides and dtypes; python/richness/_engine/adapt.py adapts numpy, torch and DLPack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "msg.hpp"

namespace richness {

// Element types a batch may come in (their names are numpy's, as the
// bindings pass them).
#define RICHNESS_DTYPES(X) X(f32, float32) X(f64, float64) X(f16, float16) X(bf16, bfloat16) X(i32, int32) X(i64, int64)

enum class DType : int {
#define RICHNESS_ENUM(code, name) code,
  RICHNESS_DTYPES(RICHNESS_ENUM)
#undef RICHNESS_ENUM
};

inline const char* dtype_name(DType d) {
  switch (d) {
#define RICHNESS_NAME(code, name) \
  case DType::code:               \
    return #name;
    RICHNESS_DTYPES(RICHNESS_NAME)
#undef RICHNESS_NAME
  }
  return "unknown";
}

constexpr size_t dtype_size(DType d) {
  return d == DType::f64 || d == DType::i64 ? 8 : d == DType::f32 || d == DType::i32 ? 4 : 2;
}

// A row-major matrix view: element (i, j) lives at ptr[i * ld + j].
// A vector (labels) is a Matrix with cols == 1 and ld its element stride.
struct Matrix {
  const void* ptr = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  DType dtype = DType::f32;
};

// An input the core refuses, with where it lies: the stream ("features",
// "outputs", "labels", "targets"; empty for the batch as a whole), the row
// where one is known (-1 otherwise) and the limit it breaks ("finite",
// "overflow" and "underflow" of the values or their products, "num_classes",
// "non-negative" and "class growth" of the labels, "int64" of the sample
// count; empty for a shape, a stream or a dtype). what() is the whole message. Bindings raise
// richness._core.InputError (a ValueError) with stream, row and limit as
// attributes (None where empty), so callers attribute an error without
// reading its text (the command line names the file of the stream).
struct input_error : std::invalid_argument {
  std::string stream, limit;
  int64_t row = -1;
  input_error(const std::string& what, std::string stream_, int64_t row_ = -1, std::string limit_ = "")
      : std::invalid_argument(what), stream(std::move(stream_)), limit(std::move(limit_)), row(row_) {}
};

// Raised for inputs of the wrong element type, naming the stream; bindings
// map it to TypeError (richness._core.DTypeError, with a stream attribute).
struct type_error : std::invalid_argument {
  std::string stream;
  explicit type_error(const std::string& what, std::string stream_ = "")
      : std::invalid_argument(what), stream(std::move(stream_)) {}
};

// One batch as the CPU backend sees it.
struct Batch {
  Matrix features;
  const Matrix* outputs = nullptr;
  const Matrix* labels = nullptr;
  const Matrix* targets = nullptr;
};

inline bool is_float(DType d) {
  return d == DType::f32 || d == DType::f64 || d == DType::f16 || d == DType::bf16;
}

inline void check_float_shape(const Matrix& m, const char* name, int64_t rows, int64_t width) {
  if (!is_float(m.dtype)) {
    Msg os;
    os << name << " must be float32, float64, float16 or bfloat16, got " << dtype_name(m.dtype);
    throw type_error(os.str(), name);
  }
  if (m.cols < 1) {
    Msg os;
    os << name << " must have at least one column, got shape (" << m.rows << ", " << m.cols << ")";
    throw input_error(os.str(), name);
  }
  if (m.rows != rows) {
    Msg os;
    os << name << " has " << m.rows << " rows but features have " << rows;
    throw input_error(os.str(), name);
  }
  if (width >= 0 && m.cols != width) {
    Msg os;
    os << name << " have " << m.cols << " columns but earlier updates had " << width;
    throw input_error(os.str(), name);
  }
  if (m.rows > 1 && m.ld < m.cols) {
    Msg os;
    os << name << ": row stride " << m.ld << " is smaller than the width " << m.cols;
    throw input_error(os.str(), name);
  }
  if (m.rows > 0 && m.ptr == nullptr) throw input_error(std::string(name) + ": null pointer", name);
}

// Widths of a state (-1: not streamed, or num_classes not fixed): what a batch
// is checked against and what merge compatibility is decided on.
struct Widths {
  int64_t n, p, c, t, k, num_classes;
};

// Validates a batch's shapes, widths, dtypes and streams against a state's
// widths, reading no data, so the device backend uses it without a sync.
// Throws with a message naming the offending input. Values (finiteness, label
// range) are each backend's to check before anything is merged.
inline void validate_batch(const Widths& s, const Batch& b) {
  const Matrix& x = b.features;
  if (!is_float(x.dtype)) {
    Msg os;
    os << "features must be float32, float64, float16 or bfloat16, got " << dtype_name(x.dtype);
    throw type_error(os.str(), "features");
  }
  if (x.rows < 0) throw input_error("features: negative row count", "features");
  const bool started = s.p >= 0;
  if (started) {
    auto stream = [](bool had, bool has, const char* name) {
      if (had && !has)
        throw input_error(std::string("this Moments streamed ") + name + " before; pass " + name +
                              "= on every update",
                          name);
      if (!had && has)
        throw input_error(std::string("this Moments was started without ") + name +
                              "; a stream cannot be added later (use a new Moments)",
                          name);
    };
    stream(s.c >= 0, b.outputs != nullptr, "outputs");
    stream(s.t >= 0, b.targets != nullptr, "targets");
    stream(s.k >= 0, b.labels != nullptr, "labels");
  }
  check_float_shape(x, "features", x.rows, started ? s.p : -1);
  if (b.outputs) check_float_shape(*b.outputs, "outputs", x.rows, started ? s.c : -1);
  if (b.targets) check_float_shape(*b.targets, "targets", x.rows, started ? s.t : -1);
  if (b.labels) {
    const Matrix& y = *b.labels;
    if (y.dtype != DType::i32 && y.dtype != DType::i64) {
      Msg os;
      os << "labels must be integers (int32 or int64), got " << dtype_name(y.dtype);
      throw type_error(os.str(), "labels");
    }
    if (y.rows != x.rows) {
      Msg os;
      os << "labels has " << y.rows << " rows but features have " << x.rows;
      throw input_error(os.str(), "labels");
    }
    if (y.rows > 0 && y.ptr == nullptr) throw input_error("labels: null pointer", "labels");
  }
}


}  // namespace richness
