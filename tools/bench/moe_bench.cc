// The grouped matmul of Mixture of Experts (tessera::grouped_matmul) against one big GEMM of
// the same FLOPs (tessera::matmul), and against the loop of one matmul per expert that a
// framework without a grouped op runs: forward, and forward + backward (x's and the weights'
// gradients). Rows are split over the experts as a router would: --skew 0 evenly, else the
// counts of a Zipf-like draw (expert e gets a share proportional to 1 / (e + 1)^skew).
//
//   bazel run //tools/bench:moe_bench -- --threads 2 --rows 8192 --width 512 --hidden 2048 --experts 8
//
// GFLOP/s count 2 N C H per product (N rows, C in, H out): 1 product forward, 3 with backward.
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "kernels/cpu/parallel.h"
#include "models/common/flags.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tools/bench/timing.h"

namespace {

using tessera::Tensor;

struct Options {
  int threads = 2;
  int reps = 11;
  int warmup = 2;
  double min_ms = 50.0;
  int64_t rows = 8192;
  int64_t width = 512;
  int64_t hidden = 2048;
  int64_t experts = 8;
  double skew = 0.0;
};

std::vector<int64_t> split_rows(const Options& o) {
  std::vector<double> share(o.experts);
  for (int64_t e = 0; e < o.experts; ++e) share[e] = 1.0 / std::pow(static_cast<double>(e + 1), o.skew);
  const double total = std::accumulate(share.begin(), share.end(), 0.0);
  std::vector<int64_t> sizes(o.experts);
  int64_t given = 0;
  for (int64_t e = 0; e < o.experts; ++e) {
    sizes[e] = static_cast<int64_t>(std::floor(static_cast<double>(o.rows) * share[e] / total));
    given += sizes[e];
  }
  sizes[0] += o.rows - given;  // the remainder to the busiest
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tessera;
  Options o;
  models::Flags f("moe_bench", "grouped matmul vs one GEMM and vs a loop of per-expert matmuls");
  f.bind("threads", o.threads, "kernel threads");
  f.bind("reps", o.reps, "timed repetitions (median)");
  f.bind("warmup", o.warmup, "untimed calls first");
  f.bind("min_ms", o.min_ms, "each repetition loops the operation for at least this long");
  f.bind("rows", o.rows, "rows (token-expert assignments)");
  f.bind("width", o.width, "C: the model width (the product's K)");
  f.bind("hidden", o.hidden, "H: the expert's hidden width (the product's N)");
  f.bind("experts", o.experts, "E");
  f.bind("skew", o.skew, "0: equal groups; s > 0: expert e gets rows in proportion to 1/(e+1)^s");
  f.parse(argc, argv);
  cpu::set_num_threads(o.threads);
  manual_seed(0);
  const std::vector<int64_t> sizes = split_rows(o);
  const Tensor counts = Tensor::from_vector(sizes, {o.experts});
  const Tensor x = randn({o.rows, o.width}).requires_grad_();
  const Tensor w = (randn({o.experts, o.width, o.hidden}) * 0.02).detach().requires_grad_();
  const Tensor dense = (randn({o.width, o.hidden}) * 0.02).detach().requires_grad_();
  const Tensor g = randn({o.rows, o.hidden});
  const bench::Timing t{o.reps, o.warmup, o.min_ms, false};
  const double flops = 2.0 * static_cast<double>(o.rows) * o.width * o.hidden;

  const auto loop = [&](const Tensor& in) {
    std::vector<Tensor> outs;
    int64_t start = 0;
    for (int64_t e = 0; e < o.experts; ++e) {
      const Tensor we = squeeze(slice(w, 0, e, e + 1), {0});
      outs.push_back(matmul(slice(in, 0, start, start + sizes[e]), we));
      start += sizes[e];
    }
    return cat(outs, 0);
  };
  struct Row {
    const char* name;
    std::function<Tensor(const Tensor&)> fwd;
  };
  const std::vector<Row> rows = {
      {"one GEMM [N, C] @ [C, H]", [&](const Tensor& in) { return matmul(in, dense); }},
      {"grouped_matmul", [&](const Tensor& in) { return grouped_matmul(in, w, counts); }},
      {"loop of E matmuls + cat", loop},
  };
  std::string groups;
  for (int64_t s : sizes) groups += (groups.empty() ? "" : " ") + std::to_string(s);
  std::printf("moe_bench: N %lld rows, C %lld, H %lld, E %lld (rows per expert: %s), %d threads\n",
              static_cast<long long>(o.rows), static_cast<long long>(o.width),
              static_cast<long long>(o.hidden), static_cast<long long>(o.experts), groups.c_str(),
              o.threads);
  std::printf("%-28s %14s %14s %16s %16s\n", "", "forward ms", "GFLOP/s", "fwd+bwd ms", "GFLOP/s");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    double fwd_ms = 0, both_ms = 0;
    {
      const NoGradGuard no_grad;
      fwd_ms = bench::median_ms(t, [&] { bench::consume(r.fwd(x)); });
    }
    both_ms = bench::median_ms(t, [&] {
      const std::vector<Tensor> grads = autograd::grad({sum(r.fwd(x) * g)}, {x, i == 0 ? dense : w});
      bench::consume(grads[0]);
      bench::consume(grads[1]);
    });
    std::printf("%-28s %14.2f %14.1f %16.2f %16.1f\n", r.name, fwd_ms, flops / fwd_ms * 1e-6, both_ms,
                3 * flops / both_ms * 1e-6);
  }
  return 0;
}
