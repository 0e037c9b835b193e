// CPU linear: y = act(x W^T + b) with the bias added by the f32 GEMM's epilogue
// (kernels/cpu/gemm.h) to each strip of kMR rows (12 on AVX-512, 6 on AVX2) of a column
// block right after the GEMM writes it, so the [rows, N] product is not read back from memory
// for it. With an activation the GEMM writes the pre-activation output (the backward reads
// it), and one parallel pass over whole rows then writes y. The activation ran in the
// epilogue too until 2026-11-27, but there GPT-mini's 2048 x 128 x 512 GELU product spent
// ~12% of the step against ~9.7% for the product then the pass (TESSERA_PROFILE_SHAPES,
// BENCHMARKS.md). The likely cause, not measured apart: the epilogue's short per-row calls
// between micro-tiles cost the GEMM more than one more read of the product costs the pass.
// Each element is rounded as matmul, then add, then the activation's op round it (the
// activation runs through that op's own vectorised path: kernels/cpu/activation.h), so the
// fused op gives the unfused ops' bits. f16/bf16 are widened and x W^T + b computed in f32
// and rounded once; the activation runs on that rounded pre-activation (rounding again), as
// the unfused ops would. f64 goes through Eigen's GEMM, then the same epilogue as a separate
// pass.
//
// linear_act_backward: grad_pre = grad * act'(pre) per row, and the bias gradient (its
// column sums) accumulated in f64 over row chunks whose size depends on the row count
// alone, then summed in chunk order: the bits do not depend on the thread count.
#include <Eigen/Core>

#include <algorithm>
#include <vector>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// The epilogue's work on rows [i0, i0 + rows), columns [j0, j0 + cols) of the product c:
// c += bias, then y = act(c) when y is set (c is then the pre-activation output).
template <typename T>
struct Epilogue {
  T* c;
  T* y;
  const T* bias;
  int64_t ld;
  Activation act;

  void run(int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    for (int64_t i = i0; i < i0 + rows; ++i) {
      T* ci = c + i * ld + j0;
      if (bias != nullptr) {
        const T* b = bias + j0;
        for (int64_t j = 0; j < cols; ++j) ci[j] = ci[j] + b[j];
      }
      if (y != nullptr) activation_run(act, ci, y + i * ld + j0, cols);
    }
  }
  static void call(const void* self, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
    static_cast<const Epilogue*>(self)->run(i0, rows, j0, cols);
  }
};

// y (and pre, with an activation) [rows, N] contiguous, of x's float type T (f32 or f64).
template <typename T>
void linear_typed(Tensor x, Tensor w, Tensor b, const Tensor& y, const Tensor& pre, Activation act) {
  const int64_t K = x.shape().back(), N = w.shape()[0];
  const int64_t rows = y.numel() / N;
  if (b.defined()) b = contiguous_cpu(b);  // itself when it already is
  const bool fused_act = act != Activation::none;
  T* c = static_cast<T*>((fused_act ? pre : y).raw_data());
  const Epilogue<T> epi{c, fused_act ? static_cast<T*>(y.raw_data()) : nullptr,
                        b.defined() ? static_cast<const T*>(b.raw_data()) : nullptr, N, act};
  if constexpr (std::is_same_v<T, float>) {
    int64_t rs = 0;
    if (!row_stride_of(x, rs)) {
      x = contiguous_cpu(x);
      row_stride_of(x, rs);
    }
    const Epilogue<T> bias_only{c, nullptr, epi.bias, N, act};
    const GemmEpilogue ge{&Epilogue<T>::call, &bias_only};
    // B = W^T [K, N]: element (k, n) is w[n, k].
    sgemm(rows, N, K, StridedMatrix{static_cast<const float*>(x.raw_data()), rs, x.strides().back()},
          StridedMatrix{static_cast<const float*>(w.raw_data()), w.strides()[1], w.strides()[0]}, c, N,
          /*accumulate=*/false, epi.bias != nullptr ? &ge : nullptr);
    if (fused_act) {
      T* yp = epi.y;
      parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)),
                   [&](int64_t r0, int64_t r1) { activation_run(act, c + r0 * N, yp + r0 * N, (r1 - r0) * N); });
    }
  } else {
    using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    x = contiguous_cpu(x);
    w = contiguous_cpu(w);
    Eigen::Map<RowMat> cm(c, rows, N);
    if (K == 0) {
      cm.setZero();
    } else {
      cm.noalias() = Eigen::Map<const RowMat>(static_cast<const T*>(x.raw_data()), rows, K) *
                     Eigen::Map<const RowMat>(static_cast<const T*>(w.raw_data()), N, K).transpose();
    }
    if (epi.y != nullptr || epi.bias != nullptr) {
      parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(N, 1)),
                   [&](int64_t r0, int64_t r1) { epi.run(r0, r1 - r0, 0, N); });
    }
  }
}

// Inputs: x [..., K], weight [N, K], bias [N] or absent. Outputs: y, pre (with an activation).
void linear_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Activation act = attrs.activation;
  if (out[0].numel() == 0) return;
  const DType dt = in[0].dtype();
  const Tensor none;
  const Tensor& pre = act == Activation::none ? none : out[1];
  if (dt == DType::f32) return linear_typed<float>(in[0], in[1], in[2], out[0], pre, act);
  if (dt == DType::f64) return linear_typed<double>(in[0], in[1], in[2], out[0], pre, act);
  // f16/bf16: widened, x W^T + b computed in f32 and rounded once; the activation then runs
  // on the rounded pre-activation (the value its backward reads), widened, on the f32 path,
  // and rounds again, as the activation's own op runs 16-bit tensors (elementwise.cc): the
  // bits of linear without an activation followed by that op.
  const Tensor wide = Tensor::empty(out[0].shape(), DType::f32, kCPU);
  linear_typed<float>(to_compute_cpu(in[0]), to_compute_cpu(in[1]),
                      in[2].defined() ? to_compute_cpu(in[2]) : Tensor(), wide, Tensor(), Activation::none);
  if (!pre.defined()) return copy_cpu(out[0], wide);
  copy_cpu(out[1], wide);
  copy_cpu(wide, out[1]);  // the rounded values, widened back
  float* w = static_cast<float*>(wide.raw_data());
  const int64_t n = wide.numel(), grain = 1 << 14;
  parallel_for(0, (n + grain - 1) / grain, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      activation_run(act, w + b * grain, w + b * grain, std::min(grain, n - b * grain));
    }
  });
  copy_cpu(out[0], wide);
}

// Rows per chunk of the bias gradient's partial sums: a function of the row count alone (at
// most 256 chunks), so the summation order is too.
int64_t chunk_rows(int64_t rows) { return std::max<int64_t>(32, (rows + 255) / 256); }

template <typename T>
void linear_act_backward_typed(const Tensor& g_in, const Tensor& pre_in, const Tensor& dpre,
                               const Tensor& db, Activation act) {
  const Tensor g = contiguous_cpu(g_in), pre = contiguous_cpu(pre_in);
  const int64_t N = g.shape().back();
  const int64_t rows = N == 0 ? 0 : g.numel() / N;
  const T* gp = static_cast<const T*>(g.raw_data());
  const T* xp = static_cast<const T*>(pre.raw_data());
  T* op = static_cast<T*>(dpre.raw_data());
  T* bp = static_cast<T*>(db.raw_data());
  if (N == 0) return;
  const int64_t chunk = chunk_rows(rows), chunks = (rows + chunk - 1) / chunk;
  std::vector<double> partial(static_cast<size_t>(chunks * N), 0.0);
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double* acc = partial.data() + c * N;
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
        T* o = op + r * N;
        activation_backward_run(act, gp + r * N, xp + r * N, o, N);
        for (int64_t j = 0; j < N; ++j) acc[j] += static_cast<double>(o[j]);
      }
    }
  });
  for (int64_t j = 0; j < N; ++j) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * N + j];
    bp[j] = static_cast<T>(s);
  }
}

// Inputs: grad, pre [..., N]. Outputs: grad_pre [..., N], grad_bias [N].
void linear_act_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const DType dt = in[0].dtype();
  if (dt == DType::f32) return linear_act_backward_typed<float>(in[0], in[1], out[0], out[1], attrs.activation);
  if (dt == DType::f64) return linear_act_backward_typed<double>(in[0], in[1], out[0], out[1], attrs.activation);
  const Tensor d = Tensor::empty(out[0].shape(), DType::f32, kCPU);
  const Tensor b = Tensor::empty(out[1].shape(), DType::f32, kCPU);
  linear_act_backward_typed<float>(to_compute_cpu(in[0]), to_compute_cpu(in[1]), d, b, attrs.activation);
  copy_cpu(out[0], d);
  copy_cpu(out[1], b);
}

TS_REGISTER_KERNEL(cpu, linear, linear_kernel);
TS_REGISTER_KERNEL(cpu, linear_act_backward, linear_act_backward_kernel);

}  // namespace

bool row_stride_of(const Tensor& x, int64_t& stride) {
  int64_t inner = 1;
  bool known = false;
  stride = std::max<int64_t>(x.shape().back(), 1);
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.shape()[d] == 1) continue;
    if (!known) {
      stride = x.strides()[d];
      known = true;
    } else if (x.strides()[d] != stride * inner) {
      return false;
    }
    inner *= x.shape()[d];
  }
  return true;
}

}  // namespace tessera::cpu
