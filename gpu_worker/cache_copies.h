// The cache copies of a LayerDispatcher (a private part, see
// layer_dispatcher.h) — its admission worker: copies into cache slots in
// flight (polled, timed for the planner, flushed), coordinator assignments,
// engine hints, and the admissions after a call that the planner decides
// (predictive) or the cache plans (lru / lfru).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/dispatch_context.h"

namespace moe {

// What a cache copy must respect of the device-planned calls (the device
// executor): the slot map they read, and the calls already enqueued that
// may still read a slot being replaced.
class SlotReaders {
 public:
  virtual ~SlotReaders() = default;
  // `layer`'s Ready slots, published to the device-planned calls.
  virtual void PublishSlotMap(int layer) = 0;
  // The compute fence a copy into `layer`'s slots starts after: every call
  // enqueued so far, or — `during_call`, planned while an eager device-path
  // call of the layer runs — that layer's last reader.
  virtual absl::StatusOr<uint64_t> CopyAfter(int layer, bool during_call) = 0;
};

class CacheCopies {
 public:
  CacheCopies(DispatchContext& ctx, SlotReaders& readers) : ctx_(ctx), readers_(readers) {}
  ~CacheCopies();  // waits for the copies in flight
  CacheCopies(const CacheCopies&) = delete;
  CacheCopies& operator=(const CacheCopies&) = delete;

  // Completed copies make their slots Ready (and are timed).
  void Poll();
  // Waits for every copy in flight.
  absl::Status Flush();
  // Copies still in flight (completed ones collected first).
  int Pending();
  bool any_in_flight() const { return !pending_.empty(); }
  uint64_t copies_started() const { return copies_started_; }
  // One finished copy for the planner's rates: its time on the copy queue
  // when the backend tells it, else `host_s` from the host clock (an upper bound).
  void ObserveCopy(uint64_t fence, double host_s);
  // A copy into a cache slot an executor started itself (copy mode always:
  // it computes from the new slot), completed like the others.
  void Track(const SlotCopy& copy, uint64_t fence);

  // Starts the copies the cache planned into slots of `layer` (after
  // SlotReaders::CopyAfter). A failed start aborts it and every copy after
  // it, so no slot stays Loading.
  absl::Status StartSlotCopies(int layer, const std::vector<SlotCopy>& copies, bool during_call = false);
  absl::Status ApplyAssignment(int layer, const std::vector<int>& experts, const std::vector<int>& pinned);
  // Fills every served layer's empty slots with its first experts this rank
  // owns and waits for the copies (DispatcherConfig::fill_cache); under
  // predictive they are the layer's provisional assignment, so the
  // coordinator's first one takes their slots. Returns the experts copied.
  absl::StatusOr<int> FillEmptySlots();
  absl::Status HintRouterLogits(int layer, int T, int k, const float* router_logits);
  // The admissions after a host-path call of `layer` (routing `ids` [T, k],
  // `missed`: its experts without a Ready slot).
  absl::Status AfterHostCall(int layer, int T, int k, const int32_t* ids, const std::vector<int>& missed);
  // The admissions after a device-planned call of `layer` with this routing
  // (call_running: the compute fence of the eager device-path call that runs
  // while this plans; 0: after the call). Errors are dropped: a later call
  // plans again.
  void AfterDeviceCall(int layer, int T, int k, const int32_t* ids, uint64_t call_running = 0);

 private:
  absl::Status StartPlannedCopies(const std::vector<SlotCopy>& planned, bool during_call = false);

  struct PendingCopy {
    SlotCopy copy;
    uint64_t fence;
    Clock::time_point start;  // enqueued on the copy queue
  };
  DispatchContext& ctx_;
  SlotReaders& readers_;
  std::vector<PendingCopy> pending_;
  uint64_t copies_started_ = 0;
  std::vector<std::vector<int>> assigned_;  // [served index] last coordinator assignment (predictive)
  std::vector<float> masked_logits_;        // HintRouterLogits in a group: other ranks' experts out
};

}  // namespace moe
