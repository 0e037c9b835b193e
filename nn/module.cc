#include "nn/module.h"

#include <algorithm>

#include <fmt/format.h>

#include <set>

namespace tessera::nn {
namespace {

// Replaces the data of the tensor every handle shares (TensorImpl) with `src`'s.
void rebind(const Tensor& t, const Tensor& src) {
  TensorImpl* impl = t.impl();
  impl->storage = src.storage();
  impl->shape = src.shape();
  impl->strides = src.strides();
  impl->offset = src.offset();
  impl->dtype = src.dtype();
  if (impl->autograd) impl->autograd->grad = Tensor();
}

bool is_float(DType d) {
  return d == DType::f32 || d == DType::f64 || d == DType::f16 || d == DType::bf16;
}

}  // namespace

Tensor Module::forward(const Tensor&) {
  fail("{}: has no one-input forward(); call its own forward method", type_name_);
}

Tensor Module::operator()(const Tensor& x) {
  for (const ForwardPreHook& hook : pre_hooks_) hook(*this);
  Tensor y = forward(x);
  for (const ForwardHook& hook : post_hooks_) {
    Tensor r = hook(*this, y);
    if (r.defined()) y = std::move(r);
  }
  return y;
}

Module& Module::submodule(const std::string& path) {
  Module* m = this;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = std::min(path.find('.', start), path.size());
    const std::string part = path.substr(start, dot - start);
    auto it = std::find_if(m->children_.begin(), m->children_.end(),
                           [&](const auto& c) { return c.first == part; });
    TS_CHECK(it != m->children_.end(), "{}: has no submodule '{}' (looking up '{}')",
             m->type_name_, part, path);
    m = it->second.get();
    start = dot + 1;
  }
  return *m;
}

void Module::check_new_name(const std::string& name) const {
  TS_CHECK(!name.empty() && name.find('.') == std::string::npos,
           "{}: a parameter, buffer or submodule name must be non-empty and contain no '.', "
           "got '{}'", type_name_, name);
  auto taken = [&](const auto& list) {
    for (const auto& [n, _] : list) {
      if (n == name) return true;
    }
    return false;
  };
  TS_CHECK(!taken(parameters_) && !taken(buffers_) && !taken(children_),
           "{}: the name '{}' is already registered", type_name_, name);
}

Tensor Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_new_name(name);
  TS_CHECK(t.defined(), "{}: parameter '{}' is an undefined tensor", type_name_, name);
  t = t.detach();
  if (requires_grad) t.requires_grad_();
  parameters_.emplace_back(name, t);
  return t;
}

Tensor Module::replace_parameter(const std::string& name, Tensor t) {
  TS_CHECK(t.defined(), "{}: parameter '{}' replaced by an undefined tensor", type_name_, name);
  for (auto& [n, p] : parameters_) {
    if (n != name) continue;
    const bool requires_grad = p.requires_grad();
    t = t.detach();
    if (requires_grad) t.requires_grad_();
    p = t;
    return t;
  }
  fail("{}: no parameter '{}' to replace", type_name_, name);
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  check_new_name(name);
  TS_CHECK(t.defined(), "{}: buffer '{}' is an undefined tensor", type_name_, name);
  buffers_.emplace_back(name, t);
  return t;
}

void Module::collect(const std::string& prefix, bool recurse, bool buffers,
                     NamedTensors& out) const {
  for (const auto& [name, t] : buffers ? buffers_ : parameters_) out.emplace_back(prefix + name, t);
  if (!recurse) return;
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", true, buffers, out);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  collect("", recurse, false, out);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [_, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  collect("", recurse, true, out);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& t : parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [_, child] : children_) child->train(on);
}

StateDict Module::state_dict() const {
  StateDict out;
  for (auto& [name, t] : named_parameters()) out[name] = t.detach();
  for (auto& [name, t] : named_buffers()) out[name] = t.detach();
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  NamedTensors mine = named_parameters();
  for (auto& nb : named_buffers()) mine.push_back(nb);
  std::vector<std::string> missing, mis_shaped, unexpected;
  std::set<std::string> known;
  for (const auto& [name, t] : mine) {
    known.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
    } else if (!it->second.defined() || it->second.shape() != t.shape()) {
      mis_shaped.push_back(fmt::format(
          "{} (module {}, given {})", name, shape_str(t.shape()),
          it->second.defined() ? shape_str(it->second.shape()) : std::string("undefined")));
    }
  }
  for (const auto& [name, _] : state) {
    if (!known.count(name)) unexpected.push_back(name);
  }
  std::string problems;
  if (strict && !missing.empty()) problems += fmt::format("; missing keys: {}", fmt::join(missing, ", "));
  if (strict && !unexpected.empty()) {
    problems += fmt::format("; unexpected keys: {}", fmt::join(unexpected, ", "));
  }
  if (!mis_shaped.empty()) problems += fmt::format("; shape mismatch: {}", fmt::join(mis_shaped, ", "));
  TS_CHECK(problems.empty(), "{}.load_state_dict: {}", type_name_, problems.substr(2));
  NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    auto it = state.find(name);
    if (it != state.end()) t.copy_(it->second.to(t.device()));
  }
}

void Module::to(DType dtype) {
  TS_CHECK(is_float(dtype), "{}.to: only floating-point dtypes convert a module, got {}",
           type_name_, dtype);
  NoGradGuard no_grad;
  for (auto list : {named_parameters(), named_buffers()}) {
    for (auto& [_, t] : list) {
      if (is_float(t.dtype()) && t.dtype() != dtype) rebind(t, t.cast(dtype));
    }
  }
}

void Module::to(Device device) {
  NoGradGuard no_grad;
  for (auto list : {named_parameters(), named_buffers()}) {
    for (auto& [_, t] : list) {
      if (t.device() != device) rebind(t, t.to(device));
    }
  }
}

void Module::zero_grad() {
  for (const Tensor& t : parameters()) {
    if (t.autograd_meta() != nullptr) t.set_grad(Tensor());
  }
}

void Module::str_into(const std::string& prefix, int depth, std::string& out) const {
  out += fmt::format("{:{}}{}{}", "", 2 * depth, prefix.empty() ? "" : prefix + ": ", type_name_);
  std::vector<std::string> shapes;
  for (const auto& [name, t] : parameters_) shapes.push_back(name + " " + shape_str(t.shape()));
  if (!shapes.empty()) out += fmt::format(" ({})", fmt::join(shapes, ", "));
  out += "\n";
  for (const auto& [name, child] : children_) child->str_into(name, depth + 1, out);
}

std::string Module::str() const {
  std::string out;
  str_into("", 0, out);
  out += fmt::format("{} parameters\n", num_parameters());
  return out;
}

}  // namespace tessera::nn
