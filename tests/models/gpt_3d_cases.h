// Shared by the 3-D suites (threads: gpt_3d_test; mpirun: gpt_3d_mpi_main): GPT-mini in
// f64, its single-device run, one rank's part of a {pp, dp, tp} run, and the check of every
// factorisation of the world's ranks against the single-device run.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "models/gpt/parallel3d.h"
#include "parallel/comm/communicator.h"
#include "tensor/dtype.h"

namespace tessera::gpt::testing3d {

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> params;
};

// 10 AdamW steps (clipped) of GPT-mini (6 blocks, 8 heads, width 32) on one device.
Run reference(DType dtype = DType::f64);
// This rank's part of the same training under `o` (every member of `world` calls it).
Run train_3d(parallel::CommPtr world, const Gpt3dOptions& o, DType dtype = DType::f64);
// Every pp x dp x tp factorisation of world->size() (powers of two), each schedule where
// pp > 1 and ZeRO 0 and 1 (with sequence parallelism on the ZeRO 1 runs where tp > 1;
// recomputation on half the runs), against `ref` (loss and parameters within 1e-10);
// collective.
// Returns the configurations run; skipped ones are reported with the reason.
int check_factorisations(parallel::CommPtr world, const Run& ref);
// In f32, every factorisation with 1F1B and ZeRO 1 against the f32 single-device run: the
// loss curve within 1e-5 relative, all parameters together within 1e-5 in norm, each tensor
// within 1e-4 in norm (AdamW amplifies rounding noise on small, near-zero-gradient tensors)
// and the attention key bias, whose exact gradient is zero, bounded by 2 steps x lr;
// collective.
int check_factorisations_f32(parallel::CommPtr world, const Run& ref);

// ---- The composition matrix: every technique on every layout ------------------------------
// One configuration: a layout of the world's ranks, a precision and the techniques on it.
struct Combo {
  int pp = 1, dp = 1, tp = 1;
  // f64 / f32: the model's dtype; bf16 / f16: autocast on an f32 model (f16 with dynamic
  // loss scaling, the overflow check reduced over the world).
  DType precision = DType::f64;
  int zero = 0;
  bool sp = false;                  // sequence parallelism (tp > 1)
  std::string schedule = "1f1b";    // gpipe | 1f1b | interleaved (2 chunks per rank)
  int accum = 1;                    // pipeline runs per step
  std::string recompute = "none";   // none | full (each pipeline chunk) | selective
  double dropout = 0.0;
  std::string str() const;          // "pp2 dp2 tp1 bf16 zero3 1f1b accum2 selective dropout0.1"
};
// Every combination on `ranks` ranks: each pp x dp x tp factorisation x {f64, f32, bf16, f16}
// x ZeRO 0-3 (where dp > 1) x sp on/off (where tp > 1) x each schedule (where pp > 1) x
// accum 1/2 x recompute none/full/selective x dropout 0/0.1. Axes that mean nothing on a
// layout (a schedule with one stage) take one value; combinations the model cannot take
// (more stages than pipeline layers) are left out, each with its reason in `skipped`.
std::vector<Combo> composition_matrix(int ranks, std::vector<std::string>* skipped = nullptr);
// The fixed subset CI runs: four per layout and precision, between them every value of every
// axis (ZeRO 0-3, sp, the three schedules, accum, the three recompute modes, dropout).
std::vector<Combo> composition_subset(int ranks);
// Trains each combination for a few steps and checks it against the single-device run in the
// same precision with the same dropout (collective; every member of `world`, the same list):
// f64 losses and parameters within 1e-10; f32 losses within 1e-5 relative; bf16 and f16
// losses within one unit roundoff (2^-9, 2^-11) relative and the same skipped steps. Returns
// the number run.
int check_compositions(parallel::CommPtr world, const std::vector<Combo>& combos);
// Checkpoints across layouts in f64 with dropout: a layout trains half the steps and saves
// (the single-device dicts, or a sharded checkpoint in `dir`), another layout (or one
// device) loads it with the generator's state and trains the rest; its losses and final
// parameters equal the single-device run's (1e-10). Collective; returns the pairs checked.
int check_resume_across_layouts(parallel::CommPtr world, const std::string& dir);

}  // namespace tessera::gpt::testing3d
