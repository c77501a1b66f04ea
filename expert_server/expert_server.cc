#include "expert_server/expert_server.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/metrics.h"
#include "core/status_macros.h"
#include "transport/wire.h"
#include "expert_compute/cpu_features.h"

namespace moe {

namespace {

// `text` as an index list below `limit` (errors name --NAME), or `all` when empty.
absl::StatusOr<std::vector<int>> IndexesOrAll(const std::string& text, int limit, const char* name,
                                              std::vector<int> all) {
  if (text.empty()) return all;
  return ParseIndexList(text, limit, name);
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

}  // namespace

ExpertServer::ExpertServer(const ExpertServerOptions& options) : options_(options) {}

ExpertServer::~ExpertServer() { Stop(std::chrono::seconds(0)); }

absl::StatusOr<std::unique_ptr<ExpertServer>> ExpertServer::Start(const ExpertServerOptions& options,
                                                                  bool* option_at_fault) {
  bool bad_option = false;
  std::unique_ptr<ExpertServer> s(new ExpertServer(options));
  absl::Status st = s->OpenModel(&bad_option);
  if (option_at_fault != nullptr) *option_at_fault = bad_option;
  MOE_RETURN_IF_ERROR(st);
  MOE_RETURN_IF_ERROR(s->LoadExperts());
  MOE_RETURN_IF_ERROR(s->ServeGrpcService());
  MOE_RETURN_IF_ERROR(s->ServeSharedMemory());
  MOE_ASSIGN_OR_RETURN(s->metrics_http_, StartMetricsEndpoint("server", options.service));
  MOE_RETURN_IF_ERROR(s->StartCoordinatorAgent());
  return s;
}

absl::Status ExpertServer::OpenModel(bool* option_at_fault) {
  MOE_ASSIGN_OR_RETURN(source_, moe::OpenModel(options_.model));
  model_spec_ = source_->spec();
  // Before slicing: the identity is the whole model's.
  const auto t0 = std::chrono::steady_clock::now();
  identity_ = IdentityOf(*source_, options_.model);
  const double identity_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // From here on, an error is an option that does not fit the model or this machine.
  *option_at_fault = true;
  if (absl::StatusOr<std::unique_ptr<ModelSource>> sliced = SliceModel(std::move(source_), options_.slice);
      sliced.ok()) {
    source_ = *std::move(sliced);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--slice: ", sliced.status().message()));
  }
  const ModelSpec& spec = source_->spec();
  MOE_ASSIGN_OR_RETURN(hosted_.layers, IndexesOrAll(options_.layers, spec.num_layers, "layers", spec.moe_layers));
  MOE_ASSIGN_OR_RETURN(hosted_.experts,
                       IndexesOrAll(options_.experts, spec.num_experts, "experts", Iota(spec.num_experts)));
  const CpuFeatures& cpu = CpuFeatures::Get();
  MOE_ASSIGN_OR_RETURN(geometry_, StorageGeometry(spec, options_.weight_dtype));
  MOE_ASSIGN_OR_RETURN(kernel_, MakeExpertKernel(options_.kernel, cpu, geometry_.format));
  MOE_ASSIGN_OR_RETURN(binding_, NumaBinding::Create(options_.numa_node, options_.threads, !options_.shm_socket.empty(),
                                                       options_.slice.index, options_.slice.count));
  *option_at_fault = false;

  LogInfo("server", "model ", source_->Describe(), ": ", spec.Summary(), "; identity ", IdentityHex(identity_.digest),
          " (computed in ", identity_s, " s)");
  LogInfo("server", binding_->Describe());
  LogInfo("server", "cpu: ", cpu.brand, "; isa: ", cpu.Summary(), "; kernel: ", kernel_->name());
  LogInfo("server", "hosting layers [", FormatIndexList(hosted_.layers), "] experts [", FormatIndexList(hosted_.experts),
          "]: ", ExpertStore::BytesNeeded(geometry_, hosted_), " bytes of packed weights in ",
          WeightFormatName(geometry_.format),
          geometry_.group > 0 ? absl::StrCat(" (group ", geometry_.group, ")") : std::string(),
          " (checkpoint: ", spec.quant.Describe(), ")");
  return absl::OkStatus();
}

absl::Status ExpertServer::LoadExperts() {
  pool_ = std::make_unique<ComputePool>(*binding_, std::chrono::microseconds(options_.idle_spin_us));
  const auto t0 = std::chrono::steady_clock::now();
  // A slice is no host copy a worker could compute whole experts from.
  const bool shareable = options_.share_weights && !options_.shm_socket.empty() && options_.slice.whole();
  MOE_ASSIGN_OR_RETURN(store_, ExpertStore::Load(*source_, geometry_, hosted_, *binding_, *pool_, shareable));
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  LogInfo("server", "weights resident: ", store_->resident_bytes(), " bytes (", store_->resident_bytes() >> 20,
          " MiB) on NUMA node ", binding_->node(), ", packed in ", load_s, " s");
  executor_ = std::make_unique<MoeExecutor>(*store_, *kernel_, *pool_, options_.merge_requests);
  metrics_ = std::make_unique<ExpertServerMetrics>(Metrics(), hosted_.layers);
  metrics_->SetComputeThreads(pool_->size());
  metrics_->SetWeightBytes(store_->resident_bytes());
  return absl::OkStatus();
}

absl::Status ExpertServer::Compute(const MoeBatch& batch, DType out_dtype, void* out, ForwardStats* stats) {
  ForwardStats local;
  if (stats == nullptr) stats = &local;
  metrics_->BatchStarted();
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  absl::Status st = executor_->Forward(batch, out_dtype, out, stats);
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  metrics_->BatchFinished();
  if (st.ok()) metrics_->RecordCompute(batch.layer, batch.n, *stats);
  return st;
}

moe::v1::ServerInfo ExpertServer::Info(uint64_t max_message_bytes) const {
  moe::v1::ServerInfo info;
  ModelSpecToProto(model_spec_, info.mutable_model());
  info.set_slice_index(static_cast<uint32_t>(options_.slice.index));
  info.set_slice_count(static_cast<uint32_t>(options_.slice.count));
  for (int l : hosted_.layers) info.add_hosted_layers(l);
  for (int e : hosted_.experts) info.add_hosted_experts(e);
  info.set_kernel(std::string(kernel_->name()));
  info.set_isa(CpuFeatures::Get().Summary());
  info.set_threads(pool_->size());
  info.mutable_numa()->set_node(binding_->node());
  info.mutable_numa()->set_num_nodes(binding_->num_nodes());
  for (int c : binding_->cpus()) info.mutable_numa()->add_cpus(c);
  info.set_weight_bytes(store_->resident_bytes());
  info.set_weight_format(WeightFormatName(geometry_.format));
  info.set_max_tokens_per_request(static_cast<uint32_t>(options_.max_tokens));
  info.set_max_message_bytes(max_message_bytes);
  info.set_version(options_.version);
  info.set_model_identity(identity_.digest);
  info.set_model_path(identity_.model);
  return info;
}

absl::Status ExpertServer::ServeGrpcService() {
  ServiceLimits limits;
  limits.max_tokens_per_request = options_.max_tokens;
  const uint64_t max_msg = MaxMessageBytes(source_->spec(), limits);
  service_ = std::make_unique<ExpertServiceImpl>(
      source_->spec(),
      [this](const MoeBatch& b, DType dt, void* out, ForwardStats* stats) { return Compute(b, dt, out, stats); },
      limits, Info(max_msg), metrics_.get());
  MOE_ASSIGN_OR_RETURN(grpc_, ServeGrpc({options_.listen, options_.credentials, max_msg, {service_.get()}}));
  LogInfo("server", "serving moe.v1.ExpertService on ", grpc_.address, " (max message ", max_msg, " bytes)");
  return absl::OkStatus();
}

absl::Status ExpertServer::ServeSharedMemory() {
  if (options_.shm_socket.empty()) return absl::OkStatus();
  const ModelSpec& spec = source_->spec();
  ShmServer::Options so;
  so.socket_path = options_.shm_socket;
  so.hidden = spec.hidden;
  so.num_layers = spec.num_layers;
  so.num_experts = spec.num_experts;
  so.slice = options_.slice;
  so.hosted = [this](int e) { return store_->HostsExpert(e); };
  so.model = identity_;
  so.allowed_uids = options_.shm_allowed_uids;
  so.max_slot_tokens = static_cast<uint32_t>(options_.max_tokens);
  if (store_->shared_fd() >= 0) {
    so.shared_store_fd = store_->shared_fd();
    so.shared_store_info = store_->SharedInfo();
  }
  so.idle_spin = std::chrono::microseconds(std::max<int64_t>(options_.idle_spin_us, 100));
  so.on_poll = [this](std::chrono::steady_clock::time_point until) { pool_->KeepHotUntil(until); };
  so.max_polling = options_.max_polling;
  so.on_request = [this](const ShmRequestRecord& r) {
    metrics_->RecordRequest(ExpertServerMetrics::Transport::kShm, r.code, r.bytes_received, r.bytes_sent,
                            r.handle_ns);
  };
  absl::StatusOr<std::unique_ptr<ShmServer>> shm = ShmServer::Start(
      so, [this](const MoeBatch& b, bf16_t* out) { return Compute(b, DType::kBF16, out, nullptr); });
  if (!shm.ok()) return absl::Status(shm.status().code(), absl::StrCat("--shm-socket: ", shm.status().message()));
  shm_ = *std::move(shm);
  LogInfo("server", "serving shared memory on unix://", options_.shm_socket);
  return absl::OkStatus();
}

// Registers what this server hosts; heartbeats carry the in-flight count.
absl::Status ExpertServer::StartCoordinatorAgent() {
  if (options_.coordinator.empty()) return absl::OkStatus();
  const ModelSpec& spec = source_->spec();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  ExpertServerRegistration reg;
  reg.server_id = options_.server_id.empty() ? absl::StrCat(host, ":", grpc_.port) : options_.server_id;
  reg.address = grpc_.address;
  reg.shm_socket = options_.shm_socket;
  reg.numa_node = binding_->node();
  reg.num_layers = spec.num_layers;
  reg.num_experts = spec.num_experts;
  reg.hosted_layers = hosted_.layers;
  reg.hosted_experts = hosted_.experts;
  reg.slice = options_.slice;
  reg.weight_bytes = store_->resident_bytes();
  reg.kernel = kernel_->name();
  reg.model = identity_;
  reg.model_type = spec.model_type;
  reg.weight_format = std::string(WeightFormatName(geometry_.format));
  absl::StatusOr<std::unique_ptr<ExpertServerAgent>> agent = ExpertServerAgent::Start(
      options_.coordinator, options_.service.tls, reg, [this] { return in_flight_.load(std::memory_order_relaxed); });
  if (!agent.ok())
    return absl::Status(agent.status().code(), absl::StrCat("--coordinator: ", agent.status().message()));
  agent_ = *std::move(agent);
  LogInfo("server", "coordinator ", options_.coordinator, " as ", reg.server_id);
  return absl::OkStatus();
}

void ExpertServer::Stop(std::chrono::seconds drain) {
  if (stopped_) return;
  stopped_ = true;
  if (shm_) shm_->Stop();
  if (service_) service_->Drain();
  if (grpc_.server) grpc_.Stop(drain);
  agent_.reset();
  metrics_http_.reset();
}

}  // namespace moe
