// LayerDispatcher's device path: Forward, the device-planned calls
// (EnqueueCapturable, eager ForwardOnDevice), the host-mapped tables the GPU
// reads (slot map, routes, channels, copy plan), their errors and accesses,
// and the forwarder threads of gRPC servers.
#include <pthread.h>
#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cpu_relax.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu_worker/dispatcher_internal.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

// A Forwarder's thread (dispatcher_internal.h): the GPU's requests to a gRPC
// server, each given `deadline` (the server deadline). A request it misses is
// answered UNAVAILABLE (the GPU computes it from the host copy); so are the
// requests after it, at once, until the server answers a probe
// (ExpertTransport::Probe) — not each sent into the silence and waited out.
void RunForwarder(Forwarder* f, int num_experts, int num_layers, std::chrono::milliseconds deadline,
                  std::chrono::nanoseconds poll) {
  pthread_setname_np(pthread_self(), "moe-forwarder");
  const shm::Segment& seg = *f->seg;
  shm::ValidatedRequest req;
  Clock::time_point last = Clock::now();
  bool silent = false;
  const auto probe_timeout = std::min<std::chrono::milliseconds>(deadline, std::chrono::seconds(1));
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
      } else if (silent && !t->Probe(probe_timeout).ok()) {
        st = absl::UnavailableError("the server missed a deadline and has not answered a probe since");
      } else {
        const MoeBatch b{static_cast<int>(req.layer), req.n_tokens, slot.tokens, req.routing()};
        std::future<absl::Status> done = t->Submit(b, slot.output, Clock::now() + deadline);
        st = AwaitResult(done);
        silent = absl::IsDeadlineExceeded(st);
      }
    }
    shm::WriteResponseStatus(slot, st);
    seg.TryPushDeviceComplete(*idx);
  }
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
// (Qwen3-30B-A3B: 128 experts, top-8; 16 layers,
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
// after the call missed the next layer. Their
// slots are read by no call in flight but this layer's own, so each layer's
// copies wait only for its last call — unless the engine enqueues
// capturable calls itself (graphs replay them at any time) or a host-path
// call is in flight: then they wait for everything, after the call.
absl::Status LayerDispatcher::ForwardOnDevice(const LayerCall& call, CallStats* stats) {
  Impl& m = *impl_;
  const Clock::time_point t0 = Clock::now();
  PollCopies();
  // Cache copies on the link beside this call (still in flight, or started during it below).
  const bool copies_before = !m.pending.empty();
  const uint64_t started_before = copies_started_;
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
  const double took = Seconds(Clock::now() - t0);
  const int missed = log[6] + log[7];
  // What cache copies beside the call cost it (the admissions' price of a copy).
  planner_.rates().overlap.Observe(CopyOverlap::Shape(T, missed), copies_before || copies_started_ != started_before,
                                   took);
  // A call the model would have copied for: its time, for its shape (the
  // table for that shape was what PublishCopyCount last wrote).
  if (config_.copy_mode == CopyMode::kAuto && m.copy_plan != nullptr && missed > 0 && missed < kDeviceCopyTable &&
      m.model_copies[missed] > 0) {
    CopyOutcomes& outcomes = planner_.device_outcomes();
    const int bucket = CopyOutcomes::DeviceBucket(missed);
    const CopyChoice choice = outcomes.Choose(bucket);
    outcomes.Observe(bucket, choice, took);
    for (int n = 1; n < kDeviceCopyTable; ++n)
      if (CopyOutcomes::DeviceBucket(n) == bucket) PublishCopyCount(n);
  }
  if (stats != nullptr) {
    *stats = LoggedStats(log);
    stats->submit_seconds = Seconds(t1 - t0);
    stats->wait_seconds = Seconds(Clock::now() - t1);
  }
  return TakeLayerError(li);
}

// The split a device-planned call logged (routing_log's header).
CallStats LayerDispatcher::LoggedStats(const int32_t* log) {
  CallStats stats;
  stats.hit_pairs = log[3];
  stats.cpu_pairs = log[4];
  stats.copied_pairs = log[5];
  stats.copied_experts = log[6];
  stats.cpu_experts = log[7];
  return stats;
}

absl::StatusOr<CallStats> LayerDispatcher::LastDeviceCall(int layer) const {
  const Impl& m = *impl_;
  if (layer < 0 || layer >= spec_.num_layers || layer_index_[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not served"));
  if (!m.device_ready) return absl::FailedPreconditionError("no device-planned call has run");
  const int32_t* log = m.device_tables[layer_index_[layer]].routing_log;
  const int32_t seq = __atomic_load_n(log, __ATOMIC_ACQUIRE);
  if (seq == 0) return absl::FailedPreconditionError(absl::StrCat("layer ", layer, ": no call logged yet"));
  CallStats stats = LoggedStats(log);
  if (__atomic_load_n(log, __ATOMIC_ACQUIRE) != seq)
    return absl::UnavailableError(absl::StrCat("layer ", layer, ": its log is being rewritten"));
  return stats;
}

bool LayerDispatcher::AwaitRoutingLog(size_t li, int32_t before, uint64_t done) {
  const int32_t* log = impl_->device_tables[li].routing_log;
  SpinYielder yielder;  // the engine's other threads (another rank's) may share this CPU
  for (uint32_t spin = 0;; ++spin) {
    const int32_t seq = __atomic_load_n(log, __ATOMIC_ACQUIRE);
    if (seq != 0 && seq != before) return true;
    // The call ended (or failed) without logging: the caller waits and reads as before.
    if (spin % 64 == 63) {
      if (backend_->ComputeDone(done)) {
        const int32_t last = __atomic_load_n(log, __ATOMIC_ACQUIRE);
        return last != 0 && last != before;
      }
      yielder.Tick(Clock::now());
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
    f->thread = std::thread(RunForwarder, raw, spec_.num_experts, spec_.num_layers,
                            std::min(config_.server_deadline, config_.deadline),
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
      // Every layer of every replay while a server is silent: once a second per server.
      if (server < m.servers.size()) {
        Server& sv = m.servers[server];
        const Clock::time_point now = Clock::now();
        if (now - sv.recompute_warned < std::chrono::seconds(1)) {
          ++sv.recompute_unwarned;
          continue;
        }
        sv.recompute_warned = now;
      }
      const uint64_t more = server < m.servers.size() ? std::exchange(m.servers[server].recompute_unwarned, 0) : 0;
      LogWarning("worker", "capturable call, layer ", layer, ", server ", address, ": no answer (",
                 absl::StatusCodeToString(sc), ", waited at most ", config_.deadline.count(),
                 " ms); its misses were computed on the device from the host copy",
                 more > 0 ? absl::StrCat(" (and ", more, " more such layer calls since the last warning)") : "");
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
    m.model_copies[missed] = n;
    PublishCopyCount(missed);
  }
}

// The device plan's copies for calls missing `missed` experts: the model's,
// unless the outcomes of eager device-path calls of that shape (timed in
// ForwardOnDevice) say the CPU alone was faster.
void LayerDispatcher::PublishCopyCount(int missed) {
  Impl& m = *impl_;
  const int model = m.model_copies[missed];
  const bool cpu = config_.copy_mode == CopyMode::kAuto && model > 0 &&
                   planner_.device_outcomes().Peek(CopyOutcomes::DeviceBucket(missed)) == CopyChoice::kCpu;
  __atomic_store_n(&m.copy_plan->copy_count[missed], cpu ? 0 : model, __ATOMIC_RELAXED);
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
