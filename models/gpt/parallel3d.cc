#include "models/gpt/parallel3d.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

#include "models/gpt/pipeline.h"
#include "models/gpt/tensor_parallel.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/comm/comm_log.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/executor.h"
#include "parallel/zero.h"
#include "tensor/error.h"

namespace tessera::gpt {

namespace {

// A module holding this rank's local shards as parameters (for ZeRO over dp).
class ShardHolder : public nn::Module {
 public:
  ShardHolder() : nn::Module("GptShards") {}
  Tensor add(const std::string& name, const Tensor& t) { return register_parameter(name, t); }
};

std::string flat_name(std::string name) {
  for (char& c : name) {
    if (c == '.') c = '_';
  }
  return name;
}

}  // namespace

struct Gpt3d::Impl {
  Gpt& model;
  Gpt3dOptions o;
  parallel::CommPtr world;
  parallel::MeshPtr mesh;     // {pp, dp, tp}
  parallel::MeshPtr tp_mesh;  // {tp}: this rank's tensor-parallel group
  parallel::pipeline::Schedule schedule;
  GptPipeline pipe;
  std::unique_ptr<TpGpt> tp;
  std::shared_ptr<ShardHolder> holder;
  std::unique_ptr<parallel::ZeroDataParallel> zero;
  std::unique_ptr<optim::AdamW> opt;
  parallel::CommPtr tied;  // first + last stage ranks with our (dp, tp), when they differ
  std::set<std::string> mine;  // parameter paths this rank's stages hold
  optim::DynamicLossScaler scaler{{.enabled = false}};

  Impl(Gpt& m, parallel::CommPtr w, Gpt3dOptions options) : model(m), o(std::move(options)), world(std::move(w)) {}

  parallel::Communicator& pp() const { return mesh->group("pp"); }
  parallel::Communicator& dp() const { return mesh->group("dp"); }
};

Gpt3d::Gpt3d(Gpt& model, parallel::CommPtr world, Gpt3dOptions o)
    : impl_(std::make_unique<Impl>(model, std::move(world), std::move(o))) {
  Impl& s = *impl_;
  const Gpt3dOptions& opt = s.o;
  TS_CHECK(opt.pp >= 1 && opt.dp >= 1 && opt.tp >= 1,
           "Gpt3d: pp ({}), dp ({}) and tp ({}) must be >= 1", opt.pp, opt.dp, opt.tp);
  TS_CHECK(s.world->size() == opt.pp * opt.dp * opt.tp,
           "Gpt3d: pp {} x dp {} x tp {} = {} ranks, but the world has {}", opt.pp, opt.dp,
           opt.tp, opt.pp * opt.dp * opt.tp, s.world->size());
  TS_CHECK(model.config().dropout == 0.0,
           "Gpt3d: dropout {} is not supported with pipelining yet (its masks would not follow "
           "the single-device run's order of draws); use 0", model.config().dropout);
  TS_CHECK(opt.zero == 0 || opt.zero == 1,
           "Gpt3d: ZeRO stage {} with pipeline/tensor parallelism is not supported (0 or 1)",
           opt.zero);
  // Everything that can fail on the layout is checked before any collective.
  s.schedule = parallel::pipeline::make_schedule(opt.schedule, static_cast<int>(opt.pp),
                                                 static_cast<int>(opt.microbatches),
                                                 static_cast<int>(opt.chunks));
  s.pipe = partition_gpt(model, s.schedule.num_stages());
  TS_CHECK(model.config().heads % opt.tp == 0,
           "Gpt3d: heads ({}) must be divisible by tp ({}): each rank computes whole heads",
           model.config().heads, opt.tp);

  s.mesh = parallel::make_mesh(s.world, {{"pp", opt.pp}, {"dp", opt.dp}, {"tp", opt.tp}});
  s.tp_mesh = parallel::make_mesh(s.mesh->group_ptr(2), {{"tp", opt.tp}});
  const int pp_rank = s.pp().rank();
  for (const auto& [name, t] : s.pipe.parameters(model, s.schedule, pp_rank)) s.mine.insert(name);
  s.tp = std::make_unique<TpGpt>(model, s.tp_mesh, megatron_plan(), "tp", "dp",
                                 [&](const std::string& name) { return s.mine.count(name) == 1; });
  s.tp->set_sequence_parallel(opt.sequence_parallel);
  s.holder = std::make_shared<ShardHolder>();
  std::map<std::string, int64_t> dims;  // flat name -> the single-device parameter's dims
  for (const auto& [name, t] : model.named_parameters()) dims[flat_name(name)] = t.dim();
  std::vector<std::string> names;
  for (const auto& [name, p] : s.tp->params()) names.push_back(name);
  for (const std::string& name : names) {
    s.tp->replace_local(name, s.holder->add(flat_name(name), s.tp->param(name).local()));
  }
  parallel::ZeroOptions zopt;
  zopt.stage = static_cast<int>(opt.zero);
  zopt.decay = [dims](const std::string& name, const Tensor&) { return dims.at(name) >= 2; };
  s.zero = std::make_unique<parallel::ZeroDataParallel>(*s.holder, s.dp(), zopt);
  optim::AdamWOptions aopt;
  aopt.lr = opt.lr;
  aopt.betas = {opt.beta1, opt.beta2};
  aopt.weight_decay = opt.weight_decay;
  s.opt = std::make_unique<optim::AdamW>(s.zero->param_groups(opt.lr, opt.weight_decay), aopt);
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
}

Gpt3d::~Gpt3d() = default;

double Gpt3d::train_step(const Tensor& idx, const Tensor& targets, double lr) {
  Impl& s = *impl_;
  const int64_t B = idx.size(0), m = s.o.microbatches;
  TS_CHECK(B % (s.o.dp * m) == 0,
           "Gpt3d: a batch of {} rows does not split into dp {} x {} micro-batches", B, s.o.dp, m);
  const int64_t rows = B / (s.o.dp * m), base = s.dp().rank() * m * rows;
  const int last_layer = s.pipe.layers - 1;
  parallel::pipeline::PipelineChunks chunks;
  for (int c = 0; c < s.schedule.chunks; ++c) {
    const int stage = s.schedule.stage_of(s.pp().rank(), c);
    const int begin = s.pipe.first_layer[stage], end = s.pipe.end_layer(stage);
    const Shape stream_shape{rows, idx.size(1), s.model.config().width};
    chunks.push_back([&s, begin, end, last_layer, stream_shape](const Tensor& input) {
      int l = begin;
      parallel::ShardedTensor x;
      if (l == 0) {
        x = s.tp->embed(input);
        ++l;
      } else {
        x = s.tp->stream(input, stream_shape);  // our block of the previous stage's output
      }
      for (; l < end; ++l) x = l == last_layer ? s.tp->head(x) : s.tp->block(l - 1, x);
      return x.local();
    });
  }
  s.opt->set_lr(lr);
  s.zero->zero_grad();
  parallel::pipeline::PipelineStep step;
  {
    auto guard = s.zero->no_sync();  // micro-batches accumulate; dp reduces once, below
    step = parallel::pipeline::run_pipeline(
        s.pp(), s.schedule, chunks, [&](int mb) { return idx.narrow(0, base + mb * rows, rows); },
        [&](const Tensor& logits, int mb) {
          // The last stage's output is this rank's slice of the vocabulary.
          const Shape full{logits.size(0), logits.size(1), s.model.config().vocab};
          const parallel::ShardedTensor z(logits, s.tp_mesh, {parallel::Shard(2)}, full);
          return s.tp->vocab_parallel_loss(z, targets.narrow(0, base + mb * rows, rows)).local();
        },
        {.recompute = s.o.recompute, .loss_scale = s.scaler.scale_value()});
    if (s.tied) {
      const Tensor g = s.tp->param("wte.weight").local().grad();
      TS_CHECK(g.defined(), "Gpt3d: the token embedding has no gradient on rank {}", s.world->rank());
      parallel::CommCause cause("pipeline tied embedding");
      s.tied->all_reduce(g, parallel::ReduceOp::sum);
    }
  }
  s.zero->finish();
  // f16: the scaler unscales this rank's gradients (its stages' and shards'); every rank
  // skips the step (clipping included) if any rank's overflowed.
  s.scaler.step(*s.opt, [&] {
    if (s.o.clip > 0) clip_grad_norm();
    s.zero->step(*s.opt);
  });
  s.scaler.update();
  Tensor loss = Tensor::from_vector<double>({step.loss}, {1});
  s.dp().all_reduce(loss, parallel::ReduceOp::avg);
  return loss.item<double>();
}

double Gpt3d::clip_grad_norm() {
  Impl& s = *impl_;
  // Every element of the single-device gradient counted once over the whole world: a
  // parameter whole on tp only on tp rank 0, the tied embedding only on the first stage,
  // and under ZeRO 0 (replicas) only on dp rank 0; ZeRO 1's shards are disjoint over dp.
  const int tp_rank = s.tp_mesh->group(0).rank(), dp_rank = s.dp().rank();
  const bool first_stage = s.pp().rank() == s.schedule.rank_of(0);
  std::map<std::string, double> weight;
  for (const auto& [name, p] : s.tp->params()) {
    double w = 1.0;
    if (p.placements()[0].is_replicate() && tp_rank != 0) w = 0.0;
    if (name == "wte.weight" && !first_stage) w = 0.0;
    if (s.o.zero == 0 && dp_rank != 0) w = 0.0;
    weight[flat_name(name)] = w;
  }
  Tensor total = Tensor::from_vector<double>(
      {s.zero->local_grad_norm_squared([&](const std::string& n) { return weight.at(n); })}, {1});
  {
    parallel::CommCause cause("gpt3d clip_grad_norm");
    s.world->all_reduce(total, parallel::ReduceOp::sum);
  }
  const double norm = std::sqrt(total.item<double>());
  // optim::clip_grad_norm's rule: scale by max / (norm + 1e-6) when above the limit.
  if (std::isfinite(norm) && s.o.clip / (norm + 1e-6) < 1.0) s.zero->scale_grads(s.o.clip / (norm + 1e-6));
  return norm;
}

std::map<std::string, Tensor> Gpt3d::full_parameters() {
  Impl& s = *impl_;
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : s.model.named_parameters()) {
    // The first stage (in pipeline order) that holds it.
    int owner = -1;
    for (int st = 0; st < s.schedule.num_stages() && owner < 0; ++st) {
      const int r = s.schedule.rank_of(st);
      for (const auto& [n, p] : s.pipe.parameters(s.model, s.schedule, r)) {
        if (n == name) owner = r;
      }
    }
    Tensor full = zeros(t.shape(), t.dtype());
    if (s.pp().rank() == owner) {
      full = s.tp->param(name).full_tensor().contiguous().view(t.shape()).clone();
    }
    s.pp().broadcast(full, owner);
    out[name] = full;
  }
  return out;
}

std::string Gpt3d::describe() const {
  const Impl& s = *impl_;
  return fmt::format("pp {} x dp {} x tp {}{}, {}{}, {} micro-batches, ZeRO {}{}: {}", s.o.pp,
                     s.o.dp, s.o.tp, s.o.sequence_parallel ? " (sequence parallel)" : "",
                     s.o.schedule, s.o.chunks > 1 ? fmt::format(" ({} chunks)", s.o.chunks) : "",
                     s.o.microbatches, s.o.zero, s.o.recompute ? ", recompute" : "", s.pipe.str());
}

}  // namespace tessera::gpt

namespace tessera::gpt {
int64_t Gpt3d::skipped_steps() const { return impl_->scaler.skipped_steps(); }
double Gpt3d::loss_scale() const { return impl_->scaler.scale_value(); }
}  // namespace tessera::gpt
