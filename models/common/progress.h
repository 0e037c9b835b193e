// Progress reporting for the example programs: a status line that rewrites itself in place
// on a terminal and becomes plain lines (at most one per `plain_interval_s`) when stdout is
// piped; the step meter behind it (window loss, throughput, ETA); and a metrics writer
// producing JSON lines for tools/plot_metrics.py.
//
//   Progress progress;                          // detects the terminal
//   progress.update(fmt::format("step {} loss {:.4f}", step, loss));
//   progress.finish();                          // ends the in-place line
//   MetricsWriter metrics("run.jsonl", /*append=*/false);
//   metrics.write({{"step", 10}, {"loss", 0.5}});
#pragma once

#include <chrono>
#include <cstdint>
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

// The steps of a run as a progress line reports them: each step's seconds and loss, the
// window since the last line (mean loss, items per second), the run's throughput and ETA.
//
//   StepMeter meter(batch * context, "tokens", /*timing_skip=*/2);
//   meter.add(seconds, loss);                     // after each step
//   StepMeter::Window w = meter.take_window();    // at a progress line: w.loss, w.rate
class StepMeter {
 public:
  // `items_per_step`: tokens or samples of a step, `unit` their name ("tokens"); the first
  // `timing_skip` steps (warm-up) are left out of rate().
  StepMeter(double items_per_step, std::string unit, int64_t timing_skip = 0);
  void add(double seconds, double loss);
  struct Window {
    int64_t steps = 0;
    double loss = 0.0;  // mean over the window
    double rate = 0.0;  // items per second over the window
  };
  // The window since the last call, which starts a new one.
  Window take_window();
  int64_t steps() const { return steps_; }        // of this run
  double seconds() const { return seconds_; }     // of this run's steps
  // Items per second over this run's steps after the first timing_skip (0: none yet).
  double rate() const;
  // Seconds left for `remaining` steps at this run's mean step time.
  double eta(int64_t remaining) const;
  const std::string& unit() const { return unit_; }
  double items_per_step() const { return items_per_step_; }
  int64_t timing_skip() const { return timing_skip_; }

 private:
  double items_per_step_;
  std::string unit_;
  int64_t timing_skip_;
  int64_t steps_ = 0, window_steps_ = 0;
  double seconds_ = 0.0, timed_seconds_ = 0.0, window_seconds_ = 0.0, window_loss_ = 0.0;
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
