#include "kernels/cpu/parallel.h"

namespace tessera::cpu {

// Only OpenMP's per-thread ICV: Eigen::setNbThreads would set one process-wide count (a race
// between simulated ranks, and a GEMM rounding that depends on which rank set it last);
// left unset, Eigen reads omp_get_max_threads() on the calling thread.
void set_num_threads(int n) { omp_set_num_threads(std::max(1, n)); }

}  // namespace tessera::cpu
