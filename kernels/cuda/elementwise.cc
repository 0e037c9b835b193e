// CUDA kernels of the elementwise ops (the device code is elementwise.cu): every functor
// family op of the op list (unary, binary with broadcasting, comparisons), gelu,
// gelu_backward and where.
//
//   Tensor y = exp(x.to(cuda(0)));         // runs launch_unary(OpId::exp, ...)
//   Tensor z = y * 2.0;                     // the 0-d CPU scalar 2.0 travels by value
//
// Dispatch lets 0-d CPU tensors join CUDA tensors as scalars (as PyTorch does); their element
// is read here on the host and passed in the kernel's arguments, so no copy to the device
// and no synchronisation is needed.
#include <cstring>

#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

EwOperand operand(const Tensor& t, const Shape& shape) {
  EwOperand o;
  if (t.device().is_cpu()) {  // a 0-d scalar (dispatch allows only those off the device)
    o.mode = kEwHostScalar;
    o.t.dtype = static_cast<int>(t.dtype());
    std::memcpy(&o.bits, t.raw_data(), static_cast<size_t>(dtype_size(t.dtype())));
    return o;
  }
  o.t = dev_tensor_broadcast(t, shape);
  o.mode = t.numel() == 1 ? kEwDeviceScalar : kEwTensor;
  return o;
}

template <OpId op>
void unary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand x = operand(in[0], y.shape());
  run_launch(op_name(op), y.device(), [&] { launch_unary(op, d, x, compute_stream(y.device())); });
}

void gelu_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand x = operand(in[0], y.shape());
  run_launch("gelu", y.device(),
             [&] { launch_gelu(a.approximate_tanh, d, x, compute_stream(y.device())); });
}

template <OpId op>
void binary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand a = operand(in[0], y.shape()), b = operand(in[1], y.shape());
  run_launch(op_name(op), y.device(), [&] { launch_binary(op, d, a, b, compute_stream(y.device())); });
}

void gelu_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand grad = operand(in[0], y.shape()), x = operand(in[1], y.shape());
  run_launch("gelu_backward", y.device(), [&] {
    launch_gelu_backward(attrs.approximate_tanh, d, grad, x, compute_stream(y.device()));
  });
}

void where_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand c = operand(in[0], y.shape()), a = operand(in[1], y.shape()),
                  b = operand(in[2], y.shape());
  run_launch("where", y.device(), [&] { launch_where(d, c, a, b, compute_stream(y.device())); });
}

// Every functor family op, from the op list.
#define TS_CUDA_UNARY(_, name, family, props) \
  register_kernel(DeviceType::cuda, OpId::name, &unary_kernel<OpId::name>);
#define TS_CUDA_BINARY(_, name, family, props) \
  register_kernel(DeviceType::cuda, OpId::name, &binary_kernel<OpId::name>);
const bool kFamiliesRegistered = [] {
  TS_UNARY_OPS(TS_CUDA_UNARY, _)
  TS_BINARY_OPS(TS_CUDA_BINARY, _)
  TS_COMPARE_OPS(TS_CUDA_BINARY, _)
  return true;
}();
#undef TS_CUDA_UNARY
#undef TS_CUDA_BINARY

TS_REGISTER_KERNEL(cuda, gelu, gelu_kernel);
TS_REGISTER_KERNEL(cuda, gelu_backward, gelu_backward_kernel);
TS_REGISTER_KERNEL(cuda, where, where_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
