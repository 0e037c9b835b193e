#include "optim/adamw8bit.h"

#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/op_attrs.h"
#include "tensor/ops.h"
#include "tensor/quant8.h"

namespace tessera::optim {

AdamW8bit::AdamW8bit(std::vector<Tensor> params, AdamW8bitOptions options)
    : AdamW8bit(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, std::move(options)) {}

AdamW8bit::AdamW8bit(std::vector<ParamGroup> groups, AdamW8bitOptions options)
    : Optimizer("AdamW8bit", std::move(groups), options.lr, options.weight_decay),
      options_(checked(std::move(options))) {}

AdamW8bitOptions AdamW8bit::checked(AdamW8bitOptions o) {
  check_adamw_values("AdamW8bit", o.lr, o.betas, o.eps, o.weight_decay);
  TS_CHECK(o.min_8bit_numel >= 0, "AdamW8bit: invalid min_8bit_numel {} (must be >= 0)",
           o.min_8bit_numel);
  return o;
}

int64_t AdamW8bit::shard_block() const { return kQuant8Block; }

Optimizer::RowShardState AdamW8bit::row_shard_state(const std::string& name,
                                                    const Shape& /*global*/, int64_t run,
                                                    int64_t run_first) const {
  if (!name.ends_with("_absmax")) return RowShardState::elements;
  // As cuts_blocks: a shard whose runs cut blocks keeps the whole parameter's scales.
  const bool cut = run > 0 && (run % kQuant8Block != 0 || run_first % kQuant8Block != 0);
  return cut ? RowShardState::whole : RowShardState::rows;
}

bool AdamW8bit::uses_master(const Tensor& p) const {
  return wants_master(options_.master_weights, p);
}

std::string AdamW8bit::name_of(const Tensor& p) const {
  if (const RowShard* rs = row_shard(p)) return rs->name;
  for (const ParamGroup& g : groups_) {
    for (size_t k = 0; k < g.params.size() && k < g.names.size(); ++k) {
      if (g.params[k].is_same(p)) return g.names[k];
    }
  }
  return "";
}

bool AdamW8bit::quantized(const Tensor& p) const {
  const RowShard* rs = row_shard(p);
  const int64_t numel = rs ? numel_of(rs->global) : p.numel();
  if (numel < options_.min_8bit_numel) return false;
  return !(options_.f32_state && options_.f32_state(name_of(p)));
}

bool AdamW8bit::cuts_blocks(const Tensor& p) const {
  const RowShard* rs = row_shard(p);
  return rs && rs->run > 0 && (rs->run % kQuant8Block != 0 || rs->run_first % kQuant8Block != 0) &&
         quantized(p);
}

std::vector<Optimizer::StateSpec> AdamW8bit::state_specs(const Tensor& p) const {
  const DType stats = p.dtype() == DType::f64 ? DType::f64 : DType::f32;
  std::vector<StateSpec> specs;
  if (quantized(p)) {
    // Where the shard cuts blocks, every holder keeps the whole parameter's scales.
    const Shape blocks = {
        quant8_blocks(cuts_blocks(p) ? numel_of(row_shard(p)->global) : p.numel())};
    specs = {{"exp_avg", p.shape(), DType::u8},
             {"exp_avg_sq", p.shape(), DType::u8},
             {"exp_avg_absmax", blocks, stats},
             {"exp_avg_sq_absmax", blocks, stats}};
  } else {
    specs = {{"exp_avg", p.shape(), stats}, {"exp_avg_sq", p.shape(), stats}};
  }
  if (uses_master(p)) specs.push_back({"master", p.shape(), DType::f32});
  return specs;
}

std::map<std::string, double> AdamW8bit::hyperparameters() const {
  return {{"beta1", options_.betas.first},
          {"beta2", options_.betas.second},
          {"eps", options_.eps},
          {"min_8bit_numel", static_cast<double>(options_.min_8bit_numel)}};
}

void AdamW8bit::set_hyperparameters(const std::map<std::string, double>& values) {
  AdamW8bitOptions o = options_;
  o.betas = {values.at("beta1"), values.at("beta2")};
  o.eps = values.at("eps");
  const double min_numel = values.at("min_8bit_numel");
  TS_CHECK(min_numel == o.min_8bit_numel,
           "AdamW8bit: the state dict was saved with min_8bit_numel {}, this optimizer has {} "
           "(which tensors hold 8-bit state would change)",
           min_numel, o.min_8bit_numel);
  options_ = checked(std::move(o));
}

void AdamW8bit::step() {
  NoGradGuard no_grad;
  step_grad_scale_ = pending_grad_scale();
  for_each_bucket_with_grad(
      [&](const Tensor& p) {
        if (const RowShard* rs = row_shard(p)) {
          TS_CHECK(rs->block > 0 && rs->block % kQuant8Block == 0,
                   "AdamW8bit: a shard of parameter '{}' {} cuts its {}-element quantization "
                   "blocks; shard with ZeroOptions::block_shards = {}",
                   rs->name, shape_str(rs->global), kQuant8Block, kQuant8Block);
          TS_CHECK(!cuts_blocks(p) || (rs->max && rs->run_stride >= rs->run),
                   "AdamW8bit: the tensor-parallel shard of parameter '{}' {} holds runs of {} "
                   "consecutive elements, which cut its {}-element quantization blocks, but its "
                   "RowShard gives no max over the other holders (or a run stride of {}) to "
                   "take the blocks' scales with",
                   rs->name, shape_str(rs->global), rs->run, kQuant8Block, rs->run_stride);
        }
        const Quant8Map& q1 = quant8_map(Quant8Kind::signed_dynamic);
        const Quant8Map& q2 = quant8_map(Quant8Kind::unsigned_dynamic);
        std::map<std::string, Tensor> s;
        for (const StateSpec& spec : state_specs(p)) {
          Tensor t;
          if (spec.name == "master") {
            t = cast(p, DType::f32).contiguous();
          } else if (spec.dtype == DType::u8) {  // the codes of 0
            const uint8_t zero = spec.name == "exp_avg" ? q1.zero_code() : q2.zero_code();
            t = full(spec.shape, zero, DType::u8, p.device());
          } else {
            t = zeros(spec.shape, spec.dtype, p.device());
          }
          s[spec.name] = t;
        }
        return s;
      },
      [&](const ParamGroup& group, std::span<const Pending> bucket) {
        const std::map<std::string, Tensor>& first = bucket.front().state->tensors;
        const bool eight_bit = first.count("exp_avg_absmax") > 0;
        const size_t width = eight_bit ? 7 : 5;
        std::vector<Tensor> in;
        in.reserve(width * bucket.size());
        // Shards that cut blocks take two passes each, after the multi-tensor call of the
        // rest; everything that can refuse is checked before anything changes (the bucket
        // is retried one parameter at a time after an Error).
        std::vector<const Pending*> cut;
        for (const Pending& item : bucket) {
          if (eight_bit && cuts_blocks(item.param)) {
            step_segments(group, item, *row_shard(item.param), false);
            cut.push_back(&item);
          }
        }
        for (const Pending& item : bucket) {
          if (eight_bit && cuts_blocks(item.param)) continue;
          const std::map<std::string, Tensor>& s = item.state->tensors;
          const auto master = s.find("master");
          in.insert(in.end(), {item.param, item.grad, s.at("exp_avg"), s.at("exp_avg_sq")});
          if (eight_bit) in.insert(in.end(), {s.at("exp_avg_absmax"), s.at("exp_avg_sq_absmax")});
          in.push_back(master == s.end() ? Tensor() : master->second);
        }
        Attrs a = op_attrs::adamw(bucket.front().state->step + 1, group.lr, options_.betas.first,
                                  options_.betas.second, options_.eps, group.weight_decay);
        a.grad_scale = step_grad_scale_;
        if (in.empty()) {
        } else if (eight_bit) {
          call_update(OpId::adamw8bit_, std::move(in), a, 7, {0, 2, 3, 4, 5, 6});
        } else {
          call_update(OpId::adamw_, std::move(in), a, 5, {0, 2, 3, 4});
        }
        for (const Pending* item : cut) step_segments(group, *item, *row_shard(item->param), true);
        for (const Pending& item : bucket) ++item.state->step;
      });
  take_grad_scale();
}

const Tensor& AdamW8bit::segments_of(const Tensor& p, const RowShard& rs) {
  auto it = segments_.find(p.impl());
  if (it != segments_.end()) return it->second;
  // This tensor's element e is element l = first + e of the tp shard (ZeRO's block shards
  // start at a block of it), in run l / run, at element r * run_stride + run_first + l % run
  // of the whole. Runs follow each other in the whole, so the blocks only increase: a
  // segment is a maximal stretch of elements in one block.
  const int64_t n = p.numel(), first = rs.first_row * rs.block;
  std::vector<int64_t> seg;  // (end, block) pairs
  for (int64_t e = 0; e < n;) {
    const int64_t l = first + e, r = l / rs.run, o = l % rs.run;
    const int64_t g = r * rs.run_stride + rs.run_first + o, b = g / kQuant8Block;
    const int64_t len = std::min({rs.run - o, kQuant8Block - g % kQuant8Block, n - e});
    TS_CHECK(seg.empty() || b >= seg.back(),
             "AdamW8bit: parameter '{}': the runs of its shard are out of order in the whole {} "
             "(run {} at element {}, after block {})",
             rs.name, shape_str(rs.global), r, g, seg.back());
    if (!seg.empty() && seg.back() == b) {
      seg[seg.size() - 2] = e + len;
    } else {
      seg.insert(seg.end(), {e + len, b});
    }
    e += len;
  }
  const int64_t count = static_cast<int64_t>(seg.size()) / 2;
  const Tensor t = Tensor::from_vector<int64_t>(seg, {count, 2}).to(p.device());
  return segments_.emplace(p.impl(), t).first->second;
}

void AdamW8bit::step_segments(const ParamGroup& group, const Pending& item, const RowShard& rs,
                              bool run) {
  std::map<std::string, Tensor>& s = item.state->tensors;
  const auto master = s.find("master");
  const Tensor w = master == s.end() ? Tensor() : master->second;
  const Tensor& a1 = s.at("exp_avg_absmax");
  const Tensor maxima = Tensor::empty({2, a1.numel()}, a1.dtype(), a1.device());
  const Tensor new1 = maxima.select(0, 0), new2 = maxima.select(0, 1);
  const int64_t t = item.state->step + 1;
  auto pass = [&](int k) {
    adamw8bit_segments_(item.param, item.grad, s.at("exp_avg"), s.at("exp_avg_sq"), a1,
                        s.at("exp_avg_sq_absmax"), w, segments_of(item.param, rs), new1, new2, k,
                        t, group.lr, options_.betas.first, options_.betas.second, options_.eps,
                        group.weight_decay, step_grad_scale_);
  };
  if (!run) {  // what could refuse: the segments, the operands' shapes, dtypes and layout
    TS_CHECK(item.param.is_contiguous(),
             "AdamW8bit: the shard of parameter '{}' {} must be contiguous (its segments are runs "
             "of its elements)",
             rs.name, shape_str(item.param.shape()));
    std::vector<TensorSpec> in;
    for (const Tensor& x : {item.param, item.grad, s.at("exp_avg"), s.at("exp_avg_sq"), a1,
                            s.at("exp_avg_sq_absmax"), w, segments_of(item.param, rs), new1,
                            new2}) {
      in.push_back(TensorSpec::of(x));
    }
    Attrs a = op_attrs::adamw(t, group.lr, options_.betas.first, options_.betas.second,
                              options_.eps, group.weight_decay);
    a.k = 1;
    a.grad_scale = step_grad_scale_;
    meta_fn(OpId::adamw8bit_segments_)(in, a);
    return;
  }
  pass(1);
  rs.max(maxima);  // each block's maxima over every holder of its elements
  pass(2);
}

}  // namespace tessera::optim
