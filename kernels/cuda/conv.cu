// The bias add of conv2d on CUDA (the convolution itself is cuDNN's, kernels/cuda/conv.cc).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv.cuh"

namespace tessera::cuda_kernels {
namespace {

// Large planes: one block per (image, channel) plane, the bias loaded once.
template <typename T>
__global__ void bias_plane_kernel(T* out, const T* bias, int64_t channels, int64_t plane) {
  const int64_t p = blockIdx.x;
  const acc_type<T> b = to_acc(bias[p % channels]);
  T* row = out + p * plane;
  for (int64_t i = threadIdx.x; i < plane; i += blockDim.x) row[i] = from_acc<T>(to_acc(row[i]) + b);
}

// Small planes (down to 1x1): one thread per element, 32-bit index arithmetic.
template <typename T>
__global__ void bias_flat_kernel(T* out, const T* bias, uint32_t channels, uint32_t plane, uint32_t n) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = from_acc<T>(to_acc(out[i]) + to_acc(bias[(i / plane) % channels]));
  }
}

}  // namespace

void launch_conv_bias(const DevTensor& out, const DevTensor& bias, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  const int64_t channels = out.sizes[1];
  const int64_t plane = out.sizes[2] * out.sizes[3];
  const int64_t planes = n / plane;
  TS_CUDA_DISPATCH_FLOATS(out.dtype, "conv2d bias", [&] {
    using T = scalar_t;
    if (plane >= 256 || n > 0x7fffffffLL) {
      if (planes > 0x7fffffffLL) throw CudaLaunchError("conv2d bias: too many planes");
      bias_plane_kernel<T><<<static_cast<unsigned>(planes), 256, 0, stream>>>(typed<T>(out), typed<T>(bias),
                                                                              channels, plane);
    } else {
      bias_flat_kernel<T><<<grid_for(n), 256, 0, stream>>>(typed<T>(out), typed<T>(bias),
                                                           static_cast<uint32_t>(channels),
                                                           static_cast<uint32_t>(plane),
                                                           static_cast<uint32_t>(n));
    }
  });
  check_launch("conv2d bias");
}

}  // namespace tessera::cuda_kernels
