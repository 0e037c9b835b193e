#include "autograd/gradcheck.h"

#include <cmath>

#include "autograd/engine.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::autograd {
namespace {

// Storage offsets (elements) of each logical element of t, in row-major order.
std::vector<int64_t> element_offsets(const Tensor& t) {
  std::vector<int64_t> out(t.numel());
  std::vector<int64_t> idx(t.dim(), 0);
  for (int64_t k = 0; k < t.numel(); ++k) {
    int64_t off = t.offset();
    for (int64_t d = 0; d < t.dim(); ++d) off += idx[d] * t.strides()[d];
    out[k] = off;
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (++idx[d] < t.shape()[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

double project(const Tensor& out, const Tensor& v) {
  return sum(cast(out, DType::f64) * v).item<double>();
}

// Sets one element of x's storage: through the host pointer on the CPU; on a device, by
// copying a host scalar into a one-element view of the storage (ordered with the device's
// work like any op, so the next fn(inputs) sees it).
class Perturber {
 public:
  explicit Perturber(const Tensor& x) : x_(x), host_(x.device().is_cpu()) {}
  void set(int64_t storage_offset, double value) const {
    if (host_) {
      static_cast<double*>(x_.storage()->data())[storage_offset] = value;
      return;
    }
    const Tensor element = Tensor::from_storage(x_.storage(), {}, {}, storage_offset, DType::f64);
    element.copy_(Tensor::from_vector<double>({value}, {}));
  }

 private:
  Tensor x_;
  bool host_;
};

}  // namespace

GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Tensor>& inputs,
                          GradcheckOptions options) {
  std::vector<Tensor> wrt;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (!t.defined() || !t.requires_grad()) continue;
    TS_CHECK(t.dtype() == DType::f64, "gradcheck: input {} must be an f64 tensor, got {} on {}",
             i, t.dtype(), t.device());
    wrt.push_back(t);
  }
  TS_CHECK(!wrt.empty(), "gradcheck: no input requires grad");

  GradcheckResult result;
  const Tensor out = fn(inputs);
  TS_CHECK(out.defined() && is_floating(out.dtype()), "gradcheck: fn must return a floating tensor");
  Generator g(12345);
  // Drawn on the CPU and copied, so the projection is the same on every device.
  const Tensor v = randn(out.shape(), DType::f64, kCPU, &g).to(out.device());
  const Tensor loss = sum(cast(out, DType::f64) * v);
  const std::vector<Tensor> analytical = grad({loss}, wrt);

  NoGradGuard no_grad;
  for (size_t w = 0; w < wrt.size(); ++w) {
    const Tensor& x = wrt[w];
    const std::vector<double> a = analytical[w].defined()
                                      ? analytical[w].to_vector<double>()
                                      : std::vector<double>(x.numel(), 0.0);
    const std::vector<double> values = x.to_vector<double>();  // logical order, as offsets
    const std::vector<int64_t> offsets = element_offsets(x);
    const Perturber element(x);
    for (int64_t k = 0; k < x.numel(); ++k) {
      const double orig = values[k];
      element.set(offsets[k], orig + options.eps);
      const double plus = project(fn(inputs), v);
      element.set(offsets[k], orig - options.eps);
      const double minus = project(fn(inputs), v);
      element.set(offsets[k], orig);
      const double numerical = (plus - minus) / (2 * options.eps);
      const double err = std::abs(a[k] - numerical);
      result.max_abs_error = std::max(result.max_abs_error, err);
      if (!(err <= options.atol + options.rtol * std::abs(numerical)) && result.ok) {
        result.ok = false;
        result.message = fmt::format(
            "gradcheck: input {} (shape {}) element {}: analytical {:.10g} vs numerical {:.10g} "
            "(error {:.3g})", w, shape_str(x.shape()), k, a[k], numerical, err);
      }
    }
  }
  return result;
}

}  // namespace tessera::autograd
