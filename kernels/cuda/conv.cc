// CUDA conv2d (NCHW) and its input and weight gradients through cuDNN's convolution API
// (cudnnConvolutionForward / BackwardData / BackwardFilter), the bias added by conv.cu.
//
//   f32:      f32 compute; TF32 tensor cores only when allow_tf32() (else FMA math only)
//   f64:      f64 compute
//   f16/bf16: f32 compute on tensor cores (cuDNN's "pseudo half" configurations)
//
// The algorithm is picked once per (shape, stride, padding, dtype, math mode) from cuDNN's
// heuristics (cudnnGetConvolution*Algorithm_v7, no benchmarking, so no device sync), as the
// first result that succeeds, is deterministic, keeps to the math mode above and needs at
// most 1 GiB of workspace; the workspace comes from the caching allocator. Deterministic
// algorithms are required for the backward passes (so BWD_DATA_ALGO_0 and
// BWD_FILTER_ALGO_0/3, which accumulate with atomics, are never used) and preferred forward.
//
// f16/bf16 with a bias run in f32 (inputs widened, bias added in f32, one rounding at the
// end), as the CPU does: cuDNN would round the convolution and the bias add would round
// again. Sums run in cuDNN's order, so results agree to rounding, not bit for bit.
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/conv.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

enum class Pass : int { forward, backward_data, backward_filter };

constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;

struct ConvKey {
  int device, dtype, pass, math;
  int n, c, h, w, o, kh, kw, sh, sw, ph, pw;
  bool operator==(const ConvKey& k) const { return std::memcmp(this, &k, sizeof(*this)) == 0; }
};
struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    size_t h = 1469598103934665603ull;  // FNV-1a (the key is all ints: no padding)
    for (size_t i = 0; i < sizeof(k); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

// Descriptors and chosen algorithm of one convolution pass, built once and kept; cuDNN
// only reads them, so concurrent calls may share a plan.
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  int algo = 0;  // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t of the pass
  size_t workspace = 0;
};

cudnnDataType_t cudnn_dtype(DType dt) {
  switch (dt) {
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: return CUDNN_DATA_FLOAT;
  }
}

cudnnMathType_t math_for(DType dt) {
  if (dt == DType::f64) return CUDNN_DEFAULT_MATH;
  if (dt == DType::f32) return allow_tf32() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
  return CUDNN_TENSOR_OP_MATH;
}

// Whether a heuristic result keeps to the math mode we asked for: f32 without TF32 must not
// touch tensor cores, and nothing may convert its inputs down (ALLOW_CONVERSION would read
// f32 or bf16 data as f16).
bool math_ok(DType dt, cudnnMathType_t asked, cudnnMathType_t got) {
  if (got == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) return false;
  if (dt == DType::f32 && asked == CUDNN_FMA_MATH) return got != CUDNN_TENSOR_OP_MATH;
  return true;
}

// Picks the first acceptable result of a heuristic list (sorted best first): deterministic
// (for the backward passes) or, forward only, any as a last resort.
template <typename Perf>
const Perf* choose(const std::vector<Perf>& results, int count, DType dt, cudnnMathType_t asked,
                   bool must_be_deterministic) {
  for (int strict = 1; strict >= 0; --strict) {
    if (!strict && must_be_deterministic) break;
    for (int i = 0; i < count; ++i) {
      const Perf& r = results[i];
      if (r.status != CUDNN_STATUS_SUCCESS || !math_ok(dt, asked, r.mathType) ||
          r.memory > kMaxWorkspaceBytes) {
        continue;
      }
      if (strict && r.determinism != CUDNN_DETERMINISTIC) continue;
      return &r;
    }
  }
  return nullptr;
}

struct Geometry {
  int n, c, h, w, o, kh, kw, oh, ow;
};

int to_int(int64_t v, const char* op) {
  TS_CHECK(v >= 0 && v <= INT_MAX, "{}: size {} is beyond what cuDNN takes", op, v);
  return static_cast<int>(v);
}

std::unique_ptr<ConvPlan> build_plan(Pass pass, const char* op, const Geometry& g, const Attrs& a, DType dt,
                                     cudnnHandle_t handle, Device d) {
  auto plan = std::make_unique<ConvPlan>();
  const cudnnDataType_t cdt = cudnn_dtype(dt);
  cudnn_check(cudnnCreateTensorDescriptor(&plan->x), op, "cudnnCreateTensorDescriptor", d);
  cudnn_check(cudnnCreateTensorDescriptor(&plan->y), op, "cudnnCreateTensorDescriptor", d);
  cudnn_check(cudnnCreateFilterDescriptor(&plan->w), op, "cudnnCreateFilterDescriptor", d);
  cudnn_check(cudnnCreateConvolutionDescriptor(&plan->conv), op, "cudnnCreateConvolutionDescriptor", d);
  cudnn_check(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NCHW, cdt, g.n, g.c, g.h, g.w), op,
              "cudnnSetTensor4dDescriptor (input)", d);
  cudnn_check(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NCHW, cdt, g.n, g.o, g.oh, g.ow), op,
              "cudnnSetTensor4dDescriptor (output)", d);
  cudnn_check(cudnnSetFilter4dDescriptor(plan->w, cdt, CUDNN_TENSOR_NCHW, g.o, g.c, g.kh, g.kw), op,
              "cudnnSetFilter4dDescriptor", d);
  cudnn_check(cudnnSetConvolution2dDescriptor(plan->conv, to_int(a.padding[0], op), to_int(a.padding[1], op),
                                              to_int(a.stride[0], op), to_int(a.stride[1], op), 1, 1,
                                              CUDNN_CROSS_CORRELATION,
                                              dt == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT),
              op, "cudnnSetConvolution2dDescriptor", d);
  const cudnnMathType_t asked = math_for(dt);
  cudnn_check(cudnnSetConvolutionMathType(plan->conv, asked), op, "cudnnSetConvolutionMathType", d);

  cudnnMathType_t math = asked;
  if (pass == Pass::forward) {
    int max = 0, count = 0;
    cudnn_check(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &max), op, "algorithm count", d);
    std::vector<cudnnConvolutionFwdAlgoPerf_t> r(std::max(max, 1));
    cudnn_check(cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x, plan->w, plan->conv, plan->y, max, &count,
                                                       r.data()),
                op, "cudnnGetConvolutionForwardAlgorithm_v7", d);
    const auto* best = choose(r, count, dt, asked, /*must_be_deterministic=*/false);
    TS_CHECK(best != nullptr, "{}: cuDNN offers no algorithm for {} input [{}, {}, {}, {}], weight [{}, {}, {}, {}]",
             op, dt, g.n, g.c, g.h, g.w, g.o, g.c, g.kh, g.kw);
    plan->algo = best->algo;
    math = best->mathType;
  } else if (pass == Pass::backward_data) {
    int max = 0, count = 0;
    cudnn_check(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &max), op, "algorithm count", d);
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> r(std::max(max, 1));
    cudnn_check(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->conv, plan->x, max,
                                                            &count, r.data()),
                op, "cudnnGetConvolutionBackwardDataAlgorithm_v7", d);
    const auto* best = choose(r, count, dt, asked, /*must_be_deterministic=*/true);
    TS_CHECK(best != nullptr, "{}: cuDNN offers no deterministic algorithm for {} input [{}, {}, {}, {}], "
             "weight [{}, {}, {}, {}]", op, dt, g.n, g.c, g.h, g.w, g.o, g.c, g.kh, g.kw);
    plan->algo = best->algo;
    math = best->mathType;
  } else {
    int max = 0, count = 0;
    cudnn_check(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &max), op, "algorithm count", d);
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> r(std::max(max, 1));
    cudnn_check(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x, plan->y, plan->conv, plan->w, max,
                                                              &count, r.data()),
                op, "cudnnGetConvolutionBackwardFilterAlgorithm_v7", d);
    const auto* best = choose(r, count, dt, asked, /*must_be_deterministic=*/true);
    TS_CHECK(best != nullptr, "{}: cuDNN offers no deterministic algorithm for {} input [{}, {}, {}, {}], "
             "weight [{}, {}, {}, {}]", op, dt, g.n, g.c, g.h, g.w, g.o, g.c, g.kh, g.kw);
    plan->algo = best->algo;
    math = best->mathType;
  }
  // The descriptor's math mode is the one the chosen algorithm was rated with.
  cudnn_check(cudnnSetConvolutionMathType(plan->conv, math), op, "cudnnSetConvolutionMathType", d);
  size_t ws = 0;
  if (pass == Pass::forward) {
    cudnn_check(cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x, plan->w, plan->conv, plan->y,
                                                        static_cast<cudnnConvolutionFwdAlgo_t>(plan->algo), &ws),
                op, "cudnnGetConvolutionForwardWorkspaceSize", d);
  } else if (pass == Pass::backward_data) {
    cudnn_check(cudnnGetConvolutionBackwardDataWorkspaceSize(
                    handle, plan->w, plan->y, plan->conv, plan->x,
                    static_cast<cudnnConvolutionBwdDataAlgo_t>(plan->algo), &ws),
                op, "cudnnGetConvolutionBackwardDataWorkspaceSize", d);
  } else {
    cudnn_check(cudnnGetConvolutionBackwardFilterWorkspaceSize(
                    handle, plan->x, plan->y, plan->conv, plan->w,
                    static_cast<cudnnConvolutionBwdFilterAlgo_t>(plan->algo), &ws),
                op, "cudnnGetConvolutionBackwardFilterWorkspaceSize", d);
  }
  plan->workspace = ws;
  return plan;
}

const ConvPlan& plan_for(Pass pass, const char* op, const Geometry& g, const Attrs& a, DType dt, cudnnHandle_t h,
                         Device d) {
  ConvKey key{d.index, static_cast<int>(dt), static_cast<int>(pass), static_cast<int>(math_for(dt)),
              g.n, g.c, g.h, g.w, g.o, g.kh, g.kw,
              to_int(a.stride[0], op), to_int(a.stride[1], op), to_int(a.padding[0], op), to_int(a.padding[1], op)};
  static std::mutex mu;
  static auto* plans = new std::unordered_map<ConvKey, std::unique_ptr<ConvPlan>, ConvKeyHash>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, build_plan(pass, op, g, a, dt, h, d)).first;
  return *it->second;
}

Geometry geometry(const Shape& x, const Shape& w, const Shape& y, const char* op) {
  for (const Shape* s : {&x, &w, &y}) {
    TS_CHECK(numel_of(*s) <= INT_MAX, "{}: tensor of shape {} has more elements than cuDNN takes", op,
             shape_str(*s));
  }
  return {to_int(x[0], op), to_int(x[1], op), to_int(x[2], op), to_int(x[3], op), to_int(w[0], op),
          to_int(w[2], op), to_int(w[3], op), to_int(y[2], op), to_int(y[3], op)};
}

// The device buffer cuDNN's chosen algorithm needs (from the caching allocator: freed when
// the kernel returns, reused only after the stream has passed this work).
Tensor workspace_for(const ConvPlan& plan, Device d) {
  return Tensor::empty({static_cast<int64_t>((plan.workspace + 7) / 8)}, DType::i64, d);
}

struct Scalars {
  double one_d = 1.0, zero_d = 0.0;
  float one_f = 1.0f, zero_f = 0.0f;
  const void* one(DType dt) const { return dt == DType::f64 ? static_cast<const void*>(&one_d) : &one_f; }
  const void* zero(DType dt) const { return dt == DType::f64 ? static_cast<const void*>(&zero_d) : &zero_f; }
};

void zero_fill(const Tensor& t, const char* op) {
  cuda_check(cudaMemsetAsync(t.raw_data(), 0, static_cast<size_t>(t.nbytes()), compute_stream(t.device())), op,
             t.device());
}

void conv2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const char* op = "conv2d";
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  const Device d = y.device();
  DeviceGuard guard(d);
  const DType dt = y.dtype();
  if ((dt == DType::f16 || dt == DType::bf16) && in[2].defined()) {
    auto widened = [&](const Tensor& t) {
      Tensor w = Tensor::empty(t.shape(), DType::f32, d);
      copy_cuda(w, t);
      return w;
    };
    const Tensor in32[3] = {widened(in[0]), widened(in[1]), widened(in[2])};
    Tensor out32[1] = {Tensor::empty(y.shape(), DType::f32, d)};
    conv2d_kernel(in32, out32, a);
    copy_cuda(y, out32[0]);
    return;
  }
  if (in[0].numel() == 0) {
    zero_fill(y, op);  // no input channels (an empty shard): the bias alone
  } else {
    const Tensor x = contiguous_cuda(in[0]), w = contiguous_cuda(in[1]);
    const Geometry g = geometry(x.shape(), w.shape(), y.shape(), op);
    CudnnLease h(d);
    const ConvPlan& plan = plan_for(Pass::forward, op, g, a, dt, h.get(), d);
    const Tensor ws = workspace_for(plan, d);
    const Scalars s;
    cudnn_check(cudnnConvolutionForward(h.get(), s.one(dt), plan.x, x.raw_data(), plan.w, w.raw_data(), plan.conv,
                                        static_cast<cudnnConvolutionFwdAlgo_t>(plan.algo), ws.raw_data(),
                                        plan.workspace, s.zero(dt), plan.y, y.raw_data()),
                op, "cudnnConvolutionForward", d);
  }
  if (in[2].defined()) {
    const Tensor bias = contiguous_cuda(in[2]);
    const DevTensor yd = dev_tensor(y), bd = dev_tensor(bias);
    run_launch(op, d, [&] { launch_conv_bias(yd, bd, compute_stream(d)); });
  }
}

// Inputs: grad [N, O, OH, OW], weight; attrs.shape = input shape.
void conv2d_backward_input_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const char* op = "conv2d_backward_input";
  const Tensor& dx = out[0];
  if (dx.numel() == 0) return;
  const Device d = dx.device();
  DeviceGuard guard(d);
  if (in[0].numel() == 0 || in[1].numel() == 0) return zero_fill(dx, op);
  const DType dt = dx.dtype();
  const Tensor gy = contiguous_cuda(in[0]), w = contiguous_cuda(in[1]);
  const Geometry g = geometry(dx.shape(), w.shape(), gy.shape(), op);
  CudnnLease h(d);
  const ConvPlan& plan = plan_for(Pass::backward_data, op, g, a, dt, h.get(), d);
  const Tensor ws = workspace_for(plan, d);
  const Scalars s;
  cudnn_check(cudnnConvolutionBackwardData(h.get(), s.one(dt), plan.w, w.raw_data(), plan.y, gy.raw_data(), plan.conv,
                                           static_cast<cudnnConvolutionBwdDataAlgo_t>(plan.algo), ws.raw_data(),
                                           plan.workspace, s.zero(dt), plan.x, dx.raw_data()),
              op, "cudnnConvolutionBackwardData", d);
}

// Inputs: grad [N, O, OH, OW], input; attrs.shape = weight shape.
void conv2d_backward_weight_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const char* op = "conv2d_backward_weight";
  const Tensor& dw = out[0];
  if (dw.numel() == 0) return;
  const Device d = dw.device();
  DeviceGuard guard(d);
  if (in[0].numel() == 0 || in[1].numel() == 0) return zero_fill(dw, op);
  const DType dt = dw.dtype();
  const Tensor gy = contiguous_cuda(in[0]), x = contiguous_cuda(in[1]);
  const Geometry g = geometry(x.shape(), dw.shape(), gy.shape(), op);
  CudnnLease h(d);
  const ConvPlan& plan = plan_for(Pass::backward_filter, op, g, a, dt, h.get(), d);
  const Tensor ws = workspace_for(plan, d);
  const Scalars s;
  cudnn_check(cudnnConvolutionBackwardFilter(h.get(), s.one(dt), plan.x, x.raw_data(), plan.y, gy.raw_data(),
                                             plan.conv, static_cast<cudnnConvolutionBwdFilterAlgo_t>(plan.algo),
                                             ws.raw_data(), plan.workspace, s.zero(dt), plan.w, dw.raw_data()),
              op, "cudnnConvolutionBackwardFilter", d);
}

TS_REGISTER_KERNEL(cuda, conv2d, conv2d_kernel);
TS_REGISTER_KERNEL(cuda, conv2d_backward_input, conv2d_backward_input_kernel);
TS_REGISTER_KERNEL(cuda, conv2d_backward_weight, conv2d_backward_weight_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
