#include "models/gpt/cli.h"

#include "models/common/run_control.h"

namespace tessera::gpt {

models::Flags gpt_flags(GptCli& cli) {
  models::Flags f(
      "gpt", "Trains a byte-level GPT on text, reports the validation loss and samples from it.");
  f.bind("layers", cli.config.layers, "transformer blocks");
  f.bind("heads", cli.config.heads, "attention heads (must divide --width)");
  f.bind("width", cli.config.width, "embedding width");
  f.bind("context", cli.config.context, "sequence length in bytes");
  f.bind("dropout", cli.config.dropout, "dropout probability (embeddings, attention, residuals)");
  f.bind("vocab", cli.config.vocab, "token vocabulary (256 for text; e.g. 50257 with --synthetic_data)");
  f.bind("vocab_pad", cli.config.vocab_pad,
         "round the embedding's rows up to a multiple of this (e.g. 64: 50257 -> 50304), the "
         "padded logits masked (1: none)");
  f.bind("batch", cli.config.batch, "sequences per step");
  f.bind("steps", cli.config.steps, "optimizer steps (the length of the learning-rate schedule)");
  f.bind("max_steps", cli.config.max_steps, "stop after this many steps in all (0: --steps); resumable");
  f.bind("lr", cli.config.lr, "peak learning rate (AdamW, warmup then cosine decay)");
  f.bind("min_lr_ratio", cli.config.min_lr_ratio, "the cosine decays to lr times this");
  f.bind("warmup", cli.config.warmup, "linear warmup steps");
  f.bind("weight_decay", cli.config.weight_decay, "AdamW decoupled weight decay (not on 1-D params)");
  f.bind("beta1", cli.config.beta1, "AdamW beta1");
  f.bind("beta2", cli.config.beta2, "AdamW beta2");
  f.bind("optimizer", cli.config.optimizer,
         "adamw, adamw8bit (8-bit block-wise moments), adafactor (factored second moments) or sgd");
  f.bind("stable_embedding", cli.config.stable_embedding,
         "adamw8bit: keep f32 state for the embeddings (wte, wpe)");
  f.bind("f32_state", cli.config.f32_state,
         "adamw8bit: keep f32 state for parameters whose name contains one of these "
         "comma-separated parts (e.g. wte,attn.c_proj)");
  f.bind("adafactor_mode", cli.config.adafactor_mode,
         "Adafactor's reference: hf (transformers/fairseq), torch or optax");
  f.bind("adafactor_beta1", cli.config.adafactor_beta1, "Adafactor's first moment (0: none)");
  f.bind("adafactor_scale_parameter", cli.config.adafactor_scale_parameter,
         "Adafactor: scale the step by the parameter's RMS");
  f.bind("momentum", cli.config.momentum, "SGD momentum");
  f.bind("clip", cli.config.clip, "max global gradient norm (0: off)");
  f.bind("precision", cli.config.precision, "f32, bf16 or f16 (mixed precision; f16 scales the loss)");
  f.bind("loss_scale", cli.config.loss_scale, "f16: the dynamic loss scale's initial value");
  f.bind("data", cli.config.data, "a text file or a directory of them (empty: /usr/share/games/fortunes)");
  f.bind("synthetic_data", cli.config.synthetic_data, "train on uniform random tokens (benchmarks)");
  f.bind("val_every", cli.config.val_every, "steps between validation losses (0: only at the end)");
  f.bind("val_batches", cli.config.val_batches, "validation batches per evaluation (0: the whole split)");
  f.bind("log_every", cli.config.log_every, "steps between progress and metrics lines");
  f.bind("save", cli.config.save, "write a checkpoint here at the end (PATH and PATH's .state.safetensors)");
  f.bind("save_every", cli.config.save_every, "also write it every N steps (0: only at the end)");
  f.bind("save_sharded", cli.config.save_sharded,
         "--save writes a directory of per-rank shards (no rank gathers the model); any layout resumes it");
  f.bind("resume", cli.config.resume, "continue from this checkpoint");
  f.bind("metrics", cli.config.metrics, "append JSON-lines metrics here (for tools/plot_metrics.py)");
  f.bind("sample", cli.config.sample_length, "bytes to generate at the end (0: no sample)");
  f.bind("prompt", cli.config.prompt, "text the sample continues (empty: a newline)");
  f.bind("temperature", cli.config.temperature, "sampling temperature (0: greedy)");
  f.bind("top_k", cli.config.top_k, "sample among the k most likely bytes (0: all 256)");
  f.bind("seed", cli.config.seed, "seed of initialisation, data windows, dropout and sampling");
  f.bind("threads", cli.config.threads, "kernel threads per rank (0: the cores shared by the ranks)");
  f.bind("device", cli.config.device, "cpu, cuda or cuda:N (single rank; needs a --config=cuda build)");
  f.bind("timing_skip", cli.config.timing_skip, "first steps left out of the final tokens/s (warm-up)");
  f.bind("dp", cli.config.dp, "data-parallel ranks (threads here; under mpirun it must equal the process count)");
  f.bind("zero", cli.config.zero, "ZeRO stage: 0 all-reduce, 1 optimizer state, 2 + gradients, 3 + params");
  models::bind_compress_flags(f, cli.config.compress);
  f.bind("accum", cli.config.accum, "micro-batches per step (gradient accumulation)");
  models::bind_offload_flags(f, cli.config.offload);
  f.bind("pp", cli.config.pp, "pipeline stages (ranks: pp x dp x tp)");
  f.bind("tp", cli.config.tp, "tensor-parallel ranks (Megatron: must divide --heads)");
  f.bind("microbatches", cli.config.microbatches, "with --pp/--tp: pipeline micro-batches per dp rank per accumulation step");
  f.bind("schedule", cli.config.schedule, "pipeline schedule: gpipe, 1f1b or interleaved");
  f.bind("chunks", cli.config.chunks, "model chunks per pipeline rank (interleaved)");
  f.bind("recompute", cli.config.recompute,
         "activation recomputation: none, full (each block; with --pp each chunk) or selective "
         "(attention core with dropout, MLP activation)");
  f.bind("act_compress", cli.config.act_compress,
         "tensors saved for backward kept compressed: none, int8 (8 bits and a scale per 256 "
         "elements) or bf16");
  f.bind("sp", cli.config.sp, "sequence parallelism: the residual stream split along the sequence on tp");
  f.bind("experts", cli.config.experts, "Mixture of Experts: experts per MoE block (0: dense MLPs)");
  f.bind("moe_top_k", cli.config.moe_top_k, "experts each token uses (k)");
  f.bind("moe_every", cli.config.moe_every, "every N-th block is a Mixture-of-Experts block");
  f.bind("moe_hidden", cli.config.moe_hidden, "each expert's hidden width (0: 4 x --width)");
  f.bind("capacity_factor", cli.config.capacity_factor,
         "expert capacity ceil(tokens per group x k x F / E), tokens past it dropped (0: dropless)");
  f.bind("moe_groups", cli.config.moe_groups,
         "capacity groups the batch's tokens are split into (each rank's micro-batch its share)");
  f.bind("drop_policy", cli.config.drop_policy, "which tokens an over-full expert keeps: position or score");
  f.bind("moe_score", cli.config.moe_score, "router scores: softmax or sigmoid");
  f.bind("aux_loss", cli.config.aux_loss, "load-balancing loss coefficient alpha (Switch/GShard)");
  f.bind("z_loss", cli.config.z_loss, "router z-loss coefficient (ST-MoE)");
  f.bind("moe_bias_rate", cli.config.moe_bias_rate,
         "aux-loss-free balancing (DeepSeek-V3): selection-bias step per training step (0: off)");
  f.bind("ep", cli.config.ep, "expert parallelism: the experts split over groups of this many dp ranks");
  f.bind("check", cli.config.check,
         "instead of training, compare the layout with one device tensor by tensor (f64) each step");
  f.bind("check_tolerance", cli.config.check_tolerance, "--check: largest relative error per tensor");
  f.bind("inject", cli.config.inject,
         "--check debugging: a bug to inject (skip_tied_allreduce, grad_times_dp, "
         "swap_microbatches, drop_dropout_offset)");
  f.bind("nonfinite", cli.config.nonfinite,
         "a step with a NaN/inf loss or gradient norm: error (stop, keep the last checkpoint) "
         "or skip (drop its update)");
  f.bind("comm_timeout", cli.config.comm_timeout,
         "seconds a rank waits in a collective before the job is declared stalled (0: forever)");
  f.bind("memory_limit", cli.memory_limit,
         "tensor memory this process may use, e.g. 8G (0: the machine's available memory "
         "decides; runs predicted to need more are refused up front)");
  f.bind("quiet", cli.quiet, "no progress output");
  return f;
}

GptTrainConfig finish(const GptCli& cli) {
  GptTrainConfig c = cli.config;
  c.verbose = !cli.quiet;
  c.memory_limit = models::parse_bytes(cli.memory_limit, "gpt: --memory_limit");
  for (std::string* path : {&c.data, &c.save, &c.resume, &c.metrics, &c.offload.dir}) {
    *path = models::from_user_dir(*path);
  }
  return c;
}

}  // namespace tessera::gpt
