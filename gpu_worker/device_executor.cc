// DeviceExecutor (device_executor.h): the device-planned calls (enqueued,
// and eager on Forward's device path), the host-mapped tables the GPU reads
// (slot map, routes, channels, copy plan), their errors and accesses, the
// admissions of capturable calls, and the forwarder threads of gRPC servers.
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
#include "gpu_worker/device_executor.h"

namespace moe {

// A Forwarder's thread (device_executor.h): the GPU's requests to a gRPC
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

DeviceExecutor::~DeviceExecutor() {
  // Capturable calls (and their graphs' replays) still running use these
  // tables. The engine's stream may be gone by now: wait for the whole
  // device instead of recording on it.
  if (planned_stream_ != nullptr) (void)ctx_.backend->SynchronizeDevice();
  for (auto& f : forwarders_) {
    f->stop.store(true);
    if (f->thread.joinable()) f->thread.join();
    ctx_.backend->FreeMapped(f->mem);
  }
  if (mapped_ != nullptr) ctx_.backend->FreeMapped(mapped_);
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
bool DeviceExecutor::Takes(const LayerCall& call) const {
  const int64_t pairs = static_cast<int64_t>(call.batch.n) * call.batch.routing.k;
  return ctx_.config.eager_on_device && mapped_ != nullptr && call.kind == MemoryKind::kDevice &&
         ctx_.backend->has_device_memory() && call.batch.n >= 1 && call.batch.n <= ctx_.capturable_max_tokens &&
         call.batch.routing.k >= 1 && call.batch.routing.k <= ctx_.config.max_top_k &&
         pairs <= int64_t{kDevicePathPairsPerExpert} * ctx_.spec.num_experts &&
         !ctx_.backend->StreamCapturing(call.stream != nullptr ? call.stream : LegacyDefaultStream());
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
absl::Status DeviceExecutor::Forward(const LayerCall& call, CallStats* stats, CacheCopies& copies, bool host_calls) {
  const Clock::time_point t0 = Clock::now();
  copies.Poll();
  // Cache copies on the link beside this call (still in flight, or started during it below).
  const bool copies_before = copies.any_in_flight();
  const uint64_t started_before = copies.copies_started();
  ctx_.planner.CallStarted();
  LayerCall c = call;
  if (c.stream == nullptr) c.stream = LegacyDefaultStream();
  const size_t li = static_cast<size_t>(ctx_.layer_index[call.batch.layer]);
  const int32_t before = ready_ ? __atomic_load_n(tables_[li].routing_log, __ATOMIC_ACQUIRE) : 0;
  MOE_RETURN_IF_ERROR(Enqueue(c, /*count_accesses=*/false));
  const Clock::time_point t1 = Clock::now();
  MOE_RETURN_IF_ERROR(ctx_.backend->WaitStream(c.stream));
  const uint64_t done = ctx_.backend->RecordCompute();
  last_reader_[li] = done;
  const bool during = !engine_calls_ && !host_calls && AwaitRoutingLog(li, before, done);
  const int32_t* log = tables_[li].routing_log;
  if (!during) MOE_RETURN_IF_ERROR(ctx_.backend->WaitCompute(done));
  const int T = call.batch.n, k = call.batch.routing.k;
  const int32_t* ids = log + kRoutingLogHeader;
  RecordLoggedAccesses(call.batch.layer, ids, T * k);
  if (log_seen_.size() < ctx_.layers.size()) log_seen_.resize(ctx_.layers.size(), 0);
  log_seen_[li] = log[0];
  // The experts this call copies over the link (copy-instead, the SMs reading
  // through the mapping) are still on it while the call runs: admissions
  // queue behind them.
  if (during) ctx_.planner.CopiesQueued(log[6]);
  copies.AfterDeviceCall(call.batch.layer, T, k, ids, during ? done : 0);
  admissions_during_calls_ += during;
  if (during) MOE_RETURN_IF_ERROR(ctx_.backend->WaitCompute(done));
  const double took = Seconds(Clock::now() - t0);
  ObserveOutcome(T, log[6] + log[7], copies_before || copies.copies_started() != started_before, took);
  if (stats != nullptr) {
    *stats = LoggedStats(log);
    stats->submit_seconds = Seconds(t1 - t0);
    stats->wait_seconds = Seconds(Clock::now() - t1);
  }
  return TakeLayerError(li);
}

// The accesses of a device-path call from its logged routing (`pairs` ids
// in [-1, E)): the cache's counters and on_access.
void DeviceExecutor::RecordLoggedAccesses(int layer, const int32_t* ids, int pairs) {
  std::vector<int>& experts = call_experts_;
  std::vector<int>& counts = call_pairs_;
  call_count_.resize(ctx_.spec.num_experts, 0);
  experts.clear();
  counts.clear();
  for (int i = 0; i < pairs; ++i)
    if (const int e = ids[i]; e >= 0 && call_count_[e]++ == 0) experts.push_back(e);
  for (int e : experts) {
    counts.push_back(call_count_[e]);
    call_count_[e] = 0;
  }
  ctx_.cache->RecordAccess(layer, experts, counts);
  if (ctx_.config.on_access)
    for (size_t i = 0; i < experts.size(); ++i)
      ctx_.config.on_access(layer, experts[i], counts[i], ctx_.cache->ReadySlot(layer, experts[i]) >= 0);
}

// What a device-path call of T tokens missing `missed` experts teaches the
// planner: what cache copies beside it cost (the admissions' price of a
// copy), and — a call the model would have copied for — its time for its
// shape (the table for that shape was what PublishCopyCount last wrote).
void DeviceExecutor::ObserveOutcome(int T, int missed, bool beside_copies, double took) {
  ctx_.planner.rates().overlap.Observe(CopyOverlap::Shape(T, missed), beside_copies, took);
  if (ctx_.config.copy_mode != CopyMode::kAuto || copy_plan_ == nullptr || missed <= 0 ||
      missed >= kDeviceCopyTable || model_copies_[missed] <= 0)
    return;
  CopyOutcomes& outcomes = ctx_.planner.device_outcomes();
  const int bucket = CopyOutcomes::DeviceBucket(missed);
  outcomes.Observe(bucket, outcomes.Choose(bucket), took);
  for (int n = 1; n < kDeviceCopyTable; ++n)
    if (CopyOutcomes::DeviceBucket(n) == bucket) PublishCopyCount(n);
}

CapturedCalls DeviceExecutor::TakeCapturedCalls() {
  CapturedCalls c;
  // Not while the engine captures: a synchronous copy would end its capture.
  std::vector<uint64_t> totals;
  if (!ready_ || ctx_.backend->StreamCapturing(planned_stream_) || !ctx_.backend->ReadCallTotals(&totals).ok())
    return c;
  totals_seen_.resize(totals.size(), 0);
  uint64_t* sums[kDeviceTotals] = {&c.calls, &c.hit_pairs, &c.cpu_pairs, &c.copied_pairs};
  for (size_t i = 0; i < totals.size(); ++i) {
    *sums[i % kDeviceTotals] += totals[i] - totals_seen_[i];  // what the GPU added since the last look
    totals_seen_[i] = totals[i];
  }
  return c;
}

// The split a device-planned call logged (routing_log's header).
CallStats DeviceExecutor::LoggedStats(const int32_t* log) {
  CallStats stats;
  stats.hit_pairs = log[3];
  stats.cpu_pairs = log[4];
  stats.copied_pairs = log[5];
  stats.copied_experts = log[6];
  stats.cpu_experts = log[7];
  return stats;
}

absl::StatusOr<CallStats> DeviceExecutor::LastCall(int layer) const {
  if (layer < 0 || layer >= ctx_.spec.num_layers || ctx_.layer_index[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not served"));
  if (!ready_) return absl::FailedPreconditionError("no device-planned call has run");
  const int32_t* log = tables_[ctx_.layer_index[layer]].routing_log;
  const int32_t seq = __atomic_load_n(log, __ATOMIC_ACQUIRE);
  if (seq == 0) return absl::FailedPreconditionError(absl::StrCat("layer ", layer, ": no call logged yet"));
  CallStats stats = LoggedStats(log);
  if (__atomic_load_n(log, __ATOMIC_ACQUIRE) != seq)
    return absl::UnavailableError(absl::StrCat("layer ", layer, ": its log is being rewritten"));
  return stats;
}

bool DeviceExecutor::AwaitRoutingLog(size_t li, int32_t before, uint64_t done) {
  const int32_t* log = tables_[li].routing_log;
  SpinYielder yielder;  // the engine's other threads (another rank's) may share this CPU
  for (uint32_t spin = 0;; ++spin) {
    const int32_t seq = __atomic_load_n(log, __ATOMIC_ACQUIRE);
    if (seq != 0 && seq != before) return true;
    // The call ended (or failed) without logging: the caller waits and reads as before.
    if (spin % 64 == 63) {
      if (ctx_.backend->ComputeDone(done)) {
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

void DeviceExecutor::PublishSlotMap(int layer) {
  if (tables_.empty() || layer < 0 || layer >= ctx_.spec.num_layers || ctx_.layer_index[layer] < 0) return;
  int32_t* buffer_of = tables_[ctx_.layer_index[layer]].buffer_of;
  for (int e = 0; e < ctx_.spec.num_experts; ++e) {
    const int slot = ctx_.cache->ReadySlot(layer, e);
    const int32_t b = !ctx_.Owns(layer, e) ? kNotThisRank : slot >= 0 ? ctx_.SlotBuffer(layer, slot) : -1;
    __atomic_store_n(buffer_of + e, b, __ATOMIC_RELEASE);
  }
}

void DeviceExecutor::PublishSlotMaps() {
  for (int layer : ctx_.layers) PublishSlotMap(layer);
}

// Capturable calls already enqueued on the engine's stream may read a slot
// being replaced: a copy waits for them — during an eager device-path call
// (its admissions), only for the layer's last reader, after which nothing
// reads its slots.
absl::StatusOr<uint64_t> DeviceExecutor::CopyAfter(int layer, bool during_call) {
  if (during_call) return last_reader_[ctx_.layer_index[layer]];
  if (planned_stream_ != nullptr) MOE_RETURN_IF_ERROR(ctx_.backend->WaitStream(planned_stream_));
  return ctx_.backend->RecordCompute();
}

// The tables in one host-mapped block: the channels, then per served layer
// buffer_of [E], channel_of [E], the error records and the routing log. Allocated at Create
// when the backend has a device (the slot map is published from the start).
absl::Status DeviceExecutor::AllocateTables() {
  if (!ctx_.backend->has_device_memory()) return absl::OkStatus();
  const size_t E = ctx_.spec.num_experts, L = ctx_.layers.size();
  const size_t log_pairs = static_cast<size_t>(ctx_.capturable_max_tokens) * ctx_.config.max_top_k;
  const size_t per_layer =
      2 * E * sizeof(int32_t) + (1 + kMaxDeviceChannels) * sizeof(DeviceError) +
      (kRoutingLogHeader + log_pairs) * sizeof(int32_t);
  const size_t channel_bytes = kMaxDeviceChannels * sizeof(DeviceChannel) + sizeof(DeviceCopyPlan);
  absl::StatusOr<void*> mem = ctx_.backend->AllocMapped(channel_bytes + L * per_layer);
  if (!mem.ok()) return absl::OkStatus();  // no mapped memory: capturable calls are refused by the backend
  mapped_ = *mem;
  auto* p = static_cast<uint8_t*>(mapped_);
  channels_ = reinterpret_cast<DeviceChannel*>(p);
  copy_plan_ = new (p + kMaxDeviceChannels * sizeof(DeviceChannel)) DeviceCopyPlan();
  p += channel_bytes;
  tables_.resize(L);
  last_reader_.assign(L, 0);
  for (size_t li = 0; li < L; ++li) {
    DeviceLayerTables& t = tables_[li];
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
  PublishSlotMaps();
  return absl::OkStatus();
}

// Points server `index`'s channel at its transport's current segment (an shm
// server after a reconnect gets its new one, registered with the device).
absl::Status DeviceExecutor::PublishChannel(size_t index) {
  const int c = channel_of_server_[index];
  Server& sv = servers_.at(index);
  if (c < 0 || forwarder_of_server_[index] >= 0 || sv.transport == nullptr) return absl::OkStatus();
  std::optional<ExpertTransport::DeviceRings> rings = sv.transport->DeviceRingsOf();
  if (!rings || rings->generation == channel_generation_[index]) return absl::OkStatus();
  void* base = rings->segment.base();
  if (channel_base_[index] != nullptr && channel_base_[index] != base) {
    // The old segment (the server reconnected): once no call on the engine's
    // stream can write to it, unregistered and unmapped.
    if (planned_stream_ != nullptr) {
      MOE_RETURN_IF_ERROR(ctx_.backend->WaitStream(planned_stream_));
      MOE_RETURN_IF_ERROR(ctx_.backend->WaitCompute(ctx_.backend->RecordCompute()));
    }
    ctx_.backend->UnregisterHost(channel_base_[index]);
    sv.transport->ReleaseDeviceSegments();
  }
  if (ctx_.backend->DeviceAddress(base) == 0) MOE_RETURN_IF_ERROR(ctx_.backend->RegisterHost(base, rings->bytes));
  channel_base_[index] = base;
  const uint64_t dev = ctx_.backend->DeviceAddress(base);
  if (dev == 0) return absl::InternalError(absl::StrCat("servers: ", sv.config.address, ": segment not mapped for the device"));
  rings->segment.SetDevicePoll(ctx_.config.poll_window);
  FillChannel(rings->segment, dev, rings->first_slot, rings->slots, static_cast<uint32_t>(rings->generation),
              &channels_[c]);
  channel_generation_[index] = rings->generation;
  return ready_ ? ctx_.backend->SetDeviceChannels(channels_, num_channels_) : absl::OkStatus();
}

void DeviceExecutor::FillChannel(const shm::Segment& seg, uint64_t device_base, uint32_t first_slot,
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
absl::Status DeviceExecutor::PrepareDevicePath() {
  if (ready_) return absl::OkStatus();
  if (mapped_ == nullptr)
    return absl::FailedPreconditionError("capturable calls need the cuda backend (host memory the GPU maps)");
  if (servers_.size() > static_cast<size_t>(kMaxDeviceChannels))
    return absl::InvalidArgumentError(absl::StrCat("servers: capturable calls reach at most ", kMaxDeviceChannels,
                                                   " servers; this worker has ", servers_.size()));
  const size_t S = servers_.size();
  channel_of_server_.assign(S, -1);
  forwarder_of_server_.assign(S, -1);
  channel_generation_.assign(S, 0);
  channel_base_.assign(S, nullptr);
  for (size_t s = 0; s < S; ++s) {
    Server& sv = servers_.at(s);
    channel_of_server_[s] = num_channels_++;
    const bool shm = sv.transport != nullptr ? sv.transport->DeviceRingsOf().has_value()
                                             : UnixSocketPath(sv.config.address).has_value();
    if (shm) {
      MOE_RETURN_IF_ERROR(PublishChannel(s));  // an unconnected one once it connects
      continue;
    }
    // A gRPC server: requests through a local segment and a forwarder thread.
    const int k = std::max(ctx_.config.max_top_k, 1);
    const shm::SegmentGeometry g = shm::Geometry(ctx_.spec.hidden, ctx_.config.max_tokens, k, 2);
    auto f = std::make_unique<Forwarder>();
    MOE_ASSIGN_OR_RETURN(f->mem, ctx_.backend->AllocMapped(g.total_bytes));
    absl::StatusOr<shm::Segment> seg = shm::Segment::Create(f->mem, g.total_bytes, ctx_.spec.hidden, ctx_.config.max_tokens, k, 2);
    if (!seg.ok()) {
      ctx_.backend->FreeMapped(f->mem);
      return seg.status();
    }
    f->seg = *seg;
    FillChannel(*f->seg, reinterpret_cast<uint64_t>(f->mem), 0, 2, 1, &channels_[channel_of_server_[s]]);
    f->route.store(sv.enabled ? sv.transport.get() : nullptr);
    Forwarder* raw = f.get();
    f->thread = std::thread(RunForwarder, raw, ctx_.spec.num_experts, ctx_.spec.num_layers,
                            std::min(ctx_.config.server_deadline, ctx_.config.deadline),
                            std::chrono::nanoseconds(ctx_.config.poll_window));
    forwarder_of_server_[s] = static_cast<int>(forwarders_.size());
    forwarders_.push_back(std::move(f));
  }
  MOE_RETURN_IF_ERROR(ctx_.backend->SetDeviceChannels(channels_, num_channels_));
  if (copy_buffer_base_ >= 0) {  // copy-instead reads the host copy's experts
    std::vector<const std::byte*> experts(ctx_.spec.num_experts);
    for (size_t li = 0; li < ctx_.layers.size(); ++li) {
      for (int e = 0; e < ctx_.spec.num_experts; ++e) experts[e] = ctx_.host->Find(ctx_.layers[li], e);
      if (absl::Status st = ctx_.backend->SetHostExperts(static_cast<int>(li), experts); !st.ok()) {
        LogWarning("worker", "capturable calls copy nothing instead of computing: ", st.message());
        copy_buffer_base_ = -1;
        break;
      }
    }
  }
  if (copy_buffer_base_ >= 0) {
    absl::StatusOr<double> probe = ctx_.backend->ProbeDeviceCopy(ctx_.host->Find(ctx_.layers.front(), 0));
    device_copy_s_ = probe.ok() ? *probe : 0;
    if (probe.ok()) {
      LogInfo("worker", "capturable calls copy an expert in ", absl::StrFormat("%.3f", *probe * 1e3),
              " ms (SM reads over the link)");
    } else {
      LogWarning("worker", "capturable calls copy nothing instead of computing: ", probe.status().message());
    }
  }
  PublishCopyPlan();
  ready_ = true;
  for (size_t s = 0; s < S; ++s) PublishRoute(s);
  return absl::OkStatus();
}

bool DeviceExecutor::LeavesToHost(const LayerCall& call) const {
  const MoeBatch& b = call.batch;
  return ctx_.Serves(b.layer) && call.kind == MemoryKind::kDevice && ctx_.backend->has_device_memory() &&
         b.n > ctx_.capturable_max_tokens && b.n <= ctx_.config.max_tokens &&
         !ctx_.backend->StreamCapturing(call.stream != nullptr ? call.stream : LegacyDefaultStream());
}

absl::Status DeviceExecutor::Enqueue(const LayerCall& engine_call, bool count_accesses) {
  LayerCall call = engine_call;
  if (call.stream == nullptr) call.stream = LegacyDefaultStream();  // stream 0, as CUDA reads it
  const MoeBatch& b = call.batch;
  if (!ctx_.Serves(b.layer))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", b.layer, " is not an MoE layer served here"));
  if (call.kind != MemoryKind::kDevice || !ctx_.backend->has_device_memory())
    return absl::InvalidArgumentError("memory: capturable calls take device pointers (cuda backend)");
  const int max_tokens = ctx_.capturable_max_tokens;
  if (b.n < 1 || b.n > max_tokens || b.routing.k < 1 || b.routing.k > ctx_.config.max_top_k)
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens/top_k: ", b.n, " x ", b.routing.k, " is outside [1, ", max_tokens, "] x [1, ", ctx_.config.max_top_k,
        "] (captured, a call's misses must fit one shared-memory request slot per server)"));
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(absl::StrCat("topk_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (!ready_ && ctx_.backend->StreamCapturing(call.stream))
    return absl::FailedPreconditionError(absl::StrCat(
        "capturable call: layer ", b.layer, " was never run outside a capture (warm up once before capturing)"));
  MOE_RETURN_IF_ERROR(PrepareDevicePath());
  engine_calls_ |= count_accesses;  // the engine's own call (Forward counts its accesses itself)
  // A reconnected shm server's new segment (not while the engine captures:
  // registering memory is not capture-safe; the next call outside does it).
  for (size_t s = 0; s < servers_.size(); ++s) {
    Server& sv = servers_.at(s);
    if (forwarder_of_server_[s] >= 0 || sv.transport == nullptr) continue;
    if (sv.transport->Generation() != channel_generation_[s] && !ctx_.backend->StreamCapturing(call.stream))
      MOE_RETURN_IF_ERROR(PublishChannel(s));
  }
  planned_stream_ = call.stream;
  DevicePlannedCall dc;
  dc.site = ctx_.layer_index[b.layer];
  dc.layer = b.layer;
  dc.T = b.n;
  dc.k = b.routing.k;
  dc.hidden = b.tokens;
  dc.ids = b.routing.ids;
  dc.weights = b.routing.weights;
  dc.out = call.out;
  dc.stream = call.stream;
  dc.tables = tables_[ctx_.layer_index[b.layer]];
  dc.num_channels = num_channels_;
  dc.timeout = call.deadline.count() > 0 ? call.deadline : ctx_.config.deadline;
  dc.count_accesses = count_accesses;
  if (copy_buffer_base_ >= 0) {
    dc.copy_plan = copy_plan_;
    dc.copy_buffer_base = copy_buffer_base_;
  }
  return ctx_.backend->EnqueueDevicePlanned(dc);
}

absl::Status DeviceExecutor::TakeStreamError(CacheCopies& copies) {
  CollectDeviceAccesses();
  absl::Status first;
  for (size_t li = 0; li < tables_.size(); ++li) {
    absl::Status st = TakeLayerError(li);
    if (first.ok()) first = std::move(st);
  }
  RefreshDeviceServers();
  PublishCopyPlan();
  PlanDeviceAdmissions(copies);
  return first;
}

// The error records of served layer `li`'s device-planned calls (the split's
// and each channel's), cleared; the first as a Status naming the layer and
// what failed (a channel's: the server's own message, or the timeout).
absl::Status DeviceExecutor::TakeLayerError(size_t li) {
  absl::Status first;
  for (int w = 0; w <= kMaxDeviceChannels; ++w) {
    DeviceError& e = tables_[li].errors[w];
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
    while (server < servers_.size() && channel_of_server_[server] != w - 1) ++server;
    const std::string address = server < servers_.size() ? servers_.at(server).config.address : "?";
    if (detail == -2) {  // no answer, but the device computed the request from the host copy: right, and slow
      // Every layer of every replay while a server is silent: once a second per server.
      if (server < servers_.size()) {
        Server& sv = servers_.at(server);
        const Clock::time_point now = Clock::now();
        if (now - sv.recompute_warned < std::chrono::seconds(1)) {
          ++sv.recompute_unwarned;
          continue;
        }
        sv.recompute_warned = now;
      }
      const uint64_t more = server < servers_.size() ? std::exchange(servers_.at(server).recompute_unwarned, 0) : 0;
      LogWarning("worker", "capturable call, layer ", layer, ", server ", address, ": no answer (",
                 absl::StatusCodeToString(sc), ", waited at most ", ctx_.config.deadline.count(),
                 " ms); its misses were computed on the device from the host copy",
                 more > 0 ? absl::StrCat(" (and ", more, " more such layer calls since the last warning)") : "");
      continue;
    }
    std::string why = detail < 0 ? absl::StrCat("no answer within ", ctx_.config.deadline.count(), " ms") : "";
    if (detail >= 0 && server < servers_.size()) {
      std::optional<shm::Segment> seg;
      if (const int f = forwarder_of_server_[server]; f >= 0) {
        seg = forwarders_[f]->seg;
      } else if (auto rings = servers_.at(server).transport->DeviceRingsOf()) {
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
void DeviceExecutor::PublishCopyPlan() {
  if (copy_plan_ == nullptr) return;
  CostModel model = ctx_.planner.rates();
  const bool priced = model.measured && device_copy_s_ > 0;
  if (priced) {
    model.copy_s = device_copy_s_;
    model.copy = OnlineScale();
  }
  for (int missed = 0; missed < kDeviceCopyTable; ++missed) {
    int n = 0;
    if (ctx_.config.copy_mode == CopyMode::kAlways) {
      n = std::min(missed, kMaxDeviceCopies);
    } else if (ctx_.config.copy_mode == CopyMode::kAuto && priced && missed > 0) {
      std::vector<CopyCandidate> candidates(missed);
      for (int i = 0; i < missed; ++i) candidates[i] = CopyCandidate{i, 1};
      model.calls_without_cpu_sample = 0;  // the table is not a call: no exploration
      n = std::min(static_cast<int>(ChooseCopies(model, candidates, 0).size()), kMaxDeviceCopies);
    }
    model_copies_[missed] = n;
    PublishCopyCount(missed);
  }
}

// The device plan's copies for calls missing `missed` experts: the model's,
// unless the outcomes of eager device-path calls of that shape (timed in
// Forward) say the CPU alone was faster.
void DeviceExecutor::PublishCopyCount(int missed) {
  const int model = model_copies_[missed];
  const bool cpu = ctx_.config.copy_mode == CopyMode::kAuto && model > 0 &&
                   ctx_.planner.device_outcomes().Peek(CopyOutcomes::DeviceBucket(missed)) == CopyChoice::kCpu;
  __atomic_store_n(&copy_plan_->copy_count[missed], cpu ? 0 : model, __ATOMIC_RELAXED);
}

// Capturable calls: an shm server that went away is reconnected (its new
// segment published to the GPU) or, while it stays down, left out of the
// routes, so calls fail at once (or go to a replica) instead of waiting out
// the deadline on a segment nobody serves. Not while the engine captures
// (registering memory is not capture-safe).
void DeviceExecutor::RefreshDeviceServers() {
  if (!ready_ || ctx_.backend->StreamCapturing(planned_stream_)) return;
  const Clock::time_point now = Clock::now();
  for (size_t s = 0; s < servers_.size(); ++s) {
    Server& sv = servers_.at(s);
    if (forwarder_of_server_[s] >= 0 || sv.transport == nullptr) continue;
    const bool was_dead = sv.device_dead;
    if (sv.device_dead && sv.down_until > now) continue;
    sv.device_dead = !sv.transport->Reconnect().ok() || !PublishChannel(s).ok();
    if (sv.device_dead) sv.down_until = now + ctx_.config.server_retry;
    if (sv.device_dead != was_dead) PublishRoute(s);
  }
}

// Popularity from device-planned calls (graph replays included): the routed
// pairs the GPU counted since the last look, reported as the eager path
// reports its own (ExpertCache::RecordAccess, on_access: the coordinator).
void DeviceExecutor::CollectDeviceAccesses() {
  // Not while the engine captures: a synchronous copy would end its capture.
  if (!ready_ || ctx_.backend->StreamCapturing(planned_stream_)) return;
  std::vector<uint32_t> counts;
  const size_t E = ctx_.spec.num_experts, L = ctx_.layers.size();
  if (!ctx_.backend->ReadAccessCounts(&counts).ok() || counts.size() != L * E) return;
  counts_seen_.resize(L * E, 0);
  std::vector<int> experts, pairs;
  for (size_t li = 0; li < L; ++li) {
    experts.clear();
    pairs.clear();
    for (size_t e = 0; e < E; ++e) {
      const uint32_t delta = counts[li * E + e] - counts_seen_[li * E + e];  // wraps correctly
      counts_seen_[li * E + e] = counts[li * E + e];
      if (delta == 0) continue;
      experts.push_back(static_cast<int>(e));
      pairs.push_back(static_cast<int>(std::min<uint32_t>(delta, 1u << 30)));
    }
    if (experts.empty()) continue;
    const int layer = ctx_.layers[li];
    ctx_.cache->RecordAccess(layer, experts, pairs);
    if (ctx_.config.on_access)
      for (size_t i = 0; i < experts.size(); ++i)
        ctx_.config.on_access(layer, experts[i], pairs[i], ctx_.cache->ReadySlot(layer, experts[i]) >= 0);
  }
}

// The routes of capturable calls (see ServerSet's route listener): the
// forwarder's transport while the server is enabled, the server's slice on
// its channel, and each expert's route (RouteExpert) over the enabled,
// connected servers that have a channel; channel c is server c's.
void DeviceExecutor::PublishRoute(size_t index) {
  if (!ready_) return;
  const Server& sv = servers_.at(index);
  if (const int f = forwarder_of_server_[index]; f >= 0)
    forwarders_[f]->route.store(sv.enabled ? sv.transport.get() : nullptr, std::memory_order_release);
  // The server's share of each expert, for the fallback of its unanswered requests.
  if (const int c = channel_of_server_[index]; c >= 0 && sv.transport != nullptr) {
    const std::pair<int, int> range = sv.slice.whole() ? std::make_pair(0, 0)
                                                       : SliceRange(ctx_.spec.intermediate, sv.slice)
                                                             .value_or(std::make_pair(0, 0));
    if (channels_[c].slice_begin != range.first || channels_[c].slice_end != range.second) {
      channels_[c].slice_begin = range.first;
      channels_[c].slice_end = range.second;
      if (absl::Status st = ctx_.backend->SetDeviceChannels(channels_, num_channels_); !st.ok())
        LogWarning("worker", "servers: ", sv.config.address, ": cannot publish its slice: ", st.message());
    }
  }
  std::vector<PlanServer> up(servers_.size());
  for (size_t s = 0; s < servers_.size(); ++s) {
    const Server& x = servers_.at(s);
    up[s] = PlanServer{x.enabled && !x.device_dead && x.transport != nullptr && channel_of_server_[s] >= 0, &x.hosts,
                       x.chunk_tokens, x.slice};
  }
  const int n = static_cast<int>(up.size());
  for (size_t li = 0; li < ctx_.layers.size(); ++li) {
    int32_t* channel_of = tables_[li].channel_of;
    for (int e = 0; e < ctx_.spec.num_experts; ++e) {
      const uint64_t route = RouteExpert(up.data(), n, e, ReplicaStart(ctx_.layers[li], n));
      __atomic_store_n(channel_of + e, route != 0 ? static_cast<int32_t>(route) : -1, __ATOMIC_RELEASE);
    }
  }
}

// Admissions for capturable calls, planned between steps: each layer's
// latest call (the GPU's routing log) goes through the planner in layer
// order, as an eager call's routing does after its split: the predictive
// policy's admissions, or lru / lfru's. Copies that completed meanwhile are
// published first. Not while the engine captures.
void DeviceExecutor::PlanDeviceAdmissions(CacheCopies& copies) {
  if (!ready_ || ctx_.host == nullptr || ctx_.config.copy_mode == CopyMode::kAlways ||
      ctx_.backend->StreamCapturing(planned_stream_))
    return;
  copies.Poll();
  log_seen_.resize(ctx_.layers.size(), 0);
  std::vector<int32_t> ids;
  for (size_t li = 0; li < ctx_.layers.size(); ++li) {
    const DeviceLayerTables& t = tables_[li];
    const int32_t seq = __atomic_load_n(t.routing_log, __ATOMIC_ACQUIRE);
    if (seq == 0 || seq == log_seen_[li]) continue;  // being written, or seen
    const int T = t.routing_log[1], k = t.routing_log[2];
    if (T < 1 || k < 1 || static_cast<int64_t>(T) * k > t.routing_log_pairs) continue;
    ids.assign(t.routing_log + kRoutingLogHeader, t.routing_log + kRoutingLogHeader + static_cast<size_t>(T) * k);
    if (__atomic_load_n(t.routing_log, __ATOMIC_ACQUIRE) != seq) continue;  // rewritten while read
    log_seen_[li] = seq;
    copies.AfterDeviceCall(ctx_.layers[li], T, k, ids.data());
  }
}

}  // namespace moe
