// The fused updates' multi-tensor form on the CPU: one adamw_ / sgd_ call over several
// tensors equals one call per tensor bit for bit; shape errors name the tuple; and
// optim::AdamW, whose bucket call fails, retries the bucket param by param so the error
// names the param. (The CUDA kernels are checked against these CPU kernels in
// tests/cuda/optim_test.cc.)
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "optim/adamw.h"
#include "tests/optim/multi_tensor_util.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim::testing {
namespace {

TEST_CASE("a multi-tensor adamw_ / sgd_ call equals one call per tensor, bit for bit") {
  // Sizes 1 and 3 and the odd starts of layout() take the scalar tail paths, 1001 the
  // vector body; bf16 params with f32 master weights exercise the rounding write-back.
  const std::vector<int64_t> sizes = {1, 3, 1001, 17};
  for (bool adam : {true, false}) {
    CAPTURE(adam);
    Operands multi = make_operands(sizes, {DType::bf16, DType::bf16, DType::f32, DType::f32,
                                           DType::f32}, 9);
    multi.roles[3].flat = abs(multi.roles[3].flat);  // exp_avg_sq >= 0
    multi.roles[3] = views_into(multi.roles[3].flat, sizes);
    Operands single;
    for (const Views& v : multi.roles) single.roles.push_back(views_into(v.flat.clone(), sizes));
    Attrs a;
    a.step_count = 3;
    a.lr = 0.01;
    a.weight_decay = 0.1;
    a.momentum = adam ? 0.0 : 0.9;
    const size_t width = adam ? 5 : 4;
    std::vector<Tensor> in;
    for (size_t j = 0; j < sizes.size(); ++j) {
      const Operands& o = multi;
      if (adam) in.insert(in.end(), {o.at(0, j), o.at(1, j), o.at(2, j), o.at(3, j), o.at(4, j)});
      else in.insert(in.end(), {o.at(0, j), o.at(1, j), o.at(2, j), o.at(4, j)});
      const Operands& t = single;
      if (adam) {
        call_tuples(OpId::adamw_, {t.at(0, j), t.at(1, j), t.at(2, j), t.at(3, j), t.at(4, j)},
                    a, 5, {0, 2, 3, 4});
      } else {
        call_tuples(OpId::sgd_, {t.at(0, j), t.at(1, j), t.at(2, j), t.at(4, j)}, a, 4,
                    {0, 2, 3});
      }
    }
    call_tuples(adam ? OpId::adamw_ : OpId::sgd_, in, a, width,
                adam ? std::vector<size_t>{0, 2, 3, 4} : std::vector<size_t>{0, 2, 3});
    for (size_t r = 0; r < multi.roles.size(); ++r) {
      CAPTURE(r);
      CHECK(bitwise_equal(multi.roles[r].flat, single.roles[r].flat));
    }
    // The calls did update: the params moved away from their starting values.
    const Operands start = make_operands(sizes, {DType::bf16}, 9);
    CHECK(!bitwise_equal(multi.roles[0].flat, start.roles[0].flat));
  }
}

TEST_CASE("multi-tensor shape errors name the tuple; AdamW.step names the param") {
  Tensor p = zeros({2, 3}), m = zeros({2, 3}), v = zeros({2, 3});
  Attrs a;
  a.lr = 0.1;
  expect_error_with(
      [&] {
        call_tuples(OpId::adamw_, {p, p, m, v, Tensor(), zeros({4}), zeros({3}), zeros({4}),
                                   zeros({4}), Tensor()},
                    a, 5, {0, 2, 3, 4});
      },
      {"adamw_ tuple 1 of 2", "[3]"});
  // One bucket of three params, the middle one's gradient the wrong shape: the bucket is
  // retried param by param, so the first steps, the error names the second, the third waits.
  Tensor w0 = zeros({4}).requires_grad_(), w1 = zeros({4}).requires_grad_();
  Tensor w2 = zeros({4}).requires_grad_();
  AdamW opt({ParamGroup{{w0, w1, w2}, {"a", "b", "c"}}});
  w0.set_grad(ones({4}));
  w1.ensure_autograd_meta().grad = ones({2});
  w2.set_grad(ones({4}));
  expect_error_with([&] { opt.step(); }, {"AdamW.step: param 1 (b)"});
  CHECK(opt.step_count(0) == 1);
  CHECK(opt.step_count(1) == 0);
  CHECK(opt.step_count(2) == 0);
  // Only the first param moved: AdamW's first step with a gradient of ones moves every
  // element by lr (m_hat / sqrt(v_hat) = 1), and decay of a zero param is zero.
  const double lr = AdamWOptions{}.lr;
  expect_rel(w0, std::vector<double>(4, -lr), 1e-6, "w0 after its step");
  CHECK(w1.to_vector<float>() == std::vector<float>(4, 0.0f));
  CHECK(w2.to_vector<float>() == std::vector<float>(4, 0.0f));
}

}  // namespace
}  // namespace tessera::optim::testing
