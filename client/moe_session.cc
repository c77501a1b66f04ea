#include "client/moe_session.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model_source.h"
#include "gpu_worker/host_expert_store.h"

namespace moe {

MoeSession::~MoeSession() {
  dispatcher_.reset();  // before the host store and backend it uses
  host_.reset();
  backend_.reset();
}

absl::StatusOr<std::unique_ptr<MoeSession>> MoeSession::Open(const SessionOptions& o) {
  auto s = std::unique_ptr<MoeSession>(new MoeSession());
  s->options_ = o;
  absl::StatusOr<std::unique_ptr<ModelSource>> source = OpenModel(o.model);
  if (!source.ok()) return source.status();
  s->source_ = *std::move(source);
  const ModelSpec& spec = s->source_->spec();

  DispatcherConfig c;
  c.layers = o.layers;
  for (const std::string& text : o.servers) {
    absl::StatusOr<ExpertServerConfig> server = ParseExpertServer(text, spec.num_experts);
    if (!server.ok()) return server.status();
    c.servers.push_back(*std::move(server));
  }
  absl::StatusOr<CachePolicyKind> policy = ParseCachePolicy(o.policy);
  if (!policy.ok()) return policy.status();
  absl::StatusOr<CopyMode> copy = ParseCopyMode(o.copy_mode);
  if (!copy.ok()) return copy.status();
  c.policy = *policy;
  c.copy_mode = *copy;
  c.slots_per_layer = o.cache_experts_per_layer;
  c.cache_gib = o.cache_gib;
  c.max_tokens = o.max_tokens;
  c.max_top_k = o.max_top_k;
  c.contexts = o.contexts;
  c.deadline = o.deadline;
  c.transport.tls = o.tls;
  c.backend.cpu_threads = o.cpu_threads;
  c.on_access = o.on_access;
  c.on_cache_activity = o.on_cache_activity;

  absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = MakeDeviceBackend(o.device);
  if (!backend.ok()) return backend.status();
  s->backend_ = *std::move(backend);
  if (o.host_copy) {
    const std::vector<int>& layers = o.layers.empty() ? spec.moe_layers : o.layers;
    absl::StatusOr<std::unique_ptr<HostExpertStore>> host =
        HostExpertStore::Load(*s->source_, layers, s->backend_.get());
    if (!host.ok()) return host.status();
    s->host_ = *std::move(host);
  }
  absl::StatusOr<std::unique_ptr<LayerDispatcher>> d =
      LayerDispatcher::Create(spec, *s->backend_, s->host_.get(), std::move(c));
  if (!d.ok()) return d.status();
  s->dispatcher_ = *std::move(d);
  return s;
}

const ModelSpec& MoeSession::spec() const { return source_->spec(); }
const char* MoeSession::device() const { return backend_->name(); }

absl::Status MoeSession::ForwardLayer(int layer, int T, int k, const bf16_t* hidden,
                                      const int32_t* topk_ids, const float* topk_weights, bf16_t* out,
                                      MemoryKind kind, CallStats* stats, void* cuda_stream) {
  absl::StatusOr<Pending> p =
      ForwardLayerAsync(layer, T, k, hidden, topk_ids, topk_weights, out, kind, cuda_stream);
  if (!p.ok()) return p.status();
  return Wait(*p, stats);
}

namespace {

LayerCall MakeLayerCall(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                        const float* topk_weights, bf16_t* out, MemoryKind kind, void* cuda_stream) {
  LayerCall call;
  call.layer = layer;
  call.T = T;
  call.k = k;
  call.hidden = hidden;
  call.topk_ids = topk_ids;
  call.topk_weights = topk_weights;
  call.out = out;
  call.kind = kind;
  call.stream = cuda_stream;
  return call;
}

}  // namespace

absl::StatusOr<MoeSession::Pending> MoeSession::ForwardLayerAsync(int layer, int T, int k,
                                                                  const bf16_t* hidden,
                                                                  const int32_t* topk_ids,
                                                                  const float* topk_weights, bf16_t* out,
                                                                  MemoryKind kind, void* cuda_stream) {
  absl::StatusOr<int> ticket = dispatcher_->Submit(
      MakeLayerCall(layer, T, k, hidden, topk_ids, topk_weights, out, kind, cuda_stream));
  if (!ticket.ok()) return ticket.status();
  return Pending{*ticket};
}

absl::Status MoeSession::ForwardLayerCapturable(int layer, int T, int k, const bf16_t* hidden,
                                                const int32_t* topk_ids, const float* topk_weights, bf16_t* out,
                                                void* cuda_stream) {
  return dispatcher_->EnqueueCapturable(
      MakeLayerCall(layer, T, k, hidden, topk_ids, topk_weights, out, MemoryKind::kDevice, cuda_stream));
}

absl::Status MoeSession::TakeStreamError() { return dispatcher_->TakeStreamError(); }

absl::Status MoeSession::Wait(Pending call, CallStats* stats) { return dispatcher_->Complete(call.ticket, stats); }

absl::Status MoeSession::ApplyAssignment(int layer, const std::vector<int>& experts,
                                         const std::vector<int>& pinned) {
  return dispatcher_->ApplyAssignment(layer, experts, pinned);
}
absl::Status MoeSession::FlushCopies() { return dispatcher_->FlushCopies(); }
int MoeSession::PendingCopies() { return dispatcher_->PendingCopies(); }
uint64_t MoeSession::copies_started() const { return dispatcher_->copies_started(); }
absl::Status MoeSession::SetServerEnabled(const std::string& address, bool enabled) {
  return dispatcher_->SetServerEnabled(address, enabled);
}
const ExpertCache& MoeSession::cache() const { return dispatcher_->cache(); }
const CostModel& MoeSession::cost_model() const { return dispatcher_->cost_model(); }
int MoeSession::slots_per_layer() const { return dispatcher_->slots_per_layer(); }

std::string MoeSession::Describe() const {
  return absl::StrCat(source_->spec().Summary(), "; device ", backend_->name(), "; cache ",
                      dispatcher_->slots_per_layer(), " experts/layer (", options_.policy, "); servers [",
                      absl::StrJoin(options_.servers, ", "), "]; copy model: ", dispatcher_->cost_model().Describe());
}

}  // namespace moe
