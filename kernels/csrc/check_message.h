// Argument checks of the torch bindings whose messages never pass through a C++ stream.
//
// TORCH_CHECK(cond, "x ", 3) formats its parts with c10::str, an std::ostringstream
// compiled into the extension.  Where torch's build links libstdc++ into the extension
// (seen with torch 2.11.0+cu130 and g++ 13.3: no NEEDED libstdc++, the stream facets
// defined in the library), streaming an integer there crashed the process (SIGSEGV in
// std::ostream::_M_insert<long>) instead of raising.  require() concatenates the parts
// with std::to_string and string appends, and hands TORCH_CHECK one finished string,
// which c10::str passes through without a stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace kvserve::check {

inline void append(std::string& message, const char* part) { message += part; }
inline void append(std::string& message, const std::string& part) { message += part; }
inline void append(std::string& message, at::ScalarType part) { message += c10::toString(part); }
inline void append(std::string& message, const at::Device& part) { message += part.str(); }
inline void append(std::string& message, at::IntArrayRef part) {
  message += '[';
  for (size_t i = 0; i < part.size(); ++i) {
    if (i > 0) message += ", ";
    message += std::to_string(part[i]);
  }
  message += ']';
}
template <typename Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
void append(std::string& message, Int part) {
  message += std::to_string(part);
}

// Raise c10::Error (RuntimeError in Python) with the parts concatenated.
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string message;
  (append(message, parts), ...);
  TORCH_CHECK(false, message);
  __builtin_unreachable();
}

// fail(parts...) unless condition holds.  The parts are evaluated either way: keep them
// cheap (numbers, sizes, literals).
template <typename... Parts>
void require(bool condition, const Parts&... parts) {
  if (!condition) fail(parts...);
}

}  // namespace kvserve::check
