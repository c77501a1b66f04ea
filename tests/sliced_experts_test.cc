// Sliced experts (issue 26 point 2): a server holding slice i/n of every
// expert's intermediate dimension (--slice) computes a partial output, and
// the worker sends the same pairs to one holder of every slice and adds the
// partials. Proven against the reference MoE of the whole model through real
// server processes (shm and gRPC), the cpu backend (and the cuda one where a
// GPU is), plus the pure pieces: SliceRange, SliceModel, RouteExpert, and the
// refusals that keep a partial from being added as the wrong share.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "client/expert_client.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "gpu_worker/device_backend.h"
#include "gpu_worker/host_expert_store.h"
#include "gpu_worker/layer_dispatcher.h"
#include "gpu_worker/miss_plan.h"
#include "gtest/gtest.h"
#include "tests/device_call.h"
#include "tests/test_support.h"

namespace moe {
namespace {

// H=512, I=256, 32 experts, top-4, MoE layers 0 and 1.
const char kModel[] = "synthetic:demo:layers=2:seed=21";
constexpr int kH = 512, kE = 32;

TEST(SliceRange, CutsAtMultiplesOf128Or64AndCoversTheDimension) {
  for (int I : {256, 768, 2048, 14336, 320}) {
    for (int n = 1; n <= kMaxSlices; ++n) {
      int next = 0;
      for (int i = 0; i < n; ++i) {
        absl::StatusOr<std::pair<int, int>> r = SliceRange(I, ExpertSlice{i, n});
        if (I / 64 < n) {
          EXPECT_FALSE(r.ok()) << I << " " << n;
          break;
        }
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->first, next);
        EXPECT_GT(r->second, r->first);
        EXPECT_EQ(r->first % 64, 0);
        next = r->second;
      }
      if (I / 64 >= n) {
        EXPECT_EQ(next, I) << I << " " << n;
      }
    }
  }
  EXPECT_EQ(*SliceRange(768, ExpertSlice{1, 2}), std::make_pair(384, 768));
  EXPECT_FALSE(SliceRange(80, ExpertSlice{0, 2}).ok());  // not a multiple of 64
  EXPECT_FALSE(SliceRange(256, ExpertSlice{2, 2}).ok());
}

TEST(ParseSlice, AcceptsIOverNAndNamesTheFlagOtherwise) {
  EXPECT_EQ(*ParseSlice("1/4"), (ExpertSlice{1, 4}));
  EXPECT_TRUE(ParseSlice("0/1")->whole());
  for (const char* bad : {"", "1", "2/2", "-1/2", "0/0", "0/9", "a/b", "1/2/3"}) {
    absl::StatusOr<ExpertSlice> s = ParseSlice(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("--slice"), std::string::npos);
  }
}

// The reference MoE of every slice adds up to the whole model's (f64: exact
// to rounding), on random tokens and routing.
TEST(SliceModel, PartialOutputsOfAllSlicesAddUpToTheWholeExpert) {
  std::unique_ptr<ModelSource> whole = *OpenModel(kModel);
  ReferenceMoe full(*whole);
  const int T = 5, k = 4;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<bf16_t> x(static_cast<size_t>(T) * kH);
  for (bf16_t& v : x) v = F32ToBf16(u(rng));
  std::vector<int32_t> ids(T * k);
  std::vector<float> w(T * k);
  for (int i = 0; i < T * k; ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + 3) % kE);
    w[i] = 0.2f + 0.1f * static_cast<float>(i % 5);
  }
  const RoutingView r{T, k, ids.data(), w.data()};
  std::vector<double> want(x.size()), sum(x.size(), 0.0), part(x.size());
  ASSERT_TRUE(full.Forward<double>(1, T, x.data(), r, want.data()).ok());
  for (int n : {2, 3}) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::unique_ptr<ModelSource>> s = SliceModel(*OpenModel(kModel), ExpertSlice{i, n});
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_LT((*s)->spec().intermediate, 256);
      ReferenceMoe ref(**s);
      ASSERT_TRUE(ref.Forward<double>(1, T, x.data(), r, part.data()).ok());
      for (size_t j = 0; j < sum.size(); ++j) sum[j] += part[j];
    }
    double err = 0, norm = 0;
    for (size_t j = 0; j < sum.size(); ++j) {
      err += (sum[j] - want[j]) * (sum[j] - want[j]);
      norm += want[j] * want[j];
    }
    ASSERT_GT(norm, 0);
    EXPECT_LT(std::sqrt(err / norm), 1e-9) << n << " slices";
  }
}

// RouteExpert: a whole server alone; one holder of every slice together;
// an incomplete set of slices passed over.
TEST(RouteExpert, OneHolderOfEverySliceOrTheNextCompleteChoice) {
  std::vector<bool> all(8, true), low(8, false);
  for (int e = 0; e < 4; ++e) low[e] = true;
  std::vector<PlanServer> s = {
      PlanServer{true, &all, 1, ExpertSlice{0, 2}},  // 0
      PlanServer{true, &low, 1, ExpertSlice{1, 2}},  // 1: slice 1 of experts 0-3 only
      PlanServer{true, &all, 1, ExpertSlice{}},      // 2: whole
      PlanServer{true, &all, 1, ExpertSlice{1, 2}},  // 3
  };
  EXPECT_EQ(RouteExpert(s.data(), 4, 2), 0b0011u);  // slices 0 and 1 (the first holder of each)
  EXPECT_EQ(RouteExpert(s.data(), 4, 6), 0b1001u);  // server 1 lacks expert 6: server 3 holds its slice 1
  s[3].up = false;
  EXPECT_EQ(RouteExpert(s.data(), 4, 6), 0b0100u);  // no slice 1 up: the whole server
  s[2].up = false;
  EXPECT_EQ(RouteExpert(s.data(), 4, 6), 0u);       // none: the worker copies it
  s[0].up = false;
  EXPECT_EQ(RouteExpert(s.data(), 4, 2), 0u);       // slice 1 alone is no route
}

// Replicas share the load: with two servers of every expert, the layers take
// turns over them (every expert of a layer's call on one, so the call is one
// request; the same one for every worker); a replica that is down leaves its
// share to the other. A search from another start finds that start's holders
// first, round to the ones before it.
TEST(RouteExpert, ReplicasTakeTurnsByLayer) {
  std::vector<bool> all(128, true);
  std::vector<PlanServer> s = {PlanServer{true, &all, 1, ExpertSlice{}}, PlanServer{true, &all, 1, ExpertSlice{}}};
  int on[2] = {0, 0};
  for (int layer = 0; layer < 8; ++layer) {
    const uint64_t first = RouteExpert(s.data(), 2, 0, ReplicaStart(layer, 2));
    ASSERT_TRUE(first == 0b01u || first == 0b10u) << first;
    for (int e = 0; e < 128; ++e) EXPECT_EQ(RouteExpert(s.data(), 2, e, ReplicaStart(layer, 2)), first);
    EXPECT_NE(first, RouteExpert(s.data(), 2, 0, ReplicaStart(layer + 1, 2))) << "the next layer, the other replica";
    ++on[first == 0b10u];
  }
  EXPECT_EQ(on[0], 4);
  EXPECT_EQ(on[1], 4);
  s[1].up = false;
  for (int layer = 0; layer < 4; ++layer) EXPECT_EQ(RouteExpert(s.data(), 2, 5, ReplicaStart(layer, 2)), 0b01u);
  // Three replicas: each takes a third of the layers.
  s.push_back(PlanServer{true, &all, 1, ExpertSlice{}});
  s[1].up = true;
  for (int layer = 0; layer < 6; ++layer)
    EXPECT_EQ(RouteExpert(s.data(), 3, 0, ReplicaStart(layer, 3)), uint64_t{1} << (layer % 3));
  // Slices from a start: the holders at or after it first.
  std::vector<PlanServer> sl = {
      PlanServer{true, &all, 1, ExpertSlice{0, 2}}, PlanServer{true, &all, 1, ExpertSlice{1, 2}},
      PlanServer{true, &all, 1, ExpertSlice{0, 2}}, PlanServer{true, &all, 1, ExpertSlice{1, 2}}};
  EXPECT_EQ(RouteExpert(sl.data(), 4, 5, 0), 0b0011u);
  EXPECT_EQ(RouteExpert(sl.data(), 4, 5, 2), 0b1100u);
  EXPECT_EQ(RouteExpert(sl.data(), 4, 5, 3), 0b1001u);  // slice 1 at 3, slice 0 round at 0
  sl[2].up = false;
  EXPECT_EQ(RouteExpert(sl.data(), 4, 5, 2), 0b1001u);  // from 3: slice 1 there, slice 0 round at 0
}

struct Batch {
  int T = 0, k = 0;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  RoutingView routing() const { return RoutingView{T, k, ids.data(), w.data()}; }
};

Batch RandomBatch(int T, int k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1), pw(0.1f, 1);
  Batch b{T, k, std::vector<bf16_t>(static_cast<size_t>(T) * kH), std::vector<int32_t>(T * k), std::vector<float>(T * k)};
  for (bf16_t& v : b.x) v = F32ToBf16(u(rng));
  for (int t = 0; t < T; ++t) {
    std::vector<int> pool(kE);
    for (int e = 0; e < kE; ++e) pool[e] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < k; ++j) {
      b.ids[t * k + j] = pool[j];
      b.w[t * k + j] = pw(rng);
    }
  }
  return b;
}

// Parameter: (device backend, transport).
class SlicedServersTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (!MakeDeviceBackend(backend_name()).ok()) GTEST_SKIP() << backend_name() << " backend unavailable";
    source_ = *OpenModel(kModel);
    reference_ = std::make_unique<ReferenceMoe>(*source_);
  }
  const std::string& backend_name() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()) == "shm"; }

  // A server with `extra` flags; the address the worker uses.
  std::string StartServer(const std::vector<std::string>& extra) {
    const std::string addr = testing::StartTestServer(servers_, dir_.path(), kModel, shm(), extra);
    EXPECT_FALSE(addr.empty());
    return addr;
  }

  std::unique_ptr<LayerDispatcher> Make(const std::vector<std::string>& addresses) {
    DispatcherConfig c;
    for (const std::string& a : addresses) c.servers.push_back(*ParseExpertServer(a, kE));
    c.transport.tls = testing::PlaintextTls();
    c.transport.max_tokens_per_slot = 32;
    c.max_tokens = 128;
    c.max_top_k = 4;
    c.measure_rates = false;
    c.copy_mode = CopyMode::kNever;
    c.deadline = std::chrono::milliseconds(10000);
    backend_ = *MakeDeviceBackend(backend_name());
    host_ = *HostExpertStore::Load(*source_, {0, 1}, ExpertGeometry::For(kH, 256), backend_.get(), 2);
    absl::StatusOr<std::unique_ptr<LayerDispatcher>> d =
        LayerDispatcher::Create(source_->spec(), *backend_, host_.get(), std::move(c));
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }

  double Forward(LayerDispatcher& d, int layer, const Batch& b, CallStats* st, absl::Status* status = nullptr) {
    std::vector<bf16_t> out(b.x.size(), F32ToBf16(123.0f));
    LayerCall call;
    call.batch = MoeBatch{layer, b.T, b.x.data(), b.routing()};
    call.out = out.data();
    absl::Status s = d.Forward(call, st);
    if (status != nullptr) *status = s;
    if (!s.ok()) return -1;
    std::vector<double> ref(out.size());
    EXPECT_TRUE(reference_->Forward<double>(layer, b.T, b.x.data(), b.routing(), ref.data()).ok());
    std::vector<float> got(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
    return RelativeL2Error(got.data(), ref.data(), ref.size());
  }

  testing::TempDir dir_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
  std::unique_ptr<ModelSource> source_;
  std::unique_ptr<ReferenceMoe> reference_;
  std::unique_ptr<DeviceBackend> backend_;
  std::unique_ptr<HostExpertStore> host_;
};

TEST_P(SlicedServersTest, TwoHalvesAddUpToTheWholeModel) {
  const std::string a = StartServer({"--slice=0/2"}), b = StartServer({"--slice=1/2"});
  std::unique_ptr<LayerDispatcher> d = Make({a, b});
  ASSERT_NE(d, nullptr);
  for (int T : {1, 7, 100}) {
    const Batch x = RandomBatch(T, 4, 100 + T);
    CallStats st;
    const double err = Forward(*d, 1, x, &st);
    EXPECT_GE(err, 0);
    EXPECT_LE(err, 1e-2) << "T=" << T;
    EXPECT_EQ(st.cpu_pairs, T * 4);
    EXPECT_EQ(st.copied_pairs, 0);
  }
}

TEST_P(SlicedServersTest, ThreeSlicesBesideAWholeServerThatTakesOverWhenOneDies) {
  const std::string s0 = StartServer({"--slice=0/3"}), s1 = StartServer({"--slice=1/3"}),
                    s2 = StartServer({"--slice=2/3"}), whole = StartServer({});
  std::unique_ptr<LayerDispatcher> d = Make({s0, s1, s2, whole});
  ASSERT_NE(d, nullptr);
  const Batch x = RandomBatch(20, 4, 7);
  CallStats st;
  EXPECT_LE(Forward(*d, 0, x, &st), 1e-2);
  servers_[1]->Signal(SIGKILL);
  servers_[1]->Wait(std::chrono::seconds(5));
  // The call that meets the dead slice fails (UNAVAILABLE) or succeeds — a
  // partial is never counted twice or lost; later calls route around it.
  absl::Status s;
  const double first = Forward(*d, 0, x, &st, &s);
  if (s.ok()) {
    EXPECT_LE(first, 1e-2);
  } else {
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_NE(s.message().find("slice 1/3"), std::string::npos) << s;
  }
  for (int i = 0; i < 3; ++i) {
    const Batch y = RandomBatch(20, 4, 30 + i);
    absl::Status later;
    const double err = Forward(*d, 0, y, &st, &later);
    ASSERT_TRUE(later.ok()) << later;
    EXPECT_LE(err, 1e-2);
  }
}

#ifdef MOE_HAVE_CUDA
// The device-driven path (a call in device memory that fits a request slot):
// the GPU writes every slice holder's request, adds the partials; when a
// slice holder dies, the combine computes that share from the host copy.
TEST_P(SlicedServersTest, DevicePathShipsToEverySliceAndRecomputesALostShare) {
  if (backend_name() != "cuda") GTEST_SKIP() << "the device path needs the cuda backend";
  const std::string a = StartServer({"--slice=0/2"}), b = StartServer({"--slice=1/2"});
  std::unique_ptr<LayerDispatcher> d = Make({a, b});
  ASSERT_NE(d, nullptr);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {  // slice 1 gone: its requests time out and its share comes from the host copy
      servers_[1]->Signal(SIGKILL);
      servers_[1]->Wait(std::chrono::seconds(5));
    }
    for (int T : {1, 16}) {
      const Batch x = RandomBatch(T, 4, 300 + T + 10 * round);
      testing::DeviceCall dev(x.x, x.ids, x.w);
      ASSERT_TRUE(dev.ok());
      LayerCall call;
      call.batch = MoeBatch{1, T, dev.x(), RoutingView{T, 4, dev.ids(), dev.weights()}};
      call.out = dev.out();
      call.kind = MemoryKind::kDevice;
      CallStats st;
      absl::Status s = d->Forward(call, &st);
      const std::vector<bf16_t> out = dev.Output();
      if (round == 1 && !s.ok()) {  // the call that met the dead server may report it; never a wrong sum
        EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
        continue;
      }
      ASSERT_TRUE(s.ok()) << s;
      std::vector<double> ref(out.size());
      ASSERT_TRUE(reference_->Forward<double>(1, T, x.x.data(), x.routing(), ref.data()).ok());
      std::vector<float> got(out.size());
      for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
      EXPECT_LE(RelativeL2Error(got.data(), ref.data(), ref.size()), 1e-2) << "T=" << T << " round " << round;
      if (round == 0) {
        EXPECT_EQ(st.cpu_pairs, T * 4);
      }
    }
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, SlicedServersTest,
                         ::testing::Combine(::testing::Values("cpu", "cuda"), ::testing::Values("shm", "grpc")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// The wire carries the expected share: a whole-expert request to a sliced
// server, or the wrong slice, is refused with FAILED_PRECONDITION naming the
// field, never answered as a partial the client would add as a whole.
TEST(SlicedServer, RefusesRequestsThatExpectAnotherShare) {
  testing::TempDir dir;
  Subprocess* raw = nullptr;
  const std::string addr = testing::StartExpertServer(&raw, {std::string("--model=") + kModel, "--threads=1",
                                                             "--slice=1/2"});
  std::unique_ptr<Subprocess> server(raw);
  ASSERT_FALSE(addr.empty());
  std::unique_ptr<ExpertClient> c = *ExpertClient::Connect(addr, testing::PlaintextTls());
  absl::StatusOr<moe::v1::ServerInfo> info = c->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->slice_index(), 1u);
  EXPECT_EQ(info->slice_count(), 2u);
  EXPECT_EQ(info->model().intermediate_size(), 256u);  // the whole model's geometry
  const Batch x = RandomBatch(2, 4, 5);
  moe::v1::ForwardRequest req = ExpertClient::MakeRequest(1, 2, kH, x.x.data(), x.routing());
  moe::v1::ForwardResponse resp;
  absl::Status s = c->Call(req, &resp);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("slice_index/slice_count"), std::string::npos) << s;
  req.set_slice_index(0);
  req.set_slice_count(2);
  EXPECT_TRUE(absl::IsFailedPrecondition(c->Call(req, &resp)));
  req.set_slice_index(1);
  ASSERT_TRUE(c->Call(req, &resp).ok());
  // A bad --slice is a one-line refusal with exit 2.
  Subprocess* bad = nullptr;
  EXPECT_TRUE(testing::StartExpertServer(&bad, {std::string("--model=") + kModel, "--slice=2/2"}).empty());
  delete bad;
  Subprocess* tiny = nullptr;  // I = 80 cannot be cut at multiples of 64
  EXPECT_TRUE(testing::StartExpertServer(&tiny, {"--model=synthetic:tiny", "--slice=0/2"}).empty());
  delete tiny;
}


// Servers whose slices do not add up to an expert (one half running alone):
// a worker says so at its start, naming the experts and the shares it found;
// with every share up it says nothing.
TEST(SlicedServer, AWorkerWarnsOfExpertsItsServersHoldOnlyInPart) {
  testing::TempDir dir;
  std::vector<std::unique_ptr<Subprocess>> servers;
  std::vector<std::string> addresses;
  for (const char* slice : {"--slice=1/2", "--slice=0/2"}) {
    Subprocess* raw = nullptr;
    addresses.push_back(testing::StartExpertServer(&raw, {std::string("--model=") + kModel, "--threads=1", slice}));
    servers.emplace_back(raw);
    ASSERT_FALSE(addresses.back().empty());
  }
  auto worker_log = [&](const std::string& servers_flag, const std::string& name) {
    const std::string err = dir.path() + "/" + name + ".err";
    Subprocess worker(testing::BinaryPath("moe-gpu-worker"),
                      {std::string("--model=") + kModel, "--servers=" + servers_flag, "--device=cpu",
                       "--cpu-threads=1", "--listen=127.0.0.1:0", "--insecure"},
                      err);
    const std::string line = worker.ReadLine(std::chrono::seconds(30));
    EXPECT_NE(line.find("ready on "), std::string::npos) << line;
    std::ifstream in(err);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string alone = worker_log(addresses[0], "alone");
  EXPECT_NE(alone.find("are held only in part (e.g. slices 1/2 of expert 0)"), std::string::npos) << alone;
  const std::string both = worker_log(addresses[0] + "," + addresses[1], "both");
  EXPECT_EQ(both.find("held only in part"), std::string::npos) << both;
}

}  // namespace
}  // namespace moe
