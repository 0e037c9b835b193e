// Sharding rules: indexing, joining, views, in-place updates and factories.
//
// Indexing keeps splits of the dims it does not index. embedding also takes a table split by
// rows (vocab parallel): each coordinate looks up the indices that fall in its rows and
// writes zeros for the rest, so the output is a Partial sum. Views keep a split when the
// split dim maps onto an output dim that starts at the same element and divides the same way.
#include <algorithm>

#include "parallel/sharding_rule.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

const Placement R = Replicate();

// Input 0 (and the inputs listed in `along`) split on dims other than the indexed one; the
// inputs in `linear` may be Partial sums together.
AxisOptions indexed(const AxisCtx& c, const std::vector<size_t>& along,
                    const std::vector<size_t>& linear) {
  const int64_t dim = normalize_dim(op_name(c.op), c.attrs.dim, c.rank(0));
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) {
    if (d == dim) continue;
    AxisOption o = all_replicate(c);
    o.in[0] = Shard(d);
    bool ok = true;
    for (size_t i : along) {
      ok = ok && c.rank(i) > d && c.in[i].shape[d] == c.in[0].shape[d];
      o.in[i] = Shard(d);
    }
    if (!ok || c.out[0].shape[d] != c.in[0].shape[d]) continue;
    o.out[0] = Shard(d);
    options.push_back(o);
  }
  if (!linear.empty()) {
    AxisOption o = all_replicate(c);
    for (size_t i : linear) o.in[i] = Partial();
    o.out[0] = Partial();
    options.push_back(o);
  }
  return options;
}

AxisOptions embedding_options(const AxisCtx& c) {
  // weight [V, D], indices [...] -> [..., D].
  const int64_t ri = c.rank(1), ro = ri + 1;
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < ri; ++d) options.push_back({{R, Shard(d)}, {Shard(d)}});
  options.push_back({{Shard(1), R}, {Shard(ro - 1)}});
  options.push_back({{Shard(0), R}, {Partial()}});
  options.push_back({{Partial(), R}, {Partial()}});
  return options;
}

std::vector<Tensor> embedding_local(const LocalCtx& c) {
  const Tensor& w = c.locals[0];
  const Tensor& idx = c.locals[1];
  const bool vocab_split = std::any_of(c.in_placements[0].begin(), c.in_placements[0].end(),
                                       [](const Placement& p) { return p.is_shard(0); });
  if (!vocab_split) return tessera::call(c.op, c.locals, c.attrs);
  const LocalBlock b = local_block(c.in[0].shape, *c.mesh, c.in_placements[0]);
  const int64_t start = b.starts[0], rows = b.shape[0];
  Shape out_shape = idx.shape();
  out_shape.push_back(w.size(1));
  if (rows == 0) return {tessera::zeros(out_shape, w.dtype(), w.device())};
  const Tensor lo = tessera::scalar_like(static_cast<double>(start), idx, "embedding");
  const Tensor hi = tessera::scalar_like(static_cast<double>(start + rows), idx, "embedding");
  const Tensor mine = tessera::where(tessera::ge(idx, lo), tessera::lt(idx, hi), tessera::ge(idx, lo));
  const Tensor shifted = tessera::where(mine, tessera::sub(idx, lo), tessera::zeros_like(idx));
  const Tensor rows_out = tessera::embedding(w, shifted);
  return {rows_out * tessera::cast(tessera::unsqueeze(mine, -1), w.dtype())};
}

AxisOptions cat_options(const AxisCtx& c) {
  const int64_t dim = normalize_dim("cat", c.attrs.dim, c.rank(0));
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) {
    if (d != dim) options.push_back(uniform(c, Shard(d), Shard(d)));
  }
  options.push_back(uniform(c, Partial(), Partial()));
  return options;
}

// copy_(dst, src): dst keeps its placements (it is written); src follows, broadcasting.
AxisOptions copy_options(const AxisCtx& c) {
  const Placement dst = c.now(0);
  AxisOption o{{dst, R}, std::vector<Placement>(c.out.size(), dst)};
  if (dst.is_partial(ReduceOp::sum)) o.in[1] = Partial();
  if (dst.is_partial() && !dst.is_partial(ReduceOp::sum)) o.in[1] = R;
  if (dst.is_shard()) {
    const int64_t j = dst.dim - (c.rank(0) - c.rank(1));
    if (j >= 0 && c.in[1].shape[j] == c.in[0].shape[dst.dim]) o.in[1] = Shard(j);
  }
  return {o};
}

// Optimizer updates: every tensor laid out like the parameter.
AxisOptions like_param(const AxisCtx& c) {
  const Placement p = c.now(0);
  AxisOptions options;
  if (!p.is_partial()) options.push_back(uniform(c, p, R));
  options.push_back(uniform(c, R, R));
  for (AxisOption& o : options) o.out.assign(c.out.size(), o.in[0]);
  return options;
}

// adamw8bit_ (and its segments_ form): a block's scale is its largest element, so no
// placement splits a tensor; the update runs on whole tensors (ZeRO cuts shards at block boundaries itself, see
// ZeroOptions::block_shards).
AxisOptions replicated_update(const AxisCtx& c) {
  AxisOptions options;
  options.push_back(uniform(c, R, R));
  for (AxisOption& o : options) o.out.assign(c.out.size(), o.in[0]);
  return options;
}

// scale_: each tensor scaled where it is, whatever its placement (the op is elementwise and
// linear), but for a Partial max or min, which a negative scale would swap.
AxisOptions scale_options(const AxisCtx& c) {
  AxisOption keep{{}, {}};
  bool linear = true;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const Placement p = c.now(i);
    linear = linear && (!p.is_partial() || p.is_partial(ReduceOp::sum) || p.is_partial(ReduceOp::avg));
    keep.in.push_back(p);
  }
  AxisOptions options;
  if (linear) options.push_back(keep);
  options.push_back(uniform(c, R, R));
  return options;
}

// ---- views ---------------------------------------------------------------------------------

AxisOptions view_options(const AxisCtx& c) {
  const Shape& in = c.in[0].shape;
  const Shape& out = c.out[0].shape;
  AxisOptions options{all_replicate(c), uniform(c, Partial(), Partial())};
  for (ReduceOp op : {ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    options.push_back(uniform(c, Partial(op), Partial(op)));
  }
  const int64_t n = c.mesh_size;
  for (int64_t d = 0; d < static_cast<int64_t>(in.size()); ++d) {
    // The output dim starting at the same flat position, if any.
    int64_t before_in = 1;
    for (int64_t k = 0; k < d; ++k) before_in *= in[k];
    int64_t before_out = 1;
    for (int64_t e = 0; e < static_cast<int64_t>(out.size()); ++e) {
      // Equal sizes split alike; otherwise both must divide evenly under any nesting of
      // the mesh's axes on this dim (hence the whole mesh's size).
      if (before_out == before_in && out[e] != 1 &&
          (out[e] == in[d] || (in[d] % n == 0 && out[e] % n == 0))) {
        options.push_back(uniform(c, Shard(d), Shard(e)));
        break;
      }
      before_out *= out[e];
      if (before_out > before_in) break;
    }
  }
  return options;
}

AxisOptions permute_options(const AxisCtx& c) {
  const std::vector<int64_t>& order = c.attrs.dims;
  AxisOptions options{all_replicate(c)};
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    options.push_back(uniform(c, Partial(op), Partial(op)));
  }
  for (int64_t e = 0; e < static_cast<int64_t>(order.size()); ++e) {
    const int64_t d = order[e] < 0 ? order[e] + c.rank(0) : order[e];
    options.push_back(uniform(c, Shard(d), Shard(e)));
  }
  return options;
}

// Views that keep every dim but `dim` where it is (slice) or map dims one to one.
AxisOptions dimwise_view(const AxisCtx& c, const std::vector<int64_t>& out_pos) {
  AxisOptions options{all_replicate(c)};
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    options.push_back(uniform(c, Partial(op), Partial(op)));
  }
  for (int64_t d = 0; d < c.rank(0); ++d) {
    if (out_pos[d] >= 0) options.push_back(uniform(c, Shard(d), Shard(out_pos[d])));
  }
  return options;
}

AxisOptions slice_options(const AxisCtx& c) {
  const int64_t dim = normalize_dim("slice", c.attrs.dim, c.rank(0));
  std::vector<int64_t> pos(c.rank(0));
  for (int64_t d = 0; d < c.rank(0); ++d) pos[d] = d == dim ? -1 : d;
  return dimwise_view(c, pos);
}

AxisOptions expand_options(const AxisCtx& c) {
  const int64_t off = static_cast<int64_t>(c.out[0].shape.size()) - c.rank(0);
  std::vector<int64_t> pos(c.rank(0));
  for (int64_t d = 0; d < c.rank(0); ++d) {
    pos[d] = c.in[0].shape[d] == c.out[0].shape[d + off] ? d + off : -1;
  }
  // Broadcasting repeats each term, which keeps every kind of Partial.
  return dimwise_view(c, pos);
}

AxisOptions squeeze_options(const AxisCtx& c) {
  const Shape& in = c.in[0].shape;
  std::vector<bool> drop(in.size(), false);
  if (c.attrs.dims.empty()) {
    for (size_t i = 0; i < in.size(); ++i) drop[i] = in[i] == 1;
  } else {
    for (int64_t d : c.attrs.dims) {
      const int64_t k = normalize_dim("squeeze", d, c.rank(0));
      drop[k] = in[k] == 1;
    }
  }
  std::vector<int64_t> pos(in.size());
  int64_t e = 0;
  for (size_t d = 0; d < in.size(); ++d) pos[d] = drop[d] ? -1 : e++;
  return dimwise_view(c, pos);
}

// Drops exactly the dims of size 1 in the global shape (a block may have size 1 elsewhere).
std::vector<Tensor> squeeze_local(const LocalCtx& c) {
  const Shape& g = c.in[0].shape;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < static_cast<int64_t>(g.size()); ++d) {
    bool listed = c.attrs.dims.empty();
    for (int64_t k : c.attrs.dims) listed = listed || normalize_dim("squeeze", k, static_cast<int64_t>(g.size())) == d;
    if (listed && g[d] == 1) dims.push_back(d);
  }
  Attrs a = c.attrs;
  if (dims.empty()) {
    a.shape = c.locals[0].shape();
    return {tessera::call_view(OpId::view, c.locals[0], a)};
  }
  a.dims = dims;
  return {tessera::call_view(OpId::squeeze, c.locals[0], a)};
}

AxisOptions unsqueeze_options(const AxisCtx& c) {
  const int64_t dim = normalize_dim("unsqueeze", c.attrs.dim, c.rank(0) + 1);
  std::vector<int64_t> pos(c.rank(0));
  for (int64_t d = 0; d < c.rank(0); ++d) pos[d] = d < dim ? d : d + 1;
  return dimwise_view(c, pos);
}

// Factories have no inputs: parallel::factory makes each rank's block directly.
AxisOptions factory_options(const AxisCtx& c) { return {all_replicate(c)}; }

}  // namespace

TS_REGISTER_SHARDING_RULE(embedding, {.options = embedding_options, .local = embedding_local});
// index_select(x, index): x split elsewhere; or the index split, giving a split output dim.
TS_REGISTER_SHARDING_RULE(index_select, {.options = [](const AxisCtx& c) {
  AxisOptions o = indexed(c, {}, {0});
  const int64_t dim = normalize_dim("index_select", c.attrs.dim, c.rank(0));
  o.push_back({{R, Shard(0)}, {Shard(dim)}});
  return o;
}});
// index_add(x, index, source), gather(x, index), scatter_add(x, index, src).
TS_REGISTER_SHARDING_RULE(index_add, {.options = [](const AxisCtx& c) { return indexed(c, {2}, {0, 2}); }});
TS_REGISTER_SHARDING_RULE(gather, {.options = [](const AxisCtx& c) { return indexed(c, {1}, {0}); }});
TS_REGISTER_SHARDING_RULE(scatter_add, {.options = [](const AxisCtx& c) { return indexed(c, {1, 2}, {0, 2}); }});

// counting_sort's order is over the whole key list: keys and outputs whole.
TS_REGISTER_SHARDING_RULE(counting_sort, {.options = [](const AxisCtx& c) { return AxisOptions{all_replicate(c)}; }});
TS_REGISTER_SHARDING_RULE(cat, {.options = cat_options});
TS_REGISTER_SHARDING_RULE(stack, {.composite = true});
TS_REGISTER_SHARDING_RULE(split, {.composite = true});

TS_REGISTER_SHARDING_RULE(copy_, {.options = copy_options});
// Bits of 8 consecutive elements share a byte: whole tensors in and out.
TS_REGISTER_SHARDING_RULE(sign_pack, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(sign_unpack, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(adamw_, {.options = like_param});
TS_REGISTER_SHARDING_RULE(scale_, {.options = scale_options});
TS_REGISTER_SHARDING_RULE(adamw8bit_, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(adamw8bit_segments_, {.options = replicated_update});
// Adafactor's passes sum whole rows and columns: on whole tensors (ZeRO and tp hand the
// optimizer row shards and sum the statistics themselves, optim::RowShard).
TS_REGISTER_SHARDING_RULE(adafactor_stats_, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(adafactor_norm_, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(adafactor_apply_, {.options = replicated_update});
TS_REGISTER_SHARDING_RULE(sgd_, {.options = like_param});

TS_REGISTER_SHARDING_RULE(view, {.options = view_options});
TS_REGISTER_SHARDING_RULE(permute, {.options = permute_options});
TS_REGISTER_SHARDING_RULE(slice, {.options = slice_options});
TS_REGISTER_SHARDING_RULE(expand, {.options = expand_options});
TS_REGISTER_SHARDING_RULE(squeeze, {.options = squeeze_options, .local = squeeze_local});
TS_REGISTER_SHARDING_RULE(unsqueeze, {.options = unsqueeze_options});

TS_REGISTER_SHARDING_RULE(full, {.options = factory_options});
TS_REGISTER_SHARDING_RULE(arange, {.options = factory_options});
TS_REGISTER_SHARDING_RULE(rand, {.options = factory_options});
TS_REGISTER_SHARDING_RULE(randn, {.options = factory_options});
TS_REGISTER_SHARDING_RULE(zeros, {.composite = true});
TS_REGISTER_SHARDING_RULE(ones, {.composite = true});

}  // namespace tessera::parallel
