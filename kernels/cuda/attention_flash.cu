// Tensor-core flash attention (FlashAttention-2 schedule) for f16/bf16, head dim 32/64/128:
// mma.sync m16n8k16 with f32 accumulation, ldmatrix fragment loads, cp.async double-buffered
// tiles in shared memory (rows padded by 16 bytes so ldmatrix is bank-conflict free).
//
//   forward: a block owns 64 queries (4 warps x 16 rows, Q fragments kept in registers) and
//     streams 64-key tiles: S = Q K^T, online softmax in the exp2 domain, O += P V with P
//     rounded to the input type (as FlashAttention does); writes O and lse = m + log(l).
//   backward, pass 1 (dK, dV): a block owns 64 keys (4 warps x 16) and streams query tiles:
//     S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T,
//     dS^T = P^T (dP^T - D), dK += dS^T Q.
//   backward, pass 2 (dQ): a block owns 64 queries and streams key tiles: S, P, dP = dO V^T,
//     dS, dQ += dS K. Recomputing S and dP here (7 GEMMs instead of 5) replaces
//     FlashAttention-2's float atomics on dQ: every output has one owner, so the result is
//     deterministic.
// Causal: tiles wholly above the diagonal are skipped; causal forward/dQ grids run the
// longest query tiles first.
#include <cstdint>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"

namespace tessera::cuda_kernels {
namespace {

constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Fragment addresses inside a row-major [rows][LD] tile, for this lane of an x4 ldmatrix:
// A operand (16 x 16 at row r0, col c0): matrices (rows 0-7, 8-15) x (cols 0-7, 8-15).
template <int LD>
__device__ __forceinline__ const uint16_t* a_frag(const uint16_t* tile, int r0, int c0, int lane) {
  return tile + (r0 + (lane & 15)) * LD + c0 + (lane >> 4) * 8;
}
// B operand from an [n][k] tile (K for Q K^T): two n8 blocks x two k halves; registers
// {0, 1} feed n block r0..r0+7, {2, 3} n block r0+8..r0+15.
template <int LD>
__device__ __forceinline__ const uint16_t* b_frag(const uint16_t* tile, int r0, int c0, int lane) {
  return tile + (r0 + (lane & 7) + ((lane >> 4) << 3)) * LD + c0 + ((lane >> 3) & 1) * 8;
}
// B operand from a [k][n] tile (V for P V) through ldmatrix.trans: same addresses as a_frag;
// registers {0, 1} feed n block c0..c0+7, {2, 3} n block c0+8..c0+15.

// rows [row0, row0 + ROWS) of one head (row stride st elements) into a [ROWS][D + 8] tile.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* g, int64_t st, int row0,
                                          int T) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i - r * kChunks, t = row0 + r;
    const bool ok = t < T;
    cp_async16(tile + r * (D + 8) + c * 8, ok ? g + t * st + c * 8 : g, ok);
  }
}

// Stores a warp's 16 x D f32 accumulator rows (times `mul`) into rows row_a, row_a + 8.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* base, int64_t st, int row_a, int T_, int tig,
                                           const float (*acc)[4], float mul_a, float mul_b) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + 8 * r;
    if (row >= T_) continue;
    const float mul = r ? mul_b : mul_a;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      T pair[2] = {from_acc<T>(acc[dt][2 * r] * mul), from_acc<T>(acc[dt][2 * r + 1] * mul)};
      *reinterpret_cast<uint32_t*>(base + row * st + dt * 8 + tig * 2) =
          *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

template <typename T>
__device__ __forceinline__ const uint16_t* head_bits(const AttnOperand& x, int b, int h) {
  return static_cast<const uint16_t*>(x.data) + b * x.sb + h * x.sh;
}
template <typename T>
__device__ __forceinline__ T* head_of(const AttnOperand& x, int b, int h) {
  return static_cast<T*>(x.data) + b * x.sb + h * x.sh;
}

// P (or dS) in C-fragment layout, 16-key block kk, as an A fragment (rounded to T).
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t* a, const float (*c)[4], int kk) {
  a[0] = Mma<T>::pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = Mma<T>::pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = Mma<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = Mma<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ---- forward ----------------------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_fwd(AttnArgs a) {
  constexpr int Br = 64, Bc = 64, LD = D + 8, NT = Bc / 8, DT = D / 8, KD = D / 16;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* Qs = smem;            // [Br][LD]
  uint16_t* Ks = Qs + Br * LD;    // [2][Bc][LD]
  uint16_t* Vs = Ks + 2 * Bc * LD;  // [2][Bc][LD]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int T_ = a.T, bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int q0 = (a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y) * Br;
  const uint16_t *q = head_bits<T>(a.q, b, h), *k = head_bits<T>(a.k, b, h),
                 *v = head_bits<T>(a.v, b, h);
  const int kv_end = a.causal ? min(T_, q0 + Br) : T_;
  const int n_tiles = (kv_end + Bc - 1) / Bc;
  load_tile<D, Br>(Qs, q, a.q.st, q0, T_);
  load_tile<D, Bc>(Ks, k, a.k.st, 0, T_);
  load_tile<D, Bc>(Vs, v, a.v.st, 0, T_);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) ldsm_x4(qf[kk], a_frag<LD>(Qs, warp * 16, kk * 16, lane));
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  const int row_a = q0 + warp * 16 + g;
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles) {
      load_tile<D, Bc>(Ks + (buf ^ 1) * Bc * LD, k, a.k.st, (j + 1) * Bc, T_);
      load_tile<D, Bc>(Vs + (buf ^ 1) * Bc * LD, v, a.v.st, (j + 1) * Bc, T_);
    }
    cp_async_commit();
    const uint16_t *Kb = Ks + buf * Bc * LD, *Vb = Vs + buf * Bc * LD;
    float s[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int nb = 0; nb < Bc / 16; ++nb) {
        uint32_t kf[4];
        ldsm_x4(kf, b_frag<LD>(Kb, nb * 16, kk * 16, lane));
        Mma<T>::run(s[2 * nb], qf[kk], kf[0], kf[1]);
        Mma<T>::run(s[2 * nb + 1], qf[kk], kf[2], kf[3]);
      }
    }
    const int k0 = j * Bc;
    const bool mask = k0 + Bc > T_ || (a.causal && k0 + Bc - 1 > q0 + warp * 16);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * sl2;
        if (mask) {
          const int col = k0 + nt * 8 + tig * 2 + (e & 1), row = row_a + (e >> 1) * 8;
          if (col >= T_ || (a.causal && col > row)) x = -INFINITY;
        }
        s[nt][e] = x;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float p0 = exp2f(s[nt][2 * r] - m_use), p1 = exp2f(s[nt][2 * r + 1] - m_use);
        s[nt][2 * r] = p0;
        s[nt][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l[r] = l[r] * alpha + sum;  // this thread's columns; the quad sums at the end
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][2 * r] *= alpha;
        o[dt][2 * r + 1] *= alpha;
      }
      m[r] = m_new;
    }
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t pa[4];
      c_to_a<T>(pa, s, kk);
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        uint32_t vf[4];
        ldsm_x4_t(vf, a_frag<LD>(Vb, kk * 16, db * 16, lane));
        Mma<T>::run(o[2 * db], pa, vf[0], vf[1]);
        Mma<T>::run(o[2 * db + 1], pa, vf[2], vf[3]);
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }
  float inv[2];
  float* lse = static_cast<float*>(a.lse) + static_cast<int64_t>(bh) * T_;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float total = l[r];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    inv[r] = 1.f / total;
    const int row = row_a + 8 * r;
    if (tig == 0 && row < T_) lse[row] = m[r] * kLn2 + logf(total);
  }
  store_rows<T, D>(head_of<T>(a.out, b, h), a.out.st, row_a, T_, tig, o, inv[0], inv[1]);
}

// ---- backward pass 1: dK, dV ------------------------------------------------------------------
template <typename T, int D, int Br>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkv(AttnArgs a) {
  constexpr int Bc = 64, LD = D + 8, NT = Br / 8, DT = D / 8, KD = D / 16;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* Ks = smem;               // [Bc][LD]
  uint16_t* Vs = Ks + Bc * LD;       // [Bc][LD]
  uint16_t* Qs = Vs + Bc * LD;       // [2][Br][LD]
  uint16_t* Gs = Qs + 2 * Br * LD;   // [2][Br][LD] dO
  float* Ls = reinterpret_cast<float*>(Gs + 2 * Br * LD);  // [2][Br] lse * log2(e)
  float* Ds = Ls + 2 * Br;                                 // [2][Br] delta
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int T_ = a.T, bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int k0 = blockIdx.y * Bc;
  const uint16_t *q = head_bits<T>(a.q, b, h), *dout = head_bits<T>(a.dout, b, h);
  const float* lse = static_cast<const float*>(a.lse) + static_cast<int64_t>(bh) * T_;
  const float* delta = static_cast<const float*>(a.delta) + static_cast<int64_t>(bh) * T_;
  auto load_queries = [&](int buf, int q0) {
    load_tile<D, Br>(Qs + buf * Br * LD, q, a.q.st, q0, T_);
    load_tile<D, Br>(Gs + buf * Br * LD, dout, a.dout.st, q0, T_);
    for (int i = threadIdx.x; i < Br; i += kThreads) {
      const int t = q0 + i;
      Ls[buf * Br + i] = t < T_ ? lse[t] * kLog2e : 0.f;
      Ds[buf * Br + i] = t < T_ ? delta[t] : 0.f;
    }
  };
  const int qt_begin = a.causal ? k0 / Br : 0, n_qt = (T_ + Br - 1) / Br;
  load_tile<D, Bc>(Ks, head_bits<T>(a.k, b, h), a.k.st, k0, T_);
  load_tile<D, Bc>(Vs, head_bits<T>(a.v, b, h), a.v.st, k0, T_);
  load_queries(0, qt_begin * Br);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  float dk[DT][4] = {}, dv[DT][4] = {};
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  const int key_a = k0 + warp * 16 + g;
  for (int qt = qt_begin, it = 0; qt < n_qt; ++qt, ++it) {
    const int buf = it & 1, q0 = qt * Br;
    if (qt + 1 < n_qt) load_queries(buf ^ 1, q0 + Br);
    cp_async_commit();
    const uint16_t *Qb = Qs + buf * Br * LD, *Gb = Gs + buf * Br * LD;
    const float *Lb = Ls + buf * Br, *Db = Ds + buf * Br;
    float st[NT][4] = {}, dpt[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t kf[4], vf[4];
      ldsm_x4(kf, a_frag<LD>(Ks, warp * 16, kk * 16, lane));
      ldsm_x4(vf, a_frag<LD>(Vs, warp * 16, kk * 16, lane));
#pragma unroll
      for (int nb = 0; nb < Br / 16; ++nb) {
        uint32_t qf[4], gf[4];
        ldsm_x4(qf, b_frag<LD>(Qb, nb * 16, kk * 16, lane));
        ldsm_x4(gf, b_frag<LD>(Gb, nb * 16, kk * 16, lane));
        Mma<T>::run(st[2 * nb], kf, qf[0], qf[1]);
        Mma<T>::run(st[2 * nb + 1], kf, qf[2], qf[3]);
        Mma<T>::run(dpt[2 * nb], vf, gf[0], gf[1]);
        Mma<T>::run(dpt[2 * nb + 1], vf, gf[2], gf[3]);
      }
    }
    // P^T and dS^T = P^T (dP^T - D); rows are keys, columns queries.
    const bool mask = q0 + Br > T_ || k0 + Bc > T_ || (a.causal && q0 < k0 + warp * 16 + 15);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + tig * 2 + (e & 1);
        float p = exp2f(st[nt][e] * sl2 - Lb[qc]);
        if (mask) {
          const int query = q0 + qc, key = key_a + (e >> 1) * 8;
          if (query >= T_ || key >= T_ || (a.causal && key > query)) p = 0.f;
        }
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - Db[qc]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < Br / 16; ++kk) {
      uint32_t pa[4], da[4];
      c_to_a<T>(pa, st, kk);
      c_to_a<T>(da, dpt, kk);
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        uint32_t gf[4], qf[4];
        ldsm_x4_t(gf, a_frag<LD>(Gb, kk * 16, db * 16, lane));
        ldsm_x4_t(qf, a_frag<LD>(Qb, kk * 16, db * 16, lane));
        Mma<T>::run(dv[2 * db], pa, gf[0], gf[1]);
        Mma<T>::run(dv[2 * db + 1], pa, gf[2], gf[3]);
        Mma<T>::run(dk[2 * db], da, qf[0], qf[1]);
        Mma<T>::run(dk[2 * db + 1], da, qf[2], qf[3]);
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }
  const float scale = static_cast<float>(a.scale);
  store_rows<T, D>(head_of<T>(a.dk, b, h), a.dk.st, key_a, T_, tig, dk, scale, scale);
  store_rows<T, D>(head_of<T>(a.dv, b, h), a.dv.st, key_a, T_, tig, dv, 1.f, 1.f);
}

// ---- backward pass 2: dQ ----------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq(AttnArgs a) {
  constexpr int Br = 64, Bc = 64, LD = D + 8, NT = Bc / 8, DT = D / 8, KD = D / 16;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* Qs = smem;              // [Br][LD]
  uint16_t* Gs = Qs + Br * LD;      // [Br][LD] dO
  uint16_t* Ks = Gs + Br * LD;      // [2][Bc][LD]
  uint16_t* Vs = Ks + 2 * Bc * LD;  // [2][Bc][LD]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int T_ = a.T, bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int q0 = (a.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y) * Br;
  const uint16_t *k = head_bits<T>(a.k, b, h), *v = head_bits<T>(a.v, b, h);
  const int kv_end = a.causal ? min(T_, q0 + Br) : T_;
  const int n_tiles = (kv_end + Bc - 1) / Bc;
  load_tile<D, Br>(Qs, head_bits<T>(a.q, b, h), a.q.st, q0, T_);
  load_tile<D, Br>(Gs, head_bits<T>(a.dout, b, h), a.dout.st, q0, T_);
  load_tile<D, Bc>(Ks, k, a.k.st, 0, T_);
  load_tile<D, Bc>(Vs, v, a.v.st, 0, T_);
  cp_async_commit();
  const int row_a = q0 + warp * 16 + g;
  const float* lse = static_cast<const float*>(a.lse) + static_cast<int64_t>(bh) * T_;
  const float* delta = static_cast<const float*>(a.delta) + static_cast<int64_t>(bh) * T_;
  float l2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + 8 * r;
    l2[r] = row < T_ ? lse[row] * kLog2e : 0.f;
    dl[r] = row < T_ ? delta[row] : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();
  float dq[DT][4] = {};
  const float sl2 = static_cast<float>(a.scale) * kLog2e;
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles) {
      load_tile<D, Bc>(Ks + (buf ^ 1) * Bc * LD, k, a.k.st, (j + 1) * Bc, T_);
      load_tile<D, Bc>(Vs + (buf ^ 1) * Bc * LD, v, a.v.st, (j + 1) * Bc, T_);
    }
    cp_async_commit();
    const uint16_t *Kb = Ks + buf * Bc * LD, *Vb = Vs + buf * Bc * LD;
    float s[NT][4] = {}, dp[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t qf[4], gf[4];
      ldsm_x4(qf, a_frag<LD>(Qs, warp * 16, kk * 16, lane));
      ldsm_x4(gf, a_frag<LD>(Gs, warp * 16, kk * 16, lane));
#pragma unroll
      for (int nb = 0; nb < Bc / 16; ++nb) {
        uint32_t kf[4], vf[4];
        ldsm_x4(kf, b_frag<LD>(Kb, nb * 16, kk * 16, lane));
        ldsm_x4(vf, b_frag<LD>(Vb, nb * 16, kk * 16, lane));
        Mma<T>::run(s[2 * nb], qf, kf[0], kf[1]);
        Mma<T>::run(s[2 * nb + 1], qf, kf[2], kf[3]);
        Mma<T>::run(dp[2 * nb], gf, vf[0], vf[1]);
        Mma<T>::run(dp[2 * nb + 1], gf, vf[2], vf[3]);
      }
    }
    const int k0 = j * Bc;
    const bool mask = k0 + Bc > T_ || (a.causal && k0 + Bc - 1 > q0 + warp * 16);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float p = exp2f(s[nt][e] * sl2 - l2[r]);
        if (mask) {
          const int col = k0 + nt * 8 + tig * 2 + (e & 1), row = row_a + 8 * r;
          if (col >= T_ || (a.causal && col > row)) p = 0.f;
        }
        dp[nt][e] = p * (dp[nt][e] - dl[r]);  // dS
      }
    }
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t da[4];
      c_to_a<T>(da, dp, kk);
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        uint32_t kf[4];
        ldsm_x4_t(kf, a_frag<LD>(Kb, kk * 16, db * 16, lane));
        Mma<T>::run(dq[2 * db], da, kf[0], kf[1]);
        Mma<T>::run(dq[2 * db + 1], da, kf[2], kf[3]);
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }
  const float scale = static_cast<float>(a.scale);
  store_rows<T, D>(head_of<T>(a.dq, b, h), a.dq.st, row_a, T_, tig, dq, scale, scale);
}

// ---- host side --------------------------------------------------------------------------------
bool aligned(const AttnOperand& x) {
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.sb % 8 == 0 && x.sh % 8 == 0 &&
         x.st % 8 == 0;
}

template <typename K>
void launch(K kernel, dim3 grid, size_t smem, const AttnArgs& a, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) {
      throw CudaLaunchError(std::string("attention: shared memory attribute: ") +
                            cudaGetErrorString(e));
    }
  }
  kernel<<<grid, kThreads, smem, stream>>>(a);
}

template <typename F>
bool with_types(const AttnArgs& a, int dtype, F&& f) {
  if (dtype != kBF16 && dtype != kF16) return false;
  if (a.D != 32 && a.D != 64 && a.D != 128) return false;
  auto typed_d = [&]<typename T>() {
    if (a.D == 32) f.template operator()<T, 32>();
    else if (a.D == 64) f.template operator()<T, 64>();
    else f.template operator()<T, 128>();
  };
  if (dtype == kBF16) typed_d.template operator()<__nv_bfloat16>();
  else typed_d.template operator()<__half>();
  return true;
}

unsigned tiles(int n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

}  // namespace

bool flash_forward(const AttnArgs& a, int dtype, cudaStream_t stream) {
  if (!aligned(a.q) || !aligned(a.k) || !aligned(a.v) || !aligned(a.out)) return false;
  return with_types(a, dtype, [&]<typename T, int D>() {
    const size_t smem = sizeof(uint16_t) * (64 + 4 * 64) * (D + 8);
    launch(flash_fwd<T, D>, dim3(a.B * a.H, tiles(a.T, 64)), smem, a, stream);
  });
}

bool flash_backward(const AttnArgs& a, int dtype, cudaStream_t stream) {
  for (const AttnOperand* x : {&a.q, &a.k, &a.v, &a.dout, &a.dq, &a.dk, &a.dv}) {
    if (!aligned(*x)) return false;
  }
  return with_types(a, dtype, [&]<typename T, int D>() {
    // 128-wide heads take 32-query tiles in pass 1: dK and dV accumulators use 128
    // registers a thread already.
    constexpr int Br = D == 128 ? 32 : 64;
    const size_t kv_smem = sizeof(uint16_t) * (2 * 64 + 4 * Br) * (D + 8) + sizeof(float) * 4 * Br;
    launch(flash_bwd_dkv<T, D, Br>, dim3(a.B * a.H, tiles(a.T, 64)), kv_smem, a, stream);
    const size_t dq_smem = sizeof(uint16_t) * (2 * 64 + 4 * 64) * (D + 8);
    launch(flash_bwd_dq<T, D>, dim3(a.B * a.H, tiles(a.T, 64)), dq_smem, a, stream);
  });
}

}  // namespace tessera::cuda_kernels
