// pool_soak: many workers, one pool (issue 45 point 4). Starts a coordinator,
// --servers expert servers (shared memory, each holding every expert: replicas
// the workers spread their misses over) and --workers moe-gpu-worker
// processes (--device: cpu by default, so it runs anywhere), all registered
// with the coordinator, which places the hottest experts in the workers'
// caches every --rebalance-seconds (--placement: each worker the top of its
// own traffic, or one placement spread over their union). A client
// thread per worker decodes closed-loop through WorkerService.ForwardLayer
// for --seconds: every layer in turn, --tokens tokens a call, Zipf routing of
// one popularity per layer (shared by all workers, each its own samples),
// every --check-every-th call checked against the reference MoE.
// Prints: per worker its steps, tokens/s, p50 / p99 step and hit rate; the
// servers' and workers' RSS sampled every --sample-seconds (first, last,
// largest: a soak must stay flat); the errors; then `moectl status` (the
// coordinator's placement across the workers). Exit 1 on a failed or wrong
// call, or when a server's RSS grew by more than --rss-growth-mib after the
// first sample (a worker's: after a minute, once it has touched the
// servers' experts it maps; a shorter run checks the servers only).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/worker_client.h"
#include "core/bf16.h"
#include "core/flags.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "testing/random_data.h"
#include "testing/subprocess.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "pool_soak: %s\n", why.c_str());
  std::exit(1);
}

struct Options {
  std::string preset = "demo", device = "cpu", placement = "per-worker", bin_dir, server_flags;
  int64_t layers = 8, workers = 8, servers = 2, tokens = 1, cache_pct = 25, check_every = 50, server_threads = 1;
  double seconds = 600, sample_seconds = 10, rebalance_seconds = 2, zipf = 1.0, rss_growth_mib = 64;
};

// VmRSS of a process in MiB (0 when gone).
double RssMib(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  return 0;
}

// The name and CPU seconds (user + system) in a /proc .../stat file: of a
// thread (task/TID/stat), or of a whole process (PID/stat: its exited
// threads included). False when it cannot be read.
bool StatCpu(const std::filesystem::path& stat, std::string* name, double* seconds) {
  std::ifstream f(stat);
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open || close + 2 > line.size()) return false;
  const std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  if (fields.size() < 13) return false;  // after the name: state, ..., utime (12th), stime (13th)
  *name = line.substr(open + 1, close - open - 1);
  *seconds = (std::strtod(fields[11].c_str(), nullptr) + std::strtod(fields[12].c_str(), nullptr)) /
             static_cast<double>(sysconf(_SC_CLK_TCK));
  return true;
}

// A process's CPU seconds: its total (exited threads included) and each live
// thread's by thread id, with its name.
struct ProcessCpu {
  double total = 0;
  std::map<std::string, std::pair<std::string, double>> threads;  // tid -> (name, seconds)
};
ProcessCpu ReadProcessCpu(pid_t pid) {
  ProcessCpu out;
  std::string name;
  if (!StatCpu(absl::StrCat("/proc/", pid, "/stat"), &name, &out.total)) return out;
  // Threads come and go while this reads: every step takes an error code, never throws.
  std::error_code ec;
  for (std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/task"), ec), end; !ec && it != end;
       it.increment(ec)) {
    double sec = 0;
    if (StatCpu(it->path() / "stat", &name, &sec)) out.threads[it->path().filename().string()] = {name, sec};
  }
  return out;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// One worker's closed-loop decode and what it measured.
struct WorkerRun {
  std::vector<double> step_ms;
  uint64_t calls = 0, failed = 0, wrong = 0, checks = 0, hits = 0, pairs = 0;
  double max_err = 0;
  std::string first_failure;
};

// Long: one worker's loop — route, call, time, check every Nth call against the reference.
void Drive(const Options& o, const ModelSpec& spec, const ModelSource& source, WorkerClient& client, int w,
           Clock::time_point end, WorkerRun* run) {
  const int T = static_cast<int>(o.tokens), k = spec.top_k, H = spec.hidden, L = static_cast<int>(spec.moe_layers.size());
  ReferenceMoe reference(source);
  // One popularity for every worker (the same seed), each its own samples.
  ZipfRouting router(L, spec.num_experts, k, o.zipf, 0.0, 7);
  router.SeedSamples(1000 + static_cast<uint64_t>(w));
  std::mt19937_64 rng(2000 + w);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<bf16_t> x(size_t(T) * H), out(x.size());
  std::vector<int32_t> ids(size_t(T) * k);
  std::vector<float> wts(ids.size());
  std::vector<double> ref(x.size());
  std::vector<float> got(x.size());
  while (Clock::now() < end) {
    const Clock::time_point s0 = Clock::now();
    for (int li = 0; li < L; ++li) {
      router.Route(li, T, ids.data(), wts.data());
      for (bf16_t& v : x) v = F32ToBf16(u(rng));
      WorkerBatch b{T, k, x.data(), ids.data(), wts.data(), out.data(), {}};
      ++run->calls;
      if (absl::Status st = client.ForwardLayer(spec.moe_layers[li], {&b}); !st.ok()) {
        if (run->failed++ == 0) run->first_failure = st.ToString();
        continue;
      }
      run->hits += b.stats.hit_pairs();
      run->pairs += b.stats.hit_pairs() + b.stats.cpu_pairs() + b.stats.copied_pairs();
      if (run->calls % static_cast<uint64_t>(o.check_every) != 0) continue;
      if (!reference.Forward<double>(spec.moe_layers[li], T, x.data(), RoutingView{T, k, ids.data(), wts.data()},
                                     ref.data()).ok())
        Die("reference");
      for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
      const double err = RelativeL2Error(got.data(), ref.data(), ref.size());
      run->max_err = std::max(run->max_err, err);
      ++run->checks;
      if (!(err <= 1e-2)) ++run->wrong;
    }
    run->step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
  }
}

// Long: flags, the processes, the drive with RSS sampling, the report.
int Main(int argc, char** argv) {
  Options o;
  FlagSet flags("pool_soak",
                "pool_soak [--workers 8] [--servers 2] [--seconds 600] [flags]\n"
                "Many GPU workers on one pool of expert servers, closed-loop decode, the servers' memory sampled.");
  flags.String("preset", &o.preset, "model preset (synthetic weights; default demo: small, runs anywhere)");
  flags.Int("layers", &o.layers, "MoE layers (default 8)");
  flags.Int("workers", &o.workers, "moe-gpu-worker processes (default 8)");
  flags.Int("servers", &o.servers, "moe-expert-server processes, every expert on each (default 2)");
  flags.Int("tokens", &o.tokens, "tokens per call (default 1: batch-1 decode)");
  flags.Int("cache-pct", &o.cache_pct, "each worker's cache, percent of a layer's experts (default 25)");
  flags.Int("check-every", &o.check_every, "check every Nth call of a worker against the reference MoE (default 50)");
  flags.Int("server-threads", &o.server_threads, "compute threads per server (default 1)");
  flags.String("device", &o.device, "workers' device backend: cpu (default) or cuda");
  flags.Double("seconds", &o.seconds, "how long the workers decode (default 600)");
  flags.Double("sample-seconds", &o.sample_seconds, "RSS sampling period (default 10)");
  flags.Double("rebalance-seconds", &o.rebalance_seconds, "coordinator's placement period (default 2)");
  flags.Double("zipf", &o.zipf, "Zipf exponent of the experts' popularity (default 1.0)");
  flags.Double("rss-growth-mib", &o.rss_growth_mib,
               "largest growth of a server's RSS after the first sample, or a worker's after a minute (a tenth "
               "of a run longer than 10 minutes), that still passes (default 64)");
  flags.String("placement", &o.placement,
               "the coordinator's placement: per-worker (its default: each worker the top of its own traffic) or union");
  flags.String("server-flags", &o.server_flags,
               "more flags for every moe-expert-server, space-separated (e.g. --max-polling-clients=0)");
  flags.String("bin-dir", &o.bin_dir, "where moe-coordinator / moe-expert-server / moe-gpu-worker / moectl are");
  flags.Parse(argc, argv);
  if (o.workers < 1 || o.servers < 1 || o.layers < 1 || o.tokens < 1 || o.seconds <= 0 || o.check_every < 1)
    flags.Fail("--workers, --servers, --layers, --tokens, --check-every: at least 1; --seconds: positive");

  absl::StatusOr<ModelSpec> full = PresetSpec(o.preset);
  if (!full.ok()) flags.Fail(std::string(full.status().message()));
  const std::string uri = absl::StrCat("synthetic:", o.preset, ":layers=", full->moe_layers.front() + o.layers);
  absl::StatusOr<std::unique_ptr<ModelSource>> source = OpenModel(uri);
  if (!source.ok()) Die(std::string(source.status().message()));
  const ModelSpec& spec = (*source)->spec();
  const int C = static_cast<int>(std::max<int64_t>(1, spec.num_experts * o.cache_pct / 100));

  char tmpl[] = "/tmp/pool_soak_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  auto bin = [&](const char* name, const char* subdir) { return RequireOurBinary("pool_soak", name, subdir, o.bin_dir); };
  std::unique_ptr<Subprocess> coord;
  const std::string caddr =
      RequireReady("pool_soak", &coord, bin("moe-coordinator", "coordinator"),
                   {"--listen=127.0.0.1:0", "--insecure", "--insecure-admin",
                    absl::StrCat("--rebalance-interval-seconds=", o.rebalance_seconds), "--heartbeat-interval-ms=200",
                    "--placement=" + o.placement},
                   dir + "/coordinator.log");
  std::vector<std::unique_ptr<Subprocess>> servers(o.servers), workers(o.workers);
  std::vector<std::string> socks;
  for (int s = 0; s < o.servers; ++s) {
    const std::string sock = absl::StrCat(dir, "/expert", s, ".sock");
    socks.push_back("unix://" + sock);
    std::vector<std::string> args{"--model=" + uri, "--listen=127.0.0.1:0", "--insecure", "--shm-socket=" + sock,
                                  absl::StrCat("--threads=", o.server_threads), "--coordinator=" + caddr,
                                  absl::StrCat("--server-id=server", s)};
    for (absl::string_view f : absl::StrSplit(o.server_flags, ' ', absl::SkipEmpty())) args.emplace_back(f);
    RequireReady("pool_soak", &servers[s], bin("moe-expert-server", "expert_server"), args,
                 absl::StrCat(dir, "/server", s, ".log"));
  }
  std::vector<std::unique_ptr<WorkerClient>> clients;
  TlsOptions tls;
  tls.insecure = true;
  for (int w = 0; w < o.workers; ++w) {
    const std::string waddr =
        RequireReady("pool_soak", &workers[w], bin("moe-gpu-worker", "gpu_worker"),
                     {"--model=" + uri, "--servers=" + absl::StrJoin(socks, ","), "--coordinator=" + caddr,
                      absl::StrCat("--worker-id=worker", w), absl::StrCat("--cache-experts-per-layer=", C),
                      "--device=" + o.device, "--cpu-threads=1", absl::StrCat("--max-tokens=", o.tokens),
                      "--listen=127.0.0.1:0", "--insecure"},
                     absl::StrCat(dir, "/worker", w, ".log"));
    absl::StatusOr<std::unique_ptr<WorkerClient>> c = WorkerClient::Connect(waddr, tls);
    if (!c.ok()) Die(std::string(c.status().message()));
    clients.push_back(*std::move(c));
  }
  std::printf("### pool_soak: %s, %lld MoE layers, %lld workers (%s) on %lld expert servers (%lld threads each), "
              "%lld token(s) a call, cache %d of %d experts per worker and layer, placement %s, %.0f s\n\n",
              o.preset.c_str(), static_cast<long long>(o.layers), static_cast<long long>(o.workers), o.device.c_str(),
              static_cast<long long>(o.servers), static_cast<long long>(o.server_threads),
              static_cast<long long>(o.tokens), C, spec.num_experts, o.placement.c_str(), o.seconds);
  std::fflush(stdout);

  const Clock::time_point t0 = Clock::now(), end = t0 + std::chrono::duration_cast<Clock::duration>(
                                                                  std::chrono::duration<double>(o.seconds));
  std::vector<WorkerRun> runs(o.workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < o.workers; ++w)
    threads.emplace_back([&, w] { Drive(o, spec, **source, *clients[w], w, end, &runs[w]); });
  // RSS: [sample][process] (servers first, then workers).
  std::vector<std::vector<double>> rss;
  std::vector<double> rss_t;  // each sample's time since the start, s
  // CPU by process and thread name: a snapshot after the first sample
  // interval (start-up done) and one at every later sample under load.
  auto cpu_snapshot = [&] {
    std::vector<ProcessCpu> snap;
    for (auto& s : servers) snap.push_back(ReadProcessCpu(s->pid()));
    for (auto& w : workers) snap.push_back(ReadProcessCpu(w->pid()));
    snap.push_back(ReadProcessCpu(getpid()));  // this process: the client threads driving the workers
    return snap;
  };
  std::vector<ProcessCpu> cpu_first, cpu_last;
  Clock::time_point cpu_first_t{}, cpu_last_t{};
  while (Clock::now() < end) {
    if (rss.size() == 1) {
      cpu_first = cpu_snapshot();
      cpu_first_t = Clock::now();
    } else if (rss.size() > 1) {  // the last one while the clients still run
      cpu_last = cpu_snapshot();
      cpu_last_t = Clock::now();
    }
    std::vector<double> row;
    for (auto& s : servers) row.push_back(RssMib(s->pid()));
    for (auto& w : workers) row.push_back(RssMib(w->pid()));
    rss.push_back(row);
    rss_t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    const auto next = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(o.sample_seconds));
    while (Clock::now() < std::min(next, end)) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (std::thread& t : threads) t.join();
  {
    std::vector<double> row;
    for (auto& s : servers) row.push_back(RssMib(s->pid()));
    for (auto& w : workers) row.push_back(RssMib(w->pid()));
    rss.push_back(row);
    rss_t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();

  std::printf("| worker | steps | tokens/s | step p50 ms | step p99 ms | hit rate | calls | failed | checked | wrong | max error |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  uint64_t failed = 0, wrong = 0, steps = 0;
  for (int w = 0; w < o.workers; ++w) {
    const WorkerRun& r = runs[w];
    steps += r.step_ms.size();
    failed += r.failed;
    wrong += r.wrong;
    std::printf("| %d | %zu | %.1f | %.3f | %.3f | %.1f%% | %llu | %llu | %llu | %llu | %.2e |\n", w, r.step_ms.size(),
                static_cast<double>(r.step_ms.size() * o.tokens) / elapsed, Quantile(r.step_ms, 0.5),
                Quantile(r.step_ms, 0.99), r.pairs ? 100.0 * static_cast<double>(r.hits) / static_cast<double>(r.pairs) : 0.0,
                static_cast<unsigned long long>(r.calls), static_cast<unsigned long long>(r.failed),
                static_cast<unsigned long long>(r.checks), static_cast<unsigned long long>(r.wrong), r.max_err);
    if (r.failed > 0) std::printf("  worker %d's first failure: %s\n", w, r.first_failure.c_str());
  }
  std::printf("\nAll workers: %.1f tokens/s, %llu steps in %.0f s.\n\n", static_cast<double>(steps * o.tokens) / elapsed,
              static_cast<unsigned long long>(steps), elapsed);
  // A worker's RSS grows while it first touches the servers' experts it maps
  // (its host copy): from a minute (or a tenth of the run, if longer) on,
  // every process must be flat; a shorter run checks only the servers.
  const double settle_s = std::max(60.0, o.seconds / 10);
  size_t settled_at = 0;
  while (settled_at < rss.size() && rss_t[settled_at] < settle_s) ++settled_at;
  const bool settled_seen = settled_at + 1 < rss.size();
  std::printf("| process | RSS MiB, first sample | at %.0f s | last | largest | last - at %.0f s |\n"
              "|---|---|---|---|---|---|\n", settle_s, settle_s);
  bool grew = false;
  for (size_t p = 0; p < rss.front().size(); ++p) {
    double mx = 0, mx_settled = 0;
    for (size_t i = 0; i < rss.size(); ++i) {
      mx = std::max(mx, rss[i][p]);
      if (i >= settled_at) mx_settled = std::max(mx_settled, rss[i][p]);
    }
    const double first = rss.front()[p], last = rss.back()[p];
    const bool server = p < servers.size();
    const std::string settled = settled_seen ? absl::StrFormat("%.1f", rss[settled_at][p]) : "-";
    const std::string delta = settled_seen ? absl::StrFormat("%+.1f", last - rss[settled_at][p]) : "-";
    std::printf("| %s %zu | %.1f | %s | %.1f | %.1f | %s |\n", server ? "server" : "worker",
                server ? p : p - servers.size(), first, settled.c_str(), last, mx, delta.c_str());
    if (server ? mx - first > o.rss_growth_mib : settled_seen && mx_settled - rss[settled_at][p] > o.rss_growth_mib)
      grew = true;
  }
  std::printf("\n(%zu samples, every %.0f s.)\n\n", rss.size(), o.sample_seconds);
  if (!cpu_last.empty()) {
    // Where the cores went under load: cores busy on average (CPU seconds
    // over wall seconds) per process, and its busiest thread names.
    const double wall = std::chrono::duration<double>(cpu_last_t - cpu_first_t).count();
    std::printf("CPU under load (%.0f s from the second sample to the last; cores busy on average, %u hardware threads):\n\n"
                "| process | cores | by thread name |\n|---|---|---|\n", wall, std::thread::hardware_concurrency());
    double all = 0;
    for (size_t p = 0; p < cpu_last.size(); ++p) {
      // A thread's time since the first snapshot (all of it if it started
      // later), summed by name; threads that ended between the snapshots
      // (gRPC's sync server starts and ends its own) count in the total only.
      const double total = (cpu_last[p].total - cpu_first[p].total) / wall;
      std::map<std::string, double> by_name;
      double named = 0;
      for (const auto& [tid, thread] : cpu_last[p].threads) {
        const auto f = cpu_first[p].threads.find(tid);
        const double u = (thread.second - (f == cpu_first[p].threads.end() ? 0.0 : f->second.second)) / wall;
        by_name[thread.first] += u;
        named += u;
      }
      std::vector<std::pair<double, std::string>> by;
      for (const auto& [name, u] : by_name)
        if (u >= 0.005) by.push_back({u, name});
      if (total - named >= 0.005) by.push_back({total - named, "(exited threads)"});
      all += total;
      std::sort(by.rbegin(), by.rend());
      std::string names;
      for (size_t i = 0; i < by.size() && i < 6; ++i)
        names += absl::StrFormat("%s%s %.2f", i ? ", " : "", by[i].second, by[i].first);
      const std::string who = p < servers.size() ? absl::StrCat("server ", p)
                              : p < servers.size() + workers.size() ? absl::StrCat("worker ", p - servers.size())
                                                                    : std::string("pool_soak (clients)");
      std::printf("| %s | %.2f | %s |\n", who.c_str(), total, names.c_str());
    }
    std::printf("| all | %.2f | |\n\n", all);
  }
  std::printf("$ moectl status\n");
  std::fflush(stdout);
  {
    Subprocess p(bin("moectl", "client"), {"--coordinator=" + caddr, "--insecure", "status"});
    std::printf("%s\n", p.ReadAll(std::chrono::seconds(30)).c_str());
    p.Wait(std::chrono::seconds(10));
  }
  for (auto& w : workers) w->Signal(SIGTERM);
  for (auto& s : servers) s->Signal(SIGTERM);
  coord->Signal(SIGTERM);
  for (auto& w : workers) w->Wait(std::chrono::seconds(20));
  for (auto& s : servers) s->Wait(std::chrono::seconds(30));
  coord->Wait(std::chrono::seconds(20));
  std::filesystem::remove_all(dir);
  if (failed > 0 || wrong > 0) {
    std::fprintf(stderr, "pool_soak: %llu failed and %llu wrong calls\n", static_cast<unsigned long long>(failed),
                 static_cast<unsigned long long>(wrong));
    return 1;
  }
  if (grew) {
    std::fprintf(stderr, "pool_soak: a server's RSS grew by more than %.0f MiB after the first sample, or a worker's "
                 "after the first minute\n", o.rss_growth_mib);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
