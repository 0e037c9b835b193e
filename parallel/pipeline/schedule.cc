#include "parallel/pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "tensor/error.h"

namespace tessera::parallel::pipeline {

namespace {

void check_sizes(const char* name, int ranks, int microbatches, int chunks) {
  TS_CHECK(ranks >= 1 && microbatches >= 1 && chunks >= 1,
           "pipeline schedule {}: ranks ({}), micro-batches ({}) and chunks ({}) must be >= 1",
           name, ranks, microbatches, chunks);
}

// Puts the transfers around each compute action: a forward of stage s > 0 receives its
// input first and a forward of s < S - 1 sends its output after; a backward of s < S - 1
// receives its output's gradient first, one of s > 0 sends its input's gradient after.
// Neighbouring stages on the same rank (one rank, several chunks) hand over locally.
Schedule with_transfers(Schedule s, const std::vector<std::vector<Action>>& compute) {
  s.actions.assign(s.ranks, {});
  const int last = s.num_stages() - 1;
  for (int r = 0; r < s.ranks; ++r) {
    for (const Action& a : compute[r]) {
      const int stage = s.stage_of(r, a.chunk);
      const bool fwd = a.kind == ActionKind::forward;
      const int from = fwd ? stage - 1 : stage + 1;  // where the input of this action comes from
      const int to = fwd ? stage + 1 : stage - 1;
      if (from >= 0 && from <= last && s.rank_of(from) != r) {
        s.actions[r].push_back({fwd ? ActionKind::recv_activation : ActionKind::recv_grad,
                                a.microbatch, a.chunk, s.rank_of(from)});
      }
      s.actions[r].push_back(a);
      if (to >= 0 && to <= last && s.rank_of(to) != r) {
        s.actions[r].push_back({fwd ? ActionKind::send_activation : ActionKind::send_grad,
                                a.microbatch, a.chunk, s.rank_of(to)});
      }
    }
  }
  return s;
}

Action forward(int mb, int chunk = 0) { return {ActionKind::forward, mb, chunk, -1}; }
Action backward(int mb, int chunk = 0) { return {ActionKind::backward, mb, chunk, -1}; }

bool is_compute(ActionKind k) { return k == ActionKind::forward || k == ActionKind::backward; }
bool is_send(ActionKind k) { return k == ActionKind::send_activation || k == ActionKind::send_grad; }
bool is_recv(ActionKind k) { return k == ActionKind::recv_activation || k == ActionKind::recv_grad; }

// What a transfer carries: (gradient?, micro-batch, the stage that receives it).
using TransferKey = std::tuple<bool, int, int>;
TransferKey key_of(const Schedule& s, int rank, const Action& a) {
  const int stage = s.stage_of(rank, a.chunk);
  switch (a.kind) {
    case ActionKind::send_activation: return {false, a.microbatch, stage + 1};
    case ActionKind::recv_activation: return {false, a.microbatch, stage};
    case ActionKind::send_grad: return {true, a.microbatch, stage - 1};
    default: return {true, a.microbatch, stage};  // recv_grad
  }
}

std::string describe(const Schedule& s, int rank, const Action& a) {
  std::string out = fmt::format("{} micro-batch {}", action_name(a.kind), a.microbatch);
  if (s.chunks > 1) out += fmt::format(" chunk {}", a.chunk);
  out += fmt::format(" (stage {})", s.stage_of(rank, a.chunk));
  if (a.peer >= 0) out += fmt::format(" {} rank {}", is_send(a.kind) ? "to" : "from", a.peer);
  return out;
}

}  // namespace

const char* action_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward: return "forward";
    case ActionKind::backward: return "backward";
    case ActionKind::send_activation: return "send_activation";
    case ActionKind::recv_activation: return "recv_activation";
    case ActionKind::send_grad: return "send_grad";
    case ActionKind::recv_grad: return "recv_grad";
  }
  return "?";
}

Schedule gpipe(int ranks, int microbatches) {
  check_sizes("gpipe", ranks, microbatches, 1);
  Schedule s{"gpipe", ranks, microbatches, 1, {}};
  std::vector<std::vector<Action>> compute(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < microbatches; ++i) compute[r].push_back(forward(i));
    for (int i = microbatches - 1; i >= 0; --i) compute[r].push_back(backward(i));
  }
  return with_transfers(s, compute);
}

Schedule one_f_one_b(int ranks, int microbatches) {
  check_sizes("1f1b", ranks, microbatches, 1);
  Schedule s{"1f1b", ranks, microbatches, 1, {}};
  std::vector<std::vector<Action>> compute(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - r - 1, microbatches);
    int f = 0, b = 0;
    while (f < warmup) compute[r].push_back(forward(f++));
    while (f < microbatches) {
      compute[r].push_back(forward(f++));
      compute[r].push_back(backward(b++));
    }
    while (b < microbatches) compute[r].push_back(backward(b++));
  }
  return with_transfers(s, compute);
}

Schedule interleaved_1f1b(int ranks, int microbatches, int chunks) {
  check_sizes("interleaved", ranks, microbatches, chunks);
  TS_CHECK(microbatches % ranks == 0,
           "pipeline schedule interleaved: micro-batches ({}) must be a multiple of the "
           "pipeline ranks ({}), e.g. {}",
           microbatches, ranks, (microbatches / ranks + 1) * ranks);
  Schedule s{"interleaved", ranks, microbatches, chunks, {}};
  const int total = microbatches * chunks;
  // The k-th forward of a rank works on chunk (k / p) % v, micro-batch (k / pv) p + k % p:
  // p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p. The
  // k-th backward walks the chunks in reverse.
  auto mb_of = [&](int k) { return (k / (ranks * chunks)) * ranks + k % ranks; };
  auto fwd_chunk = [&](int k) { return (k / ranks) % chunks; };
  auto bwd_chunk = [&](int k) { return chunks - 1 - (k / ranks) % chunks; };
  std::vector<std::vector<Action>> compute(ranks);
  for (int r = 0; r < ranks; ++r) {
    // Megatron's warm-up: enough forwards that the first backward's inputs have arrived.
    const int warmup = microbatches == ranks
                           ? total
                           : std::min(total, (ranks - r - 1) * 2 + (chunks - 1) * ranks);
    int f = 0, b = 0;
    while (f < warmup) {
      compute[r].push_back(forward(mb_of(f), fwd_chunk(f)));
      ++f;
    }
    while (f < total) {
      compute[r].push_back(forward(mb_of(f), fwd_chunk(f)));
      ++f;
      compute[r].push_back(backward(mb_of(b), bwd_chunk(b)));
      ++b;
    }
    while (b < total) {
      compute[r].push_back(backward(mb_of(b), bwd_chunk(b)));
      ++b;
    }
  }
  return with_transfers(s, compute);
}

Schedule make_schedule(const std::string& name, int ranks, int microbatches, int chunks) {
  if (name == "gpipe" || name == "1f1b") {
    TS_CHECK(chunks == 1, "pipeline schedule {}: one model chunk per rank, got {} (interleaved "
             "takes several)", name, chunks);
    return name == "gpipe" ? gpipe(ranks, microbatches) : one_f_one_b(ranks, microbatches);
  }
  if (name == "interleaved") return interleaved_1f1b(ranks, microbatches, chunks);
  fail("pipeline: unknown schedule '{}'; expected gpipe, 1f1b or interleaved", name);
}

void validate(const Schedule& s) {
  TS_CHECK(static_cast<int>(s.actions.size()) == s.ranks,
           "pipeline schedule {}: {} action lists for {} ranks", s.name, s.actions.size(), s.ranks);
  const int stages = s.num_stages();
  // (micro-batch, stage) -> position of its forward / backward in its rank's list.
  std::map<std::pair<int, int>, int> fwd_at, bwd_at;
  std::map<TransferKey, int> sends, recvs;
  for (int r = 0; r < s.ranks; ++r) {
    std::set<TransferKey> received;
    for (int i = 0; i < static_cast<int>(s.actions[r].size()); ++i) {
      const Action& a = s.actions[r][i];
      TS_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches && a.chunk >= 0 &&
                   a.chunk < s.chunks,
               "pipeline schedule {}: rank {} action {} ({}) is outside {} micro-batches x {} "
               "chunks",
               s.name, r, i, describe(s, r, a), s.microbatches, s.chunks);
      const int stage = s.stage_of(r, a.chunk);
      if (is_compute(a.kind)) {
        auto& at = a.kind == ActionKind::forward ? fwd_at : bwd_at;
        TS_CHECK(at.emplace(std::make_pair(a.microbatch, stage), i).second,
                 "pipeline schedule {}: rank {} runs {} twice", s.name, r, describe(s, r, a));
        const bool fwd = a.kind == ActionKind::forward;
        const int from = fwd ? stage - 1 : stage + 1;
        if (from >= 0 && from < stages && s.rank_of(from) != r) {
          TS_CHECK(received.count({!fwd, a.microbatch, stage}) == 1,
                   "pipeline schedule {}: rank {} runs {} before receiving its {}", s.name, r,
                   describe(s, r, a), fwd ? "input" : "output's gradient");
        }
        if (!fwd) {
          TS_CHECK(fwd_at.count({a.microbatch, stage}) == 1,
                   "pipeline schedule {}: rank {} runs {} before its forward", s.name, r,
                   describe(s, r, a));
        }
      } else {
        const TransferKey key = key_of(s, r, a);
        const int other = is_send(a.kind) ? s.rank_of(std::get<2>(key))
                                          : s.rank_of(stage + (a.kind == ActionKind::recv_grad ? 1 : -1));
        TS_CHECK(a.peer == other,
                 "pipeline schedule {}: rank {} has {} but that stage lives on rank {}", s.name,
                 r, describe(s, r, a), other);
        auto& count = is_send(a.kind) ? sends : recvs;
        TS_CHECK(++count[key] == 1, "pipeline schedule {}: rank {} repeats {}", s.name, r,
                 describe(s, r, a));
        if (is_recv(a.kind)) received.insert(key);
      }
    }
  }
  for (int mb = 0; mb < s.microbatches; ++mb) {
    for (int stage = 0; stage < stages; ++stage) {
      TS_CHECK(fwd_at.count({mb, stage}) == 1 && bwd_at.count({mb, stage}) == 1,
               "pipeline schedule {}: micro-batch {} has no {} on stage {} (rank {})", s.name,
               mb, fwd_at.count({mb, stage}) == 0 ? "forward" : "backward", stage,
               s.rank_of(stage));
    }
  }
  TS_CHECK(sends == recvs, "pipeline schedule {}: {} sends and {} receives do not pair up",
           s.name, sends.size(), recvs.size());
  simulate(s);  // throws on a deadlock
}

Timeline simulate(const Schedule& s, double forward_cost, double backward_cost) {
  TS_CHECK(forward_cost > 0 && backward_cost > 0,
           "pipeline simulate: costs must be positive, got forward {} backward {}", forward_cost,
           backward_cost);
  Timeline t;
  t.schedule = s;
  t.forward_cost = forward_cost;
  t.backward_cost = backward_cost;
  t.slots.assign(s.ranks, {});
  t.peak_live.assign(s.ranks, 0);
  std::vector<size_t> next(s.ranks, 0);
  std::vector<double> clock(s.ranks, 0.0), busy(s.ranks, 0.0);
  std::vector<int> live(s.ranks, 0);
  std::map<TransferKey, double> sent;  // when each transfer left its sender
  size_t remaining = 0;
  for (const auto& list : s.actions) remaining += list.size();
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        if (is_recv(a.kind)) {
          auto it = sent.find(key_of(s, r, a));
          if (it == sent.end()) break;  // blocked until the peer sends
          clock[r] = std::max(clock[r], it->second);
        } else if (is_send(a.kind)) {
          sent[key_of(s, r, a)] = clock[r];
        } else {
          const double cost =
              (a.kind == ActionKind::forward ? forward_cost : backward_cost) / s.chunks;
          t.slots[r].push_back({a, clock[r], clock[r] + cost});
          clock[r] += cost;
          busy[r] += cost;
          live[r] += a.kind == ActionKind::forward ? 1 : -1;
          t.peak_live[r] = std::max(t.peak_live[r], live[r]);
        }
        ++next[r];
        --remaining;
        progress = true;
      }
    }
  }
  if (remaining > 0) {
    std::string blocked;
    for (int r = 0; r < s.ranks; ++r) {
      if (next[r] < s.actions[r].size()) {
        blocked += fmt::format("; rank {} waits at {}", r, describe(s, r, s.actions[r][next[r]]));
      }
    }
    fail("pipeline schedule {}: deadlock{}", s.name, blocked);
  }
  t.makespan = *std::max_element(clock.begin(), clock.end());
  const double work = *std::max_element(busy.begin(), busy.end());
  t.bubble_fraction = work > 0 ? (t.makespan - work) / work : 0.0;
  return t;
}

std::string draw(const Timeline& t) {
  const Schedule& s = t.schedule;
  const double unit = std::min(t.forward_cost, t.backward_cost) / s.chunks;
  auto label = [&](const Action& a) {
    std::string l = fmt::format("{}{}", a.kind == ActionKind::forward ? 'F' : 'B', a.microbatch);
    if (s.chunks > 1) l += fmt::format(".{}", a.chunk);
    return l;
  };
  size_t width = 2;
  for (const auto& row : t.slots) {
    for (const Slot& slot : row) width = std::max(width, label(slot.action).size());
  }
  const int columns = static_cast<int>(std::lround(t.makespan / unit));
  std::string out = fmt::format("{} schedule: {} ranks, {} micro-batches{}; forward {:g}, "
                                "backward {:g} per micro-batch; bubble {:.3f}\n",
                                s.name, s.ranks, s.microbatches,
                                s.chunks > 1 ? fmt::format(", {} chunks per rank", s.chunks) : "",
                                t.forward_cost, t.backward_cost, t.bubble_fraction);
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> cells(columns, std::string(width, '.'));
    for (const Slot& slot : t.slots[r]) {
      const int begin = static_cast<int>(std::lround(slot.start / unit));
      const int end = static_cast<int>(std::lround(slot.end / unit));
      for (int c = begin; c < end && c < columns; ++c) {
        std::string l = label(slot.action);
        cells[c] = l + std::string(width - l.size(), ' ');
      }
    }
    out += fmt::format("rank {} |", r);
    for (const std::string& c : cells) out += c + " ";
    out.back() = '|';
    out += "\n";
  }
  return out;
}

}  // namespace tessera::parallel::pipeline
