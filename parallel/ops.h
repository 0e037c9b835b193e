// Ops on sharded tensors: the same op list as tensor/ops.h, run on each rank's local block
// under the op's sharding rule (sharding_rule.h). The result equals the op on one device
// (full_tensor() of the output matches), with collectives only where the layouts require.
//
//   ShardedTensor h = relu(matmul(x, w1));        // x [S(0)] (batch), w1 [R]: no traffic
//   ShardedTensor y = matmul(h, w2);              // w2 [S(0)] (rows): the cheaper of moving h
//                                                 // to [S(1)] (a Partial y) or gathering w2
//   ShardedTensor loss = cross_entropy(y, target);
//   loss.backward();
//
// Every function is a thin wrapper over call() (or factory / call_inplace, parallel/dispatch.h),
// which any op in the list can use directly. Inputs must live on one mesh (Error naming both
// meshes).
#pragma once

#include <array>
#include <initializer_list>
#include <vector>

#include "parallel/dispatch.h"
#include "parallel/sharded_tensor.h"
#include "tensor/op.h"

namespace tessera::parallel {

// ---- named forms ---------------------------------------------------------------------------
// Every functor family op of tensor/op_list.h (neg, exp, ..., add, ..., eq, ...), as in
// tensor/ops.h.
TS_DEFINE_FAMILY_WRAPPERS(ShardedTensor)

ShardedTensor gelu(const ShardedTensor& x, bool approximate_tanh = false);
ShardedTensor pow(const ShardedTensor& a, double exponent);
ShardedTensor where(const ShardedTensor& cond, const ShardedTensor& a, const ShardedTensor& b);
ShardedTensor operator+(const ShardedTensor& a, const ShardedTensor& b);
ShardedTensor operator-(const ShardedTensor& a, const ShardedTensor& b);
ShardedTensor operator*(const ShardedTensor& a, const ShardedTensor& b);
ShardedTensor operator/(const ShardedTensor& a, const ShardedTensor& b);
ShardedTensor operator*(const ShardedTensor& a, double b);
ShardedTensor operator+(const ShardedTensor& a, double b);

ShardedTensor sum(const ShardedTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
ShardedTensor mean(const ShardedTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
ShardedTensor max(const ShardedTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
ShardedTensor var(const ShardedTensor& x, const std::vector<int64_t>& dims = {}, int64_t correction = 1,
                  bool keepdim = false);
ShardedTensor argmax(const ShardedTensor& x, int64_t dim, bool keepdim = false);

ShardedTensor matmul(const ShardedTensor& a, const ShardedTensor& b);
// act(x @ weight^T + bias), as tessera::linear. Megatron's column split (weight and bias split
// on their first dim) keeps the output split on its last dim; a split contraction dim gives a
// Partial sum only without bias and activation.
ShardedTensor linear(const ShardedTensor& x, const ShardedTensor& weight, const ShardedTensor& bias = {},
                     Activation activation = Activation::none);
ShardedTensor softmax(const ShardedTensor& x, int64_t dim = -1);
ShardedTensor log_softmax(const ShardedTensor& x, int64_t dim = -1);
ShardedTensor layer_norm(const ShardedTensor& x, const Shape& normalized_shape,
                         const ShardedTensor& weight = {}, const ShardedTensor& bias = {},
                         double eps = 1e-5);
// tensor/ops.h's add_layer_norm: {x + r, layer_norm(x + r)}, split on leading dims alike.
struct ShardedAddLayerNorm {
  ShardedTensor sum, normed;
};
ShardedAddLayerNorm add_layer_norm(const ShardedTensor& x, const ShardedTensor& r,
                                   const Shape& normalized_shape, const ShardedTensor& weight = {},
                                   const ShardedTensor& bias = {}, double eps = 1e-5);
ShardedTensor cross_entropy(const ShardedTensor& logits, const ShardedTensor& target,
                            Reduction reduction = Reduction::mean, int64_t ignore_index = -100);
// The mask of element i is the single-device mask of element i (counter-based RNG keyed by
// the global index), whatever the placements.
ShardedTensor dropout(const ShardedTensor& x, double p, bool training = true);
ShardedTensor conv2d(const ShardedTensor& x, const ShardedTensor& weight, const ShardedTensor& bias = {},
                     std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0});
ShardedTensor max_pool2d(const ShardedTensor& x, std::array<int64_t, 2> kernel_size,
                         std::array<int64_t, 2> stride = {0, 0}, std::array<int64_t, 2> padding = {0, 0});
// q, k, v [B, H, T, D] -> out (the logsumexp stays internal, as in tessera::attention).
ShardedTensor attention(const ShardedTensor& q, const ShardedTensor& k, const ShardedTensor& v,
                        bool causal = true, double scale = 0.0);
// qkv [3, B, T, C] -> out [B, T, C] (tessera::attention_qkv): a split batch or a split of C
// into whole heads computes locally.
ShardedTensor attention_qkv(const ShardedTensor& qkv, int64_t head_dim, bool causal = true,
                            double scale = 0.0);
ShardedTensor embedding(const ShardedTensor& weight, const ShardedTensor& indices);
ShardedTensor index_select(const ShardedTensor& x, int64_t dim, const ShardedTensor& index);
ShardedTensor index_add(const ShardedTensor& x, int64_t dim, const ShardedTensor& index,
                        const ShardedTensor& source);
ShardedTensor gather(const ShardedTensor& x, int64_t dim, const ShardedTensor& index);
ShardedTensor scatter_add(const ShardedTensor& x, int64_t dim, const ShardedTensor& index,
                          const ShardedTensor& src);
// {values, indices}, as tessera::topk.
std::vector<ShardedTensor> topk(const ShardedTensor& x, int64_t k, int64_t dim = -1);
ShardedTensor cast(const ShardedTensor& x, DType dtype);
ShardedTensor clone(const ShardedTensor& x);

ShardedTensor view(const ShardedTensor& x, const Shape& shape);
ShardedTensor permute(const ShardedTensor& x, const std::vector<int64_t>& order);
ShardedTensor transpose(const ShardedTensor& x, int64_t d0, int64_t d1);
ShardedTensor slice(const ShardedTensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
ShardedTensor expand(const ShardedTensor& x, const Shape& shape);
ShardedTensor squeeze(const ShardedTensor& x, const std::vector<int64_t>& dims = {});
ShardedTensor unsqueeze(const ShardedTensor& x, int64_t dim);
ShardedTensor cat(const std::vector<ShardedTensor>& tensors, int64_t dim = 0);
ShardedTensor stack(const std::vector<ShardedTensor>& tensors, int64_t dim = 0);
std::vector<ShardedTensor> split(const ShardedTensor& x, int64_t split_size, int64_t dim = 0);

ShardedTensor full(const Shape& shape, double value, const MeshPtr& mesh, const Placements& placements,
                   DType dtype = DType::f32);
ShardedTensor zeros(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                    DType dtype = DType::f32);
ShardedTensor ones(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                   DType dtype = DType::f32);
// Drawn at (seed, offset) as tessera::randn with a Generator at that state would draw them.
ShardedTensor randn(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                    uint64_t seed, uint64_t offset = 0, DType dtype = DType::f32);
ShardedTensor rand(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                   uint64_t seed, uint64_t offset = 0, DType dtype = DType::f32);
ShardedTensor arange(double start, double end, double step, const MeshPtr& mesh,
                     const Placements& placements, DType dtype = DType::f32);

}  // namespace tessera::parallel
