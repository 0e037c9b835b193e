// What the example programs' training loops share to fail cleanly and stop when asked
// (docs/RELIABILITY.md): SIGTERM/SIGINT noted and honoured after the current step, output
// paths checked before any work, a memory budget, and the one wrapper around main().
//
//   int main(int argc, char** argv) {
//     return run_main("gpt", [&] { ... parse flags, train ... });   // errors: one line, exit 1
//   }
//   StopSignals signals;                        // in the loop's owner
//   if (int sig = stop_signal()) throw StopRequested(sig, "gpt: stopped by SIGTERM ...");
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "tensor/error.h"

namespace tessera::models {

// While one lives, the first SIGTERM or SIGINT is only recorded (a second one kills the
// process as usual: SA_RESETHAND), so the loop can finish its step, save and exit. Nests.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
};

// The signal recorded since the outermost StopSignals was installed, or 0.
int stop_signal();
const char* signal_name(int sig);  // "SIGTERM", "SIGINT"

// Thrown by a loop that stopped on a signal (after saving what it was asked to save):
// run_main() prints it and exits with 128 + the signal, as a shell reports a killed job.
class StopRequested : public Error {
 public:
  StopRequested(int sig, const std::string& message) : Error(message), signal_(sig) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

// The StopRequested a training loop throws after step `step` of `of`, saying what was kept:
// "gpt: stopped by SIGTERM after step 7 of 20; saved run/c.safetensors (continue with
// --resume=run/c.safetensors)", or that nothing was when `saved` is empty (`why_not` says
// why, e.g. "no --save was given").
StopRequested stop_requested(const std::string& program, int sig, int64_t step, int64_t of,
                             const std::string& saved, const std::string& why_not);

// Runs a program's body. Every failure (tessera::Error, std::bad_alloc, std::system_error,
// any std::exception) becomes one "error: ..." line on stderr and exit code 1 (a
// StopRequested: 128 + its signal). Under mpirun with more than one process an error also
// brings the whole job down (MPI_Abort) instead of leaving the other ranks waiting in a
// collective for this one.
int run_main(const std::function<void()>& body);

// Checks up front that `path` can be written as a whole new or appended file (metrics):
// not a directory, its directory exists, and the file can be opened for writing.
// `flag` names it in the Error ("gpt: --metrics").
void check_output_file(const std::string& path, const std::string& flag);

// "512M", "8G", "1.5T", "1048576" (bytes; K/M/G/T are powers of 1024, an optional trailing
// "B" or "iB" is accepted); Error naming `flag` otherwise. 0 means no limit.
int64_t parse_bytes(const std::string& text, const std::string& flag);
// "1.5 GiB", "12.0 MiB", "512 B".
std::string format_bytes(double bytes);
// MemAvailable from /proc/meminfo (what the kernel can hand out without swapping), or 0
// when unknown.
int64_t available_memory_bytes();

// Caps the CPU allocator (tensor/allocator.h's budget) at `bytes` for its lifetime when
// positive, restoring the previous cap after: --memory_limit.
class MemoryLimitScope {
 public:
  explicit MemoryLimitScope(int64_t bytes);
  ~MemoryLimitScope();
  MemoryLimitScope(const MemoryLimitScope&) = delete;
  MemoryLimitScope& operator=(const MemoryLimitScope&) = delete;

 private:
  int64_t previous_;
};

// Refuses a run whose predicted memory exceeds the budget: `limit` (--memory_limit) when
// positive, else the machine's available memory. `breakdown` says what the prediction is
// made of and `advice` what to change. Error naming `program`.
void check_memory_budget(const std::string& program, double predicted_bytes,
                         const std::string& breakdown, int64_t limit, const std::string& advice);

}  // namespace tessera::models
