// tessera::Error: the one exception type for bad user input (shapes, dtypes, devices, files).
//
//   TS_CHECK(a.dim() == 2, "matmul: expected a 2-D tensor, got shape {}", a.shape());
//   throw Error(fmt::format("cat: tensors must share dtype, got {} and {}", x, y));
//
// Messages name the op and the values involved. assert() is for Tessera's own invariants.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Formats a message and throws Error. Marked cold so callers' fast paths stay tight.
template <typename... Args>
[[noreturn]] [[gnu::cold]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace tessera

#define TS_CHECK(cond, ...)                   \
  do {                                        \
    if (!(cond)) [[unlikely]] {               \
      ::tessera::fail(__VA_ARGS__);           \
    }                                         \
  } while (0)
