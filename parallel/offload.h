// Offload tiers for ZeRO (ZeRO-Offload, ZeRO-Infinity): where a rank keeps what its device
// does not. The device is where compute runs (its allocator may be capped: --memory_limit);
// the host tier is host memory beside it (tensor/allocator.h: host_tier_allocator()); the
// file tier is a swap file on a local disk, read and written by a pool of I/O threads.
//
//   ZeroOptions z{.stage = 3, .units = units};
//   z.offload = {.optimizer = OffloadTier::file, .params = OffloadTier::file, .dir = "/nvme"};
//   ZeroDataParallel zero(model, comm, z);      // parallel/zero.h says what each tier holds
//
//   SwapFile f("/nvme", "rank0", {});             // the file tier's engine, on its own:
//   SwapFile::Request w = f.write(7, buf, n);     // async; buf stays alive until wait()
//   w.wait();  f.read(7, buf, n).wait();          // a read checks the record's checksum
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace tessera::parallel {

enum class OffloadTier : uint8_t { none, host, file };
const char* offload_tier_name(OffloadTier tier);  // "none", "host", "nvme"
// "none", "host", "nvme" (or "file"); Error naming `flag` and the text otherwise.
OffloadTier parse_offload_tier(std::string_view text, std::string_view flag);

// Where the optimizer's f32 copies of the parameter shards live: in the swap file when the
// parameters go there, or when they stay on the device and the optimizer goes there.
inline bool param_copies_on_file(OffloadTier optimizer, OffloadTier params) {
  return params == OffloadTier::file || (params == OffloadTier::none && optimizer == OffloadTier::file);
}

struct OffloadOptions {
  // The optimizer's parameters (f32 master copies of this rank's shards), its state and the
  // reduced gradient shards: off the device, and the update runs on the CPU. File tier: the
  // parameters and the state in the swap file, paged in a segment at a time (the next one
  // prefetched while the current one updates); the gradients stay in host memory.
  OffloadTier optimizer = OffloadTier::none;
  // Stage 3 (needs `optimizer` offloaded): the parameter shards have no device copy at all;
  // each unit's gather reads its shards from the optimizer's copy (file tier: read ahead
  // two units).
  OffloadTier params = OffloadTier::none;
  std::string dir = "";      // file tier: where the swap files go ("": $TMPDIR or /tmp)
  bool direct_io = true;     // file tier: O_DIRECT where the file system takes it
  int io_threads = 2;        // file tier: threads doing the preads and pwrites
  int64_t io_block = int64_t{4} << 20;  // bytes per pread / pwrite
  // File tier: host bytes for pages read ahead during backward for the next update (its
  // optimizer state, in forward order) and for updated pages whose writes are in flight
  // (written behind while compute goes on; released once written). Beyond it the host
  // holds the gradient shards, the pages of the segment being updated and of the next few
  // being read for it, and at stage 3 each updated parameter page until its gather takes it
  // (all of them when the updates are completed before a forward, as checkpoints do).
  // 0: nothing read ahead, an update waits for the last one's writes. The same values
  // either way: it moves I/O, not numbers.
  int64_t window = int64_t{512} << 20;
  bool any() const { return optimizer != OffloadTier::none || params != OffloadTier::none; }
};

// A swap file of records (key -> bytes), written and read asynchronously. Records are laid
// out at 4096-byte boundaries in the order first written; a record's size is fixed by its
// first write. Every write stores a checksum of the bytes, every read verifies it: a torn or
// corrupted swap file fails loudly (Error naming the file, the key and the offset) instead
// of training on garbage. The file is scratch: created exclusive, unlinked when this dies.
//
// O_DIRECT (bypassing the page cache, as ZeRO-Infinity's NVMe engine does) is used when
// asked and the file system accepts an aligned direct write (probed at open: tmpfs and some
// others refuse it); then a request whose buffer is 4096-aligned moves whole 4096-byte
// pages (the host tier's buffers are, and are padded so), any other goes through the page
// cache. direct() says which mode is in effect.
class SwapFile {
 public:
  struct Options {
    bool direct_io = true;
    int threads = 2;
    int64_t block = int64_t{4} << 20;
  };
  SwapFile(const std::string& dir, const std::string& name, Options options);
  ~SwapFile();  // waits for every request, closes and unlinks the file
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  class Request {
   public:
    Request() = default;
    // Blocks until the request is done; throws its Error (I/O failure, checksum mismatch).
    // An empty request is done.
    void wait();
    bool pending() const { return state_ != nullptr; }
    // Whether wait() would return at once (no error is thrown here).
    bool done() const;

   private:
    friend class SwapFile;
    struct State;
    std::shared_ptr<State> state_;
  };

  // Writes nbytes from data as record `key`; `data` must stay valid until wait(). `padded`:
  // the buffer extends to the next multiple of 4096 bytes (the host tier's do), so direct I/O
  // may move whole pages; otherwise a size that is not a multiple goes through the cache.
  Request write(int64_t key, const void* data, int64_t nbytes, bool padded = false);
  // Reads record `key` (written before, of nbytes) into data; checks its checksum. Reads go
  // before writes (compute waits for a read; a write only frees a buffer), and `ahead`
  // reads (nobody waits for them yet) after both.
  Request read(int64_t key, void* data, int64_t nbytes, bool padded = false, bool ahead = false);
  // Someone is about to wait for `request`: its blocks still queued (a write, or a read
  // ahead) go with the reads, first.
  void hurry(const Request& request);

  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  int64_t bytes_read() const;
  int64_t bytes_written() const;
  int64_t file_bytes() const;  // the records' extent
  // Seconds during which at least one request was in flight (the I/O time a throughput
  // figure divides by: bytes_read() + bytes_written() over it).
  double busy_seconds() const;

 private:
  // A record's checksums are per block of options_.block bytes, so the I/O threads compute
  // and check them in parallel, each on the block it moves.
  struct Record {
    int64_t offset = 0, nbytes = 0;
    std::vector<uint64_t> sums;
  };
  struct Task {
    std::shared_ptr<Request::State> request;
    Record* record = nullptr;
    int64_t key = 0, block = 0;  // the record and which of its blocks
    bool write = false;
    char* data = nullptr;        // the block's bytes in the caller's buffer
    int64_t nbytes = 0;
    bool direct = false;
  };
  Request submit(int64_t key, char* data, int64_t nbytes, bool write, bool padded, bool ahead);
  void worker();

  std::string path_;
  Options options_;
  int fd_ = -1, direct_fd_ = -1;
  bool direct_ = false;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // The queues, served in this order (see read()). A record is never read while its write
  // is in flight: its owner reads it back only after waiting for the write.
  std::deque<Task> reads_, writes_, ahead_;
  bool stop_ = false;
  std::map<int64_t, Record> records_;
  int64_t end_ = 0;
  int64_t read_ = 0, written_ = 0;
  int64_t in_flight_ = 0;  // blocks queued or moving
  std::chrono::steady_clock::time_point busy_since_;
  double busy_ = 0;
  std::vector<std::thread> threads_;
};

// The checksum SwapFile stores per record (64-bit, 4 independent lanes: several GB/s).
uint64_t swap_checksum(const void* data, int64_t nbytes);

}  // namespace tessera::parallel
