// CPU matmul: f32 through Tessera's own sgemm (kernels/cpu/gemm.h), which reads operands at
// any strides, so transposed and sliced views are never copied. f16/bf16 are widened to f32,
// multiplied with f32 accumulation and rounded once at the end. f64 goes through Eigen's GEMM
// (multi-threaded with OpenMP); its operands must be row- or column-major views, other
// layouts are copied first.
#include <Eigen/Core>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using ColMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
using Stride = Eigen::OuterStride<>;

// A matrix operand: rows x cols at `ptr` with either unit column stride (row-major, ld
// between rows) or unit row stride (column-major, ld between columns).
template <typename T>
struct MatView {
  const T* ptr;
  int64_t rows, cols, ld;
  bool row_major;
};

// Layout of the last two dims of `t`, or nullopt if neither stride is 1.
bool gemm_layout(const Tensor& t, bool& row_major, int64_t& ld) {
  const int64_t r = t.shape()[t.dim() - 2], c = t.shape()[t.dim() - 1];
  int64_t rs = t.strides()[t.dim() - 2], cs = t.strides()[t.dim() - 1];
  if (c == 1) cs = 1;       // strides of size-1 dims are arbitrary
  if (r == 1) rs = std::max<int64_t>(c, 1);
  if (cs == 1 && rs >= std::max<int64_t>(c, 1)) {
    row_major = true;
    ld = rs;
    return true;
  }
  if (rs == 1 && cs >= std::max<int64_t>(r, 1)) {
    row_major = false;
    ld = cs;
    return true;
  }
  return false;
}

template <typename T, typename MA, typename MB>
void gemm_into(const MA& a, const MB& b, T* out, int64_t m, int64_t n) {
  Eigen::Map<RowMat<T>> c(out, m, n);
  c.noalias() = a * b;
}

template <typename T>
void gemm(const MatView<T>& a, const MatView<T>& b, T* out) {
  const int64_t m = a.rows, k = a.cols, n = b.cols;
  if (k == 0) {
    std::fill(out, out + m * n, T(0));
    return;
  }
  using RA = Eigen::Map<const RowMat<T>, 0, Stride>;
  using CA = Eigen::Map<const ColMat<T>, 0, Stride>;
  if (a.row_major && b.row_major) {
    gemm_into<T>(RA(a.ptr, m, k, Stride(a.ld)), RA(b.ptr, k, n, Stride(b.ld)), out, m, n);
  } else if (a.row_major) {
    gemm_into<T>(RA(a.ptr, m, k, Stride(a.ld)), CA(b.ptr, k, n, Stride(b.ld)), out, m, n);
  } else if (b.row_major) {
    gemm_into<T>(CA(a.ptr, m, k, Stride(a.ld)), RA(b.ptr, k, n, Stride(b.ld)), out, m, n);
  } else {
    gemm_into<T>(CA(a.ptr, m, k, Stride(a.ld)), CA(b.ptr, k, n, Stride(b.ld)), out, m, n);
  }
}

// Batch offsets (in elements) of each operand for every output batch index.
std::vector<int64_t> batch_offsets(const Tensor& t, const Shape& batch) {
  const Shape tb(t.shape().begin(), t.shape().end() - 2);
  const Strides ts(t.strides().begin(), t.strides().end() - 2);
  const Strides s = broadcast_strides(tb, ts, batch);
  const int64_t nb = numel_of(batch);
  std::vector<int64_t> off(nb, 0);
  for (int64_t i = 0; i < nb; ++i) {
    int64_t rest = i, o = 0;
    for (int64_t d = static_cast<int64_t>(batch.size()) - 1; d >= 0; --d) {
      o += (rest % batch[d]) * s[d];
      rest /= batch[d];
    }
    off[i] = o;
  }
  return off;
}

// Runs one(i) for every batch index i < nb. Many small products: one per thread (the GEMM
// then runs single-threaded inside the parallel region). Few large ones: one at a time, each
// using every thread.
template <typename F>
void for_each_product(int64_t nb, int64_t m, int64_t n, int64_t k, F&& one) {
  const int64_t flops = m * n * k;
  if (nb > 1 && flops < (1 << 21)) {
    parallel_for(0, nb, std::max<int64_t>(1, (1 << 21) / std::max<int64_t>(flops, 1)),
                 [&](int64_t b0, int64_t e0) {
                   for (int64_t i = b0; i < e0; ++i) one(i);
                 });
  } else {
    for (int64_t i = 0; i < nb; ++i) one(i);
  }
}

void matmul_f64(Tensor a, Tensor b, const Tensor& out) {
  using T = double;
  bool a_row = true, b_row = true;
  int64_t lda = 0, ldb = 0;
  if (!gemm_layout(a, a_row, lda)) {
    a = contiguous_cpu(a);
    gemm_layout(a, a_row, lda);
  }
  if (!gemm_layout(b, b_row, ldb)) {
    b = contiguous_cpu(b);
    gemm_layout(b, b_row, ldb);
  }
  const Shape batch(out.shape().begin(), out.shape().end() - 2);
  const int64_t m = out.shape()[out.dim() - 2], n = out.shape()[out.dim() - 1];
  const int64_t k = a.shape()[a.dim() - 1];
  const auto aoff = batch_offsets(a, batch), boff = batch_offsets(b, batch);
  const T* ap = static_cast<const T*>(a.raw_data());
  const T* bp = static_cast<const T*>(b.raw_data());
  T* op = static_cast<T*>(out.raw_data());
  for_each_product(numel_of(batch), m, n, k, [&](int64_t i) {
    gemm<T>(MatView<T>{ap + aoff[i], m, k, lda, a_row}, MatView<T>{bp + boff[i], k, n, ldb, b_row},
            op + i * m * n);
  });
}

void matmul_f32(const Tensor& a, const Tensor& b, const Tensor& out) {
  const Shape batch(out.shape().begin(), out.shape().end() - 2);
  const int64_t m = out.shape()[out.dim() - 2], n = out.shape()[out.dim() - 1];
  const int64_t k = a.shape()[a.dim() - 1];
  const auto aoff = batch_offsets(a, batch), boff = batch_offsets(b, batch);
  const float* ap = static_cast<const float*>(a.raw_data());
  const float* bp = static_cast<const float*>(b.raw_data());
  float* op = static_cast<float*>(out.raw_data());
  const int64_t ars = a.strides()[a.dim() - 2], acs = a.strides()[a.dim() - 1];
  const int64_t brs = b.strides()[b.dim() - 2], bcs = b.strides()[b.dim() - 1];
  // One b for every batch (x @ W, as a Linear layer multiplies [B, T, C] by its weight) and
  // a's batches one run of equally strided rows: one product of nb * m rows, so b is packed
  // once instead of once per batch. Each element's sum is the same either way (the GEMM
  // blocks K by K alone), so the bits are too.
  const int64_t nb = numel_of(batch);
  bool fold = nb > 1;
  for (int64_t i = 0; fold && i < nb; ++i) fold = boff[i] == 0 && aoff[i] == i * m * ars;
  if (fold) {
    sgemm(nb * m, n, k, StridedMatrix{ap, ars, acs}, StridedMatrix{bp, brs, bcs}, op, n);
    return;
  }
  for_each_product(nb, m, n, k, [&](int64_t i) {
    sgemm(m, n, k, StridedMatrix{ap + aoff[i], ars, acs}, StridedMatrix{bp + boff[i], brs, bcs},
          op + i * m * n, n);
  });
}

void matmul_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const DType dt = in[0].dtype();
  if (dt == DType::f32) return matmul_f32(in[0], in[1], out[0]);
  if (dt == DType::f64) return matmul_f64(in[0], in[1], out[0]);
  // f16/bf16: widen (a transposed operand stays transposed), multiply in f32, round once.
  Tensor wide = Tensor::empty(out[0].shape(), DType::f32, out[0].device());
  matmul_f32(to_compute_any_layout_cpu(in[0]), to_compute_any_layout_cpu(in[1]), wide);
  copy_cpu(out[0], wide);
}

TS_REGISTER_KERNEL(cpu, matmul, matmul_kernel);

// ---- grouped matmul (Mixture of Experts) ----------------------------------------------------

// Group e's rows [starts[e], starts[e + 1]) of x times w[e]. Each product uses every thread
// (the groups are the experts' token sets: few, and large when it matters).
template <typename T>
void grouped_matmul_typed(Tensor x, Tensor w, const std::vector<int64_t>& starts, const Tensor& out) {
  const int64_t K = x.shape()[1], M = w.shape()[2];
  T* op = static_cast<T*>(out.raw_data());
  if constexpr (std::is_same_v<T, float>) {
    const float* xp = static_cast<const float*>(x.raw_data());
    const float* wp = static_cast<const float*>(w.raw_data());
    for (size_t e = 0; e + 1 < starts.size(); ++e) {
      const int64_t r0 = starts[e], m = starts[e + 1] - r0;
      if (m == 0) continue;
      sgemm(m, M, K, StridedMatrix{xp + r0 * x.strides()[0], x.strides()[0], x.strides()[1]},
            StridedMatrix{wp + static_cast<int64_t>(e) * w.strides()[0], w.strides()[1], w.strides()[2]},
            op + r0 * M, M);
    }
  } else {
    bool x_row = true, w_row = true;
    int64_t ldx = 0, ldw = 0;
    if (!gemm_layout(x, x_row, ldx)) {
      x = contiguous_cpu(x);
      gemm_layout(x, x_row, ldx);
    }
    if (!gemm_layout(w, w_row, ldw)) {
      w = contiguous_cpu(w);
      gemm_layout(w, w_row, ldw);
    }
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* wp = static_cast<const T*>(w.raw_data());
    for (size_t e = 0; e + 1 < starts.size(); ++e) {
      const int64_t r0 = starts[e], m = starts[e + 1] - r0;
      if (m == 0) continue;
      const int64_t x_off = r0 * (x_row ? ldx : 1);
      gemm<T>(MatView<T>{xp + x_off, m, K, ldx, x_row},
              MatView<T>{wp + static_cast<int64_t>(e) * w.strides()[0], K, M, ldw, w_row}, op + r0 * M);
    }
  }
}

void grouped_matmul_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const std::vector<int64_t> starts = group_starts("grouped_matmul", in[2], in[0].shape()[0]);
  const DType dt = in[0].dtype();
  if (dt == DType::f32) return grouped_matmul_typed<float>(in[0], in[1], starts, out[0]);
  if (dt == DType::f64) return grouped_matmul_typed<double>(in[0], in[1], starts, out[0]);
  Tensor wide = Tensor::empty(out[0].shape(), DType::f32, out[0].device());
  grouped_matmul_typed<float>(to_compute_cpu(in[0]), to_compute_cpu(in[1]), starts, wide);
  copy_cpu(out[0], wide);
}

// dw[e] = x_e^T g_e: a [K, M] product over group e's rows (k = its size; zero rows give zeros).
template <typename T>
void grouped_weight_typed(const Tensor& x_in, const Tensor& g_in, const std::vector<int64_t>& starts,
                          const Tensor& out) {
  const Tensor x = contiguous_cpu(x_in), g = contiguous_cpu(g_in);
  const int64_t K = x.shape()[1], M = g.shape()[1];
  const T* xp = static_cast<const T*>(x.raw_data());
  const T* gp = static_cast<const T*>(g.raw_data());
  T* op = static_cast<T*>(out.raw_data());
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t r0 = starts[e], n = starts[e + 1] - r0;
    T* dst = op + static_cast<int64_t>(e) * K * M;
    if constexpr (std::is_same_v<T, float>) {
      sgemm(K, M, n, StridedMatrix{xp + r0 * K, 1, K}, StridedMatrix{gp + r0 * M, M, 1}, dst, M);
    } else if (n == 0) {
      std::fill(dst, dst + K * M, T(0));
    } else {
      gemm<T>(MatView<T>{xp + r0 * K, K, n, K, false}, MatView<T>{gp + r0 * M, n, M, M, true}, dst);
    }
  }
}

void grouped_matmul_backward_weight_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const std::vector<int64_t> starts =
      group_starts("grouped_matmul_backward_weight", in[2], in[0].shape()[0]);
  const DType dt = in[0].dtype();
  if (dt == DType::f32) return grouped_weight_typed<float>(in[0], in[1], starts, out[0]);
  if (dt == DType::f64) return grouped_weight_typed<double>(in[0], in[1], starts, out[0]);
  Tensor wide = Tensor::empty(out[0].shape(), DType::f32, out[0].device());
  grouped_weight_typed<float>(to_compute_cpu(in[0]), to_compute_cpu(in[1]), starts, wide);
  copy_cpu(out[0], wide);
}

TS_REGISTER_KERNEL(cpu, grouped_matmul, grouped_matmul_kernel);
TS_REGISTER_KERNEL(cpu, grouped_matmul_backward_weight, grouped_matmul_backward_weight_kernel);

}  // namespace

std::vector<int64_t> group_starts(const char* op, const Tensor& sizes, int64_t rows) {
  const std::vector<int64_t> n = sizes.to_vector<int64_t>();
  std::vector<int64_t> starts(n.size() + 1, 0);
  for (size_t e = 0; e < n.size(); ++e) {
    if (n[e] < 0) fail("{}: group {} has a negative size {}", op, e, n[e]);
    starts[e + 1] = starts[e] + n[e];
  }
  if (starts.back() != rows) {
    fail("{}: the group sizes sum to {} but x has {} rows", op, starts.back(), rows);
  }
  return starts;
}

}  // namespace tessera::cpu
