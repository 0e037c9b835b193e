#include "models/gpt/model.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "autograd/checkpoint.h"
#include "models/gpt/forward.h"
#include "nn/init.h"

namespace tessera::gpt {

void GptConfig::validate() const {
  TS_CHECK(layers > 0, "GptConfig: layers must be positive, got {}", layers);
  TS_CHECK(heads > 0, "GptConfig: heads must be positive, got {}", heads);
  TS_CHECK(width > 0, "GptConfig: width must be positive, got {}", width);
  TS_CHECK(context > 0, "GptConfig: context must be positive, got {}", context);
  TS_CHECK(vocab > 0, "GptConfig: vocab must be positive, got {}", vocab);
  TS_CHECK(vocab_pad >= 1 && vocab_pad <= (int64_t{1} << 20),
           "GptConfig: vocab_pad must be in [1, 2^20] (1: no padding), got {}", vocab_pad);
  TS_CHECK(vocab <= std::numeric_limits<int64_t>::max() - vocab_pad,
           "GptConfig: vocab {} padded to a multiple of {} overflows int64", vocab, vocab_pad);
  TS_CHECK(width % heads == 0, "GptConfig: width ({}) must be divisible by heads ({})", width,
           heads);
  TS_CHECK(dropout >= 0.0 && dropout < 1.0, "GptConfig: dropout must be in [0, 1), got {}",
           dropout);
  TS_CHECK(experts >= 0, "GptConfig: experts must be >= 0 (0: dense MLPs), got {}", experts);
  TS_CHECK(moe_every >= 1, "GptConfig: moe_every must be >= 1, got {}", moe_every);
  if (experts > 0) {
    TS_CHECK(moe_every <= layers, "GptConfig: moe_every = {} leaves no Mixture-of-Experts block in "
             "{} layers", moe_every, layers);
    moe_options().validate(width);
  }
  num_parameters();  // throws when the sizes overflow
}

int64_t GptConfig::padded_vocab() const {
  TS_CHECK(vocab_pad >= 1 && vocab_pad <= (int64_t{1} << 20),
           "GptConfig: vocab_pad must be in [1, 2^20] (1: no padding), got {}", vocab_pad);
  if (vocab <= 0) return vocab;  // validate() refuses it
  const int64_t rem = vocab % vocab_pad;
  if (rem == 0) return vocab;
  const int64_t add = vocab_pad - rem;
  TS_CHECK(vocab <= std::numeric_limits<int64_t>::max() - add,
           "GptConfig: vocab {} padded to a multiple of {} overflows int64", vocab, vocab_pad);
  return vocab + add;
}

nn::MoeOptions GptConfig::moe_options() const {
  nn::MoeOptions o = moe;
  o.experts = experts;
  return o;
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
  total = add(add(add(mul(padded_vocab(), c), mul(context, c)), mul(layers, block)), mul(2, c));
  if (experts > 0) {
    // Each MoE block trades the MLP's 8 C^2 + 5 C for the router and E experts.
    const int64_t h = moe.hidden > 0 ? moe.hidden : mul(4, c);
    const int64_t expert = add(add(mul(2, mul(c, h)), h), c);
    const int64_t moe_mlp = add(mul(experts, c), mul(experts, expert));
    const int64_t blocks = layers / moe_every;
    total = add(total, mul(blocks, add(moe_mlp, -add(mul(8, mul(c, c)), mul(5, c)))));
  }
  TS_CHECK(!overflow,
           "GptConfig: the parameter count of vocab {} x width {} with {} layers and context {} "
           "overflows int64",
           vocab, width, layers, context);
  return total;
}

// ---- layers ---------------------------------------------------------------------------------

CausalSelfAttention::CausalSelfAttention(const GptConfig& config) : Module("CausalSelfAttention") {
  c_attn = register_module("c_attn", std::make_shared<nn::Linear>(config.width, 3 * config.width));
  c_proj = register_module("c_proj", std::make_shared<nn::Linear>(config.width, config.width));
}

Mlp::Mlp(const GptConfig& config) : Module("Mlp") {
  c_fc = register_module("c_fc", std::make_shared<nn::Linear>(config.width, 4 * config.width));
  c_proj = register_module("c_proj", std::make_shared<nn::Linear>(4 * config.width, config.width));
}

Block::Block(const GptConfig& config, int64_t index) : Module("Block"), config_(config), index_(index) {
  ln_1 = register_module("ln_1", std::make_shared<nn::LayerNorm>(Shape{config.width}));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config));
  ln_2 = register_module("ln_2", std::make_shared<nn::LayerNorm>(Shape{config.width}));
  if (config.moe_block(index)) {
    moe = register_module("mlp", std::make_shared<nn::MixtureOfExperts>(config.width, config.moe_options(),
                                                                       fmt::format("h.{}", index)));
  } else {
    mlp = register_module("mlp", std::make_shared<Mlp>(config));
  }
}

Tensor Block::forward(const Tensor& x) {
  TS_CHECK(x.defined() && x.dim() == 3 && x.size(2) == config_.width,
           "Block: expected input [B, T, {}], got {}", config_.width,
           x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  return block(parallel::SingleDevice{}, parallel::ModuleParameters(*this), config_, index_, x,
               {config_.dropout, is_training()});
}

// ---- the model ------------------------------------------------------------------------------

Gpt::Gpt(const GptConfig& config) : Module("Gpt"), config_(config) {
  config_.validate();
  // The vocabulary's rows draw what an unpadded model's draw; the padding is zero.
  wte = register_module("wte", std::make_shared<nn::Embedding>(config_.vocab, config_.width));
  wte->pad_rows(config_.padded_vocab() - config_.vocab);
  wpe = register_module("wpe", std::make_shared<nn::Embedding>(config_.context, config_.width));
  h = register_module("h", std::make_shared<nn::Sequential>());
  for (int64_t i = 0; i < config_.layers; ++i) h->push_back(std::make_shared<Block>(config_, i));
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
  Tensor vocabulary = wte->weight.narrow(0, 0, config_.vocab);  // the padding stays zero
  nn::init::normal_(vocabulary, 0.0, std);
  nn::init::normal_(wpe->weight, 0.0, std);
  auto init_linear = [](nn::Linear& l, double s) {
    nn::init::normal_(l.weight, 0.0, s);
    nn::init::zeros_(l.bias);
  };
  for (size_t i = 0; i < h->size(); ++i) {
    Block& b = static_cast<Block&>(*(*h)[i]);
    init_linear(*b.attn->c_attn, std);
    init_linear(*b.attn->c_proj, resid_std);
    if (b.moe) {  // the router and every expert as the MLP's layers
      // (A layer holding some of the experts draws their part of the whole draw.)
      nn::init::normal_(b.moe->router, 0.0, std);
      b.moe->init_experts(b.moe->fc_weight, [&](Tensor& t) { nn::init::normal_(t, 0.0, std); });
      b.moe->init_experts(b.moe->proj_weight, [&](Tensor& t) { nn::init::normal_(t, 0.0, resid_std); });
      continue;  // biases and the selection bias start at zero
    }
    init_linear(*b.mlp->c_fc, std);
    init_linear(*b.mlp->c_proj, resid_std);
  }
  // LayerNorms keep their construction values: weight ones, bias zeros.
}

Tensor Gpt::forward(const Tensor& idx) {
  // Each layer's dropout starts at its own offset from the step's (dropout_draws_before), as
  // a pipeline stage running that layer alone starts it.
  const DropoutKeys keys(config_, is_training(), idx.dim() == 2 ? idx.size(0) : 0,
                         idx.dim() == 2 ? idx.size(1) : 0);
  const auto observe = [this](const std::string& layer, const Tensor& out) {
    if (observer_) observer_(layer, out);
    return out;
  };
  Tensor x = observe("embed", embed(idx));
  for (size_t i = 0; i < h->size(); ++i) {
    keys.at(static_cast<int64_t>(i) + 1);
    // Blocks through operator(): ZeRO-3 hooks on each block.
    const std::shared_ptr<nn::Module> block = (*h)[i];
    if (config_.recompute == GptConfig::Recompute::full && is_training()) {
      x = autograd::checkpoint(
          [block](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*block)(in[0])}; },
          {x})[0];
    } else {
      x = (*block)(x);
    }
    observe(fmt::format("h.{}", i), x);
  }
  keys.end();
  return observe("head", head(x));
}

Tensor Gpt::embed(const Tensor& idx) {
  return gpt::embed(parallel::SingleDevice{}, parallel::ModuleParameters(*this), config_, idx,
                    {config_.dropout, is_training()});
}

Tensor Gpt::head(const Tensor& x) {
  return gpt::head(parallel::SingleDevice{}, parallel::ModuleParameters(*this), config_, x);
}

Tensor Gpt::loss(const Tensor& logits, const Tensor& targets) {
  return gpt::loss(parallel::SingleDevice{}, logits, targets);
}

}  // namespace tessera::gpt
