#include "parallel/offload.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "tensor/error.h"

namespace tessera::parallel {

const char* offload_tier_name(OffloadTier tier) {
  switch (tier) {
    case OffloadTier::none: return "none";
    case OffloadTier::host: return "host";
    case OffloadTier::file: return "nvme";
  }
  return "?";
}

OffloadTier parse_offload_tier(std::string_view text, std::string_view flag) {
  if (text == "none") return OffloadTier::none;
  if (text == "host") return OffloadTier::host;
  if (text == "nvme" || text == "file") return OffloadTier::file;
  fail("{}: unknown offload tier '{}' (expected none, host or nvme)", flag, text);
}

uint64_t swap_checksum(const void* data, int64_t nbytes) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                   0x082EFA98EC4E6C89ull};
  int64_t i = 0;
  for (; i + 32 <= nbytes; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      h[l] = (h[l] ^ w) * kMul;
      h[l] ^= h[l] >> 29;
    }
  }
  uint64_t tail = 0x3C6EF372FE94F82Bull;
  for (; i < nbytes; ++i) tail = (tail ^ p[i]) * 0x100000001B3ull;
  uint64_t out = static_cast<uint64_t>(nbytes);
  for (uint64_t v : {h[0], h[1], h[2], h[3], tail}) {
    out = (out ^ v) * kMul;
    out ^= out >> 31;
  }
  return out;
}

namespace {

constexpr int64_t kPage = 4096;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

std::string default_dir() {
  const char* t = std::getenv("TMPDIR");
  return t != nullptr && *t != '\0' ? t : "/tmp";
}

// Whether an aligned O_DIRECT write and read of one page work on fd (some file systems open
// with O_DIRECT but refuse the I/O).
bool direct_works(int fd) {
  void* page = nullptr;
  if (posix_memalign(&page, kPage, kPage) != 0) return false;
  std::memset(page, 0, kPage);
  const bool ok = pwrite(fd, page, kPage, 0) == kPage && pread(fd, page, kPage, 0) == kPage;
  std::free(page);
  return ok;
}

}  // namespace

struct SwapFile::Request::State {
  std::mutex mu;
  std::condition_variable cv;
  int64_t left = 0;
  std::string error;
};

void SwapFile::Request::wait() {
  if (!state_) return;
  std::shared_ptr<State> s = std::move(state_);
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->left == 0; });
  if (!s->error.empty()) fail("{}", s->error);
}

bool SwapFile::Request::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->left == 0;
}

SwapFile::SwapFile(const std::string& dir, const std::string& name, Options options)
    : options_(options) {
  TS_CHECK(options.threads >= 1 && options.block >= kPage && options.block % kPage == 0,
           "SwapFile: io threads {} must be >= 1 and the block {} bytes a positive multiple of "
           "{}", options.threads, options.block, kPage);
  const std::string where = dir.empty() ? default_dir() : dir;
  struct stat st{};
  if (stat(where.c_str(), &st) != 0) {
    fail("SwapFile: --offload_dir '{}' is not a directory ({})", where, std::strerror(errno));
  }
  TS_CHECK(S_ISDIR(st.st_mode), "SwapFile: --offload_dir '{}' is not a directory (it is a file)",
           where);
  path_ = fmt::format("{}/tessera-offload-{}-{}.swap", where, name, getpid());
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  TS_CHECK(fd_ >= 0, "SwapFile: cannot create '{}': {}", path_, std::strerror(errno));
  if (options.direct_io) {
    direct_fd_ = ::open(path_.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
    if (direct_fd_ >= 0 && !direct_works(direct_fd_)) {
      ::close(direct_fd_);
      direct_fd_ = -1;
    }
  }
  direct_ = direct_fd_ >= 0;
  try {
    for (int t = 0; t < options.threads; ++t) threads_.emplace_back([this] { worker(); });
  } catch (...) {  // no thread: stop the ones started, close and remove the file
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    if (direct_fd_ >= 0) ::close(direct_fd_);
    ::close(fd_);
    ::unlink(path_.c_str());
    throw;
  }
}

SwapFile::~SwapFile() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (fd_ >= 0) ::close(fd_);
  ::unlink(path_.c_str());
}

int64_t SwapFile::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return read_;
}
int64_t SwapFile::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_;
}
double SwapFile::busy_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  double busy = busy_;
  if (in_flight_ > 0) {
    busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
  }
  return busy;
}

int64_t SwapFile::file_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return end_;
}

SwapFile::Request SwapFile::write(int64_t key, const void* data, int64_t nbytes, bool padded) {
  return submit(key, static_cast<char*>(const_cast<void*>(data)), nbytes, true, padded, false);
}

SwapFile::Request SwapFile::read(int64_t key, void* data, int64_t nbytes, bool padded, bool ahead) {
  return submit(key, static_cast<char*>(data), nbytes, false, padded, ahead);
}

void SwapFile::hurry(const Request& request) {
  if (!request.state_) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (std::deque<Task>* queue : {&writes_, &ahead_}) {
    for (auto it = queue->begin(); it != queue->end();) {
      if (it->request == request.state_) {
        reads_.push_back(std::move(*it));
        it = queue->erase(it);
      } else {
        ++it;
      }
    }
  }
}

SwapFile::Request SwapFile::submit(int64_t key, char* data, int64_t nbytes, bool write,
                                   bool padded, bool ahead) {
  TS_CHECK(nbytes >= 0 && (data != nullptr || nbytes == 0),
           "SwapFile::{}: record {} of {} bytes has no buffer", write ? "write" : "read", key,
           nbytes);
  Request request;
  request.state_ = std::make_shared<Request::State>();
  const int64_t blocks = (nbytes + options_.block - 1) / options_.block;
  // Direct I/O moves whole pages: the buffer must start on a page and hold whole pages (the
  // host tier's do: `padded`).
  const bool direct = direct_ && reinterpret_cast<uintptr_t>(data) % kPage == 0 &&
                      (padded || nbytes % kPage == 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(key);
    if (it == records_.end()) {
      TS_CHECK(write, "SwapFile::read: {}: no record {} was written", path_, key);
      it = records_.emplace(key, Record{end_, nbytes, std::vector<uint64_t>(blocks)}).first;
      end_ += round_up(std::max<int64_t>(nbytes, 1), kPage);
    }
    Record& r = it->second;
    TS_CHECK(r.nbytes == nbytes, "SwapFile::{}: {}: record {} holds {} bytes, asked for {}",
             write ? "write" : "read", path_, key, r.nbytes, nbytes);
    request.state_->left = blocks;
    if (in_flight_ == 0 && blocks > 0) busy_since_ = std::chrono::steady_clock::now();
    in_flight_ += blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = b * options_.block;
      (write ? writes_ : ahead ? ahead_ : reads_).push_back(Task{request.state_, &r, key, b, write, data + at,
                            std::min(options_.block, nbytes - at), direct});
    }
    (write ? written_ : read_) += nbytes;
  }
  if (blocks == 0) request.state_.reset();
  cv_.notify_all();
  return request;
}

void SwapFile::worker() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !reads_.empty() || !writes_.empty() || !ahead_.empty(); });
      std::deque<Task>& queue = !reads_.empty() ? reads_ : !writes_.empty() ? writes_ : ahead_;
      if (queue.empty()) return;  // stopping, nothing left
      task = std::move(queue.front());
      queue.pop_front();
    }
    std::string error;
    const int64_t offset = task.record->offset + task.block * options_.block;
    // Direct I/O moves the block's whole pages (the last block's padding included).
    const int64_t len = task.direct ? round_up(task.nbytes, kPage) : task.nbytes;
    const int fd = task.direct ? direct_fd_ : fd_;
    if (task.write) task.record->sums[task.block] = swap_checksum(task.data, task.nbytes);
    int64_t done = 0;
    while (done < len && error.empty()) {
      const ssize_t n = task.write ? ::pwrite(fd, task.data + done, len - done, offset + done)
                                   : ::pread(fd, task.data + done, len - done, offset + done);
      if (n > 0) {
        done += n;
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n == 0 && !task.write && done >= task.nbytes) {
        break;  // a direct read's page padding past the end of the file
      } else {
        error = fmt::format("SwapFile::{}: {}: record {} at offset {}: {}",
                            task.write ? "write" : "read", path_, task.key, offset + done,
                            n == 0 ? std::string("unexpected end of file") : std::strerror(errno));
      }
    }
    if (error.empty() && !task.write &&
        swap_checksum(task.data, task.nbytes) != task.record->sums[task.block]) {
      error = fmt::format("SwapFile::read: {}: record {} fails its checksum at offset {} ({} "
                          "bytes): the swap file was changed under us",
                          path_, task.key, offset, task.nbytes);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--in_flight_ == 0) {
        busy_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
      }
    }
    std::lock_guard<std::mutex> lock(task.request->mu);
    if (!error.empty() && task.request->error.empty()) task.request->error = error;
    if (--task.request->left == 0) task.request->cv.notify_all();
  }
}

}  // namespace tessera::parallel
