// The expert servers of a LayerDispatcher (a private part, see
// layer_dispatcher.h): connecting and reconnecting them, which of them a
// call planned now may use (the planner's PlanServer view), drains, and the
// failover decision for a batch a server failed — another holder of its
// experts, the device, or an error. The executors carry the decisions out.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "transport/transport.h"
#include "gpu_worker/dispatch_context.h"

namespace moe {

// How often a failed server's transport is asked whether it is connected again.
inline constexpr std::chrono::milliseconds kReconnectPoll{20};

struct Server {
  ExpertServerConfig config;
  std::unique_ptr<ExpertTransport> transport;
  std::vector<bool> hosts;        // per expert
  ExpertSlice slice;               // its share of each expert (the transport's, once connected)
  Clock::time_point down_until{};  // skipped until then after a failure
  bool enabled = true;             // false: drained / marked down by the coordinator
  bool registered = false;         // HostMapping registered with the backend
  bool device_dead = false;        // capturable calls: gone and not reconnected (DeviceExecutor)
  bool failing = false;            // failed over since its last answer (logged once per change)
  bool silent = false;             // its last failure was a server deadline: probed before calls resume
  int chunk_tokens = 0;            // most tokens per staged batch
  std::chrono::microseconds polling{0};  // the window last given to SetPolling
  // Capturable calls whose requests to it the GPU computed from the host
  // copy (nobody answered): warned at most once a second, the rest counted.
  Clock::time_point recompute_warned{};
  uint64_t recompute_unwarned = 0;
};

// What to do with a batch whose server failed (ServerSet::FailOver): the
// planner's choice (ChooseFailover, miss_plan.h) and, to fail, the error.
struct FailoverStep : FailoverChoice {
  absl::Status status;  // kFail: the call's error
};

class ServerSet {
 public:
  explicit ServerSet(DispatchContext& ctx) : ctx_(ctx) {}
  ~ServerSet();  // unregisters the shm segments from the backend
  ServerSet(const ServerSet&) = delete;
  ServerSet& operator=(const ServerSet&) = delete;

  // Connects every configured server. One that cannot be reached now is
  // retried on later calls (after server_retry); an error only when none
  // answers. Warns of experts the reachable servers hold only in part
  // (their misses go to device copies when `can_copy_misses`, else fail).
  absl::Status ConnectAll(bool can_copy_misses);
  // (Re)connects server `index`.
  absl::Status Connect(size_t index);
  // Called with a server's index whenever what device-planned calls route
  // to it may have changed (connected, drained, enabled).
  void set_on_route_change(std::function<void(size_t)> f) { on_route_change_ = std::move(f); }

  size_t size() const { return servers_.size(); }
  Server& at(size_t i) { return servers_[i]; }
  const Server& at(size_t i) const { return servers_[i]; }

  // The servers as a call planned now may use them. With `any_miss`, a
  // server due a retry is reconnected first, and one that failed gets calls
  // again once its transport says it is connected (and, after a server
  // deadline, once it answered a probe) — checked every kReconnectPoll.
  const std::vector<PlanServer>& ForPlan(bool any_miss, Clock::time_point now);
  // Stops (false) or resumes routing misses to the server at `address`.
  absl::Status SetEnabled(const std::string& address, bool enabled);
  // The polling window of decode calls (ExpertTransport::SetPolling), set once per change.
  void SetPolling(int server, std::chrono::microseconds polling);

  // A batch of `layer` sent to `batch.server` failed with the server
  // failure `st`: the server is marked down (and silent after a deadline),
  // and where the batch goes is the planner's ChooseFailover over the
  // servers as they are now (another holder of the same share of its
  // experts while `deadline` allows, else the device when `device_can`,
  // else the call fails UNAVAILABLE naming the server). Logged once per
  // server state change.
  FailoverStep FailOver(int layer, const ServerBatch& batch, const absl::Status& st, Clock::time_point deadline,
                        bool device_can);
  // `server` answered: logged once if it had failed.
  void Answered(int server);

 private:
  // The servers as a call may use them now, without reconnecting any.
  const std::vector<PlanServer>& Usable(Clock::time_point now);
  void Announce(Server& failed, const absl::Status& why, const std::string& to);
  void WarnOfIncompleteSlices(bool can_copy_misses) const;

  DispatchContext& ctx_;
  std::vector<Server> servers_;
  std::vector<PlanServer> plan_;  // ForPlan's view (scratch)
  std::function<void(size_t)> on_route_change_;
};

}  // namespace moe
