#include "models/sharded/sharded_mlp.h"

#include "autograd/engine.h"
#include "parallel/comm/comm_log.h"
#include "parallel/ops.h"
#include "tensor/ops.h"

namespace tessera::examples {

// Sharded ops overload the plain ones (tessera::matmul on Tensor, parallel::matmul on
// ShardedTensor); a using-directive brings both into one overload set.
using namespace tessera::parallel;

// README snippet begins
ShardedMlpResult sharded_mlp_step(const CommPtr& world, int64_t dp, int64_t tp) {
  MeshPtr mesh = make_mesh(world, {{"dp", dp}, {"tp", tp}});
  manual_seed(0);  // every rank draws the same full tensors
  Tensor x = randn({8, 16}), w1 = randn({16, 32}), w2 = randn({32, 4}), y = randn({8, 4});

  ShardedTensor xs = distribute(x, mesh, {Shard(0), Replicate()});   // batch over dp
  ShardedTensor ys = distribute(y, mesh, {Shard(0), Replicate()});
  ShardedTensor w1s = distribute(w1, mesh, {Replicate(), Shard(1)}).requires_grad_();  // columns
  ShardedTensor w2s = distribute(w2, mesh, {Replicate(), Shard(0)}).requires_grad_();  // rows

  CommLog log;  // the step's collectives, with the op that caused each
  ShardedTensor h, loss;
  {
    CommLogScope scope(log);
    h = relu(matmul(xs, w1s));                          // [S(0), S(1)]: no communication
    ShardedTensor out = matmul(h, w2s);                 // [S(0), P(sum)]: partial over tp
    out = with_sharding_constraint(out, {Shard(0), Replicate()});  // all_reduce over tp
    ShardedTensor diff = out - ys;
    loss = mean(diff * diff);                           // [P(sum), R]: terms over dp
    loss.backward();                                    // sums w1/w2 gradients over dp
  }

  return {loss.full_tensor(), w1s.grad().full_tensor(), w2s.grad().full_tensor(),
          describe(h), log.str()};
}
// README snippet ends

ShardedMlpResult single_device_mlp_step() {
  manual_seed(0);
  Tensor x = randn({8, 16}), w1 = randn({16, 32}), w2 = randn({32, 4}), y = randn({8, 4});
  w1.requires_grad_();
  w2.requires_grad_();
  Tensor diff = matmul(relu(matmul(x, w1)), w2) - y;
  Tensor loss = mean(diff * diff);
  loss.backward();
  return {loss.detach(), w1.grad(), w2.grad(), "", ""};
}

}  // namespace tessera::examples
