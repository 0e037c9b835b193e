// Per-op profile of a CUDA run: with TESSERA_PROFILE=K set, every kernel call after the K-th
// optimizer step (a run of adamw_/sgd_ calls) is bracketed by CUDA events on the compute stream, and at
// exit a table prints, per op, the calls, the device time between the events and the host
// time spent inside the call (dispatch + launch), sorted by device time. Host time outside
// kernels (autograd bookkeeping, Python-free but not free) is the wall time minus these.
// A call's device time runs from the event before it to the event after it, so where the
// device waits on the host (it has caught up), that wait counts too.
//
// With TESSERA_PROFILE_SHAPES=1 too, a second table splits each op by its inputs' shapes,
// layouts (N row-major, T transposed, S strided) and dtypes, the 40 slowest rows, with the
// time per call and, for matmul and linear, TFLOP/s.
//
//   TESSERA_PROFILE=3 [TESSERA_PROFILE_SHAPES=1] bin/gpt --device=cuda --precision=bf16 --steps=6 ...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/profile.h"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

struct Record {
  OpId op;
  cudaEvent_t begin, end;
  double host_us;
  int shape = -1;  // index into Profile::shape_keys (TESSERA_PROFILE_SHAPES)
};

struct Profile {
  std::mutex mu;
  long skip_steps = 0;
  long steps = 0;
  bool in_update = false;
  std::vector<Record> records;
  bool shapes = false;                  // TESSERA_PROFILE_SHAPES
  std::vector<std::string> shape_keys;  // distinct "op [a]N bf16 x [b]T bf16" keys
  std::map<std::string, int> shape_index;
  std::vector<int> open_shape;         // with the open stack: each call's key (-1: none)
  std::vector<double> shape_flops;      // per key, one call's GEMM FLOPs (the shapes decide)
  std::vector<cudaEvent_t> open;  // stack of begin events (ops call ops)
  std::vector<std::chrono::steady_clock::time_point> open_host;
  std::chrono::steady_clock::time_point first;
  bool started = false;
};

Profile& profile() {
  static Profile* p = new Profile;
  return *p;
}

// The calls by op and input shapes, the slowest 40.
// record_ms: each record's device time.
void report_shapes(const Profile& p, const std::vector<float>& record_ms, double total_device) {
  struct Sum { long calls = 0; double device_ms = 0; };
  std::vector<Sum> sums(p.shape_keys.size());
  for (size_t i = 0; i < p.records.size(); ++i) {
    const int shape = p.records[i].shape;
    if (shape < 0) continue;
    ++sums[shape].calls;
    sums[shape].device_ms += record_ms[i];
  }
  std::vector<int> order(sums.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return sums[a].device_ms > sums[b].device_ms; });
  std::fprintf(stderr, "\nOps by input shapes (N row-major, T transposed, S strided), the slowest 40 of %zu:\n",
               order.size());
  std::fprintf(stderr, "| op and inputs | calls | device ms | device %% | us per call | TFLOP/s |\n"
                       "|---|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < order.size() && i < 40; ++i) {
    const Sum& s = sums[order[i]];
    const double flops = p.shape_flops[order[i]] * static_cast<double>(s.calls);
    std::fprintf(stderr, "| %s | %ld | %.2f | %.1f | %.1f | %s |\n", p.shape_keys[order[i]].c_str(),
                 s.calls, s.device_ms, 100.0 * s.device_ms / std::max(total_device, 1e-9),
                 1000.0 * s.device_ms / std::max(s.calls, 1L),
                 flops > 0 && s.device_ms > 0
                     ? std::to_string(static_cast<int>(flops / (s.device_ms * 1e9))).c_str()
                     : "");
  }
}

void report() {
  Profile& p = profile();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.records.empty()) return;
  cudaDeviceSynchronize();
  const double wall_ms = std::chrono::duration<double, std::milli>(
                             std::chrono::steady_clock::now() - p.first).count();
  struct Sum { long calls = 0; double device_ms = 0, host_ms = 0; };
  std::map<std::string, Sum> by_op;
  double total_device = 0, total_host = 0;
  std::vector<float> record_ms(p.records.size(), 0.0f);
  for (size_t i = 0; i < p.records.size(); ++i) {
    const Record& r = p.records[i];
    float& ms = record_ms[i];
    cudaEventElapsedTime(&ms, r.begin, r.end);
    Sum& s = by_op[std::string(op_name(r.op))];
    ++s.calls;
    s.device_ms += ms;
    s.host_ms += r.host_us / 1000.0;
    total_device += ms;
    total_host += r.host_us / 1000.0;
  }
  std::vector<std::pair<std::string, Sum>> rows(by_op.begin(), by_op.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.device_ms > b.second.device_ms; });
  std::fprintf(stderr, "\nTessera CUDA profile: %ld optimizer steps after %ld skipped; wall %.1f ms\n",
               p.steps - p.skip_steps, p.skip_steps, wall_ms);
  std::fprintf(stderr, "| op | calls | device ms | device %% | host ms |\n|---|---:|---:|---:|---:|\n");
  for (const auto& [name, s] : rows) {
    std::fprintf(stderr, "| %s | %ld | %.2f | %.1f | %.2f |\n", name.c_str(), s.calls, s.device_ms,
                 100.0 * s.device_ms / std::max(total_device, 1e-9), s.host_ms);
  }
  std::fprintf(stderr, "| total (top-level ops overlap nested ones) | | %.2f | | %.2f |\n",
               total_device, total_host);
  if (p.shapes) report_shapes(p, record_ms, total_device);
}

KernelObserver g_previous = nullptr;  // another backend's profile, if installed first

void observe(OpId op, Device device, bool begin, std::span<const Tensor> inputs) {
  if (!device.is_cuda()) {
    if (g_previous != nullptr) g_previous(op, device, begin, inputs);
    return;
  }
  Profile& p = profile();
  std::lock_guard<std::mutex> lock(p.mu);
  // An optimizer step is a run of update calls (AdamW issues one per bucket of parameters);
  // it counts as done when the next other op begins.
  const bool update = op == OpId::adamw_ || op == OpId::sgd_;
  if (begin && !update && p.in_update) ++p.steps;
  if (begin) p.in_update = update;
  if (p.steps < p.skip_steps) return;
  if (!p.started) {
    if (!begin) return;  // start on a clean bracket
    p.started = true;
    cudaDeviceSynchronize();
    p.first = std::chrono::steady_clock::now();
    std::atexit(report);
  }
  if (begin) {
    int shape = -1;
    if (p.shapes && p.open.empty()) {  // the key is built before the event: not timed
      std::string key(op_name(op));
      for (size_t i = 0; i < inputs.size() && i < 3; ++i) {
        if (!inputs[i].defined()) continue;
        key += (i ? " x " : " ") + cpu::operand_key(inputs[i]) + " " + std::string(dtype_name(inputs[i].dtype()));
      }
      const auto [it, added] = p.shape_index.try_emplace(key, static_cast<int>(p.shape_keys.size()));
      if (added) {
        p.shape_keys.push_back(key);
        p.shape_flops.push_back(cpu::gemm_flops(op, inputs));
      }
      shape = it->second;
    }
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e, compute_stream(device));
    p.open.push_back(e);
    p.open_host.push_back(std::chrono::steady_clock::now());
    p.open_shape.push_back(shape);
    return;
  }
  if (p.open.empty()) return;
  cudaEvent_t e;
  cudaEventCreate(&e);
  cudaEventRecord(e, compute_stream(device));
  const double host_us = std::chrono::duration<double, std::micro>(
                             std::chrono::steady_clock::now() - p.open_host.back()).count();
  // Nested calls (a kernel that calls ops) are recorded; only top-level ones would avoid
  // double counting, so nested records are dropped.
  const bool top_level = p.open.size() == 1;
  if (top_level) p.records.push_back({op, p.open.back(), e, host_us, p.open_shape.back()});
  p.open.pop_back();
  p.open_host.pop_back();
  p.open_shape.pop_back();
}

const bool kInstalled = [] {
  const char* v = std::getenv("TESSERA_PROFILE");
  if (v == nullptr || *v == '\0') return false;
  profile().skip_steps = std::atol(v);
  profile().shapes = cpu::profile_shapes_requested();
  g_previous = kernel_observer();
  set_kernel_observer(&observe);
  return true;
}();

}  // namespace
}  // namespace tessera::cuda_kernels
