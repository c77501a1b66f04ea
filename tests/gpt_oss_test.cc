// GPT-OSS end to end (issue 46 point 2): the checkpoint moe-make-model writes
// for --preset tiny-gpt-oss (openai/gpt-oss's bf16 layout: interleaved
// gate_up, gate/up/down biases; clamped SwiGLU, top-k-then-softmax routing),
// a real moe-expert-server process on it, and the worker over shm and gRPC
// (cpu backend here; the cuda one on a GPU host, skipped by name elsewhere):
// its host copy shared with the server (the packed experts carry their
// biases), some experts cached (hits), the rest computed by the server
// (misses), against the f64 reference MoE of the checkpoint at bf16
// tolerance, with activations large enough that the clamp decides the result.
// A worker is refused by a server whose expert math is not its own.
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/routing.h"
#include "gpu_worker/device_backend.h"
#include "gpu_worker/host_expert_store.h"
#include "gpu_worker/layer_dispatcher.h"
#include "gtest/gtest.h"
#include "moe/engine.h"
#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace moe {
namespace {

using testing::Subprocess;
using testing::TempDir;

constexpr int kSeed = 46;
// Activations this many times RandomBatch's U(-1, 1): most gate and up values
// pass GPT-OSS's limit of 7.
constexpr float kInputScale = 12.0f;
const char kMath[] = "clamped_swiglu(alpha=1.702, limit=7)+bias";

// Writes the tiny-gpt-oss checkpoint with the real moe-make-model binary.
bool MakeCheckpoint(const std::string& dir) {
  Subprocess make(testing::BinaryPath("moe-make-model"),
                  {"--preset=tiny-gpt-oss", "--seed=" + std::to_string(kSeed), "--out=" + dir});
  const int status = make.Wait(std::chrono::seconds(60));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

struct Batch {
  int T = 0, k = 0;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  RoutingView routing() const { return RoutingView{T, k, ids.data(), w.data()}; }
};

// T tokens of large random activations, routed as GPT-OSS's router does
// (SelectExperts, top-k then softmax) from random logits.
Batch RandomBatch(const ModelSpec& spec, int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), logit(-3.0f, 3.0f);
  Batch b;
  b.T = T;
  b.k = spec.top_k;
  b.x.resize(static_cast<size_t>(T) * spec.hidden);
  for (bf16_t& v : b.x) v = F32ToBf16(kInputScale * u(rng));
  std::vector<float> logits(static_cast<size_t>(T) * spec.num_experts);
  for (float& l : logits) l = logit(rng);
  b.ids.resize(static_cast<size_t>(T) * b.k);
  b.w.resize(b.ids.size());
  SelectExperts(logits.data(), T, spec.num_experts, b.k, spec.routing, false, b.ids.data(), b.w.data());
  return b;
}

// Parameter: (device backend, transport).
using Param = std::tuple<std::string, std::string>;

class GptOssEndToEndTest : public ::testing::TestWithParam<Param> {
 protected:
  static void SetUpTestSuite() {
    checkpoint_dir_ = new TempDir();
    checkpoint_ = checkpoint_dir_->path() + "/tiny-gpt-oss";
    ASSERT_TRUE(MakeCheckpoint(checkpoint_));
    absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(checkpoint_);
    ASSERT_TRUE(src.ok()) << src.status();
    source_ = src->release();
    reference_ = new ReferenceMoe(*source_);
    // The same experts without the clamp (the synthetic source of the same
    // seed holds the checkpoint's values), to show that the clamp matters.
    ModelSpec unclamped = source_->spec();
    unclamped.activation.limit = 1e30f;
    unclamped_source_ = MakeSyntheticSource(unclamped, kSeed).release();
    unclamped_reference_ = new ReferenceMoe(*unclamped_source_);
  }
  static void TearDownTestSuite() {
    delete unclamped_reference_;
    delete unclamped_source_;
    delete reference_;
    delete source_;
    delete checkpoint_dir_;
    source_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(source_, nullptr) << "the checkpoint was not written";
    absl::StatusOr<std::unique_ptr<DeviceBackend>> b = MakeDeviceBackend(backend_name());
    if (!b.ok()) GTEST_SKIP() << backend_name() << " backend unavailable: " << b.status().message();
  }
  const std::string& backend_name() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()) == "shm"; }

  // Relative L2 error of `out` against the f64 reference; *unclamped_gap:
  // how far the unclamped reference is from it.
  static double Error(int layer, const Batch& b, const std::vector<bf16_t>& out, double* unclamped_gap) {
    const size_t n = static_cast<size_t>(b.T) * source_->spec().hidden;
    std::vector<double> ref(n), free_ref(n);
    EXPECT_TRUE(reference_->Forward<double>(layer, b.T, b.x.data(), b.routing(), ref.data()).ok());
    EXPECT_TRUE(unclamped_reference_->Forward<double>(layer, b.T, b.x.data(), b.routing(), free_ref.data()).ok());
    *unclamped_gap = RelativeL2Error(free_ref.data(), ref.data(), n);
    std::vector<float> got(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
    return RelativeL2Error(got.data(), ref.data(), n);
  }

  // A session on the checkpoint with the test's backend, one server, an LRU
  // cache of `cached` experts per layer.
  SessionOptions Options(const std::string& server, int cached) const {
    SessionOptions o;
    o.model = checkpoint_;
    o.servers = {server};
    o.tls = testing::PlaintextTls();
    o.device = *ParseDeviceChoice(backend_name());
    o.cache_experts_per_layer = cached;
    o.policy = CachePolicy::kLru;
    o.max_tokens = 64;
    o.cpu_threads = 1;
    return o;
  }

  static TempDir* checkpoint_dir_;
  static std::string checkpoint_;
  static ModelSource* source_;
  static ReferenceMoe* reference_;
  static ModelSource* unclamped_source_;
  static ReferenceMoe* unclamped_reference_;
  TempDir dir_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
};
TempDir* GptOssEndToEndTest::checkpoint_dir_ = nullptr;
std::string GptOssEndToEndTest::checkpoint_;
ModelSource* GptOssEndToEndTest::source_ = nullptr;
ReferenceMoe* GptOssEndToEndTest::reference_ = nullptr;
ModelSource* GptOssEndToEndTest::unclamped_source_ = nullptr;
ReferenceMoe* GptOssEndToEndTest::unclamped_reference_ = nullptr;

// LayerDispatcher: half of each layer's experts cached from the host copy
// shared with the server, the other half computed by the server.
TEST_P(GptOssEndToEndTest, HitsAndMissesMatchTheReference) {
  const ModelSpec& spec = source_->spec();
  ASSERT_EQ(spec.model_type, "gpt_oss");
  ASSERT_TRUE(spec.expert_biases);
  ASSERT_EQ(spec.routing, RoutingMode::kTopKSoftmax);
  const std::string addr = testing::StartTestServer(servers_, dir_.path(), checkpoint_, shm());
  ASSERT_FALSE(addr.empty());
  std::unique_ptr<DeviceBackend> backend = *MakeDeviceBackend(backend_name());
  const ModelIdentity identity = IdentityOf(*source_, checkpoint_);
  EXPECT_EQ(identity.expert_math, kMath);
  EXPECT_EQ(identity.routing, "topk_softmax");

  // The host copy: the server's packed store, mapped (one copy of the model
  // on the host), its experts ending with their biases.
  absl::StatusOr<std::unique_ptr<HostExpertStore>> host = HostExpertStore::Open(
      *source_, identity, spec.moe_layers, {dir_.path() + "/s0.sock"}, "auto", /*share=*/true, backend.get());
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_TRUE((*host)->shared());
  EXPECT_TRUE((*host)->geometry().biases);
  EXPECT_EQ((*host)->geometry().activation, spec.activation);

  DispatcherConfig c;
  c.servers.push_back(*ParseExpertServer(addr, spec.num_experts));
  c.transport.tls = testing::PlaintextTls();
  c.transport.model = identity;
  c.transport.max_tokens_per_slot = 32;
  c.max_tokens = 128;
  c.measure_rates = false;
  c.policy = CachePolicy::kStatic;
  c.copy_mode = CopyMode::kNever;  // every miss goes to the server
  c.slots_per_layer = 4;
  c.deadline = std::chrono::milliseconds(10000);
  absl::StatusOr<std::unique_ptr<LayerDispatcher>> d = LayerDispatcher::Create(spec, *backend, host->get(), c);
  ASSERT_TRUE(d.ok()) << d.status();
  for (int layer : spec.moe_layers) {
    ASSERT_TRUE((*d)->ApplyAssignment(layer, {0, 3, 5, 6}).ok());
  }
  ASSERT_TRUE((*d)->FlushCopies().ok());

  int64_t hits = 0, cpu = 0;
  uint64_t seed = 1;
  for (int layer : spec.moe_layers)
    for (int T : {1, 3, 17, 100}) {
      SCOPED_TRACE(::testing::Message() << "layer " << layer << " T=" << T);
      const Batch b = RandomBatch(spec, T, ++seed);
      std::vector<bf16_t> out(b.x.size(), F32ToBf16(123.0f));  // poison: every row must be written
      LayerCall call;
      call.batch = MoeBatch{layer, b.T, b.x.data(), b.routing()};
      call.out = out.data();
      CallStats st;
      const absl::Status s = (*d)->Forward(call, &st);
      ASSERT_TRUE(s.ok()) << s;
      double unclamped_gap = 0;
      EXPECT_LE(Error(layer, b, out, &unclamped_gap), 1e-2);
      EXPECT_GT(unclamped_gap, 0.1) << "the clamp changes nothing here";
      EXPECT_EQ(st.hit_pairs + st.cpu_pairs, b.T * b.k);
      hits += st.hit_pairs;
      cpu += st.cpu_pairs;
    }
  EXPECT_GT(hits, 0);
  EXPECT_GT(cpu, 0);
}

// MoeSession (the engine's API) on the checkpoint: its own open path (host
// copy, identity and expert math checked with the server), and ModelInfo
// naming the expert math.
TEST_P(GptOssEndToEndTest, SessionMatchesTheReference) {
  const ModelSpec& spec = source_->spec();
  const std::string addr = testing::StartTestServer(servers_, dir_.path(), checkpoint_, shm());
  ASSERT_FALSE(addr.empty());
  SessionOptions o = Options(addr, 3);
  absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->model_info().expert_math, kMath);
  EXPECT_EQ((*s)->model_info().routing, "topk_softmax");
  uint64_t seed = 100;
  for (int round = 0; round < 2; ++round)  // the second round hits what the first admitted
    for (int layer : spec.moe_layers) {
      const Batch b = RandomBatch(spec, 24, ++seed);
      std::vector<bf16_t> out(b.x.size());
      ASSERT_TRUE((*s)->ForwardLayer(layer, b.T, b.k, b.x.data(), b.ids.data(), b.w.data(), out.data()).ok());
      double unclamped_gap = 0;
      EXPECT_LE(Error(layer, b, out, &unclamped_gap), 1e-2) << "layer " << layer;
    }
  const SessionTotals t = (*s)->totals();
  EXPECT_GT(t.hit_pairs + t.copied_pairs, 0u);
  EXPECT_GT(t.cpu_pairs, 0u);
}

// Two copies of one checkpoint whose config.json disagree on swiglu_limit
// have one digest (it covers the stored expert tensors) but compute
// different layers: a worker on one is refused by a server on the other,
// over both transports, with both sides' expert math named.
TEST_P(GptOssEndToEndTest, ServerOfOtherExpertMathIsRefused) {
  const std::string other = dir_.path() + "/limit5";
  std::filesystem::create_directory(other);
  for (const auto& f : std::filesystem::directory_iterator(checkpoint_)) {
    if (f.path().filename() == "config.json") continue;
    std::filesystem::create_symlink(f.path(), other + "/" + f.path().filename().string());
  }
  nlohmann::json config;
  std::ifstream(checkpoint_ + "/config.json") >> config;
  config["swiglu_limit"] = 5.0;
  std::ofstream(other + "/config.json") << config.dump();
  absl::StatusOr<std::unique_ptr<ModelSource>> other_source = OpenModel(other);
  ASSERT_TRUE(other_source.ok()) << other_source.status();
  const ModelIdentity ours = IdentityOf(*source_, checkpoint_), theirs = IdentityOf(**other_source, other);
  ASSERT_EQ(ours.digest, theirs.digest) << "the digest covers the stored tensors only";
  ASSERT_EQ(theirs.expert_math, "clamped_swiglu(alpha=1.702, limit=5)+bias");

  const std::string addr = testing::StartTestServer(servers_, dir_.path(), other, shm());
  ASSERT_FALSE(addr.empty());
  SessionOptions o = Options(addr, 2);
  absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
  ASSERT_FALSE(s.ok()) << "a server computing other expert math was accepted";
  EXPECT_TRUE(IsModelMismatch(s.status())) << s.status();
  const std::string msg(s.status().message());
  EXPECT_NE(msg.find("expert math differs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("limit=7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("limit=5"), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(Backends, GptOssEndToEndTest,
                         ::testing::Combine(::testing::Values("cpu", "cuda"), ::testing::Values("shm", "grpc")),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return std::get<0>(p.param) + "_" + std::get<1>(p.param);
                         });

}  // namespace
}  // namespace moe
