#include "gpu_worker/expert_cache.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<std::unique_ptr<ExpertCache>> ExpertCache::Create(const ExpertCacheConfig& c) {
  if (c.num_layers <= 0 || c.num_experts <= 0)
    return absl::InvalidArgumentError("expert cache: num_layers and num_experts must be > 0");
  if (c.slots_per_layer < 0 || c.slots_per_layer > c.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("expert cache: slots per layer ", c.slots_per_layer,
                                                   " must be in [0, num_experts=", c.num_experts, "]"));
  if (!(c.lfru_half_life > 0)) return absl::InvalidArgumentError("expert cache: lfru_half_life must be > 0");
  return std::unique_ptr<ExpertCache>(new ExpertCache(c));
}

ExpertCache::ExpertCache(const ExpertCacheConfig& c) : config_(c), layers_(c.num_layers) {
  for (Layer& l : layers_) {
    l.slots.resize(c.slots_per_layer);
    l.slot_of.assign(c.num_experts, -1);
    l.ready_map.assign(c.num_experts, -1);
    l.hits.assign(c.num_experts, 0);
    l.misses.assign(c.num_experts, 0);
    l.last_use.assign(c.num_experts, 0);
    l.score.assign(c.num_experts, 0.0);
    l.pinned.assign(c.num_experts, false);
  }
}

int ExpertCache::ReadySlot(int layer, int expert) const { return layers_[layer].ready_map[expert]; }

const std::vector<int32_t>& ExpertCache::SlotMap(int layer) const { return layers_[layer].ready_map; }

double ExpertCache::Score(const Layer& l, int expert) const {
  const double age = static_cast<double>(l.tick - l.last_use[expert]);
  return l.score[expert] * std::exp2(-age / config_.lfru_half_life);
}

void ExpertCache::RecordAccess(int layer, const std::vector<int>& experts, const std::vector<int>& pairs) {
  Layer& l = layers_[layer];
  ++l.tick;
  for (size_t i = 0; i < experts.size(); ++i) {
    const int e = experts[i];
    const int n = i < pairs.size() ? pairs[i] : 1;
    (l.ready_map[e] >= 0 ? l.hits[e] : l.misses[e]) += static_cast<uint64_t>(n);
    l.score[e] = Score(l, e) + n;
    l.last_use[e] = l.tick;
  }
}

int ExpertCache::ChooseVictim(const Layer& l) const {
  int victim = -1;
  double best = 0;
  for (int s = 0; s < static_cast<int>(l.slots.size()); ++s) {
    const Slot& slot = l.slots[s];
    if (slot.state == SlotState::kEmpty) return s;
    if (slot.state != SlotState::kReady || l.last_use[slot.expert] == l.tick) continue;  // in use by this access
    if (l.pinned[slot.expert]) continue;
    const double key = config_.policy == CachePolicy::kLfru ? Score(l, slot.expert)
                                                                : static_cast<double>(l.last_use[slot.expert]);
    if (victim < 0 || key < best) {
      victim = s;
      best = key;
    }
  }
  return victim;
}

void ExpertCache::Evict(Layer& l, int slot) {
  Slot& s = l.slots[slot];
  if (s.expert >= 0) {
    l.slot_of[s.expert] = -1;
    l.ready_map[s.expert] = -1;
  }
  s = Slot{};
  ++version_;
}

std::vector<SlotCopy> ExpertCache::PlanAdmissions(int layer, const std::vector<int>& missed, int max_copies) {
  std::vector<SlotCopy> copies;
  if (config_.policy == CachePolicy::kStatic || config_.policy == CachePolicy::kPredictive) return copies;
  Layer& l = layers_[layer];
  // Most valuable misses first (LFRU: by score; LRU: in the order given).
  std::vector<int> order = missed;
  if (config_.policy == CachePolicy::kLfru) {
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return Score(l, a) > Score(l, b); });
  }
  for (int e : order) {
    if (static_cast<int>(copies.size()) >= max_copies) break;
    if (l.slot_of[e] >= 0) continue;  // already resident or loading
    const int slot = ChooseVictim(l);
    if (slot < 0) break;
    const int old = l.slots[slot].expert;
    // LFRU admits a newcomer only if it is worth more than what it evicts.
    if (config_.policy == CachePolicy::kLfru && old >= 0 && Score(l, e) <= Score(l, old)) continue;
    Evict(l, slot);
    l.slots[slot] = Slot{e, SlotState::kLoading};
    l.slot_of[e] = slot;
    copies.push_back({layer, e, slot, old});
  }
  return copies;
}

absl::StatusOr<std::vector<SlotCopy>> ExpertCache::Assign(int layer, const std::vector<int>& experts) {
  Layer& l = layers_[layer];
  if (experts.size() > l.slots.size())
    return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": ", experts.size(),
                                                   " experts for ", l.slots.size(), " slots"));
  std::vector<bool> wanted(config_.num_experts, false);
  for (int e : experts) {
    if (e < 0 || e >= config_.num_experts)
      return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": expert ", e, " out of range"));
    if (wanted[e])
      return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": expert ", e, " twice"));
    wanted[e] = true;
  }
  // Free the slots of experts no longer wanted, then fill them with newcomers.
  std::vector<int> free_slots;
  for (int s = 0; s < static_cast<int>(l.slots.size()); ++s) {
    const int e = l.slots[s].expert;
    if (e < 0 || !wanted[e]) free_slots.push_back(s);
  }
  std::vector<SlotCopy> copies;
  size_t next = 0;
  for (int e : experts) {
    if (l.slot_of[e] >= 0) continue;  // stays where it is
    const int slot = free_slots[next++];
    const int old = l.slots[slot].expert;
    Evict(l, slot);
    l.slots[slot] = Slot{e, SlotState::kLoading};
    l.slot_of[e] = slot;
    copies.push_back({layer, e, slot, old});
  }
  for (; next < free_slots.size(); ++next) {
    if (l.slots[free_slots[next]].expert >= 0) Evict(l, free_slots[next]);
  }
  return copies;
}

absl::StatusOr<SlotCopy> ExpertCache::Replace(int layer, int slot, int expert) {
  if (layer < 0 || layer >= config_.num_layers)
    return absl::InvalidArgumentError(absl::StrCat("replace: layer ", layer, " out of range"));
  Layer& l = layers_[layer];
  if (expert < 0 || expert >= config_.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("replace: expert ", expert, " out of range"));
  if (slot < 0 || slot >= static_cast<int>(l.slots.size()))
    return absl::InvalidArgumentError(absl::StrCat("replace: slot ", slot, " out of range"));
  if (l.slot_of[expert] >= 0)
    return absl::InvalidArgumentError(absl::StrCat("replace: expert ", expert, " is already resident or loading"));
  const Slot& s = l.slots[slot];
  if (s.state == SlotState::kLoading)
    return absl::InvalidArgumentError(absl::StrCat("replace: slot ", slot, " is loading"));
  if (s.expert >= 0 && l.pinned[s.expert])
    return absl::InvalidArgumentError(absl::StrCat("replace: expert ", s.expert, " in slot ", slot, " is pinned"));
  const int old = s.expert;
  Evict(l, slot);
  l.slots[slot] = Slot{expert, SlotState::kLoading};
  l.slot_of[expert] = slot;
  return SlotCopy{layer, expert, slot, old};
}

void ExpertCache::SetPinned(int layer, const std::vector<int>& experts) {
  Layer& l = layers_[layer];
  l.pinned.assign(config_.num_experts, false);
  for (int e : experts)
    if (e >= 0 && e < config_.num_experts) l.pinned[e] = true;
}

void ExpertCache::CompleteCopy(const SlotCopy& c) {
  Layer& l = layers_[c.layer];
  Slot& s = l.slots[c.slot];
  if (s.expert != c.expert || s.state != SlotState::kLoading) return;  // reassigned meanwhile
  s.state = SlotState::kReady;
  l.ready_map[c.expert] = c.slot;
  ++version_;
}

void ExpertCache::AbortCopy(const SlotCopy& c) {
  Layer& l = layers_[c.layer];
  if (l.slots[c.slot].expert == c.expert && l.slots[c.slot].state == SlotState::kLoading) Evict(l, c.slot);
}

uint64_t ExpertCache::hits(int layer, int expert) const { return layers_[layer].hits[expert]; }
uint64_t ExpertCache::misses(int layer, int expert) const { return layers_[layer].misses[expert]; }

double ExpertCache::HitRate(int layer) const {
  const Layer& l = layers_[layer];
  uint64_t h = 0, m = 0;
  for (int e = 0; e < config_.num_experts; ++e) {
    h += l.hits[e];
    m += l.misses[e];
  }
  return h + m == 0 ? 0.0 : static_cast<double>(h) / static_cast<double>(h + m);
}

std::vector<int> ExpertCache::SlotExperts(int layer) const {
  std::vector<int> out;
  for (const Slot& s : layers_[layer].slots) out.push_back(s.expert);
  return out;
}

}  // namespace moe
