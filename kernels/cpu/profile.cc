// Per-op profile of a CPU run: with TESSERA_PROFILE=K set, every top-level CPU kernel call
// after the K-th optimizer step (a run of adamw_/sgd_ calls) is timed on the host, with the
// parallel jobs it started on the thread pool (kernels/cpu/parallel.h); at exit a table
// prints, per op, the calls, the milliseconds, their share of the profiled wall time and the
// parallel jobs, sorted by time, then the totals per step: ops, jobs, and the share of the
// step spent in GEMM ops (matmul, grouped matmul, conv) and outside them.
//
//   TESSERA_PROFILE=5 bazel-bin/models/gpt/gpt --synthetic_data --steps=15 ...
//
// With TESSERA_PROFILE_SHAPES=1 too, a second table breaks the GEMM ops down by their
// operands' shapes and layouts (N: row-major, T: transposed, S: other strides), with each
// shape's GFLOP/s (matmul and linear: 2 m n k per product) inside the step, to set beside
// the same products run alone (tools/bench/cpu_bench --only gemm). A linear's time includes
// its bias and activation; grouped matmul and conv rows show their time alone.
//
// Steps are counted per thread by the optimizer's fused update ops, so a run whose optimizer
// issues none (Adafactor) never starts the table; with simulated ranks every rank's ops are
// summed and "per step" divides by the steps of the furthest rank. With CUDA linked too, each backend's observer
// profiles its own device's calls and passes the others on.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/profile.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

struct Sum {
  long calls = 0;
  double ms = 0;
  long jobs = 0;
  double flops = 0;  // the shape table's rows: the products' FLOPs
};

struct Open {
  OpId op;
  std::chrono::steady_clock::time_point start;
  int64_t jobs_before;
  bool record;        // a top-level call after the skipped steps
  std::string shape;  // the shape table's key (GEMM ops, with TESSERA_PROFILE_SHAPES)
  double flops = 0;
};

struct Profile {
  std::mutex mu;
  long skip_steps = 0;
  long steps = 0;  // the most any thread has counted
  bool started = false;
  std::chrono::steady_clock::time_point first;
  std::map<OpId, Sum> by_op;
  bool shapes = false;                    // TESSERA_PROFILE_SHAPES
  std::map<std::string, Sum> by_shape;  // "op  [a] x [b]" -> its calls
  KernelObserver previous = nullptr;
};

Profile& profile() {
  static Profile* p = new Profile;
  return *p;
}

// Each thread's stack of open calls (ops call ops; only top-level calls are recorded), and its
// own optimizer steps (simulated ranks step on threads of their own).
thread_local std::vector<Open> t_open;
thread_local long t_steps = 0;
thread_local bool t_in_update = false;

void report_shapes(const Profile& p, double wall_ms) {
  std::vector<std::pair<std::string, Sum>> rows(p.by_shape.begin(), p.by_shape.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double ms = 0, flops = 0, flops_ms = 0;  // flops_ms: the time of the rows with a FLOP count
  std::fprintf(stderr, "\nGEMM ops by operand shapes (N row-major, T transposed, S strided):\n");
  std::fprintf(stderr, "| op and operands | calls | ms | %% of wall | GFLOP/s |\n|---|---:|---:|---:|---:|\n");
  for (const auto& [key, s] : rows) {
    ms += s.ms;
    if (s.flops > 0) {
      flops += s.flops;
      flops_ms += s.ms;
    }
    if (s.flops > 0 && s.ms > 0) {
      std::fprintf(stderr, "| %s | %ld | %.2f | %.1f | %.1f |\n", key.c_str(), s.calls, s.ms,
                   100.0 * s.ms / std::max(wall_ms, 1e-9), s.flops / (s.ms * 1e6));
    } else {
      std::fprintf(stderr, "| %s | %ld | %.2f | %.1f | |\n", key.c_str(), s.calls, s.ms,
                   100.0 * s.ms / std::max(wall_ms, 1e-9));
    }
  }
  std::fprintf(stderr, "| all GEMM ops | | %.2f | %.1f | %.1f (matmul and linear) |\n", ms,
               100.0 * ms / std::max(wall_ms, 1e-9), flops / (std::max(flops_ms, 1e-9) * 1e6));
}

void report() {
  Profile& p = profile();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.by_op.empty()) return;
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p.first).count();
  const long steps = std::max(1L, p.steps - p.skip_steps);
  std::vector<std::pair<OpId, Sum>> rows(p.by_op.begin(), p.by_op.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total_ms = 0, gemm_ms = 0;
  long calls = 0, jobs = 0;
  for (const auto& [op, s] : rows) {
    total_ms += s.ms;
    if (is_gemm_op(op)) gemm_ms += s.ms;
    calls += s.calls;
    jobs += s.jobs;
  }
  std::fprintf(stderr, "\nTessera CPU profile: %ld optimizer steps after %ld skipped; wall %.1f ms; %d threads\n",
               steps, p.skip_steps, wall_ms, num_threads());
  std::fprintf(stderr, "| op | calls | ms | %% of wall | parallel jobs |\n|---|---:|---:|---:|---:|\n");
  for (const auto& [op, s] : rows) {
    std::fprintf(stderr, "| %s | %ld | %.2f | %.1f | %ld |\n", std::string(op_name(op)).c_str(), s.calls, s.ms,
                 100.0 * s.ms / std::max(wall_ms, 1e-9), s.jobs);
  }
  std::fprintf(stderr, "| total in kernels | %ld | %.2f | %.1f | %ld |\n", calls, total_ms,
               100.0 * total_ms / std::max(wall_ms, 1e-9), jobs);
  std::fprintf(stderr,
               "per step: %.1f ms wall, %.0f kernel calls, %.0f parallel jobs; GEMM ops %.1f%% of the "
               "wall time, other kernels %.1f%%, outside kernels (autograd, allocation, Python-free "
               "glue) %.1f%%\n",
               wall_ms / steps, static_cast<double>(calls) / steps, static_cast<double>(jobs) / steps,
               100.0 * gemm_ms / wall_ms, 100.0 * (total_ms - gemm_ms) / wall_ms,
               100.0 * (wall_ms - total_ms) / wall_ms);
  if (p.shapes) report_shapes(p, wall_ms);
}

void observe(OpId op, Device device, bool begin, std::span<const Tensor> inputs) {
  Profile& p = profile();
  if (!device.is_cpu()) {
    if (p.previous != nullptr) p.previous(op, device, begin, inputs);
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (begin) {
    bool record = false;
    if (t_open.empty()) {
      // An optimizer step is a run of update calls; it is done when the next other op
      // begins. Only top-level calls count (a kernel may call ops).
      const bool update = op == OpId::adamw_ || op == OpId::sgd_;
      if (!update && t_in_update) ++t_steps;
      t_in_update = update;
      if (t_steps >= p.skip_steps) {
        std::lock_guard<std::mutex> lock(p.mu);
        p.steps = std::max(p.steps, t_steps);
        if (!p.started) {
          p.started = true;
          p.first = now;
          std::atexit(report);
        }
        record = true;
      }
    }
    Open o{op, now, internal::jobs_started(), record, {}};
    if (record && p.shapes && is_gemm_op(op)) {
      o.shape = std::string(op_name(op)) + " ";
      for (size_t i = 0; i < inputs.size() && i < 2; ++i) {
        if (!inputs[i].defined()) continue;
        if (i > 0) o.shape += " x ";
        o.shape += operand_key(inputs[i]);
      }
      o.flops = gemm_flops(op, inputs);
    }
    t_open.push_back(std::move(o));
    return;
  }
  if (t_open.empty()) return;
  const Open o = t_open.back();
  t_open.pop_back();
  if (!o.record) return;  // nested (counted in its top-level call), or before the profile
  std::lock_guard<std::mutex> lock(p.mu);
  Sum& s = p.by_op[o.op];
  ++s.calls;
  s.ms += std::chrono::duration<double, std::milli>(now - o.start).count();
  s.jobs += internal::jobs_started() - o.jobs_before;
  if (!o.shape.empty()) {
    Sum& g = p.by_shape[o.shape];
    ++g.calls;
    g.ms += std::chrono::duration<double, std::milli>(now - o.start).count();
    g.flops += o.flops;
  }
}

const bool kInstalled = [] {
  const char* v = std::getenv("TESSERA_PROFILE");
  if (v == nullptr || *v == '\0') return false;
  profile().skip_steps = std::atol(v);
  profile().shapes = profile_shapes_requested();
  profile().previous = kernel_observer();
  set_kernel_observer(&observe);
  return true;
}();

}  // namespace

bool profile_shapes_requested() {
  const char* v = std::getenv("TESSERA_PROFILE_SHAPES");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

bool is_gemm_op(OpId op) {
  return op == OpId::matmul || op == OpId::linear || op == OpId::grouped_matmul ||
         op == OpId::grouped_matmul_backward_weight || op == OpId::conv2d || op == OpId::conv2d_backward_input || op == OpId::conv2d_backward_weight;
}

std::string operand_key(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d > 0) s += ",";
    s += std::to_string(t.shape()[d]);
  }
  s += "]";
  if (t.dim() >= 2) {
    const int64_t rs = t.strides()[t.dim() - 2], cs = t.strides()[t.dim() - 1];
    s += cs == 1 || t.shape()[t.dim() - 1] == 1 ? "N" : rs == 1 || t.shape()[t.dim() - 2] == 1 ? "T" : "S";
  }
  return s;
}

double gemm_flops(OpId op, std::span<const Tensor> in) {
  if (in.size() < 2 || !in[0].defined() || !in[1].defined() || in[0].dim() < 1 || in[1].dim() < 1) return 0;
  const Tensor &a = in[0], &b = in[1];
  if (op == OpId::linear && b.dim() == 2) {
    const double k = static_cast<double>(a.shape().back());
    return k == 0 ? 0 : 2.0 * static_cast<double>(a.numel()) * static_cast<double>(b.shape()[0]);
  }
  if (op != OpId::matmul || a.dim() < 2 || b.dim() < 2) return 0;
  const double m = a.shape()[a.dim() - 2], k = a.shape()[a.dim() - 1], n = b.shape()[b.dim() - 1];
  double batch = 1;
  for (int64_t i = 1; i <= std::max(a.dim(), b.dim()) - 2; ++i) {
    const int64_t da = a.dim() - 2 - i >= 0 ? a.shape()[a.dim() - 2 - i] : 1;
    const int64_t db = b.dim() - 2 - i >= 0 ? b.shape()[b.dim() - 2 - i] : 1;
    batch *= static_cast<double>(da == 1 ? db : da);  // broadcasting: 1 against n (or 0)
  }
  return 2.0 * batch * m * n * k;
}

}  // namespace tessera::cpu
