// Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
// Cost", 2018): the second moment of every parameter with >= 2 dims kept as running averages
// of its rows and columns (m + n numbers for an m x n matrix, instead of m n), update
// clipping by the update's RMS, and a step size that may follow the parameter's scale.
// Written with ops, so it runs on any device; an f32/f64 matrix on the CPU, factored over
// its last two dims, takes three fused passes instead (tensor/ops.h: adafactor_stats_,
// adafactor_norm_, adafactor_apply_; AdafactorOptions::fused), 5x faster on large tensors.
//
//   Adafactor opt(model.parameters(), {.mode = AdafactorMode::hf});   // relative step size
//   loss.backward();
//   opt.step();
//
// The references differ in details, so each is a mode, matching it (the tests hold each to an
// f64 reference of its published code, 1e-12):
//   hf     Hugging Face transformers / fairseq: factors the last two dims; u = g^2 + eps1;
//          rows R and columns C are means of u, decayed by beta2_t = 1 - t^-decay_rate;
//          V = (R / mean(R)) C; update = g / sqrt(V), divided by max(1, RMS(update) / d);
//          step size relative_step ? min(1e-2, 1/sqrt(t)) : lr, times max(eps2, RMS(param))
//          when scale_parameter; first moment (beta1 > 0) on the scaled update; decoupled
//          weight decay p -= weight_decay x step size x p.
//   torch  torch.optim.Adafactor (PyTorch 2.5): factors the last two dims; row and column
//          means of g^2 (no eps1 inside), V = R C / max(mean(R), eps1), update =
//          g / sqrt(max(V, eps1^2)); step size min(lr, 1/sqrt(t)) x max(eps2, RMS(param));
//          weight decay p *= 1 - lr x weight_decay before the update; no first moment.
//   optax  optax.adafactor: factors the two largest dims, and only when the second largest
//          is >= min_dim_size_to_factor (128); u = g^2 + eps1; the update clipped as in hf,
//          times lr, times max(eps2, RMS(param)) when scale_parameter; first moment (beta1 >
//          0, no debiasing); weight decay adds weight_decay x p to the step (not scaled by lr).
// A parameter of the f64 model keeps f64 state; any other keeps f32 state and is updated in
// f32, then rounded to its dtype. Not elementwise: ZeRO's flat shards refuse it, its row
// shards (ZeroOptions::row_shards) run it for 1-D and 2-D parameters (and tensor-parallel
// blocks of them, RowShard::cols_sum), in every mode.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace tessera::optim {

enum class AdafactorMode { hf, torch, optax };
const char* adafactor_mode_name(AdafactorMode mode);
AdafactorMode parse_adafactor_mode(const std::string& name);  // Error naming the choices

struct AdafactorOptions {
  AdafactorMode mode = AdafactorMode::hf;
  double lr = 0.0;               // hf with relative_step: unused; torch: the maximum step (1e-2)
  bool relative_step = true;     // hf: min(1e-2, 1/sqrt(t)) instead of lr
  bool scale_parameter = true;   // hf, optax: the step times max(eps2, RMS(param)) (torch: always)
  double eps1 = 1e-30;           // regularises g^2 (torch: clamps the estimate at eps1^2)
  double eps2 = 1e-3;            // the smallest parameter scale
  double clip_threshold = 1.0;   // d: the update's RMS is at most d
  double decay_rate = 0.8;       // beta2_t = 1 - t^-decay_rate
  double beta1 = 0.0;            // first moment (hf, optax); 0: none
  double weight_decay = 0.0;
  int64_t min_dim_size_to_factor = 128;  // optax
  // The three fused passes (tensor/ops.h: adafactor_stats_, _norm_, _apply_) for f32/f64
  // matrices factored over their last two dims, on the CPU and CUDA; false: ops everywhere
  // (the same update up to the order of its sums).
  bool fused = true;
};

class Adafactor : public Optimizer {
 public:
  explicit Adafactor(std::vector<Tensor> params, AdafactorOptions options = {});
  explicit Adafactor(std::vector<ParamGroup> groups, AdafactorOptions options = {});

  void step() override;
  bool elementwise() const override { return false; }
  // On ZeRO's row shards (optim::RowShard) each rank keeps its rows' statistics and the whole
  // columns' (one all-reduce of [columns + 2] values per factored parameter and step: the
  // columns' sums, the parameter's squares and the rows' statistics' sum), and one more for
  // the update's RMS. A shard of some of the columns too (tensor parallel, RowShard::cols_sum)
  // keeps its columns' statistics, and sums its rows' over the other columns' holders first
  // (one more all-reduce of [rows + 1] values, and one for the update's RMS).
  bool supports_row_shards() const override { return true; }
  // The statistic over the columns (one value per row) is per row, the one over the rows
  // whole: "exp_avg_sq_row" and "exp_avg_sq_col" respectively, except where optax factors a
  // taller-than-wide matrix columns first (its "row" statistic is then over the rows).
  RowShardState row_shard_state(const std::string& name, const Shape& global, int64_t run,
                                int64_t run_first) const override;
  const AdafactorOptions& options() const { return options_; }
  // The dims a parameter of `shape` is factored over (rows, columns), or {-1, -1} when its
  // second moment is kept whole.
  std::pair<int64_t, int64_t> factored_dims(const Shape& shape) const;

 protected:
  std::vector<StateSpec> state_specs(const Tensor& param) const override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  static AdafactorOptions checked(AdafactorOptions options);
  void update(const ParamGroup& group, const Pending& item);
  void update_rows(const ParamGroup& group, const Pending& item, const RowShard& shard);
  // The fused passes (tensor/ops.h: adafactor_stats_, _norm_, _apply_) for a parameter they
  // take, factored over its last two dims.
  bool fusable(const Tensor& param) const;
  void update_fused(const ParamGroup& group, const Pending& item, double alpha, double beta2t);
  // The weight decay coefficient and final form adafactor_apply_ takes for this mode.
  std::pair<double, double> final_form(double alpha, double lr, double wd) const;
  void check_row_shard(const RowShard& shard, const Tensor& param) const;
  // The step size and the final update, shared by whole tensors and row shards. rms_param
  // is read only when uses_param_rms() (torch, or scale_parameter).
  bool uses_param_rms() const;
  double step_size(double lr, double t, double rms_param) const;
  Tensor next_param(const Tensor& w, Tensor update, double alpha, double denom, double lr,
                    double wd, std::map<std::string, Tensor>& state) const;

  AdafactorOptions options_;
};

}  // namespace tessera::optim
