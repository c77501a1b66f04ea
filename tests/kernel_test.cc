// Every expert kernel (amx, avx512, reference) through the real executor
// (grouping, gather, fused gate+up+SiLU, fused down + weighted accumulation,
// the pinned thread pool) against the f64 reference MoE, on random non-zero
// data. Tolerance: relative L2 error <= 1e-2 (bf16 weights and activations).
// Kernels this CPU lacks are reported as skipped, by name.
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "core/model_source.h"
#include "core/random_data.h"
#include "core/reference_moe.h"
#include "cpu_compute/compute_pool.h"
#include "cpu_compute/cpu_features.h"
#include "cpu_compute/expert_kernel.h"
#include "cpu_compute/expert_store.h"
#include "cpu_compute/moe_executor.h"
#include "cpu_compute/numa_binding.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr double kTolerance = 1e-2;

struct Shape {
  int H, I, experts, k;
};

std::unique_ptr<ExpertKernel> KernelOrSkip(const std::string& name) {
  absl::StatusOr<std::unique_ptr<ExpertKernel>> k = MakeExpertKernel(name, CpuFeatures::Get());
  if (!k.ok()) return nullptr;
  return *std::move(k);
}

class KernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  // Runs `n` random tokens through layer 1 of a random model of `shape` and
  // compares with the f64 reference; tokens t with t % 7 == 3 get no pairs.
  void Check(const Shape& shape, int n, int threads, DType out_dtype, uint64_t seed) {
    std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(GetParam());
    ASSERT_NE(kernel, nullptr);
    ModelSpec spec;
    spec.model_type = "test";
    spec.num_layers = 2;
    spec.moe_layers = {1};
    spec.num_experts = shape.experts;
    spec.top_k = shape.k;
    spec.hidden = shape.H;
    spec.intermediate = shape.I;
    std::unique_ptr<ModelSource> source = MakeSyntheticSource(spec, seed);
    absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", threads);
    ASSERT_TRUE(numa.ok()) << numa.status();
    ComputePool pool(**numa);
    HostedSet hosted{{1}, {}};
    for (int e = 0; e < shape.experts; ++e) hosted.experts.push_back(e);
    absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(*source, hosted, **numa, pool);
    ASSERT_TRUE(store.ok()) << store.status();
    MoeExecutor exec(**store, *kernel, pool);

    std::vector<bf16_t> x = RandomActivations(size_t(n) * shape.H, seed + 1);
    std::vector<int32_t> ids;
    std::vector<float> w;
    RandomRouting(n, shape.k, shape.experts, seed + 2, 0.8, &ids, &w);
    for (int t = 3; t < n; t += 7) {
      for (int j = 0; j < shape.k; ++j) ids[size_t(t) * shape.k + j] = -1;
    }
    RoutingView r{n, shape.k, ids.data(), w.data()};

    std::vector<double> ref(size_t(n) * shape.H);
    ReferenceMoe reference(*source);
    ASSERT_TRUE(reference.Forward<double>(1, n, x.data(), r, ref.data()).ok());

    // Poison the output: every element must be written.
    std::vector<float> got(size_t(n) * shape.H);
    std::vector<bf16_t> got16(size_t(n) * shape.H, F32ToBf16(NAN));
    std::fill(got.begin(), got.end(), std::numeric_limits<float>::quiet_NaN());
    ForwardStats stats;
    MoeBatch batch{1, n, x.data(), r};
    absl::Status st = out_dtype == DType::kF32 ? exec.Forward(batch, DType::kF32, got.data(), &stats)
                                               : exec.Forward(batch, DType::kBF16, got16.data(), &stats);
    ASSERT_TRUE(st.ok()) << st;
    if (out_dtype == DType::kBF16) Bf16ToF32(got16.data(), got.data(), got.size());
    for (int t = 3; t < n; t += 7) {
      for (int h = 0; h < shape.H; ++h) ASSERT_EQ(got[size_t(t) * shape.H + h], 0.0f) << "token without pairs";
    }
    if (n == 0) return;
    const double err = RelativeL2Error(got.data(), ref.data(), got.size());
    EXPECT_LE(err, kTolerance) << GetParam() << " H=" << shape.H << " I=" << shape.I << " n=" << n;
    RecordProperty("rel_error", std::to_string(err));
    CheckRunWithUnpaddedLastGroup(exec, shape, n, x, r, ref);
  }

  // Run() on groups whose last one ends unpadded, as a GPU worker hands over
  // one copied expert's rows. The rows past the end (still inside the
  // vectors' capacity) hold a token far out of range: an executor that let a
  // kernel read whole row blocks of the caller's arrays would write there and
  // crash (it did, with AMX's 16-row blocks, before the executor padded them).
  void CheckRunWithUnpaddedLastGroup(MoeExecutor& exec, const Shape& shape, int n, const std::vector<bf16_t>& x,
                                     const RoutingView& r, const std::vector<double>& ref) {
    ExpertGroups groups;
    GroupByExpert(r, shape.experts, exec.row_align(), &groups);
    if (groups.num_groups() == 0) return;
    const int last = groups.num_groups() - 1;
    const int end = groups.row_begin[last] + groups.count[last];
    for (int row = end; row < groups.total_rows; ++row) {
      groups.token[row] = 1 << 30;
      groups.weight[row] = 1.0f;
    }
    groups.total_rows = end;
    groups.token.resize(end);
    groups.weight.resize(end);
    std::vector<float> run(size_t(n) * shape.H, std::numeric_limits<float>::quiet_NaN());
    absl::Status st = exec.Run(1, n, x.data(), groups, nullptr, DType::kF32, run.data(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LE(RelativeL2Error(run.data(), ref.data(), run.size()), kTolerance)
        << GetParam() << " Run, unpadded last group, n=" << n;
  }

  void SetUp() override {
    if (KernelOrSkip(GetParam()) == nullptr)
      GTEST_SKIP() << "kernel " << GetParam() << " needs an ISA this CPU lacks ("
                   << CpuFeatures::Get().Summary() << ")";
  }
};

TEST_P(KernelTest, ZeroAndOneToken) {
  Check({96, 80, 8, 2}, 0, 2, DType::kF32, 1);
  Check({96, 80, 8, 2}, 1, 2, DType::kF32, 2);
  Check({128, 64, 4, 1}, 1, 1, DType::kBF16, 3);
}

TEST_P(KernelTest, TokenCountsOffTheBlock) {
  for (int n : {2, 7, 15, 16, 17, 31, 33, 50}) Check({96, 80, 8, 2}, n, 2, DType::kF32, 10 + n);
}

TEST_P(KernelTest, ShapesNotMultiplesOf64) {
  Check({80, 48, 6, 3}, 19, 2, DType::kF32, 20);
  Check({200, 136, 5, 2}, 23, 2, DType::kBF16, 21);
  Check({33, 17, 4, 4}, 9, 2, DType::kF32, 22);  // odd sizes, every expert per token
  Check({256, 192, 16, 8}, 40, 2, DType::kF32, 23);
}

TEST_P(KernelTest, ManyTokensPerExpert) {
  // > 32 rows per expert exercises two-row-block tiles and row remainders.
  Check({128, 96, 4, 2}, 150, 2, DType::kBF16, 30);
}

TEST_P(KernelTest, ThreadCountDoesNotChangeResults) {
  Check({160, 112, 8, 2}, 12, 1, DType::kF32, 40);
  Check({160, 112, 8, 2}, 12, 2, DType::kF32, 40);
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTest, ::testing::Values("amx", "avx512", "reference"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(KernelFactory, AutoPicksTheBestAvailableAndNamesErrors) {
  const CpuFeatures& cpu = CpuFeatures::Get();
  absl::StatusOr<std::unique_ptr<ExpertKernel>> k = MakeExpertKernel("auto", cpu);
  ASSERT_TRUE(k.ok());
  const std::string expect = cpu.HasAmxBf16() ? "amx" : cpu.HasAvx512Bf16() ? "avx512" : "reference";
  EXPECT_EQ((*k)->name(), expect);
  EXPECT_EQ(MakeExpertKernel("sse9", cpu).status().code(), absl::StatusCode::kInvalidArgument);
  CpuFeatures none;
  EXPECT_EQ(MakeExpertKernel("amx", none).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(MakeExpertKernel("avx512", none).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ExpertStore, RefusesWhatDoesNotFit) {
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel("synthetic:deepseek-v3");
  ASSERT_TRUE(src.ok());
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 1);
  ASSERT_TRUE(numa.ok());
  ComputePool pool(**numa);
  HostedSet all{(*src)->spec().moe_layers, {}};
  for (int e = 0; e < 256; ++e) all.experts.push_back(e);
  absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(**src, all, **numa, pool);
  ASSERT_EQ(store.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(store.status().message().find("bytes"), std::string::npos) << store.status();
  EXPECT_NE(store.status().message().find("available"), std::string::npos) << store.status();
}

}  // namespace
}  // namespace moe
