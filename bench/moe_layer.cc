// moe_layer: end-to-end decode steps of an MoE model on a GPU worker (cuda,
// or cpu without a GPU) with a CPU expert server process on the same host
// over shared memory. Each step runs, per layer, the attention step (RMSNorm,
// GQA over a KV cache, router) on the device and then the MoE layer through
// LayerDispatcher. The routing comes from a recorded trace (--trace: the
// benchmark of record, scripts/bench_record.sh) or from a skewed synthetic
// generator (Zipf over experts with a per-layer hot set that drifts every
// step), not from the router's random weights.
//
// One row per mode, for every (batch, cache fraction):
//   ceiling    all experts on the device (cache 100%, nothing missed); skipped, with a note,
//              when the device cannot hold every expert (each mode allocates only what it uses)
//   ours       what a user gets: the worker's default policy (predictive) and copy mode (auto),
//              from a warm cache (each layer's hottest experts at the start, as the coordinator
//              places them); --policy picks another (lfru/lru with --admissions N per call)
//   ours-graph ours (same placement, policy and copy mode) with every MoE call a
//              device-planned capturable call replayed from a CUDA graph captured per layer
//              (the split and copy-instead on the GPU, misses pushed on the server's device
//              rings, admissions planned between steps at TakeStreamError; the attention
//              stays eager)
//   ours-cpu   ours without copy-instead: every miss to the CPU server (never copy)
//   lru-copy   copy every miss to the device with LRU eviction (plain offloading)
//   copy-all   stream every expert of every layer to the device each step (modelled: the
//              measured copy time of a layer's experts, overlapped with the ceiling's compute)
//   ours-host  ours with every call on the host path (Submit + Complete); optional
//   ours-dual  ours with the batch as two micro-batches (B's work overlaps A's misses); optional
// The server stores its experts as --weight-dtype says (bf16, int8, int4) and
// shares its packed store with the worker (one host copy; --share-host-copy
// false: the worker packs its own), whose GPU cache holds the same format. A
// cache of P% is P% of the GPU memory a bf16 cache of the layer would take,
// so int8 / int4 caches hold ~2x / ~3.5x the experts.
//
// Floors (bench/model/step_floor.h, derived in bench/README.md): per timed
// step of a run, from that step's own time outside its MoE calls and the
// rows of every expert each call did not find resident (the dispatcher's
// on_access), with the best rates this run measured: DRAM read by the
// server's threads alone and beside the copy engine, the host-to-device link,
// the CPU server's best compute rate. The causal floor lets a decode call's
// copies start only once its routing is known (after its attention); the
// oracle floor lets every copy start early. A row shows the medians over the
// steps; every row except ours-dual is checked against its causal floor, and
// the run exits 3, naming the rows, when a measured step beat it by more
// than 2% (a bound that a run beats is a bug in the bound). After the rows,
// a summary sets ours beside the fastest of its simpler modes.
//
// --chunk N: a batch of T > N tokens runs as ceil(T/N) calls of at most N
// tokens per layer, each chunk through every layer in turn (as an engine
// chunks a long prompt); a row is still the whole batch through all layers.
// A chunk's attention is the decode attention of its rows (each row its own
// sequence slot, at the step's position), not a prompt's causal attention.
//
// --links shm,netns,netns:US: every row once per link to the same server
// processes — their shared memory, or gRPC over a veth pair into a network
// namespace of each server's own (real TCP through the kernel), straight or
// through a relay that delays each direction (bench/server_links.h). The
// modes' names then end in "@link", and a last table sets ours over each
// link beside ours over the first plus the link's round trip per layer call
// (issue 45 point 4: what a remote pool costs).
//
// Times are medians over the timed steps, per decode step and per MoE layer.
// With --runs N every configuration runs N times (a fresh dispatcher each, so
// its start-up probe and online rates too); a time cell is then the median run
// with its spread, "median [min-max]", and the other cells come from the
// median run.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <string>
#include <vector>

#include "bench/model/step_floor.h"
#include "bench/model/step_time_model.h"
#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/dram_bandwidth.h"
#include "bench/server_links.h"
#include "transport/transport.h"
#include "core/flags.h"
#include "core/log.h"
#include "model/model_source.h"
#include "testing/routing_trace.h"
#include "testing/random_data.h"
#include "testing/subprocess.h"
#include "model/synthetic_model.h"
#include "expert_compute/cpu_features.h"
#include "expert_compute/expert_store.h"
#include "gpu_worker/admission_policy.h"
#include "bench/model/attention.h"
#include "gpu_worker/device_backend.h"
#include "gpu_worker/host_expert_store.h"
#include "gpu_worker/layer_dispatcher.h"
#include "moe/engine.h"
#ifdef MOE_HAVE_NCCL
#include "gpu_worker/expert_parallel.h"
#endif
#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef MOE_HAVE_NCCL
#include <nccl.h>

#include <barrier>
#endif

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "moe_layer: %s\n", what.c_str());
  std::exit(1);
}
void Check(const absl::Status& st, const char* what) {
  if (!st.ok()) Die(absl::StrCat(what, ": ", st.ToString()));
}
template <typename T>
T Value(absl::StatusOr<T> v, const char* what) {
  Check(v.status(), what);
  return *std::move(v);
}
double Sec(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
std::vector<int> Ints(const std::string& text) {
  std::vector<int> v;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipEmpty())) v.push_back(std::stoi(std::string(s)));
  return v;
}

// Where each step's routing comes from (ZipfRouter or TraceRouter).
class Routing {
 public:
  virtual ~Routing() = default;
  // The c most used experts of layer index li (the warm placement a coordinator would make), ascending.
  virtual std::vector<int> Hottest(int li, int c) const = 0;
  // The next step.
  virtual void Step() = 0;
  // ids/weights [n, k] of rows [off, off + n) of this step's batch, layer index li.
  virtual void Route(int li, int off, int n, int32_t* ids, float* w) = 0;
};

// Zipf routing with a drifting per-layer hot set (testing/random_data.h).
// Every call draws new tokens (the rows' offset is not needed).
class ZipfRouter final : public Routing {
 public:
  ZipfRouter(int layers, int experts, int k, double s, double drift, uint64_t seed)
      : z_(layers, experts, k, s, drift, seed) {}
  std::vector<int> Hottest(int li, int c) const override { return z_.Hottest(li, c); }
  const std::vector<int>& Ranked(int li) const { return z_.Ranked(li); }
  void Step() override { z_.Step(); }
  void SeedSamples(uint64_t seed) { z_.SeedSamples(seed); }
  void Route(int li, int /*off*/, int T, int32_t* ids, float* w) override { z_.Route(li, T, ids, w); }

 private:
  ZipfRouting z_;
};

// A recorded trace (bench/README.md's formats) replayed as T sequences decoded
// together (InterleaveSequences, as cache_replay --batch does): step s of the
// run is step s mod S of the interleaved trace, whose layer li serves the
// bench's layer index li. The trace records no gate weights: a token's
// experts weigh the same. Hottest: the layer's most used experts over the
// whole trace — the fixed set best in hindsight, the strongest start a
// placement can give a policy that does not move it.
class TraceRouter final : public Routing {
 public:
  explicit TraceRouter(RoutingTrace batched) : t_(std::move(batched)) {}
  std::vector<int> Hottest(int li, int c) const override { return BestFixedSet(t_, li, c); }
  void Step() override { step_ = (step_ + 1) % static_cast<int>(t_.steps.size()); }
  void Route(int li, int off, int n, int32_t* ids, float* w) override {
    const int k = t_.top_k;
    const std::vector<int16_t>& tok = t_.tokens[step_][li];
    for (int r = 0; r < n; ++r) {
      int used = 0;
      for (int j = 0; j < k; ++j) {
        const size_t i = static_cast<size_t>(off + r) * k + j;
        ids[r * k + j] = i < tok.size() ? tok[i] : -1;
        used += ids[r * k + j] >= 0;
      }
      for (int j = 0; j < k; ++j) w[r * k + j] = ids[r * k + j] >= 0 ? 1.0f / static_cast<float>(used) : 0.0f;
    }
  }

 private:
  RoutingTrace t_;
  int step_ = -1;  // Step() comes first
};

// Buffers in the backend's memory (device for cuda, host for cpu).
class Buffers {
 public:
  explicit Buffers(bool device) : device_(device) {}
  ~Buffers() {
    for (void* p : ptrs_) {
#ifdef MOE_HAVE_CUDA
      if (device_) {
        cudaFree(p);
        continue;
      }
#endif
      std::free(p);
    }
  }
  template <typename T>
  T* Alloc(size_t n) {
    void* p = nullptr;
#ifdef MOE_HAVE_CUDA
    if (device_) {
      if (cudaMalloc(&p, std::max<size_t>(n * sizeof(T), 256)) != cudaSuccess) Die("cudaMalloc failed");
      ptrs_.push_back(p);
      return static_cast<T*>(p);
    }
#endif
    p = std::aligned_alloc(64, (std::max<size_t>(n * sizeof(T), 64) + 63) / 64 * 64);
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }
  void Upload(void* dst, const void* src, size_t bytes) {
#ifdef MOE_HAVE_CUDA
    if (device_) {
      if (cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) Die("cudaMemcpy failed");
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }

 private:
  bool device_;
  std::vector<void*> ptrs_;
};

struct Options {
  std::string preset = "qwen3-30b-a3b", model, device = "auto", server_bin,
              modes = "ceiling,ours,ours-graph,ours-cpu,lru-copy,copy-all";
  std::string weight_dtype = "bf16";  // the server's --weight-dtype (and the worker's cache)
  std::string policy = Name(DispatcherConfig{}.policy);  // ours' cache policy: the worker's default
  std::string trace;                  // --trace: recorded routing instead of the Zipf router
  std::shared_ptr<const RoutingTrace> routing;  // that trace, read and checked against the model
  CachePolicy ours_policy = DispatcherConfig{}.policy;  // that policy, parsed
  bool share_host_copy = true;
  int layers = 0, steps = 8, warmup = 3, server_threads = 0, context = 128, seed = 1;
  std::string batches = "1,8,32,128,1024", cache = "10,25,50,100";
  double zipf = 1.0, drift = 0.02, dram_gib = 4;
  int idle_spin_us = 2000;
  int admissions = 0;
  int runs = 1;
  int slices = 1;  // > 1: that many servers, each holding one slice of every expert (--slice i/n)
  std::vector<ServerLink> links = {ServerLink{"shm"}};  // --links: how the worker reaches the servers
  std::string server_flags;  // --server-flags
  int tp = 1;      // > 1: that many GPUs, one cache over them vs a cache per GPU (RunTensorParallel)
  bool ep = false;  // with tp > 1: expert parallelism (each GPU its own tokens, exchanged over NCCL)
  int chunk = 0;  // > 0: tokens per layer call (a larger batch runs as several calls)
  int miss_buffers = DispatcherConfig{}.miss_buffers;  // the dispatcher's temporary buffers per layer parity
  bool prefetch = DispatcherConfig{}.prefetch;          // the next layer's experts copied during a prompt's call
  int prefetch_buffers = 0;                             // its buffers per layer parity (0: the worker's default)
  // Tokens in one layer call of a batch of T.
  int CallTokens(int T) const { return chunk > 0 ? std::min(T, chunk) : T; }
  // Layer calls per step of a batch of T (per MoE layer).
  int Chunks(int T) const { return T <= 0 ? 0 : (T + CallTokens(T) - 1) / CallTokens(T); }
  // The largest call of any batch.
  int MaxCallTokens() const {
    int m = 1;
    for (int T : Ints(batches)) m = std::max(m, CallTokens(T));
    return m;
  }
};

// The CPU server's time per expert at m rows routed to it: batches of m rows
// all routed to one expert (rotating over every layer's experts, so the
// weights come from DRAM) through the transport the dispatcher uses, less an
// empty batch (the same m rows, no expert) — the server's compute for one
// expert, without the round trip a call pays once. Medians of kReps.
struct CpuProbe {
  static constexpr int kReps = 5;
  std::vector<int> m;
  std::vector<double> round_trip_s, empty_s;
  std::vector<double> expert_s;  // max(0, round trip - empty), made nondecreasing in m (a suffix minimum)

  std::vector<std::pair<int, double>> curve;  // {m, expert_s}: what cache_replay --rates reads

  // The best compute rate the probe saw (FLOP/s): the floors' CPU compute rate.
  double BestFlops(double flops_per_row) const {
    double best = 0;
    for (size_t i = 0; i < m.size(); ++i)
      if (expert_s[i] > 0) best = std::max(best, m[i] * flops_per_row / expert_s[i]);
    return best;
  }
};

CpuProbe ProbeCpu(const ModelSpec& spec, const std::string& shm, int max_m) {
  TransportOptions to;
  to.hidden = spec.hidden;
  to.max_tokens_per_slot = max_m;
  to.max_pairs_per_token = 1;
  to.slots = 2;
  std::unique_ptr<ExpertTransport> tr = Value(ConnectTransport("unix://" + shm, to), "probe transport");
  // As the dispatcher polls for decode-sized calls on machines with the threads for it.
  if (std::thread::hardware_concurrency() >= 8) tr->SetPolling(std::chrono::microseconds(2000));
  std::vector<bf16_t> x(static_cast<size_t>(max_m) * spec.hidden), y(x.size());
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (bf16_t& v : x) v = F32ToBf16(u(rng));
  std::vector<int32_t> ids(max_m);
  std::vector<float> w(max_m, 1.0f);
  const int E = spec.num_experts, nl = static_cast<int>(spec.moe_layers.size());
  int cursor = 0;
  auto time = [&](int m, bool empty) {
    std::vector<double> v;
    for (int i = 0; i <= CpuProbe::kReps; ++i) {  // the first is not timed
      const int j = cursor++;
      const int layer = spec.moe_layers[(j / E) % nl];
      std::fill(ids.begin(), ids.begin() + m, empty ? -1 : j % E);
      const MoeBatch batch{layer, m, x.data(), RoutingView{m, 1, ids.data(), w.data()}};
      const Clock::time_point t0 = Clock::now();
      std::future<absl::Status> f = tr->Submit(batch, y.data(), Clock::now() + std::chrono::minutes(2));
      Check(AwaitResult(f), "cpu probe");
      if (i > 0) v.push_back(Sec(t0));
    }
    return Median(v);
  };
  CpuProbe p;
  for (int m : {1, 4, 16, 64, 256, 1024})
    if (m <= max_m) p.m.push_back(m);
  if (p.m.back() < max_m && max_m > 1) p.m.push_back(max_m);
  for (int m : p.m) {
    p.round_trip_s.push_back(time(m, false));
    p.empty_s.push_back(time(m, true));
  }
  p.expert_s.resize(p.m.size());
  double low = 1e30;
  for (size_t i = p.m.size(); i-- > 0;) {
    low = std::min(low, std::max(0.0, p.round_trip_s[i] - p.empty_s[i]));
    p.expert_s[i] = low;
  }
  for (size_t i = 0; i < p.m.size(); ++i) p.curve.push_back({p.m[i], p.expert_s[i]});
  return p;
}

// Per timed step, per layer call (in order), the rows of each expert the
// call missed in the cache.
using Uncached = std::vector<std::vector<int>>;

struct RunResult {
  double step_s = 0, moe_s = 0, hit_rate = 0, cpu_share = 0, copied_share = 0, prefetched_share = 0;
  double submit_s = 0, wait_s = 0;  // per layer call, medians
  double copies_per_step = 0;       // cache copies (admissions) per timed step
  double plan_s = 0;                // admission planning's host seconds per timed layer call
  std::vector<Uncached> uncached;   // per timed step
  std::vector<double> steps_s;      // per timed step: its time
  std::vector<double> outside_s;    // per timed step: its time outside the MoE calls (attention, routing)
  double causal_s = 0, oracle_s = 0;  // SetFloors: the medians over the steps of their floors
  double causal_ratio = 0, oracle_ratio = 0;  // the medians over the steps of step / that step's floor
  double causal_cpu_share = 0;        // of the uncached pairs, on the CPU in the causal floor's best split
};

// The medians over the timed steps of a run's floors (bench/model/step_floor.h),
// each step's from its own uncached experts and its own time outside the MoE.
// A step is compared with its own floors (the steps' uncached experts differ).
void SetFloors(RunResult& r, const FloorRates& f) {
  std::vector<double> causal, oracle, share, causal_ratio, oracle_ratio;
  for (size_t i = 0; i < r.uncached.size(); ++i) {
    const Floor c = StepFloor(r.uncached[i], r.outside_s[i], f, true);
    const double o = StepFloor(r.uncached[i], r.outside_s[i], f, false).seconds;
    causal.push_back(c.seconds);
    share.push_back(c.cpu_share);
    oracle.push_back(o);
    causal_ratio.push_back(c.seconds > 0 ? r.steps_s[i] / c.seconds : 0);
    oracle_ratio.push_back(o > 0 ? r.steps_s[i] / o : 0);
  }
  r.causal_s = Median(causal);
  r.oracle_s = Median(oracle);
  r.causal_ratio = Median(causal_ratio);
  r.oracle_ratio = Median(oracle_ratio);
  r.causal_cpu_share = Median(share);
}

// What every run's dispatcher starts from: the servers (unix://PATH over shm,
// or HOST:PORT over gRPC: --links; request slots of 1024 tokens, 8 of them),
// C slots per layer, calls of up to max_tokens tokens, a deadline no bench
// call reaches.
DispatcherConfig BenchDispatcherConfig(const std::vector<std::string>& addresses, int C, int max_tokens, int top_k,
                                       int miss_buffers, bool prefetch, int prefetch_buffers) {
  DispatcherConfig c;
  for (const std::string& a : addresses) c.servers.push_back(ExpertServerConfig{a, {}});
  c.transport.tls.insecure = true;  // a netns link: the bench's servers listen in plaintext
  c.transport.max_tokens_per_slot = 1024;
  c.transport.slots = 8;
  c.slots_per_layer = C;
  c.max_tokens = max_tokens;
  c.max_top_k = top_k;
  c.miss_buffers = miss_buffers;
  c.prefetch = prefetch;
  c.prefetch_buffers = prefetch_buffers;
  c.deadline = std::chrono::milliseconds(120000);
  return c;
}

#ifdef MOE_HAVE_NCCL
// --tp N: N GPUs of this machine serve one model as a tensor-parallel group
// would, against the same CPU servers — every rank gets the same tokens and
// routing (the same router seed) and its output of each layer is summed over
// the ranks with ncclAllReduce on its stream, as the engine's all-reduce does.
// "union": each rank a session of the group (its own experts, cached and
// computed); "independent": each rank a whole session with the same cache
// size computing every pair (a cache per GPU), all-reducing a buffer of the
// same size as the engine's per-layer all-reduce would.
// --ep N: expert parallelism — every rank its own T tokens (the same expert
// popularity, its own samples). "union": the group's sessions exchange the
// tokens over NCCL (ExpertParallel) and each computes its experts' pairs;
// "independent": each rank computes all its tokens' pairs alone (data
// parallelism, a cache per GPU), no communication.
// A step is every layer once, timed from a barrier to the slowest rank's
// end. MoE only (no attention): what the caches change.
struct TpResult {
  double step_s = 0, hit = 0, cpu = 0, copied = 0;  // shares of the routed pairs: hits, CPU servers, copies
};

TpResult RunTensorParallelOnce(const Options& o, const ModelSpec& spec, const std::vector<std::string>& addresses,
                               HostExpertStore* host, std::vector<ncclComm_t>& comms, int T, int C, bool group) {
  const int R = static_cast<int>(comms.size()), L = static_cast<int>(spec.moe_layers.size());
  const int H = spec.hidden, k = spec.top_k;
  std::barrier sync(R);
  const std::string ep_id = o.ep ? Value(NewGroupId(), "group id") : std::string();
  std::vector<double> step_t;
  std::vector<uint64_t> hits(R, 0), pairs(R, 0), cpu(R, 0), copied(R, 0);
  auto rank_main = [&](int r) {
    if (cudaSetDevice(r) != cudaSuccess) Die("cudaSetDevice");
    std::unique_ptr<DeviceBackend> backend = Value(MakeDeviceBackend("cuda"), "device");
    DispatcherConfig c = BenchDispatcherConfig(addresses, C, group && o.ep ? T * R : T, k, o.miss_buffers, o.prefetch,
                                               o.prefetch_buffers);
    if (group) c.group = TensorParallel(r, R);
    if (group && o.ep) {
      c.group.mode = GroupMode::kExpert;
      c.group.id = ep_id;
    }
    std::unique_ptr<LayerDispatcher> d = Value(LayerDispatcher::Create(spec, *backend, host, c), "dispatcher");
    std::unique_ptr<ExpertParallel> ep;
    if (group && o.ep)
      ep = Value(ExpertParallel::Create(c.group, *d, spec.num_experts, H, T, k, std::chrono::milliseconds(120000)),
                 "expert-parallel group");
    ZipfRouter router(L, spec.num_experts, k, o.zipf, o.drift, o.seed);
    if (o.ep) router.SeedSamples(o.seed + 1000 * (r + 1));
    for (int li = 0; li < L; ++li) {  // warm: the hottest experts this rank may hold
      const int layer = spec.moe_layers[li];
      std::vector<int> mine;
      for (int e : router.Ranked(li))  // (Hottest(li, E) is every expert by id: not an order)
        if (static_cast<int>(mine.size()) < C && (!group || ExpertOwner(layer, e, R) == r)) mine.push_back(e);
      Check(d->ApplyAssignment(layer, mine), "assign");
    }
    Check(d->FlushCopies(), "flush");
    Buffers buf(true);
    bf16_t* x = buf.Alloc<bf16_t>(static_cast<size_t>(T) * H);
    bf16_t* out = buf.Alloc<bf16_t>(static_cast<size_t>(T) * H);
    bf16_t* scratch = buf.Alloc<bf16_t>(static_cast<size_t>(T) * H);
    int32_t* ids = buf.Alloc<int32_t>(static_cast<size_t>(T) * k);
    float* w = buf.Alloc<float>(static_cast<size_t>(T) * k);
    std::vector<bf16_t> h0(static_cast<size_t>(T) * H);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    for (bf16_t& v : h0) v = F32ToBf16(u(rng));
    buf.Upload(x, h0.data(), h0.size() * sizeof(bf16_t));
    std::vector<int32_t> hid(static_cast<size_t>(T) * k);
    std::vector<float> hw(hid.size());
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) Die("cudaStreamCreate");
    ExpertParallel::StepTimes warm;  // the exchange's times at the end of the warm-up (subtracted)
    for (int step = 0; step < o.warmup + o.steps; ++step) {
      if (ep != nullptr && step == o.warmup) warm = ep->step_times();
      router.Step();
      sync.arrive_and_wait();
      const Clock::time_point s0 = Clock::now();
      for (int li = 0; li < L; ++li) {
        router.Route(li, 0, T, hid.data(), hw.data());
        buf.Upload(ids, hid.data(), hid.size() * sizeof(int32_t));
        buf.Upload(w, hw.data(), hw.size() * sizeof(float));
        LayerCall call;
        call.batch = MoeBatch{spec.moe_layers[li], T, x, RoutingView{T, k, ids, w}};
        call.out = out;
        call.kind = MemoryKind::kDevice;
        call.stream = stream;
        CallStats st;
        Check(ep != nullptr ? ep->Forward(call, &st) : d->Forward(call, &st), "forward");
        // Tensor parallelism: the layer's all-reduce, of the partial sums
        // (union) or of a buffer of the same size (independent: the engine of
        // a tensor-parallel model all-reduces every layer anyway, so both pay
        // it and its sync). Expert parallelism: none (each rank has its
        // tokens' whole output).
        if (!o.ep && ncclAllReduce(group ? out : scratch, group ? out : scratch, static_cast<size_t>(T) * H, ncclBfloat16,
                          ncclSum, comms[r], stream) != ncclSuccess)
          Die("ncclAllReduce");
        if (cudaStreamSynchronize(stream) != cudaSuccess) Die("cudaStreamSynchronize");
        if (step >= o.warmup) {
          hits[r] += static_cast<uint64_t>(st.hit_pairs);
          cpu[r] += static_cast<uint64_t>(st.cpu_pairs);
          copied[r] += static_cast<uint64_t>(st.copied_pairs);
          pairs[r] += static_cast<uint64_t>(st.hit_pairs + st.cpu_pairs + st.copied_pairs);
        }
      }
      sync.arrive_and_wait();
      if (r == 0 && step >= o.warmup) step_t.push_back(Sec(s0));
    }
    if (ep != nullptr && r == 0) {
      const ExpertParallel::StepTimes& t = ep->step_times();
      const double n = std::max(1, t.calls - warm.calls) * 1e-6;
      LogInfo("bench", "--ep T=", T, " rank 0, us per timed call: routing ", (t.routing - warm.routing) / n,
              ", counts ", (t.counts - warm.counts) / n, ", send ", (t.send - warm.send) / n, ", compute ",
              (t.compute - warm.compute) / n, ", back ", (t.back - warm.back) / n);
    }
    ep.reset();
    d.reset();  // it waits for its last call on the stream
    cudaStreamDestroy(stream);
  };
  std::vector<std::thread> ranks;
  for (int r = 0; r < R; ++r) ranks.emplace_back(rank_main, r);
  for (std::thread& t : ranks) t.join();
  uint64_t h = 0, p = 0, c = 0, y = 0;  // the group's pairs: each computed once (union) or on every rank (independent)
  for (int r = 0; r < R; ++r) {
    h += hits[r];
    p += pairs[r];
    c += cpu[r];
    y += copied[r];
  }
  const double n = std::max<double>(1, static_cast<double>(p));
  return TpResult{Median(step_t), static_cast<double>(h) / n, static_cast<double>(c) / n, static_cast<double>(y) / n};
}

void RunTensorParallel(const Options& o, const ModelSpec& spec, const std::vector<std::string>& addresses,
                       HostExpertStore* host) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < o.tp)
    Die(absl::StrCat("--tp ", o.tp, ": ", devices, " CUDA device(s) visible"));
  // The all-reduce's communicators (--tp); with --ep each rank's
  // ExpertParallel makes its own from a group id, and these stay null.
  std::vector<ncclComm_t> comms(o.tp, nullptr);
  std::vector<int> devs(o.tp);
  for (int r = 0; r < o.tp; ++r) devs[r] = r;
  if (!o.ep && ncclCommInitAll(comms.data(), o.tp, devs.data()) != ncclSuccess) Die("ncclCommInitAll");
  std::printf("\n### moe_layer --%s %d: %s, %d MoE layers, one cache over the GPUs (union) vs a cache per GPU\n\n",
              o.ep ? "ep" : "tp", o.tp, o.preset.c_str(), static_cast<int>(spec.moe_layers.size()));
  if (o.ep) std::printf("T: tokens per GPU (each its own); union: NCCL token exchange (ExpertParallel)\n\n");
  std::printf("| T | cache per GPU | independent step ms | union step ms | union / independent | independent hit / "
              "cpu / copied | union hit / cpu / copied |\n|---|---|---|---|---|---|---|\n");
  for (int T : Ints(o.batches))
    for (int pct : Ints(o.cache)) {
      const int C = pct * spec.num_experts / 100;
      std::vector<double> ind_t, uni_t;
      TpResult ind, uni;
      for (int run = 0; run < o.runs; ++run) {
        ind = RunTensorParallelOnce(o, spec, addresses, host, comms, T, C, false);
        uni = RunTensorParallelOnce(o, spec, addresses, host, comms, T, C, true);
        ind_t.push_back(ind.step_s);
        uni_t.push_back(uni.step_s);
      }
      auto cell = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return absl::StrFormat("%.3f [%.3f-%.3f]", 1e3 * Median(v), 1e3 * v.front(), 1e3 * v.back());
      };
      std::printf("| %d | %d%% (%d) | %s | %s | %.2f | %.1f / %.1f / %.1f%% | %.1f / %.1f / %.1f%% |\n", T, pct, C,
                  cell(ind_t).c_str(), cell(uni_t).c_str(), Median(uni_t) / Median(ind_t), 100 * ind.hit,
                  100 * ind.cpu, 100 * ind.copied, 100 * uni.hit, 100 * uni.cpu, 100 * uni.copied);
      std::fflush(stdout);
    }
  for (ncclComm_t c : comms)
    if (c != nullptr) ncclCommDestroy(c);
}
#endif  // MOE_HAVE_NCCL

class Bench {
 public:
  Bench(const Options& o, const ModelSpec& spec, std::vector<std::string> addresses, HostExpertStore* host)
      : o_(o), spec_(spec), addresses_(std::move(addresses)), host_(host) {}
  // The servers' addresses the next runs dial (a link of --links).
  void set_addresses(std::vector<std::string> addresses) { addresses_ = std::move(addresses); }

  // The routing of one configuration, from its first step: every mode of a
  // batch sees the same tokens (the same seed, or the same trace steps).
  std::unique_ptr<Routing> MakeRouting(int T) const {
    if (o_.routing != nullptr)
      return std::make_unique<TraceRouter>(Value(InterleaveSequences(*o_.routing, T), "--trace"));
    return std::make_unique<ZipfRouter>(static_cast<int>(spec_.moe_layers.size()), spec_.num_experts, spec_.top_k,
                                        o_.zipf, o_.drift, o_.seed);
  }

  // One configuration: a fresh backend + dispatcher, warm-up, timed steps.
  // A step runs the batch through every layer, chunk by chunk (--chunk).
  // nullopt (with *skipped saying why) when the device cannot hold what the
  // configuration allocates (e.g. every expert of a model larger than the GPU).
  std::optional<RunResult> Run(int T, int C, CachePolicy policy, CopyMode copy, bool dual, bool graph,
                               std::string* skipped) {
    const int N = o_.CallTokens(T);
    std::unique_ptr<DeviceBackend> backend = Value(MakeDeviceBackend(o_.device), "device");
    DispatcherConfig c = BenchDispatcherConfig(addresses_, C, N, spec_.top_k, o_.miss_buffers, o_.prefetch, o_.prefetch_buffers);
    c.policy = policy;
    c.copy_mode = copy;
    c.admissions_per_call = o_.admissions;
    c.measure_rates = copy == CopyMode::kAuto;
    c.eager_on_device = !host_path_;
    // The floor's input: the rows of every expert a call missed in the cache.
    c.on_access = [this](int, int, int pairs, bool hit) {
      if (!hit && miss_rows_ != nullptr) miss_rows_->push_back(pairs);
    };
    absl::StatusOr<std::unique_ptr<LayerDispatcher>> created = LayerDispatcher::Create(spec_, *backend, host_, c);
    if (absl::IsResourceExhausted(created.status())) {
      *skipped = std::string(created.status().message());
      return std::nullopt;
    }
    std::unique_ptr<LayerDispatcher> d = Value(std::move(created), "dispatcher");
    graph_ = graph ? std::make_unique<Graphs>() : nullptr;
    std::unique_ptr<Routing> routing = MakeRouting(T);
    Routing& router = *routing;
    // A warm cache, as a long-running worker has: the C most popular experts of
    // each layer at the start (what a coordinator would place); the policy
    // takes it from there.
    for (size_t li = 0; li < spec_.moe_layers.size(); ++li)
      Check(d->ApplyAssignment(spec_.moe_layers[li], router.Hottest(static_cast<int>(li), C)), "assign");
    Check(d->FlushCopies(), "flush");
    const uint64_t placed = d->copies_started();  // the warm placement's copies
    const bool device_mem = backend->has_device_memory();
    Buffers buf(device_mem);
    const int H = spec_.hidden, k = spec_.top_k, L = static_cast<int>(spec_.moe_layers.size());
    Io io{d.get(), Attention(device_mem), &buf, device_mem ? MemoryKind::kDevice : MemoryKind::kHost,
          buf.Alloc<bf16_t>(static_cast<size_t>(T) * H), buf.Alloc<bf16_t>(static_cast<size_t>(T) * H),
          buf.Alloc<int32_t>(static_cast<size_t>(T) * k), buf.Alloc<float>(static_cast<size_t>(T) * k),
          std::vector<int32_t>(static_cast<size_t>(T) * k), std::vector<float>(static_cast<size_t>(T) * k),
          std::vector<int32_t>(T)};
    std::vector<bf16_t> h0(static_cast<size_t>(T) * H);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    for (bf16_t& v : h0) v = F32ToBf16(u(rng));
    buf.Upload(io.h, h0.data(), h0.size() * sizeof(bf16_t));

    RunResult r;
    std::vector<double> step_t, moe_t, submit_t, wait_t;
    uint64_t hits = 0, cpu = 0, copied = 0, prefetched = 0;
    uint64_t copies_at_timed = placed;
    double plan_at_timed = 0;
    for (int step = 0; step < o_.warmup + o_.steps; ++step) {
      const bool timed = step >= o_.warmup;
      if (step == o_.warmup) {
        copies_at_timed = d->copies_started();
        plan_at_timed = d->planning().seconds;
      }
      std::fill(io.pos.begin(), io.pos.end(), o_.context + step);
      router.Step();
      Uncached* calls = timed ? &r.uncached.emplace_back() : nullptr;
      double moe = 0;
      const Clock::time_point s0 = Clock::now();
      for (int off = 0; off < T; off += N) {
        for (int li = 0; li < L; ++li) {
          CallStats st[2];
          moe += Call(io, router, li, off, std::min(N, T - off), dual, st, calls);
          if (!timed) continue;
          submit_t.push_back(st[0].submit_seconds + st[1].submit_seconds);
          wait_t.push_back(st[0].wait_seconds + st[1].wait_seconds);
          for (const CallStats& s : st) {
            hits += s.hit_pairs;
            cpu += s.cpu_pairs;
            copied += s.copied_pairs;
            prefetched += s.prefetched_pairs;
          }
        }
      }
      if (timed) {
        step_t.push_back(Sec(s0));
        moe_t.push_back(moe);
        r.steps_s.push_back(step_t.back());
        r.outside_s.push_back(std::max(0.0, step_t.back() - moe));
      }
      if (graph) Check(d->TakeStreamError(), "graph step");
    }
    const uint64_t calls_timed = static_cast<uint64_t>(o_.steps) * L * o_.Chunks(T);
    r.copies_per_step = static_cast<double>(d->copies_started() - copies_at_timed) / std::max(1, o_.steps);
    r.plan_s = (d->planning().seconds - plan_at_timed) / static_cast<double>(std::max<uint64_t>(1, calls_timed));
    r.step_s = Median(step_t);
    r.moe_s = Median(moe_t);
    r.submit_s = Median(submit_t);
    r.wait_s = Median(wait_t);
    const double pairs = static_cast<double>(hits + cpu + copied);
    r.hit_rate = pairs > 0 ? hits / pairs : 0;
    r.cpu_share = pairs > 0 ? cpu / pairs : 0;
    r.copied_share = pairs > 0 ? copied / pairs : 0;
    r.prefetched_share = pairs > 0 ? prefetched / pairs : 0;
    if (d->cost_model().measured && !graph) {  // ours' (graph replays teach the rates nothing)
      const PlanningStats ps = d->planning();
      cost_ = absl::StrFormat("%s; copy outcomes: host path %s, device path %s; prefetch window %.3f ms; %llu "
                              "layer calls planned their admissions while they ran; admission planning: %llu layer "
                              "runs planned (%.1f us each, %llu of them outlasting their call), %llu not planned "
                              "(cost on the path %.1f us per planning)",
                              d->cost_model().Describe(), d->host_outcomes().Describe(),
                              d->device_outcomes().Describe(), d->prefetch_window_seconds() * 1e3,
                              static_cast<unsigned long long>(d->admissions_during_calls()),
                              static_cast<unsigned long long>(ps.planned),
                              ps.seconds / static_cast<double>(std::max<uint64_t>(1, ps.planned)) * 1e6,
                              static_cast<unsigned long long>(ps.on_path), static_cast<unsigned long long>(ps.unplanned),
                              ps.cost_s * 1e6);
    }
    d.reset();  // before the graphs' stream: the dispatcher's destructor waits for the stream's capturable calls
    graph_.reset();
    return r;
  }

  // A backend of 4 buffers in the host copy's format, for copy timings.
  std::unique_ptr<DeviceBackend> CopyBackend() {
    std::unique_ptr<DeviceBackend> backend = Value(MakeDeviceBackend(o_.device), "device");
    BackendConfig bc;
    bc.hidden = spec_.hidden;
    bc.intermediate = spec_.intermediate;
    bc.num_buffers = 4;
    bc.max_tokens = 1;
    bc.contexts = 1;
    bc.format = host_->geometry().format;
    bc.int4_group = host_->geometry().group;
    Check(backend->Init(bc), "backend init");
    return backend;
  }
  // Copies every expert of layer 0 to the device (through 4 buffers), waits.
  void CopyLayer(DeviceBackend& backend) {
    uint64_t f = 0;
    for (int e = 0; e < spec_.num_experts; ++e)
      f = Value(backend.LoadExpert(e % 4, host_->Find(spec_.moe_layers[0], e), 0), "load");
    Check(backend.WaitCopy(f), "wait");
  }

  // Time to copy every expert of one layer to the device: the median and
  // the fastest of 3 (the floor assumes the fastest: a bound must hold for
  // the best this run saw of a noisy link).
  double CopyAllLayer(double* fastest = nullptr) {
    std::unique_ptr<DeviceBackend> backend = CopyBackend();
    std::vector<double> t;
    for (int rep = 0; rep < 3; ++rep) {
      const Clock::time_point t0 = Clock::now();
      CopyLayer(*backend);
      t.push_back(Sec(t0));
    }
    if (fastest != nullptr) *fastest = *std::min_element(t.begin(), t.end());
    return Median(t);
  }

  // Host DRAM read by the CPU and the copy engine at once (the floor's shared
  // term): the copy engine copies layer 0's experts back to back while
  // `cpu_gbps` measures the CPU threads' read rate; their sum, GB/s.
  double SharedDramGbps(const std::function<double()>& cpu_gbps, double* copy_gbps) {
    std::unique_ptr<DeviceBackend> backend = CopyBackend();
    std::atomic<bool> stop{false};
    double copied = 0, seconds = 0;
    std::thread copier([&] {
      const Clock::time_point t0 = Clock::now();
      while (!stop.load()) {
        CopyLayer(*backend);
        copied += spec_.num_experts * static_cast<double>(host_->geometry().packed_bytes());
      }
      seconds = Sec(t0);
    });
    const double cpu = cpu_gbps();
    stop.store(true);
    copier.join();
    *copy_gbps = seconds > 0 ? copied / seconds / 1e9 : 0;
    return cpu + *copy_gbps;
  }

  // One attention step for every run (its weights and KV cache are large):
  // sized for the largest call (a chunk's rows use sequence slots from 0),
  // its cache prefilled once.
  AttentionStep* Attention(bool device_mem) {
    if (attn_ == nullptr) {
      const int max_T = o_.MaxCallTokens();
      const int steps = o_.warmup + o_.steps;
      AttentionConfig ac = Value(AttentionConfigFor(spec_, max_T, o_.context + steps + 1, o_.seed), "attention config");
      attn_ = Value(MakeAttentionStep(device_mem ? "cuda" : "cpu", ac), "attention");
      Check(attn_->PrefillCache(max_T, o_.context), "prefill");
      LogInfo("bench", "attention: ", ac.Summary());
    }
    return attn_.get();
  }

  const std::string& cost() const { return cost_; }

 private:
  // One configuration's dispatcher, attention, buffers (the backend's memory:
  // hidden states h, MoE input x, routing ids / w) and host routing.
  struct Io {
    LayerDispatcher* d;
    AttentionStep* attn;
    Buffers* buf;
    MemoryKind kind;
    bf16_t *h, *x;
    int32_t* ids;
    float* w;
    std::vector<int32_t> hid;  // [T, k] the routing, generated on the host (the
    std::vector<float> hw;     // router's output would be on the device)
    std::vector<int32_t> pos;  // [T]
  };

  // Attention over rows [off, off + n) of layer index li (sequence slots
  // 0..n-1), then this layer's routing of those rows to the device.
  void Attend(Io& io, int li, int off, int n) {
    const size_t oh = static_cast<size_t>(off) * spec_.hidden, ok = static_cast<size_t>(off) * spec_.top_k;
    Check(io.attn->Run(li, n, io.pos.data() + off, io.h + oh, io.x + oh, io.ids + ok, io.w + ok), "attention");
    io.buf->Upload(io.ids + ok, io.hid.data() + ok, static_cast<size_t>(n) * spec_.top_k * sizeof(int32_t));
    io.buf->Upload(io.w + ok, io.hw.data() + ok, static_cast<size_t>(n) * spec_.top_k * sizeof(float));
  }
  LayerCall At(const Io& io, int layer, int off, int n) const {
    const size_t oh = static_cast<size_t>(off) * spec_.hidden, ok = static_cast<size_t>(off) * spec_.top_k;
    return LayerCall{MoeBatch{layer, n, io.x + oh, RoutingView{n, spec_.top_k, io.ids + ok, io.w + ok}}, io.h + oh,
                     io.kind, {}};
  }
  // The next call's missed experts go to a new entry of `calls` (none when null).
  void Record(Uncached* calls) { miss_rows_ = calls != nullptr ? &calls->emplace_back() : nullptr; }

  // Rows [off, off + n) through layer index li: attention, then the MoE as one
  // call or, dual, two micro-batches (A's misses go out, then B's attention
  // and hits run meanwhile). Returns the MoE's seconds.
  double Call(Io& io, Routing& router, int li, int off, int n, bool dual, CallStats st[2], Uncached* calls) {
    const int layer = spec_.moe_layers[li], k = spec_.top_k;
    router.Route(li, off, n, io.hid.data() + static_cast<size_t>(off) * k, io.hw.data() + static_cast<size_t>(off) * k);
    if (graph_ != nullptr) return GraphCall(io, li, off, n, st, calls);
    const int na = dual ? n / 2 : n;
    if (na == 0 || na == n) {
      Attend(io, li, off, n);
      Record(calls);
      const Clock::time_point m0 = Clock::now();
      Check(io.d->Forward(At(io, layer, off, n), &st[0]), "forward");
      miss_rows_ = nullptr;
      return Sec(m0);
    }
    Attend(io, li, off, na);
    Record(calls);
    const Clock::time_point m0 = Clock::now();
    const int ta = Value(io.d->Submit(At(io, layer, off, na)), "submit A");
    double moe = Sec(m0);
    Attend(io, li, off + na, n - na);
    Record(calls);
    const Clock::time_point m1 = Clock::now();
    const int tb = Value(io.d->Submit(At(io, layer, off + na, n - na)), "submit B");
    miss_rows_ = nullptr;
    Check(io.d->Complete(ta, &st[0]), "complete A");
    Check(io.d->Complete(tb, &st[1]), "complete B");
    return moe + Sec(m1);
  }

  // ours-graph: one CUDA graph per (layer, tokens), captured after one eager
  // enqueue of the same call, replayed on a stream of the bench's own.
  struct Graphs {
#ifdef MOE_HAVE_CUDA
    cudaStream_t stream = nullptr;
    std::map<std::pair<int, int>, cudaGraphExec_t> exec;
    Graphs() {
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) Die("cudaStreamCreate failed");
    }
    ~Graphs() {
      for (auto& [key, e] : exec) cudaGraphExecDestroy(e);
      cudaStreamDestroy(stream);
    }
#endif
  };
  double GraphCall(Io& io, int li, int off, int n, CallStats st[2], Uncached* calls) {
#ifdef MOE_HAVE_CUDA
    const int layer = spec_.moe_layers[li];
    Attend(io, li, off, n);
    LayerCall call = At(io, layer, off, n);
    call.stream = graph_->stream;
    cudaGraphExec_t& exec = graph_->exec[{li, n}];
    if (exec == nullptr) {
      Check(io.d->EnqueueCapturable(call), "capturable warm-up");
      if (cudaStreamSynchronize(graph_->stream) != cudaSuccess) Die("warm-up failed");
      cudaGraph_t g = nullptr;
      if (cudaStreamBeginCapture(graph_->stream, cudaStreamCaptureModeGlobal) != cudaSuccess) Die("capture");
      Check(io.d->EnqueueCapturable(call), "capturable call");
      if (cudaStreamEndCapture(graph_->stream, &g) != cudaSuccess || cudaGraphInstantiate(&exec, g, 0) != cudaSuccess)
        Die("graph capture failed");
      cudaGraphDestroy(g);
    }
    const Clock::time_point m0 = Clock::now();
    if (cudaGraphLaunch(exec, graph_->stream) != cudaSuccess || cudaStreamSynchronize(graph_->stream) != cudaSuccess)
      Die("graph replay failed");
    const double seconds = Sec(m0);
    // The split as the GPU made it (its slot map at replay time, which the
    // host's view may trail): the stats, and the floors' uncached experts —
    // one row each, as the log holds no rows per expert (fewer rows only
    // lower a floor: still a bound).
    st[0] = Value(io.d->LastDeviceCall(layer), "graph call's log");
    if (calls != nullptr) calls->emplace_back(st[0].copied_experts + st[0].cpu_experts, 1);
    return seconds;
#else
    (void)io, (void)li, (void)off, (void)n, (void)st, (void)calls;
    Die("ours-graph needs the cuda backend");
    return 0;
#endif
  }

  const Options& o_;
  const ModelSpec& spec_;
  std::unique_ptr<Graphs> graph_;  // ours-graph runs
 public:
  bool host_path_ = false;         // ours-host runs (DispatcherConfig::eager_on_device = false)
 private:
  std::vector<std::string> addresses_;  // one per server (per slice)
  HostExpertStore* host_;
  std::string cost_;
  std::unique_ptr<AttentionStep> attn_;
  std::vector<int>* miss_rows_ = nullptr;  // where on_access records the current call's missed experts
};

std::string Ms(double s) { return absl::StrFormat("%.3f", s * 1e3); }

// A measured step below (1 - kFloorSlack) x its causal floor fails the run:
// the floor is a bound, so that is a bug in the floor (or its rates).
constexpr double kFloorSlack = 0.02;

// How one mode runs the worker (Bench::Run's knobs).
struct ModeRun {
  CachePolicy policy;
  CopyMode copy;
  bool dual = false, graph = false, host_path = false;
};

// Several runs of one configuration: the run with the median step time, and
// the spread of a field over the runs.
struct Runs {
  std::vector<RunResult> all;
  const RunResult& median() const {
    std::vector<size_t> order(all.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a].step_s < all[b].step_s; });
    return all[order[order.size() / 2]];
  }
  // "median" for one run, "median [min-max]" (ms) for several.
  // Seconds as ms (the default), or any value times `scale` with `digits` decimals.
  std::string Spread(double RunResult::*field, double scale = 1, int digits = -1) const {
    std::vector<double> v;
    for (const RunResult& r : all) v.push_back(r.*field * scale);
    std::sort(v.begin(), v.end());
    auto f = [&](double x) { return digits < 0 ? Ms(x) : absl::StrFormat("%.*f", digits, x); };
    if (v.size() == 1) return f(v[0]);
    return absl::StrFormat("%s [%s-%s]", f(v[v.size() / 2]), f(v.front()), f(v.back()));
  }
};

// The CPU probe's table: m -> ms per expert and its TFLOP/s.
void PrintProbe(const CpuProbe& probe, const ModelSpec& spec, const std::string& dtype) {
  std::printf("CPU server per expert (the floor's CPU rate: m rows to one expert through the shm transport, less an "
              "empty batch of m rows; medians of %d, %s weights; flops = 2*3*H*I*m):\n\n",
              CpuProbe::kReps, dtype.c_str());
  std::printf("| m | round trip ms | empty ms | ms per expert | TFLOP/s |\n|---|---|---|---|---|\n");
  for (size_t i = 0; i < probe.m.size(); ++i) {
    const double flops = 6.0 * spec.hidden * spec.intermediate * probe.m[i];
    std::printf("| %d | %s | %s | %s | %s |\n", probe.m[i], Ms(probe.round_trip_s[i]).c_str(), Ms(probe.empty_s[i]).c_str(),
                Ms(probe.expert_s[i]).c_str(),
                probe.expert_s[i] > 0 ? absl::StrFormat("%.3f", flops / probe.expert_s[i] / 1e12).c_str() : "-");
  }
  std::printf("\n");
}

// The rates of this run for cache_replay --rates (bench/replay.h LoadRates).
void WriteRates(const std::string& path, double dram_gbps, double pcie_gbps, double shared_gbps, double expert_bytes,
                const CpuProbe& probe) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) Die("--rates-out: cannot write " + path);
  std::fprintf(f, "{\"dram_gbps\": %.3f, \"pcie_gbps\": %.3f, \"shared_gbps\": %.3f, \"expert_bytes\": %.0f, "
               "\"cpu_expert_seconds\": [",
               dram_gbps, pcie_gbps, shared_gbps, expert_bytes);
  for (size_t i = 0; i < probe.curve.size(); ++i)
    std::fprintf(f, "%s[%d, %.9f]", i ? ", " : "", probe.curve[i].first, probe.curve[i].second);
  std::fprintf(f, "]}\n");
  if (std::fclose(f) != 0) Die("--rates-out: cannot write " + path);
}

int Main(int argc, char** argv) {
  Options o;
  FlagSet flags("moe_layer",
                "[--preset qwen3-30b-a3b] [--layers N] [--batches 1,8,...] [--cache 10,25,...]\n"
                "End-to-end MoE decode steps and prompts on a GPU worker with a CPU expert server over shm;\n"
                "prints a Markdown table, a row per mode (ours: the worker's defaults; ours-graph, ours-cpu,\n"
                "lru-copy, copy-all, all-on-GPU), each with its causal and oracle floors from the rates measured\n"
                "in the same run, then ours beside its simpler modes. Exits 3 when a row beat its causal floor.");
  flags.String("preset", &o.preset, "model geometry: qwen3-30b-a3b, deepseek-v3, mixtral-8x7b, tiny, ...");
  flags.String("model", &o.model,
               "serve this model instead of the synthetic --preset: a GGUF file or checkpoint directory (e.g. "
               "bench/make_peer_gguf.py's gpt-oss GGUF, the file llama.cpp reads), every MoE layer of it");
  int64_t int4_group = 0;
  int64_t layers = 0, steps = o.steps, warmup = o.warmup, threads = 0, context = o.context, slices = 1, tp = 1, ep = 1;
  flags.Int("layers", &layers,
            "MoE layers (0: the model's, or the trace's, as many as fit in host memory: one copy shared by the "
            "server and the worker, two with --share-host-copy=false)");
  flags.String("batches", &o.batches, "tokens per decode step");
  flags.String("cache", &o.cache, "cache sizes, percent of the GPU memory a bf16 cache of every expert would take");
  flags.String("modes", &o.modes,
               "rows per batch and cache size: ceiling (skipped when the device cannot hold every expert), ours, "
               "ours-graph (cuda), ours-cpu, lru-copy, copy-all (modelled), ours-host, ours-dual");
  flags.Int("steps", &steps, "timed decode steps per configuration");
  flags.Int("warmup", &warmup, "untimed steps first (the cache warms up)");
  flags.Int("server-threads", &threads,
            "expert server compute threads (0: the server's default, all cores but max(2, cores/16): the worker's caller and its shm "
            "completion thread spin in decode, and the server pins each compute thread to one core)");
  flags.Int("context", &context, "KV cache positions each sequence already has");
  std::string rates_out;
  flags.String("rates-out", &rates_out,
               "write the rates measured in this run (DRAM, link, the CPU probe) as JSON to this file, for "
               "cache_replay --rates");
  int64_t chunk = 0;
  flags.Int("chunk", &chunk,
            "tokens per layer call: a larger batch runs as ceil(T/N) calls per layer, each chunk through every "
            "layer (0: the whole batch in one call)");
  flags.String("trace", &o.trace,
               "routing from a recorded trace (bench/README.md's formats, e.g. ../shared/data/traces/*.jsonl.xz) "
               "instead of the Zipf generator: a batch of T replays it as T sequences decoded together, its first "
               "--layers layers; the warm placement is each layer's most used experts over the trace. Needs a "
               "preset of the trace's geometry (olmoe-1b-7b, kimi-linear-48b, mixtral-8x7b)");
  flags.Double("zipf", &o.zipf, "Zipf exponent of expert popularity");
  flags.Double("drift", &o.drift, "share of adjacent popularity ranks swapped per step");
  flags.String("device", &o.device, "worker backend: auto, cuda or cpu");
  int64_t spin = o.idle_spin_us;
  flags.Int("server-idle-spin-us", &spin, "the expert server's --idle-spin-us (decode keeps it hot)");
  int64_t admissions = o.admissions;
  flags.Int("admissions", &admissions, "ours under --policy lfru or lru: cache admissions started per layer call");
  flags.String("policy", &o.policy,
               "ours' cache policy from the warm placement on: predictive (the worker's default: cost-model "
               "admissions with cross-layer prefetch), lfru or lru (with --admissions per call), static");
  int64_t miss_buffers = o.miss_buffers;
  flags.Int("miss-buffers", &miss_buffers,
            "the worker's temporary buffers per layer parity for copied experts (0, the worker's default: 4-16 "
            "by the expert's size)");
  flags.Bool("prefetch", &o.prefetch,
             "the worker copies the next layer's experts during a call that copies (the default; false for A/B)");
  int64_t prefetch_buffers = o.prefetch_buffers;
  flags.Int("prefetch-buffers", &prefetch_buffers,
            "the worker's prefetch buffers per layer parity (0, the worker's default: as many as 1 GiB holds, at "
            "most a layer's experts)");
  int64_t runs = o.runs;
  flags.Int("runs", &runs, "runs of every configuration (fresh dispatcher each); cells show median [min-max]");
  flags.Int("slices", &slices,
            "expert servers, each holding slice i of n of every expert's intermediate dimension on its share of "
            "the cores (--server-threads / n threads each; default 1: one whole server)");
  flags.Int("ep", &ep,
            "GPUs: > 1 runs only the expert-parallel comparison — every GPU its own tokens, one cache over them "
            "(tokens exchanged over NCCL) vs a cache per GPU, per --batches and --cache");
  flags.Int("tp", &tp,
            "GPUs: > 1 runs only the tensor-parallel comparison — every GPU the same tokens, one cache over them "
            "(each rank its experts, ncclAllReduce of the outputs) vs a cache per GPU, per --batches and --cache");
  flags.String("server-flags", &o.server_flags,
               "more flags for every moe-expert-server started, space-separated (e.g. --merge-requests=false)");
  flags.String("server-bin", &o.server_bin, "moe-expert-server binary (default: next to this one or in the build tree)");
  flags.String("weight-dtype", &o.weight_dtype,
               "the expert server's --weight-dtype and the worker's cache precision: bf16, int8, int4, fp8, mxfp4 or "
               "auto (the checkpoint's own: e.g. mxfp4 for a GGUF of MXFP4 experts)");
  flags.Int("int4-group", &int4_group,
            "a synthetic --preset written as an int4 checkpoint with a scale per this many k (32: Kimi-K2's "
            "compressed-tensors groups), its codes served as they are (--weight-dtype int4 or auto); 0: the preset's "
            "bf16 weights");
  flags.Bool("share-host-copy", &o.share_host_copy,
             "the worker maps the server's packed store (one host copy); false: it packs its own");
  std::string links = "shm";
  flags.String("links", &links,
               "how the worker reaches the servers, every row once per link: shm (their shared memory), netns (gRPC "
               "over a veth pair into a network namespace of each server's own: real TCP through the kernel), "
               "netns:US (the same through a relay holding each direction US microseconds). netns links need root "
               "(CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's ip; e.g. shm,netns:25,netns:100");
  flags.Parse(argc, argv);
  if (absl::StatusOr<std::vector<ServerLink>> l = ParseServerLinks(links); l.ok()) {
    o.links = *std::move(l);
  } else {
    flags.Fail(std::string(l.status().message()));
  }
  // Before any thread starts: every later thread (gRPC's too) lives there.
  if (absl::c_any_of(o.links, [](const ServerLink& l) { return l.netns; }))
    if (absl::Status st = testing::EnterOwnNetworkNamespace(); !st.ok()) Die(absl::StrCat("--links: ", st.message()));
  if (absl::Status st = CheckWeightDtype(o.weight_dtype); !st.ok()) flags.Fail(std::string(st.message()));
  if (int4_group < 0 || int4_group > 4096) flags.Fail("--int4-group: 0 (off) or a group of 32 or a multiple of 64 up to 4096");
  if (int4_group != 0 && (!o.model.empty() || (o.weight_dtype != "int4" && o.weight_dtype != "auto")))
    flags.Fail("--int4-group: for a synthetic --preset served as int4 (--weight-dtype int4 or auto), not with --model");
  for (absl::string_view m : absl::StrSplit(o.modes, ',', absl::SkipEmpty()))
    if (!absl::c_linear_search(std::vector<absl::string_view>{"ceiling", "ours", "ours-graph", "ours-cpu", "lru-copy",
                                                              "copy-all", "ours-host", "ours-dual"},
                               m))
      flags.Fail(absl::StrCat("--modes: unknown mode '", m, "'"));
  o.steps = static_cast<int>(steps);
  o.warmup = static_cast<int>(warmup);
  o.context = static_cast<int>(context);
  o.idle_spin_us = static_cast<int>(spin);
  o.admissions = static_cast<int>(admissions);
  if (absl::StatusOr<CachePolicy> p = ParseCachePolicy(o.policy, "--policy"); p.ok()) {
    o.ours_policy = *p;
  } else {
    flags.Fail(std::string(p.status().message()));
  }
  if (runs < 1) Die("--runs: must be at least 1");
  if (slices < 1 || slices > kMaxSlices) Die("--slices: must be in [1, 8]");
  o.slices = static_cast<int>(slices);
#ifdef MOE_HAVE_NCCL
  if (tp < 1 || tp > 64) Die("--tp: must be in [1, 64]");
  if (ep < 1 || ep > 64) Die("--ep: must be in [1, 64]");
  if (tp > 1 && ep > 1) Die("--tp and --ep: one of them");
  if ((tp > 1 || ep > 1) && o.links.size() > 1) Die("--tp / --ep: one link (--links) at a time");
#else
  if (tp != 1 || ep != 1) Die("--tp / --ep: this build has no NCCL");
#endif
  o.tp = static_cast<int>(std::max(tp, ep));
  o.ep = ep > 1;
  if (chunk < 0) Die("--chunk: must be at least 0");
  o.chunk = static_cast<int>(chunk);
  o.runs = static_cast<int>(runs);
  if (miss_buffers < 0 || miss_buffers > kMaxMissBuffers) flags.Fail("--miss-buffers must be in [0, 256]");
  o.miss_buffers = static_cast<int>(miss_buffers);
  if (prefetch_buffers < 0 || prefetch_buffers > kMaxMissBuffers) flags.Fail("--prefetch-buffers must be in [0, 256]");
  o.prefetch_buffers = static_cast<int>(prefetch_buffers);
  // The server's own default (ChooseDefaultThreads: an engine shares the
  // host): all cores but max(2, cores / 16). The server pins its compute
  // threads, one per core, and a parallel region waits for the slowest: a
  // worker thread that lands on a pinned core halves that thread and stalls
  // the region. With one core left, the worker's two hot threads (the caller
  // and the shm completion thread, both spinning in decode) made runs bimodal
  // on the AMX host (T = 1, 25% cache: 8 or 16 ms per step, 11-48 ms without
  // copies).
  o.server_threads = threads > 0 ? static_cast<int>(threads)
                                 : static_cast<int>(Value(NumaBinding::Create("auto", 0, true), "numa")->cpus().size());

  // --model: the file's experts, all of its MoE layers; else the preset's first --layers.
  std::unique_ptr<ModelSource> source;
  std::string uri;
  if (!o.model.empty()) {
    source = Value(OpenModel(o.model), "--model");
    const int64_t n = static_cast<int64_t>(source->spec().moe_layers.size());
    if (layers != 0 && layers != n)
      Die(absl::StrCat("--layers ", layers, ": --model ", o.model, " is served whole (", n,
                       " MoE layers); write the file with the layers wanted"));
    layers = n;
    uri = o.model;
    o.preset = o.model.substr(o.model.find_last_of('/') + 1);  // the tables' title
  }
  // --int4-group: the synthetic model is an int4 checkpoint of those groups (its URI's dtype=int4:group=G).
  const std::string checkpoint = int4_group > 0 ? absl::StrCat(":dtype=int4:group=", int4_group) : "";
  ModelSpec full = source ? source->spec() : Value(PresetSpec(o.preset), "preset");
  if (!source && int4_group > 0) {
    full.quant.scheme = WeightQuant::kInt4Group;
    full.quant.group_size = static_cast<int>(int4_group);
  }
  std::optional<RoutingTrace> trace;
  if (!o.trace.empty()) trace = Value(ReadRoutingTrace(o.trace), "--trace");
  if (layers <= 0) {
    const ExpertGeometry g = Value(StorageGeometry(full, o.weight_dtype), "--weight-dtype");
    const double per_layer = (o.share_host_copy ? 1.0 : 2.0) * full.num_experts * g.packed_bytes();
    const double avail = static_cast<double>(AvailableMemoryBytes());
    layers = std::max<int64_t>(1, static_cast<int64_t>(avail * 0.8 / per_layer));
    layers = std::min<int64_t>(layers, static_cast<int64_t>(full.moe_layers.size()));
    if (trace) layers = std::min<int64_t>(layers, trace->num_layers);
  }
  // Dense leading layers (DeepSeek) are kept out: every layer of the bench model is an MoE layer.
  if (!source) {
    const int first_moe = full.moe_layers.front();
    uri = absl::StrCat("synthetic:", o.preset, ":layers=", first_moe + layers, ":seed=", o.seed, checkpoint);
    source = Value(OpenModel(uri), "model");
  }
  const ModelSpec& spec = source->spec();
  const ExpertGeometry server_geometry = Value(StorageGeometry(spec, o.weight_dtype), "--weight-dtype");
  if (trace) {
    if (o.tp > 1) Die("--trace: not with --tp / --ep");
    RoutingTrace& t = *trace;
    const int L = static_cast<int>(spec.moe_layers.size());
    if (t.num_experts != spec.num_experts || t.top_k != spec.top_k || t.num_layers < L)
      Die(absl::StrCat("--trace: ", t.num_layers, " layers of ", t.num_experts, " experts, top-", t.top_k,
                       "; --preset ", o.preset, " needs ", spec.num_experts, " experts, top-", spec.top_k, " and at least ",
                       L, " layers"));
    for (int T : Ints(o.batches))
      if (T > static_cast<int>(t.steps.size()))
        Die(absl::StrCat("--trace: batch ", T, " needs at least as many steps; the trace has ", t.steps.size()));
    o.routing = std::make_shared<const RoutingTrace>(std::move(t));
  }

  // DRAM bandwidth, measured before the server starts.
  double dram_gbps = 0, dram_max_gbps = 0;
  std::string dram_note;
  {
    std::unique_ptr<NumaBinding> numa = Value(NumaBinding::Create("auto", o.server_threads), "numa");
    ComputePool pool(*numa);
    const CpuFeatures& cpu = CpuFeatures::Get();
    DramBandwidth bw = MeasureDramBandwidth(*numa, pool, o.dram_gib, cpu.avx512f && cpu.os_avx512);
    dram_gbps = bw.gbps;
    dram_max_gbps = bw.max_gbps;
    dram_note = bw.note;
  }

  // The expert server process.
  std::string server_bin = o.server_bin;
  if (server_bin.empty()) {
    const std::filesystem::path self = std::filesystem::canonical("/proc/self/exe").parent_path();
    for (const auto& p : {self / "moe-expert-server", self / ".." / "expert_server" / "moe-expert-server"})
      if (std::filesystem::exists(p)) server_bin = p.string();
  }
  if (server_bin.empty()) Die("cannot find moe-expert-server (use --server-bin)");
  char dir_tmpl[] = "/tmp/moe_layer_XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl);
  // --slices n: n servers of server_threads / n threads each, holding slice
  // i/n of every expert on disjoint cores (the server's share of the node);
  // in network namespaces of their own when a link of --links asks.
  const int per_server = std::max(1, o.server_threads / o.slices);
  LogInfo("bench", "model ", spec.Summary(), "; starting ", o.slices, " x ", server_bin, " with ", per_server,
          " threads, ", o.weight_dtype, " experts", o.slices > 1 ? " (sliced)" : "");
  BenchServers::Options so;
  so.binary = server_bin;
  so.dir = dir;
  so.count = o.slices;
  so.links = o.links;
  for (int i = 0; i < o.slices; ++i) {
    std::vector<std::string> args{"--model=" + uri, absl::StrCat("--threads=", per_server), "--max-tokens=4096",
                                  absl::StrCat("--idle-spin-us=", o.idle_spin_us), "--weight-dtype=" + o.weight_dtype,
                                  absl::StrCat("--slice=", i, "/", o.slices)};
    for (absl::string_view f : absl::StrSplit(o.server_flags, ' ', absl::SkipEmpty())) args.emplace_back(f);
    so.args.push_back(std::move(args));
  }
  std::unique_ptr<BenchServers> servers = Value(BenchServers::Start(so), "expert servers");
  const std::vector<std::string>& sockets = servers->sockets();
  const std::string& shm = sockets.front();

  // The worker's host copy of the experts (pinned through a backend kept alive for the run).
  std::unique_ptr<DeviceBackend> pin = Value(MakeDeviceBackend(o.device), "device");
  {
    BackendConfig bc;
    bc.hidden = spec.hidden;
    bc.intermediate = spec.intermediate;
    bc.num_buffers = 1;
    bc.max_tokens = 1;
    bc.contexts = 1;
    Check(pin->Init(bc), "backend init");
  }
  const Clock::time_point h0 = Clock::now();
  std::unique_ptr<HostExpertStore> host =
      Value(HostExpertStore::Open(*source, IdentityOf(*source, uri), spec.moe_layers, {shm}, o.weight_dtype,
                                  o.share_host_copy, pin.get()),
            "host store");
  LogInfo("bench", "host expert store: ", host->shared() ? "shared with the server" : "own", ", ", host->bytes() >> 20,
          " MiB of its own, in ", Sec(h0), " s; DRAM ", dram_gbps, " GB/s");

#ifdef MOE_HAVE_NCCL
  if (o.tp > 1) {
    RunTensorParallel(o, spec, servers->Addresses(o.links.front()), host.get());
    servers.reset();
    std::filesystem::remove_all(dir);
    return 0;
  }
#endif
  Bench bench(o, spec, servers->Addresses(o.links.front()), host.get());
  const std::vector<std::string> modes = absl::StrSplit(o.modes, ',', absl::SkipEmpty());
  auto has = [&](const char* m) { return std::find(modes.begin(), modes.end(), m) != modes.end(); };
  const int L = static_cast<int>(spec.moe_layers.size());
  // The floor's rates: the link (a layer's experts over their copy time) and
  // the server's compute per expert (rows up to the largest call, at most the
  // server's --max-tokens).
  double copy_fastest = 0;
  const double copy_all_layer = bench.CopyAllLayer(&copy_fastest);
  const double copy_bytes = static_cast<double>(host->geometry().packed_bytes());
  const double pcie_gbps = copy_all_layer > 0 ? spec.num_experts * copy_bytes / copy_all_layer / 1e9 : 0;
  const double pcie_max_gbps = copy_fastest > 0 ? spec.num_experts * copy_bytes / copy_fastest / 1e9 : 0;
  // Rows up to the largest call, and at least 256: the floors' CPU compute
  // rate is the probe's best FLOP rate, which only many rows reach. Probed
  // at one row alone (decode, --batches=1) that rate is one expert's DRAM
  // time read as compute: the 48-layer floor came out 23 ms against a
  // measured 19 ms step.
  const CpuProbe probe = ProbeCpu(spec, shm, std::min(std::max(o.MaxCallTokens(), 256), 4096));
  // The DRAM the CPU and the copy engine read together: cores bound the CPU's
  // rate, the copy engine reads beside them (the H100 host: 99 GB/s by the
  // CPU alone, a 512-token prompt's step below a floor that shared those).
  double copy_beside_gbps = 0, cpu_beside_gbps = 0;
  const double shared_gbps = bench.SharedDramGbps(
      [&] {
        std::unique_ptr<NumaBinding> numa = Value(NumaBinding::Create("auto", o.server_threads), "numa");
        ComputePool pool(*numa);
        const CpuFeatures& cpu = CpuFeatures::Get();
        cpu_beside_gbps = MeasureDramBandwidth(*numa, pool, o.dram_gib, cpu.avx512f && cpu.os_avx512).max_gbps;
        return cpu_beside_gbps;
      },
      &copy_beside_gbps);
  FloorRates rates;
  // The best rates this run saw: the floors must hold for them.
  // The CPU's DRAM rate: the best any probe saw — the streaming probe alone,
  // the same beside the copy engine, and the server itself streaming one
  // expert (on the GPU host the server read 5-13% faster than the probe).
  double server_gbps = 0;
  for (size_t i = 0; i < probe.m.size(); ++i)
    if (probe.expert_s[i] > 0)
      server_gbps = std::max(server_gbps, static_cast<double>(server_geometry.packed_bytes()) / probe.expert_s[i] / 1e9);
  const double cpu_dram_gbps = std::max({dram_max_gbps, cpu_beside_gbps, server_gbps});
  rates.dram_Bps = cpu_dram_gbps * 1e9;
  rates.pcie_Bps = pcie_max_gbps * 1e9;
  rates.shared_Bps = std::max(cpu_dram_gbps, shared_gbps) * 1e9;
  rates.cpu_bytes = static_cast<double>(server_geometry.packed_bytes());
  rates.copy_bytes = copy_bytes;
  rates.flops_per_row = 6.0 * spec.hidden * spec.intermediate;
  rates.cpu_flops = probe.BestFlops(rates.flops_per_row);
  rates.num_experts = spec.num_experts;

  std::printf("\n### moe_layer: %s, %d MoE layers, backend %s, server %d threads over shm, server weights %s, "
              "ours' policy %s%s\n\n",
              o.preset.c_str(), L, pin->name(), o.server_threads, o.weight_dtype.c_str(), o.policy.c_str(),
              o.ours_policy == CachePolicy::kLfru ? absl::StrCat(" (", o.admissions, " admissions per call)").c_str() : "");
  std::printf("DRAM read %.1f GB/s (%s); expert %.2f MB bf16, %.2f MB %s (server and GPU cache; the floor's bytes), host copy %s; "
              "%s; %d warm-up + %d timed steps (medians); context %d; %d run(s) per "
              "configuration%s%s.\n\n",
              dram_gbps, dram_note.c_str(), spec.ExpertBf16Bytes() / 1e6, server_geometry.packed_bytes() / 1e6,
              o.weight_dtype.c_str(), host->shared() ? "shared" : "own",
              o.routing != nullptr ? absl::StrFormat("routing of %s (%zu steps, as many sequences as tokens)",
                                                     o.trace, o.routing->steps.size()).c_str()
                                   : absl::StrFormat("Zipf %.2f, drift %.3f", o.zipf, o.drift).c_str(),
              o.warmup, o.steps, o.context, o.runs,
              o.runs > 1 ? ", times as median [min-max] over the runs" : "",
              o.chunk > 0 ? absl::StrFormat("; batches in calls of at most %d tokens per layer (--chunk)", o.chunk).c_str() : "");
  std::printf("Host-to-device copies %.1f GB/s (a layer's %d experts, %.2f MB, in %s ms; the fastest of 3, %.1f GB/s, "
              "is the floors' link rate).\n",
              pcie_gbps, spec.num_experts, spec.num_experts * copy_bytes / 1e6, Ms(copy_all_layer).c_str(), pcie_max_gbps);
  std::printf("DRAM read by the CPU (best run) and the copy engine at once: %.1f + %.1f = %.1f GB/s (the floors' shared "
              "DRAM rate: the larger of this and the CPU's rate); the floors' CPU DRAM rate %.1f GB/s (the best of the "
              "probe alone, %.1f, beside the copy engine, and the server streaming one expert, %.1f); the CPU server's "
              "best compute rate %.2f TFLOP/s (the probe below).\n\n",
              cpu_beside_gbps, copy_beside_gbps, shared_gbps, cpu_dram_gbps, dram_max_gbps, server_gbps,
              rates.cpu_flops / 1e12);
  PrintProbe(probe, spec, o.weight_dtype);
  if (!rates_out.empty()) WriteRates(rates_out, dram_gbps, pcie_gbps, shared_gbps, rates.cpu_bytes, probe);

  // Per link: the round trip of an empty 1-token batch (what a decode layer
  // call pays for the path alone).
  const bool one_link = o.links.size() == 1 && !o.links.front().netns;
  std::map<std::string, double> link_rtt;
  if (!one_link) {
    std::printf("Links to the servers (--links; every row below once per link, the mode's name followed by @link): ");
    for (const ServerLink& link : o.links) {
      link_rtt[link.name] = Value(EmptyRoundTrip(servers->Addresses(link).front(), spec.hidden, spec.moe_layers.front(),
                                                 1, 200), "round trip over a link");
      std::printf("%s%s %.1f us", &link == &o.links.front() ? "" : ", ", link.name.c_str(), link_rtt[link.name] * 1e6);
    }
    std::printf(" (an empty 1-token batch's round trip, median of 200).\n\n");
  }
  // Every mode a row: step, MoE per layer call, the pair split, both floors
  // of its own steps (bench/model/step_floor.h) and the ratios.
  std::printf("| T | cache | mode | step ms | MoE/layer ms | hit | cpu | copied (prefetched) | causal floor ms | "
              "step/causal | oracle floor ms | step/oracle | misses on the cpu: run / causal floor | cache copies/step | "
              "plan us/call |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  // The host's DRAM rate moves within a call (a Qwen3 T=8 graph run beat a
  // floor whose CPU rate came from start-up probes taken while the host was
  // slower): after every row's runs the streaming probe runs again, and the
  // floors take the best seen. (Not the server's one-expert probe: run again,
  // its expert is still in the L3 from the first, and it read 1,347 GB/s.)
  auto raise_rates = [&] {
    std::unique_ptr<NumaBinding> numa = Value(NumaBinding::Create("auto", o.server_threads), "numa");
    ComputePool pool(*numa);
    const CpuFeatures& cpu = CpuFeatures::Get();
    const double dram = MeasureDramBandwidth(*numa, pool, o.dram_gib, cpu.avx512f && cpu.os_avx512).max_gbps;
    rates.dram_Bps = std::max(rates.dram_Bps, dram * 1e9);
    rates.shared_Bps = std::max(rates.shared_Bps, rates.dram_Bps);
  };
  std::vector<std::string> beaten;  // rows whose step beat their causal floor by more than kFloorSlack
  std::vector<std::string> summary;
  auto repeat = [&](int T, int C, const ModeRun& m, std::string* skipped) -> std::optional<Runs> {
    Runs r;
    bench.host_path_ = m.host_path;
    for (int i = 0; i < o.runs; ++i) {
      std::optional<RunResult> one = bench.Run(T, C, m.policy, m.copy, m.dual, m.graph, skipped);
      if (!one) break;
      r.all.push_back(*std::move(one));
    }
    bench.host_path_ = false;
    if (static_cast<int>(r.all.size()) < o.runs) return std::nullopt;
    raise_rates();
    // Two micro-batches overlap one's misses with the other's attention: the
    // floors (attention, then the MoE) do not describe that shape.
    for (RunResult& run : r.all)
      if (!m.dual) SetFloors(run, rates);
    return r;
  };
  auto print_row = [&](int T, const std::string& cache, const std::string& mode, const Runs& runs, bool floors) {
    const RunResult& m = runs.median();
    const double missed = m.cpu_share + m.copied_share;
    const std::string floor_cells =
        floors ? absl::StrFormat("%s | %.2f | %s | %.2f | %s", runs.Spread(&RunResult::causal_s), m.causal_ratio,
                                 runs.Spread(&RunResult::oracle_s), m.oracle_ratio,
                                 missed > 0 ? absl::StrFormat("%.0f%% / %.0f%%", 100 * m.cpu_share / missed,
                                                              100 * m.causal_cpu_share)
                                            : std::string("-"))
               : std::string("- | - | - | - | -");
    std::printf("| %d | %s | %s | %s | %s | %.0f%% | %.0f%% | %.0f%% (%.0f%%) | %s | %s | %s |\n", T, cache.c_str(),
                mode.c_str(), runs.Spread(&RunResult::step_s).c_str(), runs.Spread(&RunResult::moe_s, 1.0 / L).c_str(),
                100 * m.hit_rate, 100 * m.cpu_share, 100 * m.copied_share, 100 * m.prefetched_share, floor_cells.c_str(),
                runs.Spread(&RunResult::copies_per_step, 1.0, 1).c_str(), runs.Spread(&RunResult::plan_s, 1e6, 0).c_str());
    std::fflush(stdout);
    if (!floors) return;
    for (size_t i = 0; i < runs.all.size(); ++i)
      if (runs.all[i].causal_ratio < 1 - kFloorSlack)
        beaten.push_back(absl::StrFormat("T=%d cache %s mode %s run %zu: step / causal floor %.3f (medians: step %s "
                                         "ms, floor %s ms)", T, cache, mode, i + 1, runs.all[i].causal_ratio,
                                         Ms(runs.all[i].step_s), Ms(runs.all[i].causal_s)));
  };
  auto skip_row = [&](int T, const std::string& cache, const std::string& mode, const std::string& why) {
    std::printf("| %d | %s | %s | skipped: %s | | | | | | | | | | | |\n", T, cache.c_str(), mode.c_str(), why.c_str());
    std::fflush(stdout);
  };
  const bool device_mem = pin->has_device_memory();
  // Per link: the empty round trip of one token (what a decode layer call pays
  // for the path alone), and each (T, cache, mode)'s median step.
  std::map<std::tuple<std::string, int, std::string>, double> link_step;  // (link, T, cache) -> ours' step
  for (const ServerLink& link : o.links) {
    const bool first_link = &link == &o.links.front();
    bench.set_addresses(servers->Addresses(link));
    // A mode's name in the rows: with several links (or a netns one), "mode @link".
    auto label = [&](const std::string& mode) { return one_link ? mode : mode + " @" + link.name; };
    for (int T : Ints(o.batches)) {
      // Layer calls per step: L, times the chunks of the batch.
      const int calls = std::max(1, L * o.Chunks(T));
      // Ceiling: every expert resident, nothing missed (when the device holds them all).
      std::optional<Runs> ceil;
      if (has("ceiling") && first_link) {  // no server: the same on every link
        std::string why;
        ceil = repeat(T, spec.num_experts, ModeRun{CachePolicy::kStatic, CopyMode::kNever}, &why);
        if (ceil) print_row(T, "100%", "ceiling", *ceil, true);
        else skip_row(T, "100%", "ceiling", "the device cannot hold every expert (" + why + ")");
      }
      for (int pct : Ints(o.cache)) {
        // pct% of the GPU memory a bf16 cache of every expert takes, in slots of the cache's format.
        const double bf16_slot = static_cast<double>(pin->ExpertBytes(ExpertGeometry::For(spec.hidden, spec.intermediate)));
        const double slot = static_cast<double>(pin->ExpertBytes(host->geometry()));
        const int C = std::max(0, std::min(spec.num_experts,
                                           static_cast<int>(std::lround(pct / 100.0 * spec.num_experts * bf16_slot / slot))));
        const std::string cache = absl::StrFormat("%d%% (%d)", pct, C);
        std::map<std::string, double> step;  // mode -> median step seconds
        double outside = 0;                  // a measured run's time outside the MoE (for copy-all without a ceiling)
        for (const std::string& mode : modes) {
          if (mode == "ceiling" || mode == "copy-all") continue;
          ModeRun m{o.ours_policy, CopyMode::kAuto};
          if (mode == "ours-cpu") m.copy = CopyMode::kNever;
          if (mode == "lru-copy") m = ModeRun{CachePolicy::kLru, CopyMode::kAlways};
          m.dual = mode == "ours-dual";
          m.graph = mode == "ours-graph";
          m.host_path = mode == "ours-host";
          if (m.dual && T < 2) continue;
          if (m.graph && (!device_mem || o.Chunks(T) != 1)) {
            skip_row(T, cache, label(mode), device_mem ? "calls larger than --chunk" : "needs the cuda backend");
            continue;
          }
          std::string why;
          std::optional<Runs> runs = repeat(T, C, m, &why);
          if (!runs) {
            skip_row(T, cache, label(mode), why);
            continue;
          }
          print_row(T, cache, label(mode), *runs, !m.dual);
          step[mode] = runs->median().step_s;
          outside = Median(runs->median().outside_s);
        }
        if (has("copy-all") && first_link) {  // modelled copies: no server
          // Modelled: every expert of every layer streamed each step, overlapped
          // with the ceiling's compute (without a ceiling: the copies alone after
          // a measured run's time outside the MoE, which is below what it would take).
          const double s = ceil ? ceil->median().step_s - ceil->median().moe_s +
                                      calls * std::max(copy_all_layer, ceil->median().moe_s / calls)
                                : outside + calls * copy_all_layer;
          std::printf("| %d | %s | copy-all (model%s) | %s | %s | | | | | | | | | | |\n", T, cache.c_str(),
                      ceil ? "" : ", copies only", Ms(s).c_str(), Ms(std::max(copy_all_layer, s / calls)).c_str());
          step["copy-all"] = s;
        }
        if (step.count("ours") != 0) link_step[{link.name, T, cache}] = step["ours"];
        if (step.count("ours") != 0 && first_link) {
          std::string alt;
          for (const char* a : {"ours-cpu", "lru-copy", "copy-all"})
            if (step.count(a) != 0 && (alt.empty() || step[a] < step[alt])) alt = a;
          summary.push_back(absl::StrFormat(
              "| %d | %s | %s | %s | %s | %s |", T, cache, Ms(step["ours"]),
              alt.empty() ? std::string("-") : absl::StrFormat("%s %s ms", alt, Ms(step[alt])),
              alt.empty() ? std::string("-") : absl::StrFormat("%.2f", step["ours"] / step[alt]),
              step.count("ours-graph") ? absl::StrFormat("%.2f", step["ours-graph"] / step["ours"]) : std::string("-")));
        }
      }
    }
  }
  if (!summary.empty()) {
    std::printf("\nours against its own simpler modes (the fastest of ours-cpu, lru-copy, copy-all):\n\n"
                "| T | cache | ours step ms | fastest alternative | ours/alternative | ours-graph/ours |\n"
                "|---|---|---|---|---|---|\n");
    for (const std::string& line : summary) std::printf("%s\n", line.c_str());
  }
  if (!one_link) {
    // What a remote pool costs (issue 45 point 4): ours over each link beside
    // ours over the first link plus the link's round trip per layer call.
    const std::string& base = o.links.front().name;
    std::printf("\nours over each link beside ours over %s (its step plus every layer call's round trip over the link):\n\n"
                "| T | cache | link | round trip us | ours step ms | %s step + calls x round trip ms | ratio |\n"
                "|---|---|---|---|---|---|---|\n", base.c_str(), base.c_str());
    for (const auto& [key, step_s] : link_step) {
      const auto& [name, T, cache] = key;
      const auto b = link_step.find({base, T, cache});
      if (name == base || b == link_step.end()) continue;
      const double bound = b->second + std::max(1, L * o.Chunks(T)) * link_rtt[name];
      std::printf("| %d | %s | %s | %.1f | %s | %s | %.2f |\n", T, cache.c_str(), name.c_str(), link_rtt[name] * 1e6,
                  Ms(step_s).c_str(), Ms(bound).c_str(), step_s / bound);
    }
  }
  std::printf("\ncopy model (the last eager run of ours): %s\n", bench.cost().c_str());
  std::printf("floors' rates at the end (the best the probes saw, the streaming probe also after every row): CPU DRAM "
              "%.1f GB/s, shared DRAM %.1f GB/s\n",
              rates.dram_Bps / 1e9, rates.shared_Bps / 1e9);
  servers.reset();
  std::filesystem::remove_all(dir);
  if (!beaten.empty()) {
    std::fprintf(stderr, "moe_layer: %zu row(s) beat the causal floor by more than %.0f%% (a bound that a run beats "
                 "is a bug in the bound):\n", beaten.size(), 100 * kFloorSlack);
    for (const std::string& b : beaten) std::fprintf(stderr, "  %s\n", b.c_str());
    return 3;
  }
  return 0;
}

}  // namespace
}  // namespace moe

namespace {
// A crash prints its raw stack, library and offset per frame (a benchmark
// runs where no debugger is).
void PrintStackAndDie(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

int main(int argc, char** argv) {
  signal(SIGSEGV, PrintStackAndDie);
  signal(SIGBUS, PrintStackAndDie);
  return moe::Main(argc, argv);
}
