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
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/model/step_time_model.h"
#include "absl/strings/str_cat.h"
#include "client/worker_client.h"
#include "core/flags.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "testing/routing_trace.h"
#include "testing/subprocess.h"
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

// Runs moectl against the coordinator and prints its output, indented.
void Moectl(const Options& o, const std::string& caddr, const std::vector<std::string>& args) {
  std::vector<std::string> a = {"--coordinator=" + caddr, "--insecure"};
  a.insert(a.end(), args.begin(), args.end());
  Subprocess p(RequireOurBinary("moe-demo", "moectl", "client", o.bin_dir), a);
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

Options ParseFlags(FlagSet& flags, int argc, char** argv) {
  Options o;
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
               "      host's rates (bench/model/step_time_model.h StepTimeModel)");
  flags.Int("check-every", &o.check_every, "compare with the reference MoE every N steps");
  flags.Double("rebalance-seconds", &o.rebalance_s, "coordinator rebalance interval");
  flags.Double("half-life-seconds", &o.half_life_s, "coordinator popularity half-life");
  flags.Int("seed", &o.seed, "seed of the weights, activations and synthetic routing");
  flags.String("bin-dir", &o.bin_dir, "where moe-coordinator / moe-expert-server / moe-gpu-worker are");
  flags.Parse(argc, argv);
  if (o.steps <= 0 || o.tokens <= 0 || o.layers <= 0 || o.check_every <= 0)
    flags.Fail("--steps, --tokens, --layers and --check-every must be > 0");
  return o;
}

// The model and the routing the demo drives through it.
struct Workload {
  std::string uri;  // the model, for every process
  std::unique_ptr<ModelSource> source;
  RoutingTrace trace;
  int steps = 0;  // steps driven: --steps, at most the trace's
  int C = 0;      // cache slots per layer
  int T = 0;      // tokens per call
};

// The routing: a drifting synthetic trace, or a recorded one; exits 1 when
// the trace or the model cannot be read.
Workload PrepareWorkload(const Options& o, const FlagSet& flags) {
  Workload w;
  if (!o.trace.empty()) {
    absl::StatusOr<RoutingTrace> t = ReadRoutingTrace(o.trace);
    if (!t.ok()) flags.Fail(absl::StrCat("--trace: ", t.status().message()), 1);
    w.trace = *std::move(t);
    w.uri = absl::StrCat("synthetic:", o.preset, ":layers=", w.trace.num_layers, ":experts=", w.trace.num_experts,
                         ":top_k=", w.trace.top_k, ":seed=", o.seed);
  } else {
    w.uri = absl::StrCat("synthetic:", o.preset, ":layers=", o.layers, ":seed=", o.seed);
  }
  absl::StatusOr<std::unique_ptr<ModelSource>> source = OpenModel(w.uri);
  if (!source.ok()) flags.Fail(std::string(source.status().message()), 1);
  w.source = *std::move(source);
  const ModelSpec& spec = w.source->spec();
  const int E = spec.num_experts, K = spec.top_k;
  if (o.trace.empty()) {
    SyntheticTraceOptions so;
    so.num_layers = static_cast<int>(spec.moe_layers.size());
    so.num_experts = E;
    so.top_k = K;
    so.tokens_per_step = static_cast<int>(o.tokens);
    so.steps = static_cast<int>(o.steps);
    so.zipf = 1.1;
    so.drift_every = std::max<int>(1, static_cast<int>(o.steps / 8));
    so.drift_swaps = std::max(1, E / 8);
    so.seed = static_cast<uint64_t>(o.seed);
    w.trace = GenerateRoutingTrace(so);
  }
  w.steps = std::min<int>(static_cast<int>(o.steps), static_cast<int>(w.trace.steps.size()));
  w.C = o.cache > 0 ? static_cast<int>(std::min<int64_t>(o.cache, E)) : std::max(1, E / 4);
  // A trace's step may hold any number of tokens; use the largest pair count / k, at least --tokens.
  w.T = static_cast<int>(o.tokens);
  for (int s = 0; s < w.steps; ++s)
    for (const auto& layer : w.trace.steps[s]) {
      int pairs = 0;
      for (const ExpertAccess& a : layer) pairs += a.pairs;
      w.T = std::max(w.T, (pairs + K - 1) / K);
    }
  return w;
}

// The three processes the demo runs, in a temporary directory, and a client
// of the GPU worker.
struct Cluster {
  std::string dir, sock, caddr;
  std::unique_ptr<Subprocess> coord, server, worker;
  std::unique_ptr<WorkerClient> client;

  // SIGTERM to each (SIGKILL after 20 s), then removes the directory.
  void Stop() {
    for (auto* p : {&worker, &server, &coord}) {
      (*p)->Signal(SIGTERM);
      if ((*p)->Wait(std::chrono::seconds(20)) == -1) (*p)->Signal(SIGKILL);
    }
    std::filesystem::remove_all(dir);
  }
};

// Starts the coordinator, the expert server and the GPU worker, printing
// where each serves; exits 1 when one does not start.
Cluster StartCluster(const Options& o, const Workload& w) {
  Cluster c;
  char tmpl[] = "/tmp/moe_demo_XXXXXX";
  c.dir = mkdtemp(tmpl);
  c.sock = c.dir + "/expert.sock";
  std::printf("moe-demo: model %s\n  %s; cache %d of %d experts per layer; %d steps x %d tokens\n", w.uri.c_str(),
              w.source->spec().Summary().c_str(), w.C, w.source->spec().num_experts, w.steps, w.T);
  auto bin = [&](const char* name, const char* subdir) { return RequireOurBinary("moe-demo", name, subdir, o.bin_dir); };
  c.caddr = RequireReady("moe-demo", &c.coord, bin("moe-coordinator", "coordinator"),
                         {"--listen=127.0.0.1:0", "--insecure", "--insecure-admin", "--rebalance-interval-seconds=0",
                          absl::StrCat("--half-life-seconds=", o.half_life_s), "--heartbeat-interval-ms=200",
                          "--state-file=" + c.dir + "/coordinator-state.json"},
                         c.dir + "/coordinator.log");
  std::printf("  coordinator   %s\n", c.caddr.c_str());
  const std::string saddr =
      RequireReady("moe-demo", &c.server, bin("moe-expert-server", "expert_server"),
                   {"--model=" + w.uri, "--listen=127.0.0.1:0", "--insecure", "--shm-socket=" + c.sock, "--threads=1",
                    "--coordinator=" + c.caddr, "--server-id=demo-server"},
                   c.dir + "/expert-server.log");
  std::printf("  expert server %s + unix://%s\n", saddr.c_str(), c.sock.c_str());
  const std::string waddr =
      RequireReady("moe-demo", &c.worker, bin("moe-gpu-worker", "gpu_worker"),
                   {"--model=" + w.uri, "--servers=unix://" + c.sock, "--coordinator=" + c.caddr,
                    "--worker-id=demo-worker", absl::StrCat("--cache-experts-per-layer=", w.C), "--device=" + o.device,
                    "--cpu-threads=1", absl::StrCat("--max-tokens=", w.T), "--policy=" + o.policy,
                    "--listen=127.0.0.1:0", "--insecure"},
                   c.dir + "/gpu-worker.log");
  TlsOptions tls;
  tls.insecure = true;
  absl::StatusOr<std::unique_ptr<WorkerClient>> client = WorkerClient::Connect(waddr, tls);
  if (!client.ok()) Fail(std::string(client.status().message()));
  c.client = *std::move(client);
  absl::StatusOr<moe::v1::WorkerInfo> info = c.client->GetInfo();
  if (!info.ok()) Fail(std::string(info.status().message()));
  std::printf("  GPU worker    %s (device %s, policy %s)\n\n", waddr.c_str(), info->device().c_str(), info->policy().c_str());
  return c;
}

// What the drive measured.
struct Tally {
  explicit Tally(int layers) : hit(layers, {0, 0}), all(layers, {0, 0}) {}
  // Per layer and window (0: the first quarter, before any placement; 1: the last quarter).
  std::vector<std::array<uint64_t, 2>> hit, all;
  std::array<double, 2> model_s = {0, 0};  // modelled step time per window
  uint64_t cpu_pairs = 0, copied_pairs = 0, tokens_done = 0;
  double max_err = 0;
  int checks = 0;
  int before_end = 0, after_begin = 0;  // the windows: steps [0, before_end) and [after_begin, steps)
  double elapsed = 0;
};

// Drives the workload's steps through the GPU worker, one ForwardLayer per
// (step, layer), checking against the reference MoE every --check-every
// steps; the demo asks for the first placement after a quarter of the steps.
class Driver {
 public:
  Driver(const Options& o, const Workload& w, Cluster& cluster)
      : o_(o), w_(w), spec_(w.source->spec()), cluster_(cluster), L_(static_cast<int>(spec_.moe_layers.size())),
        reference_(*w.source), rng_(static_cast<uint64_t>(o.seed) * 7 + 1),
        x_(static_cast<size_t>(w.T) * spec_.hidden), out_(x_.size()), tally_(L_) {
    // Modelled step time per window (StepTimeModel at the GPU host's rates,
    // this model's expert size; copy contention not visible here).
    time_model_.expert_bytes = static_cast<double>(spec_.ExpertBf16Bytes());
    time_model_.pair_seconds = 2.0 * (time_model_.expert_bytes / 2.0) / 4.6e12;
    tally_.before_end = std::max(1, w.steps / 4);
    tally_.after_begin = w.steps - std::max(1, w.steps / 4);
  }

  Tally Run() {
    const Clock::time_point t0 = Clock::now();
    Clock::time_point last_print = t0;
    const int rebalance_at = std::max(1, w_.steps / 4);
    for (int s = 0; s < w_.steps; ++s) {
      if (s == rebalance_at) {
        // The operator (here: the demo) asks for the first placement, then
        // turns on automatic rebalancing so the cache follows the drift.
        std::printf("\n");
        Moectl(o_, cluster_.caddr, {"rebalance"});
        Moectl(o_, cluster_.caddr, {"policy", "set", absl::StrCat("rebalance_interval_seconds=", o_.rebalance_s)});
        std::printf("\n");
      }
      for (int li = 0; li < L_; ++li) ForwardLayer(s, li);
      tally_.tokens_done += w_.T;
      const Clock::time_point now = Clock::now();
      if (now - last_print > std::chrono::milliseconds(250) || s + 1 == w_.steps) {
        PrintProgress(s, std::chrono::duration<double>(now - t0).count());
        last_print = now;
      }
    }
    tally_.elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    return tally_;
  }

 private:
  void ForwardLayer(int s, int li) {
    const int layer = spec_.moe_layers[li], T = w_.T, K = spec_.top_k;
    TokensFromCounts(w_.trace.steps[s][li], T, K, &ids_);
    w_weights_.resize(ids_.size());
    for (size_t i = 0; i < ids_.size(); ++i) w_weights_[i] = ids_[i] >= 0 ? uw_(rng_) : 0.0f;
    for (bf16_t& v : x_) v = F32ToBf16(u_(rng_));
    WorkerBatch b{T, K, x_.data(), ids_.data(), w_weights_.data(), out_.data(), {}};
    if (absl::Status st = cluster_.client->ForwardLayer(layer, {&b}); !st.ok())
      Fail(absl::StrCat("ForwardLayer(layer ", layer, ") failed: ", st.ToString()));
    const uint64_t h = b.stats.hit_pairs(), a = h + b.stats.cpu_pairs() + b.stats.copied_pairs();
    tally_.cpu_pairs += b.stats.cpu_pairs();
    tally_.copied_pairs += b.stats.copied_pairs();
    recent_hits_ += h;
    recent_all_ += a;
    const double layer_s = time_model_.LayerSeconds(o_.step_ms * 1e-3 / L_, static_cast<int>(b.stats.cpu_experts()),
                                                    b.stats.cpu_pairs(), 0.0);
    const int window = s < tally_.before_end ? 0 : s >= tally_.after_begin ? 1 : -1;
    if (window >= 0) {
      tally_.hit[li][window] += h;
      tally_.all[li][window] += a;
      tally_.model_s[window] += layer_s;
    }
    if (s % o_.check_every == 0) Check(layer);
  }

  // The last call's output against the reference MoE.
  void Check(int layer) {
    const int T = w_.T, K = spec_.top_k;
    ref_.resize(x_.size());
    if (absl::Status st = reference_.Forward<double>(layer, T, x_.data(),
                                                     RoutingView{T, K, ids_.data(), w_weights_.data()}, ref_.data());
        !st.ok())
      Fail(st.ToString());
    std::vector<float> got(out_.size());
    for (size_t i = 0; i < out_.size(); ++i) got[i] = Bf16ToF32(out_[i]);
    tally_.max_err = std::max(tally_.max_err, RelativeL2Error(got.data(), ref_.data(), ref_.size()));
    ++tally_.checks;
  }

  void PrintProgress(int s, double elapsed) {
    std::printf("\r  step %4d/%d | %8.0f tokens/s | hit rate %5.1f%% (recent) | max error %.2e   ", s + 1, w_.steps,
                tally_.tokens_done / elapsed, recent_all_ ? 100.0 * recent_hits_ / recent_all_ : 0.0,
                tally_.max_err);
    std::fflush(stdout);
    recent_hits_ = recent_all_ = 0;
  }

  const Options& o_;
  const Workload& w_;
  const ModelSpec& spec_;
  Cluster& cluster_;
  const int L_;
  ReferenceMoe reference_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<float> u_{-1.0f, 1.0f}, uw_{0.1f, 1.0f};
  std::vector<bf16_t> x_, out_;
  std::vector<int32_t> ids_;
  std::vector<float> w_weights_;
  std::vector<double> ref_;
  StepTimeModel time_model_;
  Tally tally_;
  uint64_t recent_hits_ = 0, recent_all_ = 0;  // since the last progress line
};

// Per-layer hit rates before and after rebalancing, the modelled step time,
// the CPU's share of misses and the largest error.
void Report(const Options& o, const Workload& w, const Tally& t) {
  const ModelSpec& spec = w.source->spec();
  const int L = static_cast<int>(spec.moe_layers.size()), steps = w.steps;
  std::printf("\n\n  per-layer hit rate (GPU cache), before rebalancing (steps 1-%d) -> after (steps %d-%d):\n",
              t.before_end, t.after_begin + 1, steps);
  uint64_t hb = 0, ab = 0, ha = 0, aa = 0;
  for (int li = 0; li < L; ++li) {
    std::printf("    layer %3d: %5.1f%% -> %5.1f%%\n", spec.moe_layers[li],
                t.all[li][0] ? 100.0 * t.hit[li][0] / t.all[li][0] : 0.0,
                t.all[li][1] ? 100.0 * t.hit[li][1] / t.all[li][1] : 0.0);
    hb += t.hit[li][0];
    ab += t.all[li][0];
    ha += t.hit[li][1];
    aa += t.all[li][1];
  }
  const double before = ab ? 100.0 * hb / ab : 0, after = aa ? 100.0 * ha / aa : 0;
  const uint64_t misses = t.cpu_pairs + t.copied_pairs;
  std::printf("    all      : %5.1f%% -> %5.1f%%\n", before, after);
  std::printf("  modelled step time (device %g ms + CPU misses at 94 GB/s): %.2f ms -> %.2f ms\n", o.step_ms,
              1e3 * t.model_s[0] / t.before_end, 1e3 * t.model_s[1] / std::max(1, steps - t.after_begin));
  std::printf("  misses served by the CPU expert server: %.1f%% (%llu of %llu; the rest copied to the GPU)\n",
              misses ? 100.0 * t.cpu_pairs / misses : 0.0, static_cast<unsigned long long>(t.cpu_pairs),
              static_cast<unsigned long long>(misses));
  std::printf("  max relative error vs the reference MoE: %.2e over %d checked calls (tolerance 1e-2)\n", t.max_err,
              t.checks);
  std::printf("  %.1f s, %.0f tokens/s, %llu layer calls\n", t.elapsed, t.tokens_done / t.elapsed,
              static_cast<unsigned long long>(static_cast<uint64_t>(steps) * L));
}

int Main(int argc, char** argv) {
  FlagSet flags("moe-demo",
                "[--preset demo] [--layers 8] [--steps 400] [--tokens 16] [--cache C] [--trace FILE]\n"
                "Runs the coordinator, a CPU expert server (shm) and a GPU worker (cuda if present, else cpu),\n"
                "drives a drifting routing workload (or a recorded trace) through the client library and\n"
                "reports hit rates before/after rebalancing, the CPU's share of misses and the max error.");
  const Options o = ParseFlags(flags, argc, argv);
  const Workload w = PrepareWorkload(o, flags);
  Cluster cluster = StartCluster(o, w);
  const Tally t = Driver(o, w, cluster).Run();
  Report(o, w, t);

  Moectl(o, cluster.caddr, {"status"});
  cluster.Stop();
  if (!(t.max_err <= 1e-2)) {
    std::fprintf(stderr, "moe-demo: max error %.3g exceeds 1e-2\n", t.max_err);
    return 1;
  }
  std::printf("  all processes stopped; ok\n");
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
