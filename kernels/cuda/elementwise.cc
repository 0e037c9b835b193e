// CUDA kernels of the elementwise ops (the device code is elementwise.cu): unary ops, binary
// ops with broadcasting, comparisons, where and gelu_backward, registered against the op list.
//
//   Tensor y = gelu(x.to(cuda(0)));        // runs launch_unary(UnaryOp::gelu, ...)
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

template <OpId id, UnaryOp op>
void unary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand x = operand(in[0], y.shape());
  run_launch(op_name(id), y.device(), [&] { launch_unary(op, d, x, compute_stream(y.device())); });
}

void gelu_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand x = operand(in[0], y.shape());
  const UnaryOp op = a.approximate_tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu;
  run_launch("gelu", y.device(), [&] { launch_unary(op, d, x, compute_stream(y.device())); });
}

// Integers to negative powers throw on the CPU; a host scalar exponent is checked here (a
// device exponent cannot be without a synchronisation, see Pow in elementwise.cu).
void check_integer_pow(const Tensor& base, const Tensor& exponent) {
  if (!exponent.device().is_cpu() || !is_integral(exponent.dtype())) return;
  int64_t e = 0;
  if (exponent.dtype() == DType::i32) e = *static_cast<const int32_t*>(exponent.raw_data());
  else if (exponent.dtype() == DType::i64) e = *static_cast<const int64_t*>(exponent.raw_data());
  if (e < 0) {
    fail("pow: integers to negative integer powers are not allowed ({} {} ** {})",
         base.dtype(), shape_str(base.shape()), e);
  }
}

template <OpId id, BinaryOp op>
void binary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if constexpr (op == BinaryOp::pow) check_integer_pow(in[0], in[1]);
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand a = operand(in[0], y.shape()), b = operand(in[1], y.shape());
  run_launch(op_name(id), y.device(), [&] { launch_binary(op, d, a, b, compute_stream(y.device())); });
}

void gelu_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const EwOperand grad = operand(in[0], y.shape()), x = operand(in[1], y.shape());
  const BinaryOp op = attrs.approximate_tanh ? BinaryOp::gelu_tanh_backward : BinaryOp::gelu_backward;
  run_launch("gelu_backward", y.device(),
             [&] { launch_binary(op, d, grad, x, compute_stream(y.device())); });
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

TS_REGISTER_KERNEL(cuda, neg, (unary_kernel<OpId::neg, UnaryOp::neg>));
TS_REGISTER_KERNEL(cuda, exp, (unary_kernel<OpId::exp, UnaryOp::exp>));
TS_REGISTER_KERNEL(cuda, log, (unary_kernel<OpId::log, UnaryOp::log>));
TS_REGISTER_KERNEL(cuda, sqrt, (unary_kernel<OpId::sqrt, UnaryOp::sqrt>));
TS_REGISTER_KERNEL(cuda, rsqrt, (unary_kernel<OpId::rsqrt, UnaryOp::rsqrt>));
TS_REGISTER_KERNEL(cuda, abs, (unary_kernel<OpId::abs, UnaryOp::abs>));
TS_REGISTER_KERNEL(cuda, tanh, (unary_kernel<OpId::tanh, UnaryOp::tanh>));
TS_REGISTER_KERNEL(cuda, sigmoid, (unary_kernel<OpId::sigmoid, UnaryOp::sigmoid>));
TS_REGISTER_KERNEL(cuda, relu, (unary_kernel<OpId::relu, UnaryOp::relu>));
TS_REGISTER_KERNEL(cuda, gelu, gelu_kernel);
TS_REGISTER_KERNEL(cuda, gelu_backward, gelu_backward_kernel);
TS_REGISTER_KERNEL(cuda, add, (binary_kernel<OpId::add, BinaryOp::add>));
TS_REGISTER_KERNEL(cuda, sub, (binary_kernel<OpId::sub, BinaryOp::sub>));
TS_REGISTER_KERNEL(cuda, mul, (binary_kernel<OpId::mul, BinaryOp::mul>));
TS_REGISTER_KERNEL(cuda, div, (binary_kernel<OpId::div, BinaryOp::div>));
TS_REGISTER_KERNEL(cuda, pow, (binary_kernel<OpId::pow, BinaryOp::pow>));
TS_REGISTER_KERNEL(cuda, maximum, (binary_kernel<OpId::maximum, BinaryOp::maximum>));
TS_REGISTER_KERNEL(cuda, minimum, (binary_kernel<OpId::minimum, BinaryOp::minimum>));
TS_REGISTER_KERNEL(cuda, where, where_kernel);
TS_REGISTER_KERNEL(cuda, eq, (binary_kernel<OpId::eq, BinaryOp::eq>));
TS_REGISTER_KERNEL(cuda, ne, (binary_kernel<OpId::ne, BinaryOp::ne>));
TS_REGISTER_KERNEL(cuda, lt, (binary_kernel<OpId::lt, BinaryOp::lt>));
TS_REGISTER_KERNEL(cuda, le, (binary_kernel<OpId::le, BinaryOp::le>));
TS_REGISTER_KERNEL(cuda, gt, (binary_kernel<OpId::gt, BinaryOp::gt>));
TS_REGISTER_KERNEL(cuda, ge, (binary_kernel<OpId::ge, BinaryOp::ge>));

}  // namespace
}  // namespace tessera::cuda_kernels
