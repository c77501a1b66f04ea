// Multi-process tests of the real moe-expert-server binary on loopback: a
// generated `tiny` checkpoint, Forward and ForwardStream against the
// reference MoE, health and reflection, every bad input of the contract
// (the server keeps serving after each), refusal of a model that does not
// fit, and a clean drain on SIGTERM.
#include <signal.h>
#include <sys/wait.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/expert_client.h"
#include "transport/grpc_channel.h"
#include "transport/transport.h"
#include "expert_server/expert_service.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "transport/wire.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using testing::Subprocess;

class ExpertServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    ModelSpec spec = *PresetSpec("tiny");
    ASSERT_TRUE(WriteSyntheticCheckpoint(dir_->path(), spec, 7, 64 << 10).ok());
    source_ = OpenModel(dir_->path())->release();
    addr_ = new std::string(testing::StartExpertServer(
        &server_, {"--model=" + dir_->path(), "--threads=2", "--max-tokens=64"}));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete source_;
    delete addr_;
    delete dir_;
  }
  void SetUp() override {
    ASSERT_FALSE(addr_->empty()) << "moe-expert-server did not start";
    client_ = *ExpertClient::Connect(*addr_, testing::PlaintextTls());
  }

  struct Batch {
    int n, k;
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
    RoutingView routing() const { return RoutingView{n, k, ids.data(), w.data()}; }
  };
  Batch MakeBatch(int n, int k, uint64_t seed) {
    Batch b{n, k, RandomActivations(size_t(n) * 96, seed), {}, {}};
    RandomRouting(n, k, 8, seed + 100, 1.0, &b.ids, &b.w);
    return b;
  }
  double ErrorVsReference(int layer, const Batch& b, const std::vector<bf16_t>& out) {
    std::vector<double> ref(size_t(b.n) * 96);
    ReferenceMoe reference(*source_);
    EXPECT_TRUE(reference.Forward<double>(layer, b.n, b.x.data(), b.routing(), ref.data()).ok());
    std::vector<float> got(out.size());
    Bf16ToF32(out.data(), got.data(), got.size());
    return RelativeL2Error(got.data(), ref.data(), got.size());
  }
  moe::v1::ForwardRequest Request(int layer, const Batch& b) {
    return ExpertClient::MakeRequest(layer, b.n, 96, b.x.data(), b.routing(), 42);
  }
  // Sends `req`, expects `code` with `field` in the message, then proves the server still serves.
  void ExpectRejected(const moe::v1::ForwardRequest& req, absl::StatusCode code, const std::string& field) {
    moe::v1::ForwardResponse resp;
    absl::Status st = client_->Call(req, &resp);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(field), std::string::npos) << "message does not name " << field << ": " << st;
    Batch ok = MakeBatch(3, 2, 5);
    absl::StatusOr<std::vector<bf16_t>> out = client_->Forward(Request(1, ok));
    ASSERT_TRUE(out.ok()) << "server stopped serving after a bad request: " << out.status();
  }

  static testing::TempDir* dir_;
  static ModelSource* source_;
  static Subprocess* server_;
  static std::string* addr_;
  std::unique_ptr<ExpertClient> client_;
};

testing::TempDir* ExpertServerTest::dir_ = nullptr;
ModelSource* ExpertServerTest::source_ = nullptr;
Subprocess* ExpertServerTest::server_ = nullptr;
std::string* ExpertServerTest::addr_ = nullptr;

TEST_F(ExpertServerTest, GetInfoDescribesTheModelAndHost) {
  absl::StatusOr<moe::v1::ServerInfo> info = client_->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->model().hidden_size(), 96u);
  EXPECT_EQ(info->model().intermediate_size(), 80u);
  EXPECT_EQ(info->model().num_experts(), 8u);
  EXPECT_EQ(info->hosted_layers_size(), 2);
  EXPECT_EQ(info->hosted_experts_size(), 8);
  EXPECT_EQ(info->threads(), 2u);
  EXPECT_GT(info->weight_bytes(), 0u);
  EXPECT_FALSE(info->kernel().empty());
}

TEST_F(ExpertServerTest, UnaryForwardMatchesReference) {
  for (int n : {1, 5, 17, 64}) {
    Batch b = MakeBatch(n, 2, n);
    absl::StatusOr<std::vector<bf16_t>> out = client_->Forward(Request(2, b));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LE(ErrorVsReference(2, b, *out), 1e-2) << "n=" << n;
  }
}

TEST_F(ExpertServerTest, StreamForwardMatchesReferenceAndKeepsGoingAfterErrors) {
  auto stream = client_->OpenStream();
  std::vector<Batch> batches;
  for (int i = 0; i < 6; ++i) batches.push_back(MakeBatch(3 + 5 * i, 2, 200 + i));
  for (int i = 0; i < 6; ++i) {
    moe::v1::ForwardRequest req = Request(1 + i % 2, batches[i]);
    req.set_request_id(1000 + i);
    if (i == 3) req.set_layer(0);  // a dense layer: rejected in-stream, stream continues
    ASSERT_TRUE(stream->Write(req));
  }
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<moe::v1::ForwardStreamResponse> r = stream->Read();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->request_id(), 1000u + i);
    if (i == 3) {
      EXPECT_EQ(r->status_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_NE(r->status_message().find("layer"), std::string::npos);
      continue;
    }
    ASSERT_EQ(r->status_code(), 0) << r->status_message();
    absl::StatusOr<std::vector<bf16_t>> out = OutputAsBf16(r->response());
    ASSERT_TRUE(out.ok());
    EXPECT_LE(ErrorVsReference(1 + i % 2, batches[i], *out), 1e-2);
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// A client's stripe whose siblings never come (a hostile or broken client)
// is computed alone after the server's wait for them, and answered right.
TEST_F(ExpertServerTest, LoneStripeIsAnsweredAfterTheWaitForItsSiblings) {
  auto stream = client_->OpenStream();
  Batch b = MakeBatch(6, 2, 77);
  moe::v1::ForwardRequest req = Request(1, b);
  req.set_request_id(5);
  req.set_stripe_group(0x1234);
  req.set_stripe_count(3);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(stream->Write(req));
  absl::StatusOr<moe::v1::ForwardStreamResponse> r = stream->Read();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code(), 0) << r->status_message();
  absl::StatusOr<std::vector<bf16_t>> out = OutputAsBf16(r->response());
  ASSERT_TRUE(out.ok());
  EXPECT_LE(ErrorVsReference(1, b, *out), 1e-2);
  EXPECT_LT(ms, 2000) << "the wait for missing stripes is bounded (10 ms)";
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ExpertServerTest, F32OutputAndConcurrentClients) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    threads.emplace_back([&, c] {
      auto client = *ExpertClient::Connect(*addr_, testing::PlaintextTls());
      for (int i = 0; i < 10; ++i) {
        Batch b = MakeBatch(4 + c, 2, 300 + 10 * c + i);
        moe::v1::ForwardRequest req = Request(1, b);
        req.set_output_dtype(moe::v1::DTYPE_F32);
        moe::v1::ForwardResponse resp;
        if (!client->Call(req, &resp).ok() || resp.output().dtype() != moe::v1::DTYPE_F32) {
          ++failures;
          continue;
        }
        absl::StatusOr<std::vector<bf16_t>> out = OutputAsBf16(resp);
        if (!out.ok() || ErrorVsReference(1, b, *out) > 1e-2) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(ExpertServerTest, BadInputsAreRejectedByField) {
  using C = absl::StatusCode;
  Batch b = MakeBatch(4, 2, 9);
  moe::v1::ForwardRequest req;

  req = Request(1, b);  // wrong byte size
  req.mutable_tokens()->mutable_data()->resize(10);
  ExpectRejected(req, C::kInvalidArgument, "tokens.data");

  req = Request(1, b);  // dtype mismatch
  req.mutable_tokens()->set_dtype(moe::v1::DTYPE_F32);
  ExpectRejected(req, C::kInvalidArgument, "tokens.dtype");

  req = Request(1, b);  // shape mismatch: wrong hidden size
  req.mutable_tokens()->set_shape(1, 95);
  ExpectRejected(req, C::kInvalidArgument, "tokens.shape");

  req = Request(1, b);  // routing rows do not match tokens
  req.mutable_expert_ids()->set_shape(0, 3);
  ExpectRejected(req, C::kInvalidArgument, "expert_ids.shape");

  req = Request(1, b);  // weights of the wrong dtype
  req.mutable_expert_weights()->set_dtype(moe::v1::DTYPE_BF16);
  ExpectRejected(req, C::kInvalidArgument, "expert_weights.dtype");

  req = Request(9, b);  // unknown layer
  ExpectRejected(req, C::kInvalidArgument, "layer");
  req = Request(0, b);  // dense layer
  ExpectRejected(req, C::kInvalidArgument, "layer");

  Batch bad = b;  // unknown expert
  bad.ids[3] = 8;
  ExpectRejected(Request(1, bad), C::kInvalidArgument, "expert_ids[1,1]");
  bad = b;
  bad.ids[3] = -7;
  ExpectRejected(Request(1, bad), C::kInvalidArgument, "expert_ids[1,1]");

  bad = b;  // duplicate expert for a token
  bad.ids[5] = bad.ids[4];
  ExpectRejected(Request(1, bad), C::kInvalidArgument, "expert_ids[2,1]");

  bad = b;  // NaN and Inf weights
  bad.w[2] = NAN;
  ExpectRejected(Request(1, bad), C::kInvalidArgument, "expert_weights[1,0]");
  bad = b;
  bad.w[7] = -INFINITY;
  ExpectRejected(Request(1, bad), C::kInvalidArgument, "expert_weights[3,1]");

  Batch empty{0, 2, {}, {}, {}};  // empty batch
  ExpectRejected(Request(1, empty), C::kInvalidArgument, "tokens");

  req = Request(1, b);  // no routing at all
  req.clear_expert_ids();
  ExpectRejected(req, C::kInvalidArgument, "expert_ids");

  req = Request(1, b);
  req.set_output_dtype(moe::v1::DTYPE_I32);
  ExpectRejected(req, C::kInvalidArgument, "output_dtype");

  req = Request(1, b);  // more stripes than a batch may have
  req.set_stripe_group(7);
  req.set_stripe_count(65);
  ExpectRejected(req, C::kInvalidArgument, "stripe_count");
  Batch stripe = MakeBatch(30, 2, 11);  // 3 stripes of 30 > 64 tokens for the batch
  req = Request(1, stripe);
  req.set_stripe_group(8);
  req.set_stripe_count(3);
  ExpectRejected(req, C::kOutOfRange, "tokens");

  Batch big = MakeBatch(65, 2, 10);  // oversize: the server runs with --max-tokens=64
  ExpectRejected(Request(1, big), C::kOutOfRange, "tokens");

  // Larger than any message the server accepts: gRPC itself refuses it.
  req = Request(1, b);
  req.mutable_tokens()->mutable_data()->resize(64 << 20);
  moe::v1::ForwardResponse resp;
  absl::Status st = client_->Call(req, &resp);
  EXPECT_EQ(st.code(), C::kResourceExhausted) << st;
}

// One raw call through a generic stub on a completion queue: writes `request`
// (already serialized), half-closes, reads one message. Returns its bytes.
std::string RawCall(const std::string& addr, const std::string& method, const std::string& request,
                    grpc::Status* status) {
  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  void* tag;
  bool ok;
  auto step = [&](intptr_t want) { return cq.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) == want && ok; };
  call->StartCall(reinterpret_cast<void*>(1));
  std::string bytes;
  if (step(1)) {
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1), resp;
    call->Write(req, reinterpret_cast<void*>(2));
    if (step(2)) {
      call->WritesDone(reinterpret_cast<void*>(3));
      if (step(3)) {
        call->Read(&resp, reinterpret_cast<void*>(4));
        if (step(4)) {
          std::vector<grpc::Slice> slices;
          (void)resp.Dump(&slices);
          for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
    }
  }
  ctx.TryCancel();
  call->Finish(status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) != 5) {}
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {}
  return bytes;
}

TEST_F(ExpertServerTest, HealthAndReflectionAreServed) {
  grpc::Status st;
  // grpc.health.v1.HealthCheckRequest{service=""} is empty on the wire;
  // the answer HealthCheckResponse{status=SERVING} is field 1 = 1.
  EXPECT_EQ(RawCall(*addr_, "/grpc.health.v1.Health/Check", "", &st), std::string("\x08\x01", 2));
  // grpc.reflection.v1alpha.ServerReflectionRequest{list_services=""} (field 7):
  // the answer lists our service.
  const std::string listed =
      RawCall(*addr_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", std::string("\x3a\x00", 2), &st);
  EXPECT_NE(listed.find("moe.v1.ExpertService"), std::string::npos) << listed.size() << " bytes";
  EXPECT_NE(listed.find("grpc.health.v1.Health"), std::string::npos);
}

TEST(ExpertServerProcess, RefusesAModelThatDoesNotFit) {
  Subprocess* server = nullptr;
  const std::string addr = testing::StartExpertServer(&server, {"--model=synthetic:deepseek-v3", "--threads=1"});
  std::unique_ptr<Subprocess> owner(server);
  EXPECT_TRUE(addr.empty());
  const int st = server->Wait(std::chrono::seconds(60));
  ASSERT_TRUE(WIFEXITED(st)) << st;
  EXPECT_NE(WEXITSTATUS(st), 0);
}

TEST(ExpertServerProcess, BadFlagsExitWithOneLine) {
  Subprocess server(testing::BinaryPath("moe-expert-server"), {"--model=synthetic:tiny", "--kernel=sse9", "--insecure"});
  const int st = server.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 2);
  Subprocess help(testing::BinaryPath("moe-expert-server"), {"--help"});
  const std::string text = help.ReadAll(std::chrono::seconds(10));
  for (const char* flag : {"--model", "--listen", "--layers", "--experts", "--threads", "--numa-node", "--kernel"})
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  EXPECT_EQ(WEXITSTATUS(help.Wait(std::chrono::seconds(10))), 0);
}

TEST(ExpertServerProcess, HostsASubsetAndDrainsOnSigterm) {
  Subprocess* server = nullptr;
  const std::string addr = testing::StartExpertServer(
      &server, {"--model=synthetic:tiny:seed=3", "--threads=1", "--layers=2", "--experts=0-3,6"});
  std::unique_ptr<Subprocess> owner(server);
  ASSERT_FALSE(addr.empty());
  auto client = *ExpertClient::Connect(addr, testing::PlaintextTls());
  absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(std::vector<uint32_t>(info->hosted_layers().begin(), info->hosted_layers().end()),
            std::vector<uint32_t>({2}));
  EXPECT_EQ(std::vector<uint32_t>(info->hosted_experts().begin(), info->hosted_experts().end()),
            std::vector<uint32_t>({0, 1, 2, 3, 6}));
  std::vector<int32_t> ids = {0, 6, 1, 5};
  std::vector<float> w = {0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<bf16_t> x = RandomActivations(2 * 96, 1);
  moe::v1::ForwardResponse resp;
  absl::Status st = client->Call(ExpertClient::MakeRequest(2, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}), &resp);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not hosted"), std::string::npos) << st;
  ids[3] = 3;
  EXPECT_TRUE(client->Call(ExpertClient::MakeRequest(1, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}), &resp).code() ==
              absl::StatusCode::kInvalidArgument);  // layer 1 not hosted
  ASSERT_TRUE(client->Call(ExpertClient::MakeRequest(2, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}), &resp).ok());

  // SIGTERM while a stream of requests is in flight: the request being
  // computed completes; every other request written on the stream — queued
  // behind it, or sent after the signal — gets its own answer, UNAVAILABLE
  // "server is draining" (issue 25: never CANCELLED, never no answer), so the
  // client knows to go elsewhere; the process exits 0 well before the drain
  // deadline.
  auto stream = client->OpenStream();
  for (int i = 0; i < 20; ++i) stream->Write(ExpertClient::MakeRequest(2, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}, i));
  server->Signal(SIGTERM);
  for (int i = 20; i < 25; ++i) stream->Write(ExpertClient::MakeRequest(2, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}, i));
  int answered = 0, computed = 0;
  std::set<uint64_t> ids_seen;
  for (;;) {
    absl::StatusOr<moe::v1::ForwardStreamResponse> r = stream->Read();
    if (!r.ok()) break;
    ids_seen.insert(r->request_id());
    if (r->status_code() == 0) {
      EXPECT_EQ(r->response().output().data().size(), 2u * 96 * 2);
      ++computed;
    } else {
      EXPECT_EQ(r->status_code(), static_cast<int>(absl::StatusCode::kUnavailable)) << r->status_message();
      EXPECT_NE(r->status_message().find("draining"), std::string::npos) << r->status_message();
    }
    ++answered;
  }
  EXPECT_EQ(ids_seen.size(), static_cast<size_t>(answered));
  RecordProperty("computed_before_drain", computed);
  absl::Status end = stream->Finish();
  if (answered < 25) {  // a stream the server had not started yet is refused whole: its status says why
    EXPECT_EQ(end.code(), absl::StatusCode::kUnavailable) << end << " after " << answered << " answers";
    EXPECT_NE(end.message().find("draining"), std::string::npos) << end;
  } else {
    EXPECT_TRUE(end.ok() || end.code() == absl::StatusCode::kUnavailable) << end;  // never CANCELLED
  }
  stream.reset();
  const int status = server->Wait(std::chrono::seconds(20));
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  RecordProperty("answered_before_drain", answered);
}


// Issue 47: SIGTERM while nine streams keep sending. Every request a stream
// gets an answer to is computed or UNAVAILABLE "server is draining"; every
// stream ends OK or UNAVAILABLE "server is draining" (requests it sent and
// got no answer to were never read: the status covers them), never
// CANCELLED (4 of 9 streams were, with 63 requests unanswered).
TEST(ExpertServerProcess, SigtermEndsEveryBusyStreamUnavailableNeverCancelled) {
  Subprocess* server = nullptr;
  const std::string addr = testing::StartExpertServer(&server, {"--model=synthetic:tiny:seed=3", "--threads=1"});
  std::unique_ptr<Subprocess> owner(server);
  ASSERT_FALSE(addr.empty());
  std::vector<int32_t> ids = {1, 6, 2, 5};
  std::vector<float> w = {0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<bf16_t> x = RandomActivations(2 * 96, 4);
  constexpr int kStreams = 9;
  std::vector<std::unique_ptr<ExpertClient>> clients;
  std::vector<std::unique_ptr<ExpertClient::StreamSession>> streams;
  for (int i = 0; i < kStreams; ++i) {
    clients.push_back(*ExpertClient::Connect(addr, testing::PlaintextTls()));
    streams.push_back(clients.back()->OpenStream());
  }
  std::atomic<bool> stop_writing{false};
  std::vector<int> written(kStreams, 0), answered(kStreams, 0), draining(kStreams, 0), wrong(kStreams, 0);
  std::vector<absl::Status> ends(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {  // writer
      for (uint64_t id = 1; !stop_writing.load(); ++id) {
        if (!streams[i]->Write(ExpertClient::MakeRequest(2, 2, 96, x.data(), RoutingView{2, 2, ids.data(), w.data()}, id)))
          break;
        ++written[i];
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
    });
    threads.emplace_back([&, i] {  // reader
      for (;;) {
        absl::StatusOr<moe::v1::ForwardStreamResponse> r = streams[i]->Read();
        if (!r.ok()) break;
        ++answered[i];
        if (r->status_code() == 0) continue;
        const bool is_draining = r->status_code() == static_cast<int>(absl::StatusCode::kUnavailable) &&
                                 r->status_message().find("draining") != std::string::npos;
        ++(is_draining ? draining[i] : wrong[i]);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  server->Signal(SIGTERM);
  const int status = server->Wait(std::chrono::seconds(20));
  stop_writing = true;
  for (std::thread& t : threads) t.join();
  int cancelled = 0, unanswered = 0;
  for (int i = 0; i < kStreams; ++i) {
    ends[i] = streams[i]->Finish();
    SCOPED_TRACE(absl::StrCat("stream ", i, ": ", ends[i].ToString()));
    EXPECT_GT(answered[i], 0);
    EXPECT_EQ(wrong[i], 0);
    EXPECT_TRUE(ends[i].ok() || (ends[i].code() == absl::StatusCode::kUnavailable &&
                                 ends[i].message().find("draining") != std::string::npos));
    cancelled += ends[i].code() == absl::StatusCode::kCancelled;
    unanswered += written[i] - answered[i];
  }
  std::printf("sigterm: %d streams, %d cancelled, %d requests left to the stream's status\n", kStreams, cancelled,
              unanswered);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Issue 47: idle ForwardStreams hold no thread of the server (3,000 from one
// client cost 3,013 threads when each stream had one).
TEST(ExpertServerProcess, IdleStreamsHoldNoThreads) {
  Subprocess* server = nullptr;
  const std::string addr = testing::StartExpertServer(&server, {"--model=synthetic:tiny:seed=3", "--threads=1"});
  std::unique_ptr<Subprocess> owner(server);
  ASSERT_FALSE(addr.empty());
  auto threads_of = [](pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
    return -1;
  };
  std::vector<std::unique_ptr<ExpertClient>> clients;
  std::vector<std::unique_ptr<ExpertClient::StreamSession>> streams;
  for (int c = 0; c < 4; ++c) clients.push_back(*ExpertClient::Connect(addr, testing::PlaintextTls()));
  // One request answered on the first stream: the server's threads are up.
  streams.push_back(clients[0]->OpenStream());
  std::vector<int32_t> ids = {1, 6};
  std::vector<float> w = {0.5f, 0.5f};
  std::vector<bf16_t> x = RandomActivations(96, 5);
  ASSERT_TRUE(streams[0]->Write(ExpertClient::MakeRequest(2, 1, 96, x.data(), RoutingView{1, 2, ids.data(), w.data()}, 1)));
  ASSERT_TRUE(streams[0]->Read().ok());
  const int before = threads_of(server->pid());
  ASSERT_GT(before, 0);
  constexpr int kIdle = 1000;
  for (int i = 1; i < kIdle; ++i) streams.push_back(clients[i % clients.size()]->OpenStream());
  // Every stream answers (each was started by the server), then sits idle.
  for (int i = 0; i < kIdle; i += 97) {
    ASSERT_TRUE(streams[i]->Write(ExpertClient::MakeRequest(2, 1, 96, x.data(), RoutingView{1, 2, ids.data(), w.data()}, 2)));
    ASSERT_TRUE(streams[i]->Read().ok()) << "stream " << i;
  }
  const int after = threads_of(server->pid());
  std::printf("idle streams: %d open, server threads %d -> %d\n", kIdle, before, after);
  EXPECT_LE(after - before, 16) << "threads grew with idle streams";
  for (auto& st : streams) (void)st->Finish();
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Small stream requests are computed on gRPC's own callback threads, but
// never more than InlineRequestLimit() at once: the rest go to the stream
// workers and every stream is served while those threads are held (a limit
// as large as gRPC's callback threads would leave no thread to read the other
// streams, and this test would hang to its deadline instead).
TEST(ExpertServiceThreads, SmallRequestsOnGrpcThreadsAreBounded) {
  ModelSpec spec;
  spec.num_layers = 2;
  spec.num_experts = 8;
  spec.hidden = 64;
  const int limit = ExpertServiceImpl::InlineRequestLimit();
  const int requests = limit + 6;  // more than gRPC's threads may hold, fewer than the 16 workers
  std::mutex mu;
  std::condition_variable cv;
  int running = 0, on_grpc = 0, most_on_grpc = 0;
  bool release = false;
  BatchHandler handler = [&](const MoeBatch& b, DType, void* out, ForwardStats*) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    const bool worker = std::string(name) == "moe-stream";
    std::unique_lock<std::mutex> lock(mu);
    ++running;
    if (!worker) most_on_grpc = std::max(most_on_grpc, ++on_grpc);
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
    if (!worker) --on_grpc;
    std::memset(out, 0, size_t(b.n) * 64 * sizeof(bf16_t));
    return absl::OkStatus();
  };
  ExpertServiceImpl service(spec, handler, ServiceLimits(), moe::v1::ServerInfo());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  ConfigureServerBuilder(builder, 16 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  TransportOptions o;
  o.hidden = 64;
  o.tls.insecure = true;
  o.grpc_streams = requests;  // a stream each: a stream computes one request at a time
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectGrpcTransport(absl::StrCat("127.0.0.1:", port), o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<bf16_t> x(64, bf16_t{});
  std::vector<int32_t> ids = {1};
  std::vector<float> w = {1.0f};
  std::vector<std::vector<bf16_t>> outs(requests, std::vector<bf16_t>(64));
  std::vector<std::future<absl::Status>> done;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (int i = 0; i < requests; ++i)
    done.push_back((*t)->Submit(MoeBatch{1, 1, x.data(), RoutingView{1, 1, ids.data(), w.data()}}, outs[i].data(),
                                deadline));
  {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return running == requests; }))
        << running << " of " << requests << " requests started while " << on_grpc << " held gRPC's threads";
    EXPECT_GE(most_on_grpc, 1) << "no small request was computed where gRPC delivered it";
    EXPECT_LE(most_on_grpc, limit);
    release = true;
  }
  cv.notify_all();
  for (auto& f : done) EXPECT_TRUE(f.get().ok());
  t->reset();
  server->Shutdown();
}

}  // namespace
}  // namespace moe
