// MoeSession (include/moe/engine.h): a model source, a device backend, the
// host expert store and a LayerDispatcher, put together from SessionOptions.
#include "moe/engine.h"

#include <chrono>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "model/model_identity.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/routing.h"
#include "core/status_macros.h"
#include "transport/transport.h"
#include "gpu_worker/device_backend.h"
#ifdef MOE_HAVE_NCCL
#include "gpu_worker/expert_parallel.h"
#endif
#include "gpu_worker/host_expert_store.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

struct MoeSession::Rep {
  SessionOptions options;
  ModelInfo model;
  std::unique_ptr<ModelSource> source;
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<HostExpertStore> host;
  std::unique_ptr<LayerDispatcher> dispatcher;
  SessionTotals totals;
  // Adds one forward call (ForwardLayer, or an async call's Wait) to the totals.
  void Count(const absl::Status& st, const CallStats& c) {
    ++totals.calls;
    if (!st.ok()) ++totals.failed_calls;
    totals.hit_pairs += static_cast<uint64_t>(c.hit_pairs);
    totals.cpu_pairs += static_cast<uint64_t>(c.cpu_pairs);
    totals.copied_pairs += static_cast<uint64_t>(c.copied_pairs);
    totals.miss_tokens += static_cast<uint64_t>(c.miss_tokens);
    totals.failovers += static_cast<uint64_t>(c.failovers);
    totals.bytes_shipped += c.bytes_shipped;
    totals.seconds += c.seconds;
  }
#ifdef MOE_HAVE_NCCL
  std::unique_ptr<ExpertParallel> expert_parallel;  // group.mode kExpert: the token exchange
#endif

  bool expert_parallel_mode() const { return options.group.mode == GroupMode::kExpert && options.group.size > 1; }

  ~Rep() {
#ifdef MOE_HAVE_NCCL
    expert_parallel.reset();  // before the dispatcher it calls
#endif
    dispatcher.reset();  // before the host store and backend it uses
    host.reset();
    backend.reset();
  }
};

namespace {

// One table per choice: its values and names, in the enum's order.
template <typename E, size_t N>
absl::StatusOr<E> ParseName(const std::string& name, const std::string& field, const char* const (&names)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<E>(i);
  std::string all;
  for (size_t i = 0; i < N; ++i) absl::StrAppend(&all, i == 0 ? "" : i + 1 == N ? " or " : ", ", names[i]);
  return absl::InvalidArgumentError(absl::StrCat(field, ": '", name, "' is not ", all));
}
constexpr const char* kDeviceNames[] = {"auto", "cuda", "cpu"};
constexpr const char* kPolicyNames[] = {"static", "lru", "lfru", "predictive"};
constexpr const char* kCopyModeNames[] = {"auto", "never", "always"};
constexpr const char* kWeightDtypeNames[] = {"auto", "bf16", "int8", "int4", "fp8", "mxfp4"};
constexpr const char* kGroupModeNames[] = {"tensor", "expert"};

}  // namespace

const char* Name(DeviceChoice v) { return kDeviceNames[static_cast<int>(v)]; }
const char* Name(CachePolicy v) { return kPolicyNames[static_cast<int>(v)]; }
const char* Name(CopyMode v) { return kCopyModeNames[static_cast<int>(v)]; }
const char* Name(WeightDtype v) { return kWeightDtypeNames[static_cast<int>(v)]; }
const char* Name(GroupMode v) { return kGroupModeNames[static_cast<int>(v)]; }
absl::StatusOr<DeviceChoice> ParseDeviceChoice(const std::string& name, const std::string& field) {
  return ParseName<DeviceChoice>(name, field, kDeviceNames);
}
absl::StatusOr<CachePolicy> ParseCachePolicy(const std::string& name, const std::string& field) {
  return ParseName<CachePolicy>(name, field, kPolicyNames);
}
absl::StatusOr<CopyMode> ParseCopyMode(const std::string& name, const std::string& field) {
  return ParseName<CopyMode>(name, field, kCopyModeNames);
}
absl::StatusOr<WeightDtype> ParseWeightDtype(const std::string& name, const std::string& field) {
  return ParseName<WeightDtype>(name, field, kWeightDtypeNames);
}
absl::StatusOr<GroupMode> ParseGroupMode(const std::string& name, const std::string& field) {
  return ParseName<GroupMode>(name, field, kGroupModeNames);
}

namespace {

absl::StatusOr<DispatcherConfig> MakeDispatcherConfig(const SessionOptions& o, const ModelSpec& spec) {
  DispatcherConfig c;
  c.layers = o.layers;
  for (const std::string& text : o.servers) {
    MOE_ASSIGN_OR_RETURN(ExpertServerConfig server, ParseExpertServer(text, spec.num_experts));
    c.servers.push_back(std::move(server));
  }
  c.policy = o.policy;
  c.copy_mode = o.copy_mode;
  c.slots_per_layer = o.cache_experts_per_layer;
  c.cache_gib = o.cache_gib;
  c.max_tokens = o.max_tokens;
  c.max_top_k = o.max_top_k;
  c.contexts = o.contexts;
  c.deadline = o.deadline;
  c.server_deadline = o.server_deadline;
  c.transport.tls = o.tls;
  if (o.grpc_streams < 1 || o.grpc_streams > 64)
    return absl::InvalidArgumentError(absl::StrCat("grpc_streams: ", o.grpc_streams, " (1..64)"));
  c.transport.grpc_streams = o.grpc_streams;
  c.backend.cpu_threads = o.cpu_threads;
  c.backend.cuda_device = o.cuda_device;
  c.group = o.group;
  c.fill_cache = o.fill_cache;
  if (o.group.mode == GroupMode::kExpert && o.group.size > 1) {
    // The rank computes its own tokens and the ones its peers send it.
    if (o.max_tokens >= 1 && o.max_tokens <= kMaxCallTokens &&
        static_cast<int64_t>(o.max_tokens) * o.group.size > kMaxCallTokens)
      return absl::InvalidArgumentError(absl::StrCat("max_tokens: ", o.max_tokens, " x group.size ", o.group.size,
                                                     " exceeds ", kMaxCallTokens, " tokens per batch"));
    c.max_tokens = o.max_tokens * std::max(1, o.group.size);
  }
  c.on_access = o.on_access;
  c.on_activity = o.on_activity;
  return c;
}

ModelInfo InfoOf(const ModelSpec& s) {
  return ModelInfo{s.model_type,      s.num_layers,         s.moe_layers,
                   s.num_experts,     s.top_k,              s.hidden,
                   s.intermediate,    DTypeName(s.dtype),   s.ExpertBf16Bytes(),
                   /*identity=*/0,    ExpertMathName(s),    RoutingModeName(s.routing)};
}

// The session's GPU current on the calling thread for one call, the
// engine's own given back after it (no-op when they are the same).
class DeviceScope {
 public:
  explicit DeviceScope(DeviceBackend& b) : backend_(b), previous_(b.ActivateDevice()) {}
  ~DeviceScope() { backend_.RestoreDevice(previous_); }

 private:
  DeviceBackend& backend_;
  int previous_;
};

LayerCall MakeLayerCall(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                        const float* topk_weights, bf16_t* out, MemoryKind kind, void* cuda_stream) {
  LayerCall call;
  call.batch = MoeBatch{layer, T, hidden, RoutingView{T, k, topk_ids, topk_weights}};
  call.out = out;
  call.kind = kind;
  call.stream = cuda_stream;
  return call;
}

}  // namespace

MoeSession::MoeSession(std::unique_ptr<Rep> rep) : rep_(std::move(rep)), admin_(rep_.get()) {}
MoeSession::~MoeSession() = default;

absl::StatusOr<std::unique_ptr<MoeSession>> MoeSession::Open(const SessionOptions& o) {
  auto r = std::make_unique<Rep>();
  r->options = o;
  MOE_ASSIGN_OR_RETURN(r->source, OpenModel(o.model));
  const ModelSpec& spec = r->source->spec();
  r->model = InfoOf(spec);
  // Every server's model must be this one (checked at each connect and in
  // each request), also when the host copy is the servers' shared one.
  const auto t0 = std::chrono::steady_clock::now();
  const ModelIdentity identity = IdentityOf(*r->source, o.model);
  r->model.identity = identity.digest;
  LogInfo("worker", "model ", o.model, ": identity ", IdentityHex(identity.digest), " (computed in ",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), " s)");
  MOE_ASSIGN_OR_RETURN(DispatcherConfig c, MakeDispatcherConfig(o, spec));
  MOE_RETURN_IF_ERROR(CheckParallelGroup(o.group, spec.num_experts));
  c.transport.model = identity;
  MOE_ASSIGN_OR_RETURN(r->backend, MakeDeviceBackend(Name(o.device)));
  if (r->expert_parallel_mode()) {
#ifndef MOE_HAVE_NCCL
    return absl::FailedPreconditionError("group: expert-parallel groups need NCCL, and this build has none");
#endif
    if (!r->backend->has_device_memory())
      return absl::FailedPreconditionError("group: an expert-parallel group needs the cuda device backend");
  }
  if (o.host_copy) {
    const std::vector<int>& layers = ServedLayers(spec, o.layers);
    std::vector<std::string> unix_sockets;
    for (const ExpertServerConfig& sc : c.servers)
      if (std::optional<std::string> path = UnixSocketPath(sc.address)) unix_sockets.push_back(*path);
    // The dispatcher sizes the cache in the host copy's format.
    MOE_ASSIGN_OR_RETURN(r->host, HostExpertStore::Open(*r->source, identity, layers, unix_sockets,
                                                        Name(o.weight_dtype), o.share_host_copy, r->backend.get()));
  }
  // What one expert copy moves: the host copy's packed expert (int8 / int4
  // move ~1/2 / ~1/4 of bf16), which the coordinator's copy budget counts.
  if (r->host) r->model.expert_bytes = r->host->geometry().packed_bytes();
  MOE_ASSIGN_OR_RETURN(r->dispatcher, LayerDispatcher::Create(spec, *r->backend, r->host.get(), std::move(c)));
#ifdef MOE_HAVE_NCCL
  if (r->expert_parallel_mode()) {
    DeviceScope scope(*r->backend);
    MOE_ASSIGN_OR_RETURN(r->expert_parallel, ExpertParallel::Create(o.group, *r->dispatcher, spec.num_experts,
                                                                    spec.hidden, o.max_tokens, o.max_top_k,
                                                                    o.deadline));
  }
#endif
  return std::unique_ptr<MoeSession>(new MoeSession(std::move(r)));
}

const ModelInfo& MoeSession::model_info() const { return rep_->model; }
const SessionOptions& MoeSession::options() const { return rep_->options; }
const char* MoeSession::device() const { return rep_->backend->name(); }

absl::Status MoeSession::ForwardLayer(int layer, int T, int k, const bf16_t* hidden,
                                      const int32_t* topk_ids, const float* topk_weights, bf16_t* out,
                                      MemoryKind kind, CallStats* stats, void* cuda_stream) {
  DeviceScope scope(*rep_->backend);
  const auto t0 = std::chrono::steady_clock::now();
  const LayerCall call = MakeLayerCall(layer, T, k, hidden, topk_ids, topk_weights, out, kind, cuda_stream);
  CallStats local;
  CallStats* s = stats != nullptr ? stats : &local;
  *s = CallStats{};
  absl::Status st;
#ifdef MOE_HAVE_NCCL
  if (rep_->expert_parallel != nullptr) st = rep_->expert_parallel->Forward(call, s);
  else
#endif
  // Forward, not Submit + Wait: a decode-sized call in device memory takes
  // the device path (LayerDispatcher::Forward).
    st = rep_->dispatcher->Forward(call, s);
  s->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rep_->Count(st, *s);
  return st;
}

const std::vector<int>& MoeSession::served_layers() const { return rep_->dispatcher->layers(); }
SessionTotals MoeSession::totals() const { return rep_->totals; }

absl::Status MoeSession::ReferenceForward(const std::string& model, int layer, int T, int k, const bf16_t* hidden,
                                          const int32_t* topk_ids, const float* topk_weights, float* out) {
  if (T < 0) return absl::InvalidArgumentError(absl::StrCat("T: ", T, " < 0"));
  if (T > 0 && (k < 1 || hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr || out == nullptr))
    return absl::InvalidArgumentError("k/hidden/topk_ids/topk_weights/out: k < 1 or NULL pointer");
  static std::mutex mu;
  static std::string opened;
  static std::unique_ptr<ModelSource> source;
  static std::unique_ptr<ReferenceMoe> reference;
  std::lock_guard<std::mutex> lock(mu);
  if (!source || opened != model) {
    reference.reset();
    source.reset();
    MOE_ASSIGN_OR_RETURN(source, OpenModel(model));
    reference = std::make_unique<ReferenceMoe>(*source);
    opened = model;
  }
  if (layer < 0 || !source->spec().IsMoeLayer(layer))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is not an MoE layer of ", model));
  const RoutingView routing{T, k, topk_ids, topk_weights};
  MOE_RETURN_IF_ERROR(ValidateRouting(routing, source->spec().num_experts, {}));
  return reference->Forward<float>(layer, T, hidden, routing, out);
}

absl::StatusOr<std::string> MoeSession::NewGroupId() {
#ifdef MOE_HAVE_NCCL
  return moe::NewGroupId();
#else
  return absl::FailedPreconditionError("group: expert-parallel groups need NCCL, and this build has none");
#endif
}

absl::Status MoeSession::RefuseInExpertParallel(const char* method) const {
  if (!rep_->expert_parallel_mode()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      method, ": an expert-parallel session takes ForwardLayer calls only (every rank calls every layer)"));
}

absl::StatusOr<MoeSession::Pending> MoeSession::ForwardLayerAsync(int layer, int T, int k,
                                                                  const bf16_t* hidden,
                                                                  const int32_t* topk_ids,
                                                                  const float* topk_weights, bf16_t* out,
                                                                  MemoryKind kind, void* cuda_stream) {
  MOE_RETURN_IF_ERROR(RefuseInExpertParallel("ForwardLayerAsync"));
  DeviceScope scope(*rep_->backend);
  absl::StatusOr<int> ticket =
      rep_->dispatcher->Submit(MakeLayerCall(layer, T, k, hidden, topk_ids, topk_weights, out, kind, cuda_stream));
  if (!ticket.ok()) {  // a call that never started is a failed call
    rep_->Count(ticket.status(), CallStats{});
    return ticket.status();
  }
  return Pending{*ticket};
}

absl::Status MoeSession::ForwardLayerCapturable(int layer, int T, int k, const bf16_t* hidden,
                                                const int32_t* topk_ids, const float* topk_weights, bf16_t* out,
                                                void* cuda_stream) {
  MOE_RETURN_IF_ERROR(RefuseInExpertParallel("ForwardLayerCapturable"));
  DeviceScope scope(*rep_->backend);
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<CallStats> host;
  const absl::Status st = rep_->dispatcher->EnqueueCapturable(
      MakeLayerCall(layer, T, k, hidden, topk_ids, topk_weights, out, MemoryKind::kDevice, cuda_stream),
      /*count_accesses=*/true, &host);
  if (host.has_value()) {  // ran eagerly on the host path: counted as a forward call (the GPU counts the others)
    host->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rep_->Count(st, *host);
  }
  return st;
}

absl::Status MoeSession::TakeStreamError() {
  DeviceScope scope(*rep_->backend);
  absl::Status st = rep_->dispatcher->TakeStreamError();
  // The capturable calls the GPU ran since the last look, into the totals.
  const CapturedCalls c = rep_->dispatcher->TakeCapturedCalls();
  SessionTotals& t = rep_->totals;
  t.calls += c.calls;
  t.hit_pairs += c.hit_pairs;
  t.cpu_pairs += c.cpu_pairs;
  t.copied_pairs += c.copied_pairs;
  return st;
}

absl::Status MoeSession::Wait(Pending call, CallStats* stats) {
  DeviceScope scope(*rep_->backend);
  const auto t0 = std::chrono::steady_clock::now();
  CallStats local;
  CallStats* s = stats != nullptr ? stats : &local;
  *s = CallStats{};
  absl::Status st = rep_->dispatcher->Complete(call.ticket, s);
  s->seconds = s->submit_seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rep_->Count(st, *s);
  return st;
}

absl::Status MoeSession::Admin::ApplyAssignment(int layer, const std::vector<int>& experts,
                                         const std::vector<int>& pinned) {
  DeviceScope scope(*rep_->backend);
  return rep_->dispatcher->ApplyAssignment(layer, experts, pinned);
}
absl::Status MoeSession::Admin::FlushCopies() {
  DeviceScope scope(*rep_->backend);
  return rep_->dispatcher->FlushCopies();
}
int MoeSession::Admin::PendingCopies() { return rep_->dispatcher->PendingCopies(); }
uint64_t MoeSession::Admin::copies_started() const { return rep_->dispatcher->copies_started(); }
absl::Status MoeSession::Admin::SetServerEnabled(const std::string& address, bool enabled) {
  DeviceScope scope(*rep_->backend);
  return rep_->dispatcher->SetServerEnabled(address, enabled);
}
std::vector<int> MoeSession::Admin::CachedExperts(int layer) const { return rep_->dispatcher->cache().SlotExperts(layer); }
double MoeSession::Admin::HitRate(int layer) const { return rep_->dispatcher->cache().HitRate(layer); }
int MoeSession::Admin::slots_per_layer() const { return rep_->dispatcher->slots_per_layer(); }
std::string MoeSession::Admin::DescribeCostModel() const {
  const LayerDispatcher& d = *rep_->dispatcher;
  return absl::StrCat(d.cost_model().Describe(), "; copy outcomes: host path ", d.host_outcomes().Describe(),
                      ", device path ", d.device_outcomes().Describe());
}

std::map<std::string, double> MoeSession::Admin::PlannerRates() const {
  const LayerDispatcher& d = *rep_->dispatcher;
  const CostModel& m = d.cost_model();
  return {{"measured", m.measured ? 1.0 : 0.0},
          {"copy_seconds", m.CopySeconds()},
          {"cpu_call_seconds", m.cpu.scale() * m.cpu_call_s},
          {"cpu_expert_seconds", m.cpu.scale() * m.cpu_expert_s},
          {"device_row_seconds", m.device.scale() * m.device_row_s},
          {"copy_delay_seconds", m.overlap.delay_s()},
          {"copy_calls_observed", static_cast<double>(d.host_outcomes().observed() + d.device_outcomes().observed())},
          {"vetoed_call_shapes", static_cast<double>(d.host_outcomes().vetoed_buckets() +
                                                     d.device_outcomes().vetoed_buckets())}};
}

std::string MoeSession::Admin::Describe() const {
  return absl::StrCat(rep_->source->spec().Summary(), "; device ", rep_->backend->name(), "; cache ",
                      rep_->dispatcher->slots_per_layer(), " experts/layer (", Name(rep_->options.policy),
                      "); servers [", absl::StrJoin(rep_->options.servers, ", "), "]; copy model: ",
                      DescribeCostModel());
}

}  // namespace moe
