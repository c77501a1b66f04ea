// moe-demo: the whole system end to end on one machine. Starts the
// coordinator, one CPU expert server (shared memory) and one GPU worker (cuda
// when a GPU is usable, else the cpu backend), drives a routing workload whose
// hot set drifts (or a recorded trace) through the client library, shows a
// live progress line, and at the end prints per-layer hit rates before and
// after the coordinator's rebalancing, the share of misses the CPU served and
// the largest error against the reference MoE. Stops everything it started.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/worker_client.h"
#include "core/flags.h"
#include "core/model_source.h"
#include "core/reference_moe.h"
#include "core/routing_trace.h"
#include "core/subprocess.h"
#include "gpu_worker/admission_policy.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "demo", trace, device = "auto", bin_dir, policy = "predictive";
  int64_t layers = 8, steps = 400, tokens = 16, cache = 0, check_every = 10, seed = 1;
  double rebalance_s = 1.0, half_life_s = 2.0, step_ms = 25;
};

[[noreturn]] void Fail(const std::string& msg) {
  std::fprintf(stderr, "moe-demo: %s\n", msg.c_str());
  std::exit(1);
}

std::string FindBinary(const Options& o, const std::string& name, const std::string& subdir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  if (!o.bin_dir.empty()) dirs.push_back(o.bin_dir);
  const fs::path self = fs::canonical("/proc/self/exe").parent_path();
  dirs.push_back(self);
  dirs.push_back(self / ".." / subdir);
  for (const fs::path& d : dirs)
    if (fs::exists(d / name)) return (d / name).string();
  Fail("cannot find " + name + " (build it, or pass --bin-dir)");
}

// Starts a process and waits for its "ready on ADDR" line; returns ADDR.
std::string Start(std::unique_ptr<Subprocess>* p, const std::string& bin, const std::vector<std::string>& args,
                  const std::string& log) {
  *p = std::make_unique<Subprocess>(bin, args, log);
  for (int i = 0; i < 4; ++i) {
    const std::string line = (*p)->ReadLine(std::chrono::seconds(120));
    const size_t at = line.find("ready on ");
    if (at != std::string::npos) return line.substr(at + 9);
    if (line.empty()) break;
  }
  std::string tail;
  if (FILE* f = std::fopen(log.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) tail.append(buf, n);
    std::fclose(f);
  }
  if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
  Fail(std::filesystem::path(bin).filename().string() + " did not start; its log:\n" + tail);
}

// Runs moectl against the coordinator and prints its output, indented.
void Moectl(const Options& o, const std::string& caddr, const std::vector<std::string>& args) {
  std::vector<std::string> a = {"--coordinator=" + caddr, "--insecure"};
  a.insert(a.end(), args.begin(), args.end());
  Subprocess p(FindBinary(o, "moectl", "client"), a);
  const std::string out = p.ReadAll(std::chrono::seconds(30));
  const int st = p.Wait(std::chrono::seconds(10));
  std::string cmd = "moectl";
  for (const std::string& x : args) cmd += " " + x;
  std::printf("\n  $ %s\n", cmd.c_str());
  size_t at = 0;
  while (at < out.size()) {
    const size_t nl = out.find('\n', at);
    std::printf("    %s\n", out.substr(at, nl == std::string::npos ? std::string::npos : nl - at).c_str());
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) Fail(cmd + " failed");
}

// Tokens' top-k lists of one (step, layer), rebuilt from per-expert pair
// counts (what a trace stores): expert e appears in pairs[e] distinct tokens.
void TokensFromCounts(const std::vector<ExpertAccess>& acc, int T, int k, std::vector<int32_t>* ids) {
  ids->assign(static_cast<size_t>(T) * k, -1);
  std::vector<ExpertAccess> sorted = acc;
  std::sort(sorted.begin(), sorted.end(), [](const ExpertAccess& a, const ExpertAccess& b) { return a.pairs > b.pairs; });
  std::vector<int> fill(T, 0);
  int t = 0;
  for (const ExpertAccess& a : sorted)
    for (int n = 0; n < std::min(a.pairs, T); ++n) {
      // Round-robin over tokens keeps an expert's pairs on distinct tokens.
      for (int tries = 0; tries < T && fill[t] >= k; ++tries) t = (t + 1) % T;
      if (fill[t] >= k) return;
      (*ids)[static_cast<size_t>(t) * k + fill[t]++] = a.expert;
      t = (t + 1) % T;
    }
}

int Main(int argc, char** argv) {
  Options o;
  FlagSet flags("moe-demo",
                "[--preset demo] [--layers 8] [--steps 400] [--tokens 16] [--cache C] [--trace FILE]\n"
                "Runs the coordinator, a CPU expert server (shm) and a GPU worker (cuda if present, else cpu),\n"
                "drives a drifting routing workload (or a recorded trace) through the client library and\n"
                "reports hit rates before/after rebalancing, the CPU's share of misses and the max error.");
  flags.String("preset", &o.preset, "model geometry (synthetic weights): demo, tiny, qwen3-30b-a3b, ...");
  flags.Int("layers", &o.layers, "MoE layers of the model");
  flags.Int("steps", &o.steps, "decode steps to drive (each: every layer once)");
  flags.Int("tokens", &o.tokens, "tokens per step");
  flags.Int("cache", &o.cache, "GPU cache slots per layer (0: a quarter of the experts)");
  flags.String("trace", &o.trace,
               "replay a recorded routing trace instead (bench/README.md formats, e.g. "
               "../shared/data/traces/mixtral-8x7b-humaneval.jsonl.xz); the model takes its layers/experts/top-k");
  flags.String("device", &o.device, "GPU worker backend: auto, cuda or cpu");
  flags.String("policy", &o.policy, "GPU worker cache policy: predictive (inside the coordinator's placement), static, lru, lfru");
  flags.Double("model-step-ms", &o.step_ms,
               "modelled step time: the device part of a step (all layers); the CPU's misses are added at the GPU\n"
               "      host's rates (gpu_worker/admission_policy.h StepTimeModel)");
  flags.Int("check-every", &o.check_every, "compare with the reference MoE every N steps");
  flags.Double("rebalance-seconds", &o.rebalance_s, "coordinator rebalance interval");
  flags.Double("half-life-seconds", &o.half_life_s, "coordinator popularity half-life");
  flags.Int("seed", &o.seed, "seed of the weights, activations and synthetic routing");
  flags.String("bin-dir", &o.bin_dir, "where moe-coordinator / moe-expert-server / moe-gpu-worker are");
  flags.Parse(argc, argv);
  if (o.steps <= 0 || o.tokens <= 0 || o.layers <= 0 || o.check_every <= 0)
    flags.Fail("--steps, --tokens, --layers and --check-every must be > 0");

  // The routing: a drifting synthetic trace, or a recorded one.
  RoutingTrace trace;
  std::string uri;
  if (!o.trace.empty()) {
    absl::StatusOr<RoutingTrace> t = ReadRoutingTrace(o.trace);
    if (!t.ok()) flags.Fail(absl::StrCat("--trace: ", t.status().message()), 1);
    trace = *std::move(t);
    uri = absl::StrCat("synthetic:", o.preset, ":layers=", trace.num_layers, ":experts=", trace.num_experts,
                       ":top_k=", trace.top_k, ":seed=", o.seed);
  } else {
    uri = absl::StrCat("synthetic:", o.preset, ":layers=", o.layers, ":seed=", o.seed);
  }
  absl::StatusOr<std::unique_ptr<ModelSource>> source = OpenModel(uri);
  if (!source.ok()) flags.Fail(std::string(source.status().message()), 1);
  const ModelSpec& spec = (*source)->spec();
  const int E = spec.num_experts, K = spec.top_k, H = spec.hidden, L = static_cast<int>(spec.moe_layers.size());
  if (o.trace.empty()) {
    SyntheticTraceOptions so;
    so.num_layers = L;
    so.num_experts = E;
    so.top_k = K;
    so.tokens_per_step = static_cast<int>(o.tokens);
    so.steps = static_cast<int>(o.steps);
    so.zipf = 1.1;
    so.drift_every = std::max<int>(1, static_cast<int>(o.steps / 8));
    so.drift_swaps = std::max(1, E / 8);
    so.seed = static_cast<uint64_t>(o.seed);
    trace = GenerateRoutingTrace(so);
  }
  const int steps = std::min<int>(static_cast<int>(o.steps), static_cast<int>(trace.steps.size()));
  const int C = o.cache > 0 ? static_cast<int>(std::min<int64_t>(o.cache, E)) : std::max(1, E / 4);
  // A trace's step may hold any number of tokens; use the largest pair count / k, at least --tokens.
  int T = static_cast<int>(o.tokens);
  for (int s = 0; s < steps; ++s)
    for (const auto& layer : trace.steps[s]) {
      int pairs = 0;
      for (const ExpertAccess& a : layer) pairs += a.pairs;
      T = std::max(T, (pairs + K - 1) / K);
    }

  // Processes.
  char tmpl[] = "/tmp/moe_demo_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string sock = dir + "/expert.sock";
  std::printf("moe-demo: model %s\n  %s; cache %d of %d experts per layer; %d steps x %d tokens\n", uri.c_str(),
              spec.Summary().c_str(), C, E, steps, T);
  std::unique_ptr<Subprocess> coord, server, worker;
  const std::string caddr = Start(&coord, FindBinary(o, "moe-coordinator", "coordinator"),
                                  {"--listen=127.0.0.1:0", "--insecure", "--insecure-admin", "--rebalance-interval-seconds=0",
                                   absl::StrCat("--half-life-seconds=", o.half_life_s), "--heartbeat-interval-ms=200",
                                   "--state-file=" + dir + "/coordinator-state.json"},
                                  dir + "/coordinator.log");
  std::printf("  coordinator   %s\n", caddr.c_str());
  const std::string saddr = Start(&server, FindBinary(o, "moe-expert-server", "cpu_expert_server"),
                                  {"--model=" + uri, "--listen=127.0.0.1:0", "--insecure", "--shm-socket=" + sock,
                                   "--threads=1", "--coordinator=" + caddr, "--server-id=demo-server"},
                                  dir + "/expert-server.log");
  std::printf("  expert server %s + unix://%s\n", saddr.c_str(), sock.c_str());
  const std::string waddr = Start(&worker, FindBinary(o, "moe-gpu-worker", "gpu_worker"),
                                  {"--model=" + uri, "--servers=unix://" + sock, "--coordinator=" + caddr,
                                   "--worker-id=demo-worker", absl::StrCat("--cache-experts-per-layer=", C),
                                   "--device=" + o.device, "--cpu-threads=1", absl::StrCat("--max-tokens=", T),
                                   "--policy=" + o.policy,
                                   "--listen=127.0.0.1:0", "--insecure"},
                                  dir + "/gpu-worker.log");
  TlsOptions tls;
  tls.insecure = true;
  absl::StatusOr<std::unique_ptr<WorkerClient>> client = WorkerClient::Connect(waddr, tls);
  if (!client.ok()) Fail(std::string(client.status().message()));
  absl::StatusOr<moe::v1::WorkerInfo> info = (*client)->GetInfo();
  if (!info.ok()) Fail(std::string(info.status().message()));
  std::printf("  GPU worker    %s (device %s, policy %s)\n\n", waddr.c_str(), info->device().c_str(), info->policy().c_str());

  // Drive.
  ReferenceMoe reference(**source);
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed) * 7 + 1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), uw(0.1f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(T) * H), out(x.size());
  std::vector<int32_t> ids;
  std::vector<float> w;
  std::vector<double> ref;
  // Per layer and window (0: the first quarter, before any placement; 1: the last quarter).
  std::vector<std::array<uint64_t, 2>> hit(L, {0, 0}), all(L, {0, 0});
  // Modelled step time per window (StepTimeModel at the GPU host's rates,
  // this model's expert size; copy contention not visible here).
  StepTimeModel time_model;
  time_model.expert_bytes = static_cast<double>(spec.ExpertBf16Bytes());
  time_model.pair_seconds = 2.0 * (time_model.expert_bytes / 2.0) / 4.6e12;
  std::array<double, 2> model_s = {0, 0};
  uint64_t cpu_pairs = 0, copied_pairs = 0, tokens_done = 0;
  double max_err = 0;
  int checks = 0;
  const int before_end = std::max(1, steps / 4), after_begin = steps - std::max(1, steps / 4);
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last_print = t0;
  uint64_t recent_hits = 0, recent_all = 0;
  const int rebalance_at = std::max(1, steps / 4);
  for (int s = 0; s < steps; ++s) {
    if (s == rebalance_at) {
      // The operator (here: the demo) asks for the first placement, then
      // turns on automatic rebalancing so the cache follows the drift.
      std::printf("\n");
      Moectl(o, caddr, {"rebalance"});
      Moectl(o, caddr, {"policy", "set", absl::StrCat("rebalance_interval_seconds=", o.rebalance_s)});
      std::printf("\n");
    }
    for (int li = 0; li < L; ++li) {
      const int layer = spec.moe_layers[li];
      TokensFromCounts(trace.steps[s][li], T, K, &ids);
      w.resize(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) w[i] = ids[i] >= 0 ? uw(rng) : 0.0f;
      for (bf16_t& v : x) v = F32ToBf16(u(rng));
      WorkerBatch b{T, K, x.data(), ids.data(), w.data(), out.data(), {}};
      if (absl::Status st = (*client)->ForwardLayer(layer, {&b}); !st.ok())
        Fail(absl::StrCat("ForwardLayer(layer ", layer, ") failed: ", st.ToString()));
      const uint64_t h = b.stats.hit_pairs(), a = h + b.stats.cpu_pairs() + b.stats.copied_pairs();
      cpu_pairs += b.stats.cpu_pairs();
      copied_pairs += b.stats.copied_pairs();
      recent_hits += h;
      recent_all += a;
      const double layer_s = time_model.LayerSeconds(o.step_ms * 1e-3 / L, static_cast<int>(b.stats.cpu_experts()),
                                                     b.stats.cpu_pairs(), 0.0);
      if (s < before_end) {
        hit[li][0] += h;
        all[li][0] += a;
        model_s[0] += layer_s;
      } else if (s >= after_begin) {
        hit[li][1] += h;
        all[li][1] += a;
        model_s[1] += layer_s;
      }
      if (s % o.check_every == 0) {
        ref.resize(x.size());
        if (absl::Status st = reference.Forward<double>(layer, T, x.data(), RoutingView{T, K, ids.data(), w.data()}, ref.data());
            !st.ok())
          Fail(st.ToString());
        std::vector<float> got(out.size());
        for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
        max_err = std::max(max_err, RelativeL2Error(got.data(), ref.data(), ref.size()));
        ++checks;
      }
    }
    tokens_done += T;
    const Clock::time_point now = Clock::now();
    if (now - last_print > std::chrono::milliseconds(250) || s + 1 == steps) {
      const double el = std::chrono::duration<double>(now - t0).count();
      std::printf("\r  step %4d/%d | %8.0f tokens/s | hit rate %5.1f%% (recent) | max error %.2e   ", s + 1, steps,
                  tokens_done / el, recent_all ? 100.0 * recent_hits / recent_all : 0.0, max_err);
      std::fflush(stdout);
      recent_hits = recent_all = 0;
      last_print = now;
    }
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("\n\n  per-layer hit rate (GPU cache), before rebalancing (steps 1-%d) -> after (steps %d-%d):\n",
              before_end, after_begin + 1, steps);
  uint64_t hb = 0, ab = 0, ha = 0, aa = 0;
  for (int li = 0; li < L; ++li) {
    std::printf("    layer %3d: %5.1f%% -> %5.1f%%\n", spec.moe_layers[li],
                all[li][0] ? 100.0 * hit[li][0] / all[li][0] : 0.0, all[li][1] ? 100.0 * hit[li][1] / all[li][1] : 0.0);
    hb += hit[li][0];
    ab += all[li][0];
    ha += hit[li][1];
    aa += all[li][1];
  }
  const double before = ab ? 100.0 * hb / ab : 0, after = aa ? 100.0 * ha / aa : 0;
  const uint64_t misses = cpu_pairs + copied_pairs;
  std::printf("    all      : %5.1f%% -> %5.1f%%\n", before, after);
  std::printf("  modelled step time (device %g ms + CPU misses at 94 GB/s): %.2f ms -> %.2f ms\n", o.step_ms,
              1e3 * model_s[0] / before_end, 1e3 * model_s[1] / std::max(1, steps - after_begin));
  std::printf("  misses served by the CPU expert server: %.1f%% (%llu of %llu; the rest copied to the GPU)\n",
              misses ? 100.0 * cpu_pairs / misses : 0.0, static_cast<unsigned long long>(cpu_pairs),
              static_cast<unsigned long long>(misses));
  std::printf("  max relative error vs the reference MoE: %.2e over %d checked calls (tolerance 1e-2)\n", max_err, checks);
  std::printf("  %.1f s, %.0f tokens/s, %llu layer calls\n", elapsed, tokens_done / elapsed,
              static_cast<unsigned long long>(static_cast<uint64_t>(steps) * L));

  Moectl(o, caddr, {"status"});
  for (auto* p : {&worker, &server, &coord}) {
    (*p)->Signal(SIGTERM);
    if ((*p)->Wait(std::chrono::seconds(20)) == -1) (*p)->Signal(SIGKILL);
  }
  std::filesystem::remove_all(dir);
  if (!(max_err <= 1e-2)) {
    std::fprintf(stderr, "moe-demo: max error %.3g exceeds 1e-2\n", max_err);
    return 1;
  }
  std::printf("  all processes stopped; ok\n");
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
