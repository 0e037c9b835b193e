// The MNIST example data parallel (--dp threads, ZeRO 0-3) against the one-device run, and
// with --compress (PowerSGD, 1-bit Adam): the exact steps equal the uncompressed run's, the
// step line's ratio is the closed form, a resume is bitwise, and what it cannot combine with
// is refused. The same under mpirun is mnist_dp_mpi_test.sh.
#include <doctest/doctest.h>

#include <tuple>

#include <algorithm>
#include <cmath>
#include <string>

#include "models/mnist/model.h"
#include "models/mnist/train.h"
#include "tests/testing.h"

namespace tessera::mnist {
namespace {

using testing::contains;
using testing::error_of;
using testing::temp_dir;

MnistConfig small(int64_t steps) {
  MnistConfig c;
  c.model = "mlp";
  c.train_limit = 2048;
  c.test_limit = 500;
  c.epochs = 1;
  c.max_steps = steps;
  c.batch = 64;
  c.warmup = 5;
  c.verbose = false;
  c.threads = 2;
  c.eval_each_epoch = false;
  return c;
}

// Largest |a - b| / |b| over the steps' losses and the final test loss.
double worst_relative(const MnistResult& a, const MnistResult& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  double worst = std::abs(a.test_loss - b.test_loss) / std::abs(b.test_loss);
  for (size_t k = 0; k < a.losses.size(); ++k) {
    worst = std::max(worst, std::abs(a.losses[k] - b.losses[k]) / std::abs(b.losses[k]));
  }
  return worst;
}

TEST_CASE("--dp {2, 4} x --zero {0, 1, 2, 3} train as one device") {
  // Each rank's loss is the mean over its slice and the gradients are averaged: the batch's
  // mean, summed in another order. f32: the losses agree to rounding over 20 AdamW steps.
  const MnistResult one = train_mnist(small(20));
  int layouts = 0;
  for (int64_t dp : {2, 4}) {
    for (int64_t zero : {0, 1, 2, 3}) {
      CAPTURE(dp);
      CAPTURE(zero);
      MnistConfig c = small(20);
      c.dp = dp;
      c.zero = zero;
      const MnistResult r = train_mnist(c);
      CHECK(r.steps == 20);
      const double worst = worst_relative(r, one);
      MESSAGE("dp ", dp, " zero ", zero, ": largest relative loss difference ", worst);
      CHECK(worst <= 1e-6);  // f32 summation order (measured 8.4e-8)
      ++layouts;
    }
  }
  CHECK(layouts == 8);
}

TEST_CASE("--offload_optimizer/--offload_params: the in-memory run, bitwise") {
  int runs = 0;
  // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects that).
  for (const auto& layout :
       {std::tuple{int64_t{2}, "host", "none"}, std::tuple{int64_t{3}, "nvme", "nvme"}}) {
    const int64_t zero = std::get<0>(layout);
    const char* optimizer = std::get<1>(layout);
    const char* params = std::get<2>(layout);
    CAPTURE(zero);
    MnistConfig c = small(12);
    c.dp = 2;
    c.zero = zero;
    const MnistResult memory = train_mnist(c);
    c.offload.optimizer = optimizer;
    c.offload.params = params;
    c.offload.dir = temp_dir();
    const MnistResult off = train_mnist(c);
    CHECK(off.losses == memory.losses);
    CHECK(off.test_loss == memory.test_loss);
    ++runs;
  }
  CHECK(runs == 2);
  MnistConfig bad = small(2);
  bad.offload.params = "host";
  bad.zero = 3;
  CHECK(contains(error_of([&] { train_mnist(bad); }), "mnist: --offload_params=host puts the "
                                                        "parameter shards with the optimizer's copies"));
}

// `compressed` (dp 2, exact through step 3) beside the same run without compression: the
// losses through step 4 (before step 4's update) are the same, later ones not.
MnistResult compressed_beside_exact(const MnistConfig& compressed) {
  MnistConfig c = compressed;
  c.compress.name = "none";
  const MnistResult exact = train_mnist(c);
  const MnistResult full = train_mnist(compressed);
  REQUIRE(full.losses.size() == 16);
  for (size_t k = 0; k < 4; ++k) CHECK(full.losses[k] == exact.losses[k]);
  CHECK(full.losses[4] != exact.losses[4]);  // step 4's reduction was the first compressed
  return full;
}

// `c` saved at step 8 of 16 and resumed: bitwise `full`'s last 8 losses and test loss.
MnistConfig check_resume(const MnistConfig& c, const std::string& path, const MnistResult& full) {
  MnistConfig save = c;
  save.max_steps = 8;
  save.save = path;
  train_mnist(save);
  MnistConfig rest = c;
  rest.resume = path;
  const MnistResult r = train_mnist(rest);
  REQUIRE(r.losses.size() == 8);
  for (size_t k = 0; k < 8; ++k) CHECK(r.losses[k] == full.losses[8 + k]);
  CHECK(r.test_loss == full.test_loss);
  return rest;
}

TEST_CASE("--compress=powersgd on --dp 2: exact steps, then the closed-form ratio; bitwise resume") {
  MnistConfig c = small(16);
  c.dp = 2;
  c.compress.name = "powersgd";
  c.compress.powersgd_start = 3;
  const MnistResult full = compressed_beside_exact(c);
  // At rank 1, a matrix of n x m elements sends n + m where that is under half of n m (PyTorch's
  // min_compression_rate 2), the biases whole.
  int64_t total = 0, sent = 0;
  for (const auto& [name, t] : make_model("mlp")->named_parameters()) {
    total += t.numel();
    const int64_t n = t.size(0), m = t.numel() / n;
    sent += t.dim() >= 2 && n * m > 2 * (n + m) ? n + m : t.numel();
  }
  MESSAGE("powersgd on the MLP: ", full.compress_ratio, " of the elements (formula ",
          static_cast<double>(sent) / static_cast<double>(total), ")");
  CHECK(std::abs(full.compress_ratio - static_cast<double>(sent) / static_cast<double>(total)) < 1e-12);
  // Under ZeRO 1-3 the hook reduces each whole segment and each rank keeps its block: the
  // same steps (every matrix draws the same initial Q whatever the buckets; 2 ranks sum
  // a + b in any layout; no clipping), bitwise.
  int stages = 0;
  for (int64_t zero : {1, 2, 3}) {
    CAPTURE(zero);
    MnistConfig z = c;
    z.zero = zero;
    const MnistResult r = train_mnist(z);
    CHECK(r.losses == full.losses);
    CHECK(r.test_loss == full.test_loss);
    CHECK(r.compress_ratio == full.compress_ratio);
    ++stages;
  }
  CHECK(stages == 3);
  MnistConfig z2 = c;
  z2.zero = 2;
  check_resume(z2, temp_dir() + "/mnist_powersgd_zero2.safetensors", full);
  MnistConfig rest = check_resume(c, temp_dir() + "/mnist_powersgd.safetensors", full);
  rest.dp = 4;  // the per-rank error feedback has no place on another number of ranks
  CHECK(contains(error_of([&] { train_mnist(rest); }),
                 "mnist: the checkpoint holds the gradient compression state of 2 data-parallel ranks"));
  rest.dp = 2;  // PowerSGD's state is per bucket, and ZeRO 1-3's buckets are its segments
  rest.zero = 2;
  CHECK(contains(error_of([&] { train_mnist(rest); }),
                 "mnist: the checkpoint's gradient compression state was saved under --zero 0, "
                 "whose buckets differ from --zero 2's: resume with --zero 0"));
}

TEST_CASE("--compress=onebit_adam on --dp 2: AdamW's warm-up, then 1 bit an element; bitwise resume") {
  MnistConfig c = small(16);
  c.dp = 2;
  c.compress.name = "onebit_adam";
  c.compress.onebit_freeze = 3;
  const MnistResult full = compressed_beside_exact(c);
  // Each parameter's update in bits, padded to 8 x 2 elements, and two scales per rank: an
  // all-reduce's bytes of padded / 32 + 2 elements.
  int64_t total = 0, sent = 0;
  for (const auto& [name, t] : make_model("mlp")->named_parameters()) {
    total += t.numel();
    sent += (t.numel() + 15) / 16 * 16 / 32 + 2;
  }
  MESSAGE("onebit_adam on the MLP: ", full.compress_ratio, " of the elements");
  CHECK(std::abs(full.compress_ratio - static_cast<double>(sent) / static_cast<double>(total)) < 1e-12);
  check_resume(c, temp_dir() + "/mnist_onebit.safetensors", full);
  // The paper's pair (the momentum, l2 scales) is another run from the freeze on, and a
  // checkpoint of one does not resume the other.
  MnistConfig paper = c;
  paper.compress.onebit_send = "momentum";
  paper.compress.onebit_scale = "l2";
  const MnistResult p = train_mnist(paper);
  for (size_t k = 0; k < 4; ++k) CHECK(p.losses[k] == full.losses[k]);
  CHECK(p.losses[4] != full.losses[4]);
  paper.resume = temp_dir() + "/mnist_onebit.safetensors";
  CHECK(contains(error_of([&] { train_mnist(paper); }),
                 "OnebitAdam: the state dict was saved with freeze_step 3, bias_correction true, "
                 "and sends the update with l1 scales, bounded; this optimizer has freeze_step 3, "
                 "bias_correction true, and sends the momentum with l2 scales"));
}

TEST_CASE("--dp and --compress: bad combinations are errors naming the flags") {
  MnistConfig c = small(4);
  c.dp = 3;
  CHECK(contains(error_of([&] { train_mnist(c); }), "mnist: --batch 64 must divide into --dp 3 equal slices"));
  c = small(4);
  c.compress.name = "powersgd";
  CHECK(contains(error_of([&] { train_mnist(c); }), "mnist: --compress=powersgd compresses the "
                                                   "data-parallel gradient reduction; it needs --dp >= 2"));
  c.dp = 2;
  c.precision = "f16";
  CHECK(contains(error_of([&] { train_mnist(c); }), "mnist: --compress=powersgd keeps error feedback"));
  c = small(4);
  c.dp = 2;
  c.compress.name = "onebit_adam";
  c.optimizer.name = "sgd";
  CHECK(contains(error_of([&] { train_mnist(c); }),
                 "mnist: --compress=onebit_adam is 1-bit Adam, which replaces AdamW; it needs "
                 "--optimizer=adamw (got --optimizer=sgd)"));
  c.optimizer.name = "adamw";
  c.zero = 1;
  CHECK(contains(error_of([&] { train_mnist(c); }),
                 "mnist: --compress=onebit_adam keeps whole momenta and variances on every rank "
                 "and reduces them itself after the warm-up; ZeRO 1 shards the optimizer state"));
  c = small(4);
  c.dp = 2;
  c.compress.name = "onebit";
  CHECK(contains(error_of([&] { train_mnist(c); }), "mnist: --compress must be none, powersgd or onebit_adam, got 'onebit'"));
  c.compress.name = "onebit_adam";
  c.compress.onebit_scale = "l3";
  CHECK(contains(error_of([&] { train_mnist(c); }), "mnist: --onebit_scale must be l1 or l2, got 'l3'"));
}

}  // namespace
}  // namespace tessera::mnist
