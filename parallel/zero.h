// ZeRO (Rajbhandari et al.) and FSDP on the data-parallel axis: the same training step as
// DistributedDataParallel, with the optimizer state (stage 1), the gradients (stage 2) and
// the parameters (stage 3) partitioned over the group instead of replicated.
//
//   ZeroDataParallel zero(*model, mesh.group("dp"), {.stage = 3, .units = {"h.0", "h.1"}});
//   optim::AdamW opt(zero.param_groups(lr, weight_decay), adamw_options);
//   zero.zero_grad();
//   Tensor loss = loss_fn((*model)(x_slice));     // operator(): stage 3 gathers per unit
//   zero.backward(loss);                           // gradients reduced, each rank its slice
//   zero.clip_grad_norm(1.0);                      // the global norm over the slices
//   zero.step(opt);                                // update the slices; stages 1-2 all-gather
//
// Layout. The parameters are grouped into segments: one per (unit, dtype, device, weight
// decay), and stages 0-2 further cut a segment at bucket_bytes. Each segment is one flat
// buffer the parameters are views of (Tensor::set_data), split over the N ranks with
// array_split counts; rank r owns block r, and the optimizer (any optim::Optimizer, built on
// param_groups()) sees only those blocks ("shards"), so its state is partitioned for free.
//   stage 0  DistributedDataParallel (gradients all-reduced in buckets); the optimizer sees
//            the module's parameters.
//   stage 1  full gradients kept; reduce-scattered after backward into this rank's block of
//            the full gradient buffer; after the update the parameters are all-gathered.
//   stage 2  as 1, but each segment's gradients are reduce-scattered as soon as backward has
//            produced them all and the full buffer is freed: each rank keeps 1/N of them.
//   stage 3  as 2, and only the shards of the parameters persist: each wrapped unit's flat
//            buffer is all-gathered just before its forward and again before its backward
//            (the next unit's gather is launched ahead), and freed after each. Parameters
//            outside every unit (the root: embeddings, final norm) are gathered when the
//            module's forward starts and kept until finish(), as FSDP keeps its root.
// Every collective goes through the dp Communicator (its comm log records them with causes
// "zero ..."); launches are strictly in segment order, so ranks issue them alike.
//
// Memory is tagged (tensor/allocator.h): parameters, gradients, optimizer_state (allocated
// during step()) and gathered (stage 3's unit buffers); memory_report() reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "optim/optimizer.h"
#include "parallel/comm/communicator.h"
#include "parallel/data_parallel.h"
#include "parallel/offload.h"

namespace tessera::parallel {

struct ZeroOptions {
  int stage = 1;  // 0 (plain data parallel), 1, 2 or 3
  // Submodule paths ("h.0") wrapped as units, in forward order: stage 3 gathers and frees
  // each as a whole; for every stage a unit's parameters form their own segments. A
  // parameter in no unit belongs to the root.
  std::vector<std::string> units = {};
  int64_t bucket_bytes = int64_t{25} << 20;  // stages 0-2: the largest segment
  bool prefetch = true;        // stage 3: launch the next unit's all-gather ahead
  bool check_replicas = true;  // at construction: parameters bitwise equal to rank 0's
  // Gradients are reduced as the mean over ranks; false: their sum, for a loss that is
  // already each rank's share of the global batch's mean (backward then sees one device's
  // per-sample gradient magnitudes, which f16 loss scaling is sized for).
  bool average = true;
  // A comm hook (PowerSGD, ...) in place of the gradient reduction. Stage 0: DDP's
  // (DdpOptions::comm_hook), for each bucket's all-reduce. Stages 1-3: it reduces each whole
  // segment in place of the reduce-scatter, and each rank keeps its block; a hook that is no
  // full reduction (CommHook::full_reduction: 1-bit Adam's) is refused. Its buckets are the
  // segments (bucket i: segment i), so its state (PowerSGD's error feedback per bucket)
  // resumes only under the same stage and layout. Memory: the hook reduces whole segments,
  // so stages 2-3 hold a full segment's gradients until it is reduced, and PowerSGD adds
  // its error feedback and an input copy of every segment (model-sized in all): with it,
  // ZeRO saves the optimizer state and the parameters, not the gradients.
  std::shared_ptr<CommHook> comm_hook = nullptr;
  // Stages 1-3: shard every parameter on its own, by whole rows (a 2-D parameter's rows, a
  // 1-D one's elements), and tell the optimizer where each shard sits (optim::RowShard), so
  // that an optimizer with per-matrix statistics (Adafactor: each rank its rows' statistics,
  // the columns' after one all-reduce) computes the whole-tensor update; its checkpoints
  // gather per Optimizer::row_shard_state. Parameters of more than 2 dims are an error
  // (unless row_layout presents them as 2-D).
  bool row_shards = false;
  // With row_shards or block_shards: how the optimizer sees parameter `name` (of shape
  // `shape`), when the module holds it otherwise than as a whole 1-D or 2-D tensor (also at
  // stage 0, where the optimizer steps the parameters themselves; null: every parameter as
  // itself). Block shards use `global` and `run` only.
  struct RowLayout {
    // The same elements in the same order (2-D: the same last dim), cut by rows over dp: a
    // wrapper holding a [3C, C] weight as [3, C, C] presents [3C, C].
    Shape shape;
    // The whole parameter that tensor is a block of whole rows and (with cols_sum) some of
    // the columns of, as a tensor-parallel shard is (empty: `shape`), and the sums over the
    // ranks holding its other blocks: its other rows beyond dp (rows_sum), its other columns
    // (cols_sum); null where there are none. optim::RowShard says how they are used.
    Shape global = {};
    std::function<void(const Tensor&)> rows_sum = nullptr;
    std::function<void(const Tensor&)> cols_sum = nullptr;
    // Block shards (ZeroOptions::block_shards) of a tensor-parallel shard: optim::RowShard's
    // run, run_stride and run_first (run 0: the tensor is a contiguous part of the whole), and
    // the max over the ranks holding the whole's other runs (RowShard::max beyond dp).
    int64_t run = 0, run_stride = 0, run_first = 0;
    std::function<void(const Tensor&)> runs_max = nullptr;
  };
  std::function<RowLayout(const std::string& name, const Shape& shape)> row_layout = nullptr;
  // Stages 1-3: shard every parameter on its own, each rank a run of whole blocks of this
  // many consecutive elements of the flattened parameter (its last block may be short), and
  // tell the optimizer where each shard sits (optim::RowShard::block). An optimizer with
  // per-block state (AdamW8bit: 256, its quantization block) then keeps every block, and
  // its scale, on one rank: the single-device update. Checkpoints gather per-block state by
  // blocks (Optimizer::row_shard_state rows). 0: off. Not with row_shards.
  int64_t block_shards = 0;
  // Which parameters weight decay applies to (param_groups' group 0); default
  // optim::decay_groups' rule, dim() >= 2. A wrapper of reshaped shards (tensor parallel)
  // passes the rule on the original shapes.
  std::function<bool(const std::string& name, const Tensor& param)> decay = nullptr;
  // Parameters this rank shares with a subgroup of the data-parallel group only (expert
  // parallelism's experts, parallel/expert_parallel.h: ExpertGroups): their segments are
  // reduced and sharded over subgroup.group (each rank a block of its subgroup's), their
  // stage-3 gathers and checkpoints too. Not with a comm hook, row_shards or block_shards.
  ParamSubgroup subgroup = {};
  // Offload (parallel/offload.h; stages 1-3, an elementwise optimizer such as AdamW or SGD;
  // not with row or block shards, a comm hook or a subgroup). optimizer = host|file: the
  // optimizer is built on host copies of this rank's shards (param_groups() returns them),
  // each reduced gradient shard is copied to the host as backward completes its segment
  // (the device's is freed), and step() runs the update on the CPU, a segment at a time on
  // the file tier (the next segment's parameters and state read while this one updates),
  // then copies the updated shards back to the device. params (stage 3) = host|file: the
  // device keeps no shard; a unit's gather reads its shards from the optimizer's copies.
  // The same update on the same values: bitwise the in-memory run's losses and parameters.
  // At construction, a device budget (Allocator::set_limit) too small for the largest unit
  // with its gradients beside the root is an Error, before anything trains.
  OffloadOptions offload = {};
};

// Where an offloading ZeroDataParallel's bytes are (this rank), and its traffic so far.
struct ZeroOffloadReport {
  OffloadTier optimizer = OffloadTier::none, params = OffloadTier::none;
  bool direct_io = false;        // the swap file uses O_DIRECT
  std::string file;              // the swap file's path ("" without the file tier)
  int64_t host_bytes = 0;        // resident on the host tier now: parameters, state, gradients
  int64_t file_bytes = 0;        // the swap file's records
  int64_t read_bytes = 0, written_bytes = 0;      // swap file I/O since construction
  double io_seconds = 0;         // time the swap file had a request in flight (SwapFile::busy_seconds)
  // The most bytes the window (OffloadOptions::window) held at once: pages read ahead for a
  // step and updated pages whose writes were in flight.
  int64_t window_peak_bytes = 0;
  int64_t largest_segment_page_bytes = 0;  // the most one segment's pages held (its state and copy)
  // Seconds the caller's thread spent in the step's update (reads it waited for, the CPU
  // update, the copies back) and in gathers waiting for the swap file (stage 3, params on
  // it): what of the I/O did not overlap compute.
  double update_seconds = 0, gather_wait_seconds = 0;
  int64_t to_host_bytes = 0, to_device_bytes = 0;  // device <-> host copies since construction
  // The swap file's I/O in one optimizer step and in the forward and backward passes of a
  // step's `accum` micro-batches, by the layout: a step reads and writes every segment's
  // parameters and state once (the first step only writes state); stage 3 with params on
  // the file reads each unit's shards once per gather (twice a micro-batch, the root once),
  // except after a step the first forward's gathers of the segments whose pages the step
  // handed over (handoff_bytes; a forward without a step before it, such as an evaluation,
  // takes them instead).
  int64_t step_io_formula(int64_t state_bytes_per_element) const;
  int64_t gather_read_formula(int accum, bool after_step) const;
  int64_t shard_elements = 0;      // this rank's shard elements over every segment
  int64_t shard_bytes = 0;         // their bytes in the parameters' dtype
  int64_t gathered_shard_bytes = 0;  // stage 3: the shard bytes a micro-batch's gathers read
  int64_t handoff_bytes = 0;  // stage 3, params on the file: the pages a step hands to the next gathers
  std::string str() const;
};

// The formula's and the measured bytes per rank (see memory_report()).
struct ZeroMemory {
  int stage = 0;
  int ranks = 1;
  int64_t numel = 0;  // Ψ: parameter elements (each tensor once)
  // Of those, the subgroup's (ZeroOptions::subgroup; experts): sharded over its sub_ranks.
  int64_t sub_numel = 0;
  int sub_ranks = 1;
  int64_t parameters = 0, gradients = 0, optimizer_state = 0;  // tagged bytes, now
  int64_t gradients_peak = 0;  // tagged "gradients" high-water mark (during backward)
  int64_t gathered_peak = 0;   // tagged "gathered" high-water mark (stage 3)
  int64_t largest_unit = 0;    // bytes of the largest gathered unit (stage 3)
  int64_t root_unit = 0;       // bytes of the root unit (stage 3: kept gathered in a step)
  // Optimizer-state bytes per parameter element in the formula: AdamW's 8 by default; the
  // caller sets its optimizer's (8-bit AdamW ~2.03, Adafactor ~4(m+n)/(mn); see
  // models::optimizer_state_formula).
  double state_per_param = 8.0;
  // The ZeRO paper's figure in f32 (bytes), K = state_per_param: DDP (8 + K)Ψ, stage 1
  // 8Ψ + KΨ/N, stage 2 4Ψ + (4 + K)Ψ/N, stage 3 (8 + K)Ψ/N (for AdamW, K = 8: 16Ψ, ...),
  // the subgroup's parameters with their own N; measured = parameters + gradients +
  // optimizer state.
  double formula() const;
  int64_t measured() const { return parameters + gradients + optimizer_state; }
  std::string str() const;  // one line: each tag, the sum, the formula and their ratio
};

class ZeroDataParallel {
 public:
  // Collective over `comm` (every member, same module structure and options). Checks that
  // the members agree on the parameters and (check_replicas) that their values are equal;
  // moves the parameters into flat buffers (stage 3 keeps only this rank's shards); hooks
  // every parameter's gradient and, for stage 3, the forward of each unit and of `module`.
  // `module` and `comm` must outlive it; construct it after Module::to() and before the
  // optimizer.
  ZeroDataParallel(nn::Module& module, Communicator& comm, ZeroOptions options = {});
  ~ZeroDataParallel();
  ZeroDataParallel(const ZeroDataParallel&) = delete;
  ZeroDataParallel& operator=(const ZeroDataParallel&) = delete;

  nn::Module& module() const;
  Communicator& comm() const;
  const ZeroOptions& options() const;
  int stage() const;

  // The optimizer's groups: group 0 decays (weight_decay), group 1 does not, by the rule of
  // optim::decay_groups. Stage 0: the module's parameters; stages 1-3: this rank's shards.
  std::vector<optim::ParamGroup> param_groups(double lr, double weight_decay) const;

  // Drops every gradient (the parameters' and the shards').
  void zero_grad();
  // loss.backward(), then finish().
  void backward(const Tensor& loss);
  // After each backward: launches the segments backward did not complete (a parameter
  // without a gradient contributes zeros), waits for every reduction and leaves the reduced
  // gradients: stage 0 in each parameter's .grad(), stages 1-3 in each shard's .grad()
  // (added to what an earlier finish() left there; stage 1 requires zero_grad() between).
  // Stage 3 frees every gathered buffer. Inside no_sync() it only frees.
  void finish();

  // Gradient accumulation: backward passes while the guard lives keep full local gradients
  // (all stages); the next backward outside it reduces them once.
  class NoSync {
   public:
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    friend class ZeroDataParallel;
    explicit NoSync(ZeroDataParallel& zero);
    ZeroDataParallel& zero_;
    bool previous_;
    std::unique_ptr<DistributedDataParallel::NoSync> ddp_guard_;  // stage 0
  };
  [[nodiscard]] NoSync no_sync();

  // Collective: scales the reduced gradients so their global L2 norm is at most max_norm
  // (optim::clip_grad_norm's rule and formula); returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // For wrappers that clip over more ranks than the dp group (pipeline, tensor parallel):
  // the squared L2 norm of the reduced gradients this rank holds after finish() (stage 0:
  // each parameter's .grad, stages 1-3: its shards), each element's square times
  // weight(parameter name) (0 leaves out a copy another rank counts; at stage 0 a subgroup's
  // parameters are copies over their subgroup only). Not reduced over any group: the caller
  // sums it where it needs to.
  double local_grad_norm_squared(const std::function<double(const std::string&)>& weight) const;
  // Multiplies the reduced gradients this rank holds by `coef` (stage 0: .grad; 1-3: shards).
  void scale_grads(double coef);

  // optimizer.step() (its new state tagged optimizer_state); stages 1-2 then all-gather the
  // updated parameters. Stage 3 with the optimizer offloaded to the file tier defers each
  // segment's update to its unit's next gather (the next forward, an evaluation, a
  // checkpoint), at the learning rates and with the gradients this call saw, so the swap
  // file's traffic overlaps compute: the values are those of an update now, but the
  // optimizer (and its state) must outlive that gather or complete_step(), and the step
  // drops the gradients it takes instead of leaving them.
  void step(optim::Optimizer& optimizer);
  // Runs every update step() deferred (checkpoints and gathers do this themselves).
  void complete_step();

  // Checkpoints in the single-device layout, so a run resumes under any (dp, stage).
  // Collective. The full parameters (stage 3 gathers them), copies.
  nn::StateDict model_state_dict();
  void load_model_state_dict(const nn::StateDict& dict);
  // The dict an optimizer of the same kind built on optim::decay_groups(named_parameters())
  // of the single-device module would hold (stages 1-3 all-gather the shards' state).
  optim::Optimizer::StateDict optimizer_state_dict(const optim::Optimizer& optimizer);
  void load_optimizer_state_dict(optim::Optimizer& optimizer,
                                 const optim::Optimizer::StateDict& dict);
  // Collective, after finish(): every parameter's reduced gradient in full, by name (stages
  // 1-3 all-gather the shards' gradients; zeros where none arrived). For checking a layout
  // against one device (the equivalence checker), not for training.
  nn::StateDict gradient_dict();

  // Tagged bytes from the calling thread's MemoryScope tracker (or process_memory() when
  // none is open), with the formula for this stage.
  ZeroMemory memory_report() const;
  // The offload tiers' bytes and traffic (all zeros without ZeroOptions::offload).
  ZeroOffloadReport offload_report() const;

  struct State;  // shared with the hooks (which hold it weakly)

 private:
  std::shared_ptr<State> state_;
};

}  // namespace tessera::parallel
