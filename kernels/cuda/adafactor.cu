// Adafactor's fused passes on CUDA (adafactor.cuh): the CPU kernels' arithmetic
// (kernels/cpu/adafactor.cc) per element, each operation rounded once in the dtype, with the
// scalar functors both backends use; the sums in f64, in a fixed order.
#include "kernels/cuda/adafactor.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/scalar_ops.h"

namespace tessera::cuda_kernels {
namespace {

constexpr int kThreads = 256;

// Sums `v` over the block (kThreads threads) in a fixed tree order; thread 0 gets the sum.
__device__ double block_sum(double v) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  return partial[0];
}

// One block per row (of all B matrices): the row's sum of g^2 + eps.
template <typename S>
__global__ void row_sums_kernel(const S* g, S* out, int64_t M, int64_t N, S eps) {
  const int64_t r = blockIdx.x, b = r / M, i = r % M;
  const S* row = g + r * N;
  double acc = 0;
  for (int64_t j = threadIdx.x; j < N; j += kThreads) acc += double(row[j] * row[j] + eps);
  const double total = block_sum(acc);
  if (threadIdx.x == 0) out[b * (M + N) + i] = S(total);
}

// One thread per (matrix, column): the column's sum of g^2 + eps, rows in order.
template <typename S>
__global__ void col_sums_kernel(const S* g, S* out, int64_t B, int64_t M, int64_t N, S eps) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * N) return;
  const int64_t b = t / N, j = t % N;
  double acc = 0;
  for (int64_t i = 0; i < M; ++i) {
    const S x = g[(b * M + i) * N + j];
    acc += double(x * x + eps);
  }
  out[b * (M + N) + M + j] = S(acc);
}

template <typename S>
__device__ __forceinline__ S update_of(S g, S a, S b, bool product, S divisor, S floor) {
  if (product) return (g * a) * b;
  const S v = (a * b) / divisor;
  return g * scalar_ops::rsqrt{}(scalar_ops::maximum{}(v, floor));
}

// One block per row: the row's sum of the update's squares into rows[r].
template <typename S>
__global__ void norm_rows_kernel(const S* g, const S* a, const S* b, double* rows, int64_t M,
                                 int64_t N, bool product, S divisor, S floor) {
  const int64_t r = blockIdx.x;
  const S ai = a[r];
  const S* bj = b + (r / M) * N;
  const S* row = g + r * N;
  double acc = 0;
  for (int64_t j = threadIdx.x; j < N; j += kThreads) {
    const S x = update_of(row[j], ai, bj[j], product, divisor, floor);
    acc += double(x * x);
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) rows[r] = total;
}

// One block: the rows' sums, each thread a strided share in order, then the tree.
__global__ void sum_rows_kernel(const double* rows, int64_t count, double* out) {
  double acc = 0;
  for (int64_t r = threadIdx.x; r < count; r += kThreads) acc += rows[r];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) *out = total;
}

template <typename S>
__global__ void apply_kernel(S* w, const S* g, const S* a, const S* b, S* m, int64_t M,
                             int64_t N, int64_t total, bool product, S divisor, S floor, S scale,
                             S beta1, S one_minus_beta1, bool decay, S c, S keep, int form) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / N, j = k % N;
    S x = update_of(g[k], a[r], b[(r / M) * N + j], product, divisor, floor) * scale;
    if (m != nullptr) {
      m[k] = m[k] * beta1 + x * one_minus_beta1;
      x = m[k];
    }
    const S p = w[k];
    if (form == 0) {
      w[k] = (decay ? p - p * c : p) - x;
    } else if (form == 1) {
      w[k] = (decay ? p * keep : p) - x;
    } else {
      w[k] = decay ? p - (x + p * c) : p - x;
    }
  }
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

template <typename S>
void stats_typed(const void* g, void* out, int64_t B, int64_t M, int64_t N, double eps,
                 cudaStream_t stream) {
  if (B * M > 0) {
    row_sums_kernel<S><<<static_cast<unsigned>(B * M), kThreads, 0, stream>>>(
        static_cast<const S*>(g), static_cast<S*>(out), M, N, S(eps));
    check_launch("adafactor_stats_ rows");
  }
  if (B * N > 0) {
    col_sums_kernel<S><<<static_cast<unsigned>((B * N + kThreads - 1) / kThreads), kThreads, 0,
                         stream>>>(static_cast<const S*>(g), static_cast<S*>(out), B, M, N, S(eps));
    check_launch("adafactor_stats_ columns");
  }
}

template <typename S>
void norm_typed(const void* g, const void* a, const void* b, double* out, double* rows, int64_t B,
                int64_t M, int64_t N, bool product, double divisor, double floor,
                cudaStream_t stream) {
  if (B * M > 0) {
    norm_rows_kernel<S><<<static_cast<unsigned>(B * M), kThreads, 0, stream>>>(
        static_cast<const S*>(g), static_cast<const S*>(a), static_cast<const S*>(b), rows, M, N,
        product, S(divisor), S(floor));
    check_launch("adafactor_norm_ rows");
  }
  sum_rows_kernel<<<1, kThreads, 0, stream>>>(rows, B * M, out);
  check_launch("adafactor_norm_ sum");
}

template <typename S>
void apply_typed(void* w, const void* g, const void* a, const void* b, void* m, int64_t B,
                 int64_t M, int64_t N, bool product, double divisor, double floor, double scale,
                 double beta1, double c, int form, cudaStream_t stream) {
  const int64_t total = B * M * N;
  if (total == 0) return;
  apply_kernel<S><<<blocks_for(total), kThreads, 0, stream>>>(
      static_cast<S*>(w), static_cast<const S*>(g), static_cast<const S*>(a),
      static_cast<const S*>(b), static_cast<S*>(m), M, N, total, product, S(divisor), S(floor),
      S(scale), S(beta1), S(1.0 - beta1), c > 0, S(c), S(1.0 - c), form);
  check_launch("adafactor_apply_");
}

}  // namespace

void launch_adafactor_stats(bool f64, const void* g, void* out, int64_t B, int64_t M,
                            int64_t N, double eps, cudaStream_t stream) {
  if (f64) return stats_typed<double>(g, out, B, M, N, eps, stream);
  stats_typed<float>(g, out, B, M, N, eps, stream);
}

void launch_adafactor_norm(bool f64, const void* g, const void* a, const void* b, double* out,
                           double* rows_scratch, int64_t B, int64_t M, int64_t N, bool product,
                           double divisor, double floor, cudaStream_t stream) {
  if (f64) {
    return norm_typed<double>(g, a, b, out, rows_scratch, B, M, N, product, divisor, floor, stream);
  }
  norm_typed<float>(g, a, b, out, rows_scratch, B, M, N, product, divisor, floor, stream);
}

void launch_adafactor_apply(bool f64, void* param, const void* g, const void* a, const void* b,
                            void* exp_avg, int64_t B, int64_t M, int64_t N, bool product,
                            double divisor, double floor, double scale, double beta1, double c,
                            int form, cudaStream_t stream) {
  if (f64) {
    return apply_typed<double>(param, g, a, b, exp_avg, B, M, N, product, divisor, floor, scale,
                               beta1, c, form, stream);
  }
  apply_typed<float>(param, g, a, b, exp_avg, B, M, N, product, divisor, floor, scale, beta1, c,
                     form, stream);
}

}  // namespace tessera::cuda_kernels
