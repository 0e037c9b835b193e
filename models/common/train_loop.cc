#include "models/common/train_loop.h"

#include <fmt/format.h>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "models/common/checkpoint.h"
#include "models/common/fault.h"
#include "models/common/run_control.h"
#include "tensor/autocast.h"
#include "tensor/error.h"

namespace tessera::models {
namespace {

// The global batch's mean loss (the ranks' slices are equal, so the mean of their means) and
// whether any rank was asked to stop (its signal, else 0), in one all-reduce: every rank
// then stops after the same step.
std::pair<double, int> over_ranks(Replica& replica, double loss, int stop) {
  parallel::Communicator* comm = replica.group();
  if (comm == nullptr) return {loss, stop};
  Tensor t = Tensor::from_vector<double>({loss, static_cast<double>(stop)}, {2});
  {
    parallel::CommCause cause("train loss", parallel::CommKind::control);
    comm->all_reduce(t, parallel::ReduceOp::sum);
  }
  const std::vector<double> v = t.to_vector<double>();
  const double mean = replica.loss_is_global() ? loss : v[0] / comm->size();
  return {mean, v[1] == 0 ? 0 : (stop != 0 ? stop : SIGTERM)};
}

}  // namespace

LoopResult run_loop(Replica& replica, const LoopOptions& o, StepMeter& meter,
                    Progress& progress, MetricsWriter& metrics) {
  using Clock = std::chrono::steady_clock;
  LoopResult result;
  int64_t step = o.start_step;
  const bool verbose = o.verbose;
  auto save = [&](bool say) {
    replica.save(step);
    if (say && verbose) {
      progress.print(fmt::format("saved {} and {}", o.save, state_path(o.save)));
    }
  };
  std::vector<Tensor> losses;  // this step's micro-batch losses, read after the update
  while (step < o.stop_at) {
    replica.before_step(step, meter);
    const Clock::time_point t0 = Clock::now();
    const double lr = o.lr(step);
    const int64_t run_step = meter.steps();
    // One step's communication (the second of the run: the first creates optimizer state).
    parallel::CommLog step_log;
    std::optional<parallel::CommLogScope> log_scope;
    if (replica.group() != nullptr && run_step == 1) log_scope.emplace(step_log);

    replica.zero_grad(step, lr);
    {
      // Under autocast the micro-batches share each parameter's cast (tensor/autocast.h):
      // one cast per step. Not kept past the backward passes, so the update runs without them.
      std::optional<WeightCastCache> casts;
      if (o.accum > 1 && o.share_casts) casts.emplace();
      for (int micro = 0; micro < o.accum; ++micro) {
        losses.push_back(replica.forward_backward(step, micro).detach());
      }
    }
    // This rank's mean loss over its micro-batches (read here: after the backward passes,
    // and below after the update on a device, where the read waits for the whole step).
    auto rank_loss = [&] {
      double total = 0.0;
      for (const Tensor& l : losses) total += l.item<double>();
      return total / static_cast<double>(losses.size());
    };
    double norm = std::numeric_limits<double>::quiet_NaN();
    bool skipped = false, poisoned = false;  // poisoned: an inf/NaN norm was applied
    if (o.skip_nonfinite) {
      // Decided before the update, on values every rank shares: the global batch's loss and
      // the gradients' global norm (which clipping computes anyway; with 1-bit Adam after its
      // warm-up each dp rank's own norm, whose finiteness the ranks agree on).
      const double loss_now = over_ranks(replica, rank_loss(), 0).first;
      const std::optional<double> n = replica.grad_norm(o.clip);
      norm = n ? *n : std::numeric_limits<double>::infinity();  // the scaler found inf/NaN
      skipped = !std::isfinite(loss_now) || !std::isfinite(norm);
    } else if (o.clip > 0) {
      // (An f16 overflow is not poison: the scaler skips that step and backs off.)
      if (const std::optional<double> n = replica.grad_norm(o.clip)) {
        norm = *n;
        poisoned = !std::isfinite(norm);
      }
    }
    if (skipped) ++result.nonfinite_skipped;
    replica.step(skipped);
    fault_point("train.step", o.fault_rank);
    const auto [loss, stop] = over_ranks(replica, rank_loss(), stop_signal());
    losses.clear();
    // A diverged step stops the run before anything more is saved (skip_nonfinite dropped
    // it instead). With clipping the norm is known: an inf/NaN gradient poisoned the update.
    if (!o.skip_nonfinite && (!std::isfinite(loss) || poisoned)) {
      fail("{}: the {} is {} at step {} (the run diverged); stopped before saving anything "
           "more{}. {}",
           o.program, std::isfinite(loss) ? "gradient norm" : "loss",
           std::isfinite(loss) ? norm : loss, step + 1,
           o.save.empty() ? std::string()
                          : fmt::format(": {} holds the last good checkpoint", o.save),
           o.divergence_advice);
    }
    log_scope.reset();
    replica.after_step(run_step, step_log);
    ++step;
    meter.add(seconds_since(t0), loss);
    result.losses.push_back(loss);

    if (step % o.log_every == 0 || step == o.stop_at) {
      const StepMeter::Window w = meter.take_window();
      nlohmann::json rec = {{"step", step},
                            {"loss", loss},
                            {"lr", lr},
                            {meter.unit() + "_per_s", w.rate}};
      if (std::isfinite(norm)) rec["grad_norm"] = norm;
      replica.annotate(rec);
      metrics.write(rec);
      result.train_loss = w.loss;
      if (verbose) {
        progress.update(fmt::format(
            "{}step {}/{}  loss {:.4f}{}  {:.0f} {}/s  ETA {}{}", replica.line_prefix(), step,
            o.stop_at, w.loss, o.show_lr ? fmt::format("  lr {:.2e}", lr) : std::string(),
            w.rate, meter.unit(), format_duration(meter.eta(o.stop_at - step)),
            replica.line_suffix()));
      }
    }
    if (stop != 0) {  // every rank saw the same flag: all save (collective) and stop together
      if (!o.save.empty()) save(/*say=*/true);
      if (verbose) progress.finish();
      throw stop_requested(o.program, stop, step, o.stop_at, o.save, o.why_no_save);
    }
    // The final step's validation is the program's, after the loop.
    if (o.val_every > 0 && step % o.val_every == 0 && step < o.stop_at) {
      const double v = replica.evaluate(step);
      metrics.write({{"step", step}, {"val_loss", v}});
      result.val_losses.emplace_back(step, v);
      if (verbose) {
        progress.update(fmt::format("step {}/{}  val loss {:.4f}", step, o.stop_at, v),
                        /*force=*/true);
        progress.finish();
      }
    }
    if (!o.save.empty() && o.save_every > 0 && step % o.save_every == 0 && step < o.stop_at) {
      save(/*say=*/false);
    }
  }
  // Saved before the program's final evaluation: it does not change what resume needs, and
  // the checkpoint then holds exactly the state a longer run has at this step.
  if (!o.save.empty()) save(/*say=*/true);
  result.step = step;
  return result;
}

}  // namespace tessera::models
