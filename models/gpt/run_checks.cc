#include "models/gpt/run_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "models/common/flags.h"
#include "models/common/run_control.h"
#include "models/common/checkpoint.h"
#include "models/common/optimizers.h"
#include "models/common/sharded_checkpoint.h"
#include "parallel/comm/mpi.h"
#include "parallel/zero.h"
#include "tensor/device.h"
#include "tensor/error.h"

namespace tessera::gpt {

void validate_train_config(const GptTrainConfig& c) {
  using models::require_at_least, models::require_finite_at_least, models::require_fraction,
      models::require_one_of;
  constexpr const char* gpt = "gpt";
  // The model.
  require_at_least(gpt, "layers", c.layers, 1);
  require_at_least(gpt, "heads", c.heads, 1);
  require_at_least(gpt, "width", c.width, 1);
  require_at_least(gpt, "context", c.context, 1);
  require_at_least(gpt, "vocab", c.vocab, 1);
  require_at_least(gpt, "vocab_pad", c.vocab_pad, 1);
  TS_CHECK(c.width % c.heads == 0, "gpt: --width {} must be divisible by --heads {}", c.width,
           c.heads);
  require_fraction(gpt, "dropout", c.dropout, /*include_one=*/false);
  require_at_least(gpt, "experts", c.experts, 0);
  TS_CHECK(c.ep == 1 || c.experts > 0, "gpt: --ep {} splits Mixture-of-Experts experts over ranks; it "
           "needs --experts > 0", c.ep);
  if (c.experts > 0) {
    require_at_least(gpt, "moe_top_k", c.moe_top_k, 1);
    TS_CHECK(c.moe_top_k <= c.experts, "gpt: --moe_top_k {} must be at most --experts {}",
             c.moe_top_k, c.experts);
    require_at_least(gpt, "moe_every", c.moe_every, 1);
    TS_CHECK(c.moe_every <= c.layers, "gpt: --moe_every {} leaves no Mixture-of-Experts block in "
             "--layers {}", c.moe_every, c.layers);
    require_at_least(gpt, "moe_hidden", c.moe_hidden, 0);
    require_finite_at_least(gpt, "capacity_factor", c.capacity_factor, 0);
    require_at_least(gpt, "moe_groups", c.moe_groups, 1);
    // Each forward (a rank's micro-batch) takes its share of the batch's capacity groups.
    // (--check runs every layout as Gpt3d does, by micro-batches.)
    const bool by_microbatches = c.pp > 1 || c.tp > 1 || c.check;
    const int64_t parts = c.dp * c.accum * (by_microbatches ? c.microbatches : 1);
    TS_CHECK(c.capacity_factor == 0 || c.moe_groups % parts == 0,
             "gpt: --moe_groups {} capacity groups must divide among the batch's {} forwards "
             "(--dp {} x --accum {}{}), so that tokens drop as on one device", c.moe_groups, parts,
             c.dp, c.accum,
             by_microbatches ? fmt::format(" x --microbatches {}", c.microbatches) : std::string());
    TS_CHECK(c.capacity_factor == 0 || (c.batch * c.context) % c.moe_groups == 0,
             "gpt: --moe_groups {} must divide the batch's --batch {} x --context {} tokens", c.moe_groups,
             c.batch, c.context);
    require_one_of(gpt, "drop_policy", c.drop_policy, {"position", "score"});
    require_one_of(gpt, "moe_score", c.moe_score, {"softmax", "sigmoid"});
    require_finite_at_least(gpt, "aux_loss", c.aux_loss, 0);
    require_finite_at_least(gpt, "z_loss", c.z_loss, 0);
    require_finite_at_least(gpt, "moe_bias_rate", c.moe_bias_rate, 0);
    require_at_least(gpt, "ep", c.ep, 1);
    TS_CHECK(c.experts % c.ep == 0, "gpt: --ep {} must divide --experts {}", c.ep, c.experts);
    TS_CHECK(c.ep == 1 || c.dp % c.ep == 0,
             "gpt: --ep {} splits the experts over groups of dp ranks; it must divide --dp {}", c.ep, c.dp);
  }
  // Optimisation.
  require_at_least(gpt, "batch", c.batch, 1);
  require_at_least(gpt, "steps", c.steps, 1);
  require_at_least(gpt, "max_steps", c.max_steps, 0);
  TS_CHECK(std::isfinite(c.lr) && c.lr > 0, "gpt: --lr must be a finite number > 0, got {}",
           c.lr);
  require_fraction(gpt, "min_lr_ratio", c.min_lr_ratio, /*include_one=*/true);
  require_at_least(gpt, "warmup", c.warmup, 0);
  require_finite_at_least(gpt, "weight_decay", c.weight_decay, 0);
  require_fraction(gpt, "beta1", c.beta1, /*include_one=*/false);
  require_fraction(gpt, "beta2", c.beta2, /*include_one=*/false);
  models::validate_optimizer(gpt, c.optimizer_choice());
  TS_CHECK(c.f32_state.empty() || c.optimizer == "adamw8bit",
           "gpt: --f32_state keeps some of adamw8bit's state in f32; it needs "
           "--optimizer=adamw8bit (got --optimizer={})", c.optimizer);
  TS_CHECK(!c.stable_embedding || c.optimizer == "adamw8bit",
           "gpt: --stable_embedding keeps adamw8bit's embedding state in f32; it needs "
           "--optimizer=adamw8bit (got --optimizer={})", c.optimizer);
  TS_CHECK(std::isfinite(c.clip) && c.clip >= 0,
           "gpt: --clip must be a finite number >= 0 (0: no clipping), got {}", c.clip);
  models::precision_dtype(c.precision, gpt);
  TS_CHECK(std::isfinite(c.loss_scale) && c.loss_scale > 0,
           "gpt: --loss_scale must be a finite number > 0, got {}", c.loss_scale);
  require_at_least(gpt, "seed", c.seed, 0);
  // Validation, logging, checkpoints, sampling.
  require_at_least(gpt, "val_every", c.val_every, 0);
  require_at_least(gpt, "val_batches", c.val_batches, 0);
  require_at_least(gpt, "log_every", c.log_every, 1);
  require_at_least(gpt, "save_every", c.save_every, 0);
  TS_CHECK(c.save_every == 0 || !c.save.empty(),
           "gpt: --save_every {} needs --save (where to write the checkpoints)", c.save_every);
  TS_CHECK(!c.save_sharded || !c.save.empty(),
           "gpt: --save_sharded needs --save (the directory to write the shards into)");
  require_at_least(gpt, "sample", c.sample_length, 0);
  require_finite_at_least(gpt, "temperature", c.temperature, 0);
  require_at_least(gpt, "top_k", c.top_k, 0);
  require_at_least(gpt, "threads", c.threads, 0);
  Device::parse(c.device);
  require_at_least(gpt, "timing_skip", c.timing_skip, 0);
  require_one_of(gpt, "nonfinite", c.nonfinite, {"error", "skip"});
  TS_CHECK(std::isfinite(c.comm_timeout) && c.comm_timeout >= 0,
           "gpt: --comm_timeout must be a finite number of seconds >= 0 (0: no limit), got {}",
           c.comm_timeout);
  require_at_least(gpt, "memory_limit", c.memory_limit, 0);
  // Layouts.
  require_at_least(gpt, "dp", c.dp, 1);
  TS_CHECK(c.zero >= 0 && c.zero <= 3, "gpt: --zero must be 0, 1, 2 or 3, got {}", c.zero);
  require_at_least(gpt, "accum", c.accum, 1);
  models::validate_compress(gpt, c.compress, c.optimizer);
  models::offload_options("gpt", c.offload,
                          {.zero = c.zero, .other_layouts = c.pp > 1 || c.tp > 1,
                           .optimizer = c.optimizer, .compress = c.compress.name, .ep = c.ep});
  TS_CHECK(!c.offload.any() || Device::parse(c.device).is_cpu() || c.dp == 1,
           "gpt: offloading on {} runs one rank", c.device);
  models::require_compress_zero(gpt, c.compress, c.zero);
  // With --ep each rank keeps its experts only, reduced over the ranks holding the same ones
  // by plain reductions of flat shards.
  const bool experts_cut = c.ep > 1;
  TS_CHECK(!experts_cut || c.compress.name == "none",
           "gpt: --compress={} reduces over the whole data-parallel group, but with --ep {} each "
           "rank keeps only its experts, reduced over the ranks holding them", c.compress.name, c.ep);
  TS_CHECK(c.experts == 0 || c.optimizer != "adafactor" ||
               (c.dp == 1 && c.pp == 1 && c.tp == 1 && c.zero == 0 && !c.check),
           "gpt: --optimizer=adafactor factors each expert's matrices of the experts' [E, C, H] "
           "weights; ZeRO's row shards and the --pp/--tp layouts present 1-D and 2-D parameters "
           "only, so --experts with adafactor runs on one device (got --dp {} --zero {} --pp {} "
           "--tp {}{})", c.dp, c.zero, c.pp, c.tp, c.check ? " --check" : "");
  TS_CHECK(!experts_cut || c.optimizer == "adamw" || c.optimizer == "sgd",
           "gpt: --optimizer={} keeps per-row or per-block state that ZeRO's row or block shards "
           "carry; with --ep {} each rank keeps only its experts, sharded flat over the ranks "
           "holding them: use --optimizer=adamw or sgd", c.optimizer, c.ep);
  if (c.compress.name != "none") {
    TS_CHECK(!c.check, "gpt: --compress={} approximates the gradients, so --check (equality "
             "with one device) does not apply", c.compress.name);
    TS_CHECK(c.precision != "f16",
             "gpt: --compress={} keeps error feedback across steps, which f16's loss scaling "
             "breaks (an overflowing step's inf enters the error for good, and a new scale "
             "leaves it in the old units); use --precision=bf16 or f32",
             c.compress.name);
  }
  require_at_least(gpt, "pp", c.pp, 1);
  require_at_least(gpt, "tp", c.tp, 1);
  require_at_least(gpt, "microbatches", c.microbatches, 1);
  require_at_least(gpt, "chunks", c.chunks, 1);
  require_one_of(gpt, "schedule", c.schedule, {"gpipe", "1f1b", "interleaved"});
  require_one_of(gpt, "recompute", c.recompute, {"none", "full", "selective"});
  require_one_of(gpt, "act_compress", c.act_compress, {"none", "int8", "bf16"});
  TS_CHECK(c.act_compress == "none" || !c.check,
           "gpt: --act_compress={} rounds the activations backward reads, so --check (equality "
           "with one device) does not apply", c.act_compress);
  TS_CHECK(!c.sp || c.tp > 1, "gpt: --sp splits the sequence over tensor-parallel ranks; it "
           "needs --tp > 1");
  TS_CHECK(std::isfinite(c.check_tolerance) && c.check_tolerance > 0,
           "gpt: --check_tolerance must be a finite number > 0, got {}", c.check_tolerance);
  if (!c.inject.empty()) {
    require_one_of(gpt, "inject", c.inject,
                   {"skip_tied_allreduce", "grad_times_dp", "swap_microbatches", "drop_dropout_offset"});
    TS_CHECK(c.check, "gpt: --inject={} injects a bug for --check to find; it needs --check",
             c.inject);
  }
  // Sizes whose products must fit: the parameter count and one batch's tokens.
  int64_t tokens = 0;
  TS_CHECK(!__builtin_mul_overflow(c.batch, c.context, &tokens),
           "gpt: --batch {} x --context {} tokens overflow int64", c.batch, c.context);
  try {
    c.model_config().num_parameters();
  } catch (const Error& e) {
    fail("gpt: {}", e.what());
  }
}

std::string GptMemoryEstimate::str() const {
  std::string s = fmt::format("model state {}, activations {}, logits {}",
                              models::format_bytes(model_state),
                              models::format_bytes(activations), models::format_bytes(logits));
  if (ranks_in_process > 1) {
    s += fmt::format(" per rank, x {} ranks in this process", ranks_in_process);
  }
  return s;
}

GptMemoryEstimate estimate_gpt_memory(const GptTrainConfig& c, int ranks_in_process) {
  GptMemoryEstimate m;
  m.ranks_in_process = std::max(1, ranks_in_process);
  // Doubles throughout: the point is to refuse absurd sizes, which overflow integers.
  const GptConfig model = c.model_config();
  const double C = static_cast<double>(c.width), T = static_cast<double>(c.context),
               V = static_cast<double>(model.padded_vocab()), H = static_cast<double>(c.heads),
               L = static_cast<double>(c.layers), e = 4;  // f32 bytes
  const double psi = static_cast<double>(model.num_parameters());
  // Mixture of Experts: moe_blocks of the L blocks hold E experts of hidden width Hx in the
  // MLP's place; each token runs k of them.
  const double moe_blocks = c.experts > 0 ? std::floor(L / static_cast<double>(c.moe_every)) : 0;
  const double E = static_cast<double>(c.experts), k = static_cast<double>(c.moe_top_k),
               Hx = c.moe_hidden > 0 ? static_cast<double>(c.moe_hidden) : 4 * C;
  const double dense_block = 12 * C * C + 13 * C;
  // (A rank holds E / ep of the experts with --ep: the block a ZeRO-3 gather assembles.)
  const double moe_block =
      4 * C * C + 8 * C + E * C + E / static_cast<double>(c.ep) * (2 * C * Hx + Hx + C);
  const double largest_block = moe_blocks > 0 ? std::max(dense_block, moe_block) : dense_block;
  const bool three_d = c.pp > 1 || c.tp > 1;
  const double pp = static_cast<double>(c.pp), tp = static_cast<double>(c.tp),
               dp = static_cast<double>(c.dp);
  // Rows of one micro-batch on one rank, and how many micro-batches keep activations at
  // once (a pipeline holds up to pp of them under 1F1B, all of them under GPipe).
  double rows = 0, in_flight = 1, layers_here = L, heads_here = H, width_share = 1;
  const double experts_psi = moe_blocks * (E * C + E * (2 * C * Hx + Hx + C));
  if (three_d) {
    rows = static_cast<double>(c.batch) /
           (dp * static_cast<double>(c.accum) * static_cast<double>(c.microbatches));
    in_flight = c.schedule == "gpipe" ? static_cast<double>(c.microbatches)
                                      : std::min(pp, static_cast<double>(c.microbatches));
    if (c.recompute == "full") in_flight = 1;  // only stage inputs stay; one micro-batch is live
    layers_here = std::ceil(L / pp);
    heads_here = H / tp;
    width_share = 1 / tp;
    // Parameters of this rank's stage and tensor shard, with AdamW and gradients (ZeRO 1-3
    // shard the optimizer state over dp; the pipeline's micro-batches keep full gradients
    // until the step's one reduction, and stage 3 gathers the stage's parameters for it).
    // (The routers and the experts' output biases are whole on every tp rank; the experts
    // split their hidden width over tp and, with --ep, a rank keeps E / ep of them, sharded
    // by ZeRO over the dp / ep ranks holding them.)
    const double routers = moe_blocks * E * C, out_bias = moe_blocks * E * C;
    const double ep = static_cast<double>(c.ep), edp = dp / ep;
    const double experts_here = (experts_psi - routers - out_bias) / (ep * tp) + out_bias / ep;
    const double local = (psi - experts_psi) / (pp * tp) + routers / pp;
    m.model_state = c.zero >= 1
                        ? 8 * local + 8 * local / dp + 8 * experts_here / pp + 8 * experts_here / (pp * edp)
                        : 16 * (local + experts_here / pp);
    // The single-device model every rank builds first (same seed; whole until --ep cuts its
    // experts), and the evaluation model for the gathered parameters.
    m.model_state += 2 * e * psi;
  } else {
    rows = static_cast<double>(c.batch) / (dp * static_cast<double>(c.accum));
    parallel::ZeroMemory z;
    z.stage = static_cast<int>(c.zero);
    z.ranks = static_cast<int>(c.dp);
    // With --ep each rank keeps E / ep experts, sharded over the dp / ep ranks holding them
    // (the routers stay whole).
    const double expert_here = (experts_psi - moe_blocks * E * C) / static_cast<double>(c.ep);
    const double psi_here = psi - (experts_psi - moe_blocks * E * C) + expert_here;
    z.numel = static_cast<int64_t>(std::min(psi_here, 9e18));
    if (c.ep > 1) {
      z.sub_numel = static_cast<int64_t>(expert_here);
      z.sub_ranks = static_cast<int>(c.dp / c.ep);
    }
    // Offloaded, the optimizer state is off the device (and at stage 3 with the parameters
    // offloaded, the shards too: only the gathered units below stay).
    const bool offloaded = c.offload.optimizer != "none";
    if (offloaded) z.state_per_param = 0;
    m.model_state = c.dp > 1 || c.zero > 0 ? z.formula() : 16 * psi;
    if (offloaded && c.offload.params != "none") m.model_state = 0;
    if (c.zero == 3) {
      // Gathered: the root unit (embeddings, final norm) and two blocks (one prefetched).
      m.model_state += e * (V * C + T * C + 2 * C) + 2 * e * largest_block;
    } else if (c.dp > 1 || c.zero > 0) {
      m.model_state += e * psi_here;  // flat full-gradient buffers before their reduction
    }
  }
  const double N = rows * T;  // tokens of one micro-batch on this rank
  // Per token and block, what backward keeps: the block input, both layer-norm outputs and
  // the residual after attention (4 C, whole on every tp rank), q/k/v, the heads' output and
  // the MLP's two 4C tensors (12 C, split over tp). The fused attention (no attention
  // dropout) adds its row logsumexp (H, f32): its output is the heads' output; the composite
  // one, with dropout, the softmax probabilities (H x T).
  const bool fused_attention = c.dropout == 0;
  double per_token = fused_attention
                         ? e * (4 * C + 12 * C * width_share) + 4 * heads_here
                         : e * (4 * C + 12 * C * width_share + heads_here * T);
  // Dropout's kept masks and outputs: measured at about 2 bytes per masked element.
  if (c.dropout > 0) per_token += 2 * (heads_here * T + 3 * C * width_share);
  // A Mixture-of-Experts block keeps, instead of the MLP's two 4C tensors, per token: k
  // rows of its input (C), the expert's pre-activation and GELU output (2 Hx, split over
  // tp) and output before and after its gate (2 C); and the router's logits and scores
  // (f32, E each). Averaged over the blocks.
  // Expert parallelism adds the rows exchanged both ways (2 C per row that travels, the
  // (ep - 1) / ep of them for other ranks' experts, and their copy before sending), and a
  // rank runs its experts on the rows every rank of its group sends them: the mean is k per
  // token, the busiest rank more (a capacity factor F bounds it at F times the mean; dropless, the
  // early steps measured max/mean 1.9 per expert: taken as 2).
  if (moe_blocks > 0) {
    const double ep = static_cast<double>(c.ep);
    const double busiest = c.ep == 1 ? 1.0
                           : std::min(ep, c.capacity_factor > 0 ? std::max(1.0, c.capacity_factor) : 2.0);
    const double exchanged = 3 * C * (ep - 1) / ep;
    per_token += moe_blocks / L * e * (k * (3 * C + exchanged + busiest * 2 * Hx * width_share) + 2 * E -
                                       8 * C * width_share);
  }
  // Recomputation: per token and block, what backward reruns instead of keeping (the
  // pipeline's full recomputation is in_flight above).
  double rerun = 0;
  if (!three_d && c.recompute == "full") {
    rerun = per_token - e * C;  // each block keeps only its input
  } else if (c.recompute == "selective") {
    rerun = e * 4 * C * width_share * (L - moe_blocks) / L;  // the dense MLPs' GELU output
    // The composite attention's softmax output, dropped probabilities and mask (measured).
    if (!fused_attention) rerun += 2 * e * heads_here * T + 2 * heads_here * T;
  }
  m.activations = in_flight * N * layers_here * (per_token - rerun);
  // Alongside them at the peak, for the composite attention, one layer's [T, T] temporaries
  // (the forward's scores before softmax, the backward's gradients of the scores and
  // probabilities), measured at four such tensors; with recomputation, those or one rerun
  // block's tensors, whichever is larger (measured: they are not alive together).
  const double temporaries = fused_attention ? 0.0 : 4 * e * rows * heads_here * T * T;
  m.activations += std::max(temporaries, in_flight * N * rerun);
  // Embedding output and final norm, [tokens, C] each.
  m.activations += 2 * e * N * C;
  // Logits and their gradient, on the last stage (tp: split over the vocabulary).
  m.logits = 2 * e * N * V / tp;
  return m;
}

GptMemoryEstimate preflight(const GptTrainConfig& config, bool mpi, int ranks_here) {
  const bool writer = !mpi || parallel::mpi_world()->rank() == 0;
  if (writer && !config.save.empty()) {
    if (config.save_sharded) {
      models::check_sharded_checkpoint_path(config.save, "gpt: --save");
    } else {
      models::check_checkpoint_path(config.save, "gpt: --save");
    }
  }
  if (writer && !config.metrics.empty()) {
    models::check_output_file(config.metrics, "gpt: --metrics");
  }
  const GptMemoryEstimate m = estimate_gpt_memory(config, ranks_here);
  // The prediction is of host memory; on a GPU the caching allocator refuses cleanly itself,
  // with its own numbers.
  if (!Device::parse(config.device).is_cpu()) return m;
  double need = m.total();
  if (config.memory_limit == 0 && mpi) {
    if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
      need *= std::max(1, std::atoi(local));  // this node's processes share its memory
    }
  }
  models::check_memory_budget(
      "gpt", need, m.str(), config.memory_limit,
      "lower --batch, --context, --width or --vocab, or spread the run with --accum, --dp, "
      "--zero, --pp or --tp");
  return m;
}

}  // namespace tessera::gpt
