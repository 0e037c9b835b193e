// The communication hook point of data parallelism: a bucket's gradient reduction, replaced.
// DistributedDataParallel (DdpOptions::comm_hook) hands each bucket of each synchronising
// round to the hook instead of launching its all-reduce; the hook reduces the bucket's buffer
// in place (exactly, or approximately: a compressed reduction) and returns the work in
// flight, which DDP waits for before the gradients are read.
//
//   auto hook = std::make_shared<PowerSgd>(PowerSgdOptions{.rank = 2});   // parallel/powersgd.h
//   DistributedDataParallel ddp(*model, comm, {.comm_hook = hook});
//
// Every rank calls reduce() for the same buckets in the same order (bucket index order in
// each round), and end_round() once per round after every bucket's work was waited for, so a
// hook may issue collectives in either, in any order that is the same on every rank.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "parallel/comm/communicator.h"
#include "tensor/tensor.h"

namespace tessera::parallel {

struct GradBucket {
  int index = 0;   // 0, 1, ... in launch order
  Tensor buffer;   // flat and contiguous: the gradients back to back
  std::vector<Tensor> gradients;  // views of buffer, each in its parameter's shape
  std::vector<std::string> names;
  bool average = true;  // DdpOptions::average: the mean over the group (else the sum)
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Short name for messages and logs ("powersgd").
  virtual std::string name() const = 0;
  // Reduces bucket.buffer in place over `comm`; the returned work (completed_work() when
  // done already) is waited for before the buffer is read.
  virtual WorkHandle reduce(Communicator& comm, const GradBucket& bucket) = 0;
  // After every bucket of a synchronising round was reduced and waited for.
  virtual void end_round() {}
  // Everything needed to resume bitwise (error feedback, warm-start factors, counters), as
  // tensors keyed by name; load_state_dict validates before changing anything.
  virtual std::map<std::string, Tensor> state_dict() const { return {}; }
  virtual void load_state_dict(const std::map<std::string, Tensor>& /*dict*/) {}
  // Elements this hook sent to the wire in the last round (what an all-reduce of those
  // elements sends), and what a plain all-reduce of the same buckets would have sent.
  struct Traffic {
    int64_t sent = 0, uncompressed = 0;
  };
  virtual Traffic last_round() const { return {}; }
  // Whether reduce() leaves the whole bucket reduced over the group (exactly or
  // approximately), so ZeRO stages 1-3 can take their block of it; a hook that leaves each
  // rank its own gradient for its optimizer to reduce (1-bit Adam's) says false.
  virtual bool full_reduction() const { return true; }
};

}  // namespace tessera::parallel
