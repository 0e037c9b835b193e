// Backend-independent checks of every collective, shared by the threads and MPI suites.
//
//   run_threads(4, [](CommPtr world) { testing::check_collectives(world); });
//
// Every rank calls it with the same communicator. Each collective x dtype x even/uneven
// sizes x blocking/async is compared with the result computed locally from the
// deterministic inputs of all ranks (small integers, exact in every dtype, so comparisons are
// exact). Uses only the Communicator interface and doctest's (thread-safe) assertions.
// `device`: where every buffer lives (CUDA: the NCCL backend, or the CPU backends staging
// device tensors through host copies).
#pragma once

#include "parallel/comm/communicator.h"

namespace tessera::parallel::testing {

void check_collectives(const CommPtr& world, Device device = kCPU);

}  // namespace tessera::parallel::testing
