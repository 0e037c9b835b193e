// Adafactor's fused passes over factored matrices (tensor/ops.h): the row and column sums of
// g^2 + eps, the sum of the update's squares, and the write of the parameter (and first
// moment). Each is one pass over the [B, M, N] matrices; the sums accumulate in f64. The
// update's element arithmetic is the same steps as optim/adafactor.cc's ops, each rounded
// once in the dtype (built with -ffp-contract=off, kernels/cpu/BUILD), using the scalar
// functors the elementwise ops use.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/scalar_ops.h"
#include "tensor/error.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// Rows per chunk of work: about this many elements each. The sums' chunks are set by the
// shape alone (as kernels/cpu/reduce.cc's), so their results are bitwise the same however
// many threads run them.
constexpr int64_t kGrainElements = 1 << 15;
constexpr int64_t kSumChunkElements = 1 << 18;
int64_t rows_per_sum_chunk(int64_t N) {
  return std::max<int64_t>(1, kSumChunkElements / std::max<int64_t>(N, 1));
}
// Independent f64 partial sums along a row, so that the loop vectorises (each lane's sum is
// in order; the lanes are added in order at the end).
constexpr int kLanes = 8;
inline double lanes_sum(const double (&acc)[kLanes]) {
  double s = 0;
  for (double a : acc) s += a;
  return s;
}

void require_contiguous(const char* op,
                        std::initializer_list<std::pair<const Tensor*, const char*>> ts) {
  for (const auto& [t, what] : ts) {
    TS_CHECK(!t->defined() || t->is_contiguous(), "{}: {} {} must be contiguous", op, what,
             shape_str(t->shape()));
  }
}

template <typename S>
void stats(const Tensor& grad, const Tensor& out, double eps) {
  const int64_t B = grad.size(0), M = grad.size(1), N = grad.size(2);
  const S* g = static_cast<const S*>(grad.raw_data());
  S* o = static_cast<S*>(out.raw_data());
  const S e = S(eps);
  // Each matrix in chunks of whole rows (set by the shape), each chunk with its own column
  // partial sums, added in chunk order afterwards.
  const int64_t per = rows_per_sum_chunk(N);
  const int64_t chunks = std::max<int64_t>(1, (M + per - 1) / per);  // per matrix
  std::vector<double> partial(static_cast<size_t>(B * chunks * N), 0.0);
  parallel_for(0, B * chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / chunks, k = q % chunks;
      double* col = partial.data() + q * N;
      for (int64_t i = k * per; i < std::min(M, (k + 1) * per); ++i) {
        const S* row = g + (b * M + i) * N;
        double acc[kLanes] = {};
        int64_t j = 0;
        for (; j + kLanes <= N; j += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            const double u = double(row[j + l] * row[j + l] + e);
            acc[l] += u;
            col[j + l] += u;
          }
        }
        for (; j < N; ++j) {
          const double u = double(row[j] * row[j] + e);
          acc[0] += u;
          col[j] += u;
        }
        o[b * (M + N) + i] = S(lanes_sum(acc));
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < chunks; ++k) sum += partial[static_cast<size_t>((b * chunks + k) * N + j)];
      o[b * (M + N) + M + j] = S(sum);
    }
  }
}

// The update of one element (tensor/ops.h): kProduct (g a) b, else the floored form.
template <typename S, bool kProduct>
struct Update {
  S divisor, floor;
  S operator()(S g, S a, S b) const {
    if constexpr (kProduct) {
      return (g * a) * b;
    } else {
      const S v = (a * b) / divisor;
      return g * scalar_ops::rsqrt{}(scalar_ops::maximum{}(v, floor));
    }
  }
};

template <typename S, bool kProduct>
void norm(const Tensor& grad, const Tensor& ra, const Tensor& rb, const Tensor& out, const Attrs& at) {
  const int64_t B = grad.size(0), M = grad.size(1), N = grad.size(2), rows = B * M;
  const S* g = static_cast<const S*>(grad.raw_data());
  const S* a = static_cast<const S*>(ra.raw_data());
  const S* b = static_cast<const S*>(rb.raw_data());
  const Update<S, kProduct> u{S(at.value), S(at.eps)};
  // Chunks of whole rows set by the shape, their sums added in chunk order.
  const int64_t per = rows_per_sum_chunk(N);
  const int64_t chunks = std::max<int64_t>(1, (rows + per - 1) / per);
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double acc[kLanes] = {};
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const S ai = a[r];
        const S* bj = b + (r / M) * N;
        const S* row = g + r * N;
        int64_t j = 0;
        for (; j + kLanes <= N; j += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            const S x = u(row[j + l], ai, bj[j + l]);
            acc[l] += double(x * x);
          }
        }
        for (; j < N; ++j) {
          const S x = u(row[j], ai, bj[j]);
          acc[0] += double(x * x);
        }
      }
      partial[static_cast<size_t>(c)] = lanes_sum(acc);
    }
  });
  double total = 0;
  for (double p : partial) total += p;
  *static_cast<double*>(out.raw_data()) = total;
}

template <typename S, bool kProduct, bool kMoment, int kForm>
void apply(const Tensor& param, const Tensor& grad, const Tensor& ra, const Tensor& rb,
           const Tensor& exp_avg, const Attrs& at) {
  const int64_t M = grad.size(1), N = grad.size(2), rows = grad.size(0) * M;
  S* w = static_cast<S*>(param.raw_data());
  const S* g = static_cast<const S*>(grad.raw_data());
  const S* a = static_cast<const S*>(ra.raw_data());
  const S* b = static_cast<const S*>(rb.raw_data());
  S* m = kMoment ? static_cast<S*>(exp_avg.raw_data()) : nullptr;
  const Update<S, kProduct> u{S(at.value), S(at.eps)};
  const S scale = S(at.scale), beta1 = S(at.beta1), one_minus_beta1 = S(1.0 - at.beta1);
  const bool decay = at.weight_decay > 0;
  const S c = S(at.weight_decay), keep = S(1.0 - at.weight_decay);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(N, 1));
  parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S ai = a[r];
      const S* bj = b + (r / M) * N;
      S* __restrict wr = w + r * N;
      const S* __restrict gr = g + r * N;
      S* __restrict mr = kMoment ? m + r * N : nullptr;
      for (int64_t j = 0; j < N; ++j) {
        S x = u(gr[j], ai, bj[j]) * scale;
        if constexpr (kMoment) {
          mr[j] = mr[j] * beta1 + x * one_minus_beta1;
          x = mr[j];
        }
        const S p = wr[j];
        if constexpr (kForm == 0) {
          wr[j] = (decay ? p - p * c : p) - x;
        } else if constexpr (kForm == 1) {
          wr[j] = (decay ? p * keep : p) - x;
        } else {
          wr[j] = decay ? p - (x + p * c) : p - x;
        }
      }
    }
  });
}

template <typename F>
void by_dtype(const char* op, DType dt, F&& f) {
  if (dt == DType::f32) return f.template operator()<float>();
  if (dt == DType::f64) return f.template operator()<double>();
  TS_CHECK(false, "{}: f32 or f64 only, got {}", op, dt);
}

// The inputs only read (grad, the factors) may have any layout: a contiguous copy will do.
// The written ones must be contiguous.
Tensor readable(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void stats_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  require_contiguous("adafactor_stats_", {{&in[1], "out"}});
  const Tensor g = readable(in[0]);
  by_dtype("adafactor_stats_", g.dtype(), [&]<typename S>() { stats<S>(g, in[1], a.eps); });
}

void norm_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const Tensor g = readable(in[0]), ra = readable(in[1]), rb = readable(in[2]);
  by_dtype("adafactor_norm_", g.dtype(), [&]<typename S>() {
    if (a.k == 1) norm<S, true>(g, ra, rb, in[3], a);
    else norm<S, false>(g, ra, rb, in[3], a);
  });
}

template <typename S, bool kProduct, bool kMoment>
void apply_form(std::span<const Tensor> in, const Tensor& m, const Attrs& a) {
  if (a.dim == 0) return apply<S, kProduct, kMoment, 0>(in[0], in[1], in[2], in[3], m, a);
  if (a.dim == 1) return apply<S, kProduct, kMoment, 1>(in[0], in[1], in[2], in[3], m, a);
  apply<S, kProduct, kMoment, 2>(in[0], in[1], in[2], in[3], m, a);
}

void apply_kernel(std::span<const Tensor> raw, std::span<Tensor>, const Attrs& a) {
  const Tensor m = raw.size() > 4 ? raw[4] : Tensor();
  require_contiguous("adafactor_apply_", {{&raw[0], "param"}, {&m, "exp_avg"}});
  const std::vector<Tensor> in = {raw[0], readable(raw[1]), readable(raw[2]), readable(raw[3])};
  by_dtype("adafactor_apply_", in[0].dtype(), [&]<typename S>() {
    const bool moment = m.defined();
    if (a.k == 1) {
      if (moment) apply_form<S, true, true>(in, m, a);
      else apply_form<S, true, false>(in, m, a);
    } else {
      if (moment) apply_form<S, false, true>(in, m, a);
      else apply_form<S, false, false>(in, m, a);
    }
  });
}

}  // namespace

TS_REGISTER_KERNEL(cpu, adafactor_stats_, stats_kernel);
TS_REGISTER_KERNEL(cpu, adafactor_norm_, norm_kernel);
TS_REGISTER_KERNEL(cpu, adafactor_apply_, apply_kernel);

}  // namespace tessera::cpu
