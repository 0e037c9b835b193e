#include "parallel/comm/mpi_watchdog.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "parallel/comm/mpi.h"
#include "tensor/error.h"

namespace tessera::parallel {
namespace {

struct Watchdog {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::pair<std::string, std::chrono::steady_clock::time_point>> waits;
  uint64_t next_id = 0;
  bool started = false;
  double timeout_seconds = 600;
};

Watchdog& watchdog() {
  static Watchdog* w = [] {
    auto* dog = new Watchdog;  // never destroyed: its thread outlives static destruction
    if (const char* env = std::getenv("TESSERA_COMM_TIMEOUT")) {
      char* end = nullptr;
      const double v = std::strtod(env, &end);
      if (end != env && *end == '\0' && v >= 0 && std::isfinite(v)) {
        dog->timeout_seconds = v;
      } else {
        std::fprintf(stderr, "tessera: ignoring TESSERA_COMM_TIMEOUT='%s' (expected seconds "
                     ">= 0; 0 turns the watchdog off)\n", env);
      }
    }
    return dog;
  }();
  return *w;
}

[[noreturn]] void watchdog_abort(const std::string& what, double waited, double timeout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::fprintf(stderr,
               "error: tessera watchdog: rank %d of %d: %s has not completed after %.0f s (the "
               "limit is %g s, TESSERA_COMM_TIMEOUT or --comm_timeout): a peer rank is stalled, "
               "stopped or dead; aborting the job\n",
               rank, size, what.c_str(), waited, timeout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort does not return; in case it does
}

void watchdog_loop() {
  Watchdog& w = watchdog();
  std::unique_lock<std::mutex> lock(w.mu);
  for (;;) {
    const double timeout = w.timeout_seconds;
    const auto now = std::chrono::steady_clock::now();
    if (timeout > 0) {
      for (const auto& [id, wait] : w.waits) {
        const double waited = std::chrono::duration<double>(now - wait.second).count();
        if (waited > timeout) {
          const std::string what = wait.first;
          lock.unlock();
          watchdog_abort(what, waited, timeout);
        }
      }
    }
    // Polls at a quarter of the timeout (at most 1 s): a stall is seen within 1.25 x it.
    const double poll = timeout > 0 ? std::min(1.0, timeout / 4) : 1.0;
    w.cv.wait_for(lock, std::chrono::duration<double>(poll));
  }
}

}  // namespace

namespace internal {

WatchedWait::WatchedWait(std::string what) {
  Watchdog& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  id_ = w.next_id++;
  w.waits.emplace(id_, std::make_pair(std::move(what), std::chrono::steady_clock::now()));
  if (!w.started) {
    w.started = true;
    try {
      std::thread(watchdog_loop).detach();
    } catch (const std::system_error& e) {
      w.started = false;  // no watchdog, but the collective itself still runs
      std::fprintf(stderr, "tessera: cannot start the MPI watchdog thread: %s\n", e.what());
    }
  }
}

WatchedWait::~WatchedWait() {
  Watchdog& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  w.waits.erase(id_);
}

}  // namespace internal

double set_comm_timeout(double seconds) {
  TS_CHECK(seconds >= 0 && std::isfinite(seconds),
           "set_comm_timeout: seconds must be finite and >= 0 (0: no watchdog), got {}",
           seconds);
  Watchdog& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  const double previous = w.timeout_seconds;
  w.timeout_seconds = seconds;
  w.cv.notify_all();
  return previous;
}

double comm_timeout() {
  Watchdog& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mu);
  return w.timeout_seconds;
}

}  // namespace tessera::parallel
