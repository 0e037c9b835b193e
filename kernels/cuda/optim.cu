// Fused optimizer updates (adamw_, adamw8bit_, sgd_) on CUDA as multi-tensor apply (apex /
// PyTorch's fused _foreach kernels): the tensors of a call are cut into chunks of kChunk
// elements and each block of a launch updates one chunk of one tensor; the pointers, sizes
// and first block of each tensor are the kernel's parameters (under 4 KB, the classic limit:
// ~76 tensors a launch), so a list of any length costs a few launches and no host-to-device
// copy. Unlike apex's block table, a launch is not limited in blocks, so big tensors run
// many even waves. adamw8bit_ has its own kernel (chunks of whole quantization blocks, the
// maps in its parameters): see its section.
//
// Per element the math is kernels/cpu/optim.cc's, in the same order: f32 for f32/f16/bf16
// params (moments and master f32), f64 for f64; a 16-bit param is written as the update
// rounded once (from_acc, the CPU's rounding). Contiguous operands only (optim.cc packs any
// others); 16-byte vector loads where all of a tensor's operands are aligned.
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/optim.cuh"

namespace tessera::cuda_kernels {
namespace {

constexpr int kChunk = 16384;  // elements per block: many blocks, so launches end evenly
constexpr int kThreads = 256;
constexpr int kParamBytes = 4096;
constexpr int kOpBytes = 80;  // the update's constants (static_assert below)

// A launch's tensors: block b updates chunk b - first_block[t] of the tensor t whose blocks
// hold b. Tensors per launch by operand count D: what fits kParamBytes.
template <int D>
constexpr int kMaxTensors = (kParamBytes - kOpBytes - 8) / (D * 8 + 8 + 4);

template <int D, int T>
struct TensorList {
  void* ptr[D][T];
  int64_t numel[T];
  int32_t first_block[T];
  int32_t count;
};

template <int D, int T, typename Op>
__global__ void __launch_bounds__(kThreads)
    multi_tensor_kernel(const __grid_constant__ TensorList<D, T> list, const Op op) {
  // The last tensor whose first block is <= b (binary search, the same for the whole block).
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = list.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (list.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int t = lo;
  const int64_t start = static_cast<int64_t>(b - list.first_block[t]) * kChunk;
  const int64_t left = list.numel[t] - start;
  const int n = left < kChunk ? static_cast<int>(left) : kChunk;
  void* ptr[D];
#pragma unroll
  for (int d = 0; d < D; ++d) ptr[d] = list.ptr[d][t];
  op(ptr, start, n);
}

// Four consecutive elements, loaded and stored as one 8/16/32-byte access.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};
template <typename T>
__device__ __forceinline__ bool aligned4(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
}
template <typename T>
__device__ __forceinline__ Pack4<T> load4(const T* p) {
  return *reinterpret_cast<const Pack4<T>*>(p);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const Pack4<T>& x) {
  *reinterpret_cast<Pack4<T>*>(p) = x;
}

__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }  // IEEE (no fast math)
__device__ __forceinline__ double sqrt_of(double x) { return sqrt(x); }

// Runs one(i) over the chunk's n elements, or four(i) on aligned groups of four and one(i)
// on the tail when `vector` holds (chunk starts are multiples of 4 elements).
template <typename One, typename Four>
__device__ __forceinline__ void chunk_loop(int n, bool vector, One&& one, Four&& four) {
  if (vector) {
    const int n4 = n & ~3;
    for (int i = threadIdx.x * 4; i < n4; i += blockDim.x * 4) four(i);
    for (int i = n4 + threadIdx.x; i < n; i += blockDim.x) one(i);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) one(i);
  }
}

// The gradient as the update reads it: grad * grad_scale when scaled, rounded as scale_
// rounds it (in S, with no FMA contraction, then to P: kernels/cpu/optim.cc's scaled_grad).
template <typename P, typename S>
__device__ __forceinline__ S read_grad(P g, bool scaled, S grad_scale) {
  const S x = static_cast<S>(to_acc(g));
  if (!scaled) return x;
  if constexpr (std::is_same_v<S, double>) return static_cast<S>(to_acc(from_acc<P>(__dmul_rn(x, grad_scale))));
  else return static_cast<S>(to_acc(from_acc<P>(__fmul_rn(x, grad_scale))));
}

// ---- AdamW ---------------------------------------------------------------------------------

// P: param/grad type; S: moment (and compute) type; master: f32 when kMaster.
template <typename P, typename S, bool kMaster>
struct AdamWOp {
  static constexpr int kDepth = kMaster ? 5 : 4;
  S decay, w1, beta2, w2, bc2_sqrt, eps, step_size, grad_scale;
  bool scaled;

  // kernels/cpu/optim.cc's adamw_run, statement for statement.
  __device__ __forceinline__ void update(S& x, S g, S& m, S& v) const {
    x *= decay;
    m += w1 * (g - m);
    v = v * beta2 + w2 * (g * g);
    const S denom = sqrt_of(v) / bc2_sqrt + eps;
    x -= step_size * (m / denom);
  }

  __device__ __forceinline__ void operator()(void* const* ptr, int64_t start, int n) const {
    P* p = static_cast<P*>(ptr[0]) + start;
    const P* g = static_cast<const P*>(ptr[1]) + start;
    S* m = static_cast<S*>(ptr[2]) + start;
    S* v = static_cast<S*>(ptr[3]) + start;
    float* w = kMaster ? static_cast<float*>(ptr[kDepth - 1]) + start : nullptr;
    const bool vector =
        aligned4(p) && aligned4(g) && aligned4(m) && aligned4(v) && (!kMaster || aligned4(w));
    chunk_loop(
        n, vector,
        [&](int i) {
          // With a master the param's old value is not read (as on the CPU).
          S x;
          if constexpr (kMaster) x = w[i];
          else x = static_cast<S>(to_acc(p[i]));
          S mi = m[i], vi = v[i];
          update(x, read_grad<P>(g[i], scaled, grad_scale), mi, vi);
          m[i] = mi;
          v[i] = vi;
          if constexpr (kMaster) w[i] = x;
          p[i] = from_acc<P>(x);
        },
        [&](int i) {
          const Pack4<P> gp = load4(g + i);
          Pack4<S> mp = load4(m + i), vp = load4(v + i);
          Pack4<S> xp;
          if constexpr (kMaster) {
            const Pack4<float> wp = load4(w + i);
#pragma unroll
            for (int j = 0; j < 4; ++j) xp.v[j] = wp.v[j];
          } else {
            const Pack4<P> pp = load4(p + i);
#pragma unroll
            for (int j = 0; j < 4; ++j) xp.v[j] = static_cast<S>(to_acc(pp.v[j]));
          }
          Pack4<P> out;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            update(xp.v[j], read_grad<P>(gp.v[j], scaled, grad_scale), mp.v[j], vp.v[j]);
            out.v[j] = from_acc<P>(xp.v[j]);
          }
          store4(m + i, mp);
          store4(v + i, vp);
          if constexpr (kMaster) {
            Pack4<float> wp;
#pragma unroll
            for (int j = 0; j < 4; ++j) wp.v[j] = xp.v[j];
            store4(w + i, wp);
          }
          store4(p + i, out);
        });
  }
};

// ---- AdamW with 8-bit state ----------------------------------------------------------------
// Geometry: one thread per element of a quantization block (kAdam8Block == kThreads), a
// block of threads walking kGroup8 consecutive quantization blocks of one tensor (a chunk),
// so the maps' copy into shared memory is paid once per chunk. Per quantization block: the
// AdamW step, the new absmax by a warp-shuffle and shared-memory max, then the codes; the
// dequantized m and v stay in registers in between.
//
// The maps reach the device in the kernel's parameters (Adam8Params below, CUDA 12.1+'s
// large parameters, up to 32 KB on sm_70+): no per-device table to set up and no copy
// to order against streams, so any device and any stream see the right maps; each block
// then copies them into shared memory (the binary search indexes them per thread, which
// the constant bank serialises).
//
// Bitwise the CPU's kernels/cpu/optim.cc adamw8bit_block (built with -ffp-contract=off):
// the _rn intrinsics below round every operation once, where nvcc would otherwise fuse a
// multiply and an add into an FMA (--fmad=true by default).

constexpr int kGroup8 = 8;  // quantization blocks per chunk
constexpr int kWarps = kThreads / 32;
// Large kernel parameters: the maps (4 KB for f32 state, 6 KB for f64) and the tensor list.
constexpr int kParamBytes8 = 16384;
static_assert(kAdam8Block == kThreads, "one thread per element of a quantization block");

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float abs_of(float a) { return fabsf(a); }
__device__ __forceinline__ double abs_of(double a) { return fabs(a); }
// The CPU's running max: a NaN b is skipped. Starting from +0, the result is the largest
// non-NaN value (never -0, never NaN), whatever the order: the reduction may regroup.
template <typename S>
__device__ __forceinline__ S max_of(S a, S b) {
  return a < b ? b : a;
}

// The two maps; S is the state type: f32 state compares against the f32 thresholds, f64
// state against the exact midpoints (Quant8Map::code(float) / code(double)).
template <typename S>
struct alignas(16) Quant8Tables {
  float values[2][kAdam8Block];  // signed map (exp_avg), unsigned map (exp_avg_sq)
  S bounds[2][kAdam8Block];      // thresholds, or mid64
};

// Quant8Map::code: the number of bounds <= x (bounds[255] = +inf; NaN gives 0).
template <typename S>
__device__ __forceinline__ uint8_t code_of(S x, const S* bounds) {
  uint32_t c = 0;
#pragma unroll
  for (uint32_t s = 128; s > 0; s >>= 1) c += bounds[c + s - 1] <= x ? s : 0;
  return static_cast<uint8_t>(c);
}

template <typename S>
struct Adam8Consts {
  S decay, w1, beta2, w2, bc2_sqrt, eps, step_size, grad_scale;
  bool scaled;
};

// A launch's parameters: block b updates chunk b - first_chunk[t] of the tensor t whose
// chunks hold b. Tensors per launch: what fits kParamBytes8.
template <int D, int T, typename S>
struct Adam8Params {
  Quant8Tables<S> maps;
  Adam8Consts<S> k;
  void* ptr[D][T];
  int64_t numel[T];
  int32_t first_chunk[T];
  int32_t count;
};
template <int D, typename S>
constexpr int kMaxTensors8 =
    (kParamBytes8 - static_cast<int>(sizeof(Quant8Tables<S>) + sizeof(Adam8Consts<S>)) - 16) /
    (D * 8 + 8 + 4);

// P: param/grad type; S: state (and compute) type; master: f32 when kMaster.
// Operands: param, grad, exp_avg (u8), exp_avg_sq (u8), exp_avg_absmax, exp_avg_sq_absmax
// (S)[, master].
template <typename P, typename S, bool kMaster, int D, int T>
__global__ void __launch_bounds__(kThreads)
    adamw8bit_kernel(const __grid_constant__ Adam8Params<D, T, S> prm) {
  __shared__ Quant8Tables<S> maps;
  __shared__ S part1[2][kWarps], part2[2][kWarps];  // by parity: one barrier per block
  {
    constexpr int kWords = sizeof(Quant8Tables<S>) / sizeof(uint4);
    const uint4* src = reinterpret_cast<const uint4*>(&prm.maps);
    uint4* dst = reinterpret_cast<uint4*>(&maps);
    for (int i = threadIdx.x; i < kWords; i += blockDim.x) dst[i] = src[i];
  }
  // The last tensor whose first chunk is <= b (binary search, the same for the whole block).
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = prm.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prm.first_chunk[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int t = lo;
  P* p = static_cast<P*>(prm.ptr[0][t]);
  const P* g = static_cast<const P*>(prm.ptr[1][t]);
  uint8_t* c1 = static_cast<uint8_t*>(prm.ptr[2][t]);
  uint8_t* c2 = static_cast<uint8_t*>(prm.ptr[3][t]);
  S* a1 = static_cast<S*>(prm.ptr[4][t]);
  S* a2 = static_cast<S*>(prm.ptr[5][t]);
  float* w = nullptr;
  if constexpr (kMaster) w = static_cast<float*>(prm.ptr[D - 1][t]);
  const int64_t n = prm.numel[t];
  const int64_t q0 = static_cast<int64_t>(b - prm.first_chunk[t]) * kGroup8;
  const int64_t left = (n + kAdam8Block - 1) / kAdam8Block - q0;
  const int nq = left < kGroup8 ? static_cast<int>(left) : kGroup8;
  const Adam8Consts<S>& k = prm.k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // the maps are in shared memory

  for (int q = 0; q < nq; ++q) {
    const int64_t qb = q0 + q;
    const int64_t i = qb * kAdam8Block + threadIdx.x;
    const bool active = i < n;  // the last block may be shorter
    // Every thread reads the old scales before the barrier below; thread 0 writes after it.
    const S s1 = a1[qb], s2 = a2[qb];
    S mi = S(0), vi = S(0), max1 = S(0), max2 = S(0);
    if (active) {
      // adamw8bit_block's statements, in order. With a master the param is not read.
      S x;
      if constexpr (kMaster) x = w[i];
      else x = static_cast<S>(to_acc(p[i]));
      const S gi = read_grad<P>(g[i], k.scaled, k.grad_scale);
      x = mul_rn(x, k.decay);
      mi = mul_rn(static_cast<S>(maps.values[0][c1[i]]), s1);
      mi = add_rn(mi, mul_rn(k.w1, sub_rn(gi, mi)));
      vi = add_rn(mul_rn(mul_rn(static_cast<S>(maps.values[1][c2[i]]), s2), k.beta2),
                  mul_rn(k.w2, mul_rn(gi, gi)));
      const S denom = add_rn(div_rn(sqrt_rn(vi), k.bc2_sqrt), k.eps);
      x = sub_rn(x, mul_rn(k.step_size, div_rn(mi, denom)));
      if constexpr (kMaster) w[i] = x;
      p[i] = from_acc<P>(x);
      max1 = max_of(max1, abs_of(mi));
      max2 = max_of(max2, vi);
    }
    // The block's max |m| and max v: within each warp, then across the warps (every thread
    // ends with the same two values).
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      max1 = max_of(max1, __shfl_xor_sync(0xffffffffu, max1, off));
      max2 = max_of(max2, __shfl_xor_sync(0xffffffffu, max2, off));
    }
    if (lane == 0) {
      part1[q & 1][warp] = max1;
      part2[q & 1][warp] = max2;
    }
    __syncthreads();
    max1 = part1[q & 1][0];
    max2 = part2[q & 1][0];
#pragma unroll
    for (int j = 1; j < kWarps; ++j) {
      max1 = max_of(max1, part1[q & 1][j]);
      max2 = max_of(max2, part2[q & 1][j]);
    }
    if (threadIdx.x == 0) {
      a1[qb] = max1;
      a2[qb] = max2;
    }
    if (active) {
      // x / 0 counts as 0: an all-zero block keeps the zero codes.
      const S d1 = max1 > S(0) ? max1 : S(1), d2 = max2 > S(0) ? max2 : S(1);
      c1[i] = code_of(div_rn(mi, d1), maps.bounds[0]);
      c2[i] = code_of(div_rn(vi, d2), maps.bounds[1]);
    }
  }
}

// ---- SGD -----------------------------------------------------------------------------------

template <typename P, typename S, bool kBuffer, bool kMaster>
struct SgdOp {
  static constexpr int kDepth = 2 + (kBuffer ? 1 : 0) + (kMaster ? 1 : 0);
  S lr, weight_decay, momentum, one_minus_dampening;
  bool decay, nesterov, first;
  S grad_scale;
  bool scaled;

  // kernels/cpu/optim.cc's sgd_run, statement for statement; b is read only after step 1.
  __device__ __forceinline__ void update(S& x, S d, S& b) const {
    // Skipped, not multiplied by 0, when weight_decay == 0: 0 * inf would be NaN.
    if (decay) d += weight_decay * x;
    if constexpr (kBuffer) {
      b = first ? d : b * momentum + one_minus_dampening * d;
      d = nesterov ? d + momentum * b : b;
    }
    x -= lr * d;
  }

  __device__ __forceinline__ void operator()(void* const* ptr, int64_t start, int n) const {
    P* p = static_cast<P*>(ptr[0]) + start;
    const P* g = static_cast<const P*>(ptr[1]) + start;
    S* b = kBuffer ? static_cast<S*>(ptr[2]) + start : nullptr;
    float* w = kMaster ? static_cast<float*>(ptr[kDepth - 1]) + start : nullptr;
    const bool vector = aligned4(p) && aligned4(g) && (!kBuffer || aligned4(b)) &&
                        (!kMaster || aligned4(w));
    chunk_loop(
        n, vector,
        [&](int i) {
          S x;
          if constexpr (kMaster) x = w[i];
          else x = static_cast<S>(to_acc(p[i]));
          S bi = S(0);
          if constexpr (kBuffer) {
            if (!first) bi = b[i];
          }
          update(x, read_grad<P>(g[i], scaled, grad_scale), bi);
          if constexpr (kBuffer) b[i] = bi;
          if constexpr (kMaster) w[i] = x;
          p[i] = from_acc<P>(x);
        },
        [&](int i) {
          const Pack4<P> gp = load4(g + i);
          Pack4<S> xp, bp;
          if constexpr (kMaster) {
            const Pack4<float> wp = load4(w + i);
#pragma unroll
            for (int j = 0; j < 4; ++j) xp.v[j] = wp.v[j];
          } else {
            const Pack4<P> pp = load4(p + i);
#pragma unroll
            for (int j = 0; j < 4; ++j) xp.v[j] = static_cast<S>(to_acc(pp.v[j]));
          }
          if constexpr (kBuffer) {
            if (!first) bp = load4(b + i);
          }
          Pack4<P> out;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            update(xp.v[j], read_grad<P>(gp.v[j], scaled, grad_scale), bp.v[j]);
            out.v[j] = from_acc<P>(xp.v[j]);
          }
          if constexpr (kBuffer) store4(b + i, bp);
          if constexpr (kMaster) {
            Pack4<float> wp;
#pragma unroll
            for (int j = 0; j < 4; ++j) wp.v[j] = xp.v[j];
            store4(w + i, wp);
          }
          store4(p + i, out);
        });
  }
};

// ---- the launch loop -----------------------------------------------------------------------

// Puts up to kMaxTensors tensors in each launch, one block per chunk of each (empty tensors
// skipped), so a launch covers whole tensors and may run many waves of blocks.
template <typename Op>
void multi_tensor_apply(const OptimTuple* tuples, int64_t count, const Op& op,
                        cudaStream_t stream, const char* what) {
  constexpr int D = Op::kDepth;
  constexpr int T = kMaxTensors<D>;
  using List = TensorList<D, T>;
  static_assert(sizeof(Op) <= kOpBytes && sizeof(List) + sizeof(Op) <= kParamBytes,
                "kernel parameters over 4 KB");
  constexpr int64_t kMaxGrid = (int64_t(1) << 31) - 1;
  List list;
  list.count = 0;
  int64_t blocks = 0;
  auto launch = [&] {
    if (list.count == 0) return;
    multi_tensor_kernel<D, T, Op>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(list, op);
    check_launch(what);
    list.count = 0;
    blocks = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = tuples[i].numel;
    if (n == 0) continue;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    if (chunks > kMaxGrid) throw CudaLaunchError(std::string(what) + ": tensor too large");
    if (list.count == T || blocks + chunks > kMaxGrid) launch();
    const int t = list.count++;
    for (int d = 0; d < D; ++d) list.ptr[d][t] = tuples[i].ptr[d];
    list.numel[t] = n;
    list.first_block[t] = static_cast<int32_t>(blocks);
    blocks += chunks;
  }
  launch();
}

template <typename P, typename S>
void adamw_typed(bool master, const OptimTuple* tuples, int64_t count, const AdamWConsts& k,
                 cudaStream_t stream) {
  auto run = [&]<bool kMaster>() {
    const AdamWOp<P, S, kMaster> op{S(k.decay),    S(k.w1),  S(k.beta2),     S(k.w2),
                                    S(k.bc2_sqrt), S(k.eps), S(k.step_size), S(k.grad_scale),
                                    k.grad_scale != 1.0};
    multi_tensor_apply(tuples, count, op, stream, "adamw_");
  };
  if (master) run.template operator()<true>();
  else run.template operator()<false>();
}

// Puts up to kMaxTensors8 tensors in each launch, one block per chunk of kGroup8
// quantization blocks of each (empty tensors skipped).
template <typename P, typename S, bool kMaster>
void adamw8bit_typed(const OptimTuple* tuples, int64_t count, const AdamWConsts& k,
                     const Quant8Maps& maps, cudaStream_t stream) {
  constexpr int D = kMaster ? 7 : 6;
  constexpr int T = kMaxTensors8<D, S>;
  using Params = Adam8Params<D, T, S>;
  static_assert(sizeof(Params) <= kParamBytes8, "adamw8bit_'s kernel parameters over 16 KB");
  constexpr int64_t kMaxGrid = (int64_t(1) << 31) - 1;
  constexpr int64_t kChunk8 = int64_t(kGroup8) * kAdam8Block;
  auto prm = std::make_unique<Params>();  // ~16 KB: not on the stack
  for (int m = 0; m < 2; ++m) {
    for (int j = 0; j < kAdam8Block; ++j) {
      prm->maps.values[m][j] = maps.values[m][j];
      if constexpr (std::is_same_v<S, double>) prm->maps.bounds[m][j] = maps.mid64[m][j];
      else prm->maps.bounds[m][j] = maps.thresholds[m][j];
    }
  }
  prm->k = {S(k.decay),    S(k.w1),  S(k.beta2),     S(k.w2),
            S(k.bc2_sqrt), S(k.eps), S(k.step_size), S(k.grad_scale), k.grad_scale != 1.0};
  prm->count = 0;
  int64_t blocks = 0;
  auto launch = [&] {
    if (prm->count == 0) return;
    adamw8bit_kernel<P, S, kMaster, D, T>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(*prm);
    check_launch("adamw8bit_");
    prm->count = 0;
    blocks = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = tuples[i].numel;
    if (n == 0) continue;
    const int64_t chunks = (n + kChunk8 - 1) / kChunk8;
    if (chunks > kMaxGrid) throw CudaLaunchError("adamw8bit_: tensor too large");
    if (prm->count == T || blocks + chunks > kMaxGrid) launch();
    const int t = prm->count++;
    for (int d = 0; d < D; ++d) prm->ptr[d][t] = tuples[i].ptr[d];
    prm->numel[t] = n;
    prm->first_chunk[t] = static_cast<int32_t>(blocks);
    blocks += chunks;
  }
  launch();
}

template <typename P, typename S>
void sgd_typed(bool buffer, bool master, const OptimTuple* tuples, int64_t count,
               const SgdConsts& k, cudaStream_t stream) {
  auto run = [&]<bool kBuffer, bool kMaster>() {
    const SgdOp<P, S, kBuffer, kMaster> op{S(k.lr), S(k.weight_decay), S(k.momentum),
                                           S(k.one_minus_dampening), k.decay, k.nesterov,
                                           k.first, S(k.grad_scale), k.grad_scale != 1.0};
    multi_tensor_apply(tuples, count, op, stream, "sgd_");
  };
  if (buffer && master) run.template operator()<true, true>();
  else if (buffer) run.template operator()<true, false>();
  else if (master) run.template operator()<false, true>();
  else run.template operator()<false, false>();
}

}  // namespace

void launch_adamw(int dtype, bool master, const OptimTuple* tuples, int64_t count,
                  const AdamWConsts& k, cudaStream_t stream) {
  switch (dtype) {
    case kF32: return adamw_typed<float, float>(master, tuples, count, k, stream);
    case kF64:  // the shape inference rejects an f64 param's master
      if (master) throw CudaLaunchError("adamw_: an f64 param takes no master");
      return adamw_typed<double, double>(false, tuples, count, k, stream);
    case kF16: return adamw_typed<__half, float>(master, tuples, count, k, stream);
    case kBF16: return adamw_typed<__nv_bfloat16, float>(master, tuples, count, k, stream);
    default: throw CudaLaunchError("adamw_: unsupported dtype " + std::to_string(dtype));
  }
}

void launch_adamw8bit(int dtype, bool master, const OptimTuple* tuples, int64_t count,
                      const AdamWConsts& k, const Quant8Maps& maps, cudaStream_t stream) {
  auto run = [&]<typename P, typename S>() {
    if (master) adamw8bit_typed<P, S, true>(tuples, count, k, maps, stream);
    else adamw8bit_typed<P, S, false>(tuples, count, k, maps, stream);
  };
  switch (dtype) {
    case kF32: return run.template operator()<float, float>();
    case kF64:  // the shape inference rejects an f64 param's master
      if (master) throw CudaLaunchError("adamw8bit_: an f64 param takes no master");
      return adamw8bit_typed<double, double, false>(tuples, count, k, maps, stream);
    case kF16: return run.template operator()<__half, float>();
    case kBF16: return run.template operator()<__nv_bfloat16, float>();
    default: throw CudaLaunchError("adamw8bit_: unsupported dtype " + std::to_string(dtype));
  }
}

void launch_sgd(int dtype, bool buffer, bool master, const OptimTuple* tuples, int64_t count,
                const SgdConsts& k, cudaStream_t stream) {
  switch (dtype) {
    case kF32: return sgd_typed<float, float>(buffer, master, tuples, count, k, stream);
    case kF64:
      if (master) throw CudaLaunchError("sgd_: an f64 param takes no master");
      return sgd_typed<double, double>(buffer, false, tuples, count, k, stream);
    case kF16: return sgd_typed<__half, float>(buffer, master, tuples, count, k, stream);
    case kBF16: return sgd_typed<__nv_bfloat16, float>(buffer, master, tuples, count, k, stream);
    default: throw CudaLaunchError("sgd_: unsupported dtype " + std::to_string(dtype));
  }
}

// ---- scale_ -----------------------------------------------------------------------------
namespace {

template <typename T>
__global__ void scale_kernel(T* x, int64_t n, acc_type<T> s) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = from_acc<T, acc_type<T>>(to_acc(x[i]) * s);
  }
}

}  // namespace

void launch_scale(const DevTensor& x, double scale, cudaStream_t stream) {
  if (x.numel == 0) return;
  TS_CUDA_DISPATCH_FLOATS(x.dtype, "scale_", [&] {
    scale_kernel<scalar_t><<<grid_for(x.numel), 256, 0, stream>>>(
        typed<scalar_t>(x), x.numel, static_cast<acc_type<scalar_t>>(scale));
  });
  check_launch("scale_");
}

}  // namespace tessera::cuda_kernels
