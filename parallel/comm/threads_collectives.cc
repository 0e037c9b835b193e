// The threads backend's collectives (threads_group.h): each runs on the member's worker
// thread between an entry barrier, where the members check that they agree, and an exit
// barrier, reading peers' buffers directly in between.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/comm/threads_group.h"
#include "parallel/comm/threads_reduce.h"

namespace tessera::parallel::threads_internal {
namespace {

// The first thing the members disagree on about their collective, or "". Every member
// computes the same answer from the same slots, so all of them throw or none does.
std::string disagreement(const GroupState& g, OpKind op) {
  const int n = g.size();
  std::string bad;
  auto differs = [&](const char* what, auto value) {
    for (int m = 1; m < n && bad.empty(); ++m) {
      if (value(g.args(m)) != value(g.args(0))) {
        bad = fmt::format("{}: members disagree on the {}: {} has {} but {} has {}", g.where(op),
                          what, g.who(0), value(g.args(0)), g.who(m), value(g.args(m)));
      }
    }
  };
  differs("collective", [](const Args& a) { return std::string_view(op_name(a.op)); });
  if (!bad.empty() || op == OpKind::barrier || op == OpKind::split) return bad;
  differs("dtype", [](const Args& a) { return a.dtype; });
  if (op == OpKind::all_reduce || op == OpKind::broadcast) {
    differs("element count", [](const Args& a) { return a.numel; });
  }
  if (op == OpKind::all_reduce || op == OpKind::reduce_scatter) {
    differs("reduce op", [](const Args& a) { return reduce_op_name(a.rop); });
  }
  if (op == OpKind::broadcast) differs("root", [](const Args& a) { return a.root; });
  if (op == OpKind::all_gather || op == OpKind::reduce_scatter) {
    differs("counts", [n](const Args& a) {
      return fmt::format("[{}]", fmt::join(a.counts, a.counts + n, ", "));
    });
  }
  for (int i = 0; i < n && bad.empty() && op == OpKind::all_to_all; ++i) {
    for (int j = 0; j < n && bad.empty(); ++j) {
      if (g.args(i).recv_counts[j] != g.args(j).counts[i]) {
        bad = fmt::format("{}: {} sends {} elements to {} but it expects {}", g.where(op),
                          g.who(j), g.args(j).counts[i], g.who(i), g.args(i).recv_counts[j]);
      }
    }
  }
  return bad;
}

}  // namespace

void begin(GroupState& g, int me, const Args& args) {
  g.slots[me].args = args;
  g.wait_barrier(me, args.op, true);
  const std::string bad = disagreement(g, args.op);
  if (bad.empty()) return;
  g.sync(me, args.op);
  throw Error(bad);
}

void run_barrier(GroupState& g, int me) {
  begin(g, me, {.op = OpKind::barrier});
  g.sync(me, OpKind::barrier);  // nobody rewrites its slot while a peer still checks it
}

void run_all_reduce(GroupState& g, int me, const Tensor& t, ReduceOp rop) {
  constexpr OpKind op = OpKind::all_reduce;
  char* buf = static_cast<char*>(t.raw_data());
  begin(g, me, {.op = op, .dtype = t.dtype(), .rop = rop, .numel = t.numel(), .out = buf});
  const int n = g.size();
  const int64_t es = dtype_size(t.dtype());
  if (t.numel() > 0) {
    const auto [lo, hi] = block_range(t.numel(), n, me, es);
    if (hi > lo) {
      std::vector<const char*> src(n);
      for (int m = 0; m < n; ++m) src[m] = g.args(m).out + lo * es;
      internal::reduce_into(t.dtype(), rop, buf + lo * es, src, hi - lo);
    }
    g.sync(me, op);
    for (int b = 0; b < n; ++b) {
      const auto [blo, bhi] = block_range(t.numel(), n, b, es);
      if (b != me) copy_bytes(buf + blo * es, g.args(b).out + blo * es, (bhi - blo) * es);
    }
  }
  g.sync(me, op);
}

void run_all_gather(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& counts) {
  constexpr OpKind op = OpKind::all_gather;
  begin(g, me, {.op = op, .dtype = in.dtype(), .in = static_cast<const char*>(in.raw_data()),
                .counts = counts.data()});
  const int64_t es = dtype_size(in.dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (int m = 0; m < g.size(); ++m) {
    copy_bytes(dst + prefix(counts.data(), m) * es, g.args(m).in, counts[m] * es);
  }
  g.sync(me, op);
}

void run_reduce_scatter(GroupState& g, int me, const Tensor& out, const Tensor& in, ReduceOp rop,
                        const std::vector<int64_t>& counts) {
  constexpr OpKind op = OpKind::reduce_scatter;
  begin(g, me, {.op = op, .dtype = in.dtype(), .rop = rop,
                .in = static_cast<const char*>(in.raw_data()), .counts = counts.data()});
  if (counts[me] > 0) {
    const int64_t offset = prefix(counts.data(), me) * dtype_size(in.dtype());
    std::vector<const char*> src(g.size());
    for (int m = 0; m < g.size(); ++m) src[m] = g.args(m).in + offset;
    internal::reduce_into(in.dtype(), rop, static_cast<char*>(out.raw_data()), src, counts[me]);
  }
  g.sync(me, op);
}

void run_broadcast(GroupState& g, int me, const Tensor& t, int root) {
  constexpr OpKind op = OpKind::broadcast;
  char* buf = static_cast<char*>(t.raw_data());
  begin(g, me, {.op = op, .dtype = t.dtype(), .root = root, .numel = t.numel(), .out = buf});
  if (me != root) copy_bytes(buf, g.args(root).out, t.nbytes());
  g.sync(me, op);
}

void run_all_to_all(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts) {
  constexpr OpKind op = OpKind::all_to_all;
  begin(g, me, {.op = op, .dtype = in.dtype(), .in = static_cast<const char*>(in.raw_data()),
                .counts = send_counts.data(), .recv_counts = recv_counts.data()});
  const int64_t es = dtype_size(in.dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (int j = 0; j < g.size(); ++j) {
    const char* src = g.args(j).in + prefix(g.args(j).counts, me) * es;
    copy_bytes(dst + prefix(recv_counts.data(), j) * es, src, recv_counts[j] * es);
  }
  g.sync(me, op);
}

}  // namespace tessera::parallel::threads_internal
