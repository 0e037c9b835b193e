// GPT's forward, written once over the layout (parallel/tensor_parallel.h): the Gpt module
// runs it on Tensors with parallel::SingleDevice and its own parameters, TpGpt on
// ShardedTensors with a TpLayout and the parameters sharded by a plan. `param(path)` returns
// a parameter by its dotted path in the single-device model (block pieces: relative to the
// block). The plan only decides where tensors live; the code here is right for any plan.
//
//   const parallel::SingleDevice one;
//   Tensor x = gpt::embed(one, parallel::ModuleParameters(model), config, idx, {p, training});
//   x = gpt::block(one, gpt::Prefixed{params, "h.0."}, config, 0, x, {p, training});
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "models/gpt/model.h"
#include "parallel/dispatch.h"
#include "parallel/ops.h"
#include "parallel/tensor_parallel.h"
#include "tensor/random.h"

namespace tessera::gpt {

struct DropoutState {
  double p = 0.0;
  bool training = false;
  bool active() const { return training && p > 0.0; }
};

// Where each layer's dropout draws start. The model is a stack of layers [embed, h.0, ...,
// h.{L-1}, head] (the pipeline's numbering: layer 0 embeds, layer l runs block l - 1); a step's
// draws start at the generator's offset when the step begins (`base`), and layer l's at base +
// dropout_draws_before(l). Every dropout draws the whole batch's mask (a batch slice,
// tensor/random.h, draws its rows of it; a sharded tensor, its block), so a mask element is a
// function of (seed, step, layer, global sample index, position) alone: one device, a data-
// parallel rank, a pipeline stage running layer l alone and a tensor-parallel rank draw the
// same value for it. `rows` is the global batch, T the sequence length. Embeddings draw
// rows x T x C; a block its attention probabilities (rows x H x T x T) and two residual
// branches (rows x T x C each); the head nothing.
inline uint64_t dropout_draws_before(const GptConfig& c, int64_t rows, int64_t T, int64_t layer) {
  if (c.dropout == 0.0 || layer <= 0) return 0;
  const uint64_t n = static_cast<uint64_t>(rows) * static_cast<uint64_t>(T);
  const uint64_t embed = n * static_cast<uint64_t>(c.width);
  const uint64_t block = n * static_cast<uint64_t>(c.heads * T + 2 * c.width);
  const uint64_t blocks = static_cast<uint64_t>(std::min(layer - 1, c.layers));
  return embed + blocks * block;
}
// A forward's dropout keys: at(l) moves the calling thread's generator to layer l's first
// draw, end() past the last layer's (where one device's forward leaves it). Nothing moves
// without dropout in training. `local_rows`: the batch this forward runs (inside a batch
// slice, the slice's global batch counts).
class DropoutKeys {
 public:
  DropoutKeys(const GptConfig& c, bool training, int64_t local_rows, int64_t T,
              uint64_t base = default_generator().offset())
      : c_(c), on_(training && c.dropout > 0), T_(T), base_(base) {
    const BatchSlice* slice = current_batch_slice();
    rows_ = slice != nullptr ? slice->global_rows : local_rows;
  }
  void at(int64_t layer) const {
    if (!on_) return;
    Generator& gen = default_generator();
    gen.set_state(gen.seed(), base_ + dropout_draws_before(c_, rows_, T_, layer));
  }
  void end() const { at(c_.layers + 2); }

 private:
  const GptConfig& c_;
  bool on_;
  int64_t rows_ = 0, T_;
  uint64_t base_;
};

// A parameter accessor seen under a path prefix ("h.3." + "ln_1.weight").
template <class P>
struct Prefixed {
  const P& params;
  std::string prefix;
  decltype(auto) operator()(const std::string& path) const { return params(prefix + path); }
};

// What differs between the two tensor types, under one name for both.
namespace both {
// A plain tensor reshaped if strided; sharded tensors come from ops as laid-out blocks.
inline Tensor copy_if_strided(const Tensor& x) { return x.contiguous(); }
inline parallel::ShardedTensor copy_if_strided(const parallel::ShardedTensor& x) { return x; }
inline Device device_of(const Tensor& x) { return x.device(); }
inline Device device_of(const parallel::ShardedTensor& x) { return x.local().device(); }
}  // namespace both

// A row-wise Linear (attn.c_proj, mlp.c_proj): its input features split over tp, so the
// product is Partial there and the stream's reduction comes before the bias, which joins
// once; the sum is rounded to the product's dtype, as one device's linear rounds product
// and bias together (under autocast: low precision out). On one device the product and the
// bias are one op (tessera::linear).
// product + b, rounded back to the product's dtype when the bias is wider (f32 under autocast).
template <class T>
T plus_bias(const T& product, const T& b) {
  const T y = product + b;
  return y.dtype() == product.dtype() ? y : cast(y, product.dtype());
}
template <class L>
typename L::Tensor row_linear(const L& layout, const typename L::Tensor& x, const typename L::Tensor& w,
                              const typename L::Tensor& b) {
  if constexpr (std::is_same_v<typename L::Tensor, Tensor>) {
    return layout.stream(linear(x, w, b));
  } else {
    return plus_bias(layout.stream(linear(x, w)), b);
  }
}

// Token + position embeddings and dropout: idx [B, T] i64 -> the residual stream [B, T, C].
template <class L, class P>
typename L::Tensor embed(const L& layout, const P& param, const GptConfig& c, const Tensor& idx,
                         DropoutState drop) {
  TS_CHECK(idx.defined() && idx.dim() == 2 && idx.dtype() == DType::i64,
           "Gpt: expected idx [B, T] of dtype i64, got {}",
           idx.defined() ? fmt::format("{} {}", shape_str(idx.shape()), idx.dtype())
                         : std::string("undefined"));
  const int64_t T = idx.size(1);
  TS_CHECK(T >= 1 && T <= c.context, "Gpt: sequence length {} must be in [1, context = {}] (idx {})",
           T, c.context, shape_str(idx.shape()));
  const Tensor pos = arange(0, static_cast<double>(T), 1, DType::i64, idx.device());
  const typename L::Tensor x =
      layout.stream(embedding(param("wte.weight"), layout.input(idx)) +  // [B, T, C] + [T, C]
                    embedding(param("wpe.weight"), layout.replicate(pos)));
  return layout.region([&] { return dropout(x, drop.p, drop.training); });
}

// Causal self-attention of x [B, T, C] (the LayerNorm's output), before the residual add.
template <class L, class P>
typename L::Tensor attention(const L& layout, const P& param, const GptConfig& c,
                             const typename L::Tensor& x, DropoutState drop) {
  using T = typename L::Tensor;
  const int64_t B = x.size(0), S = x.size(1), C = c.width, H = c.heads, hd = C / H;
  // One product for q, k and v: the weight viewed [3, C, C] (a plan splits its middle dim:
  // each rank whole heads of q, k and v), the tokens as rows: [B*S, C] @ [3, C, C]^T ->
  // [3, B*S, C] (three GEMMs, and a weight gradient without per-batch partial products).
  const T product = matmul(view(layout.column_input(x), {B * S, C}),
                           transpose(view(param("attn.c_attn.weight"), {3, C, C}), 1, 2));
  // The bias in the product's dtype (16-bit under autocast, as linear casts its bias): the sum
  // is one 16-bit add, not an f32 [3, B*S, C] copy of the product, its sum and a cast back
  // (and their gradients).
  const T bias = view(param("attn.c_attn.bias"), {3, 1, C});
  const T qkv = product + (bias.dtype() == product.dtype() ? bias : cast(bias, product.dtype()));
  T merged;  // [B, S, C], the heads side by side
  if (!drop.active()) {
    // Fused, on the packed product: the [S, S] scores are never stored, qkv is never split
    // (its gradient is one tensor) and the heads come out merged. A split of C (whole heads)
    // stays local.
    merged = attention_qkv(view(qkv, {3, B, S, C}), hd, /*causal=*/true);
  } else {
    // [1, B*S, C] -> [B, H, S, hd]: a split of C (whole heads) becomes a split of H.
    auto heads_first = [&](int64_t k) {
      return transpose(view(slice(qkv, 0, k, k + 1), {B, S, H, hd}), 1, 2);
    };
    const T q = heads_first(0), k = heads_first(1), v = heads_first(2);
    // The fused op has no dropout on the probabilities: with it active, the composite, whose
    // [B, H, S, S] scores and probabilities selective recomputation reruns in backward
    // instead of keeping (the function is kept until then: it captures by value).
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const auto core = [layout, drop, S, scale](const std::vector<T>& in) {
      T scores = matmul(in[0], transpose(in[1], 2, 3)) * scale;
      const Tensor pos = arange(0, static_cast<double>(S), 1, DType::i64, both::device_of(in[0]));
      const Tensor neg_inf = full({}, -std::numeric_limits<double>::infinity(), scores.dtype());
      scores = where(layout.replicate(ge(pos.view({S, 1}), pos.view({1, S}))), scores,
                     layout.replicate(neg_inf));  // query i sees keys j <= i
      return std::vector<T>{matmul(dropout(softmax(scores, -1), drop.p, drop.training), in[2])};
    };
    const T y = layout.recompute(c.recompute == GptConfig::Recompute::selective, core, {q, k, v})[0];
    merged = view(clone(transpose(y, 1, 2)), {B, S, C});  // heads back
  }
  const T out = row_linear(layout, merged, param("attn.c_proj.weight"), param("attn.c_proj.bias"));
  return layout.region([&] { return dropout(out, drop.p, drop.training); });
}

// The experts in block `index`'s MLP place (nn/moe.h) over the B*T tokens of n [B, T, C].
template <class L, class P>
typename L::Tensor moe_mlp(const L& layout, const P& param, const GptConfig& c, int64_t index,
                           const typename L::Tensor& n, DropoutState drop) {
  using T = typename L::Tensor;
  // The layer runs on plain tensors: the tokens whole over tp (gathered from the sequence
  // split under sp), the experts' parameters replicated there (the plan leaves them whole),
  // so every tp rank routes and computes the same tokens and holds the whole gradients.
  const T whole = layout.column_input(n);
  const Tensor local = [&] {
    if constexpr (std::is_same_v<T, Tensor>) {
      return whole;
    } else {
      // On a mesh of tp alone (Gpt3d reduces dp itself): with a batch axis too, the
      // parameters' gradients would need the sum over it that the sharding rules add.
      TS_CHECK(whole.placements().size() == 1,
               "gpt: block {}'s experts run on a tensor-parallel mesh of one axis, got {} axes",
               index, whole.placements().size());
      return whole.local();
    }
  }();
  const auto plain = [&](const std::string& path) -> Tensor {
    if constexpr (std::is_same_v<T, Tensor>) {
      return param(path);
    } else {
      return param(path).local();
    }
  };
  // Evaluation and generation run dropless: a capacity is a training-time budget, and a
  // generated window's tokens need not divide into its groups.
  nn::MoeOptions o = c.moe_options();
  if (!drop.training) o.capacity_factor = 0;
  nn::MoeWeights w{plain("mlp.router"), plain("mlp.fc_weight"), plain("mlp.fc_bias"),
                   plain("mlp.proj_weight"), plain("mlp.proj_bias"),
                   o.bias_rate > 0 ? plain("mlp.selection_bias") : Tensor()};
  if constexpr (!std::is_same_v<T, Tensor>) {
    if (param("mlp.fc_weight").placements()[0].is_shard()) {
      // Expert tensor parallelism (the plan splits each expert's hidden width over tp, as
      // Megatron splits a dense MLP): the rows enter whole on every tp rank, each computes
      // its slice of the hidden units, and the second product's Partial sums are reduced;
      // the sharding rules place the collectives (the rows' gradient is summed over tp).
      w.experts = [&](const Tensor& rows, const std::vector<int64_t>& sizes, int64_t) {
        const parallel::ShardedTensor& fc = param("mlp.fc_weight");
        TS_CHECK(static_cast<int64_t>(sizes.size()) == fc.shape()[0],
                 "gpt: block {}'s tensor-parallel experts run the {} experts they hold, got {}",
                 index, fc.shape()[0], sizes.size());
        const parallel::MeshPtr& mesh = whole.mesh_ptr();
        const auto replicated = [&](const std::vector<int64_t>& v) {
          return parallel::replicate(
              Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(rows.device()), mesh);
        };
        const parallel::ShardedTensor ids = replicated(nn::row_experts(sizes)), counts = replicated(sizes);
        const parallel::ShardedTensor x(rows, mesh, {parallel::Replicate()}, rows.shape());
        const parallel::ShardedTensor h =
            gelu(parallel::call1(OpId::grouped_matmul, {x, fc, counts}) +
                     index_select(param("mlp.fc_bias"), 0, ids),
                 /*approximate_tanh=*/true);
        const parallel::ShardedTensor y =
            parallel::call1(OpId::grouped_matmul, {h, param("mlp.proj_weight"), counts}) +
            index_select(param("mlp.proj_bias"), 0, ids);
        return parallel::with_sharding_constraint(y, {parallel::Replicate()}).local();
      };
    }
  }
  const int64_t B = local.size(0), S = local.size(1);
  const Tensor y = view(nn::moe_forward(o, w, view(local.contiguous(), {B * S, c.width}),
                                        fmt::format("h.{}", index)),
                        {B, S, c.width});
  T out;
  if constexpr (std::is_same_v<T, Tensor>) {
    out = y;
  } else {
    out = layout.stream(parallel::ShardedTensor(y, whole.mesh_ptr(), whole.placements(), whole.shape()));
  }
  return layout.region([&] { return dropout(out, drop.p, drop.training); });
}

// x + attn(ln_1(x)), then + mlp(ln_2(x)); the MLP is Linear(C, 4C), tanh-GELU, Linear(4C, C),
// or in a Mixture-of-Experts block (c.moe_block(index)) the experts.
template <class L, class P>
typename L::Tensor block(const L& layout, const P& param, const GptConfig& c, int64_t index,
                         const typename L::Tensor& x, DropoutState drop) {
  using T = typename L::Tensor;
  const Shape w{c.width};
  // The LayerNorm and residual regions run on the stream's layout (with sequence
  // parallelism, each rank its part of the sequence); `region` accounts their memory.
  const T n1 = layout.region([&] { return layer_norm(x, w, param("ln_1.weight"), param("ln_1.bias")); });
  const T a = gpt::attention(layout, param, c, n1, drop);
  // h = x + a and ln_2(h): one add_layer_norm on plain tensors (the same values, one pass
  // less); sharded layouts keep the two ops, whose redistributions the layout places.
  const std::pair<T, T> h_n2 = [&]() -> std::pair<T, T> {
    if constexpr (std::is_same_v<T, Tensor>) {
      const AddLayerNorm f = add_layer_norm(x, a, w, param("ln_2.weight"), param("ln_2.bias"));
      return {f.sum, f.normed};
    } else {
      const T sum = layout.region([&] { return x + a; });
      return {sum, layout.region([&] { return layer_norm(sum, w, param("ln_2.weight"), param("ln_2.bias")); })};
    }
  }();
  const T& h = h_n2.first;
  const T& n2 = h_n2.second;
  if (c.moe_block(index)) {
    const T down = gpt::moe_mlp(layout, param, c, index, n2, drop);
    return layout.region([&] { return h + down; });
  }
  if (c.recompute != GptConfig::Recompute::selective || !drop.training) {  // (eval: no backward)
    // Column-wise up projection with its bias and GELU in one op, row-wise down projection.
    const T up = linear(layout.column_input(n2), param("mlp.c_fc.weight"), param("mlp.c_fc.bias"),
                        Activation::gelu_tanh);
    const T down = layout.region([&] {
      return dropout(row_linear(layout, up, param("mlp.c_proj.weight"), param("mlp.c_proj.bias")), drop.p,
                     drop.training);
    });
    return layout.region([&] { return h + down; });
  }
  // Selective recomputation keeps the pre-activation only and reruns GELU and the down
  // projection in backward, so the [B, T, 4C] activation is not kept. The values are the
  // other path's: the GELU reads the pre-activation as kept (as linear's own GELU does, in
  // 16 bits too), and the down projection's bias joins as in row_linear.
  const T pre = linear(layout.column_input(n2), param("mlp.c_fc.weight"), param("mlp.c_fc.bias"));
  T projected;
  if constexpr (std::is_same_v<T, Tensor>) {
    const auto act_down = [](const std::vector<T>& in) {
      return std::vector<T>{linear(gelu(in[0], /*approximate_tanh=*/true), in[1], in[2])};
    };
    projected = layout.recompute(true, act_down, {pre, param("mlp.c_proj.weight"), param("mlp.c_proj.bias")})[0];
  } else {
    const auto act_down = [](const std::vector<T>& in) {
      return std::vector<T>{linear(gelu(in[0], /*approximate_tanh=*/true), in[1])};
    };
    projected = plus_bias(layout.stream(layout.recompute(true, act_down, {pre, param("mlp.c_proj.weight")})[0]),
                          param("mlp.c_proj.bias"));
  }
  const T down = layout.region([&] { return dropout(projected, drop.p, drop.training); });
  return layout.region([&] { return h + down; });
}

// The LM head's bias with a padded vocabulary: 0 for the vocabulary, kPaddedLogit for the
// padding ([padded_vocab()]).
inline Tensor padded_logits_bias(const GptConfig& c, DType dtype, Device device) {
  return cat({zeros({c.vocab}, dtype, device), full({c.padded_vocab() - c.vocab}, kPaddedLogit, dtype, device)}, 0);
}

// Final LayerNorm and the LM head tied to the token embedding: [B, T, C] -> [B, T,
// padded_vocab()] (the padded columns kPaddedLogit).
template <class L, class P>
typename L::Tensor head(const L& layout, const P& param, const GptConfig& c,
                        const typename L::Tensor& x) {
  const typename L::Tensor n = layout.region(
      [&] { return layer_norm(x, {c.width}, param("ln_f.weight"), param("ln_f.bias")); });
  const auto wte = param("wte.weight");
  if (c.padded_vocab() == c.vocab) return matmul(layout.column_input(n), transpose(wte, 0, 1));
  const Tensor bias = padded_logits_bias(c, wte.dtype(), both::device_of(wte));
  return linear(layout.column_input(n), wte, layout.replicate(bias));
}

// Mean cross-entropy of logits [B, T, V] against targets [B, T] i64, over B*T rows.
template <class L>
typename L::Tensor loss(const L& layout, const typename L::Tensor& logits, const Tensor& targets) {
  TS_CHECK(logits.defined() && targets.defined() && logits.dim() == 3 && targets.dim() == 2 &&
               logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
           "Gpt::loss: expected logits [B, T, V] and targets [B, T], got {} and {}",
           logits.defined() ? shape_str(logits.shape()) : std::string("undefined"),
           targets.defined() ? shape_str(targets.shape()) : std::string("undefined"));
  const int64_t rows = logits.size(0) * logits.size(1);
  return layout.cross_entropy(view(both::copy_if_strided(logits), {rows, logits.size(2)}),
                              view(layout.input(targets.contiguous()), {rows}));
}

}  // namespace tessera::gpt
