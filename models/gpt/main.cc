// bazel run //models:gpt -- [--layers=L] [--heads=H] [--width=C] [--context=T] [--batch=B]
//     [--steps=N] [--lr=LR] [--precision=f32|bf16|f16] [--data=FILE|DIR] [--save=PATH]
//     [--resume=PATH] [--metrics=PATH] [--sample=N] [--dp=N --zero=0..3 --accum=K] ...
//   mpirun -np 2 bazel-bin/models/gpt/gpt --dp=2 --zero=3   (one process per rank)
//   bazel run //models:gpt -- --pp=2 --dp=2 --tp=2 --microbatches=4 --schedule=1f1b
//   bazel run --config=cuda //models:gpt -- --device=cuda --precision=bf16
//   gpt --device=cuda --precision=bf16 --layers=12 --heads=12 --width=768 --context=1024
//       --vocab=50257 --synthetic_data --batch=8 --steps=50 --timing_skip=10 --val_every=0
//       --val_batches=1 --sample=0          (GPT-2 124M throughput, tools/bench/run_gpu_bench.sh)
// Trains a byte-level GPT on text (Debian's fortunes by default), reports the validation
// loss and prints a sample (--help lists all flags).
#include <cstdio>
#include <string>

#include "models/common/flags.h"
#include "models/gpt/train.h"
#include "tensor/error.h"

int main(int argc, char** argv) {
  tessera::gpt::GptTrainConfig c;
  tessera::models::Flags f(
      "gpt", "Trains a byte-level GPT on text, reports the validation loss and samples from it.");
  f.bind("layers", c.layers, "transformer blocks");
  f.bind("heads", c.heads, "attention heads (must divide --width)");
  f.bind("width", c.width, "embedding width");
  f.bind("context", c.context, "sequence length in bytes");
  f.bind("dropout", c.dropout, "dropout probability (embeddings, attention, residuals)");
  f.bind("vocab", c.vocab, "token vocabulary (256 for text; e.g. 50257 with --synthetic_data)");
  f.bind("batch", c.batch, "sequences per step");
  f.bind("steps", c.steps, "optimizer steps (the length of the learning-rate schedule)");
  f.bind("max_steps", c.max_steps, "stop after this many steps in all (0: --steps); resumable");
  f.bind("lr", c.lr, "peak learning rate (AdamW, warmup then cosine decay)");
  f.bind("min_lr_ratio", c.min_lr_ratio, "the cosine decays to lr times this");
  f.bind("warmup", c.warmup, "linear warmup steps");
  f.bind("weight_decay", c.weight_decay, "AdamW decoupled weight decay (not on 1-D params)");
  f.bind("beta1", c.beta1, "AdamW beta1");
  f.bind("beta2", c.beta2, "AdamW beta2");
  f.bind("clip", c.clip, "max global gradient norm (0: off)");
  f.bind("precision", c.precision, "f32, bf16 or f16 (mixed precision; f16 scales the loss)");
  f.bind("data", c.data, "a text file or a directory of them (empty: /usr/share/games/fortunes)");
  f.bind("synthetic_data", c.synthetic_data, "train on uniform random tokens (benchmarks)");
  f.bind("val_every", c.val_every, "steps between validation losses (0: only at the end)");
  f.bind("val_batches", c.val_batches, "validation batches per evaluation (0: the whole split)");
  f.bind("log_every", c.log_every, "steps between progress and metrics lines");
  f.bind("save", c.save, "write a checkpoint here at the end (PATH and PATH's .state.safetensors)");
  f.bind("save_every", c.save_every, "also write it every N steps (0: only at the end)");
  f.bind("resume", c.resume, "continue from this checkpoint");
  f.bind("metrics", c.metrics, "append JSON-lines metrics here (for tools/plot_metrics.py)");
  f.bind("sample", c.sample_length, "bytes to generate at the end (0: no sample)");
  f.bind("prompt", c.prompt, "text the sample continues (empty: a newline)");
  f.bind("temperature", c.temperature, "sampling temperature (0: greedy)");
  f.bind("top_k", c.top_k, "sample among the k most likely bytes (0: all 256)");
  f.bind("seed", c.seed, "seed of initialisation, data windows, dropout and sampling");
  f.bind("threads", c.threads, "kernel threads per rank (0: the cores shared by the ranks)");
  f.bind("device", c.device, "cpu, cuda or cuda:N (single rank; needs a --config=cuda build)");
  f.bind("timing_skip", c.timing_skip, "first steps left out of the final tokens/s (warm-up)");
  f.bind("dp", c.dp, "data-parallel ranks (threads here; under mpirun: the process count)");
  f.bind("zero", c.zero, "ZeRO stage: 0 all-reduce, 1 optimizer state, 2 + gradients, 3 + params");
  f.bind("accum", c.accum, "micro-batches per step (gradient accumulation)");
  f.bind("pp", c.pp, "pipeline stages (ranks: pp x dp x tp)");
  f.bind("tp", c.tp, "tensor-parallel ranks (Megatron: must divide --heads)");
  f.bind("microbatches", c.microbatches, "with --pp/--tp: micro-batches per dp rank per step");
  f.bind("schedule", c.schedule, "pipeline schedule: gpipe, 1f1b or interleaved");
  f.bind("chunks", c.chunks, "model chunks per pipeline rank (interleaved)");
  f.bind("recompute", c.recompute, "activation recomputation per pipeline chunk");
  f.bind("sp", c.sp, "sequence parallelism: the residual stream split along the sequence on tp");
  bool quiet = false;
  f.bind("quiet", quiet, "no progress output");
  try {
    f.parse(argc, argv);
    c.verbose = !quiet;
    for (std::string* path : {&c.data, &c.save, &c.resume, &c.metrics}) {
      *path = tessera::models::from_user_dir(*path);
    }
    const tessera::gpt::GptResult r = tessera::gpt::train_gpt(c);
    if (quiet) std::printf("val loss %.4f\n", r.val_loss);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
