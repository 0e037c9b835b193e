// Pipeline schedules as data: for every rank, the ordered list of what it does with each
// micro-batch (forward, backward, and the sends and receives of activations and gradients
// between neighbouring stages). The executor runs these lists; the simulator replays them
// under a cost model to give a timeline, the bubble fraction and the live activations; the
// printer draws the timeline as ASCII (ranks x time).
//
//   Schedule s = one_f_one_b(/*ranks=*/4, /*microbatches=*/8);
//   Timeline t = simulate(s);            // forward 1, backward 2 time units
//   t.bubble_fraction;                   // (p - 1) / m = 0.375
//   std::puts(draw(t).c_str());          // rank 0 |F0 F1 F2 F3 B0 B0 F4 B1 B1 ...
//
// Stages: rank r holds model chunks c = 0 .. chunks-1, and chunk c of rank r is pipeline
// stage c * ranks + r (Megatron's interleaving; one chunk per rank is the plain pipeline).
// Micro-batch i's forward runs stage 0, 1, ..., S-1, its backward S-1, ..., 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::parallel::pipeline {

enum class ActionKind : uint8_t {
  forward,          // run the chunk's forward on the micro-batch (keeps its activations)
  backward,         // run its backward (frees them)
  send_activation,  // to the rank of the next stage
  recv_activation,  // from the rank of the previous stage, before the forward
  send_grad,        // the input's gradient, to the rank of the previous stage
  recv_grad,        // the output's gradient, from the rank of the next stage
};
const char* action_name(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::forward;
  int microbatch = 0;
  int chunk = 0;  // this rank's model chunk (0 .. chunks - 1)
  int peer = -1;  // sends and receives: the other rank
};

struct Schedule {
  std::string name;
  int ranks = 1;
  int microbatches = 1;
  int chunks = 1;  // model chunks (virtual stages) per rank
  std::vector<std::vector<Action>> actions;  // per rank, in execution order

  int num_stages() const { return ranks * chunks; }
  int stage_of(int rank, int chunk) const { return chunk * ranks + rank; }
  int rank_of(int stage) const { return stage % ranks; }
  int chunk_of(int stage) const { return stage / ranks; }
};

// GPipe: every forward, then every backward (in reverse micro-batch order). Each stage keeps
// the activations of all m micro-batches.
Schedule gpipe(int ranks, int microbatches);
// 1F1B (PipeDream-flush): rank r runs min(p - r - 1, m) warm-up forwards, then alternates one
// forward and one backward, then drains the backwards. At most p - r micro-batches live.
Schedule one_f_one_b(int ranks, int microbatches);
// Interleaved 1F1B (Megatron-LM) with `chunks` model chunks per rank: the bubble shrinks by
// the number of chunks. Needs microbatches to be a multiple of ranks.
Schedule interleaved_1f1b(int ranks, int microbatches, int chunks);
// By name: "gpipe", "1f1b" or "interleaved" (chunks used by the last only; Error otherwise).
Schedule make_schedule(const std::string& name, int ranks, int microbatches, int chunks = 1);

// Throws Error unless every (micro-batch, stage) has exactly one forward and one backward
// on the stage's rank, the forward first, every transfer a stage needs is received before
// use from the rank that sends it, and the lists cannot deadlock (sends do not block; a
// receive waits for its send).
void validate(const Schedule& schedule);

struct Slot {
  Action action;
  double start = 0, end = 0;
};
struct Timeline {
  Schedule schedule;
  double forward_cost = 1, backward_cost = 2;
  std::vector<std::vector<Slot>> slots;  // per rank: the compute actions, in order
  double makespan = 0;
  // Idle time over the busy time of a rank (the same on every rank for these schedules:
  // all do equal work): Megatron's (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) for
  // interleaving with v chunks.
  double bubble_fraction = 0;
  // Per rank: the most micro-batch chunks whose forward ran and whose backward has not.
  std::vector<int> peak_live;
};

// Replays the schedule: each rank runs its actions in order; a forward costs
// forward_cost / chunks, a backward backward_cost / chunks, transfers cost nothing and a
// receive waits for its send. Error on a deadlock (naming each rank's blocked action).
Timeline simulate(const Schedule& schedule, double forward_cost = 1, double backward_cost = 2);

// ASCII timeline: one row per rank, one column per time unit of the smallest action; a
// forward shows as "F<microbatch>", a backward as "B<microbatch>" (with ".<chunk>" when
// there are several chunks), idle as dots.
std::string draw(const Timeline& timeline);

}  // namespace tessera::parallel::pipeline
