// The fused optimizer updates' throughput on the CPU: adamw_ (f32 moments) and adamw8bit_
// (8-bit moments, tensor/quant8.h) over the same f32 parameter, adamw8bit_segments_'s two
// passes on it as a tp shard that cuts blocks (runs of 384 of a 768-wide row-parallel
// weight on tp 2, GPT-2 small's attn.c_proj; the max all-reduce between the passes, of
// [2, blocks] values, is not timed), Adafactor's step on as many elements (its three fused
// passes, and written with ops), beside a plain copy of the same bytes and a STREAM triad
// (a = b + s c over f32 arrays of the same length, on the same threads: the machine's memory
// bandwidth, the ceiling for an update). Rounds alternate the six; each figure is the
// median over the rounds of each round's median time.
//
//   bazel run -c opt //tools/bench:optim_bench -- --numel 16777216 --threads 2 --rounds 5
//
// Bytes per element, read + written once each: adamw_ 28 (param, grad, exp_avg, exp_avg_sq
// read; param and both moments written), adamw8bit_ 12 + 4 + 2 x 8/256 (param and grad read,
// param written: 12; two u8 codes read and written: 4; the f32 absmax of each block read and
// written), the two passes 22 + 4 x 8/256 (pass 1 reads param, grad and both codes and
// writes param; pass 2 reads grad and the codes and writes the codes), copy 8 (read + write
// of an f32), triad 12 (two f32 reads, one write). elements/s is the figure that matters to a
// training step: the 8-bit update moves fewer bytes, so its GB/s is lower at equal speed.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "models/common/flags.h"
#include "optim/adafactor.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/quant8.h"
#include "tensor/random.h"
#include "tools/bench/timing.h"

int main(int argc, char** argv) {
  using namespace tessera;
  int64_t numel = int64_t{1} << 24;
  int64_t threads = 2, rounds = 5, reps = 9;
  models::Flags f("optim_bench", "the fused optimizer updates' throughput beside a copy.");
  f.bind("numel", numel, "parameter elements (f32)");
  f.bind("threads", threads, "kernel threads");
  f.bind("rounds", rounds, "alternating rounds");
  f.bind("reps", reps, "timed repetitions per round");
  f.parse(argc, argv);
  cpu::set_num_threads(static_cast<int>(threads));
  NoGradGuard no_grad;
  manual_seed(1);
  const int64_t blocks = quant8_blocks(numel);
  const Tensor p = randn({numel}), g = randn({numel}) * 1e-2;
  const Tensor m = zeros({numel}), v = zeros({numel});
  const Tensor c1 = full({numel}, quant8_map(Quant8Kind::signed_dynamic).zero_code(), DType::u8);
  const Tensor c2 = zeros({numel}, DType::u8);
  const Tensor a1 = zeros({blocks}), a2 = zeros({blocks});
  const Tensor src = randn({numel}), dst = zeros({numel});
  // The segments of runs of 384 elements, 768 apart: blocks 3r (256) and 3r + 1 (128).
  std::vector<int64_t> seg;
  for (int64_t e = 0; e < numel;) {
    const int64_t o = e % 384, at = e / 384 * 768 + o;
    const int64_t len = std::min({384 - o, kQuant8Block - at % kQuant8Block, numel - e});
    seg.insert(seg.end(), {e + len, at / kQuant8Block});
    e += len;
  }
  const int64_t whole_blocks = seg.back() + 1;
  const Tensor segments =
      Tensor::from_vector<int64_t>(seg, {static_cast<int64_t>(seg.size()) / 2, 2});
  const Tensor s1 = zeros({whole_blocks}), s2 = zeros({whole_blocks});
  const Tensor n1 = zeros({whole_blocks}), n2 = zeros({whole_blocks});
  int64_t ts = 0;
  int64_t t = 0, t8 = 0;
  const bench::Timing timing{static_cast<int>(reps), 2, 50.0, false};
  struct Row {
    const char* name;
    double bytes_per_element;
    std::vector<double> ms;
  };
  // Adafactor (hf, no first moment, the step not scaled by the parameter's RMS, as gpt's
  // flags default) on the same elements as a [numel / 1024, 1024] matrix:
  // written with ops, each a pass over the tensor; its bytes counted as the minimum a fused
  // step would move (param and grad read, param written: 12).
  // The fused passes and, beside them, the same step written with ops (fused = false).
  const Tensor af_p = randn({numel / 1024, 1024}), af_g = randn({numel / 1024, 1024}) * 1e-2;
  const Tensor af_q = af_p.clone();
  optim::AdafactorOptions af_options{.mode = optim::AdafactorMode::hf, .lr = 1e-3,
                                     .relative_step = false,
                                     .scale_parameter = false};  // (gpt's default)
  optim::Adafactor adafactor(std::vector<Tensor>{af_p}, af_options);
  af_options.fused = false;
  optim::Adafactor adafactor_ops(std::vector<Tensor>{af_q}, af_options);
  std::vector<Row> rows = {{"adamw_ (f32 moments)", 28.0, {}},
                           {"adamw8bit_ (8-bit moments)", 16.0 + 16.0 / kQuant8Block, {}},
                           {"adamw8bit_segments_ x 2", 22.0 + 32.0 / kQuant8Block, {}},
                           {"Adafactor step (fused)", 12.0, {}},
                           {"Adafactor step (ops)", 12.0, {}},
                           {"copy (f32)", 8.0, {}},
                           {"triad (STREAM, f32)", 12.0, {}}};
  const Tensor ta = zeros({numel}), tb = randn({numel}), tc = randn({numel});
  float* a_ptr = ta.data<float>();
  const float* b_ptr = tb.data<float>();
  const float* c_ptr = tc.data<float>();
  auto triad = [&] {
    cpu::parallel_for(0, numel, 1 << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) a_ptr[i] = b_ptr[i] + 3.0f * c_ptr[i];
    });
  };
  for (int64_t r = 0; r < rounds; ++r) {
    rows[0].ms.push_back(bench::median_ms(timing, [&] {
      adamw_(p, g, m, v, ++t, 1e-4, 0.9, 0.999, 1e-8, 0.01);
    }));
    rows[1].ms.push_back(bench::median_ms(timing, [&] {
      adamw8bit_(p, g, c1, c2, a1, a2, ++t8, 1e-4, 0.9, 0.999, 1e-8, 0.01);
    }));
    rows[2].ms.push_back(bench::median_ms(timing, [&] {
      ++ts;
      for (int pass : {1, 2}) {
        adamw8bit_segments_(p, g, c1, c2, s1, s2, Tensor(), segments, n1, n2, pass, ts, 1e-4,
                            0.9, 0.999, 1e-8, 0.01);
      }
    }));
    rows[3].ms.push_back(bench::median_ms(timing, [&] {
      af_p.set_grad(af_g);
      adafactor.step();
    }));
    rows[4].ms.push_back(bench::median_ms(timing, [&] {
      af_q.set_grad(af_g);
      adafactor_ops.step();
    }));
    rows[5].ms.push_back(bench::median_ms(timing, [&] { dst.copy_(src); }));
    rows[6].ms.push_back(bench::median_ms(timing, triad));
  }
  std::printf("%lld f32 elements, %lld threads, median of %lld rounds x %lld reps\n",
              static_cast<long long>(numel), static_cast<long long>(threads),
              static_cast<long long>(rounds), static_cast<long long>(reps));
  std::printf("%-28s %10s %12s %10s\n", "op", "ms", "Gelem/s", "GB/s");
  for (Row& row : rows) {
    std::sort(row.ms.begin(), row.ms.end());
    const double ms = row.ms[row.ms.size() / 2];
    const double eps = static_cast<double>(numel) / (ms * 1e-3);
    std::printf("%-28s %10.3f %12.3f %10.2f\n", row.name, ms, eps / 1e9,
                eps * row.bytes_per_element / 1e9);
  }
  // The update's bandwidth against the triad's, both GB/s of this run.
  auto gbs = [&](const Row& row) {
    return static_cast<double>(numel) / (row.ms[row.ms.size() / 2] * 1e-3) * row.bytes_per_element / 1e9;
  };
  std::printf("adamw_ at %.0f%% of the triad's GB/s\n", 100.0 * gbs(rows[0]) / gbs(rows[6]));
  return p.numel() > 0 ? 0 : 1;
}
