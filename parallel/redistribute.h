// Redistribution: moving a sharded tensor from one list of placements to another, lowered to
// collectives on the mesh axes' communicators (DTensor's _redistribute, extended to uneven
// blocks and any nesting). One axis changes per step:
//   Shard(d) -> Replicate      all_gather          Partial -> Replicate   all_reduce
//   Partial  -> Shard(d)       reduce_scatter      Shard(d) -> Shard(e)   all_to_all
//   Replicate -> Shard(d)      local slice         Replicate -> Partial   local (zeros off 0)
//   Shard(d) -> Partial(sum)   local (zero-padded block)
// A step on axis i that splits or joins dim d needs every later axis to leave d unsplit (an
// outer axis splits first), so the planner un-splits inner axes first when it must. Among the
// steps available it takes the cheapest kind first: slices before reductions before gathers,
// so data shrinks before it moves.
//
//   RedistributePlan plan = plan_redistribute(mesh, {8, 6}, DType::f32, {Shard(0)}, {Replicate()});
//   plan.bytes_per_axis[0];   // what this rank sends on axis 0 (communicator.h's convention)
//   StrictRedistribution strict;   // ops that would redistribute implicitly now throw
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/placement.h"
#include "tensor/tensor.h"

namespace tessera::parallel {

struct RedistributeStep {
  int axis = 0;
  Placement from, to;
  std::string collective;  // "all_gather", "all_reduce", ..., or "local" for local steps
  int64_t bytes = 0;       // this rank sends (the cost model)
};

struct RedistributePlan {
  std::vector<RedistributeStep> steps;
  std::vector<int64_t> bytes_per_axis;  // summed over steps, per mesh axis
  int64_t total_bytes() const;
  std::string str() const;  // "axis tp: S(0) -> R all_gather 1536 B; ..."
};

// The steps this rank takes (block sizes differ per rank when uneven, so bytes may too).
RedistributePlan plan_redistribute(const DeviceMesh& mesh, const Shape& global, DType dtype,
                                   const Placements& from, const Placements& to);

// Runs a plan on a local block (no autograd; the result may be a view of `local` when only
// local steps ran). `cause` names the op in the comm log.
Tensor redistribute_local(const Tensor& local, const DeviceMesh& mesh, const Shape& global,
                          const Placements& from, const Placements& to,
                          const std::string& cause = "redistribute");

// Differentiable form: records a node whose backward redistributes the gradient back
// (gradients of Partial placements are Replicate; Partial avg/max/min scale or mask).
Tensor redistribute_autograd(const Tensor& local, const MeshPtr& mesh, const Shape& global,
                             const Placements& from, const Placements& to,
                             const std::string& cause = "redistribute");

// While alive on this thread, an op on sharded tensors whose rule needs an input moved to
// other placements throws tessera::Error instead (explicit redistribute() and
// with_sharding_constraint() stay allowed). Nests.
class StrictRedistribution {
 public:
  StrictRedistribution();
  ~StrictRedistribution();
  StrictRedistribution(const StrictRedistribution&) = delete;
  StrictRedistribution& operator=(const StrictRedistribution&) = delete;
  static bool active();
};

}  // namespace tessera::parallel
