// LayerDispatcher's admission side: the cache copies in flight (polled,
// observed, flushed), starting slot copies, coordinator assignments, engine
// hints, and the admissions after a call (host path, device path).
#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "gpu_worker/dispatcher_internal.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

void LayerDispatcher::PollCopies() {
  auto& pending = impl_->pending;
  size_t kept = 0;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < pending.size(); ++i) {
    if (backend_->CopyDone(pending[i].fence)) {
      ObserveCopy(pending[i].fence, Seconds(now - pending[i].start));
      cache_->CompleteCopy(pending[i].copy);
      PublishSlotMap(pending[i].copy.layer);
    } else {
      pending[kept++] = pending[i];
    }
  }
  pending.resize(kept);
}

void LayerDispatcher::ObserveCopy(uint64_t fence, double host_s) {
  if (std::optional<double> s = backend_->CopySeconds(fence)) {
    planner_.rates().ObserveCopy(*s, false);
  } else {
    // Done at some point before the host looked (queued behind others, perhaps).
    planner_.rates().ObserveCopy(host_s, true);
  }
}

absl::Status LayerDispatcher::FlushCopies() {
  for (auto& p : impl_->pending) {
    if (absl::Status st = backend_->WaitCopy(p.fence); !st.ok()) {
      cache_->AbortCopy(p.copy);
      continue;
    }
    ObserveCopy(p.fence, Seconds(Clock::now() - p.start));
    cache_->CompleteCopy(p.copy);
    PublishSlotMap(p.copy.layer);
  }
  impl_->pending.clear();
  return absl::OkStatus();
}

// Starts the copies the cache planned into slots of `layer`, on the copy
// queue after all compute submitted so far (an evicted slot may still be read
// by earlier calls). A failed start aborts it and every copy after it, so no
// slot stays Loading.
absl::Status LayerDispatcher::StartSlotCopies(int layer, const std::vector<SlotCopy>& copies, bool during_call) {
  if (copies.empty()) return absl::OkStatus();
  // Capturable calls: evicted experts leave the published slot map before
  // their buffers are overwritten, and the copies wait for the capturable
  // calls already enqueued on the engine's stream (during an eager device
  // call: for the layer's last reader, after which nothing reads its slots).
  PublishSlotMap(layer);
  if (!during_call && impl_->planned_stream != nullptr)
    MOE_RETURN_IF_ERROR(backend_->WaitStream(impl_->planned_stream));
  const uint64_t after = during_call ? impl_->last_reader[layer_index_[layer]] : backend_->RecordCompute();
  planner_.CopiesQueued(static_cast<int>(copies.size()));  // the link starts on them as they are enqueued
  for (size_t i = 0; i < copies.size(); ++i) {
    absl::StatusOr<uint64_t> f =
        backend_->LoadExpert(SlotBuffer(layer, copies[i].slot), host_->Find(layer, copies[i].expert), after);
    if (!f.ok()) {
      for (size_t j = i; j < copies.size(); ++j) cache_->AbortCopy(copies[j]);
      return f.status();
    }
    impl_->pending.push_back({copies[i], *f, Clock::now()});
    ++copies_started_;
    if (config_.on_activity) {
      LayerActivity a;
      a.cache_copies = 1;
      a.copy_bytes = copy_bytes_;
      a.link_seconds = planner_.rates().measured ? planner_.rates().CopySeconds() : 0.0;
      config_.on_activity(layer, a);
    }
  }
  return absl::OkStatus();
}

// The admissions' copies (grouped by layer, as the planner lists them): one
// StartSlotCopies per layer's run of copies — one stream wait and fence for
// them, not one per copy (on the GPU host each start cost 11-26 us of the
// decode's host time). A layer whose start fails
// aborts its copies not started; the others are still tried. The first error.
absl::Status LayerDispatcher::StartPlannedCopies(const std::vector<SlotCopy>& planned, bool during_call) {
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

int LayerDispatcher::SlotBuffer(int layer, int slot) const {
  return layer_index_[layer] * slots_per_layer() + slot;
}

int LayerDispatcher::PendingCopies() {
  PollCopies();
  return static_cast<int>(impl_->pending.size());
}

absl::Status LayerDispatcher::ApplyAssignment(int layer, const std::vector<int>& experts,
                                              const std::vector<int>& pinned) {
  if (layer < 0 || layer >= spec_.num_layers || layer_index_[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not served by this worker"));
  if (host_ == nullptr) return absl::FailedPreconditionError("assignment: the worker holds no host copy of the experts");
  for (const std::vector<int>* list : {&experts, &pinned})
    for (int e : *list)
      if (e >= 0 && e < spec_.num_experts && !Owns(layer, e))
        return absl::InvalidArgumentError(absl::StrCat(list == &pinned ? "pinned" : "assignment", ": expert ", e,
                                                       " of layer ", layer, " belongs to rank ",
                                                       ExpertOwner(layer, e, config_.group.size), " of the group, not ",
                                                       config_.group.rank));
  for (int e : pinned)
    if (std::find(experts.begin(), experts.end(), e) == experts.end())
      return absl::InvalidArgumentError(absl::StrCat("pinned: expert ", e, " of layer ", layer, " is not in the assignment"));
  cache_->SetPinned(layer, pinned);
  if (planner_.admission() == nullptr) {
    MOE_ASSIGN_OR_RETURN(const std::vector<SlotCopy> copies, cache_->Assign(layer, experts));
    return StartSlotCopies(layer, copies);
  }
  // predictive: the assignment is the long-horizon placement the admissions
  // work inside. Its newcomers take the slots of the experts it dropped (or
  // empty ones); experts the admissions brought in stay until they lose on
  // value; an expert the admissions evicted is not forced back.
  if (experts.size() > static_cast<size_t>(slots_per_layer()))
    return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": ", experts.size(),
                                                   " experts for ", slots_per_layer(), " slots"));
  std::vector<int>& previous = assigned_[layer_index_[layer]];
  std::vector<bool> wanted(spec_.num_experts, false);
  for (int e : experts) {
    if (e < 0 || e >= spec_.num_experts)
      return absl::InvalidArgumentError(absl::StrCat("assignment of layer ", layer, ": expert ", e, " out of range"));
    wanted[e] = true;
  }
  std::vector<int> free_slots;
  const std::vector<int> held = cache_->SlotExperts(layer);
  for (int s = 0; s < static_cast<int>(held.size()); ++s) {
    const int e = held[s];
    const bool dropped = e >= 0 && !wanted[e] &&
                         std::find(previous.begin(), previous.end(), e) != previous.end() &&
                         cache_->ReadySlot(layer, e) == s && !cache_->pinned(layer, e);
    if (e < 0 || dropped) free_slots.push_back(s);
  }
  std::vector<SlotCopy> copies;
  size_t next = 0;
  for (int e : experts) {
    if (cache_->SlotOf(layer, e) >= 0 || next >= free_slots.size()) continue;
    const bool is_new = std::find(previous.begin(), previous.end(), e) == previous.end();
    // Evicted by admissions: back only into an empty slot (pins always come back).
    if (!is_new && !cache_->pinned(layer, e) && held[free_slots[next]] >= 0) continue;
    MOE_ASSIGN_OR_RETURN(const SlotCopy copy, cache_->Replace(layer, free_slots[next++], e));
    copies.push_back(copy);
  }
  // A pin still not resident (no free slot was left) takes the slot of an
  // unpinned expert, one outside the assignment (an admission) first.
  for (int e : pinned) {
    if (cache_->SlotOf(layer, e) >= 0) continue;
    const std::vector<int> now_held = cache_->SlotExperts(layer);
    int victim = -1;
    for (int pass = 0; pass < 2 && victim < 0; ++pass)
      for (int s = 0; s < static_cast<int>(now_held.size()) && victim < 0; ++s) {
        const int v = now_held[s];
        if (v >= 0 && (cache_->pinned(layer, v) || cache_->ReadySlot(layer, v) != s)) continue;
        if (pass == 0 && v >= 0 && wanted[v]) continue;
        victim = s;
      }
    if (victim < 0) break;  // every slot pinned or loading: the next assignment retries
    MOE_ASSIGN_OR_RETURN(const SlotCopy copy, cache_->Replace(layer, victim, e));
    copies.push_back(copy);
  }
  previous = experts;
  return StartSlotCopies(layer, copies);
}

absl::Status LayerDispatcher::HintRouterLogits(int layer, int T, int k, const float* router_logits) {
  if (planner_.admission() == nullptr)
    return absl::FailedPreconditionError("router_logits: hints need the predictive cache policy");
  if (layer < 0 || layer >= spec_.num_layers || layer_index_[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("router_logits: layer ", layer, " is not served by this worker"));
  if (T < 0 || T > config_.max_tokens)
    return absl::InvalidArgumentError(absl::StrCat("router_logits: T = ", T, " is outside [0, ", config_.max_tokens, "]"));
  if (config_.group.size <= 1) return planner_.admission()->predictor().Hint(layer, T, k, router_logits);
  // Another rank's experts are never this cache's: they leave the hint.
  std::vector<float>& masked = impl_->masked_logits;
  masked.assign(router_logits, router_logits + static_cast<size_t>(std::max(T, 0)) * spec_.num_experts);
  for (size_t i = 0; i < masked.size(); ++i)
    if (!Owns(layer, static_cast<int>(i % spec_.num_experts))) masked[i] = -1e30f;  // finite: Hint refuses NaN/Inf
  return planner_.admission()->predictor().Hint(layer, T, k, masked.data());
}

// Cache admissions after a call: predictive prefetches the next layers'
// predicted experts; lru/lfru admit this call's misses.
absl::Status LayerDispatcher::StartAdmissions(InFlightCall& ctx) {
  Impl& m = *impl_;
  const int layer = ctx.call.batch.layer;
  if (planner_.admission() != nullptr && host_ != nullptr && config_.copy_mode != CopyMode::kAlways) {
    const PredictionQuality before = planner_.admission()->predictor().quality(layer);
    MOE_ASSIGN_OR_RETURN(const std::vector<SlotCopy> planned,
                         planner_.PlanAdmissions(*cache_, layer, ctx.call.batch.n,
                                                 std::max(ctx.call.batch.routing.k, 1), ctx.ids.data()));
    const PredictionQuality& after = planner_.admission()->predictor().quality(layer);
    if (config_.on_activity && after.predicted > before.predicted) {
      LayerActivity a;
      a.predicted = after.predicted - before.predicted;
      a.predicted_used = after.correct - before.correct;
      config_.on_activity(layer, a);
    }
    // Copies into the next layers' slots (StartSlotCopies orders them after
    // the compute recorded so far, so slots of earlier calls are read first).
    MOE_RETURN_IF_ERROR(StartPlannedCopies(planned));
  } else if (host_ != nullptr && config_.policy != CachePolicy::kStatic && planner_.admission() == nullptr &&
             config_.copy_mode != CopyMode::kAlways && !ctx.plan.missed.empty() && config_.admissions_per_call > 0) {
    std::vector<SlotCopy> copies = cache_->PlanAdmissions(layer, ctx.plan.missed, config_.admissions_per_call);
    MOE_RETURN_IF_ERROR(StartSlotCopies(layer, copies));
  }
  return absl::OkStatus();
}

// Admissions for capturable calls, planned between steps: each layer's
// latest call (the GPU's routing log) goes through the planner in layer
// order, as an eager call's routing does after its split (StartAdmissions):
// the predictive policy's admissions, or lru / lfru's. Copies that completed
// meanwhile are published first. Not while the engine captures.
void LayerDispatcher::PlanDeviceAdmissions() {
  Impl& m = *impl_;
  if (!m.device_ready || host_ == nullptr || config_.copy_mode == CopyMode::kAlways ||
      backend_->StreamCapturing(m.planned_stream))
    return;
  PollCopies();
  m.log_seen.resize(layers_.size(), 0);
  std::vector<int32_t> ids;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const DeviceLayerTables& t = m.device_tables[li];
    const int32_t seq = __atomic_load_n(t.routing_log, __ATOMIC_ACQUIRE);
    if (seq == 0 || seq == m.log_seen[li]) continue;  // being written, or seen
    const int T = t.routing_log[1], k = t.routing_log[2];
    if (T < 1 || k < 1 || static_cast<int64_t>(T) * k > t.routing_log_pairs) continue;
    ids.assign(t.routing_log + kRoutingLogHeader, t.routing_log + kRoutingLogHeader + static_cast<size_t>(T) * k);
    if (__atomic_load_n(t.routing_log, __ATOMIC_ACQUIRE) != seq) continue;  // rewritten while read
    m.log_seen[li] = seq;
    AdmitAfter(layers_[li], T, k, ids.data());
  }
}

// The admissions after a call of `layer` with this routing (capturable and
// eager device-planned calls): the predictive policy's, or lru / lfru's for
// the call's missed experts. Needs the host copy; not under copy mode always.
void LayerDispatcher::AdmitAfter(int layer, int T, int k, const int32_t* ids, uint64_t call_running) {
  const bool during_call = call_running != 0;
  if (host_ == nullptr || config_.copy_mode == CopyMode::kAlways) return;
  if (planner_.admission() != nullptr) {
    absl::StatusOr<std::vector<SlotCopy>> planned = planner_.PlanAdmissions(
        *cache_, layer, T, k, ids, [&] { return during_call && !backend_->ComputeDone(call_running); });
    if (planned.ok()) (void)StartPlannedCopies(*planned, during_call);
  } else if (config_.policy != CachePolicy::kStatic && config_.admissions_per_call > 0) {
    std::vector<int> missed;
    for (int i = 0; i < T * k; ++i)
      if (ids[i] >= 0 && cache_->ReadySlot(layer, ids[i]) < 0 &&
          std::find(missed.begin(), missed.end(), ids[i]) == missed.end())
        missed.push_back(ids[i]);
    (void)StartSlotCopies(layer, cache_->PlanAdmissions(layer, missed, config_.admissions_per_call), during_call);
  }
}

}  // namespace moe
