#include "models/gpt/parallel3d_impl.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "autograd/aux_loss.h"
#include "models/gpt/forward.h"
#include "models/gpt/pipeline.h"
#include "models/gpt/tensor_parallel.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/comm/comm_log.h"
#include "parallel/mesh.h"
#include "parallel/sharded_tensor.h"
#include "parallel/pipeline/executor.h"
#include "parallel/zero.h"
#include "tensor/autocast.h"
#include "tensor/error.h"
#include "tensor/random.h"

namespace tessera::gpt {

namespace {

// Names in an optimizer's global order on optim::decay_groups' groups: decayed first.
std::vector<std::string> decay_first(const std::vector<std::pair<std::string, bool>>& names) {
  std::vector<std::string> out;
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [name, decay] : names) {
      if (decay == (pass == 0)) out.push_back(name);
    }
  }
  return out;
}

}  // namespace


Gpt3d::Gpt3d(Gpt& model, parallel::CommPtr world, Gpt3dOptions o)
    : impl_(std::make_unique<Impl>(model, std::move(world), std::move(o))) {
  Impl& s = *impl_;
  const Gpt3dOptions& opt = s.o;
  TS_CHECK(opt.pp >= 1 && opt.dp >= 1 && opt.tp >= 1,
           "Gpt3d: pp ({}), dp ({}) and tp ({}) must be >= 1", opt.pp, opt.dp, opt.tp);
  TS_CHECK(s.world->size() == opt.pp * opt.dp * opt.tp,
           "Gpt3d: pp {} x dp {} x tp {} = {} ranks, but the world has {}", opt.pp, opt.dp,
           opt.tp, opt.pp * opt.dp * opt.tp, s.world->size());
  TS_CHECK(opt.zero >= 0 && opt.zero <= 3, "Gpt3d: ZeRO stage must be 0, 1, 2 or 3, got {}",
           opt.zero);
  TS_CHECK(opt.accum >= 1, "Gpt3d: accum must be >= 1, got {}", opt.accum);
  TS_CHECK(opt.inject.empty() || opt.inject == "skip_tied_allreduce" ||
               opt.inject == "grad_times_dp" || opt.inject == "swap_microbatches" ||
               opt.inject == "drop_dropout_offset",
           "Gpt3d: inject must be skip_tied_allreduce, grad_times_dp, swap_microbatches or "
           "drop_dropout_offset, got '{}'", opt.inject);
  // Everything that can fail on the layout is checked before any collective.
  s.schedule = parallel::pipeline::make_schedule(opt.schedule, static_cast<int>(opt.pp),
                                                 static_cast<int>(opt.microbatches),
                                                 static_cast<int>(opt.chunks));
  s.pipe = partition_gpt(model, s.schedule.num_stages());
  TS_CHECK(model.config().heads % opt.tp == 0,
           "Gpt3d: heads ({}) must be divisible by tp ({}): each rank computes whole heads",
           model.config().heads, opt.tp);

  TS_CHECK(opt.ep == 1 || (model.config().experts > 0 && opt.dp % opt.ep == 0),
           "Gpt3d: ep ({}) splits the experts over groups of dp ranks: it needs experts and must "
           "divide dp ({})", opt.ep, opt.dp);
  TS_CHECK(opt.ep == 1 || (!opt.row_shards && opt.block_shards == 0 && !opt.comm_hook),
           "Gpt3d: with ep {} each rank keeps its experts, reduced over the ranks holding the "
           "same ones by plain flat shards: not with row_shards, block_shards or a comm hook (got "
           "row_shards {}, block_shards {}, comm hook {})", opt.ep, opt.row_shards, opt.block_shards,
           opt.comm_hook ? opt.comm_hook->name() : std::string("none"));
  s.mesh = parallel::make_mesh(s.world, {{"pp", opt.pp}, {"dp", opt.dp}, {"tp", opt.tp}});
  s.tp_mesh = parallel::make_mesh(s.mesh->group_ptr(2), {{"tp", opt.tp}});
  s.moe = std::make_unique<MoeStep>(model.config(), &s.dp(), opt.ep);
  // Expert parallelism: every rank keeps its experts only (before anything records shapes);
  // the stages, tp shards, ZeRO and checkpoints then see E / ep experts, gathered whole over
  // ep where the single device's tensors are wanted (parallel3d_checkpoint.cc).
  if (parallel::ExpertGroups* experts = s.moe->groups()) experts->keep(model);
  const int pp_rank = s.pp().rank();
  for (const auto& [name, t] : s.pipe.parameters(model, s.schedule, pp_rank)) s.mine.insert(name);
  for (int st = 0; st < s.schedule.num_stages(); ++st) {
    const int r = s.schedule.rank_of(st);
    for (const auto& [name, t] : s.pipe.parameters(model, s.schedule, r)) s.owner.emplace(name, r);
  }
  std::vector<std::pair<std::string, bool>> model_names, holder_names;
  for (const auto& [name, t] : model.named_parameters()) {
    s.whole[name] = t.shape();
    model_names.emplace_back(name, t.dim() >= 2);
    if (s.mine.count(name) == 1) holder_names.emplace_back(name, t.dim() >= 2);
  }
  s.model_order = decay_first(model_names);
  s.tp = std::make_unique<TpGpt>(model, s.tp_mesh, megatron_plan(), "tp", "dp",
                                 [&](const std::string& name) { return s.mine.count(name) == 1; });
  s.tp->set_sequence_parallel(opt.sequence_parallel);
  s.holder = std::make_shared<ShardHolder>();
  std::map<std::string, Shape> shapes;  // flat name -> the single-device parameter's shape
  for (const auto& [name, t] : model.named_parameters()) shapes[flat_name(name)] = t.shape();
  std::vector<std::string> names;
  for (const auto& [name, p] : s.tp->params()) names.push_back(name);
  for (const std::string& name : names) {
    s.tp->replace_local(name, s.holder->add(flat_name(name), s.tp->param(name).local()));
  }
  // The holder registers in the tp parameters' (sorted) order.
  std::sort(holder_names.begin(), holder_names.end());
  s.holder_order = decay_first(holder_names);
  parallel::ZeroOptions zopt;
  zopt.stage = static_cast<int>(opt.zero);
  zopt.comm_hook = opt.comm_hook;
  zopt.decay = [shapes](const std::string& name, const Tensor&) {
    return shapes.at(name).size() >= 2;
  };
  zopt.block_shards = opt.block_shards;
  if (parallel::ExpertGroups* experts = s.moe->groups()) {
    // The experts' parameters reduce (and shard) over the ranks holding the same experts.
    zopt.subgroup = experts->subgroup(zopt.average);
    std::set<std::string> flat;
    for (const std::string& name : names) {
      if (experts->holds(name)) flat.insert(flat_name(name));
    }
    zopt.subgroup.holds = [flat](const std::string& name) { return flat.count(name) == 1; };
  }
  TS_CHECK(!opt.row_shards || opt.block_shards == 0,
           "Gpt3d: row_shards and block_shards exclude each other (got block_shards {})",
           opt.block_shards);
  zopt.row_shards = opt.row_shards;
  if (opt.row_shards) {
    // Each holder parameter as a block of the single device's 1-D or 2-D parameter: whole
    // (tp 1, or whole on tp; c_attn's [3, C, C] as [3C, C]), some of its rows (tp splits
    // dim 0, or c_attn's q, k and v row blocks alike) or some of its columns (tp splits the
    // last dim), with the sums over the tp group that holds the rest.
    parallel::MeshPtr tp_mesh = s.tp_mesh;
    const auto tp_sum = [tp_mesh](const Tensor& t) {
      parallel::CommCause cause("gpt3d tp optimizer statistics");
      tp_mesh->group(0).all_reduce(t, parallel::ReduceOp::sum);
    };
    std::map<std::string, parallel::ZeroOptions::RowLayout> layouts;
    for (const auto& [name, p] : s.tp->params()) {
      const Shape& whole = shapes.at(flat_name(name));
      const parallel::Placement& on_tp = p.placements()[0];
      const bool split = opt.tp > 1 && on_tp.is_shard();
      const bool by_cols = split && whole.size() == 2 &&
                           on_tp.dim == static_cast<int64_t>(p.shape().size()) - 1;
      parallel::ZeroOptions::RowLayout l;
      l.global = whole;
      const int64_t n = p.local().numel();
      if (whole.size() < 2) {
        l.shape = {n};
      } else {
        const int64_t cols = by_cols ? p.local().shape().back() : whole[1];
        l.shape = {n / cols, cols};
      }
      if (split) (by_cols ? l.cols_sum : l.rows_sum) = tp_sum;
      layouts[flat_name(name)] = l;
    }
    zopt.row_layout = [layouts](const std::string& name, const Shape&) { return layouts.at(name); };
  }
  if (opt.block_shards > 0) {
    // Per-block state (8-bit AdamW) counts its blocks in the single device's parameter: a tp
    // shard holds runs of its elements (the dims from the split one on, per index of the
    // dims before it), whole blocks of it when the runs are multiples of the block. Where
    // they are not, a block's scale is the max over the tp ranks holding its elements.
    parallel::MeshPtr tp_mesh = s.tp_mesh;
    const auto tp_max = [tp_mesh](const Tensor& t) {
      parallel::CommCause cause("gpt3d tp optimizer scales");
      tp_mesh->group(0).all_reduce(t, parallel::ReduceOp::max);
    };
    std::map<std::string, parallel::ZeroOptions::RowLayout> layouts;
    for (const auto& [name, p] : s.tp->params()) {
      parallel::ZeroOptions::RowLayout l;
      l.shape = p.local().shape();
      l.global = shapes.at(flat_name(name));
      const TpRuns runs = tp_runs(s, name);
      l.run = runs.run;
      l.run_stride = runs.stride;
      l.run_first = runs.first;
      if (runs.run > 0) l.runs_max = tp_max;
      layouts[flat_name(name)] = l;
    }
    zopt.row_layout = [layouts](const std::string& name, const Shape&) { return layouts.at(name); };
  }
  s.zero = std::make_unique<parallel::ZeroDataParallel>(*s.holder, s.dp(), zopt);
  if (opt.make_optimizer) {
    s.opt = opt.make_optimizer(s.zero->param_groups(opt.lr, opt.weight_decay), s.dp(),
                               opt.comm_hook);
    // Not elementwise: per-block state needs ZeRO to cut at blocks, and tp shards of whole
    // blocks (RowShard::run, checked by the optimizer per parameter); per-matrix state
    // (Adafactor) ZeRO's row shards, which present each parameter as its block of the single
    // device's (row_layout above). An optimizer paired with a hook that is not a full
    // reduction (1-bit Adam) reduces this rank's tensors over dp itself, with its per-tensor
    // scales over the tensors this rank holds (ZeroDataParallel refuses it at ZeRO 1-3).
    const bool reduces_itself = opt.comm_hook && !opt.comm_hook->full_reduction();
    TS_CHECK(s.opt->elementwise() || reduces_itself ||
                 (s.opt->shard_block() > 0 && opt.block_shards > 0 &&
                  opt.block_shards % s.opt->shard_block() == 0) ||
                 (s.opt->supports_row_shards() && opt.row_shards),
             "Gpt3d: {} is not elementwise; {}", s.opt->kind(),
             s.opt->shard_block() > 0
                 ? "ZeRO shards without Gpt3dOptions::block_shards would cut its blocks"
             : s.opt->supports_row_shards()
                 ? "its per-matrix state needs Gpt3dOptions::row_shards"
                 : "pipeline and tensor-parallel shards would split its per-tensor state");
  } else {
    optim::AdamWOptions aopt;
    aopt.lr = opt.lr;
    aopt.betas = {opt.beta1, opt.beta2};
    aopt.weight_decay = opt.weight_decay;
    s.opt = std::make_unique<optim::AdamW>(s.zero->param_groups(opt.lr, opt.weight_decay), aopt);
  }
  if (opt.loss_scale > 0) {
    s.scaler = optim::DynamicLossScaler({.init_scale = opt.loss_scale});
    s.scaler.reduce_found_inf_with([world = s.world](bool here) {
      Tensor t = Tensor::from_vector<double>({here ? 1.0 : 0.0}, {1});
      parallel::CommCause cause("loss scaler overflow check", parallel::CommKind::control);
      world->all_reduce(t, parallel::ReduceOp::max);
      return t.to_vector<double>()[0] > 0;
    });
  }

  const int first = s.schedule.rank_of(0), last = s.schedule.rank_of(s.schedule.num_stages() - 1);
  const bool member = pp_rank == first || pp_rank == last;
  const int64_t dp_rank = s.dp().rank(), tp_rank = s.tp_mesh->group(0).rank();
  const int color = member ? static_cast<int>(dp_rank * opt.tp + tp_rank)
                           : static_cast<int>(opt.dp * opt.tp + s.world->rank());
  parallel::CommPtr group = s.world->split(color, s.world->rank(), "embedding");
  if (member && first != last) s.tied = group;
  if (opt.comm_hook && !opt.comm_hook->full_reduction()) {
    s.replica = s.world->split(static_cast<int>(dp_rank), s.world->rank(), "replica");
  }
}

Gpt3d::~Gpt3d() = default;

double Gpt3d::train_step(const Tensor& idx, const Tensor& targets, double lr) {
  const double loss = forward_backward(idx, targets, lr);
  unscale_and_clip(impl_->o.clip);
  update(/*skip=*/false);
  return loss;
}

double Gpt3d::forward_backward(const Tensor& idx, const Tensor& targets, double lr) {
  Impl& s = *impl_;
  const int64_t B = idx.size(0), T = idx.size(1), m = s.o.microbatches, k = s.o.accum;
  TS_CHECK(B % (s.o.dp * k * m) == 0,
           "Gpt3d: a batch of {} rows does not split into dp {} x accum {} x {} micro-batches",
           B, s.o.dp, k, m);
  const int64_t rows = B / (s.o.dp * k * m);
  const GptConfig& config = s.model.config();
  // Each dp rank runs a contiguous block of the batch: run r's micro-batch mb is rows
  // [first_row(r, mb), + rows).
  const int64_t dp_rank = s.dp().rank();
  const auto first_row = [dp_rank, k, m, rows](int64_t run, int mb) {
    return ((dp_rank * k + run) * m + mb) * rows;
  };
  // Every rank's generator is at the step's offset here: each step ends where one device's
  // ends (below). Each layer's dropout starts from its own offset, each micro-batch draws
  // its rows of the whole batch's masks (forward.h), also when recomputation reruns a chunk.
  const uint64_t base = default_generator().offset();
  const int last_layer = s.pipe.layers - 1;
  parallel::pipeline::PipelineChunks chunks;
  for (int c = 0; c < s.schedule.chunks; ++c) {
    const int stage = s.schedule.stage_of(s.pp().rank(), c);
    const int begin = s.pipe.first_layer[stage], end = s.pipe.end_layer(stage);
    const Shape stream_shape{rows, T, config.width};
    chunks.push_back([&s, &config, begin, end, last_layer, stream_shape, first_row, base, B, T,
                      rows](const Tensor& input, int mb) {
      const int64_t row = first_row(s.run, mb);
      const BatchSliceScope slice({B, s.o.inject == "drop_dropout_offset" ? 0 : row, rows});
      const auto keep = [&](int layer, const parallel::ShardedTensor& out) {
        if (!s.o.capture) return;
        NoGradGuard no_grad;  // (a recomputation keeps the same values again)
        s.outputs[layer][row] = out.detach().full_tensor().clone();
      };
      const DropoutKeys keys(config, /*training=*/true, rows, T, base);
      int l = begin;
      parallel::ShardedTensor x;
      if (l == 0) {
        keys.at(0);
        x = s.tp->embed(input);
        keep(0, x);
        ++l;
      } else {
        // Our block of the previous stage's output, in the model's dtype (see below).
        x = s.tp->stream(cast(input, s.model.wte->weight.dtype()), stream_shape);
      }
      for (; l < end; ++l) {
        keys.at(l);
        x = l == last_layer ? s.tp->head(x) : s.tp->block(l - 1, x);
        keep(l, x);
      }
      // The next stage gets the stream in the model's dtype, f32 under autocast too: one
      // device keeps the residual stream in f32 (the linears' low-precision outputs join it
      // in f32), so rounding it at each stage boundary was a rounding one device does not
      // make (the stream and its gradient, twice the bytes of bf16 now).
      return x.local();
    });
  }
  s.opt->set_lr(lr);
  s.zero->zero_grad();
  s.B = B;
  s.T = T;
  s.outputs.clear();
  s.grads.clear();
  if (s.o.zero == 3) (*s.holder)(Tensor());  // gathers this rank's shards over dp
  // Injected: micro-batches 0 and 1 trade tokens (not targets).
  const auto source = [&s, m](int mb) {
    return s.o.inject == "swap_microbatches" && m >= 2 && mb < 2 ? 1 - mb : mb;
  };
  double loss_sum = 0.0;
  // Mixture-of-Experts blocks: their attached losses take a micro-batch's share of the loss
  // scale as its cross-entropy does; routing counts are summed over dp; experts may live on
  // other dp ranks of the ep group.
  const autograd::AuxLossScale aux_scale(s.scaler.scale_value() / static_cast<double>(k * m));
  const std::unique_ptr<nn::MoeCountReduction> moe_counts = s.moe->reduction();
  const nn::MoeDispatchScope experts_where(s.moe->dispatch());
  const nn::MoeBatchParts parts(s.o.dp * k * m);  // each forward its share of the capacity groups
  // With several micro-batches, the balancing loss's f_i are the whole step's, as one
  // device counts them: a forward-only routing pass over every micro-batch first.
  std::unique_ptr<nn::MoeStepCounts> step_counts;
  if (s.moe->on() && config.moe.aux_loss > 0 && k * m > 1) {
    const nn::MoeStatsScope pass;
    for (s.run = 0; s.run < k; ++s.run) {
      parallel::pipeline::run_pipeline_forward(
          s.pp(), s.schedule, chunks, [&](int mb) { return idx.narrow(0, first_row(s.run, source(mb)), rows); });
    }
    step_counts = std::make_unique<nn::MoeStepCounts>(pass.layers());
  }
  const nn::MoeStatsScope routing;
  {
    auto guard = s.zero->no_sync();  // micro-batches accumulate; dp reduces once, below
    for (s.run = 0; s.run < k; ++s.run) {
      const parallel::pipeline::PipelineStep step = parallel::pipeline::run_pipeline(
          s.pp(), s.schedule, chunks,
          [&](int mb) { return idx.narrow(0, first_row(s.run, source(mb)), rows); },
          [&](const Tensor& logits, int mb) {
            // The last stage's output is this rank's slice of the vocabulary.
            const Shape full{logits.size(0), logits.size(1), config.padded_vocab()};
            const parallel::ShardedTensor z(logits, s.tp_mesh, {parallel::Shard(2)}, full);
            return s.tp->vocab_parallel_loss(z, targets.narrow(0, first_row(s.run, mb), rows))
                .local();
          },
          // Each run's gradient is 1/accum of the step's.
          {.recompute = s.o.recompute, .loss_scale = s.scaler.scale_value() / static_cast<double>(k)});
      loss_sum += step.loss;
    }
    if (s.tied && s.o.inject != "skip_tied_allreduce") {
      const Tensor g = s.tp->param("wte.weight").local().grad();
      TS_CHECK(g.defined(), "Gpt3d: the token embedding has no gradient on rank {}", s.world->rank());
      parallel::CommCause cause("pipeline tied embedding");
      s.tied->all_reduce(g, parallel::ReduceOp::sum);
    }
  }
  s.zero->finish();
  s.moe->begin_step();
  s.moe->add(routing, static_cast<int>(k * m));
  if (s.o.pp > 1) s.moe->gather(s.pp());  // every stage's blocks, for the reports
  if (s.o.inject == "grad_times_dp") s.zero->scale_grads(static_cast<double>(s.o.dp));
  if (s.o.capture) s.grads = s.zero->gradient_dict();
  DropoutKeys(config, /*training=*/true, B, T, base).end();  // where one device's step ends
  Tensor loss = Tensor::from_vector<double>({loss_sum / static_cast<double>(k)}, {1});
  s.dp().all_reduce(loss, parallel::ReduceOp::avg);
  return loss.item<double>();
}

std::optional<double> Gpt3d::unscale_and_clip(double max_norm) {
  Impl& s = *impl_;
  // f16: the scaler unscales this rank's gradients (its stages' and shards'); the overflow
  // check is reduced over the world, so every rank skips the same steps.
  if (!s.scaler.unscale_and_check(*s.opt)) return std::nullopt;
  return clip_grad_norm(max_norm);
}

void Gpt3d::update(bool skip) {
  Impl& s = *impl_;
  if (!skip) s.scaler.step(*s.opt, [&] { s.zero->step(*s.opt); });  // (skipped on overflow)
  s.scaler.update();
  // The experts' selection biases (buffers every rank holds whole; the stages read them in
  // place) from the step's counts, gathered over every stage.
  if (!skip) s.moe->update_bias(s.model);
}

double Gpt3d::clip_grad_norm(double max_norm) {
  Impl& s = *impl_;
  // Every element of the single-device gradient counted once over the whole world: a
  // parameter whole on tp only on tp rank 0, the tied embedding only on the first stage,
  // and under ZeRO 0 (replicas) only on dp rank 0 (an expert's: on the first rank of the
  // ranks holding it); ZeRO 1's shards are disjoint over dp (and the experts' over them).
  // With a hook that leaves each dp rank its own gradient (1-bit Adam after the warm-up),
  // each dp rank's norm over its pp x tp ranks, as a replica's own norm without pp and tp
  // (the same as dp rank 0's while the hook still reduces exactly).
  const int tp_rank = s.tp_mesh->group(0).rank(), dp_rank = s.dp().rank();
  const parallel::ExpertGroups* experts = s.moe->groups();
  const bool first_stage = s.pp().rank() == s.schedule.rank_of(0);
  std::map<std::string, double> weight;
  for (const auto& [name, p] : s.tp->params()) {
    double w = 1.0;
    if (p.placements()[0].is_replicate() && tp_rank != 0) w = 0.0;
    if (name == "wte.weight" && !first_stage) w = 0.0;
    const bool expert = experts != nullptr && experts->holds(name);
    if (s.o.zero == 0 && !s.replica && (expert ? experts->edp().rank() : dp_rank) != 0) w = 0.0;
    weight[flat_name(name)] = w;
  }
  Tensor total = Tensor::from_vector<double>(
      {s.zero->local_grad_norm_squared([&](const std::string& n) { return weight.at(n); })}, {1});
  {
    parallel::CommCause cause("gpt3d clip_grad_norm");
    (s.replica ? *s.replica : *s.world).all_reduce(total, parallel::ReduceOp::sum);
  }
  double norm = std::sqrt(total.item<double>());
  if (s.replica) {
    // Each dp rank's own norm: whether one is inf/NaN is agreed over the world, so that every
    // rank skips (or stops on) the same steps and none waits in 1-bit Adam's reduction for a
    // rank that skipped.
    Tensor bad = Tensor::from_vector<double>({std::isfinite(norm) ? 0.0 : 1.0}, {1});
    {
      parallel::CommCause cause("gpt3d non-finite gradient norm", parallel::CommKind::control);
      s.world->all_reduce(bad, parallel::ReduceOp::max);
    }
    if (bad.item<double>() > 0 && std::isfinite(norm)) norm = std::numeric_limits<double>::infinity();
  }
  // optim::clip_grad_norm's rule: scale by max / (norm + 1e-6) when above the limit.
  if (max_norm > 0 && std::isfinite(norm) && max_norm / (norm + 1e-6) < 1.0) {
    s.zero->scale_grads(max_norm / (norm + 1e-6));
  }
  return norm;
}

optim::DynamicLossScaler& Gpt3d::scaler() { return impl_->scaler; }
const MoeStep& Gpt3d::moe() const { return *impl_->moe; }

const optim::Optimizer& Gpt3d::optimizer() const { return *impl_->opt; }

std::vector<std::pair<std::string, Tensor>> Gpt3d::activations() {
  Impl& s = *impl_;
  TS_CHECK(s.o.capture, "Gpt3d::activations: the layout was built without capture");
  NoGradGuard no_grad;
  const GptConfig& c = s.model.config();
  const DType dtype = s.model.wte->weight.dtype();
  const bool tp_lead = s.tp_mesh->group(0).rank() == 0;
  std::vector<std::pair<std::string, Tensor>> out;
  for (int l = 0; l < s.pipe.layers; ++l) {
    // Each row of each layer was computed by one (stage, dp rank) and gathered over tp: the
    // first tp rank of it contributes, every other rank adds zeros.
    Tensor full = zeros({s.B, s.T, l == s.pipe.layers - 1 ? c.padded_vocab() : c.width}, dtype);
    auto it = s.outputs.find(l);
    if (tp_lead && it != s.outputs.end()) {
      for (const auto& [row, t] : it->second) full.narrow(0, row, t.size(0)).copy_(t);
    }
    parallel::CommCause cause("gpt3d check activations", parallel::CommKind::control);
    s.world->all_reduce(full, parallel::ReduceOp::sum);
    out.emplace_back(s.pipe.layer_name(l), full);
  }
  return out;
}

std::map<std::string, Tensor> Gpt3d::full_gradients() {
  Impl& s = *impl_;
  TS_CHECK(s.o.capture, "Gpt3d::full_gradients: the layout was built without capture");
  NoGradGuard no_grad;
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : s.model.named_parameters()) {
    auto it = s.grads.find(flat_name(name));
    out[name] = gather_full(s, name, it != s.grads.end() ? it->second : Tensor(), t.shape(), t.dtype());
  }
  return out;
}

std::string Gpt3d::where_row(int layer, int64_t row) const {
  const Impl& s = *impl_;
  const int64_t m = s.o.microbatches, k = s.o.accum, rows = s.B / (s.o.dp * k * m);
  const int64_t per_dp = s.B / s.o.dp, dp_rank = row / per_dp, in_dp = row % per_dp;
  const int64_t run = in_dp / (m * rows), mb = in_dp % (m * rows) / rows;
  int stage = 0;
  while (stage + 1 < s.pipe.num_stages() && s.pipe.first_layer[stage + 1] <= layer) ++stage;
  const int64_t first = dp_rank * per_dp + (run * m + mb) * rows;
  return fmt::format("batch row {}: micro-batch {} of dp rank {}, accumulation run {} (rows "
                     "{}-{}); pipeline stage {} on pp rank {}", row, mb, dp_rank, run, first,
                     first + rows - 1, stage, s.schedule.rank_of(stage));
}

TpRuns tp_runs(const Gpt3d::Impl& s, const std::string& name) {
  if (s.o.tp == 1 || s.mine.count(name) == 0) return {};
  const parallel::ShardedTensor& p = s.tp->param(name);
  const parallel::Placement& on_tp = p.placements()[0];
  if (!on_tp.is_shard()) return {};
  // Per index of the dims before the split one, a run of the dims from it on.
  const size_t d = static_cast<size_t>(on_tp.dim);
  int64_t runs = 1, inner = 1;
  for (size_t k = 0; k < d; ++k) runs *= p.shape()[k];
  for (size_t k = d + 1; k < p.shape().size(); ++k) inner *= p.shape()[k];
  const int64_t start = parallel::local_block(p.shape(), *s.tp_mesh, p.placements()).starts[d];
  return {p.local().numel() / runs, p.shape()[d] * inner, start * inner};
}

std::string Gpt3d::where_param(const std::string& name) const {
  const Impl& s = *impl_;
  std::string held = fmt::format("held by pp rank {}", s.owner.at(name));
  if (name == "wte.weight" && s.pipe.num_stages() > 1) {
    held += fmt::format(", tied to the head on pp rank {}",
                        s.schedule.rank_of(s.schedule.num_stages() - 1));
  }
  if (s.o.tp > 1) {
    // From the plan, so that a rank of another stage (which holds no handle) says the same.
    parallel::Placement p = parallel::Replicate();
    for (const parallel::TpRule& rule : megatron_plan()) {
      if (parallel::path_matches(rule.pattern, name)) {
        p = rule.placement;
        break;
      }
    }
    held += p.is_shard() ? fmt::format(", split on tp along dim {}", p.dim) : ", whole on tp";
  }
  const parallel::ExpertGroups* experts = s.moe->groups();
  const bool expert = experts != nullptr && experts->holds(name);
  if (expert) {
    held += fmt::format(", experts [{}, {}) here (ep {})", experts->first(),
                        experts->first() + experts->local(), s.o.ep);
  }
  if (s.o.zero > 0) {
    held += fmt::format(", ZeRO {} shards over {}", s.o.zero,
                        expert ? "the ranks holding the same experts" : "dp");
  }
  return held;
}

std::string Gpt3d::describe() const {
  const Impl& s = *impl_;
  return fmt::format("pp {} x dp {} x tp {}{}{}, {}{}, {} micro-batches{}, ZeRO {}{}: {}", s.o.pp,
                     s.o.dp, s.o.tp, s.o.sequence_parallel ? " (sequence parallel)" : "",
                     s.o.ep > 1 ? fmt::format(", experts over ep {}", s.o.ep) : std::string(),
                     s.o.schedule, s.o.chunks > 1 ? fmt::format(" ({} chunks)", s.o.chunks) : "",
                     s.o.microbatches,
                     s.o.accum > 1 ? fmt::format(" x accum {}", s.o.accum) : std::string(),
                     s.o.zero, s.o.recompute ? ", recompute" : "", s.pipe.str());
}

}  // namespace tessera::gpt

namespace tessera::gpt {
int64_t Gpt3d::skipped_steps() const { return impl_->scaler.skipped_steps(); }
double Gpt3d::loss_scale() const { return impl_->scaler.scale_value(); }
}  // namespace tessera::gpt
