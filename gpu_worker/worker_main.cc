// moe-gpu-worker: a GPU worker process — the expert cache on a device
// backend (cuda, or cpu without a GPU), misses shipped to CPU expert servers —
// serving moe.v1.WorkerService.ForwardLayer over gRPC for engines that do not
// link the client library, plus health and reflection.
#include <signal.h>

#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "moe/engine.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/service_main.h"
#include "core/metrics.h"
#include "core/metrics_http.h"
#include "coordinator/agent/coordinator_agent.h"
#include "core/transport/grpc_channel.h"
#include "gpu_worker/worker_service.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

int main(int argc, char** argv) {
  std::string model, servers_flag, device = "auto", policy, copy_mode = "auto", layers_flag;
  std::string listen = moe::LoopbackListen(50061), coordinator, worker_id;
  int64_t cache_experts = 0, max_tokens = 1024, max_top_k = 8, cpu_threads = 0, deadline_ms = 30000;
  double cache_gib = 0;
  moe::FlagSet flags("moe-gpu-worker",
                     "--model DIR|synthetic:PRESET --servers ADDR[,ADDR...] [--cache-experts-per-layer C] [flags]\n"
                     "Runs an MoE model's experts from a GPU cache of hot experts, shipping the misses to CPU\n"
                     "expert servers (unix:///socket = shared memory on this host, host:port = gRPC), and serves\n"
                     "moe.v1.WorkerService.ForwardLayer.");
  flags.String("model", &model, "checkpoint directory or synthetic:PRESET[:layers=N][:seed=S] (the servers' model)");
  flags.String("servers", &servers_flag,
               "expert servers, comma list of unix:///path.sock or host:port, each optionally #experts=LIST");
  flags.String("device", &device, "device backend: auto (cuda if a GPU is usable, else cpu), cuda or cpu");
  flags.Int("cache-experts-per-layer", &cache_experts, "cache slots per MoE layer (C)");
  flags.Double("cache-gib", &cache_gib, "GPU memory for the cache, when --cache-experts-per-layer is 0");
  flags.String("policy", &policy,
               "cache policy: predictive (cost-model admissions with cross-layer prefetch, inside the\n"
               "      coordinator's placement), lru, lfru or static (placed by the coordinator / ApplyAssignment); "
               "default: predictive (with --coordinator: inside its placement, never evicting the\n"
               "      operator's pins)");
  flags.String("coordinator", &coordinator, "coordinator address host:port: register, receive cache placements, report stats");
  flags.String("worker-id", &worker_id, "stable id of this worker at the coordinator (default: HOSTNAME:PORT)");
  flags.String("copy-mode", &copy_mode,
               "uncached experts: auto (copy to the GPU when measured rates say it pays), never, always");
  flags.String("layers", &layers_flag, "MoE layers served (default: all)");
  flags.Int("max-tokens", &max_tokens, "largest number of tokens of one micro-batch");
  flags.Int("max-top-k", &max_top_k, "largest k of the routing");
  flags.Int("cpu-threads", &cpu_threads, "cpu backend: compute threads (0 = all)");
  flags.Int("deadline-ms", &deadline_ms, "per-call deadline for the expert servers");
  flags.String("listen", &listen,
               "gRPC address to listen on (loopback by default; port 0 picks a free port; a port another process "
               "holds refuses the start)");
  moe::ServiceFlags service_flags;
  service_flags.Register(flags, "expert servers and the coordinator");
  flags.Parse(argc, argv);
  if (model.empty()) flags.Fail("--model is required (see --help)");
  if (servers_flag.empty()) flags.Fail("--servers is required (see --help)");
  if (policy.empty()) policy = "predictive";
  if (absl::Status st = service_flags.Validate(); !st.ok()) flags.Fail(std::string(st.message()));
  const moe::TlsOptions& tls = service_flags.tls;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));

  sigset_t term = moe::BlockTerminationSignals();

  moe::SessionOptions o;
  o.model = model;
  for (absl::string_view s : absl::StrSplit(servers_flag, ',', absl::SkipEmpty())) o.servers.emplace_back(s);
  o.device = device;
  o.cache_experts_per_layer = static_cast<int>(cache_experts);
  o.cache_gib = cache_gib;
  o.policy = policy;
  o.copy_mode = copy_mode;
  o.max_tokens = static_cast<int>(max_tokens);
  o.max_top_k = static_cast<int>(max_top_k);
  o.cpu_threads = static_cast<int>(cpu_threads);
  o.deadline = std::chrono::milliseconds(deadline_ms);
  o.tls = tls;
  if (!layers_flag.empty()) {
    absl::StatusOr<std::vector<int>> layers = moe::ParseIndexList(layers_flag, 1 << 20, "layers");
    if (!layers.ok()) flags.Fail(std::string(layers.status().message()));
    o.layers = *layers;
  }
  std::atomic<moe::CoordinatorAgent*> agent_ptr{nullptr};
  if (!coordinator.empty())
    o.on_access = [&agent_ptr](int layer, int expert, int pairs, bool hit) {
      if (moe::CoordinatorAgent* a = agent_ptr.load(std::memory_order_acquire))
        a->RecordAccess(layer, expert, static_cast<uint64_t>(pairs), hit);
    };
  std::atomic<moe::WorkerMetrics*> metrics_ptr{nullptr};
  o.on_cache_activity = [&agent_ptr, &metrics_ptr](int layer, uint64_t copies, uint64_t bytes, uint64_t predicted,
                                                   uint64_t used) {
    if (moe::WorkerMetrics* m = metrics_ptr.load(std::memory_order_acquire))
      m->RecordCacheActivity(layer, copies, bytes, predicted, used);
    if (moe::CoordinatorAgent* a = agent_ptr.load(std::memory_order_acquire))
      a->RecordLayerActivity(layer, copies, bytes, predicted, used);
  };
  absl::StatusOr<std::unique_ptr<moe::MoeSession>> session = moe::MoeSession::Open(o);
  if (!session.ok()) flags.Fail(std::string(session.status().message()), 1);
  moe::LogInfo("worker", (*session)->Describe());

  const moe::ModelInfo& spec = (*session)->model();
  const std::vector<int> served = o.layers.empty() ? spec.moe_layers : o.layers;
  moe::WorkerMetrics metrics(moe::Metrics(), served, spec.num_layers);
  metrics_ptr.store(&metrics, std::memory_order_release);
  std::mutex mu;
  moe::WorkerServiceImpl service(**session, mu, policy, o.servers,
                                 moe::WorkerLimits{o.max_tokens, o.max_top_k}, &metrics);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  const uint64_t max_msg = 2ull * max_tokens * (2ull * (*session)->model().hidden + 8 * max_top_k) + (1 << 20);
  moe::ConfigureServerBuilder(builder, max_msg);
  absl::StatusOr<moe::ListeningServer> listening = moe::StartGrpcServer(builder, listen, *creds);
  if (!listening.ok()) flags.Fail(std::string(listening.status().message()), 1);
  std::unique_ptr<grpc::Server> server = std::move(listening->server);
  const int port = listening->port;
  const std::string bound = listening->address;

  // Coordinator: register, receive placements (applied between calls), report access counts.
  std::unique_ptr<moe::CoordinatorAgent> agent;
  std::atomic<bool> stop{false};
  std::thread ticker;
  if (!coordinator.empty()) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    moe::WorkerRegistration reg;
    reg.worker_id = worker_id.empty() ? absl::StrCat(host, ":", port) : worker_id;
    reg.address = bound;
    reg.num_layers = spec.num_layers;
    reg.num_experts = spec.num_experts;
    reg.slots_per_layer = (*session)->slots_per_layer();
    reg.expert_bytes = 6ull * spec.hidden * spec.intermediate;  // gate, up, down in bf16
    reg.cached_layers = served;
    absl::StatusOr<std::unique_ptr<moe::CoordinatorAgent>> a = moe::CoordinatorAgent::Start(
        coordinator, tls, reg, [&service](const moe::AssignmentUpdate& u) { service.OnAssignment(u); });
    if (!a.ok()) flags.Fail(absl::StrCat("--coordinator: ", a.status().message()), 1);
    agent = *std::move(a);
    service.SetAgent(agent.get());
    agent_ptr.store(agent.get(), std::memory_order_release);
    ticker = std::thread([&] {
      while (!stop.load()) {
        service.Tick();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    moe::LogInfo("worker", "coordinator ", coordinator, " as ", reg.worker_id);
  }
  absl::StatusOr<std::unique_ptr<moe::MetricsHttpServer>> metrics_started =
      moe::StartMetricsEndpoint("worker", service_flags);
  if (!metrics_started.ok()) flags.Fail(std::string(metrics_started.status().message()), 1);
  std::unique_ptr<moe::MetricsHttpServer> metrics_http = *std::move(metrics_started);
  std::printf("moe-gpu-worker ready on %s\n", bound.c_str());
  if (metrics_http) std::printf("moe-gpu-worker metrics on %s:%d\n", service_flags.metrics_address.c_str(), metrics_http->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&term, &sig);
  moe::LogInfo("worker", "signal ", sig, ": shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  stop = true;
  if (ticker.joinable()) ticker.join();
  agent_ptr.store(nullptr);
  agent.reset();
  return 0;
}
