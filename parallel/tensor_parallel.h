// Tensor parallelism as a plan applied to a module (DTensor's parallelize_module): a plan maps
// parameter path patterns to a placement on the tensor-parallel mesh axis, styles build the
// usual entries, and a layout says where a forward's activations live. A model writes its
// forward once over the tensor type (Tensor or ShardedTensor) and runs it with SingleDevice
// or with ShardedParameters + TpLayout; the sharding rules then place the collectives.
//
//   TpPlan plan = column_wise("mlp.c_fc") + row_wise("mlp.c_proj");   // "*": one component
//   ShardedParameters params(model, mesh, plan);      // every parameter, sharded or Replicate
//   TpLayout layout(mesh);                            // batch S(0) on "dp", stream whole on "tp"
//   ShardedTensor y = my_forward(layout, params, layout.input(x));   // the single-device code
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "autograd/checkpoint.h"
#include "nn/module.h"
#include "parallel/ops.h"
#include "tensor/allocator.h"

namespace tessera::parallel {

// ---- plans ---------------------------------------------------------------------------------

struct TpRule {
  std::string pattern;  // dotted parameter path; "*" matches one component ("h.*.mlp.c_fc.weight")
  Placement placement = Replicate();  // on the tensor-parallel axis
  // > 1: dim 0 stacks `groups` equal blocks (a fused q, k, v projection); the parameter is
  // viewed [groups, dim0 / groups, ...] and `placement` applies to that view, so a split of
  // dim 1 gives each rank the same slice of every block.
  int64_t groups = 1;
};
using TpPlan = std::vector<TpRule>;

TpPlan operator+(TpPlan a, const TpPlan& b);
// Whether `path` matches `pattern` component by component ("*" matches any one component).
bool path_matches(const std::string& pattern, const std::string& path);

// ---- styles (each names a layer by its path pattern: "h.*.mlp.c_fc") ---------------------
// Column-wise: a Linear's output features split (weight [out, in] and bias on dim 0); its
// input must be whole on tp, its output is split on the last dim. With groups > 1 each of
// the stacked blocks of the output features is split alike (a fused qkv: whole heads).
TpPlan column_wise(const std::string& linear, int64_t groups = 1);
// Row-wise: a Linear's input features split (weight dim 1); the product is Partial and the
// bias stays whole (added once, after the layout constraint reduces the product).
TpPlan row_wise(const std::string& linear);
// Vocab-parallel: an Embedding's rows split: the lookup is a masked local gather (a Partial
// sum), and a head tied to it produces logits split over the vocabulary.
TpPlan vocab_parallel(const std::string& embedding);

// ---- applying a plan -----------------------------------------------------------------------

// A module's parameters as ShardedTensors on `mesh`: on `tp_axis` as the first matching rule
// says (Replicate when none matches), Replicate on every other axis. Every rank passes the
// same values (one seed). Indexing by path makes it the parameter accessor of a forward
// written over the tensor type.
class ShardedParameters {
 public:
  // `keep` (when given) selects the parameters to shard, by path (a pipeline stage keeps
  // only its layers'). Error when a grouped rule's dim 0 does not divide into its groups.
  ShardedParameters(const nn::Module& module, MeshPtr mesh, const TpPlan& plan,
                    const std::string& tp_axis = "tp",
                    const std::function<bool(const std::string&)>& keep = nullptr);

  // The parameter at `path` (its grouped view where the plan gives one), or the buffer (whole
  // on every rank, sharing the module's storage, so the module's in-place updates show);
  // Error when absent.
  const ShardedTensor& operator()(const std::string& path) const;
  const std::map<std::string, ShardedTensor>& all() const { return params_; }
  // Swaps in another handle for a parameter's local block (same shape and dtype): a wrapper
  // that registers the blocks in a module of its own hands its handles back.
  void replace_local(const std::string& path, const Tensor& local);
  // The gradient in the single-device parameter's shape, gathered (collective).
  Tensor full_grad(const std::string& path) const;

 private:
  MeshPtr mesh_;
  std::map<std::string, ShardedTensor> params_;
  std::map<std::string, ShardedTensor> buffers_;
  std::map<std::string, Shape> shapes_;  // single-device shapes
};

// A plain module's parameters and buffers by dotted path: the same accessor for the
// single-device run.
class ModuleParameters {
 public:
  explicit ModuleParameters(const nn::Module& module);
  const Tensor& operator()(const std::string& path) const;

 private:
  std::map<std::string, Tensor> params_;
};

// ---- activation layouts -------------------------------------------------------------------
// A forward written over the layout calls input / replicate on plain tensors entering it,
// stream on the residual stream, column_input before a column-wise product or a tied head,
// region around the work that runs on the stream's layout, and cross_entropy for its loss.

// One device: every hook is the identity and the loss the fused cross_entropy.
struct SingleDevice {
  using Tensor = tessera::Tensor;
  Tensor input(const Tensor& t) const { return t; }
  Tensor replicate(const Tensor& t) const { return t; }
  Tensor stream(const Tensor& x) const { return x; }
  Tensor column_input(const Tensor& x) const { return x; }
  template <class F>
  Tensor region(F&& fn) const { return fn(); }
  // fn(inputs); when `on`, only the inputs are kept for backward, which reruns fn
  // (autograd::checkpoint: activation recomputation).
  template <class F>
  std::vector<Tensor> recompute(bool on, F&& fn, const std::vector<Tensor>& inputs) const {
    return on ? autograd::checkpoint(std::forward<F>(fn), inputs) : fn(inputs);
  }
  // logits [N, V], targets [N]: the mean over rows.
  Tensor cross_entropy(const Tensor& logits, const Tensor& targets) const;
};

// Megatron's layout on a mesh with a tensor-parallel axis and (optionally) a batch axis:
// inputs split over the batch axis; the residual stream whole on tp (its row-wise products
// are all-reduced into it, its gradient all-reduced where it meets column-wise weights) or,
// with sequence parallelism, split along the sequence (dim 1) on tp.
class TpLayout {
 public:
  using Tensor = ShardedTensor;
  explicit TpLayout(MeshPtr mesh, std::string tp_axis = "tp", std::string batch_axis = "dp");

  ShardedTensor input(const tessera::Tensor& t) const;      // S(0) on the batch axis
  ShardedTensor replicate(const tessera::Tensor& t) const;  // whole on every rank
  ShardedTensor stream(const ShardedTensor& x) const;       // the stream's layout
  ShardedTensor column_input(const ShardedTensor& x) const;  // whole on tp
  template <class F>
  ShardedTensor region(F&& fn) const {
    if (region_tracker_ == nullptr) return fn();
    MemoryScope scope(region_tracker_);
    return fn();
  }
  // fn(inputs); when `on`, only the inputs' local blocks are kept for backward, which reruns
  // fn on them (autograd::checkpoint sees the local tensors; fn sees them wrapped again with
  // the inputs' placements). fn's outputs keep the layouts of its first run.
  template <class F>
  std::vector<ShardedTensor> recompute(bool on, F&& fn, const std::vector<ShardedTensor>& inputs) const {
    if (!on) return fn(inputs);
    // Layouts only: the function (kept by the checkpoint until backward) must not hold a
    // tensor, or the outputs' graph would point back at it (a cycle that is never freed).
    struct Layout {
      MeshPtr mesh;
      Placements placements;
      Shape shape;
    };
    std::vector<tessera::Tensor> locals;
    std::vector<Layout> in_layouts;
    for (const ShardedTensor& x : inputs) {
      locals.push_back(x.local());
      in_layouts.push_back({x.mesh_ptr(), x.placements(), x.shape()});
    }
    auto out_layouts = std::make_shared<std::vector<Layout>>();  // the first run's
    std::vector<tessera::Tensor> out = autograd::checkpoint(
        [fn, in_layouts, out_layouts](const std::vector<tessera::Tensor>& in) {
          std::vector<ShardedTensor> wrapped;
          for (size_t i = 0; i < in.size(); ++i) {
            wrapped.emplace_back(in[i], in_layouts[i].mesh, in_layouts[i].placements, in_layouts[i].shape);
          }
          const std::vector<ShardedTensor> y = fn(wrapped);
          std::vector<tessera::Tensor> local;
          const bool first = out_layouts->empty();
          for (const ShardedTensor& t : y) {
            local.push_back(t.local());
            if (first) out_layouts->push_back({t.mesh_ptr(), t.placements(), t.shape()});
          }
          return local;
        },
        locals);
    std::vector<ShardedTensor> result;
    for (size_t i = 0; i < out.size(); ++i) {
      const Layout& o = (*out_layouts)[i];
      result.emplace_back(out[i], o.mesh, o.placements, o.shape);
    }
    return result;
  }
  // Vocab-parallel mean cross-entropy of logits [N, V] (the vocabulary split on tp) against
  // targets [N]: max, sum of exponentials and the target's logit are reductions over the
  // split vocabulary, so only [N] statistics cross ranks, never the logits. A scalar, whole
  // on every rank.
  ShardedTensor cross_entropy(const ShardedTensor& logits, const ShardedTensor& targets) const;

  // This rank's block of the stream as a sharded tensor of `global_shape` (differentiable:
  // the gradient reaches `local`); a pipeline stage wraps what it received with it.
  ShardedTensor wrap_stream(const tessera::Tensor& local, const Shape& global_shape) const;
  // Sequence parallelism (Korthikanti et al.): the stream split along dim 1 on tp, gathered
  // entering each column-wise product, reduce-scattered out of each row-wise one. When
  // `region_tracker` is given, what region() allocates is charged to it.
  void set_sequence_parallel(bool on, MemoryTracker* region_tracker = nullptr);

  const MeshPtr& mesh() const { return mesh_; }
  const std::string& tp_axis() const { return tp_axis_; }

 private:
  MeshPtr mesh_;
  std::string tp_axis_;
  Placements column_;  // S(0) on the batch axis, whole elsewhere
  Placements stream_;  // the same, or S(1) on tp
  MemoryTracker* region_tracker_ = nullptr;
};

}  // namespace tessera::parallel
