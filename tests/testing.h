// Helpers the test suites share.
//
//   CHECK(contains(error_of([&] { matmul(a, b); }), "matmul: shapes [2, 3] and [4, 5]"));
#pragma once

#include <string>

#include "tensor/error.h"

namespace tessera::testing {

// The message of the tessera::Error `f` throws ("" if it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace tessera::testing
