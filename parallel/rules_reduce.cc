// Sharding rules: the reductions (sum, mean, max, var, argmax).
//
// A reduction over a split dim leaves each coordinate one term of the result (Partial: sum
// for sum/mean, max for max); other split dims stay split.
#include <algorithm>
#include <optional>

#include "parallel/sharding_rule.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

// Out dim of input dim d after reducing `dims` (-1 when d is reduced and not kept).
int64_t reduced_position(int64_t d, const std::vector<int64_t>& dims, bool keepdim) {
  if (keepdim) return d;
  if (std::find(dims.begin(), dims.end(), d) != dims.end()) return -1;
  return d - std::count_if(dims.begin(), dims.end(), [d](int64_t r) { return r < d; });
}

AxisOptions reduction(const AxisCtx& c, std::optional<ReduceOp> partial_kind, bool linear) {
  const std::vector<int64_t> dims = normalize_dims(op_name(c.op), c.attrs.dims, c.rank(0));
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) {
      // max's kernels reject empty blocks even along kept dims.
      if (partial_kind == ReduceOp::max && !c.splits_nonempty(c.in[0].shape, d)) continue;
      options.push_back(uniform(c, Shard(d), Shard(reduced_position(d, dims, c.attrs.keepdim))));
    } else if (partial_kind && (*partial_kind == ReduceOp::sum || c.splits_nonempty(c.in[0].shape, d))) {
      options.push_back(uniform(c, Shard(d), Partial(*partial_kind)));
    }
  }
  if (linear) options.push_back(uniform(c, Partial(), Partial()));
  if (partial_kind == ReduceOp::max) options.push_back(uniform(c, Partial(ReduceOp::max), Partial(ReduceOp::max)));
  return options;
}

bool any_split(const Placements& p, const std::vector<int64_t>& dims) {
  for (const Placement& x : p) {
    if (x.is_shard() && std::find(dims.begin(), dims.end(), x.dim) != dims.end()) return true;
  }
  return false;
}

// mean over a split dim: each block's sum over the whole count, so the terms add up.
std::vector<Tensor> mean_local(const LocalCtx& c) {
  const std::vector<int64_t> dims =
      normalize_dims("mean", c.attrs.dims, static_cast<int64_t>(c.in[0].shape.size()));
  if (!any_split(c.in_placements[0], dims)) return tessera::call(c.op, c.locals, c.attrs);
  int64_t count = 1;
  for (int64_t d : dims) count *= c.in[0].shape[d];
  return {tessera::sum(c.locals[0], c.attrs.dims, c.attrs.keepdim) * (1.0 / static_cast<double>(count))};
}

}  // namespace

TS_REGISTER_SHARDING_RULE(sum, {.options = [](const AxisCtx& c) { return reduction(c, ReduceOp::sum, true); }});
TS_REGISTER_SHARDING_RULE(mean, {.options = [](const AxisCtx& c) { return reduction(c, ReduceOp::sum, true); },
                                 .local = mean_local});
TS_REGISTER_SHARDING_RULE(max, {.options = [](const AxisCtx& c) { return reduction(c, ReduceOp::max, false); }});
TS_REGISTER_SHARDING_RULE(var, {.options = [](const AxisCtx& c) { return reduction(c, std::nullopt, false); }});
TS_REGISTER_SHARDING_RULE(argmax, {.options = [](const AxisCtx& c) {
  if (c.attrs.all_dims) return AxisOptions{all_replicate(c)};
  const int64_t dim = normalize_dim("argmax", c.attrs.dim, c.rank(0));
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) {
    // argmax's kernel rejects empty blocks.
    if (d != dim && c.splits_nonempty(c.in[0].shape, d)) {
      options.push_back(uniform(c, Shard(d), Shard(reduced_position(d, {dim}, c.attrs.keepdim))));
    }
  }
  return options;
}});
// A sum over every element of several tensors: each whole (shards would each give a part of
// the sum, which the callers reduce over their own groups; optim::grad_norm's).
TS_REGISTER_SHARDING_RULE(sum_squares, {.options = [](const AxisCtx& c) { return AxisOptions{all_replicate(c)}; }});

}  // namespace tessera::parallel
