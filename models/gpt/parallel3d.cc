#include "models/gpt/parallel3d.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

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

// A module holding this rank's local shards as parameters (for ZeRO over dp). Its forward
// does nothing: calling it opens a step for ZeRO 3 (whose hooks gather the shards).
class ShardHolder : public nn::Module {
 public:
  ShardHolder() : nn::Module("GptShards") {}
  Tensor add(const std::string& name, const Tensor& t) { return register_parameter(name, t); }
  Tensor forward(const Tensor& x) override { return x; }
};

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
  std::unique_ptr<optim::Optimizer> opt;
  parallel::CommPtr tied;  // first + last stage ranks with our (dp, tp), when they differ
  std::set<std::string> mine;  // parameter paths this rank's stages hold
  std::map<std::string, int> owner;  // parameter path -> the pp rank of its first stage
  std::map<std::string, Shape> whole;  // parameter path -> the single-device shape
  std::vector<std::string> model_order;   // the single-device optimizer's order (paths)
  std::vector<std::string> holder_order;  // this rank's optimizer's order (paths)
  int64_t run = 0;  // the pipeline run (accumulation step) in progress
  // The last step's shape and, with capture, each layer's outputs (by first batch row) and
  // the reduced gradients (by holder name).
  int64_t B = 0, T = 0;
  std::map<int, std::map<int64_t, Tensor>> outputs;
  nn::StateDict grads;
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

  s.mesh = parallel::make_mesh(s.world, {{"pp", opt.pp}, {"dp", opt.dp}, {"tp", opt.tp}});
  s.tp_mesh = parallel::make_mesh(s.mesh->group_ptr(2), {{"tp", opt.tp}});
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
  zopt.decay = [shapes](const std::string& name, const Tensor&) {
    return shapes.at(name).size() >= 2;
  };
  zopt.block_shards = opt.block_shards;
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
    // dims before it), whole blocks of it when the runs are multiples of the block.
    std::map<std::string, parallel::ZeroOptions::RowLayout> layouts;
    for (const auto& [name, p] : s.tp->params()) {
      parallel::ZeroOptions::RowLayout l;
      l.shape = p.local().shape();
      l.global = shapes.at(flat_name(name));
      const parallel::Placement& on_tp = p.placements()[0];
      if (opt.tp > 1 && on_tp.is_shard()) {
        int64_t runs = 1;
        for (int64_t d = 0; d < on_tp.dim; ++d) runs *= p.shape()[static_cast<size_t>(d)];
        l.run = p.local().numel() / runs;
      }
      layouts[flat_name(name)] = l;
    }
    zopt.row_layout = [layouts](const std::string& name, const Shape&) { return layouts.at(name); };
  }
  s.zero = std::make_unique<parallel::ZeroDataParallel>(*s.holder, s.dp(), zopt);
  if (opt.make_optimizer) {
    s.opt = opt.make_optimizer(s.zero->param_groups(opt.lr, opt.weight_decay));
    // Not elementwise: per-block state needs ZeRO to cut at blocks, and tp shards of whole
    // blocks (RowShard::run, checked by the optimizer per parameter); per-matrix state
    // (Adafactor) ZeRO's row shards, which present each parameter as its block of the single
    // device's (row_layout above).
    TS_CHECK(s.opt->elementwise() ||
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
        // Our block of the previous stage's output, handed over in the compute dtype; the
        // stream itself stays in the model's dtype, as on one device.
        x = s.tp->stream(cast(input, s.model.wte->weight.dtype()), stream_shape);
      }
      for (; l < end; ++l) {
        keys.at(l);
        x = l == last_layer ? s.tp->head(x) : s.tp->block(l - 1, x);
        keep(l, x);
      }
      // Under autocast the next stage gets the stream in the compute dtype (half the bytes;
      // its gradient comes back in it too); the last stage's logits stay as they are.
      if (end - 1 != last_layer && autocast_enabled()) return cast(x.local(), autocast_dtype());
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
  {
    auto guard = s.zero->no_sync();  // micro-batches accumulate; dp reduces once, below
    for (s.run = 0; s.run < k; ++s.run) {
      const parallel::pipeline::PipelineStep step = parallel::pipeline::run_pipeline(
          s.pp(), s.schedule, chunks,
          [&](int mb) { return idx.narrow(0, first_row(s.run, source(mb)), rows); },
          [&](const Tensor& logits, int mb) {
            // The last stage's output is this rank's slice of the vocabulary.
            const Shape full{logits.size(0), logits.size(1), config.vocab};
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
}

double Gpt3d::clip_grad_norm(double max_norm) {
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
  if (max_norm > 0 && std::isfinite(norm) && max_norm / (norm + 1e-6) < 1.0) {
    s.zero->scale_grads(max_norm / (norm + 1e-6));
  }
  return norm;
}

namespace {

// A tensor of this rank's shard of parameter `name` (its layout: the tp shard's) in full,
// on the ranks of the parameter's first stage; zeros of `shape` elsewhere; then broadcast
// over pp from that stage. Collective over the world.
Tensor gather_full(Gpt3d::Impl& s, const std::string& name, const Tensor& local, const Shape& shape,
                   DType dtype) {
  const int owner = s.owner.at(name);
  Tensor full = zeros(shape, dtype);
  if (s.pp().rank() == owner) {
    const parallel::ShardedTensor& p = s.tp->param(name);
    full = parallel::ShardedTensor(local.contiguous().view(p.local().shape()), s.tp_mesh,
                                   p.placements(), p.shape())
               .full_tensor()
               .contiguous()
               .view(shape)
               .clone();
  }
  s.pp().broadcast(full, owner);
  return full;
}

// One state field of a parameter: its name, dtype and shape on the parameter's owner.
struct Field {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};

// The state fields of parameter `name` (the owner's `fields`) on every pp rank: optimizers
// keep different fields per parameter (8-bit AdamW f32 state below its size threshold,
// Adafactor whole second moments for vectors), so the ranks that do not hold it learn them
// from the owner. Two broadcasts over pp: the length, then the encoding.
std::vector<Field> fields_from_owner(Gpt3d::Impl& s, const std::string& name,
                                     const std::vector<Field>& fields) {
  const int owner = s.owner.at(name);
  std::vector<int64_t> code;
  if (s.pp().rank() == owner) {
    code.push_back(static_cast<int64_t>(fields.size()));
    for (const Field& f : fields) {
      code.push_back(static_cast<int64_t>(f.dtype));
      code.push_back(static_cast<int64_t>(f.shape.size()));
      code.insert(code.end(), f.shape.begin(), f.shape.end());
      code.push_back(static_cast<int64_t>(f.name.size()));
      for (char c : f.name) code.push_back(static_cast<unsigned char>(c));
    }
  }
  Tensor length = Tensor::from_vector<int64_t>({static_cast<int64_t>(code.size())}, {1});
  s.pp().broadcast(length, owner);
  const int64_t n = length.to_vector<int64_t>()[0];
  Tensor encoded = s.pp().rank() == owner ? Tensor::from_vector<int64_t>(code, {n})
                                          : zeros({n}, DType::i64);
  s.pp().broadcast(encoded, owner);
  code = encoded.to_vector<int64_t>();
  std::vector<Field> out(static_cast<size_t>(code.at(0)));
  size_t at = 1;
  for (Field& f : out) {
    f.dtype = static_cast<DType>(code.at(at++));
    f.shape.resize(static_cast<size_t>(code.at(at++)));
    for (int64_t& d : f.shape) d = code.at(at++);
    f.name.resize(static_cast<size_t>(code.at(at++)));
    for (char& c : f.name) c = static_cast<char>(code.at(at++));
  }
  return out;
}

// Whether optimizer state `field` has the parameter's elements (cut like the parameter by
// tp), rather than one value per row or block, or the same tensor on every shard.
optim::Optimizer::RowShardState state_kind(const Gpt3d::Impl& s, const std::string& name,
                                           const std::string& field) {
  return s.opt->row_shard_state(field, s.whole.at(name));
}
bool per_element(const Gpt3d::Impl& s, const std::string& name, const std::string& field) {
  return state_kind(s, name, field) == optim::Optimizer::RowShardState::elements;
}

// How optimizer state `field` of parameter `name` (held here) lies over tp: the tensor its
// tp blocks form (shape and placements) and this rank's block. `local` is this rank's state
// tensor. Per element: as the parameter. Otherwise with tp 1 (8-bit AdamW's scales per
// block; Adafactor's statistics) the tensor is whole. On tp shards: 8-bit AdamW's scales
// by the shard's runs of whole blocks (below); Adafactor's row statistics as the parameter
// without its last dim, its column statistics as its last dim alone, a split of the dim
// that is dropped leaving them whole on tp.
struct StateBlock {
  Shape global;
  parallel::Placements placements;
  parallel::LocalBlock block;
};
StateBlock state_block(const Gpt3d::Impl& s, const std::string& name, const std::string& field,
                       const Tensor& local) {
  const parallel::ShardedTensor& p = s.tp->param(name);
  StateBlock b;
  if (per_element(s, name, field)) {
    b.global = p.shape();
    b.placements = p.placements();
  } else if (s.o.tp == 1) {
    b.global = local.shape();
    b.placements = {parallel::Replicate()};
  } else if (s.opt->shard_block() > 0) {
    // Per block of the whole (8-bit AdamW's scales): a shard's runs of L elements (one per
    // index of the dims before the split one, R of them) hold L / block blocks each, so the
    // scales lie as [R, tp x L / block] split on dim 1; whole on tp as the parameter is.
    const parallel::Placement& on_tp = p.placements()[0];
    const int64_t block = s.opt->shard_block();
    if (on_tp.is_shard()) {
      int64_t runs = 1;
      for (int64_t d = 0; d < on_tp.dim; ++d) runs *= p.shape()[static_cast<size_t>(d)];
      b.global = {runs, numel_of(p.shape()) / runs / block};
      b.placements = {parallel::Shard(1)};
    } else {
      b.global = {(numel_of(p.shape()) + block - 1) / block};
      b.placements = {parallel::Replicate()};
    }
  } else {
    const parallel::Placement& on_tp = p.placements()[0];
    const int64_t last = static_cast<int64_t>(p.shape().size()) - 1;
    const bool rows = state_kind(s, name, field) == optim::Optimizer::RowShardState::rows;
    if (rows) {
      b.global = Shape(p.shape().begin(), p.shape().end() - 1);
      b.placements = {on_tp.is_shard(last) ? parallel::Replicate() : on_tp};
    } else {
      b.global = {p.shape().back()};
      b.placements = {on_tp.is_shard(last) ? parallel::Shard(0) : parallel::Replicate()};
    }
  }
  b.block = parallel::local_block(b.global, *s.tp_mesh, b.placements);
  return b;
}

}  // namespace

Tensor region_of(const Tensor& whole, const std::string& key, const Shape& global,
                 const std::vector<int64_t>& starts, const Shape& shape) {
  TS_CHECK(whole.numel() == numel_of(global),
           "Gpt3d: the checkpoint's '{}' has shape {}, the model's {}", key,
           shape_str(whole.shape()), shape_str(global));
  Tensor t = whole.contiguous().view(global);
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), starts[d], shape[d]);
  return t.contiguous().clone();
}

std::map<std::string, Tensor> Gpt3d::full_parameters() {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const nn::StateDict holder = s.zero->model_state_dict();  // our tp shards, whole over dp
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : s.model.named_parameters()) {
    auto it = holder.find(flat_name(name));
    out[name] = gather_full(s, name, it != holder.end() ? it->second : Tensor(), t.shape(), t.dtype());
  }
  return out;
}

std::pair<nn::StateDict, optim::Optimizer::StateDict> Gpt3d::state_dicts() {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const std::map<std::string, Tensor> params = full_parameters();
  nn::StateDict weights(params.begin(), params.end());
  // ZeRO gives the state of an optimizer over this rank's shards, indexed in holder_order.
  const optim::Optimizer::StateDict mine = s.zero->optimizer_state_dict(*s.opt);
  optim::Optimizer::StateDict out;
  for (const auto& [key, v] : mine) {
    if (key.starts_with("hparam.") || key.ends_with(".lr") || key.ends_with(".weight_decay")) {
      out[key] = v;
    }
  }
  std::map<std::string, int64_t> holder_index;
  for (size_t i = 0; i < s.holder_order.size(); ++i) holder_index[s.holder_order[i]] = static_cast<int64_t>(i);
  std::vector<int64_t> group[2];
  const nn::NamedTensors named = s.model.named_parameters();
  const std::map<std::string, Tensor> shapes(named.begin(), named.end());
  for (size_t i = 0; i < s.model_order.size(); ++i) {
    group[shapes.at(s.model_order[i]).dim() >= 2 ? 0 : 1].push_back(static_cast<int64_t>(i));
  }
  for (int g = 0; g < 2; ++g) {
    out[fmt::format("group.{}.params", g)] =
        Tensor::from_vector<int64_t>(group[g], {static_cast<int64_t>(group[g].size())});
  }
  const bool stepped = mine.count("state.0.step") == 1;  // false before the first step
  for (size_t i = 0; stepped && i < s.model_order.size(); ++i) {
    const std::string& name = s.model_order[i];
    const Tensor& param = shapes.at(name);
    const bool here = s.pp().rank() == s.owner.at(name);
    const std::string from = here ? fmt::format("state.{}.", holder_index.at(name)) : "";
    Tensor step = here ? mine.at(from + "step").clone() : zeros({}, DType::i64);
    s.pp().broadcast(step, s.owner.at(name));
    out[fmt::format("state.{}.step", i)] = step;
    std::vector<Field> held;
    if (here) {
      for (const auto& [key, v] : mine) {
        if (key.starts_with(from) && key != from + "step") {
          held.push_back({key.substr(from.size()), v.dtype(), v.shape()});
        }
      }
    }
    for (const Field& f : fields_from_owner(s, name, held)) {
      const Tensor local = here ? mine.at(from + f.name) : Tensor();
      if (per_element(s, name, f.name)) {
        out[fmt::format("state.{}.{}", i, f.name)] =
            gather_full(s, name, local, param.shape(), f.dtype);
        continue;
      }
      if (s.o.tp == 1) {  // (per block or row, or whole: the owner's tensor is the single device's)
        Tensor t = here ? local.contiguous().clone() : zeros(f.shape, f.dtype);
        s.pp().broadcast(t, s.owner.at(name));
        out[fmt::format("state.{}.{}", i, f.name)] = t;
        continue;
      }
      // On tp shards: 8-bit AdamW's scales [blocks]; Adafactor's rows' statistics [M], its
      // columns' [N] of the single device's M x N parameter; gathered over tp on the owner,
      // then broadcast over pp.
      const bool rows = state_kind(s, name, f.name) == optim::Optimizer::RowShardState::rows;
      const int64_t block = s.opt->shard_block();
      Tensor t = zeros({block > 0 ? (param.numel() + block - 1) / block
                        : rows    ? param.size(0)
                                  : param.size(-1)},
                       f.dtype);
      if (here) {
        const StateBlock b = state_block(s, name, f.name, local);
        t = parallel::ShardedTensor(local.contiguous().view(b.block.shape), s.tp_mesh,
                                    b.placements, b.global)
                .full_tensor()
                .contiguous()
                .view(t.shape())
                .clone();
      }
      s.pp().broadcast(t, s.owner.at(name));
      out[fmt::format("state.{}.{}", i, f.name)] = t;
    }
  }
  return {std::move(weights), std::move(out)};
}

void Gpt3d::load_state_dicts(const nn::StateDict& weights, const optim::Optimizer::StateDict& dict) {
  Impl& s = *impl_;
  // The single-device dicts as a block source: a region is cut from the whole tensor.
  std::map<std::string, int64_t> model_index;
  for (size_t i = 0; i < s.model_order.size(); ++i) model_index[s.model_order[i]] = static_cast<int64_t>(i);
  const auto lookup = [&](const std::string& key) -> const Tensor& {
    if (key.starts_with("model/")) {
      auto it = weights.find(key.substr(6));
      TS_CHECK(it != weights.end(), "Gpt3d: the checkpoint has no parameter '{}'", key.substr(6));
      return it->second;
    }
    // "optim/<param>/<field>" is state.<i>.<field>; "optim/<key>" is <key>.
    const std::string rest = key.substr(6);
    const size_t slash = rest.find('/');
    const std::string dict_key =
        slash == std::string::npos
            ? rest
            : fmt::format("state.{}.{}", model_index.at(rest.substr(0, slash)), rest.substr(slash + 1));
    auto it = dict.find(dict_key);
    TS_CHECK(it != dict.end(), "Gpt3d: the optimizer state has no '{}'", dict_key);
    return it->second;
  };
  BlockSource source;
  source.whole = [&](const std::string& key) { return lookup(key).clone(); };
  source.region = [&](const std::string& key, const Shape& global,
                      const std::vector<int64_t>& starts, const Shape& shape) {
    return region_of(lookup(key), key, global, starts, shape);
  };
  source.keys = [&](const std::string& prefix) {
    std::vector<std::string> out;
    for (const auto& [key, v] : dict) {
      std::string k;
      if (key.starts_with("hparam.") || (key.starts_with("group.") && !key.ends_with(".params"))) {
        k = "optim/" + key;
      } else if (key.starts_with("state.")) {
        const size_t dot = key.find('.', 6);
        const int64_t i = std::stoll(key.substr(6, dot - 6));
        k = fmt::format("optim/{}/{}", s.model_order.at(static_cast<size_t>(i)), key.substr(dot + 1));
      }
      if (!k.empty() && k.starts_with(prefix)) out.push_back(k);
    }
    return out;
  };
  read_blocks(source);
}

void Gpt3d::write_blocks(const AddBlock& add) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const nn::StateDict holder = s.zero->model_state_dict();                   // over dp
  const optim::Optimizer::StateDict mine = s.zero->optimizer_state_dict(*s.opt);  // over dp
  if (s.world->rank() == 0) {
    for (const auto& [key, v] : mine) {
      if (key.starts_with("hparam.") || (key.starts_with("group.") && !key.ends_with(".params"))) {
        add("optim/" + key, v, v.shape(), std::vector<int64_t>(static_cast<size_t>(v.dim()), 0));
      }
    }
  }
  if (s.dp().rank() != 0) return;  // the dp replicas hold the same shards
  const bool tp_lead = s.tp_mesh->group(0).rank() == 0;
  for (size_t k = 0; k < s.holder_order.size(); ++k) {
    const std::string& name = s.holder_order[k];
    if (s.owner.at(name) != s.pp().rank()) continue;  // the tied embedding once
    const parallel::ShardedTensor& p = s.tp->param(name);
    if (!p.placements()[0].is_shard() && !tp_lead) continue;  // whole on tp: written once
    const parallel::LocalBlock b = parallel::local_block(p.shape(), *s.tp_mesh, p.placements());
    add("model/" + name, holder.at(flat_name(name)).contiguous().view(b.shape), p.shape(), b.starts);
    const std::string prefix = fmt::format("state.{}.", k);
    for (const auto& [key, v] : mine) {
      if (!key.starts_with(prefix)) continue;
      const std::string field = key.substr(prefix.size());
      if (field == "step") {
        if (tp_lead) add(fmt::format("optim/{}/step", name), v, v.shape(), {});  // once
        continue;
      }
      const StateBlock sb = state_block(s, name, field, v);
      if (!sb.placements[0].is_shard() && !tp_lead) continue;  // whole on tp: written once
      add(fmt::format("optim/{}/{}", name, field), v.contiguous().view(sb.block.shape), sb.global,
          sb.block.starts);
    }
  }
}

void Gpt3d::read_blocks(const BlockSource& source) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  nn::StateDict holder_weights;
  std::map<std::string, parallel::LocalBlock> blocks;
  for (const std::string& name : s.holder_order) {
    const parallel::ShardedTensor& p = s.tp->param(name);
    blocks[name] = parallel::local_block(p.shape(), *s.tp_mesh, p.placements());
    holder_weights[flat_name(name)] =
        source.region("model/" + name, p.shape(), blocks[name].starts, blocks[name].shape);
  }
  s.zero->load_model_state_dict(holder_weights);

  // The dict of an optimizer over this rank's shards (holder_order), as ZeRO loads it.
  optim::Optimizer::StateDict mine;
  int64_t count[2] = {0, 0};
  const nn::NamedTensors named = s.model.named_parameters();
  const std::map<std::string, Tensor> shapes(named.begin(), named.end());
  for (const std::string& name : s.holder_order) ++count[shapes.at(name).dim() >= 2 ? 0 : 1];
  int64_t next = 0;
  for (int g = 0; g < 2; ++g) {
    std::vector<int64_t> ids;
    for (int64_t j = 0; j < count[g]; ++j) ids.push_back(next++);
    mine[fmt::format("group.{}.params", g)] = Tensor::from_vector<int64_t>(ids, {count[g]});
  }
  for (const char* prefix : {"optim/hparam.", "optim/group."}) {
    for (const std::string& key : source.keys(prefix)) mine[key.substr(6)] = source.whole(key);
  }
  for (size_t k = 0; k < s.holder_order.size(); ++k) {
    const std::string& name = s.holder_order[k];
    const std::string prefix = fmt::format("optim/{}/", name);
    for (const std::string& key : source.keys(prefix)) {
      const std::string field = key.substr(prefix.size());
      Tensor& t = mine[fmt::format("state.{}.{}", k, field)];
      if (field == "step" || (!per_element(s, name, field) && s.o.tp == 1)) {
        t = source.whole(key);  // (with tp 1, per-block or per-row state is whole)
        continue;
      }
      const StateBlock sb = state_block(s, name, field, Tensor());
      t = source.region(key, sb.global, sb.block.starts, sb.block.shape);
      if (!per_element(s, name, field)) t = t.reshape({t.numel()});  // (statistics are 1-D)
    }
  }
  s.zero->load_optimizer_state_dict(*s.opt, mine);
}

optim::DynamicLossScaler& Gpt3d::scaler() { return impl_->scaler; }
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
    Tensor full = zeros({s.B, s.T, l == s.pipe.layers - 1 ? c.vocab : c.width}, dtype);
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
  if (s.o.zero > 0) held += fmt::format(", ZeRO {} shards over dp", s.o.zero);
  return held;
}

std::string Gpt3d::describe() const {
  const Impl& s = *impl_;
  return fmt::format("pp {} x dp {} x tp {}{}, {}{}, {} micro-batches{}, ZeRO {}{}: {}", s.o.pp,
                     s.o.dp, s.o.tp, s.o.sequence_parallel ? " (sequence parallel)" : "",
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
