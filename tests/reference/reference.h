// An independent, deliberately naive f64 implementation of every op in tensor/op_list.h:
// the spec the op sweep (tests/tensor/op_sweep_test.cc) checks Tessera's kernels against.
// Plain loops over row-major NdArrays; nothing here calls Tessera's kernels or ops (only
// Shape and DType are shared), so a bug in a kernel cannot hide in its own reference.
//
//   ref::NdArray a = ref::NdArray::of({2, 3}, {1, 2, 3, 4, 5, 6});
//   ref::NdArray s = ref::sum(a, {1}, /*keepdim=*/true);            // [[6], [15]]
//   ref::NdArray y = ref::zip(a, ref::NdArray::of({3}, {1, 1, 1}),
//                             [](double x, double y) { return x + y; });
//
// Integer and bool tensors are held as exact doubles (all test values are small); ops that
// have integer-specific rules (pow, casts) take the dtype.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/shape.h"

namespace tessera::ref {

struct NdArray {
  Shape shape;
  std::vector<double> data;  // row-major
  bool defined = true;       // false: an absent optional input (layer_norm weight, conv bias)

  static NdArray zeros(const Shape& shape, double fill = 0.0);
  static NdArray of(const Shape& shape, std::vector<double> data);
  static NdArray absent();
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  double& at(const std::vector<int64_t>& idx);
  double at(const std::vector<int64_t>& idx) const;
};

// ---- index arithmetic (row-major) --------------------------------------------------------
int64_t count(const Shape& shape);
std::vector<int64_t> unravel(int64_t flat, const Shape& shape);
int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape);
int64_t wrap_dim(int64_t dim, int64_t ndim);  // negative dims count from the end
Shape broadcast_shape(const Shape& a, const Shape& b);
NdArray broadcast_to(const NdArray& a, const Shape& shape);

// ---- dtypes --------------------------------------------------------------------------------
// Rounds a binary floating value with `precision` significand bits (implicit bit included),
// minimum normal exponent `emin` and maximum exponent `emax`, to nearest, ties to even,
// keeping subnormals and overflowing to infinity. Written from the IEEE 754 definition.
double round_binary(double v, int precision, int emin, int emax);
// The value `v` becomes when stored as dt: RNE for the floats, truncation toward zero for
// the integers (in range), v != 0 for bool.
double round_to(double v, DType dt);
NdArray round_to(const NdArray& a, DType dt);
// Unit roundoff (half an ulp at 1): 2^-24, 2^-53, 2^-11, 2^-8; 0 for the exact dtypes.
double unit_roundoff(DType dt);

// ---- elementwise ---------------------------------------------------------------------------
NdArray map(const NdArray& a, const std::function<double(double)>& f);
// NumPy broadcasting.
NdArray zip(const NdArray& a, const NdArray& b, const std::function<double(double, double)>& f);
NdArray where(const NdArray& cond, const NdArray& a, const NdArray& b);
double sigmoid(double x);
// NaN propagates through relu, maximum and minimum (as in PyTorch).
double relu(double x);
double maximum(double a, double b);
double minimum(double a, double b);
double gelu(double x, bool approximate_tanh);
double gelu_backward(double grad, double x, bool approximate_tanh);
// a^b: real pow for floats; for integers exact repeated multiplication, with a negative
// exponent giving the truncated 1 / a^|b| (so 0 unless |a| == 1).
double pow(double a, double b, DType dt);

// ---- reductions (dims: any order, negative allowed; empty = every dim) ------------------
NdArray sum(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim);
NdArray mean(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim);
// NaN if any reduced value is NaN.
NdArray max(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim);
// Var with `correction` subtracted from the count (1 = Bessel); NaN when count <= correction.
NdArray var(const NdArray& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim);
// First index of the largest value along dim / of the flattened tensor; a NaN counts as
// the largest (the first NaN wins).
NdArray argmax(const NdArray& x, int64_t dim, bool keepdim);
NdArray argmax_all(const NdArray& x, bool keepdim);

// ---- linear algebra and fused layers (reference_nn.cc) ----------------------------------
// NumPy matmul: 1-D operands promoted (and the added dim removed), batch dims broadcast.
NdArray matmul(const NdArray& a, const NdArray& b);
NdArray softmax(const NdArray& x, int64_t dim);
NdArray log_softmax(const NdArray& x, int64_t dim);
// Normalises over the trailing `normalized_ndim` dims; weight/bias may be absent.
// Returns {y, mean, rstd} with mean/rstd shaped like the leading dims (biased variance).
std::vector<NdArray> layer_norm(const NdArray& x, const NdArray& weight, const NdArray& bias,
                                int64_t normalized_ndim, double eps);
// Given the forward's mean/rstd: {dx, dweight, dbias} (the last two absent when weight/bias
// were absent).
std::vector<NdArray> layer_norm_backward(const NdArray& grad, const NdArray& x, const NdArray& mean,
                                         const NdArray& rstd, const NdArray& weight,
                                         const NdArray& bias, int64_t normalized_ndim);

// Attention (the fused op): per (batch, head) row i, s_ij = scale q_i . k_j over the keys j
// it sees (j <= i when causal), out = softmax(s) v and lse_i = log sum_j exp(s_ij). With
// `mag`, the error magnitudes the op sweep bounds against instead of the values: every term
// P_ij |v_j| carries the relative error of P_ij, about u (1 + |s_ij| + |lse_i| + the dot
// product's sum of |terms|), and lse the same.
struct AttentionRef {
  int64_t bh, t, d;
  double scale;
  bool causal;
  // shape [B, H, T, D]; scale 0: 1 / sqrt(D).
  AttentionRef(const Shape& s, double sc, bool c);
  // q, k, v -> out, lse.
  std::vector<NdArray> forward(const std::vector<NdArray>& in, bool mag) const;
  // grad, q, k, v, out, lse -> dq, dk, dv.
  std::vector<NdArray> backward(const std::vector<NdArray>& in, bool mag) const;

 private:
  int64_t keys(int64_t i) const { return causal ? i + 1 : t; }
  double dot(const NdArray& a, int64_t p, int64_t i, const NdArray& b, int64_t j) const;
  double absdot(const NdArray& a, int64_t p, int64_t i, const NdArray& b, int64_t j) const;
};

enum class Reduction { mean, sum, none };
// logits [N, C], target [N]: {loss (scalar or [N]), logsumexp [N]}. Ignored rows add 0 and
// do not count towards the mean.
std::vector<NdArray> cross_entropy(const NdArray& logits, const NdArray& target,
                                   Reduction reduction, int64_t ignore_index);
NdArray cross_entropy_backward(const NdArray& grad, const NdArray& logits, const NdArray& target,
                               const NdArray& logsumexp, Reduction reduction, int64_t ignore_index);
// x [N, C, H, W], w [O, C, kh, kw], bias [O] or absent; zero padding.
NdArray conv2d(const NdArray& x, const NdArray& w, const NdArray& bias,
               std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
NdArray conv2d_backward_input(const NdArray& grad, const NdArray& w, const Shape& input_shape,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
NdArray conv2d_backward_weight(const NdArray& grad, const NdArray& x, const Shape& weight_shape,
                               std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
// {values, indices}: the first maximum of each window in row-major window order (a NaN
// counts as the maximum); the index is flat within the input plane (iy * W + ix); padding
// never wins.
std::vector<NdArray> max_pool2d(const NdArray& x, std::array<int64_t, 2> kernel,
                                std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
// dx [input_shape]: grad [N, C, OH, OW] added at each flat plane index of indices (same
// shape as grad); repeated indices add up.
NdArray max_pool2d_backward(const NdArray& grad, const NdArray& indices, const Shape& input_shape);

// ---- indexing, joining, views (reference_data.cc) ---------------------------------------
NdArray embedding(const NdArray& weight, const NdArray& indices);
NdArray index_select(const NdArray& x, int64_t dim, const NdArray& index);
NdArray index_add(const NdArray& x, int64_t dim, const NdArray& index, const NdArray& source);
NdArray gather(const NdArray& x, int64_t dim, const NdArray& index);
NdArray scatter_add(const NdArray& x, int64_t dim, const NdArray& index, const NdArray& src);
NdArray cat(const std::vector<NdArray>& xs, int64_t dim);
NdArray stack(const std::vector<NdArray>& xs, int64_t dim);
std::vector<NdArray> split(const NdArray& x, const std::vector<int64_t>& sizes, int64_t dim);
NdArray reshape(const NdArray& x, const Shape& shape);  // one -1 allowed
NdArray permute(const NdArray& x, const std::vector<int64_t>& order);
// Python slicing with a positive step: negative start/end count from the end, then clamp.
NdArray slice(const NdArray& x, int64_t dim, int64_t start, int64_t end, int64_t step);
NdArray expand(const NdArray& x, const Shape& shape);                 // -1 keeps a dim
NdArray squeeze(const NdArray& x, const std::vector<int64_t>& dims);  // {} = all size-1 dims
NdArray unsqueeze(const NdArray& x, int64_t dim);

// ---- optimizer updates (reference_optim.cc) ----------------------------------------------
// One torch.optim.AdamW step at 1-based step t: {param, exp_avg, exp_avg_sq}.
std::vector<NdArray> adamw(const NdArray& param, const NdArray& grad, const NdArray& exp_avg,
                           const NdArray& exp_avg_sq, int64_t t, double lr, double beta1,
                           double beta2, double eps, double weight_decay);
// The dynamic ("tree") quantization maps of Dettmers et al. (8-bit optimizers), decoded from
// their bit patterns: signed, the sign bit, then E zero bits (scale 10^-E, E <= 6), a 1,
// and 6 - E fraction bits j giving 10^-E (0.1 + 0.9 (j + 1/2) / 2^(6-E)), the pattern
// "minus zero" standing for 1; unsigned, the same with the sign bit as one more fraction bit
// (7 - E of them), the pattern 00000001 standing for 1. Each value rounded to f32; sorted.
std::vector<double> dynamic_map(bool is_signed);
// The index of the entry of `map` (ascending) nearest x, ties to the larger: the number of
// exact midpoints of neighbours that x reaches.
int nearest_code(const std::vector<double>& map, double x);
// One adamw8bit_ step (tensor/ops.h) emulated operation by operation in the state type
// (f32 for f32/f16/bf16 params, f64 for f64), each result rounded as the kernel's: inputs
// param, grad, exp_avg codes, exp_avg_sq codes, exp_avg_absmax, exp_avg_sq_absmax and master
// (absent: none); outputs the same but grad, master only when present. `dt` is param's dtype.
std::vector<NdArray> adamw8bit(const std::vector<NdArray>& in, int64_t t, double lr,
                               double beta1, double beta2, double eps, double weight_decay,
                               DType dt);
// One pass of adamw8bit_segments_ (tensor/ops.h), emulated as adamw8bit above, element by
// element with its segment's block's scales: inputs as the op's (master absent: none);
// outputs pass 1 {param[, master], new_absmax, new_sq_absmax}, pass 2 {exp_avg codes,
// exp_avg_sq codes, exp_avg_absmax, exp_avg_sq_absmax}.
std::vector<NdArray> adamw8bit_segments(const std::vector<NdArray>& in, int pass, int64_t t,
                                        double lr, double beta1, double beta2, double eps,
                                        double weight_decay, DType dt);
// One torch.optim.SGD step at 1-based step t: {param, momentum_buffer (absent when
// momentum == 0)}; at t == 1 the buffer starts as the decayed gradient (its input is
// ignored, and may be absent).
std::vector<NdArray> sgd(const NdArray& param, const NdArray& grad, const NdArray& momentum_buffer,
                         int64_t t, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov);

// ---- factories and random numbers ---------------------------------------------------------
NdArray full(const Shape& shape, double value, DType dt);
// start + i * step for i < ceil((end - start) / step), each rounded to dt.
NdArray arange(double start, double end, double step, DType dt);

// Philox-4x32-10 (Salmon et al. 2011), written from the paper; checked against Random123's
// known-answer vectors by the sweep.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
// Tessera's streams: element with counter c (= offset + global index) of a draw keyed by
// seed uses philox4x32_10({lo(c), hi(c), 0, 0}, {lo(seed), hi(seed)}) = words w0..w3.
//   uniform f32/f16/bf16: (w0 >> 8) * 2^-24, rounded to dt, and a 1 after rounding replaced
//     by the largest dt value below 1;  uniform f64: ((w0:w1) >> 11) * 2^-53;
//   normal: sqrt(-2 ln u1) cos(2 pi u2), u1 = (((w0:w1) >> 11) + 1) * 2^-53 in (0, 1],
//     u2 = ((w2:w3) >> 11) * 2^-53, rounded to dt.
double uniform01(uint64_t seed, uint64_t counter, DType dt);
double standard_normal(uint64_t seed, uint64_t counter, DType dt);
// A `shape` block at `starts` of a logical tensor `global_shape` (empty: the whole tensor).
NdArray rand(const Shape& shape, uint64_t seed, uint64_t offset, DType dt,
             const Shape& global_shape = {}, const std::vector<int64_t>& starts = {});
NdArray randn(const Shape& shape, uint64_t seed, uint64_t offset, DType dt,
              const Shape& global_shape = {}, const std::vector<int64_t>& starts = {});
// Keeps x[i] * 1 / (1 - p) where the f32 uniform of element i's counter (as for rand) is
// >= p, else 0.
NdArray dropout(const NdArray& x, double p, uint64_t seed, uint64_t offset,
                const Shape& global_shape = {}, const std::vector<int64_t>& starts = {});

}  // namespace tessera::ref
