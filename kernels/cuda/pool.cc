// Host glue of max_pool2d and max_pool2d_backward on CUDA (pool.cu); the spec is
// kernels/cpu/pool.cc. The backward gathers per input element when the attrs' window
// reproduces the grad's shape (always so through autograd), else adds plane by plane.
#include "kernels/cuda/pool.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

PoolWindow window_of(const Attrs& a) {
  return {a.kernel_size[0], a.kernel_size[1], a.stride[0], a.stride[1], a.padding[0], a.padding[1]};
}

void max_pool2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const Tensor x = contiguous_cuda(in[0]);
  const DevTensor yd = dev_tensor(out[0]), id = dev_tensor(out[1]), xd = dev_tensor(x);
  run_launch("max_pool2d", d, [&] { launch_max_pool2d(yd, id, xd, window_of(a), compute_stream(d)); });
}

// Inputs: grad [N, C, OH, OW], indices; attrs.shape = input shape (+ the forward's window).
void max_pool2d_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor g = contiguous_cuda(in[0]), idx = contiguous_cuda(in[1]);
  const PoolWindow win = window_of(a);
  auto out_size = [](int64_t n, int64_t k, int64_t s, int64_t p) { return (n + 2 * p - k) / s + 1; };
  const bool windowed =
      win.kh > 0 && win.kw > 0 && win.sh > 0 && win.sw > 0 && win.ph >= 0 && win.pw >= 0 &&
      2 * win.ph <= win.kh && 2 * win.pw <= win.kw && a.shape[2] + 2 * win.ph >= win.kh &&
      a.shape[3] + 2 * win.pw >= win.kw &&
      out_size(a.shape[2], win.kh, win.sh, win.ph) == g.shape()[2] &&
      out_size(a.shape[3], win.kw, win.sw, win.pw) == g.shape()[3];
  const DevTensor dxd = dev_tensor(out[0]), gd = dev_tensor(g), id = dev_tensor(idx);
  const Tensor ws = Tensor::empty(
      {std::max<int64_t>(1, max_pool2d_backward_workspace_bytes(dxd, windowed))}, DType::b8, d);
  const cudaStream_t s = compute_stream(d);
  run_launch("max_pool2d_backward", d, [&] {
    launch_max_pool2d_backward(dxd, gd, id, win, windowed, ws.raw_data(),
                               device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

TS_REGISTER_KERNEL(cuda, max_pool2d, max_pool2d_kernel);
TS_REGISTER_KERNEL(cuda, max_pool2d_backward, max_pool2d_backward_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
