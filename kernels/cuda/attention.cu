// Attention on CUDA: dispatch between the tensor-core flash kernels (attention_flash.cu)
// and the SIMT kernels here, plus the backward's D = rowsum(dO * O) pass.
//
// The SIMT kernels serve f32 and f64 (computed in their own precision, like the CPU) and
// 16-bit shapes the tensor-core path does not take. They follow the same flash schedule:
//   forward / dQ: a block owns 16 query rows (4 warps x 4 rows); it streams 32-key tiles of
//     K and V through shared memory; lane j scores key j against the warp's 4 rows (so
//     softmax statistics are warp reductions), then lanes switch to owning head-dim columns
//     to accumulate P V (or dS K), broadcasting p_j with shuffles.
//   dK/dV: the mirror image: a block owns 16 keys, streams 32-query tiles, lane i scores
//     query i, and accumulates P^T dO and dS^T Q.
// No atomics: every output element is owned by one thread, so results are deterministic.
#include <cmath>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"

namespace tessera::cuda_kernels {
namespace {

constexpr int kWarps = 4, kRowsPerWarp = 4, kBlockRows = kWarps * kRowsPerWarp, kTile = 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }

template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ const T* head(const AttnOperand& x, int b, int h) {
  return static_cast<const T*>(x.data) + b * x.sb + h * x.sh;
}
template <typename T>
__device__ __forceinline__ T* head_out(const AttnOperand& x, int b, int h) {
  return static_cast<T*>(x.data) + b * x.sb + h * x.sh;
}

// rows [row0, row0 + rows) of one head into shared memory (row pitch `pitch`), widened to A;
// rows at or past T are zero.
template <typename T, typename A>
__device__ void load_rows(A* dst, int pitch, const T* src, int64_t st, int row0, int rows, int T_,
                          int D) {
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = i / D, e = i - r * D, t = row0 + r;
    dst[r * pitch + e] = t < T_ ? to_acc(src[t * st + e]) : A(0);
  }
}

// DPL: head-dim columns per lane (D <= 32 * DPL).
template <typename T, int DPL>
__global__ void __launch_bounds__(128) attn_fwd_simt(AttnArgs a) {
  using A = acc_type<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.D, T_ = a.T, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [16][D]
  A* Ks = Qs + kBlockRows * D;             // [32][D + 1]: lane j reads row j
  A* Vs = Ks + kTile * (D + 1);            // [32][D]
  const int bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int qt = a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const int q0 = qt * kBlockRows, row0 = warp * kRowsPerWarp;
  const T *q = head<T>(a.q, b, h), *k = head<T>(a.k, b, h), *v = head<T>(a.v, b, h);
  load_rows(Qs, D, q, a.q.st, q0, kBlockRows, T_, D);
  const A scale = static_cast<A>(a.scale);
  const int key_end = a.causal ? min(T_, q0 + kBlockRows) : T_;
  A m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = A(-INFINITY);
    l[r] = A(0);
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[r][c] = A(0);
  }
  for (int k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();
    load_rows(Ks, D + 1, k, a.k.st, k0, kTile, T_, D);
    load_rows(Vs, D, v, a.v.st, k0, kTile, T_, D);
    __syncthreads();
    const int key = k0 + lane;
    A s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = A(0);
    for (int e = 0; e < D; ++e) {
      const A kv = Ks[lane * (D + 1) + e];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] += Qs[(row0 + r) * D + e] * kv;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int qi = q0 + row0 + r;
      const bool ok = key < T_ && (!a.causal || key <= qi);
      const A x = ok ? s[r] * scale : A(-INFINITY);
      const A m_new = max(m[r], warp_max(x));
      const A m_use = m_new == A(-INFINITY) ? A(0) : m_new;
      const A alpha = acc_exp(m[r] - m_use);
      s[r] = acc_exp(x - m_use);
      l[r] = l[r] * alpha + s[r];  // this lane's share; summed over the warp at the end
#pragma unroll
      for (int c = 0; c < DPL; ++c) o[r][c] *= alpha;
      m[r] = m_new;
    }
    const int keys = min(kTile, key_end - k0);
    for (int j = 0; j < keys; ++j) {
      A vv[DPL];
#pragma unroll
      for (int c = 0; c < DPL; ++c) {
        const int e = lane + 32 * c;
        vv[c] = e < D ? Vs[j * D + e] : A(0);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const A p = __shfl_sync(kFull, s[r], j);
#pragma unroll
        for (int c = 0; c < DPL; ++c) o[r][c] += p * vv[c];
      }
    }
  }
  T* out = head_out<T>(a.out, b, h);
  A* lse = static_cast<A*>(a.lse) + static_cast<int64_t>(bh) * T_;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const A total = warp_sum(l[r]);
    const int qi = q0 + row0 + r;
    if (qi >= T_) continue;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int e = lane + 32 * c;
      if (e < D) out[qi * a.out.st + e] = from_acc<T>(o[r][c] / total);
    }
    if (lane == 0) lse[qi] = m[r] + acc_log(total);
  }
}

// dQ_i = scale sum_j P_ij (dO_i . v_j - D_i) k_j, over the keys row i sees.
template <typename T, int DPL>
__global__ void __launch_bounds__(128) attn_bwd_dq_simt(AttnArgs a) {
  using A = acc_type<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.D, T_ = a.T, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [16][D]
  A* Gs = Qs + kBlockRows * D;             // [16][D] dO rows
  A* Ks = Gs + kBlockRows * D;             // [32][D + 1]
  A* Vs = Ks + kTile * (D + 1);            // [32][D + 1]
  const int bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int qt = a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const int q0 = qt * kBlockRows, row0 = warp * kRowsPerWarp;
  const T *k = head<T>(a.k, b, h), *v = head<T>(a.v, b, h);
  load_rows(Qs, D, head<T>(a.q, b, h), a.q.st, q0, kBlockRows, T_, D);
  load_rows(Gs, D, head<T>(a.dout, b, h), a.dout.st, q0, kBlockRows, T_, D);
  const A* lse = static_cast<const A*>(a.lse) + static_cast<int64_t>(bh) * T_;
  const A* delta = static_cast<const A*>(a.delta) + static_cast<int64_t>(bh) * T_;
  const A scale = static_cast<A>(a.scale);
  const int key_end = a.causal ? min(T_, q0 + kBlockRows) : T_;
  A li[kRowsPerWarp], di[kRowsPerWarp], dq[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int qi = q0 + row0 + r;
    li[r] = qi < T_ ? lse[qi] : A(0);
    di[r] = qi < T_ ? delta[qi] : A(0);
#pragma unroll
    for (int c = 0; c < DPL; ++c) dq[r][c] = A(0);
  }
  for (int k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();
    load_rows(Ks, D + 1, k, a.k.st, k0, kTile, T_, D);
    load_rows(Vs, D + 1, v, a.v.st, k0, kTile, T_, D);
    __syncthreads();
    const int key = k0 + lane;
    A s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = dp[r] = A(0);
    for (int e = 0; e < D; ++e) {
      const A kv = Ks[lane * (D + 1) + e], vv = Vs[lane * (D + 1) + e];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        s[r] += Qs[(row0 + r) * D + e] * kv;
        dp[r] += Gs[(row0 + r) * D + e] * vv;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int qi = q0 + row0 + r;
      const bool ok = qi < T_ && key < T_ && (!a.causal || key <= qi);
      const A p = ok ? acc_exp(s[r] * scale - li[r]) : A(0);
      s[r] = p * (dp[r] - di[r]);  // dS
    }
    const int keys = min(kTile, key_end - k0);
    for (int j = 0; j < keys; ++j) {
      A kv[DPL];
#pragma unroll
      for (int c = 0; c < DPL; ++c) {
        const int e = lane + 32 * c;
        kv[c] = e < D ? Ks[j * (D + 1) + e] : A(0);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const A ds = __shfl_sync(kFull, s[r], j);
#pragma unroll
        for (int c = 0; c < DPL; ++c) dq[r][c] += ds * kv[c];
      }
    }
  }
  T* out = head_out<T>(a.dq, b, h);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int qi = q0 + row0 + r;
    if (qi >= T_) continue;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int e = lane + 32 * c;
      if (e < D) out[qi * a.dq.st + e] = from_acc<T>(dq[r][c] * scale);
    }
  }
}

// dK_j = scale sum_i dS_ij q_i and dV_j = sum_i P_ij dO_i, over the queries that see key j.
template <typename T, int DPL>
__global__ void __launch_bounds__(128) attn_bwd_dkv_simt(AttnArgs a) {
  using A = acc_type<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.D, T_ = a.T, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  A* Ks = reinterpret_cast<A*>(smem_raw);  // [16][D]
  A* Vs = Ks + kBlockRows * D;             // [16][D]
  A* Qs = Vs + kBlockRows * D;             // [32][D + 1]: lane i reads row i
  A* Gs = Qs + kTile * (D + 1);            // [32][D + 1]
  A* Ls = Gs + kTile * (D + 1);            // [32] lse
  A* Ds = Ls + kTile;                      // [32] delta
  const int bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int k0 = blockIdx.y * kBlockRows, row0 = warp * kRowsPerWarp;
  const T *q = head<T>(a.q, b, h), *g = head<T>(a.dout, b, h);
  load_rows(Ks, D, head<T>(a.k, b, h), a.k.st, k0, kBlockRows, T_, D);
  load_rows(Vs, D, head<T>(a.v, b, h), a.v.st, k0, kBlockRows, T_, D);
  const A* lse = static_cast<const A*>(a.lse) + static_cast<int64_t>(bh) * T_;
  const A* delta = static_cast<const A*>(a.delta) + static_cast<int64_t>(bh) * T_;
  const A scale = static_cast<A>(a.scale);
  A dk[kRowsPerWarp][DPL], dv[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int c = 0; c < DPL; ++c) dk[r][c] = dv[r][c] = A(0);
  }
  // Causal: queries before this block's first key see none of its keys.
  const int q_begin = a.causal ? (k0 / kTile) * kTile : 0;
  for (int q0 = q_begin; q0 < T_; q0 += kTile) {
    __syncthreads();
    load_rows(Qs, D + 1, q, a.q.st, q0, kTile, T_, D);
    load_rows(Gs, D + 1, g, a.dout.st, q0, kTile, T_, D);
    if (threadIdx.x < kTile) {
      const int t = q0 + threadIdx.x;
      Ls[threadIdx.x] = t < T_ ? lse[t] : A(0);
      Ds[threadIdx.x] = t < T_ ? delta[t] : A(0);
    }
    __syncthreads();
    const int qi = q0 + lane;
    A s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = dp[r] = A(0);
    for (int e = 0; e < D; ++e) {
      const A qv = Qs[lane * (D + 1) + e], gv = Gs[lane * (D + 1) + e];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        s[r] += Ks[(row0 + r) * D + e] * qv;
        dp[r] += Vs[(row0 + r) * D + e] * gv;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int key = k0 + row0 + r;
      const bool ok = qi < T_ && key < T_ && (!a.causal || key <= qi);
      const A p = ok ? acc_exp(s[r] * scale - Ls[lane]) : A(0);
      s[r] = p;
      dp[r] = p * (dp[r] - Ds[lane]);  // dS
    }
    const int queries = min(kTile, T_ - q0);
    for (int i = 0; i < queries; ++i) {
      A qv[DPL], gv[DPL];
#pragma unroll
      for (int c = 0; c < DPL; ++c) {
        const int e = lane + 32 * c;
        qv[c] = e < D ? Qs[i * (D + 1) + e] : A(0);
        gv[c] = e < D ? Gs[i * (D + 1) + e] : A(0);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const A p = __shfl_sync(kFull, s[r], i), ds = __shfl_sync(kFull, dp[r], i);
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          dv[r][c] += p * gv[c];
          dk[r][c] += ds * qv[c];
        }
      }
    }
  }
  T* dk_out = head_out<T>(a.dk, b, h);
  T* dv_out = head_out<T>(a.dv, b, h);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int key = k0 + row0 + r;
    if (key >= T_) continue;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int e = lane + 32 * c;
      if (e >= D) continue;
      dk_out[key * a.dk.st + e] = from_acc<T>(dk[r][c] * scale);
      dv_out[key * a.dv.st + e] = from_acc<T>(dv[r][c]);
    }
  }
}

// delta[bh, t] = sum_d dO * O in the statistics type (f32; f64 for f64): one warp per row.
template <typename T>
__global__ void attn_delta(AttnArgs a) {
  using A = acc_type<T>;
  const int64_t rows = static_cast<int64_t>(a.B) * a.H * a.T;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int t = static_cast<int>(row % a.T), bh = static_cast<int>(row / a.T);
  const T* g = head<T>(a.dout, bh / a.H, bh % a.H) + t * a.dout.st;
  const T* o = head<T>(a.o, bh / a.H, bh % a.H) + t * a.o.st;
  A s = 0;
  for (int e = lane; e < a.D; e += 32) s += to_acc(g[e]) * to_acc(o[e]);
  s = warp_sum(s);
  if (lane == 0) static_cast<A*>(a.delta)[row] = s;
}

AttnOperand operand(const DevTensor& t) {
  return AttnOperand{t.data, t.strides[0], t.strides[1], t.strides[2]};
}

AttnArgs make_args(const DevTensor& q, double scale, bool causal) {
  AttnArgs a;
  a.B = static_cast<int>(q.sizes[0]);
  a.H = static_cast<int>(q.sizes[1]);
  a.T = static_cast<int>(q.sizes[2]);
  a.D = static_cast<int>(q.sizes[3]);
  a.scale = scale;
  a.causal = causal;
  return a;
}

void check_args(const DevTensor& q) {
  if (q.ndim != 4) throw CudaLaunchError("attention: operands must be 4-D [B, H, T, D]");
  if (q.sizes[3] > 256) throw CudaLaunchError("attention: head dim > 256 is not supported on CUDA");
  if (q.sizes[0] * q.sizes[1] > 2147483647LL || q.sizes[2] > 2147483647LL - 64) {
    throw CudaLaunchError("attention: B * H or T too large");
  }
}

// Calls f.operator()<DPL>() for the smallest DPL in {1, 2, 4, 8} with 32 * DPL >= D.
template <typename F>
void with_dpl(int D, F&& f) {
  if (D <= 32) f.template operator()<1>();
  else if (D <= 64) f.template operator()<2>();
  else if (D <= 128) f.template operator()<4>();
  else f.template operator()<8>();
}

template <typename K>
void launch_simt(K kernel, dim3 grid, size_t smem, const AttnArgs& a, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) {
      throw CudaLaunchError(std::string("attention: shared memory attribute: ") + cudaGetErrorString(e));
    }
  }
  kernel<<<grid, 128, smem, stream>>>(a);
}

unsigned tiles(int n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

}  // namespace

void launch_attention_forward(DevTensor q, DevTensor k, DevTensor v, DevTensor out,
                              DevTensor lse, double scale, bool causal, cudaStream_t stream) {
  check_args(q);
  AttnArgs a = make_args(q, scale, causal);
  if (a.B * a.H == 0 || a.T == 0) return;
  a.q = operand(q);
  a.k = operand(k);
  a.v = operand(v);
  a.out = operand(out);
  a.lse = lse.data;
  if (flash_forward(a, q.dtype, stream)) return check_launch("attention (flash forward)");
  TS_CUDA_DISPATCH_FLOATS(q.dtype, "attention", [&] {
    using A = acc_type<scalar_t>;
    with_dpl(a.D, [&]<int DPL>() {
      const size_t smem = sizeof(A) * (kBlockRows * a.D + kTile * (a.D + 1) + kTile * a.D);
      launch_simt(attn_fwd_simt<scalar_t, DPL>, dim3(a.B * a.H, tiles(a.T, kBlockRows)), smem,
                  a, stream);
    });
  });
  check_launch("attention (forward)");
}

void launch_attention_backward(DevTensor grad, DevTensor q, DevTensor k, DevTensor v,
                               DevTensor out, DevTensor lse, DevTensor delta, DevTensor dq,
                               DevTensor dk, DevTensor dv, double scale, bool causal,
                               cudaStream_t stream) {
  check_args(q);
  AttnArgs a = make_args(q, scale, causal);
  if (a.B * a.H == 0 || a.T == 0) return;
  a.q = operand(q);
  a.k = operand(k);
  a.v = operand(v);
  a.o = operand(out);
  a.dout = operand(grad);
  a.dq = operand(dq);
  a.dk = operand(dk);
  a.dv = operand(dv);
  a.lse = lse.data;
  a.delta = delta.data;
  const int64_t rows = static_cast<int64_t>(a.B) * a.H * a.T;
  TS_CUDA_DISPATCH_FLOATS(q.dtype, "attention_backward", [&] {
    attn_delta<scalar_t><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(a);
  });
  check_launch("attention_backward (delta)");
  if (flash_backward(a, q.dtype, stream)) return check_launch("attention_backward (flash)");
  TS_CUDA_DISPATCH_FLOATS(q.dtype, "attention_backward", [&] {
    using A = acc_type<scalar_t>;
    with_dpl(a.D, [&]<int DPL>() {
      const size_t dq_smem = sizeof(A) * (2 * kBlockRows * a.D + 2 * kTile * (a.D + 1));
      launch_simt(attn_bwd_dq_simt<scalar_t, DPL>, dim3(a.B * a.H, tiles(a.T, kBlockRows)),
                  dq_smem, a, stream);
      const size_t kv_smem =
          sizeof(A) * (2 * kBlockRows * a.D + 2 * kTile * (a.D + 1) + 2 * kTile);
      launch_simt(attn_bwd_dkv_simt<scalar_t, DPL>, dim3(a.B * a.H, tiles(a.T, kBlockRows)),
                  kv_smem, a, stream);
    });
  });
  check_launch("attention_backward");
}

}  // namespace tessera::cuda_kernels
