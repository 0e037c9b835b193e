// Expert parallelism (GShard, DeepSpeed-MoE, Megatron-Core): the E experts of a Mixture-of-
// Experts layer (nn/moe.h) split over the `ep` ranks of a group, E / ep each (rank i holds
// experts [i E/ep, (i+1) E/ep)), every rank routing its own tokens. Installed as the layer's
// dispatch (nn::MoeDispatchScope), it sends each expert's rows to the rank holding it and
// the outputs back:
//   1. the row counts per expert go to their experts' ranks (an all-to-all of E/ep counts);
//   2. the rows, grouped by expert, go by an all-to-all with uneven splits;
//   3. the rows received (by source rank, then expert) are regrouped by expert, and the
//      local experts run as one grouped matmul each;
//   4. the outputs are put back in received order and return by the reverse all-to-all.
// Backward runs the same exchanges in reverse (each all-to-all's gradient is the
// all-to-all with the counts swapped). The comm log records them as CommKind::activations
// ("moe dispatch", "moe combine", and their backward).
//
//   parallel::ExpertParallel ep(*ep_group, /*experts=*/8);
//   nn::MoeDispatchScope scope(&ep);
//   Tensor y = model(x);   // every rank of the group runs the same layers in the same order
//
// Rows sent per step (each direction, forward): sum over the experts e not held here of
// the rows routed to e, times C elements; backward sends the same again.
#pragma once

#include <cstdint>
#include <vector>

#include "nn/moe.h"
#include "parallel/comm/communicator.h"

namespace tessera::parallel {

class ExpertParallel final : public nn::MoeDispatch {
 public:
  // `group`: the ranks the experts are split over; `experts` must divide by its size.
  ExpertParallel(Communicator& group, int64_t experts);
  Tensor run(const Tensor& rows, const std::vector<int64_t>& sizes, const nn::ExpertsFn& experts) override;
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return local_; }

 private:
  Communicator& group_;
  int64_t experts_, local_, first_;
};

// [R, C] rows to the group's members: send_rows[j] rows (consecutive, in member order) to
// member j, recv_rows[j] rows from it; differentiable (backward: the reverse exchange).
Tensor all_to_all_rows(Communicator& group, const Tensor& rows, const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows, const std::string& cause);

}  // namespace tessera::parallel
