// Elementwise kernels on CUDA: the functor family ops (unary, binary with broadcasting,
// comparisons), gelu, gelu_backward and where, all through one skeleton instantiated with the
// scalar functors the CPU uses too (kernels/scalar_ops.h): 16-bit floats computed in f32 and
// rounded once, f64 in f64, the same NaN rules.
//
// Three paths, chosen on the host from the layouts only:
//   - flat: every operand contiguous with the output (or a scalar): 16-byte vector loads
//     and stores, with a scalar tail (and a scalar loop when a pointer is misaligned);
//   - inner-vector: broadcasting whose innermost dim is contiguous or broadcast for every
//     operand (a bias row): 16-byte accesses, one index computation per vector;
//   - strided: any strides and broadcasting, dims coalesced on the host first and the index
//     arithmetic done in 32 bits whenever the element count allows.
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/scalar_ops.h"

namespace tessera::cuda_kernels {
namespace {

namespace ops = scalar_ops;

// ---- adapters from storage types to the functors ------------------------------------------

template <typename T, typename Op> struct UnaryFn {
  __device__ T operator()(T x) const { return from_acc<T>(Op{}(to_acc(x))); }
};
template <typename T, typename Op> struct BinaryFn {
  __device__ T operator()(T a, T b) const { return from_acc<T>(Op{}(to_acc(a), to_acc(b))); }
};
template <typename T, typename Op> struct CompareFn {
  __device__ bool operator()(T a, T b) const { return Op{}(to_acc(a), to_acc(b)); }
};
template <typename T> struct WhereFn {
  __device__ T operator()(bool c, T a, T b) const { return c ? a : b; }  // the bits, unchanged
};

// ---- the skeleton ---------------------------------------------------------------------------

template <typename T> struct Arg {
  const T* p;
  T value;
  int mode;
};

// Scalars (host values and one-element device tensors) are read once per thread.
template <typename T> __device__ __forceinline__ int resolve(Arg<T>& a) {
  if (a.mode == kEwDeviceScalar) {
    a.value = a.p[0];
    a.mode = kEwHostScalar;
  }
  return 0;
}
template <typename T> __device__ __forceinline__ T load_one(const Arg<T>& a, int64_t i) {
  return a.mode == kEwTensor ? a.p[i] : a.value;
}
template <int V, typename T> __device__ __forceinline__ Vec<T, V> load_vec(const Arg<T>& a, int64_t i) {
  if (a.mode == kEwTensor) return reinterpret_cast<const Vec<T, V>*>(a.p)[i];
  Vec<T, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = a.value;
  return r;
}
template <int V, typename Out, typename F, typename... In>
__device__ __forceinline__ Vec<Out, V> apply_vec(const F& f, const Vec<In, V>&... x) {
  Vec<Out, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = f(x.v[j]...);
  return r;
}

template <int V, typename Out, typename F, typename... In>
__global__ void __launch_bounds__(256) ew_flat_kernel(Out* out, int64_t n, bool vec, F f, Arg<In>... a) {
  [[maybe_unused]] const int dummy[] = {0, resolve(a)...};
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    const int64_t nv = n / V;
    for (int64_t i = tid; i < nv; i += stride) {
      reinterpret_cast<Vec<Out, V>*>(out)[i] = apply_vec<V, Out>(f, load_vec<V>(a, i)...);
    }
    done = nv * V;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = f(load_one(a, i)...);
}

template <typename Out, typename F, size_t... K, typename... In>
__device__ __forceinline__ Out apply_at(const F& f, const int64_t* off, std::index_sequence<K...>,
                                        const Arg<In>&... a) {
  return f(load_one(a, off[K])...);
}

template <typename Out, typename F, typename... In>
__global__ void __launch_bounds__(256) ew_strided_kernel(Out* out, int64_t n, Strided<sizeof...(In)> s,
                                                         F f, Arg<In>... a) {
  [[maybe_unused]] const int dummy[] = {0, resolve(a)...};
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[sizeof...(In)];
    s.offsets(i, off);
    out[i] = apply_at<Out>(f, off, std::index_sequence_for<In...>{}, a...);
  }
}

// Strided operands whose innermost (coalesced) dim is contiguous or broadcast, with that dim
// a multiple of V: V outputs at a time share one index computation and each operand is one
// 16-byte load or one broadcast element (a bias row added to a matrix, a [B, T, 1] scale).
template <int V, typename T>
__device__ __forceinline__ Vec<T, V> load_vec_at(const Arg<T>& a, int64_t off, int64_t inner_stride) {
  Vec<T, V> r;
  if (a.mode == kEwTensor && inner_stride != 0) return *reinterpret_cast<const Vec<T, V>*>(a.p + off);
  const T v = a.mode == kEwTensor ? a.p[off] : a.value;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = v;
  return r;
}

template <int V, typename Out, typename F, int N, size_t... K, typename... In>
__device__ __forceinline__ Vec<Out, V> apply_vec_at(const F& f, const int64_t* off, const Strided<N>& s,
                                                    std::index_sequence<K...>, const Arg<In>&... a) {
  return apply_vec<V, Out>(f, load_vec_at<V>(a, off[K], s.strides[K][s.ndim - 1])...);
}

template <int V, typename Out, typename F, typename... In>
__global__ void __launch_bounds__(256) ew_inner_vec_kernel(Out* out, int64_t nv, Strided<sizeof...(In)> s,
                                                           F f, Arg<In>... a) {
  [[maybe_unused]] const int dummy[] = {0, resolve(a)...};
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[sizeof...(In)];
    s.offsets(v * V, off);
    reinterpret_cast<Vec<Out, V>*>(out)[v] =
        apply_vec_at<V, Out>(f, off, s, std::index_sequence_for<In...>{}, a...);
  }
}

// ---- host side --------------------------------------------------------------------------------

template <typename... T> struct Types {};

template <typename T> Arg<T> make_arg(const EwOperand& op) {
  Arg<T> a;
  a.p = static_cast<const T*>(op.t.data);
  a.mode = op.mode;
  std::memset(static_cast<void*>(&a.value), 0, sizeof(T));
  if (op.mode == kEwHostScalar) std::memcpy(static_cast<void*>(&a.value), &op.bits, sizeof(T));
  return a;
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The output's shape with each input's element strides, coalesced (strided_index.h; the
// output is contiguous, so only the inputs can stop a merge).
template <int N>
Strided<N> coalesce(const DevTensor& out, const std::array<EwOperand, N>& ops) {
  const int64_t* strides[N];
  for (int k = 0; k < N; ++k) strides[k] = ops[k].mode == kEwTensor ? ops[k].t.strides : nullptr;
  return coalesce_dims<N>(out.ndim, out.sizes, strides);
}

template <typename Out, typename F, typename... In, size_t... K>
void run_ew_impl(F f, const DevTensor& out, const std::array<EwOperand, sizeof...(In)>& ops,
                 cudaStream_t stream, std::index_sequence<K...>) {
  constexpr int N = sizeof...(In);
  const int64_t n = out.numel;
  if (n == 0) return;
  bool flat = true;
  for (const EwOperand& op : ops) flat = flat && (op.mode != kEwTensor || op.t.contiguous());
  Out* o = typed<Out>(out);
  // Elements per 16-byte access of the widest operand.
  constexpr size_t widest = std::max({sizeof(Out), sizeof(In)...});
  constexpr int V = static_cast<int>(16 / widest);
  constexpr size_t sizes[N] = {sizeof(In)...};
  if (flat) {
    bool vec = aligned(out.data, sizeof(Out) * V);
    for (int k = 0; k < N; ++k) {
      vec = vec && (ops[k].mode != kEwTensor || aligned(ops[k].t.data, sizes[k] * V));
    }
    const int blocks = grid_for(vec ? (n + V - 1) / V : n);
    ew_flat_kernel<V, Out><<<blocks, 256, 0, stream>>>(o, n, vec, f, make_arg<In>(ops[K])...);
    return;
  }
  const Strided<N> st = coalesce<N>(out, ops);
  const int inner = st.ndim - 1;
  bool inner_vec = V > 1 && st.ndim >= 2 && st.sizes[inner] % V == 0 && aligned(out.data, sizeof(Out) * V);
  for (int k = 0; inner_vec && k < N; ++k) {
    if (ops[k].mode != kEwTensor || st.strides[k][inner] == 0) continue;
    inner_vec = st.strides[k][inner] == 1 && aligned(ops[k].t.data, sizes[k] * V);
    for (int d = 0; inner_vec && d < inner; ++d) inner_vec = st.strides[k][d] % V == 0;
  }
  if (inner_vec) {
    ew_inner_vec_kernel<V, Out><<<grid_for(n / V), 256, 0, stream>>>(o, n / V, st, f,
                                                                    make_arg<In>(ops[K])...);
  } else {
    ew_strided_kernel<Out><<<grid_for(n), 256, 0, stream>>>(o, n, st, f, make_arg<In>(ops[K])...);
  }
}

template <typename Out, typename F, typename... In>
void run_ew(F f, const DevTensor& out, const std::array<EwOperand, sizeof...(In)>& ops,
            cudaStream_t stream, Types<In...>) {
  run_ew_impl<Out, F, In...>(f, out, ops, stream, std::index_sequence_for<In...>{});
}

[[noreturn]] void bad_dtype(const char* what, int dtype) {
  throw CudaLaunchError(std::string(what) + ": unsupported dtype " + std::to_string(dtype));
}

template <typename Op>
void unary_UnaryNumeric(const DevTensor& out, const EwOperand& x, cudaStream_t s) {
  TS_CUDA_DISPATCH_ALL(x.t.dtype, "unary", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, bool>) bad_dtype("unary", x.t.dtype);
    else run_ew<T>(UnaryFn<T, Op>{}, out, {x}, s, Types<T>{});
  });
}
template <typename Op>
void unary_UnaryFloat(const DevTensor& out, const EwOperand& x, cudaStream_t s) {
  TS_CUDA_DISPATCH_FLOATS(x.t.dtype, "unary", [&] {
    using T = scalar_t;
    run_ew<T>(UnaryFn<T, Op>{}, out, {x}, s, Types<T>{});
  });
}

template <typename Op>
void binary_Binary(const DevTensor& out, const EwOperand& a, const EwOperand& b, cudaStream_t s) {
  TS_CUDA_DISPATCH_ALL(a.t.dtype, "binary", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, bool>) bad_dtype("binary", a.t.dtype);
    else run_ew<T>(BinaryFn<T, Op>{}, out, {a, b}, s, Types<T, T>{});
  });
}
template <typename Op>
void binary_BinaryFloat(const DevTensor& out, const EwOperand& a, const EwOperand& b, cudaStream_t s) {
  TS_CUDA_DISPATCH_FLOATS(a.t.dtype, "binary", [&] {
    using T = scalar_t;
    run_ew<T>(BinaryFn<T, Op>{}, out, {a, b}, s, Types<T, T>{});
  });
}
template <typename Op>
void binary_Compare(const DevTensor& out, const EwOperand& a, const EwOperand& b, cudaStream_t s) {
  TS_CUDA_DISPATCH_STORAGE(a.t.dtype, "compare", [&] {
    using T = scalar_t;
    run_ew<bool>(CompareFn<T, Op>{}, out, {a, b}, s, Types<T, T>{});
  });
}

}  // namespace

void launch_unary(OpId op, const DevTensor& out, const EwOperand& x, cudaStream_t s) {
  switch (op) {
#define TS_CUDA_UNARY(_, name, family, props) \
  case OpId::name: unary_##family<ops::name>(out, x, s); break;
    TS_UNARY_OPS(TS_CUDA_UNARY, _)
#undef TS_CUDA_UNARY
    default: throw CudaLaunchError("launch_unary: not a unary functor op: " + std::to_string(int(op)));
  }
  check_launch("unary");
}

void launch_binary(OpId op, const DevTensor& out, const EwOperand& a, const EwOperand& b,
                   cudaStream_t s) {
  switch (op) {
#define TS_CUDA_BINARY(_, name, family, props) \
  case OpId::name: binary_##family<ops::name>(out, a, b, s); break;
    TS_BINARY_OPS(TS_CUDA_BINARY, _)
    TS_COMPARE_OPS(TS_CUDA_BINARY, _)
#undef TS_CUDA_BINARY
    default: throw CudaLaunchError("launch_binary: not a binary functor op: " + std::to_string(int(op)));
  }
  check_launch("binary");
}

void launch_gelu(bool approximate_tanh, const DevTensor& out, const EwOperand& x, cudaStream_t s) {
  if (approximate_tanh) unary_UnaryFloat<ops::gelu_tanh>(out, x, s);
  else unary_UnaryFloat<ops::gelu_erf>(out, x, s);
  check_launch("gelu");
}

void launch_gelu_backward(bool approximate_tanh, const DevTensor& out, const EwOperand& grad,
                          const EwOperand& x, cudaStream_t s) {
  if (approximate_tanh) binary_BinaryFloat<ops::gelu_tanh_backward>(out, grad, x, s);
  else binary_BinaryFloat<ops::gelu_erf_backward>(out, grad, x, s);
  check_launch("gelu_backward");
}

void launch_where(const DevTensor& out, const EwOperand& cond, const EwOperand& a,
                  const EwOperand& b, cudaStream_t s) {
  TS_CUDA_DISPATCH_STORAGE(a.t.dtype, "where", [&] {
    using T = scalar_t;
    run_ew<T>(WhereFn<T>{}, out, {cond, a, b}, s, Types<bool, T, T>{});
  });
  check_launch("where");
}

}  // namespace tessera::cuda_kernels
