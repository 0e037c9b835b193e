#include "parallel/comm/launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "kernels/cpu/parallel.h"
#include "parallel/comm/mpi.h"
#include "parallel/comm/threads.h"
#include "tensor/allocator.h"
#include "tensor/error.h"

namespace tessera::parallel {

void set_kernel_threads(int n) {
  if (n > 0) cpu::set_num_threads(n);
}

void launch(int ranks, const std::function<void(CommPtr world)>& fn,
            const LaunchOptions& options) {
  TS_CHECK(ranks >= 1, "{}: need at least 1 rank, got {}", options.program, ranks);
  if (mpi_launched()) {
    set_comm_timeout(options.timeout_seconds);  // before MPI starts: the watchdog's limit
    CommPtr world = mpi_world();
    TS_CHECK(world->size() == ranks,
             "{}: started by mpirun with {} processes but {}; they must be equal",
             options.program, world->size(),
             options.ranks_from.empty() ? fmt::format("{} ranks are needed", ranks)
                                        : options.ranks_from);
    // The processes share the machine's cores unless told otherwise.
    set_kernel_threads(options.kernel_threads > 0
                           ? options.kernel_threads
                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                             world->size()));
    process_memory().reset_peak();  // this run's peak, not the process's whole history
    fn(world);
    return;
  }
  if (ranks == 1 && !options.world_for_one) {
    // Not a MemoryScope of its own: a storage that outlives the run (a cache) would keep a
    // pointer to a tracker gone out of scope.
    set_kernel_threads(options.kernel_threads);
    process_memory().reset_peak();
    fn(nullptr);
    return;
  }
  ThreadsOptions topt;
  topt.kernel_threads = options.kernel_threads;
  topt.timeout_seconds = options.timeout_seconds > 0 ? options.timeout_seconds : 1e9;
  run_threads(
      ranks,
      [&](CommPtr world) {
        MemoryTracker tracker;  // this rank's memory, for reports and the peak
        MemoryScope scope(&tracker);
        fn(std::move(world));
      },
      topt);
}

}  // namespace tessera::parallel
