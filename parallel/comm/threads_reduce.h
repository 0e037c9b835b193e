// The threads backend's element reductions: out[i] = src[0][i] op src[1][i] op ... in member
// order, for every dtype (f16/bf16 accumulate in f32 and round once; avg divides the sum by
// the member count; bool sum/max are or, min is and). `out` may alias one of the sources.
//
//   reduce_into(DType::f32, ReduceOp::sum, out, {a, b, c}, count);
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/comm/communicator.h"
#include "tensor/dtype.h"

namespace tessera::parallel::internal {

void reduce_into(DType dt, ReduceOp op, char* out, const std::vector<const char*>& src,
                 int64_t count);

}  // namespace tessera::parallel::internal
