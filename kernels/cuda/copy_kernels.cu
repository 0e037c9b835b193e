// Strided copies with dtype conversion, and fills. launch_copy takes the path plan_copy
// (strided_index.h) chooses from the layouts: one cudaMemcpyAsync, a flat conversion, 16-byte
// vectors along a contiguous innermost dim, or one coalesced 32-bit index computation per
// element.
#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_kernels.cuh"

namespace tessera::cuda_kernels {
namespace {

// Any strides: one index computation per element (dims coalesced on the host).
template <typename D, typename S>
__global__ void __launch_bounds__(256) copy_strided_kernel(D* dst, const S* src, Strided<2> s, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[2];
    s.offsets(i, o);
    dst[o[0]] = convert<D>(src[o[1]]);
  }
}

// The innermost coalesced dim contiguous on both sides and a multiple of V: V elements per
// index computation, one vector load and one vector store (plan_copy checked the alignment).
template <int V, typename D, typename S>
__global__ void __launch_bounds__(256) copy_vector_kernel(D* dst, const S* src, Strided<2> s, int64_t nv) {
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[2];
    s.offsets(v * V, o);
    const Vec<S, V> in = *reinterpret_cast<const Vec<S, V>*>(src + o[1]);
    Vec<D, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = convert<D>(in.v[j]);
    *reinterpret_cast<Vec<D, V>*>(dst + o[0]) = out;
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

}  // namespace

void launch_copy(const DevTensor& dst, const DevTensor& src, cudaStream_t stream) {
  const int64_t n = dst.numel;
  if (n == 0) return;
  const CopyPlan plan = plan_copy(dst, src);
  if (plan.path == CopyPath::memcpy) {
    const cudaError_t e = cudaMemcpyAsync(dst.data, src.data, n * dev_dtype_size(dst.dtype),
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) throw CudaLaunchError(std::string("copy: ") + cudaGetErrorString(e));
    return;
  }
  TS_CUDA_DISPATCH_STORAGE(dst.dtype, "copy", [&] {
    using D = scalar_t;
    TS_CUDA_DISPATCH_STORAGE(src.dtype, "copy", [&] {
      using S = scalar_t;
      constexpr int V = 16 / static_cast<int>(sizeof(D) > sizeof(S) ? sizeof(D) : sizeof(S));
      D* d = typed<D>(dst);
      const S* s = typed<S>(src);
      if (plan.path == CopyPath::flat) {
        convert_kernel<D, S><<<grid_for(n), 256, 0, stream>>>(d, s, n);
      } else if (plan.path == CopyPath::vector) {
        if (plan.vec != V) throw CudaLaunchError("copy: vector width " + std::to_string(plan.vec) +
                                                 " planned, the dtypes give " + std::to_string(V));
        if constexpr (V > 1) {
          copy_vector_kernel<V, D, S><<<grid_for(n / V), 256, 0, stream>>>(d, s, plan.space, n / V);
        }
      } else {
        copy_strided_kernel<D, S><<<grid_for(n), 256, 0, stream>>>(d, s, plan.space, n);
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
