// Checking a parallel layout against one device, tensor by tensor. A run under some layout
// and the same computation on one device go step by step side by side; after each phase the
// layout's tensors (gathered to full) are compared with the single device's by name, in the
// order the step produces them. The first mismatch beyond the tolerance is kept, with where it
// happened, and every later comparison is skipped: the first wrong tensor is the one that
// points at the bug (everything after it inherits the error).
//
//   EquivalenceChecker check("pp 2 x dp 2", 1e-9);
//   check.compare(step, CheckPhase::forward, "h.0 output", got, want,
//                 [&](int64_t i) { return where_row(i); });   // "rows 8-15: dp rank 1"
//   ...
//   if (!check.ok()) std::puts(check.mismatch()->str().c_str());
//
// The error of a tensor is max |got - want| over its elements, relative to max |want| (the
// tensor's scale; a tensor of zeros is compared absolutely), so a gradient that is small
// everywhere is held to the same standard as a large one. Any model can use it: the GPT
// example's `--check` is one (models/gpt/check.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "tensor/tensor.h"

namespace tessera::parallel {

enum class CheckPhase { forward, backward, update };
const char* phase_name(CheckPhase phase);

struct Mismatch {
  int64_t step = 0;
  CheckPhase phase = CheckPhase::forward;
  std::string name;    // the tensor ("h.1 output", "gradient of wte.weight")
  std::string where;   // which ranks / block computed the worst element
  std::string layout;  // the layout checked
  double max_abs = 0.0, max_rel = 0.0, tolerance = 0.0;
  std::vector<int64_t> index;  // the worst element
  std::string str() const;     // one paragraph naming all of the above
};

class EquivalenceChecker {
 public:
  EquivalenceChecker(std::string layout, double tolerance);

  // Compares `got` (the layout's tensor, in full) with `want` (one device's); same shape, or
  // a mismatch naming both shapes. `where(i)` describes who computed flat element i (called
  // for the worst element of a mismatch only). Returns false from the first mismatch on
  // (without comparing again).
  bool compare(int64_t step, CheckPhase phase, const std::string& name, const Tensor& got,
               const Tensor& want, const std::function<std::string(int64_t)>& where = nullptr);

  bool ok() const { return !mismatch_.has_value(); }
  const std::optional<Mismatch>& mismatch() const { return mismatch_; }
  int64_t compared() const { return compared_; }  // tensors compared and found equal
  double worst() const { return worst_; }         // their largest relative error
  double tolerance() const { return tolerance_; }
  const std::string& layout() const { return layout_; }

 private:
  std::string layout_;
  double tolerance_;
  std::optional<Mismatch> mismatch_;
  int64_t compared_ = 0;
  double worst_ = 0.0;
};

}  // namespace tessera::parallel
