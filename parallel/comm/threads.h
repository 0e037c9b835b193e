// The threads backend: N ranks as N threads of one process, exchanging data through shared
// memory. Used by the tests and to simulate many devices on one host.
//
//   run_threads(4, [](CommPtr world) {
//     Tensor g = Tensor::from_vector<float>({1.f * world->rank()}, {1});
//     world->all_reduce(g, ReduceOp::sum);            // every rank: 0 + 1 + 2 + 3 = 6
//     CommPtr row = world->split(world->rank() / 2, world->rank(), "row");
//   });
//
// CPU collectives read peers' buffers directly (no copies in between); reductions run in member
// order with one rank reducing each block, so every member ends with bitwise equal results.
// Each (rank, communicator) owns a worker thread that runs its operations in program order;
// *_async returns as soon as the operation is queued.
//
// CUDA tensors are accepted: the Communicator base stages them through host copies (staging.h),
// so several ranks can share one GPU; the comm log counts the same bytes as for CPU tensors.
#pragma once

#include <functional>

#include "parallel/comm/communicator.h"

namespace tessera::parallel {

struct ThreadsOptions {
  // Kernel (OpenMP) threads per rank; 0 = max(1, hardware cores / n), so N simulated ranks on
  // a small machine do not each start a full pool.
  int kernel_threads = 0;
  // A collective or recv waiting longer than this for its peers throws Error naming the ranks
  // that never arrived.
  double timeout_seconds = 600;
};

// Runs fn(world) once per rank on n threads (rank i gets a Communicator with rank() == i,
// size() == n, name "world", backend "threads"). Returns when all threads finished; if any
// rank threw, rethrows the first failure by rank order after all threads have finished,
// preferring root causes over the "rank K failed: ..." errors other ranks saw because of it.
//
// Failure handling: when a rank's fn throws, every rank waiting in or later entering a
// collective, barrier or recv throws Error "... rank K failed: <message>"; when a rank's fn
// returns while peers wait for it, they throw "rank K exited before joining <op> on group
// '<name>'". Operations still queued when a rank's fn returns run to completion before its
// worker threads are joined.
void run_threads(int n, const std::function<void(CommPtr world)>& fn, ThreadsOptions options = {});

}  // namespace tessera::parallel
