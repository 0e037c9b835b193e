// GPU throughput of Tessera's CUDA backend beside the hardware's own ceilings, timed with CUDA
// events on the compute stream (warm-up calls, then the median of --reps timed calls; inputs
// rotated over enough copies, or large enough, to defeat the 50 MB L2):
//   copy        cudaMemcpyAsync device-to-device (the bandwidth ceiling; read + write bytes)
//   matmul      f32 (TF32 off / on), bf16, f16 at 4096^3, 8192^3 and GPT-2 124M's shapes;
//               the LM head's three bf16 products (50,257-wide rows, off 16-byte alignment)
//               staged through aligned copies and not (kernels/cuda/matmul.cc)
//   elementwise add of two 256 MiB f32 tensors, gelu, bf16 add, clone; copies that are not
//               one memcpy (heads permute, qkv column slice, transpose, f32 -> bf16 cast)
//   adamw       optim::AdamW::step over GPT-2 124M's 148 parameter tensors (28 B/param), and
//               optim::AdamW8bit::step (16 + 16/256 B/param from 4096 elements, 28 below),
//               optim::Adafactor::step (hf defaults: the fused passes, 24 B/param)
//   compress    sign_pack and sign_unpack of 256 MiB of f32 (1-bit compression)
//   moe         the grouped matmul (bf16, GPT-2 width, 8 experts) against one GEMM of the same
//               FLOPs and a loop of per-expert matmuls; its backward
//   attention   causal bf16 forward and forward + backward, B=8 H=12 T=1024 D=64
// Prints a markdown table and, with --json=PATH, one JSON line per row.
//
//   bazel run --config=cuda //tools/bench:gpu_bench -- --json=/tmp/gpu.jsonl
//   bin/gpu_bench --only=matmul --reps=10            (tools/bench/run_gpu_bench.sh)
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/cuda/strided_index.h"
#include "models/common/flags.h"
#include "optim/adamw.h"
#include "optim/adafactor.h"
#include "optim/adamw8bit.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::bench {
namespace {

using cuda_kernels::compute_stream;
using cuda_kernels::cuda_check;

struct Options {
  Device device = cuda(0);
  int reps = 20;
  int warmup = 3;
  std::string only;  // run the groups whose name contains this
};

struct Row {
  std::string group, name, shape, dtype;
  double ms = 0.0;
  double tflops = 0.0;  // 0: not a FLOP count
  double gbps = 0.0;    // 0: not a byte count
  std::string note;
};

// Median time (ms) of one call of op(i), i counting calls (for rotating inputs), measured
// by events around each timed call after o.warmup untimed ones.
double median_ms(const Options& o, const std::function<void(int)>& op) {
  const Device d = o.device;
  const cudaStream_t s = compute_stream(d);
  int call = 0;
  for (int i = 0; i < o.warmup; ++i) op(call++);
  cuda_kernels::synchronize(d);
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate", d);
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate", d);
  std::vector<float> times;
  for (int r = 0; r < o.reps; ++r) {
    cuda_check(cudaEventRecord(start, s), "cudaEventRecord", d);
    op(call++);
    cuda_check(cudaEventRecord(stop, s), "cudaEventRecord", d);
    cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize", d);
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime", d);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  return n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
}

// Normal values on the device (random data: GEMM clocks and power depend on the bits).
Tensor random_on(const Shape& shape, DType dtype, Device d, double scale = 1.0) {
  Tensor x = randn(shape, DType::f32, d);
  if (scale != 1.0) x = mul(x, full({}, scale, DType::f32, d));
  return dtype == DType::f32 ? x : cast(x, dtype);
}

// Copies of one input enough to pass 2x the L2 (at most 8): call i uses copy i % n.
int rotation(int64_t bytes_per_set) {
  const int64_t l2x2 = 100ll << 20;
  return static_cast<int>(std::clamp<int64_t>((l2x2 + bytes_per_set - 1) / bytes_per_set, 1, 8));
}

std::string dims(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0) out.push_back('x');
    out.append(std::to_string(s[i]));
  }
  return out;
}

class Bench {
 public:
  explicit Bench(Options o) : o_(std::move(o)) {}

  bool wanted(const std::string& group) const {
    return o_.only.empty() || group.find(o_.only) != std::string::npos;
  }

  // Runs one row; an Error (an op missing on CUDA, out of memory) becomes a row noting it.
  void run(std::string group, std::string name, std::string shape, std::string dtype,
           const std::function<void(Row&)>& body) {
    Row row;
    row.group = std::move(group);
    row.name = std::move(name);
    row.shape = std::move(shape);
    row.dtype = std::move(dtype);
    try {
      body(row);
    } catch (const std::exception& e) {
      row.note = fmt::format("error: {}", e.what());
      if (row.note.size() > 160) row.note = row.note.substr(0, 157) + "...";
      cudaGetLastError();  // a sticky launch error stays; the next rows will say so
    }
    rows_.push_back(row);
    std::fprintf(stderr, "%-12s %-34s %-6s %9.3f ms %s\n", row.group.c_str(), row.name.c_str(),
                 row.dtype.c_str(), row.ms, row.note.c_str());
  }

  // Always run: the other rows quote it.
  void copy_ceiling() {
    run("copy", "cudaMemcpyAsync D2D", "1 GiB", "bytes", [&](Row& r) {
      const int64_t bytes = 1ll << 30;
      Tensor a = zeros({bytes / 4}, DType::f32, o_.device);
      Tensor b = zeros({bytes / 4}, DType::f32, o_.device);
      const cudaStream_t s = compute_stream(o_.device);
      r.ms = median_ms(o_, [&](int) {
        cuda_check(cudaMemcpyAsync(b.raw_data(), a.raw_data(), bytes, cudaMemcpyDeviceToDevice, s),
                   "cudaMemcpyAsync", o_.device);
      });
      r.gbps = 2.0 * bytes / (r.ms * 1e6);
      ceiling_gbps_ = r.gbps;
    });
  }

  void matmuls() {
    if (!wanted("matmul")) return;
    const std::vector<std::pair<Shape, Shape>> shapes = {
        {{4096, 4096}, {4096, 4096}},   {{8192, 8192}, {8192, 8192}},
        {{8192, 768}, {768, 2304}},     {{8192, 768}, {768, 3072}},
        {{8192, 3072}, {3072, 768}},    {{8192, 768}, {768, 50257}}};
    struct Kind {
      DType dtype;
      bool tf32;
      const char* label;
    };
    const Kind kinds[] = {{DType::f32, false, "f32"}, {DType::f32, true, "tf32"},
                          {DType::bf16, false, "bf16"}, {DType::f16, false, "f16"}};
    for (const Kind& k : kinds) {
      for (const auto& [as, bs] : shapes) {
        run("matmul", fmt::format("[{}]x[{}]", dims(as), dims(bs)), "", k.label, [&](Row& r) {
          cuda_kernels::set_allow_tf32(k.tf32);
          const int64_t set_bytes = (numel_of(as) + numel_of(bs)) * dtype_size(k.dtype);
          const int n = rotation(set_bytes);
          std::vector<Tensor> a, b;
          for (int i = 0; i < n; ++i) {
            a.push_back(random_on(as, k.dtype, o_.device));
            b.push_back(random_on(bs, k.dtype, o_.device, 0.05));
          }
          r.shape = fmt::format("{} set(s)", n);
          r.ms = median_ms(o_, [&](int i) { (void)matmul(a[i % n], b[i % n]); });
          r.tflops = 2.0 * as[0] * as[1] * bs[1] / (r.ms * 1e9);
          const bool half = k.dtype == DType::bf16 || k.dtype == DType::f16;
          if (half && bs[1] % 8 != 0 && cuda_kernels::stage_unaligned_gemms()) {
            r.note = "unaligned rows: staged, copies included";
          }
        });
        cuda_kernels::set_allow_tf32(false);
      }
    }
    // GPT-2's head (vocab 50257, B8 T1024) in the layouts bf16 training gives it: autocast
    // casts the tied weight's transpose to a contiguous [768, 50257] (wt), so the logits are
    // x wt, their gradient's dX = dL wt^T and dW^T = x^T dL, every 50257-wide matrix 2 bytes
    // off 16-byte alignment per row. Each with the unaligned matrices staged through aligned
    // copies (the default) and read as they lie.
    const int64_t rows = 8192, C = 768, V = 50257;
    Tensor x, wt, dl;
    try {
      x = random_on({rows, C}, DType::bf16, o_.device);
      wt = random_on({C, V}, DType::bf16, o_.device, 0.05);
      dl = random_on({rows, V}, DType::bf16, o_.device, 0.05);
    } catch (const std::exception& e) {  // out of memory: a row saying so, the other groups run
      const std::string what = e.what();
      run("matmul", "head products (set-up)", "", "bf16", [&](Row&) { throw std::runtime_error(what); });
      return;
    }
    const struct {
      const char* name;
      std::function<void()> fn;
    } head[] = {{"head x wt [8192,768]x[768,50257]", [&] { (void)matmul(x, wt); }},
                {"head dX [8192,50257]x[50257,768]", [&] { (void)matmul(dl, wt.t()); }},
                {"head dW^T [768,8192]x[8192,50257]", [&] { (void)matmul(x.t(), dl); }}};
    for (const auto& h : head) {
      for (bool staged : {true, false}) {
        run("matmul", std::string(h.name) + (staged ? ", staged" : ", unstaged"), "", "bf16", [&](Row& r) {
          cuda_kernels::set_stage_unaligned_gemms(staged);
          r.ms = median_ms(o_, [&](int) { h.fn(); });
          r.tflops = 2.0 * rows * C * V / (r.ms * 1e9);
          r.note = staged ? "copies included" : "";
        });
        cuda_kernels::set_stage_unaligned_gemms(true);
      }
    }
  }

  void elementwise() {
    if (!wanted("elementwise")) return;
    const int64_t n = (256ll << 20) / 4;  // 256 MiB of f32
    auto bytes_row = [&](const std::string& name, DType dt, int tensors,
                         const std::function<std::function<void(int)>()>& make) {
      run("elementwise", name, fmt::format("{} elems", n), std::string(dtype_name(dt)),
          [&](Row& r) {
        const std::function<void(int)> op = make();
        r.ms = median_ms(o_, op);
        r.gbps = static_cast<double>(tensors) * n * dtype_size(dt) / (r.ms * 1e6);
        if (ceiling_gbps_ > 0) {
          r.note = fmt::format("{:.0f}% of copy", 100 * r.gbps / ceiling_gbps_);
        }
      });
    };
    {
      Tensor a = random_on({n}, DType::f32, o_.device), b = random_on({n}, DType::f32, o_.device);
      bytes_row("add(a, b)", DType::f32, 3, [&] { return [&](int) { (void)add(a, b); }; });
      bytes_row("gelu(a) tanh", DType::f32, 2, [&] { return [&](int) { (void)gelu(a, true); }; });
      bytes_row("clone(a)", DType::f32, 2, [&] { return [&](int) { (void)clone(a); }; });
    }
    {
      Tensor a = random_on({n}, DType::bf16, o_.device), b = random_on({n}, DType::bf16, o_.device);
      bytes_row("add(a, b)", DType::bf16, 3, [&] { return [&](int) { (void)add(a, b); }; });
    }
    strided_copies();
  }

  // Copies of GPT-2's shapes (B8 T1024 C768) that are not one memcpy: GB/s counts the bytes
  // read and written once; sources rotated over copies enough to pass 2x the L2. The note
  // names the path plan_copy (kernels/cuda/strided_index.h) takes.
  void strided_copies() {
    const int64_t B = 8, T = 1024, H = 12, D = 64, C = H * D;
    using View = std::function<Tensor(const Tensor&)>;
    auto copy_row = [&](const std::string& name, const std::string& shape, const Shape& base, DType dt,
                        const View& view, DType out_dt) {
      run("copy", name, shape, std::string(dtype_name(dt)), [&](Row& r) {
        std::vector<Tensor> src;
        const int64_t set_bytes = numel_of(base) * (dtype_size(dt) + dtype_size(out_dt));
        for (int k = 0, n = rotation(set_bytes); k < n; ++k) src.push_back(view(random_on(base, dt, o_.device)));
        const int64_t elems = src[0].numel();
        Tensor probe = Tensor::empty(src[0].shape(), out_dt, o_.device);
        const cuda_kernels::CopyPlan plan = cuda_kernels::plan_copy(
            cuda_kernels::dev_tensor(probe), cuda_kernels::dev_tensor_broadcast(src[0], probe.shape()));
        r.ms = median_ms(o_, [&](int i) {
          const Tensor& x = src[i % src.size()];
          (void)(out_dt == dt ? x.contiguous() : cast(x, out_dt));
        });
        r.gbps = static_cast<double>(elems) * (dtype_size(dt) + dtype_size(out_dt)) / (r.ms * 1e6);
        const char* path = cuda_kernels::copy_path_name(plan.path);
        r.note = ceiling_gbps_ > 0 ? fmt::format("{:.0f}% of copy, {} path", 100 * r.gbps / ceiling_gbps_, path)
                                   : fmt::format("{} path", path);
      });
    };
    copy_row("heads [B,T,H,D] -> [B,H,T,D]", "8x1024x12x64", {B, T, H, D}, DType::bf16,
             [](const Tensor& x) { return x.permute({0, 2, 1, 3}); }, DType::bf16);
    copy_row("qkv columns [B,T,3C] -> [B,T,C]", "8x1024x2304", {B, T, 3 * C}, DType::bf16,
             [&](const Tensor& x) { return x.slice(2, C, 2 * C); }, DType::bf16);
    copy_row("transpose [BT,C] -> [C,BT]", "8192x768", {B * T, C}, DType::f32,
             [](const Tensor& x) { return x.transpose(0, 1); }, DType::f32);
    copy_row("cast f32 -> bf16", "8192x768", {B * T, C}, DType::f32, [](const Tensor& x) { return x; },
             DType::bf16);
  }

  // GPT-2 124M's parameters in state-dict order (148 tensors, 124,439,808 values).
  static std::vector<Shape> gpt2_shapes() {
    const int64_t C = 768, V = 50257, T = 1024;
    std::vector<Shape> s = {{V, C}, {T, C}};
    for (int l = 0; l < 12; ++l) {
      const std::vector<Shape> block = {{C}, {C}, {3 * C, C}, {3 * C}, {C, C}, {C},
                                        {C}, {C}, {4 * C, C}, {4 * C}, {C, 4 * C}, {C}};
      s.insert(s.end(), block.begin(), block.end());
    }
    s.push_back({C});
    s.push_back({C});
    return s;
  }

  // GPT-2 124M's parameters (f32, on the device) with gradients, for the optimizer rows.
  std::vector<Tensor> gpt2_params_with_grads() const {
    std::vector<Tensor> params;
    for (const Shape& s : gpt2_shapes()) {
      Tensor p = random_on(s, DType::f32, o_.device, 0.02);
      p.requires_grad_();
      p.set_grad(random_on(s, DType::f32, o_.device, 1e-3));
      params.push_back(p);
    }
    return params;
  }

  void adamw() {
    if (!wanted("adamw")) return;
    run("adamw", "optim::AdamW::step, 148 tensors", "GPT-2 124M", "f32", [&](Row& r) {
      const std::vector<Tensor> params = gpt2_params_with_grads();
      int64_t count = 0;
      for (const Tensor& p : params) count += p.numel();
      optim::AdamWOptions ao;
      ao.lr = 1e-4;
      ao.betas = {0.9, 0.95};
      ao.weight_decay = 0.1;
      optim::AdamW opt(params, ao);
      r.shape = fmt::format("{} tensors, {} params", params.size(), count);
      r.ms = median_ms(o_, [&](int) { opt.step(); });
      // Read: param, grad, exp_avg, exp_avg_sq; written: param, exp_avg, exp_avg_sq.
      r.gbps = 28.0 * static_cast<double>(count) / (r.ms * 1e6);
      if (ceiling_gbps_ > 0) r.note = fmt::format("{:.0f}% of copy", 100 * r.gbps / ceiling_gbps_);
    });
    run("adamw", "optim::AdamW8bit::step, 148 tensors", "GPT-2 124M", "f32", [&](Row& r) {
      const std::vector<Tensor> params = gpt2_params_with_grads();
      int64_t count = 0;
      double bytes = 0;
      for (const Tensor& p : params) {
        const int64_t n = p.numel();
        count += n;
        // 8-bit from 4096 elements: param and grad read, param written (12), both codes read
        // and written (4), two scales per block read and written; below, adamw_'s 28.
        bytes += (n >= 4096 ? 16.0 + 16.0 / 256 : 28.0) * static_cast<double>(n);
      }
      optim::AdamW8bitOptions ao;
      ao.lr = 1e-4;
      ao.betas = {0.9, 0.95};
      ao.weight_decay = 0.1;
      optim::AdamW8bit opt(params, ao);
      r.shape = fmt::format("{} tensors, {} params", params.size(), count);
      r.ms = median_ms(o_, [&](int) { opt.step(); });
      r.gbps = bytes / (r.ms * 1e6);
      if (ceiling_gbps_ > 0) r.note = fmt::format("{:.0f}% of copy", 100 * r.gbps / ceiling_gbps_);
    });
    run("adamw", "optim::Adafactor::step, 148 tensors", "GPT-2 124M", "f32", [&](Row& r) {
      // hf mode's defaults (relative step, parameter scale, no first moment): the fused passes
      // for the matrices. Fewest bytes per element of a matrix: the gradient read by each of
      // the three passes (12), the parameter read for its RMS (4), read and written by the
      // update (8). The 1-D parameters (0.08% of the elements) take ops: counted the same.
      const std::vector<Tensor> params = gpt2_params_with_grads();
      int64_t count = 0;
      for (const Tensor& p : params) count += p.numel();
      optim::Adafactor opt(params, optim::AdafactorOptions{});
      r.shape = fmt::format("{} tensors, {} params", params.size(), count);
      r.ms = median_ms(o_, [&](int) { opt.step(); });
      r.gbps = 24.0 * static_cast<double>(count) / (r.ms * 1e6);
      if (ceiling_gbps_ > 0) r.note = fmt::format("{:.0f}% of copy", 100 * r.gbps / ceiling_gbps_);
    });
  }

  // 1-bit compression's bit packing over 256 MiB of f32: sign_pack reads 4 bytes and writes
  // 1/8 per element, sign_unpack the reverse.
  void compress() {
    if (!wanted("compress")) return;
    const int64_t n = (256ll << 20) / 4;
    const double bytes = 4.0 * n + n / 8.0;
    Tensor x = random_on({n}, DType::f32, o_.device);
    Tensor bits = sign_pack(x);
    const std::pair<const char*, std::function<void(int)>> rows[] = {
        {"sign_pack(x)", [&](int) { (void)sign_pack(x); }},
        {"sign_unpack(bits)", [&](int) { (void)sign_unpack(bits, n, DType::f32); }}};
    for (const auto& [name, op] : rows) {
      run("compress", name, fmt::format("{} elems", n), "f32", [&](Row& r) {
        r.ms = median_ms(o_, op);
        r.gbps = bytes / (r.ms * 1e6);
        if (ceiling_gbps_ > 0) r.note = fmt::format("{:.0f}% of copy", 100 * r.gbps / ceiling_gbps_);
      });
    }
  }

  // Mixture of Experts: the grouped matmul (one cuBLASLt GEMM per expert after reading the
  // group sizes on the host) against one GEMM of the same FLOPs and a loop of per-expert
  // matmuls over slices, at GPT-2 width: N = 16384 token-expert rows (8 x 1024 tokens, top 2),
  // C = 768, H = 3072, E = 8; rows split evenly, or Zipf-like (expert e's share ~ 1/(e+1)).
  // The backward rows: x's gradient (a grouped matmul with w transposed) plus the weights'.
  void moe() {
    if (!wanted("moe")) return;
    const int64_t N = 16384, C = 768, H = 3072, E = 8;
    const double flops = 2.0 * N * C * H;
    auto split = [&](double skew) {
      std::vector<int64_t> sizes(E);
      double total = 0;
      for (int64_t e = 0; e < E; ++e) total += 1.0 / std::pow(static_cast<double>(e + 1), skew);
      int64_t given = 0;
      for (int64_t e = 0; e < E; ++e) {
        sizes[e] = static_cast<int64_t>(N / std::pow(static_cast<double>(e + 1), skew) / total);
        given += sizes[e];
      }
      sizes[0] += N - given;
      return sizes;
    };
    const Tensor x = random_on({N, C}, DType::bf16, o_.device);
    const Tensor g = random_on({N, H}, DType::bf16, o_.device);
    const Tensor w = random_on({E, C, H}, DType::bf16, o_.device, 0.02);
    const Tensor dense = random_on({C, H}, DType::bf16, o_.device, 0.02);
    const std::string shape = fmt::format("N{} C{} H{} E{}", N, C, H, E);
    run("moe", "one GEMM [N,C]x[C,H] (same FLOPs)", shape, "bf16", [&](Row& r) {
      r.ms = median_ms(o_, [&](int) { (void)matmul(x, dense); });
      r.tflops = flops / (r.ms * 1e9);
    });
    for (const double skew : {0.0, 1.0}) {
      const std::vector<int64_t> sizes = split(skew);
      const Tensor counts = Tensor::from_vector(sizes, {E}).to(o_.device);
      const std::string label = skew == 0 ? "even" : "zipf 1";
      run("moe", "grouped_matmul, " + label, shape, "bf16", [&](Row& r) {
        r.ms = median_ms(o_, [&](int) { (void)grouped_matmul(x, w, counts); });
        r.tflops = flops / (r.ms * 1e9);
      });
      run("moe", "loop of E matmul + cat, " + label, shape, "bf16", [&](Row& r) {
        r.ms = median_ms(o_, [&](int) {
          std::vector<Tensor> outs;
          int64_t start = 0;
          for (int64_t e = 0; e < E; ++e) {
            outs.push_back(matmul(slice(x, 0, start, start + sizes[e]), squeeze(slice(w, 0, e, e + 1), {0})));
            start += sizes[e];
          }
          (void)cat(outs, 0);
        });
        r.tflops = flops / (r.ms * 1e9);
      });
      run("moe", "grouped backward (dx + dw), " + label, shape, "bf16", [&](Row& r) {
        const Tensor wt = w.transpose(1, 2);
        r.ms = median_ms(o_, [&](int) {
          (void)grouped_matmul(g, wt, counts);
          (void)grouped_matmul_backward_weight(x, g, counts);
        });
        r.tflops = 2 * flops / (r.ms * 1e9);
      });
    }
  }

  void attention_fwd_bwd() {
    if (!wanted("attention")) return;
    const int64_t B = 8, H = 12, T = 1024, D = 64;
    // FlashAttention's convention: forward 4 B H T^2 D (halved when causal), backward 2.5x.
    const double fwd_flops = 4.0 * B * H * T * T * D / 2.0;
    auto make = [&](bool grad) {
      Tensor t = random_on({B, H, T, D}, DType::bf16, o_.device);
      if (grad) t.requires_grad_();
      return t;
    };
    run("attention", "forward, causal", fmt::format("B{} H{} T{} D{}", B, H, T, D), "bf16",
        [&](Row& r) {
          NoGradGuard no_grad;
          Tensor q = make(false), k = make(false), v = make(false);
          r.ms = median_ms(o_, [&](int) { (void)attention(q, k, v, true); });
          r.tflops = fwd_flops / (r.ms * 1e9);
        });
    run("attention", "forward + backward, causal", fmt::format("B{} H{} T{} D{}", B, H, T, D),
         "bf16",
        [&](Row& r) {
          Tensor q = make(true), k = make(true), v = make(true);
          Tensor dout = random_on({B, H, T, D}, DType::bf16, o_.device);
          r.ms = median_ms(o_, [&](int) {
            for (const Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());  // no accumulation
            attention(q, k, v, true).backward(dout);
          });
          r.tflops = 3.5 * fwd_flops / (r.ms * 1e9);
        });
  }

  void report(const std::string& json_path) const {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, o_.device.index);
    std::printf("Tessera CUDA backend on %s (%s), CUDA events, median of %d calls after %d "
                "warm-up calls.\n\n",
                prop.name, fmt::format("{}", o_.device).c_str(), o_.reps, o_.warmup);
    std::printf("| group | op | shape | dtype | ms | TFLOP/s | GB/s | note |\n");
    std::printf("|---|---|---|---|---:|---:|---:|---|\n");
    auto num = [](double v, int digits) {
      return v > 0 ? fmt::format("{:.{}f}", v, digits) : std::string();
    };
    for (const Row& r : rows_) {
      std::printf("| %s | %s | %s | %s | %s | %s | %s | %s |\n", r.group.c_str(), r.name.c_str(),
                  r.shape.c_str(), r.dtype.c_str(), num(r.ms, 3).c_str(),
                  num(r.tflops, 1).c_str(), num(r.gbps, 0).c_str(), r.note.c_str());
    }
    if (json_path.empty()) return;
    std::ofstream out(json_path, std::ios::app);
    TS_CHECK(out.good(), "gpu_bench: cannot write {}", json_path);
    for (const Row& r : rows_) {
      auto quoted = [](const std::string& s) {
        std::string q = "\"";
        for (char c : s) {
          if (c == '"' || c == '\\') q += '\\';
          q += (c == '\n' ? ' ' : c);
        }
        return q + "\"";
      };
      out << fmt::format(
          "{{\"framework\": \"tessera\", \"device\": {}, \"group\": {}, \"op\": {}, "
          "\"shape\": {}, \"dtype\": {}, \"ms\": {}, \"tflops\": {}, \"gbps\": {}, "
          "\"note\": {}}}\n",
          quoted(prop.name), quoted(r.group), quoted(r.name), quoted(r.shape), quoted(r.dtype),
          r.ms, r.tflops, r.gbps, quoted(r.note));
    }
  }

 private:
  Options o_;
  std::vector<Row> rows_;
  double ceiling_gbps_ = 0.0;
};

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  using namespace tessera;
  bench::Options o;
  std::string device = "cuda";
  int64_t reps = o.reps, warmup = o.warmup;
  std::string json;
  models::Flags f("gpu_bench", "GPU throughput of Tessera's CUDA kernels beside the copy ceiling.");
  f.bind("device", device, "cuda or cuda:N");
  f.bind("reps", reps, "timed calls per row (the median is reported)");
  f.bind("warmup", warmup, "untimed calls first");
  f.bind("only", o.only, "only the groups whose name contains this (copy, matmul, ...)");
  f.bind("json", json, "append one JSON line per row here");
  try {
    f.parse(argc, argv);
    o.device = Device::parse(device);
    TS_CHECK(o.device.is_cuda(), "gpu_bench: --device must be cuda or cuda:N, got {}", device);
    TS_CHECK(reps > 0 && warmup >= 0, "gpu_bench: --reps must be positive and --warmup >= 0");
    o.reps = static_cast<int>(reps);
    o.warmup = static_cast<int>(warmup);
    bench::Bench b(o);
    b.copy_ceiling();
    b.matmuls();
    b.elementwise();
    b.adamw();
    b.compress();
    b.moe();
    b.attention_fwd_bwd();
    b.report(json);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
