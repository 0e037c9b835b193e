// CUDA kernels of the factories rand, randn and arange, and of dropout (device code:
// random.cu). Counters follow the CPU's (kernels/cpu/random.cc): element i of a tensor drawn
// at (seed, offset) uses offset + its index in the logical tensor (Attrs::rng_view), so a
// tensor drawn on the device equals the CPU's draw, whole or block by block.
//
//   Tensor r = rand({1024}, DType::f32, cuda(0));   // bitwise rand({1024}) on the CPU
#include "kernels/cuda/random.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

RngMap rng_map(std::string_view op, const Shape& local, const Attrs& a) {
  RngMap m;
  m.offset = a.offset;
  const RngView& v = a.rng_view;
  if (v.global_shape.empty() || v.global_shape == local) return m;
  TS_CHECK(v.global_shape.size() == local.size() && v.starts.size() == local.size(),
           "{}: block {} and global shape {} differ in rank", op, shape_str(local),
           shape_str(v.global_shape));
  TS_CHECK(static_cast<int64_t>(local.size()) <= kMaxDims,
           "{}: shape {} has more than {} dims", op, shape_str(local), kMaxDims);
  const Strides global = contiguous_strides(v.global_shape);
  m.ndim = static_cast<int>(local.size());
  for (int d = 0; d < m.ndim; ++d) {
    m.base += v.starts[d] * global[d];
    m.local[d] = local[d];
    m.global_strides[d] = global[d];
  }
  return m;
}

void rand_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const RngMap m = rng_map("rand", y.shape(), a);
  run_launch("rand", y.device(), [&] { launch_rand(d, a.seed, m, compute_stream(y.device())); });
}

void randn_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  const RngMap m = rng_map("randn", y.shape(), a);
  run_launch("randn", y.device(), [&] { launch_randn(d, a.seed, m, compute_stream(y.device())); });
}

void dropout_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const Tensor x = contiguous_cuda(in[0]);
  const DevTensor dy = dev_tensor(y), dx = dev_tensor(x);
  const RngMap m = rng_map("dropout", x.shape(), a);
  run_launch("dropout", y.device(),
             [&] { launch_dropout(dy, dx, a.p, a.seed, m, compute_stream(y.device())); });
}

void arange_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  DeviceGuard g(y.device());
  const DevTensor d = dev_tensor(y);
  run_launch("arange", y.device(),
             [&] { launch_arange(d, a.range_start, a.range_step, compute_stream(y.device())); });
}

TS_REGISTER_KERNEL(cuda, rand, rand_kernel);
TS_REGISTER_KERNEL(cuda, randn, randn_kernel);
TS_REGISTER_KERNEL(cuda, dropout, dropout_kernel);
TS_REGISTER_KERNEL(cuda, arange, arange_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
