// The whole system as real processes on loopback: one moe-coordinator, two
// moe-expert-server processes (each hosting every expert, shared memory,
// registered with the coordinator) and two moe-gpu-worker processes (cpu
// backend, both servers configured so each has a replica, placements from the
// coordinator), driven through WorkerClient and administered with moectl.
//
//   - skewed traffic moves the workers' caches toward the hot experts (hit
//     rate rises from 0), seen through GetWorkerInfo, the per-call stats and
//     the workers' and the coordinator's /metrics scraped over HTTP;
//   - moectl pin/unpin changes what the workers cache (and hit); drain stops
//     the traffic to a server (its own /metrics stay still), undrain resumes it;
//   - kill -9 of the coordinator: the workers keep answering correctly, and a
//     coordinator restarted on the same port with the same state file still
//     has every admin override (pin, policy, drain); the workers come back;
//   - kill -9 of one of the two replica servers under continuous traffic:
//     every call succeeds (failover to the replica);
//   - the bounded soak: concurrent traffic on both workers while one server
//     is SIGKILLed and restarted twice and the coordinator restarted once;
//     zero wrong answers, every call accounted for, RSS growth < 5%.
//
// Every output is compared with the reference MoE (relative L2 error <= 1e-2)
// on random activations and weights.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/worker_client.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "moe/v1/coordinator.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace moe {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Scrape;
using testing::Subprocess;
using testing::TempDir;

// 2 MoE layers x 32 experts, top-4, H=512, I=256: small enough for 2 cores.
const char kModel[] = "synthetic:demo:layers=2:seed=3";
constexpr int kSlots = 4;     // cache slots per layer on each worker
constexpr int kTokens = 8;    // tokens per micro-batch
constexpr double kHotShare = 0.8;
constexpr double kTolerance = 1e-2;
// The hot experts of each layer (80% of the pairs); 7 and 9 are cold everywhere.
const std::vector<std::vector<int>> kHot = {{2, 11, 19, 27}, {4, 13, 22, 30}};
const std::vector<int> kPinned = {7, 9};

// ------------------------------------------------------------------ helpers

const ModelSource& Model() {
  static const std::unique_ptr<ModelSource> src = [] {
    absl::StatusOr<std::unique_ptr<ModelSource>> s = OpenModel(kModel);
    if (!s.ok()) {
      ADD_FAILURE() << s.status();
      std::abort();
    }
    return *std::move(s);
  }();
  return *src;
}

ReferenceMoe& Reference() {
  static ReferenceMoe ref(Model());
  return ref;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Resident KiB per mapping name ("[heap]", "/memfd:moe-shm (deleted)", a
// library, "[anon]" for unnamed ones) from /proc/<pid>/smaps.
std::map<std::string, long> RssByMapping(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/smaps");
  std::map<std::string, long> out;
  std::string line, name;
  while (std::getline(f, line)) {
    if (line.rfind("Rss:", 0) == 0) {
      out[name] += std::strtol(line.c_str() + 4, nullptr, 10);
    } else if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
               line.find(':') > line.find(' ')) {
      // "start-end perms offset dev inode   pathname"
      std::istringstream h(line);
      std::string field;
      std::string inode;
      for (int i = 0; i < 4; ++i) h >> field;
      h >> inode;
      name.clear();
      std::getline(h >> std::ws, name);
      if (name.empty()) name = "[anon]";
      if (name.rfind("/memfd:", 0) == 0) name += " inode " + inode;  // one per segment
    }
  }
  return out;
}

// Resident KiB of a process's own memory: every mapping but the servers'
// shared expert stores (a worker maps them read-only; their pages are the
// server's, resident once, and show up in the worker's RSS as it reads them).
long OwnRssKib(pid_t pid) {
  long kib = 0;
  for (const auto& [name, k] : RssByMapping(pid))
    if (name.rfind("/memfd:moe-expert-store", 0) != 0) kib += k;
  return kib;
}

// The mappings whose resident size changed by 256 KiB or more, before -> after.
std::string RssGrowth(const std::map<std::string, long>& before, const std::map<std::string, long>& after) {
  std::string s;
  std::map<std::string, long> all = before;
  for (const auto& [name, kib] : after) all.emplace(name, 0);
  for (const auto& [name, unused] : all) {
    const long b = before.count(name) ? before.at(name) : 0, a = after.count(name) ? after.at(name) : 0;
    if (std::abs(a - b) >= 256) s += "  " + name + ": " + std::to_string(b) + " -> " + std::to_string(a) + " KiB\n";
  }
  return s;
}

std::string Tail(const std::string& s, size_t n = 3000) { return s.size() > n ? s.substr(s.size() - n) : s; }

bool Contains(const std::vector<int>& v, int e) { return std::find(v.begin(), v.end(), e) != v.end(); }
bool ContainsAll(const std::vector<int>& v, const std::vector<int>& want) {
  for (int e : want)
    if (!Contains(v, e)) return false;
  return true;
}
std::string Str(const std::vector<int>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ",";
    s += std::to_string(v[i]);
  }
  return s + "}";
}


// The value of one series ("name{labels}" exactly as exposed) in a scrape; NaN if absent.
double Series(const std::string& scrape, const std::string& series) {
  const std::string key = series + " ";
  size_t at = 0;
  while ((at = scrape.find(key, at)) != std::string::npos) {
    if (at == 0 || scrape[at - 1] == '\n') return std::strtod(scrape.c_str() + at + key.size(), nullptr);
    at += key.size();
  }
  return NAN;
}

struct CommandResult {
  int code = -1;
  std::string out, err;
};

// One random micro-batch of `layer`: random activations and weights; each
// token's k distinct experts come from the layer's hot set with probability
// kHotShare each (while hot ones are left), else from the cold ones.
struct Batch {
  int layer = 0, T = 0, k = 0;
  std::vector<bf16_t> x, out;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Batch SkewedBatch(int layer, std::mt19937_64& rng, double hot_share = kHotShare,
                  const std::vector<int>& forced = {}) {
  const ModelSpec& spec = Model().spec();
  const int E = spec.num_experts, K = spec.top_k, H = spec.hidden;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), uw(0.1f, 1.0f), coin(0.0f, 1.0f);
  Batch b;
  b.layer = layer;
  b.T = kTokens;
  b.k = K;
  b.x.resize(static_cast<size_t>(b.T) * H);
  b.out.assign(b.x.size(), 0);
  for (bf16_t& v : b.x) v = F32ToBf16(u(rng));
  const std::vector<int>& hot = kHot[layer];
  for (int t = 0; t < b.T; ++t) {
    std::vector<int> chosen = forced;
    while (static_cast<int>(chosen.size()) < K) {
      std::vector<int> pool;
      const bool want_hot = coin(rng) < hot_share;
      for (int e = 0; e < E; ++e)
        if (!Contains(chosen, e) && Contains(hot, e) == want_hot) pool.push_back(e);
      if (pool.empty())
        for (int e = 0; e < E; ++e)
          if (!Contains(chosen, e)) pool.push_back(e);
      chosen.push_back(pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)]);
    }
    for (int e : chosen) {
      b.ids.push_back(e);
      b.w.push_back(uw(rng));
    }
  }
  return b;
}

// Relative L2 error of b.out against the reference MoE.
double ErrorOf(const Batch& b) {
  const int H = Model().spec().hidden;
  std::vector<double> ref(static_cast<size_t>(b.T) * H);
  absl::Status st =
      Reference().Forward<double>(b.layer, b.T, b.x.data(), RoutingView{b.T, b.k, b.ids.data(), b.w.data()}, ref.data());
  if (!st.ok()) return INFINITY;
  std::vector<float> got(ref.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = Bf16ToF32(b.out[i]);
  return RelativeL2Error(got.data(), ref.data(), ref.size());
}

struct CallResult {
  absl::Status status;
  double error = INFINITY;
  int hit = 0, cpu = 0, copied = 0;
  int pairs() const { return hit + cpu + copied; }
};

// One ForwardLayer call with one micro-batch, checked against the reference.
CallResult Forward(WorkerClient& client, Batch& b, int timeout_ms = 20000) {
  CallResult r;
  std::fill(b.out.begin(), b.out.end(), 0);
  WorkerBatch wb{b.T, b.k, b.x.data(), b.ids.data(), b.w.data(), b.out.data(), {}};
  r.status = client.ForwardLayer(b.layer, {&wb}, timeout_ms);
  if (!r.status.ok()) return r;
  r.hit = static_cast<int>(wb.stats.hit_pairs());
  r.cpu = static_cast<int>(wb.stats.cpu_pairs());
  r.copied = static_cast<int>(wb.stats.copied_pairs());
  r.error = ErrorOf(b);
  return r;
}

// Background traffic of the kill/restart tests: the first failed or wrong
// answer (for the final assertions' messages), and the threads stopped and
// joined however the test leaves (a failed ASSERT included).
class FirstProblem {
 public:
  void Note(const std::string& where, const CallResult& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (text_.empty()) text_ = where + ": " + c.status.ToString() + " error " + std::to_string(c.error);
  }
  std::string text() const {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 private:
  mutable std::mutex mu_;
  std::string text_;
};

struct TrafficThreads {
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  void Join() {
    stop = true;
    for (std::thread& t : threads)
      if (t.joinable()) t.join();
  }
  ~TrafficThreads() { Join(); }
};

// ------------------------------------------------------------------ the system

struct Process {
  std::unique_ptr<Subprocess> proc;
  std::string addr;      // "ready on ADDR"
  int metrics_port = -1;
  std::string log;       // its stderr
};

class SystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // glibc gives new threads their own malloc arenas: a reconnect or a
    // coordinator restart (new completion / gRPC threads) then raises RSS by
    // 1-7 MB once, allocator noise that would swamp the soak's leak check
    // (over 5% of a 75 MB worker built without CUDA; seen in the pristine
    // root). Two arenas keep RSS a measure of what our code keeps (the
    // processes inherit it).
    setenv("MALLOC_ARENA_MAX", "2", 1);
    (void)Reference();
    state_file_ = dir_.path() + "/state.json";
    // Below the ephemeral range: two tests kill the coordinator and restart it on its port.
    ASSERT_NO_FATAL_FAILURE(StartCoordinator(absl::StrCat("127.0.0.1:", testing::ReservablePort())));
    for (int i = 0; i < 2; ++i) {
      sockets_[i] = dir_.path() + "/s" + std::to_string(i + 1) + ".sock";
      LaunchServer(i);
    }
    for (Process& s : servers_) ASSERT_NO_FATAL_FAILURE(WaitReady(s, "moe-expert-server", true));
    for (int i = 0; i < 2; ++i) {
      Process& w = workers_[i];
      w.log = dir_.path() + "/worker" + std::to_string(i + 1) + ".log";
      w.proc = std::make_unique<Subprocess>(
          testing::BinaryPath("moe-gpu-worker"),
          std::vector<std::string>{std::string("--model=") + kModel,
                                   "--servers=unix://" + sockets_[0] + ",unix://" + sockets_[1],
                                   "--coordinator=" + coord_.addr, "--worker-id=" + WorkerId(i),
                                   "--cache-experts-per-layer=" + std::to_string(kSlots), "--device=cpu",
                                   "--cpu-threads=1",
                                   // From an empty cache: what is cached is the coordinator's placement.
                                   "--fill-cache=false",
                                   // Misses always go to an expert server (no copy-instead):
                                   // what the servers' request counters assert on.
                                   "--copy-mode=never", "--max-tokens=64", "--listen=127.0.0.1:0", "--insecure",
                                   "--metrics-port=0", "--metrics-address=127.0.0.1"},
          w.log);
    }
    for (Process& w : workers_) ASSERT_NO_FATAL_FAILURE(WaitReady(w, "moe-gpu-worker", true));
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<std::unique_ptr<WorkerClient>> c = WorkerClient::Connect(workers_[i].addr, testing::PlaintextTls());
      ASSERT_TRUE(c.ok()) << c.status();
      clients_[i] = *std::move(c);
      absl::StatusOr<moe::v1::WorkerInfo> info = clients_[i]->GetInfo();
      ASSERT_TRUE(info.ok()) << info.status();
      ASSERT_EQ(info->device(), "cpu");
      ASSERT_EQ(info->slots_per_layer(), static_cast<uint32_t>(kSlots));
      ASSERT_EQ(info->policy(), "predictive") << "the default: admissions inside the coordinator's placement";
    }
    // Everyone registered, and both workers applied their latest assignment
    // (the routes to both servers included: a route change is a new version).
    ASSERT_TRUE(WaitForStatus([](const nlohmann::json& j) { return Count(j, "workers", "up") == 2 &&
                                                                   Count(j, "servers", "up") == 2 && Synced(j) == 2; },
                              10s))
        << "the workers and servers never all showed up at the coordinator: " << last_status_;
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "%s\n", Logs().c_str());
  }

  static std::string WorkerId(int i) { return absl::StrCat("w", i + 1); }
  static std::string ServerId(int i) { return absl::StrCat("s", i + 1); }

  // Starts (or restarts) expert server i on its socket; WaitReady waits for it.
  void LaunchServer(int i) {
    Process& s = servers_[i];
    s.log = dir_.path() + "/server" + std::to_string(i + 1) + ".log";
    s.addr.clear();
    s.metrics_port = -1;
    s.proc = std::make_unique<Subprocess>(
        testing::BinaryPath("moe-expert-server"),
        std::vector<std::string>{std::string("--model=") + kModel, "--listen=127.0.0.1:0", "--insecure",
                                 "--threads=1", "--shm-socket=" + sockets_[i], "--coordinator=" + coord_.addr,
                                 "--server-id=" + ServerId(i), "--metrics-port=0", "--metrics-address=127.0.0.1"},
        s.log);
  }

  // Starts (or restarts) the coordinator at `listen` with the same state file.
  void StartCoordinator(const std::string& listen) {
    coord_.log = dir_.path() + "/coordinator.log";
    coord_.addr.clear();
    coord_.metrics_port = -1;
    coord_.proc = std::make_unique<Subprocess>(
        testing::BinaryPath("moe-coordinator"),
        std::vector<std::string>{"--listen=" + listen, "--insecure", "--insecure-admin", "--rebalance-interval-seconds=0.3",
                                 "--half-life-seconds=1", "--heartbeat-interval-ms=100",
                                 "--heartbeat-timeout-seconds=1", "--state-file=" + state_file_, "--metrics-port=0",
                                 "--metrics-address=127.0.0.1"},
        coord_.log);
    ASSERT_NO_FATAL_FAILURE(WaitReady(coord_, "moe-coordinator", true));
  }

  // Waits for "NAME ready on ADDR" (and "NAME metrics on HOST:PORT").
  void WaitReady(Process& p, const std::string& name, bool metrics) {
    const Clock::time_point end = Clock::now() + 60s;
    while (p.addr.empty() && Clock::now() < end) {
      const std::string line = p.proc->ReadLine(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()));
      if (line.empty()) break;
      const size_t at = line.find("ready on ");
      if (at != std::string::npos) p.addr = line.substr(at + 9);
    }
    ASSERT_FALSE(p.addr.empty()) << name << " did not start; its log:\n" << Tail(ReadFile(p.log));
    if (!metrics) return;
    const std::string line = p.proc->ReadLine(10s);
    ASSERT_NE(line.find(" metrics on "), std::string::npos) << name << ": '" << line << "'";
    p.metrics_port = std::atoi(line.substr(line.rfind(':') + 1).c_str());
    ASSERT_GT(p.metrics_port, 0) << line;
  }

  std::string Logs() const {
    std::string s;
    for (const Process* p : {&coord_, &servers_[0], &servers_[1], &workers_[0], &workers_[1]})
      if (!p->log.empty()) s += "\n---- " + p->log + "\n" + Tail(ReadFile(p->log), 1500);
    return s;
  }

  // moectl --coordinator ADDR --insecure ARGS: exit code, stdout, stderr.
  CommandResult Moectl(const std::vector<std::string>& args) {
    std::vector<std::string> a = {"--coordinator", coord_.addr, "--insecure", "--timeout-seconds=3"};
    a.insert(a.end(), args.begin(), args.end());
    const std::string err_path = dir_.path() + "/moectl." + std::to_string(moectl_runs_.fetch_add(1)) + ".err";
    CommandResult r;
    Subprocess p(testing::BinaryPath("moectl"), a, err_path);
    r.out = p.ReadAll(20s);
    const int st = p.Wait(10s);
    r.code = st >= 0 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.err = ReadFile(err_path);
    return r;
  }

  static int Count(const nlohmann::json& status, const std::string& what, const std::string& state) {
    int n = 0;
    if (status.contains(what))
      for (const auto& x : status[what]) n += x.value("state", "") == state;
    return n;
  }
  // Workers up whose acknowledged version (> 0) is the one last assigned.
  static int Synced(const nlohmann::json& status) {
    int n = 0;
    if (status.contains("workers"))
      for (const auto& w : status["workers"]) {
        const std::string acked = w.value("acked_version", "0");
        n += w.value("state", "") == "up" && acked != "0" && acked == w.value("assigned_version", "");
      }
    return n;
  }
  static std::string StateOf(const nlohmann::json& status, const std::string& server) {
    if (status.contains("servers"))
      for (const auto& x : status["servers"])
        if (x.value("server_id", "") == server) return x.value("state", "");
    return "";
  }

  // Polls `moectl --json status` until pred holds (false at the deadline).
  bool WaitForStatus(const std::function<bool(const nlohmann::json&)>& pred, std::chrono::milliseconds timeout) {
    const Clock::time_point end = Clock::now() + timeout;
    do {
      CommandResult r = Moectl({"--json", "status"});
      last_status_ = r.out + r.err;
      if (r.code == 0) {
        const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
        if (!j.is_discarded() && pred(j)) return true;
      }
      std::this_thread::sleep_for(100ms);
    } while (Clock::now() < end);
    return false;
  }

  std::vector<int> SlotExperts(int worker, int layer) {
    absl::StatusOr<moe::v1::WorkerInfo> info = clients_[worker]->GetInfo();
    if (!info.ok()) return {};
    for (const auto& l : info->layers())
      if (static_cast<int>(l.layer()) == layer) return std::vector<int>(l.slot_experts().begin(), l.slot_experts().end());
    return {};
  }

  // One skewed call on every (worker, layer); every output checked. Adds the
  // pairs to hit[w] / all[w]. False (with a test failure) if a call failed.
  bool Round(std::mt19937_64& rng, std::vector<int>* hit = nullptr, std::vector<int>* all = nullptr,
             double hot_share = kHotShare) {
    for (int w = 0; w < 2; ++w)
      for (int layer = 0; layer < 2; ++layer) {
        Batch b = SkewedBatch(layer, rng, hot_share);
        const CallResult r = Forward(*clients_[w], b);
        EXPECT_TRUE(r.status.ok()) << WorkerId(w) << " layer " << layer << ": " << r.status;
        if (!r.status.ok()) return false;
        EXPECT_LE(r.error, kTolerance) << WorkerId(w) << " layer " << layer;
        EXPECT_EQ(r.pairs(), b.T * b.k) << "every pair is a hit or went to a server";
        ++calls_;
        if (hit != nullptr) (*hit)[w] += r.hit;
        if (all != nullptr) (*all)[w] += r.pairs();
      }
    return true;
  }

  // Skewed rounds until pred() holds; false at the deadline.
  bool DriveUntil(std::mt19937_64& rng, const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
    const Clock::time_point end = Clock::now() + timeout;
    while (Clock::now() < end) {
      if (!Round(rng)) return false;
      if (pred()) return true;
    }
    return pred();
  }

  bool EveryWorkerHolds(int layer, const std::vector<int>& experts) {
    for (int w = 0; w < 2; ++w)
      if (!ContainsAll(SlotExperts(w, layer), experts)) return false;
    return true;
  }

  // Shared-memory requests a server answered OK, from its /metrics (the series
  // appears with the first request: absent = 0); -1 if the scrape failed.
  double ServerRequests(int server) {
    const std::string m = Scrape(servers_[server].metrics_port);
    if (m.find("HTTP/1.1 200 OK") == std::string::npos) {
      ADD_FAILURE() << ServerId(server) << ": no /metrics: " << m;
      return -1;
    }
    const double v = Series(m, "moe_expert_requests_total{transport=\"shm\",code=\"OK\"}");
    return std::isnan(v) ? 0 : v;
  }

  TempDir dir_;
  std::string state_file_;
  std::string sockets_[2];
  Process coord_, servers_[2], workers_[2];
  std::unique_ptr<WorkerClient> clients_[2];
  std::string last_status_;
  std::atomic<int> moectl_runs_{0};
  int calls_ = 0;
};

// ------------------------------------------------------------------ tests

TEST_F(SystemTest, SkewedTrafficMovesPlacementTowardHotExperts) {
  std::mt19937_64 rng(1);
  const Clock::time_point t0 = Clock::now();
  // The first calls: nothing is cached yet. Placement rounds are paused for
  // them (a worker without counts of its own is placed by the global ones, so
  // w2 could otherwise get w1's hot experts before its first call).
  CommandResult p = Moectl({"policy", "set", "rebalance_interval_seconds=0"});
  ASSERT_EQ(p.code, 0) << p.err;
  std::vector<int> hit(2, 0), all(2, 0);
  ASSERT_TRUE(Round(rng, &hit, &all));
  p = Moectl({"--json", "policy", "set", "rebalance_interval_seconds=0.3"});
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(nlohmann::json::parse(p.out)["rebalance_interval_seconds"], 0.3) << p.out;
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(hit[w], 0) << WorkerId(w) << ": the cache starts empty";
    EXPECT_GT(all[w], 0);
  }
  const std::string m0 = Scrape(workers_[0].metrics_port);
  ASSERT_NE(m0.find("HTTP/1.1 200 OK"), std::string::npos) << m0;
  const double hits_before = Series(m0, "moe_worker_pairs_total{layer=\"0\",result=\"hit\"}");
  const double cpu_before = Series(m0, "moe_worker_pairs_total{layer=\"0\",result=\"cpu\"}");
  EXPECT_EQ(hits_before, 0) << m0;
  EXPECT_GT(cpu_before, 0) << m0;
  // The planner's learned rates are exported (issue 43 point 6), and reach
  // the coordinator's status with the heartbeats (moectl status's PLANNER table).
  for (const char* rate : {"measured", "copy_seconds", "cpu_expert_seconds", "copy_delay_seconds", "vetoed_call_shapes"})
    EXPECT_NE(m0.find(absl::StrCat("moe_worker_planner_rate{rate=\"", rate, "\"}")), std::string::npos) << rate << "\n"
                                                                                                      << m0;
  EXPECT_TRUE(WaitForStatus([](const nlohmann::json& j) {
    int with_rates = 0;
    for (const auto& w : j.value("workers", nlohmann::json::array()))
      with_rates += w.contains("planner_rates") && w["planner_rates"].contains("copy_seconds") &&
                    w["planner_rates"].contains("vetoed_call_shapes");
    // And the model every peer serves, by identity (issue 47 point 1).
    return with_rates == 2 && j.value("model_identity", std::string()).find(kModel) != std::string::npos;
  }, 10s)) << "the workers' planner rates or the model's identity never reached the coordinator: " << last_status_;

  // Skewed traffic until both workers cache every layer's hot experts and the
  // last rounds' hit share is above 50% on both (bounded).
  double share[2] = {0, 0};
  bool moved = false;
  const Clock::time_point end = Clock::now() + 12s;
  while (!moved && Clock::now() < end) {
    std::vector<int> h(2, 0), a(2, 0);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Round(rng, &h, &a));
    for (int w = 0; w < 2; ++w) share[w] = a[w] ? double(h[w]) / a[w] : 0;
    moved = share[0] > 0.5 && share[1] > 0.5 && EveryWorkerHolds(0, kHot[0]) && EveryWorkerHolds(1, kHot[1]);
    // ... and the coordinator placed both layers on both workers (the
    // workers' own admissions may have reached the hot sets first) and has
    // heard of the hits: they reach it with the workers' next heartbeat,
    // which a loaded machine may delay past the rounds above.
    if (moved) {
      const std::string c = Scrape(coord_.metrics_port);
      for (int w = 0; w < 2; ++w)
        moved = moved && Series(c, "moe_coordinator_copies_total{worker=\"" + WorkerId(w) + "\"}") >= 2 * kSlots;
      for (int layer = 0; layer < 2; ++layer)
        moved = moved && Series(c, "moe_coordinator_layer_hit_rate{layer=\"" + std::to_string(layer) + "\"}") > 0;
    }
  }
  ASSERT_TRUE(moved) << "after " << calls_ << " calls: hit share w1 " << share[0] << ", w2 " << share[1]
                     << "; w1 layer 0 " << Str(SlotExperts(0, 0)) << ", layer 1 " << Str(SlotExperts(0, 1))
                     << "; w2 layer 0 " << Str(SlotExperts(1, 0)) << ", layer 1 " << Str(SlotExperts(1, 1));
  std::printf("placement followed the hot experts after %d calls, %.1f s; hit share w1 %.2f, w2 %.2f\n", calls_,
              std::chrono::duration<double>(Clock::now() - t0).count(), share[0], share[1]);
  for (int w = 0; w < 2; ++w) {
    absl::StatusOr<moe::v1::WorkerInfo> info = clients_[w]->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    for (const auto& l : info->layers()) {
      EXPECT_EQ(l.slot_experts_size(), kSlots);
      EXPECT_GT(l.hit_rate(), 0.0) << WorkerId(w) << " layer " << l.layer();
    }
  }

  // The workers' /metrics: hits grew, an assignment version was applied.
  for (int w = 0; w < 2; ++w) {
    const std::string m = Scrape(workers_[w].metrics_port);
    ASSERT_NE(m.find("HTTP/1.1 200 OK"), std::string::npos) << m;
    EXPECT_NE(m.find("# TYPE moe_worker_pairs_total counter"), std::string::npos) << m;
    for (int layer = 0; layer < 2; ++layer) {
      const std::string l = std::to_string(layer);
      EXPECT_GT(Series(m, "moe_worker_pairs_total{layer=\"" + l + "\",result=\"hit\"}"), 0) << m;
      EXPECT_GT(Series(m, "moe_worker_pairs_total{layer=\"" + l + "\",result=\"cpu\"}"), 0) << m;
    }
    EXPECT_GT(Series(m, "moe_worker_assignment_version"), 0) << m;
    EXPECT_GE(Series(m, "moe_worker_cache_copies"), 2 * kSlots) << m;
    EXPECT_EQ(Series(m, "moe_worker_failovers_total"), 0) << m;
  }
  const std::string m1 = Scrape(workers_[0].metrics_port);
  EXPECT_GT(Series(m1, "moe_worker_pairs_total{layer=\"0\",result=\"hit\"}"), hits_before);
  EXPECT_GT(Series(m1, "moe_worker_pairs_total{layer=\"0\",result=\"cpu\"}"), cpu_before);

  // The coordinator's /metrics: who is up, rounds run, copies assigned, hit rates.
  const std::string c = Scrape(coord_.metrics_port);
  ASSERT_NE(c.find("HTTP/1.1 200 OK"), std::string::npos) << c;
  EXPECT_EQ(Series(c, "moe_coordinator_workers{state=\"up\"}"), 2) << c;
  EXPECT_EQ(Series(c, "moe_coordinator_servers{state=\"up\"}"), 2) << c;
  EXPECT_GT(Series(c, "moe_coordinator_rebalances_total"), 0) << c;
  for (int w = 0; w < 2; ++w) {
    EXPECT_GE(Series(c, "moe_coordinator_copies_total{worker=\"" + WorkerId(w) + "\"}"), 2 * kSlots) << c;
    EXPECT_GT(Series(c, "moe_coordinator_worker_assigned_version{worker=\"" + WorkerId(w) + "\"}"), 0) << c;
  }
  EXPECT_GT(Series(c, "moe_coordinator_layer_hit_rate{layer=\"0\"}"), 0) << c;
  EXPECT_GT(Series(c, "moe_coordinator_hit_rate"), 0) << c;
  // moectl sees the same: the hot experts on top of layer 0's popularity, resident on both workers.
  CommandResult pop = Moectl({"--json", "popularity", "--layer", "0", "--top", "4"});
  ASSERT_EQ(pop.code, 0) << pop.err;
  const nlohmann::json j = nlohmann::json::parse(pop.out);
  ASSERT_EQ(j["experts"].size(), 4u) << pop.out;
  for (const auto& e : j["experts"]) {
    EXPECT_TRUE(Contains(kHot[0], e["expert"].get<int>())) << pop.out;
    EXPECT_EQ(e["resident_on"].size(), 2u) << pop.out;
  }
}

TEST_F(SystemTest, PinUnpinAndDrainViaMoectl) {
  std::mt19937_64 rng(2);
  ASSERT_TRUE(DriveUntil(rng, [&] { return EveryWorkerHolds(1, kHot[1]); }, 10s))
      << "layer 1's hot experts never became resident: " << Str(SlotExperts(0, 1)) << " " << Str(SlotExperts(1, 1));

  // pin: cold experts 7 and 9 become resident on both workers, and hit.
  CommandResult r = Moectl({"--json", "pin", "--layer", "1", "--experts", "7,9"});
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["pins"].size(), 1u) << r.out;
  EXPECT_EQ(j["pins"][0]["layer"], 1);
  EXPECT_EQ(j["pins"][0]["experts"], nlohmann::json::array({7, 9}));
  ASSERT_TRUE(DriveUntil(rng, [&] { return EveryWorkerHolds(1, kPinned); }, 8s))
      << "pinned experts never reached the workers: " << Str(SlotExperts(0, 1)) << " " << Str(SlotExperts(1, 1));
  for (int w = 0; w < 2; ++w) {
    // Tokens routed to 7 and 9 (plus two others): those 2 pairs per token are hits.
    bool hits = false;
    CallResult last;
    for (int i = 0; i < 50 && !hits; ++i) {
      Batch b = SkewedBatch(1, rng, kHotShare, kPinned);
      last = Forward(*clients_[w], b);
      ASSERT_TRUE(last.status.ok()) << last.status;
      EXPECT_LE(last.error, kTolerance);
      hits = last.hit >= 2 * b.T;
      if (!hits) std::this_thread::sleep_for(20ms);  // the copies complete between calls
    }
    EXPECT_TRUE(hits) << WorkerId(w) << ": pinned experts do not hit (hit pairs " << last.hit << ")";
  }
  // The hot set keeps the other two slots; two hot experts had to leave.
  EXPECT_EQ(SlotExperts(0, 1).size(), static_cast<size_t>(kSlots));

  // unpin: with the skewed traffic going on, the hot experts come back and 7, 9 leave.
  r = Moectl({"unpin", "--layer", "1", "--experts", "7,9"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("unpinned layer 1 experts 7,9"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no pins in force"), std::string::npos) << r.out;
  ASSERT_TRUE(DriveUntil(rng, [&] { return EveryWorkerHolds(1, kHot[1]); }, 10s))
      << "after unpin the hot experts did not come back: " << Str(SlotExperts(0, 1)) << " "
      << Str(SlotExperts(1, 1));
  for (int w = 0; w < 2; ++w) {
    const std::vector<int> s = SlotExperts(w, 1);
    EXPECT_FALSE(Contains(s, 7) || Contains(s, 9)) << WorkerId(w) << " " << Str(s);
  }

  // Bad input: non-zero exit, one line on stderr, nothing on stdout.
  r = Moectl({"pin", "--layer", "99", "--experts", "1"});
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(!r.err.empty() && r.err.find('\n') == r.err.size() - 1) << "'" << r.err << "'";
  EXPECT_NE(r.err.find("layer"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  r = Moectl({"drain", "nosuch", "--no-wait"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("NOT_FOUND"), std::string::npos) << r.err;

  // While both replicas are up they share the misses (a worker's two layers take turns over them: ReplicaStart).
  const double s1_before = ServerRequests(0), s2_before = ServerRequests(1);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Round(rng));
  EXPECT_GT(ServerRequests(0), s1_before) << "s1 serves its share of the misses";
  EXPECT_GT(ServerRequests(1), s2_before) << "s2 serves its share of the misses";

  // drain s1 --no-wait: the call returns at once; s1 leaves the routes and,
  // once both workers acknowledged, is drained.
  r = Moectl({"--json", "drain", "s1", "--no-wait"});
  ASSERT_EQ(r.code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["server_id"], "s1") << r.out;
  EXPECT_TRUE(j["state"] == "draining" || j["state"] == "drained") << r.out;
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s1") == "drained"; }, 5s))
      << last_status_;
  // The workers' misses now go to s2 only; s1's counter stands still; results stay right.
  const double s1_drained = ServerRequests(0), s2_drained = ServerRequests(1);
  int cpu_pairs = 0;
  for (int i = 0; i < 5; ++i)
    for (int w = 0; w < 2; ++w)
      for (int layer = 0; layer < 2; ++layer) {
        Batch b = SkewedBatch(layer, rng, 0.3);  // mostly cold: misses
        const CallResult c = Forward(*clients_[w], b);
        ASSERT_TRUE(c.status.ok()) << c.status;
        EXPECT_LE(c.error, kTolerance);
        cpu_pairs += c.cpu;
      }
  EXPECT_GT(cpu_pairs, 0);
  EXPECT_EQ(ServerRequests(0), s1_drained) << "a drained server gets no requests";
  EXPECT_GE(ServerRequests(1), s2_drained + 20) << "every call had misses, all of them to s2";
  r = Moectl({"status"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("drained"), std::string::npos) << r.out;

  // undrain: s1 takes the misses again.
  r = Moectl({"undrain", "s1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("server s1: up"), std::string::npos) << r.out;
  const double s1_undrained = ServerRequests(0);
  ASSERT_TRUE(DriveUntil(rng, [&] { return ServerRequests(0) > s1_undrained; }, 5s))
      << "s1 never got requests again after undrain";
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s1") == "up"; }, 3s)) << last_status_;
}

TEST_F(SystemTest, CoordinatorRestartKeepsOverridesAndWorkersKeepServing) {
  std::mt19937_64 rng(3);
  // Admin overrides: a pin, a policy value, a drain of the replica.
  CommandResult r = Moectl({"pin", "--layer", "0", "--experts", "7,9"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = Moectl({"policy", "set", "hysteresis_margin=0.375"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = Moectl({"drain", "s2", "--no-wait"});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(DriveUntil(rng, [&] { return EveryWorkerHolds(0, kPinned); }, 8s))
      << "the pin never reached the workers: " << Str(SlotExperts(0, 0)) << " " << Str(SlotExperts(1, 0));
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s2") == "drained"; }, 5s))
      << last_status_;

  // Traffic on both workers from a background thread, through the kill and the restart.
  std::atomic<int> calls{0}, failures{0}, wrong{0};
  FirstProblem problem;
  TrafficThreads traffic;  // declared last: joined before the counters go
  traffic.threads.emplace_back([&] {
    std::mt19937_64 trng(33);
    while (!traffic.stop.load()) {
      for (int w = 0; w < 2; ++w)
        for (int layer = 0; layer < 2; ++layer) {
          Batch b = SkewedBatch(layer, trng);
          const CallResult c = Forward(*clients_[w], b);
          ++calls;
          if (!c.status.ok() || !(c.error <= kTolerance)) {
            (c.status.ok() ? wrong : failures)++;
            problem.Note(WorkerId(w) + " layer " + std::to_string(layer), c);
          }
        }
    }
  });
  auto wait_calls = [&](int n, std::chrono::milliseconds timeout) {
    const int target = calls.load() + n;
    const Clock::time_point end = Clock::now() + timeout;
    while (calls.load() < target && Clock::now() < end) std::this_thread::sleep_for(10ms);
    return calls.load() >= target;
  };
  ASSERT_TRUE(wait_calls(8, 10s));

  // kill -9: the workers keep answering, with their last assignment (the pin included).
  const std::string addr = coord_.addr;
  coord_.proc->Signal(SIGKILL);
  ASSERT_NE(coord_.proc->Wait(5s), -1);
  r = Moectl({"status"});
  EXPECT_EQ(r.code, 1) << "the coordinator is gone: " << r.out;
  EXPECT_NE(r.err.find("UNAVAILABLE"), std::string::npos) << r.err;
  const int calls_at_kill = calls.load();
  ASSERT_TRUE(wait_calls(16, 15s)) << "the workers stopped answering without the coordinator";
  std::this_thread::sleep_for(1200ms);  // past the heartbeat timeout: the agents are in back-off
  ASSERT_TRUE(wait_calls(8, 10s));
  const int calls_while_down = calls.load() - calls_at_kill;
  for (int w = 0; w < 2; ++w) EXPECT_TRUE(ContainsAll(SlotExperts(w, 0), kPinned)) << WorkerId(w);

  // Restart on the same port with the same state file.
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(addr));
  ASSERT_EQ(coord_.addr, addr);
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return Count(s, "workers", "up") == 2 &&
                                                                 StateOf(s, "s1") == "up"; },
                            10s))
      << "the workers and s1 did not come back: " << last_status_;
  // The overrides survived kill -9.
  r = Moectl({"--json", "popularity", "--layer", "0"});
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  std::set<int> pinned;
  for (const auto& e : j["experts"])
    if (e.value("pinned", false)) pinned.insert(e["expert"].get<int>());
  EXPECT_EQ(pinned, std::set<int>({7, 9})) << r.out;
  r = Moectl({"--json", "policy", "get"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["hysteresis_margin"], 0.375) << r.out;
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s2") == "drained"; }, 5s))
      << "the drain of s2 was lost: " << last_status_;
  // The workers resynced: a new session, their acknowledged version caught up, the pin still cached.
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return Synced(s) == 2; }, 10s)) << last_status_;
  ASSERT_TRUE(wait_calls(8, 10s));
  // Seen failing twice on the GPU host (a worker's layer 0 lacked a pinned
  // expert after the resync): say what the slots held and what the
  // coordinator reported, so the next occurrence can be diagnosed.
  for (int w = 0; w < 2; ++w) {
    const auto slots = SlotExperts(w, 0);
    EXPECT_TRUE(ContainsAll(slots, kPinned)) << WorkerId(w) << " layer 0 slots: " << Str(slots) << "; status "
                                             << last_status_;
  }
  const std::string c = Scrape(coord_.metrics_port);
  EXPECT_EQ(Series(c, "moe_coordinator_workers{state=\"up\"}"), 2) << c;
  EXPECT_EQ(Series(c, "moe_coordinator_servers{state=\"drained\"}"), 1) << c;

  traffic.Join();
  EXPECT_EQ(failures.load(), 0) << problem.text();
  EXPECT_EQ(wrong.load(), 0) << problem.text();
  EXPECT_GE(calls_while_down, 24);
  std::printf("%d calls, %d of them while the coordinator was down; 0 failed\n", calls.load(), calls_while_down);
  r = Moectl({"undrain", "s2"});
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST_F(SystemTest, KillingOneReplicaServerLosesNoRequest) {
  // Continuous traffic through both workers, one thread each, every output checked.
  std::atomic<int> calls[2] = {{0}, {0}}, failures{0}, wrong{0}, cpu_pairs_after_kill{0};
  std::atomic<bool> killed{false};
  FirstProblem problem;
  TrafficThreads traffic;
  for (int w = 0; w < 2; ++w)
    traffic.threads.emplace_back([&, w] {
      std::mt19937_64 rng(40 + w);
      while (!traffic.stop.load()) {
        for (int layer = 0; layer < 2 && !traffic.stop.load(); ++layer) {
          Batch b = SkewedBatch(layer, rng, 0.5);  // plenty of misses for the servers
          const bool after = killed.load();
          const CallResult c = Forward(*clients_[w], b);
          ++calls[w];
          if (c.status.ok() && after) cpu_pairs_after_kill += c.cpu;
          if (!c.status.ok() || !(c.error <= kTolerance)) {
            (c.status.ok() ? wrong : failures)++;
            problem.Note(WorkerId(w) + " layer " + std::to_string(layer), c);
          }
        }
      }
    });
  auto wait_calls = [&](int n, std::chrono::milliseconds timeout) {
    const int t0 = calls[0].load() + n, t1 = calls[1].load() + n;
    const Clock::time_point end = Clock::now() + timeout;
    while ((calls[0].load() < t0 || calls[1].load() < t1) && Clock::now() < end) std::this_thread::sleep_for(5ms);
    return calls[0].load() >= t0 && calls[1].load() >= t1;
  };
  ASSERT_TRUE(wait_calls(6, 10s));
  const double s1_served = ServerRequests(0), s2_before = ServerRequests(1);
  EXPECT_GT(s1_served, 0) << "s1, the first server, takes the misses";

  // kill -9 the server both workers are sending their misses to, mid-traffic.
  killed = true;
  servers_[0].proc->Signal(SIGKILL);
  ASSERT_NE(servers_[0].proc->Wait(5s), -1);
  ASSERT_TRUE(wait_calls(6, 15s)) << "calls stalled after the kill";
  // The coordinator notices (heartbeat timeout) and routes to the replica only.
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s1") == "down"; }, 5s))
      << last_status_;
  ASSERT_TRUE(wait_calls(10, 15s)) << "calls stalled after the coordinator marked s1 down";
  traffic.Join();

  EXPECT_EQ(failures.load(), 0) << problem.text();
  EXPECT_EQ(wrong.load(), 0) << problem.text();
  EXPECT_GT(cpu_pairs_after_kill.load(), 0);
  EXPECT_GT(ServerRequests(1), s2_before) << "the replica took over";
  double failovers = 0;
  for (int w = 0; w < 2; ++w) {
    const std::string m = Scrape(workers_[w].metrics_port);
    failovers += Series(m, "moe_worker_failovers_total");
  }
  EXPECT_GT(failovers, 0) << "the batches in flight on s1 failed over";
  std::printf("%d + %d calls, %g failovers; 0 failed\n", calls[0].load(), calls[1].load(), failovers);
  CommandResult r = Moectl({"--json", "status"});
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const auto& l : j["layers"]) EXPECT_EQ(l["routable_experts"], 32) << "s2 hosts every expert";
}

// Issue 47's hostile neighbour, round four: run by the soak as a second
// local user (a re-exec of this binary as uid 65534) for MOE_HOSTILE_SECONDS.
// It floods the coordinator with new worker ids, registers one of its own
// and reports impossible access counts for it (2^64-1 pairs, a layer the
// model lacks, duplicates), holds slow-loris connections on every /metrics endpoint in
// MOE_HOSTILE_METRICS_PORTS and opens and drops connections on the shm
// sockets in MOE_HOSTILE_SHM (not allowed there: refused at accept). It
// prints what it did; it fails when a bound did not hold from its side: more
// than the per-peer cap of its ids accepted, an impossible count accepted.
TEST(HostileNeighbour, DISABLED_RoundFourAttacksAsThisUid) {
  const char* coord = std::getenv("MOE_HOSTILE_COORDINATOR");
  const char* ports_env = std::getenv("MOE_HOSTILE_METRICS_PORTS");
  const char* shm_env = std::getenv("MOE_HOSTILE_SHM");
  const char* seconds_env = std::getenv("MOE_HOSTILE_SECONDS");
  ASSERT_TRUE(coord != nullptr && ports_env != nullptr && shm_env != nullptr && seconds_env != nullptr);
  const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(std::atof(seconds_env) * 1000));
  std::vector<std::thread> attacks;
  std::atomic<int> registered{0}, refused_registrations{0}, poison_tries{0}, poison_accepted{0}, churned{0};
  attacks.emplace_back([&] {  // registrations as fast as they come back
    auto stub = moe::v1::CoordinatorService::NewStub(grpc::CreateChannel(coord, grpc::InsecureChannelCredentials()));
    for (int i = 0; Clock::now() < until; ++i) {
      moe::v1::RegisterWorkerRequest r;
      r.set_worker_id(absl::StrCat("flood-", getpid(), "-", i));
      r.set_num_layers(Model().spec().num_layers);
      r.set_num_experts(Model().spec().num_experts);
      r.set_slots_per_layer(2);
      moe::v1::RegisterWorkerResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 2s);
      const grpc::Status st = stub->RegisterWorker(&ctx, r, &resp);
      ++(st.ok() ? registered : refused_registrations);
      if (!st.ok() && refused_registrations.load() == 1) std::printf("first refusal: %s\n", st.error_message().c_str());
    }
  });
  attacks.emplace_back([&] {  // one id of its own, with poisoned counts
    auto stub = moe::v1::CoordinatorService::NewStub(grpc::CreateChannel(coord, grpc::InsecureChannelCredentials()));
    moe::v1::RegisterWorkerRequest r;
    r.set_worker_id(absl::StrCat("rogue-", getpid()));
    r.set_num_layers(Model().spec().num_layers);
    r.set_num_experts(Model().spec().num_experts);
    r.set_slots_per_layer(2);
    while (Clock::now() < until) {
      moe::v1::RegisterWorkerResponse resp;
      grpc::ClientContext rc;
      rc.set_deadline(std::chrono::system_clock::now() + 2s);
      if (!stub->RegisterWorker(&rc, r, &resp).ok()) {  // the flood may hold its cap: wait for room
        std::this_thread::sleep_for(100ms);
        continue;
      }
      for (int kind = 0; kind < 3 && Clock::now() < until; ++kind) {
        moe::v1::HeartbeatRequest h;
        h.set_worker_id(r.worker_id());
        h.set_session(resp.session());
        moe::v1::LayerCounts* c = h.add_counts();
        c->set_layer(kind == 1 ? Model().spec().num_layers : 1);  // no such layer
        c->add_experts(3);
        c->add_pairs(kind == 0 ? ~uint64_t{0} : 5);
        c->add_hits(0);
        if (kind == 2) {  // expert 3 twice
          c->add_experts(3);
          c->add_pairs(5);
          c->add_hits(0);
        }
        moe::v1::HeartbeatResponse hr;
        grpc::ClientContext hc;
        hc.set_deadline(std::chrono::system_clock::now() + 2s);
        ++poison_tries;
        if (stub->Heartbeat(&hc, h, &hr).ok()) ++poison_accepted;
      }
      std::this_thread::sleep_for(50ms);
    }
  });
  for (absl::string_view port : absl::StrSplit(ports_env, ',', absl::SkipEmpty())) {
    const int p = std::atoi(std::string(port).c_str());
    attacks.emplace_back([p, until] {  // 8 slow-loris connections, renewed until the end
      while (Clock::now() < until)
        testing::SlowLoris(p, 8, 700ms, std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
    });
  }
  for (absl::string_view path : absl::StrSplit(shm_env, ',', absl::SkipEmpty()))
    attacks.emplace_back([path = std::string(path), until, &churned] {
      while (Clock::now() < until) {
        const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
        if (connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) ++churned;
        close(fd);
        if (churned.load() % 64 == 0) std::this_thread::sleep_for(1ms);
      }
    });
  for (std::thread& t : attacks) t.join();
  std::printf("hostile round four (uid %d): %d worker ids accepted, %d refused; %d/%d impossible count reports "
              "accepted; %d shm connections opened and dropped\n",
              static_cast<int>(geteuid()), registered.load(), refused_registrations.load(), poison_accepted.load(),
              poison_tries.load(), churned.load());
  // (The soak checks the registry: its ids that went down make room for new
  // ones, but it never holds more than the per-peer cap.)
  EXPECT_GT(refused_registrations.load(), 0);
  EXPECT_GT(poison_tries.load(), 0);
  EXPECT_EQ(poison_accepted.load(), 0);
}

TEST_F(SystemTest, SoakWithServerKillsAndCoordinatorRestart) {
  // One traffic thread per worker, every answer checked against the reference.
  std::atomic<long> calls{0}, ok{0}, failed{0}, wrong{0};
  FirstProblem problem;
  TrafficThreads traffic;
  for (int w = 0; w < 2; ++w)
    traffic.threads.emplace_back([&, w] {
      std::mt19937_64 rng(70 + w);
      while (!traffic.stop.load()) {
        for (int layer = 0; layer < 2 && !traffic.stop.load(); ++layer) {
          Batch b = SkewedBatch(layer, rng, 0.5);  // plenty of misses for the servers
          const CallResult c = Forward(*clients_[w], b, 10000);
          ++calls;
          if (!c.status.ok()) {
            ++failed;  // the caller was told
          } else if (!(c.error <= kTolerance) || c.pairs() != b.T * b.k) {
            ++wrong;
          } else {
            ++ok;
          }
          if (!c.status.ok() || !(c.error <= kTolerance)) problem.Note(WorkerId(w) + " layer " + std::to_string(layer), c);
        }
      }
    });
  auto wait_calls = [&](long n, std::chrono::milliseconds timeout) {
    const long target = calls.load() + n;
    const Clock::time_point end = Clock::now() + timeout;
    while (calls.load() < target && Clock::now() < end) std::this_thread::sleep_for(5ms);
    return calls.load() >= target;
  };
  // Traffic for `d`, never stalled for 5 s (a call that never returns would stall it).
  auto hold = [&](std::chrono::milliseconds d) {
    const Clock::time_point end = Clock::now() + d;
    while (Clock::now() < end) {
      if (!wait_calls(1, 5s)) return false;
      std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
          200ms, std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now())));
    }
    return true;
  };
  // The soak's length (CI: 40 s of traffic between the events, about a minute
  // in all); MOE_SOAK_SECONDS overrides it, up to 90.
  const char* env = std::getenv("MOE_SOAK_SECONDS");
  const int soak_s = std::clamp(env != nullptr ? std::atoi(env) : 40, 4, 90);
  const auto segment = std::chrono::milliseconds(soak_s * 1000 / 4);
  const Clock::time_point t0 = Clock::now();
  // Warm-up: every connection made, caches placed, allocators at steady state.
  ASSERT_TRUE(wait_calls(80, 30s));
  // The long-lived processes whose memory must stay flat: both workers and s2.
  const std::vector<const Process*> watched = {&workers_[0], &workers_[1], &servers_[1]};
  std::vector<long> rss_before;
  std::vector<std::map<std::string, long>> maps_before;
  for (const Process* p : watched) {
    rss_before.push_back(OwnRssKib(p->proc->pid()));
    maps_before.push_back(RssByMapping(p->proc->pid()));
  }
  // A hostile neighbour (issue 25) for the whole soak: as another uid (when
  // the test runs as root) it holds 64 silent connections on each server's
  // shm socket (defect 5: the workers must still get their slots); it keeps
  // registering with the live workers' ids at the coordinator (defect 4: every
  // try refused while their leases live); and while s1 is down it serves s1's
  // socket with unsealed segments it shrinks (defect 1: the workers must
  // refuse them, not die of SIGBUS). Every answer is still checked.
  testing::HostileNeighbour hostile;
  if (geteuid() == 0) {
    ASSERT_TRUE(hostile.HoldShmSlots({sockets_[0], sockets_[1]}, 64));
  }
  // Round four (issue 47), as uid 65534 until the coordinator restart: a
  // registration flood, impossible access counts, slow-loris connections on
  // every /metrics endpoint, shm connection churn. Meanwhile every /healthz
  // answers within 1 s and the coordinator's memory stays bounded.
  pid_t round_four = -1;
  const uint64_t coordinator_rss_before = OwnRssKib(coord_.proc->pid());
  if (geteuid() == 0) {
    round_four = testing::RunThisTestAsOtherUser(
        "HostileNeighbour.DISABLED_RoundFourAttacksAsThisUid",
        {"MOE_HOSTILE_COORDINATOR=" + coord_.addr,
         absl::StrCat("MOE_HOSTILE_METRICS_PORTS=", coord_.metrics_port, ",", servers_[0].metrics_port, ",",
                      servers_[1].metrics_port, ",", workers_[0].metrics_port),
         "MOE_HOSTILE_SHM=" + sockets_[0] + "," + sockets_[1],
         absl::StrCat("MOE_HOSTILE_SECONDS=", 2.5 * segment.count() / 1000.0)});
    ASSERT_GT(round_four, 0);
  }
  std::atomic<bool> stop_health{false};
  std::atomic<int> health_checks{0}, health_failures{0};
  std::string health_failure;
  std::mutex health_mu;
  std::thread health([&] {
    while (!stop_health.load()) {
      for (const Process* p : {&coord_, &servers_[1], &workers_[0], &workers_[1]}) {
        const int port = p->metrics_port;
        const Clock::time_point h0 = Clock::now();
        const std::string r = testing::HttpGet(port, "/healthz", 1000);
        ++health_checks;
        if (r.find(" 200 ") == std::string::npos || Clock::now() - h0 > 1s) {
          ++health_failures;
          std::lock_guard<std::mutex> lock(health_mu);
          if (health_failure.empty()) health_failure = absl::StrCat("port ", port, ": '", r.substr(0, 60), "'");
        }
      }
      std::this_thread::sleep_for(200ms);
    }
  });
  std::atomic<bool> stop_hijack{false};
  std::atomic<int> hijack_tries{0}, hijacked{0};
  std::thread hijacker([&] {
    auto stub = moe::v1::CoordinatorService::NewStub(
        grpc::CreateChannel(coord_.addr, grpc::InsecureChannelCredentials()));
    for (int i = 0; !stop_hijack.load(); ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 2s);
      moe::v1::RegisterWorkerRequest req;
      req.set_worker_id(WorkerId(i % 2));
      req.set_num_layers(Model().spec().num_layers);  // the model's geometry: refused for the id alone
      req.set_num_experts(Model().spec().num_experts);
      req.set_slots_per_layer(kSlots);
      moe::v1::RegisterWorkerResponse resp;
      const grpc::Status st = stub->RegisterWorker(&ctx, req, &resp);
      ++hijack_tries;
      if (st.ok()) ++hijacked;
      std::this_thread::sleep_for(50ms);
    }
  });

  // s1 (where the misses go first) SIGKILLed and restarted on the same socket, twice.
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(hold(segment)) << "calls stalled before kill " << round + 1;
    servers_[0].proc->Signal(SIGKILL);
    ASSERT_NE(servers_[0].proc->Wait(5s), -1);
    ASSERT_TRUE(hostile.ServeUnsealedSegments(sockets_[0]));
    ASSERT_TRUE(wait_calls(20, 20s)) << "calls stalled after kill " << round + 1;
    ASSERT_TRUE(hold(1500ms)) << "calls stalled while the hostile neighbour held s1's socket";
    hostile.StopServing();
    LaunchServer(0);
    ASSERT_NO_FATAL_FAILURE(WaitReady(servers_[0], "moe-expert-server", true));
    ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return StateOf(s, "s1") == "up"; }, 10s))
        << "s1 did not come back after restart " << round + 1 << ": " << last_status_;
    // The workers retry s1 once their back-off (server_retry) has passed:
    // wait for its misses by time, not by a count of calls (fast calls can
    // outrun the back-off on an idle machine).
    const double served = ServerRequests(0);
    ASSERT_TRUE(wait_calls(40, 20s));
    const auto s1_deadline = std::chrono::steady_clock::now() + 15s;
    while (ServerRequests(0) <= served && std::chrono::steady_clock::now() < s1_deadline)
      std::this_thread::sleep_for(50ms);
    EXPECT_GT(ServerRequests(0), served) << "the restarted s1 takes misses again (round " << round + 1 << ")";
  }
  // The coordinator stopped and restarted on the same port and state file
  // (the hijacker stops first: a restarted coordinator knows no lease until
  // the workers register again, which is not the case defect 4 is about).
  ASSERT_TRUE(hold(segment)) << "calls stalled before the coordinator restart";
  stop_hijack = true;
  hijacker.join();
  stop_health = true;
  size_t registrations = 0;
  ASSERT_TRUE(WaitForStatus([&](const nlohmann::json& j) {
    registrations = j.contains("workers") ? j["workers"].size() : 0;
    return true;
  }, 5s));
  health.join();
  int round_four_status = 0;
  if (round_four > 0) ASSERT_EQ(waitpid(round_four, &round_four_status, 0), round_four);
  const uint64_t coordinator_rss_after = OwnRssKib(coord_.proc->pid());
  const std::string addr = coord_.addr;
  coord_.proc->Signal(SIGTERM);
  ASSERT_NE(coord_.proc->Wait(10s), -1);
  ASSERT_TRUE(wait_calls(20, 20s)) << "calls stalled without the coordinator";
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(addr));
  ASSERT_TRUE(WaitForStatus([](const nlohmann::json& s) { return Count(s, "workers", "up") == 2 &&
                                                                 Count(s, "servers", "up") == 2 && Synced(s) == 2; },
                            15s))
      << "the workers and servers did not all come back: " << last_status_;
  ASSERT_TRUE(hold(segment)) << "calls stalled after the coordinator restart";
  traffic.Join();
  hostile.Stop();

  std::vector<long> rss_after;
  for (const Process* p : watched) rss_after.push_back(OwnRssKib(p->proc->pid()));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  // A lost call (one that never returns) would have stalled its thread: every
  // wait_calls above is bounded and the joins completed.
  std::printf("soak: %.0f s, %ld calls: %ld correct, %ld failed (reported to the caller), %ld wrong; "
              "2 server kills + restarts, 1 coordinator restart\n",
              seconds, calls.load(), ok.load(), failed.load(), wrong.load());
  for (size_t i = 0; i < watched.size(); ++i) {
    const char* name = i < 2 ? (i == 0 ? "w1" : "w2") : "s2";
    std::printf("soak: rss %s %ld -> %ld KiB (%+.2f%%)\n", name, rss_before[i], rss_after[i],
                100.0 * (rss_after[i] - rss_before[i]) / rss_before[i]);
    ASSERT_GT(rss_before[i], 0);
    // Flat within 5%, or 2 MiB for a small process: the kills and restarts
    // legitimately move a MiB (a new channel and its thread after a restart,
    // malloc arenas), which is 5% of a 22 MiB worker; a leak over the soak's
    // thousands of calls grows past both.
    EXPECT_LT(rss_after[i], std::max<double>(rss_before[i] * 1.05, rss_before[i] + 2048.0))
        << name << " grew by more than max(5%, 2 MiB); resident by mapping:\n" << RssGrowth(maps_before[i], RssByMapping(watched[i]->proc->pid()));
  }
  std::printf("soak: hostile neighbour: %d unsealed segments handed out (refused), %d/%d hijack tries succeeded, "
              "64 silent connections per shm socket %s\n",
              hostile.segments_handed_out(), hijacked.load(), hijack_tries.load(),
              hostile.holds_as_other_uid() ? "held as uid 65534" : "not held (not root: no other uid to use)");
  EXPECT_GT(hostile.segments_handed_out(), 0) << "the workers never came to the hostile s1";
  EXPECT_GT(hijack_tries.load(), 10);
  EXPECT_EQ(hijacked.load(), 0) << "a live worker's id was taken";
  std::printf("soak: round four %s; coordinator rss %llu -> %llu KiB; %d/%d /healthz answered within 1 s\n",
              round_four > 0 ? "ran as uid 65534" : "not run (not root: no other uid to use)",
              static_cast<unsigned long long>(coordinator_rss_before),
              static_cast<unsigned long long>(coordinator_rss_after), health_checks.load() - health_failures.load(),
              health_checks.load());
  if (round_four > 0)
    EXPECT_TRUE(WIFEXITED(round_four_status) && WEXITSTATUS(round_four_status) == 0)
        << "round four's attacker saw a bound fail (its output is above): " << round_four_status;
  EXPECT_EQ(health_failures.load(), 0) << health_failure;
  EXPECT_GT(health_checks.load(), 20);
  EXPECT_LT(coordinator_rss_after, coordinator_rss_before + 32 * 1024) << "the coordinator grew under the flood";
  std::printf("soak: %zu worker registrations at the coordinator under the flood\n", registrations);
  if (round_four > 0)  // ours and the neighbour's, its at most --max-registrations-per-peer
    EXPECT_LE(registrations, 2u + 64u + 1u);
  EXPECT_EQ(wrong.load(), 0) << problem.text();
  EXPECT_EQ(failed.load(), 0) << "s2 replicates every expert: no call should fail; " << problem.text();
  EXPECT_LT(seconds, 120);
  RecordProperty("calls", static_cast<int>(calls.load()));
  RecordProperty("failed", static_cast<int>(failed.load()));
}

}  // namespace
}  // namespace moe
