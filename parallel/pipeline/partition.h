// Splitting a stack of layers into contiguous pipeline stages.
//
//   std::vector<int> first = balance_stages({10, 40, 40, 40, 40, 10}, 3);   // {0, 2, 4}
//   // stage s holds layers [first[s], first[s + 1]) (the last up to the end)
//
// balance_stages minimises the largest stage's cost (the pipeline's pace), ties broken
// towards earlier boundaries; stages_from_counts takes the user's layers per stage.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::parallel::pipeline {

// Error when there are more stages than layers or a cost is negative.
std::vector<int> balance_stages(const std::vector<int64_t>& layer_costs, int stages);
// counts[s] layers for stage s (each >= 1, summing to the layer count; Error otherwise).
std::vector<int> stages_from_counts(const std::vector<int>& counts, int layers);

}  // namespace tessera::parallel::pipeline
