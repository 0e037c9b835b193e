// The op list: every op Tessera knows, named once, with its family. Each layer keys its own
// table by OpId: shape inference (tensor/meta_*.cc), kernels per device (kernels/cpu,
// kernels/cuda), the derivative (autograd/derivatives*.cc) and the sharding rule (parallel/).
//
//   X(name, kind, grad, family, props)
//     kind: Compute   - has a kernel per device and shape inference
//           View      - shares storage; shape/stride arithmetic only, no kernel
//           Factory   - no tensor inputs; a kernel per device fills the output
//           Composite - written with other ops in tensor/ops.cc; no kernel, no derivative
//     grad: Diff      - has a derivative (the completeness test checks it)
//           NoDiff    - not differentiable (integer/bool outputs, backward helpers, copy_,
//                       optimizer updates)
//     family: what the op is, for the tables that treat a family alike (autocast, docs,
//           the coverage table). The functor families (UnaryFloat, UnaryNumeric, Binary,
//           BinaryFloat, Compare) are listed in their own sub-lists below and get
//           everything but the derivative and the test case by default: shape inference,
//           the CPU and CUDA kernels (the scalar functor of the same name in
//           kernels/scalar_ops.h), the sharding rule (from props), the autocast rule and the
//           named wrappers in tensor/ops.h and parallel/ops.h.
//     props: what the sharding rule may assume of a functor op (Partial terms it carries):
//           Linear (Partial sum/avg pass), Increasing / Decreasing (Partial max/min pass,
//           swapped when decreasing), LinearDecreasing; for binary ops LinearBoth (a + b of
//           two Partial sums), LinearEach (a Partial times a Replicate), LinearFirst (a
//           Partial numerator), Max / Min (Partial max/min of both); for any op AlongDim
//           (works along attrs.dim: every input and output may be split on any other dim,
//           the sharding rule of every such op); None.
//
// Ops ending in _ write into their inputs and return nothing (call_copy_, call_inplace).
//
// Adding a functor op (say silu): one line in TS_UNARY_OPS, its functor in
// kernels/scalar_ops.h, its derivative, its test case (tests/reference/op_cases.cc).
// Adding another op: one line in TS_OP_LIST, shape inference, a CPU kernel, a derivative
// (or NoDiff), a sharding rule, its wrapper in tensor/ops.h and its test case.
#pragma once

#include <cstdint>

// Functor families: F(X, name, family, props), every one differentiable but comparisons.
#define TS_UNARY_OPS(F, X)                        \
  F(X, neg, UnaryNumeric, LinearDecreasing)       \
  F(X, exp, UnaryFloat, Increasing)               \
  F(X, log, UnaryFloat, None)                     \
  F(X, sqrt, UnaryFloat, None)                    \
  F(X, rsqrt, UnaryFloat, None)                   \
  F(X, abs, UnaryNumeric, None)                   \
  F(X, tanh, UnaryFloat, Increasing)              \
  F(X, sigmoid, UnaryFloat, Increasing)           \
  F(X, relu, UnaryNumeric, Increasing)            \
  F(X, silu, UnaryFloat, None)

#define TS_BINARY_OPS(F, X)                       \
  F(X, add, Binary, LinearBoth)                   \
  F(X, sub, Binary, LinearBoth)                   \
  F(X, mul, Binary, LinearEach)                   \
  F(X, div, BinaryFloat, LinearFirst)             \
  F(X, pow, Binary, None)                         \
  F(X, maximum, Binary, Max)                      \
  F(X, minimum, Binary, Min)

#define TS_COMPARE_OPS(F, X)                      \
  F(X, eq, Compare, None)                         \
  F(X, ne, Compare, None)                         \
  F(X, lt, Compare, None)                         \
  F(X, le, Compare, None)                         \
  F(X, gt, Compare, None)                         \
  F(X, ge, Compare, None)

#define TS_FUNCTOR_OP_DIFF(X, name, family, props) X(name, Compute, Diff, family, props)
#define TS_FUNCTOR_OP_NODIFF(X, name, family, props) X(name, Compute, NoDiff, family, props)

#define TS_OP_LIST(X)                                             \
  TS_UNARY_OPS(TS_FUNCTOR_OP_DIFF, X)                             \
  X(gelu, Compute, Diff, Pointwise, None)                         \
  X(gelu_backward, Compute, NoDiff, Pointwise, None)              \
  /* binary (NumPy broadcasting) */                               \
  TS_BINARY_OPS(TS_FUNCTOR_OP_DIFF, X)                            \
  X(where, Compute, Diff, Pointwise, None)                        \
  TS_COMPARE_OPS(TS_FUNCTOR_OP_NODIFF, X)                         \
  /* reductions over any dims, keepdim */                         \
  X(sum, Compute, Diff, Reduce, None)                             \
  X(mean, Compute, Diff, Reduce, None)                            \
  X(max, Compute, Diff, Reduce, None)                             \
  X(argmax, Compute, NoDiff, Reduce, None)                        \
  X(var, Compute, Diff, Reduce, None)                             \
  X(sum_squares, Compute, NoDiff, Reduce, None)                   \
  /* linear algebra and fused layers */                           \
  X(matmul, Compute, Diff, Linear, None)                          \
  X(linear, Compute, Diff, Linear, None)                          \
  X(linear_act_backward, Compute, NoDiff, Fused, None)            \
  X(softmax, Compute, Diff, Fused, AlongDim)                      \
  X(log_softmax, Compute, Diff, Fused, AlongDim)                  \
  X(layer_norm, Compute, Diff, Fused, None)                       \
  X(layer_norm_backward, Compute, NoDiff, Fused, None)            \
  X(add_layer_norm, Compute, Diff, Fused, None)                   \
  X(cross_entropy, Compute, Diff, Fused, None)                    \
  X(cross_entropy_backward, Compute, NoDiff, Fused, None)         \
  X(dropout, Compute, Diff, Fused, None)                          \
  X(attention, Compute, Diff, Fused, None)                        \
  X(attention_backward, Compute, NoDiff, Fused, None)             \
  X(attention_qkv, Compute, Diff, Fused, None)                    \
  X(attention_qkv_backward, Compute, NoDiff, Fused, None)         \
  X(conv2d, Compute, Diff, Linear, None)                          \
  X(conv2d_backward_input, Compute, NoDiff, Linear, None)         \
  X(conv2d_backward_weight, Compute, NoDiff, Linear, None)        \
  X(max_pool2d, Compute, Diff, Fused, None)                       \
  X(max_pool2d_backward, Compute, NoDiff, Fused, None)            \
  X(grouped_matmul, Compute, Diff, Linear, None)                  \
  X(grouped_matmul_backward_weight, Compute, NoDiff, Linear, None) \
  /* indexing */                                                  \
  X(embedding, Compute, Diff, Index, None)                        \
  X(index_select, Compute, Diff, Index, None)                     \
  X(index_add, Compute, Diff, Index, None)                        \
  X(gather, Compute, Diff, Index, None)                           \
  X(scatter_add, Compute, Diff, Index, None)                      \
  X(topk, Compute, Diff, Index, AlongDim)                         \
  X(counting_sort, Compute, NoDiff, Index, None)                  \
  /* joining and splitting */                                     \
  X(cat, Compute, Diff, Join, None)                               \
  X(stack, Composite, Diff, Join, None)                           \
  X(split, Composite, Diff, Join, None)                           \
  /* copies and conversions */                                    \
  X(cast, Compute, Diff, Copy, None)                              \
  X(to_device, Compute, Diff, Copy, None)                         \
  X(clone, Compute, Diff, Copy, None)                             \
  X(copy_, Compute, NoDiff, Copy, None)                           \
  X(sign_pack, Compute, NoDiff, Copy, None)                       \
  X(sign_unpack, Compute, NoDiff, Copy, None)                     \
  /* optimizer updates (in place) */                              \
  X(adamw_, Compute, NoDiff, InplaceUpdate, None)                 \
  X(adamw8bit_, Compute, NoDiff, InplaceUpdate, None)             \
  X(adamw8bit_segments_, Compute, NoDiff, InplaceUpdate, None)    \
  X(sgd_, Compute, NoDiff, InplaceUpdate, None)                   \
  X(adafactor_stats_, Compute, NoDiff, InplaceUpdate, None)       \
  X(adafactor_norm_, Compute, NoDiff, InplaceUpdate, None)        \
  X(adafactor_apply_, Compute, NoDiff, InplaceUpdate, None)       \
  X(scale_, Compute, NoDiff, InplaceUpdate, None)                 \
  /* views */                                                     \
  X(view, View, Diff, View, None)                                 \
  X(permute, View, Diff, View, None)                              \
  X(slice, View, Diff, View, None)                                \
  X(expand, View, Diff, View, None)                               \
  X(squeeze, View, Diff, View, None)                              \
  X(unsqueeze, View, Diff, View, None)                            \
  /* factories */                                                 \
  X(full, Factory, NoDiff, Factory, None)                         \
  X(arange, Factory, NoDiff, Factory, None)                       \
  X(rand, Factory, NoDiff, Factory, None)                         \
  X(randn, Factory, NoDiff, Factory, None)                        \
  X(zeros, Composite, NoDiff, Factory, None)                      \
  X(ones, Composite, NoDiff, Factory, None)

namespace tessera {

enum class OpId : uint16_t {
#define TS_OP_ENUM(name, kind, grad, family, props) name,
  TS_OP_LIST(TS_OP_ENUM)
#undef TS_OP_ENUM
};

#define TS_OP_COUNT(name, kind, grad, family, props) +1
inline constexpr int kNumOps = 0 TS_OP_LIST(TS_OP_COUNT);
#undef TS_OP_COUNT

enum class OpKind : uint8_t { Compute, View, Factory, Composite };

enum class OpFamily : uint8_t {
  UnaryFloat, UnaryNumeric, Binary, BinaryFloat, Compare,  // functor families
  Pointwise,      // elementwise with its own kernel (attributes, three inputs)
  Reduce, Linear, Fused, Index, Join, Copy, InplaceUpdate, View, Factory,
};

enum class OpProps : uint8_t {
  None, Linear, Increasing, Decreasing, LinearDecreasing,  // unary
  LinearBoth, LinearEach, LinearFirst, Max, Min,           // binary
  AlongDim,                                                // any op along attrs.dim
};

constexpr bool is_functor_family(OpFamily f) { return f <= OpFamily::Compare; }

}  // namespace tessera
