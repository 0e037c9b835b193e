#include "autograd/checkpoint.h"

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/saved_compression.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera::autograd {
namespace {

thread_local int t_recomputing = 0;
struct RecomputeMark {
  RecomputeMark() { ++t_recomputing; }
  ~RecomputeMark() { --t_recomputing; }
  RecomputeMark(const RecomputeMark&) = delete;
  RecomputeMark& operator=(const RecomputeMark&) = delete;
};


class CheckpointNode final : public Node {
 public:
  CheckpointNode(CheckpointFn fn, const std::vector<Tensor>& inputs, uint64_t seed,
                 uint64_t offset, DType autocast)
      : fn_(std::move(fn)), seed_(seed), offset_(offset), autocast_(autocast),
        has_slice_(current_batch_slice() != nullptr),
        slice_(has_slice_ ? *current_batch_slice() : BatchSlice{}) {
    for (const Tensor& t : inputs) {
      mutable_next_edges().push_back(gradient_edge(t));
      saved_.emplace_back(t, /*compressible=*/false);  // the replay starts from exact inputs
      wants_grad_.push_back(t.defined() && t.requires_grad());
    }
  }

  std::string name() const override { return "checkpoint"; }

  void release_saved() override {
    for (SavedTensor& s : saved_) s.reset();
    released_ = true;
  }

  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    TS_CHECK(!released_, "checkpoint: backward through the graph a second time, but its saved "
             "inputs were freed; pass retain_graph = true to the first backward");
    std::vector<Tensor> inputs, wanted;
    for (size_t i = 0; i < saved_.size(); ++i) {
      Tensor t = saved_[i].defined() ? saved_[i].unpack("checkpoint") : Tensor();
      if (wants_grad_[i]) {
        t = t.detach();
        t.requires_grad_(true);
        wanted.push_back(t);
      }
      inputs.push_back(t);
    }
    // Replay the forward's random stream, then restore the caller's.
    Generator& gen = default_generator();
    const uint64_t seed = gen.seed(), offset = gen.offset();
    gen.set_state(seed_, offset_);
    std::vector<Tensor> outputs;
    {
      // The recomputation runs as the forward did: with grad, under its autocast policy and
      // its batch slice (dropout draws the same rows of the masks; a pipeline's backward runs
      // outside the slice its forward ran in).
      GradModeGuard grad_on(true);
      AutocastGuard amp(autocast_, /*cache_casts=*/false);  // (each weight is cast once here)
      const RecomputeMark mark;
      // What the replay saves is read right away: compressing it would only add rounding.
      const SavedCompressionGuard exact({.mode = SavedCompression::none});
      const BatchSliceScope slice(has_slice_ ? &slice_ : nullptr);
      outputs = fn_(inputs);
    }
    gen.set_state(seed, offset);

    std::vector<Tensor> roots, root_grads;
    for (size_t k = 0; k < outputs.size() && k < grads.size(); ++k) {
      if (grads[k].defined() && outputs[k].defined() && outputs[k].requires_grad()) {
        roots.push_back(outputs[k]);
        root_grads.push_back(grads[k]);
      }
    }
    std::vector<Tensor> captured;
    if (!roots.empty()) {
      captured = run_backward(roots, root_grads, /*retain_graph=*/false, /*accumulate=*/true, wanted);
    }
    std::vector<Tensor> result(saved_.size());
    for (size_t i = 0, w = 0; i < saved_.size(); ++i) {
      if (wants_grad_[i]) {
        result[i] = w < captured.size() ? captured[w] : Tensor();
        ++w;
      }
    }
    return result;
  }

 private:
  CheckpointFn fn_;
  uint64_t seed_, offset_;
  DType autocast_;
  bool has_slice_;
  BatchSlice slice_;
  std::vector<SavedTensor> saved_;
  std::vector<bool> wants_grad_;
  bool released_ = false;
};

}  // namespace

bool recomputing() { return t_recomputing > 0; }

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs) {
  if (!GradMode::enabled()) return fn(inputs);
  const Generator& gen = default_generator();
  const uint64_t seed = gen.seed(), offset = gen.offset();
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    // Nothing this pass casts is kept: the point is to hold less until backward.
    const AutocastGuard no_cast_cache(autocast_dtype(), /*cache_casts=*/false);
    outputs = fn(inputs);
  }
  auto node = std::make_shared<CheckpointNode>(fn, inputs, seed, offset, autocast_dtype());
  node->set_num_outputs(static_cast<uint32_t>(outputs.size()));
  for (size_t k = 0; k < outputs.size(); ++k) {
    Tensor& out = outputs[k];
    if (!out.defined() || !is_floating(out.dtype())) continue;
    // An output that is one of the inputs gets its own handle, so the input keeps its graph.
    for (const Tensor& in : inputs) {
      if (out.is_same(in)) {
        out = out.detach();
        break;
      }
    }
    AutogradMeta& meta = out.ensure_autograd_meta();
    meta.grad_fn = node;
    meta.output_nr = static_cast<uint32_t>(k);
  }
  return outputs;
}

}  // namespace tessera::autograd
