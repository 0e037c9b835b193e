#include "kernels/cpu/parallel.h"

#include <Eigen/Core>

namespace tessera::cpu {

void set_num_threads(int n) {
  omp_set_num_threads(std::max(1, n));
  Eigen::setNbThreads(std::max(1, n));
}

}  // namespace tessera::cpu
