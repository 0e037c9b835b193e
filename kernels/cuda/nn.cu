// Device code of the fused nn ops: softmax / log_softmax, layer_norm forward and backward
// (cross_entropy: loss.cu; shared helpers: nn_common.cuh). The spec is the CPU (kernels/cpu/softmax.cc, norm.cc,
// loss.cc): 16-bit floats computed in f32 and rounded once, f64 in f64, layer_norm's row
// statistics summed in f64, the same operation order (no FMA contraction where the CPU
// rounds twice), so most results equal the CPU's to the last bit or within a few ulps.
//
// Rows over the contiguous last dim that fit in registers (<= 32 lanes x 8 vectors of 16
// bytes) take one warp per row with 16-byte loads and warp shuffles, reading the data once;
// longer or misaligned rows take one block per row; other dims a strided thread-per-column
// loop.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/nn.cuh"
#include "kernels/cuda/nn_common.cuh"

namespace tessera::cuda_kernels {
namespace {

// ---- softmax / log_softmax ----------------------------------------------------------------

// One warp per row held in registers: max, then the sum of exp, then the output.
template <typename T, int NV, bool kLog>
__global__ void softmax_warp_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                    int cols) {
  using A = acc_type<T>;
  constexpr int VEC = kVec<T>;
  using V = Vec<T, VEC>;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const V* xr = reinterpret_cast<const V*>(x + row * cols);
  V* yr = reinterpret_cast<V*>(y + row * cols);
  const int nvec = cols / VEC;
  A v[NV][VEC];
  A mx = neg_inf<A>();
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = k * 32 + lane;
    if (j < nvec) {
      const V p = xr[j];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        v[k][e] = to_acc(p.v[e]);
        mx = v[k][e] > mx ? v[k][e] : mx;
      }
    }
  }
  mx = warp_max(mx);
  if (mx == neg_inf<A>()) mx = A(0);  // all -inf: no inf - inf (the CPU's rule)
  A s = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (k * 32 + lane < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A ex = dexp(v[k][e] - mx);
        s += ex;
        if constexpr (!kLog) v[k][e] = ex;
      }
    }
  }
  s = warp_sum(s);
  const A lse = mx + dlog(s), inv = A(1) / s;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = k * 32 + lane;
    if (j < nvec) {
      V p;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        p.v[e] = from_acc<T>(kLog ? sub_rn(v[k][e], lse) : mul_rn(v[k][e], inv));
      }
      yr[j] = p;
    }
  }
}

// One block per row (long or misaligned rows): an online (max, sum) pass, then the output.
template <typename T, bool kLog>
__global__ void softmax_block_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t cols) {
  using A = acc_type<T>;
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  MaxSum<A> t{neg_inf<A>(), A(0)};
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) ms_add(t, to_acc(xr[i]));
  t = block_max_sum(t);
  const A mx = t.m == neg_inf<A>() ? A(0) : t.m;
  const A lse = mx + dlog(t.s), inv = A(1) / t.s;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const A v = to_acc(xr[i]);
    yr[i] = from_acc<T>(kLog ? sub_rn(v, lse) : mul_rn(dexp(v - mx), inv));
  }
}

// Softmax over a dim with inner > 1: one thread per (outer, inner) column, coalesced over inner.
template <typename T, bool kLog>
__global__ void softmax_strided_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t outer,
                                       int64_t d, int64_t inner) {
  using A = acc_type<T>;
  const int64_t n = outer * inner;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i / inner, j = i - o * inner;
    const T* xr = x + o * d * inner + j;
    T* yr = y + o * d * inner + j;
    MaxSum<A> t{neg_inf<A>(), A(0)};
    for (int64_t k = 0; k < d; ++k) ms_add(t, to_acc(xr[k * inner]));
    const A mx = t.m == neg_inf<A>() ? A(0) : t.m;
    const A lse = mx + dlog(t.s), inv = A(1) / t.s;
    for (int64_t k = 0; k < d; ++k) {
      const A v = to_acc(xr[k * inner]);
      yr[k * inner] = from_acc<T>(kLog ? sub_rn(v, lse) : mul_rn(dexp(v - mx), inv));
    }
  }
}

template <typename T, bool kLog>
void softmax_typed(T* y, const T* x, int64_t outer, int64_t d, int64_t inner, cudaStream_t s) {
  if (inner == 1) {
    constexpr int VEC = kVec<T>;
    if (d % VEC == 0 && d / VEC <= 32 * kMaxNv && aligned16(x) && aligned16(y)) {
      with_nv(d / VEC, [&](auto nv) {
        softmax_warp_kernel<T, decltype(nv)::value, kLog>
            <<<blocks_for_rows(outer, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
                x, y, outer, static_cast<int>(d));
      });
    } else {
      const int threads = d >= 8192 ? 512 : d >= 1024 ? 256 : 128;
      softmax_block_kernel<T, kLog><<<outer, threads, 0, s>>>(x, y, d);
    }
  } else {
    softmax_strided_kernel<T, kLog><<<grid_for(outer * inner), 256, 0, s>>>(x, y, outer, d, inner);
  }
}

// ---- layer_norm ---------------------------------------------------------------------------

// One warp per row in registers. Mean and variance are two f64 passes over the registers
// (the CPU's two-pass f64 statistics); the output is ((x - mean) * rstd) * w + b rounded
// step by step in the compute type, as the CPU does.
// With r (add_layer_norm) the row is s = x + r, rounded to T (as add rounds it) and
// written to s.
template <typename T, int NV>
__global__ void layer_norm_warp_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                       const T* __restrict__ b, T* __restrict__ y,
                                       stats_t<T>* __restrict__ mean, stats_t<T>* __restrict__ rstd,
                                       int64_t rows, int cols, double eps,
                                       const T* __restrict__ r, T* __restrict__ s) {
  using A = acc_type<T>;
  constexpr int VEC = kVec<T>;
  using V = Vec<T, VEC>;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const V* xr = reinterpret_cast<const V*>(x + row * cols);
  const int nvec = cols / VEC;
  A v[NV][VEC];
  double sum = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = k * 32 + lane;
    if (j < nvec) {
      V p = xr[j];
      if (r) {
        const V q = reinterpret_cast<const V*>(r + row * cols)[j];
#pragma unroll
        for (int e = 0; e < VEC; ++e) p.v[e] = from_acc<T>(add_rn(to_acc(p.v[e]), to_acc(q.v[e])));
        reinterpret_cast<V*>(s + row * cols)[j] = p;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        v[k][e] = to_acc(p.v[e]);
        sum += static_cast<double>(v[k][e]);
      }
    }
  }
  const double m = warp_sum(sum) / cols;
  double sq = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (k * 32 + lane < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const double dd = static_cast<double>(v[k][e]) - m;
        sq += dd * dd;
      }
    }
  }
  const double rs = 1.0 / sqrt(warp_sum(sq) / cols + eps);
  if (lane == 0) {
    mean[row] = static_cast<stats_t<T>>(m);
    rstd[row] = static_cast<stats_t<T>>(rs);
  }
  const A cm = static_cast<A>(m), cr = static_cast<A>(rs);
  V* yr = reinterpret_cast<V*>(y + row * cols);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = k * 32 + lane;
    if (j < nvec) {
      V wv, bv, out;
      if (w) wv = reinterpret_cast<const V*>(w)[j];
      if (b) bv = reinterpret_cast<const V*>(b)[j];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        A o = mul_rn(sub_rn(v[k][e], cm), cr);
        if (w) o = mul_rn(o, to_acc(wv.v[e]));
        if (b) o = add_rn(o, to_acc(bv.v[e]));
        out.v[e] = from_acc<T>(o);
      }
      yr[j] = out;
    }
  }
}

// One block per row for long or misaligned rows: the same arithmetic, three passes.
template <typename T>
__global__ void layer_norm_block_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                        const T* __restrict__ b, T* __restrict__ y,
                                        stats_t<T>* __restrict__ mean,
                                        stats_t<T>* __restrict__ rstd, int64_t cols, double eps,
                                        const T* __restrict__ r, T* __restrict__ s) {
  using A = acc_type<T>;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  if (r) {
    // Each thread writes the elements it reads back below (the same stride): no barrier.
    T* sr = s + row * cols;
    const T* rr = r + row * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) sr[i] = from_acc<T>(add_rn(to_acc(xr[i]), to_acc(rr[i])));
    xr = sr;
  }
  double sum = 0;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) sum += static_cast<double>(to_acc(xr[i]));
  const double m = block_sum(sum) / cols;
  double sq = 0;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const double dd = static_cast<double>(to_acc(xr[i])) - m;
    sq += dd * dd;
  }
  const double rs = 1.0 / sqrt(block_sum(sq) / cols + eps);
  if (threadIdx.x == 0) {
    mean[row] = static_cast<stats_t<T>>(m);
    rstd[row] = static_cast<stats_t<T>>(rs);
  }
  const A cm = static_cast<A>(m), cr = static_cast<A>(rs);
  T* yr = y + row * cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    A o = mul_rn(sub_rn(to_acc(xr[i]), cm), cr);
    if (w) o = mul_rn(o, to_acc(w[i]));
    if (b) o = add_rn(o, to_acc(b[i]));
    yr[i] = from_acc<T>(o);
  }
}

// ---- layer_norm backward ------------------------------------------------------------------
// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); dw = sum(g*xhat); db = sum(g).
// dw/db are deterministic two-stage column sums: per-block partials [parts, cols] into the
// workspace, then a column reduction over the parts in a fixed order (no float atomics).

constexpr int kLnBwdWarps = 8;
constexpr int64_t kLnBwdMaxBlocks = 512;  // a constant (not the SM count): same sums on any GPU
constexpr int64_t kLnColChunk = 64;       // rows per partial in the strided fallback

template <typename T> using part_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Registers hold the row's x and g only (xhat and g*w are recomputed for dx, w is re-read
// from L1 each row), so two 256-thread blocks fit per SM.
template <typename T, int NV>
__global__ void __launch_bounds__(256, 2)
ln_bwd_warp_kernel(const T* __restrict__ g, const T* __restrict__ x,
                   const stats_t<T>* __restrict__ mean, const stats_t<T>* __restrict__ rstd,
                   const T* __restrict__ w, T* __restrict__ dx, part_t<T>* __restrict__ part_w,
                   part_t<T>* __restrict__ part_b, int64_t rows, int cols,
                   const T* __restrict__ res) {
  using A = acc_type<T>;
  using P = part_t<T>;
  constexpr int VEC = kVec<T>;
  using V = Vec<T, VEC>;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int nvec = cols / VEC;
  P acc_w[NV][VEC], acc_b[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc_w[k][e] = acc_b[k][e] = P(0);
  }
  const V* wv = reinterpret_cast<const V*>(w);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(nw) + wid; row < rows;
       row += static_cast<int64_t>(gridDim.x) * nw) {
    const V* gr = reinterpret_cast<const V*>(g + row * cols);
    const V* xr = reinterpret_cast<const V*>(x + row * cols);
    const A m = static_cast<A>(mean[row]), rs = static_cast<A>(rstd[row]);
    V xs[NV], gs[NV];
    double s_gw = 0, s_gwx = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = k * 32 + lane;
      if (j < nvec) {
        xs[k] = xr[j];
        gs[k] = gr[j];
        V wk;
        if (w) wk = wv[j];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A gv = to_acc(gs[k].v[e]);
          const A xh = mul_rn(sub_rn(to_acc(xs[k].v[e]), m), rs);
          const A gw = w ? mul_rn(gv, to_acc(wk.v[e])) : gv;
          s_gw += static_cast<double>(gw);
          s_gwx += static_cast<double>(gw) * static_cast<double>(xh);
          acc_w[k][e] += static_cast<P>(gv) * static_cast<P>(xh);
          acc_b[k][e] += static_cast<P>(gv);
        }
      }
    }
    const A mean_gw = static_cast<A>(warp_sum(s_gw) / cols);
    const A mean_gwx = static_cast<A>(warp_sum(s_gwx) / cols);
    V* dr = reinterpret_cast<V*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = k * 32 + lane;
      if (j < nvec) {
        V wk, out, rv;
        if (w) wk = wv[j];
        if (res) rv = reinterpret_cast<const V*>(res + row * cols)[j];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A gv = to_acc(gs[k].v[e]);
          const A xh = mul_rn(sub_rn(to_acc(xs[k].v[e]), m), rs);
          const A gw = w ? mul_rn(gv, to_acc(wk.v[e])) : gv;
          out.v[e] = from_acc<T>(mul_rn(rs, sub_rn(sub_rn(gw, mean_gw), mul_rn(xh, mean_gwx))));
          if (res) out.v[e] = from_acc<T>(add_rn(to_acc(out.v[e]), to_acc(rv.v[e])));
        }
        dr[j] = out;
      }
    }
  }
  if (part_w == nullptr && part_b == nullptr) return;
  // The block's warps add their column sums into shared memory in warp order.
  extern __shared__ unsigned char smem_raw[];
  P* sw = reinterpret_cast<P*>(smem_raw);
  P* sb = sw + cols;
  for (int wi = 0; wi < nw; ++wi) {
    if (wid == wi) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int j = k * 32 + lane;
        if (j < nvec) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int c = j * VEC + e;
            sw[c] = wi == 0 ? acc_w[k][e] : sw[c] + acc_w[k][e];
            sb[c] = wi == 0 ? acc_b[k][e] : sb[c] + acc_b[k][e];
          }
        }
      }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    if (part_w) part_w[blockIdx.x * static_cast<int64_t>(cols) + c] = sw[c];
    if (part_b) part_b[blockIdx.x * static_cast<int64_t>(cols) + c] = sb[c];
  }
}

// Fallback dx: one block per row, three passes.
template <typename T>
__global__ void ln_bwd_block_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                    const stats_t<T>* __restrict__ mean,
                                    const stats_t<T>* __restrict__ rstd, const T* __restrict__ w,
                                    T* __restrict__ dx, int64_t cols, const T* __restrict__ res) {
  using A = acc_type<T>;
  const int64_t row = blockIdx.x;
  const T* gr = g + row * cols;
  const T* xr = x + row * cols;
  T* dr = dx + row * cols;
  const A m = static_cast<A>(mean[row]), rs = static_cast<A>(rstd[row]);
  double s_gw = 0, s_gwx = 0;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const A xh = mul_rn(sub_rn(to_acc(xr[i]), m), rs);
    const A gw = w ? mul_rn(to_acc(gr[i]), to_acc(w[i])) : to_acc(gr[i]);
    s_gw += static_cast<double>(gw);
    s_gwx += static_cast<double>(gw) * static_cast<double>(xh);
  }
  const A mean_gw = static_cast<A>(block_sum(s_gw) / cols);
  const A mean_gwx = static_cast<A>(block_sum(s_gwx) / cols);
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const A xh = mul_rn(sub_rn(to_acc(xr[i]), m), rs);
    const A gw = w ? mul_rn(to_acc(gr[i]), to_acc(w[i])) : to_acc(gr[i]);
    T out = from_acc<T>(mul_rn(rs, sub_rn(sub_rn(gw, mean_gw), mul_rn(xh, mean_gwx))));
    if (res) out = from_acc<T>(add_rn(to_acc(out), to_acc(res[row * cols + i])));
    dr[i] = out;
  }
}

// Fallback dw/db partials: thread per column, a chunk of kLnColChunk rows per grid row, f64.
template <typename T>
__global__ void ln_bwd_col_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                          const stats_t<T>* __restrict__ mean,
                                          const stats_t<T>* __restrict__ rstd,
                                          double* __restrict__ part_w,
                                          double* __restrict__ part_b, int64_t rows,
                                          int64_t cols) {
  using A = acc_type<T>;
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * kLnColChunk, r1 = min(rows, r0 + kLnColChunk);
  double sw = 0, sb = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const A gv = to_acc(g[r * cols + c]);
    const A xh = mul_rn(sub_rn(to_acc(x[r * cols + c]), static_cast<A>(mean[r])), static_cast<A>(rstd[r]));
    sw += static_cast<double>(gv) * static_cast<double>(xh);
    sb += static_cast<double>(gv);
  }
  if (part_w) part_w[blockIdx.y * cols + c] = sw;
  if (part_b) part_b[blockIdx.y * cols + c] = sb;
}

// out[c] = sum over parts of part[p, c], in f64: 32 columns x 16 part-lanes per block, the
// lanes merged in a fixed order.
template <typename T, typename P>
__global__ void ln_col_reduce_kernel(const P* __restrict__ part, int64_t parts, int64_t cols,
                                     T* __restrict__ out) {
  __shared__ double smem[16][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  double s = 0;
  if (c < cols) {
    for (int64_t p = threadIdx.y; p < parts; p += 16) s += static_cast<double>(part[p * cols + c]);
  }
  smem[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double t = 0;
    for (int k = 0; k < 16; ++k) t += smem[k][threadIdx.x];
    out[c] = from_acc<T>(static_cast<acc_type<T>>(t));  // the CPU's T(C(sum))
  }
}

}  // namespace

void launch_softmax(const DevTensor& y, const DevTensor& x, int64_t outer, int64_t d,
                    int64_t inner, bool log, cudaStream_t stream) {
  if (x.numel == 0) return;
  TS_CUDA_DISPATCH_FLOATS(x.dtype, "softmax", [&] {
    using T = scalar_t;
    if (log) softmax_typed<T, true>(typed<T>(y), typed<T>(x), outer, d, inner, stream);
    else softmax_typed<T, false>(typed<T>(y), typed<T>(x), outer, d, inner, stream);
  });
  check_launch("softmax");
}

void launch_layer_norm(const DevTensor& y, const DevTensor& mean, const DevTensor& rstd,
                       const DevTensor& x, const DevTensor& w, const DevTensor& b, int64_t rows,
                       int64_t cols, double eps, cudaStream_t stream, const DevTensor& r,
                       const DevTensor& s) {
  if (rows == 0) return;
  TS_CUDA_DISPATCH_FLOATS(x.dtype, "layer_norm", [&] {
    using T = scalar_t;
    using S = stats_t<T>;
    constexpr int VEC = kVec<T>;
    const T* wp = static_cast<const T*>(w.data);
    const T* bp = static_cast<const T*>(b.data);
    const T* rp = static_cast<const T*>(r.data);
    T* sp = static_cast<T*>(s.data);
    if (cols % VEC == 0 && cols / VEC <= 32 * kMaxNv && aligned16(x.data) && aligned16(y.data) &&
        aligned16(wp) && aligned16(bp) && aligned16(rp) && aligned16(sp)) {
      with_nv(cols / VEC, [&](auto nv) {
        layer_norm_warp_kernel<T, decltype(nv)::value>
            <<<blocks_for_rows(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
                typed<T>(x), wp, bp, typed<T>(y), typed<S>(mean), typed<S>(rstd), rows,
                static_cast<int>(cols), eps, rp, sp);
      });
    } else {
      layer_norm_block_kernel<T><<<rows, cols >= 4096 ? 512 : 256, 0, stream>>>(
          typed<T>(x), wp, bp, typed<T>(y), typed<S>(mean), typed<S>(rstd), cols, eps, rp, sp);
    }
  });
  check_launch("layer_norm");
}

int64_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t cols, int, bool want_w,
                                            bool want_b) {
  if (!want_w && !want_b) return 0;
  const int64_t parts = std::max(kLnBwdMaxBlocks, (rows + kLnColChunk - 1) / kLnColChunk);
  return 2 * parts * cols * static_cast<int64_t>(sizeof(double));
}

void launch_layer_norm_backward(const DevTensor& dx, const DevTensor& dw, const DevTensor& db,
                                const DevTensor& g, const DevTensor& x, const DevTensor& mean,
                                const DevTensor& rstd, const DevTensor& w, int64_t rows,
                                int64_t cols, void* workspace, cudaStream_t stream,
                                const DevTensor& res) {
  const bool want_w = dw.data != nullptr, want_b = db.data != nullptr;
  TS_CUDA_DISPATCH_FLOATS(x.dtype, "layer_norm_backward", [&] {
    using T = scalar_t;
    using S = stats_t<T>;
    using P = part_t<T>;
    constexpr int VEC = kVec<T>;
    const T* wp = static_cast<const T*>(w.data);
    const T* rp = static_cast<const T*>(res.data);
    auto reduce = [&](const auto* part, int64_t parts, const DevTensor& out, int64_t which) {
      if (out.data == nullptr) return;
      const dim3 block(32, 16), grid(static_cast<unsigned>((cols + 31) / 32));
      ln_col_reduce_kernel<T><<<grid, block, 0, stream>>>(part + which * parts * cols, parts, cols,
                                                          typed<T>(out));
    };
    if (rows == 0 || cols == 0) {
      // Empty input: zero parameter gradients (the CPU's empty sums).
      for (const DevTensor* o : {&dw, &db}) {
        if (o->data && o->numel) cudaMemsetAsync(o->data, 0, o->numel * sizeof(T), stream);
      }
      return;
    }
    const bool fast = cols % VEC == 0 && cols / VEC <= 32 * kMaxNv && aligned16(x.data) &&
                      aligned16(g.data) && aligned16(dx.data) && aligned16(wp) && aligned16(rp);
    if (fast) {
      const int64_t blocks = std::min(kLnBwdMaxBlocks, blocks_for_rows(rows, kLnBwdWarps));
      P* part = static_cast<P*>(workspace);
      P* pw = want_w ? part : nullptr;
      P* pb = want_b ? part + blocks * cols : nullptr;
      const size_t smem = (want_w || want_b) ? 2 * cols * sizeof(P) : 0;
      with_nv(cols / VEC, [&](auto nv) {
        ln_bwd_warp_kernel<T, decltype(nv)::value><<<blocks, 32 * kLnBwdWarps, smem, stream>>>(
            typed<T>(g), typed<T>(x), typed<S>(mean), typed<S>(rstd), wp, typed<T>(dx), pw, pb,
            rows, static_cast<int>(cols), rp);
      });
      reduce(part, blocks, dw, 0);
      reduce(part, blocks, db, 1);
    } else {
      ln_bwd_block_kernel<T><<<rows, cols >= 4096 ? 512 : 256, 0, stream>>>(
          typed<T>(g), typed<T>(x), typed<S>(mean), typed<S>(rstd), wp, typed<T>(dx), cols, rp);
      if (want_w || want_b) {
        const int64_t parts = (rows + kLnColChunk - 1) / kLnColChunk;
        double* part = static_cast<double*>(workspace);
        const dim3 grid(static_cast<unsigned>((cols + 255) / 256), static_cast<unsigned>(parts));
        ln_bwd_col_partial_kernel<T><<<grid, 256, 0, stream>>>(
            typed<T>(g), typed<T>(x), typed<S>(mean), typed<S>(rstd), want_w ? part : nullptr,
            want_b ? part + parts * cols : nullptr, rows, cols);
        reduce(part, parts, dw, 0);
        reduce(part, parts, db, 1);
      }
    }
  });
  check_launch("layer_norm_backward");
}

}  // namespace tessera::cuda_kernels
