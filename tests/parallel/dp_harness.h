// Shared by the data-parallel and ZeRO equivalence suites (threads and MPI): two small
// training tasks (the MNIST MLP and a GPT-mini on synthetic text), the record of a run and
// the comparison against the single-rank run.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "optim/adafactor.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/communicator.h"
#include "parallel/zero.h"
#include "tensor/tensor.h"

namespace tessera::parallel::testing_dp {

inline constexpr int kSteps = 20;

// A model and its data: make() builds the replica from a fixed seed; loss(model, step, part,
// parts) is the mean loss over slice `part` of `parts` equal slices of step's global batch
// (the model is called through operator(), so ZeRO-3's unit hooks see every forward).
struct Task {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
  std::function<Tensor(nn::Module&, DType, int64_t step, int part, int parts)> loss;
  double lr = 3e-3;
  // Elements whose exact gradient is zero (see the f32 tolerances); none by default.
  std::function<bool(const std::string& name, size_t index)> zero_gradient =
      [](const std::string&, size_t) { return false; };
  std::vector<std::string> units;  // ZeRO units (submodule paths, forward order)
  // Where the model and its batches live: the parameters are initialised on the CPU (the
  // same values everywhere), cast, then moved; loss() moves each batch there.
  Device device = kCPU;
  // The model's Mixture-of-Experts layers have this many experts (0: none): a ZeRO run sums
  // their routing counts over the world (nn::MoeCountReduction), gives their attached losses
  // each micro-batch's share (autograd::AuxLossScale) and, with ZeroRun::ep, splits the
  // experts over groups of ep ranks (parallel/expert_parallel.h); Run::aux records the losses.
  int64_t experts = 0;
};

Task mlp_task(Device device = kCPU);
Task gpt_task(Device device = kCPU);
// GPT-mini whose two blocks are dropless Mixture-of-Experts blocks: 8 experts, top-2,
// balancing loss 0.01 and z-loss 0.001.
Task gpt_moe_task(Device device = kCPU);

struct Run {
  std::vector<double> losses;                  // global loss per step
  std::vector<double> aux;                     // experts: the attached losses per step
  std::vector<std::vector<double>> params;     // rank 0's final parameters
  std::vector<std::string> names;
  // The f32 single-device AdamW run (train_reference): per parameter tensor, its own
  // rounding, ||f32 run - f64 run|| / ||f64 run|| (zero-gradient elements out), and the f64
  // run's final parameters; empty otherwise. check_close's f32 bound per tensor is
  // max(1e-5, 2 x rounding), and a tensor past 1e-5 must also be within that of `exact`.
  std::vector<double> rounding;
  std::vector<std::vector<double>> exact;
};

std::vector<std::vector<double>> values_of(const nn::Module& model);

struct Diff {
  double loss = 0;       // max over steps of |a - b| / max(1, |b|)
  double param_abs = 0;  // max |a - b| over every element
  double param_rel = 0;  // max over tensors of max |a - b| / max |b|
  // ||a - b|| / ||b|| (zero-gradient elements out) of the tensor nearest its f32 bound, and
  // that bound: 1e-5, or 2 x want.rounding where that is larger.
  double param_norm = 0;
  double param_norm_bound = 1e-5;
  std::string worst_tensor;  // the tensor of param_norm
  double zero_grad_abs = 0;  // max |a - b| over the zero-gradient elements
  // Over the tensors past 1e-5 of want (so on want.rounding's bound): ||a - f64 run|| /
  // ||f64 run|| of the one nearest its bound, max(1e-5, 2 x want.rounding), and its name.
  double exact_norm = 0;
  double exact_bound = 1e-5;
  std::string exact_tensor;
  bool finite = true;  // every loss and parameter of a is finite
};

Diff compare(const Task& task, const Run& got, const Run& want);

// Per parameter tensor (`names`), ||got - want|| / ||want|| over the elements whose gradient
// is not exactly zero (task.zero_gradient).
std::vector<double> tensor_norm_rel(const Task& task, const std::vector<std::string>& names,
                                    const std::vector<std::vector<double>>& got,
                                    const std::vector<std::vector<double>>& want);

// Tolerances (doctest CHECKs, with a MESSAGE naming `label` and every figure). f64: every
// element within 1e-10 of the single-rank run (summation order and the clipping norm's order
// differ, ~1e-16 each; measured ~1e-13 after 20 steps). f32: the loss curve within 1e-5
// relative and every parameter tensor within 1e-5 in norm (||a - b|| / ||b||), or within
// twice the single-device f32 run's own distance r from the f64 run where that is larger
// (Run::rounding): a run summing in another order is an equally valid rounding, so two runs
// each that far from exact arithmetic can be up to twice it apart. That premise is checked
// too: a tensor past 1e-5 of the f32 run must be within max(1e-5, 2 r) of the f64 run (the
// distributed run at most twice as far from exact as one device). (Measured on a Zen 3 AVX2
// build: the MoE GPT-mini's first-block expert tensors carry 0.8-1.2e-5 of rounding after 20
// steps, every other tensor of the three tasks less than 5e-6; train_reference checks that
// none passes 3e-5.) Every loss and parameter must be finite. Element-wise
// f32 is not a fair test of AdamW: its normalised step m / sqrt(v) turns a gradient that is
// pure rounding noise (the attention key bias, exactly zero in exact arithmetic) into a full
// lr-sized step whose sign depends on the summation order; those elements are reported and
// bounded by 2 * steps * lr. Returns whether the runs are bitwise equal.
bool check_close(const Task& task, DType dtype, const Run& got, const Run& reference,
                 const std::string& label);

// The experts' attached losses per step against the reference's: f64 within 1e-13 (the same
// sums in another order), f32 within 1e-6 (doctest CHECKs).
void check_aux(const Run& got, const Run& reference, DType dtype);

// The ZeRO suites' optimisation: AdamW (weight decay 0.1 on matrices, optim::decay_groups)
// with the global gradient norm clipped to kClip.
inline constexpr double kWeightDecay = 0.1;
inline constexpr double kClip = 1.0;

// task.make() cast to `dtype` and moved to task.device.
std::shared_ptr<nn::Module> make_model(const Task& task, DType dtype);

// The optimizer of a run: AdamW, or 8-bit AdamW (optim/adamw8bit.h; ZeRO then shards at its
// 256-element blocks, ZeroOptions::block_shards), with the same lr and weight decay.
enum class Opt { adamw, adamw8bit };
std::unique_ptr<optim::Optimizer> make_optimizer(Opt opt, std::vector<optim::ParamGroup> groups,
                                                 double lr);

// The single-device run: one rank, one micro-batch, no wrapper.
Run train_reference(const Task& task, DType dtype, Opt opt = Opt::adamw);
// This rank's part of a ZeRO run over `world` (every member calls it): kSteps steps of the
// global batch split into world.size() x accum equal slices. The losses are global (averaged
// over the ranks); the parameters are the full ones (ZeroDataParallel::model_state_dict).
struct Checkpoint {
  nn::StateDict model;
  std::map<std::string, Tensor> optimizer;  // the single-device layout
};
struct ZeroRun {
  int stage = 0;
  int accum = 1;
  int64_t start = 0, stop = kSteps;  // steps [start, stop)
  const Checkpoint* load = nullptr;  // restored before step `start`
  Checkpoint* save = nullptr;        // filled after step `stop` - 1 (on every rank)
  Opt opt = Opt::adamw;
  CommLog* step_log = nullptr;       // records the collectives of every zero.step()
  int ep = 1;                        // expert parallelism over groups of ep consecutive ranks
  CommLog* forward_log = nullptr;    // records the collectives of every micro-batch's forward
                                     // and backward
  int64_t* local_params = nullptr;   // with ep: this rank's parameter elements once it keeps
                                     // only its experts
  OffloadOptions offload = {};       // ZeroOptions::offload
  // With offload: this rank's offload_report() after construction (front) and after each
  // step, to count the swap file's bytes per step.
  std::vector<ZeroOffloadReport>* reports = nullptr;
  // With offload: complete_step() after each step (before its report), so the step's own
  // swap traffic is counted in it (stage 3 defers each update to the next gather).
  bool complete_step = false;
  // Called before each step's micro-batches (after the previous step): a schedule setting
  // the learning rate, an evaluation between steps.
  std::function<void(int64_t step, optim::Optimizer& optimizer, nn::Module& model)> before_step =
      nullptr;
};
Run train_zero(Communicator& world, const Task& task, DType dtype, const ZeroRun& spec);

// Adafactor (optim/adafactor.h) on ZeRO's row shards (ZeroOptions::row_shards), in f64:
// lr 1e-2, weight decay 0.1 on matrices, a first moment but in torch mode, every matrix
// factored (optax's min_dim_size_to_factor 1), kAdafactorSteps steps.
inline constexpr int kAdafactorSteps = 6;
optim::AdafactorOptions adafactor_options(optim::AdafactorMode mode);
// The single-device run's final parameters.
std::vector<std::vector<double>> adafactor_reference(const Task& task, optim::AdafactorMode mode);
// This rank's part of the ZeRO `stage` run over `world`: the largest difference of the final
// parameters from `want` over the elements whose gradient is not exactly zero
// (task.zero_gradient), and the row-shard all-reduces this rank made.
struct RowShardResult {
  double worst = 0;
  int64_t reduces = 0, params = 0;
};
RowShardResult adafactor_row_shards(Communicator& world, const Task& task, optim::AdafactorMode mode,
                                    int stage, const std::vector<std::vector<double>>& want,
                                    const Checkpoint* load = nullptr, Checkpoint* save = nullptr,
                                    int64_t start = 0, int64_t stop = kAdafactorSteps);

}  // namespace tessera::parallel::testing_dp
