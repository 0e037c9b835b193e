// Sharding rules: per op in tensor/op_list.h, the ways it can run on local blocks, as
// DTensor's op strategies. A rule looks at one mesh axis at a time and lists options, each
// naming the placement every input must have on that axis and the placement each output
// then has. The dispatcher (parallel/ops.h: call) picks per axis the option that is cheapest
// to reach from the inputs' current placements (keeping them when an option accepts them),
// redistributes the inputs that differ (an implicit redistribution: logged with the op as
// its cause, and an Error under StrictRedistribution), runs the op on the local blocks and
// wraps the outputs.
//
//   TS_REGISTER_SHARDING_RULE(relu, {.options = [](const AxisCtx& c) {
//     return unary_options(c, /*partial=*/false);   // R -> R, S(d) -> S(d)
//   }});
//
// Rules only describe layouts; when the local computation differs from the op itself (a
// mean over a split dim, a lookup in a vocab-split table, a loss averaged over a split
// batch), `local` computes the local outputs with other ops, keeping autograd intact.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/placement.h"
#include "tensor/op.h"

namespace tessera::parallel {

struct AxisCtx {
  OpId op;
  const Attrs& attrs;
  int axis;
  int64_t axis_size;
  const std::vector<TensorSpec>& in;   // global inputs (defined == false: absent)
  const std::vector<TensorSpec>& out;  // global outputs
  const std::vector<Placements>& current;  // every input's placements now (all axes)

  int64_t num_inputs() const { return static_cast<int64_t>(in.size()); }
  int64_t rank(size_t i) const { return static_cast<int64_t>(in[i].shape.size()); }
  const Placement& now(size_t i) const { return current[i][axis]; }
  int64_t mesh_size;  // ranks in the whole mesh
  // Whether dim d of a tensor of `shape` keeps every block non-empty however the mesh's axes
  // split it (ops that cannot reduce an empty block, such as max, need that). Conservative:
  // the other axes may split the same dim too.
  bool splits_nonempty(const Shape& shape, int64_t d) const { return shape[d] >= mesh_size; }
};

struct AxisOption {
  std::vector<Placement> in;   // per input (absent inputs: ignored)
  std::vector<Placement> out;  // per output
};
using AxisOptions = std::vector<AxisOption>;
using AxisRuleFn = AxisOptions (*)(const AxisCtx&);

struct LocalCtx {
  OpId op;
  const Attrs& attrs;  // the global attrs
  const MeshPtr& mesh;
  const std::vector<TensorSpec>& in;  // global
  const std::vector<TensorSpec>& out;
  const std::vector<Placements>& in_placements;  // as chosen
  const std::vector<Placements>& out_placements;
  const std::vector<Tensor>& locals;  // inputs' local blocks under in_placements
};
using LocalFn = std::vector<Tensor> (*)(const LocalCtx&);

struct ShardingRule {
  AxisRuleFn options = nullptr;
  LocalFn local = nullptr;  // default: the op on the local blocks (attrs made local)
  // Composite ops (tensor/op_list.h) have no rule of their own: their sharded form is built
  // from other ops (parallel/ops.h), which the completeness test accepts.
  bool composite = false;
};

void register_sharding_rule(OpId op, ShardingRule rule);
const ShardingRule* sharding_rule_for(OpId op);  // null if none

// ---- helpers shared by the rule files ------------------------------------------------------
// Every input and output Replicate (always valid).
AxisOption all_replicate(const AxisCtx& c);
// Every defined input gets `p` (absent inputs too, ignored); every output `q`.
AxisOption uniform(const AxisCtx& c, Placement p, Placement q);
// Elementwise ops with NumPy broadcasting over all inputs: Replicate, and Shard(d) of the
// output for each dim where every input either has that dim at full size (sharded) or
// broadcasts it (must be Replicate). `partial_ok[i]` lists inputs that may be Partial(sum)
// together (linear ops: add takes all Partial, mul one), giving a Partial(sum) output; the
// vector may be empty.
AxisOptions broadcast_options(const AxisCtx& c, const std::vector<std::vector<size_t>>& partial_sets,
                              size_t num_outputs = 1);

}  // namespace tessera::parallel

#define TS_REGISTER_SHARDING_RULE(op, ...)                                                \
  static const bool TS_CONCAT(ts_sharding_rule_registered_, __LINE__) =                  \
      (::tessera::parallel::register_sharding_rule(::tessera::OpId::op,                   \
                                                   ::tessera::parallel::ShardingRule __VA_ARGS__), \
       true)
