// Host glue of attention and attention_backward on CUDA (kernels in attention.cu and
// attention_flash.cu). Operands only need unit stride over the head dim: q, k, v as views
// of one projection are read in place, and the kernels write out, dq, dk and dv through
// their strides, so attention_qkv runs them on views of its packed [3, B, T, C] input and
// gradient and of its [B, T, C] output.
//
//   std::vector<Tensor> o = call(OpId::attention, {q, k, v}, attrs);   // out, lse
#include <array>
#include <cmath>

#include "kernels/cpu/util.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/grad_mode.h"
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

// q, k, v, out [B, H, T, D] (out written through its strides), lse [B, H, T].
void run_forward(const char* op, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                 const Tensor& out, const Tensor& lse, const Attrs& a) {
  const Device d = q_in.device();
  check_head_dim(op, q_in);
  DeviceGuard guard(d);
  const Tensor q = rows_of(q_in), k = rows_of(k_in), v = rows_of(v_in);
  const double scale = effective_scale(a, q.size(3));
  run_launch(op, d, [&] {
    launch_attention_forward(dev_tensor(q), dev_tensor(k), dev_tensor(v), dev_tensor(out),
                             dev_tensor(lse), scale, a.causal, compute_stream(d));
  });
}

// in: grad, q, k, v, out, lse; grads: dq, dk, dv (written through their strides).
void run_backward(const char* op, const std::array<Tensor, 6>& in, const std::array<Tensor, 3>& grads,
                  const Attrs& a) {
  const Device d = in[1].device();
  check_head_dim(op, in[1]);
  DeviceGuard guard(d);
  const Tensor grad = rows_of(in[0]), q = rows_of(in[1]), k = rows_of(in[2]);
  const Tensor v = rows_of(in[3]), o = rows_of(in[4]);
  const Tensor lse = contiguous_cuda(in[5]);
  const Tensor delta = Tensor::empty(lse.shape(), lse.dtype(), d);
  const double scale = effective_scale(a, q.size(3));
  run_launch(op, d, [&] {
    launch_attention_backward(dev_tensor(grad), dev_tensor(q), dev_tensor(k), dev_tensor(v),
                              dev_tensor(o), dev_tensor(lse), dev_tensor(delta),
                              dev_tensor(grads[0]), dev_tensor(grads[1]), dev_tensor(grads[2]),
                              scale, a.causal, compute_stream(d));
  });
}

void attention_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  run_forward("attention", in[0], in[1], in[2], out[0], out[1], a);
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
void attention_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                               const Attrs& a) {
  run_backward("attention_backward", {in[0], in[1], in[2], in[3], in[4], in[5]},
               {out[0], out[1], out[2]}, a);
}

// The kernels below take their views (cpu::attention_heads) under NoGradGuard: the inputs
// may require grad, and a view made with grad on would be recorded.
void attention_qkv_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  NoGradGuard no_grad;
  const Tensor qkv = contiguous_cuda(in[0]);
  const int64_t hd = a.head_dim;
  run_forward("attention_qkv", cpu::attention_heads(qkv, 0, hd), cpu::attention_heads(qkv, 1, hd),
              cpu::attention_heads(qkv, 2, hd), cpu::attention_heads(out[0], hd), out[1], a);
}

// Inputs: grad [B, T, C], qkv, out [B, T, C], lse. Output: grad_qkv [3, B, T, C].
void attention_qkv_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  NoGradGuard no_grad;
  const Tensor grad = contiguous_cuda(in[0]), qkv = contiguous_cuda(in[1]);
  const Tensor o = contiguous_cuda(in[2]);
  const int64_t hd = a.head_dim;
  run_backward("attention_qkv_backward",
               {cpu::attention_heads(grad, hd), cpu::attention_heads(qkv, 0, hd),
                cpu::attention_heads(qkv, 1, hd), cpu::attention_heads(qkv, 2, hd),
                cpu::attention_heads(o, hd), in[3]},
               {cpu::attention_heads(out[0], 0, hd), cpu::attention_heads(out[0], 1, hd),
                cpu::attention_heads(out[0], 2, hd)},
               a);
}

TS_REGISTER_KERNEL(cuda, attention, attention_kernel);
TS_REGISTER_KERNEL(cuda, attention_backward, attention_backward_kernel);
TS_REGISTER_KERNEL(cuda, attention_qkv, attention_qkv_kernel);
TS_REGISTER_KERNEL(cuda, attention_qkv_backward, attention_qkv_backward_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
