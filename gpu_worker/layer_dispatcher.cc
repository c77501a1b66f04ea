// LayerDispatcher (gpu_worker/layer_dispatcher.h): ParseExpertServer and the
// dispatcher's life — Create and the steps of Init (the config's checks, the
// cache and backend, the servers, the contexts, the start-up probes
// (rate_probes.h), the admission policy), the destructor, LeaveGroup. The
// other parts: see the header's top comment.
#include "gpu_worker/layer_dispatcher.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu_worker/dispatcher_internal.h"
#include "gpu_worker/rate_probes.h"

namespace moe {

absl::Status CheckParallelGroup(const ParallelGroup& g, int num_experts) {
  const bool ep = g.mode == GroupMode::kExpert;
  if (g.size < 1 || g.size > num_experts || g.rank < 0 || g.rank >= g.size)
    return absl::InvalidArgumentError(absl::StrCat("group (rank, size; mode ", ep ? "expert" : "tensor", ")",
                                                   ": rank ", g.rank, " of size ", g.size,
                                                   " (need 0 <= rank < size <= ", num_experts, ", the model's experts)"));
  if (ep && g.size > 1 &&
      (g.id.size() != kGroupIdHexChars || !std::all_of(g.id.begin(), g.id.end(), absl::ascii_isxdigit)))
    return absl::InvalidArgumentError(absl::StrCat("group.id: ", g.id.size(), " characters; need the ",
                                                   kGroupIdHexChars,
                                                   "-character hex id of NewGroupId, the same on every rank"));
  return absl::OkStatus();
}

absl::StatusOr<ExpertServerConfig> ParseExpertServer(const std::string& text, int num_experts) {
  ExpertServerConfig s;
  const size_t hash = text.find('#');
  s.address = text.substr(0, hash);
  if (s.address.empty()) return absl::InvalidArgumentError("servers: empty address in '" + text + "'");
  if (hash == std::string::npos) return s;
  const std::string opt = text.substr(hash + 1);
  if (opt.rfind("experts=", 0) != 0)
    return absl::InvalidArgumentError("servers: unknown option '" + opt + "' (expected experts=LIST)");
  MOE_ASSIGN_OR_RETURN(s.experts, ParseIndexList(opt.substr(8), num_experts, "servers"));
  if (s.experts.empty()) return absl::InvalidArgumentError("servers: empty expert list in '" + text + "'");
  return s;
}

LayerDispatcher::~LayerDispatcher() {
  if (!impl_) return;
  // Capturable calls (and their graphs' replays) still running use this
  // dispatcher's state. The engine's stream may be gone by now: wait for the
  // whole device instead of recording on it.
  if (impl_->planned_stream != nullptr) (void)backend_->SynchronizeDevice();
  for (auto& f : impl_->forwarders) {
    f->stop.store(true);
    if (f->thread.joinable()) f->thread.join();
    backend_->FreeMapped(f->mem);
  }
  if (impl_->mapped != nullptr) backend_->FreeMapped(impl_->mapped);
  // Drain in-flight copies so the backend is idle; release staged batches.
  for (InFlightCall& ctx : impl_->contexts)
    for (SentBatch& s : ctx.sent) {
      if (s.done.valid()) s.done.wait();
      if (s.staged) impl_->servers[s.batch.server].transport->Release(s.stage);
    }
  for (auto& p : impl_->pending) (void)backend_->WaitCopy(p.fence);
  for (InFlightCall& ctx : impl_->contexts) {
    if (!ctx.send.empty()) backend_->UnregisterHost(ctx.send.data());
    if (!ctx.recv.empty()) backend_->UnregisterHost(ctx.recv.data());
  }
  for (Server& s : impl_->servers)
    if (s.registered && s.transport) backend_->UnregisterHost(s.transport->HostMapping().first);
}

absl::StatusOr<std::unique_ptr<LayerDispatcher>> LayerDispatcher::Create(const ModelSpec& spec,
                                                                         DeviceBackend& backend,
                                                                         const HostExpertStore* host,
                                                                         DispatcherConfig config) {
  auto d = std::unique_ptr<LayerDispatcher>(new LayerDispatcher());
  d->spec_ = spec;
  d->backend_ = &backend;
  d->host_ = host;
  d->config_ = std::move(config);
  d->impl_ = std::make_unique<Impl>();
  MOE_RETURN_IF_ERROR(d->Init());
  return d;
}

absl::Status LayerDispatcher::Init() {
  MOE_RETURN_IF_ERROR(CheckConfig());
  MOE_RETURN_IF_ERROR(CreateCacheAndBackend());
  MOE_RETURN_IF_ERROR(ConnectServers());
  MOE_RETURN_IF_ERROR(AllocateContexts());
  MOE_RETURN_IF_ERROR(AllocateDeviceTables());
  const DispatcherConfig& c = config_;
  if (c.measure_rates && c.copy_mode == CopyMode::kAuto && host_ != nullptr && !impl_->servers.empty())
    MOE_RETURN_IF_ERROR(MeasureRates());
  assigned_.assign(layers_.size(), {});
  if (c.policy == CachePolicy::kPredictive) MOE_RETURN_IF_ERROR(CreateAdmission());
  return absl::OkStatus();
}

// The served layers and the config's limits; turns polling off where there
// are too few cores for it.
absl::Status LayerDispatcher::CheckConfig() {
  DispatcherConfig& c = config_;
  MOE_RETURN_IF_ERROR(spec_.Validate());
  layers_ = ServedLayers(spec_, c.layers);
  layer_index_.assign(spec_.num_layers, -1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int l = layers_[i];
    if (l < 0 || l >= spec_.num_layers || !spec_.IsMoeLayer(l))
      return absl::InvalidArgumentError(absl::StrCat("layers: ", l, " is not an MoE layer"));
    layer_index_[l] = static_cast<int>(i);
  }
  // Every sizing option has a range (each call's scratch is allocated up
  // front: an unbounded value would exhaust memory before any error).
  struct Range { const char* name; int64_t value, lo, hi; };
  for (const Range& r : {Range{"max-tokens", c.max_tokens, 1, kMaxCallTokens},
                         Range{"max-top-k", c.max_top_k, 1, shm::kMaxPairsPerToken},
                         Range{"contexts", c.contexts, 1, kMaxContexts}})
    if (r.value < r.lo || r.value > r.hi)
      return absl::InvalidArgumentError(absl::StrCat(r.name, ": ", r.value, " is outside [", r.lo, ", ", r.hi, "]"));
  if (!(c.cache_gib >= 0 && c.cache_gib <= kMaxCacheGib))  // NaN too
    return absl::InvalidArgumentError(absl::StrCat("cache-gib: ", c.cache_gib, " is outside [0, ", kMaxCacheGib, "]"));
  if (c.prefetch_buffers < 0 || c.prefetch_buffers > kMaxMissBuffers)
    return absl::InvalidArgumentError(absl::StrCat("prefetch-buffers: ", c.prefetch_buffers, " is outside [0, ",
                                                   kMaxMissBuffers, "] (0: by the expert's size)"));
  if (c.miss_buffers < 0 || c.miss_buffers > kMaxMissBuffers)
    return absl::InvalidArgumentError(
        absl::StrCat("miss-buffers: ", c.miss_buffers, " is outside [0, ", kMaxMissBuffers, "] (0: by the expert's size)"));
  MOE_RETURN_IF_ERROR(CheckParallelGroup(c.group, spec_.num_experts));
  if (c.poll_window.count() < 0) return absl::InvalidArgumentError("poll-window: must not be negative");
  if (c.server_deadline.count() <= 0) return absl::InvalidArgumentError("server-deadline: must be positive");
  // Polling keeps three threads busy (this one, the transport's completion
  // thread, the server's connection thread): only where there are cores for it.
  if (c.poll_window.count() > 0 && std::thread::hardware_concurrency() < 8) {
    LogInfo("worker", "decode polling off: ", std::thread::hardware_concurrency(), " hardware threads (< 8)");
    c.poll_window = std::chrono::microseconds(0);
  }
  if (c.servers.empty() && host_ == nullptr)
    return absl::InvalidArgumentError("servers: no expert server and no host copy of the experts");
  return absl::OkStatus();
}

// The temporary miss buffers per parity (config_.miss_buffers when 0) and
// the prefetch buffers per parity, for experts of `expert_bytes`.
void LayerDispatcher::SizeMissBuffers(size_t expert_bytes) {
  const size_t bytes = std::max<size_t>(1, expert_bytes);
  if (config_.miss_buffers == 0) {
    // Copied experts are computed miss_buffers / 2 per launch; on a GPU a
    // launch of two small experts leaves most SMs idle (a Qwen3-30B-A3B int8
    // prompt of 2048 tokens: 248-290 ms with 16 against 304-309 with 4,
    // H100 host), so small experts get more buffers, within
    // kAutoMissBufferBytes. The cpu backend computes them on the host's cores
    // either way: 4.
    config_.miss_buffers = backend_->has_device_memory()
                               ? static_cast<int>(std::clamp<size_t>(kAutoMissBufferBytes / bytes, 4, 16))
                               : 4;
  }
  // The prefetch of the next layer's experts (StartPrefetch): as many as
  // kAutoPrefetchBytes holds (enough to keep the link busy through the
  // engine's work between two layer calls: for a 2048-token DeepSeek-V3
  // prompt the planner measured a window of 18-25 ms, 0.8-1.4 GB of link),
  // at least miss_buffers, at most a layer's experts, or
  // config_.prefetch_buffers when set; the cpu backend, whose "copies" cross
  // no link, miss_buffers. Measured on the H100 host: a cap of 64 held int4
  // Qwen3-30B-A3B to half a layer (2048-token prompts 137.5 / 138.4 ms
  // against 121.8 / 122.1 with 128); 256 MiB held DeepSeek-V3's
  // int8 experts to 6 and 2% of the pairs (2048-token prompts 720-779 /
  // 377-389 ms at 0 / 25% cache against 695-699 / 323-327 with 1 GiB).
  const int by_bytes =
      static_cast<int>(std::min<size_t>(static_cast<size_t>(spec_.num_experts), kAutoPrefetchBytes / bytes));
  const int on_gpu = config_.prefetch_buffers > 0 ? std::min(spec_.num_experts, config_.prefetch_buffers)
                                                  : std::max(config_.miss_buffers, by_bytes);
  impl_->prefetch_per_parity = host_ == nullptr || !config_.prefetch ? 0
                               : backend_->has_device_memory()       ? on_gpu
                                                                      : config_.miss_buffers;
}

// The cache (C slots per layer: explicit, or from the memory budget) and the
// backend sized for it plus the temporary miss, prefetch and device-copy buffers.
absl::Status LayerDispatcher::CreateCacheAndBackend() {
  const DispatcherConfig& c = config_;
  BackendConfig bc = c.backend;  // the device knobs; the sizes follow from the model and the cache
  bc.hidden = spec_.hidden;
  bc.intermediate = spec_.intermediate;
  bc.activation = spec_.activation;
  bc.biases = spec_.expert_biases;
  if (host_ != nullptr) {  // the cache holds experts in the host copy's precision
    bc.format = host_->geometry().format;
    bc.int4_group = host_->geometry().group;
  }
  copy_bytes_ = GeometryOf(bc).packed_bytes();
  const size_t expert_bytes = backend_->ExpertBytes(GeometryOf(bc));
  int C = c.slots_per_layer;
  if (C == 0 && c.cache_gib > 0)
    C = static_cast<int>(c.cache_gib * (1ull << 30) / expert_bytes / std::max<size_t>(1, layers_.size()));
  if (C < 0) return absl::InvalidArgumentError("cache-experts-per-layer: must not be negative");
  if (c.slots_per_layer > spec_.num_experts)  // asked for explicitly: never clamped silently
    return absl::InvalidArgumentError(absl::StrCat("cache-experts-per-layer: ", c.slots_per_layer,
                                                   " exceeds the model's ", spec_.num_experts, " experts per layer"));
  // From --cache-gib: at most every expert (this rank's share in a group).
  C = std::min(C, (spec_.num_experts + c.group.size - 1) / c.group.size);
  SizeMissBuffers(expert_bytes);
  const int temp = host_ != nullptr ? 2 * c.miss_buffers : 0;
  // Capturable calls' copy-instead buffers (their own: an eager call on the
  // backend's stream may use the temporary ones at the same time).
  const int device_copies = host_ != nullptr && backend_->has_device_memory() ? kMaxDeviceCopies : 0;
  const uint64_t base = (static_cast<uint64_t>(C) * layers_.size() + temp + device_copies) * expert_bytes;
  // The prefetch gives way to a cache sized to the memory: fewer buffers (none at worst), not an error.
  const uint64_t free = backend_->free_memory_bytes();
  const uint64_t room = free > base ? (free - base) / (2 * expert_bytes) : 0;
  if (static_cast<uint64_t>(impl_->prefetch_per_parity) > room) {
    LogInfo("worker", "prefetch: ", room, " buffers per layer parity (of ", impl_->prefetch_per_parity,
            ") beside the cache in the device's free memory");
    impl_->prefetch_per_parity = static_cast<int>(room);
  }
  const int prefetch = 2 * impl_->prefetch_per_parity;
  const uint64_t need = base + static_cast<uint64_t>(prefetch) * expert_bytes;
  if (need > backend_->free_memory_bytes())
    return absl::ResourceExhaustedError(absl::StrCat(
        c.slots_per_layer == 0 && c.cache_gib > 0 ? absl::StrCat("cache-gib: ", c.cache_gib, " GiB asks for ") : "cache: ",
        C, " experts/layer x ", layers_.size(), " layers (+", temp + prefetch + device_copies, " miss buffers) need ",
        need, " bytes, the ", backend_->name(), " device has ", backend_->free_memory_bytes(), " free"));

  ExpertCacheConfig cc;
  cc.num_layers = spec_.num_layers;
  cc.num_experts = spec_.num_experts;
  cc.slots_per_layer = C;
  cc.policy = c.policy;
  cc.lfru_half_life = c.lfru_half_life;
  MOE_ASSIGN_OR_RETURN(cache_, ExpertCache::Create(cc));

  bc.num_buffers = C * static_cast<int>(layers_.size()) + temp + prefetch + device_copies;
  bc.max_tokens = c.max_tokens;
  bc.max_top_k = c.max_top_k;
  bc.contexts = c.contexts;
  bc.num_experts = spec_.num_experts;
  bc.device_sites = static_cast<int>(layers_.size());
  // Device-planned calls fit one request slot of every shm server.
  impl_->capturable_max_tokens = c.max_tokens;
  for (const ExpertServerConfig& sc : c.servers)
    if (UnixSocketPath(sc.address))
      impl_->capturable_max_tokens = std::min(impl_->capturable_max_tokens, c.transport.max_tokens_per_slot);
  bc.device_max_tokens = impl_->capturable_max_tokens;
  MOE_RETURN_IF_ERROR(backend_->Init(bc));
  impl_->temp_base = C * static_cast<int>(layers_.size());
  impl_->temp_fence.assign(temp, 0);
  impl_->prefetch_base = prefetch > 0 ? impl_->temp_base + temp : -1;
  impl_->prefetch_free.assign(prefetch, 0);
  for (Impl::Prefetch& p : impl_->prefetch) p.buffer.assign(spec_.num_experts, -1);
  impl_->last_pairs.assign(layers_.size(), std::vector<int32_t>(spec_.num_experts, 0));
  impl_->last_total.assign(layers_.size(), 0);
  impl_->prefetched_now.assign(spec_.num_experts, false);
  impl_->prefetch_candidate.assign(spec_.num_experts, false);
  impl_->copy_buffer_base = device_copies > 0 ? impl_->temp_base + temp + prefetch : -1;
  return absl::OkStatus();
}

// Connects every configured server. One that cannot be reached now is
// retried on later calls (after server_retry); the worker starts as long as
// one server answers.
absl::Status LayerDispatcher::ConnectServers() {
  DispatcherConfig& c = config_;
  absl::Status first_error;
  c.transport.hidden = spec_.hidden;
  c.transport.max_pairs_per_token = std::max(c.transport.max_pairs_per_token, c.max_top_k);
  // Two slots of every shm segment for the GPU's own requests (capturable
  // calls): one in flight, the next one free even if a late answer still
  // lands in the first.
  if (backend_->has_device_memory() && c.transport.slots > 2) c.transport.device_slots = 2;
  if (c.servers.size() > static_cast<size_t>(kMaxPlanServers))
    return absl::InvalidArgumentError(absl::StrCat("servers: at most ", kMaxPlanServers, ", got ", c.servers.size()));
  for (const ExpertServerConfig& sc : c.servers) {
    Server s;
    s.config = sc;
    s.hosts.assign(spec_.num_experts, sc.experts.empty());
    for (int e : sc.experts) {
      if (e < 0 || e >= spec_.num_experts)
        return absl::InvalidArgumentError(absl::StrCat("servers: expert ", e, " out of range"));
      s.hosts[e] = true;
    }
    impl_->servers.push_back(std::move(s));
    if (absl::Status st = ConnectServer(impl_->servers.size() - 1); !st.ok()) {
      if (!IsServerFailure(st) && !absl::IsNotFound(st)) return st;
      LogWarning("worker", "servers: ", sc.address, " unreachable (", st.message(), "); retrying later");
      impl_->servers.back().down_until = Clock::now() + c.server_retry;
      if (first_error.ok()) first_error = st;
    }
  }
  bool any_connected = impl_->servers.empty();
  for (const Server& sv : impl_->servers) any_connected |= sv.transport != nullptr;
  if (!any_connected)
    return absl::Status(first_error.code(), absl::StrCat("servers: no expert server is reachable; first: ",
                                                         impl_->servers.front().config.address, ": ",
                                                         first_error.message()));
  WarnOfIncompleteSlices();
  return absl::OkStatus();
}

// Experts that the reachable servers hold only as some of their slices (no
// whole holder, a share with no holder): the servers cannot compute them, so
// their misses go to the device copies, or fail without a host copy. An
// operator who started `--slice 0/2` alone hears it at the start.
// Misses can be copied to the device for the call: a host copy and
// temporary buffers to copy them into.
bool LayerDispatcher::CanCopyMisses() const { return host_ != nullptr && !impl_->temp_fence.empty(); }

void LayerDispatcher::WarnOfIncompleteSlices() const {
  const std::vector<Server>& servers = impl_->servers;
  std::vector<PlanServer> up(servers.size());
  for (size_t s = 0; s < servers.size(); ++s)
    up[s] = PlanServer{servers[s].transport != nullptr, &servers[s].hosts, servers[s].chunk_tokens, servers[s].slice};
  std::vector<int> partial;
  std::string shares;
  for (int e = 0; e < spec_.num_experts; ++e) {
    if (RouteExpert(up.data(), static_cast<int>(up.size()), e) != 0) continue;
    std::string held;
    for (const Server& sv : servers)
      if (sv.transport != nullptr && sv.hosts[e]) absl::StrAppend(&held, held.empty() ? "" : ", ", sv.slice.ToString());
    if (held.empty()) continue;  // no server holds any of it: the operator chose so (--experts)
    if (partial.empty()) shares = held;
    partial.push_back(e);
  }
  if (!partial.empty())
    LogWarning("worker", "servers: experts [", FormatIndexList(partial), "] are held only in part (e.g. slices ",
               shares, " of expert ", partial.front(), ") by the reachable servers: no server can compute them; "
               "their misses go to ", CanCopyMisses() ? "device copies" : "nowhere (fail)",
               " until the missing slices' servers answer");
}

// The per-call contexts with their registered send/recv buffers, and the
// per-expert scratch of the split.
absl::Status LayerDispatcher::AllocateContexts() {
  const DispatcherConfig& c = config_;
  impl_->contexts.resize(c.contexts);
  for (size_t i = 0; i < impl_->contexts.size(); ++i) {
    InFlightCall& ctx = impl_->contexts[i];
    ctx.context = static_cast<int>(i);
    ctx.send.resize(static_cast<size_t>(c.max_tokens) * spec_.hidden);
    ctx.recv.resize(static_cast<size_t>(c.max_tokens) * spec_.hidden);
    MOE_RETURN_IF_ERROR(backend_->RegisterHost(ctx.send.data(), ctx.send.size() * sizeof(bf16_t)));
    MOE_RETURN_IF_ERROR(backend_->RegisterHost(ctx.recv.data(), ctx.recv.size() * sizeof(bf16_t)));
  }
  impl_->slot_buffer.resize(spec_.num_experts);
  return absl::OkStatus();
}

absl::Status LayerDispatcher::MeasureRates() {
  RateProbeSetup p;
  p.backend = backend_;
  p.host = host_;
  p.layer = layers_.front();
  p.num_experts = spec_.num_experts;
  p.hidden = spec_.hidden;
  p.max_tokens = config_.max_tokens;
  p.miss_buffers = config_.miss_buffers;
  p.temp_base = impl_->temp_base;
  p.temp_buffers = static_cast<int>(impl_->temp_fence.size());
  p.deadline = config_.deadline;
  for (const Server& sv : impl_->servers)
    p.servers.push_back(ProbeServer{sv.config.address, sv.transport.get(), &sv.hosts, sv.chunk_tokens});
  return ProbeRates(p, planner_.rates());
}

// The predictive policy, priced with the measured rates when there are some.
absl::Status LayerDispatcher::CreateAdmission() {
  AdmissionConfig ac;
  ac.layers = layers_;
  ac.num_experts = spec_.num_experts;
  ac.expert_bytes = copy_bytes_;
  ac.pass_budget_bytes = config_.pass_budget_bytes;
  // Unmeasured rates: unit miss cost, copies admitted when the predicted use
  // gains half a miss, no link timing. Measured: the planner's live rates.
  ac.costs = {0.0, 0.5e-3, 1e-3, 0.0};
  return planner_.EnableAdmissions(ac);
}

void LayerDispatcher::LeaveGroup() {
  config_.group = ParallelGroup{};
  for (int layer : layers_) PublishSlotMap(layer);
}

}  // namespace moe
