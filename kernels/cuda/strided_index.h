// The index arithmetic of the strided CUDA kernels (elementwise, copy) and the copy's choice
// of path: plain C++ that nvcc and GCC both compile, so that tests/kernels:strided_index_test
// checks it on the CPU against a plain unravelling of every index.
//
//   const int64_t* st[2] = {dst.strides, src.strides};
//   Strided<2> s = coalesce_dims<2>(dst.ndim, dst.sizes, st);  // on the host
//   int64_t off[2]; s.offsets(i, off);                          // in a kernel (or on the host)
#pragma once

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TS_HOST_DEVICE inline
#endif

namespace tessera::cuda_kernels {

// An iteration space for N operands: `sizes` row-major (the last dim varies fastest), each
// operand with its own element strides (0 on broadcast dims). offsets(i) unravels the linear
// index i (below the product of the sizes) into every operand's element offset: no division
// for one dim, in 32-bit arithmetic when `small` (every linear index fits 32 bits: a GPU's
// 32-bit division is several times cheaper than its 64-bit one).
template <int N> struct Strided {
  int ndim = 0;
  bool small = true;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  TS_HOST_DEVICE void offsets(int64_t i, int64_t (&o)[N]) const {
    if (ndim == 1) {
      for (int k = 0; k < N; ++k) o[k] = i * strides[k][0];
      return;
    }
    for (int k = 0; k < N; ++k) o[k] = 0;
    if (small) {
      uint32_t li = static_cast<uint32_t>(i);
      for (int d = ndim - 1; d >= 0; --d) {
        const uint32_t s = static_cast<uint32_t>(sizes[d]);
        const uint32_t q = li / s, c = li - q * s;
        li = q;
        for (int k = 0; k < N; ++k) o[k] += static_cast<int64_t>(c) * strides[k][d];
      }
    } else {
      for (int d = ndim - 1; d >= 0; --d) {
        const int64_t q = i / sizes[d], c = i - q * sizes[d];
        i = q;
        for (int k = 0; k < N; ++k) o[k] += c * strides[k][d];
      }
    }
  }
};

// `sizes` (ndim dims) with N operands' element strides, size-1 dims dropped and each dim
// merged into the one before it wherever every operand allows it (the outer stride equals
// the inner stride times the inner size): the same offsets for every linear index, in
// fewer dims. strides[k] == nullptr: operand k is a scalar (stride 0 everywhere).
template <int N>
Strided<N> coalesce_dims(int ndim, const int64_t* sizes, const int64_t* const (&strides)[N]) {
  Strided<N> s;
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    const int64_t size = sizes[d];
    numel *= size;
    if (size == 1) continue;
    bool merge = s.ndim > 0;
    for (int k = 0; merge && k < N; ++k) {
      const int64_t st = strides[k] ? strides[k][d] : 0;
      merge = s.strides[k][s.ndim - 1] == st * size;
    }
    const int at = merge ? s.ndim - 1 : s.ndim;
    s.sizes[at] = merge ? s.sizes[at] * size : size;
    for (int k = 0; k < N; ++k) s.strides[k][at] = strides[k] ? strides[k][d] : 0;
    if (!merge) ++s.ndim;
  }
  s.small = numel <= static_cast<int64_t>(UINT32_MAX);
  return s;
}

// How launch_copy moves dst <- src (src already broadcast to dst's shape), chosen from the
// layouts, dtypes and pointers only:
//   memcpy:  same dtype, both contiguous: one cudaMemcpyAsync;
//   flat:    both contiguous, dtypes differ, and the vector path ruled out (a pointer off
//            its alignment, or a length not a multiple of `vec`): one element per thread, no
//            index arithmetic;
//   vector:  the innermost coalesced dim contiguous on both sides, a multiple of `vec`
//            elements, every vector aligned on both sides: one index computation and one
//            16-byte access (on the wider dtype's side) per `vec` elements;
//   strided: anything else, one index computation per element.
enum class CopyPath { memcpy, flat, vector, strided };

inline const char* copy_path_name(CopyPath p) {
  switch (p) {
    case CopyPath::memcpy: return "memcpy";
    case CopyPath::flat: return "flat";
    case CopyPath::vector: return "vector";
    case CopyPath::strided: return "strided";
  }
  return "?";
}

struct CopyPlan {
  CopyPath path = CopyPath::strided;
  int vec = 1;        // elements per access on the vector path
  Strided<2> space;   // operand 0 is dst, 1 is src (coalesced)
};

// dst is never broadcast (copy_ rejects an expanded destination before any kernel runs).
inline CopyPlan plan_copy(const DevTensor& dst, const DevTensor& src) {
  CopyPlan p;
  const int dsize = dev_dtype_size(dst.dtype), ssize = dev_dtype_size(src.dtype);
  const bool contiguous = dst.contiguous() && src.contiguous();
  if (dst.dtype == src.dtype && contiguous) {
    p.path = CopyPath::memcpy;
    return p;
  }
  const int64_t* st[2] = {dst.strides, src.strides};
  p.space = coalesce_dims<2>(dst.ndim, dst.sizes, st);
  const Strided<2>& s = p.space;
  const int vec = 16 / (dsize > ssize ? dsize : ssize);
  const int inner = s.ndim - 1;
  const auto aligned = [](const void* ptr, int64_t bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
  };
  bool vector = vec > 1 && s.ndim >= 1 && s.sizes[inner] % vec == 0 && s.strides[0][inner] == 1 &&
                s.strides[1][inner] == 1 && aligned(dst.data, int64_t{dsize} * vec) &&
                aligned(src.data, int64_t{ssize} * vec);
  for (int d = 0; vector && d < inner; ++d) {
    vector = s.strides[0][d] % vec == 0 && s.strides[1][d] % vec == 0;
  }
  if (vector) {
    p.path = CopyPath::vector;
    p.vec = vec;
  } else if (contiguous) {
    p.path = CopyPath::flat;
  }
  return p;
}

}  // namespace tessera::cuda_kernels
