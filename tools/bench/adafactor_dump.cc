// Tessera's Adafactor on fixed, formula-made inputs, for tools/adafactor_peer.py to compare
// with optax.adafactor (jax, x64) on the same inputs. One JSON object per line: the case, the
// shape and the f64 parameters after each of 6 steps.
//
//   bazel run //tools/bench:adafactor_dump > /tmp/tessera.jsonl
//   python3 tools/adafactor_peer.py /tmp/tessera.jsonl      # pip install jax optax
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "optim/adafactor.h"
#include "tensor/ops.h"

using namespace tessera;

// The same formulas as tools/adafactor_peer.py.
std::vector<double> initial(int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = 0.5 * std::sin(0.1 * static_cast<double>(i) + 0.3);
  return v;
}
std::vector<double> gradient(int64_t n, int step) {
  std::vector<double> v(static_cast<size_t>(n));
  const double scale = step == 3 ? 50.0 : 0.1;  // step 3 makes the update clip
  for (int64_t i = 0; i < n; ++i) {
    v[i] = scale * std::cos(0.37 * static_cast<double>(i) + static_cast<double>(step));
  }
  return v;
}

int main() {
  const std::vector<Shape> shapes = {{5, 7}, {2, 3, 4}, {6, 3, 5}, {9}, {130, 4}};
  struct Case {
    const char* name;
    double beta1, wd;
    bool scale;
  };
  for (const Case& c : {Case{"plain", 0.0, 0.0, true}, Case{"momentum_decay", 0.9, 0.1, true},
                        Case{"no_param_scale", 0.0, 0.0, false}}) {
    for (const Shape& shape : shapes) {
      const int64_t n = numel_of(shape);
      Tensor p = Tensor::from_vector<double>(initial(n), shape).requires_grad_();
      optim::AdafactorOptions o;
      o.mode = optim::AdafactorMode::optax;
      o.lr = 1e-2;
      o.relative_step = false;
      o.scale_parameter = c.scale;
      o.beta1 = c.beta1;
      o.weight_decay = c.wd;
      o.min_dim_size_to_factor = 3;
      optim::Adafactor opt({p}, o);
      for (int step = 0; step < 6; ++step) {
        p.set_grad(Tensor::from_vector<double>(gradient(n, step), shape));
        opt.step();
        std::printf("%s\n", fmt::format(R"({{"case": "{}", "shape": [{}], "step": {}, "param": [{:.17g}]}})",
                                        c.name, fmt::join(shape, ", "), step,
                                        fmt::join(p.to_vector<double>(), ", "))
                                .c_str());
      }
    }
  }
  return 0;
}
