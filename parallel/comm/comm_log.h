// The comm log: every collective a thread issues, with its group (mesh axis), its size and
// the op that caused it, while a CommLogScope is open on that thread. Redistribution and the
// sharded ops name the cause with CommCause, so a log reads like
//
//   CommLog log;
//   { CommLogScope scope(log); y = dist::matmul(x, w); }
//   log.str();   // "all_reduce  group=tp  bytes=3072  f32 x 512  cause=matmul ..."
//
// Logs are per thread: with the threads backend each simulated rank keeps its own.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/dtype.h"

namespace tessera::parallel {

// What a collective moves, so a total can be taken by kind instead of by cause names:
// ZeRO's and DDP's gradient reductions and parameter gathers are the training step's
// traffic; control is small bookkeeping (losses, stop flags, norms, consistency checks).
enum class CommKind : uint8_t { other, gradients, parameters, activations, control };
std::string_view comm_kind_name(CommKind kind);

struct CommRecord {
  std::string op;     // all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, ...
  std::string group;  // the communicator's name: a mesh axis ("tp"), "dp,tp", "world"
  int group_size = 1;
  int64_t bytes = 0;     // sent by this rank (communicator.h's wire convention)
  int64_t elements = 0;  // payload elements of this rank's buffer(s)
  DType dtype = DType::f32;
  std::string cause;  // the op or call that issued it ("matmul", "redistribute", ...)
  CommKind kind = CommKind::other;  // the innermost CommCause's
};

class CommLog {
 public:
  std::vector<CommRecord> records;

  // Bytes summed over the records whose group equals `group` (all records when empty).
  int64_t bytes(const std::string& group = "") const;
  // Bytes summed over the records of any of `kinds`.
  int64_t bytes(std::initializer_list<CommKind> kinds) const;
  // Records whose op equals `op` (and group, when given).
  int64_t count(const std::string& op, const std::string& group = "") const;
  void clear() { records.clear(); }
  std::string str() const;  // one line per record
};

// Records the calling thread's collectives into `log` while alive. Scopes nest; every open
// scope on the thread receives the record.
class CommLogScope {
 public:
  explicit CommLogScope(CommLog& log);
  ~CommLogScope();
  CommLogScope(const CommLogScope&) = delete;
  CommLogScope& operator=(const CommLogScope&) = delete;

 private:
  CommLog* log_;
};

// Names the op or call whose collectives follow on this thread, and what they move (the
// innermost wins).
class CommCause {
 public:
  explicit CommCause(std::string cause, CommKind kind = CommKind::other);
  ~CommCause();
  CommCause(const CommCause&) = delete;
  CommCause& operator=(const CommCause&) = delete;
};

// "" outside every CommCause.
const std::string& current_comm_cause();

// Whether any log is open on this thread (callers skip building records otherwise).
bool comm_log_active();
// Appends to every open log on this thread (called by Communicator's public methods).
void record_collective(CommRecord record);

}  // namespace tessera::parallel
