#include "models/data/loader.h"

#include <cassert>
#include <cstring>
#include <numeric>
#include <system_error>
#include <utility>

#include "tensor/random.h"

namespace tessera::data {
namespace {

// Contiguous CPU data, copied only when needed; batches are memcpy'd rows of it.
Tensor host_contiguous(const Tensor& t) {
  Tensor host = t.device().is_cpu() ? t : t.to(kCPU);
  return host.is_contiguous() ? host : host.contiguous();
}

// Rows order[begin, begin + count) of `src` ([N, ...] contiguous) into a new [count, ...].
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>* order, int64_t begin,
                   int64_t count) {
  Shape shape = src.shape();
  const int64_t row_bytes = src.nbytes() / shape[0];
  shape[0] = count;
  Tensor out = Tensor::empty(shape, src.dtype(), kCPU);
  const char* from = static_cast<const char*>(src.raw_data());
  char* to = static_cast<char*>(out.raw_data());
  if (row_bytes == 0) return out;
  if (order == nullptr) {  // unshuffled: the rows are already consecutive
    std::memcpy(to, from + begin * row_bytes, static_cast<size_t>(count * row_bytes));
    return out;
  }
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(to + i * row_bytes, from + (*order)[begin + i] * row_bytes,
                static_cast<size_t>(row_bytes));
  }
  return out;
}

}  // namespace

Loader::Loader(const Tensor& inputs, const Tensor& targets, LoaderOptions options)
    : options_(std::move(options)) {
  TS_CHECK(inputs.defined() && targets.defined(), "Loader: inputs and targets must be defined");
  TS_CHECK(inputs.dim() >= 1 && targets.dim() >= 1,
           "Loader: inputs and targets need a leading sample dim, got shapes {} and {}",
           shape_str(inputs.shape()), shape_str(targets.shape()));
  TS_CHECK(inputs.size(0) == targets.size(0),
           "Loader: inputs {} and targets {} hold different numbers of samples",
           shape_str(inputs.shape()), shape_str(targets.shape()));
  num_samples_ = inputs.size(0);
  TS_CHECK(num_samples_ > 0, "Loader: no samples (inputs shape {})", shape_str(inputs.shape()));
  // Permutation counters put the epoch in the high 32 bits and the sample in the low 32.
  TS_CHECK(num_samples_ < (int64_t{1} << 32), "Loader: {} samples exceed 2^32", num_samples_);
  TS_CHECK(options_.batch_size > 0, "Loader: batch_size must be positive, got {}",
           options_.batch_size);
  TS_CHECK(options_.prefetch >= 0, "Loader: prefetch must be >= 0, got {}", options_.prefetch);
  TS_CHECK(options_.world >= 1 && options_.rank >= 0 && options_.rank < options_.world,
           "Loader: rank {} of world {} is not a rank (need 0 <= rank < world, world >= 1)",
           options_.rank, options_.world);
  batches_per_epoch_ = options_.drop_last
                           ? num_samples_ / options_.batch_size
                           : (num_samples_ + options_.batch_size - 1) / options_.batch_size;
  TS_CHECK(batches_per_epoch_ > 0,
           "Loader: {} samples with batch_size {} and drop_last give no batches", num_samples_,
           options_.batch_size);
  inputs_ = host_contiguous(inputs);
  targets_ = host_contiguous(targets);
}

Loader::~Loader() { stop_worker(); }

std::vector<int64_t> Loader::permutation(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(num_samples_));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!options_.shuffle) return order;
  const uint64_t base = static_cast<uint64_t>(epoch) << 32;
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const philox::Block r = philox::philox4x32(base | static_cast<uint64_t>(i), options_.seed);
    const uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
    // Uniform in [0, i] by multiply-high (Lemire); the bias is below 2^-32 for N < 2^32.
    const int64_t j = static_cast<int64_t>(
        (static_cast<unsigned __int128>(x) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

Batch Loader::assemble(int64_t epoch, int64_t index, OrderCache& cache) const {
  const std::vector<int64_t>* order = nullptr;
  if (options_.shuffle) {
    if (cache.epoch != epoch) {
      cache.order = permutation(epoch);
      cache.epoch = epoch;
    }
    order = &cache.order;
  }
  int64_t begin = index * options_.batch_size;
  int64_t count = std::min(options_.batch_size, num_samples_ - begin);
  if (options_.world > 1) {  // this rank's block of the global batch (array_split)
    const int64_t base = count / options_.world, extra = count % options_.world;
    begin += options_.rank * base + std::min<int64_t>(options_.rank, extra);
    count = base + (options_.rank < extra ? 1 : 0);
  }
  Batch batch;
  batch.inputs = gather_rows(inputs_, order, begin, count);
  batch.targets = gather_rows(targets_, order, begin, count);
  batch.epoch = epoch;
  batch.index = index;
  if (options_.transform) options_.transform(batch);
  return batch;
}

bool Loader::next(Batch& out) {
  if (index_ >= batches_per_epoch_) {
    ++epoch_;
    index_ = 0;
    return false;
  }
  if (options_.prefetch == 0) {
    out = assemble(epoch_, index_, caller_cache_);
    ++index_;
    return true;
  }
  if (!worker_.joinable()) start_worker();
  Slot slot;
  {
    std::unique_lock<std::mutex> lock(mu_);
    ready_.wait(lock, [&] { return !queue_.empty(); });
    slot = std::move(queue_.front());
    queue_.pop_front();
  }
  space_.notify_one();
  if (slot.error) {
    // The worker stops after queueing an error; joining it here means the next call starts
    // a fresh one at this same position (and retries the batch).
    stop_worker();
    std::rethrow_exception(slot.error);
  }
  assert(slot.batch.epoch == epoch_ && slot.batch.index == index_);
  out = std::move(slot.batch);
  ++index_;
  return true;
}

void Loader::set_position(int64_t epoch, int64_t batch_index) {
  TS_CHECK(epoch >= 0 && epoch < (int64_t{1} << 32),
           "Loader::set_position: epoch must be in [0, 2^32), got {}", epoch);
  TS_CHECK(batch_index >= 0 && batch_index <= batches_per_epoch_,
           "Loader::set_position: batch_index {} outside [0, {}] (batches per epoch)", batch_index,
           batches_per_epoch_);
  // The queued batches belong to the old position; a worker restarts lazily from the new.
  stop_worker();
  epoch_ = epoch;
  index_ = batch_index;
}

void Loader::start_worker() {
  assert(queue_.empty() && !stop_);
  try {
    worker_ = std::thread([this, epoch = epoch_, index = index_] { worker_loop(epoch, index); });
  } catch (const std::system_error& e) {
    fail("Loader: cannot start the thread that prepares batches: {}", e.what());
  }
}

void Loader::stop_worker() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  space_.notify_all();
  worker_.join();
  queue_.clear();
  stop_ = false;
}

void Loader::worker_loop(int64_t epoch, int64_t index) {
  OrderCache cache;
  for (;;) {
    if (index >= batches_per_epoch_) {
      ++epoch;
      index = 0;
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      space_.wait(lock,
                  [&] { return stop_ || queue_.size() < static_cast<size_t>(options_.prefetch); });
      if (stop_) return;
    }
    // Assembly runs unlocked: the consumer keeps taking earlier batches meanwhile.
    Slot slot;
    try {
      slot.batch = assemble(epoch, index, cache);
    } catch (...) {
      slot.error = std::current_exception();
    }
    const bool failed = slot.error != nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      queue_.push_back(std::move(slot));
    }
    ready_.notify_one();
    if (failed) return;
    ++index;
  }
}

}  // namespace tessera::data
