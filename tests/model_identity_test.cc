// Model identity (issue 47, point 1): every expert server and GPU worker
// derives a content identity of its experts (model/model_identity.h) and a
// mismatch is refused in every handshake, naming both identities and both
// models. The digest in process (it changes with one stored byte, not with
// the sharding, the slice or the spelling of a synthetic URI; pinned, so a
// salted or unstable hash fails), then the real path: moe-make-model, real
// moe-expert-server processes, MoeSession / moe-gpu-worker over gRPC and
// shared memory — the repro (a server on a tiny checkpoint, a worker
// on synthetic:tiny:seed=5) refused on both transports, the same model
// accepted with outputs that match the reference, a server restarted with
// another model under the same address refused on reconnect while the
// worker's answers stay right, the server's own refusals (a request, a hello,
// a store request of another model) — and the coordinator, which refuses a
// registration of another model while a peer of the first one is live.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/expert_client.h"
#include "coordinator/coordinator.h"
#include "model/model_identity.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "transport/shm_server.h"
#include "transport/transport.h"
#include "transport/unix_socket.h"
#include "gtest/gtest.h"
#include "moe/engine.h"
#include "nlohmann/json.hpp"
#include "testing/random_data.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using testing::Subprocess;

// The worker model: tiny's geometry (H=96, I=80, 8 experts, top-2,
// MoE layers 1 and 2), another seed than moe-make-model's default 0.
const char kOther[] = "synthetic:tiny:seed=5";

uint64_t IdentityOf(const std::string& uri) {
  absl::StatusOr<std::unique_ptr<ModelSource>> s = OpenModel(uri);
  EXPECT_TRUE(s.ok()) << uri << ": " << s.status();
  return s.ok() ? (*s)->Identity() : 0;
}

// Flips the low bit of byte `byte` of tensor `name`'s stored data in the
// checkpoint `dir` (written by WriteSyntheticCheckpoint: an index and shards).
void FlipStoredByte(const std::string& dir, const std::string& name, size_t byte) {
  std::ifstream index(dir + "/model.safetensors.index.json");
  ASSERT_TRUE(index) << dir;
  const std::string shard = dir + "/" + nlohmann::json::parse(index)["weight_map"][name].get<std::string>();
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << shard;
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  const uint64_t begin = nlohmann::json::parse(header)[name]["data_offsets"][0].get<uint64_t>();
  const std::streamoff at = static_cast<std::streamoff>(8 + header_len + begin + byte);
  char b = 0;
  f.seekg(at);
  f.read(&b, 1);
  b ^= 1;
  f.seekp(at);
  f.write(&b, 1);
  ASSERT_TRUE(f.good());
}

// ---------------------------------------------------------------- the digest

TEST(ModelIdentityDigest, Hash64IsXxh64) {
  // XXH64's published values: the same in every process and on every machine.
  EXPECT_EQ(Hash64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(Hash64("abc", 3), 0x44bc2cf5ad770999ull);
  EXPECT_EQ(IdentityHex(0x44bc2cf5ad770999ull), "44bc2cf5ad770999");
  EXPECT_EQ(IdentityHex(0), "none");
}

TEST(ModelIdentityDigest, SyntheticModelsDifferByContentNotBySpelling) {
  const uint64_t tiny = IdentityOf("synthetic:tiny");
  EXPECT_EQ(tiny, IdentityOf("synthetic:tiny:layers=3"));  // tiny has 3 layers: the same weights
  EXPECT_EQ(tiny, IdentityOf("synthetic:tiny:seed=0"));
  EXPECT_NE(tiny, IdentityOf(kOther));
  EXPECT_NE(tiny, IdentityOf("synthetic:tiny:dtype=fp8"));
  EXPECT_NE(tiny, IdentityOf("synthetic:tiny:experts=4"));
  EXPECT_NE(tiny, IdentityOf("synthetic:tiny:layers=2"));
  // Pinned: a hash salted per process (absl::Hash) or a changed definition fails here.
  EXPECT_EQ(IdentityHex(tiny), "2014bf7a369e7cdd");
  // A slice is a share of the whole model: the whole model's identity.
  absl::StatusOr<std::unique_ptr<ModelSource>> half = SliceModel(*OpenModel("synthetic:demo:layers=2"), {1, 2});
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ((*half)->Identity(), IdentityOf("synthetic:demo:layers=2"));
}

TEST(ModelIdentityDigest, CheckpointIdentityCoversEveryStoredExpertByte) {
  testing::TempDir dir;
  const ModelSpec spec = *PresetSpec("tiny");
  const std::string a = dir.path() + "/a", resharded = dir.path() + "/b", tuned = dir.path() + "/c";
  ASSERT_TRUE(WriteSyntheticCheckpoint(a, spec, 7, 64 << 10).ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(resharded, spec, 7, 1 << 20).ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(tuned, spec, 7, 64 << 10).ok());
  const uint64_t base = IdentityOf(a);
  EXPECT_EQ(base, IdentityOf(a)) << "not stable within a process";
  EXPECT_EQ(base, IdentityOf(resharded)) << "the sharding is no part of the model";
  EXPECT_EQ(IdentityHex(base), "0d08e69522ba038f");  // pinned: stable across processes and builds
  // A fine-tune of one value: the last expert's down_proj, its last weight.
  const std::string last = ExpertTensorName(spec.naming, spec.moe_layers.back(), spec.num_experts - 1,
                                            Projection::kDown);
  FlipStoredByte(tuned, last, size_t{2} * spec.hidden * spec.intermediate - 1);
  EXPECT_NE(base, IdentityOf(tuned));
  // ... and of a value in the middle of the first expert.
  const std::string tuned2 = dir.path() + "/d";
  ASSERT_TRUE(WriteSyntheticCheckpoint(tuned2, spec, 7, 64 << 10).ok());
  FlipStoredByte(tuned2, ExpertTensorName(spec.naming, spec.moe_layers.front(), 0, Projection::kUp), 1001);
  EXPECT_NE(base, IdentityOf(tuned2));
  EXPECT_NE(IdentityOf(tuned), IdentityOf(tuned2));
  // Another seed, and the synthetic model of the same values (another form).
  const std::string seed8 = dir.path() + "/e";
  ASSERT_TRUE(WriteSyntheticCheckpoint(seed8, spec, 8, 64 << 10).ok());
  EXPECT_NE(base, IdentityOf(seed8));
  EXPECT_NE(base, IdentityOf("synthetic:tiny:seed=7"));
}

TEST(ModelIdentityDigest, QuantizedCheckpointsCoverTheirScales) {
  testing::TempDir dir;
  ModelSpec spec = *PresetSpec("tiny");
  spec.quant.scheme = WeightQuant::kFp8Block;
  const std::string a = dir.path() + "/a", b = dir.path() + "/b";
  ASSERT_TRUE(WriteSyntheticCheckpoint(a, spec, 3, 64 << 10).ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(b, spec, 3, 64 << 10).ok());
  ASSERT_EQ(IdentityOf(a), IdentityOf(b));
  // One scale (f32) of layer 1 expert 2's gate: its lowest mantissa bit.
  FlipStoredByte(b, ExpertTensorName(spec.naming, 1, 2, Projection::kGate) + "_scale_inv", 0);
  EXPECT_NE(IdentityOf(a), IdentityOf(b));
}

// ---------------------------------------------------------------- the real path

// moe-make-model --preset tiny --out DIR (seed 0), as in the repro.
bool MakeTiny(const std::string& out) {
  Subprocess make(testing::BinaryPath("moe-make-model"), {"--preset=tiny", "--out=" + out});
  return make.Wait(std::chrono::seconds(60)) == 0;
}

// A layer call's inputs, and its reference output under `model`.
struct Call {
  int layer = 1, n = 6, k = 2;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  explicit Call(uint64_t seed, int hidden = 96, int experts = 8) {
    x = RandomActivations(static_cast<size_t>(n) * hidden, seed);
    RandomRouting(n, k, experts, seed + 1, 0.0, &ids, &w);
  }
  RoutingView routing() const { return RoutingView{n, k, ids.data(), w.data()}; }
  MoeBatch batch() const { return MoeBatch{layer, n, x.data(), routing()}; }
  // ||out - reference of `model`|| / ||reference||.
  double Error(const ModelSource& model, const std::vector<bf16_t>& out) const {
    const int H = model.spec().hidden;
    std::vector<double> ref(static_cast<size_t>(n) * H);
    EXPECT_TRUE(ReferenceMoe(model).Forward<double>(layer, n, x.data(), routing(), ref.data()).ok());
    std::vector<float> got(out.size());
    Bf16ToF32(out.data(), got.data(), got.size());
    return RelativeL2Error(got.data(), ref.data(), got.size());
  }
};

// The message of a refusal must name both identities and both models.
void ExpectNamesBoth(const absl::Status& st, uint64_t a, const std::string& model_a, uint64_t b,
                     const std::string& model_b) {
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  for (const std::string& part : {IdentityHex(a), model_a, IdentityHex(b), model_b})
    EXPECT_NE(st.message().find(part), std::string::npos) << "does not name " << part << ": " << st;
}

// One expert server on M (moe-make-model tiny) with gRPC and shared memory.
class ModelIdentityProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    model_ = new std::string(dir_->path() + "/M");
    sock_ = new std::string(dir_->path() + "/s.sock");
    if (!MakeTiny(*model_)) return;
    grpc_ = new std::string(
        testing::StartExpertServer(&server_, {"--model=" + *model_, "--threads=1", "--shm-socket=" + *sock_}));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete grpc_;
    delete sock_;
    delete model_;
    delete dir_;
  }
  void SetUp() override {
    ASSERT_NE(grpc_, nullptr) << "moe-make-model failed";
    ASSERT_FALSE(grpc_->empty()) << "moe-expert-server did not start";
  }
  static SessionOptions Options(const std::string& model, const std::string& server) {
    SessionOptions o;
    o.model = model;
    o.servers = {server};
    o.device = DeviceChoice::kCpu;
    o.cache_experts_per_layer = 4;
    o.cpu_threads = 1;
    o.tls = testing::PlaintextTls();
    return o;
  }

  static testing::TempDir* dir_;
  static std::string *model_, *sock_, *grpc_;
  static Subprocess* server_;
};
testing::TempDir* ModelIdentityProcess::dir_ = nullptr;
std::string* ModelIdentityProcess::model_ = nullptr;
std::string* ModelIdentityProcess::sock_ = nullptr;
std::string* ModelIdentityProcess::grpc_ = nullptr;
Subprocess* ModelIdentityProcess::server_ = nullptr;

// The repro, through MoeSession on both transports (the shared
// memory one with the host copy shared and without): refused at Open, naming
// both identities and both models; never a session that mixes them.
TEST_F(ModelIdentityProcess, WorkerOfAnotherModelIsRefusedOverGrpcAndShm) {
  const uint64_t m = IdentityOf(*model_), other = IdentityOf(kOther);
  ASSERT_NE(m, other);
  for (const std::string& server : {*grpc_, "unix://" + *sock_}) {
    for (bool share : {true, false}) {
      SCOPED_TRACE(absl::StrCat(server, share ? ", shared host copy" : ", own host copy"));
      SessionOptions o = Options(kOther, server);
      o.share_host_copy = share;
      absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
      ASSERT_FALSE(s.ok()) << "a worker on " << kOther << " opened against a server on " << *model_;
      ExpectNamesBoth(s.status(), other, kOther, m, *model_);
      EXPECT_TRUE(IsModelMismatch(s.status())) << s.status();
    }
  }
}

// The same, as the issue ran it: moe-gpu-worker exits 1 with the reason.
TEST_F(ModelIdentityProcess, GpuWorkerProcessOfAnotherModelDoesNotStart) {
  const std::string err = dir_->path() + "/worker.err";
  Subprocess w(testing::BinaryPath("moe-gpu-worker"),
               {std::string("--model=") + kOther, "--servers=" + *grpc_, "--device=cpu", "--cpu-threads=1",
                "--cache-experts-per-layer=4", "--listen=127.0.0.1:0", "--insecure"},
               err);
  const int st = w.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(WIFEXITED(st)) << st;
  EXPECT_EQ(WEXITSTATUS(st), 1);
  std::ifstream in(err);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const std::string& part : {IdentityHex(IdentityOf(kOther)), std::string(kOther),
                                  IdentityHex(IdentityOf(*model_)), *model_})
    EXPECT_NE(text.find(part), std::string::npos) << "does not name " << part << ":\n" << text;
}

// The same model is accepted on both transports (shared host copy too), the
// answers match the reference of M, and the identity the server computed in
// its process is the one computed here and the session's.
TEST_F(ModelIdentityProcess, WorkerOfTheSameModelIsAcceptedAndRight) {
  const uint64_t m = IdentityOf(*model_);
  std::unique_ptr<ExpertClient> client = *ExpertClient::Connect(*grpc_, testing::PlaintextTls());
  absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->model_identity(), m);
  EXPECT_EQ(info->model_path(), *model_);
  std::unique_ptr<ModelSource> source = *OpenModel(*model_);
  for (const std::string& server : {*grpc_, "unix://" + *sock_}) {
    SCOPED_TRACE(server);
    absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(Options(*model_, server));
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->model_info().identity, m);
    for (uint64_t seed : {1, 2, 3}) {
      Call c(seed);
      std::vector<bf16_t> out(c.x.size());
      CallStats st;
      ASSERT_TRUE((*s)->ForwardLayer(c.layer, c.n, c.k, c.x.data(), c.ids.data(), c.w.data(), out.data(),
                                     MemoryKind::kHost, &st)
                      .ok());
      EXPECT_LE(c.Error(*source, out), 1e-2);
    }
  }
}

// The server's own checks: a gRPC request, a shared-memory hello and a store
// request of another model are refused (the server names both); none is
// refused for the model it serves or for a client that asserts no model.
TEST_F(ModelIdentityProcess, ServerRefusesRequestsHellosAndStoreRequestsOfAnotherModel) {
  const uint64_t m = IdentityOf(*model_), other = IdentityOf(kOther);
  std::unique_ptr<ExpertClient> client = *ExpertClient::Connect(*grpc_, testing::PlaintextTls());
  Call c(7);
  for (uint64_t id : {uint64_t{0}, m, other}) {
    moe::v1::ForwardRequest req = ExpertClient::MakeRequest(c.layer, c.n, 96, c.x.data(), c.routing(), 5);
    req.set_model_identity(id);
    moe::v1::ForwardResponse resp;
    const absl::Status st = client->Call(req, &resp);
    if (id == other) {
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
      for (const std::string& part : {IdentityHex(m), *model_, IdentityHex(other), std::string("model_identity")})
        EXPECT_NE(st.message().find(part), std::string::npos) << "does not name " << part << ": " << st;
    } else {
      EXPECT_TRUE(st.ok()) << "identity " << IdentityHex(id) << ": " << st;
    }
  }
  // A hello of another model, written by hand: the server's own refusal.
  absl::StatusOr<int> fd = unix_socket::Connect(*sock_);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const ShmHello hello = MakeShmHello(kShmHelloMagic, 96, 16, 4, 4, ModelIdentity{other, kOther});
  ASSERT_TRUE(unix_socket::Send(*fd, &hello, sizeof(hello)).ok());
  ShmReply reply{};
  int seg = -1;
  ASSERT_TRUE(unix_socket::Receive(*fd, &reply, sizeof(reply), &seg, 5000).ok());
  close(*fd);
  EXPECT_LT(seg, 0) << "a segment was handed to a client of another model";
  if (seg >= 0) close(seg);
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(reply.model_identity, m);
  EXPECT_NE(std::string(reply.message).find(IdentityHex(other)), std::string::npos) << reply.message;
  // The store: refused to another model, handed to this one.
  absl::StatusOr<SharedStoreFd> store =
      FetchSharedStore(*sock_, 96, ModelIdentity{other, kOther}, std::chrono::seconds(5));
  ASSERT_FALSE(store.ok()) << "the store was handed to a client of another model";
  ExpectNamesBoth(store.status(), other, kOther, m, *model_);
  store = FetchSharedStore(*sock_, 96, ModelIdentity{m, *model_}, std::chrono::seconds(5));
  ASSERT_TRUE(store.ok()) << store.status();
  close(store->fd);
}

// Failover and reconnect: a server killed and restarted under the same
// address (port, socket) with another model is refused when the transport
// connects again — named as at the first connect — and a session on M keeps
// answering M's outputs meanwhile (its misses computed from its host copy).
TEST(ModelIdentityRestart, ServerRestartedWithAnotherModelIsRefusedOnReconnect) {
  testing::TempDir dir;
  const std::string model = dir.path() + "/M", sock = dir.path() + "/s.sock";
  ASSERT_TRUE(MakeTiny(model));
  const int port = testing::ReservablePort();
  const std::string listen = port > 0 ? absl::StrCat("127.0.0.1:", port) : "127.0.0.1:0";
  std::vector<std::string> args = {"--model=" + model, "--threads=1", "--shm-socket=" + sock};
  Subprocess* raw = nullptr;
  const std::string grpc = testing::StartExpertServer(&raw, args, listen);
  std::unique_ptr<Subprocess> server(raw);
  ASSERT_FALSE(grpc.empty());
  std::unique_ptr<ModelSource> source = *OpenModel(model);
  const ModelIdentity m{source->Identity(), model};
  const uint64_t other = IdentityOf(kOther);

  TransportOptions to;
  to.hidden = 96;
  to.tls = testing::PlaintextTls();
  to.model = m;
  std::vector<std::unique_ptr<ExpertTransport>> transports;
  for (const std::string& a : {grpc, "unix://" + sock}) {
    absl::StatusOr<std::unique_ptr<ExpertTransport>> t = ConnectTransport(a, to);
    ASSERT_TRUE(t.ok()) << a << ": " << t.status();
    transports.push_back(*std::move(t));
  }
  SessionOptions so;
  so.model = model;
  so.servers = {grpc};
  so.device = DeviceChoice::kCpu;
  so.cache_experts_per_layer = 2;
  so.copy_mode = CopyMode::kNever;  // misses go to the server while it is up; copies only as failover
  so.cpu_threads = 1;
  so.tls = testing::PlaintextTls();
  absl::StatusOr<std::unique_ptr<MoeSession>> session = MoeSession::Open(so);
  ASSERT_TRUE(session.ok()) << session.status();
  auto forward = [&](uint64_t seed, CallStats* st) {
    Call c(seed);
    std::vector<bf16_t> out(c.x.size());
    const absl::Status s = (*session)->ForwardLayer(c.layer, c.n, c.k, c.x.data(), c.ids.data(), c.w.data(),
                                                   out.data(), MemoryKind::kHost, st);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_LE(c.Error(*source, out), 1e-2) << "a wrong answer (seed " << seed << ")";
  };
  CallStats st;
  forward(11, &st);
  EXPECT_GT(st.cpu_pairs, 0);
  for (auto& t : transports) {
    Call c(12);
    std::vector<bf16_t> out(c.x.size());
    std::future<absl::Status> f = t->Submit(c.batch(), out.data(), Clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(f.get().ok()) << t->kind();
    EXPECT_LE(c.Error(*source, out), 1e-2) << t->kind();
  }

  server->Signal(SIGKILL);
  server->Wait(std::chrono::seconds(5));
  server.reset();
  args[0] = std::string("--model=") + kOther;
  ASSERT_FALSE(testing::StartExpertServer(&raw, args, grpc).empty());
  server.reset(raw);

  // Each transport: once it reaches the new server, every batch is refused as
  // another model's, naming both (gRPC: the server's refusal of the request's
  // identity plus the worker's side; shm: the handshake's).
  for (auto& t : transports) {
    SCOPED_TRACE(t->kind());
    absl::Status last;
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < until) {
      Call c(13);
      std::vector<bf16_t> out(c.x.size());
      (void)t->Reconnect();
      std::future<absl::Status> f = t->Submit(c.batch(), out.data(), Clock::now() + std::chrono::seconds(5));
      last = f.get();
      EXPECT_FALSE(last.ok()) << "a server of another model answered";
      if (!absl::IsUnavailable(last) && !absl::IsDeadlineExceeded(last)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ExpectNamesBoth(last, m.digest, model, other, kOther);
    EXPECT_TRUE(IsModelMismatch(last)) << last;
  }
  // The session's calls never mix: its misses are computed from its own host copy.
  const auto until = Clock::now() + std::chrono::seconds(2);
  int calls = 0;
  while (Clock::now() < until) {
    forward(100 + calls++, &st);
    EXPECT_EQ(st.cpu_pairs, 0) << "a server of another model computed misses";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(calls, 5);
}

// ---------------------------------------------------------------- the coordinator

TEST(ModelIdentityCoordinator, RegistrationOfAnotherLiveModelIsRefused) {
  double now = 1000.0;
  CoordinatorOptions o;
  o.heartbeat_timeout_seconds = 3.0;
  o.clock = [&now] { return now; };
  std::unique_ptr<Coordinator> c = *Coordinator::Create(o);
  const uint64_t a = 0x1111222233334444ull, b = 0x5555666677778888ull;
  auto worker = [](const std::string& id, uint64_t identity, const std::string& path) {
    moe::v1::RegisterWorkerRequest r;
    r.set_worker_id(id);
    r.set_num_layers(3);
    r.set_num_experts(8);
    r.set_slots_per_layer(2);
    r.set_expert_bytes(1000);
    r.set_model_identity(identity);
    r.set_model_path(path);
    return r;
  };
  auto server = [](const std::string& id, uint64_t identity, const std::string& path) {
    moe::v1::RegisterExpertServerRequest r;
    r.set_server_id(id);
    r.set_address("127.0.0.1:5000");
    r.set_num_layers(3);
    r.set_num_experts(8);
    r.set_model_identity(identity);
    r.set_model_path(path);
    return r;
  };
  auto refused = [&](const absl::Status& st, const std::string& peer) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    for (const std::string& part : {std::string("model_identity"), IdentityHex(a), std::string("/models/a"),
                                    IdentityHex(b), std::string("/models/b"), peer})
      EXPECT_NE(st.message().find(part), std::string::npos) << "does not name " << part << ": " << st;
  };
  absl::StatusOr<moe::v1::RegisterWorkerResponse> w1 = c->RegisterWorker(worker("w1", a, "/models/a"), "");
  ASSERT_TRUE(w1.ok()) << w1.status();
  refused(c->RegisterExpertServer(server("s1", b, "/models/b")).status(), "s1");
  ASSERT_TRUE(c->RegisterExpertServer(server("s1", a, "/models/a")).ok());
  refused(c->RegisterWorker(worker("w2", b, "/models/b"), "").status(), "w2");
  // A peer that reports no identity (an older version) is not checked.
  EXPECT_TRUE(c->RegisterWorker(worker("w3", 0, ""), "").ok());
  // w1 restarted on b: refused while the server s1 of a is live.
  moe::v1::RegisterWorkerRequest again = worker("w1", b, "/models/b");
  again.set_session(w1->session());
  refused(c->RegisterWorker(again, "").status(), "w1");
  // A path no filesystem has is refused by its length.
  EXPECT_EQ(c->RegisterWorker(worker("w4", a, std::string(5000, 'x')), "").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Once no live peer holds a (their leases ran out), b is the coordinator's model.
  now += 10;
  c->Tick();
  EXPECT_TRUE(c->RegisterExpertServer(server("s2", b, "/models/b")).ok());
  refused(c->RegisterWorker(worker("w5", a, "/models/a"), "").status(), "w5");
}

}  // namespace
}  // namespace moe
