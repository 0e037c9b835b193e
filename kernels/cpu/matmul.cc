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
  for_each_product(numel_of(batch), m, n, k, [&](int64_t i) {
    sgemm(m, n, k, StridedMatrix{ap + aoff[i], ars, acs}, StridedMatrix{bp + boff[i], brs, bcs},
          op + i * m * n, n);
  });
}

void matmul_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const DType dt = in[0].dtype();
  if (dt == DType::f32) return matmul_f32(in[0], in[1], out[0]);
  if (dt == DType::f64) return matmul_f64(in[0], in[1], out[0]);
  // f16/bf16: widen, multiply in f32, round once.
  Tensor wide = Tensor::empty(out[0].shape(), DType::f32, out[0].device());
  matmul_f32(to_compute_cpu(in[0]), to_compute_cpu(in[1]), wide);
  copy_cpu(out[0], wide);
}

TS_REGISTER_KERNEL(cpu, matmul, matmul_kernel);

}  // namespace
}  // namespace tessera::cpu
