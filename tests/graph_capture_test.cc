// Stream-ordered and CUDA-graph-captured MoE layers through MoeSession (cuda
// backend) against a real moe-expert-server: a stream-ordered eager call on
// a non-blocking engine stream; then two layers captured into one CUDA graph
// and replayed with new hidden states and routing each step — outputs equal
// the reference MoE, and a cache assignment applied between replays changes
// the hit/miss split (slot map read at replay time) without changing the
// results. Skipped (by name) without a CUDA GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "moe/engine.h"
#include "coordinator/agent/coordinator_agent.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "gpu_worker/device_backend.h"  // CudaAvailable
#include "tests/test_support.h"

namespace moe {
namespace {

constexpr char kModel[] = "synthetic:tiny:seed=21";  // H=96, I=80, 8 experts, top-2, MoE layers 1 and 2

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

class GraphCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "needs a CUDA GPU (cuda backend)";
    sock_ = dir_.path() + "/e.sock";
    StartServer();
    SessionOptions o;
    o.model = kModel;
    server_address_ = "unix://" + sock_;
    o.servers = {server_address_};
    o.device = DeviceChoice::kCuda;
    o.policy = CachePolicy::kStatic;
    o.cache_experts_per_layer = 3;
    o.max_tokens = 8;
    // Misses go to the server (this tiny model's experts copy faster than the
    // CPU computes them: copy-instead would take them all); the device still
    // computes those no server may take. CapturedStepCopiesInsteadOfComputing
    // covers copy-instead.
    o.copy_mode = CopyMode::kNever;
    o.deadline = std::chrono::milliseconds(3000);  // a dead server costs a replay this long, not 30 s
    o.on_access = [this](int layer, int expert, int pairs, bool) { accesses_[{layer, expert}] += pairs; };
    absl::StatusOr<std::unique_ptr<MoeSession>> session = MoeSession::Open(o);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
    source_ = *OpenModel(kModel);
    reference_ = std::make_unique<ReferenceMoe>(*source_);
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void StartServer() {
    Subprocess* s = nullptr;
    grpc_address_ = testing::StartExpertServer(&s, {std::string("--model=") + kModel, "--threads=1",
                                                    "--shm-socket=" + sock_});
    ASSERT_FALSE(grpc_address_.empty());
    server_.reset(s);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    session_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device buffers of one layer call with T tokens, top-k.
  struct Buffers {
    bf16_t* hidden = nullptr;
    int32_t* ids = nullptr;
    float* weights = nullptr;
    bf16_t* out = nullptr;
  };
  Buffers Alloc(int T, int k) {
    Buffers b;
    const int H = session_->model_info().hidden;
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&b.hidden), sizeof(bf16_t) * T * H), cudaSuccess);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&b.ids), sizeof(int32_t) * T * k), cudaSuccess);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&b.weights), sizeof(float) * T * k), cudaSuccess);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&b.out), sizeof(bf16_t) * T * H), cudaSuccess);
    buffers_.push_back(b);
    return b;
  }
  ~GraphCaptureTest() override {
    for (Buffers& b : buffers_) {
      cudaFree(b.hidden), cudaFree(b.ids), cudaFree(b.weights), cudaFree(b.out);
    }
  }

  // Fills `b` with step `seed`'s inputs ON THE ENGINE STREAM (async, from
  // host vectors that must outlive the copies) and returns the reference.
  struct Inputs {
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
  };
  void Fill(const Buffers& b, int T, int k, uint64_t seed, Inputs* in) {
    const int H = session_->model_info().hidden;
    in->x = RandomActivations(static_cast<size_t>(T) * H, seed);
    RandomRouting(T, k, session_->model_info().num_experts, seed + 1, 0, &in->ids, &in->w);
    ASSERT_CUDA(cudaMemcpyAsync(b.hidden, in->x.data(), in->x.size() * 2, cudaMemcpyHostToDevice, stream_));
    ASSERT_CUDA(cudaMemcpyAsync(b.ids, in->ids.data(), in->ids.size() * 4, cudaMemcpyHostToDevice, stream_));
    ASSERT_CUDA(cudaMemcpyAsync(b.weights, in->w.data(), in->w.size() * 4, cudaMemcpyHostToDevice, stream_));
  }
  double Error(int layer, const Buffers& b, int T, int k, const Inputs& in) {
    const int H = session_->model_info().hidden;
    std::vector<bf16_t> out(static_cast<size_t>(T) * H);
    EXPECT_EQ(cudaMemcpy(out.data(), b.out, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> ref(out.size());
    EXPECT_TRUE(reference_->Forward<float>(layer, T, in.x.data(), RoutingView{T, k, in.ids.data(), in.w.data()},
                                           ref.data())
                    .ok());
    std::vector<float> got(out.size());  // bf16_t is the raw 16 bits: widen before comparing
    for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
    return RelativeL2Error(got.data(), ref.data(), got.size());
  }

  // A session on the fixture's server over gRPC with every miss through the
  // worker's forwarder thread (no copies), for the tests of that path; the
  // fixture's helpers use session_.
  void OpenForwarderSession(std::chrono::milliseconds deadline, std::chrono::milliseconds server_deadline) {
    SessionOptions o;
    o.model = kModel;
    o.servers = {grpc_address_};
    o.tls.insecure = true;  // the test server listens in plaintext on loopback
    o.copy_mode = CopyMode::kNever;
    o.device = DeviceChoice::kCuda;
    o.policy = CachePolicy::kStatic;
    o.cache_experts_per_layer = 3;
    o.max_tokens = 8;
    o.deadline = deadline;
    o.server_deadline = server_deadline;
    absl::StatusOr<std::unique_ptr<MoeSession>> grpc_session = MoeSession::Open(o);
    ASSERT_TRUE(grpc_session.ok()) << grpc_session.status();
    session_ = *std::move(grpc_session);
  }

  testing::TempDir dir_;
  std::unique_ptr<Subprocess> server_;
  std::unique_ptr<MoeSession> session_;
  std::unique_ptr<ModelSource> source_;
  std::unique_ptr<ReferenceMoe> reference_;
  cudaStream_t stream_ = nullptr;
  std::vector<Buffers> buffers_;
  std::string server_address_, sock_, grpc_address_;
  std::map<std::pair<int, int>, int> accesses_;  // (layer, expert) -> pairs reported through on_access

  // Captures one decode step (every MoE layer, T tokens) into a graph after
  // a warm-up call per layer; the caller destroys it.
  cudaGraphExec_t CaptureStep(int T, std::vector<Buffers>* bufs, std::vector<Inputs>* in) {
    const int k = session_->model_info().top_k;
    const std::vector<int>& layers = session_->model_info().moe_layers;
    for (size_t i = 0; i < layers.size(); ++i) bufs->push_back(Alloc(T, k));
    in->resize(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      Fill((*bufs)[i], T, k, 500 + i, &(*in)[i]);
      EXPECT_TRUE(session_->ForwardLayerCapturable(layers[i], T, k, (*bufs)[i].hidden, (*bufs)[i].ids,
                                                   (*bufs)[i].weights, (*bufs)[i].out, stream_)
                      .ok());
    }
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
    for (size_t i = 0; i < layers.size(); ++i)
      EXPECT_TRUE(session_->ForwardLayerCapturable(layers[i], T, k, (*bufs)[i].hidden, (*bufs)[i].ids,
                                                   (*bufs)[i].weights, (*bufs)[i].out, stream_)
                      .ok());
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    return exec;
  }
  // Replays `exec` with step `step`'s inputs; true when every layer's output
  // matches the reference (1e-2), false when any is off (NaN included).
  bool Replay(cudaGraphExec_t exec, int step, int T, std::vector<Buffers>& bufs, std::vector<Inputs>& in) {
    const int k = session_->model_info().top_k;
    const std::vector<int>& layers = session_->model_info().moe_layers;
    for (size_t i = 0; i < layers.size(); ++i) Fill(bufs[i], T, k, 7000 + 100 * step + i, &in[i]);
    EXPECT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    bool right = true;
    for (size_t i = 0; i < layers.size(); ++i) right = right && Error(layers[i], bufs[i], T, k, in[i]) <= 1e-2;
    return right;
  }
};

// The engine may destroy its stream before it closes the session: closing
// waits for the device (a replay still running included) and never records
// on the destroyed stream (it did, and crashed inside cuEventRecord).
TEST_F(GraphCaptureTest, SessionClosesAfterTheEnginesStreamIsGone) {
  const int T = 4;
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  EXPECT_TRUE(Replay(exec, 0, T, bufs, in));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream_));  // still running, perhaps, when the stream goes
  ASSERT_CUDA(cudaStreamDestroy(stream_));
  stream_ = nullptr;
  session_.reset();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaGraphExecDestroy(exec);
}

// Popularity from graph replays: every routed pair the GPU counted reaches
// on_access (the coordinator agent's hook) at TakeStreamError, hits and
// misses alike, exactly once.
TEST_F(GraphCaptureTest, CapturedReplaysReportEveryRoutedPair) {
  const int T = 4;
  for (int l : session_->model_info().moe_layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {0, 1, 2}).ok());
  ASSERT_TRUE(session_->admin().FlushCopies().ok());
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  EXPECT_TRUE(session_->TakeStreamError().ok());  // collects the warm-up's accesses
  accesses_.clear();
  const SessionTotals before = session_->totals();
  std::map<std::pair<int, int>, int> routed;
  for (int step = 0; step < 5; ++step) {
    EXPECT_TRUE(Replay(exec, step, T, bufs, in)) << "step " << step;
    for (size_t i = 0; i < in.size(); ++i)
      for (int32_t e : in[i].ids)
        if (e >= 0) ++routed[{session_->model_info().moe_layers[i], e}];
  }
  EXPECT_TRUE(session_->TakeStreamError().ok());
  EXPECT_EQ(accesses_, routed);
  // The replays in the session's totals, split as the GPU split them: the
  // assigned experts 0-2 hits, the rest to the server (copy mode never).
  const SessionTotals after = session_->totals();
  uint64_t pairs = 0, assigned = 0;
  for (const auto& [key, n] : routed) {
    pairs += n;
    if (key.second <= 2) assigned += n;
  }
  EXPECT_EQ(after.calls - before.calls, 5 * in.size());
  EXPECT_EQ(after.hit_pairs - before.hit_pairs, assigned);
  EXPECT_EQ(after.cpu_pairs - before.cpu_pairs, pairs - assigned);
  EXPECT_EQ(after.copied_pairs, before.copied_pairs);
  EXPECT_TRUE(session_->TakeStreamError().ok());
  EXPECT_EQ(session_->totals().calls, after.calls) << "counted once";
  EXPECT_GT(session_->admin().HitRate(session_->model_info().moe_layers[0]), 0.0);  // the cache's counters saw the hits too
  cudaGraphExecDestroy(exec);
}

// Admissions from graph traffic, planned between steps: with an admitting
// policy and an empty cache, replays of a step that keeps routing to the
// same experts get them cached (TakeStreamError hands the GPU's routing log
// to the planner), and the replays turn into hits — results right throughout.
TEST_F(GraphCaptureTest, ReplaysAdmitTheExpertsTheyUse) {
  for (const char* policy : {"lfru", "predictive"}) {
    SessionOptions o;
    o.model = kModel;
    o.servers = {server_address_};
    o.device = DeviceChoice::kCuda;
    o.policy = *ParseCachePolicy(policy);
    o.copy_mode = CopyMode::kNever;
    o.cache_experts_per_layer = 3;
    o.max_tokens = 8;
    o.fill_cache = false;  // from an empty cache: everything cached is what the replays admitted
    absl::StatusOr<std::unique_ptr<MoeSession>> admitting = MoeSession::Open(o);
    ASSERT_TRUE(admitting.ok()) << admitting.status();
    session_ = *std::move(admitting);
    const int T = 2, k = session_->model_info().top_k, H = session_->model_info().hidden;
    std::vector<Buffers> bufs;
    std::vector<Inputs> in;
    cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
    ASSERT_NE(exec, nullptr);
    const std::vector<int>& layers = session_->model_info().moe_layers;
    for (int step = 0; step < 8; ++step) {
      for (size_t i = 0; i < layers.size(); ++i) {  // every token routes to experts 4, 5 (token 0) and 5, 6 (token 1)
        in[i].x = RandomActivations(static_cast<size_t>(T) * H, 900 + 10 * step + i);
        in[i].ids = {4, 5, 5, 6};
        in[i].w = {0.6f, 0.4f, 0.7f, 0.3f};
        ASSERT_EQ(k, 2);
        ASSERT_CUDA(cudaMemcpy(bufs[i].hidden, in[i].x.data(), in[i].x.size() * 2, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(bufs[i].ids, in[i].ids.data(), in[i].ids.size() * 4, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(bufs[i].weights, in[i].w.data(), in[i].w.size() * 4, cudaMemcpyHostToDevice));
      }
      ASSERT_CUDA(cudaGraphLaunch(exec, stream_));
      ASSERT_CUDA(cudaStreamSynchronize(stream_));
      for (size_t i = 0; i < layers.size(); ++i)
        EXPECT_LE(Error(layers[i], bufs[i], T, k, in[i]), 1e-2) << policy << " step " << step;
      EXPECT_TRUE(session_->TakeStreamError().ok()) << policy;
      ASSERT_TRUE(session_->admin().FlushCopies().ok());
    }
    for (int l : layers) {
      std::vector<int> cached = session_->admin().CachedExperts(l);
      std::sort(cached.begin(), cached.end());
      const std::vector<int> used = {4, 5, 6};
      EXPECT_TRUE(std::includes(cached.begin(), cached.end(), used.begin(), used.end()))
          << policy << ": layer " << l << " never admitted the experts its replays use";
      EXPECT_GT(session_->admin().HitRate(l), 0.0) << policy;
    }
    cudaGraphExecDestroy(exec);
    session_.reset();
  }
}

// Popularity from a captured worker reaches the coordinator: the session's
// on_access feeds a real CoordinatorAgent (as moe-gpu-worker wires it) and a
// real moe-coordinator ranks the experts the replays use on top.
TEST_F(GraphCaptureTest, PopularityFromReplaysReachesTheCoordinator) {
  Subprocess coordinator(testing::BinaryPath("moe-coordinator"),
                         {"--listen=127.0.0.1:0", "--insecure", "--heartbeat-interval-ms=100",
                          "--rebalance-interval-seconds=0.3", "--half-life-seconds=30"},
                         dir_.path() + "/coordinator.log");
  std::string addr;
  for (int i = 0; i < 50 && addr.empty(); ++i) {
    const std::string line = coordinator.ReadLine(std::chrono::seconds(10));
    if (line.empty()) break;
    if (const size_t at = line.find("ready on "); at != std::string::npos) addr = line.substr(at + 9);
  }
  ASSERT_FALSE(addr.empty()) << "moe-coordinator did not start";
  WorkerRegistration reg;
  reg.worker_id = "graph-worker";
  reg.num_layers = session_->model_info().num_layers;
  reg.num_experts = session_->model_info().num_experts;
  reg.slots_per_layer = 3;
  reg.expert_bytes = session_->model_info().expert_bytes;
  TlsOptions tls;
  tls.insecure = true;
  absl::StatusOr<std::unique_ptr<CoordinatorAgent>> agent =
      CoordinatorAgent::Start(addr, tls, reg, [](const AssignmentUpdate&) {});
  ASSERT_TRUE(agent.ok()) << agent.status();
  SessionOptions o;
  o.model = kModel;
  o.servers = {server_address_};
  o.device = DeviceChoice::kCuda;
  o.policy = CachePolicy::kStatic;
  o.copy_mode = CopyMode::kNever;
  o.cache_experts_per_layer = 3;
  o.max_tokens = 8;
  o.on_access = [a = agent->get()](int layer, int expert, int pairs, bool hit) {
    a->RecordAccess(layer, expert, static_cast<uint64_t>(pairs), hit);
  };
  absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  session_ = *std::move(s);
  const int T = 4, k = session_->model_info().top_k, H = session_->model_info().hidden;
  ASSERT_EQ(k, 2);
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  const int L = session_->model_info().moe_layers[0];
  for (int step = 0; step < 20; ++step) {
    for (size_t i = 0; i < bufs.size(); ++i) {  // every token: experts 6 and 7
      in[i].x = RandomActivations(static_cast<size_t>(T) * H, 3000 + 10 * step + i);
      in[i].ids.assign(static_cast<size_t>(T) * k, 6);
      for (int t = 0; t < T; ++t) in[i].ids[static_cast<size_t>(t) * k + 1] = 7;
      in[i].w.assign(static_cast<size_t>(T) * k, 0.5f);
      ASSERT_CUDA(cudaMemcpy(bufs[i].hidden, in[i].x.data(), in[i].x.size() * 2, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(bufs[i].ids, in[i].ids.data(), in[i].ids.size() * 4, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(bufs[i].weights, in[i].w.data(), in[i].w.size() * 4, cudaMemcpyHostToDevice));
    }
    ASSERT_CUDA(cudaGraphLaunch(exec, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    EXPECT_TRUE(session_->TakeStreamError().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // moectl's popularity of the first MoE layer: experts 6 and 7 on top.
  std::string out;
  bool top = false;
  for (int i = 0; i < 30 && !top; ++i) {
    Subprocess moectl(testing::BinaryPath("moectl"),
                      {"--coordinator", addr, "--insecure", "--json", "popularity", "--layer", std::to_string(L),
                       "--top", "2"});
    out = moectl.ReadAll(std::chrono::seconds(10));
    moectl.Wait(std::chrono::seconds(10));
    const size_t e6 = out.find("\"expert\": 6"), e7 = out.find("\"expert\": 7");
    const size_t e6c = out.find("\"expert\":6"), e7c = out.find("\"expert\":7");
    top = (e6 != std::string::npos || e6c != std::string::npos) && (e7 != std::string::npos || e7c != std::string::npos);
    if (!top) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(top) << "the coordinator never ranked the replays' experts on top: " << out;
  cudaGraphExecDestroy(exec);
  session_.reset();
}

// A gRPC server in a captured step: its requests go through the worker's
// forwarder thread (the GPU pushes them into a local segment), with results
// equal to the reference across replays and a placement change.
TEST_F(GraphCaptureTest, CapturedStepReachesAGrpcServerThroughTheForwarder) {
  ASSERT_NO_FATAL_FAILURE(OpenForwarderSession(std::chrono::milliseconds(3000), std::chrono::milliseconds(3000)));
  const int T = 3;
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  for (int step = 0; step < 4; ++step) {
    if (step == 2) {
      for (int l : session_->model_info().moe_layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {3, 4, 5}).ok());
      ASSERT_TRUE(session_->admin().FlushCopies().ok());
    }
    EXPECT_TRUE(Replay(exec, step, T, bufs, in)) << "step " << step;
    EXPECT_TRUE(session_->TakeStreamError().ok());
  }
  cudaGraphExecDestroy(exec);
}

// A gRPC server that stops answering while its connection stays up (SIGSTOP:
// the kernel still takes its bytes) in a captured step: the forwarder's
// request waits out the server deadline once and the GPU computes it from the
// host copy; later replays fail over at once while the forwarder probes the
// server (not one server deadline per replay); once it runs again it serves
// the same graph, right.
TEST_F(GraphCaptureTest, CapturedStepFailsOverOnceFromAStalledGrpcServer) {
  const std::chrono::milliseconds server_deadline(1000);
  ASSERT_NO_FATAL_FAILURE(OpenForwarderSession(std::chrono::milliseconds(5000), server_deadline));
  const int T = 2;
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  ASSERT_TRUE(Replay(exec, 0, T, bufs, in));
  ASSERT_TRUE(session_->TakeStreamError().ok());
  server_->Signal(SIGSTOP);
  int waited = 0;
  for (int step = 1; step <= 4; ++step) {
    const Clock::time_point t0 = Clock::now();
    EXPECT_TRUE(Replay(exec, step, T, bufs, in)) << "step " << step << ": the device computes what was not answered";
    waited += Clock::now() - t0 >= server_deadline;
    (void)session_->TakeStreamError();
  }
  server_->Signal(SIGCONT);
  EXPECT_EQ(waited, 1) << "replays after the first waited out the server deadline again";
  for (int step = 5; step < 8; ++step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_TRUE(Replay(exec, step, T, bufs, in)) << "step " << step;
    (void)session_->TakeStreamError();
  }
  cudaGraphExecDestroy(exec);
}

// Replays across a drained server and a killed one: never a hang, never a
// wrong result: the device computes a request nobody answered by the deadline
// from the host copy, and the misses no server may take (copied from the host copy: at most kMaxDeviceCopies per
// call, and a step of T = 2, k = 2 misses at most 4 experts), and the server serves
// again once it is back (the worker reconnects at TakeStreamError).
TEST_F(GraphCaptureTest, ReplaysSurviveADrainedAndAKilledServer) {
  const int T = 2;
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  EXPECT_TRUE(Replay(exec, 0, T, bufs, in));
  EXPECT_TRUE(session_->TakeStreamError().ok());
  // Drained: no route for the misses; the device takes them.
  ASSERT_TRUE(session_->admin().SetServerEnabled(server_address_, false).ok());
  EXPECT_TRUE(Replay(exec, 1, T, bufs, in)) << "misses no server may take are computed on the device";
  EXPECT_TRUE(session_->TakeStreamError().ok());
  ASSERT_TRUE(session_->admin().SetServerEnabled(server_address_, true).ok());
  EXPECT_TRUE(Replay(exec, 2, T, bufs, in));
  EXPECT_TRUE(session_->TakeStreamError().ok());
  // Killed: the replay waits out the deadline, then the device computes the
  // requests nobody answered from the host copy (right, slowly; logged)...
  server_->Signal(SIGKILL);
  server_->Wait(std::chrono::seconds(10));
  const Clock::time_point t0 = Clock::now();
  EXPECT_TRUE(Replay(exec, 3, T, bufs, in)) << "the timed-out requests are recomputed on the device";
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20));
  EXPECT_GE(Clock::now() - t0, std::chrono::seconds(2)) << "the deadline (3 s) was not waited for";
  EXPECT_TRUE(session_->TakeStreamError().ok());
  // ...later replays, while it stays down, leave it out at once: the device
  // computes its misses, with no wait for the deadline.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  (void)session_->TakeStreamError();
  const Clock::time_point t1 = Clock::now();
  EXPECT_TRUE(Replay(exec, 4, T, bufs, in));
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(2)) << "a down server must not cost the deadline every replay";
  EXPECT_TRUE(session_->TakeStreamError().ok());
  // ...and a restarted server serves the same graph again.
  StartServer();
  bool back = false;
  for (int i = 0; i < 40 && !back; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (void)session_->TakeStreamError();
    back = Replay(exec, 5 + i, T, bufs, in);
  }
  EXPECT_TRUE(back) << "the restarted server was never used";
  cudaGraphExecDestroy(exec);
}

// Copy-instead inside a captured step (copy mode always: up to
// kMaxDeviceCopies missed experts per call copied from the host copy and
// computed on the device, the rest on the server), with two placements; then
// the server drained with more missed experts than the device may copy: the
// tokens of the others fail loudly (NaN, Unavailable), only those. A model
// with 32 experts (top-4) so that a call can miss more than the device takes.
TEST_F(GraphCaptureTest, CapturedStepCopiesInsteadOfComputing) {
  constexpr char kWide[] = "synthetic:demo:layers=2:seed=3";
  Subprocess* srv = nullptr;
  const std::string wide_sock = dir_.path() + "/wide.sock";
  ASSERT_FALSE(testing::StartExpertServer(&srv, {std::string("--model=") + kWide, "--threads=1",
                                                  "--shm-socket=" + wide_sock})
                   .empty());
  std::unique_ptr<Subprocess> wide_server(srv);
  SessionOptions o;
  o.model = kWide;
  o.servers = {"unix://" + wide_sock};
  o.device = DeviceChoice::kCuda;
  o.policy = CachePolicy::kStatic;
  o.copy_mode = CopyMode::kAlways;
  o.cache_experts_per_layer = 4;
  o.max_tokens = 8;
  o.deadline = std::chrono::milliseconds(3000);
  o.on_access = [this](int layer, int expert, int pairs, bool) { accesses_[{layer, expert}] += pairs; };
  absl::StatusOr<std::unique_ptr<MoeSession>> copying = MoeSession::Open(o);
  ASSERT_TRUE(copying.ok()) << copying.status();
  session_ = *std::move(copying);  // the fixture's helpers use session_, source_ and reference_
  source_ = *OpenModel(kWide);
  reference_ = std::make_unique<ReferenceMoe>(*source_);
  const int T = 8, k = session_->model_info().top_k, E = session_->model_info().num_experts;
  ASSERT_GT(T * k, kMaxDeviceCopies + 4);
  std::vector<Buffers> bufs;
  std::vector<Inputs> in;
  cudaGraphExec_t exec = CaptureStep(T, &bufs, &in);
  ASSERT_NE(exec, nullptr);
  EXPECT_TRUE(session_->TakeStreamError().ok());
  accesses_.clear();
  for (int step = 0; step < 4; ++step) {
    if (step == 2) {
      for (int l : session_->model_info().moe_layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {20, 21, 22, 23}).ok());
      ASSERT_TRUE(session_->admin().FlushCopies().ok());
    }
    EXPECT_TRUE(Replay(exec, step, T, bufs, in)) << "step " << step;
    EXPECT_TRUE(session_->TakeStreamError().ok());
  }
  int pairs = 0;
  for (const auto& [key, n] : accesses_) pairs += n;
  EXPECT_EQ(pairs, 4 * T * k * static_cast<int>(session_->model_info().moe_layers.size()));
  // Drained, every call missing kMaxDeviceCopies + 2 experts, one token each
  // (tokens 0..7 take experts 4..27 in order, k pairs a token): the device
  // copies the first kMaxDeviceCopies (lowest ids at equal pairs), the two
  // left have no route.
  ASSERT_TRUE(session_->admin().SetServerEnabled("unix://" + wide_sock, false).ok());
  for (int l : session_->model_info().moe_layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {0, 1, 2, 3}).ok());
  ASSERT_TRUE(session_->admin().FlushCopies().ok());
  const int missed = kMaxDeviceCopies + 2;
  for (size_t i = 0; i < bufs.size(); ++i) {
    in[i].x = RandomActivations(static_cast<size_t>(T) * session_->model_info().hidden, 31 + i);
    in[i].ids.assign(static_cast<size_t>(T) * k, -1);
    in[i].w.assign(static_cast<size_t>(T) * k, 0.25f);
    for (int p = 0; p < missed; ++p) in[i].ids[p] = 4 + p;  // pair p: token p / k
    ASSERT_LT(4 + missed, E);
    ASSERT_CUDA(cudaMemcpy(bufs[i].hidden, in[i].x.data(), in[i].x.size() * 2, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(bufs[i].ids, in[i].ids.data(), in[i].ids.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(bufs[i].weights, in[i].w.data(), in[i].w.size() * 4, cudaMemcpyHostToDevice));
  }
  ASSERT_CUDA(cudaGraphLaunch(exec, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(absl::IsUnavailable(session_->TakeStreamError()));
  const int H = session_->model_info().hidden;
  std::vector<bf16_t> out(static_cast<size_t>(T) * H);
  ASSERT_CUDA(cudaMemcpy(out.data(), bufs[0].out, out.size() * 2, cudaMemcpyDeviceToHost));
  std::set<int> poisoned, expected;
  for (int t = 0; t < T; ++t)
    if (std::isnan(Bf16ToF32(out[static_cast<size_t>(t) * H]))) poisoned.insert(t);
  for (int p = kMaxDeviceCopies; p < missed; ++p) expected.insert(p / k);
  EXPECT_EQ(poisoned, expected) << "the tokens of the experts neither the device nor a server took, and only them";
  cudaGraphExecDestroy(exec);
  session_.reset();
}

TEST_F(GraphCaptureTest, StreamOrderedEagerCallOnANonBlockingStream) {
  const int T = 5, k = session_->model_info().top_k, L = session_->model_info().moe_layers[0];
  Buffers b = Alloc(T, k);
  ASSERT_TRUE(session_->admin().ApplyAssignment(L, {0, 1, 2}).ok());
  ASSERT_TRUE(session_->admin().FlushCopies().ok());
  Inputs in;
  Fill(b, T, k, 7, &in);  // enqueued on the engine stream, not yet complete
  CallStats stats;
  ASSERT_TRUE(session_->ForwardLayer(L, T, k, b.hidden, b.ids, b.weights, b.out, MemoryKind::kDevice, &stats, stream_)
                  .ok());
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "hits " << stats.hit_pairs << " cpu " << stats.cpu_pairs << " copied "
                                         << stats.copied_pairs;
  EXPECT_EQ(stats.hit_pairs + stats.cpu_pairs + stats.copied_pairs, T * k);
  // The inputs the engine stream produced are what the call saw.
  std::vector<bf16_t> x(in.x.size());
  ASSERT_CUDA(cudaMemcpy(x.data(), b.hidden, x.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(x.data(), in.x.data(), x.size() * 2));
  // The same call without a stream, then with host pointers: same result.
  ASSERT_TRUE(session_->ForwardLayer(L, T, k, b.hidden, b.ids, b.weights, b.out, MemoryKind::kDevice, &stats).ok());
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "device pointers, no stream";
  std::vector<bf16_t> host_out(in.x.size());
  ASSERT_TRUE(session_->ForwardLayer(L, T, k, in.x.data(), in.ids.data(), in.w.data(), host_out.data(),
                                     MemoryKind::kHost, &stats)
                  .ok());
  ASSERT_CUDA(cudaMemcpy(b.out, host_out.data(), host_out.size() * 2, cudaMemcpyHostToDevice));
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "host pointers";
  // A capturable call given no stream runs on the legacy default stream (stream 0,
  // torch's current stream unless the engine set one), as a CUDA call would.
  ASSERT_CUDA(cudaMemset(b.out, 0, sizeof(bf16_t) * T * session_->model_info().hidden));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_TRUE(session_->ForwardLayerCapturable(L, T, k, b.hidden, b.ids, b.weights, b.out, nullptr).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(session_->TakeStreamError().ok());
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "capturable call on stream 0";

  // A drained server gets no capturable misses: with the only server
  // disabled the device computes them from the host copy (up to
  // kMaxDeviceCopies experts a call; this call misses at most 5) — right, no
  // error; once enabled again the same call is right too.
  ASSERT_TRUE(session_->admin().SetServerEnabled(server_address_, false).ok());
  ASSERT_TRUE(session_->ForwardLayerCapturable(L, T, k, b.hidden, b.ids, b.weights, b.out, stream_).ok());
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  const absl::Status drained = session_->TakeStreamError();
  EXPECT_TRUE(drained.ok()) << drained;
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "the device computes a drained server's misses";
  ASSERT_TRUE(session_->admin().SetServerEnabled(server_address_, true).ok());
  ASSERT_TRUE(session_->ForwardLayerCapturable(L, T, k, b.hidden, b.ids, b.weights, b.out, stream_).ok());
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(session_->TakeStreamError().ok());
  EXPECT_LE(Error(L, b, T, k, in), 1e-2) << "after undrain";
}

TEST_F(GraphCaptureTest, CapturedDecodeStepReplaysWithNewInputsAndPlacements) {
  const int T = 4, k = session_->model_info().top_k;
  const std::vector<int>& layers = session_->model_info().moe_layers;
  std::vector<Buffers> bufs;
  for (size_t i = 0; i < layers.size(); ++i) bufs.push_back(Alloc(T, k));
  // Warm-up outside the capture (allocates each layer's staging).
  std::vector<Inputs> in(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    Fill(bufs[i], T, k, 100 + i, &in[i]);
    ASSERT_TRUE(session_->ForwardLayerCapturable(layers[i], T, k, bufs[i].hidden, bufs[i].ids, bufs[i].weights,
                                                 bufs[i].out, stream_)
                    .ok());
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < layers.size(); ++i) EXPECT_LE(Error(layers[i], bufs[i], T, k, in[i]), 1e-2);

  // Capture both layers into one graph.
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  for (size_t i = 0; i < layers.size(); ++i)
    ASSERT_TRUE(session_->ForwardLayerCapturable(layers[i], T, k, bufs[i].hidden, bufs[i].ids, bufs[i].weights,
                                                 bufs[i].out, stream_)
                    .ok());
  ASSERT_CUDA(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  for (int step = 0; step < 6; ++step) {
    if (step == 2) {  // placement changes between replays: all misses -> many hits
      for (int l : layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {0, 1, 2}).ok());
      ASSERT_TRUE(session_->admin().FlushCopies().ok());
    }
    if (step == 4) {
      for (int l : layers) ASSERT_TRUE(session_->admin().ApplyAssignment(l, {5, 6, 7}).ok());
      ASSERT_TRUE(session_->admin().FlushCopies().ok());
    }
    for (size_t i = 0; i < layers.size(); ++i) Fill(bufs[i], T, k, 1000 * step + i, &in[i]);
    ASSERT_CUDA(cudaGraphLaunch(exec, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    for (size_t i = 0; i < layers.size(); ++i)
      EXPECT_LE(Error(layers[i], bufs[i], T, k, in[i]), 1e-2) << "step " << step << " layer " << layers[i];
    EXPECT_TRUE(session_->TakeStreamError().ok());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(GraphCaptureTest, CapturableCallRefusesBadArguments) {
  const int T = 2, k = session_->model_info().top_k, L = session_->model_info().moe_layers[0];
  Buffers b = Alloc(T, k);
  EXPECT_TRUE(absl::IsInvalidArgument(
      session_->ForwardLayerCapturable(0, T, k, b.hidden, b.ids, b.weights, b.out, stream_)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      session_->ForwardLayerCapturable(L, 9, k, b.hidden, b.ids, b.weights, b.out, stream_)));
  // A layer never run eagerly cannot be captured first.
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  const absl::Status st = session_->ForwardLayerCapturable(L, T, k, b.hidden, b.ids, b.weights, b.out, stream_);
  cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
}

}  // namespace
}  // namespace moe
