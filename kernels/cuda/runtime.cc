// Streams, the caching allocator and staged copies of the CUDA backend (see runtime.h).
#include "kernels/cuda/runtime.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/copy_kernels.cuh"
#include "tensor/error.h"
#include "tensor/host_pinning.h"

namespace tessera::cuda_kernels {

void cuda_check(cudaError_t e, std::string_view what, Device d) {
  if (e != cudaSuccess) [[unlikely]] {
    cudaGetLastError();  // clear a sticky-free error so later calls report their own
    fail("cuda: {} on {} failed: {}", what, d, cudaGetErrorString(e));
  }
}

void run_launch(std::string_view op, Device d, const std::function<void()>& launch) {
  try {
    launch();
  } catch (const CudaLaunchError& e) {
    fail("{}: CUDA kernel on {} failed: {}", op, d, e.what());
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) [[unlikely]] fail("{}: CUDA kernel on {} failed: {}", op, d, cudaGetErrorString(e));
}

DeviceGuard::DeviceGuard(Device d) {
  cudaGetDevice(&previous_);
  if (previous_ != d.index) cuda_check(cudaSetDevice(d.index), "cudaSetDevice", d);
}
DeviceGuard::~DeviceGuard() { cudaSetDevice(previous_); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace {

constexpr int kMaxDevices = 64;

// Checked on every allocation, so the device count is read from CUDA once.
void check_index(Device d) {
  static const int n = device_count();
  TS_CHECK(d.is_cuda() && d.index >= 0 && d.index < kMaxDevices, "cuda: bad device {}", d);
  TS_CHECK(d.index < n, "cuda: {} requested but {} CUDA device(s) are visible", d, n);
}

std::mutex& streams_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

cudaStream_t compute_stream(Device) { return cudaStreamLegacy; }

cudaStream_t comm_stream(Device d) {
  static std::array<cudaStream_t, kMaxDevices> streams{};
  check_index(d);
  std::lock_guard<std::mutex> lock(streams_mutex());
  if (streams[d.index] == nullptr) {
    DeviceGuard g(d);
    cuda_check(cudaStreamCreateWithFlags(&streams[d.index], cudaStreamNonBlocking),
               "cudaStreamCreate (communication)", d);
  }
  return streams[d.index];
}

void stream_wait(cudaStream_t waiter, cudaStream_t signaller, Device d) {
  DeviceGuard g(d);
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate", d);
  cuda_check(cudaEventRecord(e, signaller), "cudaEventRecord", d);
  cuda_check(cudaStreamWaitEvent(waiter, e, 0), "cudaStreamWaitEvent", d);
  cudaEventDestroy(e);  // released by CUDA once the wait is satisfied
}

void synchronize(Device d) {
  DeviceGuard g(d);
  cuda_check(cudaStreamSynchronize(compute_stream(d)), "synchronize", d);
}

// ---------------------------------------------------------------------------------------
// The caching allocator.
//
// Sizes are rounded to classes: multiples of 512 bytes up to 1 MiB, of 2 MiB above. A freed
// block goes to a free list of its class and serves the next request of that class on the
// same stream without a cudaMalloc; kernels are ordered on that stream, so the new owner's
// work runs after the old owner's. A block also used on another stream (record_stream) is
// held back until events recorded on those streams at free time have completed. cudaMalloc
// failing empties the cache (cudaFree of every free block) and tries once more.
namespace {

int64_t round_size(int64_t n) {
  constexpr int64_t kSmall = 512, kLarge = 2 << 20, kSmallLimit = 1 << 20;
  if (n <= 0) return 0;
  if (n <= kSmallLimit) return (n + kSmall - 1) / kSmall * kSmall;
  return (n + kLarge - 1) / kLarge * kLarge;
}

struct Block {
  void* ptr = nullptr;
  int64_t size = 0;  // rounded
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> other_streams;
};

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(Device d) : device_(d) {}

  void* allocate(int64_t nbytes) override {
    if (nbytes <= 0) return nullptr;
    const int64_t size = round_size(nbytes);
    const cudaStream_t stream = compute_stream(device_);
    std::lock_guard<std::mutex> lock(mu_);
    check_limit(device_, size, stats_.allocated_bytes);
    ++stats_.num_allocs;
    process_pending_locked();
    auto& list = free_[{stream, size}];
    Block b;
    if (!list.empty()) {
      b = std::move(list.back());
      list.pop_back();
      ++stats_.num_cache_hits;
    } else {
      b.size = size;
      b.stream = stream;
      b.ptr = malloc_locked(size);
    }
    stats_.allocated_bytes += size;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    void* p = b.ptr;
    live_.emplace(p, std::move(b));
    return p;
  }

  void deallocate(void* ptr, int64_t) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    TS_CHECK(it != live_.end(), "cuda allocator: freeing {} which it did not allocate", ptr);
    Block b = std::move(it->second);
    live_.erase(it);
    stats_.allocated_bytes -= b.size;
    if (b.other_streams.empty()) {
      free_[{b.stream, b.size}].push_back(std::move(b));
      return;
    }
    // Used on other streams: reusable once their work queued so far has finished.
    Pending pending{std::move(b), {}};
    DeviceGuard g(device_);
    for (cudaStream_t s : pending.block.other_streams) {
      cudaEvent_t e = nullptr;
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate", device_);
      cuda_check(cudaEventRecord(e, s), "cudaEventRecord", device_);
      pending.events.push_back(e);
    }
    pending.block.other_streams.clear();
    pending_.push_back(std::move(pending));
  }

  void record_stream(void* ptr, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    TS_CHECK(it != live_.end(), "cuda record_stream: {} is not the start of a live block", ptr);
    Block& b = it->second;
    if (stream != b.stream &&
        std::find(b.other_streams.begin(), b.other_streams.end(), stream) == b.other_streams.end()) {
      b.other_streams.push_back(stream);
    }
  }

  MemoryStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return MemoryStats{stats_.allocated_bytes, stats_.peak_allocated_bytes, stats_.reserved_bytes,
                       stats_.num_allocs};
  }
  CachingStats caching_stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }
  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    empty_cache_locked();
  }

 private:
  struct Pending {
    Block block;
    std::vector<cudaEvent_t> events;
  };

  void process_pending_locked() {
    for (size_t i = 0; i < pending_.size();) {
      bool done = true;
      for (cudaEvent_t e : pending_[i].events) {
        const cudaError_t r = cudaEventQuery(e);
        if (r == cudaErrorNotReady) {
          cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++i;
        continue;
      }
      for (cudaEvent_t e : pending_[i].events) cudaEventDestroy(e);
      Block b = std::move(pending_[i].block);
      free_[{b.stream, b.size}].push_back(std::move(b));
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  void* malloc_locked(int64_t size) {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, static_cast<size_t>(size));
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      empty_cache_locked();
      e = cudaMalloc(&p, static_cast<size_t>(size));
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      fail("cuda: out of memory on {}: tried to allocate {} bytes; {} bytes allocated by "
           "Tessera, {} reserved, {} free of {} on the device ({})",
           device_, size, stats_.allocated_bytes, stats_.reserved_bytes, free_b, total_b,
           cudaGetErrorString(e));
    }
    ++stats_.num_cuda_mallocs;
    stats_.reserved_bytes += size;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    return p;
  }

  void empty_cache_locked() {
    DeviceGuard g(device_);
    for (auto& [key, list] : free_) {
      for (Block& b : list) {
        cudaFree(b.ptr);  // synchronises the device: no kernel still uses it
        stats_.reserved_bytes -= b.size;
        ++stats_.num_frees_to_system;
      }
      list.clear();
    }
  }

  Device device_;
  mutable std::mutex mu_;
  CachingStats stats_;
  std::map<std::pair<cudaStream_t, int64_t>, std::vector<Block>> free_;
  std::unordered_map<void*, Block> live_;
  std::vector<Pending> pending_;
};

CachingAllocator& caching_allocator(Device d) {
  static std::array<std::atomic<CachingAllocator*>, kMaxDevices> allocators{};
  static std::mutex mu;
  check_index(d);
  if (CachingAllocator* a = allocators[d.index].load(std::memory_order_acquire)) return *a;
  std::lock_guard<std::mutex> lock(mu);
  if (allocators[d.index].load() == nullptr) allocators[d.index].store(new CachingAllocator(d));
  return *allocators[d.index].load();
}

const bool kAllocatorRegistered =
    (register_allocator(DeviceType::cuda, [](Device d) -> Allocator& { return caching_allocator(d); }),
     true);

// The host tier's blocks (offloaded optimizer state, gradients, parameters) pinned where a GPU
// is present: copy_to_device / copy_to_host then move them by DMA, without the staging copy.
// Best effort: a machine without a GPU, or a failed registration, leaves the block pageable.
const bool kHostPinningRegistered = (register_host_pinning(HostPinning{
    [](void* p, int64_t n) {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 ||
          cudaHostRegister(p, static_cast<size_t>(n), cudaHostRegisterPortable) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky error: the block stays pageable
      }
    },
    [](void* p, int64_t) {
      if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();  // it was never pinned
    }}), true);

// Whether `p` is page-locked host memory (cudaHostAlloc'd or registered).
bool pinned_host(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

}  // namespace

namespace {

// ZeRO-Offload's gradient shards into their pinned host-tier blocks on the communication
// stream, after the compute that produced them, while backward goes on (the offload waits
// before it reads them); the device block is kept until the copy is done.
const bool kAsyncToHostRegistered = (register_async_to_host(
    static_cast<int>(DeviceType::cuda),
    [](void* dst, const void* src, int64_t nbytes, int index, void* block) -> std::function<void()> {
      if (nbytes <= 0 || !pinned_host(dst)) return nullptr;
      const Device d = cuda(index);
      DeviceGuard g(d);
      const cudaStream_t comm = comm_stream(d);
      stream_wait(comm, compute_stream(d), d);
      cudaEvent_t done = nullptr;
      cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate", d);
      try {
        cuda_check(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost, comm),
                   "cudaMemcpyAsync D2H (gradient to the host tier)", d);
        cuda_check(cudaEventRecord(done, comm), "cudaEventRecord", d);
        record_stream(d, block, comm);
      } catch (...) {
        cudaStreamSynchronize(comm);  // nothing left in flight over the event or the blocks
        cudaEventDestroy(done);
        throw;
      }
      return [done, d] {
        DeviceGuard g(d);
        const cudaError_t e = cudaEventSynchronize(done);
        cudaEventDestroy(done);
        cuda_check(e, "cudaEventSynchronize (gradient to the host tier)", d);
      };
    }), true);

}  // namespace

CachingStats caching_stats(Device d) { return caching_allocator(d).caching_stats(); }
void empty_cache(Device d) { caching_allocator(d).empty_cache(); }
void record_stream(Device d, void* ptr, cudaStream_t stream) {
  caching_allocator(d).record_stream(ptr, stream);
}

// ---------------------------------------------------------------------------------------
// Pinned staging: two 4 MiB page-locked buffers per device, used alternately so that the
// host copy into one overlaps the DMA out of the other.
namespace {

constexpr int64_t kStageBytes = 4 << 20;

struct Staging {
  std::mutex mu;
  void* buf[2] = {nullptr, nullptr};
  cudaEvent_t done[2] = {nullptr, nullptr};
  bool used[2] = {false, false};
};

Staging& staging(Device d) {
  static std::array<Staging, kMaxDevices> all;
  check_index(d);
  Staging& s = all[d.index];
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.buf[0] == nullptr) {
      DeviceGuard g(d);  // the events belong to d
      for (int i = 0; i < 2; ++i) {
        cuda_check(cudaEventCreateWithFlags(&s.done[i], cudaEventDisableTiming), "cudaEventCreate", d);
        void* p = nullptr;
        cuda_check(cudaHostAlloc(&p, kStageBytes, cudaHostAllocPortable), "cudaHostAlloc", d);
        s.buf[i] = p;
      }
    }
  }
  return s;
}

}  // namespace

void copy_to_device(void* dst, const void* src, int64_t nbytes, Device d) {
  if (nbytes <= 0) return;
  DeviceGuard g(d);
  if (pinned_host(src)) {
    // DMA straight from the pinned block; waited for, since its owner may reuse it as soon
    // as this returns (the host tier pages a segment out right after its copy).
    const cudaStream_t stream = compute_stream(d);
    cuda_check(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync H2D (pinned)", d);
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize", d);
    return;
  }
  Staging& s = staging(d);
  std::lock_guard<std::mutex> lock(s.mu);
  const cudaStream_t stream = compute_stream(d);
  int which = 0;
  for (int64_t pos = 0; pos < nbytes; pos += kStageBytes, which ^= 1) {
    const int64_t n = std::min(kStageBytes, nbytes - pos);
    if (s.used[which]) cuda_check(cudaEventSynchronize(s.done[which]), "cudaEventSynchronize", d);
    std::memcpy(s.buf[which], static_cast<const char*>(src) + pos, static_cast<size_t>(n));
    cuda_check(cudaMemcpyAsync(static_cast<char*>(dst) + pos, s.buf[which], static_cast<size_t>(n),
                               cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync H2D", d);
    cuda_check(cudaEventRecord(s.done[which], stream), "cudaEventRecord", d);
    s.used[which] = true;
  }
}

void copy_to_host(void* dst, const void* src, int64_t nbytes, Device d) {
  if (nbytes <= 0) return;
  DeviceGuard g(d);
  if (pinned_host(dst)) {  // DMA straight into the pinned block
    const cudaStream_t stream = compute_stream(d);
    cuda_check(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync D2H (pinned)", d);
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize", d);
    return;
  }
  Staging& s = staging(d);
  std::lock_guard<std::mutex> lock(s.mu);
  const cudaStream_t stream = compute_stream(d);
  // Chunk k is copied out of the device while chunk k-1 is copied out of the staging buffer.
  const int64_t chunks = (nbytes + kStageBytes - 1) / kStageBytes;
  auto issue = [&](int64_t k) {
    const int64_t pos = k * kStageBytes, n = std::min(kStageBytes, nbytes - pos);
    const int which = static_cast<int>(k & 1);
    cuda_check(cudaMemcpyAsync(s.buf[which], static_cast<const char*>(src) + pos,
                               static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync D2H", d);
    cuda_check(cudaEventRecord(s.done[which], stream), "cudaEventRecord", d);
    s.used[which] = true;
  };
  issue(0);
  for (int64_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks) {
      // The buffer chunk k+1 uses was drained on the host in iteration k-1.
      issue(k + 1);
    }
    const int which = static_cast<int>(k & 1);
    cuda_check(cudaEventSynchronize(s.done[which]), "cudaEventSynchronize", d);
    const int64_t pos = k * kStageBytes, n = std::min(kStageBytes, nbytes - pos);
    std::memcpy(static_cast<char*>(dst) + pos, s.buf[which], static_cast<size_t>(n));
  }
}

// ---------------------------------------------------------------------------------------

DevTensor dev_tensor(const Tensor& t) {
  TS_CHECK(t.dim() <= kMaxDims, "cuda: tensor {} has {} dims; the CUDA kernels take at most {}",
           shape_str(t.shape()), t.dim(), kMaxDims);
  DevTensor d;
  d.data = t.raw_data();
  d.dtype = static_cast<int>(t.dtype());
  d.ndim = static_cast<int>(t.dim());
  d.numel = t.numel();
  for (int i = 0; i < d.ndim; ++i) {
    d.sizes[i] = t.shape()[i];
    d.strides[i] = t.strides()[i];
  }
  return d;
}

DevTensor dev_tensor_broadcast(const Tensor& t, const Shape& shape) {
  TS_CHECK(static_cast<int64_t>(shape.size()) <= kMaxDims,
           "cuda: shape {} has more than {} dims", shape_str(shape), kMaxDims);
  const Strides s = broadcast_strides(t.shape(), t.strides(), shape);
  DevTensor d;
  d.data = t.raw_data();
  d.dtype = static_cast<int>(t.dtype());
  d.ndim = static_cast<int>(shape.size());
  d.numel = numel_of(shape);
  for (int i = 0; i < d.ndim; ++i) {
    d.sizes[i] = shape[i];
    d.strides[i] = s[i];
  }
  return d;
}

void copy_cuda(const Tensor& dst, const Tensor& src) {
  TS_CHECK(dst.device() == src.device() && dst.device().is_cuda(),
           "cuda copy: both tensors must be on one CUDA device, got {} and {}", dst.device(),
           src.device());
  if (dst.numel() == 0) return;
  DeviceGuard g(dst.device());
  const DevTensor out = dev_tensor(dst), in = dev_tensor_broadcast(src, dst.shape());
  run_launch("copy", dst.device(),
             [&] { launch_copy(out, in, compute_stream(dst.device())); });
}

Tensor contiguous_cuda(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  copy_cuda(out, t);
  return out;
}

namespace {
std::atomic<int>& tf32_flag() {
  static std::atomic<int> flag{[] {
    const char* v = std::getenv("TESSERA_ALLOW_TF32");
    return v != nullptr && std::strcmp(v, "1") == 0 ? 1 : 0;
  }()};
  return flag;
}
}  // namespace

void set_allow_tf32(bool allow) { tf32_flag().store(allow ? 1 : 0); }
bool allow_tf32() { return tf32_flag().load() != 0; }

}  // namespace tessera::cuda_kernels
