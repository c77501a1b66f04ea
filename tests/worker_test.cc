// The engine-facing surfaces of the GPU worker: the client library's
// MoeSession (in process) and the moe-gpu-worker process over gRPC
// (WorkerService), both against a real expert server process over shm.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>

#include "client/expert_client.h"
#include "moe/engine.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "transport/grpc_channel.h"
#include "transport/wire.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe/v1/worker.grpc.pb.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using testing::Subprocess;
using testing::TempDir;

const char kModel[] = "synthetic:tiny:seed=21";
constexpr int kH = 96;

struct Batch {
  int T = 0, k = 0;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Batch RandomBatch(int T, int k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), pw(0.1f, 1.0f);
  Batch b{T, k, std::vector<bf16_t>(static_cast<size_t>(T) * kH), {}, {}};
  for (bf16_t& v : b.x) v = F32ToBf16(u(rng));
  for (int t = 0; t < T; ++t) {
    std::vector<int> e = {0, 1, 2, 3, 4, 5, 6, 7};
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < k; ++j) {
      b.ids.push_back(e[j]);
      b.w.push_back(pw(rng));
    }
  }
  return b;
}

double Error(int layer, const Batch& b, const bf16_t* out) {
  static std::unique_ptr<ModelSource> src = *OpenModel(kModel);
  ReferenceMoe ref(*src);
  std::vector<double> r(static_cast<size_t>(b.T) * kH);
  EXPECT_TRUE(ref.Forward<double>(layer, b.T, b.x.data(), RoutingView{b.T, b.k, b.ids.data(), b.w.data()}, r.data()).ok());
  std::vector<float> got(r.size());
  for (size_t i = 0; i < r.size(); ++i) got[i] = Bf16ToF32(out[i]);
  return RelativeL2Error(got.data(), r.data(), r.size());
}

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = dir_.path() + "/expert.sock";
    Subprocess* s = nullptr;
    server_addr_ = testing::StartExpertServer(&s, {std::string("--model=") + kModel, "--threads=1",
                                                   "--shm-socket=" + socket_});
    server_.reset(s);
    ASSERT_FALSE(server_addr_.empty());
  }
  TempDir dir_;
  std::string socket_, server_addr_;
  std::unique_ptr<Subprocess> server_;
};

TEST_F(WorkerTest, SessionForwardsSyncAndAsync) {
  SessionOptions o;
  o.model = kModel;
  o.servers = {"unix://" + socket_};
  o.device = DeviceChoice::kCpu;
  o.cache_experts_per_layer = 3;
  o.max_tokens = 64;
  o.cpu_threads = 1;
  absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  MoeSession& session = **s;
  EXPECT_STREQ(session.device(), "cpu");
  Batch a = RandomBatch(9, 2, 1), b = RandomBatch(20, 3, 2);
  std::vector<bf16_t> oa(a.x.size()), ob(b.x.size());
  ASSERT_TRUE(session.ForwardLayer(1, a.T, a.k, a.x.data(), a.ids.data(), a.w.data(), oa.data()).ok());
  EXPECT_LE(Error(1, a, oa.data()), 1e-2);
  // Two micro-batches in flight.
  absl::StatusOr<MoeSession::Pending> pa = session.ForwardLayerAsync(2, a.T, a.k, a.x.data(), a.ids.data(), a.w.data(), oa.data());
  absl::StatusOr<MoeSession::Pending> pb = session.ForwardLayerAsync(2, b.T, b.k, b.x.data(), b.ids.data(), b.w.data(), ob.data());
  ASSERT_TRUE(pa.ok() && pb.ok());
  ASSERT_TRUE(session.Wait(*pa).ok());
  ASSERT_TRUE(session.Wait(*pb).ok());
  EXPECT_LE(Error(2, a, oa.data()), 1e-2);
  EXPECT_LE(Error(2, b, ob.data()), 1e-2);
  // Device pointers on a backend without device memory are refused, by name.
  absl::Status st = session.ForwardLayer(1, a.T, a.k, a.x.data(), a.ids.data(), a.w.data(), oa.data(), MemoryKind::kDevice);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  // The session keeps its totals: 4 calls (one failed), every routed pair of
  // the three good ones counted once, as a hit, on the CPU or copied.
  const SessionTotals t = session.totals();
  EXPECT_EQ(t.calls, 4u);
  EXPECT_EQ(t.failed_calls, 1u);
  EXPECT_EQ(t.hit_pairs + t.cpu_pairs + t.copied_pairs, static_cast<uint64_t>(2 * a.T * a.k + b.T * b.k));
  EXPECT_GT(t.seconds, 0);
  EXPECT_EQ(session.served_layers(), session.model_info().moe_layers);
}

TEST_F(WorkerTest, SessionRejectsBadOptions) {
  SessionOptions o;
  o.model = kModel;
  o.servers = {"unix://" + socket_};
  // Names outside the choices are refused naming the field (the C ABI and the
  // flags parse through these).
  absl::StatusOr<DeviceChoice> tpu = ParseDeviceChoice("tpu");
  EXPECT_TRUE(absl::IsInvalidArgument(tpu.status()));
  EXPECT_NE(tpu.status().message().find("device: 'tpu' is not auto, cuda or cpu"), std::string::npos) << tpu.status();
  EXPECT_TRUE(absl::IsInvalidArgument(ParseCachePolicy("fifo").status()));
  EXPECT_EQ(*ParseCachePolicy(Name(CachePolicy::kLfru)), CachePolicy::kLfru);
  o.device = DeviceChoice::kCpu;
  o.policy = CachePolicy::kLru;
  o.servers = {"unix://" + dir_.path() + "/nobody.sock"};
  EXPECT_FALSE(MoeSession::Open(o).ok());
}

void Encode(const Batch& b, moe::v1::MicroBatch* m) {
  EncodeTensor(DType::kBF16, {b.T, kH}, b.x.data(), m->mutable_hidden());
  EncodeTensor(DType::kI32, {b.T, b.k}, b.ids.data(), m->mutable_topk_ids());
  EncodeTensor(DType::kF32, {b.T, b.k}, b.w.data(), m->mutable_topk_weights());
}

TEST_F(WorkerTest, WorkerProcessServesForwardLayerOverGrpc) {
  Subprocess worker(testing::BinaryPath("moe-gpu-worker"),
                    {std::string("--model=") + kModel, "--servers=unix://" + socket_, "--device=cpu",
                     "--cache-experts-per-layer=4", "--policy=static", "--cpu-threads=1", "--max-tokens=128",
                     "--listen=127.0.0.1:0", "--insecure"});
  std::string line = worker.ReadLine(std::chrono::seconds(30));
  ASSERT_NE(line.find("ready on "), std::string::npos) << line;
  const std::string addr = line.substr(line.find("ready on ") + 9);
  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  auto stub = moe::v1::WorkerService::NewStub(channel);

  // Static placement pushed over the API, then a two-micro-batch call.
  {
    grpc::ClientContext ctx;
    moe::v1::ApplyAssignmentRequest req;
    moe::v1::ApplyAssignmentResponse resp;
    req.set_layer(1);
    for (int e : {2, 4, 6, 7}) req.add_experts(e);
    ASSERT_TRUE(stub->ApplyAssignment(&ctx, req, &resp).ok());
  }
  Batch a = RandomBatch(10, 2, 3), b = RandomBatch(40, 4, 4);
  moe::v1::ForwardLayerRequest req;
  req.set_layer(1);
  Encode(a, req.add_batches());
  Encode(b, req.add_batches());
  int hits = 0;
  for (int round = 0; round < 3; ++round) {  // the assignment's copies complete between calls
    grpc::ClientContext ctx;
    moe::v1::ForwardLayerResponse resp;
    grpc::Status st = stub->ForwardLayer(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.outputs_size(), 2);
    std::vector<bf16_t> oa(a.x.size()), ob(b.x.size());
    std::memcpy(oa.data(), resp.outputs(0).data().data(), oa.size() * 2);
    std::memcpy(ob.data(), resp.outputs(1).data().data(), ob.size() * 2);
    EXPECT_LE(Error(1, a, oa.data()), 1e-2);
    EXPECT_LE(Error(1, b, ob.data()), 1e-2);
    hits = resp.stats(0).hit_pairs() + resp.stats(1).hit_pairs();
  }
  EXPECT_GT(hits, 0);
  {
    grpc::ClientContext ctx;
    moe::v1::WorkerInfo info;
    ASSERT_TRUE(stub->GetWorkerInfo(&ctx, moe::v1::WorkerInfoRequest(), &info).ok());
    EXPECT_EQ(info.device(), "cpu");
    EXPECT_EQ(info.slots_per_layer(), 4u);
    EXPECT_GT(info.layers(0).hit_rate(), 0.0);
  }
  // Bad input: the field is named; the worker keeps serving.
  {
    moe::v1::ForwardLayerRequest bad = req;
    bad.mutable_batches(1)->mutable_topk_weights()->mutable_shape()->Set(1, 3);
    grpc::ClientContext ctx;
    moe::v1::ForwardLayerResponse resp;
    grpc::Status st = stub->ForwardLayer(&ctx, bad, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("batches[1].topk_weights"), std::string::npos) << st.error_message();
  }
  {
    moe::v1::ForwardLayerRequest bad = req;
    reinterpret_cast<int32_t*>(bad.mutable_batches(0)->mutable_topk_ids()->mutable_data()->data())[3] = 99;
    grpc::ClientContext ctx;
    moe::v1::ForwardLayerResponse resp;
    grpc::Status st = stub->ForwardLayer(&ctx, bad, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("batches[0].topk_ids[1,1]"), std::string::npos) << st.error_message();
  }
  {
    grpc::ClientContext ctx;
    moe::v1::ForwardLayerResponse resp;
    ASSERT_TRUE(stub->ForwardLayer(&ctx, req, &resp).ok());
  }
}

TEST_F(WorkerTest, WorkerRefusesBadFlagsWithOneLine) {
  for (auto [flag, named] : std::vector<std::pair<std::string, std::string>>{{"--policy=bogus", "policy"},
                                                                             {"--grpc-streams=0", "--grpc-streams"}}) {
    const std::string err = dir_.path() + "/worker" + named + ".err";
    Subprocess worker(testing::BinaryPath("moe-gpu-worker"),
                      {std::string("--model=") + kModel, "--servers=unix://" + socket_, "--device=cpu", flag,
                       "--insecure"},
                      err);
    const int status = worker.Wait(std::chrono::seconds(20));
    ASSERT_TRUE(WIFEXITED(status)) << flag;
    EXPECT_NE(WEXITSTATUS(status), 0) << flag;
    std::ifstream f(err);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
    EXPECT_NE(text.find(named), std::string::npos) << text;
  }
}

// The same bad input to the worker (WorkerService) and to the expert server
// (ExpertService): the same status code, each naming the field in its own
// proto's terms (the worker's batches[i].topk_ids is the server's expert_ids).
TEST_F(WorkerTest, WorkerAndServerAgreeOnCodesAndFieldNames) {
  Subprocess worker(testing::BinaryPath("moe-gpu-worker"),
                    {std::string("--model=") + kModel, "--servers=unix://" + socket_, "--device=cpu",
                     "--cache-experts-per-layer=2", "--cpu-threads=1", "--max-tokens=64", "--listen=127.0.0.1:0",
                     "--insecure"});
  const std::string line = worker.ReadLine(std::chrono::seconds(30));
  ASSERT_NE(line.find("ready on "), std::string::npos) << line;
  auto stub = moe::v1::WorkerService::NewStub(
      grpc::CreateChannel(line.substr(line.find("ready on ") + 9), grpc::InsecureChannelCredentials()));
  auto server = *ExpertClient::Connect(server_addr_, testing::PlaintextTls());

  struct Case {
    std::string what;
    int T;            // tokens
    uint32_t layer;
    std::function<void(Batch&)> spoil;  // applied to a valid batch of T tokens, k = 2
    int dtype = -1;   // >= 0: the tokens' dtype field on the wire
    grpc::StatusCode code;
    std::string worker_field, server_field;
  };
  const std::vector<Case> cases = {
      {"no tokens", 0, 1, nullptr, -1, grpc::StatusCode::INVALID_ARGUMENT, "batches[0].hidden", "tokens"},
      {"too many tokens", 8193, 1, nullptr, -1, grpc::StatusCode::OUT_OF_RANGE, "batches[0].hidden", "tokens"},
      {"expert out of range", 3, 1, [](Batch& b) { b.ids[3] = 8; }, -1, grpc::StatusCode::INVALID_ARGUMENT,
       "batches[0].topk_ids[1,1]", "expert_ids[1,1]"},
      {"repeated expert", 3, 1, [](Batch& b) { b.ids[5] = b.ids[4]; }, -1, grpc::StatusCode::INVALID_ARGUMENT,
       "batches[0].topk_ids[2,1]", "expert_ids[2,1]"},
      {"NaN weight", 3, 1, [](Batch& b) { b.w[2] = std::nanf(""); }, -1, grpc::StatusCode::INVALID_ARGUMENT,
       "batches[0].topk_weights[1,0]", "expert_weights[1,0]"},
      {"layer 2^32-1", 3, 0xffffffffu, nullptr, -1, grpc::StatusCode::INVALID_ARGUMENT, "layer: 4294967295",
       "layer: 4294967295"},
      {"unknown dtype", 3, 1, nullptr, 77, grpc::StatusCode::INVALID_ARGUMENT,
       "batches[0].hidden.dtype: expected BF16, got unknown value 77", "tokens.dtype: expected BF16, got unknown value 77"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // The server's limit is its default --max-tokens (8192); the worker's is 64.
    Batch b = RandomBatch(c.T == 8193 ? 65 : c.T, 2, 9);
    Batch sb = RandomBatch(c.T, 2, 9);
    if (c.spoil) {
      c.spoil(b);
      c.spoil(sb);
    }
    moe::v1::ForwardLayerRequest wreq;
    wreq.set_layer(c.layer);
    Encode(b, wreq.add_batches());
    moe::v1::ForwardRequest sreq = ExpertClient::MakeRequest(
        static_cast<int>(c.layer), sb.T, kH, sb.x.data(), RoutingView{sb.T, sb.k, sb.ids.data(), sb.w.data()});
    sreq.set_layer(c.layer);
    if (c.dtype >= 0) {
      wreq.mutable_batches(0)->mutable_hidden()->set_dtype(static_cast<moe::v1::DType>(c.dtype));
      sreq.mutable_tokens()->set_dtype(static_cast<moe::v1::DType>(c.dtype));
    }
    grpc::ClientContext ctx;
    moe::v1::ForwardLayerResponse wresp;
    const grpc::Status ws = stub->ForwardLayer(&ctx, wreq, &wresp);
    moe::v1::ForwardResponse sresp;
    const absl::Status ss = server->Call(sreq, &sresp);
    EXPECT_EQ(ws.error_code(), c.code) << "worker: " << ws.error_message();
    EXPECT_EQ(static_cast<int>(ss.code()), static_cast<int>(c.code)) << "server: " << ss;
    EXPECT_EQ(ws.error_message().rfind(c.worker_field, 0), 0u) << "worker: " << ws.error_message();
    EXPECT_EQ(std::string(ss.message()).rfind(c.server_field, 0), 0u) << "server: " << ss;
  }
  // Both keep serving.
  Batch ok = RandomBatch(4, 2, 10);
  moe::v1::ForwardLayerRequest wreq;
  wreq.set_layer(1);
  Encode(ok, wreq.add_batches());
  grpc::ClientContext ctx;
  moe::v1::ForwardLayerResponse wresp;
  ASSERT_TRUE(stub->ForwardLayer(&ctx, wreq, &wresp).ok());
  std::vector<bf16_t> out(ok.x.size());
  std::memcpy(out.data(), wresp.outputs(0).data().data(), out.size() * 2);
  EXPECT_LE(Error(1, ok, out.data()), 1e-2);
  EXPECT_TRUE(server->Forward(ExpertClient::MakeRequest(1, ok.T, kH, ok.x.data(),
                                                        RoutingView{ok.T, ok.k, ok.ids.data(), ok.w.data()}))
                  .ok());
}

}  // namespace
}  // namespace moe
