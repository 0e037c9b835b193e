#include "parallel/onebit.h"

#include <cmath>

#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {

// sum |v| / count (l1) or ||v|| / sqrt(count) (l2), as a [1] tensor.
Tensor sign_scale(const Tensor& v, int64_t count, OnebitScale scale) {
  const Tensor s = scale == OnebitScale::l1
                       ? sum(abs(v)) / static_cast<double>(count)
                       : sqrt(sum(v * v)) / std::sqrt(static_cast<double>(count));
  return s.reshape({1});
}

}  // namespace

OnebitScale parse_onebit_scale(const std::string& name, const std::string& where) {
  if (name == "l1") return OnebitScale::l1;
  if (name == "l2") return OnebitScale::l2;
  fail("{}: the 1-bit scale must be l1 (mean |x|) or l2 (||x|| / sqrt(n), DeepSpeed's), got '{}'",
       where, name);
}

const char* onebit_scale_name(OnebitScale scale) { return scale == OnebitScale::l1 ? "l1" : "l2"; }

int64_t onebit_padded(int64_t numel, int ranks) {
  const int64_t unit = 8 * static_cast<int64_t>(ranks);
  return (numel + unit - 1) / unit * unit;
}

void onebit_all_reduce(Communicator& comm, const Tensor& x, const Tensor& worker_error,
                       const Tensor& server_error, OnebitScale scale) {
  onebit_all_reduce_many(comm, {x}, {worker_error}, {server_error}, scale);
}

void onebit_all_reduce_many(Communicator& comm, const std::vector<Tensor>& xs,
                            const std::vector<Tensor>& worker_errors,
                            const std::vector<Tensor>& server_errors, OnebitScale how) {
  NoGradGuard no_grad;
  const int w = comm.size();
  const size_t count = xs.size();
  TS_CHECK(count > 0 && worker_errors.size() == count && server_errors.size() == count,
           "onebit_all_reduce: {} tensors with {} worker errors and {} server errors", count,
           worker_errors.size(), server_errors.size());
  const DType dt = xs[0].dtype();
  const Device device = xs[0].device();
  // Per tensor k: its chunk (elements per server) and the bytes of a chunk's signs, and where
  // those bytes sit in each rank's piece of the exchange: piece j holds chunk j of every
  // tensor, in order (piece_bytes in all).
  std::vector<int64_t> chunk(count), chunk_bytes(count), at(count);
  int64_t piece_bytes = 0;
  for (size_t k = 0; k < count; ++k) {
    const Tensor& x = xs[k];
    const int64_t n = x.numel();
    TS_CHECK(x.dim() == 1 && n % (8 * static_cast<int64_t>(w)) == 0 && is_floating(x.dtype()),
             "onebit_all_reduce: x must be a floating 1-D tensor of a multiple of 8 x {} ranks "
             "elements (onebit_padded), got {} {}",
             w, x.dtype(), shape_str(x.shape()));
    TS_CHECK(x.dtype() == dt && x.device() == device,
             "onebit_all_reduce: tensor {} is {} on {}, tensor 0 {} on {}", k, x.dtype(),
             x.device(), dt, device);
    chunk[k] = n / w;
    chunk_bytes[k] = chunk[k] / 8;
    at[k] = piece_bytes;
    piece_bytes += chunk_bytes[k];
    const Tensor& we = worker_errors[k];
    const Tensor& se = server_errors[k];
    TS_CHECK(we.shape() == x.shape() && we.dtype() == x.dtype() &&
                 se.shape() == Shape{chunk[k]} && se.dtype() == x.dtype(),
             "onebit_all_reduce: worker_error must be {} {} and server_error {} [{}], got {} {} "
             "and {} {}",
             x.dtype(), shape_str(x.shape()), x.dtype(), chunk[k], we.dtype(),
             shape_str(we.shape()), se.dtype(), shape_str(se.shape()));
  }
  const int64_t tensors = static_cast<int64_t>(count);
  CommCause cause("onebit all-reduce", CommKind::gradients);
  // Worker: compress each x + its error; rank j's piece gathers chunk j of every tensor.
  const Tensor send = Tensor::empty({w * piece_bytes}, DType::u8, device);
  std::vector<Tensor> scale(count);
  for (size_t k = 0; k < count; ++k) {
    const int64_t n = xs[k].numel();
    const Tensor y = (xs[k] + worker_errors[k]).contiguous();
    scale[k] = sign_scale(y, n, how);
    const Tensor bits = sign_pack(y);
    worker_errors[k].copy_(y - scale[k] * sign_unpack(bits, n, y.dtype()));
    for (int j = 0; j < w; ++j) {
      send.narrow(0, j * piece_bytes + at[k], chunk_bytes[k])
          .copy_(bits.narrow(0, j * chunk_bytes[k], chunk_bytes[k]));
    }
  }
  // Phase 1: piece j of every rank's signs to rank j; every rank's scales to all.
  const Tensor mine = Tensor::empty({w * piece_bytes}, DType::u8, device);
  comm.all_to_all(mine, send);
  const Tensor scales = Tensor::empty({w * tensors}, dt, device);
  comm.all_gather(scales, cat(scale));
  // Server of chunk `rank` of each tensor: the mean of the decompressed chunks, plus its
  // error, compressed.
  const Tensor server_send = Tensor::empty({piece_bytes}, DType::u8, device);
  std::vector<Tensor> server_scale(count);
  for (size_t k = 0; k < count; ++k) {
    Tensor z = zeros({chunk[k]}, dt, device);
    for (int i = 0; i < w; ++i) {
      const Tensor sign_i =
          sign_unpack(mine.narrow(0, i * piece_bytes + at[k], chunk_bytes[k]), chunk[k], dt);
      z = z + sign_i * (scales.narrow(0, i * tensors + static_cast<int64_t>(k), 1) * (1.0 / w));
    }
    z = z + server_errors[k];
    server_scale[k] = sign_scale(z, chunk[k], how);
    const Tensor server_bits = sign_pack(z);
    server_errors[k].copy_(z - server_scale[k] * sign_unpack(server_bits, chunk[k], z.dtype()));
    server_send.narrow(0, at[k], chunk_bytes[k]).copy_(server_bits);
  }
  // Phase 2: every server's signs and scales to all.
  const Tensor all_bits = Tensor::empty({w * piece_bytes}, DType::u8, device);
  comm.all_gather(all_bits, server_send);
  const Tensor server_scales = Tensor::empty({w * tensors}, dt, device);
  comm.all_gather(server_scales, cat(server_scale));
  for (size_t k = 0; k < count; ++k) {
    for (int j = 0; j < w; ++j) {
      xs[k].narrow(0, j * chunk[k], chunk[k])
          .copy_(sign_unpack(all_bits.narrow(0, j * piece_bytes + at[k], chunk_bytes[k]), chunk[k], dt) *
                 server_scales.narrow(0, j * tensors + static_cast<int64_t>(k), 1));
    }
  }
}

}  // namespace tessera::parallel
