// The table of sharding rules keyed by OpId, and the helpers shared by the rule files
// (sharding_rule.h).
#include "parallel/sharding_rule.h"

namespace tessera::parallel {
namespace {

struct RuleTable {
  ShardingRule entries[kNumOps];
  bool registered[kNumOps] = {};
};
RuleTable& rules() {
  static RuleTable* t = new RuleTable;
  return *t;
}

}  // namespace

void register_sharding_rule(OpId op, ShardingRule rule) {
  rules().entries[static_cast<int>(op)] = rule;
  rules().registered[static_cast<int>(op)] = true;
}

const ShardingRule* sharding_rule_for(OpId op) {
  const int i = static_cast<int>(op);
  return rules().registered[i] ? &rules().entries[i] : nullptr;
}


AxisOption all_replicate(const AxisCtx& c) {
  return AxisOption{std::vector<Placement>(c.in.size(), Replicate()),
                    std::vector<Placement>(c.out.size(), Replicate())};
}

AxisOption uniform(const AxisCtx& c, Placement p, Placement q) {
  return AxisOption{std::vector<Placement>(c.in.size(), p), std::vector<Placement>(c.out.size(), q)};
}

AxisOptions broadcast_options(const AxisCtx& c, const std::vector<std::vector<size_t>>& partial_sets,
                              size_t num_outputs) {
  AxisOptions options{all_replicate(c)};
  const Shape& out = c.out[0].shape;
  const int64_t rank = static_cast<int64_t>(out.size());
  for (int64_t d = 0; d < rank; ++d) {
    AxisOption o{std::vector<Placement>(c.in.size(), Replicate()),
                 std::vector<Placement>(c.out.size(), Replicate())};
    bool any = false;
    for (size_t i = 0; i < c.in.size(); ++i) {
      if (!c.in[i].defined) continue;
      const int64_t j = d - (rank - c.rank(i));  // the input's dim aligned with out dim d
      if (j < 0) continue;                       // missing: broadcast, stays Replicate
      if (c.in[i].shape[j] != out[d]) continue;  // size 1 broadcast: stays Replicate
      o.in[i] = Shard(j);
      any = true;
    }
    if (!any) continue;
    for (size_t k = 0; k < num_outputs && k < c.out.size(); ++k) o.out[k] = Shard(d);
    options.push_back(o);
  }
  for (const std::vector<size_t>& set : partial_sets) {
    AxisOption o = all_replicate(c);
    for (size_t i : set) o.in[i] = Partial();
    for (size_t k = 0; k < num_outputs && k < c.out.size(); ++k) o.out[k] = Partial();
    options.push_back(o);
  }
  return options;
}

}  // namespace tessera::parallel
