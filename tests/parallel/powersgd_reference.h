// The PowerSGD test fixture shared by powersgd_test (threads) and powersgd_mpi_main
// (mpirun): a module with every kind of parameter the hook sorts, fixed gradients per rank
// and round, fixed initial Qs, an independent f64 PowerSGD on plain arrays, and one rank's
// DDP run with the hook.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "parallel/comm/communicator.h"
#include "parallel/powersgd.h"

namespace tessera::parallel::testing_powersgd {

// Matrices it compresses at rank 1 ([16, 12]; a [6, 4, 5] kernel as [6, 20]), one too small
// to gain ([4, 3]: 12 <= 2 (4 + 3)), a vector; f64.
struct Params : nn::Module {
  Params();
  static std::vector<std::pair<std::string, Shape>> shapes();
  Tensor forward(const Tensor& x) override { return x; }
};

// Rank `rank`'s gradient of parameter k (registration order) at round t: fixed values.
std::vector<double> grad_values(int rank, int t, size_t k, int64_t n);
// The initial Q of a compressed matrix: fixed values from its index and shape.
Tensor q0_of(int bucket, int tensor, const Shape& shape);

using Mat = std::vector<double>;  // row-major

struct RefParam {
  std::string name;
  Shape shape;
  int64_t n = 0, cols = 0, r = 0;
  bool compressed = false;
  Mat q;                   // the same on every rank (warm start)
  std::vector<Mat> error;  // per rank
};
// The parameters of Params for `ranks` ranks at approximation rank `rank`.
std::vector<RefParam> ref_params(int ranks, int64_t rank);
// Where DDP put each parameter: (bucket, index in the bucket).
using Places = std::map<std::string, std::pair<int, int>>;
// `rounds` rounds of PowerSGD (min_compression_rate 2, error feedback, warm start, Q0 from
// q0_of by the matrix's place) on `ranks` ranks' grad_values; returns result[t][k] (the
// same on every rank), leaving each parameter's error and Q.
std::vector<std::vector<Mat>> reference(std::vector<RefParam>& params, int ranks, int rounds,
                                        int64_t start_iter, const Places& places);

struct RankRun {
  std::vector<std::vector<std::vector<double>>> grads;  // [round][param] after finish()
  std::map<std::string, Tensor> state;                   // the hook's, at the end
  std::vector<std::string> bucket_names;                  // bucket 0's, in order
  Places places;
  std::vector<int64_t> round_bytes;                       // gradient bytes per round
  std::vector<CommHook::Traffic> traffic;
};
// This rank's DDP with PowerSGD over `comm` (buckets of `bucket_bytes`): `rounds`
// synchronising rounds from `first` on; `load`: the hook's state to resume from.
RankRun run_rank(Communicator& comm, int first, int rounds, const PowerSgdOptions& options,
                 const std::map<std::string, Tensor>* load = nullptr,
                 int64_t bucket_bytes = int64_t{25} << 20, bool average = true);
// The largest difference of every rank's gradients from the reference, relative to each
// tensor's largest reference value.
double worst_relative(const std::vector<std::vector<std::vector<double>>>& got,
                      const std::vector<std::vector<Mat>>& want);

}  // namespace tessera::parallel::testing_powersgd
