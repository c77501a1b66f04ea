// ServerSet (server_set.h): connecting the servers, the view a call's plan
// gets of them, drains, and the failover decision of a failed batch.
#include "gpu_worker/server_set.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/status_macros.h"

namespace moe {

ServerSet::~ServerSet() {
  for (Server& s : servers_)
    if (s.registered && s.transport) ctx_.backend->UnregisterHost(s.transport->HostMapping().first);
}

absl::Status ServerSet::ConnectAll(bool can_copy_misses) {
  const DispatcherConfig& c = ctx_.config;
  absl::Status first_error;
  if (c.servers.size() > static_cast<size_t>(kMaxPlanServers))
    return absl::InvalidArgumentError(absl::StrCat("servers: at most ", kMaxPlanServers, ", got ", c.servers.size()));
  for (const ExpertServerConfig& sc : c.servers) {
    Server s;
    s.config = sc;
    s.hosts.assign(ctx_.spec.num_experts, sc.experts.empty());
    for (int e : sc.experts) {
      if (e < 0 || e >= ctx_.spec.num_experts)
        return absl::InvalidArgumentError(absl::StrCat("servers: expert ", e, " out of range"));
      s.hosts[e] = true;
    }
    servers_.push_back(std::move(s));
    if (absl::Status st = Connect(servers_.size() - 1); !st.ok()) {
      if (!IsServerFailure(st) && !absl::IsNotFound(st)) return st;
      LogWarning("worker", "servers: ", sc.address, " unreachable (", st.message(), "); retrying later");
      servers_.back().down_until = Clock::now() + c.server_retry;
      if (first_error.ok()) first_error = st;
    }
  }
  bool any_connected = servers_.empty();
  for (const Server& sv : servers_) any_connected |= sv.transport != nullptr;
  if (!any_connected)
    return absl::Status(first_error.code(), absl::StrCat("servers: no expert server is reachable; first: ",
                                                         servers_.front().config.address, ": ",
                                                         first_error.message()));
  WarnOfIncompleteSlices(can_copy_misses);
  return absl::OkStatus();
}

absl::Status ServerSet::Connect(size_t index) {
  Server& s = servers_[index];
  const DispatcherConfig& c = ctx_.config;
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport(s.config.address, c.transport);
  if (!t.ok())
    return absl::Status(t.status().code(), absl::StrCat("servers: ", s.config.address, ": ", t.status().message()));
  auto [base, bytes] = (*t)->HostMapping();
  if (base != nullptr) {
    // shm: gather straight into the segment's slots, read partials from them.
    MOE_RETURN_IF_ERROR(ctx_.backend->RegisterHost(base, bytes));
    s.registered = true;
    s.chunk_tokens = c.transport.max_tokens_per_slot;
  } else {
    s.chunk_tokens = c.max_tokens;
  }
  s.transport = *std::move(t);
  s.slice = s.transport->slice();
  if (!s.slice.whole()) MOE_RETURN_IF_ERROR(SliceRange(ctx_.spec.intermediate, s.slice).status());
  s.polling = std::chrono::microseconds(0);
  if (on_route_change_) on_route_change_(index);
  return absl::OkStatus();
}

// Experts that the reachable servers hold only as some of their slices (no
// whole holder, a share with no holder): the servers cannot compute them, so
// their misses go to the device copies, or fail without a host copy. An
// operator who started `--slice 0/2` alone hears it at the start.
void ServerSet::WarnOfIncompleteSlices(bool can_copy_misses) const {
  std::vector<PlanServer> up(servers_.size());
  for (size_t s = 0; s < servers_.size(); ++s)
    up[s] = PlanServer{servers_[s].transport != nullptr, &servers_[s].hosts, servers_[s].chunk_tokens,
                       servers_[s].slice};
  std::vector<int> partial;
  std::string shares;
  for (int e = 0; e < ctx_.spec.num_experts; ++e) {
    if (RouteExpert(up.data(), static_cast<int>(up.size()), e) != 0) continue;
    std::string held;
    for (const Server& sv : servers_)
      if (sv.transport != nullptr && sv.hosts[e]) absl::StrAppend(&held, held.empty() ? "" : ", ", sv.slice.ToString());
    if (held.empty()) continue;  // no server holds any of it: the operator chose so (--experts)
    if (partial.empty()) shares = held;
    partial.push_back(e);
  }
  if (!partial.empty())
    LogWarning("worker", "servers: experts [", FormatIndexList(partial), "] are held only in part (e.g. slices ",
               shares, " of expert ", partial.front(), ") by the reachable servers: no server can compute them; "
               "their misses go to ", can_copy_misses ? "device copies" : "nowhere (fail)",
               " until the missing slices' servers answer");
}

const std::vector<PlanServer>& ServerSet::ForPlan(bool any_miss, Clock::time_point now) {
  const DispatcherConfig& c = ctx_.config;
  for (size_t i = 0; i < servers_.size(); ++i) {
    Server& sv = servers_[i];
    if (sv.transport == nullptr && sv.enabled && sv.down_until <= now && any_miss)
      if (!Connect(i).ok()) sv.down_until = now + c.server_retry;
    // Not a call sent into a channel still in back-off or into the silence.
    if (sv.transport != nullptr && (sv.failing || sv.silent) && sv.enabled && sv.down_until <= now) {
      const absl::Status up =
          sv.silent ? sv.transport->Probe(std::min<std::chrono::milliseconds>(c.server_deadline, std::chrono::seconds(1)))
                    : sv.transport->Reconnect();
      if (up.ok()) sv.silent = false;
      else sv.down_until = now + std::min<Clock::duration>(c.server_retry, kReconnectPoll);
    }
  }
  return Usable(now);
}

absl::Status ServerSet::SetEnabled(const std::string& address, bool enabled) {
  for (size_t i = 0; i < servers_.size(); ++i)
    if (servers_[i].config.address == address) {
      servers_[i].enabled = enabled;
      if (on_route_change_) on_route_change_(i);
      return absl::OkStatus();
    }
  return absl::NotFoundError("servers: no server " + address);
}

void ServerSet::SetPolling(int server, std::chrono::microseconds polling) {
  Server& sv = servers_[server];
  if (sv.polling == polling) return;
  sv.transport->SetPolling(polling);
  sv.polling = polling;
}

// An operator must see a failover: logged once per server state change (and
// again when it answers: Answered); each one is counted in
// CallStats::failovers (moe_worker_failovers_total).
void ServerSet::Announce(Server& failed, const absl::Status& why, const std::string& to) {
  if (failed.failing) return;
  failed.failing = true;
  LogWarning("worker", "servers: ", failed.config.address, " failed (", why.message(), "); its misses go to ", to,
             " until it answers again");
}

void ServerSet::Answered(int server) {
  Server& sv = servers_[server];
  if (!sv.failing) return;
  sv.failing = false;
  LogInfo("worker", "servers: ", sv.config.address, " answers again; its misses go to it");
}

const std::vector<PlanServer>& ServerSet::Usable(Clock::time_point now) {
  plan_.resize(servers_.size());
  for (size_t i = 0; i < servers_.size(); ++i) {
    const Server& sv = servers_[i];
    plan_[i] = PlanServer{sv.enabled && sv.transport != nullptr && sv.down_until <= now, &sv.hosts, sv.chunk_tokens,
                          sv.slice};
  }
  return plan_;
}

FailoverStep ServerSet::FailOver(int layer, const ServerBatch& batch, const absl::Status& st,
                                 Clock::time_point deadline, bool device_can) {
  Server& failed = servers_[batch.server];
  failed.down_until = Clock::now() + ctx_.config.server_retry;
  // Connected but silent: calls resume only after a probe is answered
  // (ForPlan), not with a real batch that waits out the deadline again.
  if (absl::IsDeadlineExceeded(st)) failed.silent = true;
  const Clock::time_point now = Clock::now();
  const std::vector<PlanServer>& up = Usable(now);
  FailoverStep step;
  static_cast<FailoverChoice&>(step) = ChooseFailover(up.data(), static_cast<int>(up.size()), batch.server, batch.ids,
                                                      now < deadline, device_can);
  switch (step.action) {
    case FailoverChoice::kResend:
      Announce(failed, st, servers_[step.server].config.address);
      break;
    case FailoverChoice::kDevice:
      Announce(failed, st, "the device (copies from the host copy)");
      break;
    case FailoverChoice::kFail:
      if (!failed.slice.whole()) {
        // The other slices' partials of these pairs are (or will be) added:
        // the device computes whole experts, so it cannot stand in for one share.
        Announce(failed, st, "another holder of its slice when one is up");
        step.status = absl::UnavailableError(absl::StrCat(
            "servers: ", failed.config.address, " (slice ", failed.slice.ToString(), ") failed (", st.message(),
            ") and no other server holds that slice of layer ", layer, "'s experts; later calls route around it"));
      } else {
        step.status = absl::UnavailableError(absl::StrCat("servers: ", failed.config.address, " failed (",
                                                          st.message(), ") and no other server or device copy can take layer ",
                                                          layer, "'s misses"));
      }
      break;
  }
  return step;
}

}  // namespace moe
