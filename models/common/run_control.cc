#include "models/common/run_control.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <new>
#include <system_error>

#include "parallel/comm/mpi.h"
#include "tensor/allocator.h"

namespace tessera::models {
namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

volatile sig_atomic_t g_signal = 0;

extern "C" void record_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
}

std::mutex g_mu;
int g_depth = 0;  // guarded by g_mu
struct sigaction g_old_term, g_old_int;

}  // namespace

StopSignals::StopSignals() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_depth++ > 0) return;
  g_signal = 0;
  struct sigaction sa = {};
  sa.sa_handler = record_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_RESTART;  // the second signal acts as it always does
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

StopSignals::~StopSignals() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (--g_depth > 0) return;
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

int stop_signal() { return g_signal; }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "a signal";
  }
}

StopRequested stop_requested(const std::string& program, int sig, int64_t step, int64_t of,
                             const std::string& saved, const std::string& why_not) {
  const std::string head =
      fmt::format("{}: stopped by {} after step {} of {}", program, signal_name(sig), step, of);
  if (saved.empty()) {
    return StopRequested(sig, fmt::format("{}; {}, so this run's steps are not kept", head,
                                          why_not));
  }
  return StopRequested(sig, fmt::format("{}; saved {} (continue with --resume={})", head, saved,
                                        saved));
}

int run_main(const std::function<void()>& body) {
  std::string message;
  int code = 1;
  try {
    body();
    return 0;
  } catch (const StopRequested& e) {
    // Every rank agreed to stop at the same step and saved together: a clean exit.
    std::fprintf(stderr, "%s\n", e.what());
    return 128 + e.signal();
  } catch (const Error& e) {
    message = e.what();
  } catch (const std::bad_alloc&) {
    message = "out of memory (std::bad_alloc); lower the batch or the model size, or set "
              "--memory_limit to be told up front";
  } catch (const std::system_error& e) {
    message = fmt::format("system error: {}", e.what());
  } catch (const std::exception& e) {
    message = fmt::format("unexpected exception: {}", e.what());
  }
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  parallel::mpi_abort_if_running(code, message);
  return code;
}

void check_output_file(const std::string& path, const std::string& flag) {
  TS_CHECK(!path.empty(), "{}: the path is empty", flag);
  struct stat st;
  const bool existed = ::stat(path.c_str(), &st) == 0;
  TS_CHECK(!existed || !S_ISDIR(st.st_mode), "{}={} is a directory; give a file path", flag,
           path);
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat dst;
  if (::stat(dir.c_str(), &dst) != 0 || !S_ISDIR(dst.st_mode)) {
    fail("{}={}: directory '{}' does not exist", flag, path, dir);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}={}: cannot open it for writing: {}", flag, path, errno_text(errno));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());  // the run creates it; a failed check leaves nothing
}

int64_t parse_bytes(const std::string& text, const std::string& flag) {
  const char* s = text.c_str();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s, &end);
  std::string unit(end);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() == 2 && unit[1] == 'i') unit.pop_back();
  double scale = 1;
  if (unit == "K" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (!unit.empty()) scale = -1;
  const double bytes = v * scale;
  TS_CHECK(end != s && errno == 0 && scale > 0 && std::isfinite(bytes) && bytes >= 0 &&
               bytes < 9.2e18,
           "{}: expected a size such as 512M, 8G or 1073741824 (bytes), got '{}'", flag, text);
  return static_cast<int64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // reported in kB
  }
  return 0;
}

MemoryLimitScope::MemoryLimitScope(int64_t bytes) : previous_(allocator_for(kCPU).limit()) {
  if (bytes > 0) allocator_for(kCPU).set_limit(bytes);
}

MemoryLimitScope::~MemoryLimitScope() { allocator_for(kCPU).set_limit(previous_); }

void check_memory_budget(const std::string& program, double predicted_bytes,
                         const std::string& breakdown, int64_t limit, const std::string& advice) {
  const int64_t budget = limit > 0 ? limit : available_memory_bytes();
  if (budget <= 0 || predicted_bytes <= static_cast<double>(budget)) return;
  fail("{}: this run needs about {} ({}), more than {} {}; {}", program,
       format_bytes(predicted_bytes), breakdown,
       limit > 0 ? "the --memory_limit of" : "the memory this machine has available,",
       format_bytes(static_cast<double>(budget)), advice);
}

}  // namespace tessera::models
