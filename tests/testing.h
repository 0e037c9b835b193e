// Helpers the test suites share.
//
//   CHECK(contains(error_of([&] { matmul(a, b); }), "matmul: shapes [2, 3] and [4, 5]"));
#pragma once

#include <cstdlib>
#include <filesystem>
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

// A directory for the test's files: Bazel's TEST_TMPDIR (else the system's temporary
// directory), or a `sub`directory of it, created when missing.
inline std::string temp_dir(const std::string& sub = "") {
  const char* t = std::getenv("TEST_TMPDIR");
  std::string dir = t != nullptr ? t : std::filesystem::temp_directory_path().string();
  if (!sub.empty()) {
    dir += "/" + sub;
    std::filesystem::create_directories(dir);
  }
  return dir;
}

}  // namespace tessera::testing
