#include "parallel/comm/communicator.h"

#include <numeric>

#include "parallel/comm/comm_log.h"
#include "parallel/comm/staging.h"
#include "tensor/error.h"

namespace tessera::parallel {
namespace {

class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

int64_t sum_of(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

std::string counts_str(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

WorkHandle completed_work() { return std::make_shared<CompletedWork>(); }

void wait_ignoring_errors(const WorkHandle& work) {
  if (!work) return;
  try {
    work->wait();
  } catch (...) {  // reported where the error arose
  }
}

int64_t all_reduce_wire_bytes(int64_t bytes, int n) { return n <= 1 ? 0 : 2 * (n - 1) * bytes / n; }
int64_t all_gather_wire_bytes(int64_t input_bytes, int n) { return (n - 1) * input_bytes; }
int64_t reduce_scatter_wire_bytes(int64_t input_bytes, int64_t own_block_bytes) {
  return input_bytes - own_block_bytes;
}

namespace {

// Checks shared by every collective: a defined, contiguous buffer.
void check_buffer(const Communicator& c, const char* op, const char* what, const Tensor& t) {
  TS_CHECK(t.defined(), "{} on group '{}': {} is undefined", op, c.name(), what);
  TS_CHECK(t.is_contiguous(), "{} on group '{}': {} {} must be contiguous", op, c.name(), what,
           shape_str(t.shape()));
}

void check_pair(const Communicator& c, const char* op, const Tensor& out, const Tensor& in) {
  check_buffer(c, op, "output", out);
  check_buffer(c, op, "input", in);
  TS_CHECK(out.dtype() == in.dtype(), "{} on group '{}': output is {} but input is {}", op,
           c.name(), out.dtype(), in.dtype());
  TS_CHECK(out.device() == in.device(), "{} on group '{}': output is on {} but input on {}", op,
           c.name(), out.device(), in.device());
}

void check_reduce(const Communicator& c, const char* op, DType dt, ReduceOp rop) {
  TS_CHECK(rop != ReduceOp::avg || is_floating(dt),
           "{} on group '{}': avg needs a floating dtype, got {}", op, c.name(), dt);
  TS_CHECK(dt != DType::u8,
           "{} on group '{}': u8 tensors hold codes and are not reduced (gather or broadcast them)",
           op, c.name());
}

std::vector<int64_t> fill_counts(const Communicator& c, const char* op, const char* which,
                                 std::vector<int64_t> counts, int64_t equal) {
  if (counts.empty()) return std::vector<int64_t>(c.size(), equal);
  TS_CHECK(static_cast<int>(counts.size()) == c.size(),
           "{} on group '{}' of {} ranks: {} has {} entries {}", op, c.name(), c.size(), which,
           counts.size(), counts_str(counts));
  for (int64_t k : counts) {
    TS_CHECK(k >= 0, "{} on group '{}': negative entry in {} {}", op, c.name(), which,
             counts_str(counts));
  }
  return counts;
}

void log(const Communicator& c, const char* op, int64_t bytes, int64_t elements, DType dt) {
  if (!comm_log_active()) return;  // no strings built when nobody records
  record_collective(CommRecord{op, c.name(), c.size(), bytes, elements, dt, "", CommKind::other});
}

}  // namespace

bool Communicator::staged(const Tensor& t) const {
  return internal::off_host(t) && stages_device_tensors();
}

CommPtr Communicator::split(int color, int key, const std::string& name) {
  TS_CHECK(color >= 0, "split on group '{}': color must be >= 0, got {}", name_, color);
  return do_split(color, key, name);
}

WorkHandle Communicator::all_reduce_async(const Tensor& tensor, ReduceOp op) {
  check_buffer(*this, "all_reduce", "tensor", tensor);
  check_reduce(*this, "all_reduce", tensor.dtype(), op);
  log(*this, "all_reduce", all_reduce_wire_bytes(tensor.nbytes(), size_), tensor.numel(),
      tensor.dtype());
  if (staged(tensor)) [[unlikely]] {
    const Tensor h = internal::host_copy(tensor);
    return internal::copy_back(do_all_reduce(h, op), tensor, h);
  }
  return do_all_reduce(tensor, op);
}

WorkHandle Communicator::all_gather_async(const Tensor& output, const Tensor& input,
                                          std::vector<int64_t> counts) {
  check_pair(*this, "all_gather", output, input);
  counts = fill_counts(*this, "all_gather", "counts", std::move(counts), input.numel());
  TS_CHECK(counts[rank_] == input.numel(),
           "all_gather on group '{}': rank {} sends {} elements but counts {} say {}", name_,
           rank_, input.numel(), counts_str(counts), counts[rank_]);
  TS_CHECK(sum_of(counts) == output.numel(),
           "all_gather on group '{}': output {} holds {} elements, counts {} sum to {}", name_,
           shape_str(output.shape()), output.numel(), counts_str(counts), sum_of(counts));
  log(*this, "all_gather", all_gather_wire_bytes(input.nbytes(), size_), input.numel(),
      input.dtype());
  if (staged(output)) [[unlikely]] {
    const Tensor h = internal::host_buffer(output);
    return internal::copy_back(do_all_gather(h, internal::host_copy(input), counts), output, h);
  }
  return do_all_gather(output, input, counts);
}

WorkHandle Communicator::reduce_scatter_async(const Tensor& output, const Tensor& input,
                                              ReduceOp op, std::vector<int64_t> counts) {
  check_pair(*this, "reduce_scatter", output, input);
  check_reduce(*this, "reduce_scatter", input.dtype(), op);
  counts = fill_counts(*this, "reduce_scatter", "counts", std::move(counts), output.numel());
  TS_CHECK(counts[rank_] == output.numel(),
           "reduce_scatter on group '{}': rank {} receives {} elements but counts {} say {}",
           name_, rank_, output.numel(), counts_str(counts), counts[rank_]);
  TS_CHECK(sum_of(counts) == input.numel(),
           "reduce_scatter on group '{}': input {} holds {} elements, counts {} sum to {}", name_,
           shape_str(input.shape()), input.numel(), counts_str(counts), sum_of(counts));
  const int64_t esize = dtype_size(input.dtype());
  log(*this, "reduce_scatter", reduce_scatter_wire_bytes(input.nbytes(), counts[rank_] * esize),
      input.numel(), input.dtype());
  if (staged(output)) [[unlikely]] {
    const Tensor h = internal::host_buffer(output);
    return internal::copy_back(do_reduce_scatter(h, internal::host_copy(input), op, counts),
                               output, h);
  }
  return do_reduce_scatter(output, input, op, counts);
}

WorkHandle Communicator::broadcast_async(const Tensor& tensor, int root) {
  check_buffer(*this, "broadcast", "tensor", tensor);
  TS_CHECK(root >= 0 && root < size_, "broadcast on group '{}' of {} ranks: root {} out of range",
           name_, size_, root);
  log(*this, "broadcast", rank_ == root ? (size_ - 1) * tensor.nbytes() : 0, tensor.numel(),
      tensor.dtype());
  if (staged(tensor)) [[unlikely]] {
    const bool root_here = rank_ == root;  // the root's tensor is only read
    const Tensor h = root_here ? internal::host_copy(tensor) : internal::host_buffer(tensor);
    return internal::copy_back(do_broadcast(h, root), root_here ? Tensor() : tensor, h);
  }
  return do_broadcast(tensor, root);
}

WorkHandle Communicator::all_to_all_async(const Tensor& output, const Tensor& input,
                                          std::vector<int64_t> send_counts,
                                          std::vector<int64_t> recv_counts) {
  check_pair(*this, "all_to_all", output, input);
  TS_CHECK(send_counts.empty() || input.numel() == sum_of(send_counts),
           "all_to_all on group '{}': input {} holds {} elements, send_counts {} sum to {}",
           name_, shape_str(input.shape()), input.numel(), counts_str(send_counts),
           sum_of(send_counts));
  TS_CHECK(send_counts.empty() ? input.numel() % size_ == 0 : true,
           "all_to_all on group '{}' of {} ranks: input {} does not split into equal blocks; "
           "pass send_counts", name_, size_, shape_str(input.shape()));
  send_counts = fill_counts(*this, "all_to_all", "send_counts", std::move(send_counts),
                            input.numel() / size_);
  TS_CHECK(recv_counts.empty() ? output.numel() % size_ == 0 : true,
           "all_to_all on group '{}' of {} ranks: output {} does not split into equal blocks; "
           "pass recv_counts", name_, size_, shape_str(output.shape()));
  recv_counts = fill_counts(*this, "all_to_all", "recv_counts", std::move(recv_counts),
                            output.numel() / size_);
  TS_CHECK(output.numel() == sum_of(recv_counts),
           "all_to_all on group '{}': output {} holds {} elements, recv_counts {} sum to {}",
           name_, shape_str(output.shape()), output.numel(), counts_str(recv_counts),
           sum_of(recv_counts));
  TS_CHECK(send_counts[rank_] == recv_counts[rank_],
           "all_to_all on group '{}': rank {} keeps {} elements by send_counts but {} by "
           "recv_counts", name_, rank_, send_counts[rank_], recv_counts[rank_]);
  const int64_t esize = dtype_size(input.dtype());
  log(*this, "all_to_all", input.nbytes() - send_counts[rank_] * esize, input.numel(),
      input.dtype());
  if (staged(output)) [[unlikely]] {
    const Tensor h = internal::host_buffer(output);
    return internal::copy_back(
        do_all_to_all(h, internal::host_copy(input), send_counts, recv_counts), output, h);
  }
  return do_all_to_all(output, input, send_counts, recv_counts);
}

WorkHandle Communicator::send_async(const Tensor& tensor, int dst, int tag) {
  check_buffer(*this, "send", "tensor", tensor);
  TS_CHECK(dst >= 0 && dst < size_ && dst != rank_,
           "send on group '{}' of {} ranks: rank {} cannot send to {}", name_, size_, rank_, dst);
  log(*this, "send", tensor.nbytes(), tensor.numel(), tensor.dtype());
  if (staged(tensor)) [[unlikely]] return do_send(internal::host_copy(tensor), dst, tag);
  return do_send(tensor, dst, tag);
}

WorkHandle Communicator::recv_async(const Tensor& tensor, int src, int tag) {
  check_buffer(*this, "recv", "tensor", tensor);
  TS_CHECK(src >= 0 && src < size_ && src != rank_,
           "recv on group '{}' of {} ranks: rank {} cannot receive from {}", name_, size_, rank_,
           src);
  log(*this, "recv", 0, tensor.numel(), tensor.dtype());
  if (staged(tensor)) [[unlikely]] {
    const Tensor h = internal::host_buffer(tensor);
    return internal::copy_back(do_recv(h, src, tag), tensor, h);
  }
  return do_recv(tensor, src, tag);
}

WorkHandle Communicator::barrier_async() {
  log(*this, "barrier", 0, 0, DType::b8);
  return do_barrier();
}

}  // namespace tessera::parallel
