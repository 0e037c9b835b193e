// The f64 reference: AdamW and SGD steps, written from the update rules in PyTorch's
// documentation of torch.optim.AdamW / torch.optim.SGD, one element at a time.
#include <cmath>
#include <stdexcept>

#include "tests/reference/reference.h"

namespace tessera::ref {

namespace {

void require_same_shape(const char* op, const NdArray& a, const NdArray& b) {
  if (a.shape != b.shape) throw std::invalid_argument(std::string(op) + ": shape mismatch");
}

}  // namespace

std::vector<NdArray> adamw(const NdArray& param, const NdArray& grad, const NdArray& exp_avg,
                           const NdArray& exp_avg_sq, int64_t t, double lr, double beta1,
                           double beta2, double eps, double weight_decay) {
  require_same_shape("ref::adamw", param, grad);
  require_same_shape("ref::adamw", param, exp_avg);
  require_same_shape("ref::adamw", param, exp_avg_sq);
  if (t < 1) throw std::invalid_argument("ref::adamw: t must be >= 1");
  NdArray p = param, m = exp_avg, v = exp_avg_sq;
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(t));
  for (int64_t i = 0; i < p.numel(); ++i) {
    const double g = grad.data[i];
    p.data[i] *= 1 - lr * weight_decay;
    m.data[i] = beta1 * m.data[i] + (1 - beta1) * g;
    v.data[i] = beta2 * v.data[i] + (1 - beta2) * g * g;
    const double m_hat = m.data[i] / bc1;
    const double denom = std::sqrt(v.data[i]) / std::sqrt(bc2) + eps;
    p.data[i] -= lr * m_hat / denom;
  }
  return {p, m, v};
}

std::vector<NdArray> sgd(const NdArray& param, const NdArray& grad, const NdArray& momentum_buffer,
                         int64_t t, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov) {
  require_same_shape("ref::sgd", param, grad);
  if (t < 1) throw std::invalid_argument("ref::sgd: t must be >= 1");
  const bool has_momentum = momentum != 0;
  if (has_momentum && t > 1) require_same_shape("ref::sgd", param, momentum_buffer);
  NdArray p = param;
  NdArray buf = has_momentum ? NdArray::zeros(param.shape) : NdArray::absent();
  for (int64_t i = 0; i < p.numel(); ++i) {
    double d = grad.data[i];
    if (weight_decay != 0) d += weight_decay * p.data[i];
    if (has_momentum) {
      const double b =
          t == 1 ? d : momentum * momentum_buffer.data[i] + (1 - dampening) * d;
      buf.data[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p.data[i] -= lr * d;
  }
  return {p, buf};
}

}  // namespace tessera::ref
