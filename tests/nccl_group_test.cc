// Groups of GPUs over NCCL (issue 26), one session per GPU:
// - tensor parallelism: every rank given the same tokens returns its share
//   and ncclAllReduce on its stream sums them — the layer's output, equal to
//   the reference MoE on every rank;
// - expert parallelism: every rank its own tokens (different counts, none
//   too), exchanged by the sessions within the call; each rank's output
//   equals the reference of its tokens; a rank's bad input fails only its
//   call; a peer that stops answering is left at the deadline and the
//   survivor's outputs stay exact;
// - a moe-gpu-worker process driving both GPUs (--gpus 2) serves
//   WorkerService.ForwardLayer exactly, one cache over the two GPUs.
// Needs two CUDA GPUs and NCCL: skipped by name otherwise (the CI machine
// has none).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/model_source.h"
#include "transport/wire.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/worker.grpc.pb.h"
#include "model/reference_moe.h"
#include "gtest/gtest.h"
#include "moe/engine.h"
#include "tests/device_call.h"
#include "tests/test_support.h"

namespace moe {
namespace {

const char kModel[] = "synthetic:demo:layers=2:seed=41";  // H=512, 32 experts, top-4
constexpr int kH = 512, kE = 32, kK = 4, kRanks = 2;

// Random tokens and routing of one call, from `seed`.
void Batch(uint64_t seed, int T, std::vector<bf16_t>* x, std::vector<int32_t>* ids, std::vector<float>* w) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1), pw(0.1f, 1);
  x->resize(static_cast<size_t>(T) * kH);
  for (bf16_t& v : *x) v = F32ToBf16(u(rng));
  ids->assign(static_cast<size_t>(T) * kK, -1);
  w->assign(ids->size(), 0.f);
  for (int t = 0; t < T; ++t) {
    std::vector<int> pool(kE);
    for (int e = 0; e < kE; ++e) pool[e] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < kK; ++j) {
      (*ids)[t * kK + j] = pool[j];
      (*w)[t * kK + j] = pw(rng);
    }
  }
}

// The relative error of a call's output against the f64 reference.
double ErrorOf(ReferenceMoe& reference, int layer, int T, const std::vector<bf16_t>& x,
               const std::vector<int32_t>& ids, const std::vector<float>& w, const std::vector<bf16_t>& out) {
  std::vector<double> ref(out.size());
  if (!reference.Forward<double>(layer, T, x.data(), RoutingView{T, kK, ids.data(), w.data()}, ref.data()).ok())
    return 1e9;
  std::vector<float> got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
  return RelativeL2Error(got.data(), ref.data(), ref.size());
}

// Rank r's session options on GPU r (made current: the session opens there).
SessionOptions RankOptions(int r, const std::string& server, int max_tokens) {
  cudaSetDevice(r);
  SessionOptions o;
  o.model = kModel;
  o.servers = {server};
  o.device = DeviceChoice::kCuda;
  o.cache_experts_per_layer = 4;
  o.policy = CachePolicy::kLru;
  o.max_tokens = max_tokens;
  o.max_top_k = kK;
  return o;
}

bool HaveGpus(int n, int* found) {
  *found = 0;
  return cudaGetDeviceCount(found) == cudaSuccess && *found >= n;
}

TEST(NcclTensorParallel, TwoGpusAllReduceTheirSharesIntoTheLayer) {
  int devices = 0;
  if (!HaveGpus(kRanks, &devices)) GTEST_SKIP() << "needs " << kRanks << " CUDA GPUs, found " << devices;
  testing::TempDir dir;
  std::vector<std::unique_ptr<Subprocess>> servers;
  const std::string server = testing::StartTestServer(servers, dir.path(), kModel, /*shm=*/true);
  ASSERT_FALSE(server.empty());
  std::unique_ptr<ModelSource> source = *OpenModel(kModel);
  ReferenceMoe reference(*source);
  std::vector<ncclComm_t> comms(kRanks);
  int devs[kRanks] = {0, 1};
  ASSERT_EQ(ncclCommInitAll(comms.data(), kRanks, devs), ncclSuccess);

  std::vector<std::vector<double>> errors(kRanks);
  std::vector<std::string> failures(kRanks);
  auto rank_main = [&](int r) {
    SessionOptions o = RankOptions(r, server, 512);
    o.group = TensorParallel(r, kRanks);
    absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
    if (!s.ok()) {
      failures[r] = std::string(s.status().message());
      return;
    }
    cudaStream_t stream = nullptr;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    for (int step = 0; step < 6; ++step)
      for (int layer : {0, 1}) {
        const int T = step % 2 == 0 ? 1 : 300;  // the device path, then the host path (over a request slot)
        std::vector<bf16_t> x;
        std::vector<int32_t> ids;
        std::vector<float> w;
        Batch(1000 * step + layer, T, &x, &ids, &w);
        testing::DeviceCall dev(x, ids, w);
        absl::Status st = (*s)->ForwardLayer(layer, T, kK, dev.x(), dev.ids(), dev.weights(), dev.out(),
                                             MemoryKind::kDevice, nullptr, stream);
        if (!st.ok()) {
          failures[r] = std::string(st.message());
          return;
        }
        // The engine's all-reduce of the layer output: the ranks' shares add up.
        if (ncclAllReduce(dev.out(), dev.out(), x.size(), ncclBfloat16, ncclSum, comms[r], stream) != ncclSuccess ||
            cudaStreamSynchronize(stream) != cudaSuccess) {
          failures[r] = "ncclAllReduce";
          return;
        }
        errors[r].push_back(ErrorOf(reference, layer, T, x, ids, w, dev.Output()));
      }
    s->reset();  // before the stream its calls used (engine.h)
    cudaStreamDestroy(stream);
  };
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) ranks.emplace_back(rank_main, r);
  for (std::thread& t : ranks) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(failures[r].empty()) << "rank " << r << ": " << failures[r];
    EXPECT_EQ(errors[r].size(), 12u);
    for (double e : errors[r]) EXPECT_LE(e, 1e-2) << "rank " << r;
  }
}


// Expert parallelism: two ranks, each with its own tokens, one session per
// GPU sharing a group id.
class NcclExpertParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (!HaveGpus(kRanks, &devices)) GTEST_SKIP() << "needs " << kRanks << " CUDA GPUs, found " << devices;
    server_ = testing::StartTestServer(servers_, dir_.path(), kModel, /*shm=*/true);
    ASSERT_FALSE(server_.empty());
    absl::StatusOr<std::string> id = MoeSession::NewGroupId();
    ASSERT_TRUE(id.ok()) << id.status();
    id_ = *id;
    source_ = *OpenModel(kModel);
    reference_ = std::make_unique<ReferenceMoe>(*source_);
  }

  // Opens rank r's session on GPU r (collective: both ranks at once).
  absl::StatusOr<std::unique_ptr<MoeSession>> Open(int r, std::chrono::milliseconds deadline) {
    SessionOptions o = RankOptions(r, server_, 320);
    o.deadline = deadline;
    o.group.rank = r;
    o.group.size = kRanks;
    o.group.mode = GroupMode::kExpert;
    o.group.id = id_;
    return MoeSession::Open(o);
  }

  // One call of rank r with T tokens from `seed`; its error against the
  // reference, or the call's status.
  absl::StatusOr<double> Call(MoeSession& s, cudaStream_t stream, int layer, int T, uint64_t seed,
                              bool bad_id = false) {
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
    Batch(seed, T, &x, &ids, &w);
    if (bad_id && T > 0) ids[0] = kE + 3;
    testing::DeviceCall dev(x, ids, w);
    absl::Status st = s.ForwardLayer(layer, T, kK, dev.x(), dev.ids(), dev.weights(), dev.out(), MemoryKind::kDevice,
                                     nullptr, stream);
    if (!st.ok()) return st;
    if (cudaStreamSynchronize(stream) != cudaSuccess) return absl::InternalError("stream");
    if (T == 0) return 0.0;
    return ErrorOf(*reference_, layer, T, x, ids, w, dev.Output());
  }

  // Runs body(rank, session, stream) on a thread per rank, each with its
  // session (the ranks open together) and a stream of its own; a rank that
  // cannot open says why in failures[rank].
  void RunRanks(std::chrono::milliseconds deadline, std::vector<std::string>& failures,
                const std::function<void(int, MoeSession&, cudaStream_t)>& body) {
    std::vector<std::thread> ranks;
    for (int r = 0; r < kRanks; ++r)
      ranks.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<MoeSession>> s = Open(r, deadline);
        if (!s.ok()) {
          failures[r] = std::string(s.status().message());
          return;
        }
        cudaStream_t stream = nullptr;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        body(r, **s, stream);
        s->reset();  // before the stream its calls used (engine.h)
        cudaStreamDestroy(stream);
      });
    for (std::thread& t : ranks) t.join();
  }

  testing::TempDir dir_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
  std::string server_, id_;
  std::unique_ptr<ModelSource> source_;
  std::unique_ptr<ReferenceMoe> reference_;
};

TEST_F(NcclExpertParallel, EachRanksTokensComeBackExactWithOneCacheOverBothGpus) {
  // Tokens per (step, rank): the device path (batch within a request slot),
  // the host path (above it), a rank with none.
  const int kT[][kRanks] = {{1, 7}, {300, 2}, {0, 40}, {5, 0}, {250, 320}, {3, 3}};
  std::vector<std::string> failures(kRanks);
  std::vector<int> calls(kRanks, 0);
  std::vector<std::vector<int>> cached(kRanks);
  RunRanks(std::chrono::milliseconds(20000), failures, [&](int r, MoeSession& s, cudaStream_t stream) {
    for (int step = 0; step < 6; ++step)
      for (int layer : {0, 1}) {
        absl::StatusOr<double> e = Call(s, stream, layer, kT[step][r], 7000 * step + 100 * layer + r);
        if (!e.ok()) failures[r] += absl::StrCat(" step ", step, ": ", e.status().message());
        else if (*e > 1e-2) failures[r] += absl::StrCat(" step ", step, " layer ", layer, ": error ", *e);
        else ++calls[r];
      }
    cached[r] = s.admin().CachedExperts(0);
    // The async and capturable calls are refused in this mode.
    EXPECT_TRUE(absl::IsFailedPrecondition(
        s.ForwardLayerAsync(0, 1, kK, nullptr, nullptr, nullptr, nullptr, MemoryKind::kDevice, stream).status()));
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(failures[r].empty()) << "rank " << r << ":" << failures[r];
    EXPECT_EQ(calls[r], 12) << "rank " << r;
    // One cache over both GPUs: each holds only experts it owns.
    EXPECT_FALSE(cached[r].empty()) << "rank " << r;
    for (int e : cached[r]) {
      if (e >= 0) {
        EXPECT_EQ(ExpertOwner(0, e, kRanks), r) << "rank " << r << " caches expert " << e;
      }
    }
  }
}

TEST_F(NcclExpertParallel, BadInputFailsOnlyItsRanksCall) {
  std::vector<absl::Status> bad(kRanks);
  std::vector<std::vector<double>> errors(kRanks);
  std::vector<std::string> failures(kRanks);
  RunRanks(std::chrono::milliseconds(20000), failures, [&](int r, MoeSession& s, cudaStream_t stream) {
    for (int step = 0; step < 3; ++step) {
      // Step 1: rank 0 routes a token to an expert that does not exist.
      absl::StatusOr<double> e = Call(s, stream, 0, 6, 500 * step + r, /*bad_id=*/step == 1 && r == 0);
      if (step == 1 && r == 0) bad[r] = e.status();
      else if (e.ok()) errors[r].push_back(*e);
      else failures[r] += std::string(e.status().message());
    }
  });
  EXPECT_TRUE(absl::IsInvalidArgument(bad[0])) << bad[0];
  EXPECT_NE(bad[0].message().find("topk_ids"), std::string::npos) << bad[0];
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(failures[r].empty()) << "rank " << r << ": " << failures[r];
    EXPECT_EQ(errors[r].size(), r == 0 ? 2u : 3u);
    for (double e : errors[r]) EXPECT_LE(e, 1e-2) << "rank " << r;
  }
}

TEST_F(NcclExpertParallel, APeerThatStopsAnsweringIsLeftAtTheDeadline) {
  constexpr auto kDeadline = std::chrono::milliseconds(3000);
  std::atomic<bool> survivor_done{false};
  std::vector<std::string> failures(kRanks);
  std::vector<double> errors;
  double stalled_call_s = 0, alone_call_s = 0;
  RunRanks(kDeadline, failures, [&](int r, MoeSession& s, cudaStream_t stream) {
    for (int step = 0; step < 2; ++step) {  // together
      absl::StatusOr<double> e = Call(s, stream, step % 2, 9, 900 * step + r);
      if (!e.ok() || *e > 1e-2) failures[r] += absl::StrCat(" step ", step, " together");
    }
    if (r == 1) {  // rank 1's GPU "hangs": it never calls again while rank 0 runs
      while (!survivor_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } else {
      for (int step = 2; step < 5; ++step) {
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<double> e = Call(s, stream, step % 2, 9, 900 * step);
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        (step == 2 ? stalled_call_s : alone_call_s) = sec;
        if (!e.ok()) failures[0] += absl::StrCat(" step ", step, ": ", e.status().message());
        else errors.push_back(*e);
      }
      survivor_done = true;
    }
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(failures[r].empty()) << "rank " << r << ":" << failures[r];
  ASSERT_EQ(errors.size(), 3u);
  for (double e : errors) EXPECT_LE(e, 1e-2);  // the peer's experts computed on the CPU server: exact
  // The stalled call waited for the deadline, not past it by much.
  EXPECT_GE(stalled_call_s, 0.9 * std::chrono::duration<double>(kDeadline).count());
  EXPECT_LE(stalled_call_s, std::chrono::duration<double>(kDeadline).count() + 2.0);
  EXPECT_LE(alone_call_s, 1.0);  // alone afterwards: no more waits
}


// moe-gpu-worker --gpus 2: one process, one cache over both GPUs (the
// experts split between them, tokens exchanged over NCCL), served over gRPC.
TEST_F(NcclExpertParallel, MultiGpuWorkerServesOneCacheOverItsGpus) {
  Subprocess worker(testing::BinaryPath("moe-gpu-worker"),
                    {std::string("--model=") + kModel, "--servers=" + server_, "--device=cuda", "--gpus=2",
                     "--cache-experts-per-layer=4", "--policy=static", "--max-tokens=300", "--max-top-k=4",
                     "--listen=127.0.0.1:0", "--insecure"});
  const std::string line = worker.ReadLine(std::chrono::seconds(60));
  ASSERT_NE(line.find("ready on "), std::string::npos) << line;
  auto stub = moe::v1::WorkerService::NewStub(
      grpc::CreateChannel(line.substr(line.find("ready on ") + 9), grpc::InsecureChannelCredentials()));
  {  // a placement for the whole worker: each GPU takes the experts it owns
    grpc::ClientContext ctx;
    moe::v1::ApplyAssignmentRequest req;
    moe::v1::ApplyAssignmentResponse resp;
    req.set_layer(1);
    for (int e = 0; e < 8; ++e) req.add_experts(e);
    grpc::Status st = stub->ApplyAssignment(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  int hits = 0;
  for (int round = 0; round < 4; ++round)
    for (int T : {1, 37, 300}) {
      std::vector<bf16_t> x;
      std::vector<int32_t> ids;
      std::vector<float> w;
      Batch(31 * round + T, T, &x, &ids, &w);
      moe::v1::ForwardLayerRequest req;
      req.set_layer(1);
      moe::v1::MicroBatch* m = req.add_batches();
      EncodeTensor(DType::kBF16, {T, kH}, x.data(), m->mutable_hidden());
      EncodeTensor(DType::kI32, {T, kK}, ids.data(), m->mutable_topk_ids());
      EncodeTensor(DType::kF32, {T, kK}, w.data(), m->mutable_topk_weights());
      grpc::ClientContext ctx;
      moe::v1::ForwardLayerResponse resp;
      grpc::Status st = stub->ForwardLayer(&ctx, req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      ASSERT_EQ(resp.outputs_size(), 1);
      std::vector<bf16_t> out(x.size());
      ASSERT_EQ(resp.outputs(0).data().size(), out.size() * sizeof(bf16_t));
      std::memcpy(out.data(), resp.outputs(0).data().data(), out.size() * sizeof(bf16_t));
      EXPECT_LE(ErrorOf(*reference_, 1, T, x, ids, w, out), 1e-2) << "T=" << T << " round " << round;
      if (round == 3) hits += resp.stats(0).hit_pairs();
    }
  EXPECT_GT(hits, 0);
  grpc::ClientContext ctx;
  moe::v1::WorkerInfo info;
  ASSERT_TRUE(stub->GetWorkerInfo(&ctx, moe::v1::WorkerInfoRequest(), &info).ok());
  EXPECT_EQ(info.slots_per_layer(), 8u);  // 4 per GPU: one cache of both
  for (const moe::v1::LayerCacheInfo& l : info.layers())
    if (l.layer() == 1) {
      std::vector<int> held(l.slot_experts().begin(), l.slot_experts().end());
      std::sort(held.begin(), held.end());
      EXPECT_EQ(held, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));  // no expert twice
    }
}

}  // namespace
}  // namespace moe
