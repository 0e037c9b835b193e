// Random and range factories on CUDA: rand, randn, dropout and arange (the spec is
// kernels/cpu/random.cc and copy.cc's arange). Each element's draw is a pure function of
// (seed, counter) through tensor/random.h's Philox, so rand and dropout's keep/drop decisions
// are bitwise the CPU's; randn goes through the device's log/cos/sqrt, within a few ulps of
// the CPU's before the final rounding.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/random.cuh"
#include "tensor/random.h"

namespace tessera::cuda_kernels {
namespace {

__device__ __forceinline__ uint64_t counter_of(const RngMap& m, int64_t i) {
  if (m.ndim == 0) return m.offset + static_cast<uint64_t>(i);
  int64_t g = m.base;
  for (int d = m.ndim - 1; d >= 0; --d) {
    const int64_t q = i / m.local[d];
    g += (i - q * m.local[d]) * m.global_strides[d];
    i = q;
  }
  return m.offset + static_cast<uint64_t>(g);
}

// Largest value below 1 in T, so rounding a uniform draw never yields 1.
template <typename T> __device__ __forceinline__ T below_one() {
  if constexpr (std::is_same_v<T, __half>) return __ushort_as_half(0x3bff);
  else return __ushort_as_bfloat16(0x3f7f);
}

template <typename T>
__global__ void rand_kernel(T* out, int64_t n, uint64_t seed, RngMap m) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t c = counter_of(m, i);
    if constexpr (std::is_same_v<T, double>) {
      out[i] = philox::uniform_f64(seed, c);
    } else if constexpr (std::is_same_v<T, float>) {
      out[i] = philox::uniform(seed, c);
    } else {
      T v = from_acc<T>(philox::uniform(seed, c));
      if (to_acc(v) >= 1.0f) v = below_one<T>();
      out[i] = v;
    }
  }
}

// philox::normal's Box-Muller on the device.
__device__ __forceinline__ double normal(uint64_t seed, uint64_t counter) {
  const philox::Block b = philox::philox4x32(counter, seed);
  const uint64_t w0 = ((static_cast<uint64_t>(b[0]) << 32) | b[1]) >> 11;
  const uint64_t w1 = ((static_cast<uint64_t>(b[2]) << 32) | b[3]) >> 11;
  const double u1 = (static_cast<double>(w0) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  const double u2 = static_cast<double>(w1) * (1.0 / 9007199254740992.0);
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
}

template <typename T>
__global__ void randn_kernel(T* out, int64_t n, uint64_t seed, RngMap m) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = convert<T>(normal(seed, counter_of(m, i)));  // one rounding, as T(double)
  }
}

template <typename T>
__global__ void dropout_kernel(T* out, const T* x, int64_t n, float p, acc_type<T> scale,
                               uint64_t seed, RngMap m) {
  using C = acc_type<T>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool keep = philox::uniform(seed, counter_of(m, i)) >= p;
    out[i] = keep ? from_acc<T>(C(to_acc(x[i]) * scale)) : from_acc<T>(C(0));
  }
}

template <typename T>
__global__ void arange_kernel(T* out, int64_t n, double start, double step) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // The CPU's start + step * i compiles to one fused multiply-add (GCC contracts at -O3
    // with FMA hardware); fma() here gives the same bits.
    out[i] = convert<T>(fma(step, static_cast<double>(i), start));
  }
}

}  // namespace

void launch_rand(const DevTensor& out, uint64_t seed, const RngMap& m, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  TS_CUDA_DISPATCH_FLOATS(out.dtype, "rand", [&] {
    rand_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(typed<scalar_t>(out), n, seed, m);
  });
  check_launch("rand");
}

void launch_randn(const DevTensor& out, uint64_t seed, const RngMap& m, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  TS_CUDA_DISPATCH_FLOATS(out.dtype, "randn", [&] {
    randn_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(typed<scalar_t>(out), n, seed, m);
  });
  check_launch("randn");
}

void launch_dropout(const DevTensor& out, const DevTensor& x, double p, uint64_t seed,
                    const RngMap& m, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  TS_CUDA_DISPATCH_FLOATS(out.dtype, "dropout", [&] {
    using C = acc_type<scalar_t>;
    const C scale = static_cast<C>(1.0 / (1.0 - p));
    dropout_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(
        typed<scalar_t>(out), typed<scalar_t>(x), n, static_cast<float>(p), scale, seed, m);
  });
  check_launch("dropout");
}

void launch_arange(const DevTensor& out, double start, double step, cudaStream_t stream) {
  const int64_t n = out.numel;
  if (n == 0) return;
  TS_CUDA_DISPATCH_ALL(out.dtype, "arange", [&] {
    arange_kernel<scalar_t><<<grid_for(n), 256, 0, stream>>>(typed<scalar_t>(out), n, start, step);
  });
  check_launch("arange");
}

}  // namespace tessera::cuda_kernels
