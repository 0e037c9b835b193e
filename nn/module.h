// nn::Module: a named tree of parameters, buffers and submodules, as in torch.nn.Module.
// Layers hold their tensors as members and register the same handles here, so
// named_parameters(), state_dict() and the optimizer see exactly what forward() uses.
//
//   class Net : public nn::Module {
//    public:
//     Net() { fc = register_module("fc", std::make_shared<nn::Linear>(784, 10)); }
//     Tensor forward(const Tensor& x) override { return fc->forward(x); }
//     std::shared_ptr<nn::Linear> fc;
//   };
//   Net net;  net.named_parameters();   // {"fc.weight", "fc.bias"}
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensor/ops.h"

namespace tessera::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = std::map<std::string, Tensor>;

class Module {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // One-input forward; modules with other signatures define their own and leave this.
  virtual Tensor forward(const Tensor& x);
  // forward(x) wrapped in the hooks below: what containers (Sequential) and models call on
  // their children, so wrappers such as ZeRO-3 see each unit's forward.
  Tensor operator()(const Tensor& x);

  // Forward hooks, run by operator() in registration order (hooks cannot be removed; one
  // that should stop acting checks its own state). A pre hook runs before forward; a post
  // hook gets the output and may return a replacement (undefined: keep it).
  using ForwardPreHook = std::function<void(Module&)>;
  using ForwardHook = std::function<Tensor(Module&, const Tensor& output)>;
  void register_forward_pre_hook(ForwardPreHook hook) { pre_hooks_.push_back(std::move(hook)); }
  void register_forward_hook(ForwardHook hook) { post_hooks_.push_back(std::move(hook)); }
  // The submodule at a dotted path ("h.0"); Error naming the missing part.
  Module& submodule(const std::string& path);

  const std::string& type_name() const { return type_name_; }

  // ---- the tree -----------------------------------------------------------------------
  // Dotted names ("block.0.weight"), depth first in registration order.
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const {
    return children_;
  }
  int64_t num_parameters() const;

  // ---- mode ---------------------------------------------------------------------------
  // Sets training mode here and in every submodule (Dropout reads it).
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- state --------------------------------------------------------------------------
  // Parameters and buffers by dotted name, detached (they share data with the module).
  StateDict state_dict() const;
  // Copies values in. strict: every module entry must be present and no extra entries may
  // be given. Shapes must match exactly; a dtype difference is cast. Errors list all keys
  // that are missing, unexpected or mis-shaped before anything is modified.
  void load_state_dict(const StateDict& state, bool strict = true);

  // Converts every parameter and buffer in place (all handles see the change); gradients
  // are dropped. Floating-point dtypes only are converted by to(DType).
  void to(DType dtype);
  void to(Device device);
  void zero_grad();

  // A one-line-per-module summary with parameter shapes and the total count.
  std::string str() const;

 protected:
  // Registers `t` (made a leaf requiring grad) and returns the stored handle.
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  Tensor register_buffer(const std::string& name, Tensor t);
  // Puts `t` (made a leaf requiring grad) in the place of this module's own parameter `name`
  // (Error when there is none), keeping its place in the order; returns the stored handle.
  // For a module whose parameters change shape (expert parallelism keeping some experts).
  Tensor replace_parameter(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    check_new_name(name);
    children_.emplace_back(name, module);
    return module;
  }

 private:
  void check_new_name(const std::string& name) const;
  void collect(const std::string& prefix, bool recurse, bool buffers, NamedTensors& out) const;
  void str_into(const std::string& prefix, int depth, std::string& out) const;

  std::string type_name_;
  bool training_ = true;
  NamedTensors parameters_;
  NamedTensors buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<ForwardPreHook> pre_hooks_;
  std::vector<ForwardHook> post_hooks_;
};

}  // namespace tessera::nn
