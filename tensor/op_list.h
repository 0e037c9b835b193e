// The op list: every op Tessera knows, named once. Each layer keys its own table by OpId:
// shape inference (tensor/meta_*.cc), kernels per device (kernels/cpu, kernels/cuda), the
// derivative (autograd/derivatives*.cc) and, later, the sharding rule (parallel/).
//
//   X(name, kind, grad)
//     kind: Compute   - has a kernel per device and shape inference
//           View      - shares storage; shape/stride arithmetic only, no kernel
//           Factory   - no tensor inputs; a kernel per device fills the output
//           Composite - written with other ops in tensor/ops.cc; no kernel, no derivative
//     grad: Diff      - has a derivative (the completeness test checks it)
//           NoDiff    - not differentiable (integer/bool outputs, backward helpers, copy_,
//                       optimizer updates)
//
// Ops ending in _ write into their inputs and return nothing (call_copy_, call_inplace).
//
// Adding an op: one line here, one meta function, one CPU kernel, one derivative (or NoDiff).
#pragma once

#define TS_OP_LIST(X)                                   \
  /* elementwise unary */                               \
  X(neg, Compute, Diff)                                 \
  X(exp, Compute, Diff)                                 \
  X(log, Compute, Diff)                                 \
  X(sqrt, Compute, Diff)                                \
  X(rsqrt, Compute, Diff)                               \
  X(abs, Compute, Diff)                                 \
  X(tanh, Compute, Diff)                                \
  X(sigmoid, Compute, Diff)                             \
  X(relu, Compute, Diff)                                \
  X(gelu, Compute, Diff)                                \
  X(gelu_backward, Compute, NoDiff)                     \
  /* elementwise binary (NumPy broadcasting) */         \
  X(add, Compute, Diff)                                 \
  X(sub, Compute, Diff)                                 \
  X(mul, Compute, Diff)                                 \
  X(div, Compute, Diff)                                 \
  X(pow, Compute, Diff)                                 \
  X(maximum, Compute, Diff)                             \
  X(minimum, Compute, Diff)                             \
  X(where, Compute, Diff)                               \
  X(eq, Compute, NoDiff)                                \
  X(ne, Compute, NoDiff)                                \
  X(lt, Compute, NoDiff)                                \
  X(le, Compute, NoDiff)                                \
  X(gt, Compute, NoDiff)                                \
  X(ge, Compute, NoDiff)                                \
  /* reductions over any dims, keepdim */               \
  X(sum, Compute, Diff)                                 \
  X(mean, Compute, Diff)                                \
  X(max, Compute, Diff)                                 \
  X(argmax, Compute, NoDiff)                            \
  X(var, Compute, Diff)                                 \
  /* linear algebra and fused layers */                 \
  X(matmul, Compute, Diff)                              \
  X(softmax, Compute, Diff)                             \
  X(log_softmax, Compute, Diff)                         \
  X(layer_norm, Compute, Diff)                          \
  X(layer_norm_backward, Compute, NoDiff)               \
  X(cross_entropy, Compute, Diff)                       \
  X(cross_entropy_backward, Compute, NoDiff)            \
  X(dropout, Compute, Diff)                             \
  X(attention, Compute, Diff)                           \
  X(attention_backward, Compute, NoDiff)                \
  X(conv2d, Compute, Diff)                              \
  X(conv2d_backward_input, Compute, NoDiff)             \
  X(conv2d_backward_weight, Compute, NoDiff)            \
  X(max_pool2d, Compute, Diff)                          \
  X(max_pool2d_backward, Compute, NoDiff)               \
  /* indexing */                                        \
  X(embedding, Compute, Diff)                           \
  X(index_select, Compute, Diff)                        \
  X(index_add, Compute, Diff)                           \
  X(gather, Compute, Diff)                              \
  X(scatter_add, Compute, Diff)                         \
  /* joining and splitting */                           \
  X(cat, Compute, Diff)                                 \
  X(stack, Composite, Diff)                             \
  X(split, Composite, Diff)                             \
  /* copies and conversions */                          \
  X(cast, Compute, Diff)                                \
  X(to_device, Compute, Diff)                           \
  X(clone, Compute, Diff)                               \
  X(copy_, Compute, NoDiff)                             \
  /* optimizer updates (in place) */                    \
  X(adamw_, Compute, NoDiff)                            \
  X(sgd_, Compute, NoDiff)                              \
  /* views */                                           \
  X(view, View, Diff)                                   \
  X(permute, View, Diff)                                \
  X(slice, View, Diff)                                  \
  X(expand, View, Diff)                                 \
  X(squeeze, View, Diff)                                \
  X(unsqueeze, View, Diff)                              \
  /* factories */                                       \
  X(full, Factory, NoDiff)                              \
  X(arange, Factory, NoDiff)                            \
  X(rand, Factory, NoDiff)                              \
  X(randn, Factory, NoDiff)                             \
  X(zeros, Composite, NoDiff)                           \
  X(ones, Composite, NoDiff)
