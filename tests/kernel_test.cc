// Every expert kernel (amx, avx512, reference) in every storage format (bf16,
// int8, int4, fp8, mxfp4) through the real executor (grouping, gather, activation
// quantization, fused gate+up+SiLU, down (one weighted row per pair), the
// per-token sum, the pinned thread pool) against an f64 reference MoE, on
// random non-zero data.
// bf16: the reference MoE of the model, relative L2 error <= 1e-2. int8/int4:
// the f64 MoE of the weights the packed experts stand for (UnpackExpert),
// activation quantization included: <= 1e-2 (int8, mxfp4), <= 3e-2 (int4).
// GPT-OSS's expert math (biases, clamped SwiGLU) runs the same cases through
// the same kernels (KernelTest.GptOss*), one with inputs large enough that
// the clamp changes the result.
// Kernels this CPU lacks are reported as skipped, by name.
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "model/model_source.h"
#include "model/quantization.h"
#include "model/synthetic_model.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "core/status_macros.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/cpu_features.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/moe_executor.h"
#include "expert_compute/numa_binding.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {

double Tolerance(WeightFormat f) { return f == WeightFormat::kInt4 ? 3e-2 : 1e-2; }

struct Shape {
  int H, I, experts, k;
};

// Which family's expert math a case runs: SiLU (the default) or GPT-OSS's
// (biases, clamped SwiGLU), with activations scaled by x_scale (large ones
// drive gate and up past the clamp's limit).
struct ExpertMath {
  bool gpt_oss = false;
  float x_scale = 1.0f;
};

// A synthetic model's spec of `shape` whose only MoE layer is `moe_layer` (the last).
ModelSpec TestSpec(const Shape& shape, int moe_layer = 1) {
  ModelSpec spec;
  spec.model_type = "test";
  spec.num_layers = moe_layer + 1;
  spec.moe_layers = {moe_layer};
  spec.num_experts = shape.experts;
  spec.top_k = shape.k;
  spec.hidden = shape.H;
  spec.intermediate = shape.I;
  return spec;
}

std::unique_ptr<ExpertKernel> KernelOrSkip(const std::string& name, WeightFormat f) {
  absl::StatusOr<std::unique_ptr<ExpertKernel>> k = MakeExpertKernel(name, CpuFeatures::Get(), f);
  if (!k.ok() || !(*k)->Supports(f)) return nullptr;
  return *std::move(k);
}

// out[t] = sum_j w[t,j] FFN_e(x_t) in f64 from the weights layer `layer`'s
// packed experts stand for (UnpackExpert).
std::vector<double> DequantizedReference(const ExpertStore& store, int n, const std::vector<bf16_t>& x,
                                         const RoutingView& r, int layer = 1) {
  const ExpertGeometry& g = store.geometry();
  const int H = g.H, I = g.I;
  std::vector<std::vector<float>> w(store.num_experts());
  for (int e = 0; e < store.num_experts(); ++e) {
    w[e].resize(size_t(3) * I * H + 2 * I + H);
    float* b = w[e].data() + size_t(3) * I * H;
    float* const biases[3] = {b, b + I, b + 2 * I};
    UnpackExpert(g, store.Find(layer, e), w[e].data(), w[e].data() + size_t(I) * H, w[e].data() + size_t(2) * I * H,
                 biases);
  }
  std::vector<double> out(size_t(n) * H, 0.0), xf(H), act(I);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) xf[h] = Bf16ToF32(x[size_t(t) * H + h]);
    for (int j = 0; j < r.k; ++j) {
      const int e = r.ids[size_t(t) * r.k + j];
      if (e < 0) continue;
      const float* gate = w[e].data();
      const float* b = g.biases ? gate + size_t(3) * I * H : nullptr;
      AddExpertOutput<double>(gate, gate + size_t(I) * H, gate + size_t(2) * I * H, H, I, xf.data(),
                              r.weights[size_t(t) * r.k + j], act.data(), out.data() + size_t(t) * H, g.activation,
                              b, b ? b + I : nullptr, b ? b + 2 * I : nullptr);
    }
  }
  return out;
}

using KernelParam = std::tuple<std::string, WeightFormat>;

class KernelTest : public ::testing::TestWithParam<KernelParam> {
 protected:
  const std::string& name() const { return std::get<0>(GetParam()); }
  WeightFormat format() const { return std::get<1>(GetParam()); }

  // Runs `n` random tokens through layer 1 of a random model of `shape` and
  // compares with the f64 reference; tokens t with t % 7 == 3 get no pairs.
  void Check(const Shape& shape, int n, int threads, DType out_dtype, uint64_t seed, ExpertMath math = {}) {
    std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(name(), format());
    ASSERT_NE(kernel, nullptr);
    ModelSpec spec = TestSpec(shape);
    if (math.gpt_oss) {
      spec.model_type = "gpt_oss";
      ASSERT_TRUE(ExpertMathForModelType(nlohmann::json::object(), &spec).ok());
    }
    std::unique_ptr<ModelSource> source = MakeSyntheticSource(spec, seed);
    absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", threads);
    ASSERT_TRUE(numa.ok()) << numa.status();
    ComputePool pool(**numa);
    HostedSet hosted{{1}, {}};
    for (int e = 0; e < shape.experts; ++e) hosted.experts.push_back(e);
    const ExpertGeometry geometry =
        ExpertGeometry::For(shape.H, shape.I, format()).WithExpertMath(spec.activation, spec.expert_biases);
    absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(*source, geometry, hosted, **numa, pool);
    ASSERT_TRUE(store.ok()) << store.status();
    MoeExecutor exec(**store, *kernel, pool);

    std::vector<bf16_t> x = RandomActivations(size_t(n) * shape.H, seed + 1);
    if (math.x_scale != 1.0f)
      for (bf16_t& v : x) v = F32ToBf16(Bf16ToF32(v) * math.x_scale);
    std::vector<int32_t> ids;
    std::vector<float> w;
    RandomRouting(n, shape.k, shape.experts, seed + 2, 0.8, &ids, &w);
    for (int t = 3; t < n; t += 7) {
      for (int j = 0; j < shape.k; ++j) ids[size_t(t) * shape.k + j] = -1;
    }
    RoutingView r{n, shape.k, ids.data(), w.data()};

    std::vector<double> ref(size_t(n) * shape.H);
    if (format() == WeightFormat::kBf16) {
      ReferenceMoe reference(*source);
      ASSERT_TRUE(reference.Forward<double>(1, n, x.data(), r, ref.data()).ok());
    } else {
      ref = DequantizedReference(**store, n, x, r);
    }
    if (math.gpt_oss && math.x_scale > 1.0f && n > 0) {  // the clamp must matter: without it the result differs
      ModelSpec unclamped = spec;
      unclamped.activation.limit = 1e30f;
      std::unique_ptr<ModelSource> free_source = MakeSyntheticSource(unclamped, seed);
      ReferenceMoe free_reference(*free_source);
      std::vector<double> free_ref(ref.size());
      ASSERT_TRUE(free_reference.Forward<double>(1, n, x.data(), r, free_ref.data()).ok());
      EXPECT_GT(RelativeL2Error(free_ref.data(), ref.data(), ref.size()), 0.1) << "the clamp changes nothing here";
    }

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
    EXPECT_LE(err, Tolerance(format())) << name() << " " << WeightFormatName(format()) << " H=" << shape.H
                                        << " I=" << shape.I << " n=" << n;
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
    EXPECT_LE(RelativeL2Error(run.data(), ref.data(), run.size()), Tolerance(format()))
        << name() << " " << WeightFormatName(format()) << " Run, unpadded last group, n=" << n;
  }

  void SetUp() override {
    if (KernelOrSkip(name(), format()) == nullptr)
      GTEST_SKIP() << "kernel " << name() << " for " << WeightFormatName(format())
                   << " weights needs an ISA this CPU lacks (" << CpuFeatures::Get().Summary() << ")";
  }
};

TEST_P(KernelTest, ZeroAndOneToken) {
  Check({96, 80, 8, 2}, 0, 2, DType::kF32, 1);
  Check({96, 80, 8, 2}, 1, 2, DType::kF32, 2);
  Check({128, 64, 4, 1}, 1, 1, DType::kBF16, 3);
}

// GPT-OSS experts: biases on gate, up and down, clamped SwiGLU (alpha 1.702,
// limit 7) in every kernel and format, against the f64 reference.
TEST_P(KernelTest, GptOssBiasesAndClampedSwiglu) {
  Check({192, 128, 8, 4}, 1, 2, DType::kF32, 70, {true});
  Check({192, 128, 8, 4}, 21, 2, DType::kBF16, 71, {true});
  Check({200, 136, 6, 4}, 37, 2, DType::kF32, 72, {true});  // not multiples of 64
}

// Inputs 12x larger: most gate and up values pass the limit, so the clamp
// decides the result (checked: the unclamped reference differs by > 10%).
TEST_P(KernelTest, GptOssClampBeyondTheLimit) {
  Check({192, 128, 8, 4}, 3, 2, DType::kF32, 80, {true, 12.0f});
  Check({192, 128, 8, 4}, 33, 2, DType::kF32, 81, {true, 12.0f});
}

// GPT-OSS-20B/120B's expert shape (H = I = 2880), a few tokens.
TEST_P(KernelTest, GptOssRealShape) {
  Check({2880, 2880, 4, 4}, 2, 2, DType::kF32, 90, {true, 4.0f});
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

// Few tokens: the executor sums each token's rows in column ranges spread over
// the threads (H = 1000: ranges of 336 columns and a shorter last one); token
// 3 has no pairs, so one range of zeros too.
TEST_P(KernelTest, FewTokensSumTheirRowsInColumnRanges) {
  Check({1000, 64, 4, 2}, 1, 2, DType::kBF16, 50);
  Check({1000, 64, 4, 2}, 5, 2, DType::kF32, 51);
}

TEST_P(KernelTest, ManyTokensPerExpert) {
  // > 32 rows per expert exercises two-row-block tiles and row remainders.
  Check({128, 96, 4, 2}, 150, 2, DType::kBF16, 30);
}

// GPT-OSS's expert shape (H = I = 2880: 90 MXFP4 scale blocks per row),
// against the f64 MoE of the stored values; mxfp4 only (the other formats'
// real shapes run in bench/quant_accuracy and the server tests).
TEST_P(KernelTest, GptOssShapeMxfp4) {
  if (format() != WeightFormat::kMxfp4) GTEST_SKIP() << "mxfp4 only";
  Check({2880, 2880, 4, 2}, 6, 2, DType::kBF16, 60);
}

TEST_P(KernelTest, ThreadCountDoesNotChangeResults) {
  Check({160, 112, 8, 2}, 12, 1, DType::kF32, 40);
  Check({160, 112, 8, 2}, 12, 2, DType::kF32, 40);
}

// How long a region waits for a lockstep peer: about its observed lag, never
// more than three quarters of the layer's region (what the merge saves) nor
// 2 ms; and waits stop after three misses in a row, restart after one catch.
TEST(MergeWindow, BoundedByLagRegionAndCapAndCorrectedByOutcomes) {
  EXPECT_EQ(MergeWindowNs(0, 0), 10'000u);
  EXPECT_EQ(MergeWindowNs(100'000, 1'000'000), 160'000u);
  EXPECT_EQ(MergeWindowNs(1'000'000, 0), MoeExecutor::kDefaultMergeWindowNs) << "region time unknown";
  EXPECT_EQ(MergeWindowNs(1'000'000, 1'000'000), 750'000u) << "a wait as long as the region saves nothing";
  EXPECT_EQ(MergeWindowNs(10'000'000, 100'000'000), MoeExecutor::kMaxMergeWindowNs);
  EXPECT_LT(MergeWindowNs(10'000, 5'000), 5'000u) << "a tiny region: waits shorter than it";
  uint32_t score = kWaitScoreOne;
  for (int i = 0; i < 8; ++i) score = NextWaitScore(score, true);
  EXPECT_EQ(score, kWaitScoreOne);
  score = NextWaitScore(NextWaitScore(score, false), false);
  EXPECT_GE(score, kWaitScoreOne / 2) << "two misses still wait";
  score = NextWaitScore(score, false);
  EXPECT_LT(score, kWaitScoreOne / 2) << "three misses in a row stop the waits";
  EXPECT_GE(NextWaitScore(score, true), kWaitScoreOne / 2) << "one peer caught (or that a wait would have caught) restarts them";
}

// Every expert of layer 1 of a synthetic model of `shape`, stored in
// `format`, and the pool that computes them.
struct HostedLayer {
  std::unique_ptr<ModelSource> source;
  std::unique_ptr<NumaBinding> numa;
  std::unique_ptr<ComputePool> pool;
  std::unique_ptr<ExpertStore> store;
};
absl::StatusOr<HostedLayer> HostLayerOne(const Shape& shape, WeightFormat format, uint64_t seed) {
  HostedLayer l;
  l.source = MakeSyntheticSource(TestSpec(shape), seed);
  MOE_ASSIGN_OR_RETURN(l.numa, NumaBinding::Create("auto", 2));
  l.pool = std::make_unique<ComputePool>(*l.numa);
  HostedSet hosted{{1}, {}};
  for (int e = 0; e < shape.experts; ++e) hosted.experts.push_back(e);
  MOE_ASSIGN_OR_RETURN(l.store, ExpertStore::Load(*l.source, ExpertGeometry::For(shape.H, shape.I, format), hosted,
                                                  *l.numa, *l.pool));
  return l;
}

// Requests that wait for the pool at the same time and share experts are
// computed in one region, grouped by expert across them (MoeExecutor::Forward),
// and each gets exactly the bytes it gets alone: requests of other k and sizes
// merge; one of another output dtype, and one whose experts the region does
// not read, run in regions of their own. The pool is held busy
// until the requests queue, so the merge is certain, not a race. A caller
// alone waits for a peer at most once per layer after the peers left.
TEST_P(KernelTest, ConcurrentRequestsMergeExactly) {
  std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(name(), format());
  ASSERT_NE(kernel, nullptr);
  const Shape shape{160, 112, 8, 4};  // (H = 160: widen below)
  absl::StatusOr<HostedLayer> layer = HostLayerOne(shape, format(), 91);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ComputePool& pool = *layer->pool;
  MoeExecutor exec(*layer->store, *kernel, pool);

  struct Request {
    int n, k;
    DType dtype;
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
    std::vector<std::byte> alone, merged;
    ForwardStats stats;
  };
  // 1 and 2 route to experts 0-3 only (they merge), 4 to experts 4-7 only.
  std::vector<Request> req = {{1, 4, DType::kBF16}, {3, 4, DType::kBF16}, {8, 2, DType::kBF16}, {5, 4, DType::kF32},
                              {2, 2, DType::kBF16}};
  for (size_t i = 0; i < req.size(); ++i) {
    Request& r = req[i];
    r.x = RandomActivations(size_t(r.n) * shape.H, 100 + i);
    RandomRouting(r.n, r.k, shape.experts, 200 + i, 0.8, &r.ids, &r.w);
    if (i == 1 || i == 2 || i == 4)
      for (int t = 0; t < r.n; ++t)
        for (int j = 0; j < r.k; ++j) r.ids[size_t(t) * r.k + j] = (i == 4 ? 4 : 0) + (t + j) % 4;
    const size_t bytes = size_t(r.n) * shape.H * (r.dtype == DType::kBF16 ? 2 : 4);
    r.alone.assign(bytes, std::byte{0x7f});
    r.merged.assign(bytes, std::byte{0x7f});
  }
  auto forward = [&](Request& r, std::vector<std::byte>& out, ForwardStats* stats) {
    return exec.Forward({1, r.n, r.x.data(), RoutingView{r.n, r.k, r.ids.data(), r.w.data()}}, r.dtype, out.data(),
                        stats);
  };
  for (Request& r : req) ASSERT_TRUE(forward(r, r.alone, nullptr).ok());
  const MergeStats before = exec.merge_stats();
  EXPECT_EQ(before.regions, req.size());
  EXPECT_EQ(before.windows, 0u) << "a caller alone waited for peers";

  // Hold the pool: request 0 takes its region and waits for the pool, the
  // others queue behind it in order.
  std::atomic<bool> holding{false}, release{false};
  std::thread blocker([&] {
    pool.Run([&](int t, int) {
      if (t != 0) return;
      holding = true;
      while (!release) std::this_thread::yield();
    });
  });
  auto wait_for = [](const std::function<bool()>& ok) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!ok() && std::chrono::steady_clock::now() < end) std::this_thread::yield();
    return ok();
  };
  ASSERT_TRUE(wait_for([&] { return holding.load(); }));
  std::vector<std::thread> clients;
  std::vector<absl::Status> status(req.size());
  for (size_t i = 0; i < req.size(); ++i) {
    clients.emplace_back([&, i] { status[i] = forward(req[i], req[i].merged, &req[i].stats); });
    if (i == 0)
      ASSERT_TRUE(wait_for([&] { return exec.merge_stats().regions == before.regions + 1; }));
    else
      ASSERT_TRUE(wait_for([&] { return exec.waiting_requests() == static_cast<int>(i); }));
  }
  release = true;
  blocker.join();
  for (std::thread& t : clients) t.join();
  // Each row's math is its own, so bf16 weights give the same bytes; other
  // formats may take another kernel path at another row count (fp8 on
  // AVX-512: 3.7e-3 off at 3 vs 7 rows per expert), so within half the
  // format's tolerance.
  auto widen = [](const Request& r, const std::vector<std::byte>& b) {
    std::vector<float> f(size_t(r.n) * 160);
    if (r.dtype == DType::kF32)
      std::memcpy(f.data(), b.data(), f.size() * 4);
    else
      Bf16ToF32(reinterpret_cast<const bf16_t*>(b.data()), f.data(), f.size());
    return f;
  };
  for (size_t i = 0; i < req.size(); ++i) {
    ASSERT_TRUE(status[i].ok()) << i << ": " << status[i];
    if (format() == WeightFormat::kBf16) {
      EXPECT_TRUE(req[i].merged == req[i].alone) << "request " << i << " differs from its result alone";
    } else {
      const std::vector<float> merged = widen(req[i], req[i].merged), alone = widen(req[i], req[i].alone);
      EXPECT_LE(RelativeL2Error(merged.data(), alone.data(), merged.size()), Tolerance(format()) / 2) << i;
    }
  }
  const MergeStats after = exec.merge_stats();
  EXPECT_EQ(after.regions, before.regions + 4) << "request 0 alone, 1 and 2 together, 3 (f32) and 4 (other experts) alone";
  EXPECT_EQ(after.merged_regions, 1u);
  EXPECT_EQ(after.merged_requests, 2u);
  EXPECT_EQ(req[0].stats.merged_requests, 1);
  EXPECT_EQ(req[1].stats.merged_requests, 2);
  EXPECT_EQ(req[2].stats.merged_requests, 2);
  EXPECT_EQ(req[3].stats.merged_requests, 1);
  EXPECT_EQ(req[4].stats.merged_requests, 1);

  // The peers gone, a caller alone pays at most one wait (one layer here).
  for (int i = 0; i < 12; ++i) ASSERT_TRUE(forward(req[0], req[0].merged, nullptr).ok());
  EXPECT_LE(exec.merge_stats().windows - before.windows, 1u);
}

// The stripes of one client batch (StripeOf: the gRPC transport's split of a
// large batch over its connections) share one region whatever their size and
// with merging off: 3 stripes of 120 tokens (360 > kMergeTokens), the first
// sent 1 ms before the others, are one region of 3 requests, each stripe
// exactly its bytes alone. A stripe whose sibling never comes runs alone
// after at most kMaxStripeWaitNs.
TEST_P(KernelTest, StripesOfOneBatchAreComputedTogether) {
  std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(name(), format());
  ASSERT_NE(kernel, nullptr);
  if (format() != WeightFormat::kBf16) GTEST_SKIP() << "the grouping is format-independent: bf16 only";
  const Shape shape{160, 112, 8, 4};
  absl::StatusOr<HostedLayer> layer = HostLayerOne(shape, format(), 93);
  ASSERT_TRUE(layer.ok()) << layer.status();
  MoeExecutor exec(*layer->store, *kernel, *layer->pool, /*merge=*/false);
  constexpr int kStripes = 3, kRows = 120, k = 4;
  std::vector<bf16_t> x = RandomActivations(size_t(kStripes) * kRows * shape.H, 300);
  std::vector<int32_t> ids;
  std::vector<float> w;
  RandomRouting(kStripes * kRows, k, shape.experts, 301, 0.9, &ids, &w);
  auto stripe = [&](int i, StripeOf of) {
    MoeBatch b{1, kRows, x.data() + size_t(i) * kRows * shape.H,
               RoutingView{kRows, k, ids.data() + size_t(i) * kRows * k, w.data() + size_t(i) * kRows * k}};
    b.stripe = of;
    return b;
  };
  const size_t bytes = size_t(kRows) * shape.H * 2;
  std::vector<std::vector<std::byte>> alone(kStripes, std::vector<std::byte>(bytes)), together = alone;
  std::vector<MoeBatch> batches;
  for (int i = 0; i < kStripes; ++i) batches.push_back(stripe(i, {}));
  for (int i = 0; i < kStripes; ++i) ASSERT_TRUE(exec.Forward(batches[i], DType::kBF16, alone[i].data(), nullptr).ok());
  const MergeStats before = exec.merge_stats();
  for (int i = 0; i < kStripes; ++i) batches[i] = stripe(i, StripeOf{0x5eed, kStripes});
  std::vector<absl::Status> status(kStripes);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStripes; ++i) {
    clients.emplace_back([&, i] { status[i] = exec.Forward(batches[i], DType::kBF16, together[i].data(), nullptr); });
    if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the first region waits (10 ms at most)
  }
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kStripes; ++i) {
    ASSERT_TRUE(status[i].ok()) << i << ": " << status[i];
    EXPECT_TRUE(together[i] == alone[i]) << "stripe " << i << " differs from its result alone";
  }
  const MergeStats after = exec.merge_stats();
  EXPECT_EQ(after.regions, before.regions + 1) << "the three stripes in one region";
  EXPECT_EQ(after.merged_requests - before.merged_requests, uint64_t(kStripes));

  // A group repeated (four requests of a 3-stripe group): at most 3 in its region.
  {
    const MergeStats b4 = exec.merge_stats();
    std::vector<std::byte> extra(bytes);
    std::vector<std::thread> four;
    std::vector<absl::Status> st4(kStripes + 1);
    for (int i = 0; i <= kStripes; ++i)
      four.emplace_back([&, i] {
        st4[i] = exec.Forward(batches[i % kStripes], DType::kBF16, i < kStripes ? together[i].data() : extra.data(),
                              nullptr);
      });
    for (std::thread& t : four) t.join();
    for (const absl::Status& st : st4) ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(extra == alone[0]);
    const MergeStats a4 = exec.merge_stats();
    EXPECT_EQ(a4.regions, b4.regions + 2) << "three in one region, the repeat in another";
    EXPECT_EQ(a4.merged_requests - b4.merged_requests, uint64_t(kStripes));
  }

  // One stripe of two, its sibling lost: computed alone after the wait.
  MoeBatch lone = stripe(0, StripeOf{0xbad, 2});
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(exec.Forward(lone, DType::kBF16, together[0].data(), nullptr).ok());
  const double waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(together[0] == alone[0]);
  EXPECT_GE(waited_ms, MoeExecutor::kMaxStripeWaitNs / 1e6 * 0.9);
  EXPECT_LT(waited_ms, MoeExecutor::kMaxStripeWaitNs / 1e6 + 2000);
}

// A bf16 model quantized to MXFP4 on load (--weight-dtype mxfp4: OCP scale,
// round to nearest) against the bf16 model's own f64 MoE, at H = I = 2880.
// E2M1 has 8 magnitudes per sign: on these weights (uniform in a block) its
// per-weight RMS error is ~14% (int4 with a scale per 32: ~7%), and the MoE's
// relative error compounds it over gate, up and down: 0.19 measured (AVX-512
// and reference alike: 1.7e-3 of it is the kernels' own, against the stored
// values) — far above the 3e-2 that issue 46 asks of 4-bit formats, which no
// 4-bit code with one scale per 32 meets on such weights. The bounds check
// that the quantizer did what the format allows, not more.
TEST(Mxfp4Quantization, Bf16ModelQuantizedOnLoadAgainstTheBf16Model) {
  const Shape shape{2880, 2880, 4, 2};
  const ModelSpec spec = TestSpec(shape);
  std::unique_ptr<ModelSource> source = MakeSyntheticSource(spec, 70);
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
  ASSERT_TRUE(numa.ok()) << numa.status();
  ComputePool pool(**numa);
  absl::StatusOr<ExpertGeometry> g = StorageGeometry(spec, "mxfp4");
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(*source, *g, HostedSet{{1}, {0, 1, 2, 3}}, **numa, pool);
  ASSERT_TRUE(store.ok()) << store.status();
  std::unique_ptr<ExpertKernel> kernel = *MakeExpertKernel("auto", CpuFeatures::Get(), WeightFormat::kMxfp4);
  MoeExecutor exec(**store, *kernel, pool);
  const int n = 6;
  const std::vector<bf16_t> x = RandomActivations(size_t(n) * shape.H, 71);
  std::vector<int32_t> ids;
  std::vector<float> w;
  RandomRouting(n, shape.k, shape.experts, 72, 0.0, &ids, &w);
  const RoutingView r{n, shape.k, ids.data(), w.data()};
  std::vector<float> got(size_t(n) * shape.H);
  ASSERT_TRUE(exec.Forward({1, n, x.data(), r}, DType::kF32, got.data(), nullptr).ok());
  std::vector<double> bf16_ref(got.size());
  ASSERT_TRUE(ReferenceMoe(*source).Forward<double>(1, n, x.data(), r, bf16_ref.data()).ok());
  const std::vector<double> stored_ref = DequantizedReference(**store, n, x, r);
  const double vs_stored = RelativeL2Error(got.data(), stored_ref.data(), got.size());
  const double vs_bf16 = RelativeL2Error(got.data(), bf16_ref.data(), got.size());
  std::printf("mxfp4 on load, H = I = 2880, kernel %s: %.3g vs the stored values, %.3g vs the bf16 model\n",
              kernel->name(), vs_stored, vs_bf16);
  RecordProperty("rel_error_vs_bf16", std::to_string(vs_bf16));
  EXPECT_LE(vs_stored, 1e-2);
  EXPECT_GT(vs_bf16, 0.05);  // quantized, not the bf16 weights
  EXPECT_LE(vs_bf16, 0.22);
}

// A batch whose workspace cannot be allocated is an error, not a crash; the
// executor then still serves the next batch. The child process runs the large
// batch with its address space limited to what it uses plus 48 MiB (it needs
// about 100 MiB of workspace: 8192 tokens x top-2, H = 1024), then lifts the
// limit for a small one.
TEST(ExecutorWorkspace, TooLargeABatchIsResourceExhausted) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto run = [] {
    std::unique_ptr<ModelSource> source = MakeSyntheticSource(TestSpec({1024, 64, 4, 2}), 7);
    absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
    if (!numa.ok()) std::_Exit(2);
    ComputePool pool(**numa);
    HostedSet hosted{{1}, {0, 1, 2, 3}};
    absl::StatusOr<std::unique_ptr<ExpertStore>> store =
        ExpertStore::Load(*source, ExpertGeometry::For(1024, 64), hosted, **numa, pool);
    absl::StatusOr<std::unique_ptr<ExpertKernel>> kernel = MakeExpertKernel("auto", CpuFeatures::Get());
    if (!store.ok() || !kernel.ok()) std::_Exit(3);
    MoeExecutor exec(**store, **kernel, pool);
    const int big = 8192, small = 4;
    const std::vector<bf16_t> x = RandomActivations(size_t(big) * 1024, 8);
    std::vector<int32_t> ids(size_t(big) * 2);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 4);
    const std::vector<float> w(ids.size(), 0.5f);
    std::vector<bf16_t> out(size_t(big) * 1024);
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages <= 0) std::_Exit(4);
    const rlim_t limit = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t{48} << 20);
    rlimit old{};
    if (getrlimit(RLIMIT_AS, &old) != 0) std::_Exit(5);
    const rlimit rl{limit, old.rlim_max};  // the soft limit only: lifted again below
    if (setrlimit(RLIMIT_AS, &rl) != 0) std::_Exit(5);
    const absl::Status st = exec.Forward({1, big, x.data(), RoutingView{big, 2, ids.data(), w.data()}}, DType::kBF16,
                                         out.data(), nullptr);
    if (st.code() != absl::StatusCode::kResourceExhausted || st.message().find("tokens:") != 0) {
      std::fprintf(stderr, "large batch: %s\n", st.ToString().c_str());
      std::_Exit(6);
    }
    if (setrlimit(RLIMIT_AS, &old) != 0) std::_Exit(5);
    const absl::Status ok = exec.Forward({1, small, x.data(), RoutingView{small, 2, ids.data(), w.data()}},
                                         DType::kBF16, out.data(), nullptr);
    if (!ok.ok()) std::fprintf(stderr, "small batch: %s\n", std::string(ok.message()).c_str());
    std::_Exit(ok.ok() ? 0 : 7);
  };
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(0), "");
}

INSTANTIATE_TEST_SUITE_P(Kernels, KernelTest,
                         ::testing::Combine(::testing::Values("amx", "avx512", "reference"),
                                            ::testing::Values(WeightFormat::kBf16, WeightFormat::kInt8,
                                                              WeightFormat::kInt4, WeightFormat::kFp8,
                                                              WeightFormat::kMxfp4)),
                         [](const ::testing::TestParamInfo<KernelParam>& p) {
                           return std::get<0>(p.param) + "_" + WeightFormatName(std::get<1>(p.param));
                         });

// A quantized checkpoint stored in its own format (fp8: --weight-dtype fp8;
// int4: auto, Kimi-K2's groups of 32 included) keeps its own codes and scales:
// every packed weight is exactly code x scale of its block or group, whole
// and sliced. Each kernel then computes it within 1e-2 of the f64 MoE of
// those values (the SIMD kernels round code x scale to bf16 once, or
// quantize the activations to int8).
class Fp8Checkpoint : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (KernelOrSkip(GetParam(), WeightFormat::kFp8) == nullptr)
      GTEST_SKIP() << "kernel " << GetParam() << " for fp8 weights needs an ISA this CPU lacks ("
                   << CpuFeatures::Get().Summary() << ")";
  }

  // Long: one walk (load, compare every packed weight, run the kernel) per model URI and slice, kept whole for its trace.
  void CheckStoredExactly(const std::vector<std::string>& uris, const std::string& weight_dtype, WeightFormat want) {
    std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(GetParam(), want);
    if (kernel == nullptr) GTEST_SKIP() << "kernel " << GetParam() << " lacks " << WeightFormatName(want);
    for (const std::string& uri : uris) {
      SCOPED_TRACE(uri);
      for (const ExpertSlice slice : {ExpertSlice{}, ExpertSlice{1, 2}}) {
        absl::StatusOr<std::unique_ptr<ModelSource>> opened = OpenModel(uri);
        ASSERT_TRUE(opened.ok()) << opened.status();
        absl::StatusOr<std::unique_ptr<ModelSource>> sliced = SliceModel(*std::move(opened), slice);
        if (!sliced.ok()) continue;  // tiny's intermediate size cannot be cut in two
        const ModelSource& source = **sliced;
        const ModelSpec& spec = source.spec();
        absl::StatusOr<ExpertGeometry> g = StorageGeometry(spec, weight_dtype);
        ASSERT_TRUE(g.ok()) << g.status();
        ASSERT_EQ(g->format, want);
        ASSERT_EQ(g->group, want == WeightFormat::kFp8 ? spec.quant.block_cols : spec.quant.group_size);
        absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
        ASSERT_TRUE(numa.ok()) << numa.status();
        ComputePool pool(**numa);
        const int layer = spec.moe_layers[0];
        HostedSet hosted{{layer}, {}};
        for (int e = 0; e < spec.num_experts; ++e) hosted.experts.push_back(e);
        absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(source, *g, hosted, **numa, pool);
        ASSERT_TRUE(store.ok()) << store.status();
        const int H = spec.hidden, I = spec.intermediate;
        std::vector<float> w(size_t(3) * H * I);
        ExpertCodes codes;
        ExpertWeights wb;
        for (int e = 0; e < spec.num_experts; ++e) {
          ASSERT_TRUE(source.ReadExpertCodes(layer, e, &codes).ok());
          ASSERT_TRUE(source.ReadExpert(layer, e, &wb).ok());
          UnpackExpert(*g, (*store)->Find(layer, e), w.data(), w.data() + size_t(I) * H, w.data() + size_t(2) * I * H);
          int64_t inexact = 0, off_checkpoint = 0;
          size_t at = 0;
          for (auto [p, b] : {std::pair{&codes.gate, &wb.gate}, std::pair{&codes.up, &wb.up}, std::pair{&codes.down, &wb.down}})
            for (int r = 0; r < p->rows; ++r)
              for (int c = 0; c < p->cols; ++c, ++at) {
                const uint8_t code = p->codes[size_t(r) * p->cols + c];
                const float value = want == WeightFormat::kFp8 ? Fp8E4M3ToF32(code) : float(int8_t(code));
                inexact += w[at] != value * p->Scale(r, c);
                off_checkpoint += F32ToBf16(w[at]) != (*b)[size_t(r) * p->cols + c];  // what ReadExpert dequantizes
              }
          ASSERT_EQ(inexact, 0) << "expert " << e << ": packed weights differ from code x scale";
          ASSERT_EQ(off_checkpoint, 0) << "expert " << e << ": packed weights differ from the checkpoint's dequantized values";
        }
        const int n = slice.whole() ? 37 : 3, k = spec.top_k;  // 3 tokens: decode-sized groups
        std::vector<bf16_t> x = RandomActivations(size_t(n) * H, 7);
        std::vector<int32_t> ids;
        std::vector<float> rw;
        RandomRouting(n, k, spec.num_experts, 8, 0.8, &ids, &rw);
        const RoutingView r{n, k, ids.data(), rw.data()};
        const std::vector<double> ref = DequantizedReference(**store, n, x, r, layer);
        MoeExecutor exec(**store, *kernel, pool);
        std::vector<float> got(size_t(n) * H, NAN);
        ASSERT_TRUE(exec.Forward(MoeBatch{layer, n, x.data(), r}, DType::kF32, got.data(), nullptr).ok());
        const double err = RelativeL2Error(got.data(), ref.data(), got.size());
        EXPECT_LE(err, 1e-2) << "slice " << slice.ToString();
        EXPECT_GT(err, 0.0) << "identical to f64 to the last bit is not plausible";
        RecordProperty("rel_error", std::to_string(err));
      }
    }
  }
};

TEST_P(Fp8Checkpoint, StoredExactlyAndComputedWithinBf16Rounding) {
  CheckStoredExactly({"synthetic:tiny:seed=5:dtype=fp8", "synthetic:qwen3-30b-a3b:layers=1:experts=4:top_k=2:seed=6:dtype=fp8"},
                     "fp8", WeightFormat::kFp8);
}

// A slice that would cut an int4 checkpoint's groups (256 columns, the
// slice starting at column 384 of down) cannot keep its codes: the store
// re-quantizes it from its bf16 values into the same group size instead of
// failing, within int4's error of those values.
TEST(Int4Checkpoint, SliceCuttingItsGroupsIsRequantized) {
  absl::StatusOr<std::unique_ptr<ModelSource>> sliced =
      SliceModel(*OpenModel("synthetic:qwen3-30b-a3b:layers=1:experts=2:top_k=2:seed=6:dtype=int4:group=256"),
                 ExpertSlice{1, 2});
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  const ModelSource& source = **sliced;
  const ModelSpec& spec = source.spec();
  absl::StatusOr<ExpertGeometry> g = StorageGeometry(spec, "auto");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->format, WeightFormat::kInt4);
  ASSERT_EQ(g->group, 256);
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 1);
  ASSERT_TRUE(numa.ok()) << numa.status();
  ComputePool pool(**numa);
  const int layer = spec.moe_layers[0];
  absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(source, *g, HostedSet{{layer}, {0, 1}}, **numa, pool);
  ASSERT_TRUE(store.ok()) << store.status();
  const int H = spec.hidden, I = spec.intermediate;
  std::vector<float> w(size_t(3) * H * I);
  ExpertWeights wb;
  ASSERT_TRUE(source.ReadExpert(layer, 1, &wb).ok());
  UnpackExpert(*g, (*store)->Find(layer, 1), w.data(), w.data() + size_t(I) * H, w.data() + size_t(2) * I * H);
  std::vector<double> want;
  for (const std::vector<bf16_t>* m : {&wb.gate, &wb.up, &wb.down})
    for (bf16_t v : *m) want.push_back(Bf16ToF32(v));
  std::vector<double> got(w.begin(), w.end());
  const double err = RelativeL2Error(got.data(), want.data(), got.size());
  EXPECT_LE(err, 3e-2);  // 4-bit formats' bound (measured 4.4e-3)
  // The fallback ran: the slice's down projection does not fit, and some of
  // the packed weights are not the checkpoint's code x scale.
  ExpertCodes codes;
  ASSERT_TRUE(source.ReadExpertCodes(layer, 1, &codes).ok());
  EXPECT_FALSE(CodesFit(*g, codes).ok());
  int64_t off_codes = 0;
  const float* down = w.data() + size_t(2) * I * H;
  for (int r = 0; r < codes.down.rows; ++r)
    for (int c = 0; c < codes.down.cols; ++c)
      off_codes += down[size_t(r) * codes.down.cols + c] !=
                   float(int8_t(codes.down.codes[size_t(r) * codes.down.cols + c])) * codes.down.Scale(r, c);
  EXPECT_GT(off_codes, 0) << "the down projection was packed from its codes, which the slice cuts";
}

// int4 checkpoints (compressed-tensors): groups of 32 (Kimi-K2's, half a
// 64-k chunk) and of 128, served by --weight-dtype auto with their own codes.
TEST_P(Fp8Checkpoint, Int4StoredExactlyAndComputedWithinBf16Rounding) {
  CheckStoredExactly({"synthetic:tiny:seed=5:dtype=int4:group=32",
                      "synthetic:qwen3-30b-a3b:layers=1:experts=4:top_k=2:seed=6:dtype=int4:group=32",
                      "synthetic:qwen3-30b-a3b:layers=1:experts=4:top_k=2:seed=6:dtype=int4"},
                     "auto", WeightFormat::kInt4);
}

// Every E4M3 code (zero and the subnormals included) comes out of the
// kernel's fp8 paths exactly: a one-hot activation row reads one column of
// down, code x scale (a power of two, so that rounding code x scale to bf16 on
// the many-rows path is exact too). 1 row: the decode path (codes converted in
// registers); 8 rows: each panel converted once.
TEST_P(Fp8Checkpoint, EveryCodeDecodesExactly) {
  const int H = 64, I = 256;
  const ExpertGeometry g = ExpertGeometry::For(H, I, WeightFormat::kFp8, 128);
  ExpertCodes w;
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) codes.push_back(static_cast<uint8_t>(c));  // 0x7f, 0xff: NaN
  for (auto [p, rows, cols] : {std::tuple{&w.gate, I, H}, std::tuple{&w.up, I, H}, std::tuple{&w.down, H, I}}) {
    p->scheme = WeightQuant::kFp8Block, p->rows = rows, p->cols = cols, p->br = p->bc = 128, p->scale_cols = (cols + 127) / 128;
    p->scales.assign(size_t((rows + 127) / 128) * p->scale_cols, 0.125f);
    p->codes.resize(size_t(rows) * cols);
    for (size_t i = 0; i < p->codes.size(); ++i) p->codes[i] = codes[(i * 7) % codes.size()];
  }
  std::unique_ptr<std::byte, decltype(&std::free)> packed(
      static_cast<std::byte*>(std::aligned_alloc(64, (g.packed_bytes() + 63) / 64 * 64)), &std::free);
  ASSERT_TRUE(PackExpertCodes(g, w, packed.get()).ok());
  std::unique_ptr<ExpertKernel> kernel = KernelOrSkip(GetParam(), WeightFormat::kFp8);
  const int rows = 16, ldo = g.Hn + 16;  // 16: the amx kernel's row block (rows past m are padding)
  std::vector<bf16_t> act(size_t(rows) * g.lda());
  std::vector<float> weight(rows, 1.0f), out(size_t(rows) * ldo);
  for (int m : {1, 8}) {
    int64_t wrong = 0;
    for (int k = 0; k < I; ++k) {
      std::fill(act.begin(), act.end(), bf16_t{0});
      for (int r = 0; r < m; ++r) act[size_t(r) * g.lda() + k] = F32ToBf16(1.0f);
      std::fill(out.begin(), out.end(), 0.0f);
      kernel->Down(g, packed.get(), KernelRows{act.data()}, m, weight.data(), out.data(), ldo, 0, g.down_groups());
      for (int r = 0; r < m; ++r)
        for (int n = 0; n < H; ++n) {
          const float want = Fp8E4M3ToF32(w.down.codes[size_t(n) * I + k]) * 0.125f;
          wrong += out[size_t(r) * ldo + n] != want;
        }
    }
    EXPECT_EQ(wrong, 0) << m << " rows: outputs that are not exactly code x scale";
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Fp8Checkpoint, ::testing::Values("amx", "avx512", "reference"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Idle compute threads sleep after idle_spin (here at once), and then each
// region pays their futex wake-up; KeepHotUntil (what a server does while a
// client polls for its next request) keeps them spinning through the
// deadline, and they sleep again after it.
TEST(ComputePool, KeepHotUntilKeepsIdleThreadsSpinning) {
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
  ASSERT_TRUE(numa.ok()) << numa.status();
  ComputePool pool(**numa, std::chrono::microseconds(0));
  if (pool.size() < 2) GTEST_SKIP() << "one CPU: no idle compute thread";
  std::atomic<int> ran{0};
  const ComputePool::Task task = [&](int, int) { ran.fetch_add(1); };
  const auto sleeps_reach = [&](uint64_t n) {
    for (int i = 0; i < 2000 && pool.sleeps() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return pool.sleeps() >= n;
  };
  pool.Run(task);
  EXPECT_TRUE(sleeps_reach(pool.size() - 1)) << "cold threads did not sleep";
  const auto hot_for = std::chrono::milliseconds(300);
  pool.KeepHotUntil(std::chrono::steady_clock::now() + hot_for);
  pool.Run(task);  // wakes them; after it they stay hot
  const uint64_t after_run = pool.sleeps();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(pool.sleeps(), after_run) << "a thread slept before the deadline";
  pool.KeepHotUntil(std::chrono::steady_clock::now());  // never shortens
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(pool.sleeps(), after_run);
  EXPECT_TRUE(sleeps_reach(after_run + pool.size() - 1)) << "threads spun past the deadline";
  EXPECT_EQ(ran.load(), 2 * pool.size());
}

// A hot idle compute thread (KeepHotUntil: a server whose client polls keeps
// them spinning between layers) shares its PU with a thread that has work —
// on a host where the worker's and the server connections' threads outnumber
// the cores the pool leaves free, the scheduler puts them there. Pause-only
// spinning held the PU for whole scheduler slices (20 ms of work took ~40
// ms and every wait was a slice); the spinner yields every kSpinYieldPeriod.
namespace {
double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
double WallForCpuOn(int cpu, double cpu_s) {
  cpu_set_t saved, one;
  pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved);
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const double c0 = ThreadCpuSeconds();
  const auto w0 = std::chrono::steady_clock::now();
  while (ThreadCpuSeconds() - c0 < cpu_s) {
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  return wall;
}
}  // namespace

TEST(ComputePool, HotIdleThreadGivesItsPuToAThreadWithWork) {
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
  ASSERT_TRUE(numa.ok()) << numa.status();
  const int cpu = (*numa)->cpus().size() > 1 ? (*numa)->cpus()[1] : -1;
  if (cpu < 0) GTEST_SKIP() << "one CPU: no idle compute thread";
  // Each side the best of 3: other tests running beside this one (ctest -j)
  // take the CPU now and then; a thread that does not yield takes it always.
  const double alone = std::min({WallForCpuOn(cpu, 0.02), WallForCpuOn(cpu, 0.02), WallForCpuOn(cpu, 0.02)});
  ComputePool pool(**numa, std::chrono::microseconds(0));
  pool.KeepHotUntil(std::chrono::steady_clock::now() + std::chrono::seconds(20));
  pool.Run([](int, int) {});  // thread 1 on cpus()[1], spinning for the next region from here
  const uint64_t sleeps = pool.sleeps();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double shared = std::min({WallForCpuOn(cpu, 0.02), WallForCpuOn(cpu, 0.02), WallForCpuOn(cpu, 0.02)});
  EXPECT_EQ(pool.sleeps(), sleeps) << "the compute thread slept: nothing measured";
  EXPECT_LT(shared, 1.35 * alone + 0.002) << "20 ms of work took " << 1e3 * shared
                                          << " ms beside a hot idle compute thread (" << 1e3 * alone << " ms alone)";
}

TEST(Fp8Checkpoint, BlocksTheKernelsCannotGroupAreRefused) {
  ModelSpec spec = *PresetSpec("tiny");
  spec.quant.scheme = WeightQuant::kFp8Block;
  spec.quant.block_cols = 96;
  absl::StatusOr<ExpertGeometry> g = StorageGeometry(spec, "fp8");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("--weight-dtype fp8"), std::string::npos) << g.status();
  spec.quant.scheme = WeightQuant::kNone;  // a bf16 model is quantized per channel and 128 columns
  EXPECT_EQ(StorageGeometry(spec, "fp8")->group, ExpertGeometry::kDefaultFp8Group);

  // A slice whose first column of down falls inside a checkpoint block (192
  // intermediate rows in 3 slices of 64): its scale groups would straddle two
  // blocks, so the store refuses it, naming the way out.
  spec.quant.scheme = WeightQuant::kFp8Block;
  spec.quant.block_cols = 128;
  spec.intermediate = 192;
  absl::StatusOr<std::unique_ptr<ModelSource>> sliced = SliceModel(MakeSyntheticSource(spec, 3), ExpertSlice{1, 3});
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  absl::StatusOr<ExpertGeometry> sg = StorageGeometry((*sliced)->spec(), "fp8");
  ASSERT_TRUE(sg.ok()) << sg.status();
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 1);
  ASSERT_TRUE(numa.ok()) << numa.status();
  ComputePool pool(**numa);
  absl::StatusOr<std::unique_ptr<ExpertStore>> store =
      ExpertStore::Load(**sliced, *sg, HostedSet{{spec.moe_layers[0]}, {0}}, **numa, pool);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << store.status();
  EXPECT_NE(store.status().message().find("--weight-dtype int8"), std::string::npos) << store.status();
}

// The int8/int4 paths of the avx512 kernel (AVX-512-VNNI) and of the amx
// kernel (AMX-INT8 tiles of 8 tokens, the rest on VNNI) called directly
// against the reference kernel on the same packed experts and quantized rows,
// at row counts around the 4-row VNNI chunks and the 8/16-token tiles. All
// compute the same exact int32 dot products; only the f32 combination order
// differs (and GateUp's exp), so Down's f32 output (from the same
// act) matches within 1e-5 relative L2. GateUp stores bf16, where an f32
// difference of ~1e-7 still flips a rounding now and then (one flip alone
// can exceed any small L2 bound at m = 1): at most 1% of act elements may
// differ, each by one bf16 step (plus 1e-5 of the largest, for sums that
// cancel).
class IntDirectTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    kernel_ = KernelOrSkip(GetParam(), WeightFormat::kInt8);
    if (kernel_ == nullptr)
      GTEST_SKIP() << "kernel " << GetParam() << " for int8/int4 weights needs an ISA this CPU lacks ("
                   << CpuFeatures::Get().Summary() << ")";
    ref_ = KernelOrSkip("reference", WeightFormat::kInt8);
    ASSERT_NE(ref_, nullptr);
  }

  // Quantized rows of m x K bf16 values (K a multiple of 64, rows ld apart).
  struct Rows {
    std::vector<int8_t> q;
    std::vector<float> scale;
    std::vector<int32_t> sum32;
    KernelRows Quantize(const bf16_t* x, int m, int K, int ld) {
      q.resize(size_t(2) * m * ld);
      scale.resize(m);
      sum32.resize(size_t(2) * m * (K / 32));
      QuantizeRows(x, m, K, ld, q.data(), scale.data(), sum32.data());
      return KernelRows{nullptr, q.data(), scale.data(), sum32.data()};
    }
  };

  void Check(int H, int I, WeightFormat f, int group, uint64_t seed) {
    const ExpertGeometry g = ExpertGeometry::For(H, I, f, group);
    const std::vector<bf16_t> gate = RandomActivations(size_t(I) * H, seed), up = RandomActivations(size_t(I) * H, seed + 1),
                              down = RandomActivations(size_t(H) * I, seed + 2);
    std::vector<std::byte> buf(g.packed_bytes() + 64);
    std::byte* packed = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    PackExpert(g, gate.data(), up.data(), down.data(), packed);
    for (int m : {1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 40}) {
      SCOPED_TRACE(testing::Message() << WeightFormatName(f) << " H=" << H << " I=" << I << " group=" << g.group
                                      << " m=" << m);
      std::vector<bf16_t> x(size_t(m) * g.ldx(), 0);
      const std::vector<bf16_t> xs = RandomActivations(size_t(m) * H, seed + 3 + m);
      for (int r = 0; r < m; ++r) std::copy_n(xs.data() + size_t(r) * H, H, x.data() + size_t(r) * g.ldx());
      Rows xq, aq;
      const KernelRows xr = xq.Quantize(x.data(), m, g.Kh, g.ldx());
      // GateUp: the kernel in two column ranges, as the executor splits them.
      // Padding columns of act (past Ki) are never written or read.
      std::vector<bf16_t> act_ref(size_t(m) * g.lda()), act(size_t(m) * g.lda(), F32ToBf16(NAN));
      const int groups = g.gate_up_groups(), split = groups / 2;
      ref_->GateUp(g, packed, xr, m, act_ref.data(), 0, groups);
      kernel_->GateUp(g, packed, xr, m, act.data(), 0, split);
      kernel_->GateUp(g, packed, xr, m, act.data(), split, groups);
      std::vector<float> a32(act.size()), r32(act.size());
      Bf16ToF32(act.data(), a32.data(), act.size());
      Bf16ToF32(act_ref.data(), r32.data(), act.size());
      float amax = 0;
      for (float v : r32) amax = std::max(amax, std::fabs(v));
      size_t differ = 0;
      for (size_t i = 0; i < act.size(); ++i) {
        if (int(i % g.lda()) >= g.Ki) {
          act[i] = act_ref[i] = 0;
          continue;
        }
        ASSERT_LE(std::fabs(a32[i] - r32[i]), std::fabs(r32[i]) / 128 + 1e-5f * amax) << "act element " << i;
        differ += act[i] != act_ref[i];
      }
      // Over many scale groups (K = 2880: 90 of mxfp4's, 45 of int4's at group
      // 64) the two f32 orders differ enough to flip ~5% of the bf16 roundings
      // of small elements (int4 measured alike); each element's bound above and
      // Down's 1e-5 still hold there.
      EXPECT_LE(differ, act.size() / (g.Kh <= 512 ? 100 : 10)) << "act elements not bit-equal";
      CheckDown(g, packed, aq.Quantize(act_ref.data(), m, g.Ki, g.lda()), m, seed);
    }
  }

  // Down into rows of ldo > H floats holding random values, plus one row
  // past m that must stay as it was; so must the columns past H.
  void CheckDown(const ExpertGeometry& g, const std::byte* packed, const KernelRows& ar, int m, uint64_t seed) {
    const int ldo = g.H + 3;
    std::vector<float> weight(m);
    for (int r = 0; r < m; ++r) weight[r] = 0.25f + 0.125f * (r % 5);
    const std::vector<bf16_t> init16 = RandomActivations(size_t(m + 1) * ldo, seed + 7);
    std::vector<float> init(init16.size());
    Bf16ToF32(init16.data(), init.data(), init.size());
    std::vector<float> out_ref = init, out = init;
    const int groups = g.down_groups(), split = (groups + 1) / 2;
    ref_->Down(g, packed, ar, m, weight.data(), out_ref.data(), ldo, 0, groups);
    kernel_->Down(g, packed, ar, m, weight.data(), out.data(), ldo, 0, split);
    kernel_->Down(g, packed, ar, m, weight.data(), out.data(), ldo, split, groups);
    std::vector<double> got, want;
    for (int t = 0; t <= m; ++t) {
      for (int col = 0; col < ldo; ++col) {
        const size_t i = size_t(t) * ldo + col;
        if (col >= g.H || t == m) {
          ASSERT_EQ(out[i], init[i]) << "row " << t << " column " << col << " (H=" << g.H << ", m=" << m
                                     << ") written";
          continue;
        }
        got.push_back(out[i]);
        want.push_back(out_ref[i]);
      }
    }
    EXPECT_LE(RelativeL2Error(got.data(), want.data(), got.size()), 1e-5);
  }

  std::unique_ptr<ExpertKernel> kernel_, ref_;  // kernel_: the one under test
};

TEST_P(IntDirectTest, Int8MatchesReference) {
  Check(200, 136, WeightFormat::kInt8, 0, 101);
  Check(33, 17, WeightFormat::kInt8, 0, 102);
  Check(320, 200, WeightFormat::kInt8, 0, 103);
}

TEST_P(IntDirectTest, Int4MatchesReference) {
  Check(200, 136, WeightFormat::kInt4, 0, 111);  // default group 128
  Check(80, 48, WeightFormat::kInt4, 64, 112);
  Check(33, 17, WeightFormat::kInt4, 0, 113);
  Check(320, 200, WeightFormat::kInt4, 192, 114);
  // Kimi-K2's groups of 32 (compressed-tensors): 32-k-deep tiles on AMX, two scale groups per 64-k chunk.
  Check(200, 136, WeightFormat::kInt4, 32, 115);
  Check(33, 17, WeightFormat::kInt4, 32, 116);
  Check(7168 / 4, 2048 / 4, WeightFormat::kInt4, 32, 117);
}

// mxfp4 (group 32, E8M0 scales): the vpshufb-mapped nibbles on VNNI and the
// 32-k-deep int8 tiles on AMX against the reference's exact int32 sums; H =
// I = 2880 is GPT-OSS's (45 chunks of 64, 90 scale blocks).
TEST_P(IntDirectTest, Mxfp4MatchesReference) {
  Check(200, 136, WeightFormat::kMxfp4, 0, 121);
  Check(33, 17, WeightFormat::kMxfp4, 0, 122);
  Check(2880, 2880, WeightFormat::kMxfp4, 0, 123);
}

INSTANTIATE_TEST_SUITE_P(Kernels, IntDirectTest, ::testing::Values("avx512", "amx"),
                         [](const ::testing::TestParamInfo<const char*>& p) { return std::string(p.param); });

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

// A server started without --threads leaves cores to an engine that shares
// the host (measured: all 16 cores decoded 2.5x slower through transformers
// than 14), unless an affinity set cores aside or a CPU quota caps it.
TEST(NumaBinding, DefaultThreadsLeaveCoresToASameHostEngine) {
  EXPECT_EQ(ChooseDefaultThreads(16, true, true, 0).threads, 14);
  EXPECT_EQ(ChooseDefaultThreads(64, true, true, 0).threads, 60);
  EXPECT_EQ(ChooseDefaultThreads(16, true, false, 0).threads, 16);   // no engine here: every core
  EXPECT_EQ(ChooseDefaultThreads(8, false, true, 0).threads, 8);     // a cpuset set cores aside already
  EXPECT_EQ(ChooseDefaultThreads(16, true, true, 4.5).threads, 4);   // the quota binds
  EXPECT_EQ(ChooseDefaultThreads(16, false, false, 32).threads, 16); // a quota above the cores changes nothing
  EXPECT_EQ(ChooseDefaultThreads(2, true, true, 0).threads, 1);      // never below one
  EXPECT_EQ(ChooseDefaultThreads(1, true, true, 0.2).threads, 1);
  EXPECT_NE(ChooseDefaultThreads(16, true, true, 0).why.find("left to the engine"), std::string::npos);
  EXPECT_NE(ChooseDefaultThreads(16, true, true, 4).why.find("quota"), std::string::npos);
  // The real binding applies it and says how it chose.
  absl::StatusOr<std::unique_ptr<NumaBinding>> alone = NumaBinding::Create("auto", 0, false);
  absl::StatusOr<std::unique_ptr<NumaBinding>> shared = NumaBinding::Create("auto", 0, true);
  ASSERT_TRUE(alone.ok() && shared.ok());
  EXPECT_LE((*shared)->cpus().size(), (*alone)->cpus().size());
  EXPECT_GE((*shared)->cpus().size(), 1u);
  EXPECT_NE((*shared)->Describe().find("compute threads ("), std::string::npos) << (*shared)->Describe();
  if (const double quota = CgroupCpuQuota(); quota > 0) {
    EXPECT_LE((*alone)->cpus().size(), std::max<size_t>(1, static_cast<size_t>(quota)));
  }
}

TEST(ExpertStore, RefusesWhatDoesNotFit) {
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel("synthetic:deepseek-v3");
  ASSERT_TRUE(src.ok());
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 1);
  ASSERT_TRUE(numa.ok());
  ComputePool pool(**numa);
  HostedSet all{(*src)->spec().moe_layers, {}};
  for (int e = 0; e < 256; ++e) all.experts.push_back(e);
  absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(**src, ExpertGeometry::For((*src)->spec().hidden, (*src)->spec().intermediate), all, **numa, pool);
  ASSERT_EQ(store.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(store.status().message().find("bytes"), std::string::npos) << store.status();
  EXPECT_NE(store.status().message().find("available"), std::string::npos) << store.status();
}

// Packing quantizes within half a step: int8 per channel (scale = amax/127),
// int4 per group (scale <= amax/7); UnpackExpert returns what the kernels use.
TEST(ExpertPacking, IntegerFormatsRoundTripWithinHalfAStep) {
  const int H = 200, I = 136;
  std::unique_ptr<ModelSource> src = MakeSyntheticSource(TestSpec({H, I, 1, 1}, 0), 77);
  ExpertWeights w;
  ASSERT_TRUE(src->ReadExpert(0, 0, &w).ok());
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kInt4}) {
    const ExpertGeometry g = ExpertGeometry::For(H, I, f, f == WeightFormat::kInt4 ? 64 : 0);
    std::vector<std::byte> packed(g.packed_bytes() + 64);
    std::byte* p = packed.data() + (64 - reinterpret_cast<uintptr_t>(packed.data()) % 64) % 64;
    PackExpert(g, w.gate.data(), w.up.data(), w.down.data(), p);
    std::vector<float> back(size_t(3) * I * H);
    UnpackExpert(g, p, back.data(), back.data() + size_t(I) * H, back.data() + size_t(2) * I * H);
    const bf16_t* orig[3] = {w.gate.data(), w.up.data(), w.down.data()};
    for (int m = 0; m < 3; ++m) {
      const int N = m < 2 ? I : H, K = m < 2 ? H : I;
      const int group = f == WeightFormat::kInt4 ? g.group : K;
      for (int n = 0; n < N; ++n) {
        for (int k0 = 0; k0 < K; k0 += group) {
          double amax = 0;
          for (int k = k0; k < std::min(K, k0 + group); ++k) amax = std::max<double>(amax, std::fabs(Bf16ToF32(orig[m][size_t(n) * K + k])));
          const double step = f == WeightFormat::kBf16 ? 0 : amax / (f == WeightFormat::kInt8 ? 127.0 : 7.0);
          for (int k = k0; k < std::min(K, k0 + group); ++k) {
            const double v = Bf16ToF32(orig[m][size_t(n) * K + k]);
            ASSERT_LE(std::fabs(back[size_t(m) * I * H + size_t(n) * K + k] - v), step * 0.5 + 1e-6 * amax)
                << WeightFormatName(f) << " matrix " << m << " (" << n << ", " << k << ")";
          }
        }
      }
    }
  }
}

// The AVX-512 activation quantizer writes exactly what the scalar one does.
TEST(ExpertPacking, QuantizeRowsAvx512MatchesScalar) {
  if (!CpuFeatures::Get().HasAvx512Bf16()) GTEST_SKIP() << "QuantizeRowsAvx512 needs AVX-512 (this CPU: " << CpuFeatures::Get().Summary() << ")";
  const int m = 5, K = 192;
  std::vector<bf16_t> x = RandomActivations(size_t(m) * K, 91);
  for (int k = 0; k < K; ++k) x[size_t(4) * K + k] = 0;  // an all-zero row
  std::vector<int8_t> q1(2 * m * K), q2(2 * m * K);
  std::vector<float> s1(m), s2(m);
  std::vector<int32_t> u1(2 * m * K / 32), u2(2 * m * K / 32);
  QuantizeRowsScalar(x.data(), m, K, K, q1.data(), s1.data(), u1.data());
  QuantizeRowsAvx512(x.data(), m, K, K, q2.data(), s2.data(), u2.data());
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(s1, s2);
  EXPECT_EQ(u1, u2);
  EXPECT_EQ(s1[4], 0.0f);
  for (int r = 0; r < 2 * m; ++r)  // sum32: each 32-column chunk's codes
    for (int c = 0; c < K / 32; ++c) {
      int32_t sum = 0;
      for (int k = 32 * c; k < 32 * c + 32; ++k) sum += q1[size_t(r) * K + k];
      ASSERT_EQ(u1[size_t(r) * (K / 32) + c], sum) << "row " << r << " chunk " << c;
    }
  // hi + lo/254 rebuilds each row to ~15 bits.
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < K; ++k) {
      const double v = s1[r] * (q1[size_t(2 * r) * K + k] + q1[size_t(2 * r + 1) * K + k] / 254.0);
      ASSERT_NEAR(v, Bf16ToF32(x[size_t(r) * K + k]), s1[r] / 254.0 * 0.5 + 1e-7);
    }
}

// --weight-dtype: auto follows the checkpoint; the memory check counts the packed size.
TEST(ExpertStore, StorageGeometryFollowsTheFlagAndTheCheckpoint) {
  ModelSpec spec;
  spec.hidden = 7168;
  spec.intermediate = 2048;
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kBf16);
  spec.quant.scheme = WeightQuant::kFp8Block;  // its own codes and 128-column block scales: exact
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kFp8);
  EXPECT_EQ(StorageGeometry(spec, "auto")->group, 128);
  spec.quant.block_cols = 96;  // too narrow for the kernels' scale groups: int8
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt8);
  EXPECT_EQ(StorageGeometry(spec, "bf16")->format, WeightFormat::kBf16);
  spec.quant.scheme = WeightQuant::kInt4Group;
  spec.quant.group_size = 64;
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt4);
  EXPECT_EQ(StorageGeometry(spec, "auto")->group, 64);
  spec.quant.group_size = 32;  // Kimi-K2's: half a 64-column chunk, kept as int4 groups of 32
  EXPECT_EQ(StorageGeometry(spec, "int4")->group, 32);
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt4);
  EXPECT_EQ(StorageGeometry(spec, "auto")->group, 32);
  spec.quant.group_size = 96;  // neither 32 nor whole chunks: int8 (not re-quantized into int4 groups of 128)
  EXPECT_EQ(StorageGeometry(spec, "int4")->group, ExpertGeometry::kDefaultInt4Group);
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt8);
  absl::StatusOr<ExpertGeometry> bad = StorageGeometry(spec, "fp16");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--weight-dtype"), std::string::npos) << bad.status();
  const HostedSet one{{0}, {0}};
  const double bf16 = ExpertStore::BytesNeeded(*StorageGeometry(spec, "bf16"), one);
  const double int8 = ExpertStore::BytesNeeded(*StorageGeometry(spec, "int8"), one);
  const double int4 = ExpertStore::BytesNeeded(*StorageGeometry(spec, "int4"), one);
  EXPECT_NEAR(int8 / bf16, 0.5, 0.01);
  EXPECT_NEAR(int4 / bf16, 0.25 + 2.0 / 128, 0.002);  // 4 bits plus one f32 scale per group of 128
  // mxfp4: asked for, or kept from an MXFP4 checkpoint (safetensors, or a GGUF of MXFP4 experts only).
  EXPECT_EQ(StorageGeometry(spec, "mxfp4")->format, WeightFormat::kMxfp4);
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt8);  // int4 groups of 96 (above): not mxfp4
  spec.quant = QuantConfig{.scheme = WeightQuant::kMxfp4};
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kMxfp4);
  EXPECT_EQ(StorageGeometry(spec, "auto")->group, 32);
  spec.quant = QuantConfig{.scheme = WeightQuant::kGgufBlock, .gguf_bits = 4, .gguf_types = "MXFP4", .gguf_mxfp4 = true};
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kMxfp4);
  spec.quant.gguf_mxfp4 = false;  // MXFP4 beside another type: the int8 of any GGUF block type
  EXPECT_EQ(StorageGeometry(spec, "auto")->format, WeightFormat::kInt8);
  // 4.25 bits per weight: 4-bit codes and one byte per 32 (H = I = 2880, GPT-OSS's).
  spec.hidden = spec.intermediate = 2880;
  const double bf16_oss = ExpertStore::BytesNeeded(*StorageGeometry(spec, "bf16"), one);
  const double mx_oss = ExpertStore::BytesNeeded(*StorageGeometry(spec, "mxfp4"), one);
  EXPECT_NEAR(mx_oss / bf16_oss, 4.25 / 16, 0.003);
}

}  // namespace
}  // namespace moe
