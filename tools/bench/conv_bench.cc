// CPU conv2d and max_pool2d benchmarks on the MNIST CNN's shapes (f32, batch 128): each conv's
// forward, input gradient and weight gradient, and each pooling layer's forward and
// forward + backward through autograd (max_pool2d(x).sum().backward()).
//
//   bazel run //tools/bench:conv_bench -- --threads 2 --reps 21
//   bazel run //tools/bench:conv_bench -- --check    # correctness only, no timing
//   bazel run //tools/bench:conv_bench -- --only pool2   # operations whose name has "pool2"
//
// Each figure is the median over --reps timed repetitions after --warmup untimed ones; a
// repetition of a fast operation loops it until it takes >= --min_ms. --check runs every
// timed operation on 1 thread and on --threads threads and requires the same bits (the
// kernels' reductions have a fixed order), and compares f32 with the f64 kernels.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "kernels/cpu/parallel.h"
#include "models/common/flags.h"
#include "tensor/ops.h"
#include "tools/bench/timing.h"

namespace {

using tessera::Shape;
using tessera::Tensor;

struct Options {
  int threads = 2;
  int reps = 15;
  int warmup = 3;
  double min_ms = 20.0;
  int64_t batch = 128;
  bool check = false;
  std::string only;  // run only operations whose name contains this
  bool cpu_time = false;
};

using tessera::bench::consume;
using tessera::bench::sink;

double median_ms(const Options& opts, const std::function<void()>& op) {
  return tessera::bench::median_ms(tessera::bench::Timing{opts.reps, opts.warmup, opts.min_ms, opts.cpu_time}, op);
}

// One benchmarked operation: returns its result (for --check) given inputs of a dtype.
struct Op {
  std::string name;
  double gflop;  // 0: not a FLOP-bound operation
  std::function<Tensor(tessera::DType)> run;
};

struct ConvShape {
  const char* name;
  Shape x, w;
};

// The f32 inputs as they are (so no conversion is timed), other dtypes converted.
Tensor as(const Tensor& t, tessera::DType dt) { return t.dtype() == dt ? t : t.cast(dt); }

std::vector<Op> make_ops(const Options& opts) {
  const int64_t n = opts.batch;
  const std::array<int64_t, 2> s1{1, 1}, p1{1, 1};
  std::vector<Op> ops;
  // Whether --only can match an operation of this layer ("conv" and "conv2_forward" match
  // "conv2"); inputs are drawn only for layers that will run.
  auto wanted = [&](const std::string& layer) {
    return opts.only.empty() || layer.find(opts.only) != std::string::npos ||
           opts.only.find(layer) != std::string::npos;
  };
  for (const ConvShape& cs : {ConvShape{"conv1", {n, 1, 28, 28}, {32, 1, 3, 3}},
                              ConvShape{"conv2", {n, 32, 14, 14}, {64, 32, 3, 3}}}) {
    if (!wanted(cs.name)) continue;
    const Tensor x = tessera::randn(cs.x), w = tessera::randn(cs.w), b = tessera::randn({cs.w[0]});
    const Tensor y = tessera::conv2d(x, w, b, s1, p1);
    const Tensor g = tessera::randn(y.shape());
    const double gflop =
        2.0 * static_cast<double>(y.numel()) * cs.w[1] * cs.w[2] * cs.w[3] / 1e9;
    const Shape xs = cs.x, ws = cs.w;
    ops.push_back({std::string(cs.name) + "_forward", gflop, [=](tessera::DType dt) {
                     return tessera::conv2d(as(x, dt), as(w, dt), as(b, dt), s1, p1);
                   }});
    ops.push_back({std::string(cs.name) + "_backward_input", gflop, [=](tessera::DType dt) {
                     return tessera::conv2d_backward_input(as(g, dt), as(w, dt), xs, s1, p1);
                   }});
    ops.push_back({std::string(cs.name) + "_backward_weight", gflop, [=](tessera::DType dt) {
                     return tessera::conv2d_backward_weight(as(g, dt), as(x, dt), ws, s1, p1);
                   }});
  }
  for (const auto& [name, shape] : {std::pair<const char*, Shape>{"pool1", {n, 32, 28, 28}},
                                    std::pair<const char*, Shape>{"pool2", {n, 64, 14, 14}}}) {
    if (!wanted(name)) continue;
    const Tensor x = tessera::randn(shape);
    ops.push_back({std::string(name) + "_forward", 0, [=](tessera::DType dt) {
                     return tessera::max_pool2d(as(x, dt), {2, 2});
                   }});
    ops.push_back({std::string(name) + "_forward_backward", 0, [=](tessera::DType dt) {
                     Tensor leaf = as(x, dt).detach().requires_grad_();
                     tessera::max_pool2d(leaf, {2, 2}).sum().backward();
                     return leaf.grad();
                   }});
  }
  return ops;
}

// Bitwise equality across thread counts and closeness to the f64 kernels.
bool check(const Options& opts, const std::vector<Op>& ops) {
  bool ok = true;
  for (const Op& op : ops) {
    tessera::cpu::set_num_threads(1);
    const Tensor one = op.run(tessera::DType::f32).contiguous();
    tessera::cpu::set_num_threads(opts.threads);
    const Tensor many = op.run(tessera::DType::f32).contiguous();
    const Tensor wide = op.run(tessera::DType::f64).cast(tessera::DType::f32).contiguous();
    const bool same = std::memcmp(one.raw_data(), many.raw_data(), one.numel() * 4) == 0;
    const std::vector<float> a = many.to_vector<float>(), r = wide.to_vector<float>();
    double err = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      err = std::max(err, std::fabs(static_cast<double>(a[i]) - r[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(r[i])));
    }
    const bool close = err <= 1e-5 * std::max(scale, 1.0);
    std::printf("%-28s 1 vs %d threads: %s   max |f32 - f64| = %.3g (max |f64| %.3g)%s\n",
                op.name.c_str(), opts.threads, same ? "same bits" : "DIFFERENT", err, scale,
                close ? "" : "  TOO FAR");
    ok = ok && same && close;
  }
  return ok;
}

Options parse(int argc, char** argv) {
  Options o;
  tessera::models::Flags f("conv_bench", "conv2d and max_pool2d of the MNIST CNN, timed.");
  f.bind("threads", o.threads, "kernel threads");
  f.bind("reps", o.reps, "timed repetitions (the median is reported)");
  f.bind("warmup", o.warmup, "untimed calls first");
  f.bind("min_ms", o.min_ms, "each repetition loops an op until it takes this long");
  f.bind("batch", o.batch, "images per batch");
  f.bind("check", o.check, "verify 1 vs 2 threads give the same bits, f32 vs f64");
  f.bind("only", o.only, "run only operations whose name contains this");
  f.bind("cpu_time", o.cpu_time, "time with process CPU time, not wall time");
  f.parse(argc, argv);
  TS_CHECK(o.threads >= 1 && o.reps >= 1 && o.batch >= 1 && o.warmup >= 0,
           "conv_bench: --threads, --reps, --batch must be >= 1, --warmup >= 0");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options opts;
  try {
    opts = parse(argc, argv);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::vector<Op> ops = make_ops(opts);
  std::erase_if(ops, [&](const Op& op) { return op.name.find(opts.only) == std::string::npos; });
  if (opts.check) return check(opts, ops) ? 0 : 1;
  tessera::cpu::set_num_threads(opts.threads);
  std::printf("Tessera conv/pool benchmarks: f32, batch %lld, %d thread(s), median of %d reps%s\n",
              static_cast<long long>(opts.batch), opts.threads, opts.reps,
              opts.cpu_time ? " (process CPU time)" : "");
  std::printf("%-28s %10s %10s\n", "operation", "median ms", "GFLOP/s");
  for (const Op& op : ops) {
    const double ms = median_ms(opts, [&] { consume(op.run(tessera::DType::f32)); });
    if (op.gflop > 0) {
      std::printf("%-28s %10.3f %10.1f\n", op.name.c_str(), ms, op.gflop / (ms * 1e-3));
    } else {
      std::printf("%-28s %10.3f %10s\n", op.name.c_str(), ms, "-");
    }
  }
  return sink == 12345.0f ? 1 : 0;  // reads sink so the work stays observable
}
