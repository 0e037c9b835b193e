// Expert parallelism (GShard, DeepSpeed-MoE, Megatron-Core): the E experts of a Mixture-of-
// Experts layer (nn/moe.h) split over the `ep` ranks of a group, E / ep each (rank i holds
// experts [i E/ep, (i+1) E/ep)), every rank routing its own tokens. Installed as the layer's
// dispatch (nn::MoeDispatchScope), it sends each expert's rows to the rank holding it and
// the outputs back:
//   1. the row counts per expert go to their experts' ranks (an all-to-all of E/ep counts);
//   2. the rows for other members' experts, grouped by expert, go by an all-to-all with
//      uneven splits, launched asynchronously: while they travel, this rank's own rows for
//      its own experts (which need no exchange) run through them;
//   3. the rows received (by source rank, then expert) are regrouped by expert, and the
//      local experts run as one grouped matmul each;
//   4. the outputs are put back in received order and return by the reverse all-to-all,
//      and the own rows' outputs join them in place.
// Backward runs the same exchanges in reverse (each all-to-all's gradient is the
// all-to-all with the counts swapped), synchronously: the autograd engine runs one node at
// a time. The comm log records them as CommKind::activations ("moe dispatch", "moe
// combine", and their backward).
//
//   parallel::ExpertParallel ep(*ep_group, /*experts=*/8);
//   nn::MoeDispatchScope scope(&ep);
//   Tensor y = model(x);   // every rank of the group runs the same layers in the same order
//
// Rows sent per step (each direction, forward): sum over the experts e not held here of
// the rows routed to e, times C elements; backward sends the same again.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "nn/moe.h"
#include "parallel/comm/communicator.h"
#include "parallel/data_parallel.h"

namespace tessera::parallel {

class ExpertParallel final : public nn::MoeDispatch {
 public:
  // `group`: the ranks the experts are split over; `experts` must divide by its size.
  ExpertParallel(Communicator& group, int64_t experts);
  Tensor run(const Tensor& rows, const std::vector<int64_t>& sizes, const nn::ExpertsFn& experts) override;
  std::pair<int64_t, int64_t> local_experts() const override { return {first_, local_}; }
  int64_t first_expert() const { return first_; }

 private:
  Communicator& group_;
  int64_t experts_, local_, first_;
};

// The groups expert parallelism cuts a data-parallel group into (Megatron-Core's expert and
// expert-data-parallel groups): `ep` consecutive dp ranks share out the experts, E / ep each
// (the ep group, whose dispatch() exchanges the rows), and the dp / ep ranks at the same
// place in their ep groups hold the same experts (the expert-data-parallel group, `edp`).
// After keep(), each rank holds only its experts' parameters: ZeRO and DDP reduce (and
// shard) them over edp with subgroup(), everything else over dp. Checkpoints stay in the
// single-device layout: gather() assembles the experts whole over ep, slice() cuts a whole
// dict back to this rank's.
//
//   ExpertGroups experts(dp, /*ep=*/2, /*experts=*/8);   // collective over dp
//   { auto only = experts.building();  model = make_model(); }  // (or build whole, then:)
//   experts.keep(*model);                                 // before ZeRO and the optimizer
//   ZeroOptions z;  z.subgroup = experts.subgroup(z.average);
//   ZeroDataParallel zero(*model, dp, z);
//   nn::MoeDispatchScope d(&experts.dispatch());          // around every forward
//   nn::StateDict whole = zero.model_state_dict();  experts.gather(whole);  // collective over ep
class ExpertGroups {
 public:
  // Collective over `dp` (every member, the same ep and experts); ep must divide dp's size
  // and the experts.
  ExpertGroups(Communicator& dp, int64_t ep, int64_t experts);
  Communicator& ep() const { return *ep_; }
  Communicator& edp() const { return *edp_; }
  ExpertParallel& dispatch() const { return *dispatch_; }
  int64_t first() const { return dispatch_->first_expert(); }
  int64_t local() const { return dispatch_->local_experts().second; }
  // Every nn::MixtureOfExperts in `module` keeps this rank's experts (a layer built under
  // building() holds them already); their parameters' names (as `module` names them) are
  // the ones holds() answers for. Returns how many MoE layers it found.
  int keep(nn::Module& module);
  // While alive, MoE layers are built with this rank's experts only (nn::MoeBuildScope): the
  // model never holds all of them.
  [[nodiscard]] nn::MoeBuildScope building() const { return nn::MoeBuildScope(first(), local()); }
  bool holds(const std::string& name) const { return names_.count(name) == 1; }
  // The single-device shape of parameter `name`, of shape `here` on this rank.
  Shape whole_shape(const std::string& name, const Shape& here) const {
    Shape s = here;
    if (holds(name)) s[0] = experts_;
    return s;
  }
  // The parameters keep() cut, reduced over edp; `average`: the wrapper averages over dp
  // (the scale then makes edp's average dp's: 1 / ep).
  ParamSubgroup subgroup(bool average) const;
  // Collective over ep: the expert parameters' tensors in a model state dict, and the state
  // of those parameters in an optimizer state dict ("state.<i>.<field>", parameter i being
  // order[i]), assembled whole along their first dim.
  void gather(nn::StateDict& model) const;
  // Parameter `name`'s tensor (or its per-element state) `t` whole along dim 0: gathered
  // over ep when it is an expert's (collective then), `t` itself otherwise.
  Tensor whole(const std::string& name, const Tensor& t) const;
  void gather(std::map<std::string, Tensor>& optimizer, const std::vector<std::string>& order) const;
  // The inverse on whole dicts: this rank's experts' rows (nothing collective).
  void slice(nn::StateDict& model) const;
  void slice(std::map<std::string, Tensor>& optimizer, const std::vector<std::string>& order) const;

 private:
  // Parameter i's name in an optimizer state key "state.<i>.<field>" (empty: not an
  // expert's, or a scalar field).
  std::string expert_field(const std::string& key, const std::vector<std::string>& order) const;
  CommPtr ep_, edp_;
  std::unique_ptr<ExpertParallel> dispatch_;
  int64_t experts_;
  std::set<std::string> names_;
};

// [R, C] rows to the group's members: send_rows[j] rows (consecutive, in member order) to
// member j, recv_rows[j] rows from it; differentiable (backward: the reverse exchange).
Tensor all_to_all_rows(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, const std::string& cause);

// The same exchange launched now and finished by wait(), so that work in between overlaps
// it; wait() returns the rows received, differentiable as all_to_all_rows's.
class PendingRows {
 public:
  PendingRows(Communicator& group, const Tensor& rows, std::vector<int64_t> send_rows,
              std::vector<int64_t> recv_rows, std::string cause);
  ~PendingRows();
  PendingRows(const PendingRows&) = delete;
  PendingRows& operator=(const PendingRows&) = delete;
  Tensor wait();

 private:
  Communicator* group_;
  Tensor rows_, sent_, out_;
  std::vector<int64_t> send_, recv_;
  std::string cause_;
  WorkHandle work_;
};

}  // namespace tessera::parallel
