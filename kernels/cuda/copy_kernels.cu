// Grid-stride strided copy and fill. Element types only matter through their size here;
// arithmetic kernels (and casts on the device) arrive with the full CUDA backend.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/copy_kernels.cuh"

namespace tessera::cuda_kernels {
namespace {

struct Layout {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t dst_strides[kMaxDims];
  int64_t src_strides[kMaxDims];
};

template <typename Word>
__global__ void strided_copy_kernel(Word* dst, const Word* src, Layout l, int64_t numel) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i, d_off = 0, s_off = 0;
    for (int d = l.ndim - 1; d >= 0; --d) {
      const int64_t c = rest % l.shape[d];
      rest /= l.shape[d];
      d_off += c * l.dst_strides[d];
      s_off += c * l.src_strides[d];
    }
    dst[d_off] = src[s_off];
  }
}

template <typename Word>
__global__ void fill_kernel(Word* dst, Word value, int64_t numel) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

int blocks_for(int64_t numel) {
  const int64_t b = (numel + 255) / 256;
  return static_cast<int>(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

template <typename Word>
void copy_as(void* dst, const void* src, const Layout& l, int64_t numel) {
  strided_copy_kernel<Word><<<blocks_for(numel), 256>>>(static_cast<Word*>(dst),
                                                        static_cast<const Word*>(src), l, numel);
  check(cudaGetLastError(), "strided_copy");
}

template <typename Word>
void fill_as(void* dst, const void* value, int64_t numel) {
  Word w;
  std::memcpy(&w, value, sizeof(Word));
  fill_kernel<Word><<<blocks_for(numel), 256>>>(static_cast<Word*>(dst), w, numel);
  check(cudaGetLastError(), "fill");
}

}  // namespace

void launch_strided_copy(void* dst, const void* src, int ndim, const int64_t* shape,
                         const int64_t* dst_strides, const int64_t* src_strides, int64_t numel,
                         int elem_size) {
  if (numel == 0) return;
  Layout l{};
  l.ndim = ndim;
  for (int d = 0; d < ndim; ++d) {
    l.shape[d] = shape[d];
    l.dst_strides[d] = dst_strides[d];
    l.src_strides[d] = src_strides[d];
  }
  switch (elem_size) {
    case 1: return copy_as<uint8_t>(dst, src, l, numel);
    case 2: return copy_as<uint16_t>(dst, src, l, numel);
    case 4: return copy_as<uint32_t>(dst, src, l, numel);
    case 8: return copy_as<uint64_t>(dst, src, l, numel);
    default: throw std::runtime_error("strided_copy: unsupported element size");
  }
}

void launch_fill(void* dst, const void* value, int64_t numel, int elem_size) {
  if (numel == 0) return;
  switch (elem_size) {
    case 1: return fill_as<uint8_t>(dst, value, numel);
    case 2: return fill_as<uint16_t>(dst, value, numel);
    case 4: return fill_as<uint32_t>(dst, value, numel);
    case 8: return fill_as<uint64_t>(dst, value, numel);
    default: throw std::runtime_error("fill: unsupported element size");
  }
}

}  // namespace tessera::cuda_kernels
