// Strided copies with dtype conversion, and fills.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_kernels.cuh"

namespace tessera::cuda_kernels {
namespace {

template <typename D, typename S>
__global__ void copy_kernel(D* dst, const S* src, OffsetCalc<2> oc, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto o = oc.get(i);
    dst[o[0]] = convert<D>(src[o[1]]);
  }
}

// Contiguous dst and src of different dtypes: no index arithmetic.
template <typename D, typename S>
__global__ void convert_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = convert<D>(src[i]);
  }
}

template <typename Word>
__global__ void fill_kernel(Word* dst, Word value, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

// Consecutive lanes move consecutive elements of a column, on both sides: every warp access
// is 64 contiguous bytes, whichever side is off 16-byte alignment (a thread moving 8
// neighbours would touch 16 partial sectors per store on the unaligned side). Each thread
// loads kRepitchUnroll elements, a block apart, before storing them (loads in flight).
// Grid-stride loops over a column's chunks (x) and the columns (y).
constexpr int kRepitchUnroll = 8;

__global__ void repitch16_kernel(uint16_t* __restrict__ dst, int64_t ldd, const uint16_t* __restrict__ src,
                                 int64_t lds, int64_t rows, int64_t cols) {
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kRepitchUnroll;
  for (int64_t c = blockIdx.y; c < cols; c += gridDim.y) {
    const uint16_t* s = src + c * lds;
    uint16_t* d = dst + c * ldd;
    for (int64_t base = blockIdx.x * chunk + threadIdx.x; base < rows; base += gridDim.x * chunk) {
      uint16_t v[kRepitchUnroll];
#pragma unroll
      for (int u = 0; u < kRepitchUnroll; ++u) {
        const int64_t r = base + static_cast<int64_t>(u) * blockDim.x;
        if (r < rows) v[u] = s[r];
      }
#pragma unroll
      for (int u = 0; u < kRepitchUnroll; ++u) {
        const int64_t r = base + static_cast<int64_t>(u) * blockDim.x;
        if (r < rows) d[r] = v[u];
      }
    }
  }
}

bool same_strides(const DevTensor& a, const DevTensor& b) {
  for (int d = 0; d < a.ndim; ++d) {
    if (a.sizes[d] != 1 && a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

}  // namespace

void launch_copy(const DevTensor& dst, const DevTensor& src, cudaStream_t stream) {
  const int64_t n = dst.numel;
  if (n == 0) return;
  if (dst.dtype == src.dtype && dst.contiguous() && src.contiguous()) {
    const cudaError_t e = cudaMemcpyAsync(dst.data, src.data, n * dev_dtype_size(dst.dtype),
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) throw CudaLaunchError(std::string("copy: ") + cudaGetErrorString(e));
    return;
  }
  const bool flat = dst.contiguous() && src.contiguous() && same_strides(dst, src);
  TS_CUDA_DISPATCH_STORAGE(dst.dtype, "copy", [&] {
    using D = scalar_t;
    TS_CUDA_DISPATCH_STORAGE(src.dtype, "copy", [&] {
      using S = scalar_t;
      if (flat) {
        convert_kernel<D, S><<<grid_for(n), 256, 0, stream>>>(typed<D>(dst), typed<S>(src), n);
      } else {
        const DevTensor* ops[2] = {&dst, &src};
        copy_kernel<D, S><<<grid_for(n), 256, 0, stream>>>(typed<D>(dst), typed<S>(src),
                                                            OffsetCalc<2>(dst, ops), n);
      }
    });
  });
  check_launch("copy");
}

void launch_fill(const DevTensor& dst, uint64_t bits, cudaStream_t stream) {
  const int64_t n = dst.numel;
  if (n == 0) return;
  switch (dev_dtype_size(dst.dtype)) {
    case 1: fill_kernel<uint8_t><<<grid_for(n), 256, 0, stream>>>(typed<uint8_t>(dst), static_cast<uint8_t>(bits), n); break;
    case 2: fill_kernel<uint16_t><<<grid_for(n), 256, 0, stream>>>(typed<uint16_t>(dst), static_cast<uint16_t>(bits), n); break;
    case 4: fill_kernel<uint32_t><<<grid_for(n), 256, 0, stream>>>(typed<uint32_t>(dst), static_cast<uint32_t>(bits), n); break;
    default: fill_kernel<uint64_t><<<grid_for(n), 256, 0, stream>>>(typed<uint64_t>(dst), bits, n); break;
  }
  check_launch("fill");
}

void launch_repitch16(void* dst, int64_t ld_dst, const void* src, int64_t ld_src, int64_t rows, int64_t cols,
                      cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int threads = 256;
  const int64_t chunk = threads * kRepitchUnroll;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((rows + chunk - 1) / chunk, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(cols, 65535)));
  repitch16_kernel<<<grid, threads, 0, stream>>>(static_cast<uint16_t*>(dst), ld_dst,
                                                 static_cast<const uint16_t*>(src), ld_src, rows, cols);
  check_launch("repitch16");
}

}  // namespace tessera::cuda_kernels
