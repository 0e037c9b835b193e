// Sharding rules: matmul, linear, grouped_matmul and the fused layers (softmax, layer_norm, cross_entropy,
// attention, conv2d, max_pool2d) with their backward helpers, and dropout.
//
// matmul follows Megatron: a split
// row dim of the left operand or column dim of the right one stays split, a split
// contraction dim gives a Partial sum. The fused row-wise layers need the dims they
// normalise whole and keep the other dims split.
#include <algorithm>
#include <optional>

#include "parallel/comm/comm_log.h"
#include "parallel/sharding_rule.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

AxisOptions matmul_options(const AxisCtx& c) {
  const int64_t ra = c.rank(0), rb = c.rank(1), ro = static_cast<int64_t>(c.out[0].shape.size());
  AxisOptions options{all_replicate(c)};
  options.push_back({{Shard(ra - 2), Replicate()}, {Shard(ro - 2)}});
  options.push_back({{Replicate(), Shard(rb - 1)}, {Shard(ro - 1)}});
  options.push_back({{Shard(ra - 1), Shard(rb - 2)}, {Partial()}});
  options.push_back({{Partial(), Replicate()}, {Partial()}});
  options.push_back({{Replicate(), Partial()}, {Partial()}});
  for (int64_t d = 0; d < ro - 2; ++d) {  // batch dims, broadcast like elementwise
    AxisOption o{{Replicate(), Replicate()}, {Shard(d)}};
    bool any = false;
    for (size_t i = 0; i < 2; ++i) {
      const int64_t j = d - (ro - c.rank(i));
      if (j < 0 || c.in[i].shape[j] != c.out[0].shape[d]) continue;
      o.in[i] = Shard(j);
      any = true;
    }
    if (any) options.push_back(o);
  }
  return options;
}

// linear: x [..., K], weight [N, K], bias [N] -> y, pre [..., N]. Split rows of x stay split;
// Megatron's column split (weight and bias on dim 0) splits the output's last dim; a split
// contraction dim (or a Partial operand) gives a Partial sum only when nothing follows the
// product: no bias (every rank would add it) and no activation (not linear).
AxisOptions linear_options(const AxisCtx& c) {
  const int64_t rx = c.rank(0);
  const Placement R = Replicate();
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < rx - 1; ++d) options.push_back({{Shard(d), R, R}, {Shard(d), Shard(d)}});
  options.push_back({{R, Shard(0), Shard(0)}, {Shard(rx - 1), Shard(rx - 1)}});
  if (!c.in[2].defined && c.attrs.activation == Activation::none) {
    options.push_back({{Shard(rx - 1), Shard(1), R}, {Partial(), Partial()}});
    options.push_back({{Partial(), R, R}, {Partial(), Partial()}});
    options.push_back({{R, Partial(), R}, {Partial(), Partial()}});
  }
  return options;
}

// linear_act_backward: grad, pre [..., N] -> grad_pre [..., N], grad_bias [N] (the sum over
// the leading dims: Partial where they are split). Linear in grad.
AxisOptions linear_act_backward_options(const AxisCtx& c) {
  const int64_t r = c.rank(0);
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < r - 1; ++d) options.push_back({{Shard(d), Shard(d)}, {Shard(d), Partial()}});
  options.push_back({{Shard(r - 1), Shard(r - 1)}, {Shard(r - 1), Shard(0)}});
  options.push_back({{Partial(), Replicate()}, {Partial(), Partial()}});
  return options;
}

// Ops along attrs.dim (props AlongDim in the op list: softmax, log_softmax, topk, ...):
// every input and output split alike on any other dim.
AxisOptions along_dim_options(const AxisCtx& c) {
  const int64_t dim = normalize_dim(op_name(c.op), c.attrs.dim, c.rank(0));
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) {
    if (d != dim) options.push_back(uniform(c, Shard(d), Shard(d)));
  }
  return options;
}

AxisOptions layer_norm_options(const AxisCtx& c) {
  // x, weight, bias -> y, mean, rstd: leading dims of x split; weight/bias whole.
  const int64_t lead = c.rank(0) - c.attrs.normalized_ndim;
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < lead; ++d) options.push_back({{Shard(d), Replicate(), Replicate()}, {Shard(d), Shard(d), Shard(d)}});
  return options;
}

AxisOptions add_layer_norm_options(const AxisCtx& c) {
  // x, r, weight, bias -> s, y, mean, rstd: leading dims of x and r split alike.
  const int64_t lead = c.rank(0) - c.attrs.normalized_ndim;
  AxisOptions options{all_replicate(c)};
  const Placement R = Replicate();
  for (int64_t d = 0; d < lead; ++d) {
    options.push_back({{Shard(d), Shard(d), R, R}, {Shard(d), Shard(d), Shard(d), Shard(d)}});
  }
  return options;
}

AxisOptions layer_norm_backward_options(const AxisCtx& c) {
  // grad, x, mean, rstd, weight, bias[, residual_grad] -> grad_x, grad_weight, grad_bias.
  // residual_grad is added to grad_x: placed as grad (both Partial: the sum of the ranks'
  // grad_x + residual_grad is the whole's).
  const int64_t lead = c.rank(1) - c.attrs.normalized_ndim;
  const bool residual = c.num_inputs() > 6;
  AxisOptions options{all_replicate(c)};
  const Placement R = Replicate();
  for (int64_t d = 0; d < lead; ++d) {
    AxisOption o{{Shard(d), Shard(d), Shard(d), Shard(d), R, R}, {Shard(d), Partial(), Partial()}};
    if (residual) o.in.push_back(Shard(d));
    options.push_back(std::move(o));
  }
  AxisOption partial{{Partial(), R, R, R, R, R}, {Partial(), Partial(), Partial()}};
  if (residual) partial.in.push_back(Partial());
  options.push_back(std::move(partial));
  return options;
}

// The count of targets that are not ignored, summed over the axes splitting the batch.
double target_count(const LocalCtx& c, const Tensor& target, const Placements& p) {
  std::vector<std::string> axes;
  for (int a = 0; a < c.mesh->ndim(); ++a) {
    if (p[a].is_shard(0)) axes.push_back(c.mesh->axis_name(a));
  }
  Tensor n = tessera::sum(tessera::cast(
      tessera::ne(target, tessera::scalar_like(static_cast<double>(c.attrs.ignore_index), target,
                                               "cross_entropy")),
      DType::f64));
  n = tessera::clone(n);
  if (!axes.empty()) c.mesh->group(axes).all_reduce(n, ReduceOp::sum);
  return n.item<double>();
}

bool batch_split(const Placements& p) {
  return std::any_of(p.begin(), p.end(), [](const Placement& x) { return x.is_shard(0); });
}

AxisOptions cross_entropy_options(const AxisCtx& c) {
  const bool none = c.attrs.reduction == Reduction::none;
  AxisOptions options{all_replicate(c)};
  options.push_back({{Shard(0), Shard(0)}, {none ? Shard(0) : Partial(), Shard(0)}});
  return options;
}

// cross_entropy and its backward averaging over a batch split on some axes: run the sum
// form, with the mean's divisor the global count of targets (input `target` of the op).
// `scale_grad`: the backward scales its incoming gradient; the forward scales its loss.
std::vector<Tensor> mean_over_split_batch(const LocalCtx& c, size_t target, bool scale_grad) {
  if (c.attrs.reduction != Reduction::mean || !batch_split(c.in_placements[target])) {
    return tessera::call(c.op, c.locals, c.attrs);
  }
  const double inv_count = 1.0 / target_count(c, c.locals[target], c.in_placements[target]);
  Attrs a = c.attrs;
  a.reduction = Reduction::sum;
  std::vector<Tensor> in = c.locals;
  if (scale_grad) in[0] = in[0] * inv_count;
  std::vector<Tensor> out = tessera::call(c.op, in, a);
  if (!scale_grad) out[0] = out[0] * inv_count;
  return out;
}

std::vector<Tensor> cross_entropy_local(const LocalCtx& c) { return mean_over_split_batch(c, 1, false); }

AxisOptions cross_entropy_backward_options(const AxisCtx& c) {
  // grad, logits, target, logsumexp -> grad_logits.
  const bool none = c.attrs.reduction == Reduction::none;
  AxisOptions options{all_replicate(c)};
  options.push_back({{none ? Shard(0) : Replicate(), Shard(0), Shard(0), Shard(0)}, {Shard(0)}});
  options.push_back({{Partial(), Replicate(), Replicate(), Replicate()}, {Partial()}});
  return options;
}

std::vector<Tensor> cross_entropy_backward_local(const LocalCtx& c) {
  return mean_over_split_batch(c, 2, true);
}

AxisOptions conv2d_options(const AxisCtx& c) {
  // x [N, C, H, W], weight [O, C, kh, kw], bias [O].
  const Placement R = Replicate();
  return {all_replicate(c),
          {{Shard(0), R, R}, {Shard(0)}},
          {{R, Shard(0), Shard(0)}, {Shard(1)}},
          {{Shard(1), Shard(1), Partial()}, {Partial()}},
          {{Partial(), R, Partial()}, {Partial()}}};
}

AxisOptions conv2d_backward_input_options(const AxisCtx& c) {
  // grad [N, O, ...], weight [O, C, kh, kw] -> grad_x [N, C, H, W].
  const Placement R = Replicate();
  return {all_replicate(c),
          {{Shard(0), R}, {Shard(0)}},
          {{Shard(1), Shard(0)}, {Partial()}},
          {{R, Shard(1)}, {Shard(1)}},
          {{Partial(), R}, {Partial()}}};
}

AxisOptions conv2d_backward_weight_options(const AxisCtx& c) {
  // grad [N, O, ...], x [N, C, H, W] -> grad_weight [O, C, kh, kw].
  const Placement R = Replicate();
  return {all_replicate(c),
          {{Shard(0), Shard(0)}, {Partial()}},
          {{Shard(1), R}, {Shard(0)}},
          {{R, Shard(1)}, {Shard(1)}},
          {{Partial(), R}, {Partial()}}};
}

// grouped_matmul: x [N, K], w [E, K, M], sizes [E] -> [N, M]. The rows are grouped by the
// sizes' values, so they stay whole; splitting each expert as Megatron splits a Linear
// (expert tensor parallelism) is local: w's columns give output columns, split K a Partial.
AxisOptions grouped_matmul_options(const AxisCtx& c) {
  const Placement R = Replicate();
  return {all_replicate(c),
          {{R, Shard(2), R}, {Shard(1)}},
          {{Shard(1), Shard(1), R}, {Partial()}},
          {{Partial(), R, R}, {Partial()}},
          {{R, Partial(), R}, {Partial()}}};
}

// grouped_matmul_backward_weight: x [N, K], grad [N, M], sizes [E] -> [E, K, M].
AxisOptions grouped_matmul_backward_weight_options(const AxisCtx& c) {
  const Placement R = Replicate();
  return {all_replicate(c),
          {{Shard(1), R, R}, {Shard(1)}},
          {{R, Shard(1), R}, {Shard(2)}},
          {{Partial(), R, R}, {Partial()}},
          {{R, Partial(), R}, {Partial()}}};
}

// attention (q, k, v -> out, lse) and its backward (grad, q, k, v, out, lse -> dq, dk, dv):
// every (batch, head) pair is independent, so a split batch (dim 0) or head dim (dim 1) of
// all operands computes locally; the sequence and head-size dims stay whole.
AxisOptions attention_options(const AxisCtx& c) {
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < 2; ++d) options.push_back(uniform(c, Shard(d), Shard(d)));
  return options;
}

// attention_qkv (qkv [3, B, T, C] -> out [B, T, C], lse [B, H, T]) and its backward (grad,
// qkv, out, lse -> grad_qkv): the batch split, or C split into whole heads. That is offered
// when this axis splits the H heads evenly and, if another mesh axis splits C now as well,
// when the whole mesh does (the splitting axes' sizes multiply to a divisor of it).
AxisOptions attention_qkv_options(const AxisCtx& c) {
  const bool backward = c.op == OpId::attention_qkv_backward;
  const Shape& qkv = c.in[backward ? 1 : 0].shape;
  // Each input's dim that holds the heads.
  const std::vector<int64_t> head_dims = backward ? std::vector<int64_t>{2, 3, 2, 1} : std::vector<int64_t>{3};
  bool split_elsewhere = false;
  for (size_t i = 0; i < head_dims.size(); ++i) {
    for (size_t a = 0; a < c.current[i].size(); ++a) {
      split_elsewhere = split_elsewhere || (static_cast<int>(a) != c.axis && c.current[i][a].is_shard(head_dims[i]));
    }
  }
  const int64_t ways = split_elsewhere ? c.mesh_size : c.axis_size;
  AxisOptions options{all_replicate(c)};
  const auto add = [&](Placement rows, Placement packed, Placement stats) {
    if (backward) options.push_back({{rows, packed, rows, stats}, {packed}});
    else options.push_back({{packed}, {rows, stats}});
  };
  add(Shard(0), Shard(1), Shard(0));
  const int64_t heads = c.attrs.head_dim > 0 ? qkv[3] / c.attrs.head_dim : 0;
  if (heads > 0 && heads % ways == 0) add(Shard(2), Shard(3), Shard(1));
  return options;
}

AxisOptions pool_options(const AxisCtx& c) {
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < 2; ++d) options.push_back(uniform(c, Shard(d), Shard(d)));
  return options;
}

}  // namespace

TS_REGISTER_SHARDING_RULE(matmul, {.options = matmul_options});
TS_REGISTER_SHARDING_RULE(linear, {.options = linear_options});
TS_REGISTER_SHARDING_RULE(linear_act_backward, {.options = linear_act_backward_options});
TS_REGISTER_SHARDING_RULE(grouped_matmul, {.options = grouped_matmul_options});
TS_REGISTER_SHARDING_RULE(grouped_matmul_backward_weight,
                          {.options = grouped_matmul_backward_weight_options});
const bool kAlongDimRegistered = [] {
#define TS_ALONG_DIM_RULE(name, kind, grad, family, props) \
  if (OpProps::props == OpProps::AlongDim) {               \
    register_sharding_rule(OpId::name, {.options = along_dim_options}); \
  }
  TS_OP_LIST(TS_ALONG_DIM_RULE)
#undef TS_ALONG_DIM_RULE
  return true;
}();
TS_REGISTER_SHARDING_RULE(layer_norm, {.options = layer_norm_options});
TS_REGISTER_SHARDING_RULE(layer_norm_backward, {.options = layer_norm_backward_options});
TS_REGISTER_SHARDING_RULE(add_layer_norm, {.options = add_layer_norm_options});
TS_REGISTER_SHARDING_RULE(cross_entropy, {.options = cross_entropy_options, .local = cross_entropy_local});
TS_REGISTER_SHARDING_RULE(cross_entropy_backward, {.options = cross_entropy_backward_options,
                                                   .local = cross_entropy_backward_local});
TS_REGISTER_SHARDING_RULE(attention, {.options = attention_options});
TS_REGISTER_SHARDING_RULE(attention_backward, {.options = attention_options});
TS_REGISTER_SHARDING_RULE(attention_qkv, {.options = attention_qkv_options});
TS_REGISTER_SHARDING_RULE(attention_qkv_backward, {.options = attention_qkv_options});
TS_REGISTER_SHARDING_RULE(conv2d, {.options = conv2d_options});
TS_REGISTER_SHARDING_RULE(conv2d_backward_input, {.options = conv2d_backward_input_options});
TS_REGISTER_SHARDING_RULE(conv2d_backward_weight, {.options = conv2d_backward_weight_options});
TS_REGISTER_SHARDING_RULE(max_pool2d, {.options = pool_options});
TS_REGISTER_SHARDING_RULE(max_pool2d_backward, {.options = pool_options});

}  // namespace tessera::parallel
