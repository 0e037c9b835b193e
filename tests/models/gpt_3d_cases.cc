#include "tests/models/gpt_3d_cases.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "models/common/sharded_checkpoint.h"
#include "models/data/text.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "tensor/autocast.h"
#include "tensor/random.h"

namespace tessera::gpt::testing3d {

namespace {

constexpr int kSteps = 10, kMicro = 4, kLayers = 6;  // 8 pipeline layers: up to 8 stages
constexpr int64_t kBatch = 32, kContext = 8;         // 4 micro-batches x up to 8 dp ranks
constexpr double kLr = 1e-2, kWd = 0.1;
constexpr double kClip = 0.5;  // below the gradient norm of the first steps: clipping acts

std::shared_ptr<Gpt> make_gpt(DType dtype, double dropout = 0.0,
                              GptConfig::Recompute recompute = GptConfig::Recompute::none) {
  manual_seed(0);
  auto m = std::make_shared<Gpt>(GptConfig{.layers = kLayers, .heads = 8, .width = 32,
                                           .context = kContext, .vocab = 256,
                                           .dropout = dropout, .recompute = recompute});
  m->to(dtype);
  return m;
}

const data::TextWindows& windows() {
  static const data::TextWindows w = [] {
    std::vector<uint8_t> bytes;
    for (int i = 0; i < 8192; ++i) bytes.push_back(static_cast<uint8_t>("three dimensions "[i % 17]));
    return data::TextWindows(std::move(bytes), data::TextSplit::train, 8);
  }();
  return w;
}

}  // namespace

Run reference(DType dtype) {
  const auto model = make_gpt(dtype);
  optim::AdamW opt(optim::decay_groups(model->named_parameters(), kLr, kWd),
                   {.lr = kLr, .betas = {0.9, 0.95}, .weight_decay = kWd});
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const data::TextBatch b = windows().get(step, kBatch, kContext);
    Tensor loss = Gpt::loss((*model)(b.idx), b.targets);
    run.losses.push_back(loss.item<double>());
    loss.backward();
    const double norm = optim::clip_grad_norm(model->parameters(), kClip);
    if (step == 0) CHECK(norm > kClip);  // the clipping is exercised
    opt.step();
  }
  for (const auto& [name, t] : model->named_parameters()) run.params[name] = t.to_vector<double>();
  return run;
}

Run train_3d(parallel::CommPtr world, const Gpt3dOptions& o, DType dtype) {
  const auto model = make_gpt(dtype);
  Gpt3d g(*model, world, o);
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    const data::TextBatch b = windows().get(step, kBatch, kContext);
    run.losses.push_back(g.train_step(b.idx, b.targets, kLr));
  }
  for (const auto& [name, t] : g.full_parameters()) run.params[name] = t.to_vector<double>();
  return run;
}


int check_factorisations(parallel::CommPtr world, const Run& ref) {
  const int n = world->size();
  int runs = 0;
  for (int pp = 1; pp <= n; pp *= 2) {
    for (int dp = 1; pp * dp <= n; dp *= 2) {
      const int tp = n / (pp * dp);
      for (const char* name : {"gpipe", "1f1b", "interleaved"}) {
        const int chunks = std::string(name) == "interleaved" ? 2 : 1;
        if (pp == 1 && std::string(name) != "1f1b") continue;  // one stage: schedules alike
        if (pp * chunks > kLayers + 2) {
          if (world->rank() == 0) {
            MESSAGE(fmt::format("skipped: {} on pp={} needs {} stages; the model has {} "
                                "pipeline layers", name, pp, pp * chunks, kLayers + 2));
          }
          continue;
        }
        for (int zero : {0, 1}) {
          const Gpt3dOptions o{.pp = pp, .dp = dp, .tp = tp, .zero = zero, .schedule = name,
                               .chunks = chunks, .microbatches = kMicro,
                               .recompute = (pp + dp + zero) % 2 == 1,  // half the runs
                               .clip = kClip,
                               .sequence_parallel = tp > 1 && zero == 1,
                               .lr = kLr, .weight_decay = kWd};
          const Run r = train_3d(world, o, DType::f64);
          double loss_err = 0, param_err = 0;
          REQUIRE(r.losses.size() == ref.losses.size());
          for (size_t i = 0; i < r.losses.size(); ++i) {
            loss_err = std::max(loss_err, std::abs(r.losses[i] - ref.losses[i]));
          }
          REQUIRE(r.params.size() == ref.params.size());
          for (const auto& [pname, v] : r.params) {
            const std::vector<double>& w = ref.params.at(pname);
            for (size_t i = 0; i < v.size(); ++i) param_err = std::max(param_err, std::abs(v[i] - w[i]));
          }
          if (world->rank() == 0) {
            MESSAGE(fmt::format("{} ranks: pp={} dp={} tp={} {} zero={}{}{}: loss err {:.2g}, "
                                "param err {:.2g}", n, pp, dp, tp, name, zero,
                                o.recompute ? " recompute" : "",
                                o.sequence_parallel ? " sp" : "", loss_err, param_err));
          }
          CAPTURE(pp);
          CAPTURE(dp);
          CAPTURE(tp);
          CAPTURE(name);
          CAPTURE(zero);
          CHECK(loss_err <= 1e-10);
          CHECK(param_err <= 1e-10);
          ++runs;
        }
      }
    }
  }
  return runs;
}

int check_factorisations_f32(parallel::CommPtr world, const Run& ref) {
  const int n = world->size();
  int runs = 0;
  for (int pp = 1; pp <= n; pp *= 2) {
    for (int dp = 1; pp * dp <= n; dp *= 2) {
      const int tp = n / (pp * dp);
      const Gpt3dOptions o{.pp = pp, .dp = dp, .tp = tp, .zero = 1, .schedule = "1f1b",
                           .microbatches = kMicro, .clip = kClip, .lr = kLr, .weight_decay = kWd};
      const Run r = train_3d(world, o, DType::f32);
      double loss_rel = 0, norm_rel = 0, key_bias = 0, all_err2 = 0, all_norm2 = 0;
      std::string worst;
      for (size_t i = 0; i < r.losses.size(); ++i) {
        loss_rel = std::max(loss_rel, std::abs(r.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
      }
      for (const auto& [pname, v] : r.params) {
        const std::vector<double>& w = ref.params.at(pname);
        // The attention key bias has an exactly-zero gradient (softmax ignores a shift of all
        // keys): AdamW turns its rounding noise into lr-sized steps of either sign.
        const bool has_key_bias = pname.ends_with("attn.c_attn.bias");
        double err2 = 0, norm2 = 0;
        for (size_t i = 0; i < v.size(); ++i) {
          const double e = std::abs(v[i] - w[i]);
          if (has_key_bias && i >= 32 && i < 64) {
            key_bias = std::max(key_bias, e);
          } else {
            err2 += e * e;
            norm2 += w[i] * w[i];
          }
        }
        all_err2 += err2;
        all_norm2 += norm2;
        const double rel = std::sqrt(err2 / std::max(norm2, 1e-300));
        if (rel > norm_rel) {
          norm_rel = rel;
          worst = fmt::format("{} (norm {:.3g})", pname, std::sqrt(norm2));
        }
      }
      if (world->rank() == 0) {
        MESSAGE(fmt::format("f32, {} ranks: pp={} dp={} tp={} 1f1b zero=1: loss rel {:.2g}, "
                            "all parameters norm rel {:.2g}, worst tensor {:.2g} ({}), key bias abs {:.2g}",
                            n, pp, dp, tp, loss_rel, std::sqrt(all_err2 / all_norm2), norm_rel,
                            worst, key_bias));
      }
      CAPTURE(pp);
      CAPTURE(dp);
      CAPTURE(tp);
      CHECK(loss_rel <= 1e-5);
      CHECK(std::sqrt(all_err2 / all_norm2) <= 1e-5);
      // Per tensor, small ones whose gradients are close to rounding noise (the query bias,
      // LayerNorm shifts) see AdamW's normalised step amplify summation-order differences:
      // measured up to 2.1e-5 under tp (whose split products sum in another order).
      CHECK(norm_rel <= 1e-4);
      CHECK(key_bias <= 2 * kSteps * kLr);
      ++runs;
    }
  }
  return runs;
}

// ---- the composition matrix ----------------------------------------------------------------

namespace {

constexpr int kComboSteps = 4;
constexpr double kLossScale = 65536.0;  // f16's initial scale (the gpt example's default)

// The model's dtype and the autocast dtype of a precision.
DType model_dtype(DType precision) { return precision == DType::f64 ? DType::f64 : DType::f32; }
DType autocast_of(DType precision) {
  return precision == DType::bf16 || precision == DType::f16 ? precision : DType::f32;  // f32: off
}

struct ComboRun {
  std::vector<double> losses;
  int64_t skipped = 0;
  std::map<std::string, std::vector<double>> params;
};

// The single-device run: the model in its dtype (autocast for bf16 / f16, with dynamic loss
// scaling for f16), dropout's masks drawn by one forward over the whole batch, clipped AdamW.
ComboRun single_device(DType precision, double dropout) {
  const auto model = make_gpt(model_dtype(precision), dropout);
  optim::AdamW opt(optim::decay_groups(model->named_parameters(), kLr, kWd),
                   {.lr = kLr, .betas = {0.9, 0.95}, .weight_decay = kWd});
  optim::DynamicLossScaler scaler({.init_scale = kLossScale, .enabled = precision == DType::f16});
  const std::vector<Tensor> params = model->parameters();
  ComboRun run;
  for (int step = 0; step < kComboSteps; ++step) {
    opt.zero_grad();
    const data::TextBatch b = windows().get(step, kBatch, kContext);
    Tensor loss;
    {
      AutocastGuard amp(autocast_of(precision));
      loss = Gpt::loss((*model)(b.idx), b.targets);
    }
    run.losses.push_back(loss.item<double>());
    scaler.scale(loss).backward();
    scaler.step(opt, [&] {
      optim::clip_grad_norm(params, kClip);
      opt.step();
    });
    scaler.update();
  }
  run.skipped = scaler.skipped_steps();
  for (const auto& [name, t] : model->named_parameters()) run.params[name] = t.to_vector<double>();
  return run;
}

ComboRun train_combo(parallel::CommPtr world, const Combo& c) {
  const auto model = make_gpt(model_dtype(c.precision), c.dropout,
                              c.recompute == "selective" ? GptConfig::Recompute::selective
                                                         : GptConfig::Recompute::none);
  const Gpt3dOptions o{.pp = c.pp, .dp = c.dp, .tp = c.tp, .zero = c.zero,
                       .schedule = c.schedule, .chunks = c.schedule == "interleaved" ? 2 : 1,
                       .microbatches = kMicro, .accum = c.accum,
                       .recompute = c.recompute == "full", .clip = kClip,
                       .loss_scale = c.precision == DType::f16 ? kLossScale : 0.0,
                       .sequence_parallel = c.sp, .lr = kLr, .weight_decay = kWd};
  Gpt3d g(*model, world, o);
  ComboRun run;
  for (int step = 0; step < kComboSteps; ++step) {
    const data::TextBatch b = windows().get(step, kBatch, kContext);
    AutocastGuard amp(autocast_of(c.precision));
    run.losses.push_back(g.train_step(b.idx, b.targets, kLr));
  }
  run.skipped = g.skipped_steps();
  for (const auto& [name, t] : g.full_parameters()) run.params[name] = t.to_vector<double>();
  return run;
}

}  // namespace

std::string Combo::str() const {
  return fmt::format("pp{} dp{} tp{} {} zero{}{}{} accum{} {} dropout{}", pp, dp, tp,
                     dtype_name(precision), zero, sp ? " sp" : "",
                     pp > 1 ? " " + schedule : std::string(), accum, recompute, dropout);
}

std::vector<Combo> composition_matrix(int ranks, std::vector<std::string>* skipped) {
  std::vector<Combo> out;
  for (DType precision : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    for (int pp = 1; pp <= ranks; ++pp) {
      for (int dp = 1; pp * dp <= ranks; ++dp) {
        if (ranks % (pp * dp) != 0) continue;
        const int tp = ranks / (pp * dp);
        for (const char* schedule : {"gpipe", "1f1b", "interleaved"}) {
          if (pp == 1 && std::string(schedule) != "1f1b") continue;  // one stage: alike
          for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) {
            for (bool sp : {false, true}) {
              if (sp && tp == 1) continue;
              for (int accum : {1, 2}) {
                for (const char* recompute : {"none", "full", "selective"}) {
                  for (double dropout : {0.0, 0.1}) {
                    Combo c{pp, dp, tp, precision, zero, sp, schedule, accum, recompute, dropout};
                    const int chunks = c.schedule == "interleaved" ? 2 : 1;
                    if (pp * chunks > kLayers + 2) {
                      if (skipped != nullptr) {
                        skipped->push_back(fmt::format(
                            "{}: {} stages, but the model has {} pipeline layers", c.str(),
                            pp * chunks, kLayers + 2));
                      }
                      continue;
                    }
                    out.push_back(c);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

std::vector<Combo> composition_subset(int ranks) {
  std::vector<Combo> out;
  for (const Combo& c : composition_matrix(ranks)) {
    const bool many_dp = c.dp > 1, split = c.tp > 1, staged = c.pp > 1;
    // A: everything on.  B: ZeRO 2, interleaved, full recomputation.  C: ZeRO 1, sp, GPipe,
    // without dropout.  D: plain data parallelism with dropout.
    const bool a = c.zero == (many_dp ? 3 : 0) && c.sp == split && c.schedule == "1f1b" &&
                   c.accum == 2 && c.recompute == "selective" && c.dropout > 0;
    const bool b = c.zero == (many_dp ? 2 : 0) && !c.sp &&
                   c.schedule == (staged ? "interleaved" : "1f1b") && c.accum == 1 &&
                   c.recompute == "full" && c.dropout > 0;
    const bool d3 = c.zero == (many_dp ? 1 : 0) && c.sp == split &&
                    c.schedule == (staged ? "gpipe" : "1f1b") && c.accum == 2 &&
                    c.recompute == "none" && c.dropout == 0;
    const bool d4 = c.zero == 0 && !c.sp && c.schedule == "1f1b" && c.accum == 1 &&
                    c.recompute == "none" && c.dropout > 0;
    if (a || b || d3 || d4) out.push_back(c);
  }
  return out;
}

int check_compositions(parallel::CommPtr world, const std::vector<Combo>& combos) {
  std::map<std::pair<DType, double>, ComboRun> refs;  // by (precision, dropout)
  std::map<DType, std::pair<double, std::string>> worst;  // largest relative loss difference
  int runs = 0;
  for (const Combo& c : combos) {
    auto key = std::pair{c.precision, c.dropout};
    if (refs.count(key) == 0) refs[key] = single_device(c.precision, c.dropout);
    const ComboRun& ref = refs.at(key);
    const ComboRun r = train_combo(world, c);
    CAPTURE(c.str());
    REQUIRE(r.losses.size() == ref.losses.size());
    double loss_abs = 0, loss_rel = 0, param_abs = 0;
    for (size_t i = 0; i < r.losses.size(); ++i) {
      loss_abs = std::max(loss_abs, std::abs(r.losses[i] - ref.losses[i]));
      loss_rel = std::max(loss_rel, std::abs(r.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
    }
    for (const auto& [name, v] : r.params) {
      const std::vector<double>& w = ref.params.at(name);
      for (size_t i = 0; i < v.size(); ++i) param_abs = std::max(param_abs, std::abs(v[i] - w[i]));
    }
    if (loss_rel >= worst[c.precision].first) worst[c.precision] = {loss_rel, c.str()};
    if (c.precision == DType::f64) {
      CHECK(loss_abs <= 1e-10);
      CHECK(param_abs <= 1e-10);
    } else if (c.precision == DType::f32) {
      CHECK(loss_rel <= 1e-5);
    } else {
      // One unit roundoff of the precision (bf16 2^-9, f16 2^-11): a layout rounds where one
      // device does not (each tp rank's partial product of a row-wise layer before the
      // all-reduce, where one device rounds the whole sum), which moves the mean loss by
      // about one rounding. (Pipeline stages hand the stream over in f32, as one device
      // keeps it.)
      CHECK(loss_rel <= (c.precision == DType::bf16 ? 0x1p-9 : 0x1p-11));
    }
    CHECK(r.skipped == ref.skipped);
    ++runs;
  }
  if (world->rank() == 0) {
    for (const auto& [precision, w] : worst) {
      MESSAGE(fmt::format("{} ranks, {}: largest relative loss difference from one device {:.3g} "
                          "({})", world->size(), dtype_name(precision), w.first, w.second));
    }
  }
  return runs;
}

int check_resume_across_layouts(parallel::CommPtr world, const std::string& dir) {
  const ComboRun ref = single_device(DType::f64, 0.1);
  constexpr int kHalf = kComboSteps / 2;
  struct Pair {
    Combo save, load;  // load.pp == 0: one device
    bool sharded;
  };
  const auto layout = [](int pp, int dp, int tp, int zero, bool sp, const char* schedule) {
    return Combo{pp, dp, tp, DType::f64, zero, sp, schedule, 1, "none", 0.1};
  };
  const std::vector<Pair> pairs = {
      {layout(2, 2, 1, 3, false, "1f1b"), layout(1, 1, 4, 0, true, "1f1b"), false},
      {layout(1, 2, 2, 2, true, "1f1b"), layout(4, 1, 1, 0, false, "interleaved"), true},
      {layout(4, 1, 1, 0, false, "gpipe"), layout(1, 4, 1, 1, false, "1f1b"), true},
      {layout(2, 1, 2, 1, false, "1f1b"), layout(0, 0, 0, 0, false, "1f1b"), false},
  };
  const auto options = [](const Combo& c) {
    return Gpt3dOptions{.pp = c.pp, .dp = c.dp, .tp = c.tp, .zero = c.zero,
                        .schedule = c.schedule, .chunks = c.schedule == "interleaved" ? 2 : 1,
                        .microbatches = kMicro, .accum = c.accum, .clip = kClip,
                        .sequence_parallel = c.sp, .lr = kLr, .weight_decay = kWd};
  };
  int checked = 0;
  for (const Pair& p : pairs) {
    CAPTURE(p.save.str());
    CAPTURE(p.load.str());
    CAPTURE(p.sharded);
    // The first half under `save`, then the checkpoint.
    nn::StateDict weights;
    optim::Optimizer::StateDict state;
    uint64_t offset = 0;
    {
      const auto model = make_gpt(DType::f64, 0.1);
      Gpt3d g(*model, world, options(p.save));
      for (int step = 0; step < kHalf; ++step) {
        const data::TextBatch b = windows().get(step, kBatch, kContext);
        g.train_step(b.idx, b.targets, kLr);
      }
      offset = default_generator().offset();
      if (p.sharded) {
        if (world->rank() == 0) models::prepare_sharded_checkpoint(dir);
        world->barrier();
        models::ShardedCheckpointWriter w(dir, world->rank());
        g.write_blocks([&](const std::string& key, const Tensor& block, const Shape& global,
                           const std::vector<int64_t>& starts) { w.add(key, block, global, starts); });
        w.write();
        world->barrier();
        if (world->rank() == 0) models::commit_sharded_checkpoint(dir);
        world->barrier();
      } else {
        std::tie(weights, state) = g.state_dicts();
      }
    }
    // The second half under `load`.
    std::vector<double> losses;
    std::map<std::string, std::vector<double>> params;
    const auto model = make_gpt(DType::f64, 0.1);
    default_generator().set_state(default_generator().seed(), offset);
    if (p.load.pp == 0) {  // one device
      optim::AdamW opt(optim::decay_groups(model->named_parameters(), kLr, kWd),
                       {.lr = kLr, .betas = {0.9, 0.95}, .weight_decay = kWd});
      model->load_state_dict(weights);
      opt.load_state_dict(state);
      for (int step = kHalf; step < kComboSteps; ++step) {
        opt.zero_grad();
        const data::TextBatch b = windows().get(step, kBatch, kContext);
        const Tensor loss = Gpt::loss((*model)(b.idx), b.targets);
        losses.push_back(loss.item<double>());
        loss.backward();
        optim::clip_grad_norm(model->parameters(), kClip);
        opt.step();
      }
      for (const auto& [name, t] : model->named_parameters()) params[name] = t.to_vector<double>();
    } else {
      Gpt3d g(*model, world, options(p.load));
      if (p.sharded) {
        models::ShardedCheckpointReader reader(dir);
        g.read_blocks({.region = [&](const std::string& key, const Shape&,
                                     const std::vector<int64_t>& starts,
                                     const Shape& shape) { return reader.read(key, starts, shape); },
                       .whole = [&](const std::string& key) { return reader.read(key); },
                       .keys = [&](const std::string& prefix) { return reader.keys(prefix); }});
      } else {
        g.load_state_dicts(weights, state);
      }
      for (int step = kHalf; step < kComboSteps; ++step) {
        const data::TextBatch b = windows().get(step, kBatch, kContext);
        losses.push_back(g.train_step(b.idx, b.targets, kLr));
      }
      for (const auto& [name, t] : g.full_parameters()) params[name] = t.to_vector<double>();
    }
    REQUIRE(losses.size() == static_cast<size_t>(kComboSteps - kHalf));
    for (size_t i = 0; i < losses.size(); ++i) {
      CHECK(std::abs(losses[i] - ref.losses[kHalf + i]) <= 1e-10);
    }
    double param_err = 0;
    for (const auto& [name, v] : params) {
      const std::vector<double>& w = ref.params.at(name);
      for (size_t i = 0; i < v.size(); ++i) param_err = std::max(param_err, std::abs(v[i] - w[i]));
    }
    CHECK(param_err <= 1e-10);
    ++checked;
    world->barrier();  // the next pair rewrites the directory
  }
  return checked;
}

}  // namespace tessera::gpt::testing3d
