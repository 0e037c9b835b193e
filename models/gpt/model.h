// GPT-2 from tensor ops only (no hand-written backward; the forward, in forward.h, is the
// one TpGpt runs sharded): token and position embeddings, pre-LayerNorm blocks of causal
// self-attention (fused qkv) and a 4x tanh-GELU MLP, a final LayerNorm, and an LM head tied
// to the token embedding. Parameter names follow the torch/nanoGPT state dict ("wte.weight",
// "h.0.attn.c_attn.weight", ...), so tools/gpt_reference.py builds the same model in PyTorch.
//
//   manual_seed(0);                                     // GPT-2 init draws from it
//   gpt::Gpt model({.layers = 2, .heads = 2, .width = 32, .context = 16, .vocab = 64});
//   Tensor logits = model.forward(idx);                 // idx [B, T] i64 -> [B, T, vocab]
//                                                       // (padded_vocab() with vocab_pad)
//   Tensor loss = gpt::Gpt::loss(logits, targets);      // targets [B, T] i64
//   loss.backward();
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "nn/layers.h"
#include "nn/moe.h"

namespace tessera::gpt {

// The logit of a padded vocabulary entry: f16's lowest finite value, so finite in every
// dtype (a padded column times a zero one-hot stays 0 in the vocab-parallel loss) and below
// any real logit by far more than exp's range, so its probability is exactly 0.
inline constexpr double kPaddedLogit = -65504.0;

struct GptConfig {
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;    // embedding width C; head_dim = width / heads
  int64_t context = 128;  // longest sequence (rows of wpe)
  int64_t vocab = 256;
  // The token embedding (and so the tied LM head) has padded_vocab() rows: vocab rounded up
  // to a multiple of vocab_pad (1: none), so the head's GEMM dimension aligns (GPT-2's
  // 50257 -> 50304 with 64). The padded rows start at zero and are never read by the
  // embedding; their logits are kPaddedLogit, so the softmax gives them exactly zero and
  // they never get a gradient. forward() returns all padded_vocab() logits. The embedding
  // checks token ids against its rows, so an id in [vocab, padded_vocab()) is not rejected
  // (it reads a zero row) where an unpadded model's lookup would reject it.
  int64_t vocab_pad = 1;
  // Error (naming both) when vocab_pad < 1 or the padded count overflows int64: it is read
  // before validate() too (the memory estimate refuses absurd sizes first).
  int64_t padded_vocab() const;
  double dropout = 0.0;   // after the embeddings, on attention weights, on each residual branch
  // Activation recomputation in training: none; full (each block keeps only its input and
  // reruns its forward in backward); selective (Megatron's: only the attention core with
  // dropout on the probabilities, and the MLP's activation, are rerun: the parts that are
  // cheap to compute and hold [B, H, T, T] and [B, T, 4C] tensors).
  enum class Recompute { none, full, selective };
  Recompute recompute = Recompute::none;
  // Mixture of Experts (nn/moe.h): with experts > 0, the MLP of every moe_every-th block
  // (blocks moe_every - 1, 2 moe_every - 1, ...) is `experts` experts of which each token
  // uses moe.top_k. moe.experts is ignored (experts decides); moe.hidden 0 is 4C.
  int64_t experts = 0;
  int64_t moe_every = 1;
  nn::MoeOptions moe = {};
  bool moe_block(int64_t i) const { return experts > 0 && i % moe_every == moe_every - 1; }
  nn::MoeOptions moe_options() const;

  // Throws tessera::Error naming the offending field ("GptConfig: heads must ...").
  void validate() const;
  // V*C + context*C + layers*(12*C^2 + 13*C) + 2*C with V = padded_vocab() (the head is
  // tied: no extra parameters);
  // a Mixture-of-Experts block has E*C (router) + E*(2*C*H + H + C) in its MLP's place.
  int64_t num_parameters() const;
};

// Parameter holders named as torch's (attn.c_attn [3C, C] projects to q, k and v at once,
// attn.c_proj [C, C]; mlp.c_fc [4C, C], mlp.c_proj [C, 4C]). Block's forward uses them; it
// is written once for every layout in models/gpt/forward.h.
class CausalSelfAttention : public nn::Module {
 public:
  explicit CausalSelfAttention(const GptConfig& config);
  std::shared_ptr<nn::Linear> c_attn, c_proj;
};

class Mlp : public nn::Module {
 public:
  explicit Mlp(const GptConfig& config);
  std::shared_ptr<nn::Linear> c_fc, c_proj;
};

// x + attn(ln_1(x)), then + mlp(ln_2(x)): causal self-attention (the future masked; fused
// unless attention dropout is active), a 4x tanh-GELU MLP (or, in a Mixture-of-Experts
// block, the experts: `moe` in `mlp`'s place), dropout on each residual branch.
class Block : public nn::Module {
 public:
  Block(const GptConfig& config, int64_t index);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<Mlp> mlp;                     // null in a Mixture-of-Experts block
  std::shared_ptr<nn::MixtureOfExperts> moe;    // registered as "mlp"; null otherwise

 private:
  GptConfig config_;
  int64_t index_;
};

class Gpt : public nn::Module {
 public:
  // Validates `config`, builds the layers and applies GPT-2's initialisation from this
  // thread's generator: N(0, 0.02) for embeddings and Linear weights, N(0, 0.02/sqrt(2L))
  // for the residual projections (attn.c_proj, mlp.c_proj), zero biases, LayerNorm 1/0.
  explicit Gpt(const GptConfig& config);

  // idx [B, T] i64 with T <= context and values in [0, vocab) -> logits [B, T,
  // padded_vocab()] (the padded columns kPaddedLogit):
  // head(blocks(embed(idx))), the pieces a pipeline puts on its first and last stages.
  Tensor forward(const Tensor& idx) override;
  // Token + position embeddings (and dropout): idx [B, T] -> x [B, T, C].
  Tensor embed(const Tensor& idx);
  // Final LayerNorm and the tied LM head: x [B, T, C] -> logits [B, T, padded_vocab()].
  Tensor head(const Tensor& x);
  // Mean cross-entropy of logits [B, T, V] against targets [B, T] i64 (over B*T rows).
  static Tensor loss(const Tensor& logits, const Tensor& targets);

  const GptConfig& config() const { return config_; }
  // Called by forward with each pipeline layer's output: "embed", "h.0", ..., "head" (the
  // logits). For comparing a layout with this model layer by layer (models/gpt/check.h).
  using LayerObserver = std::function<void(const std::string& layer, const Tensor& output)>;
  void set_layer_observer(LayerObserver observer) { observer_ = std::move(observer); }

  std::shared_ptr<nn::Embedding> wte, wpe;
  std::shared_ptr<nn::Sequential> h;  // the blocks, named h.0, h.1, ...
  std::shared_ptr<nn::LayerNorm> ln_f;

 private:
  void init_weights();
  GptConfig config_;
  LayerObserver observer_;
};

}  // namespace tessera::gpt
