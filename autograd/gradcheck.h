// Finite-difference gradient check in f64: the analytical gradient of <fn(inputs), v> for a
// fixed random projection v against central differences, element by element.
//
//   auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]); },
//                                {randn({3, 4}, DType::f64).requires_grad_()});
//   CHECK_MESSAGE(r.ok, r.message);
//
// Inputs may be non-contiguous views (perturbations go to the viewed storage element), on
// any device (a device input is perturbed by a one-element copy into its storage; the
// projection v is drawn on the CPU and copied, so it is the same everywhere).
// Inputs that do not require grad are held fixed.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::autograd {

struct GradcheckOptions {
  double eps = 1e-6;   // finite-difference step
  double atol = 1e-7;  // |analytical - numerical| <= atol + rtol * |numerical|
  double rtol = 1e-5;
};

struct GradcheckResult {
  bool ok = true;
  std::string message;       // the first failing input and element, with both values
  double max_abs_error = 0;
};

using GradcheckFn = std::function<Tensor(const std::vector<Tensor>&)>;

GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Tensor>& inputs,
                          GradcheckOptions options = {});

}  // namespace tessera::autograd
