// ExpertTransport over real processes: the moe-expert-server binary with a
// gRPC port and a shared-memory socket; the same random batches through shm,
// gRPC stream and gRPC unary must agree with each other and with the reference
// MoE; concurrency, batches split over slots, server faults (kill -9, stop
// answering, restart), peer-uid refusal, and an mTLS channel with certificates
// generated here.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/atomic_max.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "transport/shm_segment.h"
#include "transport/shm_server.h"
#include "transport/transport.h"
#include "transport/unix_socket.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using testing::Subprocess;
constexpr int kH = 96;
const char kModel[] = "synthetic:tiny:seed=5";

struct Batch {
  int n, k;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  MoeBatch view(int layer = 1) const {
    return MoeBatch{layer, n, x.data(), RoutingView{n, k, ids.data(), w.data()}};
  }
};

Batch MakeBatch(int n, int k, uint64_t seed) {
  Batch b{n, k, RandomActivations(size_t(n) * kH, seed), {}, {}};
  RandomRouting(n, k, 8, seed + 1, 1.0, &b.ids, &b.w);
  return b;
}

TransportOptions Options() {
  TransportOptions o;
  o.hidden = kH;
  o.max_tokens_per_slot = 16;
  o.max_pairs_per_token = 4;
  o.slots = 8;
  o.tls.insecure = true;
  return o;
}

Clock::time_point In(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

class TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = dir_.path() + "/expert.sock";
    Subprocess* s = nullptr;
    addr_ = testing::StartExpertServer(&s, {std::string("--model=") + kModel, "--threads=2", "--shm-socket=" + socket_});
    server_.reset(s);
    ASSERT_FALSE(addr_.empty());
  }
  std::unique_ptr<ExpertTransport> Connect(const std::string& which, TransportOptions o = Options()) {
    o.grpc_unary = which == "grpc-unary";
    o.grpc_streams = which == "grpc-3streams" ? 3 : 1;
    absl::StatusOr<std::unique_ptr<ExpertTransport>> t =
        ConnectTransport(which == "shm" ? "unix://" + socket_ : addr_, o);
    EXPECT_TRUE(t.ok()) << which << ": " << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  double ErrorVsReference(const Batch& b, const std::vector<bf16_t>& out) {
    std::unique_ptr<ModelSource> src = *OpenModel(kModel);
    ReferenceMoe ref(*src);
    std::vector<double> r(size_t(b.n) * kH);
    EXPECT_TRUE(ref.Forward<double>(1, b.n, b.x.data(), RoutingView{b.n, b.k, b.ids.data(), b.w.data()}, r.data()).ok());
    std::vector<float> got(out.size());
    Bf16ToF32(out.data(), got.data(), got.size());
    return RelativeL2Error(got.data(), r.data(), got.size());
  }

  testing::TempDir dir_;
  std::string socket_, addr_;
  std::unique_ptr<Subprocess> server_;
};

TEST_F(TransportTest, AllTransportsAgreeWithEachOtherAndTheReference) {
  std::vector<std::string> kinds = {"shm", "grpc-stream", "grpc-unary"};
  std::vector<std::unique_ptr<ExpertTransport>> ts;
  for (const auto& k : kinds) {
    ts.push_back(Connect(k));
    ASSERT_NE(ts.back(), nullptr);
    EXPECT_EQ(std::string(ts.back()->kind()), k);
  }
  // 40 tokens > 16 per slot: the shm transport splits it over 3 slots.
  for (int n : {1, 7, 16, 40}) {
    Batch b = MakeBatch(n, 2, 100 + n);
    std::vector<std::vector<bf16_t>> outs;
    for (auto& t : ts) {
      std::vector<bf16_t> out(size_t(n) * kH, 0xffff);
      absl::Status st = t->Submit(b.view(), out.data(), In(10000)).get();
      ASSERT_TRUE(st.ok()) << t->kind() << " n=" << n << ": " << st;
      outs.push_back(out);
    }
    EXPECT_EQ(outs[0], outs[1]) << "shm vs grpc-stream, n=" << n;
    EXPECT_EQ(outs[0], outs[2]) << "shm vs grpc-unary, n=" << n;
    EXPECT_LE(ErrorVsReference(b, outs[0]), 1e-2) << "n=" << n;
  }
}

// The zero-copy path: inputs written straight into transport memory (for shm,
// the shared segment itself) and the output read from there.
TEST_F(TransportTest, StagedBatchesAreZeroCopyAndMatchSubmit) {
  for (const char* kind : {"shm", "grpc-stream", "grpc-3streams"}) {
    auto t = Connect(kind);
    ASSERT_NE(t, nullptr);
    Batch b = MakeBatch(10, 2, 55);
    std::vector<bf16_t> expect(size_t(b.n) * kH);
    ASSERT_TRUE(t->Submit(b.view(), expect.data(), In(5000)).get().ok());
    for (int round = 0; round < 20; ++round) {  // more rounds than slots: Release returns them
      absl::StatusOr<StagingArea> s = t->Stage(b.n, b.k, In(5000));
      ASSERT_TRUE(s.ok()) << kind << ": " << s.status();
      std::memcpy(s->tokens, b.x.data(), b.x.size() * 2);
      std::memcpy(s->expert_ids, b.ids.data(), b.ids.size() * 4);
      std::memcpy(s->expert_weights, b.w.data(), b.w.size() * 4);
      if (std::string(kind) == "shm") {
        auto [base, bytes] = t->HostMapping();
        auto* lo = static_cast<const char*>(base);
        EXPECT_TRUE(reinterpret_cast<const char*>(s->tokens) >= lo &&
                    reinterpret_cast<const char*>(s->output) < lo + bytes) << "staged memory is not the segment";
      }
      ASSERT_TRUE(t->SubmitStaged(*s, 1, In(5000)).get().ok()) << kind;
      EXPECT_EQ(std::vector<bf16_t>(s->output, s->output + expect.size()), expect) << kind;
      t->Release(*s);
    }
  }
  auto shm = Connect("shm");
  EXPECT_EQ(shm->Stage(17, 2, In(1000)).status().code(), absl::StatusCode::kInvalidArgument);  // > one slot
}

// A batch of 48 KB or more per stream is striped over the streams (one
// request each, sent at once, answered into its rows of the output): 900
// tokens of 208 bytes over 3 streams are 3 requests (requests_sent) and give
// the bytes of one stream and the reference's result; a small batch in flight
// beside it goes whole and is unaffected.
TEST_F(TransportTest, LargeBatchStripedOverStreamsMatchesOneStream) {
  auto one = Connect("grpc-stream"), three = Connect("grpc-3streams");
  ASSERT_NE(one, nullptr);
  ASSERT_NE(three, nullptr);
  Batch big = MakeBatch(900, 2, 77), small = MakeBatch(3, 2, 78);
  std::vector<bf16_t> expect(size_t(big.n) * kH), got(expect.size(), F32ToBf16(7.0f));
  std::vector<bf16_t> small_expect(size_t(small.n) * kH), small_got(small_expect.size());
  ASSERT_TRUE(one->Submit(big.view(), expect.data(), In(10000)).get().ok());
  ASSERT_TRUE(one->Submit(small.view(), small_expect.data(), In(10000)).get().ok());
  EXPECT_EQ(one->requests_sent(), 2u) << "one stream: each batch whole";
  for (int round = 0; round < 3; ++round) {
    const uint64_t before = three->requests_sent();
    auto f = three->Submit(big.view(), got.data(), In(10000));
    EXPECT_EQ(three->requests_sent() - before, 3u) << "the large batch striped over the three streams";
    auto g = three->Submit(small.view(), small_got.data(), In(10000));
    EXPECT_EQ(three->requests_sent() - before, 4u) << "the small batch whole";
    ASSERT_TRUE(f.get().ok());
    ASSERT_TRUE(g.get().ok());
    EXPECT_EQ(got, expect) << "round " << round;
    EXPECT_EQ(small_got, small_expect);
  }
  EXPECT_LT(ErrorVsReference(big, got), 1e-2);
  // An empty batch is still one request, refused by the server (no stripes, no broken future).
  Batch none = MakeBatch(0, 2, 79);
  EXPECT_EQ(three->Submit(none.view(), got.data(), In(5000)).get().code(), absl::StatusCode::kInvalidArgument);
}

// Established TCP connections of this network namespace to `port` (either end).
int ConnectionsTo(int port) {
  int count = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state;
      f >> sl >> local >> remote >> state;
      const auto port_of = [](const std::string& a) { return std::stoi(a.substr(a.rfind(':') + 1), nullptr, 16); };
      if (state == "01" && port_of(remote) == port) ++count;
    }
  }
  return count;
}

TEST_F(TransportTest, EachStreamHasAConnectionOfItsOwn) {
  const int port = std::stoi(addr_.substr(addr_.rfind(':') + 1));
  const int before = ConnectionsTo(port);
  auto t = Connect("grpc-3streams");
  ASSERT_NE(t, nullptr);
  Batch b = MakeBatch(4, 2, 9);
  std::vector<bf16_t> out(size_t(b.n) * kH);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(t->Submit(b.view(), out.data(), In(5000)).get().ok());
  // Three streams, three connections (gRPC would otherwise put them all on one).
  EXPECT_EQ(ConnectionsTo(port) - before, 3);
}

TEST_F(TransportTest, ServerErrorsAndOversizeBatchesComeBackAsStatus) {
  for (const char* kind : {"shm", "grpc-stream", "grpc-unary"}) {
    auto t = Connect(kind);
    ASSERT_NE(t, nullptr);
    Batch b = MakeBatch(3, 2, 7);
    std::vector<bf16_t> out(3 * kH);
    absl::Status st = t->Submit(b.view(/*layer=*/0), out.data(), In(5000)).get();  // dense layer
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << kind << ": " << st;
    EXPECT_NE(st.message().find("layer"), std::string::npos) << st;
    b.ids[1] = b.ids[0];  // duplicate expert
    st = t->Submit(b.view(), out.data(), In(5000)).get();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << kind << ": " << st;
    // and the transport still works
    b = MakeBatch(3, 2, 8);
    EXPECT_TRUE(t->Submit(b.view(), out.data(), In(5000)).get().ok()) << kind;
  }
  auto shm = Connect("shm");
  Batch big = MakeBatch(8 * 16 + 1, 2, 9);  // more than slots x tokens per slot
  std::vector<bf16_t> out(size_t(big.n) * kH);
  absl::Status st = shm->Submit(big.view(), out.data(), In(5000)).get();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

TEST_F(TransportTest, ManyBatchesInFlightFromSeveralThreads) {
  for (const char* kind : {"shm", "grpc-stream", "grpc-3streams", "grpc-unary"}) {
    auto t = Connect(kind);
    ASSERT_NE(t, nullptr);
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int th = 0; th < 4; ++th) {
      threads.emplace_back([&, th] {
        for (int round = 0; round < 5; ++round) {
          std::vector<Batch> batches;
          std::vector<std::vector<bf16_t>> outs;
          std::vector<std::future<absl::Status>> futs;
          for (int i = 0; i < 4; ++i) {  // 4 in flight per thread, 16 overall
            batches.push_back(MakeBatch(1 + (th * 7 + i * 3 + round) % 20, 2, 1000 * th + 10 * round + i));
            outs.emplace_back(size_t(batches.back().n) * kH);
          }
          for (int i = 0; i < 4; ++i) futs.push_back(t->Submit(batches[i].view(), outs[i].data(), In(20000)));
          for (int i = 0; i < 4; ++i) {
            if (!futs[i].get().ok() || ErrorVsReference(batches[i], outs[i]) > 1e-2) ++bad;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(bad.load(), 0) << kind;
  }
}

// A ForwardStream message that is no ForwardRequest (and so carries no id to
// answer) ends that stream with INVALID_ARGUMENT; the server and other
// streams go on.
TEST_F(TransportTest, GarbageOnTheStreamEndsThatStreamOnly) {
  auto healthy = Connect("grpc-stream");
  ASSERT_NE(healthy, nullptr);
  auto channel = grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto next = [&cq](void* want) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(tag, want);
    return ok;
  };
  auto call = stub.PrepareCall(&ctx, "/moe.v1.ExpertService/ForwardStream", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(next(reinterpret_cast<void*>(1)));
  const std::string junk("\x1a\xff\xff\xff\x0f\x01", 6);  // a tokens tensor longer than the message
  grpc::Slice slice(junk);
  call->Write(grpc::ByteBuffer(&slice, 1), reinterpret_cast<void*>(2));
  ASSERT_TRUE(next(reinterpret_cast<void*>(2)));
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(3));
  EXPECT_FALSE(next(reinterpret_cast<void*>(3))) << "no answer to bytes without a request id";
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  ASSERT_TRUE(next(reinterpret_cast<void*>(4)));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("ForwardRequest"), std::string::npos) << status.error_message();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  // The other stream is unaffected.
  Batch b = MakeBatch(5, 2, 77);
  std::vector<bf16_t> out(size_t(b.n) * kH);
  ASSERT_TRUE(healthy->Submit(b.view(), out.data(), In(10000)).get().ok());
  EXPECT_LT(ErrorVsReference(b, out), 1e-2);
}

// kill -9 with batches in flight: each completes with UNAVAILABLE (or
// DEADLINE_EXCEEDED) by its deadline; later batches fail fast; once a server
// is back on the same socket and port, the transports reconnect.
TEST_F(TransportTest, KilledServerFailsFastAndTransportsReconnect) {
  std::vector<std::unique_ptr<ExpertTransport>> ts;
  for (const char* kind : {"shm", "grpc-stream", "grpc-unary"}) ts.push_back(Connect(kind));
  Batch b = MakeBatch(40, 2, 3);
  std::vector<std::vector<bf16_t>> outs(30, std::vector<bf16_t>(size_t(b.n) * kH));
  std::vector<std::future<absl::Status>> futs;
  for (int i = 0; i < 30; ++i) futs.push_back(ts[i % 3]->Submit(b.view(), outs[i].data(), In(3000)));
  server_->Signal(SIGKILL);
  server_->Wait(std::chrono::seconds(10));
  const auto t0 = Clock::now();
  for (auto& f : futs) {
    ASSERT_EQ(f.wait_until(In(4000)), std::future_status::ready) << "a request hung past its deadline";
    absl::Status st = f.get();
    EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kUnavailable ||
                st.code() == absl::StatusCode::kDeadlineExceeded) << st;
  }
  for (auto& t : ts) {
    std::vector<bf16_t> out(size_t(b.n) * kH);
    absl::Status st = t->Submit(b.view(), out.data(), In(2000)).get();
    EXPECT_TRUE(st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded)
        << t->kind() << ": " << st;
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(7));

  Subprocess* s = nullptr;
  const std::string addr = testing::StartExpertServer(
      &s, {std::string("--model=") + kModel, "--threads=2", "--shm-socket=" + socket_}, addr_);
  server_.reset(s);
  ASSERT_EQ(addr, addr_);
  // Issue 25: every transport is back within 1.5 s of the server's start
  // (the gRPC channel's reconnect back-off is 100 ms growing to at most 1 s:
  // MakeChannelArguments).
  const auto back = Clock::now();
  for (auto& t : ts) {
    absl::Status st;
    std::vector<bf16_t> out(size_t(b.n) * kH);
    for (int attempt = 0; attempt < 50; ++attempt) {
      st = t->Submit(b.view(), out.data(), In(2000)).get();
      if (st.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(st.ok()) << t->kind() << " did not reconnect: " << st;
    EXPECT_LE(ErrorVsReference(b, out), 1e-2);
    const double s_back = std::chrono::duration<double>(Clock::now() - back).count();
    std::printf("%s reconnected %.3f s after the server's start\n", t->kind(), s_back);
    EXPECT_LE(s_back, 1.5) << t->kind();
  }
}

// True once every thread of `pid` is stopped (state 'T' in /proc): SIGSTOP is
// delivered asynchronously, and a spinning thread may still answer meanwhile.
bool AllThreadsStopped(pid_t pid) {
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'T') return false;
  }
  return !ec;
}

// A server that stops answering (SIGSTOP): requests end with DEADLINE_EXCEEDED at their deadline.
TEST_F(TransportTest, SilentServerHitsTheDeadline) {
  std::vector<std::unique_ptr<ExpertTransport>> ts;
  for (const char* kind : {"shm", "grpc-stream", "grpc-unary"}) ts.push_back(Connect(kind));
  server_->Signal(SIGSTOP);
  for (int i = 0; i < 500 && !AllThreadsStopped(server_->pid()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(AllThreadsStopped(server_->pid()));
  Batch b = MakeBatch(5, 2, 4);
  for (auto& t : ts) {
    std::vector<bf16_t> out(size_t(b.n) * kH);
    const auto t0 = Clock::now();
    auto f = t->Submit(b.view(), out.data(), In(300));
    ASSERT_EQ(f.wait_until(In(2000)), std::future_status::ready) << t->kind();
    EXPECT_EQ(f.get().code(), absl::StatusCode::kDeadlineExceeded) << t->kind();
    EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1500));
  }
  server_->Signal(SIGCONT);
}

// Probe (what a worker asks before sending batches to a server that missed a
// deadline): never blocks; UNAVAILABLE while the server is stopped, however
// often asked; OK once it runs again; a transport destroyed with a probe in
// flight neither hangs nor crashes.
TEST_F(TransportTest, ProbeAnswersOnlyOnceAStoppedServerRunsAgain) {
  std::unique_ptr<ExpertTransport> t = Connect("grpc-stream");
  std::unique_ptr<ExpertTransport> doomed = Connect("grpc-stream");
  server_->Signal(SIGSTOP);
  for (int i = 0; i < 500 && !AllThreadsStopped(server_->pid()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(AllThreadsStopped(server_->pid()));
  const std::chrono::milliseconds timeout(200);
  EXPECT_FALSE(doomed->Probe(timeout).ok());  // its GetInfo is now in flight, unanswered
  doomed.reset();
  for (int i = 0; i < 20; ++i) {  // 0.6 s: several probes time out unanswered
    const auto t0 = Clock::now();
    EXPECT_EQ(t->Probe(timeout).code(), absl::StatusCode::kUnavailable) << i;
    EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(150)) << "Probe blocked (its timeout is 200 ms)";
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  server_->Signal(SIGCONT);
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = t->Probe(timeout).ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(up) << "the running server never answered a probe";
  Batch b = MakeBatch(5, 2, 4);
  std::vector<bf16_t> out(size_t(b.n) * kH);
  auto f = t->Submit(b.view(), out.data(), In(2000));
  EXPECT_TRUE(f.get().ok());
}

int SegmentMappings(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += line.find("moe-expert-segment") != std::string::npos;
  return n;
}

// A caller that gives up on a staged batch the server still holds releases
// it (the slot stays the server's); if that server then dies, the client
// must still unmap the dead connection's segment: no segment is kept per
// server crash (the soak test saw worker RSS grow by one segment per kill).
TEST_F(TransportTest, ClientUnmapsADeadServersSegmentAfterAReleasedStagedBatch) {
  auto t = Connect("shm");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(SegmentMappings(getpid()), 1);
  server_->Signal(SIGSTOP);
  for (int i = 0; i < 500 && !AllThreadsStopped(server_->pid()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  Batch b = MakeBatch(4, 2, 8);
  absl::StatusOr<StagingArea> s = t->Stage(b.n, b.k, In(1000));
  ASSERT_TRUE(s.ok()) << s.status();
  std::memcpy(s->tokens, b.x.data(), b.x.size() * 2);
  std::memcpy(s->expert_ids, b.ids.data(), b.ids.size() * 4);
  std::memcpy(s->expert_weights, b.w.data(), b.w.size() * 4);
  EXPECT_EQ(t->SubmitStaged(*s, 1, In(200)).get().code(), absl::StatusCode::kDeadlineExceeded);
  t->Release(*s);  // the stopped server still owns the slot
  server_->Signal(SIGKILL);
  server_->Wait(std::chrono::seconds(10));
  // The client notices the death, then retires the connection on its next call.
  const auto end = Clock::now() + std::chrono::seconds(5);
  std::vector<bf16_t> out(size_t(b.n) * kH);
  while (SegmentMappings(getpid()) != 0 && Clock::now() < end) {
    EXPECT_FALSE(t->Submit(b.view(), out.data(), In(200)).get().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  EXPECT_EQ(SegmentMappings(getpid()), 0) << "the dead server's segment is still mapped";
}

TEST_F(TransportTest, ServerFreesTheSegmentOfAClientThatLeft) {
  EXPECT_EQ(SegmentMappings(server_->pid()), 0);
  {
    auto t = Connect("shm");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(SegmentMappings(server_->pid()), 1);
  }
  for (int i = 0; i < 100 && SegmentMappings(server_->pid()) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(SegmentMappings(server_->pid()), 0);
}

// In-process shm servers of the tests below: the tiny model's geometry at
// `path`, no idle spin.
ShmServer::Options TestServerOptions(const std::string& path) {
  ShmServer::Options so;
  so.socket_path = path;
  so.hidden = kH;
  so.num_layers = 4;
  so.num_experts = 8;
  so.idle_spin = std::chrono::microseconds(0);
  return so;
}

// Polling mode through a real ShmServer and ShmTransport: while the client's
// window is open the server's connection thread polls (it is not registered
// as a sleeper on the request doorbell); past the window, past the server's
// cap, or with polling off, it falls back to sleeping on the futex.
class ShmPollingTest : public ::testing::Test {
 protected:
  void StartServer(std::chrono::microseconds cap) {
    ShmServer::Options so = TestServerOptions(dir_.path() + "/poll.sock");
    so.max_client_poll = cap;
    so.on_poll = [this](Clock::time_point until) {  // the latest deadline the server kept its threads hot to
      AtomicMax(hot_until_ns_, static_cast<int64_t>(until.time_since_epoch().count()));
    };
    absl::StatusOr<std::unique_ptr<ShmServer>> srv = ShmServer::Start(so, [](const MoeBatch& b, bf16_t* out) {
      std::memcpy(out, b.tokens, size_t(b.n) * kH * sizeof(bf16_t));  // echo
      return absl::OkStatus();
    });
    ASSERT_TRUE(srv.ok()) << srv.status();
    server_ = *std::move(srv);
    absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + so.socket_path, Options());
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
    header_ = static_cast<shm::SegmentHeader*>(transport_->HostMapping().first);
    ASSERT_NE(header_, nullptr);
  }
  // One echo round trip; returns when its result is back.
  void RoundTrip() {
    const Batch b = MakeBatch(2, 2, 17);
    std::vector<bf16_t> out(b.x.size());
    std::future<absl::Status> f = transport_->Submit(b.view(), out.data(), In(5000));
    ASSERT_TRUE(AwaitResult(f).ok());
    EXPECT_EQ(std::memcmp(out.data(), b.x.data(), out.size() * sizeof(bf16_t)), 0);
  }
  bool ServerAsleep() const { return header_->request_sleepers.load() > 0; }
  // How long until the server thread sleeps on the doorbell (capped at `limit`).
  Clock::duration TimeUntilAsleep(Clock::time_point from, std::chrono::milliseconds limit) const {
    while (!ServerAsleep() && Clock::now() - from < limit) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return Clock::now() - from;
  }

  Clock::time_point HotUntil() const { return Clock::time_point(Clock::duration(hot_until_ns_.load())); }

  testing::TempDir dir_;
  std::unique_ptr<ShmServer> server_;
  std::unique_ptr<ExpertTransport> transport_;
  shm::SegmentHeader* header_ = nullptr;
  std::atomic<int64_t> hot_until_ns_{0};
};

TEST_F(ShmPollingTest, ServerPollsThroughTheWindowThenSleeps) {
  StartServer(std::chrono::seconds(5));
  // Off: the server sleeps right after answering (idle spin 0).
  RoundTrip();
  EXPECT_LT(TimeUntilAsleep(Clock::now(), std::chrono::milliseconds(2000)), std::chrono::milliseconds(1000));
  EXPECT_EQ(hot_until_ns_.load(), 0) << "no window, yet the server kept its compute threads hot";
  // On: still polling well inside the window...
  transport_->SetPolling(std::chrono::milliseconds(400));
  const Clock::time_point sent = Clock::now();
  RoundTrip();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(ServerAsleep()) << "the server slept inside the client's polling window";
  // ...and it asked for its compute threads hot through the window (on_poll).
  EXPECT_GE(HotUntil(), sent + std::chrono::milliseconds(300));
  EXPECT_LE(HotUntil(), Clock::now() + std::chrono::milliseconds(400));
  // ...and asleep once it closed (a clean fall back, not a spin forever).
  const Clock::duration asleep_after = TimeUntilAsleep(sent, std::chrono::milliseconds(5000));
  EXPECT_GE(asleep_after, std::chrono::milliseconds(300));
  EXPECT_LT(asleep_after, std::chrono::milliseconds(4000));
  // Off again: results still right, and the server sleeps at once.
  transport_->SetPolling(std::chrono::microseconds(0));
  RoundTrip();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_LT(TimeUntilAsleep(Clock::now(), std::chrono::milliseconds(2000)), std::chrono::milliseconds(1000));
}

TEST_F(ShmPollingTest, ServerCapsTheClientsWindow) {
  StartServer(std::chrono::milliseconds(50));
  transport_->SetPolling(std::chrono::seconds(60));  // asks for a minute of polling
  const Clock::time_point sent = Clock::now();
  RoundTrip();
  EXPECT_LT(TimeUntilAsleep(sent, std::chrono::milliseconds(10000)), std::chrono::milliseconds(5000));
  // Polling mode stays usable: many back-to-back batches all come back right.
  for (int i = 0; i < 200; ++i) RoundTrip();
}

// Several polling clients of one server: at most Options::max_polling of its
// connection threads poll at once; the others sleep on their doorbells (not
// a core each), and their clients' requests are still answered (the ring
// wakes them). With no limit every one of them polls.
TEST(ShmPollingBudget, AtMostMaxPollingConnectionsPollAtOnce) {
  testing::TempDir dir;
  for (const int max_polling : {1, 0}) {
    ShmServer::Options so = TestServerOptions(dir.path() + absl::StrCat("/budget", max_polling, ".sock"));
    so.max_client_poll = std::chrono::seconds(5);
    so.max_polling = max_polling;
    absl::StatusOr<std::unique_ptr<ShmServer>> srv = ShmServer::Start(so, [](const MoeBatch& b, bf16_t* out) {
      std::memcpy(out, b.tokens, size_t(b.n) * kH * sizeof(bf16_t));  // echo
      return absl::OkStatus();
    });
    ASSERT_TRUE(srv.ok()) << srv.status();
    constexpr int kClients = 3;
    std::vector<std::unique_ptr<ExpertTransport>> clients;
    auto round_trip = [](ExpertTransport& t, uint64_t seed) {
      const Batch b = MakeBatch(2, 2, seed);
      std::vector<bf16_t> out(b.x.size());
      std::future<absl::Status> f = t.Submit(b.view(), out.data(), In(5000));
      ASSERT_TRUE(AwaitResult(f).ok());
      EXPECT_EQ(std::memcmp(out.data(), b.x.data(), out.size() * sizeof(bf16_t)), 0);
    };
    for (int i = 0; i < kClients; ++i) {
      absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + so.socket_path, Options());
      ASSERT_TRUE(t.ok()) << t.status();
      clients.push_back(*std::move(t));
      clients.back()->SetPolling(std::chrono::milliseconds(2000));
    }
    auto asleep = [&] {
      int n = 0;
      for (auto& c : clients) n += static_cast<shm::SegmentHeader*>(c->HostMapping().first)->request_sleepers.load() > 0;
      return n;
    };
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < kClients; ++i) round_trip(*clients[i], 100 * round + i);
      // Inside every client's window: how many sleep, sampled for 200 ms (a
      // thread changes state for a moment when it wakes from a nap and tries
      // for the poll again): the count seen most often.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      int seen[kClients + 1] = {};
      for (int i = 0; i < 40; ++i, std::this_thread::sleep_for(std::chrono::milliseconds(5))) ++seen[asleep()];
      const int mode = static_cast<int>(std::max_element(seen, seen + kClients + 1) - seen);
      EXPECT_EQ(mode, max_polling == 0 ? 0 : kClients - max_polling)
          << "max_polling " << max_polling << ", round " << round;
    }
    clients.clear();
    srv->reset();
  }
}

// Device rings (what a GPU works, shm_segment.h): a request pushed on the
// device submit ring with no futex wake-up — as a GPU pushes it — is
// answered on the device complete ring, right after other requests (the
// server polls) and after a second of silence (it naps, never sleeps until
// a doorbell); the host's Stage/Submit never hand out the device's slots.
TEST_F(ShmPollingTest, DeviceRingRequestsNeedNoWakeUp) {
  ShmServer::Options so = TestServerOptions(dir_.path() + "/dev.sock");
  absl::StatusOr<std::unique_ptr<ShmServer>> srv = ShmServer::Start(so, [](const MoeBatch& b, bf16_t* out) {
    for (size_t i = 0; i < size_t(b.n) * kH; ++i) out[i] = F32ToBf16(2.f * Bf16ToF32(b.tokens[i]));
    return absl::OkStatus();
  });
  ASSERT_TRUE(srv.ok()) << srv.status();
  TransportOptions o = Options();
  o.device_slots = 2;
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + so.socket_path, o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::optional<ExpertTransport::DeviceRings> rings = (*t)->DeviceRingsOf();
  ASSERT_TRUE(rings.has_value());
  EXPECT_EQ(rings->first_slot, static_cast<uint32_t>(o.slots - 2));
  EXPECT_EQ(rings->slots, 2u);
  const shm::Segment& seg = rings->segment;
  const shm::SegmentGeometry& g = seg.geometry();
  seg.SetDevicePoll(std::chrono::milliseconds(2));
  auto* submit = reinterpret_cast<shm::RingHeader*>(seg.base() + g.device_submit_ring_offset);
  auto* complete = reinterpret_cast<shm::RingHeader*>(seg.base() + g.device_complete_ring_offset);
  auto* entries = reinterpret_cast<uint32_t*>(submit + 1);
  uint64_t index = 0;
  // Push one request as the GPU does (no RingRequest), wait for its answer.
  auto device_round_trip = [&]() -> Clock::duration {
    const uint32_t slot = rings->first_slot + static_cast<uint32_t>(index % rings->slots);
    const shm::RequestSlot v = seg.slot(slot);
    const Batch b = MakeBatch(3, 2, 40 + index);
    std::memcpy(v.tokens, b.x.data(), b.x.size() * sizeof(bf16_t));
    std::memcpy(v.ids, b.ids.data(), b.ids.size() * 4);
    std::memcpy(v.weights, b.w.data(), b.w.size() * 4);
    shm::WriteRequestHeader(v, index + 1, 1, 3, 2);
    const Clock::time_point t0 = Clock::now();
    __atomic_store_n(&entries[index % g.num_slots], slot, __ATOMIC_RELAXED);
    submit->tail.store(index + 1, std::memory_order_release);
    while (complete->tail.load(std::memory_order_acquire) <= index && Clock::now() - t0 < std::chrono::seconds(5))
      std::this_thread::yield();
    const Clock::duration took = Clock::now() - t0;
    EXPECT_GT(complete->tail.load(), index) << "request " << index << " not answered";
    EXPECT_EQ(v.header->status_code, 0);
    for (size_t i = 0; i < b.x.size(); ++i) EXPECT_EQ(v.output[i], F32ToBf16(2.f * Bf16ToF32(b.x[i])));
    complete->head.store(index + 1, std::memory_order_release);
    ++index;
    return took;
  };
  device_round_trip();  // the first one may find the server asleep on the futex (up to 50 ms)
  for (int i = 0; i < 20; ++i)
    EXPECT_LT(device_round_trip(), std::chrono::milliseconds(20)) << "inside the polling window";
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // past the poll and the short naps
  EXPECT_LT(device_round_trip(), std::chrono::milliseconds(30)) << "after a second of silence";
  // The host's staging never lands in the device's slots.
  const uint8_t* device_lo = reinterpret_cast<const uint8_t*>(seg.slot(rings->first_slot).header);
  for (int i = 0; i < 3 * o.slots; ++i) {
    absl::StatusOr<StagingArea> st = (*t)->Stage(1, 1, In(1000));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_LT(reinterpret_cast<const uint8_t*>(st->tokens), device_lo);
    (*t)->Release(*st);
  }
  const Batch b = MakeBatch(4, 2, 99);
  std::vector<bf16_t> out(b.x.size());
  std::future<absl::Status> f = (*t)->Submit(b.view(), out.data(), In(5000));
  ASSERT_TRUE(AwaitResult(f).ok());
  EXPECT_EQ(out[5], F32ToBf16(2.f * Bf16ToF32(b.x[5])));
  // Bad options are refused.
  o.device_slots = o.slots;
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectTransport("unix://" + so.socket_path, o).status()));
}

TEST(TransportSecurity, ShmRefusesPeersWhoseUidIsNotAllowed) {
  testing::TempDir dir;
  Subprocess* s = nullptr;
  const std::string sock = dir.path() + "/s.sock";
  testing::StartExpertServer(&s, {std::string("--model=") + kModel, "--threads=1", "--shm-socket=" + sock,
                                  "--shm-allow-uids=" + std::to_string(getuid() + 4242)});
  std::unique_ptr<Subprocess> owner(s);
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + sock, Options());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kPermissionDenied) << t.status();
  struct stat st;
  ASSERT_EQ(stat(sock.c_str(), &st), 0);
  // Another uid is allowed: the socket is reachable (0666) and SO_PEERCRED
  // decides, as above (hardening_test: an allowed uid outside the group gets in).
  EXPECT_EQ(st.st_mode & 0777, 0666u);
}

// Peer credentials are checked at accept (issue 25, defect 5): a uid over
// its cap, or one that may not use the socket, is refused with its reason
// and holds no slot — silent connections of a disallowed neighbour cannot
// starve an allowed user, and each refusal lets go within a quarter second.
class ShmAcceptTest : public ::testing::Test {
 protected:
  std::unique_ptr<ShmServer> Start(std::vector<uid_t> allowed, size_t max_connections) {
    ShmServer::Options so = TestServerOptions(dir_.path() + "/accept" + std::to_string(n_++) + ".sock");
    so.allowed_uids = std::move(allowed);
    so.max_connections = max_connections;
    path_ = so.socket_path;
    absl::StatusOr<std::unique_ptr<ShmServer>> srv =
        ShmServer::Start(so, [](const MoeBatch&, bf16_t*) { return absl::OkStatus(); });
    EXPECT_TRUE(srv.ok()) << srv.status();
    return srv.ok() ? *std::move(srv) : nullptr;
  }
  // Opens n connections that never say hello; the caller closes them.
  std::vector<int> Silent(int n) {
    std::vector<int> socks;
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<int> s = unix_socket::Connect(path_);
      if (s.ok()) socks.push_back(*s);
    }
    return socks;
  }
  testing::TempDir dir_;
  std::string path_;
  int n_ = 0;
};

// A closed session gives its descriptors back at once, not at the next
// accept (issue 25: 266 fds lingered after 250 sessions).
TEST_F(ShmAcceptTest, ClosedSessionsHoldNoDescriptors) {
  std::unique_ptr<ShmServer> srv = Start({getuid()}, 256);
  ASSERT_NE(srv, nullptr);
  auto open_fds = [] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) n += !e.path().empty();
    return n;
  };
  {  // one session first: lazily created state (threads, the listener's) is not a leak
    absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + path_, Options());
    ASSERT_TRUE(t.ok()) << t.status();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int before = open_fds();
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + path_, Options());
    ASSERT_TRUE(t.ok()) << t.status();
  }
  int after = open_fds();
  for (int i = 0; i < 50 && after > before + 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    after = open_fds();
  }
  EXPECT_LE(after, before + 2) << "closed sessions still hold descriptors";
}

TEST_F(ShmAcceptTest, AUidOverItsCapIsRefusedWithTheReason) {
  std::unique_ptr<ShmServer> srv = Start({getuid(), getuid() + 4242}, 8);  // 4 per uid
  ASSERT_NE(srv, nullptr);
  std::vector<int> held = Silent(4);
  ASSERT_EQ(held.size(), 4u);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + path_, Options());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  EXPECT_NE(t.status().message().find("cap"), std::string::npos) << t.status();
  for (int s : held) close(s);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(ConnectTransport("unix://" + path_, Options()).ok()) << "the uid's slots came back";
}

TEST_F(ShmAcceptTest, DisallowedSilentPeersLetGoAndHoldNoSlot) {
  std::unique_ptr<ShmServer> srv = Start({getuid() + 4242}, 4);  // this process's uid is not allowed
  ASSERT_NE(srv, nullptr);
  std::vector<int> silent = Silent(100);
  ASSERT_EQ(silent.size(), 100u);
  // Every one is let go (refused or closed) well before the 2 s handshake timeout.
  const Clock::time_point t0 = Clock::now();
  for (int s : silent) {
    char b;
    pollfd p{s, POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 1500), 1) << "a refused connection was held";
    (void)recv(s, &b, 1, MSG_DONTWAIT);
    close(s);
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1500));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport("unix://" + path_, Options());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kPermissionDenied) << t.status();
}

// The defect as reported: another uid's silent connections while an allowed
// user connects. Needs root (to be the other uid: a child drops to nobody).
TEST_F(ShmAcceptTest, AllowedUserConnectsWhileADisallowedNeighbourFloods) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (a child process becomes uid 65534)";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);  // nobody must reach the socket file
  std::unique_ptr<ShmServer> srv = Start({getuid(), 65533}, 16);  // socket 0666: nobody may reach it
  ASSERT_NE(srv, nullptr);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    char said = 2;  // 2: may not change uid here (a container without CAP_SETUID)
    if (setgid(65534) == 0 && setuid(65534) == 0) {
      std::vector<int> socks = Silent(300);
      said = static_cast<char>(socks.size() > 0);
      (void)!write(ready[1], &said, 1);
      std::this_thread::sleep_for(std::chrono::seconds(5));
      _exit(0);
    }
    (void)!write(ready[1], &said, 1);
    _exit(0);
  }
  close(ready[1]);  // a child that dies before writing ends the read (EOF), never a hang
  char one = 0;
  const ssize_t got = read(ready[0], &one, 1);
  if (got == 1 && one == 2) {
    waitpid(child, nullptr, 0);
    close(ready[0]);
    GTEST_SKIP() << "this root may not change its uid (no CAP_SETUID)";
  }
  ASSERT_EQ(got, 1);
  ASSERT_EQ(one, 1) << "the neighbour could not connect";
  int ok = 0;
  for (int i = 0; i < 20; ++i) ok += ConnectTransport("unix://" + path_, Options()).ok();
  EXPECT_EQ(ok, 20) << "an allowed user was refused while a disallowed neighbour flooded the socket";
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  close(ready[0]);
}

TEST(TransportSecurity, ServerNeedsTlsOrAnExplicitInsecure) {
  Subprocess s(testing::BinaryPath("moe-expert-server"), {std::string("--model=") + kModel, "--listen=127.0.0.1:0"});
  const int st = s.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 2);
}

TEST(TransportSecurity, MutualTlsChannel) {
  testing::TempDir dir;
  const std::string d = dir.path();
  const std::string cmd =
      "cd " + d + " && "
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=test-ca && "
      "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost && "
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile san.ext && "
      "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=worker && "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 1"
      " > openssl.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl failed; see " << d << "/openssl.log";
  Subprocess* s = nullptr;
  const std::string addr = testing::StartExpertServer(
      &s, {std::string("--model=") + kModel, "--threads=1", "--tls-cert=" + d + "/server.pem",
           "--tls-key=" + d + "/server.key", "--tls-ca=" + d + "/ca.pem"});
  std::unique_ptr<Subprocess> owner(s);
  ASSERT_FALSE(addr.empty());
  TransportOptions o = Options();
  o.tls = TlsOptions{d + "/client.pem", d + "/client.key", d + "/ca.pem", false, ""};
  o.connect_timeout = std::chrono::milliseconds(3000);
  absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport(addr, o);
  ASSERT_TRUE(t.ok()) << t.status();
  Batch b = MakeBatch(6, 2, 11);
  std::vector<bf16_t> out(size_t(b.n) * kH);
  EXPECT_TRUE((*t)->Submit(b.view(), out.data(), In(5000)).get().ok());
  // Without a client certificate the server refuses the handshake.
  o.tls.cert_file.clear();
  o.tls.key_file.clear();
  absl::StatusOr<std::unique_ptr<ExpertTransport>> anon = ConnectTransport(addr, o);
  EXPECT_FALSE(anon.ok());
  // Plaintext against a TLS server fails too.
  o.tls = TlsOptions{};
  o.tls.insecure = true;
  EXPECT_FALSE(ConnectTransport(addr, o).ok());
}


// A same-host peer that hands out a segment it could resize (no seals), or
// announces more bytes than its memfd holds, is refused at connect, naming
// why — before anything is mapped, so its ftruncate cannot SIGBUS this
// process. The real server's sealed segment is accepted (the tests above).
TEST(ShmSegmentSeals, UnsealedOrShortSegmentsAreRefusedAtConnect) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/fake.sock";
  absl::StatusOr<int> listening = unix_socket::Listen(path, 0600);
  ASSERT_TRUE(listening.ok()) << listening.status();
  // One connection per case: the fake server answers the hello with a memfd of
  // `size` bytes announced as `announced`, sealed or not.
  auto serve = [&](uint64_t size, uint64_t announced, bool sealed, uint32_t magic = kShmHelloMagic) {
    return std::thread([&, size, announced, sealed, magic] {
      const int c = accept(*listening, nullptr, nullptr);
      if (c < 0) return;
      ShmHello hello{};
      int none = -1;
      if (unix_socket::Receive(c, &hello, sizeof(hello), &none, 5000).ok()) {
        const int fd = memfd_create("hostile-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
        if (sealed) {
          ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
        }
        ShmReply reply{};
        reply.magic = magic;
        reply.segment_bytes = announced;
        EXPECT_TRUE(unix_socket::Send(c, &reply, sizeof(reply), fd).ok());
        close(fd);
        if (magic == kShmStoreMagic) {  // the store's description follows
          const std::string info(announced, 'x');
          EXPECT_TRUE(unix_socket::Send(c, info.data(), info.size()).ok());
        }
        char byte;
        (void)!read(c, &byte, 1);  // until the client hangs up
      }
      close(c);
    });
  };
  TransportOptions o = Options();
  o.connect_timeout = std::chrono::milliseconds(5000);
  {
    std::thread t = serve(1 << 20, 1 << 20, /*sealed=*/false);
    absl::StatusOr<std::unique_ptr<ExpertTransport>> tr = ConnectTransport("unix://" + path, o);
    EXPECT_EQ(tr.status().code(), absl::StatusCode::kFailedPrecondition) << tr.status();
    EXPECT_NE(tr.status().message().find("not sealed against resizing"), std::string::npos) << tr.status();
    t.join();
  }
  {
    std::thread t = serve(4096, 1 << 20, /*sealed=*/true);
    absl::StatusOr<std::unique_ptr<ExpertTransport>> tr = ConnectTransport("unix://" + path, o);
    EXPECT_EQ(tr.status().code(), absl::StatusCode::kInvalidArgument) << tr.status();
    EXPECT_NE(tr.status().message().find("bytes announced"), std::string::npos) << tr.status();
    t.join();
  }
  {
    // A store request answered with an unsealed memfd: refused before the
    // worker maps it as its host copy.
    std::thread t = serve(1 << 20, 16, /*sealed=*/false, kShmStoreMagic);
    absl::StatusOr<SharedStoreFd> store =
        FetchSharedStore(path, 64, ModelIdentity{}, std::chrono::milliseconds(5000));
    EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
    EXPECT_NE(store.status().message().find("store: the memfd is not sealed"), std::string::npos) << store.status();
    t.join();
  }
  close(*listening);
}

}  // namespace
}  // namespace moe
