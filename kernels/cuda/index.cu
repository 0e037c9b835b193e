// Device code of the indexing ops: embedding and index_select (row gathers, 16-byte copies
// where the rows allow), index_add (sorted segments: deterministic, in the CPU's order),
// gather and scatter_add (strided, any rank). The spec is kernels/cpu/index.cc.
//
// index_add: (index, position) pairs are radix-sorted (stable, so equal indices keep their
// position order) and each run of equal indices is summed by one block (by one thread per
// column where rows are narrow), which walks the run in position order starting from the
// destination's value, rounding after every add exactly as the CPU does (16-bit types
// accumulate in 16 bits there). Results equal the CPU's bit for bit in every dtype; no atomics.
#include <cub/cub.cuh>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/index.cuh"

namespace tessera::cuda_kernels {
namespace {

__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

int threads_for(int64_t work) {
  int64_t t = (work + 31) / 32 * 32;
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, t)));
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) that divides a row and both base pointers.
int copy_unit(int64_t row_bytes, const void* a, const void* b) {
  for (int u : {16, 8, 4, 2}) {
    if (row_bytes % u == 0 && reinterpret_cast<uintptr_t>(a) % u == 0 &&
        reinterpret_cast<uintptr_t>(b) % u == 0) {
      return u;
    }
  }
  return 1;
}

// Row k of out [outer * n rows] <- row (o * mid + idx[i]) of x, k = o * n + i. One block per
// row (rows of >= 32 units) or one thread per unit (short rows).
template <typename U>
__global__ void gather_rows_kernel(U* __restrict__ out, const U* __restrict__ x, const void* idx,
                                   bool i64, int64_t outer, int64_t n, int64_t mid, int64_t units,
                                   int op, int64_t dim, DeviceErrorRecord* err) {
  const int64_t rows = outer * n;
  for (int64_t k = blockIdx.x; k < rows; k += gridDim.x) {
    const int64_t o = k / n, i = k - o * n;
    const int64_t id = load_index(idx, i64, i);
    U* dst = out + k * units;
    if (id < 0 || id >= mid) {
      if (threadIdx.x == 0) report_bad_index(err, op, id, mid, dim);
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = U{};
      continue;
    }
    const U* src = x + (o * mid + id) * units;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
  }
}

template <typename U>
__global__ void gather_units_kernel(U* __restrict__ out, const U* __restrict__ x, const void* idx,
                                    bool i64, int64_t outer, int64_t n, int64_t mid, int64_t units,
                                    int op, int64_t dim, DeviceErrorRecord* err) {
  const int64_t total = outer * n * units;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = t / units, u = t - k * units;
    const int64_t o = k / n, i = k - o * n;
    const int64_t id = load_index(idx, i64, i);
    if (id < 0 || id >= mid) {
      report_bad_index(err, op, id, mid, dim);
      out[t] = U{};
    } else {
      out[t] = x[(o * mid + id) * units + u];
    }
  }
}

void gather_rows(void* out, const void* x, const DevTensor& idx, int64_t outer, int64_t mid,
                 int64_t row_bytes, int op, int64_t dim, DeviceErrorRecord* err, cudaStream_t s) {
  const int64_t n = idx.numel;
  if (outer * n == 0 || row_bytes == 0) return;
  const bool i64 = idx.dtype == kI64;
  auto run = [&](auto unit) {
    using U = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    if (units >= 32) {
      const int blocks = static_cast<int>(std::min<int64_t>(outer * n, 65535));
      gather_rows_kernel<U><<<blocks, threads_for(units), 0, s>>>(
          static_cast<U*>(out), static_cast<const U*>(x), idx.data, i64, outer, n, mid, units, op,
          dim, err);
    } else {
      gather_units_kernel<U><<<grid_for(outer * n * units), 256, 0, s>>>(
          static_cast<U*>(out), static_cast<const U*>(x), idx.data, i64, outer, n, mid, units, op,
          dim, err);
    }
  };
  switch (copy_unit(row_bytes, out, x)) {
    case 16: run(uint4{}); break;
    case 8: run(uint2{}); break;
    case 4: run(uint32_t{}); break;
    case 2: run(uint16_t{}); break;
    default: run(uint8_t{}); break;
  }
}

// ---- index_add ----------------------------------------------------------------------------

// keys[i] = idx[i] (bad ones become `mid`, which sorts after every valid row), vals[i] = i.
__global__ void index_add_keys_kernel(const void* idx, bool i64, int64_t n, int64_t mid,
                                      uint32_t* __restrict__ keys, uint32_t* __restrict__ vals,
                                      int64_t dim, DeviceErrorRecord* err) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t id = load_index(idx, i64, i);
    if (id < 0 || id >= mid) {
      report_bad_index(err, kErrIndexAdd, id, mid, dim);
      id = mid;
    }
    keys[i] = static_cast<uint32_t>(id);
    vals[i] = static_cast<uint32_t>(i);
  }
}

// One block per run of equal sorted keys (the block at the run's first position does it):
// out[o, key, :] += src[o, pos, :] for the run's positions in order, rounding each add.
template <typename T, int VEC>
__global__ void index_add_runs_kernel(T* __restrict__ out, const T* __restrict__ src,
                                      const uint32_t* __restrict__ keys,
                                      const uint32_t* __restrict__ pos, int64_t n, int64_t outer,
                                      int64_t mid, int64_t inner) {
  using V = Vec<T, VEC>;
  const int64_t inner_v = inner / VEC, per_run = outer * inner_v;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const uint32_t key = keys[p];
    if (key >= mid || (p > 0 && keys[p - 1] == key)) continue;
    int64_t end = p + 1;
    while (end < n && keys[end] == key) ++end;
    for (int64_t e = threadIdx.x; e < per_run; e += blockDim.x) {
      const int64_t o = e / inner_v, cv = e - o * inner_v;
      V* dst = reinterpret_cast<V*>(out + (o * mid + key) * inner) + cv;
      const T* sbase = src + o * n * inner + cv * VEC;
      V acc = *dst;
#pragma unroll 4
      for (int64_t q = p; q < end; ++q) {
        const V v = *reinterpret_cast<const V*>(sbase + static_cast<int64_t>(pos[q]) * inner);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc.v[k] = from_acc<T>(to_acc(acc.v[k]) + to_acc(v.v[k]));
      }
      *dst = acc;
    }
  }
}

// The same sums one thread per (o, position, c), for where a block per run would not do:
// narrow rows (inner < kNarrowInner: a slice's backward along the last dim has inner = 1;
// a block's threads would stride through memory a whole row apart) and few runs (n <
// kFewRuns: the backward of GPT's slice of q, k or v from [3, B x T, C] has n = 1 and inner
// = B x T x C, so a block per run would leave all but one multiprocessor idle).
// Consecutive threads take consecutive columns, then positions: sorted keys that are
// consecutive rows read and write coalesced. The thread at a run's first position walks the
// run; the others have nothing to do.
constexpr int64_t kNarrowInner = 32;
constexpr int64_t kFewRuns = 1024;

template <typename T>
__global__ void index_add_narrow_kernel(T* __restrict__ out, const T* __restrict__ src,
                                        const uint32_t* __restrict__ keys,
                                        const uint32_t* __restrict__ pos, int64_t n,
                                        int64_t outer, int64_t mid, int64_t inner) {
  const int64_t total = outer * n * inner;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % inner, rest = e / inner, p = rest % n, o = rest / n;
    const uint32_t key = keys[p];
    if (key >= mid || (p > 0 && keys[p - 1] == key)) continue;
    T* dst = out + (o * mid + key) * inner + c;
    const T* sbase = src + o * n * inner + c;
    T acc = *dst;
    for (int64_t q = p; q < n && keys[q] == key; ++q) {
      acc = from_acc<T>(to_acc(acc) + to_acc(sbase[static_cast<int64_t>(pos[q]) * inner]));
    }
    *dst = acc;
  }
}

constexpr int64_t kAlign = 256;
int64_t align_up(int64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

size_t cub_sort_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr),
                                  static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<int>(n));
  return bytes;
}

// ---- gather / scatter_add -----------------------------------------------------------------

// Element k of out (contiguous, idx's shape) <- x at k's coordinates with dim replaced by idx.
template <typename U>
__global__ void gather_kernel(U* __restrict__ out, const U* __restrict__ x, DevTensor xs,
                              DevTensor is, bool i64, int dim, DeviceErrorRecord* err) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < is.numel;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rem = k, ioff = 0, xoff = 0;
    for (int d = is.ndim - 1; d >= 0; --d) {
      const int64_t c = rem % is.sizes[d];
      rem /= is.sizes[d];
      ioff += c * is.strides[d];
      if (d != dim) xoff += c * xs.strides[d];
    }
    const int64_t id = load_index(is.data, i64, ioff);
    if (id < 0 || id >= xs.sizes[dim]) {
      report_bad_index(err, kErrGather, id, xs.sizes[dim], dim);
      out[k] = U{};
    } else {
      out[k] = x[xoff + id * xs.strides[dim]];
    }
  }
}

// One thread per line of idx along dim (all other coordinates fixed): lines never write the
// same element, and each walks its line in order, so adds happen in the CPU's order.
template <typename T>
__global__ void scatter_add_kernel(T* __restrict__ out, const T* __restrict__ src, DevTensor os,
                                   DevTensor ss, DevTensor is, bool i64, int dim,
                                   DeviceErrorRecord* err) {
  const int64_t len = is.sizes[dim];
  const int64_t lines = len == 0 ? 0 : is.numel / len;
  for (int64_t l = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; l < lines;
       l += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rem = l, ioff = 0, soff = 0, ooff = 0;
    for (int d = is.ndim - 1; d >= 0; --d) {
      if (d == dim) continue;
      const int64_t c = rem % is.sizes[d];
      rem /= is.sizes[d];
      ioff += c * is.strides[d];
      soff += c * ss.strides[d];
      ooff += c * os.strides[d];
    }
    for (int64_t j = 0; j < len; ++j) {
      const int64_t id = load_index(is.data, i64, ioff + j * is.strides[dim]);
      if (id < 0 || id >= os.sizes[dim]) {
        report_bad_index(err, kErrScatterAdd, id, os.sizes[dim], dim);
        continue;
      }
      T& dst = out[ooff + id * os.strides[dim]];
      dst = from_acc<T>(to_acc(dst) + to_acc(src[soff + j * ss.strides[dim]]));
    }
  }
}

}  // namespace

int64_t index_add_workspace_bytes(int64_t n) {
  if (n == 0) return 0;
  return 4 * align_up(n * 4) + align_up(static_cast<int64_t>(cub_sort_bytes(n)));
}

void launch_embedding(const DevTensor& out, const DevTensor& w, const DevTensor& idx,
                      DeviceErrorRecord* err, cudaStream_t stream) {
  gather_rows(out.data, w.data, idx, 1, w.sizes[0], w.sizes[1] * dev_dtype_size(w.dtype),
              kErrEmbedding, 0, err, stream);
  check_launch("embedding");
}

void launch_index_select(const DevTensor& out, const DevTensor& x, const DevTensor& idx,
                         int64_t outer, int64_t mid, int64_t inner, int64_t dim,
                         DeviceErrorRecord* err, cudaStream_t stream) {
  gather_rows(out.data, x.data, idx, outer, mid, inner * dev_dtype_size(x.dtype), kErrIndexSelect,
              dim, err, stream);
  check_launch("index_select");
}

void launch_index_add(const DevTensor& out, const DevTensor& src, const DevTensor& idx,
                      int64_t outer, int64_t mid, int64_t inner, int64_t dim, void* workspace,
                      DeviceErrorRecord* err, cudaStream_t stream) {
  const int64_t n = idx.numel;
  if (n == 0 || outer * inner == 0) return;
  if (n >= (int64_t{1} << 31) || mid >= (int64_t{1} << 31) - 1) {
    throw CudaLaunchError("index_add: more than 2^31 indices or rows are not supported on CUDA");
  }
  char* ws = static_cast<char*>(workspace);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(ws);
  uint32_t* keys = reinterpret_cast<uint32_t*>(ws + align_up(n * 4));
  uint32_t* vals_in = reinterpret_cast<uint32_t*>(ws + 2 * align_up(n * 4));
  uint32_t* vals = reinterpret_cast<uint32_t*>(ws + 3 * align_up(n * 4));
  void* temp = ws + 4 * align_up(n * 4);
  size_t temp_bytes = cub_sort_bytes(n);
  index_add_keys_kernel<<<grid_for(n), 256, 0, stream>>>(idx.data, idx.dtype == kI64, n, mid,
                                                          keys_in, vals_in, dim, err);
  int end_bit = 1;
  while ((int64_t{1} << end_bit) <= mid) ++end_bit;  // keys are in [0, mid]
  const cudaError_t e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys, vals_in,
                                                        vals, static_cast<int>(n), 0, end_bit,
                                                        stream);
  if (e != cudaSuccess) throw CudaLaunchError(std::string("index_add sort: ") + cudaGetErrorString(e));
  TS_CUDA_DISPATCH_ALL(out.dtype, "index_add", [&] {
    using T = scalar_t;
    constexpr int kV = 16 / sizeof(T) > 0 ? 16 / static_cast<int>(sizeof(T)) : 1;
    const bool vec = inner % kV == 0 && reinterpret_cast<uintptr_t>(out.data) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(src.data) % 16 == 0;
    const int blocks = static_cast<int>(std::min<int64_t>(n, 65535));
    if (inner < kNarrowInner || n < kFewRuns) {
      index_add_narrow_kernel<T><<<grid_for(outer * n * inner), 256, 0, stream>>>(
          typed<T>(out), typed<T>(src), keys, vals, n, outer, mid, inner);
    } else if (vec) {
      index_add_runs_kernel<T, kV><<<blocks, threads_for(outer * inner / kV), 0, stream>>>(
          typed<T>(out), typed<T>(src), keys, vals, n, outer, mid, inner);
    } else {
      index_add_runs_kernel<T, 1><<<blocks, threads_for(outer * inner), 0, stream>>>(
          typed<T>(out), typed<T>(src), keys, vals, n, outer, mid, inner);
    }
  });
  check_launch("index_add");
}

void launch_gather(const DevTensor& out, const DevTensor& x, const DevTensor& idx, int dim,
                   DeviceErrorRecord* err, cudaStream_t stream) {
  if (idx.numel == 0) return;
  const bool i64 = idx.dtype == kI64;
  auto run = [&](auto unit) {
    using U = decltype(unit);
    gather_kernel<U><<<grid_for(idx.numel), 256, 0, stream>>>(
        static_cast<U*>(out.data), static_cast<const U*>(x.data), x, idx, i64, dim, err);
  };
  switch (dev_dtype_size(x.dtype)) {
    case 8: run(uint64_t{}); break;
    case 4: run(uint32_t{}); break;
    case 2: run(uint16_t{}); break;
    default: run(uint8_t{}); break;
  }
  check_launch("gather");
}

void launch_scatter_add(const DevTensor& out, const DevTensor& src, const DevTensor& idx, int dim,
                        DeviceErrorRecord* err, cudaStream_t stream) {
  if (idx.numel == 0) return;
  const int64_t lines = idx.numel / idx.sizes[dim];
  TS_CUDA_DISPATCH_ALL(out.dtype, "scatter_add", [&] {
    using T = scalar_t;
    scatter_add_kernel<T><<<grid_for(lines), 256, 0, stream>>>(
        typed<T>(out), typed<T>(src), out, src, idx, idx.dtype == kI64, dim, err);
  });
  check_launch("scatter_add");
}

}  // namespace tessera::cuda_kernels
