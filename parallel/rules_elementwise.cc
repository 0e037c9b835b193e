// Sharding rules: elementwise ops, casts and copies, dropout.
//
// Elementwise work keeps any Shard of the broadcast output (inputs that broadcast a dim hold
// it whole). Partial terms pass through what is linear in them: add/sub of two Partial sums,
// mul by a Replicate factor, div of a Partial numerator, where with a Replicate condition,
// dropout (its mask is keyed by the global index, so equal on every term). Functions that
// keep order (exp, tanh, sigmoid, relu, casts) also carry Partial max/min, neg swaps them.
// The functor family ops get their rule from their props column in tensor/op_list.h.
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

// Casts between floating types are linear up to one rounding per term; to or from integers
// they are not (truncation), but they keep order.
AxisOptions cast_options(const AxisCtx& c) {
  const bool floats = is_floating(c.in[0].dtype) && is_floating(c.attrs.dtype);
  const bool to_bool = c.attrs.dtype == DType::b8;
  return unary(c, floats, to_bool ? Order::none : Order::increasing);
}

AxisOptions copy_like(const AxisCtx& c) { return unary(c, true, Order::increasing); }

AxisOptions unary_family(const AxisCtx& c, OpProps props) {
  switch (props) {
    case OpProps::Linear: return unary(c, true, Order::none);
    case OpProps::Increasing: return unary(c, false, Order::increasing);
    case OpProps::Decreasing: return unary(c, false, Order::decreasing);
    case OpProps::LinearDecreasing: return unary(c, true, Order::decreasing);
    default: return unary(c, false, Order::none);
  }
}

AxisOptions binary_family(const AxisCtx& c, OpProps props) {
  switch (props) {
    case OpProps::LinearBoth: return broadcast_options(c, {{0, 1}});
    case OpProps::LinearEach: return broadcast_options(c, {{0}, {1}});
    case OpProps::LinearFirst: return broadcast_options(c, {{0}});
    case OpProps::Max:
    case OpProps::Min: {
      const ReduceOp r = props == OpProps::Max ? ReduceOp::max : ReduceOp::min;
      AxisOptions o = broadcast_options(c, {});
      o.push_back(uniform(c, Partial(r), Partial(r)));
      return o;
    }
    default: return broadcast_options(c, {});
  }
}

// The functor families, from the op list.
#define TS_RULE_UNARY(_, name, family, props)                                     \
  register_sharding_rule(OpId::name, ShardingRule{.options = [](const AxisCtx& c) { \
                           return unary_family(c, OpProps::props);                  \
                         }});
#define TS_RULE_BINARY(_, name, family, props)                                    \
  register_sharding_rule(OpId::name, ShardingRule{.options = [](const AxisCtx& c) { \
                           return binary_family(c, OpProps::props);                 \
                         }});
const bool kFamiliesRegistered = [] {
  TS_UNARY_OPS(TS_RULE_UNARY, _)
  TS_BINARY_OPS(TS_RULE_BINARY, _)
  TS_COMPARE_OPS(TS_RULE_BINARY, _)
  return true;
}();
#undef TS_RULE_UNARY
#undef TS_RULE_BINARY

}  // namespace

TS_REGISTER_SHARDING_RULE(gelu, {.options = plain_unary});
// d gelu(x) * grad: linear in grad.
TS_REGISTER_SHARDING_RULE(gelu_backward, {.options = [](const AxisCtx& c) {
  return broadcast_options(c, {{0}});
}});

// where(cond, a, b) is linear in (a, b) together when cond is the same everywhere.
TS_REGISTER_SHARDING_RULE(where, {.options = [](const AxisCtx& c) { return broadcast_options(c, {{1, 2}}); }});

TS_REGISTER_SHARDING_RULE(cast, {.options = cast_options});
TS_REGISTER_SHARDING_RULE(to_device, {.options = copy_like});
TS_REGISTER_SHARDING_RULE(clone, {.options = copy_like});
// Linear given the mask; the dispatcher keys the mask by global index (RngView).
TS_REGISTER_SHARDING_RULE(dropout, {.options = [](const AxisCtx& c) { return unary(c, true, Order::none); }});

}  // namespace tessera::parallel
