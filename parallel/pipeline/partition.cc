#include "parallel/pipeline/partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "tensor/error.h"

namespace tessera::parallel::pipeline {

std::vector<int> balance_stages(const std::vector<int64_t>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  TS_CHECK(stages >= 1, "pipeline partition: stages must be >= 1, got {}", stages);
  TS_CHECK(stages <= n,
           "pipeline partition: {} stages for {} layers; each stage needs at least one layer "
           "(use at most {} stages, or a model with more layers)",
           stages, n, n);
  for (int i = 0; i < n; ++i) {
    TS_CHECK(costs[i] >= 0, "pipeline partition: layer {} has negative cost {}", i, costs[i]);
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[s][i]: the smallest possible largest cost splitting layers [0, i) into s stages.
  std::vector<std::vector<int64_t>> best(stages + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int i = s; i <= n; ++i) {
      for (int j = s - 1; j < i; ++j) {  // the last stage is [j, i)
        if (best[s - 1][j] == kInf) continue;
        const int64_t worst = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (worst < best[s][i]) {
          best[s][i] = worst;
          cut[s][i] = j;
        }
      }
    }
  }
  std::vector<int> first(stages);
  for (int s = stages, i = n; s >= 1; --s) {
    first[s - 1] = cut[s][i];
    i = cut[s][i];
  }
  return first;
}

std::vector<int> stages_from_counts(const std::vector<int>& counts, int layers) {
  TS_CHECK(!counts.empty(), "pipeline partition: no stages given");
  std::vector<int> first;
  int total = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    TS_CHECK(counts[s] >= 1, "pipeline partition: stage {} is given {} layers (at least 1)", s,
             counts[s]);
    first.push_back(total);
    total += counts[s];
  }
  TS_CHECK(total == layers, "pipeline partition: the stages hold {} layers, the model has {}",
           total, layers);
  return first;
}

}  // namespace tessera::parallel::pipeline
