#include "models/gpt/moe_step.h"

#include <fmt/format.h>

#include <algorithm>

#include "parallel/comm/comm_log.h"

namespace tessera::gpt {

MoeStep::MoeStep(const GptConfig& config, parallel::Communicator* comm, int64_t ep)
    : config_(config), comm_(comm) {
  if (ep <= 1) return;
  TS_CHECK(on() && comm != nullptr && comm->size() % ep == 0,
           "gpt: --ep {} splits the experts over groups of ep data-parallel ranks; it needs "
           "--experts > 0 and a dp size divisible by it (dp {}, experts {})", ep,
           comm != nullptr ? comm->size() : 1, config.experts);
  groups_ = std::make_unique<parallel::ExpertGroups>(*comm, ep, config.experts);
}

std::unique_ptr<nn::MoeCountReduction> MoeStep::reduction() const {
  if (!on() || comm_ == nullptr || comm_->size() == 1) return nullptr;
  return std::make_unique<nn::MoeCountReduction>([comm = comm_](Tensor& t) {
    parallel::CommCause cause("moe routing counts", parallel::CommKind::control);
    comm->all_reduce(t, parallel::ReduceOp::sum);
  });
}

void MoeStep::begin_step() {
  layers_.clear();
  loss_sum_ = 0.0;
  micro_batches_ = 0;
}

void MoeStep::add(const nn::MoeStatsScope& scope, int micro_batches) {
  for (const nn::MoeLayerStats& seen : scope.layers()) {
    loss_sum_ += seen.aux_loss + seen.z_loss;
    auto same = std::find_if(layers_.begin(), layers_.end(),
                             [&](const nn::MoeLayerStats& l) { return l.name == seen.name; });
    if (same == layers_.end()) {
      layers_.push_back(seen);
      continue;
    }
    for (size_t e = 0; e < same->counts.size(); ++e) same->counts[e] += seen.counts[e];
    same->tokens += seen.tokens;
    same->dropped += seen.dropped;
    same->aux_loss += seen.aux_loss;
    same->z_loss += seen.z_loss;
  }
  micro_batches_ += micro_batches;
}

void MoeStep::gather(parallel::Communicator& pp) {
  if (!on()) return;
  std::vector<int64_t> blocks;
  for (int64_t i = 0; i < config_.layers; ++i) {
    if (config_.moe_block(i)) blocks.push_back(i);
  }
  const int64_t E = config_.experts, width = E + 4, n = static_cast<int64_t>(blocks.size());
  // One row per block: counts, tokens, dropped, aux and z summed over the micro-batches; zero
  // on the ranks that do not run it (each block runs on one pp rank).
  std::vector<double> rows(static_cast<size_t>(n * width), 0.0);
  for (int64_t b = 0; b < n; ++b) {
    const std::string name = fmt::format("h.{}", blocks[b]);
    for (const nn::MoeLayerStats& l : layers_) {
      if (l.name != name) continue;
      double* row = rows.data() + b * width;
      for (int64_t e = 0; e < E; ++e) row[e] = static_cast<double>(l.counts[e]);
      row[E] = static_cast<double>(l.tokens);
      row[E + 1] = static_cast<double>(l.dropped);
      row[E + 2] = l.aux_loss;
      row[E + 3] = l.z_loss;
    }
  }
  Tensor t = Tensor::from_vector(rows, {n, width});
  {
    const parallel::CommCause cause("moe routing statistics", parallel::CommKind::control);
    pp.all_reduce(t, parallel::ReduceOp::sum);
  }
  const std::vector<double> all = t.to_vector<double>();
  layers_.clear();
  loss_sum_ = 0.0;
  for (int64_t b = 0; b < n; ++b) {
    const double* row = all.data() + b * width;
    nn::MoeLayerStats l;
    l.name = fmt::format("h.{}", blocks[b]);
    for (int64_t e = 0; e < E; ++e) l.counts.push_back(static_cast<int64_t>(row[e]));
    l.tokens = static_cast<int64_t>(row[E]);
    l.dropped = static_cast<int64_t>(row[E + 1]);
    l.aux_loss = row[E + 2];
    l.z_loss = row[E + 3];
    loss_sum_ += l.aux_loss + l.z_loss;
    layers_.push_back(std::move(l));
  }
}

void MoeStep::update_bias(Gpt& model) const {
  if (!on() || config_.moe.bias_rate <= 0) return;
  for (size_t i = 0; i < model.h->size(); ++i) {
    Block& b = static_cast<Block&>(*(*model.h)[i]);
    if (!b.moe) continue;
    const std::string name = fmt::format("h.{}", i);
    auto seen = std::find_if(layers_.begin(), layers_.end(),
                             [&](const nn::MoeLayerStats& l) { return l.name == name; });
    TS_CHECK(seen != layers_.end(), "gpt: block {} has experts but the step recorded no routing for it", name);
    nn::update_selection_bias(b.moe->selection_bias, seen->counts, config_.moe.bias_rate);
  }
}

std::string MoeStep::line() const {
  if (layers_.empty()) return "";
  double worst = 0.0;
  int64_t dropped = 0, assigned = 0;
  for (const nn::MoeLayerStats& s : layers_) {
    worst = std::max(worst, s.imbalance());
    dropped += s.dropped;
    for (int64_t c : s.counts) assigned += c;
  }
  std::string out = fmt::format("  moe max/mean {:.2f}", worst);
  if (config_.moe.capacity_factor > 0) {
    out += fmt::format(" dropped {:.1f}%", assigned > 0 ? 100.0 * dropped / assigned : 0.0);
  }
  if (config_.moe.aux_loss > 0 || config_.moe.z_loss > 0) out += fmt::format(" aux {:.4f}", loss());
  return out;
}

void MoeStep::annotate(nlohmann::json& record) const {
  if (layers_.empty()) return;
  nlohmann::json layers = nlohmann::json::array();
  for (const nn::MoeLayerStats& s : layers_) {
    layers.push_back({{"layer", s.name},
                      {"counts", s.counts},
                      {"tokens", s.tokens},
                      {"dropped", s.dropped},
                      {"aux_loss", micro_batches_ > 0 ? s.aux_loss / micro_batches_ : 0.0},
                      {"z_loss", micro_batches_ > 0 ? s.z_loss / micro_batches_ : 0.0}});
  }
  record["moe"] = std::move(layers);
}

}  // namespace tessera::gpt
