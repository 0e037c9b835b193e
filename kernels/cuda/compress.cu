// 1-bit compression's bit packing on CUDA (the spec is kernels/cpu/compress.cc). sign_pack:
// each warp reads 32 consecutive elements (coalesced), one ballot turns their signs into a
// 32-bit word whose bit l is lane l's, and lane 0 stores it (four bytes, little-endian:
// byte k of the word holds elements 8k..8k+7, the CPU's order). sign_unpack: one thread per
// element.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compress.cuh"

namespace tessera::cuda_kernels {
namespace {

template <typename T> __device__ __forceinline__ bool not_negative(T v) {
  // Not less than 0: NaN counts as not negative (the CPU's _CMP_NLT_UQ).
  if constexpr (std::is_same_v<T, double>) return !(v < 0.0);
  else return !(static_cast<float>(to_acc(v)) < 0.0f);
}

template <typename T>
__global__ void sign_pack_kernel(uint8_t* bits, const T* x, int64_t n, int64_t nbytes) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t words = (n + 31) / 32;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5; w < words;
       w += warps) {
    const int64_t i = 32 * w + lane;
    const bool set = i < n && not_negative(x[i]);
    const unsigned word = __ballot_sync(0xffffffffu, set);
    if (lane == 0) {
      const int64_t b0 = 4 * w;
      if (b0 + 4 <= nbytes) {
        *reinterpret_cast<unsigned*>(bits + b0) = word;  // bits is 4-byte aligned (allocator)
      } else {
        for (int64_t b = b0; b < nbytes; ++b) bits[b] = static_cast<uint8_t>(word >> (8 * (b - b0)));
      }
    }
  }
}

template <typename T>
__global__ void sign_unpack_kernel(T* out, const uint8_t* bits, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool set = (bits[i >> 3] >> (i & 7)) & 1;
    out[i] = convert<T>(set ? 1.0f : -1.0f);
  }
}

}  // namespace

void launch_sign_pack(const DevTensor& bits, const DevTensor& x, cudaStream_t stream) {
  const int64_t n = x.numel, nbytes = bits.numel;
  if (nbytes == 0) return;
  // Whole warps: 32 elements each, a block of 256 threads covers 256 elements.
  TS_CUDA_DISPATCH_FLOATS(x.dtype, "sign_pack", [&] {
    sign_pack_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(
        typed<uint8_t>(bits), typed<const scalar_t>(x), n, nbytes);
  });
  check_launch("sign_pack");
}

void launch_sign_unpack(const DevTensor& out, const DevTensor& bits, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  TS_CUDA_DISPATCH_FLOATS(out.dtype, "sign_unpack", [&] {
    sign_unpack_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(
        typed<scalar_t>(out), typed<const uint8_t>(bits), n);
  });
  check_launch("sign_unpack");
}

}  // namespace tessera::cuda_kernels
