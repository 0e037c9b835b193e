// bazel run //models:gpt -- [--layers=L] [--heads=H] [--width=C] [--context=T] [--batch=B]
//     [--steps=N] [--lr=LR] [--precision=f32|bf16|f16] [--data=FILE|DIR] [--save=PATH]
//     [--resume=PATH] [--metrics=PATH] [--sample=N] [--dp=N --zero=0..3 --accum=K] ...
//   mpirun -np 2 bazel-bin/models/gpt/gpt --dp=2 --zero=3   (one process per rank)
//   bazel run //models:gpt -- --pp=2 --dp=2 --tp=2 --microbatches=4 --schedule=1f1b
//   bazel run //models:gpt -- --pp=2 --dp=2 --check --steps=3     (layout vs one device, f64)
//   bazel run --config=cuda //models:gpt -- --device=cuda --precision=bf16
//   gpt --device=cuda --precision=bf16 --layers=12 --heads=12 --width=768 --context=1024
//       --vocab=50257 --synthetic_data --batch=8 --steps=50 --timing_skip=10 --val_every=0
//       --val_batches=1 --sample=0          (GPT-2 124M throughput, tools/bench/run_gpu_bench.sh)
// Trains a byte-level GPT on text (Debian's fortunes by default), reports the validation
// loss and prints a sample (--help lists all flags). Any failure is one "error: ..." line and
// exit code 1 (under mpirun the whole job stops); SIGTERM/SIGINT saves and exits 128 + signal.
#include <cstdio>

#include "models/common/run_control.h"
#include "models/gpt/cli.h"

int main(int argc, char** argv) {
  tessera::gpt::GptCli cli;
  tessera::models::Flags flags = tessera::gpt::gpt_flags(cli);
  return tessera::models::run_main([&] {
    flags.parse(argc, argv);
    const tessera::gpt::GptResult r = tessera::gpt::train_gpt(tessera::gpt::finish(cli));
    if (!r.check_report.empty()) {
      if (!r.check_ok) throw tessera::Error(r.check_report);  // "check: mismatch at step ..."
      if (cli.quiet) std::printf("%s\n", r.check_report.c_str());
      return;
    }
    if (cli.quiet) std::printf("val loss %.4f\n", r.val_loss);
    if (!r.sample_error.empty()) throw tessera::Error(r.sample_error);  // after the result
  });
}
