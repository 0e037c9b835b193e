// CUDA kernels of 1-bit compression's bit packing, sign_pack and sign_unpack (device code:
// compress.cu; the spec is kernels/cpu/compress.cc, tensor/ops.h).
#include "kernels/cuda/compress.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

void sign_pack_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& bits = out[0];
  if (bits.numel() == 0) return;
  DeviceGuard g(bits.device());
  const Tensor x = contiguous_cuda(in[0]);
  const DevTensor db = dev_tensor(bits), dx = dev_tensor(x);
  run_launch("sign_pack", bits.device(),
             [&] { launch_sign_pack(db, dx, compute_stream(bits.device())); });
}

void sign_unpack_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const Tensor bits = contiguous_cuda(in[0]);
  const DevTensor dy = dev_tensor(y), db = dev_tensor(bits);
  run_launch("sign_unpack", y.device(),
             [&] { launch_sign_unpack(dy, db, compute_stream(y.device())); });
}

TS_REGISTER_KERNEL(cuda, sign_pack, sign_pack_kernel);
TS_REGISTER_KERNEL(cuda, sign_unpack, sign_unpack_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
