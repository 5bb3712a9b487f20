// Error messages built by hand rather than through std::ostream: formatting
// numbers through an ostream's locale facets (num_put) is not safe when
// another library in the process (torch's CUDA build, say) brings its own C++
// runtime state; std::to_string and snprintf do not use those facets.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace richness {

// A number in scientific notation with 3 significant digits (3.1e+17), for
// magnitudes that std::to_string would print as hundreds of digits.
struct Sci {
  double v;
};

struct Msg {
  Msg& operator<<(Sci v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", v.v);  // C formatting: no locale facets
    s += buf;
    return *this;
  }
  std::string s;
  Msg& operator<<(const char* v) {
    s += v;
    return *this;
  }
  Msg& operator<<(const std::string& v) {
    s += v;
    return *this;
  }
  Msg& operator<<(char v) {
    s += v;
    return *this;
  }
  template <typename T, typename = typename std::enable_if<std::is_arithmetic<T>::value>::type>
  Msg& operator<<(T v) {
    s += std::to_string(v);
    return *this;
  }
  std::string str() const { return s; }
};

}  // namespace richness
