// LayerDispatcher's servers: (re)connecting one, publishing the routes
// capturable calls read, draining (SetServerEnabled), and the failover of a
// failed sent batch (another server hosting its experts, else the device).
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "model/routing.h"
#include "core/status_macros.h"
#include "gpu_worker/dispatcher_internal.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

absl::Status LayerDispatcher::ConnectServer(size_t index) {
  Server& s = impl_->servers[index];
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport(s.config.address, config_.transport);
  if (!t.ok())
    return absl::Status(t.status().code(), absl::StrCat("servers: ", s.config.address, ": ", t.status().message()));
  auto [base, bytes] = (*t)->HostMapping();
  if (base != nullptr) {
    // shm: gather straight into the segment's slots, read partials from them.
    MOE_RETURN_IF_ERROR(backend_->RegisterHost(base, bytes));
    s.registered = true;
    s.chunk_tokens = config_.transport.max_tokens_per_slot;
  } else {
    s.chunk_tokens = config_.max_tokens;
  }
  s.transport = *std::move(t);
  s.slice = s.transport->slice();
  if (!s.slice.whole()) MOE_RETURN_IF_ERROR(SliceRange(spec_.intermediate, s.slice).status());
  s.polling = std::chrono::microseconds(0);
  PublishRoute(index);
  return absl::OkStatus();
}

void LayerDispatcher::PublishRoute(size_t index) {
  Impl& m = *impl_;
  if (!m.device_ready) return;
  const Server& sv = m.servers[index];
  if (const int f = m.forwarder_of_server[index]; f >= 0)  // its requests go through the transport while enabled
    m.forwarders[f]->route.store(sv.enabled ? sv.transport.get() : nullptr, std::memory_order_release);
  // The server's share of each expert, for the fallback of its unanswered requests.
  if (const int c = m.channel_of_server[index]; c >= 0 && sv.transport != nullptr) {
    const std::pair<int, int> range =
        sv.slice.whole() ? std::make_pair(0, 0) : SliceRange(spec_.intermediate, sv.slice).value_or(std::make_pair(0, 0));
    if (m.channels[c].slice_begin != range.first || m.channels[c].slice_end != range.second) {
      m.channels[c].slice_begin = range.first;
      m.channels[c].slice_end = range.second;
      if (absl::Status st = backend_->SetDeviceChannels(m.channels, m.num_channels); !st.ok())
        LogWarning("worker", "servers: ", sv.config.address, ": cannot publish its slice: ", st.message());
    }
  }
  // Each expert's route (RouteExpert) over the enabled, connected servers
  // that have a channel; channel c is server c's.
  std::vector<PlanServer> up(m.servers.size());
  for (size_t s = 0; s < m.servers.size(); ++s) {
    const Server& x = m.servers[s];
    up[s] = PlanServer{x.enabled && !x.device_dead && x.transport != nullptr && m.channel_of_server[s] >= 0, &x.hosts,
                       x.chunk_tokens, x.slice};
  }
  const int n = static_cast<int>(up.size());
  for (size_t li = 0; li < layers_.size(); ++li) {
    int32_t* channel_of = m.device_tables[li].channel_of;
    for (int e = 0; e < spec_.num_experts; ++e) {
      const uint64_t route = RouteExpert(up.data(), n, e, ReplicaStart(layers_[li], n));
      __atomic_store_n(channel_of + e, route != 0 ? static_cast<int32_t>(route) : -1, __ATOMIC_RELEASE);
    }
  }
}

absl::Status LayerDispatcher::SetServerEnabled(const std::string& address, bool enabled) {
  for (size_t i = 0; i < impl_->servers.size(); ++i)
    if (impl_->servers[i].config.address == address) {
      impl_->servers[i].enabled = enabled;
      PublishRoute(i);
      return absl::OkStatus();
    }
  return absl::NotFoundError("servers: no server " + address);
}

// SentBatch `index` of the call failed with `st`. A server failure
// (UNAVAILABLE / DEADLINE_EXCEEDED: no answer within server_deadline / ...)
// moves it to another server hosting every expert of the batch, while the
// call's deadline allows, else computes it on
// the device from host copies (copy_fallback), else is UNAVAILABLE; any other
// error (the server rejected the batch: a bug or bad input) is returned as
// is. On OK *partial is the output to add, null when computed on the device.
absl::Status LayerDispatcher::FailOver(InFlightCall& ctx, size_t index, absl::Status st, const bf16_t** partial) {
  Impl& m = *impl_;
  SentBatch& sh = ctx.sent[index];
  const int H = spec_.hidden;
  // An operator must see a failover: logged once per server state change
  // (and again when it answers: AddPartials); each one is counted in
  // CallStats::failovers (moe_worker_failovers_total).
  auto announce = [&](Server& failed, const absl::Status& why, const std::string& to) {
    if (failed.failing) return;
    failed.failing = true;
    LogWarning("worker", "servers: ", failed.config.address, " failed (", why.message(), "); its misses go to ", to,
               " until it answers again");
  };
  while (!st.ok()) {
    if (!IsServerFailure(st)) return st;
    ++ctx.stats.failovers;
    m.servers[sh.batch.server].down_until = Clock::now() + config_.server_retry;
    // Connected but silent: calls resume only after a probe is answered
    // (host_executor.cc), not with a real batch that waits out the deadline again.
    if (absl::IsDeadlineExceeded(st)) m.servers[sh.batch.server].silent = true;
    if (sh.staged) {
      m.servers[sh.batch.server].transport->Release(sh.stage);
      sh.staged = false;
    }
    const Clock::time_point now = Clock::now();
    const int next = OtherServerFor(sh.batch, now);
    if (next >= 0 && now < ctx.deadline) {
      announce(m.servers[sh.batch.server], st, m.servers[next].config.address);
      sh.batch.server = next;
      bf16_t* dst = ctx.send.data() + sh.host_offset * H;
      MOE_RETURN_IF_ERROR(Gather(ctx, sh.batch.rows, dst));
      bf16_t* out = ctx.recv.data() + sh.host_offset * H;
      sh.done = m.servers[next].transport->Submit(GatheredBatch(ctx.call.batch.layer, sh.batch, dst), out,
                                                  ctx.ServerDeadline(config_.server_deadline));
      st = AwaitResult(sh.done);
      *partial = out;
      continue;
    }
    if (!m.servers[sh.batch.server].slice.whole()) {
      // The other slices' partials of these pairs are (or will be) added:
      // the device computes whole experts, so it cannot stand in for one share.
      announce(m.servers[sh.batch.server], st, "another holder of its slice when one is up");
      return absl::UnavailableError(absl::StrCat(
          "servers: ", m.servers[sh.batch.server].config.address, " (slice ",
          m.servers[sh.batch.server].slice.ToString(), ") failed (", st.message(), ") and no other server holds that "
          "slice of layer ", ctx.call.batch.layer, "'s experts; later calls route around it"));
    }
    if (host_ != nullptr && config_.copy_fallback && !m.temp_fence.empty()) {
      announce(m.servers[sh.batch.server], st, "the device (copies from the host copy)");
      MOE_RETURN_IF_ERROR(ComputeServerBatchOnDevice(ctx, sh.batch));
      ctx.stats.cpu_pairs -= sh.batch.pairs;  // computed on the device instead
      *partial = nullptr;                     // nothing to add
      return absl::OkStatus();
    }
    return absl::UnavailableError(absl::StrCat(
        "servers: ", m.servers[sh.batch.server].config.address, " failed (", st.message(),
        ") and no other server or device copy can take layer ", ctx.call.batch.layer, "'s misses"));
  }
  return absl::OkStatus();
}

// Another usable server than the batch's own hosting every expert of it, or -1.
int LayerDispatcher::OtherServerFor(const ServerBatch& b, Clock::time_point now) const {
  for (size_t s = 0; s < impl_->servers.size(); ++s) {
    const Server& sv = impl_->servers[s];
    if (static_cast<int>(s) == b.server || !sv.enabled || sv.transport == nullptr || sv.down_until > now) continue;
    if (!(sv.slice == impl_->servers[b.server].slice)) continue;  // the same share of each expert, or none
    bool all = true;
    for (int32_t e : b.ids) all = all && (e < 0 || sv.hosts[e]);
    if (all) return static_cast<int>(s);
  }
  return -1;
}

// A failed server batch computed on the device, expert by expert, from host copies.
absl::Status LayerDispatcher::ComputeServerBatchOnDevice(InFlightCall& ctx, const ServerBatch& b) {
  ExpertGroups& groups = impl_->failover_groups;
  GroupByExpert(RoutingView{b.n, b.k, b.ids.data(), b.weights.data()}, spec_.num_experts, 1, &groups);
  for (int32_t& t : groups.token)
    if (t >= 0) t = b.rows[t];  // batch rows -> the call's tokens
  impl_->copy_groups.resize(groups.num_groups());
  std::iota(impl_->copy_groups.begin(), impl_->copy_groups.end(), 0);
  return ComputeCopiedInBuffers(ctx, groups, impl_->copy_groups);
}

}  // namespace moe
