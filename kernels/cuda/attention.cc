// Host glue of attention and attention_backward on CUDA (kernels in attention.cu and
// attention_flash.cu). Operands only need unit stride over the head dim: GPT's q, k, v,
// views of one fused [B, T, 3C] projection, are read in place.
//
//   std::vector<Tensor> o = call(OpId::attention, {q, k, v}, attrs);   // out, lse
#include <cmath>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

// `t` itself when its head dim has unit stride, else a contiguous copy.
Tensor rows_of(const Tensor& t) {
  return t.stride(3) == 1 || t.size(3) == 1 ? t : contiguous_cuda(t);
}

double effective_scale(const Attrs& a, int64_t head_dim) {
  return a.scale != 0.0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

void check_head_dim(const char* op, const Tensor& q) {
  TS_CHECK(q.size(3) <= 256, "{}: head dim {} of {} is over CUDA's limit of 256", op, q.size(3),
           shape_str(q.shape()));
}

void attention_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  check_head_dim("attention", in[0]);
  DeviceGuard guard(d);
  const Tensor q = rows_of(in[0]), k = rows_of(in[1]), v = rows_of(in[2]);
  const double scale = effective_scale(a, q.size(3));
  run_launch("attention", d, [&] {
    launch_attention_forward(dev_tensor(q), dev_tensor(k), dev_tensor(v), dev_tensor(out[0]),
                             dev_tensor(out[1]), scale, a.causal, compute_stream(d));
  });
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
void attention_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                               const Attrs& a) {
  const Device d = in[1].device();
  check_head_dim("attention_backward", in[1]);
  DeviceGuard guard(d);
  const Tensor grad = rows_of(in[0]), q = rows_of(in[1]), k = rows_of(in[2]);
  const Tensor v = rows_of(in[3]), o = rows_of(in[4]);
  const Tensor lse = contiguous_cuda(in[5]);
  const Tensor delta = Tensor::empty(lse.shape(), lse.dtype(), d);
  const double scale = effective_scale(a, q.size(3));
  run_launch("attention_backward", d, [&] {
    launch_attention_backward(dev_tensor(grad), dev_tensor(q), dev_tensor(k), dev_tensor(v),
                              dev_tensor(o), dev_tensor(lse), dev_tensor(delta),
                              dev_tensor(out[0]), dev_tensor(out[1]), dev_tensor(out[2]), scale,
                              a.causal, compute_stream(d));
  });
}

TS_REGISTER_KERNEL(cuda, attention, attention_kernel);
TS_REGISTER_KERNEL(cuda, attention_backward, attention_backward_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
