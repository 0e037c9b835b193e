// The block sizes of the CPU's full reductions (kernels/cpu/reduce.cc), shared with
// sum_squares (kernels/cpu/optim.cc), which sums each tensor in the same blocks so that its
// norm is bitwise sum()'s.
#pragma once

#include <cstdint>

namespace tessera::cpu {

inline constexpr int64_t kReduceBlock = int64_t{1} << 14;           // elements per block
inline constexpr int64_t kReduceBlockThreshold = int64_t{1} << 16;  // size from which blocks are used

}  // namespace tessera::cpu
