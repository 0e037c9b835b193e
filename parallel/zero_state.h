// ZeroDataParallel's state (private to parallel/zero*.cc): parameters, flat segments, units,
// and the operations the hooks, the step and the checkpoint conversion share.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/comm_log.h"
#include "parallel/data_parallel.h"
#include "parallel/zero.h"
#include "tensor/allocator.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace zero_internal {

inline constexpr const char* kName = "ZeroDataParallel";

inline bool same_view(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.storage() == b.storage() && a.offset() == b.offset() &&
         a.shape() == b.shape();
}

}  // namespace zero_internal

using zero_internal::kName;
using zero_internal::same_view;

// Offload (zero_offload.cc; the check and set-up in zero_offload_setup.cc): checked, then
// set up a segment at a time at construction; a unit's gather takes the shard of segment s
// onto the device (params offloaded: from the host copy) and drops it after;
// read_ahead starts the swap-file reads of the units gathered after u; take_grad moves
// segment s's reduced gradient to the host copy's .grad; step runs the optimizer on the
// host copies; set_shard writes new shard values (checkpoint loads); page_all brings every
// segment's parameters and optimizer state into host memory (in) or back to the file.
void offload_check(ZeroDataParallel::State& st);  // options and budget, before any buffer
void offload_adopt(ZeroDataParallel::State& st, int s);  // segment s's host copy, once built
void offload_finish_setup(ZeroDataParallel::State& st);  // the swap file's first writes done
void offload_shard_in(ZeroDataParallel::State& st, int s);
void offload_shard_out(ZeroDataParallel::State& st, int s);
void offload_read_ahead(ZeroDataParallel::State& st, int u, bool forward);
void offload_take_grad(ZeroDataParallel::State& st, int s);
void offload_settle_grads(ZeroDataParallel::State& st);  // every gradient copy to the host done
void offload_step(ZeroDataParallel::State& st, optim::Optimizer& optimizer);
void offload_complete(ZeroDataParallel::State& st);  // every deferred update now
void offload_set_shard(ZeroDataParallel::State& st, int s, const Tensor& values);
void offload_page_all(ZeroDataParallel::State& st, const optim::Optimizer* optimizer, bool in);

struct ZeroDataParallel::State {
  struct Param {
    std::string name;
    Tensor tensor;
    int unit = 0;        // index into units (the root is the last)
    int segment = 0;
    int64_t offset = 0;  // in the segment's flat buffer, in elements
    bool decay = false;
    bool ready = false;    // its gradient arrived in the current synchronising backward
    bool adopted = false;  // its gradient is in the segment's flat buffer since zero_grad
  };
  struct Segment {
    int unit = 0;
    bool decay = false;
    DType dtype = DType::f32;
    Device device = kCPU;
    std::vector<int> params = {};  // indices into State::params, in buffer order
    int64_t numel = 0;
    Communicator* comm = nullptr;      // the group it is reduced and sharded over
    double scale = 1.0;                // times its reduced gradient (ParamSubgroup::scale)
    std::vector<int64_t> counts = {};  // per rank of comm (array_split)
    int64_t shard_start = 0;
    int64_t shard_numel = 0;
    Tensor flat_param = {};  // stages 1-2: the parameters' storage; stage 3: gathered/released
    Tensor shard = {};       // the optimizer's parameter: this rank's block
    Tensor flat_grad = {};   // the full local gradients (stage 1: kept; 2-3: per round)
    Tensor reduced = {};     // reduce_scatter output in flight
    Tensor host = {};        // offload: the optimizer's parameter, on the host tier
    WorkHandle work = {};
    int waiting = 0;         // params whose gradient has not arrived this round
  };
  enum class Gather : uint8_t { released, gathering, gathered };
  struct Unit {
    std::string path;  // "" for the root
    nn::Module* module = nullptr;
    std::vector<int> segments = {};
    std::vector<int> params = {};
    int64_t bytes = 0;
    Gather gather = Gather::gathered;
    std::vector<WorkHandle> works = {};
    int grads_waiting = 0;  // stage 3: its params' gradients still to come in this backward
  };

  nn::Module* module = nullptr;
  Communicator* comm = nullptr;
  ZeroOptions options;
  std::unique_ptr<DistributedDataParallel> ddp;  // stage 0
  std::vector<Param> params;                     // registration order
  std::vector<Segment> segments;                 // launch order
  std::vector<Unit> units;                       // the wrapped units in forward order, then root
  int next_launch = 0;
  bool sync = true;
  int64_t numel = 0;

  struct Offload;  // zero_offload_state.h
  std::shared_ptr<Offload> offload;  // ZeroOptions::offload in use

  int root() const { return static_cast<int>(units.size()) - 1; }
  // The tensor the optimizer steps for a segment, whose .grad holds its reduced gradient.
  const Tensor& owner(const Segment& seg) const { return offload ? seg.host : seg.shard; }
  int stage() const { return options.stage; }

  // Parameter p's place in a flat buffer of its segment (values, gradients or state).
  static Tensor param_view(const Tensor& flat, const Param& p) {
    return flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.shape());
  }
  Tensor shard_slice(const Segment& seg, const Tensor& flat) const {
    return flat.narrow(0, seg.shard_start, seg.shard_numel);
  }

  // ---- stage 3: gathering units ---------------------------------------------------------
  void gather_async(int u) {
    Unit& unit = units[u];
    if (unit.gather != Gather::released) return;
    CommCause cause(fmt::format("zero gather {}", unit.path.empty() ? "root" : unit.path),
                    CommKind::parameters);
    MemoryTagScope tag(MemoryTag::gathered);
    if (offload) {  // every shard onto the device first: nothing is launched if one fails
      try {
        for (int s : unit.segments) offload_shard_in(*this, s);
      } catch (...) {
        for (int s : unit.segments) offload_shard_out(*this, s);
        throw;
      }
    }
    for (int s : unit.segments) {
      Segment& seg = segments[s];
      seg.flat_param.storage()->reallocate();
      unit.works.push_back(seg.comm->all_gather_async(seg.flat_param, seg.shard, seg.counts));
    }
    unit.gather = Gather::gathering;
  }
  void ensure_gathered(int u) {
    Unit& unit = units[u];
    if (unit.gather == Gather::released) gather_async(u);
    if (unit.gather == Gather::gathering) {
      for (WorkHandle& w : unit.works) w->wait();
      unit.works.clear();
      unit.gather = Gather::gathered;
      if (offload) {
        for (int s : unit.segments) offload_shard_out(*this, s);
      }
    }
  }
  void release(int u) {
    Unit& unit = units[u];
    if (unit.gather == Gather::released) return;
    for (WorkHandle& w : unit.works) w->wait();  // never free a buffer a gather writes
    unit.works.clear();
    for (int s : unit.segments) {
      segments[s].flat_param.storage()->release();
      if (offload) offload_shard_out(*this, s);
    }
    unit.gather = Gather::released;
  }
  void release_all() {
    for (int u = 0; u < static_cast<int>(units.size()); ++u) release(u);
  }

  void pre_forward(int u) {
    if (offload) offload_read_ahead(*this, u, /*forward=*/true);
    ensure_gathered(u);
    units[u].grads_waiting = static_cast<int>(units[u].params.size());
    // The next unit in forward order (after the root: the first unit).
    const int next = u == root() ? 0 : u + 1;
    if (options.prefetch && next < root()) gather_async(next);
  }
  void post_forward(int u) {
    if (u != root()) {
      release(u);  // reshard after forward; the backward gathers again
    } else if (!GradMode::enabled()) {
      release(u);  // evaluation: the root is not needed until the next forward
    }
  }
  void pre_backward(int u) {
    if (offload) offload_read_ahead(*this, u, /*forward=*/false);
    ensure_gathered(u);
    if (options.prefetch && u > 0) gather_async(u - 1);
  }

  // ---- gradients ------------------------------------------------------------------------
  void adopt(Param& p) {
    Segment& seg = segments[p.segment];
    if (!seg.flat_grad.defined()) {
      MemoryTagScope tag(MemoryTag::gradients);
      seg.flat_grad = Tensor::empty({seg.numel}, seg.dtype, seg.device);
    }
    const Tensor view = param_view(seg.flat_grad, p);
    const Tensor grad = p.tensor.grad();
    if (!same_view(grad, view)) {
      view.copy_(grad);
      p.tensor.set_grad(view);
    }
    p.adopted = true;
  }

  void on_gradient(int i) {
    Param& p = params[i];
    NoGradGuard no_grad;
    adopt(p);
    if (stage() == 3 && p.unit != root() && --units[p.unit].grads_waiting == 0) {
      release(p.unit);  // its backward is over: every parameter has its gradient
    }
    if (!sync) return;
    TS_CHECK(!p.ready,
             "{}: parameter '{}' received a second gradient before finish(); call finish() "
             "after every synchronising backward, and run the backward passes of gradient "
             "accumulation inside no_sync()",
             kName, p.name);
    p.ready = true;
    if (--segments[p.segment].waiting == 0) launch_filled();
  }

  void launch(int s) {
    Segment& seg = segments[s];
    NoGradGuard no_grad;
    if (!seg.flat_grad.defined()) {
      MemoryTagScope tag(MemoryTag::gradients);
      seg.flat_grad = Tensor::empty({seg.numel}, seg.dtype, seg.device);
    }
    for (int i : seg.params) {  // no gradient since zero_grad: contributes zeros
      Param& p = params[i];
      if (!p.adopted) {
        param_view(seg.flat_grad, p).copy_(zeros({}, seg.dtype, seg.device));
        p.adopted = true;
      }
    }
    if (options.comm_hook) {
      // The hook reduces the whole segment in place (PowerSGD: approximately); finalize()
      // takes this rank's block of it.
      GradBucket bucket;
      bucket.index = s;
      bucket.buffer = seg.flat_grad;
      bucket.average = options.average;
      for (int i : seg.params) {
        bucket.gradients.push_back(param_view(seg.flat_grad, params[i]));
        bucket.names.push_back(params[i].name);
      }
      CommCause cause(fmt::format("zero {} segment {}", options.comm_hook->name(), s),
                      CommKind::gradients);
      seg.work = options.comm_hook->reduce(*seg.comm, bucket);
      TS_CHECK(seg.work != nullptr, "{}: comm hook '{}' returned no work for segment {}", kName,
               options.comm_hook->name(), s);
    } else {
      {
        MemoryTagScope tag(MemoryTag::gradients);
        seg.reduced = Tensor::empty({seg.shard_numel}, seg.dtype, seg.device);
      }
      CommCause cause(fmt::format("zero reduce_scatter segment {}", s), CommKind::gradients);
      seg.work = seg.comm->reduce_scatter_async(seg.reduced, seg.flat_grad,
                                            options.average ? ReduceOp::avg : ReduceOp::sum,
                                            seg.counts);
    }
    if (stage() >= 2) {
      // The full gradients go with the reduction: the buffer lives until it completes. The
      // previous segment's reduction has had this segment's backward to finish: take its
      // block now, so at most two full segments are alive at once, not the whole model.
      for (int i : seg.params) params[i].tensor.set_grad(Tensor());
      if (s > 0) finalize(s - 1);
    }
  }
  // Waits for segment s's reduction and leaves this rank's block in the shard's gradient.
  void finalize(int s) {
    Segment& seg = segments[s];
    if (!seg.work) return;
    NoGradGuard no_grad;
    seg.work->wait();
    seg.work.reset();
    if (options.comm_hook) {  // the whole segment was reduced: this rank's block of it
      MemoryTagScope tag(MemoryTag::gradients);
      seg.reduced = shard_slice(seg, seg.flat_grad).clone();
    }
    if (seg.scale != 1.0) seg.reduced.copy_(seg.reduced * seg.scale);
    if (offload) {  // to the host tier: the device keeps no gradient shard
      offload_take_grad(*this, s);
      for (int i : seg.params) params[i].tensor.set_grad(Tensor());
      seg.reduced = Tensor();
      if (stage() >= 2) seg.flat_grad = Tensor();
      return;
    }
    const Tensor grad = seg.shard.grad();
    if (stage() == 1) {
      // The reduced block lives in this rank's block of the full gradient buffer, which the
      // next backward overwrites: accumulate inside no_sync() instead.
      TS_CHECK(!grad.defined(),
               "{}: stage 1: a second synchronising backward without zero_grad() in between "
               "(the reduced gradients live in the full gradient buffer; accumulate inside "
               "no_sync())",
               kName);
      const Tensor slice = shard_slice(seg, seg.flat_grad);
      slice.copy_(seg.reduced);
      seg.shard.set_grad(slice);
      for (int i : seg.params) params[i].tensor.set_grad(Tensor());
    } else if (grad.defined()) {
      grad.copy_(grad + seg.reduced);
    } else {
      seg.shard.set_grad(seg.reduced);
    }
    seg.reduced = Tensor();
    if (stage() >= 2) seg.flat_grad = Tensor();  // freed: each rank keeps its block
  }

  void launch_filled() {
    while (next_launch < static_cast<int>(segments.size()) && segments[next_launch].waiting == 0) {
      launch(next_launch++);
    }
  }

  void reset_round() {
    for (Param& p : params) p.ready = false;
    for (Segment& seg : segments) {
      seg.waiting = static_cast<int>(seg.params.size());
      seg.work.reset();
      seg.reduced = Tensor();
    }
    next_launch = 0;
  }

  void wait_all() {
    for (Segment& seg : segments) wait_ignoring_errors(seg.work);
    for (Unit& unit : units) {
      for (WorkHandle& w : unit.works) wait_ignoring_errors(w);
    }
  }

  // Indices of `items` with the decaying ones first, each part in index order: the order of
  // optim::decay_groups (and of param_groups()).
  template <typename T>
  static std::vector<int> decay_first(const std::vector<T>& items) {
    std::vector<int> order;
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < static_cast<int>(items.size()); ++i) {
        if (items[i].decay == (pass == 0)) order.push_back(i);
      }
    }
    return order;
  }
  // The single-device optimizer's parameter k is params[canonical_order()[k]].
  std::vector<int> canonical_order() const { return decay_first(params); }
  // Row or block shards: one parameter per segment, each shard whole rows (blocks) of it.
  bool per_param_shards() const { return options.row_shards || options.block_shards > 0; }
  // The unit a shard holds whole runs of: a row of the segment's (one) parameter (row
  // shards), a block (block shards; the parameter's last may be short); 1 otherwise.
  int64_t row_length(const Segment& seg) const {
    if (options.block_shards > 0) return options.block_shards;
    const Shape shape = row_layout(params[seg.params.front()]).shape;
    return options.row_shards && shape.size() == 2 ? shape[1] : 1;
  }
  // How an optimizer on row shards sees parameter p (ZeroOptions::row_layout; global filled).
  ZeroOptions::RowLayout row_layout(const Param& p) const {
    ZeroOptions::RowLayout l;
    if (options.row_layout) l = options.row_layout(p.name, p.tensor.shape());
    else l.shape = p.tensor.shape();
    if (l.global.empty()) l.global = l.shape;
    return l;
  }
  // Rows (blocks) in `count` elements of a segment starting at a row boundary.
  int64_t rows_in(const Segment& seg, int64_t count) const {
    const int64_t row = row_length(seg);
    return (count + row - 1) / row;
  }

  // The sharded optimizer's parameter j is the shard of segments[optimizer_order()[j]].
  std::vector<int> optimizer_order() const { return decay_first(segments); }

  nn::NamedTensors named() const {
    nn::NamedTensors out;
    for (const Param& p : params) out.emplace_back(p.name, p.tensor);
    return out;
  }
};

// Tells a row-sharding optimizer where each shard sits (zero.cc).
void attach_row_shards(ZeroDataParallel::State& st, optim::Optimizer& optimizer);

// Stages 1-3 hand the optimizer flat 1-D shards that cut across parameters: only an
// elementwise optimizer (optim::Optimizer::elementwise) computes the same update on them.
// With row_shards, an optimizer that supports them (optim::Optimizer::supports_row_shards)
// gets whole rows of one parameter per shard instead.
inline void check_elementwise(const optim::Optimizer& optimizer, int stage, const char* call,
                              const ZeroOptions& options) {
  const int64_t block = optimizer.shard_block();
  if (stage == 0 || optimizer.elementwise() ||
      (options.row_shards && optimizer.supports_row_shards()) ||
      (block > 0 && options.block_shards > 0 && options.block_shards % block == 0)) {
    return;
  }
  fail("ZeroDataParallel::{}: ZeRO stage {} runs the optimizer on {}, but {} is not elementwise "
       "(its update depends on {}); use stage 0, an elementwise optimizer such as AdamW or SGD{}",
       call, stage,
       options.block_shards > 0 ? fmt::format("shards of {}-element blocks", options.block_shards)
       : options.row_shards     ? std::string("row shards")
                                : std::string("flat 1-D shards of the parameters"),
       optimizer.kind(), block > 0 ? fmt::format("blocks of {} elements", block) : "whole tensors",
       optimizer.supports_row_shards()
           ? ", or ZeroOptions::row_shards"
           : (block > 0 ? fmt::format(", or ZeroOptions::block_shards = {}", block) : ""));
}

}  // namespace tessera::parallel
