// LayerDispatcher (gpu_worker/layer_dispatcher.h): ParseExpertServer, Create
// and the steps of Init (the config's checks, the cache and backend sized
// with the executors' buffers, the parts built and connected, the start-up
// probes (rate_probes.h), the admission policy), and the calls handed to
// the parts. The parts: see the header's top comment.
#include "gpu_worker/layer_dispatcher.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu_worker/cache_copies.h"
#include "gpu_worker/device_executor.h"
#include "gpu_worker/dispatch_context.h"
#include "gpu_worker/host_executor.h"
#include "gpu_worker/rate_probes.h"
#include "gpu_worker/server_set.h"

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

LayerDispatcher::LayerDispatcher() = default;
// The parts go in reverse order: the host executor's calls first (their
// staged batches go back to the servers' transports), the copies in flight,
// the device executor (it waits for the device-planned calls still enqueued
// and stops its forwarders), the servers, then what they share.
LayerDispatcher::~LayerDispatcher() = default;

absl::StatusOr<std::unique_ptr<LayerDispatcher>> LayerDispatcher::Create(const ModelSpec& spec,
                                                                         DeviceBackend& backend,
                                                                         const HostExpertStore* host,
                                                                         DispatcherConfig config) {
  auto d = std::unique_ptr<LayerDispatcher>(new LayerDispatcher());
  d->ctx_ = std::make_unique<DispatchContext>();
  d->ctx_->spec = spec;
  d->ctx_->backend = &backend;
  d->ctx_->host = host;
  d->ctx_->config = std::move(config);
  MOE_RETURN_IF_ERROR(d->Init());
  return d;
}

namespace {

struct SegmentSlots {
  int slots, tokens_per_slot;
};

// The request slots (a power of two, at most kShmServerMaxSlots) and tokens
// per slot (at least `tokens`) a segment needs so that `contexts` calls of up
// to max_tokens hold every batch at once, each with one slot to spare for a
// resend, beside the GPU's `device_slots`.
SegmentSlots SlotsFor(int contexts, int max_tokens, int tokens, int device_slots) {
  for (;; tokens *= 2) {
    const int need = contexts * ((max_tokens + tokens - 1) / tokens + 1) + device_slots;
    if (need <= kShmServerMaxSlots || tokens >= max_tokens)
      return {static_cast<int>(std::bit_ceil(static_cast<unsigned>(need))), tokens};
  }
}

}  // namespace

absl::Status LayerDispatcher::Init() {
  DispatchContext& ctx = *ctx_;
  MOE_RETURN_IF_ERROR(CheckConfig());
  HostBuffers buffers;
  int device_copy_base = -1;
  MOE_RETURN_IF_ERROR(CreateCacheAndBackend(&buffers, &device_copy_base));
  TransportOptions& t = ctx.config.transport;
  t.hidden = ctx.spec.hidden;
  t.max_pairs_per_token = std::max(t.max_pairs_per_token, ctx.config.max_top_k);
  // Two slots of every shm segment for the GPU's own requests (capturable
  // calls): one in flight, the next one free even if a late answer still
  // lands in the first.
  const int device_slots = ctx.backend->has_device_memory() ? 2 : 0;
  // A call's misses to one server go out as batches of at most a slot's
  // tokens, each holding its slot (its answer stays there) until the call
  // combines, and a failed batch's resend takes one more: `contexts` calls of
  // max_tokens need this many host slots per segment. With fewer, a call
  // staging its later batches waits for a slot only its own combine frees,
  // until the server deadline, and the healthy server is then taken for
  // failed (an 8192-token prompt did that at 8 slots of 1024). Slots grow to
  // the next power of two, at most what a server grants (kShmServerMaxSlots);
  // past that, slots grow in tokens. The segment (registered with the GPU)
  // then holds contexts x max_tokens rows each way, rounded up.
  const SegmentSlots need = SlotsFor(ctx.config.contexts, ctx.config.max_tokens, t.max_tokens_per_slot, device_slots);
  if (t.slots < need.slots || t.max_tokens_per_slot < need.tokens_per_slot) {
    LogInfo("worker", "shm segments: ", need.slots, " request slots of ", need.tokens_per_slot, " tokens (asked ", t.slots,
            " of ", t.max_tokens_per_slot, "): ", ctx.config.contexts, " calls of up to ", ctx.config.max_tokens,
            " tokens in flight");
    t.slots = std::max(t.slots, need.slots);
    t.max_tokens_per_slot = need.tokens_per_slot;
  }
  t.device_slots = device_slots;  // fewer than t.slots: a GPU's need is >= 4
  servers_ = std::make_unique<ServerSet>(ctx);
  device_ = std::make_unique<DeviceExecutor>(ctx, *servers_, device_copy_base);
  servers_->set_on_route_change([device = device_.get()](size_t server) { device->PublishRoute(server); });
  copies_ = std::make_unique<CacheCopies>(ctx, *device_);
  host_ = std::make_unique<HostExecutor>(ctx, *servers_, *copies_, buffers);
  MOE_RETURN_IF_ERROR(servers_->ConnectAll(host_->can_copy_misses()));
  MOE_RETURN_IF_ERROR(host_->Init());
  MOE_RETURN_IF_ERROR(device_->AllocateTables());
  const DispatcherConfig& c = ctx.config;
  if (c.measure_rates && c.copy_mode == CopyMode::kAuto && ctx.host != nullptr && servers_->size() > 0)
    MOE_RETURN_IF_ERROR(MeasureRates());
  if (c.policy == CachePolicy::kPredictive) MOE_RETURN_IF_ERROR(CreateAdmission());
  if (c.fill_cache && ctx.host != nullptr && c.policy != CachePolicy::kStatic && c.copy_mode != CopyMode::kAlways &&
      ctx.slots_per_layer() > 0) {
    const Clock::time_point t0 = Clock::now();
    MOE_ASSIGN_OR_RETURN(const int filled, copies_->FillEmptySlots());
    LogInfo("worker", "cache: filled with ", filled, " experts (", filled * ctx.copy_bytes >> 20, " MiB) in ",
            absl::StrFormat("%.2f", Seconds(Clock::now() - t0)), " s; the policy replaces them by use");
  }
  return absl::OkStatus();
}

// The served layers and the config's limits; turns polling off where there
// are too few cores for it.
absl::Status LayerDispatcher::CheckConfig() {
  DispatcherConfig& c = ctx_->config;
  MOE_RETURN_IF_ERROR(ctx_->spec.Validate());
  ctx_->layers = ServedLayers(ctx_->spec, c.layers);
  ctx_->layer_index.assign(ctx_->spec.num_layers, -1);
  for (size_t i = 0; i < ctx_->layers.size(); ++i) {
    const int l = ctx_->layers[i];
    if (l < 0 || l >= ctx_->spec.num_layers || !ctx_->spec.IsMoeLayer(l))
      return absl::InvalidArgumentError(absl::StrCat("layers: ", l, " is not an MoE layer"));
    ctx_->layer_index[l] = static_cast<int>(i);
  }
  // Every sizing option has a range (each call's scratch is allocated up
  // front: an unbounded value would exhaust memory before any error).
  struct Range { const char* name; int64_t value, lo, hi; };
  for (const Range& r : {Range{"max-tokens", c.max_tokens, 1, kMaxCallTokens},
                         Range{"max-top-k", c.max_top_k, 1, shm::kMaxPairsPerToken},
                         Range{"contexts", c.contexts, 1, kMaxContexts},
                         Range{"transport.max_tokens_per_slot", c.transport.max_tokens_per_slot, 1, kMaxCallTokens}})
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
  MOE_RETURN_IF_ERROR(CheckParallelGroup(c.group, ctx_->spec.num_experts));
  if (c.poll_window.count() < 0) return absl::InvalidArgumentError("poll-window: must not be negative");
  if (c.server_deadline.count() <= 0) return absl::InvalidArgumentError("server-deadline: must be positive");
  // Polling keeps three threads busy (this one, the transport's completion
  // thread, the server's connection thread): only where there are cores for it.
  if (c.poll_window.count() > 0 && std::thread::hardware_concurrency() < 8) {
    LogInfo("worker", "decode polling off: ", std::thread::hardware_concurrency(), " hardware threads (< 8)");
    c.poll_window = std::chrono::microseconds(0);
  }
  if (c.servers.empty() && ctx_->host == nullptr)
    return absl::InvalidArgumentError("servers: no expert server and no host copy of the experts");
  return absl::OkStatus();
}

// The temporary miss buffers per parity (config.miss_buffers when 0) and
// the prefetch buffers per parity, for experts of `expert_bytes`.
void LayerDispatcher::SizeMissBuffers(size_t expert_bytes, HostBuffers* buffers) {
  const size_t bytes = std::max<size_t>(1, expert_bytes);
  if (ctx_->config.miss_buffers == 0) {
    // Copied experts are computed miss_buffers / 2 per launch; on a GPU a
    // launch of two small experts leaves most SMs idle (a Qwen3-30B-A3B int8
    // prompt of 2048 tokens: 248-290 ms with 16 against 304-309 with 4,
    // H100 host), so small experts get more buffers, within
    // kAutoMissBufferBytes. The cpu backend computes them on the host's cores
    // either way: 4.
    ctx_->config.miss_buffers = ctx_->backend->has_device_memory()
                               ? static_cast<int>(std::clamp<size_t>(kAutoMissBufferBytes / bytes, 4, 16))
                               : 4;
  }
  // The prefetch of the next layer's experts (StartPrefetch): as many as
  // kAutoPrefetchBytes holds (enough to keep the link busy through the
  // engine's work between two layer calls: for a 2048-token DeepSeek-V3
  // prompt the planner measured a window of 18-25 ms, 0.8-1.4 GB of link),
  // at least miss_buffers, at most a layer's experts, or
  // ctx_->config.prefetch_buffers when set; the cpu backend, whose "copies" cross
  // no link, miss_buffers. Measured on the H100 host: a cap of 64 held int4
  // Qwen3-30B-A3B to half a layer (2048-token prompts 137.5 / 138.4 ms
  // against 121.8 / 122.1 with 128); 256 MiB held DeepSeek-V3's
  // int8 experts to 6 and 2% of the pairs (2048-token prompts 720-779 /
  // 377-389 ms at 0 / 25% cache against 695-699 / 323-327 with 1 GiB).
  const int by_bytes =
      static_cast<int>(std::min<size_t>(static_cast<size_t>(ctx_->spec.num_experts), kAutoPrefetchBytes / bytes));
  const int on_gpu = ctx_->config.prefetch_buffers > 0 ? std::min(ctx_->spec.num_experts, ctx_->config.prefetch_buffers)
                                                  : std::max(ctx_->config.miss_buffers, by_bytes);
  buffers->prefetch_per_parity = ctx_->host == nullptr || !ctx_->config.prefetch ? 0
                               : ctx_->backend->has_device_memory()       ? on_gpu
                                                                      : ctx_->config.miss_buffers;
}

// The cache (C slots per layer: explicit, or from the memory budget) and the
// backend sized for it plus the host executor's temporary miss and prefetch
// buffers and the device executor's copy buffers, which follow the slots.
// Long: the sizes depend on each other and on the device's free memory.
absl::Status LayerDispatcher::CreateCacheAndBackend(HostBuffers* buffers, int* device_copy_base) {
  const DispatcherConfig& c = ctx_->config;
  BackendConfig bc = c.backend;  // the device knobs; the sizes follow from the model and the cache
  bc.hidden = ctx_->spec.hidden;
  bc.intermediate = ctx_->spec.intermediate;
  bc.activation = ctx_->spec.activation;
  bc.biases = ctx_->spec.expert_biases;
  if (ctx_->host != nullptr) {  // the cache holds experts in the host copy's precision
    bc.format = ctx_->host->geometry().format;
    bc.int4_group = ctx_->host->geometry().group;
  }
  ctx_->copy_bytes = GeometryOf(bc).packed_bytes();
  const size_t expert_bytes = ctx_->backend->ExpertBytes(GeometryOf(bc));
  int C = c.slots_per_layer;
  if (C == 0 && c.cache_gib > 0)
    C = static_cast<int>(c.cache_gib * (1ull << 30) / expert_bytes / std::max<size_t>(1, ctx_->layers.size()));
  if (C < 0) return absl::InvalidArgumentError("cache-experts-per-layer: must not be negative");
  if (c.slots_per_layer > ctx_->spec.num_experts)  // asked for explicitly: never clamped silently
    return absl::InvalidArgumentError(absl::StrCat("cache-experts-per-layer: ", c.slots_per_layer,
                                                   " exceeds the model's ", ctx_->spec.num_experts, " experts per layer"));
  // From --cache-gib: at most every expert (this rank's share in a group).
  C = std::min(C, (ctx_->spec.num_experts + c.group.size - 1) / c.group.size);
  SizeMissBuffers(expert_bytes, buffers);
  const int temp = ctx_->host != nullptr ? 2 * c.miss_buffers : 0;
  // Capturable calls' copy-instead buffers (their own: an eager call on the
  // backend's stream may use the temporary ones at the same time).
  const int device_copies = ctx_->host != nullptr && ctx_->backend->has_device_memory() ? kMaxDeviceCopies : 0;
  const uint64_t base = (static_cast<uint64_t>(C) * ctx_->layers.size() + temp + device_copies) * expert_bytes;
  // The prefetch gives way to a cache sized to the memory: fewer buffers (none at worst), not an error.
  const uint64_t free = ctx_->backend->free_memory_bytes();
  const uint64_t room = free > base ? (free - base) / (2 * expert_bytes) : 0;
  if (static_cast<uint64_t>(buffers->prefetch_per_parity) > room) {
    LogInfo("worker", "prefetch: ", room, " buffers per layer parity (of ", buffers->prefetch_per_parity,
            ") beside the cache in the device's free memory");
    buffers->prefetch_per_parity = static_cast<int>(room);
  }
  const int prefetch = 2 * buffers->prefetch_per_parity;
  const uint64_t need = base + static_cast<uint64_t>(prefetch) * expert_bytes;
  if (need > ctx_->backend->free_memory_bytes())
    return absl::ResourceExhaustedError(absl::StrCat(
        c.slots_per_layer == 0 && c.cache_gib > 0 ? absl::StrCat("cache-gib: ", c.cache_gib, " GiB asks for ") : "cache: ",
        C, " experts/layer x ", ctx_->layers.size(), " layers (+", temp + prefetch + device_copies, " miss buffers) need ",
        need, " bytes, the ", ctx_->backend->name(), " device has ", ctx_->backend->free_memory_bytes(), " free"));

  ExpertCacheConfig cc;
  cc.num_layers = ctx_->spec.num_layers;
  cc.num_experts = ctx_->spec.num_experts;
  cc.slots_per_layer = C;
  cc.policy = c.policy;
  cc.lfru_half_life = c.lfru_half_life;
  MOE_ASSIGN_OR_RETURN(ctx_->cache, ExpertCache::Create(cc));

  bc.num_buffers = C * static_cast<int>(ctx_->layers.size()) + temp + prefetch + device_copies;
  bc.max_tokens = c.max_tokens;
  bc.max_top_k = c.max_top_k;
  bc.contexts = c.contexts;
  bc.num_experts = ctx_->spec.num_experts;
  bc.device_sites = static_cast<int>(ctx_->layers.size());
  // Device-planned calls fit one request slot of every shm server.
  ctx_->capturable_max_tokens = c.max_tokens;
  for (const ExpertServerConfig& sc : c.servers)
    if (UnixSocketPath(sc.address))
      ctx_->capturable_max_tokens = std::min(ctx_->capturable_max_tokens, c.transport.max_tokens_per_slot);
  bc.device_max_tokens = ctx_->capturable_max_tokens;
  MOE_RETURN_IF_ERROR(ctx_->backend->Init(bc));
  buffers->temp_base = C * static_cast<int>(ctx_->layers.size());
  buffers->temp_buffers = temp;
  buffers->prefetch_base = prefetch > 0 ? buffers->temp_base + temp : -1;
  *device_copy_base = device_copies > 0 ? buffers->temp_base + temp + prefetch : -1;
  return absl::OkStatus();
}

absl::Status LayerDispatcher::MeasureRates() {
  const DispatchContext& ctx = *ctx_;
  const HostBuffers& buffers = host_->buffers();
  RateProbeSetup p;
  p.backend = ctx.backend;
  p.host = ctx.host;
  p.layer = ctx.layers.front();
  p.num_experts = ctx.spec.num_experts;
  p.hidden = ctx.spec.hidden;
  p.max_tokens = ctx.config.max_tokens;
  p.miss_buffers = ctx.config.miss_buffers;
  p.temp_base = buffers.temp_base;
  p.temp_buffers = buffers.temp_buffers;
  p.deadline = ctx.config.deadline;
  for (size_t s = 0; s < servers_->size(); ++s) {
    const Server& sv = servers_->at(s);
    p.servers.push_back(ProbeServer{sv.config.address, sv.transport.get(), &sv.hosts, sv.chunk_tokens});
  }
  return ProbeRates(p, ctx_->planner.rates());
}

// The predictive policy, priced with the measured rates when there are some.
absl::Status LayerDispatcher::CreateAdmission() {
  AdmissionConfig ac;
  ac.layers = ctx_->layers;
  ac.num_experts = ctx_->spec.num_experts;
  ac.expert_bytes = ctx_->copy_bytes;
  ac.pass_budget_bytes = ctx_->config.pass_budget_bytes;
  // Unmeasured rates: unit miss cost, copies admitted when the predicted use
  // gains half a miss, no link timing. Measured: the planner's live rates.
  ac.costs = {0.0, 0.5e-3, 1e-3, 0.0};
  return ctx_->planner.EnableAdmissions(ac);
}

// ---------------------------------------------------------------------------
// Calls, handed to the part that carries them out.

absl::StatusOr<int> LayerDispatcher::Submit(const LayerCall& call) { return host_->Submit(call); }

absl::Status LayerDispatcher::Complete(int ticket, CallStats* stats) { return host_->Complete(ticket, stats); }

absl::Status LayerDispatcher::RunOnHost(const LayerCall& call, CallStats* stats) {
  MOE_ASSIGN_OR_RETURN(const int ticket, host_->Submit(call));
  return host_->Complete(ticket, stats);
}

absl::Status LayerDispatcher::Forward(const LayerCall& call, CallStats* stats) {
  if (device_->Takes(call)) return device_->Forward(call, stats, *copies_, host_->busy());
  return RunOnHost(call, stats);
}

absl::Status LayerDispatcher::EnqueueCapturable(const LayerCall& call, bool count_accesses,
                                                std::optional<CallStats>* host_stats) {
  if (!device_->LeavesToHost(call)) return device_->Enqueue(call, count_accesses);
  LayerCall c = call;
  if (c.stream == nullptr) c.stream = LegacyDefaultStream();  // stream-ordered as a capturable call is
  CallStats stats;
  const absl::Status st = RunOnHost(c, &stats);
  if (host_stats != nullptr) *host_stats = stats;
  return st;
}

absl::Status LayerDispatcher::TakeStreamError() { return device_->TakeStreamError(*copies_); }

int LayerDispatcher::CapturableMaxTokens() const { return ctx_->capturable_max_tokens; }

CapturedCalls LayerDispatcher::TakeCapturedCalls() { return device_->TakeCapturedCalls(); }

absl::StatusOr<CallStats> LayerDispatcher::LastDeviceCall(int layer) const { return device_->LastCall(layer); }

absl::Status LayerDispatcher::ApplyAssignment(int layer, const std::vector<int>& experts,
                                              const std::vector<int>& pinned) {
  return copies_->ApplyAssignment(layer, experts, pinned);
}

absl::Status LayerDispatcher::HintRouterLogits(int layer, int T, int k, const float* router_logits) {
  return copies_->HintRouterLogits(layer, T, k, router_logits);
}

absl::Status LayerDispatcher::FlushCopies() { return copies_->Flush(); }

int LayerDispatcher::PendingCopies() { return copies_->Pending(); }

absl::Status LayerDispatcher::SetServerEnabled(const std::string& address, bool enabled) {
  return servers_->SetEnabled(address, enabled);
}

void LayerDispatcher::LeaveGroup() {
  ctx_->config.group = ParallelGroup{};
  device_->PublishSlotMaps();
}

const AdmissionPolicy* LayerDispatcher::admission() const { return ctx_->planner.admission(); }
const ExpertCache& LayerDispatcher::cache() const { return *ctx_->cache; }
const CostModel& LayerDispatcher::cost_model() const { return ctx_->planner.rates(); }
double LayerDispatcher::prefetch_window_seconds() const { return ctx_->planner.PrefetchWindow(); }
int LayerDispatcher::slots_per_layer() const { return ctx_->slots_per_layer(); }
const std::vector<int>& LayerDispatcher::layers() const { return ctx_->layers; }
uint64_t LayerDispatcher::copies_started() const { return copies_->copies_started(); }
uint64_t LayerDispatcher::admissions_during_calls() const { return device_->admissions_during_calls(); }
PlanningStats LayerDispatcher::planning() const { return ctx_->planner.planning(); }
const CopyOutcomes& LayerDispatcher::host_outcomes() const { return ctx_->planner.host_outcomes(); }
const CopyOutcomes& LayerDispatcher::device_outcomes() const { return ctx_->planner.device_outcomes(); }

}  // namespace moe
