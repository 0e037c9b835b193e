#include "autograd/node.h"

#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
}

Node::Node() : sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

SavedTensor::SavedTensor(const Tensor& t, bool compressible) {
  if (!t.defined()) return;
  version_ = t.storage()->version();
  packed_ = compressible ? pack_saved(t) : keep_saved(t);
  if (packed_.mode != SavedCompression::none) source_ = t.storage();
}

Tensor SavedTensor::unpack(std::string_view op) const {
  if (!defined()) {
    fail("{}: its saved tensors were already freed by an earlier backward; call backward "
         "with retain_graph = true to backward through the graph twice", op);
  }
  const std::shared_ptr<StorageImpl> source =
      packed_.mode == SavedCompression::none ? packed_.data.storage() : source_.lock();
  if (source != nullptr && source->version() != version_) {
    fail("{}: a tensor of shape {} saved for backward was modified in place (version {} -> "
         "{}); clone it before the in-place update", op, shape_str(packed_.shape), version_,
         source->version());
  }
  return unpack_saved(packed_);
}

void Node::run_pre_hooks(std::vector<Tensor>& grads) const {
  for (uint32_t nr = 0; nr < grads.size() && nr < output_hooks_.size(); ++nr) {
    for (const GradHook& hook : output_hooks_[nr]) {
      if (!grads[nr].defined()) continue;
      Tensor r = hook(grads[nr]);
      if (r.defined()) grads[nr] = std::move(r);
    }
  }
}

AccumulateGrad::AccumulateGrad(Tensor variable) : variable_(std::move(variable)) {
  set_num_outputs(1);
}

void AccumulateGrad::run_pre_hooks(std::vector<Tensor>& grads) const {
  Node::run_pre_hooks(grads);
  const AutogradMeta* meta = variable_.autograd_meta();
  if (meta == nullptr || grads.empty()) return;
  for (const GradHook& hook : meta->hooks) {
    if (!grads[0].defined()) break;
    Tensor r = hook(grads[0]);
    if (r.defined()) grads[0] = std::move(r);
  }
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads) {
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  AutogradMeta& meta = variable_.ensure_autograd_meta();
  NoGradGuard no_grad;
  if (meta.grad.defined()) {
    meta.grad = meta.grad + g;
  } else if (g.is_contiguous() && g.storage().use_count() == 1) {
    meta.grad = std::move(g);  // nothing else sees this buffer: keep it
  } else {
    meta.grad = clone(g);  // .grad must own its memory (g may be a view or shared)
  }
  for (const auto& hook : meta.post_accumulate_hooks) hook(variable_);
  return {};
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn() != nullptr) return {t.grad_fn(), t.output_nr()};
  AutogradMeta& meta = t.ensure_autograd_meta();
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t);
    meta.grad_accumulator = acc;
  }
  return {acc, 0};
}

}  // namespace tessera::autograd
