// Device helpers shared by the fused nn kernels (nn.cu: softmax, layer_norm; loss.cu:
// cross_entropy): the CPU's rounding steps without FMA contraction, warp and block sums, the
// online (max, sum) pair of a logsumexp, 16-byte vectors and the per-row launch shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace tessera::cuda_kernels {
namespace {

constexpr unsigned kFull = 0xffffffffu;

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return -__longlong_as_double(0x7ff0000000000000LL);
}
__device__ __forceinline__ float dexp(float v) { return expf(v); }
__device__ __forceinline__ double dexp(double v) { return exp(v); }
__device__ __forceinline__ float dlog(float v) { return logf(v); }
__device__ __forceinline__ double dlog(double v) { return log(v); }
// Rounded operations the compiler may not fuse into FMAs (the CPU rounds each one).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

template <typename T> using stats_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T> inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A u = __shfl_xor_sync(kFull, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// A block-wide sum, the same value returned to every thread (fixed order: deterministic).
template <typename A> __device__ A block_sum(A v) {
  __shared__ A smem[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) smem[wid] = v;
  __syncthreads();
  A r = threadIdx.x < nw ? smem[threadIdx.x] : A(0);
  if (wid == 0) r = warp_sum(r);
  if (threadIdx.x == 0) smem[0] = r;
  __syncthreads();
  r = smem[0];
  __syncthreads();
  return r;
}

// Online softmax statistics: the running max m and sum s of exp(x - m).
template <typename A> struct MaxSum { A m, s; };
template <typename A> __device__ __forceinline__ void ms_add(MaxSum<A>& t, A v) {
  if (v > t.m) {
    t.s = t.s * dexp(t.m - v) + A(1);
    t.m = v;
  } else if (v != neg_inf<A>()) {
    t.s += dexp(v - t.m);  // NaN inputs make s NaN, as on the CPU
  }
}
template <typename A> __device__ __forceinline__ MaxSum<A> ms_merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = b.m > a.m ? b.m : a.m;
  const A s = (a.s == A(0) ? A(0) : a.s * dexp(a.m - m)) + (b.s == A(0) ? A(0) : b.s * dexp(b.m - m));
  return {m, s};
}
template <typename A> __device__ MaxSum<A> block_max_sum(MaxSum<A> t) {
  __shared__ A sm[32], ss[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    t = ms_merge(t, MaxSum<A>{__shfl_xor_sync(kFull, t.m, o), __shfl_xor_sync(kFull, t.s, o)});
  }
  if (lane == 0) { sm[wid] = t.m; ss[wid] = t.s; }
  __syncthreads();
  if (wid == 0) {
    t = lane < nw ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>{neg_inf<A>(), A(0)};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      t = ms_merge(t, MaxSum<A>{__shfl_xor_sync(kFull, t.m, o), __shfl_xor_sync(kFull, t.s, o)});
    }
    if (lane == 0) { sm[0] = t.m; ss[0] = t.s; }
  }
  __syncthreads();
  t = {sm[0], ss[0]};
  __syncthreads();
  return t;
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Runs f with the compile-time number of 16-byte vectors per lane a row of nvec vectors needs.
template <typename F> void with_nv(int64_t nvec, F&& f) {
  const int64_t per_lane = (nvec + 31) / 32;
  if (per_lane <= 1) f(std::integral_constant<int, 1>{});
  else if (per_lane <= 2) f(std::integral_constant<int, 2>{});
  else if (per_lane <= 4) f(std::integral_constant<int, 4>{});
  else if (per_lane <= 6) f(std::integral_constant<int, 6>{});
  else f(std::integral_constant<int, 8>{});
}
constexpr int kMaxNv = 8;
constexpr int kWarpsPerBlock = 4;

int64_t blocks_for_rows(int64_t rows, int warps) { return (rows + warps - 1) / warps; }

}  // namespace
}  // namespace tessera::cuda_kernels
