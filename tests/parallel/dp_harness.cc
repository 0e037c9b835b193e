#include "tests/parallel/dp_harness.h"

#include "parallel/comm/comm_log.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "models/data/text.h"
#include "autograd/aux_loss.h"
#include "models/gpt/model.h"
#include "models/mnist/model.h"
#include "nn/moe.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/clip.h"
#include "parallel/expert_parallel.h"
#include "parallel/zero.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/quant8.h"
#include "tensor/random.h"

namespace tessera::parallel::testing_dp {

Task mlp_task(Device device) {
  constexpr int64_t kBatch = 32;
  Task task;
  task.name = "mnist mlp";
  task.device = device;
  task.units = {"1"};  // the 784 x 256 layer; the output layer stays in the root
  task.make = [] {
    manual_seed(0);
    return std::shared_ptr<nn::Module>(mnist::make_mlp());
  };
  task.loss = [device](nn::Module& model, DType dtype, int64_t step, int part, int parts) {
    // The global batch of `step` is drawn whole from its own seed, on every rank alike.
    manual_seed(1000 + static_cast<uint64_t>(step));
    const Tensor x = randn({kBatch, 1, 28, 28});
    const Tensor y = argmax(x.flatten(1).narrow(1, 0, 10), 1);
    const int64_t rows = kBatch / parts;
    // to(): the tensor itself when already there (the CPU runs).
    return cross_entropy(model(x.narrow(0, part * rows, rows).cast(dtype).to(device)),
                         y.narrow(0, part * rows, rows).to(device));
  };
  return task;
}

// Byte text with some structure to learn (synthetic: hermetic and fast).
const data::TextWindows& text_windows() {
  static const data::TextWindows windows = [] {
    const std::string lines[] = {"the quick brown fox jumps over the lazy dog. ",
                                 "pack my box with five dozen liquor jugs! ",
                                 "how vexingly quick daft zebras jump; ",
                                 "sphinx of black quartz, judge my vow.\n"};
    std::vector<uint8_t> bytes;
    for (int i = 0; bytes.size() < 8192; ++i) {
      const std::string& s = lines[(i * 7 + i / 3) % 4];
      bytes.insert(bytes.end(), s.begin(), s.end());
    }
    return data::TextWindows(std::move(bytes), data::TextSplit::train, /*seed=*/3);
  }();
  return windows;
}

Task gpt_task(Device device) {
  constexpr int64_t kBatch = 8, kContext = 16;
  Task task;
  task.name = "gpt-mini";
  task.device = device;
  task.units = {"h.0", "h.1"};  // the transformer blocks
  task.make = [] {
    manual_seed(0);
    return std::shared_ptr<nn::Module>(std::make_shared<gpt::Gpt>(gpt::GptConfig{
        .layers = 2, .heads = 2, .width = 32, .context = kContext, .vocab = 256}));
  };
  task.loss = [device](nn::Module& model, DType, int64_t step, int part, int parts) {
    const data::TextBatch b = text_windows().get(step, kBatch, kContext, part, parts);
    return gpt::Gpt::loss(model(b.idx.to(device)), b.targets.to(device));
  };
  task.lr = 1e-2;
  // Adding a constant to every key of a head shifts all of a query's scores equally, which
  // softmax ignores: the key bias c_attn.bias[C, 2C) has gradient exactly zero.
  task.zero_gradient = [](const std::string& name, size_t i) {
    return name.ends_with("attn.c_attn.bias") && i >= 32 && i < 64;
  };
  return task;
}

Task gpt_moe_task(Device device) {
  Task task = gpt_task(device);
  task.name = "gpt-mini-moe";
  task.experts = 8;
  task.make = [] {
    manual_seed(0);
    gpt::GptConfig c{.layers = 2, .heads = 2, .width = 32, .context = 16, .vocab = 256};
    c.experts = 8;
    c.moe_every = 1;
    c.moe.top_k = 2;
    c.moe.aux_loss = 0.01;
    c.moe.z_loss = 0.001;
    return std::shared_ptr<nn::Module>(std::make_shared<gpt::Gpt>(c));
  };
  return task;
}

// The attached losses of the forwards `scope` saw (over every rank sharing the batch).
double attached_losses(const nn::MoeStatsScope& scope) {
  double total = 0;
  for (const nn::MoeLayerStats& s : scope.layers()) total += s.aux_loss + s.z_loss;
  return total;
}

std::vector<std::vector<double>> values_of(const nn::Module& model) {
  std::vector<std::vector<double>> out;
  for (const Tensor& p : model.parameters()) out.push_back(p.to_vector<double>());
  return out;
}


std::vector<double> tensor_norm_rel(const Task& task, const std::vector<std::string>& names,
                                    const std::vector<std::vector<double>>& got,
                                    const std::vector<std::vector<double>>& want) {
  REQUIRE(got.size() == want.size());
  REQUIRE(names.size() == want.size());
  std::vector<double> out;
  for (size_t t = 0; t < want.size(); ++t) {
    REQUIRE(got[t].size() == want[t].size());
    double err2 = 0, norm2 = 0;
    for (size_t i = 0; i < want[t].size(); ++i) {
      if (task.zero_gradient(names[t], i)) continue;
      const double e = got[t][i] - want[t][i];
      err2 += e * e;
      norm2 += want[t][i] * want[t][i];
    }
    out.push_back(std::sqrt(err2 / std::max(norm2, 1e-300)));
  }
  return out;
}

Diff compare(const Task& task, const Run& got, const Run& want) {
  Diff d;
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    d.loss = std::max(d.loss, std::abs(got.losses[i] - want.losses[i]) /
                                  std::max(1.0, std::abs(want.losses[i])));
  }
  for (double l : got.losses) d.finite = d.finite && std::isfinite(l);
  for (const std::vector<double>& p : got.params) {
    for (double v : p) d.finite = d.finite && std::isfinite(v);
  }
  const std::vector<double> norm_rel = tensor_norm_rel(task, want.names, got.params, want.params);
  const std::vector<double> to_exact =
      want.exact.empty() ? std::vector<double>() : tensor_norm_rel(task, want.names, got.params, want.exact);
  for (size_t t = 0; t < want.params.size(); ++t) {
    double scale = 0, worst = 0;
    for (size_t i = 0; i < want.params[t].size(); ++i) {
      const double b = want.params[t][i], e = std::abs(got.params[t][i] - b);
      scale = std::max(scale, std::abs(b));
      worst = std::max(worst, e);
      if (task.zero_gradient(want.names[t], i)) d.zero_grad_abs = std::max(d.zero_grad_abs, e);
    }
    d.param_abs = std::max(d.param_abs, worst);
    d.param_rel = std::max(d.param_rel, worst / std::max(scale, 1e-30));
    // The tensor nearest its bound (f32: max(1e-5, 2 x the reference's rounding)).
    const double bound = want.rounding.empty() ? 1e-5 : std::max(1e-5, 2 * want.rounding[t]);
    if (norm_rel[t] / bound > d.param_norm / d.param_norm_bound) {
      d.param_norm = norm_rel[t];
      d.param_norm_bound = bound;
      d.worst_tensor = want.names[t];
    }
    // Past 1e-5 the bound rests on the run being no worse a rounding than the reference's:
    // its own distance from exact arithmetic (the f64 run) is checked against the same bound.
    if (!to_exact.empty() && norm_rel[t] > 1e-5 && to_exact[t] / bound > d.exact_norm / d.exact_bound) {
      d.exact_norm = to_exact[t];
      d.exact_bound = bound;
      d.exact_tensor = want.names[t];
    }
  }
  return d;
}


bool check_close(const Task& task, DType dtype, const Run& got, const Run& reference,
                 const std::string& label) {
  const Diff d = compare(task, got, reference);
  const bool bitwise = got.losses == reference.losses && got.params == reference.params;
  MESSAGE(fmt::format("{} {} {}: {} (loss rel {:.2g}; params: max abs {:.2g}, max rel {:.2g}, "
                      "norm rel {:.2g} of {:.2g} ({}), zero-gradient elements abs {:.2g}{})",
                      task.name, dtype, label, bitwise ? "bitwise equal" : "close", d.loss,
                      d.param_abs, d.param_rel, d.param_norm, d.param_norm_bound, d.worst_tensor,
                      d.zero_grad_abs,
                      d.exact_tensor.empty()
                          ? std::string()
                          : fmt::format("; from the f64 run {:.2g} of {:.2g} ({})", d.exact_norm,
                                        d.exact_bound, d.exact_tensor)));
  CHECK(d.finite);
  if (dtype == DType::f64) {
    CHECK(d.loss <= 1e-10);
    CHECK(d.param_abs <= 1e-10);
    CHECK(d.param_rel <= 1e-10);
  } else {
    CHECK(d.loss <= 1e-5);
    CHECK(d.param_norm <= d.param_norm_bound);
    CHECK(d.exact_norm <= d.exact_bound);
    CHECK(d.zero_grad_abs <= 2 * kSteps * task.lr);
  }
  return bitwise;
}

void check_aux(const Run& got, const Run& reference, DType dtype) {
  REQUIRE(got.aux.size() == reference.aux.size());
  double worst = 0;
  for (size_t s = 0; s < got.aux.size(); ++s) worst = std::max(worst, std::abs(got.aux[s] - reference.aux[s]));
  CHECK(worst <= (dtype == DType::f64 ? 1e-13 : 1e-6));
}

std::shared_ptr<nn::Module> make_model(const Task& task, DType dtype) {
  std::shared_ptr<nn::Module> model = task.make();
  model->to(dtype);
  if (!task.device.is_cpu()) model->to(task.device);
  return model;
}

std::unique_ptr<optim::Optimizer> make_optimizer(Opt opt, std::vector<optim::ParamGroup> groups,
                                                 double lr) {
  if (opt == Opt::adamw8bit) {
    return std::make_unique<optim::AdamW8bit>(std::move(groups),
                                              optim::AdamW8bitOptions{.lr = lr, .weight_decay = kWeightDecay});
  }
  return std::make_unique<optim::AdamW>(std::move(groups),
                                        optim::AdamWOptions{.lr = lr, .weight_decay = kWeightDecay});
}

Run train_reference(const Task& task, DType dtype, Opt which) {
  std::shared_ptr<nn::Module> model = make_model(task, dtype);
  std::unique_ptr<optim::Optimizer> optimizer =
      make_optimizer(which, optim::decay_groups(model->named_parameters(), task.lr, kWeightDecay), task.lr);
  optim::Optimizer& opt = *optimizer;
  const std::vector<Tensor> params = model->parameters();
  Run run;
  for (int64_t step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const nn::MoeStatsScope routing;
    Tensor loss = task.loss(*model, dtype, step, 0, 1);
    run.losses.push_back(loss.item<double>());
    if (task.experts > 0) run.aux.push_back(attached_losses(routing));
    loss.backward();
    optim::clip_grad_norm(params, kClip);
    opt.step();
  }
  run.params = values_of(*model);
  for (auto& [name, _] : model->named_parameters()) run.names.push_back(name);
  // The f32 run's own rounding, against the same run in f64 (the 8-bit optimizer's
  // quantisation steps would swamp it: those runs keep the 1e-5 bound).
  // That floor must stay small: every tensor within 3e-5 of the f64 run (measured at most
  // 1.17e-5), so no bound passes 6e-5.
  if (dtype == DType::f32 && which == Opt::adamw) {
    const Run exact = train_reference(task, DType::f64, which);
    run.rounding = tensor_norm_rel(task, run.names, run.params, exact.params);
    run.exact = exact.params;
    for (size_t t = 0; t < run.rounding.size(); ++t) {
      CHECK_MESSAGE(run.rounding[t] <= 3e-5,
                    fmt::format("{} f32 one-device run: {} is {:.3g} (norm rel) from the f64 run",
                                task.name, run.names[t], run.rounding[t]));
    }
  }
  return run;
}

Run train_zero(Communicator& world, const Task& task, DType dtype, const ZeroRun& spec) {
  std::shared_ptr<nn::Module> model = make_model(task, dtype);
  ZeroOptions zopt{.stage = spec.stage, .units = task.units};
  zopt.offload = spec.offload;
  if (spec.opt == Opt::adamw8bit) zopt.block_shards = kQuant8Block;
  // Expert parallelism: each rank keeps its experts only, reduced over the ranks holding the
  // same ones.
  std::unique_ptr<ExpertGroups> experts;
  std::optional<nn::MoeDispatchScope> dispatch;
  if (spec.ep > 1) {
    REQUIRE(task.experts > 0);
    REQUIRE(spec.save == nullptr);  // (the harness saves without the experts' gather)
    experts = std::make_unique<ExpertGroups>(world, spec.ep, task.experts);
    REQUIRE(experts->keep(*model) > 0);
    zopt.subgroup = experts->subgroup(zopt.average);
    dispatch.emplace(&experts->dispatch());
    if (spec.local_params != nullptr) *spec.local_params = model->num_parameters();
  }
  ZeroDataParallel zero(*model, world, zopt);
  std::unique_ptr<optim::Optimizer> optimizer =
      make_optimizer(spec.opt, zero.param_groups(task.lr, kWeightDecay), task.lr);
  optim::Optimizer& opt = *optimizer;
  if (spec.load != nullptr) {
    zero.load_model_state_dict(spec.load->model);
    zero.load_optimizer_state_dict(opt, spec.load->optimizer);
  }
  if (spec.reports != nullptr) spec.reports->push_back(zero.offload_report());
  const int ranks = world.size(), accum = spec.accum;
  std::optional<nn::MoeCountReduction> counts;
  if (task.experts > 0) {
    counts.emplace([&world](Tensor& t) { world.all_reduce(t, ReduceOp::sum); });
  }
  // ZeRO averages the ranks' gradients; each micro-batch's loss is divided by accum.
  const autograd::AuxLossScale aux_scale(1.0 / accum);
  Run run;
  for (int64_t step = spec.start; step < spec.stop; ++step) {
    if (spec.before_step) spec.before_step(step, opt, *model);
    zero.zero_grad();
    double local = 0, aux = 0;
    // Experts with accumulation: the balancing loss's f_i from the whole step's routing (a
    // pass without grad over the micro-batches first), as one device counts the whole batch.
    std::optional<nn::MoeStepCounts> step_counts;
    if (task.experts > 0 && accum > 1) {
      const nn::MoeStatsScope routing;
      const NoGradGuard no_grad;
      for (int micro = 0; micro < accum; ++micro) {
        task.loss(*model, dtype, step, world.rank() * accum + micro, ranks * accum);
      }
      step_counts.emplace(routing.layers());
    }
    for (int micro = 0; micro < accum; ++micro) {
      const nn::MoeStatsScope routing;
      std::optional<CommLogScope> logged;
      if (spec.forward_log != nullptr) logged.emplace(*spec.forward_log);
      Tensor loss = task.loss(*model, dtype, step, world.rank() * accum + micro, ranks * accum);
      local += loss.item<double>();
      aux += attached_losses(routing) / accum;
      if (accum > 1) loss = loss / static_cast<double>(accum);
      if (micro + 1 < accum) {
        auto guard = zero.no_sync();
        zero.backward(loss);
      } else {
        zero.backward(loss);
      }
      logged.reset();
    }
    zero.clip_grad_norm(kClip);
    {
      std::optional<CommLogScope> scope;
      if (spec.step_log != nullptr) scope.emplace(*spec.step_log);
      zero.step(opt);
    }
    if (spec.complete_step) zero.complete_step();
    if (spec.reports != nullptr) spec.reports->push_back(zero.offload_report());
    Tensor total = Tensor::from_vector<double>({local}, {1});
    world.all_reduce(total, ReduceOp::sum);
    run.losses.push_back(total.item<double>() / (ranks * accum));
    if (task.experts > 0) run.aux.push_back(aux);
  }
  if (spec.save != nullptr) spec.save->optimizer = zero.optimizer_state_dict(opt);
  nn::StateDict full = zero.model_state_dict();
  if (experts) experts->gather(full);  // the experts whole, as one device holds them
  if (spec.save != nullptr) spec.save->model = full;
  for (auto& [name, _] : model->named_parameters()) {
    run.names.push_back(name);
    run.params.push_back(full.at(name).to_vector<double>());
  }
  return run;
}

optim::AdafactorOptions adafactor_options(optim::AdafactorMode mode) {
  optim::AdafactorOptions o;
  o.mode = mode;
  o.lr = 1e-2;
  o.relative_step = false;
  o.beta1 = mode == optim::AdafactorMode::torch ? 0.0 : 0.9;
  o.weight_decay = kWeightDecay;
  o.min_dim_size_to_factor = 1;  // optax: factor every matrix, as the others do
  return o;
}

std::vector<std::vector<double>> adafactor_reference(const Task& task, optim::AdafactorMode mode) {
  std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
  optim::Adafactor opt(optim::decay_groups(model->named_parameters(), 1e-2, kWeightDecay),
                       adafactor_options(mode));
  for (int64_t step = 0; step < kAdafactorSteps; ++step) {
    opt.zero_grad();
    task.loss(*model, DType::f64, step, 0, 1).backward();
    opt.step();
  }
  return values_of(*model);
}

RowShardResult adafactor_row_shards(Communicator& world, const Task& task, optim::AdafactorMode mode,
                                    int stage, const std::vector<std::vector<double>>& want,
                                    const Checkpoint* load, Checkpoint* save, int64_t start,
                                    int64_t stop) {
  RowShardResult out;
  std::shared_ptr<nn::Module> model = make_model(task, DType::f64);
  out.params = static_cast<int64_t>(model->parameters().size());
  ZeroDataParallel zero(*model, world, {.stage = stage, .units = task.units, .row_shards = true});
  optim::Adafactor opt(zero.param_groups(1e-2, kWeightDecay), adafactor_options(mode));
  if (load != nullptr) {
    zero.load_model_state_dict(load->model);
    zero.load_optimizer_state_dict(opt, load->optimizer);
  }
  CommLog log;
  for (int64_t step = start; step < stop; ++step) {
    zero.zero_grad();
    zero.backward(task.loss(*model, DType::f64, step, world.rank(), world.size()));
    CommLogScope scope(log);
    zero.step(opt);
  }
  for (const CommRecord& r : log.records) out.reduces += r.cause == "zero row-shard statistics";
  if (save != nullptr) save->optimizer = zero.optimizer_state_dict(opt);
  const nn::StateDict full = zero.model_state_dict();
  if (save != nullptr) save->model = full;
  size_t i = 0;
  for (const auto& entry : model->named_parameters()) {
    const std::vector<double> v = full.at(entry.first).to_vector<double>();
    for (size_t k = 0; k < v.size(); ++k) {
      if (!task.zero_gradient(entry.first, k)) out.worst = std::max(out.worst, std::abs(v[k] - want[i][k]));
    }
    ++i;
  }
  return out;
}

}  // namespace tessera::parallel::testing_dp
