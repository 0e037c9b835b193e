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

}  // namespace tessera::gpt::testing3d
