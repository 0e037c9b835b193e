#include "parallel/onebit.h"

#include <cmath>

#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {

// ||v|| / sqrt(count), as a [1] tensor.
Tensor rms_scale(const Tensor& v, int64_t count) {
  return (sqrt(sum(v * v)) / std::sqrt(static_cast<double>(count))).reshape({1});
}

}  // namespace

int64_t onebit_padded(int64_t numel, int ranks) {
  const int64_t unit = 8 * static_cast<int64_t>(ranks);
  return (numel + unit - 1) / unit * unit;
}

void onebit_all_reduce(Communicator& comm, const Tensor& x, const Tensor& worker_error,
                       const Tensor& server_error) {
  NoGradGuard no_grad;
  const int w = comm.size();
  const int64_t n = x.numel(), chunk = n / w, chunk_bytes = chunk / 8;
  TS_CHECK(x.dim() == 1 && n % (8 * static_cast<int64_t>(w)) == 0 && is_floating(x.dtype()),
           "onebit_all_reduce: x must be a floating 1-D tensor of a multiple of 8 x {} ranks "
           "elements (onebit_padded), got {} {}",
           w, x.dtype(), shape_str(x.shape()));
  TS_CHECK(worker_error.shape() == x.shape() && worker_error.dtype() == x.dtype() &&
               server_error.shape() == Shape{chunk} && server_error.dtype() == x.dtype(),
           "onebit_all_reduce: worker_error must be {} {} and server_error {} [{}], got {} {} and "
           "{} {}",
           x.dtype(), shape_str(x.shape()), x.dtype(), chunk, worker_error.dtype(),
           shape_str(worker_error.shape()), server_error.dtype(), shape_str(server_error.shape()));
  CommCause cause("onebit all-reduce", CommKind::gradients);
  // Worker: compress x + its error.
  const Tensor y = (x + worker_error).contiguous();
  const Tensor s = rms_scale(y, n);
  const Tensor bits = sign_pack(y);
  worker_error.copy_(y - s * sign_unpack(bits, n, y.dtype()));
  // Phase 1: chunk j of every rank's signs to rank j; every rank's scale to all.
  const Tensor mine = Tensor::empty({n / 8}, DType::u8, x.device());
  comm.all_to_all(mine, bits);
  const Tensor scales = Tensor::empty({w}, x.dtype(), x.device());
  comm.all_gather(scales, s);
  // Server of chunk `rank`: the mean of the decompressed chunks, plus its error, compressed.
  Tensor z = zeros({chunk}, x.dtype(), x.device());
  for (int i = 0; i < w; ++i) {
    const Tensor sign_i = sign_unpack(mine.narrow(0, i * chunk_bytes, chunk_bytes), chunk, x.dtype());
    z = z + sign_i * (scales.narrow(0, i, 1) * (1.0 / w));
  }
  z = z + server_error;
  const Tensor t = rms_scale(z, chunk);
  const Tensor server_bits = sign_pack(z);
  server_error.copy_(z - t * sign_unpack(server_bits, chunk, z.dtype()));
  // Phase 2: every server's signs and scale to all.
  const Tensor all_bits = Tensor::empty({n / 8}, DType::u8, x.device());
  comm.all_gather(all_bits, server_bits);
  const Tensor server_scales = Tensor::empty({w}, x.dtype(), x.device());
  comm.all_gather(server_scales, t);
  for (int j = 0; j < w; ++j) {
    x.narrow(0, j * chunk, chunk)
        .copy_(sign_unpack(all_bits.narrow(0, j * chunk_bytes, chunk_bytes), chunk, x.dtype()) *
               server_scales.narrow(0, j, 1));
  }
}

}  // namespace tessera::parallel
