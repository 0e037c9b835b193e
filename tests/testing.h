// Helpers the test suites share.
//
//   CHECK(contains(error_of([&] { matmul(a, b); }), "matmul: shapes [2, 3] and [4, 5]"));
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tensor/op.h"

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

// Counts the kernel calls of `ops` (every op when empty) while it lives. The kernel observer
// is process-wide: one counter at a time, the previous observer restored after it.
//
//   { const KernelCalls casts({OpId::cast}); f(); CHECK(casts.count() == 3); }
class KernelCalls {
 public:
  explicit KernelCalls(std::vector<OpId> ops = {}) : previous_(kernel_observer()) {
    ops_() = std::move(ops);
    count_() = 0;
    set_kernel_observer(&observe);
  }
  ~KernelCalls() { set_kernel_observer(previous_); }
  KernelCalls(const KernelCalls&) = delete;
  KernelCalls& operator=(const KernelCalls&) = delete;
  int count() const { return count_(); }

 private:
  static std::vector<OpId>& ops_() {
    static std::vector<OpId> ops;
    return ops;
  }
  static int& count_() {
    static int count = 0;
    return count;
  }
  static void observe(OpId op, Device, bool begin, std::span<const Tensor>) {
    const std::vector<OpId>& ops = ops_();
    if (begin && (ops.empty() || std::find(ops.begin(), ops.end(), op) != ops.end())) ++count_();
  }
  KernelObserver previous_;
};

}  // namespace tessera::testing
