#include "models/gpt/model.h"

#include <cmath>
#include <limits>

#include "nn/init.h"

namespace tessera::gpt {

void GptConfig::validate() const {
  TS_CHECK(layers > 0, "GptConfig: layers must be positive, got {}", layers);
  TS_CHECK(heads > 0, "GptConfig: heads must be positive, got {}", heads);
  TS_CHECK(width > 0, "GptConfig: width must be positive, got {}", width);
  TS_CHECK(context > 0, "GptConfig: context must be positive, got {}", context);
  TS_CHECK(vocab > 0, "GptConfig: vocab must be positive, got {}", vocab);
  TS_CHECK(width % heads == 0, "GptConfig: width ({}) must be divisible by heads ({})", width,
           heads);
  TS_CHECK(dropout >= 0.0 && dropout < 1.0, "GptConfig: dropout must be in [0, 1), got {}",
           dropout);
  num_parameters();  // throws when the sizes overflow
}

int64_t GptConfig::num_parameters() const {
  // Checked: sizes come from flags and files, and --vocab=2^62 must not wrap around.
  int64_t total = 0;
  bool overflow = false;
  auto mul = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow |= __builtin_mul_overflow(a, b, &r);
    return r;
  };
  auto add = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow |= __builtin_add_overflow(a, b, &r);
    return r;
  };
  const int64_t c = width;
  const int64_t block = add(mul(12, mul(c, c)), mul(13, c));
  total = add(add(add(mul(vocab, c), mul(context, c)), mul(layers, block)), mul(2, c));
  TS_CHECK(!overflow,
           "GptConfig: the parameter count of vocab {} x width {} with {} layers and context {} "
           "overflows int64",
           vocab, width, layers, context);
  return total;
}

// ---- attention ------------------------------------------------------------------------------

CausalSelfAttention::CausalSelfAttention(const GptConfig& config)
    : Module("CausalSelfAttention"), heads(config.heads), width(config.width) {
  c_attn = register_module("c_attn", std::make_shared<nn::Linear>(width, 3 * width));
  c_proj = register_module("c_proj", std::make_shared<nn::Linear>(width, width));
  attn_dropout = register_module("attn_dropout", std::make_shared<nn::Dropout>(config.dropout));
  resid_dropout = register_module("resid_dropout", std::make_shared<nn::Dropout>(config.dropout));
}

Tensor CausalSelfAttention::causal_mask(int64_t T) {
  if (!mask_.defined() || mask_.size(0) != T) {
    const Tensor pos = arange(0, static_cast<double>(T), 1, DType::i64);
    mask_ = ge(pos.view({T, 1}), pos.view({1, T}));  // query i sees keys j <= i
  }
  return mask_;
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  TS_CHECK(x.defined() && x.dim() == 3 && x.size(2) == width,
           "CausalSelfAttention: expected input [B, T, {}], got {}", width,
           x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  const int64_t B = x.size(0), T = x.size(1), hd = width / heads;
  // [B, T, 3C] -> three [B, T, C] views -> [B, H, T, hd] each.
  const std::vector<Tensor> qkv = split(c_attn->forward(x), width, 2);
  auto heads_first = [&](const Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
  const Tensor q = heads_first(qkv[0]), k = heads_first(qkv[1]), v = heads_first(qkv[2]);

  // On CUDA, the fused flash-attention op: it never stores the [T, T] scores. It has no
  // dropout on the probabilities, so an active attention dropout keeps the composite path,
  // as does the CPU (whose results the golden and equivalence tests pin down).
  const bool attn_dropout_active = attn_dropout->is_training() && attn_dropout->p > 0.0;
  if (x.device().is_cuda() && !attn_dropout_active) {
    const Tensor y = attention(q, k, v, /*causal=*/true).transpose(1, 2).reshape({B, T, width});
    return resid_dropout->forward(c_proj->forward(y));
  }
  Tensor scores = matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  const Tensor neg_inf =
      scalar_like(-std::numeric_limits<double>::infinity(), scores, "CausalSelfAttention");
  scores = where(causal_mask(T), scores, neg_inf);
  const Tensor weights = attn_dropout->forward(softmax(scores, -1));
  const Tensor y = matmul(weights, v).transpose(1, 2).reshape({B, T, width});  // heads back
  return resid_dropout->forward(c_proj->forward(y));
}

// ---- MLP and block --------------------------------------------------------------------------

Mlp::Mlp(const GptConfig& config) : Module("Mlp") {
  c_fc = register_module("c_fc", std::make_shared<nn::Linear>(config.width, 4 * config.width));
  gelu = register_module("gelu", std::make_shared<nn::GELU>(/*approximate_tanh=*/true));
  c_proj = register_module("c_proj", std::make_shared<nn::Linear>(4 * config.width, config.width));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(config.dropout));
}

Tensor Mlp::forward(const Tensor& x) {
  return dropout->forward(c_proj->forward(gelu->forward(c_fc->forward(x))));
}

Block::Block(const GptConfig& config) : Module("Block") {
  ln_1 = register_module("ln_1", std::make_shared<nn::LayerNorm>(Shape{config.width}));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config));
  ln_2 = register_module("ln_2", std::make_shared<nn::LayerNorm>(Shape{config.width}));
  mlp = register_module("mlp", std::make_shared<Mlp>(config));
}

Tensor Block::forward(const Tensor& x) {
  const Tensor h = x + attn->forward(ln_1->forward(x));
  return h + mlp->forward(ln_2->forward(h));
}

// ---- the model ------------------------------------------------------------------------------

Gpt::Gpt(const GptConfig& config) : Module("Gpt"), config_(config) {
  config_.validate();
  wte = register_module("wte", std::make_shared<nn::Embedding>(config_.vocab, config_.width));
  wpe = register_module("wpe", std::make_shared<nn::Embedding>(config_.context, config_.width));
  drop = register_module("drop", std::make_shared<nn::Dropout>(config_.dropout));
  h = register_module("h", std::make_shared<nn::Sequential>());
  for (int64_t i = 0; i < config_.layers; ++i) h->push_back(std::make_shared<Block>(config_));
  ln_f = register_module("ln_f", std::make_shared<nn::LayerNorm>(Shape{config_.width}));
  init_weights();
}

void Gpt::init_weights() {
  // The layers drew torch's defaults on construction; GPT-2's scheme replaces them, in a fixed
  // order (wte, wpe, then each block's c_attn, attn.c_proj, c_fc, mlp.c_proj), so a seed
  // gives the same model everywhere. Residual projections are scaled down by 1/sqrt(2L): each
  // block adds two of them to the residual stream.
  const double std = 0.02;
  const double resid_std = std / std::sqrt(2.0 * static_cast<double>(config_.layers));
  nn::init::normal_(wte->weight, 0.0, std);
  nn::init::normal_(wpe->weight, 0.0, std);
  auto init_linear = [](nn::Linear& l, double s) {
    nn::init::normal_(l.weight, 0.0, s);
    nn::init::zeros_(l.bias);
  };
  for (size_t i = 0; i < h->size(); ++i) {
    Block& b = static_cast<Block&>(*(*h)[i]);
    init_linear(*b.attn->c_attn, std);
    init_linear(*b.attn->c_proj, resid_std);
    init_linear(*b.mlp->c_fc, std);
    init_linear(*b.mlp->c_proj, resid_std);
  }
  // LayerNorms keep their construction values: weight ones, bias zeros.
}

Tensor Gpt::forward(const Tensor& idx) {
  return head((*h)(embed(idx)));  // blocks through operator(): ZeRO-3 hooks on each block
}

Tensor Gpt::embed(const Tensor& idx) {
  TS_CHECK(idx.defined() && idx.dim() == 2 && idx.dtype() == DType::i64,
           "Gpt: expected idx [B, T] of dtype i64, got {}",
           idx.defined() ? fmt::format("{} {}", shape_str(idx.shape()), idx.dtype())
                         : std::string("undefined"));
  const int64_t T = idx.size(1);
  TS_CHECK(T >= 1 && T <= config_.context,
           "Gpt: sequence length {} must be in [1, context = {}] (idx {})", T, config_.context,
           shape_str(idx.shape()));
  const Tensor pos = arange(0, static_cast<double>(T), 1, DType::i64, idx.device());
  return drop->forward(wte->forward(idx) + wpe->forward(pos));  // [B, T, C] + [T, C]
}

Tensor Gpt::head(const Tensor& x) {
  return matmul(ln_f->forward(x), wte->weight.t());  // tied head: [B, T, C] @ [C, V]
}

Tensor Gpt::loss(const Tensor& logits, const Tensor& targets) {
  TS_CHECK(logits.defined() && targets.defined() && logits.dim() == 3 && targets.dim() == 2 &&
               logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
           "Gpt::loss: expected logits [B, T, V] and targets [B, T], got {} and {}",
           logits.defined() ? shape_str(logits.shape()) : std::string("undefined"),
           targets.defined() ? shape_str(targets.shape()) : std::string("undefined"));
  const int64_t rows = logits.size(0) * logits.size(1);
  return cross_entropy(logits.reshape({rows, logits.size(2)}), targets.reshape({rows}));
}

}  // namespace tessera::gpt
