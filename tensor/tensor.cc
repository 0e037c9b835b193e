#include "tensor/tensor.h"

#include <algorithm>

#include "tensor/grad_mode.h"
#include "tensor/op.h"

namespace tessera {

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  const int64_t nbytes = storage_bytes("empty", shape, dtype_size(dtype));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = make_storage(nbytes, device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::from_storage(Storage storage, const Shape& shape, const Strides& strides,
                            int64_t offset, DType dtype) {
  TS_CHECK(shape.size() == strides.size(), "from_storage: shape {} and strides {} differ in rank",
           shape_str(shape), shape_str(strides));
  // Views (expand, view, slices) build their shapes here: every dim is a size, and the
  // element count must be countable (expand({1 << 40, 1 << 40}) is refused, not wrapped).
  for (int64_t s : shape) {
    TS_CHECK(s >= 0, "from_storage: negative size in shape {}", shape_str(shape));
  }
  numel_of(shape);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const { return shape()[normalize_dim("size", d, dim())]; }
int64_t Tensor::stride(int64_t d) const { return strides()[normalize_dim("stride", d, dim())]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to misplace (PyTorch agrees)
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (impl_->shape[i] == 1) continue;
    if (impl_->strides[i] != expected) return false;
    expected *= impl_->shape[i];
  }
  return true;
}

// ---- autograd state ------------------------------------------------------------------

AutogradMeta& Tensor::ensure_autograd_meta() const {
  if (!impl_->autograd) impl_->autograd = std::make_unique<AutogradMeta>();
  return *impl_->autograd;
}

bool Tensor::requires_grad() const {
  const AutogradMeta* m = autograd_meta();
  return m != nullptr && (m->requires_grad || m->grad_fn != nullptr);
}

Tensor& Tensor::requires_grad_(bool on) {
  TS_CHECK(defined(), "requires_grad_: tensor is undefined");
  TS_CHECK(is_leaf(), "requires_grad_: only leaves can change requires_grad (this tensor was "
                      "computed by an op; use detach() first)");
  TS_CHECK(!on || is_floating(dtype()),
           "requires_grad_: only floating tensors can require grad, got dtype {}", dtype());
  ensure_autograd_meta().requires_grad = on;
  if (on && storage() != nullptr) storage()->mark_grad_leaf();
  return *this;
}

Tensor Tensor::grad() const {
  const AutogradMeta* m = autograd_meta();
  return m != nullptr ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& grad) const {
  if (grad.defined()) {
    TS_CHECK(grad.shape() == shape() && grad.dtype() == dtype(),
             "set_grad: gradient {} {} does not match tensor {} {}", shape_str(grad.shape()),
             grad.dtype(), shape_str(shape()), dtype());
  }
  ensure_autograd_meta().grad = grad;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> kNone;
  const AutogradMeta* m = autograd_meta();
  return m != nullptr ? m->grad_fn : kNone;
}

uint32_t Tensor::output_nr() const {
  const AutogradMeta* m = autograd_meta();
  return m != nullptr ? m->output_nr : 0;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

void Tensor::set_data(const Tensor& src) const {
  TS_CHECK(defined() && src.defined(), "set_data: undefined tensor");
  TS_CHECK(src.shape() == shape() && src.dtype() == dtype(),
           "set_data: source {} {} does not match tensor {} {}", shape_str(src.shape()),
           src.dtype(), shape_str(shape()), dtype());
  impl_->storage = src.impl_->storage;
  if (requires_grad() && is_leaf() && storage() != nullptr) storage()->mark_grad_leaf();
  impl_->strides = src.impl_->strides;
  impl_->offset = src.impl_->offset;
}

Tensor Tensor::detach() const {
  return from_storage(impl_->storage, impl_->shape, impl_->strides, impl_->offset, impl_->dtype);
}

// ---- host transfers --------------------------------------------------------------------

namespace {
Tensor wrap_host(const void* data, DType dt, const Shape& shape) {
  const int64_t nbytes = storage_bytes("copy to/from host", shape, dtype_size(dt));
  auto storage = std::make_shared<StorageImpl>(const_cast<void*>(data), nbytes, kCPU, nullptr);
  return Tensor::from_storage(std::move(storage), shape, contiguous_strides(shape), 0, dt);
}
}  // namespace

void copy_to_host(const Tensor& t, DType as, void* out) {
  NoGradGuard no_grad;
  call_copy_(wrap_host(out, as, t.shape()), t);
}

void copy_from_host(const void* src, DType dt, const Tensor& dst) {
  NoGradGuard no_grad;
  call_copy_(dst, wrap_host(src, dt, dst.shape()));
}

// ---- printing ----------------------------------------------------------------------------

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::string out = fmt::format("Tensor(shape={}, dtype={}, device={}", shape_str(shape()),
                                dtype(), device());
  if (requires_grad()) out += ", requires_grad";
  constexpr int64_t kShown = 16;
  const std::vector<double> values = to_vector<double>();
  const size_t n = std::min<size_t>(values.size(), kShown);
  out += fmt::format(", values=[{:.6g}", fmt::join(values.begin(), values.begin() + n, ", "));
  if (values.size() > n) out += fmt::format(", ... ({} more)", values.size() - n);
  return out + "])";
}

}  // namespace tessera
