// Running a program's ranks: as the MPI world when the process was started by mpirun (this
// process is one rank), else as threads of this process with the threads communicator
// (threads.h), else (one rank that needs no communicator) on the calling thread. What the
// example programs and tools share, so "mpirun or threads" is decided in one place.
//
//   LaunchOptions o;  o.program = "gpt";  o.ranks_from = "--dp is 2";
//   launch(2, [&](CommPtr world) { train(world); }, o);   // threads, or 2 mpirun processes
#pragma once

#include <functional>
#include <string>

#include "parallel/comm/communicator.h"

namespace tessera::parallel {

struct LaunchOptions {
  std::string program = "launch";  // names the program in errors
  // How the number of ranks came about, for the error when mpirun started another number of
  // processes ("--dp is 2").
  std::string ranks_from;
  // Kernel (OpenMP) threads per rank; 0: the machine's cores shared among the ranks of this
  // process (a single rank on the calling thread keeps the current setting).
  int kernel_threads = 0;
  // Seconds a rank waits in a collective before the job is declared stalled (threads: the
  // rank's Error; mpirun: the watchdog aborts the job); 0: wait forever.
  double timeout_seconds = 600;
  // One rank outside mpirun: false runs fn(nullptr) on the calling thread (no communicator
  // wanted), true runs it as a one-thread world.
  bool world_for_one = true;
};

// Runs fn once per rank of this process: `ranks` threads, or this process's rank under
// mpirun (whose world must have `ranks` processes: Error naming options.ranks_from
// otherwise). Each thread rank's tensor memory is tracked by a MemoryTracker of its own
// (MemoryScope); otherwise the process's peak is reset first, so either way a rank's peak is
// this run's. Rethrows a rank's failure as run_threads does.
void launch(int ranks, const std::function<void(CommPtr world)>& fn,
            const LaunchOptions& options = {});

// Kernel (OpenMP) threads of the calling thread; n <= 0 leaves the setting alone.
void set_kernel_threads(int n);

}  // namespace tessera::parallel
