#include "models/common/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "tensor/error.h"

namespace tessera::models {

Progress::Progress(double plain_interval_s)
    : terminal_(isatty(fileno(stdout)) != 0), interval_s_(plain_interval_s) {}

void Progress::update(const std::string& line, bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (terminal_) {
    // \33[K clears what a longer previous line left behind.
    std::printf("\r%s\33[K", line.c_str());
    std::fflush(stdout);
    line_open_ = true;
    return;
  }
  if (!force && printed_any_ &&
      std::chrono::duration<double>(now - last_).count() < interval_s_) {
    return;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  last_ = now;
  printed_any_ = true;
}

void Progress::finish() {
  if (line_open_) std::printf("\n");
  line_open_ = false;
  std::fflush(stdout);
}

void Progress::print(const std::string& line) {
  finish();
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

StepMeter::StepMeter(double items_per_step, std::string unit, int64_t timing_skip)
    : items_per_step_(items_per_step), unit_(std::move(unit)), timing_skip_(timing_skip) {}

void StepMeter::add(double seconds, double loss) {
  seconds_ += seconds;
  if (steps_ >= timing_skip_) timed_seconds_ += seconds;
  window_seconds_ += seconds;
  window_loss_ += loss;
  ++window_steps_;
  ++steps_;
}

StepMeter::Window StepMeter::take_window() {
  Window w;
  w.steps = window_steps_;
  if (window_steps_ > 0) {
    w.loss = window_loss_ / static_cast<double>(window_steps_);
    w.rate = static_cast<double>(window_steps_) * items_per_step_ / window_seconds_;
  }
  window_steps_ = 0;
  window_seconds_ = window_loss_ = 0.0;
  return w;
}

double StepMeter::rate() const {
  const int64_t timed = steps_ - timing_skip_;
  if (timed <= 0) return 0.0;
  return static_cast<double>(timed) * items_per_step_ /
         (timing_skip_ == 0 ? seconds_ : timed_seconds_);
}

double StepMeter::eta(int64_t remaining) const {
  return static_cast<double>(remaining) * (seconds_ / static_cast<double>(steps_));
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "--";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  TS_CHECK(file_ != nullptr, "metrics: cannot open {} for writing: {}", path,
           std::strerror(errno));
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : file_(std::exchange(other.file_, nullptr)), path_(std::move(other.path_)) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (file_ != nullptr) std::fclose(file_);
    file_ = std::exchange(other.file_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (file_ == nullptr) return;
  const std::string line = record.dump() + "\n";
  TS_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
           "metrics: writing {} failed: {}", path_, std::strerror(errno));
}

}  // namespace tessera::models
