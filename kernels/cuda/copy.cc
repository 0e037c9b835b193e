// The byte movers on CUDA: to_device, copy_, clone, cast and full. Host <-> device copies go
// through runtime.cc's pinned staging; casts between two host/device tensors of different
// dtypes convert on the device when the data is there, else on the host.
//
//   Tensor g = randn({1024, 1024}).to(cuda(0));   // H2D
//   Tensor h = cast(g, DType::bf16).to(kCPU);       // cast on the device, then D2H
#include <cstring>

#include "kernels/cpu/util.h"
#include "kernels/cuda/copy_kernels.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

// Copies src into dst (same shape after broadcasting, any dtypes, at least one on CUDA).
void copy_between(const Tensor& dst, const Tensor& src) {
  const Device dd = dst.device(), sd = src.device();
  if (dd.is_cuda() && sd.is_cuda()) {
    if (dd == sd) return copy_cuda(dst, src);
    // Between two GPUs: through a contiguous copy on the source, then peer memcpy.
    Tensor packed = Tensor::empty(dst.shape(), dst.dtype(), sd);
    copy_cuda(packed, src);
    Tensor landed = Tensor::empty(packed.shape(), packed.dtype(), dd);
    synchronize(sd);
    cuda_check(cudaMemcpyPeer(landed.raw_data(), dd.index, packed.raw_data(), sd.index,
                              static_cast<size_t>(packed.nbytes())), "cudaMemcpyPeer", dd);
    return copy_cuda(dst, landed);
  }
  if (sd.is_cpu()) {
    // H2D: a contiguous host copy in dst's dtype and shape, staged to the device.
    Tensor host = Tensor::empty(dst.shape(), dst.dtype(), kCPU);
    cpu::copy_cpu(host, src);
    if (dst.is_contiguous()) return copy_to_device(dst.raw_data(), host.raw_data(), host.nbytes(), dd);
    Tensor staged = Tensor::empty(dst.shape(), dst.dtype(), dd);
    copy_to_device(staged.raw_data(), host.raw_data(), host.nbytes(), dd);
    return copy_cuda(dst, staged);
  }
  // D2H: packed (and cast) on the device, then staged to the host.
  Tensor packed = src;
  if (!(src.is_contiguous() && src.shape() == dst.shape() && src.dtype() == dst.dtype())) {
    packed = Tensor::empty(dst.shape(), dst.dtype(), sd);
    copy_cuda(packed, src);
  }
  if (dst.is_contiguous()) return copy_to_host(dst.raw_data(), packed.raw_data(), packed.nbytes(), sd);
  Tensor host = Tensor::empty(dst.shape(), dst.dtype(), kCPU);
  copy_to_host(host.raw_data(), packed.raw_data(), packed.nbytes(), sd);
  cpu::copy_cpu(dst, host);
}

void copy_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_between(out[0], in[1]);
}

void copy_input_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_between(out[0], in[0]);
}

void full_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  // The element's bits as the CPU's conversion from f64 makes them.
  Tensor one = Tensor::empty({}, out[0].dtype(), kCPU);
  Tensor value = Tensor::empty({}, DType::f64, kCPU);
  *static_cast<double*>(value.raw_data()) = a.value;
  cpu::copy_cpu(one, value);
  uint64_t bits = 0;
  std::memcpy(&bits, one.raw_data(), dtype_size(one.dtype()));
  DeviceGuard g(out[0].device());
  const DevTensor d = dev_tensor(out[0]);
  run_launch("full", out[0].device(), [&] { launch_fill(d, bits, compute_stream(out[0].device())); });
}

TS_REGISTER_KERNEL(cuda, copy_, copy_kernel);
TS_REGISTER_KERNEL(cuda, to_device, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, clone, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, cast, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, full, full_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
