// PendingRequests: the in-flight batches of one transport, each with its
// promise, output buffer and deadline. Whoever completes an entry first wins
// (the response, the deadline reaper, or a disconnect); the others find it
// gone. A reaper thread completes expired entries with DEADLINE_EXCEEDED, so
// no future outlives its deadline by more than scheduling noise. Several
// entries may complete one future together (a Group: the stripes of one
// batch): it is ready once every one of them completed, with the first
// error, or OK. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "transport/transport.h"

namespace moe {

class PendingRequests {
 public:
  // One future for several entries (AddToGroup).
  class Group {
   public:
    explicit Group(int entries) : left_(entries) {}
    std::future<absl::Status> future() { return done_.get_future(); }
    void Complete(const absl::Status& status);

   private:
    std::mutex mu_;
    int left_;
    absl::Status first_;
    std::promise<absl::Status> done_;
  };

  struct Entry {
    // Completes the request: its own promise, or its share of its group's.
    void Finish(const absl::Status& status);
    std::promise<absl::Status> done;
    std::shared_ptr<Group> group;
    bf16_t* out = nullptr;
    int n = 0;
    uint64_t generation = 0;  // connection the request went out on
    Clock::time_point deadline;
  };

  PendingRequests();
  ~PendingRequests();  // fails what is left with CANCELLED

  // Registers a request; returns its id and sets *future.
  uint64_t Add(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
               std::future<absl::Status>* future);
  // Registers one of `group`'s requests (their future is the group's).
  uint64_t AddToGroup(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
                      std::shared_ptr<Group> group);
  // Removes the entry (nullopt if it was already completed).
  std::optional<Entry> Take(uint64_t id);
  // Completes the entry, if still pending, with `status`.
  void Complete(uint64_t id, const absl::Status& status);
  // Completes every pending entry sent on `generation` with `status`.
  void FailGeneration(uint64_t generation, const absl::Status& status);
  size_t size();

 private:
  void Reap();
  uint64_t AddEntry(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
                    std::shared_ptr<Group> group, std::future<absl::Status>* future);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> entries_;
  uint64_t next_id_ = 1;
  // When the reaper wakes next on its own. Add wakes it only for an earlier
  // deadline: a notify per request is a futex syscall and a thread wake-up on
  // every round trip's critical path.
  Clock::time_point reaper_wake_ = Clock::time_point::min();
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace moe
