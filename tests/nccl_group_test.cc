// The tensor-parallel contract with a real all-reduce (issue 26): one
// session per GPU, each rank rank r of the group, every rank given the same
// tokens; each returns its share and ncclAllReduce on its stream sums them —
// the layer's output, equal to the reference MoE on every rank. Needs two
// CUDA GPUs and NCCL: skipped by name otherwise (the CI machine has none).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/model_source.h"
#include "core/reference_moe.h"
#include "gtest/gtest.h"
#include "moe/engine.h"
#include "tests/device_call.h"
#include "tests/test_support.h"

namespace moe {
namespace {

const char kModel[] = "synthetic:demo:layers=2:seed=41";  // H=512, 32 experts, top-4
constexpr int kH = 512, kE = 32, kK = 4, kRanks = 2;

TEST(NcclTensorParallel, TwoGpusAllReduceTheirSharesIntoTheLayer) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < kRanks)
    GTEST_SKIP() << "needs " << kRanks << " CUDA GPUs, found " << devices;
  testing::TempDir dir;
  std::vector<std::unique_ptr<Subprocess>> servers;
  const std::string server = testing::StartTestServer(servers, dir.path(), kModel, /*shm=*/true);
  ASSERT_FALSE(server.empty());
  std::unique_ptr<ModelSource> source = *OpenModel(kModel);
  ReferenceMoe reference(*source);
  std::vector<ncclComm_t> comms(kRanks);
  int devs[kRanks] = {0, 1};
  ASSERT_EQ(ncclCommInitAll(comms.data(), kRanks, devs), ncclSuccess);

  // The same tokens and routing on both ranks, per (step, layer).
  auto batch = [](int step, int layer, int T, std::vector<bf16_t>* x, std::vector<int32_t>* ids,
                  std::vector<float>* w) {
    std::mt19937_64 rng(1000 * step + layer);
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
  };
  std::vector<std::vector<double>> errors(kRanks);
  std::vector<std::string> failures(kRanks);
  auto rank_main = [&](int r) {
    cudaSetDevice(r);  // the session opens on the current GPU
    SessionOptions o;
    o.model = kModel;
    o.servers = {server};
    o.device = "cuda";
    o.cache_experts_per_layer = 4;
    o.policy = "lru";
    o.max_tokens = 512;
    o.max_top_k = kK;
    o.group = TensorParallelGroup{r, kRanks};
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
        batch(step, layer, T, &x, &ids, &w);
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
        const std::vector<bf16_t> out = dev.Output();
        std::vector<double> ref(out.size());
        if (!reference.Forward<double>(layer, T, x.data(), RoutingView{T, kK, ids.data(), w.data()}, ref.data()).ok())
          failures[r] = "reference";
        std::vector<float> got(out.size());
        for (size_t i = 0; i < out.size(); ++i) got[i] = Bf16ToF32(out[i]);
        errors[r].push_back(RelativeL2Error(got.data(), ref.data(), ref.size()));
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

}  // namespace
}  // namespace moe
