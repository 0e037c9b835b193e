#include "models/gpt/pipeline.h"

#include <fmt/format.h>

#include <set>

#include "parallel/comm/comm_log.h"
#include "parallel/pipeline/partition.h"
#include "tensor/error.h"

namespace tessera::gpt {

namespace {

int64_t count(const nn::NamedTensors& params) {
  int64_t n = 0;
  for (const auto& [name, t] : params) n += t.numel();
  return n;
}

// A module that only holds children (the stage's share of the GPT's layers).
class Holder : public nn::Module {
 public:
  explicit Holder(std::string type) : nn::Module(std::move(type)) {}
  void add(const std::string& name, std::shared_ptr<nn::Module> m) { register_module(name, std::move(m)); }
};

}  // namespace

std::string GptPipeline::layer_name(int layer) const {
  if (layer == 0) return "embed";
  if (layer == layers - 1) return "head";
  return fmt::format("h.{}", layer - 1);
}

GptPipeline partition_gpt(const Gpt& model, int stages, const std::vector<int>& layers_per_stage) {
  const int blocks = static_cast<int>(model.config().layers);
  GptPipeline p;
  p.layers = blocks + 2;
  if (!layers_per_stage.empty()) {
    TS_CHECK(static_cast<int>(layers_per_stage.size()) == stages,
             "partition_gpt: {} stages but {} layer counts given", stages, layers_per_stage.size());
    p.first_layer = parallel::pipeline::stages_from_counts(layers_per_stage, p.layers);
    return p;
  }
  std::vector<int64_t> costs;
  costs.push_back(model.wte->weight.numel() + model.wpe->weight.numel());
  for (int b = 0; b < blocks; ++b) costs.push_back(count((*model.h)[b]->named_parameters()));
  costs.push_back(count(model.ln_f->named_parameters()));
  try {
    p.first_layer = parallel::pipeline::balance_stages(costs, stages);
  } catch (const Error& e) {
    fail("partition_gpt: a GPT of {} blocks has {} pipeline layers (embed, the blocks, head): "
         "{}", blocks, p.layers, e.what());
  }
  return p;
}

parallel::pipeline::PipelineChunks GptPipeline::chunks(Gpt& model,
                                                       const parallel::pipeline::Schedule& s,
                                                       int rank) const {
  TS_CHECK(s.num_stages() == num_stages(),
           "GptPipeline: the partition has {} stages, the {} schedule {}", num_stages(), s.name,
           s.num_stages());
  parallel::pipeline::PipelineChunks out;
  for (int c = 0; c < s.chunks; ++c) {
    const int stage = s.stage_of(rank, c);
    const int begin = first_layer[stage], end = end_layer(stage), last = layers - 1;
    out.push_back([&model, begin, end, last](const Tensor& input, int /*microbatch*/) {
      Tensor x = input;
      for (int l = begin; l < end; ++l) {
        if (l == 0) {
          x = model.embed(x);
        } else if (l == last) {
          x = model.head(x);
        } else {
          x = (*(*model.h)[l - 1])(x);
        }
      }
      return x;
    });
  }
  return out;
}

nn::NamedTensors GptPipeline::parameters(Gpt& model, const parallel::pipeline::Schedule& s,
                                         int rank) const {
  nn::NamedTensors out;
  std::set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const nn::Module& m) {
    for (const auto& [name, t] : m.named_parameters()) {
      if (seen.insert(t.impl()).second) out.emplace_back(prefix + name, t);
    }
  };
  for (int c = 0; c < s.chunks; ++c) {
    const int stage = s.stage_of(rank, c);
    for (int l = first_layer[stage]; l < end_layer(stage); ++l) {
      if (l == 0 || l == layers - 1) add("wte.", *model.wte);
      if (l == 0) add("wpe.", *model.wpe);
      if (l == layers - 1) add("ln_f.", *model.ln_f);
      if (l > 0 && l < layers - 1) add(fmt::format("h.{}.", l - 1), *(*model.h)[l - 1]);
    }
  }
  return out;
}

std::shared_ptr<nn::Module> GptPipeline::stage_module(Gpt& model,
                                                      const parallel::pipeline::Schedule& s,
                                                      int rank) const {
  auto stage = std::make_shared<Holder>("GptStages");
  auto blocks = std::make_shared<Holder>("Blocks");
  bool embed = false, head = false, any_block = false;
  for (int c = 0; c < s.chunks; ++c) {
    const int st = s.stage_of(rank, c);
    for (int l = first_layer[st]; l < end_layer(st); ++l) {
      if (l == 0) {
        embed = true;
      } else if (l == layers - 1) {
        head = true;
      } else {
        blocks->add(std::to_string(l - 1), (*model.h)[l - 1]);
        any_block = true;
      }
    }
  }
  // Registration order as in Gpt: wte, wpe, h, ln_f.
  if (embed || head) stage->add("wte", model.wte);
  if (embed) stage->add("wpe", model.wpe);
  if (any_block) stage->add("h", blocks);
  if (head) stage->add("ln_f", model.ln_f);
  return stage;
}

void GptPipeline::sync_tied_gradients(Gpt& model, parallel::Communicator& pp,
                                      const parallel::pipeline::Schedule& s) const {
  const int first = s.rank_of(0), last = s.rank_of(s.num_stages() - 1);
  const bool member = pp.rank() == first || pp.rank() == last;
  // Collective over pp even where the group is trivial, so every rank makes the same calls.
  auto group = pp.split(member ? 0 : 1, pp.rank(), "embedding");
  if (!member || first == last) return;
  const Tensor g = model.wte->weight.grad();
  TS_CHECK(g.defined(), "GptPipeline: rank {} holds the {} stage but wte has no gradient",
           pp.rank(), pp.rank() == first ? "first" : "last");
  parallel::CommCause cause("pipeline tied embedding");
  group->all_reduce(g, parallel::ReduceOp::sum);
}

std::string GptPipeline::str() const {
  std::string out;
  for (int s = 0; s < num_stages(); ++s) {
    out += fmt::format("{}stage {}:", s == 0 ? "" : " | ", s);
    for (int l = first_layer[s]; l < end_layer(s); ++l) {
      out += ' ';  // (not " " + name: GCC 12 warns falsely of -Wrestrict on that)
      out += layer_name(l);
    }
  }
  return out;
}

}  // namespace tessera::gpt
