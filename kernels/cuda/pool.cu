// Device code of max_pool2d (NCHW) and its backward. The spec is kernels/cpu/pool.cc: the
// window is clipped to the plane, a greater value wins, ties keep the first, the first NaN
// wins for good; the backward adds each output's gradient at its argmax in output order.
//
// Backward without atomics: each input element gathers, in increasing output order, the
// gradients of the windows that contain it and chose it, so overlapping windows sum in the
// CPU's order (16-bit grads in f32, rounded once). A check kernel records any index that lies
// outside its window (impossible for indices from max_pool2d); indices from elsewhere take a
// plane-per-thread loop that accepts any in-plane index.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/pool.cuh"

namespace tessera::cuda_kernels {
namespace {

__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename A> __device__ __forceinline__ void fold_max(A v, int64_t idx, A& best, int64_t& arg) {
  bool take = v > best;
  if constexpr (std::is_floating_point_v<A>) take = take || (v != v && best == best);
  if (take) {
    best = v;
    arg = idx;
  }
}

template <typename T>
__global__ void max_pool_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t* __restrict__ ind,
                                int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                PoolWindow win) {
  using A = acc_type<T>;
  const int64_t n = planes * oh * ow;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % ow, t = i / ow, r = t % oh, p = t / oh;
    const int64_t y0 = imax(0, r * win.sh - win.ph), y1 = imin(h, r * win.sh - win.ph + win.kh);
    const int64_t x0 = imax(0, c * win.sw - win.pw), x1 = imin(w, c * win.sw - win.pw + win.kw);
    const T* plane = x + p * h * w;
    A best = to_acc(plane[y0 * w + x0]);
    int64_t arg = y0 * w + x0;
    for (int64_t iy = y0; iy < y1; ++iy) {
      for (int64_t ix = iy == y0 ? x0 + 1 : x0; ix < x1; ++ix) {
        fold_max(to_acc(plane[iy * w + ix]), iy * w + ix, best, arg);
      }
    }
    y[i] = from_acc<T>(best);
    ind[i] = arg;
  }
}

// Records indices that are out of the plane or outside their output's (clipped) window.
__global__ void check_window_kernel(const void* ind, bool i64, int64_t planes, int64_t h,
                                    int64_t w, int64_t oh, int64_t ow, PoolWindow win,
                                    DeviceErrorRecord* err) {
  const int64_t n = planes * oh * ow;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % ow, r = (i / ow) % oh;
    const int64_t k = load_index(ind, i64, i);
    const int64_t iy = k >= 0 ? k / w : -1, ix = k >= 0 ? k % w : -1;
    const bool in_window = k >= 0 && k < h * w && iy >= r * win.sh - win.ph &&
                           iy < r * win.sh - win.ph + win.kh && ix >= c * win.sw - win.pw &&
                           ix < c * win.sw - win.pw + win.kw;
    if (!in_window) report_bad_index(err, kErrMaxPoolBackward, k, h * w, 0);
  }
}

// One thread per input element: the outputs whose windows hold it, in increasing order.
template <typename T>
__global__ void max_pool_bwd_gather_kernel(const T* __restrict__ g, const void* ind, bool i64,
                                           T* __restrict__ dx, int64_t planes, int64_t h, int64_t w,
                                           int64_t oh, int64_t ow, PoolWindow win) {
  using A = acc_type<T>;
  const int64_t n = planes * h * w;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pos = i % (h * w), p = i / (h * w);
    const int64_t iy = pos / w, ix = pos % w;
    // Windows r with r*sh - ph <= iy < r*sh - ph + kh.
    const int64_t ly = iy + win.ph - win.kh + 1, lx = ix + win.pw - win.kw + 1;
    const int64_t r0 = ly <= 0 ? 0 : (ly + win.sh - 1) / win.sh;
    const int64_t r1 = imin(oh - 1, (iy + win.ph) / win.sh);
    const int64_t c0 = lx <= 0 ? 0 : (lx + win.sw - 1) / win.sw;
    const int64_t c1 = imin(ow - 1, (ix + win.pw) / win.sw);
    A acc = A(0);
    const int64_t base = p * oh * ow;
    for (int64_t r = r0; r <= r1; ++r) {
      for (int64_t c = c0; c <= c1; ++c) {
        const int64_t k = base + r * ow + c;
        if (load_index(ind, i64, k) == pos) acc += to_acc(g[k]);
      }
    }
    dx[i] = from_acc<T>(acc);
  }
}

// Any in-plane indices: one thread per plane adds in output order into an f32/f64 plane.
template <typename T>
__global__ void max_pool_bwd_plane_kernel(const T* __restrict__ g, const void* ind, bool i64,
                                          T* __restrict__ dx, acc_type<T>* __restrict__ wide,
                                          int64_t planes, int64_t hw, int64_t ohw,
                                          DeviceErrorRecord* err) {
  using A = acc_type<T>;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < planes;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A* acc = wide + p * hw;
    for (int64_t i = 0; i < hw; ++i) acc[i] = A(0);
    for (int64_t k = 0; k < ohw; ++k) {
      const int64_t i = load_index(ind, i64, p * ohw + k);
      if (i < 0 || i >= hw) {
        report_bad_index(err, kErrMaxPoolBackward, i, hw, 0);
        continue;
      }
      acc[i] += to_acc(g[p * ohw + k]);
    }
    for (int64_t i = 0; i < hw; ++i) dx[p * hw + i] = from_acc<T>(acc[i]);
  }
}

}  // namespace

void launch_max_pool2d(const DevTensor& y, const DevTensor& idx, const DevTensor& x,
                       const PoolWindow& win, cudaStream_t stream) {
  const int64_t n = y.numel;
  if (n == 0) return;
  const int64_t planes = x.sizes[0] * x.sizes[1];
  TS_CUDA_DISPATCH_ALL(x.dtype, "max_pool2d", [&] {
    using T = scalar_t;
    max_pool_kernel<T><<<grid_for(n), 256, 0, stream>>>(typed<T>(x), typed<T>(y),
                                                        typed<int64_t>(idx), planes, x.sizes[2],
                                                        x.sizes[3], y.sizes[2], y.sizes[3], win);
  });
  check_launch("max_pool2d");
}

int64_t max_pool2d_backward_workspace_bytes(const DevTensor& dx, bool windowed) {
  if (windowed) return 0;
  return dx.numel * (dx.dtype == kF64 ? 8 : 4);
}

void launch_max_pool2d_backward(const DevTensor& dx, const DevTensor& grad, const DevTensor& idx,
                                const PoolWindow& win, bool windowed, void* workspace,
                                DeviceErrorRecord* err, cudaStream_t stream) {
  if (dx.numel == 0) return;
  const int64_t planes = dx.sizes[0] * dx.sizes[1], h = dx.sizes[2], w = dx.sizes[3];
  const int64_t oh = grad.sizes[2], ow = grad.sizes[3];
  const bool i64 = idx.dtype == kI64;
  TS_CUDA_DISPATCH_FLOATS(dx.dtype, "max_pool2d_backward", [&] {
    using T = scalar_t;
    if (windowed) {
      if (grad.numel > 0) {
        check_window_kernel<<<grid_for(grad.numel), 256, 0, stream>>>(idx.data, i64, planes, h, w,
                                                                       oh, ow, win, err);
      }
      max_pool_bwd_gather_kernel<T><<<grid_for(dx.numel), 256, 0, stream>>>(
          typed<T>(grad), idx.data, i64, typed<T>(dx), planes, h, w, oh, ow, win);
    } else {
      max_pool_bwd_plane_kernel<T><<<grid_for(planes, 64), 64, 0, stream>>>(
          typed<T>(grad), idx.data, i64, typed<T>(dx), static_cast<acc_type<T>*>(workspace),
          planes, h * w, oh * ow, err);
    }
  });
  check_launch("max_pool2d_backward");
}

}  // namespace tessera::cuda_kernels
