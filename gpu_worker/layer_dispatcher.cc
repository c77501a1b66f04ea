#include "gpu_worker/layer_dispatcher.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <new>
#include <optional>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cpu_relax.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/routing.h"
#include "core/status_macros.h"

namespace moe {

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The start-up CPU probe: round trips per size (their median), and the
// experts one token goes to when it measures what a copy costs the CPU.
constexpr int kProbeRepeats = 9;
constexpr int kShareProbeExperts = 8;
constexpr size_t kShareCopiesQueued = 4;  // copies kept in flight beside that probe
constexpr int kShareSamples = 3;           // alternated alone / beside pairs (the median share)

// A server this call cannot use: down, late, cancelled — or one that is up
// but not usable as it is (FailedPrecondition: a shared-memory segment that
// fails the worker's checks after a reconnect, e.g. one another process
// serves on the server's socket; a server holding another slice). Each is
// failed over like a server that went away, never returned to the caller
// while another holder, a copy or the host copy can take the batch.
bool IsServerFailure(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) || absl::IsCancelled(st) ||
         absl::IsAborted(st) || absl::IsFailedPrecondition(st);
}

// The batch a server computes for a sent batch whose tokens were gathered into `tokens`.
MoeBatch GatheredBatch(int layer, const ServerBatch& b, const bf16_t* tokens) {
  return MoeBatch{layer, b.n, tokens, RoutingView{b.n, b.k, b.ids.data(), b.weights.data()}};
}

// The fastest of several runs: the unloaded cost (a probe can only be slowed
// down by noise — a page fault, a descheduled thread — never sped up).
double Fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

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

// ---------------------------------------------------------------------------
// Internals: servers, calls in flight, their sent batches.

// How often a failed server's transport is asked whether it is connected again.
constexpr std::chrono::milliseconds kReconnectPoll{20};

struct Server {
  ExpertServerConfig config;
  std::unique_ptr<ExpertTransport> transport;
  std::vector<bool> hosts;        // per expert
  ExpertSlice slice;               // its share of each expert (the transport's, once connected)
  Clock::time_point down_until{};  // skipped until then after a failure
  bool enabled = true;             // false: drained / marked down by the coordinator
  bool registered = false;         // HostMapping registered with the backend
  bool device_dead = false;        // capturable calls: gone and not reconnected (RefreshDeviceServers)
  bool failing = false;            // failed over since its last answer (logged once per change)
  int chunk_tokens = 0;            // most tokens per staged batch
  std::chrono::microseconds polling{0};  // the window last given to SetPolling
};

// One batch sent to one server: the plan's batch and its transport state.
struct SentBatch {
  ServerBatch batch;             // batch.server: the server it is sent to (changes on failover)
  bool staged = false;
  StagingArea stage;
  size_t host_offset = 0;        // non-staged: row offset into the context's send/recv buffers
  Clock::time_point sent_at{};   // handed to the transport
  std::future<absl::Status> done;
};

struct InFlightCall {
  bool busy = false;
  LayerCall call;
  Clock::time_point deadline;
  std::vector<int32_t> ids;      // host routing [T, k]
  std::vector<float> weights;
  std::vector<SentBatch> sent;
  // Per-call scratch reused across calls.
  std::vector<bf16_t> send, recv;  // non-staged transports: [max_tokens, H] each
  CallStats stats;
  std::vector<uint64_t> copy_fences;  // the call's copy-instead copies, timed at Complete
  struct CopyLaunch {
    uint64_t start, end;   // compute-queue timing marks around the launch
    double prior_s;        // CostModel::CopyDevicePrior of its experts
  };
  std::vector<CopyLaunch> copy_launches;  // the call's launches of copied experts, timed at Complete
  Clock::time_point submitted{};
  double device_prior_s = -1;  // prior device time of a hits-only call (-1: the call is not one)
};

// A context's send/recv buffers for `rows` rows (between its calls).
absl::Status GrowHostBuffers(DeviceBackend& backend, int hidden, InFlightCall& ctx, size_t rows) {
  for (std::vector<bf16_t>* b : {&ctx.send, &ctx.recv}) {
    backend.UnregisterHost(b->data());
    b->resize(rows * hidden);
    b->shrink_to_fit();
    MOE_RETURN_IF_ERROR(backend.RegisterHost(b->data(), b->size() * sizeof(bf16_t)));
  }
  return absl::OkStatus();
}

// A gRPC server's device rings, kept by the worker: the GPU pushes requests
// into a local segment in host-mapped memory as it would into an shm
// server's, and this thread moves each to the server through its transport
// and the answer back. (An shm server works its own device rings.)
struct Forwarder {
  void* mem = nullptr;  // AllocMapped
  std::optional<shm::Segment> seg;
  std::atomic<ExpertTransport*> route{nullptr};  // null while drained or unconnected
  std::atomic<bool> stop{false};
  std::thread thread;
};

void RunForwarder(Forwarder* f, int num_experts, int num_layers, std::chrono::milliseconds deadline,
                  std::chrono::nanoseconds poll) {
  const shm::Segment& seg = *f->seg;
  shm::ValidatedRequest req;
  Clock::time_point last = Clock::now();
  while (!f->stop.load(std::memory_order_acquire)) {
    std::optional<uint32_t> idx = seg.TryPopDeviceSubmit();
    if (!idx) {
      const std::chrono::nanoseconds nap = shm::DeviceNap(Clock::now() - last, poll);
      if (nap.count() > 0) std::this_thread::sleep_for(nap);
      continue;
    }
    last = Clock::now();
    if (!seg.ValidateSlotIndex(*idx).ok()) continue;  // our own GPU wrote it: cannot happen
    const shm::RequestSlot slot = seg.slot(*idx);
    absl::Status st = shm::ValidateRequestSlot(seg, *idx, num_experts, num_layers, &req);
    if (st.ok()) {
      ExpertTransport* t = f->route.load(std::memory_order_acquire);
      if (t == nullptr) {
        st = absl::UnavailableError("the server is drained or unconnected");
      } else {
        const MoeBatch b{static_cast<int>(req.layer), req.n_tokens, slot.tokens, req.routing()};
        std::future<absl::Status> done = t->Submit(b, slot.output, Clock::now() + deadline);
        st = AwaitResult(done);
      }
    }
    shm::WriteResponseStatus(slot, st);
    seg.TryPushDeviceComplete(*idx);
  }
}

struct LayerDispatcher::Impl {
  std::vector<Server> servers;
  std::vector<InFlightCall> contexts;
  // Pending cache copies (lru/lfru admissions and static assignments).
  struct PendingCopy {
    SlotCopy copy;
    uint64_t fence;
    Clock::time_point start;  // enqueued on the copy queue
  };
  std::vector<PendingCopy> pending;
  // Temporary miss buffers: [parity][i] -> backend buffer, with the compute
  // fence after which it may be overwritten.
  int temp_base = 0;
  std::vector<uint64_t> temp_fence;
  int temp_next[2] = {0, 0};
  // Prefetch (StartPrefetch): per layer parity, the next served layer's
  // experts copied during a call into that parity's prefetch buffers, which
  // follow the temporary ones (prefetch_per_parity each; none without a host
  // copy).
  struct Prefetch {
    int layer = -1;                // the layer they are for, -1: none
    std::vector<int32_t> buffer;   // per expert: its prefetch buffer index, -1: not prefetched
    uint64_t last_fence = 0;       // the last of its copies (copies land in order)
  };
  Prefetch prefetch[2];
  int prefetch_base = -1;               // backend buffer of prefetch buffer 0, -1: no prefetch
  int prefetch_per_parity = 0;
  std::vector<uint64_t> prefetch_free;  // per prefetch buffer: the compute fence after which it may be overwritten
  std::vector<std::vector<int32_t>> last_pairs;  // [served index][expert]: pairs of the layer's last host-path call
  std::vector<int64_t> last_total;               // [served index]: that call's pairs
  std::vector<bool> prefetched_now;              // per expert: computed from a prefetch in the call being planned
  std::vector<bool> prefetch_candidate;          // StartPrefetch: per expert, not cached and in the host copy
  std::vector<int> prefetch_order;               // StartPrefetch: ChoosePrefetch's choice (scratch)
  ExpertGroups prefetch_groups;                  // RunHits: the prefetched experts' launch
  std::vector<int32_t> prefetch_launch_buffers;  // its buffer per group
  // Split scratch: the plan of the call being submitted and its inputs.
  MissPlan plan;
  std::vector<int32_t> slot_buffer;     // per expert: the buffer of its Ready slot, or -1
  std::vector<float> masked_logits;     // HintRouterLogits in a group: other ranks' experts out
  std::vector<PlanServer> plan_servers;
  std::vector<int> access_pairs;        // per accessed expert of the plan
  ExpertGroups one_group;               // ComputeCopied's single group, ComputeCopiedInBuffers' launch
  std::vector<int32_t> launch_buffers;  // ComputeCopiedInBuffers: the launch's buffer per group
  std::vector<int> copy_groups;         // ComputeCopiedInBuffers' groups (ComputeCopies, failover)
  ExpertGroups failover_groups;         // a failed sent batch's pairs by expert

  // Device-planned calls (EnqueueCapturable): the host-mapped tables the
  // GPU reads at run time (gpu_worker/device_plan.h) — per served layer the
  // slot map, the routes and the error records, and the channels: one per
  // server that a call may ship to (an shm server's own device rings, or a
  // Forwarder's for a gRPC server). Written by the driving thread only.
  void* mapped = nullptr;                      // one AllocMapped block for all of them
  DeviceChannel* channels = nullptr;           // [kMaxDeviceChannels] (the backend's device copy is what calls read)
  std::vector<DeviceLayerTables> device_tables;  // by served index
  std::vector<int> channel_of_server;          // server -> channel, -1: none (yet)
  std::vector<uint64_t> channel_generation;    // server -> segment generation its channel shows
  std::vector<void*> channel_base;             // server -> that segment's mapping (registered with the device)
  int num_channels = 0;
  DeviceCopyPlan* copy_plan = nullptr;         // copy-instead of capturable calls (PublishCopyPlan)
  int copy_buffer_base = -1;                   // their kMaxDeviceCopies buffers, -1: none (no host copy)
  double device_copy_s = 0;                    // one expert copied by the SMs (ProbeDeviceCopy), 0: unknown
  bool device_ready = false;                   // PrepareDevicePath ran
  std::vector<std::unique_ptr<Forwarder>> forwarders;
  std::vector<int> forwarder_of_server;        // server -> forwarder, -1: none (an shm server)
  std::vector<uint32_t> counts_seen;           // device access counts already reported
  std::vector<int32_t> log_seen;               // per served layer: the routing log's last sequence planned from
  void* planned_stream = nullptr;              // the engine's stream of capturable calls
  // The engine enqueued capturable calls itself (graphs replay them at any
  // time): cache copies wait for its stream, never only for one layer's reader.
  bool engine_calls = false;
  std::vector<uint64_t> last_reader;           // per served layer: its last eager device call's compute fence
  int capturable_max_tokens = 0;               // CapturableMaxTokens, fixed at Create
  std::vector<int> call_experts, call_pairs;   // ForwardOnDevice's accesses (scratch)
  std::vector<int32_t> call_count;             // [E] its pairs per expert, zero between calls
};

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
  if (c.group.size < 1 || c.group.size > spec_.num_experts || c.group.rank < 0 || c.group.rank >= c.group.size)
    return absl::InvalidArgumentError(absl::StrCat(c.group.mode == GroupMode::kExpert ? "group (ep_rank, ep_size)"
                                                                                      : "group (tp_rank, tp_size)",
                                                   ": rank ", c.group.rank, " of size ",
                                                   c.group.size, " (need 0 <= rank < size <= ", spec_.num_experts,
                                                   ", the model's experts)"));
  if (c.poll_window.count() < 0) return absl::InvalidArgumentError("poll-window: must not be negative");
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
    // bench/RESULTS.md stop 21), so small experts get more buffers, within
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
  // no link, miss_buffers. Measured (bench/RESULTS.md): a cap of 64 held int4
  // Qwen3-30B-A3B to half a layer (2048-token prompts 137.5 / 138.4 ms
  // against 121.8 / 122.1 with 128, stop 23); 256 MiB held DeepSeek-V3's
  // int8 experts to 6 and 2% of the pairs (2048-token prompts 720-779 /
  // 377-389 ms at 0 / 25% cache against 695-699 / 323-327 with 1 GiB, stop 25).
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
  return absl::OkStatus();
}

// The per-call contexts with their registered send/recv buffers, and the
// per-expert scratch of the split.
absl::Status LayerDispatcher::AllocateContexts() {
  const DispatcherConfig& c = config_;
  impl_->contexts.resize(c.contexts);
  for (InFlightCall& ctx : impl_->contexts) {
    ctx.send.resize(static_cast<size_t>(c.max_tokens) * spec_.hidden);
    ctx.recv.resize(static_cast<size_t>(c.max_tokens) * spec_.hidden);
    MOE_RETURN_IF_ERROR(backend_->RegisterHost(ctx.send.data(), ctx.send.size() * sizeof(bf16_t)));
    MOE_RETURN_IF_ERROR(backend_->RegisterHost(ctx.recv.data(), ctx.recv.size() * sizeof(bf16_t)));
  }
  impl_->slot_buffer.resize(spec_.num_experts);
  return absl::OkStatus();
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

// ---------------------------------------------------------------------------
// Rates: one expert copied, what one more expert adds to a device call at 1
// and many rows, and the first server's round trip for 1 and 2 experts and
// many tokens.
absl::Status LayerDispatcher::MeasureRates() {
  // The CPU probe climbs to prompt-sized batches (its throughput per row grows
  // several-fold from decode to prefill); the device probe stays at 64 rows.
  int cpu_rows = std::min(config_.max_tokens, 1024);
  for (const Server& sv : impl_->servers)
    if (sv.transport != nullptr) cpu_rows = std::min(cpu_rows, std::max(1, sv.chunk_tokens));
  const int rows = std::max(cpu_rows, std::min(config_.max_tokens, 64));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(rows) * spec_.hidden), y(x.size());
  for (bf16_t& v : x) v = F32ToBf16(dist(rng));
  MOE_RETURN_IF_ERROR(MeasureDeviceRates(std::min(config_.max_tokens, 64), x, y));
  return MeasureServerRates(cpu_rows, x, y);
}

// One expert copied; then what one more expert adds to a call on the device
// at 1 and at `rows` rows: a call of n experts (the temporary buffers, each
// loaded) less a call of one, over n - 1. A call's own cost (its activations'
// transfers, launches, the host's wait) is the call's, not each copied
// expert's: priced per expert, it made a probe of one expert per call say
// 0.17 ms for a 128-row int8 expert the packed kernels compute in 0.008 ms,
// and the planner kept prompts' experts on the CPU (bench/RESULTS.md, stop 19).
absl::Status LayerDispatcher::MeasureDeviceRates(int rows, const std::vector<bf16_t>& x, std::vector<bf16_t>& y) {
  const int layer = layers_.front();
  const int n = std::max(1, std::min(2 * config_.miss_buffers, 8));  // temporary buffers used
  std::vector<double> t;
  for (int i = 0; i < std::max(3, n); ++i) {
    const Clock::time_point t0 = Clock::now();
    MOE_ASSIGN_OR_RETURN(const uint64_t f, backend_->LoadExpert(impl_->temp_base + i % n,
                                                                 host_->Find(layer, i % spec_.num_experts), 0));
    MOE_RETURN_IF_ERROR(backend_->WaitCopy(f));
    t.push_back(Seconds(Clock::now() - t0));
  }
  planner_.rates().copy_s = Fastest(t);
  std::vector<int32_t> buffers(n);
  std::iota(buffers.begin(), buffers.end(), impl_->temp_base);
  // The fastest of 5 calls of `launches` launches of `experts` experts with m
  // rows each (the same m tokens).
  auto device_time = [&](int m, int experts, int launches) -> absl::StatusOr<double> {
    ExpertGroups g;
    for (int e = 0; e < experts; ++e) {
      g.expert.push_back(e);
      g.row_begin.push_back(static_cast<int32_t>(g.token.size()));
      g.count.push_back(m);
      for (int r = 0; r < m; ++r) g.token.push_back(r), g.weight.push_back(0.5f);
      while (g.token.size() % backend_->hit_row_align() != 0) g.token.push_back(-1), g.weight.push_back(0.f);
    }
    g.total_rows = static_cast<int32_t>(g.token.size());
    g.total_pairs = experts * m;
    const HitPlan p{&g, buffers.data()};
    std::vector<double> v;
    for (int i = 0; i < 5; ++i) {
      const Clock::time_point t0 = Clock::now();
      MOE_RETURN_IF_ERROR(backend_->BeginCall(0, m, x.data(), MemoryKind::kHost));
      for (int l = 0; l < launches; ++l) MOE_RETURN_IF_ERROR(backend_->RunExperts(0, p));
      MOE_RETURN_IF_ERROR(backend_->FinishCall(0, y.data(), MemoryKind::kHost));
      v.push_back(Seconds(Clock::now() - t0));
    }
    return Fastest(v);
  };
  // Hits: one more expert in a grouped launch at m rows (with one buffer, the
  // whole call: an upper bound).
  auto per_hit = [&](int m) -> absl::StatusOr<double> {
    MOE_ASSIGN_OR_RETURN(const double one, device_time(m, 1, 1));
    if (n == 1) return one;
    MOE_ASSIGN_OR_RETURN(const double all, device_time(m, n, 1));
    return std::max(1e-7, (all - one) / (n - 1));
  };
  // Copied experts, as ComputeCopiedInBuffers launches them: what one more
  // launch of `per_launch` experts adds to a call, per expert. (Priced as
  // hits, a copied expert cost ~1 us and its device time was hidden from
  // the planner.)
  const int per_launch = std::min(n, std::max(1, config_.miss_buffers / 2));
  auto per_copied = [&](int m) -> absl::StatusOr<double> {
    MOE_ASSIGN_OR_RETURN(const double one, device_time(m, per_launch, 1));
    MOE_ASSIGN_OR_RETURN(const double two, device_time(m, per_launch, 2));
    return std::max(1e-7, (two - one) / per_launch);
  };
  CostModel& r = planner_.rates();
  MOE_ASSIGN_OR_RETURN(const double h1, per_hit(1));
  MOE_ASSIGN_OR_RETURN(const double hm, per_hit(rows));
  r.device_row_s = std::max(0.0, (hm - h1) / std::max(1, rows - 1));
  r.device_fixed_s = std::max(0.0, h1 - r.device_row_s);
  MOE_ASSIGN_OR_RETURN(const double c1, per_copied(1));
  MOE_ASSIGN_OR_RETURN(const double cm, per_copied(rows));
  r.copy_device_row_s = std::max(0.0, (cm - c1) / std::max(1, rows - 1));
  r.copy_device_fixed_s = std::max(0.0, c1 - r.copy_device_row_s);
  return absl::OkStatus();
}

// The first server that answered at start: round trips for 1 and 2 experts
// and `rows` tokens. Sets planner_.rates().measured when it could.
absl::Status LayerDispatcher::MeasureServerRates(int rows, const std::vector<bf16_t>& x, std::vector<bf16_t>& y) {
  const int layer = layers_.front();
  auto connected = std::find_if(impl_->servers.begin(), impl_->servers.end(),
                                [](const Server& sv) { return sv.transport != nullptr; });
  if (connected == impl_->servers.end()) return absl::OkStatus();
  Server& s = *connected;
  // Probes rotate through the hosted experts so their weights come from DRAM,
  // not from the L3 cache a repeated expert would sit in.
  std::vector<int> hosted;
  for (int e = 0; e < spec_.num_experts; ++e)
    if (s.hosts[e]) hosted.push_back(e);
  if (hosted.empty()) return absl::OkStatus();
  size_t cursor = 0;
  // m tokens to the same `experts` distinct experts (one token row of k >= 2 ids).
  auto cpu_time = [&](int m, int experts) -> absl::StatusOr<double> {
    const int k = std::max(2, experts);
    std::vector<int32_t> ids(static_cast<size_t>(m) * k, -1), row(k, -1);
    std::vector<float> w(ids.size(), 0.5f);
    std::vector<double> v;
    for (int i = 0; i < kProbeRepeats; ++i) {
      for (int j = 0; j < experts && j < static_cast<int>(hosted.size()); ++j) row[j] = hosted[cursor++ % hosted.size()];
      for (int t = 0; t < m; ++t) std::copy(row.begin(), row.end(), ids.begin() + static_cast<size_t>(t) * k);
      const MoeBatch batch{layer, m, x.data(), RoutingView{m, k, ids.data(), w.data()}};
      const Clock::time_point t0 = Clock::now();
      std::future<absl::Status> f = s.transport->Submit(batch, y.data(), Clock::now() + config_.deadline);
      if (absl::Status st = AwaitResult(f); !st.ok())
        return absl::Status(st.code(), absl::StrCat("servers: probing ", s.config.address, ": ", st.message()));
      v.push_back(Seconds(Clock::now() - t0));
    }
    return Median(v);  // a probe at prompt sizes varies; the median, not the luckiest run
  };
  // One token to one and two experts, before and after the larger probes:
  // every other term is priced against these two, and a transient
  // disturbance of the shared host in one of them (a 2 ms round trip instead
  // of 0.1) once made the whole curve "2 ms per call, nothing per expert or
  // row" (bench/RESULTS.md, stop 22); the lower of the two medians is kept.
  MOE_ASSIGN_OR_RETURN(double c11, cpu_time(1, 1));
  MOE_ASSIGN_OR_RETURN(double c12, cpu_time(1, 2));
  // Seconds per pair at 4, 16, 64, ... rows of one expert, up to `rows`.
  std::vector<std::pair<int, double>> at;
  for (int m = std::min(4, rows); m >= 2 && m <= rows; m = m * 4 > rows && m < rows ? rows : m * 4) {
    MOE_ASSIGN_OR_RETURN(const double cm, cpu_time(m, 1));
    at.push_back({m, cm});
  }
  MOE_ASSIGN_OR_RETURN(const double c11_again, cpu_time(1, 1));
  MOE_ASSIGN_OR_RETURN(const double c12_again, cpu_time(1, 2));
  c11 = std::min(c11, c11_again);
  c12 = std::min(c12, c12_again);
  planner_.rates().cpu_expert_s = std::max(0.0, c12 - c11);
  planner_.rates().cpu_pair_curve.clear();
  for (const auto& [m, cm] : at) planner_.rates().cpu_pair_curve.push_back({m, std::max(0.0, (cm - c11) / (m - 1))});
  planner_.rates().cpu_pair_s = planner_.rates().cpu_pair_curve.empty() ? 0.0 : planner_.rates().cpu_pair_curve.front().second;
  planner_.rates().cpu_call_s = std::max(0.0, c11 - planner_.rates().cpu_expert_s - planner_.rates().cpu_pair_s);
  planner_.rates().measured = true;
  return MeasureCopyCpuShare(layer, [&] { return cpu_time(1, std::min<int>(kShareProbeExperts, hosted.size())); });
}

// What a copy costs the CPU servers (CostModel::copy_cpu_share): one token to
// several experts — their weights streamed from DRAM, as a decode's misses
// are — alone, then while the copy engine streams experts into the temporary
// buffers until it is done; the share of its pace the CPU lost is
// 1 - alone / beside. The H100 host's CPU read 57-125 GB/s beside copies of
// 33-53 GB/s where it read 75-140 alone (moe_layer, 52 runs, bench/RESULTS.md
// stop 23): pricing each copy as all of its bytes taken from the CPU kept the
// cache's admissions from copies that paid. Needs device memory (a copy the host
// thread makes itself cannot run beside the probe) and temporary buffers.
absl::Status LayerDispatcher::MeasureCopyCpuShare(int layer, const std::function<absl::StatusOr<double>()>& probe) {
  Impl& m = *impl_;
  CostModel& r = planner_.rates();
  if (!backend_->has_device_memory() || m.temp_fence.empty() || host_ == nullptr || !(r.copy_s > 0))
    return absl::OkStatus();
  std::vector<const std::byte*> sources;
  for (int e = 0; e < spec_.num_experts; ++e)
    if (const std::byte* src = host_->Find(layer, e); src != nullptr) sources.push_back(src);
  if (sources.empty()) return absl::OkStatus();
  // One sample: the probe alone, then beside copies. A shared host's pace
  // drifts between probes (one pair read 10% on one start and 55% on the
  // next, stop 27): the median of kShareSamples alternated pairs.
  std::vector<double> shares;
  for (int sample = 0; sample < kShareSamples; ++sample) {
    MOE_ASSIGN_OR_RETURN(const double alone, probe());
    MOE_ASSIGN_OR_RETURN(const double beside, ProbeBesideCopies(sources, probe));
    if (alone > 0 && beside > 0) shares.push_back(std::clamp(1.0 - alone / beside, 0.0, 1.0));
  }
  if (!shares.empty()) r.copy_cpu_share = Median(shares);
  return absl::OkStatus();
}

// `probe` while the copy engine streams `sources` into the temporary buffers
// until it is done; its seconds.
absl::StatusOr<double> LayerDispatcher::ProbeBesideCopies(const std::vector<const std::byte*>& sources,
                                                          const std::function<absl::StatusOr<double>()>& probe) {
  Impl& m = *impl_;
  // A thread of its own keeps a few copies queued until the probe is done (a
  // backend whose LoadExpert waits for staging space cannot run ahead).
  const int buffers = static_cast<int>(m.temp_fence.size());
  std::atomic<bool> stop{false};
  absl::Status copied;
  std::vector<uint64_t> fences;
  std::thread copier([&] {
    for (size_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      if (i >= kShareCopiesQueued) copied = backend_->WaitCopy(fences[i - kShareCopiesQueued]);
      absl::StatusOr<uint64_t> f =
          copied.ok() ? backend_->LoadExpert(m.temp_base + static_cast<int>(i % buffers), sources[i % sources.size()], 0)
                      : absl::StatusOr<uint64_t>(copied);
      if (!f.ok()) {
        copied = f.status();
        return;
      }
      fences.push_back(*f);
    }
  });
  absl::StatusOr<double> beside = probe();
  stop.store(true);
  copier.join();
  if (!fences.empty()) MOE_RETURN_IF_ERROR(backend_->WaitCopy(fences.back()));
  MOE_RETURN_IF_ERROR(copied);
  return beside;
}

// ---------------------------------------------------------------------------

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
  for (size_t li = 0; li < layers_.size(); ++li) {
    int32_t* channel_of = m.device_tables[li].channel_of;
    for (int e = 0; e < spec_.num_experts; ++e) {
      const uint64_t route = RouteExpert(up.data(), static_cast<int>(up.size()), e);
      __atomic_store_n(channel_of + e, route != 0 ? static_cast<int32_t>(route) : -1, __ATOMIC_RELEASE);
    }
  }
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
// decode's host time, bench/RESULTS.md stop 25). A layer whose start fails
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

absl::Status LayerDispatcher::SetServerEnabled(const std::string& address, bool enabled) {
  for (size_t i = 0; i < impl_->servers.size(); ++i)
    if (impl_->servers[i].config.address == address) {
      impl_->servers[i].enabled = enabled;
      PublishRoute(i);
      return absl::OkStatus();
    }
  return absl::NotFoundError("servers: no server " + address);
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

absl::StatusOr<int> LayerDispatcher::Submit(const LayerCall& call) {
  const Clock::time_point t_start = Clock::now();
  Impl& m = *impl_;
  MOE_ASSIGN_OR_RETURN(const int ticket, FreeContext());
  // Validation: nothing is touched before the call is known to be sound.
  MOE_RETURN_IF_ERROR(CheckCall(call));
  // The engine's earlier work on its stream (which produced hidden/routing)
  // comes before ours: an event wait, no host sync of that stream.
  MOE_RETURN_IF_ERROR(backend_->WaitStream(call.stream));
  InFlightCall& ctx = m.contexts[ticket];
  MOE_RETURN_IF_ERROR(CopyRouting(call, ctx.ids, ctx.weights));
  const int T = call.batch.n, k = std::max(call.batch.routing.k, 1);
  const RoutingView routing{T, k, ctx.ids.data(), ctx.weights.data()};
  MOE_RETURN_IF_ERROR(ValidateRouting(routing, spec_.num_experts, {}));
  if (config_.group.size > 1)  // another rank computes these pairs
    for (int32_t& e : ctx.ids)
      if (e >= 0 && !Owns(call.batch.layer, e)) e = -1;

  PollCopies();
  planner_.CallStarted();  // the link's idle window since the last call's own copies
  ctx.stats = CallStats{};
  MOE_RETURN_IF_ERROR(PlanCall(call.batch.layer, routing));

  MOE_RETURN_IF_ERROR(backend_->BeginCall(ticket, T, call.batch.tokens, call.kind));
  ctx.busy = true;
  ctx.call = call;
  ctx.submitted = t_start;
  ctx.device_prior_s = -1;
  // Hits only (none prefetched, whose copies the call may wait for): the device time is the call's time.
  if (m.plan.missed.empty() && planner_.rates().measured && m.prefetch[call.batch.layer & 1].layer != call.batch.layer) {
    ctx.device_prior_s = 0;
    for (int e : m.plan.accessed) ctx.device_prior_s += planner_.rates().DevicePrior(m.plan.hit_pairs[e]);
  }
  ctx.deadline = t_start + (call.deadline.count() > 0 ? call.deadline : config_.deadline);
  ctx.sent.clear();
  if (absl::Status st = Dispatch(ticket); !st.ok()) {
    Abort(ticket);
    return st;
  }
  ctx.stats.submit_seconds = Seconds(Clock::now() - t_start);
  return ticket;
}

absl::StatusOr<int> LayerDispatcher::FreeContext() const {
  for (size_t i = 0; i < impl_->contexts.size(); ++i)
    if (!impl_->contexts[i].busy) return static_cast<int>(i);
  return absl::ResourceExhaustedError(
      absl::StrCat("contexts: ", impl_->contexts.size(), " calls already in flight"));
}

absl::Status LayerDispatcher::CheckCall(const LayerCall& call) const {
  const MoeBatch& b = call.batch;
  if (b.layer < 0 || b.layer >= spec_.num_layers || layer_index_[b.layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", b.layer, " is not an MoE layer served here"));
  if (b.n < 0 || b.n > config_.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: ", b.n, " is outside [0, ", config_.max_tokens, "]"));
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (b.n > 0 && (b.routing.k < 1 || b.routing.k > config_.max_top_k))
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: k = ", b.routing.k, " is outside [1, ", config_.max_top_k, "]"));
  if (b.n > 0 && (b.tokens == nullptr || b.routing.ids == nullptr || b.routing.weights == nullptr ||
                  call.out == nullptr))
    return absl::InvalidArgumentError("hidden/topk_ids/topk_weights/out: null pointer");
  if (call.kind == MemoryKind::kDevice && !backend_->has_device_memory())
    return absl::InvalidArgumentError("kind: device pointers given to a backend without device memory");
  return absl::OkStatus();
}

// The call's routing in host memory (a copy of T*k ids/weights from the
// device when it lives there).
absl::Status LayerDispatcher::CopyRouting(const LayerCall& call, std::vector<int32_t>& ids,
                                          std::vector<float>& weights) {
  const RoutingView& r = call.batch.routing;
  const int T = call.batch.n, k = std::max(r.k, 1);
  ids.resize(static_cast<size_t>(T) * k);
  weights.resize(ids.size());
  if (T == 0) return absl::OkStatus();
  if (call.kind == MemoryKind::kDevice)
    return backend_->RoutingToHost(r.ids, r.weights, T * k, ids.data(), weights.data());
  std::memcpy(ids.data(), r.ids, ids.size() * sizeof(int32_t));
  std::memcpy(weights.data(), r.weights, weights.size() * sizeof(float));
  return absl::OkStatus();
}

// The split of a validated routing of `layer` (PlanMisses) into impl_->plan,
// against the slot map and the servers as they are now. Servers due a retry
// are reconnected first when the call has misses.
absl::Status LayerDispatcher::PlanCall(int layer, const RoutingView& routing) {
  Impl& m = *impl_;
  const int E = spec_.num_experts;
  for (int e = 0; e < E; ++e) {
    const int slot = cache_->ReadySlot(layer, e);
    m.slot_buffer[e] = slot >= 0 ? SlotBuffer(layer, slot) : -1;
  }
  // The experts prefetched for this layer are computed from their prefetch
  // buffers with the hits; a prefetch for another layer of the parity is stale.
  std::fill(m.prefetched_now.begin(), m.prefetched_now.end(), false);
  Impl::Prefetch& pf = m.prefetch[layer & 1];
  if (pf.layer == layer) {
    for (int e = 0; e < E; ++e)
      if (pf.buffer[e] >= 0 && m.slot_buffer[e] < 0) {
        m.slot_buffer[e] = m.prefetch_base + pf.buffer[e];
        m.prefetched_now[e] = true;
      }
  } else if (pf.layer >= 0) {
    ReleasePrefetch(layer & 1, false);
  }
  bool any_miss = false;
  for (size_t i = 0, n = static_cast<size_t>(routing.n) * routing.k; i < n && !any_miss; ++i)
    any_miss = routing.ids[i] >= 0 && m.slot_buffer[routing.ids[i]] < 0;
  const Clock::time_point now = Clock::now();
  m.plan_servers.resize(m.servers.size());
  for (size_t i = 0; i < m.servers.size(); ++i) {
    Server& sv = m.servers[i];
    if (sv.transport == nullptr && sv.enabled && sv.down_until <= now && any_miss)
      if (!ConnectServer(i).ok()) sv.down_until = now + config_.server_retry;
    // A server that failed gets calls again once its transport says it is
    // connected (a gRPC channel is asked to connect now), checked every
    // kReconnectPoll — not a call sent into a channel still in back-off.
    if (sv.transport != nullptr && sv.failing && sv.enabled && sv.down_until <= now &&
        !sv.transport->Reconnect().ok())
      sv.down_until = now + std::min<Clock::duration>(config_.server_retry, kReconnectPoll);
    m.plan_servers[i] = PlanServer{sv.enabled && sv.transport != nullptr && sv.down_until <= now, &sv.hosts,
                                   sv.chunk_tokens, sv.slice};
  }
  MissPlanInput in;
  in.layer = layer;
  in.routing = routing;
  in.num_experts = E;
  in.slot_buffer = m.slot_buffer.data();
  in.servers = m.plan_servers.data();
  in.num_servers = static_cast<int>(m.plan_servers.size());
  in.hit_row_align = backend_->hit_row_align();
  in.copy_mode = config_.copy_mode;
  in.can_copy = host_ != nullptr && !m.temp_fence.empty();
  in.copy_min_tokens = config_.copy_min_tokens;
  return planner_.PlanCall(in, &m.plan);
}

// Ships the CPU misses, enqueues the hits, the copied experts and the cache
// admissions of a call whose routing Submit has planned.
absl::Status LayerDispatcher::Dispatch(int ticket) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  const int layer = ctx.call.batch.layer;
  // 1. The CPU misses, per server, before any device compute is enqueued.
  MOE_RETURN_IF_ERROR(ShipMisses(ticket));
  // 2. Hits: one grouped launch over the cached experts, then one over the
  // experts prefetched for this call, after their copies (RunHits).
  const int parity = layer & 1;
  const bool prefetched = m.prefetch[parity].layer == layer;
  const absl::Status hits = RunHits(ticket);
  if (prefetched) ReleasePrefetch(parity, true);
  MOE_RETURN_IF_ERROR(hits);
  // 3. Bookkeeping.
  m.access_pairs.clear();
  for (int e : m.plan.accessed) m.access_pairs.push_back(m.plan.hit_pairs[e] + m.plan.miss_pairs[e]);
  cache_->RecordAccess(layer, m.plan.accessed, m.access_pairs);
  std::vector<int32_t>& last = m.last_pairs[layer_index_[layer]];
  std::fill(last.begin(), last.end(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < m.plan.accessed.size(); ++i) {
    last[m.plan.accessed[i]] = m.access_pairs[i];
    total += m.access_pairs[i];
  }
  m.last_total[layer_index_[layer]] = total;
  if (config_.on_access)  // a prefetched expert was not cached: its pairs count as misses
    for (int e : m.plan.accessed) {
      if (m.plan.hit_pairs[e] > 0) config_.on_access(layer, e, m.plan.hit_pairs[e], !m.prefetched_now[e]);
      if (m.plan.miss_pairs[e] > 0) config_.on_access(layer, e, m.plan.miss_pairs[e], false);
    }
  // 4. Copy-instead-of-compute, then the next layer's prefetch behind it on the link.
  MOE_RETURN_IF_ERROR(ComputeCopies(ticket));
  if (!m.plan.copy_experts.empty() || prefetched) planner_.OwnCopiesQueued();
  MOE_ASSIGN_OR_RETURN(const int prefetches, StartPrefetch(ticket));
  if (config_.on_activity && (ctx.stats.cpu_pairs > 0 || ctx.stats.copied_pairs > 0)) {
    LayerActivity a;
    a.cpu_pairs = static_cast<uint64_t>(ctx.stats.cpu_pairs);
    a.copied_pairs = static_cast<uint64_t>(ctx.stats.copied_pairs);
    a.prefetched_pairs = static_cast<uint64_t>(ctx.stats.prefetched_pairs);
    const int link_copies = static_cast<int>(m.plan.copy_experts.size()) + prefetches;
    a.link_seconds = planner_.rates().measured ? planner_.rates().CopySeconds() * link_copies : 0.0;
    config_.on_activity(layer, a);
  }
  // 5. Admissions for later calls (after the compute above, so an evicted
  // slot is overwritten only once it was read).
  return StartAdmissions(ticket);
}

// Turns the plan's server batches into the call's sent batches and hands them
// to the transports: gathered straight into the transport's memory (staged)
// where it has some, else through the context's send buffer.
absl::Status LayerDispatcher::ShipMisses(int ticket) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  CallStats& stats = ctx.stats;
  const int H = spec_.hidden;
  stats.cpu_experts += m.plan.cpu_experts;
  for (int e : m.plan.missed)  // once per pair, however many slice holders compute a share of it
    if (m.plan.route_of[e] != 0) stats.cpu_pairs += m.plan.miss_pairs[e];
  // A token travels to every server one of its pairs goes to (to each slice
  // holder): the batches' rows may add up to more than the call's tokens.
  size_t rows = 0;
  for (const ServerBatch& b : m.plan.batches) rows += static_cast<size_t>(b.n);
  if (rows * H > ctx.send.size()) MOE_RETURN_IF_ERROR(GrowHostBuffers(*backend_, H, ctx, rows));
  size_t offset = 0;  // the batch's first row in the call's send/recv buffers
  for (ServerBatch& b : m.plan.batches) {
    SentBatch& sh = ctx.sent.emplace_back();
    stats.miss_tokens += b.n;
    stats.bytes_shipped += static_cast<uint64_t>(b.n) * (2 * H * sizeof(bf16_t) + b.k * 8);
    sh.host_offset = offset;
    offset += b.n;
    sh.batch = std::move(b);
  }
  const std::chrono::microseconds polling =
      ctx.call.batch.n <= config_.poll_max_tokens ? config_.poll_window : std::chrono::microseconds(0);
  for (SentBatch& sh : ctx.sent) {
    Server& server = m.servers[sh.batch.server];
    if (server.polling != polling) {
      server.transport->SetPolling(polling);
      server.polling = polling;
    }
    bf16_t* dst = nullptr;
    if (server.registered) {
      absl::StatusOr<StagingArea> staged = server.transport->Stage(sh.batch.n, sh.batch.k, ctx.deadline);
      if (staged.ok()) {
        sh.staged = true;
        sh.stage = *staged;
        dst = sh.stage.tokens;
      }
    }
    if (dst == nullptr) dst = ctx.send.data() + sh.host_offset * H;
    MOE_RETURN_IF_ERROR(Gather(ticket, sh.batch.rows, dst));
    if (sh.staged) {
      std::memcpy(sh.stage.expert_ids, sh.batch.ids.data(), sh.batch.ids.size() * sizeof(int32_t));
      std::memcpy(sh.stage.expert_weights, sh.batch.weights.data(), sh.batch.weights.size() * sizeof(float));
      sh.sent_at = Clock::now();
      sh.done = server.transport->SubmitStaged(sh.stage, static_cast<uint32_t>(ctx.call.batch.layer), ctx.deadline);
    } else {
      sh.sent_at = Clock::now();
      sh.done = server.transport->Submit(GatheredBatch(ctx.call.batch.layer, sh.batch, dst),
                                         ctx.recv.data() + sh.host_offset * H, ctx.deadline);
    }
  }
  return absl::OkStatus();
}

// The call's rows `rows` gathered into host memory `dst`, complete on return.
absl::Status LayerDispatcher::Gather(int ticket, const std::vector<int32_t>& rows, bf16_t* dst) {
  MOE_ASSIGN_OR_RETURN(const uint64_t f,
                       backend_->GatherRows(ticket, rows.data(), static_cast<int>(rows.size()), dst));
  return backend_->WaitCompute(f);
}

// The plan's copied experts: under copy-every-miss admitted into the cache
// (the plain LRU offload) and computed from their new slots; the rest through
// the temporary buffers.
absl::Status LayerDispatcher::ComputeCopies(int ticket) {
  Impl& m = *impl_;
  const MissPlan& plan = m.plan;
  const int layer = m.contexts[ticket].call.batch.layer;
  // The link starts on them now, while the loops below are still enqueueing
  // (a bf16 call's per-expert cuBLAS launches kept the host here for 4-5 ms
  // at 2048 tokens; timed from the loops' end, the planner's link clock ran
  // that far behind the link, and the prefetch window it measures shrank
  // by as much: bench/RESULTS.md stop 23).
  planner_.CopiesQueued(static_cast<int>(plan.copy_experts.size()));
  std::vector<int> copy_list = plan.copy_experts;
  if (config_.copy_mode == CopyMode::kAlways && config_.policy != CachePolicy::kStatic &&
      !copy_list.empty()) {
    std::vector<SlotCopy> copies = cache_->PlanAdmissions(layer, copy_list, static_cast<int>(copy_list.size()));
    for (const SlotCopy& copy : copies) {
      absl::StatusOr<uint64_t> f =
          ComputeCopied(ticket, plan.copies, plan.copy_group(copy.expert), SlotBuffer(layer, copy.slot));
      if (!f.ok()) {
        cache_->AbortCopy(copy);
        return f.status();
      }
      m.pending.push_back({copy, *f, Clock::now()});
      ++copies_started_;
      copy_list.erase(std::find(copy_list.begin(), copy_list.end(), copy.expert));
    }
  }
  m.copy_groups.clear();
  for (int e : copy_list) m.copy_groups.push_back(plan.copy_group(e));
  return ComputeCopiedInBuffers(ticket, plan.copies, m.copy_groups);
}

// Cache admissions after a call: predictive prefetches the next layers'
// predicted experts; lru/lfru admit this call's misses.
absl::Status LayerDispatcher::StartAdmissions(int ticket) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
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
             config_.copy_mode != CopyMode::kAlways && !m.plan.missed.empty() && config_.admissions_per_call > 0) {
    std::vector<SlotCopy> copies = cache_->PlanAdmissions(layer, m.plan.missed, config_.admissions_per_call);
    MOE_RETURN_IF_ERROR(StartSlotCopies(layer, copies));
  }
  return absl::OkStatus();
}

// Prefetch, for prompts: a call that moved experts over the link (copied, or
// computed from a prefetch) starts copying the next served layer's experts
// into that layer's prefetch buffers right away, behind its own copies, so
// the link keeps working while this layer computes, its CPU share finishes
// and the next layer's attention runs; the next layer's call computes them
// after its cached hits (PlanCall, RunHits). Which and how many, from what the
// planner did: at most as many as this call moved, and only experts whose
// expected pairs in the next call (its last call's, scaled to this call's
// size) are at least those of the least-used expert this call moved — an
// expert the planner would copy too. Decode calls, whose experts the plan
// leaves to the CPU servers, prefetch nothing. Returns the copies started.
absl::StatusOr<int> LayerDispatcher::StartPrefetch(int ticket) {
  Impl& m = *impl_;
  const InFlightCall& ctx = m.contexts[ticket];
  if (!config_.prefetch || m.prefetch_base < 0 || config_.copy_mode != CopyMode::kAuto) return 0;
  int moved = 0;
  int32_t least = std::numeric_limits<int32_t>::max();
  for (int e : m.plan.copy_experts) {
    ++moved;
    least = std::min(least, m.plan.miss_pairs[e]);
  }
  for (int e : m.plan.accessed)
    if (m.prefetched_now[e] && m.plan.hit_pairs[e] > 0) {
      ++moved;
      least = std::min(least, m.plan.hit_pairs[e]);
    }
  if (moved == 0) return 0;
  const size_t index = layer_index_[ctx.call.batch.layer], next_index = (index + 1) % layers_.size();
  const int next = layers_[next_index], parity = next & 1;
  Impl::Prefetch& pf = m.prefetch[parity];
  if (pf.layer == next) return 0;  // another micro-batch's call started it
  if (pf.layer >= 0) ReleasePrefetch(parity, false);
  if (m.last_total[next_index] == 0) return 0;
  const double scale = static_cast<double>(m.last_total[index]) / static_cast<double>(m.last_total[next_index]);
  for (int e = 0; e < spec_.num_experts; ++e)
    m.prefetch_candidate[e] = cache_->SlotOf(next, e) < 0 && host_->Find(next, e) != nullptr;
  const CostModel& rates = planner_.rates();
  std::vector<int>& order = m.prefetch_order;
  ChoosePrefetch(m.last_pairs[next_index], m.prefetch_candidate, scale, least, moved, m.prefetch_per_parity,
                 planner_.PrefetchWindow(), rates.measured ? rates.CopySeconds() : 0.0, &order);
  const int n = static_cast<int>(order.size());
  if (n == 0) return 0;
  pf.layer = next;
  for (int i = 0; i < n; ++i) {
    const int ti = parity * m.prefetch_per_parity + i;
    MOE_ASSIGN_OR_RETURN(pf.last_fence, backend_->LoadExpert(m.prefetch_base + ti, host_->Find(next, order[i]),
                                                             m.prefetch_free[ti]));
    pf.buffer[order[i]] = ti;
  }
  planner_.CopiesQueued(n);
  return n;
}

// Gives back the prefetch of `parity`: consumed by a call (its buffers free
// once the compute enqueued so far, which reads them, has run) or stale
// (nothing read them; copies land in order, so a later copy into one of them
// lands after the prefetch's).
void LayerDispatcher::ReleasePrefetch(int parity, bool consumed) {
  Impl& m = *impl_;
  Impl::Prefetch& pf = m.prefetch[parity];
  const uint64_t after = consumed ? backend_->RecordCompute() : 0;
  for (int32_t& ti : pf.buffer) {
    if (ti < 0) continue;
    if (consumed) m.prefetch_free[ti] = after;
    ti = -1;
  }
  pf.layer = -1;
}

namespace {
// A launch's groups: none yet.
void ClearGroups(ExpertGroups& launch) {
  launch.expert.clear();
  launch.row_begin.clear();
  launch.count.clear();
  launch.token.clear();
  launch.weight.clear();
  launch.total_rows = launch.total_pairs = 0;
}
// Appends group g of `from` to `launch`, padded so that the next group starts
// on a multiple of `align` rows.
void AppendGroup(const ExpertGroups& from, int g, int align, ExpertGroups& launch) {
  const int32_t begin = from.row_begin[g], count = from.count[g];
  launch.expert.push_back(from.expert[g]);
  launch.row_begin.push_back(static_cast<int32_t>(launch.token.size()));
  launch.count.push_back(count);
  launch.token.insert(launch.token.end(), from.token.begin() + begin, from.token.begin() + begin + count);
  launch.weight.insert(launch.weight.end(), from.weight.begin() + begin, from.weight.begin() + begin + count);
  while (launch.token.size() % align != 0) {
    launch.token.push_back(-1);
    launch.weight.push_back(0.f);
  }
  launch.total_rows = static_cast<int32_t>(launch.token.size());
  launch.total_pairs += count;
}
}  // namespace

// The plan's hits: the cached experts' groups in one launch, which waits for
// no copy; then, after their copies landed, the experts prefetched for this
// call (PlanCall gave them their prefetch buffers as slots) in a launch of
// their own, counted as copied and prefetched and timed as copied experts.
absl::Status LayerDispatcher::RunHits(int ticket) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  const ExpertGroups& hits = m.plan.hits;
  if (hits.num_groups() == 0) return absl::OkStatus();
  bool any = false;
  for (int g = 0; g < hits.num_groups() && !any; ++g) any = m.prefetched_now[hits.expert[g]];
  ctx.stats.hit_pairs = hits.total_pairs;
  if (!any) return backend_->RunExperts(ticket, m.plan.hit_plan());
  const int align = backend_->hit_row_align();
  ExpertGroups &cached = m.one_group, &fetched = m.prefetch_groups;
  ClearGroups(cached);
  ClearGroups(fetched);
  m.launch_buffers.clear();
  m.prefetch_launch_buffers.clear();
  double prior = 0;
  for (int g = 0; g < hits.num_groups(); ++g) {
    if (!m.prefetched_now[hits.expert[g]]) {
      AppendGroup(hits, g, align, cached);
      m.launch_buffers.push_back(m.plan.hit_buffer[g]);
      continue;
    }
    AppendGroup(hits, g, align, fetched);
    m.prefetch_launch_buffers.push_back(m.plan.hit_buffer[g]);
    prior += planner_.rates().CopyDevicePrior(hits.count[g]);
    ctx.stats.hit_pairs -= hits.count[g];
    ctx.stats.copied_pairs += hits.count[g];
    ++ctx.stats.copied_experts;
    ctx.stats.prefetched_pairs += hits.count[g];
    ++ctx.stats.prefetched_experts;
  }
  if (cached.num_groups() > 0)
    MOE_RETURN_IF_ERROR(backend_->RunExperts(ticket, HitPlan{&cached, m.launch_buffers.data()}));
  backend_->ComputeWaitCopy(m.prefetch[ctx.call.batch.layer & 1].last_fence);  // copies land in order
  const uint64_t start = backend_->MarkCompute();
  MOE_RETURN_IF_ERROR(backend_->RunExperts(ticket, HitPlan{&fetched, m.prefetch_launch_buffers.data()}));
  ctx.copy_launches.push_back({start, backend_->MarkCompute(), prior});
  return absl::OkStatus();
}

// Copies the expert of group g of `groups` (of the call's layer) into cache
// buffer `buffer` and computes the group's pairs there.
absl::StatusOr<uint64_t> LayerDispatcher::ComputeCopied(int ticket, const ExpertGroups& groups, int g,
                                                        int buffer) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  const int layer = ctx.call.batch.layer;
  const uint64_t after = backend_->RecordCompute();  // an evicted slot may still be read by earlier calls
  MOE_ASSIGN_OR_RETURN(const uint64_t f, backend_->LoadExpert(buffer, host_->Find(layer, groups.expert[g]), after));
  backend_->ComputeWaitCopy(f);
  ctx.copy_fences.push_back(f);
  ExpertGroups& one = m.one_group;
  ClearGroups(one);
  AppendGroup(groups, g, 1, one);  // the group alone, from row 0 (aligned for any backend)
  MOE_RETURN_IF_ERROR(backend_->RunExperts(ticket, HitPlan{&one, &buffer}));
  ctx.stats.copied_pairs += one.total_pairs;
  ++ctx.stats.copied_experts;
  return f;
}

// The layer parity's temporary buffers split in two halves that launches
// alternate between: a launch computes up to half of them at once, and the
// next launch's copies land in the other half while it runs. One expert per
// launch (before) left most of the device idle: at 128 rows per expert
// (2048-token prompts) the copied experts' compute outlasted their copies,
// and prompts mixing CPU work and copies ran slower than copying everything.
absl::Status LayerDispatcher::ComputeCopiedInBuffers(int ticket, const ExpertGroups& groups,
                                                     const std::vector<int>& gs) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  const int layer = ctx.call.batch.layer, parity = layer & 1, B = config_.miss_buffers;
  const int per_launch = std::max(1, B / 2), halves = B >= 2 ? 2 : 1, align = backend_->hit_row_align();
  ExpertGroups& launch = m.one_group;
  for (size_t i0 = 0; i0 < gs.size(); i0 += per_launch) {
    const size_t i1 = std::min(gs.size(), i0 + per_launch);
    const int first = parity * B + (m.temp_next[parity]++ % halves) * per_launch;  // the half's first buffer
    ClearGroups(launch);
    m.launch_buffers.clear();
    uint64_t last_copy = 0;
    double prior = 0;
    for (size_t i = i0; i < i1; ++i) {
      const int g = gs[i], ti = first + static_cast<int>(i - i0);
      MOE_ASSIGN_OR_RETURN(last_copy, backend_->LoadExpert(m.temp_base + ti, host_->Find(layer, groups.expert[g]),
                                                           m.temp_fence[ti]));
      ctx.copy_fences.push_back(last_copy);
      m.launch_buffers.push_back(m.temp_base + ti);
      AppendGroup(groups, g, align, launch);
      prior += planner_.rates().CopyDevicePrior(groups.count[g]);
    }
    ctx.stats.copied_pairs += launch.total_pairs;
    ctx.stats.copied_experts += static_cast<int>(i1 - i0);
    backend_->ComputeWaitCopy(last_copy);  // copies land in order: the last covers the launch's
    // The launch alone, timed on the compute queue (its start mark passes
    // once the copies landed and the work before it is done).
    const uint64_t start = backend_->MarkCompute();
    MOE_RETURN_IF_ERROR(backend_->RunExperts(ticket, HitPlan{&launch, m.launch_buffers.data()}));
    const uint64_t end = backend_->MarkCompute();
    const uint64_t done = backend_->RecordCompute();
    ctx.copy_launches.push_back({start, end, prior});
    for (size_t i = i0; i < i1; ++i) m.temp_fence[first + static_cast<int>(i - i0)] = done;
  }
  return absl::OkStatus();
}

// Gives back everything a failed call holds; its output is discarded.
void LayerDispatcher::Abort(int ticket) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  ctx.copy_fences.clear();
  ctx.copy_launches.clear();
  for (SentBatch& sh : ctx.sent) {
    if (sh.done.valid()) sh.done.wait();
    if (sh.staged) m.servers[sh.batch.server].transport->Release(sh.stage);
  }
  ctx.sent.clear();
  (void)backend_->FinishCall(ticket, nullptr, ctx.call.kind);
  ctx.busy = false;
}

absl::Status LayerDispatcher::Complete(int ticket, CallStats* out_stats) {
  Impl& m = *impl_;
  if (ticket < 0 || ticket >= static_cast<int>(m.contexts.size()) || !m.contexts[ticket].busy)
    return absl::InvalidArgumentError(absl::StrCat("ticket: ", ticket, " is not a call in flight"));
  InFlightCall& ctx = m.contexts[ticket];
  const Clock::time_point t0 = Clock::now();
  uint64_t last_fence = 0;
  const absl::Status result = AddPartials(ticket, &last_fence);
  // FinishCall waits for all of the call's device work, the reads of the
  // partial sums (AddRows) included: only then are the slots given back (one
  // sync per call instead of two).
  absl::Status fin = backend_->FinishCall(ticket, result.ok() ? ctx.call.out : nullptr, ctx.call.kind);
  if (!fin.ok() && last_fence != 0) (void)backend_->WaitCompute(last_fence);
  // The engine's later work on its stream sees the output.
  if (absl::Status sig = backend_->SignalStream(ctx.call.stream); fin.ok()) fin = sig;
  for (SentBatch& sh : ctx.sent) {
    if (sh.done.valid()) sh.done.wait();  // failed-early calls: nothing may still write
    if (sh.staged) m.servers[sh.batch.server].transport->Release(sh.stage);
    sh.staged = false;
  }
  ctx.sent.clear();
  ctx.busy = false;
  const Clock::time_point end = Clock::now();
  // The copies the call computed from (all done: FinishCall waited for the
  // compute that read them), timed on the copy queue: under load they take
  // longer than the start-up probe's (PCIe and the CPU servers share DRAM).
  for (uint64_t f : ctx.copy_fences) ObserveCopy(f, Seconds(end - ctx.submitted));
  ctx.copy_fences.clear();
  // Their launches, timed on the compute queue: the copied experts' device
  // cost, which the call's end time cannot separate from the link's.
  if (result.ok() && fin.ok())
    for (const InFlightCall::CopyLaunch& l : ctx.copy_launches)
      if (std::optional<double> s = backend_->ComputeSeconds(l.start, l.end))
        planner_.rates().ObserveCopyDevice(l.prior_s, *s);
  ctx.copy_launches.clear();
  // A hits-only call: Submit to here bounds the device time from above.
  if (ctx.device_prior_s > 0 && result.ok() && fin.ok())
    planner_.rates().ObserveDevice(ctx.device_prior_s, Seconds(end - ctx.submitted), true);
  ctx.stats.wait_seconds = Seconds(end - t0);
  if (out_stats != nullptr) *out_stats = ctx.stats;
  if (!result.ok()) return result;
  return fin;
}

// Waits for every sent batch of the call (failing over those whose server
// failed) and adds the servers' partial sums; *last_fence: the fence after
// the last AddRows.
absl::Status LayerDispatcher::AddPartials(int ticket, uint64_t* last_fence) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
  int timed_server = -1;
  for (size_t i = 0; i < ctx.sent.size(); ++i) {
    SentBatch& sh = ctx.sent[i];
    // The first batch a server got in this call is timed for the cost model
    // (later ones queue behind it); one already answered bounds it from above.
    const bool timed = sh.batch.server != timed_server;
    timed_server = sh.batch.server;
    const bool ready = sh.done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    // The transport's completion thread polls in decode; this thread spins
    // only briefly (a core more would compete with the server's pool).
    absl::Status st = AwaitResult(sh.done);
    if (timed && st.ok())
      planner_.rates().ObserveCpu(sh.batch.experts, sh.batch.pairs, Seconds(Clock::now() - sh.sent_at), ready);
    const bf16_t* partial = sh.staged ? sh.stage.output : ctx.recv.data() + sh.host_offset * spec_.hidden;
    if (st.ok()) {
      Server& sv = m.servers[sh.batch.server];
      if (sv.failing) {  // once per state change, as its failure was
        sv.failing = false;
        LogInfo("worker", "servers: ", sv.config.address, " answers again; its misses go to it");
      }
    }
    if (!st.ok()) MOE_RETURN_IF_ERROR(FailOver(ticket, i, std::move(st), &partial));
    if (partial != nullptr && sh.batch.n > 0) {
      MOE_ASSIGN_OR_RETURN(*last_fence, backend_->AddRows(ticket, sh.batch.rows.data(), sh.batch.n, partial));
    }
  }
  return absl::OkStatus();
}

// SentBatch `index` of the call failed with `st`. A server failure
// (UNAVAILABLE / DEADLINE_EXCEEDED / ...) moves it to another server hosting
// every expert of the batch, while the deadline allows, else computes it on
// the device from host copies (copy_fallback), else is UNAVAILABLE; any other
// error (the server rejected the batch: a bug or bad input) is returned as
// is. On OK *partial is the output to add, null when computed on the device.
absl::Status LayerDispatcher::FailOver(int ticket, size_t index, absl::Status st, const bf16_t** partial) {
  Impl& m = *impl_;
  InFlightCall& ctx = m.contexts[ticket];
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
      MOE_RETURN_IF_ERROR(Gather(ticket, sh.batch.rows, dst));
      bf16_t* out = ctx.recv.data() + sh.host_offset * H;
      sh.done = m.servers[next].transport->Submit(GatheredBatch(ctx.call.batch.layer, sh.batch, dst), out,
                                                  ctx.deadline);
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
      MOE_RETURN_IF_ERROR(ComputeServerBatchOnDevice(ticket, sh.batch));
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
absl::Status LayerDispatcher::ComputeServerBatchOnDevice(int ticket, const ServerBatch& b) {
  ExpertGroups& groups = impl_->failover_groups;
  GroupByExpert(RoutingView{b.n, b.k, b.ids.data(), b.weights.data()}, spec_.num_experts, 1, &groups);
  for (int32_t& t : groups.token)
    if (t >= 0) t = b.rows[t];  // batch rows -> the call's tokens
  impl_->copy_groups.resize(groups.num_groups());
  std::iota(impl_->copy_groups.begin(), impl_->copy_groups.end(), 0);
  return ComputeCopiedInBuffers(ticket, groups, impl_->copy_groups);
}

absl::Status LayerDispatcher::Forward(const LayerCall& call, CallStats* stats) {
  if (OnDevicePath(call)) return ForwardOnDevice(call, stats);
  MOE_ASSIGN_OR_RETURN(const int ticket, Submit(call));
  return Complete(ticket, stats);
}

// One path for decode: a decode-shaped call in device memory that fits the
// device's request slots runs as the capturable call does (the split, the
// shipping, copy-instead and the merge on the GPU), not captured; other
// calls, host memory and the cpu backend take the host path (Submit +
// Complete). Decode-shaped: at most kDevicePathPairsPerExpert pairs per
// expert of the layer on average — the device plan prices each missed
// expert as one row and copies at most kMaxDeviceCopies of them, where the
// host planner prices each expert at its rows. Measured on the H100
// (bench/RESULTS.md, stop 19; Qwen3-30B-A3B: 128 experts, top-8; 16 layers,
// no cache, uniform routing), device path / host path, ms per step: bf16
// 8 tokens (0.5 pairs per expert) 59 / 67, 32 tokens (2) 165 / 134, 512
// tokens 268 / 203; int8 8 tokens 33 / 35, 32 tokens 85 / 75.
bool LayerDispatcher::OnDevicePath(const LayerCall& call) const {
  const int64_t pairs = static_cast<int64_t>(call.batch.n) * call.batch.routing.k;
  return config_.eager_on_device && impl_->mapped != nullptr && call.kind == MemoryKind::kDevice &&
         backend_->has_device_memory() && call.batch.n >= 1 && call.batch.n <= CapturableMaxTokens() &&
         call.batch.routing.k >= 1 && call.batch.routing.k <= config_.max_top_k &&
         pairs <= int64_t{kDevicePathPairsPerExpert} * spec_.num_experts &&
         !backend_->StreamCapturing(call.stream != nullptr ? call.stream : LegacyDefaultStream());
}

// The device path of Forward: the capturable call; the call's accesses,
// stats and admissions from the routing the GPU logged (the device's
// counters skip these calls: they are reported here, once); a wait for the
// stream; this layer's errors.
//
// The plan kernel logs the routing before any expert runs, so the
// admissions are planned and their copies started while the call's experts
// run, not after: at decode speed a layer call is about as long as one
// expert copy (OLMoE, H100: 0.3-0.8 ms against 0.25 ms), and copies started
// after the call missed the next layer (bench/RESULTS.md, stop 26). Their
// slots are read by no call in flight but this layer's own, so each layer's
// copies wait only for its last call — unless the engine enqueues
// capturable calls itself (graphs replay them at any time) or a host-path
// call is in flight: then they wait for everything, after the call.
absl::Status LayerDispatcher::ForwardOnDevice(const LayerCall& call, CallStats* stats) {
  Impl& m = *impl_;
  const Clock::time_point t0 = Clock::now();
  PollCopies();
  planner_.CallStarted();
  LayerCall c = call;
  if (c.stream == nullptr) c.stream = LegacyDefaultStream();
  const size_t li = static_cast<size_t>(layer_index_[call.batch.layer]);
  const int32_t before = m.device_ready ? __atomic_load_n(m.device_tables[li].routing_log, __ATOMIC_ACQUIRE) : 0;
  MOE_RETURN_IF_ERROR(EnqueueCapturable(c, /*count_accesses=*/false));
  const Clock::time_point t1 = Clock::now();
  MOE_RETURN_IF_ERROR(backend_->WaitStream(c.stream));
  const uint64_t done = backend_->RecordCompute();
  bool host_calls = false;
  for (const InFlightCall& ctx : m.contexts) host_calls |= ctx.busy;
  m.last_reader[li] = done;
  const bool during = !m.engine_calls && !host_calls && AwaitRoutingLog(li, before, done);
  const int32_t* log = m.device_tables[li].routing_log;
  if (!during) MOE_RETURN_IF_ERROR(backend_->WaitCompute(done));
  const int T = call.batch.n, k = call.batch.routing.k;
  const int32_t* ids = log + kRoutingLogHeader;
  std::vector<int>& experts = m.call_experts;
  std::vector<int>& pairs = m.call_pairs;
  std::vector<int32_t>& count = m.call_count;
  count.resize(spec_.num_experts, 0);
  experts.clear();
  pairs.clear();
  for (int i = 0; i < T * k; ++i)  // the log holds only ids in [-1, E)
    if (const int e = ids[i]; e >= 0 && count[e]++ == 0) experts.push_back(e);
  for (int e : experts) {
    pairs.push_back(count[e]);
    count[e] = 0;
  }
  cache_->RecordAccess(call.batch.layer, experts, pairs);
  if (config_.on_access)
    for (size_t i = 0; i < experts.size(); ++i)
      config_.on_access(call.batch.layer, experts[i], pairs[i], cache_->ReadySlot(call.batch.layer, experts[i]) >= 0);
  if (m.log_seen.size() < layers_.size()) m.log_seen.resize(layers_.size(), 0);
  m.log_seen[li] = log[0];
  // The experts this call copies over the link (copy-instead, the SMs reading
  // through the mapping) are still on it while the call runs: admissions
  // queue behind them.
  if (during) planner_.CopiesQueued(log[6]);
  AdmitAfter(call.batch.layer, T, k, ids, during ? done : 0);
  admissions_during_calls_ += during;
  if (during) MOE_RETURN_IF_ERROR(backend_->WaitCompute(done));
  if (stats != nullptr) {
    *stats = CallStats{};
    stats->hit_pairs = log[3];
    stats->cpu_pairs = log[4];
    stats->copied_pairs = log[5];
    stats->copied_experts = log[6];
    stats->cpu_experts = log[7];
    stats->submit_seconds = Seconds(t1 - t0);
    stats->wait_seconds = Seconds(Clock::now() - t1);
  }
  return TakeLayerError(li);
}

bool LayerDispatcher::AwaitRoutingLog(size_t li, int32_t before, uint64_t done) {
  const int32_t* log = impl_->device_tables[li].routing_log;
  for (uint32_t spin = 0;; ++spin) {
    const int32_t seq = __atomic_load_n(log, __ATOMIC_ACQUIRE);
    if (seq != 0 && seq != before) return true;
    // The call ended (or failed) without logging: the caller waits and reads as before.
    if (spin % 64 == 63 && backend_->ComputeDone(done)) {
      const int32_t last = __atomic_load_n(log, __ATOMIC_ACQUIRE);
      return last != 0 && last != before;
    }
    CpuRelax();
  }
}


// ---------------------------------------------------------------------------
// Capturable calls (device-planned: CUDA graphs and decode).

void LayerDispatcher::PublishSlotMap(int layer) {
  Impl& m = *impl_;
  if (m.device_tables.empty() || layer < 0 || layer >= spec_.num_layers || layer_index_[layer] < 0) return;
  int32_t* buffer_of = m.device_tables[layer_index_[layer]].buffer_of;
  for (int e = 0; e < spec_.num_experts; ++e) {
    const int slot = cache_->ReadySlot(layer, e);
    const int32_t b = !Owns(layer, e) ? kNotThisRank : slot >= 0 ? SlotBuffer(layer, slot) : -1;
    __atomic_store_n(buffer_of + e, b, __ATOMIC_RELEASE);
  }
}

void LayerDispatcher::LeaveGroup() {
  config_.group = ParallelGroup{};
  for (int layer : layers_) PublishSlotMap(layer);
}

// The tables in one host-mapped block: the channels, then per served layer
// buffer_of [E], channel_of [E] and the error records. Allocated at Create
// when the backend has a device (the slot map is published from the start).
absl::Status LayerDispatcher::AllocateDeviceTables() {
  Impl& m = *impl_;
  if (!backend_->has_device_memory()) return absl::OkStatus();
  const size_t E = spec_.num_experts, L = layers_.size();
  const size_t log_pairs = static_cast<size_t>(CapturableMaxTokens()) * config_.max_top_k;
  const size_t per_layer =
      2 * E * sizeof(int32_t) + (1 + kMaxDeviceChannels) * sizeof(DeviceError) +
      (kRoutingLogHeader + log_pairs) * sizeof(int32_t);
  const size_t channel_bytes = kMaxDeviceChannels * sizeof(DeviceChannel) + sizeof(DeviceCopyPlan);
  absl::StatusOr<void*> mem = backend_->AllocMapped(channel_bytes + L * per_layer);
  if (!mem.ok()) return absl::OkStatus();  // no mapped memory: capturable calls are refused by the backend
  m.mapped = *mem;
  auto* p = static_cast<uint8_t*>(m.mapped);
  m.channels = reinterpret_cast<DeviceChannel*>(p);
  m.copy_plan = new (p + kMaxDeviceChannels * sizeof(DeviceChannel)) DeviceCopyPlan();
  p += channel_bytes;
  m.device_tables.resize(L);
  m.last_reader.assign(L, 0);
  for (size_t li = 0; li < L; ++li) {
    DeviceLayerTables& t = m.device_tables[li];
    t.errors = reinterpret_cast<DeviceError*>(p);
    p += (1 + kMaxDeviceChannels) * sizeof(DeviceError);
    t.buffer_of = reinterpret_cast<int32_t*>(p);
    p += E * sizeof(int32_t);
    t.channel_of = reinterpret_cast<int32_t*>(p);
    p += E * sizeof(int32_t);
    t.routing_log = reinterpret_cast<int32_t*>(p);
    t.routing_log_pairs = static_cast<int32_t>(log_pairs);
    p += (kRoutingLogHeader + log_pairs) * sizeof(int32_t);
    for (size_t e = 0; e < E; ++e) t.buffer_of[e] = t.channel_of[e] = -1;
  }
  for (int l : layers_) PublishSlotMap(l);
  return absl::OkStatus();
}

// Points server `index`'s channel at its transport's current segment (an shm
// server after a reconnect gets its new one, registered with the device).
absl::Status LayerDispatcher::PublishChannel(size_t index) {
  Impl& m = *impl_;
  const int c = m.channel_of_server[index];
  Server& sv = m.servers[index];
  if (c < 0 || m.forwarder_of_server[index] >= 0 || sv.transport == nullptr) return absl::OkStatus();
  std::optional<ExpertTransport::DeviceRings> rings = sv.transport->DeviceRingsOf();
  if (!rings || rings->generation == m.channel_generation[index]) return absl::OkStatus();
  void* base = rings->segment.base();
  if (m.channel_base[index] != nullptr && m.channel_base[index] != base) {
    // The old segment (the server reconnected): once no call on the engine's
    // stream can write to it, unregistered and unmapped.
    if (m.planned_stream != nullptr) {
      MOE_RETURN_IF_ERROR(backend_->WaitStream(m.planned_stream));
      MOE_RETURN_IF_ERROR(backend_->WaitCompute(backend_->RecordCompute()));
    }
    backend_->UnregisterHost(m.channel_base[index]);
    sv.transport->ReleaseDeviceSegments();
  }
  if (backend_->DeviceAddress(base) == 0) MOE_RETURN_IF_ERROR(backend_->RegisterHost(base, rings->bytes));
  m.channel_base[index] = base;
  const uint64_t dev = backend_->DeviceAddress(base);
  if (dev == 0) return absl::InternalError(absl::StrCat("servers: ", sv.config.address, ": segment not mapped for the device"));
  rings->segment.SetDevicePoll(config_.poll_window);
  FillChannel(rings->segment, dev, rings->first_slot, rings->slots, static_cast<uint32_t>(rings->generation),
              &m.channels[c]);
  m.channel_generation[index] = rings->generation;
  return m.device_ready ? backend_->SetDeviceChannels(m.channels, m.num_channels) : absl::OkStatus();
}

void LayerDispatcher::FillChannel(const shm::Segment& seg, uint64_t device_base, uint32_t first_slot,
                                  uint32_t slots, uint32_t generation, DeviceChannel* out) {
  const shm::SegmentGeometry& g = seg.geometry();
  DeviceChannel ch;
  ch.submit_ring = g.device_submit_ring_offset;
  ch.complete_ring = g.device_complete_ring_offset;
  ch.doorbell = offsetof(shm::SegmentHeader, request_doorbell);
  ch.slots_offset = g.slots_offset;
  ch.slot_stride = g.slot_stride;
  ch.tokens_offset = g.tokens_offset;
  ch.ids_offset = g.ids_offset;
  ch.weights_offset = g.weights_offset;
  ch.output_offset = g.output_offset;
  ch.num_slots = g.num_slots;
  ch.first_slot = first_slot;
  ch.device_slots = slots;
  ch.max_tokens = g.max_tokens;
  ch.max_pairs = g.max_pairs;
  ch.generation = generation;
  ch.slice_begin = out->slice_begin;  // the server's, set by PublishRoute
  ch.slice_end = out->slice_end;
  ch.base = 0;
  *out = ch;  // the fields first, then the base that turns the channel on
  __atomic_store_n(&out->base, device_base, __ATOMIC_RELEASE);
}

// The first capturable call: one channel per server (an shm server's device
// rings, else a forwarder), the routes published. Not while capturing (it
// registers memory and starts threads); the backend refuses a first call in
// a capture anyway.
absl::Status LayerDispatcher::PrepareDevicePath() {
  Impl& m = *impl_;
  if (m.device_ready) return absl::OkStatus();
  if (m.mapped == nullptr)
    return absl::FailedPreconditionError("capturable calls need the cuda backend (host memory the GPU maps)");
  if (m.servers.size() > static_cast<size_t>(kMaxDeviceChannels))
    return absl::InvalidArgumentError(absl::StrCat("servers: capturable calls reach at most ", kMaxDeviceChannels,
                                                   " servers; this worker has ", m.servers.size()));
  const size_t S = m.servers.size();
  m.channel_of_server.assign(S, -1);
  m.forwarder_of_server.assign(S, -1);
  m.channel_generation.assign(S, 0);
  m.channel_base.assign(S, nullptr);
  for (size_t s = 0; s < S; ++s) {
    Server& sv = m.servers[s];
    m.channel_of_server[s] = m.num_channels++;
    const bool shm = sv.transport != nullptr ? sv.transport->DeviceRingsOf().has_value()
                                             : UnixSocketPath(sv.config.address).has_value();
    if (shm) {
      MOE_RETURN_IF_ERROR(PublishChannel(s));  // an unconnected one once it connects
      continue;
    }
    // A gRPC server: requests through a local segment and a forwarder thread.
    const int k = std::max(config_.max_top_k, 1);
    const shm::SegmentGeometry g = shm::Geometry(spec_.hidden, config_.max_tokens, k, 2);
    auto f = std::make_unique<Forwarder>();
    MOE_ASSIGN_OR_RETURN(f->mem, backend_->AllocMapped(g.total_bytes));
    absl::StatusOr<shm::Segment> seg = shm::Segment::Create(f->mem, g.total_bytes, spec_.hidden, config_.max_tokens, k, 2);
    if (!seg.ok()) {
      backend_->FreeMapped(f->mem);
      return seg.status();
    }
    f->seg = *seg;
    FillChannel(*f->seg, reinterpret_cast<uint64_t>(f->mem), 0, 2, 1, &m.channels[m.channel_of_server[s]]);
    f->route.store(sv.enabled ? sv.transport.get() : nullptr);
    Forwarder* raw = f.get();
    f->thread = std::thread(RunForwarder, raw, spec_.num_experts, spec_.num_layers, config_.deadline,
                            std::chrono::nanoseconds(config_.poll_window));
    m.forwarder_of_server[s] = static_cast<int>(m.forwarders.size());
    m.forwarders.push_back(std::move(f));
  }
  MOE_RETURN_IF_ERROR(backend_->SetDeviceChannels(m.channels, m.num_channels));
  if (m.copy_buffer_base >= 0) {  // copy-instead reads the host copy's experts
    std::vector<const std::byte*> experts(spec_.num_experts);
    for (size_t li = 0; li < layers_.size(); ++li) {
      for (int e = 0; e < spec_.num_experts; ++e) experts[e] = host_->Find(layers_[li], e);
      if (absl::Status st = backend_->SetHostExperts(static_cast<int>(li), experts); !st.ok()) {
        LogWarning("worker", "capturable calls copy nothing instead of computing: ", st.message());
        m.copy_buffer_base = -1;
        break;
      }
    }
  }
  if (m.copy_buffer_base >= 0) {
    absl::StatusOr<double> probe = backend_->ProbeDeviceCopy(host_->Find(layers_.front(), 0));
    m.device_copy_s = probe.ok() ? *probe : 0;
    if (probe.ok()) {
      LogInfo("worker", "capturable calls copy an expert in ", absl::StrFormat("%.3f", *probe * 1e3),
              " ms (SM reads over the link)");
    } else {
      LogWarning("worker", "capturable calls copy nothing instead of computing: ", probe.status().message());
    }
  }
  PublishCopyPlan();
  m.device_ready = true;
  for (size_t s = 0; s < S; ++s) PublishRoute(s);
  return absl::OkStatus();
}

// The most tokens one capturable call may have: every request fits one slot
// (computed once, by CreateCacheAndBackend: the servers do not change).
int LayerDispatcher::CapturableMaxTokens() const { return impl_->capturable_max_tokens; }

absl::Status LayerDispatcher::EnqueueCapturable(const LayerCall& engine_call, bool count_accesses) {
  Impl& m = *impl_;
  LayerCall call = engine_call;
  if (call.stream == nullptr) call.stream = LegacyDefaultStream();  // stream 0, as CUDA reads it
  const MoeBatch& b = call.batch;
  if (b.layer < 0 || b.layer >= spec_.num_layers || layer_index_[b.layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", b.layer, " is not an MoE layer served here"));
  if (call.kind != MemoryKind::kDevice || !backend_->has_device_memory())
    return absl::InvalidArgumentError("memory: capturable calls take device pointers (cuda backend)");
  const int max_tokens = CapturableMaxTokens();
  // A call too large for the device's request slots (a prompt) is not being
  // captured in practice: it runs as a stream-ordered eager call (the host
  // path, where large T belongs). While capturing it cannot.
  if (b.n > max_tokens && b.n <= config_.max_tokens && !backend_->StreamCapturing(call.stream)) return Forward(call);
  if (b.n < 1 || b.n > max_tokens || b.routing.k < 1 || b.routing.k > config_.max_top_k)
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens/top_k: ", b.n, " x ", b.routing.k, " is outside [1, ", max_tokens, "] x [1, ", config_.max_top_k,
        "] (captured, a call's misses must fit one shared-memory request slot per server)"));
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(absl::StrCat("topk_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (!m.device_ready && backend_->StreamCapturing(call.stream))
    return absl::FailedPreconditionError(absl::StrCat(
        "capturable call: layer ", b.layer, " was never run outside a capture (warm up once before capturing)"));
  MOE_RETURN_IF_ERROR(PrepareDevicePath());
  m.engine_calls |= count_accesses;  // the engine's own call (ForwardOnDevice counts its accesses itself)
  // A reconnected shm server's new segment (not while the engine captures:
  // registering memory is not capture-safe; the next call outside does it).
  for (size_t s = 0; s < m.servers.size(); ++s) {
    Server& sv = m.servers[s];
    if (m.forwarder_of_server[s] >= 0 || sv.transport == nullptr) continue;
    if (sv.transport->Generation() != m.channel_generation[s] && !backend_->StreamCapturing(call.stream))
      MOE_RETURN_IF_ERROR(PublishChannel(s));
  }
  m.planned_stream = call.stream;
  DevicePlannedCall dc;
  dc.site = layer_index_[b.layer];
  dc.layer = b.layer;
  dc.T = b.n;
  dc.k = b.routing.k;
  dc.hidden = b.tokens;
  dc.ids = b.routing.ids;
  dc.weights = b.routing.weights;
  dc.out = call.out;
  dc.stream = call.stream;
  dc.tables = m.device_tables[layer_index_[b.layer]];
  dc.num_channels = m.num_channels;
  dc.timeout = call.deadline.count() > 0 ? call.deadline : config_.deadline;
  dc.count_accesses = count_accesses;
  if (m.copy_buffer_base >= 0) {
    dc.copy_plan = m.copy_plan;
    dc.copy_buffer_base = m.copy_buffer_base;
  }
  return backend_->EnqueueDevicePlanned(dc);
}

absl::Status LayerDispatcher::TakeStreamError() {
  CollectDeviceAccesses();
  absl::Status first;
  for (size_t li = 0; li < impl_->device_tables.size(); ++li) {
    absl::Status st = TakeLayerError(li);
    if (first.ok()) first = std::move(st);
  }
  RefreshDeviceServers();
  PublishCopyPlan();
  PlanDeviceAdmissions();
  return first;
}

// The error records of served layer `li`'s device-planned calls (the split's
// and each channel's), cleared; the first as a Status naming the layer and
// what failed (a channel's: the server's own message, or the timeout).
absl::Status LayerDispatcher::TakeLayerError(size_t li) {
  Impl& m = *impl_;
  absl::Status first;
  for (int w = 0; w <= kMaxDeviceChannels; ++w) {
    DeviceError& e = m.device_tables[li].errors[w];
    const int32_t code = __atomic_load_n(&e.code, __ATOMIC_ACQUIRE);
    if (code == 0) continue;
    const int layer = e.layer, detail = e.detail;
    __atomic_store_n(&e.code, 0, __ATOMIC_RELEASE);
    if (!first.ok()) continue;
    const absl::StatusCode sc = StatusCodeFromWire(code, absl::StatusCode::kInternal);
    if (w == 0) {
      first = absl::Status(sc, sc == absl::StatusCode::kInvalidArgument
                                   ? absl::StrCat("capturable call, layer ", layer, ": topk_ids/topk_weights: expert ",
                                                  detail, " out of range or a weight not finite")
                               : sc == absl::StatusCode::kUnavailable && detail >= 0
                                   ? absl::StrCat("capturable call, layer ", layer,
                                                  ": no connected, enabled server hosts expert ", detail)
                                   : absl::StrCat("capturable call, layer ", layer, ": a server's request (channel ",
                                                  -1 - detail, ") could not be sent: ", absl::StatusCodeToString(sc)));
      continue;
    }
    size_t server = 0;
    while (server < m.servers.size() && m.channel_of_server[server] != w - 1) ++server;
    const std::string address = server < m.servers.size() ? m.servers[server].config.address : "?";
    if (detail == -2) {  // no answer, but the device computed the request from the host copy: right, and slow
      LogWarning("worker", "capturable call, layer ", layer, ", server ", address, ": no answer within ",
                 config_.deadline.count(), " ms; its misses were computed on the device from the host copy");
      continue;
    }
    std::string why = detail < 0 ? absl::StrCat("no answer within ", config_.deadline.count(), " ms") : "";
    if (detail >= 0 && server < m.servers.size()) {
      std::optional<shm::Segment> seg;
      if (const int f = m.forwarder_of_server[server]; f >= 0) {
        seg = m.forwarders[f]->seg;
      } else if (auto rings = m.servers[server].transport->DeviceRingsOf()) {
        seg = rings->segment;
      }
      shm::ValidatedResponse resp;
      if (seg && shm::ValidateResponseSlot(*seg, static_cast<uint32_t>(detail), &resp).ok())
        why = std::string(resp.status.message());
    }
    first = absl::Status(sc, absl::StrCat("capturable call, layer ", layer, ", server ", address, ": ", why));
  }
  return first;
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

// Copy-instead for capturable calls: for each number m of missed experts,
// how many the device takes — the planner's own decision (ChooseCopies) for
// m experts of one row each (decode), with the link priced at what the
// device-planned copy really costs (the SMs reading through the mapping,
// probed once: slower than the copy engine the eager path's rate measures).
// copy_mode never, no measured rates or no probe: none; always: every
// missed expert up to kMaxDeviceCopies.
void LayerDispatcher::PublishCopyPlan() {
  Impl& m = *impl_;
  if (m.copy_plan == nullptr) return;
  CostModel model = planner_.rates();
  const bool priced = model.measured && m.device_copy_s > 0;
  if (priced) {
    model.copy_s = m.device_copy_s;
    model.copy = OnlineScale();
  }
  for (int missed = 0; missed < kDeviceCopyTable; ++missed) {
    int n = 0;
    if (config_.copy_mode == CopyMode::kAlways) {
      n = std::min(missed, kMaxDeviceCopies);
    } else if (config_.copy_mode == CopyMode::kAuto && priced && missed > 0) {
      std::vector<CopyCandidate> candidates(missed);
      for (int i = 0; i < missed; ++i) candidates[i] = CopyCandidate{i, 1};
      model.calls_without_cpu_sample = 0;  // the table is not a call: no exploration
      n = std::min(static_cast<int>(ChooseCopies(model, candidates, 0).size()), kMaxDeviceCopies);
    }
    __atomic_store_n(&m.copy_plan->copy_count[missed], n, __ATOMIC_RELAXED);
  }
}

// Capturable calls: an shm server that went away is reconnected (its new
// segment published to the GPU) or, while it stays down, left out of the
// routes, so calls fail at once (or go to a replica) instead of waiting out
// the deadline on a segment nobody serves. Not while the engine captures
// (registering memory is not capture-safe).
void LayerDispatcher::RefreshDeviceServers() {
  Impl& m = *impl_;
  if (!m.device_ready || backend_->StreamCapturing(m.planned_stream)) return;
  const Clock::time_point now = Clock::now();
  for (size_t s = 0; s < m.servers.size(); ++s) {
    Server& sv = m.servers[s];
    if (m.forwarder_of_server[s] >= 0 || sv.transport == nullptr) continue;
    const bool was_dead = sv.device_dead;
    if (sv.device_dead && sv.down_until > now) continue;
    sv.device_dead = !sv.transport->Reconnect().ok() || !PublishChannel(s).ok();
    if (sv.device_dead) sv.down_until = now + config_.server_retry;
    if (sv.device_dead != was_dead) PublishRoute(s);
  }
}

// Popularity from device-planned calls (graph replays included): the routed
// pairs the GPU counted since the last look, reported as the eager path
// reports its own (ExpertCache::RecordAccess, on_access: the coordinator).
void LayerDispatcher::CollectDeviceAccesses() {
  Impl& m = *impl_;
  // Not while the engine captures: a synchronous copy would end its capture.
  if (!m.device_ready || backend_->StreamCapturing(m.planned_stream)) return;
  std::vector<uint32_t> counts;
  const size_t E = spec_.num_experts, L = layers_.size();
  if (!backend_->ReadAccessCounts(&counts).ok() || counts.size() != L * E) return;
  m.counts_seen.resize(L * E, 0);
  std::vector<int> experts, pairs;
  for (size_t li = 0; li < L; ++li) {
    experts.clear();
    pairs.clear();
    for (size_t e = 0; e < E; ++e) {
      const uint32_t delta = counts[li * E + e] - m.counts_seen[li * E + e];  // wraps correctly
      m.counts_seen[li * E + e] = counts[li * E + e];
      if (delta == 0) continue;
      experts.push_back(static_cast<int>(e));
      pairs.push_back(static_cast<int>(std::min<uint32_t>(delta, 1u << 30)));
    }
    if (experts.empty()) continue;
    const int layer = layers_[li];
    cache_->RecordAccess(layer, experts, pairs);
    if (config_.on_access)
      for (size_t i = 0; i < experts.size(); ++i)
        config_.on_access(layer, experts[i], pairs[i], cache_->ReadySlot(layer, experts[i]) >= 0);
  }
}

}  // namespace moe
