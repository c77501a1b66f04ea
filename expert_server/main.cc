// moe-expert-server: serves the experts of an MoE model from CPU memory over
// gRPC (moe.v1.ExpertService, grpc.health.v1.Health, server reflection),
// optionally over shared memory (--shm-socket), with Prometheus metrics on
// --metrics-port. main parses the flags into ExpertServerOptions, starts the
// ExpertServer and stops it on SIGTERM/SIGINT.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "core/log.h"
#include "process/service_main.h"
#include "transport/grpc_channel.h"
#include "transport/shm_segment.h"
#include "expert_server/expert_server.h"

namespace {

struct Flags {
  moe::ExpertServerOptions server;
  int64_t drain_seconds = 30;
};

// The command line as ExpertServerOptions; exits 2 with one line on a bad flag.
// Long: one flag after another (each with its help text, what --help shows), then their checks.
Flags ParseFlags(moe::FlagSet& flags, int argc, char** argv) {
  Flags f;
  moe::ExpertServerOptions& o = f.server;
  std::string shm_uids, slice = "0/1";
  int64_t threads = 0, max_tokens = o.max_tokens;
  flags.String("model", &o.model, "checkpoint directory (config.json + safetensors), a GGUF file (FILE.gguf) or synthetic:PRESET[:layers=N][:seed=S][:dtype=D][:group=G]");
  flags.String("listen", &o.listen,
               "gRPC address to listen on, host:port (loopback by default; port 0 picks a free port; a port "
               "another process holds refuses the start)");
  flags.String("layers", &o.layers, "MoE layers to host, e.g. 3-10,12 (model layer indexes; default: all)");
  flags.String("experts", &o.experts, "experts to host in every hosted layer, e.g. 0-63 (default: all)");
  flags.String("slice", &slice,
               "i/n (0 <= i < n <= 8): hold slice i of n of every hosted expert's intermediate dimension (gate and up rows, down "
               "columns), e.g. one server per NUMA node with 0/2 and 1/2, pinned to disjoint cores; GPU workers "
               "send each token to one holder of every slice and add the partial outputs (default 0/1: whole)");
  flags.Int("threads", &threads,
            "compute threads. 0 (default) = one per core of the NUMA node, less max(2, cores/16) cores left to a "
            "same-host engine and GPU worker when --shm-socket is served and no CPU affinity (taskset, cpuset) set "
            "cores aside, capped by the cgroup CPU quota; the start-up log says how it chose");
  flags.String("numa-node", &o.numa_node, "NUMA node for threads and weight memory: auto (node of the first allowed CPU) or an index");
  flags.Int("idle-spin-us", &o.idle_spin_us,
            "how long idle compute threads (and shm connections) spin for the next batch before sleeping; "
            "while a same-host GPU worker polls for its next request (decode: its poll window, 2 ms after each "
            "request) they stay hot through that window whatever this says");
  int64_t max_polling = o.max_polling;
  flags.Int("max-polling-clients", &max_polling,
            "same-host clients (GPUs, worker processes) whose next request this server polls for at once, a core "
            "each; the others' requests are picked up on the client's doorbell or, from a GPU, within 50 us "
            "(default 2: a worker with one or two GPUs; 0: every client, for hosts with a core to spare per client)");
  flags.Bool("merge-requests", &o.merge_requests,
             "compute requests of one layer that several clients (GPUs, workers) send at the same time and that "
             "share experts (at least half of a request's) in one pass, grouped by expert, so an expert they share "
             "is read from memory once; on a layer where such a request came last time, a client's request waits "
             "up to ~1.5x the observed lag for it (at most 3/4 of the layer's pass and 2 ms; waits stop while "
             "most of them miss) (default true; false: one request at a time, in arrival order)");
  flags.String("kernel", &o.kernel, "expert kernel: auto, amx, avx512 or reference");
  flags.String("weight-dtype", &o.weight_dtype,
               "precision the experts are stored and computed in: auto (the checkpoint's: fp8 -> fp8, exact; "
               "int4 -> int4, its own codes and group scales, exact; mxfp4 (safetensors or an all-MXFP4 GGUF) -> mxfp4, "
               "exact; else bf16), bf16, int8 "
               "(per-channel scales), int4 (per-group scales), fp8 (an fp8 checkpoint's own codes and block "
               "scales, computed as bf16; other models quantized per channel and 128 columns) or mxfp4 (OCP "
               "MXFP4: E2M1 with an E8M0 scale per 32 columns, 4.25 bits per weight; other models quantized "
               "round-to-nearest)");
  flags.Int("max-tokens", &max_tokens, "largest number of tokens accepted in one request (1..65536)");
  flags.Int("drain-seconds", &f.drain_seconds, "on SIGTERM/SIGINT, how long in-flight requests may take to finish (0..3600)");
  flags.String("shm-socket", &o.shm_socket, "also serve same-host clients over shared memory on this Unix socket (mode 0660)");
  flags.Bool("share-weights", &o.share_weights,
             "with --shm-socket: keep the packed experts in a sealed memfd that same-host GPU workers map "
             "read-only, so worker and server hold the model once (default true)");
  flags.String("shm-allow-uids", &shm_uids, "uids allowed on the shm socket, comma list (default: this process's uid)");
  flags.String("coordinator", &o.coordinator, "coordinator address host:port: register what this server hosts and heartbeat");
  flags.String("server-id", &o.server_id, "stable id of this server at the coordinator (default: HOSTNAME:PORT)");
  o.service.Register(flags);
  flags.Parse(argc, argv);
  if (o.model.empty()) flags.Fail("--model is required (see --help)");
  if (absl::Status st = moe::CheckListenAddress(o.listen); !st.ok()) flags.Fail(std::string(st.message()));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(o.service.tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));
  o.credentials = *creds;
  if (!shm_uids.empty()) {
    absl::StatusOr<std::vector<int>> uids = moe::ParseIndexList(shm_uids, 1 << 30, "shm-allow-uids");
    if (!uids.ok()) flags.Fail(std::string(uids.status().message()));
    o.shm_allowed_uids.assign(uids->begin(), uids->end());
  }
  // One request's tokens fit one shm slot (and its gRPC message 2 GB):
  // 2147483647 overflowed the message limit.
  if (max_tokens < 1 || max_tokens > moe::shm::kMaxTokensPerSlot)
    flags.Fail(absl::StrCat("--max-tokens: ", max_tokens, " is outside [1, ", moe::shm::kMaxTokensPerSlot, "]"));
  if (f.drain_seconds < 0 || f.drain_seconds > 3600)
    flags.Fail(absl::StrCat("--drain-seconds: ", f.drain_seconds, " is outside [0, 3600]"));
  if (absl::StatusOr<moe::ExpertSlice> s = moe::ParseSlice(slice); s.ok()) {
    o.slice = *s;
  } else {
    flags.Fail(std::string(s.status().message()));
  }
  if (absl::Status st = o.service.Validate(); !st.ok()) flags.Fail(std::string(st.message()));
  if (o.idle_spin_us < 0 || o.idle_spin_us > 1000000) flags.Fail("--idle-spin-us must be in [0, 1000000]");
  o.threads = static_cast<int>(threads);
  if (max_polling < 0 || max_polling > 4096) flags.Fail("--max-polling-clients must be in [0, 4096]");
  o.max_polling = static_cast<int>(max_polling);
  o.max_tokens = static_cast<int>(max_tokens);
  o.version = MOE_VERSION;
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  moe::FlagSet flags("moe-expert-server",
                     "--model DIR|synthetic:PRESET[:layers=N][:seed=S] [--listen ADDR] [flags]\n"
                     "Serves the routed experts of an MoE model from CPU memory (moe.v1.ExpertService).");
  const Flags f = ParseFlags(flags, argc, argv);
  // Before any thread starts: every thread inherits the blocked signals.
  moe::BlockTerminationSignals();
  bool option_at_fault = false;
  absl::StatusOr<std::unique_ptr<moe::ExpertServer>> server = moe::ExpertServer::Start(f.server, &option_at_fault);
  if (!server.ok()) flags.Fail(std::string(server.status().message()), option_at_fault ? 2 : 1);
  // Line 1 is what scripts and tests wait for; line 2 (only with --metrics-port)
  // names the metrics port, the chosen one when it was 0.
  moe::AnnounceReady("moe-expert-server", (*server)->address(), f.server.service, (*server)->metrics_endpoint());

  const int sig = moe::WaitForTerminationSignal();
  moe::LogInfo("server", "signal ", sig, ": draining in-flight requests (up to ", f.drain_seconds, " s)");
  (*server)->Stop(std::chrono::seconds(f.drain_seconds));
  const moe::MergeStats m = (*server)->merge_stats();
  moe::LogInfo("server", "stopped; ", m.regions, " compute passes, ", m.merged_regions, " of them merged ",
               m.merged_requests, " requests of several clients; ", m.windows, " waits for a peer's request, ",
               m.windows_filled, " of them met, ", m.wait_ns / 1'000'000, " ms waited; ", m.late_peers,
               " requests came while their layer's pass ran");
  return 0;
}
