// CPU reductions: sum, mean, max, argmax, var over any set of dims.
//
// The input is viewed as [kept dims..., reduced dims...] (each group coalesced) and one of
// three loops runs, chosen from the shapes only, never from the thread count, so results
// are bitwise identical however many threads run them:
//   - outer: the innermost kept dim is contiguous: accumulate whole rows of outputs at once
//     (vectorises across outputs; e.g. sum over dim 0 of a row-major matrix);
//   - blocks: few outputs, many reduced elements: fixed-size blocks of the reduced range
//     are reduced in parallel and merged in order (e.g. a full sum);
//   - per output: each output reduces its elements sequentially (e.g. sum over the last dim).
// Sums accumulate in 16 independent lanes within a contiguous run and in f64 across runs.
#include <cmath>
#include <limits>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce_blocks.h"
#include "kernels/cpu/util.h"
#include "tensor/internal/meta_util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

constexpr int64_t kBlock = kReduceBlock;  // reduced elements per block in the blocks loop
constexpr int64_t kBlockThreshold = kReduceBlockThreshold;  // reduced size from which blocks are used
constexpr int64_t kOuterChunk = 256;       // outputs per chunk in the outer loop

// ---- reducers ----------------------------------------------------------------------------
// Each has State, init(), step(state, x, ridx), merge(into, from) (from covers later ridx),
// and finalize(state, count) -> output value. `run` (optional) reduces a contiguous run.

template <typename T>
struct SumReducer {
  using C = compute_t<T>;
  using State = std::conditional_t<std::is_floating_point_v<C>, double, int64_t>;
  using Out = std::conditional_t<std::is_same_v<T, bool>, int64_t, T>;
  bool mean = false;
  State init() const { return 0; }
  void step(State& s, C x, int64_t) const { s += static_cast<State>(x); }
  void merge(State& s, const State& o) const { s += o; }
  void run(State& s, const T* p, int64_t n, int64_t) const {
    if constexpr (std::is_floating_point_v<C>) {
      constexpr int kLanes = 16;
      C lanes[kLanes] = {};
      int64_t i = 0;
      if constexpr (is_low_precision_v<T>) {
        // Widened 256 at a time (copy.cc's run helpers): the same lanes in the same order.
        alignas(64) float wide[256];
        while (i + kLanes <= n) {
          const int64_t m = std::min<int64_t>(256, (n - i) / kLanes * kLanes);
          widen_run(p + i, wide, m);
          for (int64_t w = 0; w < m; w += kLanes) {
            for (int j = 0; j < kLanes; ++j) lanes[j] += wide[w + j];
          }
          i += m;
        }
      }
      for (; i + kLanes <= n; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) lanes[j] += C(p[i + j]);
      }
      for (int w = kLanes / 2; w > 0; w /= 2) {
        for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
      }
      State t = lanes[0];
      for (; i < n; ++i) t += C(p[i]);
      s += t;
    } else {
      State t = 0;
      for (int64_t i = 0; i < n; ++i) t += static_cast<State>(p[i]);
      s += t;
    }
  }
  Out finalize(const State& s, int64_t count) const {
    if (mean) return Out(s / static_cast<double>(count));
    return Out(s);
  }
};

template <typename T>
struct MaxReducer {
  using C = compute_t<T>;
  using State = C;
  using Out = T;
  State init() const {
    if constexpr (std::is_floating_point_v<C>) return -std::numeric_limits<C>::infinity();
    else return std::numeric_limits<C>::lowest();
  }
  static C pick(C a, C x) {
    if constexpr (std::is_floating_point_v<C>) return (x > a || x != x) ? x : a;  // NaN wins
    else return x > a ? x : a;
  }
  void step(State& s, C x, int64_t) const { s = pick(s, x); }
  void merge(State& s, const State& o) const { s = pick(s, o); }
  Out finalize(const State& s, int64_t) const { return Out(s); }
};

template <typename T>
struct ArgmaxReducer {
  using C = compute_t<T>;
  struct State {
    C value;
    int64_t index;
  };
  using Out = int64_t;
  State init() const { return {MaxReducer<T>{}.init(), -1}; }
  // First maximum wins; a NaN counts as the maximum (the first NaN), as in PyTorch.
  static bool better(const State& s, C x) {
    if (s.index < 0) return true;
    if constexpr (std::is_floating_point_v<C>) {
      if (s.value != s.value) return false;
      if (x != x) return true;
    }
    return x > s.value;
  }
  void step(State& s, C x, int64_t ridx) const {
    if (better(s, x)) s = {x, ridx};
  }
  void merge(State& s, const State& o) const {
    if (o.index >= 0 && better(s, o.value)) s = o;
  }
  Out finalize(const State& s, int64_t) const { return s.index; }
};

template <typename T>
struct VarReducer {  // Welford's algorithm, merged with Chan et al.'s formula.
  using C = compute_t<T>;
  struct State {
    double n = 0, mean = 0, m2 = 0;
  };
  using Out = T;
  int64_t correction = 1;
  State init() const { return {}; }
  void step(State& s, C x, int64_t) const {
    s.n += 1;
    const double d = static_cast<double>(x) - s.mean;
    s.mean += d / s.n;
    s.m2 += d * (static_cast<double>(x) - s.mean);
  }
  void merge(State& s, const State& o) const {
    if (o.n == 0) return;
    if (s.n == 0) { s = o; return; }
    const double n = s.n + o.n, d = o.mean - s.mean;
    s.m2 += o.m2 + d * d * s.n * o.n / n;
    s.mean += d * o.n / n;
    s.n = n;
  }
  Out finalize(const State& s, int64_t) const {
    const double denom = s.n - static_cast<double>(correction);
    if (denom <= 0) return Out(std::numeric_limits<double>::quiet_NaN());
    return Out(s.m2 / denom);
  }
};

template <typename R, typename T>
concept HasRun = requires(const R& r, typename R::State& s, const T* p) { r.run(s, p, 1, 0); };

// ---- the driver --------------------------------------------------------------------------

struct Layout {
  Shape kshape;
  Strides kin;   // input strides (elements) of kept dims
  Strides kout;  // output strides of kept dims
  Shape rshape;
  Strides rin;   // input strides of reduced dims
  int64_t nk = 1, nr = 1;
};

void coalesce_group(Shape& shape, std::vector<Strides*> strides) {
  Shape s;
  std::vector<Strides> st(strides.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !s.empty();
    for (size_t k = 0; merge && k < strides.size(); ++k) {
      merge = st[k].back() == (*strides[k])[d] * shape[d];
    }
    if (merge) {
      s.back() *= shape[d];
      for (size_t k = 0; k < strides.size(); ++k) st[k].back() = (*strides[k])[d];
    } else {
      s.push_back(shape[d]);
      for (size_t k = 0; k < strides.size(); ++k) st[k].push_back((*strides[k])[d]);
    }
  }
  shape = std::move(s);
  for (size_t k = 0; k < strides.size(); ++k) *strides[k] = std::move(st[k]);
}

Layout make_layout(const Tensor& x, const std::vector<int64_t>& rdims) {
  Layout l;
  std::vector<bool> reduced(x.dim(), false);
  for (int64_t d : rdims) reduced[d] = true;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (reduced[d]) {
      l.rshape.push_back(x.shape()[d]);
      l.rin.push_back(x.strides()[d]);
    } else {
      l.kshape.push_back(x.shape()[d]);
      l.kin.push_back(x.strides()[d]);
    }
  }
  l.kout = contiguous_strides(l.kshape);
  l.nk = numel_of(l.kshape);
  l.nr = numel_of(l.rshape);
  coalesce_group(l.kshape, {&l.kin, &l.kout});
  coalesce_group(l.rshape, {&l.rin});
  return l;
}

// Reduces reduced-space indices [rbegin, rend) of the input block at `base` into s.
template <typename T, typename R>
void reduce_range(const R& r, typename R::State& s, const T* base, const Layout& l,
                  int64_t rbegin, int64_t rend) {
  using C = compute_t<T>;
  if (l.rshape.empty()) {
    if (rbegin < rend) r.step(s, C(base[0]), 0);
    return;
  }
  const int64_t inner = l.rshape.back(), istride = l.rin.back();
  int64_t ridx = rbegin;
  while (ridx < rend) {
    const int64_t pos = ridx % inner;
    const int64_t n = std::min(inner - pos, rend - ridx);
    const T* p = base + offset_of(ridx, l.rshape, l.rin);
    if constexpr (HasRun<R, T>) {
      if (istride == 1) {
        r.run(s, p, n, ridx);
        ridx += n;
        continue;
      }
    }
    for (int64_t i = 0; i < n; ++i) r.step(s, C(p[i * istride]), ridx + i);
    ridx += n;
  }
}

template <typename T, typename R>
void reduce_driver(const Tensor& x, const Tensor& out, const std::vector<int64_t>& rdims,
                   const R& r) {
  using Out = typename R::Out;
  using State = typename R::State;
  const Layout l = make_layout(x, rdims);
  const T* in = static_cast<const T*>(x.raw_data());
  Out* o = static_cast<Out*>(out.raw_data());
  if (l.nk == 0) return;

  const bool inner_contig = !l.rshape.empty() && l.rin.back() == 1;
  const bool outer = !inner_contig && !l.kshape.empty() && l.kin.back() == 1 &&
                     l.kshape.back() >= 16 && l.nr > 1;
  if (outer) {
    // Rows of the innermost kept dim, chunked; each chunk accumulates over all of R.
    const int64_t kinner = l.kshape.back();
    const int64_t chunks_per_row = (kinner + kOuterChunk - 1) / kOuterChunk;
    const int64_t rows = l.nk / kinner;
    Shape kouter_shape(l.kshape.begin(), l.kshape.end() - 1);
    Strides kouter_in(l.kin.begin(), l.kin.end() - 1), kouter_out(l.kout.begin(), l.kout.end() - 1);
    const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / (kOuterChunk * l.nr));
    parallel_for(0, rows * chunks_per_row, grain, [&](int64_t b, int64_t e) {
      std::vector<State> st(kOuterChunk);
      [[maybe_unused]] alignas(64) float wide[kOuterChunk];  // a 16-bit row's chunk, widened
      for (int64_t c = b; c < e; ++c) {
        const int64_t row = c / chunks_per_row, k0 = (c % chunks_per_row) * kOuterChunk;
        const int64_t width = std::min(kOuterChunk, kinner - k0);
        const T* row_in = in + offset_of(row, kouter_shape, kouter_in) + k0;
        Out* row_out = o + offset_of(row, kouter_shape, kouter_out) + k0 * l.kout.back();
        for (int64_t j = 0; j < width; ++j) st[j] = r.init();
        for (int64_t ri = 0; ri < l.nr; ++ri) {
          const T* p = row_in + offset_of(ri, l.rshape, l.rin);
          if constexpr (is_low_precision_v<T>) {
            widen_run(p, wide, width);
            for (int64_t j = 0; j < width; ++j) r.step(st[j], wide[j], ri);
          } else {
            for (int64_t j = 0; j < width; ++j) r.step(st[j], compute_t<T>(p[j]), ri);
          }
        }
        for (int64_t j = 0; j < width; ++j) row_out[j * l.kout.back()] = r.finalize(st[j], l.nr);
      }
    });
    return;
  }

  if (l.nr >= kBlockThreshold && l.nk < 64) {
    const int64_t nblocks = (l.nr + kBlock - 1) / kBlock;
    std::vector<State> partial(nblocks);
    for (int64_t k = 0; k < l.nk; ++k) {
      const T* base = in + offset_of(k, l.kshape, l.kin);
      parallel_for(0, nblocks, 1, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk) {
          partial[blk] = r.init();
          reduce_range<T>(r, partial[blk], base, l, blk * kBlock, std::min(l.nr, (blk + 1) * kBlock));
        }
      });
      State s = partial[0];
      for (int64_t blk = 1; blk < nblocks; ++blk) r.merge(s, partial[blk]);
      o[offset_of(k, l.kshape, l.kout)] = r.finalize(s, l.nr);
    }
    return;
  }

  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(l.nr, 1));
  parallel_for(0, l.nk, grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      State s = r.init();
      reduce_range<T>(r, s, in + offset_of(k, l.kshape, l.kin), l, 0, l.nr);
      o[offset_of(k, l.kshape, l.kout)] = r.finalize(s, l.nr);
    }
  });
}

std::vector<int64_t> reduce_dims(const Tensor& x, const Attrs& a, const char* op) {
  return normalize_dims(op, a.dims, x.dim());
}

void sum_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_dtype(in[0].dtype(), [&]<typename T>() {
    reduce_driver<T>(in[0], out[0], reduce_dims(in[0], a, "sum"), SumReducer<T>{});
  });
}

void mean_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "mean", [&]<typename T>() {
    SumReducer<T> r;
    r.mean = true;
    reduce_driver<T>(in[0], out[0], reduce_dims(in[0], a, "mean"), r);
  });
}

void max_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_dtype(in[0].dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      reduce_driver<T>(in[0], out[0], reduce_dims(in[0], a, "max"), MaxReducer<T>{});
    }
  });
}

void argmax_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& x = in[0];
  std::vector<int64_t> dims;
  if (a.all_dims) {
    for (int64_t d = 0; d < x.dim(); ++d) dims.push_back(d);
  } else if (x.dim() > 0) {
    dims.push_back(normalize_dim("argmax", a.dim, x.dim()));
  }
  visit_dtype(x.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) reduce_driver<T>(x, out[0], dims, ArgmaxReducer<T>{});
  });
}

void var_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "var", [&]<typename T>() {
    VarReducer<T> r;
    r.correction = a.correction;
    reduce_driver<T>(in[0], out[0], reduce_dims(in[0], a, "var"), r);
  });
}

TS_REGISTER_KERNEL(cpu, sum, sum_kernel);
TS_REGISTER_KERNEL(cpu, mean, mean_kernel);
TS_REGISTER_KERNEL(cpu, max, max_kernel);
TS_REGISTER_KERNEL(cpu, argmax, argmax_kernel);
TS_REGISTER_KERNEL(cpu, var, var_kernel);

}  // namespace
}  // namespace tessera::cpu
