// moe-gpu-worker: a GPU worker process — the expert cache on a device
// backend (cuda, or cpu without a GPU), misses shipped to CPU expert servers —
// serving moe.v1.WorkerService.ForwardLayer over gRPC for engines that do not
// link the client library, plus health and reflection.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "moe/engine.h"
#include "core/flags.h"
#include "core/log.h"
#include "process/service_main.h"
#include "core/metrics.h"
#include "process/metrics_http.h"
#include "coordinator/agent/coordinator_agent.h"
#include "transport/grpc_channel.h"
#include "expert_compute/expert_store.h"
#include "gpu_worker/worker_service.h"
#include "gpu_worker/worker_sessions.h"

namespace {

struct WorkerFlags {
  moe::SessionOptions session;
  std::string listen = moe::LoopbackListen(50061);
  std::string coordinator, worker_id;
  moe::ServiceFlags service;
  int gpus = 1;
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

// The command line as WorkerFlags; exits 2 with one line on a bad flag.
// Long: one definition per flag (with its help text), then the checks.
WorkerFlags ParseFlags(moe::FlagSet& flags, int argc, char** argv) {
  WorkerFlags f;
  moe::SessionOptions& o = f.session;
  std::string servers_flag, layers_flag, device = "auto", policy, copy_mode = "auto", weight_dtype = "auto";
  int64_t cache_experts = 0, max_tokens = 1024, max_top_k = 8, cpu_threads = 0, deadline_ms = 30000, server_deadline_ms = 10000, grpc_streams = 8,
          tp_rank = 0, tp_size = 1, gpus = 1;
  // --policy shows no default in --help: "" means predictive, said in its text.
  flags.String("model", &o.model, "checkpoint directory, FILE.gguf or synthetic:PRESET[:layers=N][:seed=S][:dtype=D][:group=G] (the servers' model)");
  flags.String("servers", &servers_flag,
               "expert servers, comma list of unix:///path.sock or host:port, each optionally #experts=LIST");
  flags.String("device", &device, "device backend: auto (cuda if a GPU is usable, else cpu), cuda or cpu");
  flags.Int("cache-experts-per-layer", &cache_experts, "cache slots per MoE layer (C)");
  flags.Double("cache-gib", &o.cache_gib,
               "GPU memory for the cache, when --cache-experts-per-layer is 0. Beside it the worker takes\n"
               "      buffers for copied experts (2 x 4-16 experts, 256 MiB for small ones, and 16 for decode's\n"
               "      device path) and for a prompt's prefetch of the next layer's experts (2 x 1 GiB, at least\n"
               "      2 x 4 experts; fewer, or none, when the cache fills the device)");
  flags.String("policy", &policy,
               "cache policy: predictive (cost-model admissions with cross-layer prefetch, inside the\n"
               "      coordinator's placement), lru, lfru or static (placed by the coordinator / ApplyAssignment); "
               "default: predictive (with --coordinator: inside its placement, never evicting the\n"
               "      operator's pins)");
  flags.String("coordinator", &f.coordinator, "coordinator address host:port: register, receive cache placements, report stats");
  flags.String("worker-id", &f.worker_id, "stable id of this worker at the coordinator (default: HOSTNAME:PORT)");
  flags.String("copy-mode", &copy_mode,
               "uncached experts: auto (copy to the GPU when measured rates say it pays), never, always");
  flags.String("layers", &layers_flag, "MoE layers served (default: all)");
  flags.Int("tp-size", &tp_size,
            "tensor parallelism: GPUs that each see every token and whose engine sums their outputs; this worker "
            "computes and caches only its rank's experts (1..1024, at most the model's experts; default 1: every expert)");
  flags.Int("tp-rank", &tp_rank, "tensor parallelism: this worker's rank in [0, --tp-size)");
  flags.Int("gpus", &gpus,
            "GPUs this worker drives (0..N-1; default 1: the current one): N > 1 holds one cache over them (each GPU\n"
            "      its share of the experts, --cache-* per GPU), splits each micro-batch's tokens across them and\n"
            "      exchanges the tokens of a peer GPU's experts over NCCL; a GPU silent past --deadline-ms is left\n"
            "      (its experts become CPU misses)");
  flags.String("weight-dtype", &weight_dtype,
               "precision of the host copy and the GPU cache: auto (the same-host servers' when shared, else the "
               "checkpoint's: fp8 -> fp8, exact; int4 -> int4 (its own codes, exact); mxfp4 -> mxfp4, exact; else bf16), "
               "bf16, int8, int4, "
               "fp8 (an fp8 checkpoint's own codes and block scales) or mxfp4 (OCP MXFP4, 4.25 bits per weight)");
  flags.Bool("share-host-copy", &o.share_host_copy,
             "map the same-host (unix://) servers' packed experts read-only instead of keeping an own host copy, "
             "when they cover the served layers (default true)");
  flags.Bool("fill-cache", &o.fill_cache,
             "fill the cache's empty slots at start with each layer's first experts (copied before the worker\n"
             "      serves: hits from the first call; the policy, or the coordinator's placement, replaces them;\n"
             "      not under --policy=static) (default true)");
  flags.Int("max-tokens", &max_tokens, "largest number of tokens of one micro-batch");
  flags.Int("max-top-k", &max_top_k, "largest k of the routing");
  flags.Int("cpu-threads", &cpu_threads, "cpu backend: compute threads (0 = all)");
  flags.Int("deadline-ms", &deadline_ms, "per-call deadline for the expert servers");
  flags.Int("server-deadline-ms", &server_deadline_ms,
            "a server silent this long on one batch has failed: the batch goes to another server holding its "
            "experts (or the device) within --deadline-ms");
  flags.Int("grpc-streams", &grpc_streams, "ForwardStreams per host:port expert server, each on a TCP connection of its own (1..64; default 8): a batch goes to the first idle one, and one of 96 KB or more (7 tokens at H = 7168) is striped over several at once, since one gRPC connection moves only ~1-1.5 GB/s");
  flags.String("listen", &f.listen,
               "gRPC address to listen on (loopback by default; port 0 picks a free port; a port another process "
               "holds refuses the start)");
  f.service.Register(flags, "expert servers and the coordinator");
  flags.Parse(argc, argv);
  if (o.model.empty()) flags.Fail("--model is required (see --help)");
  if (servers_flag.empty()) flags.Fail("--servers is required (see --help)");
  if (absl::Status st = moe::CheckListenAddress(f.listen); !st.ok()) flags.Fail(std::string(st.message()));
  auto choice = [&flags](auto parsed) {  // one line naming the flag on a bad name
    if (!parsed.ok()) flags.Fail(std::string(parsed.status().message()));
    return *parsed;
  };
  o.device = choice(moe::ParseDeviceChoice(device, "--device"));
  o.policy = choice(moe::ParseCachePolicy(policy.empty() ? "predictive" : policy, "--policy"));
  o.copy_mode = choice(moe::ParseCopyMode(copy_mode, "--copy-mode"));
  o.weight_dtype = choice(moe::ParseWeightDtype(weight_dtype, "--weight-dtype"));
  if (absl::Status st = f.service.Validate(); !st.ok()) flags.Fail(std::string(st.message()));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(f.service.tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));
  f.credentials = *creds;
  for (absl::string_view s : absl::StrSplit(servers_flag, ',')) {
    if (s.empty())
      flags.Fail(absl::StrCat("--servers: '", servers_flag, "' has an empty entry (a comma list of host:port or unix://PATH)"));
    o.servers.emplace_back(s);
  }
  o.cache_experts_per_layer = static_cast<int>(cache_experts);
  o.max_tokens = static_cast<int>(max_tokens);
  o.max_top_k = static_cast<int>(max_top_k);
  o.cpu_threads = static_cast<int>(cpu_threads);
  o.deadline = std::chrono::milliseconds(deadline_ms);
  o.server_deadline = std::chrono::milliseconds(server_deadline_ms);
  if (grpc_streams < 1 || grpc_streams > 64) flags.Fail("--grpc-streams: " + std::to_string(grpc_streams) + " (1..64)");
  o.grpc_streams = static_cast<int>(grpc_streams);
  if (tp_size < 1 || tp_size > 1024 || tp_rank < 0 || tp_rank >= tp_size)
    flags.Fail("--tp-rank/--tp-size: need 0 <= rank < size <= 1024, got " + std::to_string(tp_rank) + "/" +
               std::to_string(tp_size));
  o.group = moe::TensorParallel(static_cast<int>(tp_rank), static_cast<int>(tp_size));
  if (gpus < 1 || gpus > 64) flags.Fail("--gpus: " + std::to_string(gpus) + " (1..64)");
  if (gpus > 1 && tp_size > 1) flags.Fail("--gpus and --tp-size: a multi-GPU worker is its own group");
  f.gpus = static_cast<int>(gpus);
  o.tls = f.service.tls;
  if (!layers_flag.empty()) {
    absl::StatusOr<std::vector<int>> layers = moe::ParseIndexList(layers_flag, 1 << 20, "layers");
    if (!layers.ok()) flags.Fail(std::string(layers.status().message()));
    o.layers = *layers;
  }
  return f;
}

// Routes the session's access and cache-activity callbacks to the worker's
// metrics and coordinator agent once they exist (the session calls them from
// its own threads, so both are published with release stores).
struct SessionHooks {
  std::atomic<moe::CoordinatorAgent*> agent{nullptr};
  std::atomic<moe::WorkerMetrics*> metrics{nullptr};

  void Install(moe::SessionOptions& o, bool with_coordinator) {
    if (with_coordinator)
      o.on_access = [this](int layer, int expert, int pairs, bool hit) {
        if (moe::CoordinatorAgent* a = agent.load(std::memory_order_acquire))
          a->RecordAccess(layer, expert, static_cast<uint64_t>(pairs), hit);
      };
    o.on_activity = [this](int layer, const moe::LayerActivity& activity) {
      if (moe::WorkerMetrics* m = metrics.load(std::memory_order_acquire)) m->RecordActivity(layer, activity);
      if (moe::CoordinatorAgent* a = agent.load(std::memory_order_acquire)) a->RecordLayerActivity(layer, activity);
    };
  }
};

// The worker at the coordinator: registered with what it caches, placements
// handed to the service (applied between calls by a thread that ticks it every
// 20 ms), access counts reported through the hooks. Destroying it stops the
// ticker, unhooks the agent and leaves the coordinator.
class CoordinatorLink {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorLink>> Start(const WorkerFlags& f, const moe::WorkerSessions& sessions,
                                                               const std::vector<int>& served,
                                                               const moe::ListeningServer& grpc,
                                                               moe::WorkerServiceImpl& service, SessionHooks& hooks) {
    const moe::ModelInfo& spec = sessions.primary().model_info();
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    moe::WorkerRegistration reg;
    reg.worker_id = f.worker_id.empty() ? absl::StrCat(host, ":", grpc.port) : f.worker_id;
    reg.address = grpc.address;
    reg.num_layers = spec.num_layers;
    reg.num_experts = spec.num_experts;
    reg.slots_per_layer = sessions.slots_per_layer();  // a multi-GPU worker: its GPUs' union
    reg.expert_bytes = spec.expert_bytes;
    reg.cached_layers = served;
    reg.group = f.session.group;
    reg.top_k = f.session.max_top_k;  // routed experts per token never exceed it (WorkerService refuses more)
    reg.model = moe::ModelIdentity{spec.identity, f.session.model};
    absl::StatusOr<std::unique_ptr<moe::CoordinatorAgent>> agent = moe::CoordinatorAgent::Start(
        f.coordinator, f.service.tls, reg, [&service](const moe::AssignmentUpdate& u) { service.OnAssignment(u); });
    if (!agent.ok()) return agent.status();
    std::unique_ptr<CoordinatorLink> link(new CoordinatorLink(*std::move(agent), hooks));
    service.SetAgent(link->agent_.get());
    hooks.agent.store(link->agent_.get(), std::memory_order_release);
    link->ticker_ = std::thread([&service, stop = &link->stop_] {
      while (!stop->load()) {
        service.Tick();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    moe::LogInfo("worker", "coordinator ", f.coordinator, " as ", reg.worker_id);
    return link;
  }

  ~CoordinatorLink() {
    stop_ = true;
    if (ticker_.joinable()) ticker_.join();
    hooks_.agent.store(nullptr);
  }

 private:
  CoordinatorLink(std::unique_ptr<moe::CoordinatorAgent> agent, SessionHooks& hooks)
      : agent_(std::move(agent)), hooks_(hooks) {}

  std::unique_ptr<moe::CoordinatorAgent> agent_;
  SessionHooks& hooks_;
  std::atomic<bool> stop_{false};
  std::thread ticker_;
};

}  // namespace

int main(int argc, char** argv) {
  moe::FlagSet flags("moe-gpu-worker",
                     "--model DIR|synthetic:PRESET --servers ADDR[,ADDR...] [--cache-experts-per-layer C] [flags]\n"
                     "Runs an MoE model's experts from a GPU cache of hot experts, shipping the misses to CPU\n"
                     "expert servers (unix:///socket = shared memory on this host, host:port = gRPC), and serves\n"
                     "moe.v1.WorkerService.ForwardLayer.");
  WorkerFlags f = ParseFlags(flags, argc, argv);
  moe::BlockTerminationSignals();

  SessionHooks hooks;
  hooks.Install(f.session, !f.coordinator.empty());
  absl::StatusOr<std::unique_ptr<moe::WorkerSessions>> sessions = moe::WorkerSessions::Open(f.session, f.gpus);
  if (!sessions.ok()) flags.Fail(std::string(sessions.status().message()), 1);
  moe::LogInfo("worker", (*sessions)->primary().admin().Describe(),
               f.gpus > 1 ? absl::StrCat("; x ", f.gpus, " GPUs, one cache (expert-parallel)") : std::string());

  const moe::SessionOptions& o = f.session;
  const moe::ModelInfo& spec = (*sessions)->primary().model_info();
  const std::vector<int> served = (*sessions)->primary().served_layers();
  moe::WorkerMetrics metrics(moe::Metrics(), served, spec.num_layers);
  hooks.metrics.store(&metrics, std::memory_order_release);
  std::mutex mu;
  // The planner's learned rates, read at each scrape between calls (the
  // session is used under `mu`).
  const moe::MetricsRegistry::Hook planner_rates = moe::Metrics().AddScrapeHook([&] {
    std::lock_guard<std::mutex> lock(mu);
    metrics.SetPlannerRates((*sessions)->primary().admin().PlannerRates());
  });
  moe::WorkerServiceImpl service(**sessions, mu, moe::Name(o.policy), o.servers, moe::WorkerLimits{o.max_tokens, o.max_top_k},
                                 &metrics);
  const uint64_t max_msg = 2ull * o.max_tokens * (2ull * spec.hidden + 8 * o.max_top_k) + (1 << 20);
  absl::StatusOr<moe::ListeningServer> grpc = moe::ServeGrpc({f.listen, f.credentials, max_msg, {&service}});
  if (!grpc.ok()) flags.Fail(std::string(grpc.status().message()), 1);

  // Coordinator: register, receive placements (applied between calls), report access counts.
  std::unique_ptr<CoordinatorLink> link;
  if (!f.coordinator.empty()) {
    absl::StatusOr<std::unique_ptr<CoordinatorLink>> l = CoordinatorLink::Start(f, **sessions, served, *grpc, service, hooks);
    if (!l.ok()) flags.Fail(absl::StrCat("--coordinator: ", l.status().message()), 1);
    link = *std::move(l);
  }
  absl::StatusOr<std::unique_ptr<moe::MetricsHttpServer>> metrics_http = moe::StartMetricsEndpoint("worker", f.service);
  if (!metrics_http.ok()) flags.Fail(std::string(metrics_http.status().message()), 1);
  moe::AnnounceReady("moe-gpu-worker", grpc->address, f.service, metrics_http->get());

  const int sig = moe::WaitForTerminationSignal();
  moe::LogInfo("worker", "signal ", sig, ": shutting down");
  grpc->Stop(std::chrono::seconds(5));
  link.reset();
  return 0;
}
