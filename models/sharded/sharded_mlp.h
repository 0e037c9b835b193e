// A Megatron-style two-layer MLP step on a {dp, tp} mesh, written with sharded tensors: the
// README's sharded example (tests/docs/readme_sharded_test.cc checks it against one device).
//
//   run_threads(4, [](CommPtr world) { ShardedMlpResult r = sharded_mlp_step(world, 2, 2); });
//   // or, one process per rank: mpirun -np 4 bazel-bin/models/sharded/sharded_mlp
#pragma once

#include <string>

#include "parallel/comm/communicator.h"
#include "tensor/tensor.h"

namespace tessera::examples {

using parallel::CommPtr;

struct ShardedMlpResult {
  Tensor loss;              // the full loss on every rank
  Tensor grad_w1, grad_w2;  // full gradients on every rank
  std::string describe_h;   // describe() of the hidden activation
  std::string comm_log;     // the collectives this rank issued, with their causes
};

// One forward and backward of relu(x @ w1) @ w2 with a mean squared loss: x split by batch
// over dp, w1 by columns and w2 by rows over tp (no communication in between), the output's
// partial sums reduced over tp, and the replicated weights' gradients summed over dp.
ShardedMlpResult sharded_mlp_step(const CommPtr& world, int64_t dp, int64_t tp);

// The same step on one device.
ShardedMlpResult single_device_mlp_step();

}  // namespace tessera::examples
