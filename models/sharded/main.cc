// bazel run //models:sharded_mlp -- --dp=2 --tp=2       (simulated ranks: threads)
// mpirun -np 4 bazel-bin/models/sharded/sharded_mlp --dp=2 --tp=2   (one process per rank)
//
// Runs one step of the sharded MLP (sharded_mlp.h), prints the hidden activation's layout and
// rank 0's comm log, and checks loss and gradients against the same step on one device.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <mutex>

#include "models/common/flags.h"
#include "models/sharded/sharded_mlp.h"
#include "parallel/comm/launch.h"

using namespace tessera;
using namespace tessera::parallel;
using namespace tessera::examples;

namespace {

double max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = 0.0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]) / (1.0 + std::abs(y[i])));
  return m;
}

// Rank 0 reports; every rank checks.
bool report(const CommPtr& world, const ShardedMlpResult& r) {
  const ShardedMlpResult ref = single_device_mlp_step();
  const double err = std::max({max_diff(r.loss, ref.loss), max_diff(r.grad_w1, ref.grad_w1),
                               max_diff(r.grad_w2, ref.grad_w2)});
  if (world->rank() == 0) {
    std::printf("%s\ncollectives on rank 0:\n%s\n", r.describe_h.c_str(), r.comm_log.c_str());
    std::printf("loss %.6f (one device %.6f); max relative difference of loss and gradients: %.2e\n",
                r.loss.item<double>(), ref.loss.item<double>(), err);
  }
  return err < 1e-5;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t dp = 2, tp = 2;
  models::Flags flags("sharded_mlp", "one data + tensor parallel MLP step, checked against one device");
  flags.bind("dp", dp, "data-parallel degree (batch split)");
  flags.bind("tp", tp, "tensor-parallel degree (weights split)");
  flags.parse(argc, argv);
  bool ok = true;
  std::mutex mu;
  LaunchOptions options;
  options.program = "sharded_mlp";
  options.ranks_from = fmt::format("--dp {} x --tp {} = {}", dp, tp, dp * tp);
  launch(
      static_cast<int>(dp * tp),
      [&](CommPtr world) {
        const bool good = report(world, sharded_mlp_step(world, dp, tp));
        std::lock_guard<std::mutex> lock(mu);
        ok = ok && good;
      },
      options);
  if (!ok) std::fprintf(stderr, "sharded_mlp: result differs from the single-device step\n");
  return ok ? 0 : 1;
}
