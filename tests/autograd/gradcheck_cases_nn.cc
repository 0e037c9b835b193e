// gradcheck cases for matmul, the fused layers, indexing, joining and splitting.
#include "tests/autograd/gradcheck_cases.h"
#include "tests/reference/op_cases.h"

namespace tessera::gradcheck_cases {

void add_nn_cases(Table& t) {
  // ---- linear algebra and fused layers ----
  t[OpId::matmul] = {
      [](Maker& mk) {
        auto fn = on2([](const Tensor& a, const Tensor& b) { return matmul(a, b); });
        return CaseList{
            {Layout::contiguous, "[3, 4] @ [4, 5]", {mk.normal({3, 4}), mk.normal({4, 5})}, fn},
            {Layout::contiguous,
             "[4] @ [4, 5] and [3, 4] @ [4]",
             {mk.normal({3, 4}), mk.normal({4})},
             on2([](const Tensor& a, const Tensor& v) {
               return matmul(a, v) + matmul(v, transpose(a, 0, 1));
             })},
            {Layout::contiguous,
             "[4] @ [4] and [2, 3, 4] @ [4]",
             {mk.normal({2, 3, 4}), mk.normal({4})},
             on2([](const Tensor& a, const Tensor& v) { return matmul(a, v) * matmul(v, v); })},
            {Layout::contiguous,
             "the same input on both sides",
             {mk.normal({3, 4})},
             on1([](const Tensor& a) { return matmul(a, transpose(a, 0, 1)); })},
            {Layout::broadcast, "[4] @ [2, 4, 3]", {mk.normal({4}), mk.normal({2, 4, 3})}, fn},
            {Layout::broadcast,
             "batched [2, 1, 3, 4] @ [3, 4, 5]",
             {mk.normal({2, 1, 3, 4}), mk.normal({3, 4, 5})},
             fn},
            {Layout::broadcast,
             "[3, 4] @ [2, 4, 5]",
             {mk.normal({3, 4}), mk.normal({2, 4, 5})},
             fn},
            {Layout::noncontiguous,
             "transposed @ strided",
             {mk.normal({3, 4}, Memory::transposed), mk.normal({4, 5}, Memory::strided)},
             fn},
            {Layout::noncontiguous,
             "permuted batch @ transposed",
             {mk.normal({2, 3, 4}, Memory::permuted), mk.normal({4, 5}, Memory::transposed)},
             fn},
        };
      },
      ""};
  for (OpId op : {OpId::softmax, OpId::log_softmax}) {
    t[op] = {[op](Maker& mk) {
               auto fn = [op](int64_t dim) {
                 return GradcheckFn([=](const Tensors& in) {
                   return op == OpId::softmax ? softmax(in[0], dim) : log_softmax(in[0], dim);
                 });
               };
               return CaseList{
                   {Layout::contiguous, "dim -1", {mk.normal({3, 5})}, fn(-1)},
                   {Layout::contiguous, "dim 0 of [3, 2, 4]", {mk.normal({3, 2, 4})}, fn(0)},
                   {Layout::noncontiguous,
                    "transposed, dim -1",
                    {mk.normal({3, 5}, Memory::transposed)},
                    fn(-1)},
                   {Layout::noncontiguous,
                    "strided, dim 1",
                    {mk.normal({2, 3, 4}, Memory::strided)},
                    fn(1)},
               };
             },
             ""};
  }
  t[OpId::layer_norm] = {
      [](Maker& mk) {
        auto full_fn = [](Shape norm) {
          return GradcheckFn(
              [=](const Tensors& in) { return layer_norm(in[0], norm, in[1], in[2]); });
        };
        auto bare = [](Shape norm) {
          return GradcheckFn([=](const Tensors& in) { return layer_norm(in[0], norm); });
        };
        auto weight_only =
            GradcheckFn([](const Tensors& in) { return layer_norm(in[0], {5}, in[1]); });
        auto bias_only =
            GradcheckFn([](const Tensors& in) { return layer_norm(in[0], {5}, Tensor(), in[1]); });
        return CaseList{
            {Layout::contiguous,
             "weight and bias",
             {mk.normal({3, 5}), mk.normal({5}), mk.normal({5})},
             full_fn({5})},
            {Layout::contiguous, "no weight, no bias", {mk.normal({3, 5})}, bare({5})},
            {Layout::contiguous, "weight only", {mk.normal({3, 5}), mk.normal({5})}, weight_only},
            {Layout::contiguous, "bias only", {mk.normal({3, 5}), mk.normal({5})}, bias_only},
            {Layout::contiguous,
             "two normalized dims",
             {mk.normal({2, 3, 4}), mk.normal({3, 4}), mk.normal({3, 4})},
             full_fn({3, 4})},
            {Layout::contiguous,
             "every dim normalized, eps 0.1",
             {mk.normal({2, 3}), mk.normal({2, 3}), mk.normal({2, 3})},
             GradcheckFn([](const Tensors& in) {
               return layer_norm(in[0], {2, 3}, in[1], in[2], 0.1);
             })},
            {Layout::noncontiguous,
             "transposed x, strided weight and bias",
             {mk.normal({3, 5}, Memory::transposed), mk.normal({5}, Memory::strided),
              mk.normal({5}, Memory::strided)},
             full_fn({5})},
            {Layout::noncontiguous,
             "permuted x, no weight",
             {mk.normal({2, 3, 4}, Memory::permuted)},
             bare({3, 4})},
        };
      },
      ""};
  t[OpId::cross_entropy] = {
      [](Maker& mk) {
        // Target 5 rows over 4 classes; row 3 is ignored (-100 by default, 2 in the custom case).
        const Tensor target = index({1, 0, 3, -100, 2}, {5});
        const Tensor target_custom = index({1, 0, 3, 2, 2}, {5});
        auto fn = [](Tensor tgt, Reduction r, int64_t ignore) {
          return GradcheckFn(
              [=](const Tensors& in) { return cross_entropy(in[0], tgt, r, ignore); });
        };
        return CaseList{
            {Layout::contiguous,
             "mean, ignore -100",
             {mk.normal({5, 4})},
             fn(target, Reduction::mean, -100)},
            {Layout::contiguous,
             "sum, ignore -100",
             {mk.normal({5, 4})},
             fn(target, Reduction::sum, -100)},
            {Layout::contiguous,
             "none, ignore -100",
             {mk.normal({5, 4})},
             fn(target, Reduction::none, -100)},
            {Layout::contiguous,
             "mean, ignore_index 2",
             {mk.normal({5, 4})},
             fn(target_custom, Reduction::mean, 2)},
            {Layout::contiguous,
             "sum, i32 target",
             {mk.normal({3, 4})},
             fn(on_device(Tensor::from_vector<int32_t>({3, 0, 2}, {3})), Reduction::sum, -100)},
            {Layout::contiguous,
             "batch of one",
             {mk.normal({1, 4})},
             fn(index({2}, {1}), Reduction::mean, -100)},
            {Layout::noncontiguous,
             "transposed, mean",
             {mk.normal({5, 4}, Memory::transposed)},
             fn(target, Reduction::mean, -100)},
            {Layout::noncontiguous,
             "strided, none, ignore_index 2",
             {mk.normal({5, 4}, Memory::strided)},
             fn(target_custom, Reduction::none, 2)},
        };
      },
      ""};
  t[OpId::dropout] = {[](Maker& mk) {
                        // A fresh generator per call: every finite-difference evaluation draws the
                        // same mask.
                        auto fn = GradcheckFn([](const Tensors& in) {
                          Generator g(99);
                          return dropout(in[0], 0.3, true, &g);
                        });
                        return CaseList{
                            {Layout::contiguous, "p = 0.3", {mk.normal({4, 6})}, fn},
                            {Layout::noncontiguous,
                             "p = 0.3, transposed",
                             {mk.normal({4, 6}, Memory::transposed)},
                             fn},
                            {Layout::noncontiguous,
                             "p = 0.3, strided",
                             {mk.normal({2, 3, 4}, Memory::strided)},
                             fn},
                        };
                      },
                      ""};
  t[OpId::attention] = {
      [](Maker& mk) {
        auto fn = [](bool causal, double scale) {
          return GradcheckFn(
              [=](const Tensors& in) { return attention(in[0], in[1], in[2], causal, scale); });
        };
        const Shape s{2, 2, 4, 3};
        return CaseList{
            {Layout::contiguous, "causal", {mk.normal(s), mk.normal(s), mk.normal(s)}, fn(true, 0)},
            {Layout::contiguous,
             "not causal, scale 0.7",
             {mk.normal(s), mk.normal(s), mk.normal(s)},
             fn(false, 0.7)},
            {Layout::contiguous,
             "causal, one row of 5 keys",
             {mk.normal({1, 1, 5, 2}), mk.normal({1, 1, 5, 2}), mk.normal({1, 1, 5, 2})},
             fn(true, 0)},
            {Layout::noncontiguous,
             "transposed q, permuted k, strided v",
             {mk.normal(s, Memory::transposed), mk.normal(s, Memory::permuted),
              mk.normal(s, Memory::strided)},
             fn(true, 0)},
        };
      },
      ""};
  t[OpId::conv2d] = {
      [](Maker& mk) {
        auto fn = [](std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
          return GradcheckFn([=](const Tensors& in) {
            return conv2d(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), stride, padding);
          });
        };
        return CaseList{
            {Layout::contiguous,
             "bias, stride 1, no padding",
             {mk.normal({2, 3, 5, 5}), mk.normal({4, 3, 3, 3}), mk.normal({4})},
             fn({1, 1}, {0, 0})},
            {Layout::contiguous,
             "bias, stride 2, padding 1",
             {mk.normal({2, 3, 5, 5}), mk.normal({4, 3, 3, 3}), mk.normal({4})},
             fn({2, 2}, {1, 1})},
            {Layout::contiguous,
             "no bias, stride [2, 1], padding [0, 1], 2x3 kernel",
             {mk.normal({1, 2, 5, 4}), mk.normal({3, 2, 2, 3})},
             fn({2, 1}, {0, 1})},
            {Layout::contiguous,
             "stride 3 > kernel 2",
             {mk.normal({1, 2, 7, 7}), mk.normal({2, 2, 2, 2}), mk.normal({2})},
             fn({3, 3}, {0, 0})},
            {Layout::contiguous,
             "1x1 kernel",
             {mk.normal({2, 3, 3, 3}), mk.normal({4, 3, 1, 1})},
             fn({1, 1}, {0, 0})},
            {Layout::contiguous,
             "padding 2 around a 3x3 input",
             {mk.normal({1, 1, 3, 3}), mk.normal({2, 1, 3, 3})},
             fn({1, 1}, {2, 2})},
            {Layout::noncontiguous,
             "permuted x, strided weight, bias, stride 2, padding 1",
             {mk.normal({2, 3, 5, 5}, Memory::permuted), mk.normal({4, 3, 3, 3}, Memory::strided),
              mk.normal({4}, Memory::strided)},
             fn({2, 2}, {1, 1})},
            {Layout::noncontiguous,
             "transposed x (H <-> W), no bias",
             {mk.normal({1, 2, 4, 5}, Memory::transposed),
              mk.normal({3, 2, 3, 2}, Memory::transposed)},
             fn({1, 1}, {1, 0})},
        };
      },
      ""};
  t[OpId::max_pool2d] = {[](Maker& mk) {
                           auto fn = [](std::array<int64_t, 2> k, std::array<int64_t, 2> stride,
                                        std::array<int64_t, 2> padding) {
                             return GradcheckFn([=](const Tensors& in) {
                               return max_pool2d(in[0], k, stride, padding);
                             });
                           };
                           return CaseList{
                               {Layout::contiguous,
                                "2x2, default stride",
                                {mk.distinct({2, 2, 4, 4}, 0)},
                                fn({2, 2}, {0, 0}, {0, 0})},
                               {Layout::contiguous,
                                "3x3, stride 2, padding 1",
                                {mk.distinct({2, 2, 5, 5}, 0)},
                                fn({3, 3}, {2, 2}, {1, 1})},
                               {Layout::contiguous,
                                "3x2, stride [1, 2], padding [1, 0]",
                                {mk.distinct({1, 2, 5, 5}, 0)},
                                fn({3, 2}, {1, 2}, {1, 0})},
                               {Layout::contiguous,
                                "2x2, stride 1, padding 1 (windows mostly padding)",
                                {mk.distinct({1, 2, 3, 3}, 0)},
                                fn({2, 2}, {1, 1}, {1, 1})},
                               {Layout::noncontiguous,
                                "permuted, 3x3, stride 2, padding 1",
                                {mk.distinct({2, 2, 5, 5}, 0, Memory::permuted)},
                                fn({3, 3}, {2, 2}, {1, 1})},
                               {Layout::noncontiguous,
                                "strided, 2x2, stride 1",
                                {mk.distinct({1, 2, 4, 5}, 0, Memory::strided)},
                                fn({2, 2}, {1, 1}, {0, 0})},
                           };
                         },
                         ""};

  // ---- indexing (integer index inputs are held fixed) ----
  t[OpId::embedding] = {
      [](Maker& mk) {
        const Tensor ids = index({1, 4, 1, 0, 5, 4, 4, 2}, {2, 4});
        auto fn = GradcheckFn([ids](const Tensors& in) { return embedding(in[0], ids); });
        return CaseList{
            {Layout::contiguous, "weight [6, 3], repeated ids [2, 4]", {mk.normal({6, 3})}, fn},
            {Layout::contiguous, "i32 ids", {mk.normal({6, 3})}, GradcheckFn([](const Tensors& in) {
               return embedding(in[0], on_device(Tensor::from_vector<int32_t>({5, 0, 5}, {3})));
             })},
            {Layout::contiguous, "0-d id", {mk.normal({6, 3})}, GradcheckFn([](const Tensors& in) {
               return embedding(in[0], index({2}, {}));
             })},
            {Layout::noncontiguous,
             "transposed weight",
             {mk.normal({6, 3}, Memory::transposed)},
             fn},
            {Layout::noncontiguous, "strided weight", {mk.normal({6, 3}, Memory::strided)}, fn},
        };
      },
      ""};
  t[OpId::index_select] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim, Tensor idx) {
          return GradcheckFn([=](const Tensors& in) { return index_select(in[0], dim, idx); });
        };
        return CaseList{
            {Layout::contiguous,
             "dim 0, repeats",
             {mk.normal({5, 3})},
             fn(0, index({4, 0, 4, 2}, {4}))},
            {Layout::contiguous, "dim 1", {mk.normal({2, 5, 3})}, fn(1, index({3, 1, 1}, {3}))},
            {Layout::noncontiguous,
             "transposed, dim -1",
             {mk.normal({3, 5}, Memory::transposed)},
             fn(-1, index({2, 2, 0, 4}, {4}))},
            {Layout::noncontiguous,
             "strided, dim 0",
             {mk.normal({5, 3}, Memory::strided)},
             fn(0, index({1, 3, 1}, {3}))},
        };
      },
      ""};
  t[OpId::index_add] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim, Tensor idx) {
          return GradcheckFn([=](const Tensors& in) { return index_add(in[0], dim, idx, in[1]); });
        };
        return CaseList{
            {Layout::contiguous,
             "dim 0, repeats",
             {mk.normal({5, 3}), mk.normal({4, 3})},
             fn(0, index({4, 0, 4, 2}, {4}))},
            {Layout::contiguous,
             "dim 1",
             {mk.normal({2, 5}), mk.normal({2, 3})},
             fn(1, index({3, 1, 3}, {3}))},
            {Layout::noncontiguous,
             "transposed x, strided source",
             {mk.normal({5, 3}, Memory::transposed), mk.normal({4, 3}, Memory::strided)},
             fn(0, index({1, 1, 0, 4}, {4}))},
        };
      },
      ""};
  t[OpId::gather] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim, Tensor idx) {
          return GradcheckFn([=](const Tensors& in) { return gather(in[0], dim, idx); });
        };
        const Tensor idx0 = index({0, 3, 1, 3, 3, 2, 1, 0, 0, 2, 2, 3, 0, 1, 1}, {5, 3});
        const Tensor idx1 = index({2, 0, 2, 1, 1, 1, 0, 2}, {4, 2});
        return CaseList{
            {Layout::contiguous,
             "dim 0, index [5, 3] over x [4, 3]",
             {mk.normal({4, 3})},
             fn(0, idx0)},
            {Layout::contiguous, "dim 1, index narrower than x", {mk.normal({4, 3})}, fn(1, idx1)},
            {Layout::noncontiguous,
             "transposed, dim 0",
             {mk.normal({4, 3}, Memory::transposed)},
             fn(0, idx0)},
            {Layout::noncontiguous,
             "strided, dim 1",
             {mk.normal({4, 3}, Memory::strided)},
             fn(1, idx1)},
        };
      },
      ""};
  t[OpId::scatter_add] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim, Tensor idx) {
          return GradcheckFn(
              [=](const Tensors& in) { return scatter_add(in[0], dim, idx, in[1]); });
        };
        // src is larger than the index in some dims: those entries get a zero gradient.
        const Tensor idx0 = index({3, 0, 3, 1, 3, 0}, {2, 3});
        const Tensor idx1 = index({1, 1, 0, 2, 0, 0}, {3, 2});
        return CaseList{
            {Layout::contiguous,
             "dim 0, src [3, 3] > index [2, 3]",
             {mk.normal({4, 3}), mk.normal({3, 3})},
             fn(0, idx0)},
            {Layout::contiguous, "dim 1", {mk.normal({4, 3}), mk.normal({3, 4})}, fn(1, idx1)},
            {Layout::noncontiguous,
             "transposed x, strided src",
             {mk.normal({4, 3}, Memory::transposed), mk.normal({3, 3}, Memory::strided)},
             fn(0, idx0)},
        };
      },
      ""};

  // ---- joining and splitting ----
  t[OpId::cat] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim) {
          return GradcheckFn([=](const Tensors& in) { return cat(in, dim); });
        };
        return CaseList{
            {Layout::contiguous, "dim 0", {mk.normal({2, 3}), mk.normal({4, 3})}, fn(0)},
            {Layout::contiguous,
             "dim -1, three inputs",
             {mk.normal({2, 3}), mk.normal({2, 1}), mk.normal({2, 2})},
             fn(-1)},
            {Layout::noncontiguous,
             "transposed and strided, dim 1",
             {mk.normal({3, 2}, Memory::transposed), mk.normal({3, 4}, Memory::strided)},
             fn(1)},
        };
      },
      ""};
  t[OpId::stack] = {
      [](Maker& mk) {
        auto fn = [](int64_t dim) {
          return GradcheckFn([=](const Tensors& in) { return stack(in, dim); });
        };
        return CaseList{
            {Layout::contiguous,
             "dim 0",
             {mk.normal({2, 3}), mk.normal({2, 3}), mk.normal({2, 3})},
             fn(0)},
            {Layout::contiguous, "dim -1", {mk.normal({2, 3}), mk.normal({2, 3})}, fn(-1)},
            {Layout::noncontiguous,
             "transposed and strided, dim 1",
             {mk.normal({2, 3}, Memory::transposed), mk.normal({2, 3}, Memory::strided)},
             fn(1)},
        };
      },
      "cat"};
  t[OpId::split] = {
      [](Maker& mk) {
        // Each piece goes through a different function, so a gradient routed to the wrong piece
        // shows up.
        auto pieces = [](const std::vector<Tensor>& p, int64_t dim) {
          Tensors out;
          for (size_t i = 0; i < p.size(); ++i)
            out.push_back(p[i] * static_cast<double>(i + 1) + tanh(p[i]));
          return cat(out, dim);
        };
        auto by_size =
            GradcheckFn([=](const Tensors& in) { return pieces(split(in[0], 4, 1), 1); });
        auto by_sizes = GradcheckFn([=](const Tensors& in) {
          return pieces(split(in[0], {1, 3}, 0), 0);
        });
        return CaseList{
            {Layout::contiguous,
             "split_size 4 along dim 1 of [4, 6]",
             {mk.normal({4, 6})},
             by_size},
            {Layout::contiguous, "sizes {1, 3} along dim 0", {mk.normal({4, 6})}, by_sizes},
            {Layout::noncontiguous,
             "transposed, split_size 4",
             {mk.normal({4, 6}, Memory::transposed)},
             by_size},
            {Layout::noncontiguous,
             "strided, sizes {1, 3}",
             {mk.normal({4, 6}, Memory::strided)},
             by_sizes},
        };
      },
      "slice"};

  // ---- the ops with their cases in tests/reference/op_cases.cc ----
  // Float inputs are differentiated (distinct values: no ties for selections; positive or
  // away from zero where the case's domain says so), fixed-dtype ones are small integers in
  // the domain's range; each case contiguous and, for rank >= 2, with its inputs transposed.
  for (const ref::OpTestCase& tc : ref::op_test_cases()) {
    if (tc.grad_output < 0) continue;
    auto previous = t.count(tc.op) ? t[tc.op].make : nullptr;
    t[tc.op] = {[previous, tc](Maker& mk) {
                  CaseList cases = previous ? previous(mk) : CaseList{};
                  auto fn = GradcheckFn([tc](const Tensors& in) {
                    return call(tc.op, in, tc.attrs)[static_cast<size_t>(tc.grad_output)];
                  });
                  for (Memory m : {Memory::contiguous, Memory::transposed}) {
                    Tensors inputs;
                    bool all_2d = true;
                    for (const ref::OpInput& in : tc.inputs) {
                      all_2d = all_2d && in.shape.size() >= 2;
                      const Memory mm = in.shape.size() >= 2 ? m : Memory::contiguous;
                      if (in.dtype) {
                        std::vector<int64_t> v(static_cast<size_t>(numel_of(in.shape)));
                        const int64_t lo = static_cast<int64_t>(in.domain.a),
                                      span = static_cast<int64_t>(in.domain.b) - lo + 1;
                        for (size_t i = 0; i < v.size(); ++i) v[i] = lo + static_cast<int64_t>(i * 7 + 3) % span;
                        inputs.push_back(on_device(cast(Tensor::from_vector<int64_t>(v, in.shape), *in.dtype)));
                      } else if (in.domain.positive()) {
                        inputs.push_back(mk.positive(in.shape, mm));
                      } else if (in.domain.kind == ref::Domain::Kind::away_from_zero) {
                        inputs.push_back(mk.nonzero(in.shape, mm));
                      } else {
                        inputs.push_back(mk.distinct(in.shape, 0, mm));
                      }
                    }
                    if (m == Memory::transposed && !all_2d) continue;
                    cases.push_back({m == Memory::contiguous ? Layout::contiguous : Layout::noncontiguous,
                                     tc.label + (m == Memory::contiguous ? "" : ", transposed"),
                                     inputs, fn});
                  }
                  return cases;
                },
                ""};
  }
}

}  // namespace tessera::gradcheck_cases
