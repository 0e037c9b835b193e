#include "nn/layers.h"

#include <fmt/format.h>

#include <cmath>

#include "nn/init.h"
#include "tensor/grad_mode.h"

namespace tessera::nn {
namespace {

void check_positive(const char* layer, const char* what, int64_t v) {
  TS_CHECK(v > 0, "{}: {} must be positive, got {}", layer, what, v);
}

}  // namespace

Linear::Linear(int64_t in, int64_t out, bool has_bias, DType dtype)
    : Module("Linear"), in_features(in), out_features(out) {
  check_positive("Linear", "in_features", in);
  check_positive("Linear", "out_features", out);
  Tensor w = Tensor::empty({out, in}, dtype);
  init::kaiming_uniform_(w, std::sqrt(5.0));
  weight = register_parameter("weight", w);
  if (has_bias) {
    Tensor b = Tensor::empty({out}, dtype);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    init::uniform_(b, -bound, bound);
    bias = register_parameter("bias", b);
  }
}

Tensor Linear::forward(const Tensor& x) {
  TS_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features,
           "Linear: expected input [..., {}], got {}", in_features,
           x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  return linear(x, weight, bias);  // one op: the bias joins the product's output blocks
}

TiledLinear::TiledLinear(int64_t in, int64_t out, int64_t count, bool has_bias, DType dtype)
    : Module("TiledLinear"), in_features(in), out_features(out) {
  check_positive("TiledLinear", "in_features", in);
  check_positive("TiledLinear", "out_features", out);
  TS_CHECK(count >= 1 && count <= out,
           "TiledLinear: tiles must be in [1, out_features = {}], got {}", out, count);
  for (int64_t t = 0; t < count; ++t) {
    // array_split: the first out % count tiles take one row more.
    const int64_t rows = out / count + (t < out % count ? 1 : 0);
    tiles.push_back(register_module(fmt::format("{}", t),
                                    std::make_shared<Linear>(in, rows, has_bias, dtype)));
  }
}

Tensor TiledLinear::forward(const Tensor& x) {
  TS_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features,
           "TiledLinear: expected input [..., {}], got {}", in_features,
           x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  std::vector<Tensor> parts;
  parts.reserve(tiles.size());
  for (auto& tile : tiles) parts.push_back((*tile)(x));  // operator(): ZeRO's unit hooks run
  return cat(parts, -1);
}

std::vector<std::string> TiledLinear::tile_paths(const std::string& prefix) const {
  std::vector<std::string> out;
  for (size_t t = 0; t < tiles.size(); ++t) {
    out.push_back(fmt::format("{}{}{}", prefix, prefix.empty() ? "" : ".", t));
  }
  return out;
}

void TiledLinear::load_whole(const Tensor& weight, const Tensor& bias) {
  TS_CHECK(weight.shape() == Shape({out_features, in_features}),
           "TiledLinear::load_whole: weight {} is not [{}, {}]", shape_str(weight.shape()),
           out_features, in_features);
  NoGradGuard no_grad;
  int64_t row = 0;
  for (auto& tile : tiles) {
    tile->weight.copy_(weight.narrow(0, row, tile->out_features));
    if (tile->bias.defined() && bias.defined()) tile->bias.copy_(bias.narrow(0, row, tile->out_features));
    row += tile->out_features;
  }
}

Embedding::Embedding(int64_t num, int64_t dim, DType dtype) : Module("Embedding") {
  check_positive("Embedding", "num_embeddings", num);
  check_positive("Embedding", "embedding_dim", dim);
  Tensor w = Tensor::empty({num, dim}, dtype);
  init::normal_(w, 0.0, 1.0);
  weight = register_parameter("weight", w);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight, indices); }

void Embedding::pad_rows(int64_t rows) {
  TS_CHECK(rows >= 0, "Embedding::pad_rows: rows must be >= 0, got {}", rows);
  if (rows == 0) return;
  const Tensor w = weight.detach();
  weight = replace_parameter("weight", cat({w, zeros({rows, w.size(1)}, w.dtype(), w.device())}, 0));
}

LayerNorm::LayerNorm(Shape shape, double eps_, bool affine, DType dtype)
    : Module("LayerNorm"), normalized_shape(std::move(shape)), eps(eps_) {
  TS_CHECK(!normalized_shape.empty(), "LayerNorm: normalized_shape must not be empty");
  if (affine) {
    weight = register_parameter("weight", ones(normalized_shape, dtype));
    bias = register_parameter("bias", zeros(normalized_shape, dtype));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, normalized_shape, weight, bias, eps);
}

Dropout::Dropout(double p_) : Module("Dropout"), p(p_) {
  TS_CHECK(p >= 0.0 && p < 1.0, "Dropout: p must be in [0, 1), got {}", p);
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, p, is_training()); }

Conv2d::Conv2d(int64_t in, int64_t out, std::array<int64_t, 2> k, std::array<int64_t, 2> stride_,
               std::array<int64_t, 2> padding_, bool has_bias, DType dtype)
    : Module("Conv2d"), stride(stride_), padding(padding_) {
  check_positive("Conv2d", "in_channels", in);
  check_positive("Conv2d", "out_channels", out);
  check_positive("Conv2d", "kernel height", k[0]);
  check_positive("Conv2d", "kernel width", k[1]);
  Tensor w = Tensor::empty({out, in, k[0], k[1]}, dtype);
  init::kaiming_uniform_(w, std::sqrt(5.0));
  weight = register_parameter("weight", w);
  if (has_bias) {
    Tensor b = Tensor::empty({out}, dtype);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in * k[0] * k[1]));
    init::uniform_(b, -bound, bound);
    bias = register_parameter("bias", b);
  }
}

Tensor Conv2d::forward(const Tensor& x) { return conv2d(x, weight, bias, stride, padding); }

MaxPool2d::MaxPool2d(std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p)
    : Module("MaxPool2d"), kernel_size(k), stride(s), padding(p) {}

Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_size, stride, padding); }

Flatten::Flatten(int64_t s, int64_t e) : Module("Flatten"), start_dim(s), end_dim(e) {}

Tensor Flatten::forward(const Tensor& x) { return flatten(x, start_dim, end_dim); }

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) : Module("Sequential") {
  for (auto& m : modules) push_back(std::move(m));
}

void Sequential::push_back(std::shared_ptr<Module> module) {
  TS_CHECK(module != nullptr, "Sequential: module {} is null", modules_.size());
  register_module(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (auto& m : modules_) y = (*m)(y);
  return y;
}

MLP::MLP(const std::vector<int64_t>& sizes, Activation activation, double p) : Module("MLP") {
  TS_CHECK(sizes.size() >= 2, "MLP: needs at least an input and an output width, got {} sizes",
           sizes.size());
  layers = register_module("layers", std::make_shared<Sequential>());
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    layers->push_back(std::make_shared<Linear>(sizes[i], sizes[i + 1]));
    if (i + 2 == sizes.size()) break;
    switch (activation) {
      case Activation::relu:
        layers->push_back(std::make_shared<ReLU>());
        break;
      case Activation::gelu:
        layers->push_back(std::make_shared<GELU>());
        break;
      case Activation::tanh: {
        struct Tanh : Module {
          Tanh() : Module("Tanh") {}
          Tensor forward(const Tensor& x) override { return tanh(x); }
        };
        layers->push_back(std::make_shared<Tanh>());
        break;
      }
    }
    if (p > 0.0) layers->push_back(std::make_shared<Dropout>(p));
  }
}

}  // namespace tessera::nn
