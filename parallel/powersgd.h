// PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
// for Distributed Optimization", NeurIPS 2019) as a data-parallel comm hook (comm_hook.h),
// the algorithm of PyTorch's powerSGD_hook:
//
//   auto hook = std::make_shared<PowerSgd>(PowerSgdOptions{.rank = 1, .start_iter = 10});
//   DistributedDataParallel ddp(*model, comm, {.comm_hook = hook});
//
// For the first start_iter synchronising rounds every bucket is all-reduced exactly. Then,
// per bucket:
//   input = gradients + error (the error feedback: what earlier rounds did not send)
//   each gradient of >= 2 dims is a matrix M [n, m] (dim 0 by the rest); with r = min(n, m,
//   rank) it is compressed when n m > min_compression_rate (n + m) r; the others (vectors,
//   biases, matrices too small to gain) are all-reduced as they are, in one flat tensor;
//   per compressed matrix: Q [m, r] (the last round's with warm_start, else drawn from
//   Philox keyed by the seed, the gradient's name and the round: the same on every rank and
//   in any bucket layout, DDP's or ZeRO's segments), orthogonalized; P = M Q; all-reduce
//   the Ps; orthogonalize each P (Gram-Schmidt); Q = M^T P; all-reduce the Qs (divided by
//   the group size when averaging); M is replaced by P Q^T;
//   error = input - the result (PyTorch's: the whole bucket, the exactly reduced tensors
//   included, whose errors sum to zero over the group); with a sum (DdpOptions::average
//   false) the result is the sum of the inputs, and the error input - result / group size.
// P and Q and the orthogonalization are f32 (f64 for f64 gradients) whatever the gradients'
// dtype. Three all-reduces per bucket (the uncompressed tensors and the Ps are in flight
// while backward goes on; the Qs follow when DDP waits), of n r + m r elements per matrix
// instead of n m.
//
// One difference from PyTorch: its round counter advances after bucket 0, so at the switch
// its later buckets are compressed a round earlier than bucket 0; here every bucket of a
// round does the same (the same result with one bucket).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm_hook.h"
#include "tensor/random.h"

namespace tessera::parallel {

struct PowerSgdOptions {
  int64_t rank = 1;                   // the approximation's rank r
  int64_t start_iter = 10;            // synchronising rounds reduced exactly first
  double min_compression_rate = 2.0;  // compress when n m > rate (n + m) r
  bool error_feedback = true;
  bool warm_start = true;             // start each round's Q from the last round's
  double orthogonalization_epsilon = 0.0;  // added to each column's norm before dividing
  uint64_t seed = 0;                  // keys the initial Qs' Philox draws (with name, round)
  // The initial Q [m, r] of compressed matrix `tensor` (its index among the bucket's
  // gradients) of bucket `bucket`, instead of a draw (to compare with another
  // implementation's); it is orthogonalized as a draw is. Null: randn.
  std::function<Tensor(int bucket, int tensor, const Shape& shape)> initial_q = nullptr;
};

class PowerSgd : public CommHook {
 public:
  explicit PowerSgd(PowerSgdOptions options = {});

  std::string name() const override { return "powersgd"; }
  WorkHandle reduce(Communicator& comm, const GradBucket& bucket) override;
  void end_round() override;
  // "rounds" (i64), "error.<bucket>" and "q.<bucket>.<tensor>" (the warm-start factors, by
  // the gradient's index in its bucket). Loading ignores an older version's "rng".
  std::map<std::string, Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, Tensor>& dict) override;
  Traffic last_round() const override { return last_; }

  const PowerSgdOptions& options() const { return options_; }
  // Synchronising rounds completed (compression starts when this reaches start_iter).
  int64_t rounds() const { return rounds_; }

  // Gram-Schmidt on the columns of `m` [n, k] in place, in order: each column divided by its
  // norm (+ epsilon; a zero column stays zero), then removed from the columns after it.
  static void orthogonalize(const Tensor& m, double epsilon);

  struct BucketState {
    Tensor error;             // the bucket's elements, its dtype (undefined: none yet)
    std::map<int, Tensor> q;  // per compressed gradient (index in the bucket): [m, r]
  };

 private:
  PowerSgdOptions options_;
  int64_t rounds_ = 0;
  std::map<int, std::shared_ptr<BucketState>> buckets_;
  Traffic last_, current_;
};

}  // namespace tessera::parallel
