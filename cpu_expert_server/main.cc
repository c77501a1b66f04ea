// moe-expert-server: serves the experts of an MoE model from CPU memory over
// gRPC (moe.v1.ExpertService, grpc.health.v1.Health, server reflection),
// optionally over shared memory (--shm-socket), with Prometheus metrics on
// --metrics-port.
#include <signal.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/service_main.h"
#include "core/metrics.h"
#include "core/metrics_http.h"
#include "core/model_source.h"
#include "core/transport/grpc_channel.h"
#include "core/transport/shm_server.h"
#include "core/wire.h"
#include "coordinator/agent/coordinator_agent.h"
#include "cpu_compute/compute_pool.h"
#include "cpu_compute/cpu_features.h"
#include "cpu_compute/expert_kernel.h"
#include "cpu_expert_server/expert_metrics.h"
#include "cpu_expert_server/expert_service.h"
#include "cpu_compute/expert_store.h"
#include "cpu_compute/moe_executor.h"
#include "cpu_compute/numa_binding.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace {

std::string RangeText(const std::vector<int>& v) {
  if (v.empty()) return "none";
  std::string out;
  size_t i = 0;
  while (i < v.size()) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? absl::StrCat(v[i]) : absl::StrCat(v[i], "-", v[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, listen = moe::LoopbackListen(50051), layers_flag, experts_flag, numa = "auto", kernel_name = "auto";
  std::string shm_socket, shm_uids, coordinator, server_id;
  int64_t threads = 0, max_tokens = 8192, drain_seconds = 30, idle_spin_us = 50;
  moe::FlagSet flags("moe-expert-server",
                     "--model DIR|synthetic:PRESET[:layers=N][:seed=S] [--listen ADDR] [flags]\n"
                     "Serves the routed experts of an MoE model from CPU memory (moe.v1.ExpertService).");
  flags.String("model", &model, "checkpoint directory (config.json + safetensors) or synthetic:PRESET[:layers=N][:seed=S]");
  flags.String("listen", &listen,
               "gRPC address to listen on, host:port (loopback by default; port 0 picks a free port; a port "
               "another process holds refuses the start)");
  flags.String("layers", &layers_flag, "MoE layers to host, e.g. 3-10,12 (model layer indexes; default: all)");
  flags.String("experts", &experts_flag, "experts to host in every hosted layer, e.g. 0-63 (default: all)");
  flags.Int("threads", &threads, "compute threads (0 = one per core of the NUMA node)");
  flags.String("numa-node", &numa, "NUMA node for threads and weight memory: auto (node of the first allowed CPU) or an index");
  flags.Int("idle-spin-us", &idle_spin_us,
            "how long idle compute threads (and shm connections) spin for the next batch before sleeping; "
            "a server dedicated to decode keeps its threads hot between layers with e.g. 2000");
  flags.String("kernel", &kernel_name, "expert kernel: auto, amx, avx512 or reference");
  flags.Int("max-tokens", &max_tokens, "largest number of tokens accepted in one request");
  flags.Int("drain-seconds", &drain_seconds, "on SIGTERM/SIGINT, how long in-flight requests may take to finish");
  flags.String("shm-socket", &shm_socket, "also serve same-host clients over shared memory on this Unix socket (mode 0660)");
  flags.String("shm-allow-uids", &shm_uids, "uids allowed on the shm socket, comma list (default: this process's uid)");
  flags.String("coordinator", &coordinator, "coordinator address host:port: register what this server hosts and heartbeat");
  flags.String("server-id", &server_id, "stable id of this server at the coordinator (default: HOSTNAME:PORT)");
  moe::ServiceFlags service_flags;
  service_flags.Register(flags);
  flags.Parse(argc, argv);
  if (model.empty()) flags.Fail("--model is required (see --help)");
  const moe::TlsOptions& tls = service_flags.tls;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));
  std::vector<uid_t> allowed_uids;
  if (!shm_uids.empty()) {
    absl::StatusOr<std::vector<int>> uids = moe::ParseIndexList(shm_uids, 1 << 30, "shm-allow-uids");
    if (!uids.ok()) flags.Fail(std::string(uids.status().message()));
    allowed_uids.assign(uids->begin(), uids->end());
  }
  if (max_tokens <= 0) flags.Fail("--max-tokens must be > 0");
  if (absl::Status st = service_flags.Validate(); !st.ok()) flags.Fail(std::string(st.message()));

  // Block termination signals in every thread; main waits for them with sigwait.
  sigset_t term = moe::BlockTerminationSignals();

  const moe::CpuFeatures& cpu = moe::CpuFeatures::Get();
  absl::StatusOr<std::unique_ptr<moe::ModelSource>> source = moe::OpenModel(model);
  if (!source.ok()) flags.Fail(std::string(source.status().message()), 1);
  const moe::ModelSpec& spec = (*source)->spec();
  absl::StatusOr<std::vector<int>> layers = moe::ParseIndexList(layers_flag, spec.num_layers, "layers");
  if (!layers.ok()) flags.Fail(std::string(layers.status().message()));
  absl::StatusOr<std::vector<int>> experts = moe::ParseIndexList(experts_flag, spec.num_experts, "experts");
  if (!experts.ok()) flags.Fail(std::string(experts.status().message()));
  moe::HostedSet hosted;
  hosted.layers = layers_flag.empty() ? spec.moe_layers : *layers;
  if (experts_flag.empty()) {
    for (int e = 0; e < spec.num_experts; ++e) hosted.experts.push_back(e);
  } else {
    hosted.experts = *experts;
  }
  absl::StatusOr<std::unique_ptr<moe::ExpertKernel>> kernel = moe::MakeExpertKernel(kernel_name, cpu);
  if (!kernel.ok()) flags.Fail(std::string(kernel.status().message()));
  absl::StatusOr<std::unique_ptr<moe::NumaBinding>> binding =
      moe::NumaBinding::Create(numa, static_cast<int>(threads));
  if (!binding.ok()) flags.Fail(std::string(binding.status().message()));

  moe::LogInfo("server", "model ", (*source)->Describe(), ": ", spec.Summary());
  moe::LogInfo("server", (*binding)->Describe());
  moe::LogInfo("server", "cpu: ", cpu.brand, "; isa: ", cpu.Summary(), "; kernel: ", (*kernel)->name());
  const auto geometry = moe::ExpertGeometry::For(spec.hidden, spec.intermediate);
  moe::LogInfo("server", "hosting layers [", RangeText(hosted.layers), "] experts [", RangeText(hosted.experts),
               "]: ", moe::ExpertStore::BytesNeeded(geometry, hosted), " bytes of packed weights");

  if (idle_spin_us < 0 || idle_spin_us > 1000000) flags.Fail("--idle-spin-us must be in [0, 1000000]");
  moe::ComputePool pool(**binding, std::chrono::microseconds(idle_spin_us));
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<moe::ExpertStore>> store = moe::ExpertStore::Load(**source, hosted, **binding, pool);
  if (!store.ok()) flags.Fail(std::string(store.status().message()), 1);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  moe::LogInfo("server", "weights resident: ", (*store)->resident_bytes(), " bytes (",
               (*store)->resident_bytes() >> 20, " MiB) on NUMA node ", (*binding)->node(), ", packed in ", load_s, " s");

  moe::MoeExecutor executor(**store, **kernel, pool);
  moe::ExpertServerMetrics metrics(moe::Metrics(), hosted.layers);
  metrics.SetComputeThreads(pool.size());
  metrics.SetWeightBytes((*store)->resident_bytes());
  // The one compute path of both transports, recorded once here.
  std::atomic<uint32_t> in_flight{0};
  auto compute = [&executor, &metrics, &in_flight](const moe::ForwardBatch& b, moe::DType dt, void* out,
                                                   moe::ForwardStats* stats) {
    moe::ForwardStats local;
    if (stats == nullptr) stats = &local;
    metrics.BatchStarted();
    in_flight.fetch_add(1, std::memory_order_relaxed);
    absl::Status st = executor.Forward(b, dt, out, stats);
    in_flight.fetch_sub(1, std::memory_order_relaxed);
    metrics.BatchFinished();
    if (st.ok()) metrics.RecordCompute(b.layer, b.n, *stats);
    return st;
  };
  moe::ServiceLimits limits;
  limits.max_tokens_per_request = static_cast<int>(max_tokens);
  const uint64_t max_msg = moe::MaxMessageBytes(spec, limits);

  moe::v1::ServerInfo info;
  moe::ModelSpecToProto(spec, info.mutable_model());
  for (int l : hosted.layers) info.add_hosted_layers(l);
  for (int e : hosted.experts) info.add_hosted_experts(e);
  info.set_kernel(std::string((*kernel)->name()));
  info.set_isa(cpu.Summary());
  info.set_threads(pool.size());
  info.mutable_numa()->set_node((*binding)->node());
  info.mutable_numa()->set_num_nodes((*binding)->num_nodes());
  for (int c : (*binding)->cpus()) info.mutable_numa()->add_cpus(c);
  info.set_weight_bytes((*store)->resident_bytes());
  info.set_max_tokens_per_request(static_cast<uint32_t>(max_tokens));
  info.set_max_message_bytes(max_msg);
  info.set_version(MOE_VERSION);

  moe::ExpertServiceImpl service(spec, compute, limits, info, &metrics);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  moe::ConfigureServerBuilder(builder, max_msg);
  absl::StatusOr<moe::ListeningServer> listening = moe::StartGrpcServer(builder, listen, *creds);
  if (!listening.ok()) flags.Fail(std::string(listening.status().message()), 1);
  std::unique_ptr<grpc::Server> server = std::move(listening->server);
  const int port = listening->port;
  const std::string bound = listening->address;
  moe::LogInfo("server", "serving moe.v1.ExpertService on ", bound, " (max message ", max_msg, " bytes)");
  std::unique_ptr<moe::ShmServer> shm;
  if (!shm_socket.empty()) {
    moe::ShmServer::Options so;
    so.socket_path = shm_socket;
    so.hidden = spec.hidden;
    so.num_layers = spec.num_layers;
    so.num_experts = spec.num_experts;
    so.hosted = [&store](int e) { return (*store)->HostsExpert(e); };
    so.allowed_uids = allowed_uids;
    so.max_slot_tokens = static_cast<uint32_t>(max_tokens);
    so.idle_spin = std::chrono::microseconds(std::max<int64_t>(idle_spin_us, 100));
    so.on_request = [&metrics](const moe::ShmRequestRecord& r) {
      metrics.RecordRequest(moe::ExpertServerMetrics::Transport::kShm, r.code, r.bytes_received, r.bytes_sent,
                            r.handle_ns);
    };
    absl::StatusOr<std::unique_ptr<moe::ShmServer>> s = moe::ShmServer::Start(so, [&compute](const moe::MissBatch& b, moe::bf16_t* out) {
      moe::ForwardBatch fb{static_cast<int>(b.layer), b.n, b.tokens, moe::RoutingView{b.n, b.k, b.expert_ids, b.expert_weights}};
      return compute(fb, moe::DType::kBF16, out, nullptr);
    });
    if (!s.ok()) flags.Fail(absl::StrCat("--shm-socket: ", s.status().message()), 1);
    shm = *std::move(s);
    moe::LogInfo("server", "serving shared memory on unix://", shm_socket);
  }
  absl::StatusOr<std::unique_ptr<moe::MetricsHttpServer>> metrics_started =
      moe::StartMetricsEndpoint("server", service_flags);
  if (!metrics_started.ok()) flags.Fail(std::string(metrics_started.status().message()), 1);
  std::unique_ptr<moe::MetricsHttpServer> metrics_http = *std::move(metrics_started);
  // Coordinator: register what this server hosts; heartbeats carry the in-flight count.
  std::unique_ptr<moe::ExpertServerAgent> agent;
  if (!coordinator.empty()) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    moe::ExpertServerRegistration reg;
    reg.server_id = server_id.empty() ? absl::StrCat(host, ":", port) : server_id;
    reg.address = bound;
    reg.shm_socket = shm_socket;
    reg.numa_node = (*binding)->node();
    reg.num_layers = spec.num_layers;
    reg.num_experts = spec.num_experts;
    reg.hosted_layers = hosted.layers;
    reg.hosted_experts = hosted.experts;
    reg.weight_bytes = (*store)->resident_bytes();
    reg.kernel = (*kernel)->name();
    absl::StatusOr<std::unique_ptr<moe::ExpertServerAgent>> a = moe::ExpertServerAgent::Start(
        coordinator, tls, reg, [&in_flight] { return in_flight.load(std::memory_order_relaxed); });
    if (!a.ok()) flags.Fail(absl::StrCat("--coordinator: ", a.status().message()), 1);
    agent = *std::move(a);
    moe::LogInfo("server", "coordinator ", coordinator, " as ", reg.server_id);
  }
  // Line 1 is what scripts and tests wait for; line 2 (only with --metrics-port)
  // names the metrics port, the chosen one when it was 0.
  std::printf("moe-expert-server ready on %s\n", bound.c_str());
  if (metrics_http) std::printf("moe-expert-server metrics on %s:%d\n", service_flags.metrics_address.c_str(), metrics_http->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&term, &sig);
  moe::LogInfo("server", "signal ", sig, ": draining in-flight requests (up to ", drain_seconds, " s)");
  if (shm) shm->Stop();
  service.Drain();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(drain_seconds));
  server->Wait();
  agent.reset();
  metrics_http.reset();
  moe::LogInfo("server", "stopped");
  return 0;
}
