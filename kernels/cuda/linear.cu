// Device code of linear's bias and activation pass and of linear_act_backward (see
// linear.cuh). The CPU (kernels/cpu/linear.cc) is the spec: the same functors, 16-bit values
// computed in f32, the bias gradient summed in f64.
#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/scalar_ops.h"

namespace tessera::cuda_kernels {
namespace {

namespace ops = scalar_ops;

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename A>
__device__ __forceinline__ A activate(int act, A v) {
  switch (act) {
    case 1: return ops::relu{}(v);
    case 2: return ops::gelu_erf{}(v);
    case 3: return ops::gelu_tanh{}(v);
    default: return v;
  }
}

template <typename A>
__device__ __forceinline__ A activate_backward(int act, A g, A x) {
  switch (act) {
    case 1: return x > A(0) ? g : A(0);
    case 2: return ops::gelu_erf_backward{}(g, x);
    case 3: return ops::gelu_tanh_backward{}(g, x);
    default: return g;
  }
}

// A is the accumulator's type (f32 for 16-bit T, else T); acc may alias pre or y.
template <typename T, typename A>
__global__ void bias_act_kernel(const A* acc, T* pre, T* y, const T* __restrict__ bias, int64_t total,
                                int64_t n, int act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A v = acc[i];
    if (bias != nullptr) v = add_rn(v, static_cast<A>(to_acc(bias[i % n])));  // one rounding
    const T rounded = from_acc<T>(v);
    if (act == 0) {
      y[i] = rounded;
    } else {
      pre[i] = rounded;
      y[i] = from_acc<T>(activate(act, static_cast<A>(to_acc(rounded))));
    }
  }
}

// y = act(pre), 16 bytes of pre per thread and step where aligned (vec), else one element.
template <typename T, int V>
__global__ void act_kernel(const T* __restrict__ pre, T* __restrict__ y, int64_t total, int act) {
  struct alignas(16) Pack { T v[V]; };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total / V; i += stride) {
    Pack p;
    if constexpr (V > 1) p = reinterpret_cast<const Pack*>(pre)[i];
    else p.v[0] = pre[i];
#pragma unroll
    for (int e = 0; e < V; ++e) p.v[e] = from_acc<T>(activate(act, to_acc(p.v[e])));
    if constexpr (V > 1) reinterpret_cast<Pack*>(y)[i] = p;
    else y[i] = p.v[0];
  }
}

constexpr int kColTile = 32, kRowThreads = 8;
constexpr int64_t kChunkRows = 256;  // rows per partial sum of the bias gradient

// Block (32, 8) over 32 columns of one chunk of rows (chunk first_chunk + blockIdx.y): dpre
// for each element, and the chunk's column sums (f64) into part[chunk][col].
template <typename T>
__global__ void act_backward_kernel(const T* __restrict__ g, const T* __restrict__ pre,
                                    T* __restrict__ dpre, double* __restrict__ part, int64_t rows,
                                    int64_t n, int act, int64_t first_chunk) {
  __shared__ double sums[kRowThreads][kColTile];
  const int64_t col = blockIdx.x * static_cast<int64_t>(kColTile) + threadIdx.x;
  const int64_t chunk = first_chunk + blockIdx.y;
  const int64_t r0 = chunk * kChunkRows, r1 = min(rows, r0 + kChunkRows);
  double acc = 0.0;
  if (col < n) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowThreads) {
      const int64_t i = r * n + col;
      const auto d = activate_backward(act, to_acc(g[i]), to_acc(pre[i]));
      dpre[i] = from_acc<T>(d);
      acc += static_cast<double>(d);  // before rounding to 16 bits, as the CPU
    }
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < kRowThreads; ++k) s += sums[k][threadIdx.x];
    part[chunk * n + col] = s;
  }
}

template <typename T>
__global__ void col_sum_kernel(const double* __restrict__ part, int64_t parts, int64_t n, T* __restrict__ out) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= n) return;
  double s = 0.0;
  for (int64_t p = 0; p < parts; ++p) s += part[p * n + col];
  if constexpr (std::is_same_v<T, double>) {
    out[col] = s;
  } else {
    out[col] = from_acc<T>(__double2float_rn(s));  // the CPU's f32 sum, then 16 bits
  }
}

}  // namespace

void launch_bias_act(const DevTensor& acc, const DevTensor& pre, const DevTensor& y, const DevTensor& bias,
                     int64_t rows, int64_t n, int act, cudaStream_t stream) {
  const int64_t total = rows * n;
  if (total == 0) return;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + threads - 1) / threads, 65535 * 8));
  TS_CUDA_DISPATCH_FLOATS(y.dtype, "linear", [&] {
    using T = scalar_t;
    using A = acc_type<T>;
    bias_act_kernel<T, A><<<blocks, threads, 0, stream>>>(static_cast<const A*>(acc.data),
                                                         act != 0 ? typed<T>(pre) : nullptr, typed<T>(y),
                                                         static_cast<const T*>(bias.data), total, n, act);
  });
  check_launch("linear (bias and activation)");
}

void launch_act(const DevTensor& pre, const DevTensor& y, int64_t total, int act, cudaStream_t stream) {
  if (total == 0) return;
  TS_CUDA_DISPATCH_FLOATS(y.dtype, "linear", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    const T* p = typed<T>(pre);
    T* o = typed<T>(y);
    const bool vec = total % V == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(o) % 16 == 0;
    const int64_t items = vec ? total / V : total;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((items + 255) / 256, 132 * 16));
    if (vec) act_kernel<T, V><<<blocks, 256, 0, stream>>>(p, o, total, act);
    else act_kernel<T, 1><<<blocks, 256, 0, stream>>>(p, o, total, act);
  });
  check_launch("linear (activation)");
}

int64_t linear_act_backward_workspace_bytes(int64_t rows, int64_t n) {
  const int64_t parts = std::max<int64_t>(1, (rows + kChunkRows - 1) / kChunkRows);
  return parts * n * static_cast<int64_t>(sizeof(double));
}

void launch_linear_act_backward(const DevTensor& dpre, const DevTensor& db, const DevTensor& g,
                                const DevTensor& pre, int64_t rows, int64_t n, int act,
                                void* workspace, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t parts = (rows + kChunkRows - 1) / kChunkRows;
  TS_CUDA_DISPATCH_FLOATS(g.dtype, "linear_act_backward", [&] {
    using T = scalar_t;
    if (rows == 0) {  // an empty sum: a zero bias gradient
      const cudaError_t e = cudaMemsetAsync(db.data, 0, static_cast<size_t>(n) * sizeof(T), stream);
      if (e != cudaSuccess) throw CudaLaunchError(std::string("linear_act_backward: ") + cudaGetErrorString(e));
      return;
    }
    double* part = static_cast<double*>(workspace);
    constexpr int64_t kMaxGridY = 65535;
    for (int64_t first = 0; first < parts; first += kMaxGridY) {
      const dim3 block(kColTile, kRowThreads),
          grid(static_cast<unsigned>((n + kColTile - 1) / kColTile),
               static_cast<unsigned>(std::min(kMaxGridY, parts - first)));
      act_backward_kernel<T><<<grid, block, 0, stream>>>(typed<T>(g), typed<T>(pre), typed<T>(dpre), part,
                                                         rows, n, act, first);
    }
    col_sum_kernel<T><<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(part, parts, n,
                                                                                  typed<T>(db));
  });
  check_launch("linear_act_backward");
}

}  // namespace tessera::cuda_kernels
