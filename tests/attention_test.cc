// AttentionStep (cpu and cuda) against the double-precision ReferenceAttention:
// decode steps at varied positions after PrefillCache, hidden states, MoE
// input and routing; argument checks; AttentionConfigFor. The cuda cases skip
// (naming the reason) where no GPU is usable.
#include "bench/model/attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "model/model_spec.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "bench/model/attention_reference.h"
#include "gtest/gtest.h"

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe {
namespace {

AttentionConfig SmallConfig() {
  AttentionConfig c;
  c.hidden = 128;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.num_experts = 8;
  c.top_k = 2;
  c.num_layers = 2;
  c.max_batch = 8;
  c.max_seq = 160;
  c.seed = 7;
  c.cpu_threads = 2;
  return c;
}

// Makes the step, or skips the test when the backend cannot exist here
// (cuda without CUDA compiled in or without a usable GPU).
#define MAKE_STEP_OR_SKIP(var, backend, config)                                               \
  std::unique_ptr<AttentionStep> var;                                                         \
  {                                                                                           \
    absl::StatusOr<std::unique_ptr<AttentionStep>> made = MakeAttentionStep(backend, config); \
    if (std::string(backend) == "cuda" &&                                                     \
        made.status().code() == absl::StatusCode::kFailedPrecondition)                        \
      GTEST_SKIP() << "no cuda here: " << made.status();                                      \
    ASSERT_TRUE(made.ok()) << made.status();                                                  \
    var = *std::move(made);                                                                   \
  }

// One array of n Ts in the memory a step's Run reads and writes, with copies
// to and from host vectors.
template <typename T>
class StepArray {
 public:
  StepArray(MemoryKind kind, size_t n) : kind_(kind), n_(n) {
    if (kind_ == MemoryKind::kHost) {
      host_.resize(n_);
      ptr_ = host_.data();
      return;
    }
#ifdef MOE_HAVE_CUDA
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n_ * sizeof(T)), cudaSuccess);
    ptr_ = static_cast<T*>(p);
#else
    ADD_FAILURE() << "device memory without CUDA";
#endif
  }
  ~StepArray() {
#ifdef MOE_HAVE_CUDA
    if (kind_ == MemoryKind::kDevice) cudaFree(ptr_);
#endif
  }
  StepArray(const StepArray&) = delete;
  StepArray& operator=(const StepArray&) = delete;

  T* get() { return ptr_; }
  void Set(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    if (kind_ == MemoryKind::kHost) {
      std::copy(v.begin(), v.end(), host_.begin());
      return;
    }
#ifdef MOE_HAVE_CUDA
    ASSERT_EQ(cudaMemcpy(ptr_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
#endif
  }
  std::vector<T> Get() const {
    if (kind_ == MemoryKind::kHost) return host_;
    std::vector<T> v(n_);
#ifdef MOE_HAVE_CUDA
    EXPECT_EQ(cudaMemcpy(v.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
#endif
    return v;
  }

 private:
  const MemoryKind kind_;
  const size_t n_;
  std::vector<T> host_;
  T* ptr_ = nullptr;
};

std::vector<double> ToDouble(const std::vector<bf16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = Bf16ToF32(v[i]);
  return d;
}

// Checks the routing of token t against the reference. An id may differ from
// the reference's only where the reference's logits of the two are a
// near-tie (within 1e-3); weights are compared with the reference's softmax
// over the ids the implementation chose, so a tie resolved the other way is
// still checked.
void ExpectRoutingMatches(const ReferenceAttention::Result& ref, int t, int E, int k,
                          const int32_t* ids, const float* weights, const std::string& where) {
  const double* lg = ref.logits.data() + static_cast<size_t>(t) * E;
  double max_chosen = -INFINITY;
  for (int j = 0; j < k; ++j) {
    const int32_t id = ids[j];
    ASSERT_GE(id, 0) << where;
    ASSERT_LT(id, E) << where;
    EXPECT_EQ(std::count(ids, ids + k, id), 1) << where << " repeats expert " << id;
    const int32_t want = ref.topk_ids[static_cast<size_t>(t) * k + j];
    if (id != want) {
      EXPECT_LE(std::abs(lg[id] - lg[want]), 1e-3)
          << where << " token " << t << " slot " << j << ": expert " << id << " (logit " << lg[id]
          << ") instead of " << want << " (logit " << lg[want] << ")";
    }
    max_chosen = std::max(max_chosen, lg[id]);
  }
  double sum = 0.0;
  for (int j = 0; j < k; ++j) sum += std::exp(lg[ids[j]] - max_chosen);
  for (int j = 0; j < k; ++j) {
    const double want = std::exp(lg[ids[j]] - max_chosen) / sum;
    EXPECT_NEAR(weights[j], want, 1e-2) << where << " token " << t << " slot " << j;
  }
}

// Runs decode steps through every layer of `c` on `backend` and compares each
// layer's output with the reference given the same input: PrefillCache(T,
// prefill), then one step per entry of `steps` (positions of the T tokens).
// Returns the mean seconds of one Run (timing printed by the large test).
double CheckDecodeSteps(const std::string& backend, const AttentionConfig& c, int T, int prefill,
                        const std::vector<std::vector<int32_t>>& steps) {
  absl::StatusOr<std::unique_ptr<AttentionStep>> made = MakeAttentionStep(backend, c);
  if (backend == "cuda" && made.status().code() == absl::StatusCode::kFailedPrecondition) {
    [&] { GTEST_SKIP() << "no cuda here: " << made.status(); }();
    return 0;
  }
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return 0;
  AttentionStep& step = **made;
  EXPECT_STREQ(step.name(), backend.c_str());
  ReferenceAttention ref(c);
  const int H = c.hidden, k = c.top_k, E = c.num_experts;
  EXPECT_TRUE(step.PrefillCache(T, prefill).ok());
  EXPECT_TRUE(ref.PrefillCache(T, prefill).ok());

  StepArray<bf16_t> h(step.memory_kind(), static_cast<size_t>(T) * H);
  StepArray<bf16_t> moe_in(step.memory_kind(), static_cast<size_t>(T) * H);
  StepArray<int32_t> ids(step.memory_kind(), static_cast<size_t>(T) * k);
  StepArray<float> weights(step.memory_kind(), static_cast<size_t>(T) * k);
  std::vector<bf16_t> h_host = RandomActivations(static_cast<size_t>(T) * H, /*seed=*/11);

  double run_seconds = 0;
  int runs = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    const std::vector<int32_t>& pos = steps[s];
    for (int layer = 0; layer < c.num_layers; ++layer) {
      const std::string where = "step " + std::to_string(s) + " layer " + std::to_string(layer);
      h.Set(h_host);
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status st =
          step.Run(layer, T, pos.data(), h.get(), moe_in.get(), ids.get(), weights.get());
      run_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++runs;
      EXPECT_TRUE(st.ok()) << where << ": " << st;
      if (!st.ok()) return 0;
      ReferenceAttention::Result want;
      EXPECT_TRUE(ref.Run(layer, T, pos.data(), h_host.data(), &want).ok());

      const std::vector<bf16_t> h_out = h.Get();
      const std::vector<double> h_got = ToDouble(h_out), x_got = ToDouble(moe_in.Get());
      const size_t n = static_cast<size_t>(T) * H;
      EXPECT_LE(RelativeL2Error(h_got.data(), want.h.data(), n), 1e-2) << where;
      EXPECT_LE(RelativeL2Error(x_got.data(), want.moe_in.data(), n), 1e-2) << where;
      // The attention's own contribution (h_out - h_in), which the residual
      // would otherwise dwarf, is checked too, and must be neither ~0 nor huge.
      std::vector<double> delta_got(n), delta_want(n), h_in = ToDouble(h_host);
      for (size_t i = 0; i < n; ++i) {
        delta_got[i] = h_got[i] - h_in[i];
        delta_want[i] = want.h[i] - h_in[i];
      }
      EXPECT_LE(RelativeL2Error(delta_got.data(), delta_want.data(), n), 2e-2) << where;
      const double delta_scale = RelativeL2Error(h_in.data(), h_got.data(), n);
      EXPECT_GT(delta_scale, 0.01) << where << ": attention barely changes h";
      EXPECT_LT(delta_scale, 20.0) << where << ": attention output blows up";

      const std::vector<int32_t> ids_got = ids.Get();
      const std::vector<float> w_got = weights.Get();
      for (int t = 0; t < T; ++t) {
        ExpectRoutingMatches(want, t, E, k, ids_got.data() + static_cast<size_t>(t) * k,
                             w_got.data() + static_cast<size_t>(t) * k, where);
      }
      h_host = h_out;  // the next layer / step continues from this backend's output
    }
  }
  return run_seconds / std::max(runs, 1);
}

// Steps at varied positions: three inside a prefilled context of `prefill`
// (token 0 starting at position 0, the others spread over the context; keys
// past pos[t] must be ignored), then one at the end of the cache. (Contexts
// past 64 positions make the cuda backend split a (token, head) over several
// blocks, and mixed lengths leave some of those splits empty.)
std::vector<std::vector<int32_t>> VariedSteps(int T, int prefill, int max_seq) {
  std::vector<std::vector<int32_t>> steps;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = (t * 37) % prefill + s;
    steps.push_back(pos);
  }
  std::vector<int32_t> last(T);
  for (int t = 0; t < T; ++t) last[t] = max_seq - 1 - t;
  steps.push_back(last);
  return steps;
}

class AttentionBackendTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(AttentionBackendTest, DecodeStepsMatchReference) {
  const auto& [backend, T] = GetParam();
  const AttentionConfig c = SmallConfig();
  CheckDecodeSteps(backend, c, T, 100, VariedSteps(T, 100, c.max_seq));
}

// Shapes off the power-of-two path: head_dim 36 (not a multiple of 8 or 32),
// 3 kv heads of 2 query heads each, 5 experts, top-3, H = 120.
TEST_P(AttentionBackendTest, DecodeStepsMatchReferenceOddShapes) {
  const auto& [backend, T] = GetParam();
  AttentionConfig c = SmallConfig();
  c.hidden = 120;
  c.num_heads = 6;
  c.num_kv_heads = 3;
  c.head_dim = 36;
  c.num_experts = 5;
  c.top_k = 3;
  c.max_seq = 130;
  c.seed = 99;
  CheckDecodeSteps(backend, c, T, 90, VariedSteps(T, 90, c.max_seq));
}

// Two steps of one config compute the same bits (weights and prefill are
// functions of the seed), and another seed gives other results.
TEST_P(AttentionBackendTest, DeterministicFromSeed) {
  const auto& [backend, T] = GetParam();
  AttentionConfig c = SmallConfig();
  auto run = [&](const AttentionConfig& config, std::vector<bf16_t>* x_out,
                 std::vector<int32_t>* ids_out) {
    MAKE_STEP_OR_SKIP(step, backend, config);
    ASSERT_TRUE(step->PrefillCache(T, 16).ok());
    StepArray<bf16_t> h(step->memory_kind(), static_cast<size_t>(T) * c.hidden);
    StepArray<bf16_t> x(step->memory_kind(), static_cast<size_t>(T) * c.hidden);
    StepArray<int32_t> ids(step->memory_kind(), static_cast<size_t>(T) * c.top_k);
    StepArray<float> w(step->memory_kind(), static_cast<size_t>(T) * c.top_k);
    h.Set(RandomActivations(static_cast<size_t>(T) * c.hidden, 5));
    std::vector<int32_t> pos(T, 16);
    ASSERT_TRUE(step->Run(1, T, pos.data(), h.get(), x.get(), ids.get(), w.get()).ok());
    *x_out = x.Get();
    *ids_out = ids.Get();
  };
  std::vector<bf16_t> x1, x2, x3;
  std::vector<int32_t> i1, i2, i3;
  run(c, &x1, &i1);
  if (IsSkipped()) return;
  run(c, &x2, &i2);
  EXPECT_EQ(x1, x2);
  EXPECT_EQ(i1, i2);
  c.seed += 1;
  run(c, &x3, &i3);
  EXPECT_NE(x1, x3);
}

TEST_P(AttentionBackendTest, RejectsBadArguments) {
  const auto& [backend, T] = GetParam();
  const AttentionConfig c = SmallConfig();
  MAKE_STEP_OR_SKIP(step, backend, c);
  StepArray<bf16_t> h(step->memory_kind(), static_cast<size_t>(c.max_batch + 1) * c.hidden);
  StepArray<bf16_t> x(step->memory_kind(), static_cast<size_t>(c.max_batch + 1) * c.hidden);
  StepArray<int32_t> ids(step->memory_kind(), static_cast<size_t>(c.max_batch + 1) * c.top_k);
  StepArray<float> w(step->memory_kind(), static_cast<size_t>(c.max_batch + 1) * c.top_k);
  auto expect_invalid = [](const absl::Status& st, const std::string& field) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(field), std::string::npos)
        << "'" << st.message() << "' does not name " << field;
  };
  std::vector<int32_t> pos(c.max_batch + 1, 3);
  pos[T - 1] = c.max_seq;
  expect_invalid(step->Run(0, T, pos.data(), h.get(), x.get(), ids.get(), w.get()),
                 "pos[" + std::to_string(T - 1) + "]");
  pos[T - 1] = -1;
  expect_invalid(step->Run(0, T, pos.data(), h.get(), x.get(), ids.get(), w.get()), "pos[");
  pos[T - 1] = 3;
  expect_invalid(step->Run(0, c.max_batch + 1, pos.data(), h.get(), x.get(), ids.get(), w.get()),
                 "T = ");
  expect_invalid(step->Run(0, -1, pos.data(), h.get(), x.get(), ids.get(), w.get()), "T = ");
  expect_invalid(step->Run(c.num_layers, T, pos.data(), h.get(), x.get(), ids.get(), w.get()),
                 "layer");
  expect_invalid(step->Run(0, T, nullptr, h.get(), x.get(), ids.get(), w.get()), "pos");
  expect_invalid(step->Run(0, T, pos.data(), h.get(), nullptr, ids.get(), w.get()), "moe_in");
  expect_invalid(step->PrefillCache(T, c.max_seq + 1), "len");
  expect_invalid(step->PrefillCache(c.max_batch + 1, 4), "T = ");
  // T == 0 is a no-op; a valid call still works after the rejected ones.
  EXPECT_TRUE(step->Run(0, 0, nullptr, nullptr, nullptr, nullptr, nullptr).ok());
  h.Set(RandomActivations(static_cast<size_t>(c.max_batch + 1) * c.hidden, 3));
  EXPECT_TRUE(step->Run(0, T, pos.data(), h.get(), x.get(), ids.get(), w.get()).ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionBackendTest,
                         ::testing::Combine(::testing::Values("cpu", "cuda"),
                                            ::testing::Values(1, 5)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_T" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The cuda implementation at Qwen3-30B-A3B's geometry (H=2048, 32 heads, 4 kv
// heads, head_dim 128, 128 experts, top-8), one layer, 16 tokens over a
// ~300-position context and 1 token at 300, against the reference (about a
// second of double math); then prints the steady-state time of one Run for T = 1, 16, 64 at a
// 1024-position context. Skips without a GPU (the cpu backend is covered by
// the small configs).
TEST(AttentionCuda, MatchesReferenceAtQwen3Size) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("qwen3-30b-a3b", 1);
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<AttentionConfig> c = AttentionConfigFor(*spec, 64, 1100, 3);
  ASSERT_TRUE(c.ok()) << c.status();
  const int T = 16;
  std::vector<std::vector<int32_t>> steps(2, std::vector<int32_t>(T));
  for (int t = 0; t < T; ++t) {
    steps[0][t] = 300 + 7 * t;
    steps[1][t] = 301 + 7 * t;
  }
  CheckDecodeSteps("cuda", *c, T, 300, steps);
  if (IsSkipped() || HasFailure()) return;
  // One token: its positions are split over several blocks.
  CheckDecodeSteps("cuda", *c, 1, 300, {{300}, {301}});

  absl::StatusOr<std::unique_ptr<AttentionStep>> step = MakeAttentionStep("cuda", *c);
  ASSERT_TRUE(step.ok()) << step.status();
  constexpr int kContext = 1024;
  ASSERT_TRUE((*step)->PrefillCache(c->max_batch, kContext).ok());
  for (int batch : {1, 16, 64}) {
    StepArray<bf16_t> h(MemoryKind::kDevice, static_cast<size_t>(batch) * c->hidden);
    StepArray<bf16_t> x(MemoryKind::kDevice, static_cast<size_t>(batch) * c->hidden);
    StepArray<int32_t> ids(MemoryKind::kDevice, static_cast<size_t>(batch) * c->top_k);
    StepArray<float> w(MemoryKind::kDevice, static_cast<size_t>(batch) * c->top_k);
    h.Set(RandomActivations(static_cast<size_t>(batch) * c->hidden, 1));
    const std::vector<int32_t> pos(batch, kContext);
    constexpr int kWarmup = 5, kRuns = 50;
    std::chrono::steady_clock::time_point t0;
    for (int i = 0; i < kWarmup + kRuns; ++i) {
      if (i == kWarmup) t0 = std::chrono::steady_clock::now();
      ASSERT_TRUE((*step)->Run(0, batch, pos.data(), h.get(), x.get(), ids.get(), w.get()).ok());
    }
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        kRuns;
    std::printf("cuda attention step, qwen3-30b-a3b layer, T=%d, context %d: %.1f us per Run\n",
                batch, kContext + 1, us);
  }
}

TEST(AttentionConfig, ValidateNamesTheField) {
  AttentionConfig c = SmallConfig();
  EXPECT_TRUE(c.Validate().ok());
  c.num_kv_heads = 3;
  EXPECT_NE(std::string(c.Validate().message()).find("num_kv_heads"), std::string::npos);
  c = SmallConfig();
  c.head_dim = 33;
  EXPECT_NE(std::string(c.Validate().message()).find("head_dim"), std::string::npos);
  c = SmallConfig();
  c.top_k = 9;
  EXPECT_NE(std::string(c.Validate().message()).find("top_k"), std::string::npos);
  c = SmallConfig();
  c.max_seq = 0;
  EXPECT_NE(std::string(c.Validate().message()).find("max_seq"), std::string::npos);
  EXPECT_EQ(MakeAttentionStep("tpu", SmallConfig()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeAttentionStep("cpu", c).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttentionConfig, ForEveryPreset) {
  for (const std::string& preset : PresetNames()) {
    absl::StatusOr<ModelSpec> spec = PresetSpec(preset);
    ASSERT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<AttentionConfig> c = AttentionConfigFor(*spec, 16, 1024, 1);
    ASSERT_TRUE(c.ok()) << preset << ": " << c.status();
    EXPECT_EQ(c->hidden, spec->hidden);
    EXPECT_EQ(c->num_experts, spec->num_experts);
    EXPECT_EQ(c->top_k, spec->top_k);
    EXPECT_EQ(c->num_layers, spec->num_layers);
  }
  absl::StatusOr<AttentionConfig> qwen =
      AttentionConfigFor(*PresetSpec("qwen3-30b-a3b"), 8, 128, 0);
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(std::make_tuple(qwen->num_heads, qwen->num_kv_heads, qwen->head_dim),
            std::make_tuple(32, 4, 128));
  absl::StatusOr<AttentionConfig> ds = AttentionConfigFor(*PresetSpec("deepseek-v3"), 8, 128, 0);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(std::make_tuple(ds->num_heads, ds->num_kv_heads, ds->head_dim),
            std::make_tuple(56, 8, 128));
  absl::StatusOr<AttentionConfig> tiny = AttentionConfigFor(*PresetSpec("tiny"), 8, 128, 0);
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->num_heads * tiny->head_dim, 96);
  EXPECT_EQ(tiny->num_heads % tiny->num_kv_heads, 0);
}

}  // namespace
}  // namespace moe
