// Data parallelism (DDP): every rank of a group holds a full replica of an ordinary
// nn::Module (its parameters are Replicate on the "dp" axis) and runs its slice of the
// global batch; gradients are averaged over the group in buckets, each launched with
// all_reduce_async from gradient hooks as soon as it fills, so communication overlaps the
// rest of backward.
//
//   manual_seed(0);                                       // identical replicas (checked)
//   auto model = mnist::make_mlp();
//   DistributedDataParallel ddp(*model, mesh.group("dp"));
//   optim::AdamW opt(model->parameters());
//   opt.zero_grad();
//   { auto guard = ddp.no_sync();  (loss(micro_0) / 2.0).backward(); }   // local only
//   (loss(micro_1) / 2.0).backward();                    // buckets launch during backward
//   ddp.finish();                                        // wait; grads now averaged
//   opt.step();
//
// Buckets hold parameters in reverse registration order (the order backward finishes their
// gradients), one dtype and device per bucket, about bucket_bytes each (a larger parameter
// gets a bucket of its own). Buckets are launched strictly in index order on every rank (a
// bucket that fills early waits for its predecessors), so collectives line up across ranks
// even when gradients arrive in a different order. Construct the DDP after Module::to().
// Gradients are views of the bucket buffers once their bucket launched (PyTorch's
// gradient_as_bucket_view): one copy of the gradients, tagged MemoryTag::gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "parallel/comm/communicator.h"
#include "parallel/comm_hook.h"

namespace tessera::parallel {

// Parameters a rank shares with only some ranks of the data-parallel group: expert
// parallelism's experts, each held by the ranks of its expert-data-parallel group (the ranks
// at the same place in their ep groups; parallel/expert_parallel.h). Their gradients are
// reduced, their replicas checked and (ZeRO) their shards cut over `group`, a subgroup of
// the data-parallel group, and each reduced gradient is multiplied by `scale` (the reduction
// averages over `group` where the caller means the whole group: group size / whole size;
// 1 for sums).
struct ParamSubgroup {
  Communicator* group = nullptr;                              // null: none
  std::function<bool(const std::string& name)> holds = nullptr;  // which parameters
  double scale = 1.0;
  bool has(const std::string& name) const { return group != nullptr && holds && holds(name); }
};

// `named` cut into the parameters reduced over the whole group and those of `sub`.
std::pair<nn::NamedTensors, nn::NamedTensors> split_subgroup(const nn::NamedTensors& named,
                                                              const ParamSubgroup& sub);

struct DdpOptions {
  int64_t bucket_bytes = int64_t{25} << 20;  // 25 MiB, PyTorch's default
  bool average = true;         // all_reduce avg (sum / group size); false: plain sum
  bool check_replicas = true;  // at construction: every rank's parameters equal rank 0's
  // Reduces each bucket instead of the all-reduce (parallel/comm_hook.h: PowerSGD, ...);
  // shared, so its state outlives a DDP rebuilt around it. Null: the all-reduce.
  std::shared_ptr<CommHook> comm_hook = nullptr;
  // Parameters reduced over a subgroup (expert parallelism); not with a comm hook.
  ParamSubgroup subgroup = {};
};

// Collective: every member throws the same Error unless all agree on the names, shapes and
// dtypes of `params` and on `options_hash` (`who` names the caller in the message).
void check_same_parameters(Communicator& comm, std::string_view who,
                           const nn::NamedTensors& params, uint64_t options_hash);

// Collective: every member throws the same Error unless every parameter is bitwise equal to
// rank 0's (naming the first that differs, the lowest differing rank and the difference).
void check_same_values(Communicator& comm, std::string_view who, const nn::NamedTensors& params);

class DistributedDataParallel {
 public:
  // Collective over `comm`: every member constructs it, with the same model structure and
  // options. Checks (always) that the members' parameter lists agree in names, shapes and
  // dtypes and (check_replicas) that their values are bitwise equal to rank 0's; on a
  // difference every member throws the same Error naming the first differing parameter.
  // Registers a post-accumulate-grad hook on every parameter (hooks cannot be removed: once
  // this object is destroyed they do nothing). `module` and `comm` must outlive it.
  DistributedDataParallel(nn::Module& module, Communicator& comm, DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  nn::Module& module() const;
  Communicator& comm() const;
  const DdpOptions& options() const;
  Tensor forward(const Tensor& x) const { return module().forward(x); }

  // After each backward that should synchronise (outside no_sync), before optimizer.step():
  // launches, in order, the buckets backward did not fill (a parameter without a gradient
  // on this rank contributes zeros, so every rank issues the same collectives), waits for
  // every bucket in order and writes the reduced values into each parameter's .grad()
  // (defined afterwards for every parameter, zeros where no rank had a gradient). Inside
  // no_sync() it does nothing.
  void finish();
  // loss.backward(), then finish().
  void backward(const Tensor& loss);

  // Gradient accumulation: backward passes while the guard lives only accumulate into
  // .grad(); the next backward outside it reduces the accumulated gradients once.
  class NoSync {
   public:
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    friend class DistributedDataParallel;
    explicit NoSync(DistributedDataParallel& ddp);
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync();

  // Collective: copies rank 0's parameter values into every member (in buckets).
  void broadcast_parameters();
  // Collective: the check the constructor runs (Error naming the first parameter, in
  // registration order, that differs from rank 0's anywhere, the lowest such rank and the
  // largest absolute difference).
  void check_replicas();

  struct BucketInfo {
    DType dtype = DType::f32;
    Device device = kCPU;
    int64_t elements = 0;
    std::vector<std::string> names;  // in bucket order (reverse registration order)
  };
  std::vector<BucketInfo> buckets() const;

  struct Stats {
    int64_t rounds = 0;                // finish() calls that reduced
    int64_t launched_in_backward = 0;  // bucket all_reduces launched from gradient hooks
    int64_t launched_in_finish = 0;    // ... launched by finish() (unfilled buckets)
  };
  const Stats& stats() const;
  // Buckets launched and not yet waited for (between backward and finish()).
  int pending() const;

  struct State;  // shared with the hooks (which hold it weakly)

 private:
  std::shared_ptr<State> state_;
};

}  // namespace tessera::parallel
