#include "tests/models/gpt_3d_cases.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "models/data/text.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "tensor/random.h"

namespace tessera::gpt::testing3d {

namespace {

constexpr int kSteps = 10, kMicro = 4, kLayers = 6;  // 8 pipeline layers: up to 8 stages
constexpr int64_t kBatch = 32, kContext = 8;         // 4 micro-batches x up to 8 dp ranks
constexpr double kLr = 1e-2, kWd = 0.1;
constexpr double kClip = 0.5;  // below the gradient norm of the first steps: clipping acts

std::shared_ptr<Gpt> make_gpt(DType dtype) {
  manual_seed(0);
  auto m = std::make_shared<Gpt>(
      GptConfig{.layers = kLayers, .heads = 8, .width = 32, .context = kContext, .vocab = 256});
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

}  // namespace tessera::gpt::testing3d
