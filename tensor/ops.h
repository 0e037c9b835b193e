// The op API. Every function here goes through call()/call_view() (tensor/op.h), so it
// validates its inputs (tessera::Error naming the op and the shapes), runs the device's
// kernel, and records the autograd graph when an input requires grad.
//
//   Tensor x = randn({8, 16}), w = randn({16, 4}).requires_grad_();
//   Tensor loss = cross_entropy(matmul(x, w), arange(0, 8, 1, DType::i64) % 4);
//   loss.backward();
//
// Binary ops broadcast like NumPy and require equal dtypes (cast explicitly); a double
// operand takes the tensor's dtype (an integer tensor rejects a fractional scalar).
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/op_attrs.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace tessera {

// ---- elementwise --------------------------------------------------------------------------
// The functor family ops of tensor/op_list.h, one function each, named as the op: every
// TS_UNARY_OPS member as f(x) (neg, exp, ..., silu), every TS_BINARY_OPS member as f(a, b)
// (add, ..., minimum), every TS_COMPARE_OPS member as f(a, b) returning bool (eq, ..., ge).
TS_DEFINE_FAMILY_WRAPPERS(Tensor)

// GELU, exact (erf) or with the tanh approximation.
Tensor gelu(const Tensor& x, bool approximate_tanh = false);
// d gelu(x) / dx * grad, fused (the derivative of gelu uses it).
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool approximate_tanh = false);

Tensor pow(const Tensor& a, double exponent);
// cond ? a : b elementwise; cond is bool; all three broadcast.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// A 0-d tensor holding `value` in `like`'s dtype, for scalar operands (Error if `like` is
// integral or bool and value does not convert exactly).
Tensor scalar_like(double value, const Tensor& like, const char* op);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

// ---- reductions (dims empty = all dims) ---------------------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Largest value; its gradient is shared evenly between tied maxima.
Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Index of the (first) largest value along dim, as i64.
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
// Index into the flattened tensor.
Tensor argmax(const Tensor& x);
// Variance with Bessel's correction by default (correction = 1).
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, int64_t correction = 1,
           bool keepdim = false);
// The sum of the squares of every element of every tensor, in f64 (a 0-d f64 tensor on the
// tensors' device), in one op: each tensor summed as sum(cast(x, f64) * cast(x, f64)) sums
// it (bitwise on the CPU), the tensors' sums added in order; deterministic for any thread
// count. For gradient norms (optim::grad_norm). Not differentiable; at least one tensor.
Tensor sum_squares(const std::vector<Tensor>& xs);
// Sums `x` down to `shape` (the inverse of broadcasting `shape` to x's shape).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- linear algebra and fused layers -----------------------------------------------------
// NumPy matmul: 1-D operands are promoted, batch dims broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
// Grouped (segmented) matmul for Mixture of Experts: x [N, K] holds E groups of consecutive
// rows, sizes[e] of them (an integer tensor [E] summing to N); group e is multiplied by
// w[e] (w [E, K, M], any strides): [N, M]. One op instead of E small matmuls.
inline Tensor grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& sizes) {
  return call(OpId::grouped_matmul, {x, w, sizes}, Attrs{})[0];
}
// A fully connected layer in one op: act(x @ weight^T + bias) for x [..., K], weight
// [N, K] (nn::Linear's layout) and an optional bias [N]. The bias and the activation are
// applied to each output block while the f32 GEMM has it in cache (CPU; f64: a pass after
// Eigen's GEMM) or in one pass after cuBLASLt's (CUDA). 16-bit inputs: x W^T + b computed
// in f32 and rounded once, the activation applied to that rounded value and rounded again
// (the unfused ops' result). With an activation, output 1 is the pre-activation (the
// backward reads it). The backward fuses the activation's derivative with the bias's
// gradient (linear_act_backward).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              Activation activation = Activation::none);
Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);
// Normalises over the trailing dims given by normalized_shape; weight/bias optional.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);
// A residual add and the layer_norm of its result in one pass: {s, y} with s = x + r (x and r
// of one shape and dtype) and y = layer_norm(s, ...). The same values as x + r, then
// layer_norm (s is rounded to the dtype before it is normalised), bit for bit; under
// autocast too (where the sum would not be f32 there, the two ops run: see
// add_layer_norm_fuses). In backward, an output nothing used counts as a zero gradient:
// with only s used, weight and bias get zero gradients (not none), and with only y used the
// sum's gradient is grad_x + 0 (a -0 becomes +0).
struct AddLayerNorm {
  Tensor sum, normed;
};
// Whether add_layer_norm runs as one op on inputs of these dtypes (always, unless autocast
// would give the composite's sum another dtype than the op's).
bool add_layer_norm_fuses(DType x, DType r);
AddLayerNorm add_layer_norm(const Tensor& x, const Tensor& r, const Shape& normalized_shape,
                            const Tensor& weight = Tensor(), const Tensor& bias = Tensor(),
                            double eps = 1e-5);
// logits [N, C], target [N] (i64); mean over targets that are not ignore_index.
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     Reduction reduction = Reduction::mean, int64_t ignore_index = -100);
// Zeroes each element with probability p and scales the rest by 1/(1-p); identity when
// !training or p == 0. The mask comes from this thread's generator (see random.h).
Tensor dropout(const Tensor& x, double p, bool training = true,
               Generator* generator = nullptr);
// Fused scaled dot-product attention: q, k, v [B, H, T, D] (one float dtype) give
// softmax(q k^T * scale [+ causal mask]) v, [B, H, T, D]; scale 0 means 1/sqrt(D). The
// probabilities are never stored: backward recomputes them from the saved row logsumexp
// (flash-attention style on CUDA).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                 double scale = 0.0);
// The same attention over the packed projection GPT computes: qkv [3, B, T, C] holds q, k
// and v, each [B, T, C] with H = C / head_dim heads side by side; the result is [B, T, C],
// the heads merged back (head h in columns [h * head_dim, (h + 1) * head_dim)). No split of
// qkv, no transposes in or out, and the backward writes one [3, B, T, C] gradient.
Tensor attention_qkv(const Tensor& qkv, int64_t head_dim, bool causal = true, double scale = 0.0);
// x [N, C, H, W], weight [O, C, kh, kw], bias [O] optional.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0});
// x [N, C, H, W]; stride defaults to the kernel size; padding counts as -inf.
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel_size,
                  std::array<int64_t, 2> stride = {0, 0}, std::array<int64_t, 2> padding = {0, 0});

// ---- indexing ----------------------------------------------------------------------------
// Rows of weight [V, D] picked by integer indices of any shape: out [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Entries of x along dim picked by a 1-D integer index.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// x with source's slices added at index along dim (functional; x is not modified).
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source);
// out[i][j] = x[index[i][j]][j] for dim 0 (torch.gather semantics), index shape = out shape.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// x with src[i][j] added at x[index[i][j]][j] for dim 0 (functional).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// The k largest values of x along dim, descending (NaN above everything; equal values in
// index order), and their i64 indices: {values, indices}, x's shape with k along dim.
inline std::vector<Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1) {
  return call(OpId::topk, {x}, op_attrs::topk(k, dim));
}
// A stable counting sort of integer keys [n] in [0, buckets): {order, counts}, order i64 [n]
// the positions of the keys in sorted order (equal keys in position order), counts i64
// [buckets]. Not differentiable (Mixture of Experts groups its tokens by expert with it).
inline std::vector<Tensor> counting_sort(const Tensor& keys, int64_t buckets) {
  Attrs a;
  a.k = buckets;
  return call(OpId::counting_sort, {keys}, a);
}

// ---- joining and splitting ---------------------------------------------------------------
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Views of consecutive chunks of split_size along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);

// ---- copies and conversions --------------------------------------------------------------
Tensor cast(const Tensor& x, DType dtype);
// Signs packed 8 to a byte (1-bit compression, parallel/onebit.h): bit j (least significant
// first) of byte k is 1 when element 8k + j of x (flattened, row-major) is >= 0 or NaN, 0
// when it is negative; the last byte's bits past numel are 0. u8 [ceil(numel / 8)].
Tensor sign_pack(const Tensor& x);
// And back: the first `numel` signs of `bits` (u8 [ceil(numel / 8)]) as +1 / -1 in `dtype`,
// [numel].
Tensor sign_unpack(const Tensor& bits, int64_t numel, DType dtype = DType::f32);
Tensor to(const Tensor& x, Device device);
Tensor clone(const Tensor& x);
void copy_(const Tensor& dst, const Tensor& src);

// ---- optimizer updates (fused, in place; call under NoGradGuard as optim/ does) ------------
// One AdamW step, as torch.optim.AdamW (t = step, 1-based):
//   param *= 1 - lr * weight_decay
//   exp_avg += (1 - beta1) * (grad - exp_avg)
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2
//   param -= lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
// grad has param's dtype and shape; the moments are f32 (f64 for an f64 param). With an f32
// `master` (f32/f16/bf16 params) the update runs on the master and param is written as the
// master rounded to param's dtype (param's own values are not read).
// grad_scale != 1: grad is read as grad * grad_scale, rounded as scale_ rounds it (clipping's
// coefficient applied in this pass, optim::clip_grad_norm(Optimizer&, ...); grad itself is
// not written). The same holds for adamw8bit_[segments_] and sgd_.
void adamw_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
            const Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
            double eps, double weight_decay, const Tensor& master = Tensor(),
            double grad_scale = 1.0);
// Each x = x * scale in place, in one op over all of them: computed in f32 for f32, f16 and
// bf16 (scale rounded to f32, the product rounded once to x's dtype) and in f64 for f64,
// i.e. what copy_(x, x * scale) gives (16-bit: copy_(x, cast(x, f32) * scale)). For
// clipping gradients (optim::clip_grads_to_norm). Each x must not overlap itself or another
// (no expanded layouts).
void scale_(const std::vector<Tensor>& xs, double scale);
// adamw_ with both moments held in 8 bits, block-wise (tensor/quant8.h): exp_avg and
// exp_avg_sq are u8 codes shaped like param, on the signed and the unsigned dynamic map, and
// exp_avg_absmax / exp_avg_sq_absmax their blocks' scales, [ceil(numel / 256)] in the state
// dtype (f32; f64 for an f64 param). Per block of 256 elements (the last may be shorter):
//   m = map_signed[exp_avg] * exp_avg_absmax;  v = map_unsigned[exp_avg_sq] * exp_avg_sq_absmax
//   m, v and param updated exactly as adamw_ does (same order of operations, state dtype)
//   exp_avg_absmax = max |m|, exp_avg_sq_absmax = max v over the block (0 for an all-zero one)
//   exp_avg = code of m / exp_avg_absmax, exp_avg_sq = code of v / exp_avg_sq_absmax
//     (the nearest map entry, ties to the larger; x / 0 counts as 0; a NaN moment is left
//     out of its block's max and takes code 0)
// param, the codes, the scales and master must be contiguous (grad may have any layout).
// `master` as for adamw_.
void adamw8bit_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                const Tensor& exp_avg_sq, const Tensor& exp_avg_absmax,
                const Tensor& exp_avg_sq_absmax, int64_t step, double lr, double beta1,
                double beta2, double eps, double weight_decay, const Tensor& master = Tensor(),
                double grad_scale = 1.0);
// adamw8bit_ on a tensor whose quantization blocks are partly held elsewhere (a tensor-parallel
// shard whose runs cut blocks), in two passes between which the caller takes the maxima over
// every holder. The scales exp_avg_absmax / exp_avg_sq_absmax are the whole tensor's (the same
// [B] on every holder); `segments` (i64 [S, 2]) cuts param's flattened elements
// into runs: segment s ends at element segments[s][0] (it starts where s - 1 ends; 1 to 256
// elements) and lies in block segments[s][1] (blocks increasing). Each element's arithmetic
// is adamw8bit_'s with its block's scales.
//   pass 1 (update): param (and master) updated; new_absmax[b] / new_sq_absmax[b] = max |m| /
//     max v over this tensor's elements of block b (0 for a block it does not touch).
//   (the caller: new_absmax and new_sq_absmax max-reduced over the holders)
//   pass 2 (requantize): m and v recomputed from the unchanged codes and scales (the same
//     values), coded on new_absmax / new_sq_absmax; then the scales = the new ones.
void adamw8bit_segments_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                         const Tensor& exp_avg_sq, const Tensor& exp_avg_absmax,
                         const Tensor& exp_avg_sq_absmax, const Tensor& master,
                         const Tensor& segments, const Tensor& new_absmax,
                         const Tensor& new_sq_absmax, int pass, int64_t step, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         double grad_scale = 1.0);
// One SGD step, as torch.optim.SGD:
//   d = grad + weight_decay * param
//   with momentum: buf = (step == 1 ? d : momentum * buf + (1 - dampening) * d)
//                  d = nesterov ? d + momentum * buf : buf
//   param -= lr * d
// momentum_buffer is undefined iff momentum == 0 (its old values are not read at step 1);
// dtypes and `master` as for adamw_.
void sgd_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, int64_t step,
          double lr, double momentum, double dampening, double weight_decay, bool nesterov,
          const Tensor& master = Tensor(), double grad_scale = 1.0);

// Adafactor's three passes over factored matrices (optim/adafactor.h), fused: grad and param
// [B, M, N] (B matrices of M rows and N columns; f32 or f64, contiguous), the row factors a
// [B, M] and the column factors b [B, N] in their dtype, on their device.
//   adafactor_stats_: out [B, M + N] (their dtype) = the sums of grad^2 + eps along each row
//     (the first M) and down each column (the last N), accumulated in f64, rounded once.
//   The update of element (i, j) of matrix k: u = product ? (g * a_i) * b_j
//                                               : g * rsqrt(max((a_i * b_j) / divisor, floor))
//   adafactor_norm_: out [1] f64 = the sum of u^2, accumulated in f64.
//   adafactor_apply_: u *= scale; with exp_avg (beta1 > 0, param's shape):
//     exp_avg = exp_avg * beta1 + u * (1 - beta1), u = exp_avg; then, c the decay coefficient:
//       form 0 (hf):    param = (c > 0 ? param - param * c : param) - u
//       form 1 (torch): param = (c > 0 ? param * (1 - c) : param) - u
//       form 2 (optax): param = c > 0 ? param - (u + param * c) : param - u
// Each operation rounds once in the dtype (the scalars rounded to it first), as the same
// steps written with ops would.
void adafactor_stats_(const Tensor& grad, const Tensor& out, double eps);
void adafactor_norm_(const Tensor& grad, const Tensor& a, const Tensor& b, const Tensor& out,
                     bool product, double divisor, double floor);
void adafactor_apply_(const Tensor& param, const Tensor& grad, const Tensor& a, const Tensor& b,
                      const Tensor& exp_avg, bool product, double divisor, double floor,
                      double scale, double beta1, double c, int64_t form);

// ---- views -------------------------------------------------------------------------------
Tensor view(const Tensor& x, const Shape& shape);      // one dim may be -1
Tensor reshape(const Tensor& x, const Shape& shape);   // view when possible, else a copy
Tensor permute(const Tensor& x, const std::vector<int64_t>& order);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor expand(const Tensor& x, const Shape& shape);    // -1 keeps a dim
Tensor squeeze(const Tensor& x, const std::vector<int64_t>& dims = {});  // {} = all size-1 dims
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& x);

// ---- factories ---------------------------------------------------------------------------
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = kCPU);
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor zeros_like(const Tensor& x);
Tensor ones_like(const Tensor& x);
// Values start, start + step, ... below end (above, for a negative step).
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::f32,
              Device device = kCPU);
// Uniform [0, 1) / standard normal, drawn at the generator's (seed, offset).
Tensor rand(const Shape& shape, DType dtype = DType::f32, Device device = kCPU,
            Generator* generator = nullptr);
Tensor randn(const Shape& shape, DType dtype = DType::f32, Device device = kCPU,
             Generator* generator = nullptr);
// The block of a logical tensor `view.global_shape` drawn at (seed, offset) that starts at
// `view.starts` and has `shape`: equal to slicing the full draw (sharded init).
Tensor rand_block(const Shape& shape, const RngView& view, uint64_t seed, uint64_t offset,
                  DType dtype = DType::f32, Device device = kCPU);
Tensor randn_block(const Shape& shape, const RngView& view, uint64_t seed, uint64_t offset,
                   DType dtype = DType::f32, Device device = kCPU);

// ---- backward helpers (fused; used by derivatives, not differentiable) ---------------------
// Returns {grad_x, grad_weight, grad_bias}; the latter two undefined when weight/bias were.
// residual_grad (grad's shape and dtype): added to grad_x, rounded as grad_x + residual_grad
// would be (add_layer_norm's backward: the sum's own gradient joins layer_norm's).
std::vector<Tensor> layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& mean,
                                        const Tensor& rstd, const Tensor& weight,
                                        const Tensor& bias, int64_t normalized_ndim,
                                        const Tensor& residual_grad = Tensor());
// Returns {grad * act'(pre), its sum over the leading dims [N]} for linear's pre-activation.
std::vector<Tensor> linear_act_backward(const Tensor& grad, const Tensor& pre, Activation activation);
Tensor cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                              const Tensor& logsumexp, Reduction reduction, int64_t ignore_index);
// Returns {grad_q, grad_k, grad_v} of attention, given its output `out` and the row
// logsumexp `lse` [B, H, T] (f32; f64 for f64 inputs) that attention's op saved.
std::vector<Tensor> attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out, const Tensor& lse,
                                       bool causal, double scale);
// The gradient of qkv [3, B, T, C] for attention_qkv, given grad and out [B, T, C] and the
// row logsumexp lse [B, H, T] its op saved.
Tensor attention_qkv_backward(const Tensor& grad, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int64_t head_dim, bool causal, double scale);
Tensor conv2d_backward_input(const Tensor& grad, const Tensor& weight, const Shape& input_shape,
                             std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
Tensor conv2d_backward_weight(const Tensor& grad, const Tensor& x, const Shape& weight_shape,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);
// [E, K, M]: group e's rows of x [N, K] transposed times its rows of grad [N, M].
Tensor grouped_matmul_backward_weight(const Tensor& x, const Tensor& grad, const Tensor& sizes);

}  // namespace tessera
