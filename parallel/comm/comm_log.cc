#include "parallel/comm/comm_log.h"

#include <fmt/format.h>

#include <algorithm>

namespace tessera::parallel {
namespace {
thread_local std::vector<CommLog*> open_logs;
thread_local std::vector<std::pair<std::string, CommKind>> causes;
const std::string kNoCause;
}  // namespace

int64_t CommLog::bytes(const std::string& group) const {
  int64_t total = 0;
  for (const CommRecord& r : records) {
    if (group.empty() || r.group == group) total += r.bytes;
  }
  return total;
}

int64_t CommLog::bytes(std::initializer_list<CommKind> kinds) const {
  int64_t total = 0;
  for (const CommRecord& r : records) {
    if (std::find(kinds.begin(), kinds.end(), r.kind) != kinds.end()) total += r.bytes;
  }
  return total;
}

std::string_view comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::other: return "other";
    case CommKind::gradients: return "gradients";
    case CommKind::parameters: return "parameters";
    case CommKind::activations: return "activations";
    case CommKind::control: return "control";
  }
  return "?";
}

int64_t CommLog::count(const std::string& op, const std::string& group) const {
  return std::count_if(records.begin(), records.end(), [&](const CommRecord& r) {
    return r.op == op && (group.empty() || r.group == group);
  });
}

std::string CommLog::str() const {
  std::string out;
  for (const CommRecord& r : records) {
    out += fmt::format("{:<15} group={:<8} n={} bytes={:<10} {} x {:<8} cause={}\n", r.op,
                       r.group, r.group_size, r.bytes, dtype_name(r.dtype), r.elements,
                       r.cause.empty() ? "-" : r.cause);
  }
  return out;
}

CommLogScope::CommLogScope(CommLog& log) : log_(&log) { open_logs.push_back(log_); }
CommLogScope::~CommLogScope() {
  auto it = std::find(open_logs.rbegin(), open_logs.rend(), log_);
  if (it != open_logs.rend()) open_logs.erase(std::next(it).base());
}

CommCause::CommCause(std::string cause, CommKind kind) {
  causes.emplace_back(std::move(cause), kind);
}
CommCause::~CommCause() { causes.pop_back(); }

const std::string& current_comm_cause() {
  return causes.empty() ? kNoCause : causes.back().first;
}

bool comm_log_active() { return !open_logs.empty(); }

void record_collective(CommRecord record) {
  if (open_logs.empty()) return;
  if (record.cause.empty() && !causes.empty()) {
    record.cause = causes.back().first;
    record.kind = causes.back().second;
  }
  for (CommLog* log : open_logs) log->records.push_back(record);
}

}  // namespace tessera::parallel
