// Sharding rules: elementwise ops, casts and copies, dropout.
//
// Elementwise work keeps any Shard of the broadcast output (inputs that broadcast a dim hold
// it whole). Partial terms pass through what is linear in them: add/sub of two Partial sums,
// mul by a Replicate factor, div of a Partial numerator, where with a Replicate condition,
// dropout (its mask is keyed by the global index, so equal on every term). Functions that
// keep order (exp, tanh, sigmoid, relu, casts) also carry Partial max/min, neg swaps them.
#include "parallel/sharding_rule.h"

namespace tessera::parallel {
namespace {

enum class Order { none, increasing, decreasing };

AxisOptions unary(const AxisCtx& c, bool linear, Order order) {
  AxisOptions options{all_replicate(c)};
  for (int64_t d = 0; d < c.rank(0); ++d) options.push_back(uniform(c, Shard(d), Shard(d)));
  if (linear) {
    options.push_back(uniform(c, Partial(ReduceOp::sum), Partial(ReduceOp::sum)));
    options.push_back(uniform(c, Partial(ReduceOp::avg), Partial(ReduceOp::avg)));
  }
  if (order != Order::none) {
    const bool flip = order == Order::decreasing;
    options.push_back(uniform(c, Partial(ReduceOp::max), Partial(flip ? ReduceOp::min : ReduceOp::max)));
    options.push_back(uniform(c, Partial(ReduceOp::min), Partial(flip ? ReduceOp::max : ReduceOp::min)));
  }
  return options;
}

AxisOptions plain_unary(const AxisCtx& c) { return unary(c, false, Order::none); }
AxisOptions increasing_unary(const AxisCtx& c) { return unary(c, false, Order::increasing); }

// Casts between floating types are linear up to one rounding per term; to or from integers
// they are not (truncation), but they keep order.
AxisOptions cast_options(const AxisCtx& c) {
  const bool floats = is_floating(c.in[0].dtype) && is_floating(c.attrs.dtype);
  const bool to_bool = c.attrs.dtype == DType::b8;
  return unary(c, floats, to_bool ? Order::none : Order::increasing);
}

AxisOptions copy_like(const AxisCtx& c) { return unary(c, true, Order::increasing); }

AxisOptions binary(const AxisCtx& c) { return broadcast_options(c, {}); }

}  // namespace

TS_REGISTER_SHARDING_RULE(neg, {.options = [](const AxisCtx& c) { return unary(c, true, Order::decreasing); }});
TS_REGISTER_SHARDING_RULE(exp, {.options = increasing_unary});
TS_REGISTER_SHARDING_RULE(log, {.options = plain_unary});
TS_REGISTER_SHARDING_RULE(sqrt, {.options = plain_unary});
TS_REGISTER_SHARDING_RULE(rsqrt, {.options = plain_unary});
TS_REGISTER_SHARDING_RULE(abs, {.options = plain_unary});
TS_REGISTER_SHARDING_RULE(tanh, {.options = increasing_unary});
TS_REGISTER_SHARDING_RULE(sigmoid, {.options = increasing_unary});
TS_REGISTER_SHARDING_RULE(relu, {.options = increasing_unary});
TS_REGISTER_SHARDING_RULE(gelu, {.options = plain_unary});
// d gelu(x) * grad: linear in grad.
TS_REGISTER_SHARDING_RULE(gelu_backward, {.options = [](const AxisCtx& c) {
  return broadcast_options(c, {{0}});
}});

TS_REGISTER_SHARDING_RULE(add, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{0, 1}}); }});
TS_REGISTER_SHARDING_RULE(sub, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{0, 1}}); }});
TS_REGISTER_SHARDING_RULE(mul, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{0}, {1}}); }});
TS_REGISTER_SHARDING_RULE(div, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{0}}); }});
TS_REGISTER_SHARDING_RULE(pow, {.options = binary});
TS_REGISTER_SHARDING_RULE(maximum, {.options = [](const AxisCtx& c) {
  AxisOptions o = broadcast_options(c, {});
  o.push_back(uniform(c, Partial(ReduceOp::max), Partial(ReduceOp::max)));
  return o;
}});
TS_REGISTER_SHARDING_RULE(minimum, {.options = [](const AxisCtx& c) {
  AxisOptions o = broadcast_options(c, {});
  o.push_back(uniform(c, Partial(ReduceOp::min), Partial(ReduceOp::min)));
  return o;
}});
// where(cond, a, b) is linear in (a, b) together when cond is the same everywhere.
TS_REGISTER_SHARDING_RULE(where, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{1, 2}}); }});
TS_REGISTER_SHARDING_RULE(eq, {.options = binary});
TS_REGISTER_SHARDING_RULE(ne, {.options = binary});
TS_REGISTER_SHARDING_RULE(lt, {.options = binary});
TS_REGISTER_SHARDING_RULE(le, {.options = binary});
TS_REGISTER_SHARDING_RULE(gt, {.options = binary});
TS_REGISTER_SHARDING_RULE(ge, {.options = binary});

TS_REGISTER_SHARDING_RULE(cast, {.options = cast_options});
TS_REGISTER_SHARDING_RULE(to_device, {.options = copy_like});
TS_REGISTER_SHARDING_RULE(clone, {.options = copy_like});
// Linear given the mask; the dispatcher keys the mask by global index (RngView).
TS_REGISTER_SHARDING_RULE(dropout, {.options = [](const AxisCtx& c) { return unary(c, true, Order::none); }});

}  // namespace tessera::parallel
