// Reductions on CUDA: sum, mean, max, argmax, var (the spec is kernels/cpu/reduce.cc: floats
// accumulate in f64, integers in i64, var by Welford merged with Chan's formula, the first
// maximum / first NaN wins).
//
// Four kernels, chosen from the shapes only, so results are bitwise reproducible:
//   - rows, a warp per output: each output's elements are one contiguous run (sum over the
//     last dim), read with 16-byte vector loads, combined by warp shuffles;
//   - rows, a block per output (long runs), optionally split into chunks across blocks whose
//     partial states a second kernel merges in a fixed order (a full sum);
//   - columns: the innermost kept dim is contiguous (sum over dim 0 of a matrix): 32 outputs
//     per block row, coalesced reads, 16 slices of the reduced range merged in order,
//     optionally split into chunks like the rows;
//   - thin columns: the same, where the reduced range has at most 16 elements (the sum of a
//     [3, rows, C] gradient over its 3): a thread per output doing those 16 slices' steps
//     and merges itself, so no block waits on 13 idle rows of threads (the same bits).
// Other layouts are packed with the reduced dims last by the caller (reduce.cc).
#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/reduce.cuh"

namespace tessera::cuda_kernels {
namespace {

constexpr int kTargetBlocks = 132 * 4;  // enough blocks to fill an H100 several times
constexpr int kColThreadsY = 16;
constexpr int kRowBlockThreads = 256;
constexpr int kMaxStateBytes = 32;

// ---- reducers: init, step(state, element, index), merge(into, from), finalize ----------------
// States are plain structs (no initialisers: they live in shared memory).

template <typename T>
struct SumR {
  using State = std::conditional_t<std::is_floating_point_v<acc_type<T>>, double, int64_t>;
  using Out = std::conditional_t<std::is_same_v<T, bool>, int64_t, T>;
  bool mean;
  __device__ State init() const { return 0; }
  __device__ void step(State& s, T x, int64_t) const { s += static_cast<State>(to_acc(x)); }
  __device__ void merge(State& s, const State& o) const { s += o; }
  __device__ Out finalize(const State& s, int64_t count) const {
    if constexpr (std::is_floating_point_v<State>) {
      if (mean) return convert<Out>(s / static_cast<double>(count));
    }
    return convert<Out>(s);
  }
};

template <typename C> __device__ __forceinline__ C lowest() {
  if constexpr (std::is_floating_point_v<C>) return -std::numeric_limits<C>::infinity();
  else return std::numeric_limits<C>::lowest();
}

template <typename T>
struct MaxR {
  using C = acc_type<T>;
  using State = C;
  using Out = T;
  __device__ State init() const { return lowest<C>(); }
  __device__ static C pick(C a, C x) {
    if constexpr (std::is_floating_point_v<C>) return (x > a || x != x) ? x : a;  // NaN wins
    else return x > a ? x : a;
  }
  __device__ void step(State& s, T x, int64_t) const { s = pick(s, to_acc(x)); }
  __device__ void merge(State& s, const State& o) const { s = pick(s, o); }
  __device__ Out finalize(const State& s, int64_t) const { return convert<Out>(s); }
};

template <typename T>
struct ArgmaxR {
  using C = acc_type<T>;
  struct State {
    C value;
    int64_t index;
  };
  using Out = int64_t;
  __device__ State init() const { return {lowest<C>(), -1}; }
  // The winner of two candidates in any order: a NaN beats numbers, a larger value beats a
  // smaller one, and ties go to the smaller index: the CPU's "first maximum, first NaN".
  __device__ static State pick(const State& a, const State& b) {
    if (b.index < 0) return a;
    if (a.index < 0) return b;
    if constexpr (std::is_floating_point_v<C>) {
      const bool an = a.value != a.value, bn = b.value != b.value;
      if (an || bn) {
        if (an && bn) return a.index <= b.index ? a : b;
        return an ? a : b;
      }
    }
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index <= b.index ? a : b;
  }
  __device__ void step(State& s, T x, int64_t i) const { s = pick(s, State{to_acc(x), i}); }
  __device__ void merge(State& s, const State& o) const { s = pick(s, o); }
  __device__ Out finalize(const State& s, int64_t) const { return s.index; }
};

template <typename T>
struct VarR {  // Welford's algorithm, merged with Chan et al.'s formula, in f64
  struct State {
    double n, mean, m2;
  };
  using Out = T;
  int64_t correction;
  __device__ State init() const { return {0.0, 0.0, 0.0}; }
  __device__ void step(State& s, T x, int64_t) const {
    const double v = static_cast<double>(to_acc(x));
    s.n += 1;
    const double d = v - s.mean;
    s.mean += d / s.n;
    s.m2 += d * (v - s.mean);
  }
  __device__ void merge(State& s, const State& o) const {
    if (o.n == 0) return;
    if (s.n == 0) { s = o; return; }
    const double n = s.n + o.n, d = o.mean - s.mean;
    s.m2 += o.m2 + d * d * s.n * o.n / n;
    s.mean += d * o.n / n;
    s.n = n;
  }
  __device__ Out finalize(const State& s, int64_t) const {
    const double denom = s.n - static_cast<double>(correction);
    if (denom <= 0) return convert<Out>(__longlong_as_double(0x7ff8000000000000LL));
    return convert<Out>(s.m2 / denom);
  }
};

// ---- warp and block combination in a fixed tree ------------------------------------------

template <typename S> __device__ __forceinline__ S shfl_down(const S& s, int delta) {
  constexpr int W = (sizeof(S) + 3) / 4;
  uint32_t w[W] = {};
  memcpy(w, &s, sizeof(S));
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = __shfl_down_sync(0xffffffffu, w[i], delta);
  S r;
  memcpy(&r, w, sizeof(S));
  return r;
}

template <typename R, typename S> __device__ __forceinline__ S warp_reduce(const R& r, S s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) r.merge(s, shfl_down(s, off));
  return s;  // valid in lane 0
}

// Over a 1-D block; the result is valid in thread 0.
template <typename R, typename S> __device__ S block_reduce(const R& r, S s) {
  __shared__ alignas(16) unsigned char raw[32 * kMaxStateBytes];
  S* smem = reinterpret_cast<S*>(raw);
  s = warp_reduce(r, s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (nw == 1) return s;
  __syncthreads();  // the previous use of smem is over
  if (lane == 0) smem[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < nw ? smem[lane] : r.init();
    s = warp_reduce(r, s);
  }
  return s;
}

// ---- index helpers -----------------------------------------------------------------------

// Offset of linear index i (below the product of the sizes) in a coalesced layout.
__device__ __forceinline__ int64_t at(const Strided<1>& s, int64_t i) {
  int64_t o[1];
  s.offsets(i, o);
  return o[0];
}

// Steps s over p[t], p[t + nt], ... below n (element index idx0 + j), with 16-byte loads
// after peeling the elements before the first aligned address.
template <typename T, typename R>
__device__ __forceinline__ void reduce_run(const R& r, typename R::State& s, const T* p, int64_t n,
                                           int64_t idx0, int t, int nt) {
  constexpr int V = 16 / sizeof(T);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  int64_t head = n;
  if (V > 1 && addr % sizeof(T) == 0) head = std::min<int64_t>(n, ((16 - addr % 16) % 16) / sizeof(T));
  for (int64_t j = t; j < head; j += nt) r.step(s, p[j], idx0 + j);
  if (head == n) return;
  const Vec<T, V>* pv = reinterpret_cast<const Vec<T, V>*>(p + head);
  const int64_t nv = (n - head) / V;
  for (int64_t j = t; j < nv; j += nt) {
    const Vec<T, V> v = pv[j];
#pragma unroll
    for (int e = 0; e < V; ++e) r.step(s, v.v[e], idx0 + head + j * V + e);
  }
  for (int64_t j = head + nv * V + t; j < n; j += nt) r.step(s, p[j], idx0 + j);
}

// ---- kernels -------------------------------------------------------------------------------

template <typename T, typename R>
__global__ void __launch_bounds__(256) rows_warp_kernel(typename R::Out* out, const T* in,
                                                        Strided<1> kept, int64_t nk, int64_t nr, R r) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t step = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = first; row < nk; row += step) {
    typename R::State s = r.init();
    reduce_run<T>(r, s, in + at(kept, row), nr, 0, lane, 32);
    s = warp_reduce(r, s);
    if (lane == 0) out[row] = r.finalize(s, nr);
  }
}

// Block per (row, chunk): grid.y chunks of `chunk` elements. kPartial: states to ws.
template <typename T, typename R, bool kPartial>
__global__ void __launch_bounds__(kRowBlockThreads) rows_block_kernel(
    typename R::Out* out, typename R::State* ws, const T* in, Strided<1> kept, int64_t nk, int64_t nr,
    int64_t chunk, R r) {
  const int64_t begin = blockIdx.y * chunk, end = std::min(nr, begin + chunk);
  for (int64_t row = blockIdx.x; row < nk; row += gridDim.x) {
    typename R::State s = r.init();
    if (begin < end) reduce_run<T>(r, s, in + at(kept, row) + begin, end - begin, begin, threadIdx.x, blockDim.x);
    s = block_reduce(r, s);
    if (threadIdx.x == 0) {
      if constexpr (kPartial) ws[row * gridDim.y + blockIdx.y] = s;
      else out[row] = r.finalize(s, nr);
    }
  }
}

// Outputs [kouter..., kinner] (kinner contiguous in the input); block (32, kColThreadsY).
template <typename T, typename R, bool kPartial>
__global__ void __launch_bounds__(32 * kColThreadsY) cols_kernel(
    typename R::Out* out, typename R::State* ws, const T* in, Strided<1> kouter, int64_t nouter,
    int64_t kinner, Strided<1> red, int64_t nr, int64_t chunk, R r) {
  using State = typename R::State;
  __shared__ alignas(16) unsigned char raw[kColThreadsY * 32 * kMaxStateBytes];
  State* smem = reinterpret_cast<State*>(raw);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles = (kinner + 31) / 32;
  const int64_t begin = blockIdx.y * chunk, end = std::min(nr, begin + chunk);
  for (int64_t b = blockIdx.x; b < nouter * tiles; b += gridDim.x) {
    const int64_t outer = b / tiles, j = (b - outer * tiles) * 32 + tx;
    State s = r.init();
    if (j < kinner) {
      const T* base = in + at(kouter, outer) + j;
      for (int64_t ri = begin + ty; ri < end; ri += kColThreadsY) r.step(s, base[at(red, ri)], ri);
    }
    smem[ty * 32 + tx] = s;
    __syncthreads();
    if (ty == 0 && j < kinner) {
      for (int y = 1; y < kColThreadsY; ++y) r.merge(s, smem[y * 32 + tx]);
      const int64_t k = outer * kinner + j;
      if constexpr (kPartial) ws[k * gridDim.y + blockIdx.y] = s;
      else out[k] = r.finalize(s, nr);
    }
    __syncthreads();
  }
}

// cols_kernel's arithmetic where nr <= kColThreadsY (one chunk): slice y holds element y
// alone, so a thread per output steps slice 0 and merges slices 1..15 in order itself.
template <typename T, typename R>
__global__ void __launch_bounds__(256) cols_thin_kernel(typename R::Out* out, const T* in,
                                                        Strided<1> kouter, int64_t nouter, int64_t kinner,
                                                        Strided<1> red, int64_t nr, R r) {
  using State = typename R::State;
  const int64_t n = nouter * kinner;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t outer = nouter == 1 ? 0 : k / kinner, j = k - outer * kinner;
    const T* base = in + at(kouter, outer) + j;
    State s = r.init();
    if (nr > 0) r.step(s, base[at(red, 0)], 0);
#pragma unroll
    for (int y = 1; y < kColThreadsY; ++y) {
      State t = r.init();
      if (y < nr) r.step(t, base[at(red, y)], y);
      r.merge(s, t);
    }
    out[k] = r.finalize(s, nr);
  }
}

// Merges each output's nchunks partial states in order (a warp per output).
template <typename R>
__global__ void __launch_bounds__(256) merge_kernel(typename R::Out* out, const typename R::State* ws,
                                                    int64_t nk, int nchunks, int64_t nr, R r) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t step = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t k = first; k < nk; k += step) {
    typename R::State s = r.init();
    for (int c = lane; c < nchunks; c += 32) r.merge(s, ws[k * nchunks + c]);
    s = warp_reduce(r, s);
    if (lane == 0) out[k] = r.finalize(s, nr);
  }
}

// ---- planning --------------------------------------------------------------------------------

enum class Kind { rows_warp, rows_block, cols, cols_thin };

struct Plan {
  Kind kind = Kind::rows_warp;
  int nchunks = 1;
  int64_t chunk = 0;
};

bool is_row(const ReduceLayout& l) {
  return l.nr == 0 || l.nred == 0 || (l.nred == 1 && l.rstrides[0] == 1);
}
bool is_col(const ReduceLayout& l) {
  return l.nkept > 0 && l.kstrides[l.nkept - 1] == 1;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Plan make_plan(const ReduceLayout& l) {
  Plan p;
  p.chunk = std::max<int64_t>(l.nr, 1);
  if (is_row(l)) {
    if (l.nr <= 1024 || (l.nr <= 8192 && l.nk >= 2048)) return p;
    p.kind = Kind::rows_block;
    if (l.nk < kTargetBlocks && l.nr >= 32768) {
      const int64_t want = std::min<int64_t>({ceil_div(kTargetBlocks, l.nk), ceil_div(l.nr, 16384), 65535});
      p.chunk = ceil_div(ceil_div(l.nr, want), 64) * 64;  // keeps chunk starts 16-byte aligned
      p.nchunks = static_cast<int>(ceil_div(l.nr, p.chunk));
    }
    return p;
  }
  p.kind = l.nr <= kColThreadsY ? Kind::cols_thin : Kind::cols;
  if (p.kind == Kind::cols_thin) return p;
  const int64_t kinner = l.ksizes[l.nkept - 1];
  const int64_t blocks = (l.nk / kinner) * ceil_div(kinner, 32);
  if (blocks < kTargetBlocks && l.nr >= 1024) {
    const int64_t want = std::min<int64_t>({ceil_div(kTargetBlocks, blocks), ceil_div(l.nr, 256), 65535});
    p.chunk = ceil_div(l.nr, want);
    p.nchunks = static_cast<int>(ceil_div(l.nr, p.chunk));
  }
  return p;
}

Strided<1> offsets_of(int n, const int64_t* sizes, const int64_t* strides) {
  const int64_t* st[1] = {strides};
  return coalesce_dims<1>(n, sizes, st);
}

template <typename T, typename R>
void run_reduce(const DevTensor& out, const DevTensor& in, const ReduceLayout& l, void* workspace,
                cudaStream_t stream, R r) {
  using Out = typename R::Out;
  using State = typename R::State;
  static_assert(sizeof(State) <= kMaxStateBytes && sizeof(State) % 4 == 0);
  if (l.nk == 0) return;
  const Plan p = make_plan(l);
  Out* o = typed<Out>(out);
  const T* x = typed<T>(in);
  State* ws = static_cast<State*>(workspace);
  const int64_t nr = l.nr;
  const Strided<1> kept = offsets_of(l.nkept, l.ksizes, l.kstrides);
  switch (p.kind) {
    case Kind::rows_warp: {
      const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(l.nk, 8), 65535 * 16));
      rows_warp_kernel<T><<<blocks, 256, 0, stream>>>(o, x, kept, l.nk, nr, r);
      break;
    }
    case Kind::rows_block: {
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>(l.nk, 1 << 30)), p.nchunks);
      if (p.nchunks == 1) {
        rows_block_kernel<T, R, false><<<grid, kRowBlockThreads, 0, stream>>>(o, ws, x, kept, l.nk, nr, p.chunk, r);
      } else {
        rows_block_kernel<T, R, true><<<grid, kRowBlockThreads, 0, stream>>>(o, ws, x, kept, l.nk, nr, p.chunk, r);
      }
      break;
    }
    case Kind::cols_thin:
    case Kind::cols: {
      const int64_t kinner = l.ksizes[l.nkept - 1];
      const int64_t nouter = l.nk / kinner;
      const Strided<1> kouter = offsets_of(l.nkept - 1, l.ksizes, l.kstrides);
      const Strided<1> red = offsets_of(l.nred, l.rsizes, l.rstrides);
      if (p.kind == Kind::cols_thin) {
        const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(l.nk, 256), 132 * 32));
        cols_thin_kernel<T, R><<<blocks, 256, 0, stream>>>(o, x, kouter, nouter, kinner, red, nr, r);
        break;
      }
      const int64_t blocks = nouter * ceil_div(kinner, 32);
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks, 1 << 30)), p.nchunks);
      const dim3 block(32, kColThreadsY);
      if (p.nchunks == 1) {
        cols_kernel<T, R, false><<<grid, block, 0, stream>>>(o, ws, x, kouter, nouter, kinner, red, nr, p.chunk, r);
      } else {
        cols_kernel<T, R, true><<<grid, block, 0, stream>>>(o, ws, x, kouter, nouter, kinner, red, nr, p.chunk, r);
      }
      break;
    }
  }
  if (p.nchunks > 1) {
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(l.nk, 8), 65535 * 16));
    merge_kernel<R><<<blocks, 256, 0, stream>>>(o, ws, l.nk, p.nchunks, nr, r);
  }
}

[[noreturn]] void bad_dtype(const char* what, int dtype) {
  throw CudaLaunchError(std::string(what) + ": unsupported dtype " + std::to_string(dtype));
}

}  // namespace

bool reduce_direct(const ReduceLayout& l) { return is_row(l) || is_col(l); }

int64_t reduce_workspace_bytes(const ReduceLayout& l) {
  if (l.nk == 0) return 0;
  const Plan p = make_plan(l);
  return p.nchunks > 1 ? l.nk * p.nchunks * kMaxStateBytes : 0;
}

void launch_reduce(ReduceOp op, const DevTensor& out, const DevTensor& in, const ReduceLayout& l,
                   int64_t correction, void* workspace, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::sum:
      TS_CUDA_DISPATCH_ALL(in.dtype, "sum", [&] {
        run_reduce<scalar_t>(out, in, l, workspace, stream, SumR<scalar_t>{false});
      });
      break;
    case ReduceOp::mean:
      TS_CUDA_DISPATCH_FLOATS(in.dtype, "mean", [&] {
        run_reduce<scalar_t>(out, in, l, workspace, stream, SumR<scalar_t>{true});
      });
      break;
    case ReduceOp::max:
      TS_CUDA_DISPATCH_ALL(in.dtype, "max", [&] {
        if constexpr (std::is_same_v<scalar_t, bool>) bad_dtype("max", in.dtype);
        else run_reduce<scalar_t>(out, in, l, workspace, stream, MaxR<scalar_t>{});
      });
      break;
    case ReduceOp::argmax:
      TS_CUDA_DISPATCH_ALL(in.dtype, "argmax", [&] {
        if constexpr (std::is_same_v<scalar_t, bool>) bad_dtype("argmax", in.dtype);
        else run_reduce<scalar_t>(out, in, l, workspace, stream, ArgmaxR<scalar_t>{});
      });
      break;
    case ReduceOp::var:
      TS_CUDA_DISPATCH_FLOATS(in.dtype, "var", [&] {
        run_reduce<scalar_t>(out, in, l, workspace, stream, VarR<scalar_t>{correction});
      });
      break;
  }
  check_launch("reduce");
}

// ---- sum_squares -----------------------------------------------------------------------
namespace {

constexpr int kSquaresThreads = 256;
constexpr int kSquaresGroup = 48;  // tensors per launch, passed by value (kernel parameters)

// Up to kSquaresGroup tensors of one launch: their blocks numbered one after another.
struct SquaresGroup {
  const void* x[kSquaresGroup];
  int64_t numel[kSquaresGroup];
  int64_t first_block[kSquaresGroup + 1];  // tensor t's blocks: [first_block[t], first_block[t + 1])
  int dtype[kSquaresGroup];
  int count;
};

template <typename T>
__device__ __forceinline__ double squares_run(const void* data, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(data);
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSquaresThreads) {
    const double v = static_cast<double>(to_acc(x[i]));
    acc += v * v;
  }
  return acc;
}

// Block b (numbered over the group's tensors): the squares of its tensor's elements
// [j kSquaresChunk, (j + 1) kSquaresChunk) in f64, each thread a strided run, then a fixed tree
// over the block: the same bits for the same tensor on every run, whatever else is launched
// with it.
__global__ void __launch_bounds__(kSquaresThreads) squares_kernel(double* partial, SquaresGroup g) {
  __shared__ double s[kSquaresThreads];
  const int64_t b = blockIdx.x;
  int t = 0;
  while (t + 1 < g.count && g.first_block[t + 1] <= b) ++t;
  const int64_t begin = (b - g.first_block[t]) * kSquaresChunk;
  const int64_t end = begin + kSquaresChunk < g.numel[t] ? begin + kSquaresChunk : g.numel[t];
  double acc = 0.0;
  switch (g.dtype[t]) {
    case kF64: acc = squares_run<double>(g.x[t], begin, end); break;
    case kF16: acc = squares_run<__half>(g.x[t], begin, end); break;
    case kBF16: acc = squares_run<__nv_bfloat16>(g.x[t], begin, end); break;
    default: acc = squares_run<float>(g.x[t], begin, end); break;
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kSquaresThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[b] = s[0];
}

// Thread t: sums[t] = tensor t's block sums added in order (0 for an empty tensor).
__global__ void fold_blocks_kernel(double* sums, const double* partial, SquaresGroup g) {
  const int t = threadIdx.x;
  if (t >= g.count) return;
  const int64_t first = g.first_block[t], n = g.first_block[t + 1] - first;
  double v = n > 0 ? partial[first] : 0.0;
  for (int64_t i = 1; i < n; ++i) v += partial[first + i];
  sums[t] = v;
}

// One thread: out = in[0] + in[1] + ... in order.
__global__ void fold_kernel(double* out, const double* in, int64_t n) {
  double t = in[0];
  for (int64_t i = 1; i < n; ++i) t += in[i];
  *out = t;
}

}  // namespace

int64_t squares_blocks(int64_t numel) { return (numel + kSquaresChunk - 1) / kSquaresChunk; }

void launch_sum_squares(const DevTensor& out, const std::vector<DevTensor>& xs, double* sums,
                        double* partial, cudaStream_t stream) {
  // Two launches per group of tensors (their blocks' squares, then each tensor's blocks
  // folded in order), then one fold of the per-tensor sums in order.
  for (size_t first = 0; first < xs.size(); first += kSquaresGroup) {
    SquaresGroup g{};
    g.count = static_cast<int>(std::min<size_t>(kSquaresGroup, xs.size() - first));
    for (int t = 0; t < g.count; ++t) {
      const DevTensor& x = xs[first + t];
      if (x.dtype != kF32 && x.dtype != kF64 && x.dtype != kF16 && x.dtype != kBF16) {
        bad_dtype("sum_squares", x.dtype);
      }
      g.x[t] = x.data;
      g.numel[t] = x.numel;
      g.dtype[t] = x.dtype;
      g.first_block[t + 1] = g.first_block[t] + squares_blocks(x.numel);
    }
    const int64_t blocks = g.first_block[g.count];
    if (blocks > 0) {
      squares_kernel<<<static_cast<unsigned>(blocks), kSquaresThreads, 0, stream>>>(partial, g);
    }
    fold_blocks_kernel<<<1, kSquaresGroup, 0, stream>>>(sums + first, partial, g);
  }
  fold_kernel<<<1, 1, 0, stream>>>(typed<double>(out), sums, static_cast<int64_t>(xs.size()));
  check_launch("sum_squares");
}

}  // namespace tessera::cuda_kernels
