// Device code of the fused cross_entropy forward and backward over [N, C] logits: one block
// per row with an online (max, sum) logsumexp, the per-row losses reduced in f64 in a fixed
// order (kernels/cpu/loss.cc is the spec). Out-of-range targets are recorded on the device
// (index.cuh's DeviceErrorRecord) and reported at the next indexing op.
#include "kernels/cuda/nn.cuh"
#include "kernels/cuda/nn_common.cuh"

namespace tessera::cuda_kernels {
namespace {

// ---- cross_entropy ------------------------------------------------------------------------

__device__ __forceinline__ int64_t load_target(const void* t, bool i64, int64_t r) {
  return i64 ? static_cast<const int64_t*>(t)[r] : static_cast<const int32_t*>(t)[r];
}

// One block per row: online logsumexp over the row (16-byte loads after a scalar head that
// reaches alignment: rows of 50257 logits start anywhere), then the row's loss.
template <typename T>
__global__ void ce_forward_kernel(const T* __restrict__ x, const void* target, bool t64,
                                  int64_t c, int64_t ignore_index, stats_t<T>* __restrict__ lse,
                                  double* __restrict__ row_loss, stats_t<T>* __restrict__ loss_none,
                                  DeviceErrorRecord* err) {
  using A = acc_type<T>;
  constexpr int VEC = kVec<T>;
  using V = Vec<T, VEC>;
  const int64_t r = blockIdx.x;
  const T* xr = x + r * c;
  MaxSum<A> t{neg_inf<A>(), A(0)};
  int64_t head = ((16 - reinterpret_cast<uintptr_t>(xr) % 16) % 16) / sizeof(T);
  if (reinterpret_cast<uintptr_t>(xr) % sizeof(T) != 0 || head > c) head = c;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) ms_add(t, to_acc(xr[i]));
  const int64_t nvec = (c - head) / VEC;
  const V* xv = reinterpret_cast<const V*>(xr + head);
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    const V p = xv[j];
#pragma unroll
    for (int e = 0; e < VEC; ++e) ms_add(t, to_acc(p.v[e]));
  }
  for (int64_t i = head + nvec * VEC + threadIdx.x; i < c; i += blockDim.x) ms_add(t, to_acc(xr[i]));
  t = block_max_sum(t);
  if (threadIdx.x != 0) return;
  const double l = static_cast<double>(t.m) + log(static_cast<double>(t.s));
  lse[r] = static_cast<stats_t<T>>(l);
  const int64_t tg = load_target(target, t64, r);
  double rl = 0.0;
  if (tg != ignore_index) {
    if (tg < 0 || tg >= c) {
      report_bad_index(err, kErrCrossEntropy, tg, c, r);
      rl = __longlong_as_double(0x7ff8000000000000LL);  // NaN: the loss is unusable
    } else {
      rl = l - static_cast<double>(to_acc(xr[tg]));
    }
  }
  if (loss_none) loss_none[r] = static_cast<stats_t<T>>(rl);
  else row_loss[r] = rl;
}

// mean / sum of the row losses in a fixed order (one block).
template <typename T>
__global__ void ce_reduce_kernel(const double* __restrict__ row_loss, const void* target, bool t64,
                                 int64_t n, int64_t ignore_index, bool mean,
                                 stats_t<T>* __restrict__ out) {
  double s = 0, cnt = 0;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    s += row_loss[r];
    cnt += load_target(target, t64, r) != ignore_index ? 1.0 : 0.0;  // exact below 2^53
  }
  s = block_sum(s);
  cnt = block_sum(cnt);
  if (threadIdx.x == 0) {
    const double v = mean ? s / cnt : s;  // no counted targets: 0/0 = NaN, as on the CPU
    out[0] = static_cast<stats_t<T>>(v);
  }
}

// The mean/sum scale: grad * (1 / count for mean), in f64 (one block).
template <typename T>
__global__ void ce_scale_kernel(const stats_t<T>* __restrict__ grad, const void* target, bool t64, int64_t n,
                                int64_t ignore_index, bool mean, double* __restrict__ scale) {
  double cnt = 0;
  if (mean) {
    for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
      cnt += load_target(target, t64, r) != ignore_index ? 1.0 : 0.0;
    }
    cnt = block_sum(cnt);
  }
  if (threadIdx.x == 0) {
    const double g = static_cast<double>(grad[0]);
    scale[0] = mean ? g / cnt : g;
  }
}

// dx = exp(x - lse) * s, minus s at the target before the one rounding (the CPU's order).
template <typename T>
__global__ void ce_backward_kernel(const T* __restrict__ x, const void* target, bool t64,
                                   const stats_t<T>* __restrict__ lse,
                                   const stats_t<T>* __restrict__ grad,
                                   const double* __restrict__ scale, int64_t c,
                                   int64_t ignore_index, bool vec_ok, T* __restrict__ dx,
                                   DeviceErrorRecord* err) {
  using A = acc_type<T>;
  constexpr int VEC = kVec<T>;
  using V = Vec<T, VEC>;
  const int64_t r = blockIdx.x;
  const T* xr = x + r * c;
  T* dr = dx + r * c;
  const int64_t tg = load_target(target, t64, r);
  bool zero = tg == ignore_index;
  if (!zero && (tg < 0 || tg >= c)) {
    if (threadIdx.x == 0) report_bad_index(err, kErrCrossEntropyBackward, tg, c, r);
    zero = true;
  }
  if (zero) {
    for (int64_t i = threadIdx.x; i < c; i += blockDim.x) dr[i] = from_acc<T>(A(0));
    return;
  }
  const A s = static_cast<A>(grad ? static_cast<double>(grad[r]) : scale[0]);
  const A l = static_cast<A>(lse[r]);
  auto one = [&](int64_t i, T xv) {
    const A v = mul_rn(dexp(sub_rn(to_acc(xv), l)), s);
    return from_acc<T>(i == tg ? sub_rn(v, s) : v);
  };
  int64_t head = c;
  if (vec_ok) {
    head = ((16 - reinterpret_cast<uintptr_t>(xr) % 16) % 16) / sizeof(T);
    if (head > c) head = c;
  }
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dr[i] = one(i, xr[i]);
  const int64_t nvec = (c - head) / VEC;
  const V* xv = reinterpret_cast<const V*>(xr + head);
  V* dv = reinterpret_cast<V*>(dr + head);
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    const V p = xv[j];
    V o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = one(head + j * VEC + e, p.v[e]);
    dv[j] = o;
  }
  for (int64_t i = head + nvec * VEC + threadIdx.x; i < c; i += blockDim.x) dr[i] = one(i, xr[i]);
}

int ce_threads(int64_t c) { return c >= 16384 ? 512 : c >= 2048 ? 256 : 128; }

}  // namespace

int64_t cross_entropy_workspace_bytes(int64_t n) {
  return (n + 1) * static_cast<int64_t>(sizeof(double));
}

void launch_cross_entropy(const DevTensor& loss, const DevTensor& lse, const DevTensor& logits,
                          const DevTensor& target, int reduction, int64_t ignore_index,
                          void* workspace, DeviceErrorRecord* err, cudaStream_t stream) {
  const int64_t n = logits.sizes[0], c = logits.sizes[1];
  const bool t64 = target.dtype == kI64;
  TS_CUDA_DISPATCH_FLOATS(logits.dtype, "cross_entropy", [&] {
    using T = scalar_t;
    using S = stats_t<T>;
    double* row_loss = static_cast<double*>(workspace);
    if (n > 0) {
      ce_forward_kernel<T><<<n, ce_threads(c), 0, stream>>>(
          typed<T>(logits), target.data, t64, c, ignore_index, typed<S>(lse), row_loss,
          reduction == 2 ? typed<S>(loss) : nullptr, err);
    }
    if (reduction != 2) {
      ce_reduce_kernel<T><<<1, 1024, 0, stream>>>(row_loss, target.data, t64, n, ignore_index,
                                                  reduction == 0, typed<S>(loss));
    }
  });
  check_launch("cross_entropy");
}

void launch_cross_entropy_backward(const DevTensor& dx, const DevTensor& grad,
                                   const DevTensor& logits, const DevTensor& target,
                                   const DevTensor& lse, int reduction, int64_t ignore_index,
                                   void* workspace, DeviceErrorRecord* err, cudaStream_t stream) {
  const int64_t n = logits.sizes[0], c = logits.sizes[1];
  if (n == 0) return;
  const bool t64 = target.dtype == kI64;
  TS_CUDA_DISPATCH_FLOATS(logits.dtype, "cross_entropy_backward", [&] {
    using T = scalar_t;
    using S = stats_t<T>;
    double* scale = static_cast<double*>(workspace);
    if (reduction != 2) {
      ce_scale_kernel<T><<<1, 1024, 0, stream>>>(typed<S>(grad), target.data, t64, n,
                                                 ignore_index, reduction == 0, scale);
    }
    // 16-byte vectors need x and dx at the same offset from a 16-byte boundary.
    const bool vec_ok = (reinterpret_cast<uintptr_t>(logits.data) - reinterpret_cast<uintptr_t>(dx.data)) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(logits.data) % sizeof(T) == 0;
    ce_backward_kernel<T><<<n, ce_threads(c), 0, stream>>>(
        typed<T>(logits), target.data, t64, typed<S>(lse), reduction == 2 ? typed<S>(grad) : nullptr,
        scale, c, ignore_index, vec_ok, typed<T>(dx), err);
  });
  check_launch("cross_entropy_backward");
}

}  // namespace tessera::cuda_kernels
