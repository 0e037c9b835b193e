// The MPI backend's watchdog (parallel/comm/mpi.h): MPI's blocking calls cannot be
// interrupted, and OpenMPI spins in them forever when a peer stops, hangs or dies without
// taking the job down. Every blocking wait registers for its lifetime; a thread (started
// with the first) aborts the whole job with a message naming the call when one has waited
// longer than comm_timeout(), as NCCL's and PyTorch's watchdogs do.
//
//   {
//     internal::WatchedWait watched("all_reduce on group 'dp' (rank 1 of 4)");
//     MPI_Allreduce(...);   // a stall past the timeout ends the job with that text
//   }
#pragma once

#include <cstdint>
#include <string>

namespace tessera::parallel::internal {

class WatchedWait {
 public:
  explicit WatchedWait(std::string what);
  ~WatchedWait();
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;

 private:
  uint64_t id_ = 0;
};

}  // namespace tessera::parallel::internal
