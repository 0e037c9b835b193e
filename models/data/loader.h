// Mini-batches over in-memory (inputs, targets) with a deterministic, resumable order and a
// background thread that assembles the next batches while the model trains.
//
//   Loader loader(train.images, train.labels, {.batch_size = 64, .seed = 1});
//   for (Batch b; loader.epoch() < 10;) {
//     if (!loader.next(b)) continue;           // false once per epoch, at its end
//     step(b.inputs, b.targets);
//   }
//   save(loader.epoch(), loader.batch_index());  // resume: loader.set_position(e, i)
//
// Epoch e's sample order is a pure function of (seed, e), so (epoch, batch index) is all a
// checkpoint needs, and prefetching cannot change which batch comes next.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::data {

struct Batch {
  Tensor inputs;   // [b, ...] rows of the inputs, contiguous, CPU
  Tensor targets;  // [b, ...]
  int64_t epoch = 0;
  int64_t index = 0;  // batch index within the epoch
};

struct LoaderOptions {
  int64_t batch_size = 64;
  bool shuffle = true;
  uint64_t seed = 0;
  // Distributed sampling: every rank of `world` sees the same global batches (batch_size
  // rows, the same order) and takes its slice of each, rank r the r-th of world array_split
  // blocks (the first blocks one row larger when the rows do not divide), so the slices of
  // all ranks concatenate to the one-rank batch. Epoch length is the one-rank loader's.
  int rank = 0;
  int world = 1;
  // Drop the last, smaller batch of each epoch instead of delivering it.
  bool drop_last = false;
  // Batches assembled ahead on a background thread; 0 assembles on the caller's thread.
  int prefetch = 2;
  // Optional: runs on each batch where it is assembled (the prefetch thread), e.g. for
  // augmentation. It must be a pure function of the batch (use batch.epoch/index to key any
  // randomness) for the order to stay deterministic; what it throws is rethrown by next().
  std::function<void(Batch&)> transform = nullptr;
};

class Loader {
 public:
  // inputs [N, ...] and targets [N, ...] on any device; copied to contiguous CPU tensors
  // when they are not already.
  Loader(const Tensor& inputs, const Tensor& targets, LoaderOptions options = {});
  ~Loader();  // stops and joins the prefetch thread
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Fills `out` with the batch at (epoch(), batch_index()) and advances. At the end of an
  // epoch returns false instead and moves to the next epoch's first batch. On an error
  // (e.g. thrown by the transform) rethrows it and leaves the position unchanged.
  // One consumer thread only.
  bool next(Batch& out);

  int64_t epoch() const { return epoch_; }
  // Index of the batch the next call to next() returns (== batches_per_epoch() when the
  // next call ends the epoch).
  int64_t batch_index() const { return index_; }
  // Resumes at (epoch, batch_index): the batches that follow are those an uninterrupted
  // loader with the same data and options delivers from there.
  void set_position(int64_t epoch, int64_t batch_index);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t num_samples() const { return num_samples_; }
  const LoaderOptions& options() const { return options_; }

  // The sample order of `epoch`: Fisher-Yates driven by Philox draws keyed by the seed at
  // counters epoch * 2^32 + i; the identity without shuffle.
  std::vector<int64_t> permutation(int64_t epoch) const;

 private:
  // The permutation of the most recent epoch assembled, kept by whichever thread assembles.
  struct OrderCache {
    int64_t epoch = -1;
    std::vector<int64_t> order;
  };
  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };

  Batch assemble(int64_t epoch, int64_t index, OrderCache& cache) const;
  void start_worker();
  void stop_worker();
  void worker_loop(int64_t epoch, int64_t index);

  Tensor inputs_, targets_;
  LoaderOptions options_;
  int64_t num_samples_ = 0;
  int64_t batches_per_epoch_ = 0;
  int64_t epoch_ = 0;
  int64_t index_ = 0;
  OrderCache caller_cache_;  // prefetch == 0 only

  std::thread worker_;
  std::mutex mu_;
  std::condition_variable ready_;  // a slot was queued
  std::condition_variable space_;  // a slot was taken, or stop
  std::deque<Slot> queue_;         // batches in delivery order, starting at the position
  bool stop_ = false;
};

}  // namespace tessera::data
