// ExpertCache: the bookkeeping of a GPU worker's expert cache — per MoE layer
// C slots, the slot map expert -> slot, hit/miss counters per (layer, expert),
// and the replacement policy (static set, LRU, or LFRU). It holds no weights:
// a device backend performs the copies it plans.
//
// Correctness rule: an expert is used from a slot only after its copy
// completed. PlanAdmissions/Assign/Replace mark the chosen slots Loading and remove the
// evicted experts from the slot map at once; ReadySlot() and SlotMap() report
// a slot only after CompleteCopy() marked it Ready. A policy change can thus
// make results slower, never wrong.
//
// Not thread-safe: one dispatcher thread owns it (the copy engine reports
// completions back through that thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/types.h"

namespace moe {

// kPredictive: the cache itself plans nothing; an AdmissionPolicy
// (gpu_worker/admission_policy.h) chooses copies through Replace(), and
// coordinator assignments (Assign) and pins still apply.
// (The policy is moe/types.h CachePolicy.)

struct ExpertCacheConfig {
  int num_layers = 0;       // layer indexes are model layer indexes in [0, num_layers)
  int num_experts = 0;
  int slots_per_layer = 0;  // C
  CachePolicy policy = CachePolicy::kLru;
  // LFRU: an expert's score is its token count with exponential decay of this
  // half-life, in accesses of the layer (so every layer ages at its own pace).
  double lfru_half_life = 64.0;
};

// One copy the backend must perform: weights of (layer, expert) into slot.
struct SlotCopy {
  int layer = 0;
  int expert = 0;
  int slot = 0;
  int evicted = -1;  // expert that held the slot before, or -1
};

class ExpertCache {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertCache>> Create(const ExpertCacheConfig& config);

  // The slot (layer, expert) may be computed from, or -1 (not resident, or its copy is in flight).
  int ReadySlot(int layer, int expert) const;
  // expert -> ready slot (-1 otherwise) for one layer; num_experts entries. The
  // device keeps a copy of this array (refreshed when version() changes).
  const std::vector<int32_t>& SlotMap(int layer) const;
  // Bumped whenever any slot map changes.
  uint64_t version() const { return version_; }

  // Records one forward's routing of `layer`: for each distinct expert, the
  // number of (token, expert) pairs; counts hits and misses and feeds the policy.
  void RecordAccess(int layer, const std::vector<int>& experts, const std::vector<int>& pairs);

  // LRU / LFRU: for the experts that just missed in `layer` (as passed to
  // RecordAccess), the copies worth making now — at most `max_copies` — with
  // their slots taken (Loading) and evictions applied. Static: none.
  std::vector<SlotCopy> PlanAdmissions(int layer, const std::vector<int>& missed, int max_copies);

  // Static (coordinator) assignment: the resident set of `layer` becomes
  // `experts` (at most C); returns the copies to make. Experts already
  // resident keep their slots.
  absl::StatusOr<std::vector<SlotCopy>> Assign(int layer, const std::vector<int>& experts);

  // Loads `expert` (not resident nor loading) into `slot` of `layer`, evicting
  // its occupant (a Ready, unpinned expert, or none); the slot is Loading until
  // CompleteCopy. InvalidArgument when the expert or slot does not qualify.
  absl::StatusOr<SlotCopy> Replace(int layer, int slot, int expert);
  // Pins (an operator's or the coordinator's): pinned experts are never
  // evicted by PlanAdmissions or Replace (Assign, the coordinator's own set, may).
  void SetPinned(int layer, const std::vector<int>& experts);
  bool pinned(int layer, int expert) const { return layers_[layer].pinned[expert]; }
  // The slot holding or loading (layer, expert), or -1.
  int SlotOf(int layer, int expert) const { return layers_[layer].slot_of[expert]; }

  // The backend finished `copy`: its slot becomes Ready (unless it was reassigned meanwhile).
  void CompleteCopy(const SlotCopy& copy);
  // The copy failed: the slot becomes empty again.
  void AbortCopy(const SlotCopy& copy);

  uint64_t hits(int layer, int expert) const;
  uint64_t misses(int layer, int expert) const;
  // Hits / (hits + misses) of a layer (0 when it saw no pairs).
  double HitRate(int layer) const;
  // Experts resident or loading in `layer`, by slot (-1 = empty).
  std::vector<int> SlotExperts(int layer) const;
  const ExpertCacheConfig& config() const { return config_; }

 private:
  enum class SlotState : uint8_t { kEmpty, kLoading, kReady };
  struct Slot {
    int expert = -1;
    SlotState state = SlotState::kEmpty;
  };
  struct Layer {
    std::vector<Slot> slots;
    std::vector<int32_t> slot_of;      // expert -> slot holding or loading it, or -1
    std::vector<int32_t> ready_map;    // expert -> ready slot, or -1
    std::vector<uint64_t> hits, misses;
    std::vector<uint64_t> last_use;    // access tick of the layer
    std::vector<double> score;         // LFRU decayed pair count, as of last_use
    std::vector<bool> pinned;          // expert -> never evicted by admissions
    uint64_t tick = 0;
  };
  explicit ExpertCache(const ExpertCacheConfig& c);
  double Score(const Layer& l, int expert) const;  // LFRU score now
  // The slot to (re)use for a newcomer in `l`: empty first, else the policy's
  // victim among Ready slots not touched by this access; -1 if none.
  int ChooseVictim(const Layer& l) const;
  void Evict(Layer& l, int slot);

  ExpertCacheConfig config_;
  std::vector<Layer> layers_;
  uint64_t version_ = 0;
};

}  // namespace moe
