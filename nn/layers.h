// The standard layers, each built from ops in tensor/ops.h (their gradients come from the
// ops' derivatives; nothing here is hand-differentiated). Shapes, defaults and
// initialisation follow torch.nn, so state dicts carry over name for name.
//
//   auto mlp = std::make_shared<nn::Sequential>();
//   mlp->push_back(std::make_shared<nn::Flatten>());
//   mlp->push_back(std::make_shared<nn::Linear>(784, 256));
//   mlp->push_back(std::make_shared<nn::ReLU>());
//   Tensor logits = mlp->forward(images);   // [N, 256]
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "nn/module.h"

namespace tessera::nn {

// y = x W^T + b; weight [out, in], bias [out]; init U(-1/sqrt(in), 1/sqrt(in)) as torch.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  int64_t in_features, out_features;
  Tensor weight, bias;
};

// Memory-centric tiling (ZeRO-Infinity's TiledLinear): a Linear cut along its output
// features into `tiles` Linear submodules "0", "1", ... (array_split rows), whose
// outputs are concatenated. On its own it computes the untiled layer (x's gradient summed
// over the tiles, so f32 rounding differs by the order); its point is ZeRO stage 3 with the
// tiles as units (tile_paths()): each tile's weight is gathered, used and freed on its own,
// in forward and again in backward, so a layer whose weight alone exceeds the device budget
// (a large vocabulary's head) trains with one tile on the device at a time.
//
//   auto head = register_module("head", std::make_shared<nn::TiledLinear>(C, V, 8));
//   zero_options.units = head->tile_paths("head");   // + the other units
class TiledLinear : public Module {
 public:
  TiledLinear(int64_t in_features, int64_t out_features, int64_t tiles, bool bias = true,
              DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  // "prefix.0", "prefix.1", ... (prefix: this module's path in the model).
  std::vector<std::string> tile_paths(const std::string& prefix) const;
  // Copies a whole [out, in] weight and [out] bias (undefined: none) into the tiles.
  void load_whole(const Tensor& weight, const Tensor& bias);
  int64_t in_features, out_features;
  std::vector<std::shared_ptr<Linear>> tiles;
};

// Rows of weight [num, dim] picked by integer indices; init N(0, 1) as torch.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, DType dtype = DType::f32);
  Tensor forward(const Tensor& indices) override;
  // Appends `rows` zero rows to the table (gradients dropped): a vocabulary padded so a tied
  // head's GEMM dimension aligns, the table's own rows and draws unchanged.
  void pad_rows(int64_t rows);
  Tensor weight;
};

// Normalises over the trailing `normalized_shape`; weight ones, bias zeros.
class LayerNorm : public Module {
 public:
  LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true,
            DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  Shape normalized_shape;
  double eps;
  Tensor weight, bias;
};

// Zeroes elements with probability p while training (scaling the rest by 1/(1-p)).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p;
};

// x [N, C, H, W] -> [N, O, H', W']; weight [O, C, kh, kw]; init as torch.nn.Conv2d.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel_size,
         std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0},
         bool bias = true, DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> stride, padding;
  Tensor weight, bias;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(std::array<int64_t, 2> kernel_size, std::array<int64_t, 2> stride = {0, 0},
                     std::array<int64_t, 2> padding = {0, 0});
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> kernel_size, stride, padding;
};

// Merges dims start_dim..end_dim (default: all but the batch dim).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor forward(const Tensor& x) override;
  int64_t start_dim, end_dim;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return relu(x); }
};

class GELU : public Module {
 public:
  explicit GELU(bool approximate_tanh = false) : Module("GELU"), approximate_tanh(approximate_tanh) {}
  Tensor forward(const Tensor& x) override { return gelu(x, approximate_tanh); }
  bool approximate_tanh;
};

// Runs its modules in order; they are registered as "0", "1", ... (torch's naming).
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules);
  void push_back(std::shared_ptr<Module> module);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return modules_.size(); }
  const std::shared_ptr<Module>& operator[](size_t i) const { return modules_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};

enum class Activation { relu, gelu, tanh };

// Linear layers of the given widths with the activation (and optional dropout) between
// them, none after the last: sizes {784, 256, 10} = Linear(784, 256), act, Linear(256, 10).
// Layers are named "layers.0", "layers.1", ... inside a Sequential.
class MLP : public Module {
 public:
  MLP(const std::vector<int64_t>& sizes, Activation activation = Activation::relu,
      double dropout = 0.0);
  Tensor forward(const Tensor& x) override { return layers->forward(x); }
  std::shared_ptr<Sequential> layers;
};

}  // namespace tessera::nn
