#include "parallel/powersgd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

namespace {

constexpr const char* kName = "PowerSgd";

// Work that runs `rest` (the bucket's later phases) on the first wait().
class PhasedWork : public Work {
 public:
  explicit PhasedWork(std::function<void()> rest) : rest_(std::move(rest)) {}
  void wait() override {
    if (done_) return;
    done_ = true;
    rest_();
  }
  bool is_completed() override { return done_; }

 private:
  std::function<void()> rest_;
  bool done_ = false;
};

Tensor flat_cat(const std::vector<Tensor>& parts, DType dtype, Device device) {
  if (parts.empty()) return Tensor::empty({0}, dtype, device);
  std::vector<Tensor> flat;
  flat.reserve(parts.size());
  for (const Tensor& t : parts) flat.push_back(t.reshape({-1}));
  return cat(flat).contiguous();
}

// splitmix64's finalizer: a well-mixed 64-bit value from any input.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The Philox key of gradient `name`'s initial Q in round `round` (FNV-1a of the name):
// the same on every rank and in any bucket layout.
uint64_t q0_seed(uint64_t seed, const std::string& name, int64_t round) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  return mix64(mix64(seed ^ h) ^ static_cast<uint64_t>(round));
}

}  // namespace

PowerSgd::PowerSgd(PowerSgdOptions options) : options_(std::move(options)) {
  TS_CHECK(options_.rank >= 1, "{}: rank must be >= 1, got {}", kName, options_.rank);
  TS_CHECK(options_.start_iter >= 0, "{}: start_iter must be >= 0, got {}", kName,
           options_.start_iter);
  TS_CHECK(options_.min_compression_rate >= 0, "{}: min_compression_rate must be >= 0, got {}",
           kName, options_.min_compression_rate);
  TS_CHECK(options_.orthogonalization_epsilon >= 0,
           "{}: orthogonalization_epsilon must be >= 0, got {}", kName,
           options_.orthogonalization_epsilon);
}

void PowerSgd::orthogonalize(const Tensor& m, double epsilon) {
  NoGradGuard no_grad;
  TS_CHECK(m.dim() == 2, "{}: orthogonalize takes a matrix, got {}", kName, shape_str(m.shape()));
  const int64_t k = m.size(1);
  for (int64_t i = 0; i < k; ++i) {
    const Tensor col = m.narrow(1, i, 1);
    Tensor denom = sqrt(sum(col * col));
    if (epsilon != 0) denom = denom + epsilon;
    // A zero column (norm 0, no epsilon) stays zero: divided by 1 instead of 0.
    const Tensor safe = where(gt(denom, scalar_like(0.0, denom, kName)), denom,
                              scalar_like(1.0, denom, kName));
    col.copy_(col / safe);
    if (i + 1 < k) {
      const Tensor rest = m.narrow(1, i + 1, k - i - 1);
      rest.copy_(rest - sum(col * rest, {0}, /*keepdim=*/true) * col);
    }
  }
}

WorkHandle PowerSgd::reduce(Communicator& comm, const GradBucket& b) {
  NoGradGuard no_grad;
  const Tensor& buffer = b.buffer;
  const int64_t numel = buffer.numel();
  current_.uncompressed += numel;
  const ReduceOp exact = b.average ? ReduceOp::avg : ReduceOp::sum;
  if (rounds_ < options_.start_iter) {
    current_.sent += numel;
    return comm.all_reduce_async(buffer, exact);
  }
  std::shared_ptr<BucketState>& slot = buckets_[b.index];
  if (!slot) slot = std::make_shared<BucketState>();
  std::shared_ptr<BucketState> st = slot;
  if (st->error.defined() && st->error.device() != buffer.device()) {  // loaded on the CPU
    st->error = st->error.to(buffer.device());
  }
  for (auto& [j, q] : st->q) {
    if (q.device() != buffer.device()) q = q.to(buffer.device());
  }
  if (options_.error_feedback) {
    if (!st->error.defined()) {
      st->error = zeros({numel}, buffer.dtype(), buffer.device());
    } else {
      TS_CHECK(st->error.numel() == numel && st->error.dtype() == buffer.dtype(),
               "{}: bucket {}'s error feedback is {} {}, the bucket {} {}", kName, b.index,
               st->error.dtype(), shape_str(st->error.shape()), buffer.dtype(), numel);
      buffer.copy_(buffer + st->error);
    }
  }
  const Tensor input = options_.error_feedback ? buffer.clone() : Tensor();
  const DType f = buffer.dtype() == DType::f64 ? DType::f64 : DType::f32;

  struct Matrix {
    int index;
    Tensor grad, m;  // the gradient, and it as [n, cols] in the factors' dtype
    int64_t n, cols, r;
    Tensor p, q;
  };
  std::vector<Matrix> mats;
  std::vector<Tensor> plain;
  for (int j = 0; j < static_cast<int>(b.gradients.size()); ++j) {
    const Tensor& g = b.gradients[static_cast<size_t>(j)];
    if (g.dim() >= 2 && g.numel() > 0) {
      const int64_t n = g.size(0), cols = g.numel() / n;
      const int64_t r = std::min({n, cols, options_.rank});
      if (static_cast<double>(n) * static_cast<double>(cols) >
          options_.min_compression_rate * static_cast<double>(n + cols) * static_cast<double>(r)) {
        mats.push_back({j, g, cast(g.reshape({n, cols}), f), n, cols, r, {}, {}});
        continue;
      }
    }
    plain.push_back(g);
  }
  const Tensor un = flat_cat(plain, buffer.dtype(), buffer.device());
  for (Matrix& x : mats) {
    const Shape qshape = {x.cols, x.r};
    auto it = st->q.find(x.index);
    if (options_.warm_start && it != st->q.end() && it->second.shape() == qshape) {
      x.q = it->second;
    } else if (options_.initial_q) {
      const Tensor q0 = options_.initial_q(b.index, x.index, qshape);
      TS_CHECK(q0.defined() && q0.shape() == qshape,
               "{}: initial_q for tensor {} ('{}') of bucket {} must be {}, got {}", kName,
               x.index, b.names.at(static_cast<size_t>(x.index)), b.index, shape_str(qshape),
               q0.defined() ? shape_str(q0.shape()) : "undefined");
      x.q = cast(q0, f).to(buffer.device()).contiguous().clone();
    } else {
      Generator gen(q0_seed(options_.seed, b.names.at(static_cast<size_t>(x.index)), rounds_));
      x.q = randn(qshape, f, buffer.device(), &gen);
    }
    orthogonalize(x.q, options_.orthogonalization_epsilon);
    x.p = matmul(x.m, x.q);
  }
  std::vector<Tensor> parts;
  for (const Matrix& x : mats) parts.push_back(x.p);
  const Tensor ps = flat_cat(parts, f, buffer.device());
  WorkHandle w_un, w_p;
  {
    CommCause cause(fmt::format("powersgd bucket {} uncompressed", b.index), CommKind::gradients);
    w_un = comm.all_reduce_async(un, exact);
  }
  {
    CommCause cause(fmt::format("powersgd bucket {} P", b.index), CommKind::gradients);
    w_p = comm.all_reduce_async(ps, ReduceOp::sum);
  }
  int64_t q_numel = 0;
  for (const Matrix& x : mats) q_numel += x.cols * x.r;
  current_.sent += un.numel() + ps.numel() + q_numel;

  const int size = comm.size();
  const PowerSgdOptions& o = options_;
  return std::make_shared<PhasedWork>([=, &comm, &o]() mutable {
    NoGradGuard no_grad_inner;
    w_un->wait();
    int64_t at = 0;
    for (const Tensor& g : plain) {
      g.copy_(un.narrow(0, at, g.numel()).view(g.shape()));
      at += g.numel();
    }
    w_p->wait();
    at = 0;
    std::vector<Tensor> qs_parts;
    for (Matrix& x : mats) {
      x.p = ps.narrow(0, at, x.n * x.r).view({x.n, x.r});
      at += x.n * x.r;
      orthogonalize(x.p, o.orthogonalization_epsilon);
      x.q = matmul(x.m.t(), x.p);
      qs_parts.push_back(x.q);
    }
    const Tensor qs = flat_cat(qs_parts, f, buffer.device());
    {
      CommCause cause(fmt::format("powersgd bucket {} Q", b.index), CommKind::gradients);
      comm.all_reduce(qs, ReduceOp::sum);
    }
    if (b.average) qs.copy_(qs / static_cast<double>(size));
    at = 0;
    if (!o.warm_start) st->q.clear();
    for (Matrix& x : mats) {
      const Tensor q = qs.narrow(0, at, x.cols * x.r).view({x.cols, x.r});
      at += x.cols * x.r;
      x.grad.copy_(cast(matmul(x.p, q.t()), x.grad.dtype()).view(x.grad.shape()));
      if (o.warm_start) st->q[x.index] = q.clone();
    }
    // The error is what this rank's input did not contribute: against the mean (with a sum,
    // the result over the group size), so the errors' mean over the group is the mean
    // input's error either way.
    if (o.error_feedback) {
      st->error.copy_(b.average ? input - buffer : input - buffer / static_cast<double>(size));
    }
  });
}

void PowerSgd::end_round() {
  ++rounds_;
  last_ = current_;
  current_ = {};
}

std::map<std::string, Tensor> PowerSgd::state_dict() const {
  std::map<std::string, Tensor> out;
  out["rounds"] = Tensor::from_vector<int64_t>({rounds_}, {});
  for (const auto& [k, st] : buckets_) {
    if (st->error.defined()) out[fmt::format("error.{}", k)] = st->error.clone();
    for (const auto& [j, q] : st->q) out[fmt::format("q.{}.{}", k, j)] = q.clone();
  }
  return out;
}

void PowerSgd::load_state_dict(const std::map<std::string, Tensor>& dict) {
  auto need = [&](const std::string& key, DType dtype, const Shape& shape) -> const Tensor& {
    auto it = dict.find(key);
    TS_CHECK(it != dict.end(), "{}: the state dict has no '{}'", kName, key);
    TS_CHECK(it->second.dtype() == dtype && it->second.shape() == shape,
             "{}: the state dict's '{}' is {} {}, expected {} {}", kName, key, it->second.dtype(),
             shape_str(it->second.shape()), dtype, shape_str(shape));
    return it->second;
  };
  const int64_t rounds = need("rounds", DType::i64, {}).item<int64_t>();
  TS_CHECK(rounds >= 0, "{}: the state dict's rounds is {}", kName, rounds);
  std::map<int, std::shared_ptr<BucketState>> buckets;
  for (const auto& [key, v] : dict) {
    // "rng": an older hook's generator state; the initial Qs are keyed by name and round now.
    if (key == "rounds" || key == "rng") continue;
    int k = -1, j = -1;
    char tail = 0;
    if (std::sscanf(key.c_str(), "error.%d%c", &k, &tail) == 1 && k >= 0) {
      std::shared_ptr<BucketState>& st = buckets[k];
      if (!st) st = std::make_shared<BucketState>();
      st->error = v.contiguous().clone();
    } else if (std::sscanf(key.c_str(), "q.%d.%d%c", &k, &j, &tail) == 2 && k >= 0 && j >= 0 &&
               v.dim() == 2) {
      std::shared_ptr<BucketState>& st = buckets[k];
      if (!st) st = std::make_shared<BucketState>();
      st->q[j] = v.contiguous().clone();
    } else {
      fail("{}: unexpected key '{}' {} in the state dict (expected rounds, error.<bucket>, "
           "q.<bucket>.<tensor> [m, r])",
           kName, key, shape_str(v.shape()));
    }
  }
  rounds_ = rounds;
  buckets_ = std::move(buckets);
  current_ = {};
}

}  // namespace tessera::parallel
