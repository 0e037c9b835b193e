// Training the byte-level GPT (models/gpt/model.h) on text (models/data/text.h): the loop
// behind `bazel run //models:gpt`, callable from tests. AdamW (betas 0.9/0.95, decoupled
// weight decay on matrices and embeddings only), linear warmup + cosine decay, gradient
// clipping, f32 / bf16 / f16 mixed precision, periodic validation loss, safetensors
// checkpoints with exact resume, JSON-lines metrics, a progress line with tokens/s, and a
// seeded text sample (temperature, top-k) at the end. --device=cuda runs the single-rank loop
// on a GPU; --synthetic_data with --vocab=50257 trains GPT-2 sizes on random tokens (the GPU
// benchmark, tools/bench/run_gpu_bench.sh).
//
//   GptTrainConfig config;  config.layers = 2;  config.steps = 500;
//   GptResult r = train_gpt(config);      // r.val_loss in nats per byte, r.sample: the text
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/common/comm_hooks.h"
#include "models/common/offload_flags.h"
#include "models/common/optimizers.h"
#include "models/gpt/model.h"
#include "tensor/dtype.h"

namespace tessera::gpt {

struct GptTrainConfig {
  // The model (vocab: 256, the bytes of text; any size with synthetic_data).
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;
  int64_t context = 128;
  double dropout = 0.0;
  int64_t vocab = 256;            // at least 256 on text (tokens are bytes)
  int64_t vocab_pad = 1;          // the embedding's rows: vocab rounded up to a multiple (GptConfig)
  // Optimisation.
  int64_t batch = 16;             // sequences of `context` bytes per step
  int64_t steps = 3000;           // length of the schedule (the run ends here)
  int64_t max_steps = 0;          // stop after this many steps in all (0: steps); the
                                  // schedule still spans `steps`, so a stopped run resumes
  double lr = 1e-3;               // peak learning rate
  double min_lr_ratio = 0.1;      // the cosine decays to lr * this
  int64_t warmup = 100;           // linear warmup steps (at most steps / 2)
  double weight_decay = 0.1;      // on 2-D+ parameters only (optim::decay_groups)
  double beta1 = 0.9, beta2 = 0.95;
  // adamw | adamw8bit | adafactor | sgd (models/common/optimizers.h). adafactor keeps
  // factored second moments on every layout (ZeRO on row shards; tp shards sum the other
  // rows' or columns' statistics); adamw8bit 8-bit moments per 256-element block on every
  // layout (ZeRO on block shards; a tp shard that cuts blocks max-reduces their scales over
  // the holders), f32 for the embeddings with stable_embedding.
  std::string optimizer = "adamw";
  bool stable_embedding = false;
  // adamw8bit: parameters whose name contains one of these comma-separated parts keep f32
  // state on every layout ("wte,attn.c_proj").
  std::string f32_state;
  std::string adafactor_mode = "hf";
  double adafactor_beta1 = 0.0;
  bool adafactor_scale_parameter = false;
  double momentum = 0.9;  // sgd
  double clip = 1.0;              // max global gradient norm; 0 = no clipping
  std::string precision = "f32";  // f32 | bf16 | f16 (f16 with dynamic loss scaling)
  double loss_scale = 65536.0;    // f16: the dynamic loss scale's initial value
  int64_t seed = 0;               // initialisation, data windows, dropout, sampling
  // Data: a file or a directory of text files (empty: Debian's fortunes).
  std::string data;
  // Uniform random tokens in [0, vocab) instead of text (throughput benchmarks): Philox
  // draws keyed by the seed, validation on kSyntheticEvalBatches batches of their own.
  bool synthetic_data = false;
  // Validation: the mean loss over the first val_batches evaluation batches of the
  // validation split (0: all of them), every val_every steps (0: only at the end).
  int64_t val_every = 250;
  int64_t val_batches = 8;
  int64_t log_every = 10;         // steps between progress / metrics lines
  // Checkpoints and metrics.
  // Checkpoints are saved atomically (models/common/checkpoint.h: the previous one is kept
  // until the new one is complete); a SIGTERM/SIGINT finishes the step, saves, and stops.
  std::string save;               // written at the end (and every save_every steps)
  int64_t save_every = 0;
  std::string resume;             // continue from this checkpoint (the newest complete one)
  // --save writes a sharded checkpoint: `save` is a directory with one file per writing rank
  // (each its own shards; models/common/sharded_checkpoint.h), for models too large to
  // gather on one rank. --resume reads either kind into any layout.
  bool save_sharded = false;
  std::string metrics;            // JSON-lines file (appended to when resuming)
  // The sample generated at the end (sample_length 0: none).
  std::string prompt;             // empty: "\n"
  int64_t sample_length = 300;    // bytes generated after the prompt
  double temperature = 0.8;       // 0: greedy
  int64_t top_k = 40;             // 0: the whole vocabulary
  int64_t threads = 0;            // kernel threads (per rank); 0: all cores (shared by ranks)
  // A step whose loss or gradient norm is NaN or inf: "error" stops the run before anything
  // more is saved (the last checkpoint stays good); "skip" drops that step's update, as
  // f16 loss scaling does, and goes on (GptResult::nonfinite_skipped counts them).
  std::string nonfinite = "error";
  // Seconds a rank waits in a collective before the job is declared stalled (threads: the
  // rank's Error; mpirun: the watchdog aborts the job). 0: wait forever.
  double comm_timeout = 600;
  // Bytes of tensor memory this process may use (0: no cap): the run is refused up front
  // when its predicted peak (run_checks.h) exceeds it, else the machine's available memory,
  // and the CPU allocator throws a clean Error past it.
  int64_t memory_limit = 0;
  // Where the single-rank loop runs: cpu, cuda or cuda:N (a --config=cuda build). The model
  // is moved there after initialisation (same initial values as on the CPU), batches are
  // built on the CPU and copied over, checkpoints are written from CPU copies. Not yet with
  // --dp/--zero/--pp/--tp or mpirun.
  std::string device = "cpu";
  // The first steps of this run left out of tokens_per_s (warm-up: allocator growth,
  // library handles, autotuning). On a GPU every step ends at a synchronised point (its loss
  // is read after the optimizer step), so the figure is the device's.
  int64_t timing_skip = 0;
  // Data parallelism (parallel/zero.h): dp ranks, each a 1/dp slice of every batch, as
  // threads of this process or, under mpirun, one process each (dp = the world size); zero:
  // the ZeRO stage (0: gradients all-reduced; 1-3: optimizer state, gradients, parameters
  // partitioned; the transformer blocks are stage 3's units); accum: micro-batches per step.
  int64_t dp = 1;
  int64_t zero = 0;
  int64_t accum = 1;
  // Offload under ZeRO (models/common/offload_flags.h, parallel/offload.h): the optimizer's
  // state, f32 parameter copies and reduced gradient shards (--zero 1-3), and at --zero 3 the
  // parameter shards, off the device, in host memory or a swap file. The same numbers as in
  // memory; --memory_limit caps the device.
  models::OffloadChoice offload;
  // Gradient compression over dp (models/common/comm_hooks.h: --compress=powersgd on ZeRO
  // 0-3 and pp/tp, or onebit_adam in AdamW's place on ZeRO 0 and pp/tp, its scales per
  // stage tensor and tp shard, with their flags). Checkpoints keep each rank's error
  // feedback (a resume needs the same layout).
  models::CompressChoice compress;
  // Pipeline and tensor parallelism (models/gpt/parallel3d.h): pp stages x dp x tp ranks
  // (ZeRO 0-3 over dp), `microbatches` per dp rank and pipeline run by `schedule` (gpipe,
  // 1f1b, interleaved with `chunks` model chunks per rank), `accum` runs per step. Every
  // precision, dropout (the single-device masks) and recomputation; checkpoints are in the
  // single-device layout, so a run resumes under any other layout.
  int64_t pp = 1;
  int64_t tp = 1;
  int64_t microbatches = 1;
  std::string schedule = "1f1b";
  int64_t chunks = 1;
  // Activation recomputation: none | full (each block; with --pp, each pipeline chunk) |
  // selective (the attention core with dropout and the MLP activation, on every layout).
  std::string recompute = "none";
  // Compressed saved activations (autograd/saved_compression.h): none | int8 (8 bits and a
  // scale per 256 elements) | bf16; parameters and their casts are never compressed.
  std::string act_compress = "none";
  bool sp = false;  // sequence parallelism over tp
  // Mixture of Experts (nn/moe.h): experts > 0 replaces the MLP of every moe_every-th block
  // by `experts` experts, moe_top_k per token (--top_k is sampling's); dropless unless
  // capacity_factor > 0 (then per moe_groups groups of the batch's tokens, dropping by
  // drop_policy = position | score); router scores moe_score = softmax | sigmoid; the
  // balancing loss aux_loss (alpha), the router z_loss, and DeepSeek-V3's selection bias
  // moved by moe_bias_rate after each step from the step's global counts. Every layout and
  // --accum give one device's numbers; moe_groups are the whole batch's (each rank's
  // micro-batch takes its share); evaluation and sampling are dropless.
  int64_t experts = 0;
  int64_t moe_top_k = 2;
  int64_t moe_every = 2;
  int64_t moe_hidden = 0;
  double capacity_factor = 0.0;
  int64_t moe_groups = 1;
  std::string drop_policy = "position";
  std::string moe_score = "softmax";
  double aux_loss = 0.01;
  double z_loss = 0.0;
  double moe_bias_rate = 0.0;
  // Expert parallelism: the experts split over groups of ep consecutive dp ranks, each
  // expert's tokens sent to its rank and back by all-to-all (parallel/expert_parallel.h);
  // each rank keeps only its experts' parameters, reduced and ZeRO-sharded over the dp / ep
  // ranks holding the same ones (parallel::ExpertGroups); checkpoints hold them whole.
  int64_t ep = 1;
  // Instead of training: run the layout above and one device side by side in f64 and compare
  // every layer output, gradient and parameter at each step (models/gpt/check.h); stop at
  // the first tensor whose relative error exceeds check_tolerance. `inject`: a bug to inject
  // (skip_tied_allreduce, grad_times_dp, swap_microbatches, drop_dropout_offset), to see
  // the checker name it.
  bool check = false;
  double check_tolerance = 1e-9;
  std::string inject;
  bool verbose = true;            // progress line and summary on stdout

  GptConfig model_config() const;
  models::OptimizerChoice optimizer_choice() const;
};

// Validation batches of --synthetic_data (random tokens have no split of their own).
inline constexpr int64_t kSyntheticEvalBatches = 8;

struct GptResult {
  int64_t steps = 0;                  // total optimizer steps, including those before a resume
  std::vector<double> losses;         // each step's training loss, in this run
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, val loss), in this run
  double train_loss = 0.0;            // mean training loss over the last log window
  double val_loss = 0.0;              // of the final model
  double tokens_per_s = 0.0;          // over the training steps of this run (timing_skip on)
  int64_t peak_device_bytes = 0;      // the device allocator's high-water mark (--device)
  int64_t peak_host_bytes = 0;        // this process's tensor memory high-water mark
  double predicted_bytes = 0.0;       // the up-front prediction for this process
  int64_t nonfinite_skipped = 0;      // steps skipped by --nonfinite=skip
  int64_t skipped_steps = 0;          // f16 steps skipped for inf/NaN gradients
  int64_t optimizer_state_bytes = 0;  // rank 0's optimizer state after the run (one device,
                                      // dp and ZeRO: its shards' state)
  double optimizer_state_formula = 0; // the formula's bytes for the whole model on one device
                                      // (models::optimizer_state_formula_bytes)
  std::string sample;                 // the generated bytes (without the prompt)
  std::string sample_error;           // why sampling failed (the rest of the result stands)
  // Data-parallel runs (dp > 1, zero > 0 or mpirun): rank 0's tagged memory after the first
  // step (ZeroMemory::str()) and the bytes it sent in one step, in units of a ring pass
  // over the parameters (4 Ψ (n - 1) / n bytes: 2 for DDP and stages 1-2, 3 for stage 3).
  std::string memory_report;
  // --check: whether the layout equalled one device at every step, and the report.
  bool check_ok = true;
  std::string check_report;
  double comm_per_step = 0.0;
  // --compress: the gradient elements the last step sent over the elements of an exact
  // all-reduce (1 before compression starts).
  double compress_ratio = 1.0;
  // --experts: the last step's routing per Mixture-of-Experts block, over every rank (summed
  // over its micro-batches), and the mean of its aux_loss + z_loss.
  std::vector<nn::MoeLayerStats> moe_stats;
  double moe_loss = 0.0;
};

// Runs the ranks (threads, or this process's part under mpirun) and returns rank 0's result.
GptResult train_gpt(const GptTrainConfig& config);

struct SampleOptions {
  int64_t length = 300;       // bytes to generate
  double temperature = 0.8;   // logits are divided by it; 0: greedy (argmax)
  int64_t top_k = 40;         // sample among the k most likely bytes (0: all)
  uint64_t seed = 0;          // byte i draws Philox uniform (seed, i): reproducible
  DType precision = DType::f32;  // autocast dtype of the forward passes
};

// Autoregressive generation: the prompt's bytes (at least one), then `length` bytes, each
// drawn from softmax(logits / temperature) of the last position restricted to the top_k
// logits (ties broken by the lower byte), the window cropped to the model's context.
// Runs on the model's device under NoGradGuard in eval mode (the model's train/eval mode is
// restored) and does not touch the default generator, so sampling mid-training changes
// nothing after it. Returns the generated bytes only.
std::string sample(Gpt& model, const std::string& prompt, const SampleOptions& options);

}  // namespace tessera::gpt
