// What a test binary needs from the machine it runs on, checked by the shared main
// (tests/main.cc) before any test case runs: a requirement returns "" when met, else why
// not, and the binary then fails with that reason rather than running (or, for a suite
// whose cases compiled away, rather than passing empty). //tests:gpu_suite registers one
// for every GPU-tagged suite.
//
//   static const bool registered = tessera::testing::add_suite_requirement(
//       "a CUDA device", [] { return std::string(have_device() ? "" : "none is visible"); });
#pragma once

#include <string>

namespace tessera::testing {

using SuiteRequirement = std::string (*)();

// Registers `check` (call it from a static initialiser); returns true.
bool add_suite_requirement(const char* what, SuiteRequirement check);

}  // namespace tessera::testing
