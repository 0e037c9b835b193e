// CPU indexing kernels: embedding, index_select, index_add, gather, scatter_add, topk,
// counting_sort. Indices are checked (tessera::Error naming the op, the bad index and the
// size). Accumulating kernels are parallel only over positions that never collide, and add in index order, so
// they are deterministic.
#include <algorithm>
#include <numeric>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// Reads integer index tensors (i32 or i64) as i64, contiguous.
std::vector<int64_t> load_indices(const Tensor& t) { return t.to_vector<int64_t>(); }

void check_range(const char* op, int64_t idx, int64_t size, int64_t dim) {
  if (idx < 0 || idx >= size) {
    fail("{}: index {} is out of range for dim {} of size {}", op, idx, dim, size);
  }
}

void embedding_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor w = contiguous_cpu(in[0]);
  const std::vector<int64_t> idx = load_indices(in[1]);
  const int64_t v = w.shape()[0], d = w.shape()[1];
  for (int64_t i : idx) check_range("embedding", i, v, 0);
  const int64_t row_bytes = d * dtype_size(w.dtype());
  const char* wp = static_cast<const char*>(w.raw_data());
  char* op = static_cast<char*>(out[0].raw_data());
  parallel_for(0, static_cast<int64_t>(idx.size()), std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(d, 1)),
               [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(op + i * row_bytes, wp + idx[i] * row_bytes, row_bytes);
  });
}

void index_select_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t dim = normalize_dim("index_select", a.dim, x.dim());
  const std::vector<int64_t> idx = load_indices(in[1]);
  const Split3 s = split3(x.shape(), dim);
  for (int64_t i : idx) check_range("index_select", i, s.mid, dim);
  const int64_t n = static_cast<int64_t>(idx.size());
  const int64_t es = dtype_size(x.dtype());
  const char* xp = static_cast<const char*>(x.raw_data());
  char* op = static_cast<char*>(out[0].raw_data());
  parallel_for(0, s.outer * n, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(s.inner, 1)),
               [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t o = k / n, i = k % n;
      std::memcpy(op + (o * n + i) * s.inner * es, xp + (o * s.mid + idx[i]) * s.inner * es,
                  s.inner * es);
    }
  });
}

// out = x; out[..., index[i], ...] += source[..., i, ...]. Parallel over (outer, inner
// column chunks); every chunk walks the index list in order.
void index_add_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& o = out[0];
  copy_cpu(o, in[0]);
  const Tensor src = contiguous_cpu(in[2]);
  const int64_t dim = normalize_dim("index_add", a.dim, o.dim());
  const std::vector<int64_t> idx = load_indices(in[1]);
  const Split3 s = split3(o.shape(), dim);
  for (int64_t i : idx) check_range("index_add", i, s.mid, dim);
  const int64_t n = static_cast<int64_t>(idx.size());
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (s.inner + kChunk - 1) / kChunk;
  visit_dtype(o.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      T* op = static_cast<T*>(o.raw_data());
      const T* sp = static_cast<const T*>(src.raw_data());
      parallel_for(0, s.outer * chunks, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
          const int64_t outer = k / chunks, c0 = (k % chunks) * kChunk;
          const int64_t c1 = std::min(s.inner, c0 + kChunk);
          for (int64_t i = 0; i < n; ++i) {
            T* dst = op + (outer * s.mid + idx[i]) * s.inner;
            const T* from = sp + (outer * n + i) * s.inner;
            for (int64_t c = c0; c < c1; ++c) dst[c] = T(C(dst[c]) + C(from[c]));
          }
        }
      });
    }
  });
}

// Offsets for gather/scatter_add: walks the index tensor's shape; `pos(dim)` replaced by the
// index value in the indexed tensor.
template <typename F>
void walk_index(const Shape& ishape, F&& fn) {
  const int64_t n = numel_of(ishape);
  std::vector<int64_t> coord(ishape.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    fn(k, coord);
    for (int64_t d = static_cast<int64_t>(ishape.size()) - 1; d >= 0; --d) {
      if (++coord[d] < ishape[d]) break;
      coord[d] = 0;
    }
  }
}

int64_t offset_with(const std::vector<int64_t>& coord, const Strides& strides, int64_t dim,
                    int64_t value) {
  int64_t off = 0;
  for (size_t d = 0; d < coord.size(); ++d) {
    off += (static_cast<int64_t>(d) == dim ? value : coord[d]) * strides[d];
  }
  return off;
}

void gather_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t dim = normalize_dim("gather", a.dim, x.dim());
  const std::vector<int64_t> idx = load_indices(in[1]);
  const Strides xs = x.strides();
  const int64_t es = dtype_size(x.dtype());
  const char* xp = static_cast<const char*>(x.raw_data());
  char* op = static_cast<char*>(out[0].raw_data());
  walk_index(in[1].shape(), [&](int64_t k, const std::vector<int64_t>& coord) {
    check_range("gather", idx[k], x.shape()[dim], dim);
    std::memcpy(op + k * es, xp + offset_with(coord, xs, dim, idx[k]) * es, es);
  });
}

void scatter_add_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& o = out[0];
  copy_cpu(o, in[0]);
  const int64_t dim = normalize_dim("scatter_add", a.dim, o.dim());
  const std::vector<int64_t> idx = load_indices(in[1]);
  const Tensor src = contiguous_cpu(in[2]);
  const Strides os = o.strides(), ss = src.strides();
  visit_dtype(o.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      T* op = static_cast<T*>(o.raw_data());
      const T* sp = static_cast<const T*>(src.raw_data());
      walk_index(in[1].shape(), [&](int64_t k, const std::vector<int64_t>& coord) {
        check_range("scatter_add", idx[k], o.shape()[dim], dim);
        T& dst = op[offset_with(coord, os, dim, idx[k])];
        dst = T(C(dst) + C(sp[offset_with(coord, ss, -1, 0)]));
      });
    }
  });
}

// Each row along dim: its k largest values, descending, NaN above everything (as PyTorch);
// equal values in index order, so the result is deterministic.
void topk_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t dim = normalize_dim("topk", a.dim, x.dim());
  const Split3 s = split3(x.shape(), dim);
  const int64_t k = a.k;
  int64_t* ip = static_cast<int64_t*>(out[1].raw_data());
  visit_dtype(x.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      T* vp = static_cast<T*>(out[0].raw_data());
      parallel_for(0, s.outer * s.inner, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(s.mid, 1)),
                   [&](int64_t begin, int64_t end) {
        std::vector<int64_t> order(static_cast<size_t>(s.mid));
        for (int64_t r = begin; r < end; ++r) {
          const int64_t o = r / s.inner, i = r % s.inner;
          const T* row = xp + o * s.mid * s.inner + i;
          auto value = [&](int64_t j) { return C(row[j * s.inner]); };
          auto before = [&](int64_t p, int64_t q) {
            const C vp_ = value(p), vq = value(q);
            const bool np = vp_ != vp_, nq = vq != vq;
            if (np != nq) return np;
            if (!np && vp_ != vq) return vp_ > vq;
            return p < q;
          };
          std::iota(order.begin(), order.end(), int64_t{0});
          std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
          for (int64_t j = 0; j < k; ++j) {
            const int64_t at = o * k * s.inner + j * s.inner + i;
            vp[at] = row[order[j] * s.inner];
            ip[at] = order[j];
          }
        }
      });
    }
  });
}

// Keys in [0, k): counts per key, then each key's positions in position order (stable).
void counting_sort_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const std::vector<int64_t> keys = load_indices(in[0]);
  int64_t* order = static_cast<int64_t*>(out[0].raw_data());
  int64_t* counts = static_cast<int64_t*>(out[1].raw_data());
  std::fill(counts, counts + a.k, int64_t{0});
  for (int64_t key : keys) {
    check_range("counting_sort", key, a.k, 0);
    ++counts[key];
  }
  std::vector<int64_t> next(static_cast<size_t>(a.k), 0);
  for (int64_t b = 1; b < a.k; ++b) next[b] = next[b - 1] + counts[b - 1];
  for (size_t i = 0; i < keys.size(); ++i) order[next[keys[i]]++] = static_cast<int64_t>(i);
}

TS_REGISTER_KERNEL(cpu, embedding, embedding_kernel);
TS_REGISTER_KERNEL(cpu, counting_sort, counting_sort_kernel);
TS_REGISTER_KERNEL(cpu, index_select, index_select_kernel);
TS_REGISTER_KERNEL(cpu, index_add, index_add_kernel);
TS_REGISTER_KERNEL(cpu, gather, gather_kernel);
TS_REGISTER_KERNEL(cpu, scatter_add, scatter_add_kernel);
TS_REGISTER_KERNEL(cpu, topk, topk_kernel);

}  // namespace
}  // namespace tessera::cpu
