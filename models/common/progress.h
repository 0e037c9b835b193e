// Progress reporting for the example programs: a status line that rewrites itself in place
// on a terminal and becomes plain lines (at most one per `plain_interval_s`) when stdout is
// piped; and a metrics writer producing JSON lines for tools/plot_metrics.py.
//
//   Progress progress;                          // detects the terminal
//   progress.update(fmt::format("step {} loss {:.4f}", step, loss));
//   progress.finish();                          // ends the in-place line
//   MetricsWriter metrics("run.jsonl", /*append=*/false);
//   metrics.write({{"step", 10}, {"loss", 0.5}});
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::models {

class Progress {
 public:
  explicit Progress(double plain_interval_s = 2.0);
  // `force` prints even when the last plain line was recent (epoch ends, final lines).
  void update(const std::string& line, bool force = false);
  // Moves past the in-place line (terminal) so the next output starts on its own line.
  void finish();
  // Plain output that does not collide with the in-place line.
  void print(const std::string& line);
  bool is_terminal() const { return terminal_; }

 private:
  bool terminal_;
  bool line_open_ = false;
  double interval_s_;
  std::chrono::steady_clock::time_point last_;
  bool printed_any_ = false;
};

// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);

// Seconds from `start` to now (steady clock).
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

class MetricsWriter {
 public:
  MetricsWriter() = default;  // disabled: write() does nothing
  // Opens `path` (truncating, or appending when resuming); Error naming the path on failure.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  // One JSON object per line, flushed, so a crashed run keeps what it logged.
  void write(const nlohmann::json& record);
  bool enabled() const { return file_ != nullptr; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace tessera::models
