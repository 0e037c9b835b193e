#include "parallel/zero.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "optim/clip.h"
#include "parallel/comm/comm_log.h"
#include "parallel/data_parallel.h"
#include "parallel/placement.h"
#include "tensor/allocator.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {

constexpr const char* kName = "ZeroDataParallel";

bool same_view(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.storage() == b.storage() && a.offset() == b.offset() &&
         a.shape() == b.shape();
}

}  // namespace

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
    std::vector<int64_t> counts = {};  // per rank (array_split)
    int64_t shard_start = 0;
    int64_t shard_numel = 0;
    Tensor flat_param = {};  // stages 1-2: the parameters' storage; stage 3: gathered/released
    Tensor shard = {};       // the optimizer's parameter: this rank's block
    Tensor flat_grad = {};   // the full local gradients (stage 1: kept; 2-3: per round)
    Tensor reduced = {};     // reduce_scatter output in flight
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

  int root() const { return static_cast<int>(units.size()) - 1; }
  int stage() const { return options.stage; }

  Tensor param_view(const Segment& seg, const Tensor& flat, const Param& p) const {
    (void)seg;
    return flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.shape());
  }
  Tensor shard_slice(const Segment& seg, const Tensor& flat) const {
    return flat.narrow(0, seg.shard_start, seg.shard_numel);
  }

  // ---- stage 3: gathering units ---------------------------------------------------------
  void gather_async(int u) {
    Unit& unit = units[u];
    if (unit.gather != Gather::released) return;
    CommCause cause(fmt::format("zero gather {}", unit.path.empty() ? "root" : unit.path));
    MemoryTagScope tag(MemoryTag::gathered);
    for (int s : unit.segments) {
      Segment& seg = segments[s];
      seg.flat_param.storage()->reallocate();
      unit.works.push_back(comm->all_gather_async(seg.flat_param, seg.shard, seg.counts));
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
    }
  }
  void release(int u) {
    Unit& unit = units[u];
    if (unit.gather == Gather::released) return;
    for (WorkHandle& w : unit.works) w->wait();  // never free a buffer a gather writes
    unit.works.clear();
    for (int s : unit.segments) segments[s].flat_param.storage()->release();
    unit.gather = Gather::released;
  }
  void release_all() {
    for (int u = 0; u < static_cast<int>(units.size()); ++u) release(u);
  }

  void pre_forward(int u) {
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
    const Tensor view = param_view(seg, seg.flat_grad, p);
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
        param_view(seg, seg.flat_grad, p).copy_(zeros({}, seg.dtype, seg.device));
        p.adopted = true;
      }
    }
    {
      MemoryTagScope tag(MemoryTag::gradients);
      seg.reduced = Tensor::empty({seg.shard_numel}, seg.dtype, seg.device);
    }
    CommCause cause(fmt::format("zero reduce_scatter segment {}", s));
    seg.work = comm->reduce_scatter_async(seg.reduced, seg.flat_grad, ReduceOp::avg, seg.counts);
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
    for (Segment& seg : segments) {
      if (!seg.work) continue;
      try {
        seg.work->wait();
      } catch (...) {  // reported where the error arose
      }
    }
    for (Unit& unit : units) {
      for (WorkHandle& w : unit.works) {
        try {
          w->wait();
        } catch (...) {
        }
      }
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
  // The sharded optimizer's parameter j is the shard of segments[optimizer_order()[j]].
  std::vector<int> optimizer_order() const { return decay_first(segments); }

  nn::NamedTensors named() const {
    nn::NamedTensors out;
    for (const Param& p : params) out.emplace_back(p.name, p.tensor);
    return out;
  }
};

// ---- construction ------------------------------------------------------------------------

ZeroDataParallel::ZeroDataParallel(nn::Module& module, Communicator& comm, ZeroOptions options)
    : state_(std::make_shared<State>()) {
  TS_CHECK(options.stage >= 0 && options.stage <= 3, "{}: stage must be 0, 1, 2 or 3, got {}",
           kName, options.stage);
  TS_CHECK(options.bucket_bytes > 0, "{}: bucket_bytes must be positive, got {}", kName,
           options.bucket_bytes);
  State& st = *state_;
  st.module = &module;
  st.comm = &comm;
  st.options = options;

  // Parameters once each (a tied weight is one tensor).
  for (auto& [name, param] : module.named_parameters()) {
    if (!param.requires_grad()) continue;
    const bool seen = std::any_of(st.params.begin(), st.params.end(),
                                  [&](const State::Param& p) { return p.tensor.is_same(param); });
    if (!seen) st.params.push_back({name, param});
  }
  for (State::Param& p : st.params) {
    p.decay = options.decay ? options.decay(p.name, p.tensor)
                            : p.tensor.dim() >= 2;  // optim::decay_groups' rule
    st.numel += p.tensor.numel();
  }

  // Units: each wrapped path, then the root (everything else).
  std::map<const TensorImpl*, int> unit_of;
  for (size_t u = 0; u < options.units.size(); ++u) {
    const std::string& path = options.units[u];
    nn::Module& m = module.submodule(path);
    for (const Tensor& t : m.parameters()) {
      auto [it, inserted] = unit_of.emplace(t.impl(), static_cast<int>(u));
      TS_CHECK(inserted || it->second == static_cast<int>(u),
               "{}: a parameter of unit '{}' also belongs to unit '{}'; units must not share "
               "parameters (leave shared ones to the root)",
               kName, path, options.units[it->second]);
    }
    st.units.push_back({path, &m});
  }
  st.units.push_back({"", &module});
  for (int i = 0; i < static_cast<int>(st.params.size()); ++i) {
    auto it = unit_of.find(st.params[i].tensor.impl());
    st.params[i].unit = it == unit_of.end() ? st.root() : it->second;
    st.units[st.params[i].unit].params.push_back(i);
  }

  check_same_parameters(comm, kName, st.named(),
                        static_cast<uint64_t>(options.stage) * 1000003u +
                            static_cast<uint64_t>(options.bucket_bytes) * 7 +
                            options.units.size());
  if (options.check_replicas) check_same_values(comm, kName, st.named());

  // Segments in the order backward completes them: the wrapped units last to first, then
  // the root; inside a unit, parameters in reverse registration order.
  const int n = comm.size();
  const int64_t cap = options.stage == 3 ? INT64_MAX : options.bucket_bytes;
  std::vector<int> unit_order;
  for (int u = st.root() - 1; u >= 0; --u) unit_order.push_back(u);
  unit_order.push_back(st.root());
  for (int u : unit_order) {
    std::map<std::tuple<bool, int, std::string>, int> open;  // (decay, dtype, device) -> segment
    const std::vector<int>& members = st.units[u].params;
    for (auto it = members.rbegin(); it != members.rend(); ++it) {
      State::Param& p = st.params[*it];
      const auto key = std::make_tuple(p.decay, static_cast<int>(p.tensor.dtype()),
                                       p.tensor.device().str());
      auto o = open.find(key);
      const int64_t bytes = p.tensor.nbytes();
      if (o == open.end() || (st.segments[o->second].numel > 0 &&
                              st.segments[o->second].numel * dtype_size(p.tensor.dtype()) +
                                      bytes > cap)) {
        st.segments.push_back({u, p.decay, p.tensor.dtype(), p.tensor.device()});
        st.units[u].segments.push_back(static_cast<int>(st.segments.size()) - 1);
        o = open.insert_or_assign(key, static_cast<int>(st.segments.size()) - 1).first;
      }
      State::Segment& seg = st.segments[o->second];
      p.segment = o->second;
      p.offset = seg.numel;
      seg.params.push_back(*it);
      seg.numel += p.tensor.numel();
    }
  }

  // Flat buffers: the parameters become views of them (stage 3: of a buffer released below).
  NoGradGuard no_grad;
  for (State::Segment& seg : st.segments) {
    for (int r = 0; r < n; ++r) {
      seg.counts.push_back(block_size(seg.numel, n, r));
      if (r < comm.rank()) seg.shard_start += seg.counts.back();
    }
    seg.shard_numel = seg.counts[comm.rank()];
    {
      MemoryTagScope tag(options.stage == 3 ? MemoryTag::gathered : MemoryTag::parameters);
      seg.flat_param = Tensor::empty({seg.numel}, seg.dtype, seg.device);
    }
    for (int i : seg.params) {
      State::Param& p = st.params[i];
      const Tensor view = st.param_view(seg, seg.flat_param, p);
      view.copy_(p.tensor);
      p.tensor.set_data(view);
      p.tensor.set_grad(Tensor());
    }
    if (options.stage == 3) {
      MemoryTagScope tag(MemoryTag::parameters);
      seg.shard = st.shard_slice(seg, seg.flat_param).clone();
      seg.flat_param.storage()->release();  // one segment at a time: no full-model peak
    } else {
      seg.shard = st.shard_slice(seg, seg.flat_param);
    }
    st.units[seg.unit].bytes += seg.numel * dtype_size(seg.dtype);
  }
  if (options.stage == 3) {
    for (State::Unit& unit : st.units) unit.gather = State::Gather::released;
  }
  st.reset_round();

  if (options.stage == 0) {
    DdpOptions ddp;
    ddp.bucket_bytes = options.bucket_bytes;
    ddp.check_replicas = false;  // checked above
    st.ddp = std::make_unique<DistributedDataParallel>(module, comm, ddp);
    return;
  }

  // Hooks hold the state weakly: once this object is gone they do nothing.
  std::weak_ptr<State> weak = state_;
  for (int i = 0; i < static_cast<int>(st.params.size()); ++i) {
    st.params[i].tensor.register_post_accumulate_grad_hook([weak, i](const Tensor&) {
      if (std::shared_ptr<State> state = weak.lock()) state->on_gradient(i);
    });
  }
  if (options.stage == 3) {
    for (int u = 0; u < static_cast<int>(st.units.size()); ++u) {
      st.units[u].module->register_forward_pre_hook([weak, u](nn::Module&) {
        if (std::shared_ptr<State> state = weak.lock()) state->pre_forward(u);
      });
      st.units[u].module->register_forward_hook([weak, u](nn::Module&, const Tensor& out) {
        std::shared_ptr<State> state = weak.lock();
        if (!state) return Tensor();
        state->post_forward(u);
        if (u != state->root() && GradMode::enabled() && out.defined() && out.requires_grad()) {
          // The gradient of the unit's output arrives before any of its backward runs.
          out.register_hook([weak, u](const Tensor&) {
            if (std::shared_ptr<State> s = weak.lock()) s->pre_backward(u);
            return Tensor();
          });
        }
        return Tensor();
      });
    }
  }
}

ZeroDataParallel::~ZeroDataParallel() { state_->wait_all(); }

nn::Module& ZeroDataParallel::module() const { return *state_->module; }
Communicator& ZeroDataParallel::comm() const { return *state_->comm; }
const ZeroOptions& ZeroDataParallel::options() const { return state_->options; }
int ZeroDataParallel::stage() const { return state_->options.stage; }

std::vector<optim::ParamGroup> ZeroDataParallel::param_groups(double lr, double weight_decay) const {
  const State& st = *state_;
  if (st.stage() == 0) {  // the module's own parameters, grouped by the decay rule
    std::vector<optim::ParamGroup> groups(2);
    groups[0].weight_decay = weight_decay;
    groups[1].weight_decay = 0.0;
    groups[0].lr = groups[1].lr = lr;
    for (const State::Param& p : st.params) {
      optim::ParamGroup& g = groups[p.decay ? 0 : 1];
      g.params.push_back(p.tensor);
      g.names.push_back(p.name);
    }
    return groups;
  }
  std::vector<optim::ParamGroup> groups(2);
  groups[0].weight_decay = weight_decay;
  groups[1].weight_decay = 0.0;
  for (int s : st.optimizer_order()) {
    const State::Segment& seg = st.segments[s];
    optim::ParamGroup& g = groups[seg.decay ? 0 : 1];
    g.lr = lr;
    g.params.push_back(seg.shard);
    g.names.push_back(fmt::format("zero segment {} ({}{} elements of {})", s,
                                  st.units[seg.unit].path.empty()
                                      ? std::string("root, ")
                                      : st.units[seg.unit].path + ", ",
                                  seg.shard_numel, seg.numel));
  }
  groups[0].lr = groups[1].lr = lr;
  return groups;
}

// ---- the step ----------------------------------------------------------------------------

void ZeroDataParallel::zero_grad() {
  State& st = *state_;
  for (State::Param& p : st.params) {
    p.tensor.set_grad(Tensor());
    p.adopted = false;
  }
  for (State::Segment& seg : st.segments) {
    seg.shard.set_grad(Tensor());
    if (st.stage() >= 2) seg.flat_grad = Tensor();
  }
}

void ZeroDataParallel::backward(const Tensor& loss) {
  loss.backward();
  finish();
}

void ZeroDataParallel::finish() {
  State& st = *state_;
  if (st.stage() == 0) {
    st.ddp->finish();
    return;
  }
  if (!st.sync) {
    if (st.stage() == 3) st.release_all();
    return;
  }
  struct ResetOnExit {
    State& st;
    ~ResetOnExit() {
      st.wait_all();
      st.reset_round();
      if (st.stage() == 3) {
        try {
          st.release_all();
        } catch (...) {
        }
      }
    }
  } reset{st};
  while (st.next_launch < static_cast<int>(st.segments.size())) st.launch(st.next_launch++);
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) st.finalize(s);
}

ZeroDataParallel::NoSync::NoSync(ZeroDataParallel& zero) : zero_(zero), previous_(zero.state_->sync) {
  if (zero.state_->ddp) {
    ddp_guard_.reset(new DistributedDataParallel::NoSync(zero.state_->ddp->no_sync()));
  }
  zero.state_->sync = false;
}

ZeroDataParallel::NoSync::~NoSync() { zero_.state_->sync = previous_; }

ZeroDataParallel::NoSync ZeroDataParallel::no_sync() { return NoSync(*this); }

double ZeroDataParallel::clip_grad_norm(double max_norm) {
  State& st = *state_;
  if (st.stage() == 0) {
    std::vector<Tensor> ps;
    for (const State::Param& p : st.params) ps.push_back(p.tensor);
    return optim::clip_grad_norm(ps, max_norm);
  }
  NoGradGuard no_grad;
  std::vector<Tensor> shards;
  for (const State::Segment& seg : st.segments) shards.push_back(seg.shard);
  const double local = std::pow(optim::grad_norm(shards), 2);
  Tensor total = Tensor::from_vector<double>({local}, {1});
  {
    CommCause cause("zero clip_grad_norm");
    st.comm->all_reduce(total, ReduceOp::sum);
  }
  return optim::clip_grads_to_norm(shards, std::sqrt(total.item<double>()), max_norm);
}

double ZeroDataParallel::local_grad_norm_squared(
    const std::function<double(const std::string&)>& weight) const {
  const State& st = *state_;
  NoGradGuard no_grad;
  auto sum_sq = [](const Tensor& g) {
    const Tensor g64 = cast(g, DType::f64);
    return sum(g64 * g64).item<double>();
  };
  double total = 0.0;
  if (st.stage() == 0) {
    for (const State::Param& p : st.params) {
      const Tensor g = p.tensor.grad();
      const double w = weight(p.name);
      if (g.defined() && g.numel() > 0 && w != 0.0) total += w * sum_sq(g);
    }
    return total;
  }
  for (const State::Segment& seg : st.segments) {
    const Tensor g = seg.shard.grad();
    if (!g.defined() || seg.shard_numel == 0) continue;
    for (int i : seg.params) {  // the part of each parameter inside this rank's block
      const State::Param& p = st.params[i];
      const int64_t lo = std::max(p.offset, seg.shard_start);
      const int64_t hi = std::min(p.offset + p.tensor.numel(), seg.shard_start + seg.shard_numel);
      const double w = weight(p.name);
      if (lo < hi && w != 0.0) total += w * sum_sq(g.narrow(0, lo - seg.shard_start, hi - lo));
    }
  }
  return total;
}

void ZeroDataParallel::scale_grads(double coef) {
  State& st = *state_;
  NoGradGuard no_grad;
  std::vector<Tensor> owned;
  if (st.stage() == 0) {
    for (const State::Param& p : st.params) owned.push_back(p.tensor);
  } else {
    for (const State::Segment& seg : st.segments) owned.push_back(seg.shard);
  }
  for (const Tensor& t : owned) {
    const Tensor g = t.grad();
    if (g.defined() && g.numel() > 0) copy_(g, g * coef);
  }
}

void ZeroDataParallel::step(optim::Optimizer& optimizer) {
  State& st = *state_;
  {
    MemoryTagScope tag(MemoryTag::optimizer_state);
    optimizer.step();
  }
  if (st.stage() == 1 || st.stage() == 2) {
    NoGradGuard no_grad;
    CommCause cause("zero all_gather parameters");
    std::vector<std::pair<WorkHandle, Tensor>> works;
    for (State::Segment& seg : st.segments) {
      Tensor send = seg.shard.clone();  // the output holds the shard itself: do not alias
      works.emplace_back(st.comm->all_gather_async(seg.flat_param, send, seg.counts), send);
    }
    for (auto& [work, send] : works) work->wait();
  }
}

// ---- checkpoints -------------------------------------------------------------------------

nn::StateDict ZeroDataParallel::model_state_dict() {
  State& st = *state_;
  NoGradGuard no_grad;
  if (st.stage() == 3) {
    for (int u = 0; u < static_cast<int>(st.units.size()); ++u) st.ensure_gathered(u);
  }
  nn::StateDict out;
  for (const auto& [k, v] : st.module->state_dict()) out[k] = v.clone();
  if (st.stage() == 3) st.release_all();
  return out;
}

void ZeroDataParallel::load_model_state_dict(const nn::StateDict& dict) {
  State& st = *state_;
  NoGradGuard no_grad;
  if (st.stage() != 3) {
    st.module->load_state_dict(dict);
    return;
  }
  for (int u = 0; u < static_cast<int>(st.units.size()); ++u) st.ensure_gathered(u);
  try {
    st.module->load_state_dict(dict);
  } catch (...) {
    st.release_all();
    throw;
  }
  for (State::Segment& seg : st.segments) seg.shard.copy_(st.shard_slice(seg, seg.flat_param));
  st.release_all();
}


optim::Optimizer::StateDict ZeroDataParallel::optimizer_state_dict(const optim::Optimizer& optimizer) {
  State& st = *state_;
  optim::Optimizer::StateDict shard_dict = optimizer.state_dict();
  if (st.stage() == 0) return shard_dict;
  NoGradGuard no_grad;
  const std::vector<int> order = st.canonical_order();
  std::vector<int> index_of(st.params.size());
  for (int k = 0; k < static_cast<int>(order.size()); ++k) index_of[order[k]] = k;

  optim::Optimizer::StateDict out;
  for (const auto& [k, v] : shard_dict) {
    if (k.rfind("hparam.", 0) == 0 || k.ends_with(".lr") || k.ends_with(".weight_decay")) {
      out[k] = v;
    }
  }
  std::vector<int64_t> group_params[2];
  for (int k = 0; k < static_cast<int>(order.size()); ++k) {
    group_params[st.params[order[k]].decay ? 0 : 1].push_back(k);
  }
  for (int g = 0; g < 2; ++g) {
    out[fmt::format("group.{}.params", g)] = Tensor::from_vector<int64_t>(
        group_params[g], {static_cast<int64_t>(group_params[g].size())});
  }
  const std::vector<int> seg_order = st.optimizer_order();
  CommCause cause("zero gather optimizer state");
  for (int j = 0; j < static_cast<int>(seg_order.size()); ++j) {
    const State::Segment& seg = st.segments[seg_order[j]];
    const std::string prefix = fmt::format("state.{}.", j);
    for (const auto& [k, v] : shard_dict) {
      if (k.rfind(prefix, 0) != 0) continue;
      const std::string name = k.substr(prefix.size());
      if (name == "step") {
        for (int i : seg.params) out[fmt::format("state.{}.step", index_of[i])] = v.clone();
        continue;
      }
      TS_CHECK(v.dim() == 1 && v.numel() == seg.shard_numel,
               "{}: optimizer state '{}' has shape {}, expected [{}] (the shard)", kName, k,
               shape_str(v.shape()), seg.shard_numel);
      const Tensor full = Tensor::empty({seg.numel}, v.dtype(), v.device());
      st.comm->all_gather(full, v.contiguous(), seg.counts);
      for (int i : seg.params) {
        const State::Param& p = st.params[i];
        out[fmt::format("state.{}.{}", index_of[i], name)] = st.param_view(seg, full, p).clone();
      }
    }
  }
  return out;
}

void ZeroDataParallel::load_optimizer_state_dict(optim::Optimizer& optimizer,
                                                 const optim::Optimizer::StateDict& dict) {
  State& st = *state_;
  if (st.stage() == 0) {
    optimizer.load_state_dict(dict);
    return;
  }
  NoGradGuard no_grad;
  const std::vector<int> order = st.canonical_order();
  std::vector<int> index_of(st.params.size());
  for (int k = 0; k < static_cast<int>(order.size()); ++k) index_of[order[k]] = k;

  optim::Optimizer::StateDict out;
  // Keys the optimizer's own dict has about its groups (segment indices) stay its own.
  for (const auto& [k, v] : optimizer.state_dict()) {
    if (k.rfind("group.", 0) == 0 && k.ends_with(".params")) out[k] = v;
  }
  for (const auto& [k, v] : dict) {
    if (k.rfind("hparam.", 0) == 0 || (k.rfind("group.", 0) == 0 && !k.ends_with(".params"))) {
      out[k] = v;
    }
  }
  for (int g = 0; g < 2; ++g) {
    const std::string key = fmt::format("group.{}.params", g);
    auto it = dict.find(key);
    TS_CHECK(it != dict.end(), "{}: optimizer state dict has no '{}'", kName, key);
    int64_t expected = 0;
    for (const State::Param& p : st.params) expected += p.decay == (g == 0);
    TS_CHECK(it->second.numel() == expected,
             "{}: optimizer state dict's group {} holds {} parameters, this model {}", kName, g,
             it->second.numel(), expected);
  }
  const std::vector<int> seg_order = st.optimizer_order();
  for (int j = 0; j < static_cast<int>(seg_order.size()); ++j) {
    const State::Segment& seg = st.segments[seg_order[j]];
    // Every member's state names and step must agree (a segment steps as one).
    std::set<std::string> names;
    int with_state = 0;
    int64_t step = -1;
    for (int i : seg.params) {
      const std::string prefix = fmt::format("state.{}.", index_of[i]);
      auto it = dict.find(prefix + "step");
      if (it == dict.end()) continue;
      ++with_state;
      const int64_t s = it->second.item<int64_t>();
      TS_CHECK(step < 0 || s == step,
               "{}: parameters '{}' and its segment's others have different step counts ({} "
               "and {}); a segment steps as one",
               kName, st.params[i].name, s, step);
      step = s;
      for (auto k = dict.lower_bound(prefix); k != dict.end() && k->first.rfind(prefix, 0) == 0; ++k) {
        if (k->first != prefix + "step") names.insert(k->first.substr(prefix.size()));
      }
    }
    if (with_state == 0) continue;
    TS_CHECK(with_state == static_cast<int>(seg.params.size()),
             "{}: only {} of the {} parameters of segment {} have optimizer state", kName,
             with_state, seg.params.size(), seg_order[j]);
    out[fmt::format("state.{}.step", j)] = Tensor::from_vector<int64_t>({step}, {});
    for (const std::string& name : names) {
      Tensor full;
      for (int i : seg.params) {
        const State::Param& p = st.params[i];
        const std::string key = fmt::format("state.{}.{}", index_of[i], name);
        auto it = dict.find(key);
        TS_CHECK(it != dict.end(), "{}: optimizer state dict has no '{}'", kName, key);
        TS_CHECK(it->second.shape() == p.tensor.shape(),
                 "{}: optimizer state '{}' has shape {}, parameter '{}' is {}", kName, key,
                 shape_str(it->second.shape()), p.name, shape_str(p.tensor.shape()));
        if (!full.defined()) full = Tensor::empty({seg.numel}, it->second.dtype(), seg.device);
        st.param_view(seg, full, p).copy_(it->second);
      }
      out[fmt::format("state.{}.{}", j, name)] = st.shard_slice(seg, full).clone();
    }
  }
  optimizer.load_state_dict(out);
}

// ---- memory ------------------------------------------------------------------------------

ZeroMemory ZeroDataParallel::memory_report() const {
  const State& st = *state_;
  const MemoryTracker& t = MemoryScope::current() ? *MemoryScope::current() : process_memory();
  ZeroMemory m;
  m.stage = st.stage();
  m.ranks = st.comm->size();
  m.numel = st.numel;
  m.parameters = t.current(MemoryTag::parameters);
  m.gradients = t.current(MemoryTag::gradients);
  m.optimizer_state = t.current(MemoryTag::optimizer_state);
  m.gradients_peak = t.peak(MemoryTag::gradients);
  m.gathered_peak = t.peak(MemoryTag::gathered);
  if (st.stage() == 3) {
    for (int u = 0; u < st.root(); ++u) m.largest_unit = std::max(m.largest_unit, st.units[u].bytes);
    m.root_unit = st.units[st.root()].bytes;
  }
  return m;
}

double ZeroMemory::formula() const {
  const double psi = static_cast<double>(numel), n = ranks;
  switch (stage) {
    case 0: return 16 * psi;
    case 1: return 8 * psi + 8 * psi / n;
    case 2: return 4 * psi + 12 * psi / n;
    default: return 16 * psi / n;
  }
}

std::string ZeroMemory::str() const {
  auto mib = [](double b) { return fmt::format("{:.2f} MiB", b / (1 << 20)); };
  std::string s = fmt::format(
      "memory per rank (ZeRO stage {}, {} ranks, Ψ = {} parameters): parameters {}, gradients "
      "{} (peak {}), optimizer state {}; sum {} vs formula {} ({:.3f}x)",
      stage, ranks, numel, mib(parameters), mib(gradients), mib(gradients_peak),
      mib(optimizer_state), mib(measured()), mib(formula()),
      measured() / std::max(formula(), 1.0));
  if (stage == 3) {
    s += fmt::format("; gathered peak {} (root unit {}, largest unit {})", mib(gathered_peak),
                     mib(root_unit), mib(largest_unit));
  }
  return s;
}

}  // namespace tessera::parallel
