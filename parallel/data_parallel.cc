#include "parallel/data_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {

constexpr const char* kName = "DistributedDataParallel";

// FNV-1a, to compare the members' parameter lists with one small broadcast.
void hash_bytes(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
}

Tensor i64_tensor(std::vector<int64_t> values) {
  const auto n = static_cast<int64_t>(values.size());
  return Tensor::from_vector<int64_t>(values, {n});
}

}  // namespace

void check_same_parameters(Communicator& comm, std::string_view who, const nn::NamedTensors& params,
                           uint64_t options_hash) {
  uint64_t h = 14695981039346656037ull;
  int64_t total = 0;
  for (const auto& [name, param] : params) {
    hash_bytes(h, name.data(), name.size() + 1);
    for (int64_t d : param.shape()) hash_bytes(h, &d, sizeof d);
    const auto dt = static_cast<int>(param.dtype());
    hash_bytes(h, &dt, sizeof dt);
    total += param.numel();
  }
  hash_bytes(h, &options_hash, sizeof options_hash);
  const std::vector<int64_t> mine{static_cast<int64_t>(params.size()), total,
                                  static_cast<int64_t>(h)};
  Tensor root = i64_tensor(mine);
  CommCause cause(fmt::format("{} check structure", who), CommKind::control);
  comm.broadcast(root, 0);
  Tensor differs = i64_tensor({root.to_vector<int64_t>() != mine ? 1 : 0});
  comm.all_reduce(differs, ReduceOp::max);
  const std::vector<int64_t> r0 = root.to_vector<int64_t>();
  TS_CHECK(differs.item<int64_t>() == 0,
           "{}: the members of group '{}' disagree on the parameter list (names, shapes, "
           "dtypes) or the options: rank 0 has {} parameters of {} elements, rank {} has {} "
           "of {}{}",
           who, comm.name(), r0[0], r0[1], comm.rank(), mine[0], mine[1],
           r0 == mine ? " (same here; another rank differs)" : "");
}

void check_same_values(Communicator& comm, std::string_view who, const nn::NamedTensors& params) {
  CommCause cause(fmt::format("{} check replicas", who), CommKind::control);
  NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(params.size());
  int64_t first = n;  // the first differing parameter (list order) on this rank
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& param = params[i].second;
    Tensor root = param.contiguous().clone();
    comm.broadcast(root, 0);  // rank 0's values
    if (comm.rank() != 0 && first == n) {
      const Tensor mine = param.to(kCPU).contiguous(), theirs = root.to(kCPU);
      if (std::memcmp(mine.raw_data(), theirs.raw_data(), static_cast<size_t>(mine.nbytes())) != 0) {
        first = i;
      }
    }
  }
  Tensor global_first = i64_tensor({first});
  comm.all_reduce(global_first, ReduceOp::min);
  const int64_t bad = global_first.item<int64_t>();
  if (bad == n) return;

  // Every member agrees a parameter differs: find the lowest differing rank and the size of
  // the difference, so every member throws the same message.
  const auto& [name, param] = params[bad];
  Tensor rank = i64_tensor({first == bad ? comm.rank() : comm.size()});
  comm.all_reduce(rank, ReduceOp::min);
  Tensor root = param.contiguous().clone();
  comm.broadcast(root, 0);
  const double diff =
      comm.rank() == 0
          ? 0.0
          : max(abs(param.cast(DType::f64) - root.cast(DType::f64))).item<double>();
  Tensor max_diff = Tensor::from_vector<double>({diff}, {1});
  comm.all_reduce(max_diff, ReduceOp::max);
  fail("{}: replicas differ: parameter '{}' {} on rank {} is not bitwise equal to rank 0's "
       "(largest |difference| over the group {:g}); seed the initialisation identically on "
       "every rank or call broadcast_parameters()",
       who, name, shape_str(param.shape()), rank.item<int64_t>(), max_diff.item<double>());
}

std::pair<nn::NamedTensors, nn::NamedTensors> split_subgroup(const nn::NamedTensors& named,
                                                              const ParamSubgroup& sub) {
  std::pair<nn::NamedTensors, nn::NamedTensors> out;
  for (const auto& [name, t] : named) (sub.has(name) ? out.second : out.first).emplace_back(name, t);
  return out;
}

struct DistributedDataParallel::State {
  struct Slot {
    std::string name;
    Tensor param;
    int bucket = 0;
    int64_t offset = 0;  // in the bucket's buffer, in elements
    bool ready = false;  // its gradient arrived in the current synchronising backward
  };
  struct Bucket {
    DType dtype = DType::f32;
    Device device = kCPU;
    std::vector<int> slots = {};  // indices into State::slots, in bucket order
    int64_t elements = 0;
    Communicator* comm = nullptr;  // the group it is reduced over (the subgroup's or the whole)
    double scale = 1.0;            // times the reduced values (ParamSubgroup::scale)
    Tensor buffer = {};           // flat, contiguous: the slots' values back to back
    int waiting = 0;              // slots whose gradient has not arrived yet this round
    WorkHandle work = {};         // set while launched and not yet waited for
  };

  nn::Module* module = nullptr;
  Communicator* comm = nullptr;
  DdpOptions options;
  std::vector<Slot> slots;  // registration order
  std::vector<Bucket> buckets;
  int next_launch = 0;      // buckets launch strictly in index order
  bool sync = true;         // false inside no_sync()
  Stats stats;

  // Copies each slot's gradient (or, for parameters, its value) into the bucket's buffer.
  void pack(Bucket& bucket, bool values) {
    NoGradGuard no_grad;
    for (int s : bucket.slots) {
      const Slot& slot = slots[s];
      const Tensor dst = bucket.buffer.narrow(0, slot.offset, slot.param.numel())
                             .view(slot.param.shape());
      const Tensor src = values ? slot.param : slot.param.grad();
      if (src.defined() && src.storage() == dst.storage() && src.offset() == dst.offset()) {
        continue;  // the gradient already is this view (set by the previous round)
      }
      if (!src.defined()) {
        dst.copy_(zeros({}, bucket.dtype, bucket.device));
        continue;
      }
      TS_CHECK(src.dtype() == bucket.dtype && src.device() == bucket.device &&
                   src.shape() == slot.param.shape(),
               "{}: {} of parameter '{}' is {} {} on {}, but its bucket holds {} on {} "
               "(construct the DDP after Module::to())",
               kName, values ? "the value" : "the gradient", slot.name, src.dtype(),
               shape_str(src.shape()), src.device(), bucket.dtype, bucket.device);
      dst.copy_(src);
    }
  }

  void launch(int k, bool from_hook) {
    Bucket& bucket = buckets[k];
    pack(bucket, /*values=*/false);
    // Gradients become views of the bucket (PyTorch's gradient_as_bucket_view): the reduced
    // values land in .grad() directly, and the separate gradient tensors are freed, so
    // gradients cost one copy of the parameters, not two.
    for (int s : bucket.slots) slot_grad_to_view(bucket, s);
    CommCause cause(fmt::format("ddp bucket {}", k), CommKind::gradients);
    if (options.comm_hook) {
      GradBucket gb{k, bucket.buffer, {}, {}, options.average};
      for (int s : bucket.slots) {
        gb.gradients.push_back(view_of(bucket, s));
        gb.names.push_back(slots[s].name);
      }
      bucket.work = options.comm_hook->reduce(*bucket.comm, gb);
      TS_CHECK(bucket.work != nullptr, "{}: comm hook '{}' returned no work for bucket {}",
               kName, options.comm_hook->name(), k);
    } else {
      bucket.work = bucket.comm->all_reduce_async(bucket.buffer,
                                                  options.average ? ReduceOp::avg : ReduceOp::sum);
    }
    ++(from_hook ? stats.launched_in_backward : stats.launched_in_finish);
  }

  Tensor view_of(const Bucket& bucket, int s) const {
    const Slot& slot = slots[s];
    return bucket.buffer.narrow(0, slot.offset, slot.param.numel()).view(slot.param.shape());
  }
  void slot_grad_to_view(const Bucket& bucket, int s) {
    const Tensor view = view_of(bucket, s);
    const Tensor grad = slots[s].param.grad();
    if (!(grad.defined() && grad.storage() == view.storage() && grad.offset() == view.offset())) {
      slots[s].param.set_grad(view);
    }
  }

  // Launches every filled bucket whose predecessors are all launched.
  void launch_filled() {
    while (next_launch < static_cast<int>(buckets.size()) && buckets[next_launch].waiting == 0) {
      launch(next_launch++, /*from_hook=*/true);
    }
  }

  void on_gradient(int s) {
    if (!sync) return;  // accumulating under no_sync: .grad() keeps the sum, nothing to send
    Slot& slot = slots[s];
    TS_CHECK(!slot.ready,
             "{}: parameter '{}' received a second gradient before finish(); call finish() "
             "after every synchronising backward, and run the backward passes of gradient "
             "accumulation inside no_sync()",
             kName, slot.name);
    slot.ready = true;
    if (--buckets[slot.bucket].waiting == 0) launch_filled();
  }

  // Marks the round over: every bucket waits for all its gradients again.
  void reset_round() {
    for (Slot& slot : slots) slot.ready = false;
    for (Bucket& bucket : buckets) {
      bucket.waiting = static_cast<int>(bucket.slots.size());
      bucket.work.reset();
    }
    next_launch = 0;
  }

  int pending() const {
    int n = 0;
    for (const Bucket& bucket : buckets) n += bucket.work != nullptr;
    return n;
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& module, Communicator& comm,
                                                 DdpOptions options)
    : state_(std::make_shared<State>()) {
  TS_CHECK(options.bucket_bytes > 0, "{}: bucket_bytes must be positive, got {}", kName,
           options.bucket_bytes);
  TS_CHECK(options.subgroup.group == nullptr || !options.comm_hook,
           "{}: comm hook '{}' with parameters reduced over subgroup '{}': a hook reduces over "
           "the whole group only", kName, options.comm_hook ? options.comm_hook->name() : "",
           options.subgroup.group != nullptr ? options.subgroup.group->name() : "");
  State& st = *state_;
  st.module = &module;
  st.comm = &comm;
  st.options = options;

  // Parameters once each (a tied weight registered twice is one tensor, one gradient).
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (auto& entry : module.named_parameters()) {
    const std::string& name = entry.first;
    Tensor& param = entry.second;
    if (!param.requires_grad()) continue;
    const bool seen = std::any_of(st.slots.begin(), st.slots.end(),
                                  [&](const State::Slot& s) { return s.param.is_same(param); });
    if (!seen) st.slots.push_back({name, param});
  }

  // Buckets in reverse registration order, one open bucket per (dtype, device, subgroup): a
  // parameter that would overflow its open bucket closes it and opens the next.
  std::map<std::tuple<int, std::string, bool>, int> open;
  for (int s = static_cast<int>(st.slots.size()) - 1; s >= 0; --s) {
    State::Slot& slot = st.slots[s];
    const DType dtype = slot.param.dtype();
    const Device device = slot.param.device();
    const bool sub = options.subgroup.has(slot.name);
    const auto key = std::make_tuple(static_cast<int>(dtype), device.str(), sub);
    auto it = open.find(key);
    const int64_t bytes = slot.param.nbytes();
    if (it == open.end() ||
        (st.buckets[it->second].elements > 0 &&
         (st.buckets[it->second].elements * dtype_size(dtype) + bytes > options.bucket_bytes))) {
      st.buckets.push_back({dtype, device});
      st.buckets.back().comm = sub ? options.subgroup.group : &comm;
      st.buckets.back().scale = sub ? options.subgroup.scale : 1.0;
      it = open.insert_or_assign(key, static_cast<int>(st.buckets.size()) - 1).first;
    }
    State::Bucket& bucket = st.buckets[it->second];
    slot.bucket = it->second;
    slot.offset = bucket.elements;
    bucket.slots.push_back(s);
    bucket.elements += slot.param.numel();
  }
  {
    MemoryTagScope tag(MemoryTag::gradients);
    for (State::Bucket& bucket : st.buckets) {
      bucket.buffer = Tensor::empty({bucket.elements}, bucket.dtype, bucket.device);
    }
  }
  st.reset_round();

  // The members must agree on the parameter list before any bucket collective: a rank
  // whose buckets differ would otherwise pair its all_reduces with the wrong peers' buffers.
  nn::NamedTensors named;
  for (const State::Slot& slot : st.slots) named.emplace_back(slot.name, slot.param);
  uint64_t options_hash = static_cast<uint64_t>(options.bucket_bytes) * 2 + (options.average ? 1 : 0);
  if (options.comm_hook) {  // every member must reduce its buckets the same way
    hash_bytes(options_hash, options.comm_hook->name().data(), options.comm_hook->name().size());
  }
  const auto [whole, sub] = split_subgroup(named, options.subgroup);
  check_same_parameters(comm, kName, whole, options_hash);
  if (options.subgroup.group != nullptr) {
    check_same_parameters(*options.subgroup.group, kName, sub, options_hash);
  }
  if (options.check_replicas) check_replicas();

  // The hooks hold the state weakly: once this object is gone they do nothing.
  std::weak_ptr<State> weak = state_;
  for (int s = 0; s < static_cast<int>(st.slots.size()); ++s) {
    st.slots[s].param.register_post_accumulate_grad_hook([weak, s](const Tensor&) {
      if (std::shared_ptr<State> state = weak.lock()) state->on_gradient(s);
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // Collectives in flight read our buffers: let them finish before the buffers go.
  for (State::Bucket& bucket : state_->buckets) wait_ignoring_errors(bucket.work);
}

nn::Module& DistributedDataParallel::module() const { return *state_->module; }
Communicator& DistributedDataParallel::comm() const { return *state_->comm; }
const DdpOptions& DistributedDataParallel::options() const { return state_->options; }
const DistributedDataParallel::Stats& DistributedDataParallel::stats() const {
  return state_->stats;
}
int DistributedDataParallel::pending() const { return state_->pending(); }

void DistributedDataParallel::finish() {
  State& st = *state_;
  if (!st.sync) return;
  struct ResetOnExit {
    State& st;
    ~ResetOnExit() {
      // Never leave a collective reading a buffer we reuse.
      for (State::Bucket& bucket : st.buckets) wait_ignoring_errors(bucket.work);
      st.reset_round();
    }
  } reset{st};
  // Unfilled buckets (parameters without a gradient in this backward) join in order.
  while (st.next_launch < static_cast<int>(st.buckets.size())) {
    st.launch(st.next_launch++, /*from_hook=*/false);
  }
  for (State::Bucket& bucket : st.buckets) {
    bucket.work->wait();
    bucket.work.reset();
    if (bucket.scale != 1.0) {
      NoGradGuard no_grad;
      bucket.buffer.copy_(bucket.buffer * bucket.scale);
    }
    // The reduced values are in .grad() already (views of the bucket); a hook or user code
    // that replaced a .grad() between launch and here gets the view back.
    for (int s : bucket.slots) st.slot_grad_to_view(bucket, s);
  }
  if (st.options.comm_hook) st.options.comm_hook->end_round();
  ++st.stats.rounds;
}

void DistributedDataParallel::backward(const Tensor& loss) {
  loss.backward();
  finish();
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.state_->sync) {
  TS_CHECK(ddp.state_->pending() == 0,
           "{}: no_sync() entered with {} bucket(s) still in flight; call finish() after the "
           "previous backward first",
           kName, ddp.state_->pending());
  ddp.state_->sync = false;
}

DistributedDataParallel::NoSync::~NoSync() { ddp_.state_->sync = previous_; }

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() { return NoSync(*this); }

void DistributedDataParallel::broadcast_parameters() {
  State& st = *state_;
  TS_CHECK(st.pending() == 0, "{}: broadcast_parameters() with buckets in flight", kName);
  CommCause cause("ddp broadcast parameters", CommKind::parameters);
  NoGradGuard no_grad;
  for (State::Bucket& bucket : st.buckets) {
    st.pack(bucket, /*values=*/true);
    bucket.comm->broadcast(bucket.buffer, 0);
    if (bucket.comm->rank() == 0) continue;
    for (int s : bucket.slots) {
      const State::Slot& slot = st.slots[s];
      slot.param.copy_(
          bucket.buffer.narrow(0, slot.offset, slot.param.numel()).view(slot.param.shape()));
    }
  }
}

void DistributedDataParallel::check_replicas() {
  State& st = *state_;
  TS_CHECK(st.pending() == 0, "{}: check_replicas() with buckets in flight", kName);
  nn::NamedTensors named;
  for (const State::Slot& slot : st.slots) named.emplace_back(slot.name, slot.param);
  const auto [whole, sub] = split_subgroup(named, st.options.subgroup);
  check_same_values(*st.comm, kName, whole);
  if (st.options.subgroup.group != nullptr) check_same_values(*st.options.subgroup.group, kName, sub);
}

std::vector<DistributedDataParallel::BucketInfo> DistributedDataParallel::buckets() const {
  std::vector<BucketInfo> out;
  for (const State::Bucket& bucket : state_->buckets) {
    BucketInfo info{bucket.dtype, bucket.device, bucket.elements, {}};
    for (int s : bucket.slots) info.names.push_back(state_->slots[s].name);
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace tessera::parallel
