// The op tables and call() (op.h): the one path from an op name to a kernel and the graph.
#include <new>
#include <system_error>
#include <unordered_map>
#include <unordered_set>

#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/op.h"

namespace tessera {
namespace {

constexpr OpInfo kOpInfos[] = {
#define TS_OP_INFO(name, kind, grad, family, props)                                 \
  OpInfo{OpId::name, #name, OpKind::kind, std::string_view(#grad) == "Diff", OpFamily::family, \
         OpProps::props},
    TS_OP_LIST(TS_OP_INFO)
#undef TS_OP_INFO
};
static_assert(std::size(kOpInfos) == kNumOps);

struct Tables {
  MetaFn meta[kNumOps] = {};
  ViewFn view[kNumOps] = {};
  KernelFn kernel[kNumDeviceTypes][kNumOps] = {};
  GraphRecorder recorder = nullptr;
  KernelObserver observer = nullptr;
};

// Filled during static initialisation (registrars in kernels/, tensor/, autograd/), read-only
// afterwards, so lookups take no lock.
Tables& tables() {
  static Tables* t = new Tables;
  return *t;
}

int index_of(OpId op) { return static_cast<int>(op); }

bool any_requires_grad(std::span<const Tensor> inputs) {
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

void maybe_record(OpId op, std::span<const Tensor> inputs, std::span<Tensor> outputs,
                  const Attrs& attrs) {
  GraphRecorder recorder = tables().recorder;
  if (recorder == nullptr || !GradMode::enabled() || !op_info(op).differentiable) return;
  if (!any_requires_grad(inputs)) return;
  recorder(op, inputs, outputs, attrs);
}

// The device whose kernel table serves this call. Copies between devices are served by the
// non-CPU side, which knows how to move bytes to and from the host.
Device dispatch_device(OpId op, std::span<const Tensor> inputs, const Attrs& attrs) {
  const std::string_view name = op_name(op);
  if (op_info(op).kind == OpKind::Factory) return attrs.device;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (t.defined() && t.storage()->released()) [[unlikely]] {
      fail("{}: input {} {} has released storage: its bytes were freed (a ZeRO-3 parameter "
           "outside its unit's forward and backward; call the module through operator() so "
           "the unit's hooks gather it, or gather the full parameters first)",
           name, i, shape_str(t.shape()));
    }
  }
  if (op == OpId::to_device) return inputs[0].device().is_cpu() ? attrs.device : inputs[0].device();
  if (op == OpId::copy_) return inputs[0].device().is_cpu() ? inputs[1].device() : inputs[0].device();
  // 0-d CPU tensors are scalars and may join tensors on any device, as in PyTorch.
  auto is_scalar = [](const Tensor& t) { return t.dim() == 0 && t.device().is_cpu(); };
  Device device = inputs[0].device();
  for (const Tensor& t : inputs) {
    if (t.defined() && !is_scalar(t)) {
      device = t.device();
      break;
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (t.defined() && t.device() != device && !is_scalar(t)) {
      fail("{}: inputs are on different devices ({} and {} for input {}); move them with "
           ".to() first", name, device, t.device(), i);
    }
  }
  return device;
}

KernelFn find_kernel(OpId op, Device device) {
  KernelFn fn = tables().kernel[static_cast<int>(device.type)][index_of(op)];
  if (fn == nullptr) {
    fail("{}: no kernel for device {} (is its backend linked in? CUDA needs --config=cuda)",
         op_name(op), device);
  }
  return fn;
}

// Shape inference for `inputs`: validates them (throwing Error naming the op) and returns
// the output specs.
std::vector<TensorSpec> infer(OpId op, std::span<const Tensor> inputs, const Attrs& attrs) {
  MetaFn meta = meta_fn(op);
  if (meta == nullptr) fail("{}: no shape inference registered", op_name(op));
  std::vector<TensorSpec> in_specs;
  in_specs.reserve(inputs.size());
  for (const Tensor& t : inputs) in_specs.push_back(TensorSpec::of(t));
  return meta(in_specs, attrs);
}

// A tensor written in place must not be an expanded view (elements sharing memory).
void reject_expanded(std::string_view op, const std::string& what, const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.strides()[d] == 0 && t.shape()[d] > 1) {
      fail("{}: {} {} with strides {} is an expanded view and is written in place: several of "
           "its elements share one memory location; clone() it first",
           op, what, shape_str(t.shape()), shape_str(t.strides()));
    }
  }
}

// Inputs' shapes for an error message: "[2, 3] f32, [3] f32".
std::string inputs_str(std::span<const Tensor> inputs) {
  std::string out;
  for (const Tensor& t : inputs) {
    if (!out.empty()) out += ", ";
    out += t.defined() ? fmt::format("{} {}", shape_str(t.shape()), t.dtype()) : "undefined";
  }
  return out;
}

std::vector<Tensor> allocate_outputs(OpId op, const std::vector<TensorSpec>& specs) {
  std::vector<Tensor> outputs;
  outputs.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (!s.defined) {
      outputs.emplace_back();
      continue;
    }
    try {
      outputs.push_back(Tensor::empty(s.shape, s.dtype, s.device));
    } catch (const std::bad_alloc&) {
      fail("{}: out of memory allocating output {} ({} {} on {})", op_name(op), i,
           shape_str(s.shape), s.dtype, s.device);
    } catch (const Error& e) {
      fail("{}: cannot allocate output {} ({} {} on {}): {}", op_name(op), i, shape_str(s.shape),
           s.dtype, s.device, e.what());
    }
  }
  return outputs;
}

// Runs a kernel; scratch allocations and worker threads inside it fail as Errors naming the op
// (a try block costs nothing on the path that does not throw).
void run_kernel(KernelFn kernel, OpId op, Device device, std::span<const Tensor> inputs,
                std::span<Tensor> outputs, const Attrs& attrs) {
  try {
    kernel(inputs, outputs, attrs);
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory in the {} kernel (inputs {})", op_name(op), device,
         inputs_str(inputs));
  } catch (const std::system_error& e) {
    fail("{}: the {} kernel failed: {} (inputs {})", op_name(op), device, e.what(),
         inputs_str(inputs));
  }
}

// An op whose device has no kernel of its own runs the CPU kernel on staged copies: the
// inputs copied to the host, the outputs copied back into the device tensors call()
// allocated. Correct everywhere at the cost of two copies; //tests:coverage_test lists
// which ops have a kernel on which device.
void run_on_cpu(OpId op, std::span<const Tensor> inputs, std::span<Tensor> outputs,
                const std::vector<TensorSpec>& out_specs, const Attrs& attrs) {
  NoGradGuard no_grad;  // the caller records the op itself, on the device tensors
  std::vector<Tensor> host_in;
  host_in.reserve(inputs.size());
  for (const Tensor& t : inputs) host_in.push_back(t.defined() ? t.to(kCPU) : t);
  std::vector<TensorSpec> host_specs = out_specs;  // the same outputs, on the host
  for (TensorSpec& s : host_specs) s.device = kCPU;
  std::vector<Tensor> host_out = allocate_outputs(op, host_specs);
  run_kernel(find_kernel(op, kCPU), op, kCPU, host_in, host_out, attrs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined()) call_copy_(outputs[i], host_out[i]);
  }
}

// The same for an in-place op (call_inplace): each input's storage copied to the host once
// (inputs sharing memory on the device share it on the host, so the CPU kernel's overlap
// checks and any aliasing see what the device holds), the CPU kernel run on views of the
// copies with the inputs' offsets and strides, and the storages it writes copied back.
void run_inplace_on_cpu(OpId op, std::span<const Tensor> inputs, const Attrs& attrs,
                        const std::vector<size_t>& written) {
  NoGradGuard no_grad;
  struct Copy {
    Tensor device, host;  // the whole storage as bytes
  };
  std::unordered_map<const StorageImpl*, Copy> copies;
  std::vector<Tensor> host;
  host.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      host.push_back(t);
      continue;
    }
    auto it = copies.find(t.storage().get());
    if (it == copies.end()) {
      const Tensor bytes =
          Tensor::from_storage(t.storage(), {t.storage()->nbytes()}, {1}, 0, DType::u8);
      it = copies.emplace(t.storage().get(), Copy{bytes, bytes.to(kCPU)}).first;
    }
    host.push_back(Tensor::from_storage(it->second.host.storage(), t.shape(), t.strides(),
                                        t.offset(), t.dtype()));
  }
  run_kernel(find_kernel(op, kCPU), op, kCPU, host, std::span<Tensor>(), attrs);
  std::unordered_set<const StorageImpl*> done;
  for (size_t i : written) {
    if (i < inputs.size() && inputs[i].defined() && done.insert(inputs[i].storage().get()).second) {
      const Copy& c = copies.at(inputs[i].storage().get());
      call_copy_(c.device, c.host);
    }
  }
}

}  // namespace

const OpInfo& op_info(OpId op) { return kOpInfos[index_of(op)]; }
std::span<const OpInfo> all_ops() { return kOpInfos; }
std::string_view op_name(OpId op) { return kOpInfos[index_of(op)].name; }

std::string_view activation_name(Activation a) {
  switch (a) {
    case Activation::none: return "none";
    case Activation::relu: return "relu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
  }
  return "unknown";
}

void register_meta(OpId op, MetaFn fn) { tables().meta[index_of(op)] = fn; }
void register_kernel(DeviceType device, OpId op, KernelFn fn) {
  tables().kernel[static_cast<int>(device)][index_of(op)] = fn;
}
void register_view(OpId op, ViewFn fn) { tables().view[index_of(op)] = fn; }
void set_graph_recorder(GraphRecorder recorder) { tables().recorder = recorder; }
void set_kernel_observer(KernelObserver observer) { tables().observer = observer; }
KernelObserver kernel_observer() { return tables().observer; }

MetaFn meta_fn(OpId op) { return tables().meta[index_of(op)]; }
KernelFn kernel_fn(DeviceType device, OpId op) {
  return tables().kernel[static_cast<int>(device)][index_of(op)];
}
ViewFn view_fn(OpId op) { return tables().view[index_of(op)]; }

std::vector<Tensor> call(OpId op, std::vector<Tensor> inputs, const Attrs& attrs) {
  const OpInfo& info = op_info(op);
  if (info.kind != OpKind::Compute && info.kind != OpKind::Factory) {
    fail("{}: is a {} op and cannot be called through call()", info.name,
         info.kind == OpKind::View ? "view" : "composite");
  }
  if (info.kind == OpKind::Compute && (inputs.empty() || !inputs[0].defined())) {
    fail("{}: input 0 is an undefined tensor", info.name);
  }
  if (autocast_enabled()) [[unlikely]] autocast_inputs(op, inputs);
  // Autocast's cast of a parameter: served from the cast cache when it holds one (autocast.h).
  const bool cached_cast = op == OpId::cast && internal::cast_cache_applies(inputs[0], attrs.dtype);
  if (cached_cast) [[unlikely]] {
    if (Tensor hit = internal::cast_cache_find(inputs[0], attrs.dtype); hit.defined()) {
      std::vector<Tensor> outputs{std::move(hit)};
      maybe_record(op, inputs, outputs, attrs);
      return outputs;
    }
  }
  const Device device = dispatch_device(op, inputs, attrs);
  const std::vector<TensorSpec> out_specs = infer(op, inputs, attrs);
  std::vector<Tensor> outputs;
  if (info.kind == OpKind::Compute && !device.is_cpu() &&
      kernel_fn(device.type, op) == nullptr && kernel_fn(DeviceType::cpu, op) != nullptr) {
    outputs = allocate_outputs(op, out_specs);
    run_on_cpu(op, inputs, outputs, out_specs, attrs);
    if (cached_cast) internal::cast_cache_put(inputs[0], attrs.dtype, outputs[0]);
    maybe_record(op, inputs, outputs, attrs);
    return outputs;
  }
  KernelFn kernel = find_kernel(op, device);

  outputs = allocate_outputs(op, out_specs);
  if (KernelObserver obs = tables().observer) [[unlikely]] {
    obs(op, device, true, inputs);
    try {
      run_kernel(kernel, op, device, inputs, outputs, attrs);
    } catch (...) {
      obs(op, device, false, inputs);  // every begin has its end, also when the kernel throws
      throw;
    }
    obs(op, device, false, inputs);
  } else {
    run_kernel(kernel, op, device, inputs, outputs, attrs);
  }
  if (cached_cast) [[unlikely]] internal::cast_cache_put(inputs[0], attrs.dtype, outputs[0]);
  maybe_record(op, inputs, outputs, attrs);
  return outputs;
}

Tensor call1(OpId op, std::vector<Tensor> inputs, const Attrs& attrs) {
  return call(op, std::move(inputs), attrs)[0];
}

Tensor call_view(OpId op, const Tensor& input, const Attrs& attrs) {
  TS_CHECK(input.defined(), "{}: input is an undefined tensor", op_name(op));
  ViewFn fn = view_fn(op);
  if (fn == nullptr) fail("{}: no view function registered", op_name(op));
  Tensor out = fn(input, attrs);
  maybe_record(op, std::span<const Tensor>(&input, 1), std::span<Tensor>(&out, 1), attrs);
  return out;
}

void call_copy_(const Tensor& dst, const Tensor& src) {
  TS_CHECK(dst.defined() && src.defined(), "copy_: undefined tensor (dst {}, src {})",
           dst.defined() ? "defined" : "undefined", src.defined() ? "defined" : "undefined");
  if (GradMode::enabled() && (src.requires_grad() || dst.requires_grad())) {
    fail("copy_: not differentiable; called with a tensor that requires grad (dst {}, src {}). "
         "Use it under NoGradGuard, or clone()/cast() to keep the graph",
         shape_str(dst.shape()), shape_str(src.shape()));
  }
  reject_expanded("copy_", "destination", dst);
  std::vector<Tensor> inputs = {dst, src};
  const Device device = dispatch_device(OpId::copy_, inputs, Attrs{});
  infer(OpId::copy_, inputs, Attrs{});
  std::vector<Tensor> out = {dst};
  KernelObserver obs = tables().observer;
  if (obs) obs(OpId::copy_, device, true, inputs);
  try {
    run_kernel(find_kernel(OpId::copy_, device), OpId::copy_, device, inputs, out, Attrs{});
  } catch (...) {
    if (obs) obs(OpId::copy_, device, false, inputs);
    throw;
  }
  if (obs) obs(OpId::copy_, device, false, inputs);
  dst.storage()->bump_version();
}

void call_inplace(OpId op, std::vector<Tensor> inputs, const Attrs& attrs,
                  const std::vector<size_t>& written) {
  const OpInfo& info = op_info(op);
  TS_CHECK(info.kind == OpKind::Compute && !info.differentiable,
           "{}: call_inplace runs only non-differentiable Compute ops", info.name);
  TS_CHECK(!inputs.empty() && inputs[0].defined(), "{}: input 0 is an undefined tensor",
           info.name);
  if (GradMode::enabled() && any_requires_grad(inputs)) {
    fail("{}: writes its inputs in place and is not differentiable; called under grad mode "
         "with an input that requires grad (input 0 {}). Call it under NoGradGuard",
         info.name, shape_str(inputs[0].shape()));
  }
  // `written` may name optional trailing inputs that were not passed.
  for (size_t i : written) {
    if (i < inputs.size() && inputs[i].defined()) {
      reject_expanded(info.name, fmt::format("input {}", i), inputs[i]);
    }
  }
  const Device device = dispatch_device(op, inputs, attrs);
  const std::vector<TensorSpec> out_specs = infer(op, inputs, attrs);
  TS_CHECK(out_specs.empty(), "{}: an in-place op's shape inference returned {} outputs",
           info.name, out_specs.size());
  KernelObserver obs = tables().observer;
  if (obs) obs(op, device, true, inputs);
  try {
    if (!device.is_cpu() && kernel_fn(device.type, op) == nullptr &&
        kernel_fn(DeviceType::cpu, op) != nullptr) {
      run_inplace_on_cpu(op, inputs, attrs, written);
    } else {
      run_kernel(find_kernel(op, device), op, device, inputs, std::span<Tensor>(), attrs);
    }
  } catch (...) {
    if (obs) obs(op, device, false, inputs);
    throw;
  }
  if (obs) obs(op, device, false, inputs);
  for (size_t i : written) {
    if (i < inputs.size() && inputs[i].defined()) inputs[i].storage()->bump_version();
  }
}

}  // namespace tessera
