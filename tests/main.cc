// The one doctest main for every suite (tools/build_defs/tessera.bzl links it into each
// ts_cc_test). Beyond doctest's own main it fails a run in which no test case executed: a
// suite whose cases all compiled away (a GPU suite built without --config=cuda) or a filter
// that matches nothing would otherwise report success having checked nothing. A suite may
// also state what it needs from the machine (tests/suite_requirements.h, e.g. the GPU
// suites through //tests:gpu_suite): checked before any test case runs, a requirement not
// met fails the binary with its reason. Queries (--help, --list-test-cases, --count, ...)
// run no test case and are left alone.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "tests/suite_requirements.h"

namespace tessera::testing {
namespace {

std::vector<std::pair<std::string, SuiteRequirement>>& requirements() {
  static std::vector<std::pair<std::string, SuiteRequirement>> r;  // filled at static init
  return r;
}

bool g_run_started = false;  // a real run, not a query
int g_cases_started = 0;

// Counts the test cases that actually start (doctest's own "passing filters" count also
// includes cases outside --first/--last).
struct CaseCounter : doctest::IReporter {
  explicit CaseCounter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override { g_run_started = true; }
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override { ++g_cases_started; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("tessera_case_counter", 1, CaseCounter);

}  // namespace

bool add_suite_requirement(const char* what, SuiteRequirement check) {
  requirements().emplace_back(what, check);
  return true;
}

}  // namespace tessera::testing

int main(int argc, char** argv) {
  using namespace tessera::testing;
  doctest::Context context(argc, argv);
  if (!context.shouldExit()) {
    for (const auto& [what, check] : requirements()) {
      const std::string why_not = check();
      if (!why_not.empty()) {
        std::fprintf(stderr, "FAILED: %s needs %s: %s\n", argv[0], what.c_str(), why_not.c_str());
        return 1;
      }
    }
  }
  const int result = context.run();
  if (context.shouldExit() || !g_run_started) return result;  // a query: nothing to count
  if (g_cases_started == 0) {
    std::fprintf(stderr,
                 "FAILED: %s ran no test case (none was compiled in, or none matched the "
                 "filters); a suite that checks nothing must not pass\n",
                 argv[0]);
    return 1;
  }
  return result;
}
