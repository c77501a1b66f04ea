// pool_clients: several clients of one expert server at once (issue 45 point
// 1), with the server merging concurrent requests of a layer (its default,
// --merge-requests) and without. Each client is a thread with its own
// transport (shm or gRPC) that decodes like a GPU worker's misses: every layer
// in turn, one request of T tokens per layer, top-k routing; with --lockstep
// (the default) the clients wait for each other after every layer, as the GPUs
// of a tensor- or expert-parallel group do at their all-reduce. Routing:
//   same      every client the same experts (a cache per GPU under tensor
//             parallelism: each GPU sends the same misses)
//   zipf      each client its own samples of one Zipf popularity per layer
//             (workers of one model sharing a pool)
//   disjoint  client c only experts e with e % clients == c (expert parallelism
//             with one cache over the GPUs)
// Prints per merge setting and client count: the median step (every layer
// once) of the slowest and the fastest client, the slowest client's p99, and
// the step over the same clients' step alone (one client, same routing).
// The server runs in another process, as in production.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/bf16.h"
#include "core/flags.h"
#include "core/log.h"
#include "model/synthetic_model.h"
#include "testing/subprocess.h"
#include "transport/transport.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "pool_clients: %s\n", why.c_str());
  std::exit(1);
}

struct Options {
  std::string preset = "qwen3-30b-a3b", routing = "zipf", transport = "shm", server_bin, clients = "1,2,4";
  std::string server_flags;  // --server-flags
  int layers = 8, tokens = 1, steps = 50, warmup = 10, runs = 3, server_threads = 0;
  double zipf = 1.0;
  bool lockstep = true;
};

// Routing of client c at (step, layer): T tokens x k distinct experts.
class Router {
 public:
  Router(const Options& o, int experts, int k, int clients)
      : o_(o), E_(experts), k_(k), C_(clients), rank_(o.layers, std::vector<int>(experts)) {
    std::mt19937 rng(7);
    for (auto& r : rank_) {  // each layer its own order of popularity
      for (int e = 0; e < E_; ++e) r[e] = e;
      std::shuffle(r.begin(), r.end(), rng);
    }
    double sum = 0;
    for (int i = 0; i < E_; ++i) sum += 1.0 / std::pow(i + 1, o.zipf);
    cdf_.resize(E_);
    double acc = 0;
    for (int i = 0; i < E_; ++i) cdf_[i] = (acc += 1.0 / std::pow(i + 1, o.zipf) / sum);
  }
  void Route(int client, int step, int layer, std::vector<int32_t>* ids, std::vector<float>* w) const {
    const bool same = o_.routing == "same";
    std::mt19937_64 rng(uint64_t(step) * 1000003 + uint64_t(layer) * 7919 + (same ? 0 : uint64_t(client + 1) * 104729));
    std::uniform_real_distribution<double> u(0, 1);
    ids->assign(size_t(o_.tokens) * k_, -1);
    w->assign(ids->size(), 1.0f / k_);
    for (int t = 0; t < o_.tokens; ++t) {
      int32_t* row = ids->data() + size_t(t) * k_;
      for (int j = 0; j < k_; ++j) {
        for (int tries = 0; tries < 1000; ++tries) {
          int e;
          if (o_.routing == "disjoint") {
            const int per = std::max(1, E_ / C_);
            e = std::min(E_ - 1, client + C_ * static_cast<int>(u(rng) * per));
          } else {
            const int i = static_cast<int>(std::lower_bound(cdf_.begin(), cdf_.end(), u(rng)) - cdf_.begin());
            e = rank_[layer][std::min(i, E_ - 1)];
          }
          if (std::find(row, row + j, e) == row + j) {
            row[j] = e;
            break;
          }
        }
      }
    }
  }

 private:
  const Options& o_;
  int E_, k_, C_;
  std::vector<std::vector<int>> rank_;
  std::vector<double> cdf_;
};

struct ClientTimes {
  std::vector<double> step_ms;
};

// One run: `clients` threads, each its own transport to `address`.
std::vector<ClientTimes> RunClients(const Options& o, const ModelSpec& spec, const std::string& address, int clients) {
  const int H = spec.hidden, k = spec.top_k, L = o.layers;
  Router router(o, spec.num_experts, k, clients);
  std::barrier sync(clients);
  std::vector<ClientTimes> times(clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      TransportOptions to;
      to.hidden = H;
      to.max_tokens_per_slot = std::max(16, o.tokens);
      to.max_pairs_per_token = k;
      to.tls.insecure = true;  // the server listens in plaintext on loopback
      absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport(address, to);
      if (!t.ok()) Die(absl::StrCat("client ", c, ": ", t.status().message()));
      (*t)->SetPolling(std::chrono::microseconds(2000));  // a decoding worker's window
      std::mt19937 rng(11 + c);
      std::uniform_real_distribution<float> u(-1, 1);
      std::vector<bf16_t> x(size_t(o.tokens) * H), out(x.size());
      for (bf16_t& v : x) v = F32ToBf16(u(rng));
      std::vector<int32_t> ids;
      std::vector<float> w;
      for (int step = 0; step < o.warmup + o.steps; ++step) {
        if (o.lockstep) sync.arrive_and_wait();
        const Clock::time_point s0 = Clock::now();
        for (int l = 0; l < L; ++l) {
          router.Route(c, step, l, &ids, &w);
          const MoeBatch b{spec.moe_layers[l], o.tokens, x.data(), RoutingView{o.tokens, k, ids.data(), w.data()}};
          std::future<absl::Status> f = (*t)->Submit(b, out.data(), Clock::now() + std::chrono::seconds(30));
          if (absl::Status st = AwaitResult(f); !st.ok()) Die(absl::StrCat("client ", c, ": ", st.message()));
          if (o.lockstep) sync.arrive_and_wait();  // the group's per-layer all-reduce
        }
        if (step >= o.warmup)
          times[c].step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return times;
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}
double Median(std::vector<double> v) { return Quantile(std::move(v), 0.5); }

int Main(int argc, char** argv) {
  Options o;
  int64_t layers = o.layers, tokens = o.tokens, steps = o.steps, warmup = o.warmup, runs = o.runs,
          threads = o.server_threads;
  FlagSet flags("pool_clients", "[--preset P] [--layers N] [--clients 1,2,4] [--routing zipf|same|disjoint] [flags]\n"
                                "Several decode clients of one expert server, its request merging on and off.");
  flags.String("preset", &o.preset, "model preset (synthetic weights)");
  flags.Int("layers", &layers, "MoE layers (default 8)");
  flags.Int("tokens", &tokens, "tokens per request (default 1: batch-1 decode)");
  flags.String("clients", &o.clients, "client counts, comma list (default 1,2,4)");
  flags.String("routing", &o.routing, "zipf (each client its own samples of one popularity), same, disjoint");
  flags.Double("zipf", &o.zipf, "Zipf exponent of the experts' popularity (default 1.0)");
  flags.Bool("lockstep", &o.lockstep, "clients wait for each other after every layer (default true)");
  flags.String("transport", &o.transport, "shm or grpc (default shm)");
  flags.Int("steps", &steps, "timed steps per run (default 50)");
  flags.Int("warmup", &warmup, "untimed steps first (default 10)");
  flags.Int("runs", &runs, "runs per configuration: medians over them (default 3)");
  flags.Int("server-threads", &threads, "server compute threads (default 0: the server's default)");
  flags.String("server-bin", &o.server_bin, "moe-expert-server binary (default: next to this one)");
  flags.String("server-flags", &o.server_flags,
               "more flags for the server, space-separated (e.g. --max-polling-clients=0)");
  flags.Parse(argc, argv);
  o.layers = static_cast<int>(layers);
  o.tokens = static_cast<int>(tokens);
  o.steps = static_cast<int>(steps);
  o.warmup = static_cast<int>(warmup);
  o.runs = static_cast<int>(runs);
  o.server_threads = static_cast<int>(threads);
  if (o.routing != "zipf" && o.routing != "same" && o.routing != "disjoint")
    flags.Fail("--routing: zipf, same or disjoint");
  if (o.transport != "shm" && o.transport != "grpc") flags.Fail("--transport: shm or grpc");
  if (o.layers < 1 || o.tokens < 1 || o.tokens > 256 || o.steps < 1 || o.warmup < 0 || o.runs < 1)
    flags.Fail("--layers, --tokens (1..256), --steps, --runs: at least 1; --warmup: at least 0");
  std::vector<int> counts;
  for (absl::string_view s : absl::StrSplit(o.clients, ',', absl::SkipEmpty())) {
    int c = 0;
    if (!absl::SimpleAtoi(s, &c) || c < 1 || c > 64) flags.Fail("--clients: counts in [1, 64]");
    counts.push_back(c);
  }
  if (counts.empty()) flags.Fail("--clients: at least one count");
  absl::StatusOr<ModelSpec> full = PresetSpec(o.preset);
  if (!full.ok()) flags.Fail(std::string(full.status().message()));
  const int first_moe = full->moe_layers.front();
  const std::string uri = absl::StrCat("synthetic:", o.preset, ":layers=", first_moe + o.layers);
  absl::StatusOr<ModelSpec> spec_or = PresetSpec(o.preset, first_moe + o.layers);
  if (!spec_or.ok()) Die(std::string(spec_or.status().message()));
  const ModelSpec& spec = *spec_or;
  std::string bin = o.server_bin;
  if (bin.empty()) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      self[n] = 0;
      const std::string dir = std::string(self).substr(0, std::string(self).rfind('/'));
      for (const std::string& p : {dir + "/moe-expert-server", dir + "/../expert_server/moe-expert-server"})
        if (access(p.c_str(), X_OK) == 0) {
          bin = p;
          break;
        }
    }
  }
  if (bin.empty()) Die("cannot find moe-expert-server (use --server-bin)");

  std::printf("### pool_clients: %s, %d MoE layers, %d token(s) per request, top-%d of %d experts, routing %s "
              "(Zipf %.2f), %s, %s\n\n",
              o.preset.c_str(), o.layers, o.tokens, spec.top_k, spec.num_experts, o.routing.c_str(), o.zipf,
              o.transport.c_str(), o.lockstep ? "lockstep (a barrier after every layer)" : "free-running");
  std::printf("Step: every layer once, ms; median of %d runs [min-max] of each run's median over %d steps. "
              "slowest / fastest: the client with the largest / smallest median in the run.\n\n",
              o.runs, o.steps);
  for (const bool merge : {true, false}) {
    std::printf("| clients | server merging | slowest client p50 | fastest client p50 | slowest client p99 | "
                "slowest p99 / fastest p50 | step / 1 client |\n|---|---|---|---|---|---|---|\n");
    char dir_tmpl[] = "/tmp/pool_clients_XXXXXX";
    const std::string dir = mkdtemp(dir_tmpl);
    const std::string sock = dir + "/expert.sock";
    std::vector<std::string> args{"--model=" + uri, "--shm-socket=" + sock, "--insecure", "--listen=127.0.0.1:0",
                                  absl::StrCat("--merge-requests=", merge ? "true" : "false")};
    if (o.server_threads > 0) args.push_back(absl::StrCat("--threads=", o.server_threads));
    for (absl::string_view f : absl::StrSplit(o.server_flags, ' ', absl::SkipEmpty())) args.emplace_back(f);
    const std::string log = dir + "/server.log";
    Subprocess server(bin, args, log);
    const std::string ready = server.ReadLine(std::chrono::minutes(5));
    const size_t at = ready.find("ready on ");
    if (at == std::string::npos) Die("the expert server did not start (" + log + ")");
    const std::string address = o.transport == "shm" ? "unix://" + sock : ready.substr(at + 9);
    double one = 0;
    for (int clients : counts) {
      std::vector<double> slow, fast, p99, ratio;
      for (int r = 0; r < o.runs; ++r) {
        std::vector<ClientTimes> t = RunClients(o, spec, address, clients);
        double s = 0, f = 1e300, q = 0;
        for (ClientTimes& c : t) {
          const double m = Median(c.step_ms);
          if (m > s) s = m, q = Quantile(c.step_ms, 0.99);
          f = std::min(f, m);
        }
        slow.push_back(s);
        fast.push_back(f);
        p99.push_back(q);
        ratio.push_back(q / f);
      }
      const double s = Median(slow);
      if (clients == counts.front()) one = s;
      auto span = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return absl::StrCat(" [", absl::StrFormat("%.3f", v.front()), "-", absl::StrFormat("%.3f", v.back()), "]");
      };
      std::printf("| %d | %s | %.3f%s | %.3f | %.3f | %.2f | %s |\n", clients, merge ? "on" : "off", s,
                  span(slow).c_str(), Median(fast), Median(p99), Median(ratio),
                  counts.front() == 1 ? absl::StrFormat("%.2f", s / one).c_str() : "-");
      std::fflush(stdout);
    }
    server.Signal(SIGTERM);
    server.Wait(std::chrono::seconds(30));
    // The server's own count of merged passes, from its exit line.
    std::string merged = "?";
    if (std::FILE* f = std::fopen(log.c_str(), "r")) {
      char line[1024];
      while (std::fgets(line, sizeof(line), f))
        if (std::string l = line; l.find("stopped; ") != std::string::npos) merged = l.substr(l.find("stopped; ") + 9);
      std::fclose(f);
    }
    while (!merged.empty() && (merged.back() == '\n' || merged.back() == '\r')) merged.pop_back();
    std::printf("\nserver --merge-requests=%s, all runs: %s\n\n", merge ? "true" : "false", merged.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
