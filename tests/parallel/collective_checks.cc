#include "tests/parallel/collective_checks.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tests/testing.h"

namespace tessera::parallel::testing {
namespace {

using tessera::testing::contains;
using tessera::testing::error_of;

// Subgroups run the same checks over fewer dtypes: one of each kind of reduction path
// (f32, the f32-accumulated 16-bit floats, integers, bool).
constexpr DType kFewDTypes[] = {DType::f32, DType::bf16, DType::i64, DType::b8};
constexpr ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

// Member `rank`'s element i: integers in [-5, 5], exact in every dtype, and so are sums over
// 8 members; 0/1 for bool; [0, 250] for u8 (moved, never reduced). `salt` gives every call
// its own data.
double value(DType dt, int rank, int64_t i, int salt) {
  if (dt == DType::b8) return (rank + i + salt) % 3 == 0 ? 1.0 : 0.0;
  if (dt == DType::u8) return static_cast<double>((rank * 37 + i * 11 + salt * 5) % 251);
  return static_cast<double>((rank * 7 + i * 3 + salt * 5) % 11 - 5);
}

std::vector<double> values(DType dt, int rank, int64_t len, int salt) {
  std::vector<double> v(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) v[i] = value(dt, rank, i, salt);
  return v;
}

// The device every buffer of this rank's checks lives on (check_collectives' argument; one
// value per rank thread, so the helpers below need no extra parameter).
thread_local Device t_device = kCPU;

Tensor host_values(DType dt, const std::vector<double>& v) {
  return Tensor::from_vector<double>(v, {static_cast<int64_t>(v.size())}).cast(dt);
}

// Values in dt, and an uninitialised buffer, on the checks' device.
Tensor make(DType dt, const std::vector<double>& v) { return host_values(dt, v).to(t_device); }
Tensor buffer(const Shape& shape, DType dt = DType::f32) {
  return Tensor::empty(shape, dt, t_device);
}
Tensor i64s(std::vector<int64_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector<int64_t>(v, {n}).to(t_device);
}

// x rounded to dt the way the library rounds (through a cast).
double round_to(DType dt, double x) { return host_values(dt, {x}).to_vector<double>()[0]; }

double combine(DType dt, ReduceOp op, double a, double b) {
  if (dt == DType::b8) {
    return op == ReduceOp::min ? double(a != 0 && b != 0) : double(a != 0 || b != 0);
  }
  if (op == ReduceOp::max) return std::max(a, b);
  if (op == ReduceOp::min) return std::min(a, b);
  return a + b;
}

// Elements [offset, offset + len) of the n members' values reduced in member order. Sums are
// exact; avg divides in f32 for f32/f16/bf16 (their accumulation type) and rounds once.
std::vector<double> reduced(DType dt, ReduceOp op, int n, int64_t offset, int64_t len, int salt) {
  std::vector<double> out(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) {
    double acc = value(dt, 0, offset + i, salt);
    for (int m = 1; m < n; ++m) acc = combine(dt, op, acc, value(dt, m, offset + i, salt));
    if (op == ReduceOp::avg) {
      acc = dt == DType::f64 ? acc / n
                             : round_to(dt, static_cast<double>(static_cast<float>(acc) /
                                                                static_cast<float>(n)));
    }
    out[i] = acc;
  }
  return out;
}

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Counts that differ per member, with member 1 (member 0 of a single-member group) empty.
std::vector<int64_t> uneven_counts(int n, int salt) {
  std::vector<int64_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = r == 1 % n ? 0 : (r * 3 + salt) % 5 + 1;
  return counts;
}

std::string label(const Communicator& c, const char* op, DType dt, const std::string& detail,
                  bool async) {
  return fmt::format("{} {} {} {} on group '{}' (rank {} of {})", op, dt, detail,
                     async ? "async" : "blocking", c.name(), c.rank(), c.size());
}

// Exact comparison: every expected value is representable in the tensor's dtype.
void check_equal(const Tensor& t, const std::vector<double>& want, const std::string& what) {
  const std::vector<double> got = t.to_vector<double>();
  REQUIRE_MESSAGE(got.size() == want.size(), what, ": ", got.size(), " elements, expected ",
                  want.size());
  size_t bad = 0;
  while (bad < got.size() && got[bad] == want[bad]) ++bad;
  CHECK_MESSAGE(bad == got.size(), what, ": element ", bad, " is ",
                bad < got.size() ? got[bad] : 0.0, ", expected ",
                bad < got.size() ? want[bad] : 0.0);
}

void finish(const WorkHandle& h) {
  h->wait();
  CHECK(h->is_completed());
}

// ---- one function per collective; each works on any communicator ----------------------

void check_all_reduce(Communicator& c, std::span<const DType> dtypes, int& salt) {
  for (DType dt : dtypes) {
    if (dt == DType::u8) continue;  // codes: refused (check_argument_errors)
    for (ReduceOp op : kAllOps) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      // 37: blocks shorter than a cache line; 3000: several reduction chunks per block.
      for (int64_t len : {int64_t{37}, int64_t{3000}}) {
        for (bool async : {false, true}) {
          ++salt;
          Tensor t = make(dt, values(dt, c.rank(), len, salt));
          if (async) finish(c.all_reduce_async(t, op));
          else c.all_reduce(t, op);
          check_equal(t, reduced(dt, op, c.size(), 0, len, salt),
                      label(c, "all_reduce", dt, fmt::format("{} len {}", reduce_op_name(op), len),
                            async));
        }
      }
    }
  }
  Tensor empty = buffer({0}, DType::f32);
  c.all_reduce(empty, ReduceOp::sum);
  CHECK(empty.numel() == 0);
}

void check_all_gather(Communicator& c, std::span<const DType> dtypes, int& salt) {
  const int n = c.size();
  for (DType dt : dtypes) {
    for (bool uneven : {false, true}) {
      for (bool async : {false, true}) {
        ++salt;
        const std::vector<int64_t> counts =
            uneven ? uneven_counts(n, salt) : std::vector<int64_t>(n, 5);
        Tensor in = make(dt, values(dt, c.rank(), counts[c.rank()], salt));
        Tensor out = buffer({sum_of(counts)}, dt);
        const std::vector<int64_t> arg = uneven ? counts : std::vector<int64_t>{};
        if (async) finish(c.all_gather_async(out, in, arg));
        else c.all_gather(out, in, arg);
        std::vector<double> want;
        for (int m = 0; m < n; ++m) {
          const std::vector<double> part = values(dt, m, counts[m], salt);
          want.insert(want.end(), part.begin(), part.end());
        }
        check_equal(out, want, label(c, "all_gather", dt, uneven ? "uneven" : "even", async));
      }
    }
  }
}

void check_reduce_scatter(Communicator& c, std::span<const DType> dtypes, int& salt) {
  const int n = c.size(), me = c.rank();
  for (DType dt : dtypes) {
    if (dt == DType::u8) continue;  // codes: refused (check_argument_errors)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      for (bool uneven : {false, true}) {
        for (bool async : {false, true}) {
          ++salt;
          const std::vector<int64_t> counts =
              uneven ? uneven_counts(n, salt) : std::vector<int64_t>(n, 6);
          Tensor in = make(dt, values(dt, me, sum_of(counts), salt));
          Tensor out = buffer({counts[me]}, dt);
          const std::vector<int64_t> arg = uneven ? counts : std::vector<int64_t>{};
          if (async) finish(c.reduce_scatter_async(out, in, op, arg));
          else c.reduce_scatter(out, in, op, arg);
          const int64_t offset = std::accumulate(counts.begin(), counts.begin() + me, int64_t{0});
          check_equal(out, reduced(dt, op, n, offset, counts[me], salt),
                      label(c, "reduce_scatter", dt,
                            fmt::format("{} {}", reduce_op_name(op), uneven ? "uneven" : "even"),
                            async));
        }
      }
    }
  }
}

void check_broadcast(Communicator& c, std::span<const DType> dtypes, int& salt) {
  for (DType dt : dtypes) {
    for (int root = 0; root < c.size(); ++root) {
      for (bool async : {false, true}) {
        ++salt;
        Tensor t = make(dt, values(dt, c.rank(), 11, salt));
        if (async) finish(c.broadcast_async(t, root));
        else c.broadcast(t, root);
        check_equal(t, values(dt, root, 11, salt),
                    label(c, "broadcast", dt, fmt::format("root {}", root), async));
      }
    }
  }
}

void check_all_to_all(Communicator& c, std::span<const DType> dtypes, int& salt) {
  const int n = c.size(), me = c.rank();
  for (DType dt : dtypes) {
    for (bool uneven : {false, true}) {
      for (bool async : {false, true}) {
        ++salt;
        // Elements member s sends to member j (some zero when uneven).
        auto amount = [&](int s, int j) -> int64_t { return uneven ? (s + 2 * j + salt) % 3 : 4; };
        std::vector<int64_t> send(n), recv(n);
        for (int j = 0; j < n; ++j) {
          send[j] = amount(me, j);
          recv[j] = amount(j, me);
        }
        Tensor in = make(dt, values(dt, me, sum_of(send), salt));
        Tensor out = buffer({sum_of(recv)}, dt);
        const std::vector<int64_t> send_arg = uneven ? send : std::vector<int64_t>{};
        const std::vector<int64_t> recv_arg = uneven ? recv : std::vector<int64_t>{};
        if (async) finish(c.all_to_all_async(out, in, send_arg, recv_arg));
        else c.all_to_all(out, in, send_arg, recv_arg);
        std::vector<double> want;
        for (int j = 0; j < n; ++j) {
          int64_t offset = 0;  // where member j's block for us starts in its input
          for (int k = 0; k < me; ++k) offset += amount(j, k);
          for (int64_t t = 0; t < amount(j, me); ++t) {
            want.push_back(value(dt, j, offset + t, salt));
          }
        }
        check_equal(out, want, label(c, "all_to_all", dt, uneven ? "uneven" : "even", async));
      }
    }
  }
}

// A ring: everyone sends to the next member and receives from the previous one.
void check_send_recv(Communicator& c, std::span<const DType> dtypes, int& salt) {
  const int n = c.size(), me = c.rank();
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (DType dt : dtypes) {
    salt += 5;
    const std::string what = label(c, "send/recv", dt, "ring", false);
    // Tags 5 and 7 are received in the opposite order; tag 9 twice keeps its order.
    c.send(make(dt, values(dt, me, 7, salt)), next, 5);
    c.send(make(dt, values(dt, me, 9, salt + 1)), next, 7);
    c.send(make(dt, values(dt, me, 3, salt + 2)), next, 9);
    c.send(make(dt, values(dt, me, 3, salt + 3)), next, 9);
    Tensor b = buffer({9}, dt), a = buffer({7}, dt);
    Tensor first = buffer({3}, dt), second = buffer({3}, dt);
    c.recv(b, prev, 7);
    c.recv(a, prev, 5);
    c.recv(first, prev, 9);
    c.recv(second, prev, 9);
    check_equal(a, values(dt, prev, 7, salt), what + " tag 5");
    check_equal(b, values(dt, prev, 9, salt + 1), what + " tag 7");
    check_equal(first, values(dt, prev, 3, salt + 2), what + " tag 9, first");
    check_equal(second, values(dt, prev, 3, salt + 3), what + " tag 9, second");

    // Receive posted before the send on every member, both async.
    Tensor in = buffer({5}, dt);
    WorkHandle r = c.recv_async(in, prev, 11);
    WorkHandle s = c.send_async(make(dt, values(dt, me, 5, salt + 4)), next, 11);
    finish(s);
    finish(r);
    check_equal(in, values(dt, prev, 5, salt + 4), what + " recv posted first");
  }
}

// Barriers have no data; what is checked is that they complete and that collectives on
// either side still pair up.
void check_barrier(Communicator& c) {
  c.barrier();
  finish(c.barrier_async());
  Tensor ones = i64s({1, 1});
  c.all_reduce(ones, ReduceOp::sum);
  c.barrier();
  check_equal(ones, {double(c.size()), double(c.size())},
              label(c, "barrier", DType::i64, "", false));
}

// Five different collectives in flight at once, waited in reverse order.
void check_async_in_flight(Communicator& c, int& salt) {
  const int n = c.size(), me = c.rank();
  salt += 5;
  Tensor reduce = make(DType::f32, values(DType::f32, me, 100, salt));
  Tensor gather_in = make(DType::f64, values(DType::f64, me, 4, salt + 1));
  Tensor gather_out = buffer({4 * n}, DType::f64);
  Tensor bcast = make(DType::i32, values(DType::i32, me, 6, salt + 2));
  Tensor rs_in = make(DType::bf16, values(DType::bf16, me, 3 * n, salt + 3));
  Tensor rs_out = buffer({3}, DType::bf16);
  Tensor a2a_in = make(DType::i64, values(DType::i64, me, 2 * n, salt + 4));
  Tensor a2a_out = buffer({2 * n}, DType::i64);
  std::vector<WorkHandle> handles = {
      c.all_reduce_async(reduce, ReduceOp::sum),
      c.all_gather_async(gather_out, gather_in),
      c.broadcast_async(bcast, n - 1),
      c.reduce_scatter_async(rs_out, rs_in, ReduceOp::max),
      c.all_to_all_async(a2a_out, a2a_in),
  };
  for (auto it = handles.rbegin(); it != handles.rend(); ++it) finish(*it);
  const std::string what = label(c, "async in flight", DType::f32, "", true);
  check_equal(reduce, reduced(DType::f32, ReduceOp::sum, n, 0, 100, salt), what + " all_reduce");
  std::vector<double> gathered, exchanged;
  for (int m = 0; m < n; ++m) {
    for (int64_t i = 0; i < 4; ++i) gathered.push_back(value(DType::f64, m, i, salt + 1));
    for (int64_t i = 0; i < 2; ++i) exchanged.push_back(value(DType::i64, m, 2 * me + i, salt + 4));
  }
  check_equal(gather_out, gathered, what + " all_gather");
  check_equal(bcast, values(DType::i32, n - 1, 6, salt + 2), what + " broadcast");
  check_equal(rs_out, reduced(DType::bf16, ReduceOp::max, n, 3 * me, 3, salt + 3),
              what + " reduce_scatter");
  check_equal(a2a_out, exchanged, what + " all_to_all");
}

void check_all(Communicator& c, std::span<const DType> dtypes) {
  int salt = 0;
  check_all_reduce(c, dtypes, salt);
  check_all_gather(c, dtypes, salt);
  check_reduce_scatter(c, dtypes, salt);
  check_broadcast(c, dtypes, salt);
  check_all_to_all(c, dtypes, salt);
  check_send_recv(c, dtypes, salt);
  check_barrier(c);
  check_async_in_flight(c, salt);
}

// Every member's `id` in member order (all_gather of one i64 each).
std::vector<int64_t> gather_ids(Communicator& c, int64_t id) {
  Tensor out = buffer({c.size()}, DType::i64);
  c.all_gather(out, i64s({id}));
  return out.to_vector<int64_t>();
}

void check_group(Communicator& c, const std::string& name, int world_rank,
                 const std::vector<int64_t>& world_ranks) {
  CHECK(c.name() == name);
  REQUIRE(c.size() == static_cast<int>(world_ranks.size()));
  CHECK(world_ranks[c.rank()] == world_rank);
  CHECK_MESSAGE(gather_ids(c, world_rank) == world_ranks, "members of group '", name, "'");
}

void check_split(Communicator& world) {
  const int n = world.size(), me = world.rank();
  // Even and odd ranks, each ranked by world rank.
  CommPtr parity = world.split(me % 2, me, "parity");
  std::vector<int64_t> same_parity;
  for (int r = me % 2; r < n; r += 2) same_parity.push_back(r);
  check_group(*parity, "parity", me, same_parity);
  CHECK(parity->backend() == world.backend());
  check_all(*parity, kFewDTypes);

  // Keys order the members: descending world rank here.
  CommPtr reversed = world.split(0, -me, "reversed");
  std::vector<int64_t> descending(n);
  std::iota(descending.rbegin(), descending.rend(), 0);
  check_group(*reversed, "reversed", me, descending);

  if (n == 4 || n == 8) {
    // A 2 x (n/2) grid: rows and columns, collectives interleaved with the world's.
    const int cols = n / 2, row = me / cols, col = me % cols;
    CommPtr rows = world.split(row, col, "row");
    CommPtr columns = world.split(col, row, "col");
    std::vector<int64_t> row_members, col_members;
    for (int c = 0; c < cols; ++c) row_members.push_back(row * cols + c);
    for (int r = 0; r < 2; ++r) col_members.push_back(r * cols + col);
    check_group(*rows, "row", me, row_members);
    check_group(*columns, "col", me, col_members);
    Tensor row_sum = i64s({me});
    Tensor col_sum = i64s({me});
    Tensor world_sum = i64s({me});
    WorkHandle h = rows->all_reduce_async(row_sum, ReduceOp::sum);
    world.all_reduce(world_sum, ReduceOp::sum);
    columns->all_reduce(col_sum, ReduceOp::sum);
    finish(h);
    CHECK(row_sum.item<int64_t>() == sum_of(row_members));
    CHECK(col_sum.item<int64_t>() == sum_of(col_members));
    CHECK(world_sum.item<int64_t>() == int64_t{n} * (n - 1) / 2);
    int salt = 1000;
    check_all_reduce(*columns, kFewDTypes, salt);

    // Nested: each row split again by column parity.
    CommPtr nested = rows->split(col % 2, col, "row_parity");
    std::vector<int64_t> nested_members;
    for (int c = col % 2; c < cols; c += 2) nested_members.push_back(row * cols + c);
    check_group(*nested, "row_parity", me, nested_members);
    check_broadcast(*nested, kFewDTypes, salt);
  }
}

// Bad arguments throw before anything is exchanged, on every rank alike, so the group stays
// usable (checked at the end).
void check_argument_errors(Communicator& c) {
  const int n = c.size(), me = c.rank();
  Tensor x = buffer({4}, DType::f32);
  // Counts that do not add up to the buffers.
  CHECK(contains(error_of([&] { c.all_gather(buffer({4 * n + 1}), x); }), "all_gather"));
  std::vector<int64_t> counts(n, 4);
  counts[0] = 5;  // rank 0: not its input's size; the others: does not sum to the output
  CHECK_THROWS_AS(c.all_gather(buffer({4 * n}), x, counts), Error);
  CHECK(contains(error_of([&] { c.reduce_scatter(x, buffer({4 * n + 1}), ReduceOp::sum); }),
                 "reduce_scatter"));
  CHECK_THROWS_AS(c.reduce_scatter(x, buffer({4 * n}), ReduceOp::sum, counts), Error);
  CHECK(contains(error_of([&] {
                   c.all_to_all(buffer({n}), buffer({n + 1}),
                                std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1));
                 }),
                 "all_to_all"));
  // Non-contiguous buffers.
  Tensor strided = buffer({3, 4}, DType::f32).t();
  CHECK(contains(error_of([&] { c.all_reduce(strided, ReduceOp::sum); }), "contiguous"));
  CHECK_THROWS_AS(c.broadcast(strided, 0), Error);
  // avg is only defined for floating dtypes.
  CHECK(contains(error_of([&] { c.all_reduce(buffer({3}, DType::i32), ReduceOp::avg); }),
                 "avg"));
  CHECK_THROWS_AS(c.all_reduce(buffer({3}, DType::b8), ReduceOp::avg), Error);
  // u8 holds codes: moved, never reduced.
  CHECK(contains(error_of([&] { c.all_reduce(buffer({3}, DType::u8), ReduceOp::max); }),
                 "u8 tensors hold codes"));
  CHECK(contains(error_of([&] {
                   c.reduce_scatter(buffer({1}, DType::u8), buffer({n}, DType::u8), ReduceOp::sum);
                 }),
                 "u8 tensors hold codes"));
  CHECK_THROWS_AS(c.reduce_scatter(buffer({1}, DType::i64),
                                   buffer({n}, DType::i64), ReduceOp::avg),
                  Error);
  // Peers and roots out of range.
  CHECK_THROWS_AS(c.broadcast(x, n), Error);
  CHECK_THROWS_AS(c.send(x, me), Error);
  CHECK_THROWS_AS(c.recv(x, n), Error);
  // Nothing was started, so the group still pairs up.
  Tensor ones = make(DType::f32, {1.0});
  c.all_reduce(ones, ReduceOp::sum);
  CHECK(ones.item<float>() == float(n));
}

}  // namespace

void check_collectives(const CommPtr& world, Device device) {
  REQUIRE(world);
  t_device = device;
  CHECK(world->name() == "world");
  CHECK(world->rank() >= 0);
  CHECK(world->rank() < world->size());
  check_all(*world, kAllDTypes);
  check_split(*world);
  check_argument_errors(*world);
}

}  // namespace tessera::parallel::testing
