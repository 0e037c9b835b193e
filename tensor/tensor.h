// Tensor: storage + shape + strides + offset + dtype (+ device, from the storage), plus the
// autograd state when it takes part in a graph. Copying a Tensor shares it (like a
// shared_ptr); views share storage; clone() copies data.
//
//   Tensor x = randn({4, 3}).requires_grad_();
//   Tensor y = (x * 2.0 + 1.0).sum();
//   y.backward();
//   std::vector<float> g = x.grad().to_vector<float>();   // all 2.0
//
// Ops live in tensor/ops.h; the methods below that compute are thin wrappers over them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/shape.h"
#include "tensor/storage.h"

namespace tessera {

namespace autograd {
class Node;
}

class Tensor;
struct TensorImpl;
struct AutogradMeta;

using GradHook = std::function<Tensor(const Tensor&)>;

class Tensor {
 public:
  Tensor() = default;  // undefined: ops reject it, optional inputs use it for "absent"
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
  // A view of `storage` (no copy).
  static Tensor from_storage(Storage storage, const Shape& shape, const Strides& strides,
                             int64_t offset, DType dtype);
  // Copies host values into a new tensor on `device`.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape,
                            Device device = kCPU);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  const Strides& strides() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  int64_t offset() const;
  DType dtype() const;
  Device device() const;
  const Storage& storage() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype()); }
  bool is_contiguous() const;
  // Same TensorImpl (not just equal values).
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // Raw pointer to the first element (storage + offset). CPU or device memory alike.
  void* raw_data() const;
  // Typed host pointer; throws Error on a dtype mismatch or a non-CPU tensor.
  template <typename T>
  T* data() const;
  // Value of a one-element tensor converted to T (copies from the device if needed).
  template <typename T>
  T item() const;
  // All values in logical (row-major) order, converted to T.
  template <typename T>
  std::vector<T> to_vector() const;

  // ---- autograd -----------------------------------------------------------------------
  bool requires_grad() const;
  // Marks a leaf as requiring grad; returns *this for chaining.
  Tensor& requires_grad_(bool on = true);
  // Accumulated gradient (undefined until a backward reaches this tensor).
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  uint32_t output_nr() const;
  bool is_leaf() const;
  // The methods below to backward() are defined in autograd/ (link //autograd).
  // Keep .grad() on a non-leaf too.
  void retain_grad() const;
  // Runs on the gradient flowing into this tensor; may return a replacement (or undefined
  // to keep it). Leaves run hooks before accumulating.
  void register_hook(GradHook hook) const;
  // Leaves only: runs after the gradient was accumulated into .grad() (data parallel).
  void register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const;
  // Reverse-mode from this tensor. A non-scalar needs `grad`.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  // Shares data, drops the graph.
  Tensor detach() const;
  AutogradMeta* autograd_meta() const;
  AutogradMeta& ensure_autograd_meta() const;

  // ---- views (no copy) ----------------------------------------------------------------
  Tensor reshape(const Shape& shape) const;  // copies only if strides do not allow a view
  Tensor view(const Shape& shape) const;     // never copies; Error if impossible
  Tensor permute(const std::vector<int64_t>& order) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // 2-D transpose
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;  // drops `dim`
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(const std::vector<int64_t>& dims = {}) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor contiguous() const;

  // ---- copies and conversions ---------------------------------------------------------
  Tensor clone() const;
  Tensor cast(DType dtype) const;
  Tensor to(Device device) const;
  // In-place copy from src (broadcast to this shape, cast to this dtype); not differentiable.
  // const like the other methods: it writes the data, not the handle.
  const Tensor& copy_(const Tensor& src) const;
  // Rebinds this tensor (and every handle sharing it: modules, optimizers) to view src's
  // storage, offset and strides, keeping its autograd state (PyTorch's `p.data = src`).
  // Shapes and dtypes must match. ZeRO uses it to make parameters views of flat buffers.
  void set_data(const Tensor& src) const;

  // ---- a few reductions as methods ----------------------------------------------------
  Tensor sum(const std::vector<int64_t>& dims = {}, bool keepdim = false) const;
  Tensor mean(const std::vector<int64_t>& dims = {}, bool keepdim = false) const;

  std::string str() const;  // shape, dtype, device and (a prefix of) the values

 private:
  std::shared_ptr<TensorImpl> impl_;
};

struct AutogradMeta {
  bool requires_grad = false;
  bool retains_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;  // null for leaves
  uint32_t output_nr = 0;
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves: the node accumulating .grad
  std::vector<GradHook> hooks;
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;
};

struct TensorImpl {
  Storage storage;
  Shape shape;
  Strides strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  std::unique_ptr<AutogradMeta> autograd;
};

inline const Shape& Tensor::shape() const { return impl_->shape; }
inline const Strides& Tensor::strides() const { return impl_->strides; }
inline int64_t Tensor::numel() const { return numel_of(impl_->shape); }
inline int64_t Tensor::offset() const { return impl_->offset; }
inline DType Tensor::dtype() const { return impl_->dtype; }
inline Device Tensor::device() const { return impl_->storage->device(); }
inline const Storage& Tensor::storage() const { return impl_->storage; }
inline void* Tensor::raw_data() const {
  return static_cast<char*>(impl_->storage->data()) + impl_->offset * dtype_size(impl_->dtype);
}
inline AutogradMeta* Tensor::autograd_meta() const { return impl_->autograd.get(); }

template <typename T>
T* Tensor::data() const {
  TS_CHECK(defined(), "data: tensor is undefined");
  TS_CHECK(dtype() == dtype_of_v<T>, "data: tensor has dtype {}, requested {}", dtype(),
           dtype_of_v<T>);
  TS_CHECK(device().is_cpu(), "data: tensor is on {}; use .to(cpu) first", device());
  return static_cast<T*>(raw_data());
}

// Copies the tensor's values, in logical order, to host memory as T (f16/bf16/bool/ints
// converted through their natural value).
void copy_to_host(const Tensor& t, DType as, void* out);

template <typename T>
std::vector<T> Tensor::to_vector() const {
  TS_CHECK(defined(), "to_vector: tensor is undefined");
  std::vector<T> out(static_cast<size_t>(numel()));
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> tmp(out.size());
    copy_to_host(*this, DType::b8, tmp.data());
    for (size_t i = 0; i < tmp.size(); ++i) out[i] = tmp[i] != 0;
  } else {
    copy_to_host(*this, dtype_of_v<T>, out.data());
  }
  return out;
}

template <typename T>
T Tensor::item() const {
  TS_CHECK(defined() && numel() == 1, "item: expected a one-element tensor, got shape {}",
           defined() ? shape_str(shape()) : std::string("undefined"));
  return to_vector<T>()[0];
}

// Copies `count` host values of dtype `dt` into the contiguous tensor `dst` (any device).
void copy_from_host(const void* src, DType dt, const Tensor& dst);

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  TS_CHECK(static_cast<int64_t>(values.size()) == numel_of(shape),
           "from_vector: {} values do not fill shape {}", values.size(), shape_str(shape));
  Tensor t = empty(shape, dtype_of_v<T>, device);
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> tmp(values.begin(), values.end());
    copy_from_host(tmp.data(), DType::b8, t);
  } else {
    copy_from_host(values.data(), dtype_of_v<T>, t);
  }
  return t;
}

}  // namespace tessera
