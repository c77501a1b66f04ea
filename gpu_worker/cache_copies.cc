// CacheCopies (cache_copies.h): the cache copies in flight (polled,
// observed, flushed), starting slot copies, coordinator assignments, engine
// hints, and the admissions after a call (host path, device path).
#include "gpu_worker/cache_copies.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe {

CacheCopies::~CacheCopies() {
  for (PendingCopy& p : pending_) (void)ctx_.backend->WaitCopy(p.fence);
}

void CacheCopies::Poll() {
  size_t kept = 0;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (ctx_.backend->CopyDone(pending_[i].fence)) {
      ObserveCopy(pending_[i].fence, Seconds(now - pending_[i].start));
      ctx_.cache->CompleteCopy(pending_[i].copy);
      readers_.PublishSlotMap(pending_[i].copy.layer);
    } else {
      pending_[kept++] = pending_[i];
    }
  }
  pending_.resize(kept);
}

void CacheCopies::ObserveCopy(uint64_t fence, double host_s) {
  if (std::optional<double> s = ctx_.backend->CopySeconds(fence)) {
    ctx_.planner.rates().ObserveCopy(*s, false);
  } else {
    // Done at some point before the host looked (queued behind others, perhaps).
    ctx_.planner.rates().ObserveCopy(host_s, true);
  }
}

absl::Status CacheCopies::Flush() {
  for (PendingCopy& p : pending_) {
    if (absl::Status st = ctx_.backend->WaitCopy(p.fence); !st.ok()) {
      ctx_.cache->AbortCopy(p.copy);
      continue;
    }
    ObserveCopy(p.fence, Seconds(Clock::now() - p.start));
    ctx_.cache->CompleteCopy(p.copy);
    readers_.PublishSlotMap(p.copy.layer);
  }
  pending_.clear();
  return absl::OkStatus();
}

int CacheCopies::Pending() {
  Poll();
  return static_cast<int>(pending_.size());
}

void CacheCopies::Track(const SlotCopy& copy, uint64_t fence) {
  pending_.push_back({copy, fence, Clock::now()});
  ++copies_started_;
}

// On the copy queue after the compute that may still read an evicted slot
// (SlotReaders::CopyAfter); evicted experts leave the published slot map first.
absl::Status CacheCopies::StartSlotCopies(int layer, const std::vector<SlotCopy>& copies, bool during_call) {
  if (copies.empty()) return absl::OkStatus();
  readers_.PublishSlotMap(layer);
  absl::StatusOr<uint64_t> after = readers_.CopyAfter(layer, during_call);
  if (!after.ok()) {
    for (const SlotCopy& c : copies) ctx_.cache->AbortCopy(c);
    return after.status();
  }
  ctx_.planner.CopiesQueued(static_cast<int>(copies.size()));  // the link starts on them as they are enqueued
  const DispatcherConfig& config = ctx_.config;
  for (size_t i = 0; i < copies.size(); ++i) {
    absl::StatusOr<uint64_t> f = ctx_.backend->LoadExpert(ctx_.SlotBuffer(layer, copies[i].slot),
                                                          ctx_.host->Find(layer, copies[i].expert), *after);
    if (!f.ok()) {
      for (size_t j = i; j < copies.size(); ++j) ctx_.cache->AbortCopy(copies[j]);
      return f.status();
    }
    Track(copies[i], *f);
    if (config.on_activity) {
      LayerActivity a;
      a.cache_copies = 1;
      a.copy_bytes = ctx_.copy_bytes;
      a.link_seconds = ctx_.planner.rates().measured ? ctx_.planner.rates().CopySeconds() : 0.0;
      config.on_activity(layer, a);
    }
  }
  return absl::OkStatus();
}

// The admissions' copies (grouped by layer, as the planner lists them): one
// StartSlotCopies per layer's run of copies — one stream wait and fence for
// them, not one per copy (on the GPU host each start cost 11-26 us of the
// decode's host time). A layer whose start fails
// aborts its copies not started; the others are still tried. The first error.
absl::Status CacheCopies::StartPlannedCopies(const std::vector<SlotCopy>& planned, bool during_call) {
  absl::Status first;
  std::vector<SlotCopy> run;
  for (size_t i = 0; i < planned.size();) {
    size_t j = i + 1;
    while (j < planned.size() && planned[j].layer == planned[i].layer) ++j;
    run.assign(planned.begin() + static_cast<std::ptrdiff_t>(i), planned.begin() + static_cast<std::ptrdiff_t>(j));
    if (absl::Status st = StartSlotCopies(planned[i].layer, run, during_call); first.ok()) first = std::move(st);
    i = j;
  }
  return first;
}

// Long: the assignment's checks, then predictive's merge of it with the admissions' own choices.
absl::Status CacheCopies::ApplyAssignment(int layer, const std::vector<int>& experts, const std::vector<int>& pinned) {
  ExpertCache& cache = *ctx_.cache;
  const int E = ctx_.spec.num_experts;
  if (!ctx_.Serves(layer))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not served by this worker"));
  if (ctx_.host == nullptr)
    return absl::FailedPreconditionError("assignment: the worker holds no host copy of the experts");
  for (const std::vector<int>* list : {&experts, &pinned})
    for (int e : *list)
      if (e >= 0 && e < E && !ctx_.Owns(layer, e))
        return absl::InvalidArgumentError(absl::StrCat(list == &pinned ? "pinned" : "assignment", ": expert ", e,
                                                       " of layer ", layer, " belongs to rank ",
                                                       ExpertOwner(layer, e, ctx_.config.group.size),
                                                       " of the group, not ", ctx_.config.group.rank));
  for (int e : pinned)
    if (std::find(experts.begin(), experts.end(), e) == experts.end())
      return absl::InvalidArgumentError(absl::StrCat("pinned: expert ", e, " of layer ", layer, " is not in the assignment"));
  cache.SetPinned(layer, pinned);
  if (ctx_.planner.admission() == nullptr) {
    MOE_ASSIGN_OR_RETURN(const std::vector<SlotCopy> copies, cache.Assign(layer, experts));
    return StartSlotCopies(layer, copies);
  }
  // predictive: the assignment is the long-horizon placement the admissions
  // work inside. Its newcomers take the slots of the experts it dropped (or
  // empty ones); experts the admissions brought in stay until they lose on
  // value; an expert the admissions evicted is not forced back.
  if (experts.size() > static_cast<size_t>(ctx_.slots_per_layer()))
    return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": ", experts.size(),
                                                   " experts for ", ctx_.slots_per_layer(), " slots"));
  assigned_.resize(ctx_.layers.size());
  std::vector<int>& previous = assigned_[ctx_.layer_index[layer]];
  std::vector<bool> wanted(E, false);
  for (int e : experts) {
    if (e < 0 || e >= E)
      return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": expert ", e, " out of range"));
    wanted[e] = true;
  }
  std::vector<int> free_slots;
  const std::vector<int> held = cache.SlotExperts(layer);
  for (int s = 0; s < static_cast<int>(held.size()); ++s) {
    const int e = held[s];
    const bool dropped = e >= 0 && !wanted[e] && std::find(previous.begin(), previous.end(), e) != previous.end() &&
                         cache.ReadySlot(layer, e) == s && !cache.pinned(layer, e);
    if (e < 0 || dropped) free_slots.push_back(s);
  }
  std::vector<SlotCopy> copies;
  size_t next = 0;
  for (int e : experts) {
    if (cache.SlotOf(layer, e) >= 0 || next >= free_slots.size()) continue;
    const bool is_new = std::find(previous.begin(), previous.end(), e) == previous.end();
    // Evicted by admissions: back only into an empty slot (pins always come back).
    if (!is_new && !cache.pinned(layer, e) && held[free_slots[next]] >= 0) continue;
    MOE_ASSIGN_OR_RETURN(const SlotCopy copy, cache.Replace(layer, free_slots[next++], e));
    copies.push_back(copy);
  }
  // A pin still not resident (no free slot was left) takes the slot of an
  // unpinned expert, one outside the assignment (an admission) first.
  for (int e : pinned) {
    if (cache.SlotOf(layer, e) >= 0) continue;
    const std::vector<int> now_held = cache.SlotExperts(layer);
    int victim = -1;
    for (int pass = 0; pass < 2 && victim < 0; ++pass)
      for (int s = 0; s < static_cast<int>(now_held.size()) && victim < 0; ++s) {
        const int v = now_held[s];
        if (v >= 0 && (cache.pinned(layer, v) || cache.ReadySlot(layer, v) != s)) continue;
        if (pass == 0 && v >= 0 && wanted[v]) continue;
        victim = s;
      }
    if (victim < 0) break;  // every slot pinned or loading: the next assignment retries
    MOE_ASSIGN_OR_RETURN(const SlotCopy copy, cache.Replace(layer, victim, e));
    copies.push_back(copy);
  }
  previous = experts;
  return StartSlotCopies(layer, copies);
}

absl::StatusOr<int> CacheCopies::FillEmptySlots() {
  ExpertCache& cache = *ctx_.cache;
  assigned_.resize(ctx_.layers.size());
  int filled = 0;
  for (int layer : ctx_.layers) {
    const std::vector<int> held = cache.SlotExperts(layer);
    std::vector<SlotCopy> copies;
    int e = 0;
    for (int s = 0; s < static_cast<int>(held.size()); ++s) {
      if (held[s] >= 0) continue;
      while (e < ctx_.spec.num_experts &&
             (!ctx_.Owns(layer, e) || cache.SlotOf(layer, e) >= 0 || ctx_.host->Find(layer, e) == nullptr))
        ++e;
      if (e >= ctx_.spec.num_experts) break;
      MOE_ASSIGN_OR_RETURN(const SlotCopy copy, cache.Replace(layer, s, e++));
      copies.push_back(copy);
    }
    if (ctx_.planner.admission() != nullptr)
      for (const SlotCopy& c : copies) assigned_[ctx_.layer_index[layer]].push_back(c.expert);
    MOE_RETURN_IF_ERROR(StartSlotCopies(layer, copies));
  }
  MOE_RETURN_IF_ERROR(Flush());  // a copy that failed leaves its slot empty (aborted)
  for (int layer : ctx_.layers)
    for (int e : cache.SlotExperts(layer)) filled += e >= 0 && cache.ReadySlot(layer, e) >= 0;
  return filled;
}

absl::Status CacheCopies::HintRouterLogits(int layer, int T, int k, const float* router_logits) {
  AdmissionPolicy* admission = ctx_.planner.admission();
  if (admission == nullptr)
    return absl::FailedPreconditionError("router_logits: hints need the predictive cache policy");
  if (!ctx_.Serves(layer))
    return absl::InvalidArgumentError(absl::StrCat("router_logits: layer ", layer, " is not served by this worker"));
  if (T < 0 || T > ctx_.config.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("router_logits: T = ", T, " is outside [0, ", ctx_.config.max_tokens, "]"));
  if (ctx_.config.group.size <= 1) return admission->predictor().Hint(layer, T, k, router_logits);
  // Another rank's experts are never this cache's: they leave the hint.
  const int E = ctx_.spec.num_experts;
  masked_logits_.assign(router_logits, router_logits + static_cast<size_t>(std::max(T, 0)) * E);
  for (size_t i = 0; i < masked_logits_.size(); ++i)
    if (!ctx_.Owns(layer, static_cast<int>(i % E))) masked_logits_[i] = -1e30f;  // finite: Hint refuses NaN/Inf
  return admission->predictor().Hint(layer, T, k, masked_logits_.data());
}

// Predictive prefetches the next layers' predicted experts; lru/lfru admit
// this call's misses.
absl::Status CacheCopies::AfterHostCall(int layer, int T, int k, const int32_t* ids, const std::vector<int>& missed) {
  const DispatcherConfig& config = ctx_.config;
  if (ctx_.host == nullptr || config.copy_mode == CopyMode::kAlways) return absl::OkStatus();
  if (AdmissionPolicy* admission = ctx_.planner.admission(); admission != nullptr) {
    const PredictionQuality before = admission->predictor().quality(layer);
    MOE_ASSIGN_OR_RETURN(const std::vector<SlotCopy> planned,
                         ctx_.planner.PlanAdmissions(*ctx_.cache, layer, T, k, ids));
    const PredictionQuality& after = admission->predictor().quality(layer);
    if (config.on_activity && after.predicted > before.predicted) {
      LayerActivity a;
      a.predicted = after.predicted - before.predicted;
      a.predicted_used = after.correct - before.correct;
      config.on_activity(layer, a);
    }
    // Copies into the next layers' slots (after the compute recorded so far,
    // so slots of earlier calls are read first).
    return StartPlannedCopies(planned);
  }
  if (config.policy != CachePolicy::kStatic && !missed.empty() && config.admissions_per_call > 0)
    return StartSlotCopies(layer, ctx_.cache->PlanAdmissions(layer, missed, config.admissions_per_call));
  return absl::OkStatus();
}

void CacheCopies::AfterDeviceCall(int layer, int T, int k, const int32_t* ids, uint64_t call_running) {
  const bool during_call = call_running != 0;
  const DispatcherConfig& config = ctx_.config;
  if (ctx_.host == nullptr || config.copy_mode == CopyMode::kAlways) return;
  if (ctx_.planner.admission() != nullptr) {
    absl::StatusOr<std::vector<SlotCopy>> planned = ctx_.planner.PlanAdmissions(
        *ctx_.cache, layer, T, k, ids, [&] { return during_call && !ctx_.backend->ComputeDone(call_running); });
    if (planned.ok()) (void)StartPlannedCopies(*planned, during_call);
  } else if (config.policy != CachePolicy::kStatic && config.admissions_per_call > 0) {
    std::vector<int> missed;
    for (int i = 0; i < T * k; ++i)
      if (ids[i] >= 0 && ctx_.cache->ReadySlot(layer, ids[i]) < 0 &&
          std::find(missed.begin(), missed.end(), ids[i]) == missed.end())
        missed.push_back(ids[i]);
    (void)StartSlotCopies(layer, ctx_.cache->PlanAdmissions(layer, missed, config.admissions_per_call), during_call);
  }
}

}  // namespace moe
