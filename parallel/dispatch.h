// The sharded op path (dispatch.cc): any op of the list on sharded tensors. Global shape
// inference, a strategy per mesh axis from the op's sharding rule (sharding_rule.h), the
// redistribution of the inputs, the local op, and the outputs wrapped with their placements.
//
//   std::vector<ShardedTensor> y = parallel::call(OpId::topk, {x}, op_attrs::topk(2, -1));
//   ShardedTensor w = parallel::factory(OpId::randn, attrs, mesh, {Shard(0)});
//
// The named forms (parallel/ops.h) are thin wrappers over these.
#pragma once

#include <initializer_list>
#include <vector>

#include "parallel/sharded_tensor.h"
#include "tensor/op.h"

namespace tessera::parallel {

// Runs `op` (Compute or View) on sharded inputs; all its outputs.
std::vector<ShardedTensor> call(OpId op, const std::vector<ShardedTensor>& inputs,
                                const Attrs& attrs = {});
ShardedTensor call1(OpId op, const std::vector<ShardedTensor>& inputs, const Attrs& attrs = {});
// In-place ops (copy_, adamw_, sgd_): the inputs listed in `written` keep their placements
// (Error if the rule would move them); the others are redistributed to match.
void call_inplace(OpId op, const std::vector<ShardedTensor>& inputs, const Attrs& attrs,
                  const std::vector<size_t>& written);
// Factories (full, arange, rand, randn): each rank makes its block of the global tensor
// (random draws equal slicing the single-device draw).
ShardedTensor factory(OpId op, const Attrs& attrs, const MeshPtr& mesh, const Placements& placements);

// A plain tensor every rank holds in full, as a Replicate sharded tensor on `mesh`.
ShardedTensor replicate(const Tensor& t, const MeshPtr& mesh);

}  // namespace tessera::parallel
