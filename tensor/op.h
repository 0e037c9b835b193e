// Op identities, attributes and the per-layer tables keyed by OpId.
//
//   std::vector<Tensor> out = call(OpId::layer_norm, {x, w, b}, attrs);  // y, mean, rstd
//   register_kernel(DeviceType::cpu, OpId::add, &add_kernel);            // in kernels/cpu
//
// call() is the single path every op takes: shape inference (which validates and throws
// tessera::Error naming the op), output allocation, the device's kernel, and, when grad
// mode is on and an input requires grad, the autograd hook that records the graph.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

#include "tensor/op_list.h"
#include "tensor/tensor.h"

namespace tessera {

struct OpInfo {
  OpId id;
  std::string_view name;
  OpKind kind;
  bool differentiable;
  OpFamily family;
  OpProps props;
};

const OpInfo& op_info(OpId op);
std::span<const OpInfo> all_ops();
std::string_view op_name(OpId op);

enum class Reduction : uint8_t { mean, sum, none };

// linear's fused activation (gelu: the erf form; gelu_tanh: the tanh approximation).
enum class Activation : uint8_t { none, relu, gelu, gelu_tanh };
std::string_view activation_name(Activation a);

// Where a locally drawn random tensor sits inside the logical tensor whose element indices
// key the RNG: element i of the local block uses the counter of its global index. Empty
// global_shape: the local tensor is the whole logical tensor.
struct RngView {
  Shape global_shape;
  std::vector<int64_t> starts;
};

// Op attributes. One struct for every op keeps kernels, derivatives and sharding
// rules to one signature; each op documents the fields it reads in tensor/ops.h.
struct Attrs {
  Shape shape;                // view/expand target, factory output shape
  std::vector<int64_t> dims;  // reduction dims (empty = all), permute order, squeeze dims
  bool keepdim = false;
  int64_t dim = 0;            // softmax, log_softmax, cat, argmax, index ops, slice, unsqueeze
  bool all_dims = false;      // argmax over the flattened tensor
  int64_t start = 0, end = 0, step = 1;  // slice
  double value = 0.0;                    // full
  double range_start = 0.0, range_end = 0.0, range_step = 1.0;  // arange
  double p = 0.0;                        // dropout probability of zeroing
  bool causal = false;                   // attention: query i attends to keys j <= i
  double scale = 0.0;                    // attention: logits scale (0: 1/sqrt(head dim)); scale_
  int64_t head_dim = 0;                  // attention_qkv: the width of one head
  double eps = 1e-5;                     // layer_norm
  int64_t normalized_ndim = 1;           // layer_norm: trailing dims normalised
  int64_t correction = 1;                // var (1 = unbiased)
  int64_t k = 1;                         // topk: how many values along dim
  bool approximate_tanh = false;         // gelu
  Activation activation = Activation::none;  // linear, linear_act_backward
  Reduction reduction = Reduction::mean; // cross_entropy
  int64_t ignore_index = -100;           // cross_entropy
  std::array<int64_t, 2> kernel_size{1, 1}, stride{1, 1}, padding{0, 0};  // conv2d, pool
  uint64_t seed = 0, offset = 0;         // rand, randn, dropout
  RngView rng_view;                      // rand, randn, dropout
  DType dtype = DType::f32;              // cast target, factory dtype
  Device device = kCPU;                  // to_device target, factory device
  // Optimizer updates (adamw_ also reads eps above).
  double lr = 0.0, weight_decay = 0.0;     // adamw_, sgd_
  double beta1 = 0.9, beta2 = 0.999;       // adamw_
  double momentum = 0.0, dampening = 0.0;  // sgd_
  bool nesterov = false;                   // sgd_
  int64_t step_count = 1;  // 1-based: adamw_'s bias correction; sgd_ seeds its buffer at 1
  // adamw_, adamw8bit_[segments_], sgd_: the gradient is read as grad * grad_scale (the
  // clipping coefficient, optim::clip_grad_norm(Optimizer&, ...)), rounded as scale_ rounds.
  double grad_scale = 1.0;
};

// Shape inference input/output: what a tensor is, without data.
struct TensorSpec {
  Shape shape;
  DType dtype = DType::f32;
  Device device = kCPU;
  bool defined = true;  // false for an absent optional input

  static TensorSpec of(const Tensor& t) {
    if (!t.defined()) return TensorSpec{{}, DType::f32, kCPU, false};
    return TensorSpec{t.shape(), t.dtype(), t.device(), true};
  }
};

// Validates inputs (throwing Error naming the op) and returns the output specs.
using MetaFn = std::vector<TensorSpec> (*)(std::span<const TensorSpec> in, const Attrs& attrs);
// Computes outputs (allocated contiguous by call(), or the destination for copy_).
using KernelFn = void (*)(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs);
// Returns a view of `in` (shape/stride/offset arithmetic only; no autograd).
using ViewFn = Tensor (*)(const Tensor& in, const Attrs& attrs);
// Installed by autograd/: links outputs into the graph.
using GraphRecorder = void (*)(OpId op, std::span<const Tensor> in, std::span<Tensor> out,
                               const Attrs& attrs);

// Observes every kernel call() runs, for per-op profiles: begin == true just before the
// kernel of `op` runs on `device` with `inputs`, false just after (the same inputs). Each
// backend installs one when TESSERA_PROFILE is set (kernels/cpu/profile.cc,
// kernels/cuda/profile.cc).
using KernelObserver = void (*)(OpId op, Device device, bool begin, std::span<const Tensor> inputs);
void set_kernel_observer(KernelObserver observer);
KernelObserver kernel_observer();

void register_meta(OpId op, MetaFn fn);
void register_kernel(DeviceType device, OpId op, KernelFn fn);
void register_view(OpId op, ViewFn fn);
void set_graph_recorder(GraphRecorder recorder);

MetaFn meta_fn(OpId op);
KernelFn kernel_fn(DeviceType device, OpId op);
ViewFn view_fn(OpId op);

// Runs a Compute or Factory op; returns all its outputs.
std::vector<Tensor> call(OpId op, std::vector<Tensor> inputs, const Attrs& attrs = {});
// The first output only.
Tensor call1(OpId op, std::vector<Tensor> inputs, const Attrs& attrs = {});
// Runs a View op: the view plus graph recording.
Tensor call_view(OpId op, const Tensor& input, const Attrs& attrs);
// copy_: writes src into dst in place (no graph; Error if that would lose a gradient).
void call_copy_(const Tensor& dst, const Tensor& src);
// An op that writes into its inputs (adamw_, sgd_): shape inference validates (and returns
// no outputs), the kernel runs with an empty output span, and the storage version of each
// input listed in `written` is bumped. No graph: Error if grad mode is on and an input
// requires grad (optimizers step under NoGradGuard), or if a written input is an expanded
// view.
void call_inplace(OpId op, std::vector<Tensor> inputs, const Attrs& attrs,
                  const std::vector<size_t>& written);

}  // namespace tessera

// The named wrappers of the functor family ops, for a tensor type T with a call1(OpId,
// {inputs}) in scope (Tensor here, parallel::ShardedTensor in parallel/ops.h): f(x) for the
// unary ops, f(a, b) for binary ops and comparisons (bool results). One line in the op list
// names the op on every tensor type.
#define TS_UNARY_WRAPPER(T, name, family, props) \
  inline T name(const T& x) { return call1(::tessera::OpId::name, {x}); }
#define TS_BINARY_WRAPPER(T, name, family, props) \
  inline T name(const T& a, const T& b) { return call1(::tessera::OpId::name, {a, b}); }
#define TS_DEFINE_FAMILY_WRAPPERS(T)     \
  TS_UNARY_OPS(TS_UNARY_WRAPPER, T)      \
  TS_BINARY_OPS(TS_BINARY_WRAPPER, T)    \
  TS_COMPARE_OPS(TS_BINARY_WRAPPER, T)

#define TS_CONCAT_INNER(a, b) a##b
#define TS_CONCAT(a, b) TS_CONCAT_INNER(a, b)

// Static registration from .cc files in libraries built with alwayslink = True.
#define TS_REGISTER_META(op, fn)                                                        \
  static const bool TS_CONCAT(ts_meta_registered_, __LINE__) =                          \
      (::tessera::register_meta(::tessera::OpId::op, fn), true)
#define TS_REGISTER_KERNEL(device, op, fn)                                              \
  static const bool TS_CONCAT(ts_kernel_registered_, __LINE__) =                        \
      (::tessera::register_kernel(::tessera::DeviceType::device, ::tessera::OpId::op, fn), \
       true)
#define TS_REGISTER_VIEW(op, fn)                                                        \
  static const bool TS_CONCAT(ts_view_registered_, __LINE__) =                          \
      (::tessera::register_view(::tessera::OpId::op, fn), true)
