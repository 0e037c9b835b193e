// Bad input throws tessera::Error whose message names the op and the shapes / dtypes /
// values involved. Never an abort.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/allocator.h"
#include "tensor/ops.h"
#include "tensor/shape.h"

using namespace tessera;

namespace {

// Runs f, requires a tessera::Error, and checks that its message mentions every fragment.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& fragments) {
  std::string message;
  try {
    f();
  } catch (const Error& e) {
    message = e.what();
  } catch (const std::exception& e) {
    FAIL("expected tessera::Error, got another exception: " << e.what());
  }
  REQUIRE_MESSAGE(!message.empty(), "expected tessera::Error, nothing was thrown");
  for (const std::string& frag : fragments) {
    CHECK_MESSAGE(message.find(frag) != std::string::npos,
                  "error message \"" << message << "\" lacks \"" << frag << "\"");
  }
}

Tensor f32(const Shape& s) { return zeros(s); }

}  // namespace

TEST_CASE("shape mismatches name the op and both shapes") {
  expect_error([] { add(f32({2, 3}), f32({4})); }, {"add", "[2, 3]", "[4]", "broadcastable"});
  expect_error([] { where(zeros({2}, DType::b8), f32({3}), f32({2})); }, {"where", "[2]", "[3]"});
  expect_error([] { matmul(f32({2, 3}), f32({4, 5})); }, {"matmul", "[2, 3]", "[4, 5]", "3 vs 4"});
  expect_error([] { matmul(f32({2, 2, 3}), f32({3, 3, 1})); }, {"matmul", "batch"});
  expect_error([] { cat({f32({2, 3}), f32({2, 4})}, 0); }, {"cat", "[2, 4]", "[2, 3]"});
  expect_error([] { stack({f32({2}), f32({3})}); }, {"stack", "[3]", "[2]"});
  expect_error([] { split(f32({5}), std::vector<int64_t>{2, 2}); }, {"split", "sum to 4", "5"});
  expect_error([] { layer_norm(f32({2, 3}), {4}); }, {"layer_norm", "[4]", "[2, 3]"});
  expect_error([] { layer_norm(f32({2, 3}), {3}, f32({2})); }, {"layer_norm", "[2]", "[3]"});
  expect_error([] { conv2d(f32({1, 3, 8, 8}), f32({4, 2, 3, 3})); },
               {"conv2d", "[1, 3, 8, 8]", "3 channels", "[4, 2, 3, 3]"});
  expect_error([] { conv2d(f32({1, 1, 2, 2}), f32({1, 1, 3, 3})); }, {"conv2d", "does not fit"});
  expect_error([] { max_pool2d(f32({2, 2}), {2, 2}); }, {"max_pool2d", "4-D", "[2, 2]"});
  expect_error([] { cross_entropy(f32({4, 3}), zeros({5}, DType::i64)); },
               {"cross_entropy", "[5]", "[4, 3]"});
  expect_error([] { index_add(f32({4, 3}), 0, zeros({2}, DType::i64), f32({3, 3})); },
               {"index_add", "[3, 3]", "[2, 3]"});
  expect_error([] { gather(f32({4, 3}), 0, zeros({5}, DType::i64)); }, {"gather", "rank"});
  expect_error([] { copy_(f32({2, 3}), f32({3, 2})); }, {"copy_", "[3, 2]", "[2, 3]"});
  expect_error([] { copy_(f32({1, 3}).expand({2, 3}), f32({2, 3})); },
               {"copy_", "expanded", "[2, 3]", "[0, 1]"});
}

TEST_CASE("mixing dtypes without a cast is an error") {
  expect_error([] { add(f32({2}), zeros({2}, DType::f64)); }, {"add", "f32", "f64", "cast"});
  expect_error([] { mul(zeros({2}, DType::bf16), f32({2})); }, {"mul", "bf16", "f32"});
  expect_error([] { matmul(f32({2, 2}), zeros({2, 2}, DType::f16)); }, {"matmul", "f32", "f16"});
  expect_error([] { exp(zeros({2}, DType::i32)); }, {"exp", "floating", "i32"});
  expect_error([] { div(zeros({2}, DType::i64), zeros({2}, DType::i64)); }, {"div", "integer"});
  expect_error([] { zeros({2}, DType::i32) * 0.5; }, {"mul", "0.5", "i32"});
  expect_error([] { embedding(f32({4, 2}), f32({3})); }, {"embedding", "integer", "f32"});
  expect_error([] { where(f32({2}), f32({2}), f32({2})); }, {"where", "bool"});
  expect_error([] { zeros({2}, DType::i64).requires_grad_(); }, {"requires_grad_", "floating", "i64"});
  expect_error([] { rand({2}, DType::i32); }, {"rand", "floating", "i32"});
}

TEST_CASE("out-of-range indices are errors, not crashes") {
  Tensor w = f32({5, 3});
  expect_error([&] { embedding(w, Tensor::from_vector<int64_t>({0, 5}, {2})); },
               {"embedding", "index 5", "size 5"});
  expect_error([&] { embedding(w, Tensor::from_vector<int64_t>({-1}, {1})); },
               {"embedding", "index -1"});
  expect_error([] { cross_entropy(f32({2, 3}), Tensor::from_vector<int64_t>({1, 3}, {2})); },
               {"cross_entropy", "target 3", "row 1", "3 classes"});
  expect_error([] { index_select(f32({4, 2}), 0, Tensor::from_vector<int64_t>({4}, {1})); },
               {"index_select", "index 4", "size 4"});
  expect_error([] { gather(f32({2, 2}), 1, Tensor::from_vector<int64_t>({0, 2, 1, 1}, {2, 2})); },
               {"gather", "index 2"});
  expect_error([] { scatter_add(f32({2, 2}), 0, Tensor::from_vector<int64_t>({9}, {1, 1}), f32({1, 1})); },
               {"scatter_add", "index 9"});
  // ignore_index rows are skipped, not range-checked.
  CHECK(cross_entropy(f32({2, 3}), Tensor::from_vector<int64_t>({-100, 1}, {2})).item<float>() ==
        doctest::Approx(std::log(3.0)));
}

TEST_CASE("invalid views and dims") {
  expect_error([] { f32({2, 3}).view({4}); }, {"view", "[2, 3]", "[4]"});
  expect_error([] { f32({2, 3}).t().view({6}); }, {"view", "reshape"});
  expect_error([] { f32({2, 3}).reshape({-1, -1}); }, {"reshape", "-1"});
  expect_error([] { f32({2, 3}).reshape({4, -1}); }, {"reshape", "infer"});
  expect_error([] { f32({2, 3}).permute({0, 0}); }, {"permute", "repeats"});
  expect_error([] { f32({2, 3}).permute({0}); }, {"permute", "2-d"});
  expect_error([] { f32({2, 3}).expand({4, 3, 2}); }, {"expand", "[2, 3]", "[4, 3, 2]"});
  expect_error([] { f32({2, 3}).narrow(1, 2, 2); }, {"narrow", "[2, 4)", "size 3"});
  expect_error([] { f32({2, 3}).slice(0, 0, 2, 0); }, {"slice", "step"});
  expect_error([] { sum(f32({2, 3}), {2}); }, {"sum", "dim 2", "2-d"});
  expect_error([] { sum(f32({2, 3}), {1, -1}); }, {"sum", "repeats"});
  expect_error([] { softmax(f32({2, 3}), 3); }, {"softmax", "dim 3"});
  expect_error([] { f32({2, 3}).select(0, 2); }, {"select", "index 2"});
  expect_error([] { full({2, -1}, 1.0); }, {"full", "negative", "[2, -1]"});
  expect_error([] { arange(0, 1, 0); }, {"arange", "step"});
  expect_error([] { dropout(f32({2}), 1.0); }, {"dropout", "[0, 1)"});
}

TEST_CASE("undefined tensors and misuse of autograd") {
  expect_error([] { neg(Tensor()); }, {"neg", "undefined"});
  expect_error([] { add(f32({2}), Tensor()); }, {"add", "undefined"});
  expect_error([] { Tensor().item<float>(); }, {"item"});
  expect_error([] { f32({2}).backward(); }, {"backward", "does not require grad"});
  Tensor w = f32({3}).requires_grad_();
  expect_error([&] { (w * 2.0).backward(); }, {"backward", "[3]", "one-element"});
  expect_error([&] { (w * 2.0).requires_grad_(); }, {"requires_grad_", "leaves"});
  expect_error([&] { f32({3}).copy_(w); }, {"copy_", "requires grad"});
}

// Sizes are checked: a shape from a flag or a file can ask for more than int64 counts, and
// nothing may wrap around into a small allocation (under the sanitizer build a wrap shows as
// a heap overflow; here the product itself is refused).
TEST_CASE("sizes that overflow int64 are errors, not wrapped allocations") {
  const int64_t big = int64_t{1} << 62;
  expect_error([&] { ones({big}); }, {"empty", "[4611686018427387904]", "4-byte"});
  expect_error([&] { zeros({big, 4}); }, {"[4611686018427387904, 4]", "int64"});
  // A zero dim empties the tensor, but the other dims' strides would still wrap.
  expect_error([&] { zeros({0, big, big}); }, {"[0, 4611686018427387904, 4611686018427387904]",
                                              "strides"});
  expect_error([&] { Tensor::empty({3, big, 8}, DType::b8); }, {"strides"});
  expect_error([&] { f32({1}).expand({big, big}); },
               {"[4611686018427387904, 4611686018427387904]"});
  expect_error([&] { f32({0}).reshape({big, big, 0}); }, {"reshape", "int64"});
  expect_error([] { numel_of({int64_t{1} << 32, int64_t{1} << 32}); }, {"int64"});
  expect_error([] { contiguous_strides({2, int64_t{1} << 32, int64_t{1} << 32}); },
               {"strides", "overflow"});
  expect_error([] { storage_bytes("op", {int64_t{1} << 61}, 8); }, {"op", "8-byte"});
  expect_error([] { storage_bytes("op", {2, -3}, 4); }, {"op", "negative", "[2, -3]"});
  // The largest shapes that do fit are fine (no allocation: zero elements, or a view).
  CHECK(numel_of({0, big}) == 0);
  CHECK(contiguous_strides({big, 1}) == Strides{1, 1});
  CHECK(storage_bytes("op", {0, big, 1}, 8) == 0);
  CHECK(storage_bytes("op", {big / 2}, 2) == big);
  CHECK(zeros({0, big}).numel() == 0);
  CHECK(f32({1}).expand({big}).numel() == big);
}

// The CPU allocator's budget (Allocator::set_limit, gpt/mnist --memory_limit).
TEST_CASE("the allocator budget refuses a request with the tag, the request and the budget") {
  Allocator& cpu = allocator_for(kCPU);
  const int64_t before = cpu.limit();
  const int64_t in_use = cpu.stats().allocated_bytes;
  cpu.set_limit(in_use + (int64_t{8} << 20));
  {
    MemoryTagScope tag(MemoryTag::optimizer_state);
    expect_error([] { zeros({int64_t{4} << 20}); },  // 16 MiB of f32
                 {"full", "cpu allocator", "16777216 bytes", "optimizer state",
                  "memory budget"});
  }
  const Tensor fits = zeros({int64_t{1} << 20});  // 4 MiB: under the budget
  CHECK(fits.sum().item<float>() == 0.0f);
  cpu.set_limit(before);
  expect_error([&] { cpu.set_limit(-1); }, {"set_limit", "-1"});
  // Far beyond any machine: refused before rounding to a size class could overflow.
  expect_error([] { allocator_for(kCPU).allocate(int64_t{1} << 60); }, {"out of memory"});
}
