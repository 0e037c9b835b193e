// The MPI backend: one process per rank, launched by mpirun, tensors of any dtype. CUDA
// tensors are staged through host copies (parallel/comm/staging.h), so several ranks can
// share one GPU; with one GPU per rank, nccl_world (nccl.h) avoids the copies.
//
//   // mpirun -np 4 bazel-bin/models/gpt/train ...
//   CommPtr world = mpi_world();        // launch.h chooses between this and run_threads()
//   world->all_reduce(grad, ReduceOp::avg);
//   CommPtr tp = world->split(world->rank() / 2, world->rank(), "tp");
//
// Blocking forms (all_reduce(), all_gather(), ...) run MPI's blocking collective, whose tuned
// algorithms are 1.5-3x faster than the nonblocking ones in OpenMPI 4.1 (libnbc). An async
// call therefore starts lazily: its nonblocking MPI call is posted by the next call on any
// MPI communicator of this process, by is_completed(), or by wait() (which, if nothing
// posted it yet, runs the blocking form instead). Issue order is kept, so every rank still
// posts collectives in program order. Keep waiting on (or polling) every handle: like
// MPI's own nonblocking collectives, an unwaited one may never progress.
//
// send() copies the tensor and posts MPI_Isend from the copy, so it returns at once and a
// send posted before the peer's recv never deadlocks (as with the threads backend).
// MPI errors come back as tessera::Error("mpi: MPI_Allreduce on group 'tp' failed on rank 1
// of 2: ..."): every communicator has MPI_ERRORS_RETURN.
//
// A watchdog bounds every blocking wait (collectives, recv, split, MPI_Finalize): one that
// has not completed after comm_timeout() seconds (default 600; TESSERA_COMM_TIMEOUT or
// set_comm_timeout(); 0: off) means a peer is stalled, stopped or dead, and the watchdog
// prints which call waited and aborts the whole job (MPI_Abort), rather than spin forever.
#pragma once

#include <cstdint>
#include <string>

#include "parallel/comm/communicator.h"

namespace tessera::parallel {

// The MPI world, a duplicate of MPI_COMM_WORLD named "world" (backend "mpi"). The first
// call initialises MPI with MPI_THREAD_MULTIPLE (unless the program already did) and
// registers MPI_Finalize at exit.
CommPtr mpi_world();

// True when this process was started by mpirun (OMPI_COMM_WORLD_SIZE, or PMI_SIZE for other
// launchers, is set), so launch() (launch.h) can choose between mpi_world() and run_threads().
bool mpi_launched();

// The watchdog's limit in seconds (0: no watchdog); returns the previous value.
double set_comm_timeout(double seconds);
double comm_timeout();

// After an error on this rank: when MPI is running with more than one process, prints the
// message and brings every rank down (MPI_Abort with `code`), so no peer waits forever in a
// collective for this one; otherwise returns and the caller exits as usual.
void mpi_abort_if_running(int code, const std::string& message);

namespace internal {
// MPI counts and displacements are ints. all_reduce, broadcast, send and recv split longer
// buffers into chunks of at most this many elements; all_gather, reduce_scatter and
// all_to_all throw an Error when their whole buffer holds more. Default INT32_MAX; tests
// lower it to exercise both paths with small tensors. Returns the previous value.
int64_t set_mpi_max_count(int64_t elements);
}  // namespace internal

}  // namespace tessera::parallel
