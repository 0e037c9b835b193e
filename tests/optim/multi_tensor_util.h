// Helpers for the suites that call the fused updates (adamw_, sgd_) in their multi-tensor
// form directly (tests/optim/multi_tensor_test.cc on the CPU, tests/cuda/optim_test.cc on
// CUDA): a call taking tuples of `width` operands, and operands laid out as views into one
// flat buffer per role, some of them deliberately misaligned.
//
//   Operands o = make_operands({1, 3, 1001}, {DType::f32, DType::f32, DType::f32, DType::f32}, 7);
//   call_tuples(OpId::adamw_, {o.at(0, 0), o.at(1, 0), o.at(2, 0), o.at(3, 0), Tensor()},
//               attrs, /*width=*/5, /*written=*/{0, 2, 3, 4});
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera::optim::testing {

// call_inplace takes the written inputs as an initializer_list (of a length fixed at compile
// time; indices past the inputs are skipped).
template <size_t... I>
void call_written(OpId op, std::vector<Tensor> in, const Attrs& a,
                  const std::array<size_t, sizeof...(I)>& w, std::index_sequence<I...>) {
  call_inplace(op, std::move(in), a, {w[I]...});
}

// One call of `op` on consecutive tuples of `width` inputs, positions `written` of every
// tuple being written.
inline void call_tuples(OpId op, std::vector<Tensor> in, const Attrs& a, size_t width,
                        std::vector<size_t> written) {
  std::array<size_t, 1024> w;
  w.fill(SIZE_MAX);
  size_t n = 0;
  for (size_t j = 0; j < in.size() / width; ++j) {
    for (size_t k : written) w.at(n++) = j * width + k;
  }
  NoGradGuard no_grad;
  call_written(op, std::move(in), a, w, std::make_index_sequence<1024>());
}

// Tensors of `sizes` as views into one flat buffer per role: even tensors start at a
// multiple of 4 elements, odd ones one element later, so their operands are not 16-byte
// aligned (the kernels' scalar path). Returns the starts and the buffer's size.
inline std::pair<std::vector<int64_t>, int64_t> layout(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (size_t j = 0; j < sizes.size(); ++j) {
    at += static_cast<int64_t>(j % 2);
    starts.push_back(at);
    at = (at + sizes[j] + 3) / 4 * 4;
  }
  return {starts, at + 4};
}

struct Views {
  Tensor flat;
  std::vector<Tensor> views;
};

inline Views views_into(const Tensor& flat, const std::vector<int64_t>& sizes) {
  Views v{flat, {}};
  const std::vector<int64_t> starts = layout(sizes).first;
  for (size_t j = 0; j < sizes.size(); ++j) {
    v.views.push_back(flat.slice(0, starts[j], starts[j] + sizes[j]));
  }
  return v;
}

inline int64_t flat_size(const std::vector<int64_t>& sizes) { return layout(sizes).second; }

// One optimizer's operands on one device: views into flat buffers, role by role.
struct Operands {
  std::vector<Views> roles;  // param, grad, state..., master
  Tensor at(size_t role, size_t j) const { return roles[role].views[j]; }
};

// Standard normal values (seeded) in every role, on the CPU, cast to the role's dtype.
inline Operands make_operands(const std::vector<int64_t>& sizes,
                              const std::vector<DType>& role_dtypes, uint64_t seed) {
  Operands o;
  const int64_t n = flat_size(sizes);
  Generator gen(seed);
  for (DType dt : role_dtypes) {
    Tensor flat = cast(randn({n}, DType::f64, kCPU, &gen), dt);
    o.roles.push_back(views_into(flat, sizes));
  }
  return o;
}

}  // namespace tessera::optim::testing
