// What the example programs share to fail cleanly (models/common/run_control.h, flags.h):
// signals recorded for a clean stop, run_main's one-line errors and exit codes, output-file
// checks, sizes, the memory budget check, fault-injection parsing, and flags that are never
// clamped or truncated.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>

#include "models/common/fault.h"
#include "models/common/flags.h"
#include "models/common/run_control.h"
#include "tests/testing.h"

namespace tessera::models {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

std::string temp_dir() { return testing::temp_dir("run_control_test"); }

// Runs f in a child process with stderr captured; returns (exit status, stderr).
std::pair<int, std::string> in_child(const std::function<int()>& f) {
  const std::string err = temp_dir() + "/child_stderr.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    if (freopen(err.c_str(), "w", stderr) == nullptr) _exit(99);
    std::fflush(stderr);
    const int code = f();
    std::fflush(stderr);
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(err);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status), text};
}

TEST_CASE("a SIGTERM or SIGINT is recorded while StopSignals lives; a second one acts") {
  CHECK(stop_signal() == 0);
  {
    StopSignals outer;
    {
      StopSignals inner;  // nests: the handlers stay until the outermost goes
      CHECK(stop_signal() == 0);
    }
    raise(SIGTERM);
    CHECK(stop_signal() == SIGTERM);
    raise(SIGINT);  // the first signal is the one reported
    CHECK(stop_signal() == SIGTERM);
  }
  CHECK(std::string(signal_name(SIGTERM)) == "SIGTERM");
  CHECK(std::string(signal_name(SIGINT)) == "SIGINT");
  // A second SIGTERM (SA_RESETHAND) and one after the scope end get the default action.
  auto [status, text] = in_child([] {
    StopSignals s;
    raise(SIGTERM);
    if (stop_signal() != SIGTERM) return 3;
    raise(SIGTERM);
    return 4;  // not reached
  });
  CHECK(status == 1000 + SIGTERM);
}

TEST_CASE("run_main: one error line and exit code 1 for every kind of failure") {
  auto run = [](std::function<void()> body) { return in_child([&] { return run_main(body); }); };
  auto [ok, ok_text] = run([] {});
  CHECK(ok == 0);
  CHECK(ok_text.empty());
  auto [e1, t1] = run([] { fail("gpt: --pp must be >= 1, got 0"); });
  CHECK(e1 == 1);
  CHECK(t1 == "error: gpt: --pp must be >= 1, got 0\n");
  auto [e2, t2] = run([] { throw std::bad_alloc(); });
  CHECK(e2 == 1);
  CHECK(t2.find("error: out of memory (std::bad_alloc)") == 0);
  auto [e3, t3] = run([] {
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                            "thread");
  });
  CHECK(e3 == 1);
  CHECK(t3.find("error: system error: thread") == 0);
  auto [e4, t4] = run([] { throw std::length_error("vector::_M_default_append"); });
  CHECK(e4 == 1);
  CHECK(t4 == "error: unexpected exception: vector::_M_default_append\n");
  auto [e5, t5] = run([] { throw StopRequested(SIGTERM, "gpt: stopped by SIGTERM"); });
  CHECK(e5 == 128 + SIGTERM);
  CHECK(t5 == "gpt: stopped by SIGTERM\n");
}

TEST_CASE("check_output_file: a writable file path, checked without leaving a file") {
  const std::string dir = temp_dir();
  CHECK(error_of([&] { check_output_file(dir, "gpt: --metrics"); })
            .find("gpt: --metrics=" + dir + " is a directory") != std::string::npos);
  CHECK(error_of([&] { check_output_file(dir + "/nope/m.jsonl", "--metrics"); })
            .find("directory '" + dir + "/nope' does not exist") != std::string::npos);
  CHECK(error_of([&] { check_output_file("", "--metrics"); }).find("empty") !=
        std::string::npos);
  const std::string fresh = dir + "/fresh.jsonl";
  fs::remove(fresh);
  check_output_file(fresh, "--metrics");
  CHECK_FALSE(fs::exists(fresh));
  std::ofstream(dir + "/kept.jsonl") << "{\"step\": 1}\n";
  check_output_file(dir + "/kept.jsonl", "--metrics");  // appending keeps what is there
  std::ifstream in(dir + "/kept.jsonl");
  std::string line;
  std::getline(in, line);
  CHECK(line == "{\"step\": 1}");
}

TEST_CASE("parse_bytes and format_bytes") {
  CHECK(parse_bytes("0", "--memory_limit") == 0);
  CHECK(parse_bytes("1048576", "--memory_limit") == 1048576);
  CHECK(parse_bytes("512M", "--memory_limit") == int64_t{512} << 20);
  CHECK(parse_bytes("8G", "--memory_limit") == int64_t{8} << 30);
  CHECK(parse_bytes("8GiB", "--memory_limit") == int64_t{8} << 30);
  CHECK(parse_bytes("1.5k", "--memory_limit") == 1536);
  CHECK(parse_bytes("2T", "--memory_limit") == int64_t{2} << 40);
  for (const char* bad : {"", "-1", "8X", "G", "nan", "inf", "1e30", "8 G"}) {
    CHECK_MESSAGE(error_of([&] { parse_bytes(bad, "gpt: --memory_limit"); })
                          .find("gpt: --memory_limit: expected a size") != std::string::npos,
                  bad);
  }
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(3.0 * (int64_t{1} << 30)) == "3.0 GiB");
}

TEST_CASE("check_memory_budget refuses a prediction above the limit, naming both") {
  check_memory_budget("gpt", 1000, "all of it", 2000, "advice");  // fits
  const std::string msg = error_of(
      [] { check_memory_budget("gpt", 3.0 * (1 << 30), "activations", 1 << 30, "lower it"); });
  CHECK(msg == "gpt: this run needs about 3.0 GiB (activations), more than the --memory_limit "
               "of 1.0 GiB; lower it");
  // Without a limit, the machine's available memory decides (it is surely below 1 EiB).
  CHECK(available_memory_bytes() > 0);
  CHECK(error_of([] { check_memory_budget("mnist", 1e18, "x", 0, "y"); })
            .find("more than the memory this machine has available") != std::string::npos);
}

TEST_CASE("flags: out-of-range integers and numbers are errors, never clamped") {
  struct Config {
    int64_t steps = 1;
    int threads = 0;
    uint8_t small = 0;
    double lr = 0.1;
  } c;
  auto parse = [&](std::vector<std::string> args) {
    Flags f("prog", "test");
    f.bind("steps", c.steps, "");
    f.bind("threads", c.threads, "");
    f.bind("small", c.small, "");
    f.bind("lr", c.lr, "");
    std::vector<char*> argv = {const_cast<char*>("prog")};
    for (std::string& a : args) argv.push_back(a.data());
    f.parse(static_cast<int>(argv.size()), argv.data());
  };
  parse({"--steps=9223372036854775807", "--threads=-4", "--small=255", "--lr=1e-300"});
  CHECK(c.steps == INT64_MAX);
  CHECK(c.threads == -4);  // the range of a value is the program's to check; the type's is ours
  CHECK(c.small == 255);
  CHECK(error_of([&] { parse({"--steps=9223372036854775808"}); })
            .find("prog: --steps=9223372036854775808 is out of range") != std::string::npos);
  CHECK(error_of([&] { parse({"--steps=-99999999999999999999"}); }).find("out of range") !=
        std::string::npos);
  CHECK(error_of([&] { parse({"--threads=4294967297"}); })
            .find("prog: --threads=4294967297 is out of range [-2147483648, 2147483647]") !=
        std::string::npos);
  CHECK(error_of([&] { parse({"--small=-1"}); }).find("--small=-1 is out of range [0, 255]") !=
        std::string::npos);
  CHECK(error_of([&] { parse({"--lr=1e999"}); }).find("--lr=1e999 is out of range") !=
        std::string::npos);
  CHECK(error_of([&] { parse({"--lr=1e-999"}); }).find("too small to represent") !=
        std::string::npos);
  CHECK(error_of([&] { parse({"--steps=2^62"}); }).find("expects an integer, got '2^62'") !=
        std::string::npos);
}

TEST_CASE("TESSERA_FAULT: unset does nothing; a malformed one is an Error naming it") {
  // fault_point() reads TESSERA_FAULT once per process: the children set it before their
  // first call, and this process calls it only after forking them.
  auto [status, text] = in_child([] {
    setenv("TESSERA_FAULT", "train.step:explode", 1);
    try {
      fault_point("train.step");
    } catch (const Error& e) {
      std::fprintf(stderr, "%s", e.what());
      return 0;
    }
    return 5;
  });
  CHECK(status == 0);
  CHECK(text.find("TESSERA_FAULT='train.step:explode' is not") == 0);
  auto [killed, killed_text] = in_child([] {
    setenv("TESSERA_FAULT", "p:kill:2:1", 1);
    fault_point("p", 0);  // another rank
    fault_point("q", 1);  // another point
    fault_point("p", 1);  // the first hit
    fault_point("p", 1);  // the second: dies here
    return 6;
  });
  CHECK(killed == 1000 + SIGKILL);
  CHECK(killed_text.find("fault injection: kill at p (hit 2, rank 1)") != std::string::npos);
  fault_point("anything", 3);  // TESSERA_FAULT is unset in this test's own process
}

}  // namespace
}  // namespace tessera::models
