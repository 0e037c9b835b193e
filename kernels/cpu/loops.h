// Strided loops for elementwise kernels: any shapes, strides and broadcasting, with the
// innermost run handed to a callback that specialises the contiguous case.
//
//   Operands<3> ops = operands_for(out, {a, b});           // out first, inputs broadcast
//   for_each_run(ops, [&](const Run<3>& r) { ... r.ptr[k], r.stride[k] (bytes), r.n ... });
//
// Dims are coalesced first, so a contiguous tensor of any rank is one run and a broadcast
// row vector is runs of its length. Runs are split across threads by element count.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "tensor/tensor.h"

namespace tessera::cpu {

template <int N>
struct Operands {
  Shape shape;                               // the iteration shape (the output's)
  std::array<char*, N> base{};               // first element of each operand
  std::array<std::vector<int64_t>, N> strides;  // bytes, per dim of `shape`
};

template <int N>
struct Run {
  std::array<char*, N> ptr;
  std::array<int64_t, N> stride;  // bytes between consecutive elements of the run
  int64_t n;
};

// Operand 0 is `out` (its shape is the iteration shape); the rest broadcast to it.
template <int N>
Operands<N> operands_for(const Tensor& out, std::initializer_list<Tensor> inputs) {
  Operands<N> ops;
  ops.shape = out.shape();
  auto add = [&](int k, const Tensor& t) {
    ops.base[k] = static_cast<char*>(t.raw_data());
    const Strides s = broadcast_strides(t.shape(), t.strides(), ops.shape);
    ops.strides[k].resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) ops.strides[k][i] = s[i] * dtype_size(t.dtype());
  };
  add(0, out);
  int k = 1;
  for (const Tensor& t : inputs) add(k++, t);
  return ops;
}

// Drops size-1 dims and merges neighbours that are contiguous for every operand.
template <int N>
void coalesce(Operands<N>& ops) {
  Shape shape;
  std::array<std::vector<int64_t>, N> strides;
  for (size_t d = 0; d < ops.shape.size(); ++d) {
    if (ops.shape[d] == 1) continue;
    bool merge = !shape.empty();
    for (int k = 0; merge && k < N; ++k) {
      merge = strides[k].back() == ops.strides[k][d] * ops.shape[d];
    }
    if (merge) {
      shape.back() *= ops.shape[d];
      for (int k = 0; k < N; ++k) strides[k].back() = ops.strides[k][d];
    } else {
      shape.push_back(ops.shape[d]);
      for (int k = 0; k < N; ++k) strides[k].push_back(ops.strides[k][d]);
    }
  }
  if (shape.empty()) {
    shape.push_back(1);
    for (int k = 0; k < N; ++k) strides[k].push_back(0);
  }
  ops.shape = std::move(shape);
  ops.strides = std::move(strides);
}

// Calls fn(run) over every element of ops.shape, as runs along the innermost dim.
template <int N, typename F>
void for_each_run(Operands<N> ops, F&& fn, int64_t grain = kElementwiseGrain) {
  coalesce(ops);
  const int64_t nd = static_cast<int64_t>(ops.shape.size());
  const int64_t inner = ops.shape.back();
  const int64_t total = numel_of(ops.shape);
  if (total == 0) return;
  parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    // Multi-index of `begin`, then walk run by run.
    std::vector<int64_t> idx(nd, 0);
    int64_t rest = begin;
    for (int64_t d = nd - 1; d >= 0; --d) {
      idx[d] = rest % ops.shape[d];
      rest /= ops.shape[d];
    }
    std::array<char*, N> ptr;
    for (int k = 0; k < N; ++k) {
      int64_t off = 0;
      for (int64_t d = 0; d < nd; ++d) off += idx[d] * ops.strides[k][d];
      ptr[k] = ops.base[k] + off;
    }
    Run<N> run;
    for (int k = 0; k < N; ++k) run.stride[k] = ops.strides[k][nd - 1];
    int64_t pos = begin;
    while (pos < end) {
      const int64_t n = std::min(inner - idx[nd - 1], end - pos);
      run.ptr = ptr;
      run.n = n;
      fn(run);
      pos += n;
      // Advance the multi-index by n (carrying into outer dims).
      idx[nd - 1] += n;
      for (int k = 0; k < N; ++k) ptr[k] += n * ops.strides[k][nd - 1];
      for (int64_t d = nd - 1; d > 0 && idx[d] == ops.shape[d]; --d) {
        idx[d] = 0;
        ++idx[d - 1];
        for (int k = 0; k < N; ++k) {
          ptr[k] += ops.strides[k][d - 1] - ops.shape[d] * ops.strides[k][d];
        }
      }
    }
  });
}

}  // namespace tessera::cpu
