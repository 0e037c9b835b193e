// Whether ops record an autograd graph on this thread (each simulated rank is a thread).
//
//   { NoGradGuard guard; y = model(x); }   // no graph is built inside
#pragma once

namespace tessera {

class GradMode {
 public:
  static bool enabled();
  static void set_enabled(bool enabled);
};

// Disables graph recording for its lifetime and restores the previous mode after.
class NoGradGuard {
 public:
  NoGradGuard() : previous_(GradMode::enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Sets grad mode to `enabled` for its lifetime (checkpoint recomputation turns it back on).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : previous_(GradMode::enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~GradModeGuard() { GradMode::set_enabled(previous_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace tessera
