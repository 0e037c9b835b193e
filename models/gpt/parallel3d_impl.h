// Gpt3d's internals, shared by parallel3d.cc (the layout and the step) and
// parallel3d_checkpoint.cc (state dicts and sharded checkpoints). Not part of the API.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "models/gpt/parallel3d.h"
#include "models/gpt/pipeline.h"
#include "models/gpt/tensor_parallel.h"
#include "optim/loss_scaler.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/executor.h"
#include "parallel/zero.h"

namespace tessera::gpt {

// A module holding this rank's local shards as parameters (for ZeRO over dp). Its forward
// does nothing: calling it opens a step for ZeRO 3 (whose hooks gather the shards).
class ShardHolder : public nn::Module {
 public:
  ShardHolder() : nn::Module("GptShards") {}
  Tensor add(const std::string& name, const Tensor& t) { return register_parameter(name, t); }
  Tensor forward(const Tensor& x) override { return x; }
};

// A parameter path as the holder names it ("h.0.attn" -> "h_0_attn").
inline std::string flat_name(std::string name) {
  for (char& c : name) {
    if (c == '.') c = '_';
  }
  return name;
}

struct Gpt3d::Impl {
  Gpt& model;
  Gpt3dOptions o;
  parallel::CommPtr world;
  parallel::MeshPtr mesh;     // {pp, dp, tp}
  parallel::MeshPtr tp_mesh;  // {tp}: this rank's tensor-parallel group
  parallel::pipeline::Schedule schedule;
  GptPipeline pipe;
  std::unique_ptr<TpGpt> tp;
  std::shared_ptr<ShardHolder> holder;
  // (Before zero: its ep and expert-data-parallel groups outlive the wrapper reducing over them.)
  std::unique_ptr<MoeStep> moe;
  std::unique_ptr<parallel::ZeroDataParallel> zero;
  std::unique_ptr<optim::Optimizer> opt;
  parallel::CommPtr tied;  // first + last stage ranks with our (dp, tp), when they differ
  // With a comm hook that leaves each dp rank its own gradient (1-bit Adam after its
  // warm-up): the pp x tp ranks of our dp rank, over which the gradient norm is summed.
  parallel::CommPtr replica;
  std::set<std::string> mine;  // parameter paths this rank's stages hold
  std::map<std::string, int> owner;  // parameter path -> the pp rank of its first stage
  std::map<std::string, Shape> whole;  // parameter path -> the single-device shape
  std::vector<std::string> model_order;   // the single-device optimizer's order (paths)
  std::vector<std::string> holder_order;  // this rank's optimizer's order (paths)
  int64_t run = 0;  // the pipeline run (accumulation step) in progress
  // The last step's shape and, with capture, each layer's outputs (by first batch row) and
  // the reduced gradients (by holder name).
  int64_t B = 0, T = 0;
  std::map<int, std::map<int64_t, Tensor>> outputs;
  nn::StateDict grads;
  optim::DynamicLossScaler scaler{{.enabled = false}};

  Impl(Gpt& m, parallel::CommPtr w, Gpt3dOptions options) : model(m), o(std::move(options)), world(std::move(w)) {}

  parallel::Communicator& pp() const { return mesh->group("pp"); }
  parallel::Communicator& dp() const { return mesh->group("dp"); }
};

// How this rank's tp shard of parameter `name` lies in the single device's (flattened):
// optim::RowShard's run, run_stride and run_first (all 0 when it is whole on tp, or not held
// here).
struct TpRuns {
  int64_t run = 0, stride = 0, first = 0;
};
TpRuns tp_runs(const Gpt3d::Impl& s, const std::string& name);

// A tensor of this rank's shard of parameter `name` (its layout: the tp shard's) in full,
// on the ranks of the parameter's first stage; zeros of `shape` elsewhere; then broadcast
// over pp from that stage. Collective over the world.
Tensor gather_full(Gpt3d::Impl& s, const std::string& name, const Tensor& local, const Shape& shape,
                   DType dtype);

}  // namespace tessera::gpt
