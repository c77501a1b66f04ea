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
// GPT-OSS in GGUF (issue 46 point 3, GptOssGguf): llama.cpp's gpt-oss layout
// as moe-make-model --format gguf writes it reads back as the checkpoint of
// the same seed (bf16) or exactly as its stored blocks (MXFP4, GPT-OSS-20B's
// expert shape), a real moe-expert-server on the file serves a layer against
// the f64 reference, and a bad file is refused in one line naming the tensor.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/expert_client.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"
#include "model/gguf.h"
#include "model/gguf_model.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/routing.h"
#include "model/synthetic_model.h"
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
  // Misses to the server (the planner would copy all of them here: the cpu
  // backend's copies are memcpys), so both devices' expert math is checked.
  o.copy_mode = CopyMode::kNever;
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

// ---------------------------------------------------------------- GGUF

// Runs the real moe-make-model with `args`; true iff it exited 0.
bool MakeModel(const std::vector<std::string>& args) {
  Subprocess make(testing::BinaryPath("moe-make-model"), args);
  const int status = make.Wait(std::chrono::seconds(120));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

void ExpectSameExpert(const ExpertWeights& a, const ExpertWeights& b, const std::string& what) {
  EXPECT_EQ(a.gate, b.gate) << what;
  EXPECT_EQ(a.up, b.up) << what;
  EXPECT_EQ(a.down, b.down) << what;
  EXPECT_EQ(a.gate_bias, b.gate_bias) << what;
  EXPECT_EQ(a.up_bias, b.up_bias) << what;
  EXPECT_EQ(a.down_bias, b.down_bias) << what;
}

// moe-make-model --format gguf on tiny-gpt-oss: llama.cpp's gpt-oss layout
// (separate gate/up/down with F32 biases, the router), read back as the
// safetensors checkpoint of the same seed: the same spec and expert math,
// every expert and bias bit for bit, the same f64 layer output.
TEST(GptOssGguf, MakeModelGgufReadsBackAsTheCheckpoint) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt", path = dir.path() + "/tiny-gpt-oss.gguf";
  ASSERT_TRUE(MakeCheckpoint(ckpt));
  ASSERT_TRUE(MakeModel({"--preset=tiny-gpt-oss", "--seed=" + std::to_string(kSeed), "--format=gguf", "--out=" + path}));
  std::unique_ptr<ModelSource> st = *OpenModel(ckpt);
  absl::StatusOr<std::unique_ptr<ModelSource>> gg = OpenModel(path);
  ASSERT_TRUE(gg.ok()) << gg.status();
  const ModelSpec &a = (*gg)->spec(), &b = st->spec();
  EXPECT_EQ(a.model_type, "gpt_oss");
  EXPECT_EQ(std::tie(a.num_layers, a.moe_layers, a.num_experts, a.top_k, a.hidden, a.intermediate),
            std::tie(b.num_layers, b.moe_layers, b.num_experts, b.top_k, b.hidden, b.intermediate));
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_TRUE(a.expert_biases);
  EXPECT_EQ(a.routing, RoutingMode::kTopKSoftmax);
  EXPECT_EQ(a.dtype, DType::kBF16);
  EXPECT_EQ(IdentityOf(**gg, path).expert_math, kMath);
  EXPECT_NE((*gg)->Describe().find("(gpt-oss, experts BF16; routing top-4 then softmax"), std::string::npos)
      << (*gg)->Describe();
  ExpertWeights x, y;
  for (int l : a.moe_layers)
    for (int e = 0; e < a.num_experts; ++e) {
      ASSERT_TRUE((*gg)->ReadExpert(l, e, &x).ok());
      ASSERT_TRUE(st->ReadExpert(l, e, &y).ok());
      ExpectSameExpert(x, y, absl::StrCat("layer ", l, " expert ", e));
    }
  // The router as llama.cpp reads it: ffn_gate_inp.weight [H, E] and .bias [E], F32.
  std::unique_ptr<GgufFile> f = *GgufFile::Open(path);
  const GgufTensor* router = f->Find("blk.1.ffn_gate_inp.weight");
  const GgufTensor* router_bias = f->Find("blk.1.ffn_gate_inp.bias");
  ASSERT_NE(router, nullptr);
  ASSERT_NE(router_bias, nullptr);
  EXPECT_EQ(router->dims, (std::vector<int64_t>{a.hidden, a.num_experts}));
  EXPECT_EQ(router_bias->dims, (std::vector<int64_t>{a.num_experts}));
  std::vector<bf16_t> rw(size_t(a.num_experts) * a.hidden), rb(a.num_experts);
  GenerateRouter(kSeed, 1, a.num_experts, a.hidden, rw.data(), rb.data());
  std::vector<float> got(rw.size());
  DequantizeGgml(static_cast<GgmlType>(router->type), router->data, static_cast<int64_t>(got.size()), got.data());
  for (size_t i = 0; i < rw.size(); ++i) ASSERT_EQ(got[i], Bf16ToF32(rw[i])) << i;
  // One layer through both sources' f64 reference: the same output.
  ReferenceMoe ra(**gg), rb_ref(*st);
  const Batch batch = RandomBatch(a, 13, 7);
  std::vector<double> oa(size_t(batch.T) * a.hidden), ob(oa.size());
  ASSERT_TRUE(ra.Forward<double>(1, batch.T, batch.x.data(), batch.routing(), oa.data()).ok());
  ASSERT_TRUE(rb_ref.Forward<double>(1, batch.T, batch.x.data(), batch.routing(), ob.data()).ok());
  EXPECT_EQ(oa, ob);
  double norm = 0;
  for (double v : oa) norm += v * v;
  EXPECT_GT(norm, 0);
}

// A real moe-expert-server on `path` (--weight-dtype auto): checks that it
// names GPT-OSS's expert math and stores `stored`, then returns its relative
// error on large random activations (the clamp decides) routed top-k then
// softmax, against the f64 reference of `reference`; *unclamped_gap: how far
// the same layer without the clamp is. -1 when a step failed.
double ServedGgufError(const std::string& path, const char* stored, const ModelSource& reference, double* unclamped_gap) {
  Subprocess* server = nullptr;
  const std::string addr =
      testing::StartExpertServer(&server, {"--model=" + path, "--threads=2", "--max-tokens=64", "--weight-dtype=auto"});
  std::unique_ptr<Subprocess> owned(server);
  if (addr.empty()) return ADD_FAILURE() << "moe-expert-server did not start on " << path, -1;
  std::unique_ptr<ExpertClient> client = *ExpertClient::Connect(addr, testing::PlaintextTls());
  absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
  if (!info.ok()) return ADD_FAILURE() << info.status(), -1;
  EXPECT_EQ(info->weight_format(), stored);
  EXPECT_EQ(info->model().expert_math(), kMath);
  EXPECT_EQ(info->model().routing(), "topk_softmax");
  const ModelSpec& spec = reference.spec();
  const int layer = spec.moe_layers.back();
  const Batch b = RandomBatch(spec, 19, 23);
  absl::StatusOr<std::vector<bf16_t>> got =
      client->Forward(ExpertClient::MakeRequest(layer, b.T, spec.hidden, b.x.data(), b.routing(), 1));
  if (!got.ok()) return ADD_FAILURE() << got.status(), -1;
  const size_t n = got->size();
  std::vector<double> ref(n), free_ref(n);
  EXPECT_TRUE(ReferenceMoe(reference).Forward<double>(layer, b.T, b.x.data(), b.routing(), ref.data()).ok());
  ModelSpec unclamped = spec;
  unclamped.activation.limit = 1e30f;
  // The reference's values with the clamp lifted: a source over the same experts.
  class Unclamped final : public ModelSource {
   public:
    Unclamped(const ModelSource& base, ModelSpec spec) : base_(base), spec_(std::move(spec)) {}
    const ModelSpec& spec() const override { return spec_; }
    std::string Describe() const override { return "unclamped " + base_.Describe(); }
    absl::Status ReadExpert(int l, int e, ExpertWeights* out) const override { return base_.ReadExpert(l, e, out); }
    uint64_t Identity() const override { return base_.Identity(); }

   private:
    const ModelSource& base_;
    ModelSpec spec_;
  } free_source(reference, unclamped);
  EXPECT_TRUE(ReferenceMoe(free_source).Forward<double>(layer, b.T, b.x.data(), b.routing(), free_ref.data()).ok());
  *unclamped_gap = RelativeL2Error(free_ref.data(), ref.data(), n);
  std::vector<float> f(n);
  Bf16ToF32(got->data(), f.data(), n);
  return RelativeL2Error(f.data(), ref.data(), n);
}

// The server on moe-make-model's bf16 tiny-gpt-oss GGUF serves the layer the
// safetensors checkpoint of the same seed defines (f64 reference of the
// checkpoint's values) within bf16's bound.
TEST(GptOssGguf, ServerOnBf16GgufMatchesTheCheckpointReference) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt", path = dir.path() + "/m.gguf";
  ASSERT_TRUE(MakeCheckpoint(ckpt));
  ASSERT_TRUE(MakeModel({"--preset=tiny-gpt-oss", "--seed=" + std::to_string(kSeed), "--out=" + path}));
  std::unique_ptr<ModelSource> st = *OpenModel(ckpt);
  double gap = 0;
  const double err = ServedGgufError(path, "bf16", *st, &gap);
  std::printf("[gpt-oss gguf] bf16 tiny-gpt-oss served: relative error %.3g (unclamped reference %.3g away)\n", err, gap);
  EXPECT_GT(err, 0);
  EXPECT_LE(err, 1e-2);
  EXPECT_GT(gap, 0.1) << "the clamp changes nothing here";
}

// GPT-OSS-20B's expert shape (H = I = 2880; one layer, 4 of its experts) in
// MXFP4 through moe-make-model's writer: the values read are the stored
// blocks' exactly (and the synthetic mxfp4 model's of the same seed), the
// biases the generator's, --weight-dtype auto keeps them as mxfp4 (unpacked:
// the same values), and a real server on the file computes the layer within
// bf16's bound of the f64 reference over those stored values.
TEST(GptOssGguf, Mxfp4GgufIsServedWithItsStoredValues) {
  TempDir dir;
  const std::string path = dir.path() + "/m.gguf";
  ModelSpec spec = *PresetSpec("gpt-oss-20b", 1);
  spec.num_experts = 4;
  ASSERT_TRUE(WriteSyntheticGguf(path, spec, 5, GgmlType::kMXFP4).ok());
  absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(path);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->spec().quant.gguf_mxfp4);
  EXPECT_TRUE((*m)->spec().expert_biases);
  const ExpertGeometry g = *StorageGeometry((*m)->spec(), "auto");
  EXPECT_EQ(g.format, WeightFormat::kMxfp4);
  EXPECT_TRUE(g.biases);
  std::unique_ptr<GgufFile> f = *GgufFile::Open(path);
  std::unique_ptr<ModelSource> synth = *OpenModel("synthetic:gpt-oss-20b:layers=1:experts=4:seed=5:dtype=mxfp4");
  const int64_t n = int64_t{spec.hidden} * spec.intermediate;
  std::vector<float> stored(n);
  ExpertWeights w, s;
  for (int e : {0, 3}) {
    ASSERT_TRUE((*m)->ReadExpert(0, e, &w).ok());
    ASSERT_TRUE(synth->ReadExpert(0, e, &s).ok());
    for (auto [name, ours, theirs] : {std::tuple{"gate", &w.gate, &s.gate}, std::tuple{"up", &w.up, &s.up},
                                      std::tuple{"down", &w.down, &s.down}}) {
      const GgufTensor* t = f->Find(absl::StrCat("blk.0.ffn_", name, "_exps.weight"));
      ASSERT_EQ(t->type, static_cast<uint32_t>(GgmlType::kMXFP4));
      DequantizeGgml(GgmlType::kMXFP4, t->data + t->nbytes / 4 * e, n, stored.data());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bf16ToF32((*ours)[i]), stored[i]) << name << " " << i;
        ASSERT_EQ(Bf16ToF32((*ours)[i]), Bf16ToF32((*theirs)[i])) << name << " " << i;  // +0 and -0 alike
      }
    }
    EXPECT_EQ(w.gate_bias, s.gate_bias);
    EXPECT_EQ(w.up_bias, s.up_bias);
    EXPECT_EQ(w.down_bias, s.down_bias);
  }
  // Stored natively: the packed expert unpacks to the file's values.
  std::vector<bf16_t> packed_expert;
  {
    const size_t bytes = (g.packed_bytes() + 63) / 64 * 64;
    std::unique_ptr<std::byte, decltype(&std::free)> packed(static_cast<std::byte*>(std::aligned_alloc(64, bytes)), &std::free);
    ASSERT_TRUE((*m)->ReadExpert(0, 2, &w).ok());
    PackExpert(g, w.gate.data(), w.up.data(), w.down.data(), packed.get(), w.gate_bias.data(), w.up_bias.data(),
               w.down_bias.data());
    std::vector<float> back(3 * n);
    UnpackExpert(g, packed.get(), back.data(), back.data() + n, back.data() + 2 * n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], Bf16ToF32(w.gate[i])) << i;
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[2 * n + i], Bf16ToF32(w.down[i])) << i;
  }
  double gap = 0;
  const double err = ServedGgufError(path, "mxfp4", **m, &gap);
  std::printf("[gpt-oss gguf] mxfp4 gpt-oss-20b shape served: relative error %.3g (unclamped reference %.3g away)\n", err,
              gap);
  EXPECT_GT(err, 0);
  EXPECT_LE(err, 1e-2);
  EXPECT_GT(gap, 0.1) << "the clamp changes nothing here";
}

// A gpt-oss GGUF without one bias tensor, with a misshapen or integer one, or
// with llama.cpp's gating key saying another routing, is refused in one line
// naming the tensor or key.
TEST(GptOssGguf, BadFilesAreRefusedNamingTheTensor) {
  TempDir dir;
  const std::string good = dir.path() + "/good.gguf";
  ASSERT_TRUE(WriteSyntheticGguf(good, *PresetSpec("tiny-gpt-oss", 1), 1, GgmlType::kBF16).ok());
  ASSERT_TRUE(OpenModel(good).ok());
  const std::unique_ptr<GgufFile> src = *GgufFile::Open(good);
  // Rewrites the good file with its tensors edited by `edit` (dropped when
  // it returns false) and `extra` metadata.
  auto rewrite = [&](const std::function<bool(GgufTensorSpec&)>& edit, std::vector<GgufKv> extra = {}) {
    std::vector<GgufKv> kv = {{"general.architecture", std::string("gpt-oss")}};
    for (const char* k : {"block_count", "embedding_length", "expert_count", "expert_used_count", "expert_feed_forward_length"})
      kv.push_back({absl::StrCat("gpt-oss.", k), static_cast<uint32_t>(*src->Int(absl::StrCat("gpt-oss.", k)))});
    for (GgufKv& e : extra) kv.push_back(std::move(e));
    std::vector<GgufTensorSpec> tensors;
    std::vector<const GgufTensor*> from;
    for (const GgufTensor& t : src->tensors()) {
      GgufTensorSpec spec{t.name, static_cast<GgmlType>(t.type), t.dims};
      if (!edit(spec)) continue;
      tensors.push_back(spec);
      from.push_back(&t);
    }
    const std::string path = dir.path() + "/bad.gguf";
    EXPECT_TRUE(WriteGguf(path, kv, tensors, [&](size_t i, std::span<std::byte> dst) {
                  std::memcpy(dst.data(), from[i]->data, std::min(dst.size(), from[i]->nbytes));
                }).ok());
    return OpenModel(path).status();
  };
  EXPECT_TRUE(rewrite([](GgufTensorSpec&) { return true; }).ok());
  struct Case {
    const char* what;
    std::function<bool(GgufTensorSpec&)> edit;
    std::vector<GgufKv> extra;
    const char* names;
  };
  const std::vector<Case> cases = {
      {"a missing bias", [](GgufTensorSpec& t) { return t.name != "blk.0.ffn_up_exps.bias"; }, {},
       "no tensor blk.0.ffn_up_exps.bias (gpt-oss experts carry biases)"},
      {"a bias of the wrong shape",
       [](GgufTensorSpec& t) {
         if (t.name == "blk.0.ffn_down_exps.bias") t.dims = {80, 8};
         return true;
       },
       {}, "blk.0.ffn_down_exps.bias: dims [80,8], expected [96,8]"},
      {"an integer bias",
       [](GgufTensorSpec& t) {
         if (t.name == "blk.0.ffn_gate_exps.bias") t.type = static_cast<GgmlType>(26);  // I32
         return true;
       },
       {}, "blk.0.ffn_gate_exps.bias: type I32"},
      {"an expert tensor of the wrong shape",
       [](GgufTensorSpec& t) {
         if (t.name == "blk.0.ffn_up_exps.weight") t.dims = {96, 64, 8};
         return true;
       },
       {}, "blk.0.ffn_up_exps.weight: dims [96,64,8]"},
      {"softmax-then-top-k gating", [](GgufTensorSpec&) { return true; },
       {{"gpt-oss.expert_gating_func", uint32_t{1}}}, "gpt-oss.expert_gating_func: 1 is not top-k then softmax"},
  };
  for (const Case& c : cases) {
    const absl::Status st = rewrite(c.edit, c.extra);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << st;
    EXPECT_NE(st.message().find(c.names), std::string::npos) << c.what << ": " << st;
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << c.what;
  }
}

}  // namespace
}  // namespace moe
