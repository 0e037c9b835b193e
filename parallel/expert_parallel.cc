#include "parallel/expert_parallel.h"

#include <fmt/format.h>

#include <functional>
#include <numeric>

#include "autograd/node.h"
#include "parallel/comm/comm_log.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

// Launches the exchange of `rows` into a new `out`; `sent` holds the (contiguous) input the
// exchange reads until it completes.
WorkHandle launch(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                  const std::vector<int64_t>& recv_rows, const std::string& cause, Tensor& out,
                  Tensor& sent) {
  const int64_t width = rows.dim() == 2 ? rows.size(1) : 1;
  const int64_t total = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  out = Tensor::empty({total, width}, rows.dtype(), rows.device());
  sent = rows.contiguous();
  const CommCause why(cause, CommKind::activations);
  return group.all_to_all_async(out, sent, times(send_rows, width), times(recv_rows, width));
}

Tensor exchange(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                const std::vector<int64_t>& recv_rows, const std::string& cause) {
  Tensor out, sent;
  launch(group, rows, send_rows, recv_rows, cause, out, sent)->wait();
  return out;
}

class AllToAllRowsNode final : public autograd::Node {
 public:
  AllToAllRowsNode(Communicator& group, std::vector<int64_t> send, std::vector<int64_t> recv,
                   Shape in_shape, DType dtype, Device device, std::string cause)
      : group_(group), send_(std::move(send)), recv_(std::move(recv)), in_shape_(std::move(in_shape)),
        dtype_(dtype), device_(device), cause_(std::move(cause)) {}
  std::string name() const override { return "all_to_all_rows"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    const int64_t recv_total = std::accumulate(recv_.begin(), recv_.end(), int64_t{0});
    const Tensor g = grads[0].defined() ? grads[0] : zeros({recv_total, in_shape_[1]}, dtype_, device_);
    return {exchange(group_, g, recv_, send_, cause_ + " backward")};
  }

 private:
  Communicator& group_;
  std::vector<int64_t> send_, recv_;
  Shape in_shape_;
  DType dtype_;
  Device device_;
  std::string cause_;
};

void check_rows(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                const std::vector<int64_t>& recv_rows, const std::string& cause) {
  TS_CHECK(rows.defined() && rows.dim() == 2, "all_to_all_rows ({}): expected rows [R, C], got {}", cause,
           rows.defined() ? shape_str(rows.shape()) : std::string("undefined"));
  const size_t n = static_cast<size_t>(group.size());
  TS_CHECK(send_rows.size() == n && recv_rows.size() == n &&
               std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0}) == rows.size(0),
           "all_to_all_rows ({}): {} send and {} receive counts for a group of {} and {} rows", cause,
           send_rows.size(), recv_rows.size(), n, rows.size(0));
}

// `out` (the exchange of `rows`) as a function of rows: backward is the reverse exchange.
Tensor with_exchange_gradient(Tensor out, Communicator& group, const Tensor& rows,
                              const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                              const std::string& cause) {
  if (!GradMode::enabled() || !rows.requires_grad()) return out;
  auto node = std::make_shared<AllToAllRowsNode>(group, send_rows, recv_rows, rows.shape(), rows.dtype(),
                                                 rows.device(), cause);
  node->mutable_next_edges().push_back(autograd::gradient_edge(rows));
  AutogradMeta& meta = out.ensure_autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = 0;
  return out;
}

}  // namespace

Tensor all_to_all_rows(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, const std::string& cause) {
  check_rows(group, rows, send_rows, recv_rows, cause);
  Tensor out;
  {
    const NoGradGuard no_grad;
    out = exchange(group, rows, send_rows, recv_rows, cause);
  }
  return with_exchange_gradient(std::move(out), group, rows, send_rows, recv_rows, cause);
}

PendingRows::PendingRows(Communicator& group, const Tensor& rows, std::vector<int64_t> send_rows,
                         std::vector<int64_t> recv_rows, std::string cause)
    : group_(&group), rows_(rows), send_(std::move(send_rows)), recv_(std::move(recv_rows)),
      cause_(std::move(cause)) {
  check_rows(group, rows, send_, recv_, cause_);
  const NoGradGuard no_grad;
  work_ = launch(group, rows, send_, recv_, cause_, out_, sent_);
}

PendingRows::~PendingRows() {
  if (work_) wait_ignoring_errors(work_);  // never free buffers an exchange still uses
}

Tensor PendingRows::wait() {
  TS_CHECK(work_ != nullptr, "PendingRows ({}): wait() called twice", cause_);
  work_->wait();
  work_.reset();
  sent_ = Tensor();
  return with_exchange_gradient(std::move(out_), *group_, rows_, send_, recv_, cause_);
}

ExpertParallel::ExpertParallel(Communicator& group, int64_t experts)
    : group_(group), experts_(experts), local_(0), first_(0) {
  TS_CHECK(experts >= 1 && experts % group.size() == 0,
           "ExpertParallel: {} experts do not split evenly over the {} ranks of group '{}'", experts,
           group.size(), group.name());
  local_ = experts / group.size();
  first_ = local_ * group.rank();
}

Tensor ExpertParallel::run(const Tensor& rows, const std::vector<int64_t>& sizes,
                           const nn::ExpertsFn& experts) {
  TS_CHECK(static_cast<int64_t>(sizes.size()) == experts_,
           "ExpertParallel: {} group sizes for {} experts", sizes.size(), experts_);
  const int P = group_.size();
  // 1. Each member's row counts for my experts: [source][local expert].
  std::vector<int64_t> send_rows(P, 0);
  for (int64_t e = 0; e < experts_; ++e) send_rows[e / local_] += sizes[e];
  // On the rows' device: a device communicator (NCCL) takes device tensors only.
  Tensor counts_in = Tensor::empty({P * local_}, DType::i64, rows.device());
  {
    const CommCause why("moe routing counts", CommKind::control);
    group_.all_to_all(counts_in, Tensor::from_vector(sizes, {experts_}).to(rows.device()));
  }
  const std::vector<int64_t> from = counts_in.to_vector<int64_t>();
  std::vector<int64_t> recv_rows(P, 0);
  for (int s = 0; s < P; ++s) {
    for (int64_t j = 0; j < local_; ++j) recv_rows[s] += from[s * local_ + j];
  }
  // 2. The rows for other members' experts go by an exchange launched now; my own rows for my
  // experts need none, and run while the others travel (overlapping the exchange).
  const int me = group_.rank();
  std::vector<int64_t> send_start(P + 1, 0);
  for (int m = 0; m < P; ++m) send_start[m + 1] = send_start[m] + send_rows[m];
  std::vector<int64_t> send_remote = send_rows, recv_remote = recv_rows;
  send_remote[me] = 0;
  recv_remote[me] = 0;
  const auto index = [&](const std::vector<int64_t>& v) {
    return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(rows.device());
  };
  // (The rows around my block: before it and after it.)
  const Tensor remote = cat({rows.narrow(0, 0, send_start[me]),
                             rows.narrow(0, send_start[me + 1], rows.size(0) - send_start[me + 1])});
  PendingRows dispatch(group_, remote, send_remote, recv_remote, "moe dispatch");
  const std::vector<int64_t> my_sizes(sizes.begin() + first_, sizes.begin() + first_ + local_);
  const Tensor mine = experts(rows.narrow(0, send_start[me], send_rows[me]), my_sizes, first_);
  // 3. Received by (source, expert); regrouped by (expert, source) for the grouped matmuls.
  const Tensor received = dispatch.wait();
  std::vector<int64_t> source_start(P + 1, 0), remote_sizes(local_, 0);
  for (int s = 0; s < P; ++s) source_start[s + 1] = source_start[s] + recv_remote[s];
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(source_start[P]));
  for (int64_t j = 0; j < local_; ++j) {
    for (int s = 0; s < P; ++s) {
      if (s == me) continue;
      int64_t at = source_start[s];
      for (int64_t i = 0; i < j; ++i) at += from[s * local_ + i];
      for (int64_t r = 0; r < from[s * local_ + j]; ++r) order.push_back(at + r);
      remote_sizes[j] += from[s * local_ + j];
    }
  }
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < order.size(); ++i) back[order[i]] = static_cast<int64_t>(i);
  const Tensor out = experts(index_select(received, 0, index(order)), remote_sizes, first_);
  // 4. Back in received order, then to the members the rows came from; my rows' outputs go
  // back in their place.
  const Tensor returned =
      all_to_all_rows(group_, index_select(out, 0, index(back)), recv_remote, send_remote, "moe combine");
  const int64_t before = send_start[me];
  return cat({returned.narrow(0, 0, before), mine,
              returned.narrow(0, before, returned.size(0) - before)});
}

}  // namespace tessera::parallel

namespace tessera::parallel {

ExpertGroups::ExpertGroups(Communicator& dp, int64_t ep, int64_t experts) : experts_(experts) {
  TS_CHECK(ep >= 1 && dp.size() % ep == 0 && experts % ep == 0,
           "ExpertGroups: ep {} must divide the {} ranks of group '{}' and the {} experts", ep,
           dp.size(), dp.name(), experts);
  const int rank = dp.rank(), p = static_cast<int>(ep);
  ep_ = dp.split(rank / p, rank % p, "ep");
  edp_ = dp.split(rank % p, rank / p, "edp");
  dispatch_ = std::make_unique<ExpertParallel>(*ep_, experts);
}

int ExpertGroups::keep(nn::Module& module) {
  int layers = 0;
  const std::function<void(nn::Module&, const std::string&)> walk = [&](nn::Module& m,
                                                                       const std::string& prefix) {
    if (auto* moe = dynamic_cast<nn::MixtureOfExperts*>(&m)) {
      TS_CHECK(moe->options.experts == experts_,
               "ExpertGroups: layer '{}' has {} experts, the groups were made for {}", prefix,
               moe->options.experts, experts_);
      moe->keep_experts(first(), local());
      for (const char* name : {"fc_weight", "fc_bias", "proj_weight", "proj_bias"}) {
        names_.insert(prefix.empty() ? std::string(name) : prefix + "." + name);
      }
      ++layers;
    }
    for (const auto& [name, child] : m.named_children()) {
      walk(*child, prefix.empty() ? name : prefix + "." + name);
    }
  };
  walk(module, "");
  return layers;
}

ParamSubgroup ExpertGroups::subgroup(bool average) const {
  ParamSubgroup s;
  s.group = edp_.get();
  s.holds = [names = names_](const std::string& name) { return names.count(name) == 1; };
  s.scale = average ? 1.0 / static_cast<double>(ep_->size()) : 1.0;
  return s;
}

namespace {

// [local, ...] blocks of the ep group's members, in member order: [E, ...].
Tensor gather_rows(Communicator& ep, const Tensor& mine) {
  Shape whole = mine.shape();
  whole[0] *= ep.size();
  Tensor out = Tensor::empty(whole, mine.dtype(), mine.device());
  const CommCause why("moe gather experts", CommKind::parameters);
  ep.all_gather(out, mine.contiguous());
  return out;
}

}  // namespace

std::string ExpertGroups::expert_field(const std::string& key, const std::vector<std::string>& order) const {
  if (!key.starts_with("state.")) return "";
  const size_t dot = key.find('.', 6);
  if (dot == std::string::npos || key.substr(dot + 1) == "step") return "";
  const size_t i = static_cast<size_t>(std::stoll(key.substr(6, dot - 6)));
  TS_CHECK(i < order.size(), "ExpertGroups: optimizer state '{}' for parameter {} of {}", key, i,
           order.size());
  return holds(order[i]) ? order[i] : "";
}

Tensor ExpertGroups::whole(const std::string& name, const Tensor& t) const {
  return holds(name) ? gather_rows(*ep_, t) : t;
}

void ExpertGroups::gather(nn::StateDict& model) const {
  for (auto& [name, t] : model) t = whole(name, t);  // (a map: every member walks the same keys)
}

void ExpertGroups::gather(std::map<std::string, Tensor>& optimizer,
                          const std::vector<std::string>& order) const {
  for (auto& [key, t] : optimizer) {
    const std::string param = expert_field(key, order);
    if (param.empty()) continue;
    TS_CHECK(t.dim() >= 1 && t.size(0) == local(),
             "ExpertGroups: optimizer state '{}' of expert parameter '{}' has shape {}; expected "
             "the parameter's {} experts first (an elementwise optimizer's state)",
             key, param, shape_str(t.shape()), local());
    t = gather_rows(*ep_, t);
  }
}

void ExpertGroups::slice(nn::StateDict& model) const {
  for (auto& [name, t] : model) {
    if (!holds(name)) continue;
    TS_CHECK(t.dim() >= 1 && t.size(0) == experts_,
             "ExpertGroups: '{}' has shape {}, expected its {} experts first", name,
             shape_str(t.shape()), experts_);
    t = t.narrow(0, first(), local()).contiguous();
  }
}

void ExpertGroups::slice(std::map<std::string, Tensor>& optimizer,
                         const std::vector<std::string>& order) const {
  for (auto& [key, t] : optimizer) {
    const std::string param = expert_field(key, order);
    if (param.empty()) continue;
    TS_CHECK(t.dim() >= 1 && t.size(0) == experts_,
             "ExpertGroups: optimizer state '{}' of expert parameter '{}' has shape {}, expected "
             "its {} experts first", key, param, shape_str(t.shape()), experts_);
    t = t.narrow(0, first(), local()).contiguous();
  }
}

}  // namespace tessera::parallel
