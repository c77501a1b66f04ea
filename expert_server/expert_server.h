// ExpertServer: one running CPU expert server — the model source, the packed
// experts it hosts (ExpertStore), the kernel, compute pool and MoeExecutor
// that run them, the gRPC service (moe.v1.ExpertService, health, reflection),
// the optional shared-memory endpoint, the /metrics endpoint and the
// coordinator agent — started from one ExpertServerOptions. moe-expert-server's
// main parses flags into the options, starts it, waits for a termination
// signal and stops it. Start and Stop are called from one thread; the
// accessors may be called from any thread while the server runs.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/agent/coordinator_agent.h"
#include "process/metrics_http.h"
#include "model/model_identity.h"
#include "model/model_source.h"
#include "process/service_main.h"
#include "transport/shm_server.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/moe_executor.h"
#include "expert_compute/numa_binding.h"
#include "expert_server/expert_metrics.h"
#include "expert_server/expert_service.h"

namespace moe {

// What moe-expert-server's flags ask for; each field names its flag. The
// checks that need no model (max_tokens > 0, idle_spin_us range, the TLS
// flags) are main's; Start checks the rest against the model and this machine.
struct ExpertServerOptions {
  std::string model;                      // --model: checkpoint directory, FILE.gguf or synthetic:PRESET...
  std::string listen = LoopbackListen(50051);  // --listen
  std::string layers;                     // --layers text; "" = every MoE layer
  std::string experts;                    // --experts text; "" = every expert
  ExpertSlice slice;                      // --slice i/n; {0, 1} = whole experts
  std::string numa_node = "auto";         // --numa-node
  int threads = 0;                        // --threads; 0 = ChooseDefaultThreads (expert_compute/numa_binding.h)
  std::string kernel = "auto";            // --kernel
  std::string weight_dtype = "auto";      // --weight-dtype
  int64_t idle_spin_us = 50;              // --idle-spin-us
  bool merge_requests = true;             // --merge-requests (MoeExecutor: concurrent requests batched per expert)
  int max_polling = 2;                    // --max-polling-clients (ShmServer::Options::max_polling)
  int max_tokens = 8192;                  // --max-tokens
  std::string shm_socket;                 // --shm-socket; "" = no shared memory
  std::vector<uid_t> shm_allowed_uids;    // --shm-allow-uids; empty = this process's uid
  // --share-weights: with --shm-socket, the packed experts live in a sealed
  // memfd that same-host GPU workers map read-only (one host copy).
  bool share_weights = true;
  std::string coordinator;                // --coordinator; "" = none
  std::string server_id;                  // --server-id; "" = HOSTNAME:PORT
  ServiceFlags service;                   // TLS (served and to the coordinator), metrics endpoint
  std::shared_ptr<grpc::ServerCredentials> credentials;  // MakeServerCredentials(service.tls)
  std::string version;                    // reported in ServerInfo
};

class ExpertServer {
 public:
  // Opens the model, resolves the options against it and this machine, packs
  // the hosted experts and starts serving: gRPC, then shared memory, the
  // metrics endpoint and the coordinator agent, as the options ask. Logs each
  // step. On failure, *option_at_fault (when given) says whether an option
  // did not fit the model or this machine (--layers, --experts, --kernel, --weight-dtype,
  // --numa-node, --threads: main exits 2, as for any bad flag) rather than
  // the model, the memory or the network (main exits 1).
  static absl::StatusOr<std::unique_ptr<ExpertServer>> Start(const ExpertServerOptions& options,
                                                             bool* option_at_fault = nullptr);

  // Stops if Stop was not called, without a drain.
  ~ExpertServer();
  ExpertServer(const ExpertServer&) = delete;
  ExpertServer& operator=(const ExpertServer&) = delete;

  // Stops the shared-memory endpoint, drains the gRPC service (open calls may
  // take up to `drain`), then leaves the coordinator and closes the metrics
  // endpoint. Idempotent.
  void Stop(std::chrono::seconds drain);

  // The gRPC address bound ("host:port", the chosen port when --listen's was 0).
  const std::string& address() const { return grpc_.address; }
  // The metrics endpoint, or nullptr without --metrics-port.
  const MetricsHttpServer* metrics_endpoint() const { return metrics_http_.get(); }
  // What the executor's merging of concurrent requests did (logged at exit).
  MergeStats merge_stats() const { return executor_->merge_stats(); }

 private:
  explicit ExpertServer(const ExpertServerOptions& options);

  // The steps of Start, in order.
  absl::Status OpenModel(bool* option_at_fault);
  absl::Status LoadExperts();
  absl::Status ServeGrpcService();
  absl::Status ServeSharedMemory();
  absl::Status StartCoordinatorAgent();

  // The one compute path of both transports, recorded in metrics_.
  absl::Status Compute(const MoeBatch& batch, DType out_dtype, void* out, ForwardStats* stats);
  // What GetInfo answers.
  moe::v1::ServerInfo Info(uint64_t max_message_bytes) const;

  const ExpertServerOptions options_;
  std::unique_ptr<ModelSource> source_;  // sliced when options_.slice is
  ModelSpec model_spec_;                 // the whole model's (what clients see)
  ModelIdentity identity_;               // the whole model's (model/model_identity.h), told in every handshake
  HostedSet hosted_;
  ExpertGeometry geometry_;  // the packed experts' layout and precision (--weight-dtype)
  std::unique_ptr<ExpertKernel> kernel_;
  std::unique_ptr<NumaBinding> binding_;
  std::unique_ptr<ComputePool> pool_;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<MoeExecutor> executor_;
  std::unique_ptr<ExpertServerMetrics> metrics_;
  std::atomic<uint32_t> in_flight_{0};  // batches computing now, for the coordinator's heartbeats
  std::unique_ptr<ExpertServiceImpl> service_;
  ListeningServer grpc_;
  std::unique_ptr<ShmServer> shm_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<ExpertServerAgent> agent_;
  bool stopped_ = false;
};

}  // namespace moe
