#include "autograd/engine.h"

#include <queue>
#include <unordered_map>

#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

struct ByLatest {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr() < b->sequence_nr(); }
};

void accumulate_into(Tensor& slot, Tensor g) {
  if (!g.defined()) return;
  slot = slot.defined() ? slot + g : std::move(g);
}

}  // namespace

std::vector<Tensor> run_backward(const std::vector<Tensor>& roots,
                                 const std::vector<Tensor>& grads, bool retain_graph,
                                 bool accumulate, const std::vector<Tensor>& capture) {
  TS_CHECK(grads.empty() || grads.size() == roots.size(),
           "backward: {} gradients given for {} roots", grads.size(), roots.size());
  NoGradGuard no_grad;
  // Each derivative runs in the dtypes its forward saw; autocast would re-cast gradients.
  AutocastGuard no_autocast(DType::f32);

  // Keeps every node alive while the engine holds raw pointers to it.
  std::unordered_map<Node*, std::shared_ptr<Node>> alive;
  std::unordered_map<Node*, int> deps;
  std::unordered_map<Node*, std::vector<Tensor>> buffers;

  std::vector<Edge> root_edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    TS_CHECK(r.defined(), "backward: root {} is undefined", i);
    Edge e = gradient_edge(r);
    TS_CHECK(e.valid(), "backward: root {} (shape {}) does not require grad and has no grad_fn",
             i, shape_str(r.shape()));
    Tensor g = grads.empty() ? Tensor() : grads[i];
    if (!g.defined()) {
      TS_CHECK(r.numel() == 1, "backward: root {} has shape {}; a gradient is only implicit for "
               "one-element roots", i, shape_str(r.shape()));
      g = ones_like(r);
    }
    TS_CHECK(g.shape() == r.shape() && g.dtype() == r.dtype(),
             "backward: gradient {} {} does not match root {} {} {}", shape_str(g.shape()),
             g.dtype(), i, shape_str(r.shape()), r.dtype());
    auto& buf = buffers[e.fn.get()];
    buf.resize(e.fn->num_outputs());
    accumulate_into(buf[e.input_nr], g);
    alive[e.fn.get()] = e.fn;
    root_edges.push_back(std::move(e));
  }

  // Count, for every reachable node, the edges that lead into it.
  std::vector<Node*> stack;
  for (const Edge& e : root_edges) {
    if (deps.emplace(e.fn.get(), 0).second) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      auto [it, inserted] = deps.emplace(e.fn.get(), 0);
      ++it->second;
      if (inserted) {
        alive[e.fn.get()] = e.fn;
        stack.push_back(e.fn.get());
      }
    }
  }

  // Where captured gradients arrive: (node, output slot) -> result index.
  std::vector<Tensor> captured(capture.size());
  std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> capture_at;
  for (size_t i = 0; i < capture.size(); ++i) {
    Edge e = gradient_edge(capture[i]);
    if (!e.valid()) continue;
    capture_at[e.fn.get()].push_back({e.input_nr, i});
    alive[e.fn.get()] = e.fn;
  }

  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  for (const Edge& e : root_edges) {
    if (deps[e.fn.get()] == 0) {
      deps[e.fn.get()] = -1;  // queued
      ready.push(e.fn.get());
    }
  }

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> in = std::move(buffers[node]);
    buffers.erase(node);
    in.resize(node->num_outputs());
    node->run_pre_hooks(in);
    const bool is_leaf = dynamic_cast<AccumulateGrad*>(node) != nullptr;
    bool skip = is_leaf && !accumulate;
    if (auto it = capture_at.find(node); it != capture_at.end()) {
      for (auto [slot, idx] : it->second) captured[idx] = in[slot];
      skip = skip || is_leaf;
    }
    std::vector<Tensor> out;
    if (!skip) out = node->apply(std::move(in));
    if (!retain_graph) node->release_saved();

    const auto& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (i < out.size() && out[i].defined()) {
        auto& buf = buffers[e.fn.get()];
        buf.resize(e.fn->num_outputs());
        accumulate_into(buf[e.input_nr], std::move(out[i]));
      }
      if (--deps[e.fn.get()] == 0) {
        deps[e.fn.get()] = -1;
        ready.push(e.fn.get());
      }
    }
  }
  return captured;
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph) {
  run_backward(roots, grads, retain_graph, /*accumulate=*/true, {});
}

std::vector<Tensor> grad(const std::vector<Tensor>& roots, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grads, bool retain_graph) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    TS_CHECK(inputs[i].defined() && inputs[i].requires_grad(),
             "grad: input {} does not require grad", i);
  }
  return run_backward(roots, grads, retain_graph, /*accumulate=*/false, inputs);
}

}  // namespace tessera::autograd

namespace tessera {

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::backward({*this}, {grad}, retain_graph);
}

void Tensor::register_hook(GradHook hook) const {
  TS_CHECK(requires_grad(), "register_hook: tensor does not require grad");
  if (grad_fn() != nullptr) {
    grad_fn()->add_output_hook(output_nr(), std::move(hook));
  } else {
    ensure_autograd_meta().hooks.push_back(std::move(hook));
  }
}

void Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const {
  TS_CHECK(requires_grad() && is_leaf(),
           "register_post_accumulate_grad_hook: only leaves that require grad accumulate .grad");
  ensure_autograd_meta().post_accumulate_hooks.push_back(std::move(hook));
}

void Tensor::retain_grad() const {
  TS_CHECK(requires_grad(), "retain_grad: tensor does not require grad");
  AutogradMeta& meta = ensure_autograd_meta();
  if (is_leaf() || meta.retains_grad) return;  // leaves keep .grad anyway
  meta.retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_ptr();
  grad_fn()->add_output_hook(output_nr(), [weak](const Tensor& g) {
    if (auto impl = weak.lock()) {
      Tensor self(impl);
      Tensor current = self.grad();
      self.ensure_autograd_meta().grad = current.defined() ? current + g : tessera::clone(g);
    }
    return Tensor();
  });
}

}  // namespace tessera
