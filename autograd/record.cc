// OpNode, the graph node of every recorded op, and the recorder call() invokes.
#include "autograd/derivatives.h"
#include "autograd/node.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

class OpNode final : public Node {
 public:
  OpNode(OpId op, const Attrs& attrs, const Derivative& d, std::span<const Tensor> in,
         std::span<const Tensor> out)
      : op_(op), attrs_(attrs), derivative_(d.fn), differentiable_outputs_(d.differentiable_outputs) {
    auto& edges = mutable_next_edges();
    edges.reserve(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      edges.push_back(gradient_edge(in[i]));
      in_specs_.push_back(TensorSpec::of(in[i]));
      saved_inputs_.push_back(i < 32 && (d.save_inputs >> i & 1u) ? SavedTensor(in[i]) : SavedTensor());
    }
    for (size_t i = 0; i < out.size(); ++i) {
      out_specs_.push_back(TensorSpec::of(out[i]));
      saved_outputs_.push_back(i < 32 && (d.save_outputs >> i & 1u) ? SavedTensor(out[i])
                                                                     : SavedTensor());
    }
    set_num_outputs(static_cast<uint32_t>(out.size()));
    for (const auto& v : {&saved_inputs_, &saved_outputs_}) {
      for (const SavedTensor& t : *v) saves_any_ = saves_any_ || t.defined();
    }
  }

  std::string name() const override { return std::string(op_name(op_)); }

  void release_saved() override {
    for (auto& s : saved_inputs_) s.reset();
    for (auto& s : saved_outputs_) s.reset();
    released_ = true;
  }

  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    bool any = false;
    for (const Tensor& g : grads) any = any || g.defined();
    if (!any) return std::vector<Tensor>(next_edges().size());
    // Multi-output ops: a missing gradient for a differentiable output is zero.
    for (size_t i = 0; i < grads.size(); ++i) {
      const TensorSpec& s = out_specs_[i];
      const bool differentiable = i >= 32 || (differentiable_outputs_ >> i & 1u);
      if (!grads[i].defined() && s.defined && is_floating(s.dtype) && differentiable) {
        grads[i] = zeros(s.shape, s.dtype, s.device);
      }
    }
    std::vector<Tensor> inputs = unpack(saved_inputs_);
    std::vector<Tensor> outputs = unpack(saved_outputs_);
    std::vector<bool> needs(next_edges().size());
    for (size_t i = 0; i < needs.size(); ++i) needs[i] = next_edges()[i].valid();
    const GradCtx ctx{op_, attrs_, inputs, outputs, in_specs_, out_specs_, grads, needs};
    std::vector<Tensor> result = derivative_(ctx);
    result.resize(needs.size());
    for (size_t i = 0; i < result.size(); ++i) {
      if (!needs[i] || !result[i].defined()) {
        result[i] = Tensor();
        continue;
      }
      const TensorSpec& s = in_specs_[i];
      TS_CHECK(result[i].shape() == s.shape && result[i].dtype() == s.dtype,
               "{} backward: gradient for input {} is {} {}, expected {} {}", name(), i,
               shape_str(result[i].shape()), result[i].dtype(), shape_str(s.shape), s.dtype);
    }
    return result;
  }

 private:
  std::vector<Tensor> unpack(const std::vector<SavedTensor>& saved) const {
    if (released_ && saves_any_) {
      fail("{}: backward through the graph a second time, but its saved tensors were freed; "
           "pass retain_graph = true to the first backward", op_name(op_));
    }
    std::vector<Tensor> out(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (saved[i].defined()) out[i] = saved[i].unpack(op_name(op_));
    }
    return out;
  }

  OpId op_;
  Attrs attrs_;
  DerivativeFn derivative_;
  uint32_t differentiable_outputs_;
  std::vector<TensorSpec> in_specs_, out_specs_;
  std::vector<SavedTensor> saved_inputs_, saved_outputs_;
  bool saves_any_ = false;
  bool released_ = false;
};

void record_op(OpId op, std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Derivative* d = derivative_for(op);
  if (d == nullptr) fail("{}: marked differentiable but has no derivative registered", op_name(op));
  auto node = std::make_shared<OpNode>(op, attrs, *d, in, out);
  for (size_t k = 0; k < out.size(); ++k) {
    if (!out[k].defined() || !is_floating(out[k].dtype())) continue;
    if (k < 32 && !(d->differentiable_outputs >> k & 1u)) continue;
    AutogradMeta& meta = out[k].ensure_autograd_meta();
    meta.grad_fn = node;
    meta.output_nr = static_cast<uint32_t>(k);
  }
}

const bool kRecorderInstalled = (set_graph_recorder(&record_op), true);

}  // namespace

namespace {
struct DerivativeTable {
  Derivative entries[kNumOps];
};
DerivativeTable& table() {
  static DerivativeTable* t = new DerivativeTable;
  return *t;
}
}  // namespace

void register_derivative(OpId op, Derivative d) { table().entries[static_cast<int>(op)] = d; }

const Derivative* derivative_for(OpId op) {
  const Derivative& d = table().entries[static_cast<int>(op)];
  return d.fn != nullptr ? &d : nullptr;
}

}  // namespace tessera::autograd
