// DeviceBackend conformance: every test runs against each backend ("cpu",
// "cuda") in each storage format (bf16, int8, int4, fp8, mxfp4: "cuda_int8" is the cuda
// backend with an int8 cache) and compares with a double-precision SwiGLU
// reference written here, computed from the weights the packed experts stand
// for (dequantized): relative L2 error <= 1e-2 for bf16, int8, fp8 and mxfp4,
// <= 3e-2 for int4.
// GPT-OSS's expert math (biases, clamped SwiGLU: core/expert_activation.h)
// runs through the same kernels in every format (GptOssBiasesAndClampedSwiglu),
// with inputs large enough that the clamp decides the result.
// Without a usable GPU the cuda instances are skipped (by name, with the
// reason); on a GPU host the same tests are the cuda backend's self-check.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/bf16.h"
#include "model/model_source.h"
#include "expert_compute/packed_index.h"
#include "testing/packed_expert.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "gpu_worker/device_backend.h"

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe {
namespace {

constexpr uint64_t kWeightSeed = 20261122;
// The stated bound per storage format (the CPU kernels also quantize activations).
double Tolerance(WeightFormat f) { return f == WeightFormat::kInt4 ? 3e-2 : 1e-2; }

struct Geometry {
  int H, I;
};
// Multiples of 8 (16-byte vector paths), a model-sized K loop, and odd sizes
// (element paths and tails).
constexpr Geometry kTiny{96, 80};
constexpr Geometry kWide{512, 256};
constexpr Geometry kOdd{100, 44};

// The experts' math: SiLU without biases (most families), or GPT-OSS's
// (gate/up/down biases, clamped SwiGLU).
struct ExpertMath {
  ExpertActivation activation;
  bool biases = false;
};
const ExpertMath kGptOss{ExpertActivation::ClampedSwiglu(ExpertActivation::kGptOssAlpha, ExpertActivation::kGptOssLimit),
                         true};

// One expert as LoadExpert takes it (packed in the backend's format) and the
// weights that stands for (gate [I,H], up [I,H], down [H,I] back to back, f32;
// then, with biases, gate [I], up [I], down [H]).
struct Expert {
  PackedExpert packed;
  std::vector<float> w;
  ExpertMath math;
  const std::byte* data() const { return packed.data(); }
};

// Synthetic expert `id`, packed in `format` (int4: scale groups of `group` k, 0: the default).
Expert MakeExpert(const Geometry& g, int id, WeightFormat format, const ExpertMath& math = {}, int group = 0) {
  const size_t ih = static_cast<size_t>(g.I) * g.H;
  Expert e;
  e.math = math;
  e.packed = MakePackedExpert(g.H, g.I, format, kWeightSeed, id, math.biases, group);
  e.w.resize(3 * ih + (math.biases ? 2 * g.I + g.H : 0));
  float* b = e.w.data() + 3 * ih;
  float* const biases[3] = {b, b + g.I, b + 2 * g.I};
  UnpackExpert(ExpertGeometry::For(g.H, g.I, format, group).WithExpertMath(math.activation, math.biases), e.packed.data(),
               e.w.data(), e.w.data() + ih, e.w.data() + 2 * ih, math.biases ? biases : nullptr);
  return e;
}

// out[H] += w * (down . act(gate . x + bg, up . x + bu) + bd), all in double,
// act the expert's activation (core/expert_activation.h), the biases when it
// has them.
void AddFfn(const Geometry& g, const Expert& ex, const bf16_t* x, double w, double* out) {
  const size_t ih = static_cast<size_t>(g.I) * g.H;
  const std::vector<float>& e = ex.w;
  const float* bias = ex.math.biases ? e.data() + 3 * ih : nullptr;
  std::vector<double> xd(g.H), act(g.I);
  for (int h = 0; h < g.H; ++h) xd[h] = Bf16ToF32(x[h]);
  AddExpertOutput<double>(e.data(), e.data() + ih, e.data() + 2 * ih, g.H, g.I, xd.data(), w, act.data(), out,
                          ex.math.activation, bias, bias ? bias + g.I : nullptr, bias ? bias + 2 * g.I : nullptr);
}

// A hit plan in owned host arrays.
struct Plan {
  std::vector<int32_t> buffer, row_begin, count, token;
  std::vector<float> weight;

  // Appends a group of `tokens` (-1: padding) through `buf`.
  void AddGroup(int buf, const std::vector<int32_t>& tokens, uint64_t seed) {
    buffer.push_back(buf);
    row_begin.push_back(static_cast<int32_t>(token.size()));
    count.push_back(static_cast<int32_t>(tokens.size()));
    for (size_t i = 0; i < tokens.size(); ++i) {
      token.push_back(tokens[i]);
      weight.push_back(0.25f + 0.5f * static_cast<float>((seed * 7919 + i * 104729) % 1000) / 1000.f);
    }
  }
  // The groups as a HitPlan, each group padded to a multiple of `align`
  // rows (the backend's hit_row_align()).
  HitPlan View(int align) const {
    groups_.expert.clear();
    groups_.row_begin.clear();
    groups_.count.clear();
    groups_.token.clear();
    groups_.weight.clear();
    for (size_t g = 0; g < buffer.size(); ++g) {
      groups_.expert.push_back(static_cast<int32_t>(g));
      groups_.row_begin.push_back(static_cast<int32_t>(groups_.token.size()));
      groups_.count.push_back(count[g]);
      groups_.token.insert(groups_.token.end(), token.begin() + row_begin[g], token.begin() + row_begin[g] + count[g]);
      groups_.weight.insert(groups_.weight.end(), weight.begin() + row_begin[g], weight.begin() + row_begin[g] + count[g]);
      while (groups_.token.size() % align != 0) {
        groups_.token.push_back(-1);
        groups_.weight.push_back(0.0f);
      }
    }
    groups_.total_rows = static_cast<int32_t>(groups_.token.size());
    groups_.total_pairs = 0;
    for (int32_t t : groups_.token) groups_.total_pairs += t >= 0;
    return HitPlan{&groups_, buffer.data()};
  }
  int max_count() const { return count.empty() ? 0 : *std::max_element(count.begin(), count.end()); }

 private:
  mutable ExpertGroups groups_;
};

// The plan of a routing: T tokens x k experts (Zipf-skewed over `experts`
// buffers, so counts are uneven and tokens receive several experts).
Plan PlanFromRouting(int T, int k, int experts, uint64_t seed) {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  RandomRouting(T, k, experts, seed, 1.1, &ids, &weights);
  Plan p;
  for (int e = 0; e < experts; ++e) {
    std::vector<int32_t> tokens;
    std::vector<float> w;
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        if (ids[static_cast<size_t>(t) * k + j] == e) {
          tokens.push_back(t);
          w.push_back(weights[static_cast<size_t>(t) * k + j]);
        }
    if (tokens.empty()) continue;
    p.AddGroup(e, tokens, seed + e);
    std::copy(w.begin(), w.end(), p.weight.end() - static_cast<long>(w.size()));
  }
  return p;
}

// ref[T*H] += the plan's FFNs of `x`, with buffer b holding experts[b].
void AddReference(const Geometry& g, const std::vector<Expert>& experts,
                  const bf16_t* x, const Plan& p, double* ref) {
  for (size_t grp = 0; grp < p.buffer.size(); ++grp)
    for (int r = p.row_begin[grp]; r < p.row_begin[grp] + p.count[grp]; ++r) {
      const int t = p.token[r];
      if (t < 0) continue;
      AddFfn(g, experts[p.buffer[grp]], x + static_cast<size_t>(t) * g.H, p.weight[r],
             ref + static_cast<size_t>(t) * g.H);
    }
}

double ErrorVsReference(const std::vector<bf16_t>& out, const std::vector<double>& ref) {
  std::vector<float> f(out.size());
  Bf16ToF32(out.data(), f.data(), out.size());
  return RelativeL2Error(f.data(), ref.data(), f.size());
}

#ifdef MOE_HAVE_CUDA
// Device memory for the kDevice cases.
class DeviceArray {
 public:
  explicit DeviceArray(size_t bytes) {
    if (cudaMalloc(&p_, std::max<size_t>(bytes, 1)) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};
#endif

class DeviceBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string param = GetParam();
    const size_t us = param.find('_');
    backend_name_ = param.substr(0, us);
    const std::string fmt = us == std::string::npos ? "bf16" : param.substr(us + 1);
    // int4g32: int4 in Kimi-K2's scale groups of 32 k (the default is 128).
    int4_group_ = fmt == "int4g32" ? 32 : 0;
    format_ = fmt == "int8"   ? WeightFormat::kInt8
              : fmt == "int4" || fmt == "int4g32" ? WeightFormat::kInt4
              : fmt == "fp8"  ? WeightFormat::kFp8
              : fmt == "mxfp4" ? WeightFormat::kMxfp4
                              : WeightFormat::kBf16;
    tolerance_ = Tolerance(format_);
    NewBackend();
  }

  // A config of geometry g in the test's format.
  BackendConfig Config(const Geometry& g, int num_buffers, int max_tokens, int max_top_k = 8) const {
    BackendConfig c;
    c.hidden = g.H;
    c.intermediate = g.I;
    c.num_buffers = num_buffers;
    c.max_tokens = max_tokens;
    c.max_top_k = max_top_k;
    c.contexts = 2;
    c.cpu_threads = 2;
    c.format = format_;
    c.int4_group = int4_group_;
    c.activation = math_.activation;
    c.biases = math_.biases;
    return c;
  }
  Expert Make(const Geometry& g, int id) const { return MakeExpert(g, id, format_, math_, int4_group_); }

  // A fresh, uninitialized backend (the tests that loop over geometries call
  // it per geometry; Init may be called once per backend).
  void NewBackend() {
    backend_.reset();
    absl::StatusOr<std::unique_ptr<DeviceBackend>> b = MakeDeviceBackend(backend_name_);
    if (!b.ok()) {
      if (backend_name_ == "cuda") GTEST_SKIP() << "no CUDA device: " << b.status().message();
      FAIL() << b.status();
    }
    backend_ = std::move(*b);
    ASSERT_STREQ(backend_->name(), backend_name_.c_str());
  }

  // Inits the backend for geometry g and loads `num_buffers` distinct experts
  // (buffer b holds expert 100 + b), waiting for the copies.
  void Start(const Geometry& g, int num_buffers, int max_tokens = 96, int max_top_k = 8) {
    geometry_ = g;
    ASSERT_TRUE(backend_->Init(Config(g, num_buffers, max_tokens, max_top_k)).ok());
    experts_.clear();
    for (int b = 0; b < num_buffers; ++b) {
      experts_.push_back(Make(g, 100 + b));
      absl::StatusOr<uint64_t> f = backend_->LoadExpert(b, experts_.back().data(), 0);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(backend_->WaitCopy(*f).ok());
      EXPECT_TRUE(backend_->CopyDone(*f));
    }
  }

  // Random activations times input_scale_.
  std::vector<bf16_t> Input(int T, uint64_t seed) const {
    std::vector<bf16_t> x = RandomActivations(static_cast<size_t>(T) * geometry_.H + 1, seed);
    if (input_scale_ != 1.0f)
      for (bf16_t& v : x) v = F32ToBf16(Bf16ToF32(v) * input_scale_);
    return x;
  }

  // One whole call in context ctx on host memory; returns the output.
  std::vector<bf16_t> Call(int ctx, int T, const std::vector<bf16_t>& x,
                           const std::vector<Plan>& plans) {
    std::vector<bf16_t> out(static_cast<size_t>(T) * geometry_.H + 1, 0x7fc0);
    absl::Status st = backend_->BeginCall(ctx, T, x.data(), MemoryKind::kHost);
    EXPECT_TRUE(st.ok()) << st;
    for (const Plan& p : plans) {
      st = backend_->RunExperts(ctx, p.View(backend_->hit_row_align()));
      EXPECT_TRUE(st.ok()) << st;
    }
    st = backend_->FinishCall(ctx, out.data(), MemoryKind::kHost);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(out.back(), 0x7fc0) << "FinishCall wrote past T x H";
    out.pop_back();
    return out;
  }

  std::vector<double> Reference(int T, const std::vector<bf16_t>& x,
                                const std::vector<Plan>& plans) const {
    std::vector<double> ref(static_cast<size_t>(T) * geometry_.H, 0.0);
    for (const Plan& p : plans) AddReference(geometry_, experts_, x.data(), p, ref.data());
    return ref;
  }

  // Runs `plans` on T tokens and checks the output against the reference.
  void ExpectMatches(int T, const std::vector<Plan>& plans, uint64_t seed,
                     const std::string& what) {
    const std::vector<bf16_t> x = Input(T, seed);
    const std::vector<bf16_t> out = Call(0, T, x, plans);
    const double err = ErrorVsReference(out, Reference(T, x, plans));
    EXPECT_LE(err, tolerance_) << what << " (H=" << geometry_.H << ", I=" << geometry_.I
                               << ", T=" << T << ")";
  }

  std::string backend_name_;
  WeightFormat format_ = WeightFormat::kBf16;
  int int4_group_ = 0;
  ExpertMath math_;           // the experts' math (Start loads experts of it)
  float input_scale_ = 1.0f;  // Input's activations scaled by this
  double tolerance_ = 1e-2;
  Geometry geometry_{};
  std::vector<Expert> experts_;
  std::unique_ptr<DeviceBackend> backend_;
};

// GPT-OSS experts (gate/up/down biases, clamped SwiGLU with alpha 1.702 and
// limit 7) in every format: the decode (few rows) and prompt (many rows)
// paths, the tiny, model-sized and odd geometries, with inputs 12x the usual
// scale so that most gate and up values pass the limit (checked: the same
// experts without the clamp differ by more than 10%).
TEST_P(DeviceBackendTest, GptOssBiasesAndClampedSwiglu) {
  math_ = kGptOss;
  input_scale_ = 12.0f;
  uint64_t seed = 300;
  for (const Geometry& g : {kTiny, kWide, kOdd}) {
    ASSERT_NO_FATAL_FAILURE(NewBackend());
    ASSERT_NO_FATAL_FAILURE(Start(g, 8, /*max_tokens=*/256));
    for (int T : {1, 4, 33, 256}) {
      const std::vector<Plan> plans = {PlanFromRouting(T, 4, 8, ++seed)};
      const std::vector<bf16_t> x = Input(T, ++seed);
      const std::vector<double> ref = Reference(T, x, plans);
      const double err = ErrorVsReference(Call(0, T, x, plans), ref);
      EXPECT_LE(err, tolerance_) << "H=" << g.H << " I=" << g.I << " T=" << T;
      // The clamp decides the result here: the unclamped math is far off.
      std::vector<Expert> saved = experts_;
      for (Expert& e : experts_) e.math.activation.limit = 1e30f;
      const std::vector<double> unclamped = Reference(T, x, plans);
      experts_ = std::move(saved);
      EXPECT_GT(RelativeL2Error(unclamped.data(), ref.data(), ref.size()), 0.1) << "the clamp changes nothing, T=" << T;
    }
  }
}

TEST_P(DeviceBackendTest, SingleRowGroups) {
  for (const Geometry& g : {kTiny, kOdd}) {
    ASSERT_NO_FATAL_FAILURE(NewBackend());
    ASSERT_NO_FATAL_FAILURE(Start(g, 4));
    Plan one;
    one.AddGroup(2, {0}, 1);
    ExpectMatches(1, {one}, 11, "one token, one expert");
    Plan each;  // every token its own group
    for (int t = 0; t < 5; ++t) each.AddGroup(t % 4, {t}, 10 + t);
    ExpectMatches(5, {each}, 12, "one row per group");
  }
}

TEST_P(DeviceBackendTest, UnevenGroupsFromRouting) {
  for (const Geometry& g : {kTiny, kWide, kOdd}) {
    ASSERT_NO_FATAL_FAILURE(NewBackend());
    ASSERT_NO_FATAL_FAILURE(Start(g, 12));
    // 64 tokens x top-4 over 12 Zipf-skewed experts: counts from 1 to > 32
    // (the cuda backend's cuBLAS path), every token receiving 4 experts.
    const Plan p = PlanFromRouting(64, 4, 12, 5);
    ASSERT_GT(p.max_count(), 32);
    ExpectMatches(64, {p}, 21, "routing plan");
    const Plan q = PlanFromRouting(9, 3, 12, 6);  // small groups only
    ExpectMatches(9, {q}, 22, "small routing plan");
  }
}

// Every group size the grouped kernels take (1 to 64 rows, the packed
// formats' CUDA-core and tensor-core paths; then several 64-row passes, and
// past the packed path's bound to cuBLAS), on a model-sized K loop and on
// sizes that are not multiples of 64 (padded chunks). Groups above 64 rows
// repeat tokens (T is 64): each row is its own pair.
TEST_P(DeviceBackendTest, EveryGroupSizeUpTo64RowsAndPasses) {
  for (const Geometry& g : {kWide, kTiny}) {
    ASSERT_NO_FATAL_FAILURE(NewBackend());
    ASSERT_NO_FATAL_FAILURE(Start(g, 3, /*max_tokens=*/64, /*max_top_k=*/16));
    for (int rows : {1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65, 130, 256, 257}) {
      Plan p;
      std::vector<int32_t> a(rows), b(rows);
      for (int r = 0; r < rows; ++r) a[r] = (r * 5) % 64, b[r] = (r * 7 + 3) % 64;
      p.AddGroup(0, a, 1);
      p.AddGroup(2, b, 2);
      p.AddGroup(1, {rows % 64}, 3);  // a one-row group beside them
      ExpectMatches(64, {p}, 70 + rows, "groups of " + std::to_string(rows) + " rows");
    }
  }
}

TEST_P(DeviceBackendTest, HandBuiltGroups) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 6));
  const int T = 48;
  Plan p;
  // Uneven counts, each group a different row pattern; tokens 0..3 receive
  // several experts; the 40-row group exceeds the grouped-kernel bound.
  p.AddGroup(0, {0}, 1);
  p.AddGroup(1, {0, 1, 2}, 2);
  p.AddGroup(2, {3, 0, 1, 4, 5, 6, 7}, 3);
  std::vector<int32_t> sixteen(16), forty(40), seventeen(17);
  std::iota(sixteen.begin(), sixteen.end(), 10);
  std::iota(forty.begin(), forty.end(), 3);
  std::iota(seventeen.begin(), seventeen.end(), 30);
  p.AddGroup(3, sixteen, 4);
  p.AddGroup(4, forty, 5);
  p.AddGroup(5, seventeen, 6);
  p.AddGroup(0, {}, 7);  // empty group
  p.AddGroup(5, {47, 2}, 8);
  ExpectMatches(T, {p}, 31, "hand-built groups");
}

TEST_P(DeviceBackendTest, PaddingRowsAreSkipped) {
  for (const Geometry& g : {kTiny, kOdd}) {
    ASSERT_NO_FATAL_FAILURE(NewBackend());
    ASSERT_NO_FATAL_FAILURE(Start(g, 3));
    Plan p;
    p.AddGroup(0, {-1, 0, -1, 1}, 1);
    p.AddGroup(1, {-1}, 2);  // padding only
    std::vector<int32_t> big;  // > 32 rows with padding in between
    for (int t = 0; t < 20; ++t) {
      big.push_back(t);
      big.push_back(-1);
    }
    p.AddGroup(2, big, 3);
    ExpectMatches(20, {p}, 41, "padding rows");
  }
}

TEST_P(DeviceBackendTest, EmptyAndSingleTokenCalls) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 2));
  // T = 0: no plan, then a plan of padding rows only.
  Plan none;
  ExpectMatches(0, {none}, 51, "T=0, empty plan");
  Plan pad;
  pad.AddGroup(1, {-1, -1}, 1);
  ExpectMatches(0, {pad}, 52, "T=0, padding plan");
  // T = 1 with no work: the output is zero.
  const std::vector<bf16_t> x = Input(1, 53);
  const std::vector<bf16_t> out = Call(0, 1, x, {none});
  for (bf16_t v : out) ASSERT_EQ(Bf16ToF32(v), 0.0f);
  // T = 1, both experts.
  Plan both;
  both.AddGroup(0, {0}, 2);
  both.AddGroup(1, {0}, 3);
  ExpectMatches(1, {both}, 54, "T=1, two experts");
}

TEST_P(DeviceBackendTest, SeveralRunExpertsPerCallAccumulate) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 4));
  const Plan a = PlanFromRouting(16, 2, 4, 61);
  const Plan b = PlanFromRouting(16, 2, 4, 62);
  ExpectMatches(16, {a, b, a}, 63, "three plans in one call");
}

TEST_P(DeviceBackendTest, GatherRowsCopiesActivations) {
  ASSERT_NO_FATAL_FAILURE(Start(kOdd, 1));
  for (const Geometry& g : {kOdd}) {
    const int T = 12;
    const std::vector<bf16_t> x = Input(T, 71);
    ASSERT_TRUE(backend_->BeginCall(1, T, x.data(), MemoryKind::kHost).ok());
    const std::vector<int32_t> rows = {11, 0, 5, 5, 3};
    std::vector<bf16_t> dst(rows.size() * g.H + 1, 0x1234);
    absl::StatusOr<uint64_t> f = backend_->GatherRows(1, rows.data(), static_cast<int>(rows.size()),
                                                      dst.data());
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(backend_->WaitCompute(*f).ok());
    for (size_t i = 0; i < rows.size(); ++i)
      for (int h = 0; h < g.H; ++h)
        ASSERT_EQ(dst[i * g.H + h], x[static_cast<size_t>(rows[i]) * g.H + h]) << i << "," << h;
    EXPECT_EQ(dst.back(), 0x1234);
    // n = 0 still yields a fence.
    f = backend_->GatherRows(1, rows.data(), 0, dst.data());
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(backend_->WaitCompute(*f).ok());
    std::vector<bf16_t> out(static_cast<size_t>(T) * g.H);
    ASSERT_TRUE(backend_->FinishCall(1, out.data(), MemoryKind::kHost).ok());
  }
}

TEST_P(DeviceBackendTest, AddRowsAddsPartials) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 3));
  const Geometry& g = kTiny;
  const int T = 10;
  const std::vector<bf16_t> x = Input(T, 81);
  const Plan p = PlanFromRouting(T, 2, 3, 82);
  const std::vector<int32_t> rows = {4, 9, 0, 4};  // row 4 twice
  const std::vector<bf16_t> partial = RandomActivations(rows.size() * g.H, 83, 0.5f);
  ASSERT_TRUE(backend_->BeginCall(0, T, x.data(), MemoryKind::kHost).ok());
  ASSERT_TRUE(backend_->RunExperts(0, p.View(backend_->hit_row_align())).ok());
  absl::StatusOr<uint64_t> f =
      backend_->AddRows(0, rows.data(), static_cast<int>(rows.size()), partial.data());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(backend_->WaitCompute(*f).ok());
  std::vector<bf16_t> out(static_cast<size_t>(T) * g.H);
  ASSERT_TRUE(backend_->FinishCall(0, out.data(), MemoryKind::kHost).ok());

  std::vector<double> ref = Reference(T, x, {p});
  for (size_t i = 0; i < rows.size(); ++i)
    for (int h = 0; h < g.H; ++h)
      ref[static_cast<size_t>(rows[i]) * g.H + h] += Bf16ToF32(partial[i * g.H + h]);
  EXPECT_LE(ErrorVsReference(out, ref), tolerance_);
}

TEST_P(DeviceBackendTest, ComputeWaitsForCopyFence) {
  // Buffers loaded with no WaitCopy: ComputeWaitCopy alone orders the compute.
  const Geometry& g = kWide;
  ASSERT_TRUE(backend_->Init(Config(g, 4, 32)).ok());
  geometry_ = g;
  // Registered sources, so the cuda copies are truly asynchronous.
  for (int b = 0; b < 4; ++b) experts_.push_back(Make(g, 200 + b));
  for (int b = 0; b < 4; ++b) {
    Expert& e = experts_[b];
    ASSERT_TRUE(backend_->RegisterHost(e.packed.bytes.get(), e.packed.size).ok());
    absl::StatusOr<uint64_t> f = backend_->LoadExpert(b, e.data(), 0);
    ASSERT_TRUE(f.ok()) << f.status();
    backend_->ComputeWaitCopy(*f);
  }
  const Plan p = PlanFromRouting(32, 2, 4, 91);
  ExpectMatches(32, {p}, 92, "compute after ComputeWaitCopy");
  for (Expert& e : experts_) backend_->UnregisterHost(e.packed.bytes.get());
}

TEST_P(DeviceBackendTest, BufferReusedAfterComputeFence) {
  ASSERT_NO_FATAL_FAILURE(Start(kWide, 2));
  const int T = 24;
  const std::vector<bf16_t> x = Input(T, 101);
  const Plan p = PlanFromRouting(T, 2, 2, 102);
  const std::vector<double> ref_old = Reference(T, x, {p});

  // In one call: compute from buffer 0, then overwrite buffer 0 behind a
  // compute fence; the call's result must still be the old expert's.
  ASSERT_TRUE(backend_->BeginCall(0, T, x.data(), MemoryKind::kHost).ok());
  ASSERT_TRUE(backend_->RunExperts(0, p.View(backend_->hit_row_align())).ok());
  const uint64_t done = backend_->RecordCompute();
  Expert replacement = Make(kWide, 999);
  // Registered, so the cuda copy is asynchronous and only the fence holds it back.
  ASSERT_TRUE(backend_->RegisterHost(replacement.packed.bytes.get(), replacement.packed.size).ok());
  absl::StatusOr<uint64_t> copy = backend_->LoadExpert(0, replacement.data(), done);
  ASSERT_TRUE(copy.ok()) << copy.status();
  std::vector<bf16_t> out(static_cast<size_t>(T) * kWide.H);
  ASSERT_TRUE(backend_->FinishCall(0, out.data(), MemoryKind::kHost).ok());
  EXPECT_LE(ErrorVsReference(out, ref_old), tolerance_) << "copy overtook compute";

  // The next call sees the new expert once the copy is waited for.
  backend_->ComputeWaitCopy(*copy);
  experts_[0] = replacement;
  ExpectMatches(T, {p}, 101, "after reuse");
  ASSERT_TRUE(backend_->WaitCopy(*copy).ok());
  EXPECT_TRUE(backend_->CopyDone(*copy));
  backend_->UnregisterHost(replacement.packed.bytes.get());
}

TEST_P(DeviceBackendTest, TwoContextsInterleave) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 4));
  const int T0 = 20, T1 = 7;
  const std::vector<bf16_t> x0 = Input(T0, 111), x1 = Input(T1, 112);
  const Plan p0 = PlanFromRouting(T0, 2, 4, 113), p1 = PlanFromRouting(T1, 3, 4, 114);
  ASSERT_TRUE(backend_->BeginCall(0, T0, x0.data(), MemoryKind::kHost).ok());
  ASSERT_TRUE(backend_->BeginCall(1, T1, x1.data(), MemoryKind::kHost).ok());
  ASSERT_TRUE(backend_->RunExperts(1, p1.View(backend_->hit_row_align())).ok());
  ASSERT_TRUE(backend_->RunExperts(0, p0.View(backend_->hit_row_align())).ok());
  std::vector<bf16_t> out0(static_cast<size_t>(T0) * kTiny.H), out1(static_cast<size_t>(T1) * kTiny.H);
  ASSERT_TRUE(backend_->FinishCall(1, out1.data(), MemoryKind::kHost).ok());
  ASSERT_TRUE(backend_->FinishCall(0, out0.data(), MemoryKind::kHost).ok());
  EXPECT_LE(ErrorVsReference(out0, Reference(T0, x0, {p0})), tolerance_);
  EXPECT_LE(ErrorVsReference(out1, Reference(T1, x1, {p1})), tolerance_);
}

TEST_P(DeviceBackendTest, RegisteredHostMemory) {
  // The path a dispatcher takes: inputs, gathered rows, partials and outputs
  // in registered memory (the cpu backend registers nothing and must agree).
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 3));
  const Geometry& g = kTiny;
  const int T = 16;
  const size_t n = static_cast<size_t>(T) * g.H;
  // One registered region holding x | gathered rows | partials | out.
  std::vector<bf16_t> region(4 * n + 64);
  ASSERT_TRUE(backend_->RegisterHost(region.data(), region.size() * sizeof(bf16_t)).ok());
  bf16_t* x = region.data();
  bf16_t* gathered = x + n;
  bf16_t* partial = gathered + n;
  bf16_t* out = partial + n + 8;  // 16-byte offset into the region
  const std::vector<bf16_t> xv = Input(T, 121);
  std::copy(xv.begin(), xv.begin() + static_cast<long>(n), x);
  const std::vector<bf16_t> pv = RandomActivations(n, 122, 0.5f);
  std::copy(pv.begin(), pv.end(), partial);
  const Plan p = PlanFromRouting(T, 2, 3, 123);
  std::vector<int32_t> rows(T);
  std::iota(rows.begin(), rows.end(), 0);
  std::reverse(rows.begin(), rows.end());

  ASSERT_TRUE(backend_->BeginCall(0, T, x, MemoryKind::kHost).ok());
  absl::StatusOr<uint64_t> gf = backend_->GatherRows(0, rows.data(), T, gathered);
  ASSERT_TRUE(gf.ok()) << gf.status();
  ASSERT_TRUE(backend_->RunExperts(0, p.View(backend_->hit_row_align())).ok());
  absl::StatusOr<uint64_t> af = backend_->AddRows(0, rows.data(), T, partial);
  ASSERT_TRUE(af.ok()) << af.status();
  ASSERT_TRUE(backend_->WaitCompute(*gf).ok());
  for (int i = 0; i < T; ++i)
    for (int h = 0; h < g.H; ++h)
      ASSERT_EQ(gathered[static_cast<size_t>(i) * g.H + h],
                x[static_cast<size_t>(rows[i]) * g.H + h]);
  ASSERT_TRUE(backend_->FinishCall(0, out, MemoryKind::kHost).ok());

  std::vector<double> ref = Reference(T, xv, {p});
  for (int i = 0; i < T; ++i)
    for (int h = 0; h < g.H; ++h)
      ref[static_cast<size_t>(rows[i]) * g.H + h] += Bf16ToF32(partial[static_cast<size_t>(i) * g.H + h]);
  EXPECT_LE(ErrorVsReference(std::vector<bf16_t>(out, out + n), ref), tolerance_);
  backend_->UnregisterHost(region.data());
}

TEST_P(DeviceBackendTest, FenceIdsIncreaseAndOldFencesAreDone) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 1));
  uint64_t prev = backend_->RecordCompute();
  const uint64_t first = prev;
  // More fences than any event ring is likely to hold.
  for (int i = 0; i < 3000; ++i) {
    const uint64_t f = backend_->RecordCompute();
    ASSERT_GT(f, prev);
    prev = f;
  }
  EXPECT_TRUE(backend_->WaitCompute(first).ok());
  EXPECT_TRUE(backend_->WaitCompute(prev).ok());
  EXPECT_TRUE(backend_->WaitCompute(0).ok());
  uint64_t copy = 0;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<uint64_t> f = backend_->LoadExpert(0, experts_[0].data(), prev);
    ASSERT_TRUE(f.ok());
    ASSERT_GT(*f, copy);
    copy = *f;
  }
  EXPECT_TRUE(backend_->WaitCopy(copy).ok());
  EXPECT_TRUE(backend_->CopyDone(copy));
}

// CopySeconds: the copy's own time once done (positive, and not more than
// the host saw from its start to its end), nothing for fence 0, an unissued
// fence or one too old to tell.
TEST_P(DeviceBackendTest, CopySecondsTimesDoneCopies) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 1));
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<uint64_t> f = backend_->LoadExpert(0, experts_[0].data(), 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(backend_->WaitCopy(*f).ok());
  const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::optional<double> s = backend_->CopySeconds(*f);
  ASSERT_TRUE(s.has_value());
  EXPECT_GT(*s, 0);
  EXPECT_LE(*s, host_s);
  EXPECT_FALSE(backend_->CopySeconds(0).has_value());
  EXPECT_FALSE(backend_->CopySeconds(*f + 1).has_value());
  uint64_t last = *f;
  for (int i = 0; i < 3000; ++i) {
    absl::StatusOr<uint64_t> g = backend_->LoadExpert(0, experts_[0].data(), 0);
    ASSERT_TRUE(g.ok());
    last = *g;
  }
  ASSERT_TRUE(backend_->WaitCopy(last).ok());
  EXPECT_FALSE(backend_->CopySeconds(*f).has_value()) << "a fence 3000 copies old";
  EXPECT_TRUE(backend_->CopySeconds(last).has_value());
}

TEST_P(DeviceBackendTest, DeviceMemoryCalls) {
  if (!backend_->has_device_memory()) GTEST_SKIP() << GetParam() << " has no device memory";
#ifdef MOE_HAVE_CUDA
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 3));
  const Geometry& g = kTiny;
  const int T = 8;
  const size_t n = static_cast<size_t>(T) * g.H;
  const std::vector<bf16_t> x = Input(T, 131);
  const Plan p = PlanFromRouting(T, 2, 3, 132);
  DeviceArray dx(n * sizeof(bf16_t)), dout(n * sizeof(bf16_t));
  ASSERT_NE(dx.as<void>(), nullptr);
  ASSERT_EQ(cudaMemcpy(dx.as<void>(), x.data(), n * sizeof(bf16_t), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_TRUE(backend_->BeginCall(0, T, dx.as<bf16_t>(), MemoryKind::kDevice).ok());
  ASSERT_TRUE(backend_->RunExperts(0, p.View(backend_->hit_row_align())).ok());
  ASSERT_TRUE(backend_->FinishCall(0, dout.as<bf16_t>(), MemoryKind::kDevice).ok());
  std::vector<bf16_t> out(n);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.as<void>(), n * sizeof(bf16_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_LE(ErrorVsReference(out, Reference(T, x, {p})), tolerance_);

  // Routing produced on the device comes back intact.
  const std::vector<int32_t> ids = {3, 1, 4, 1, 5, 9};
  const std::vector<float> w = {0.5f, 0.25f, 0.125f, 1.f, 2.f, 3.f};
  DeviceArray dids(ids.size() * 4), dw(w.size() * 4);
  ASSERT_EQ(cudaMemcpy(dids.as<void>(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.as<void>(), w.data(), w.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<int32_t> hids(ids.size());
  std::vector<float> hw(w.size());
  ASSERT_TRUE(backend_->RoutingToHost(dids.as<int32_t>(), dw.as<float>(), static_cast<int>(ids.size()),
                                      hids.data(), hw.data())
                  .ok());
  EXPECT_EQ(hids, ids);
  EXPECT_EQ(hw, w);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

TEST_P(DeviceBackendTest, RejectsOutOfRangeInput) {
  ASSERT_NO_FATAL_FAILURE(Start(kTiny, 2, /*max_tokens=*/8));
  const std::vector<bf16_t> x = Input(8, 141);
  EXPECT_FALSE(backend_->BeginCall(5, 1, x.data(), MemoryKind::kHost).ok()) << "context";
  EXPECT_FALSE(backend_->BeginCall(0, 9, x.data(), MemoryKind::kHost).ok()) << "T > max_tokens";
  EXPECT_FALSE(backend_->LoadExpert(2, experts_[0].data(), 0).ok()) << "buffer";
  ASSERT_TRUE(backend_->BeginCall(0, 4, x.data(), MemoryKind::kHost).ok());
  const std::vector<int32_t> rows = {4};
  std::vector<bf16_t> dst(kTiny.H);
  EXPECT_FALSE(backend_->GatherRows(0, rows.data(), 1, dst.data()).ok()) << "row >= T";
  EXPECT_FALSE(backend_->AddRows(0, rows.data(), 1, dst.data()).ok()) << "row >= T";
  Plan p;
  p.AddGroup(0, {0, 4}, 1);
  EXPECT_FALSE(backend_->RunExperts(0, p.View(backend_->hit_row_align())).ok()) << "token >= T";
  std::vector<bf16_t> out(4 * kTiny.H);
  EXPECT_TRUE(backend_->FinishCall(0, out.data(), MemoryKind::kHost).ok());
}

// An expert of geometry g in `format` whose packed bytes `write` fills
// (from zeros), and the weights those bytes stand for.
Expert HandPackedExpert(const Geometry& g, WeightFormat format, const std::function<void(const ExpertGeometry&, std::byte*)>& write) {
  const ExpertGeometry eg = ExpertGeometry::For(g.H, g.I, format);
  Expert e;
  e.packed.size = eg.packed_bytes();
  e.packed.bytes.reset(static_cast<std::byte*>(std::aligned_alloc(64, (e.packed.size + 63) / 64 * 64)), std::free);
  std::fill_n(e.packed.bytes.get(), e.packed.size, std::byte{0});
  write(eg, e.packed.bytes.get());
  const size_t ih = static_cast<size_t>(g.I) * g.H;
  e.w.resize(3 * ih);
  UnpackExpert(eg, e.data(), e.w.data(), e.w.data() + ih, e.w.data() + 2 * ih);
  return e;
}

// A format's hand-made codes decoded exactly: experts make(g, 0) and
// make(g, 1) in buffers 0 and 1, for kWide, kTiny and kOdd (the CUDA-core
// kernels), called in two groups of each row count 1-257 (T = 130;
// larger groups repeat tokens), within 5e-3 (the weights are exact in bf16:
// bf16 rounding of act and output only). The cuda backend's paths: the
// tensor-core kernel at 8 (1-8 rows), 16, 32 and 64 rows per pass (several
// passes from 65), dequantize + cuBLAS above 256 rows.
class HandMadeCodesTest : public DeviceBackendTest {
 protected:
  void ExpectDecodedExactly(const std::function<Expert(const Geometry&, int)>& make, const std::string& what) {
    tolerance_ = 5e-3;
    for (const Geometry& g : {kWide, kTiny, kOdd}) {
      ASSERT_NO_FATAL_FAILURE(NewBackend());
      geometry_ = g;
      ASSERT_TRUE(backend_->Init(Config(g, 2, 130)).ok());
      experts_.clear();
      for (int b = 0; b < 2; ++b) {
        experts_.push_back(make(g, b));
        absl::StatusOr<uint64_t> f = backend_->LoadExpert(b, experts_.back().data(), 0);
        ASSERT_TRUE(f.ok()) << f.status();
        ASSERT_TRUE(backend_->WaitCopy(*f).ok());
      }
      for (int n : {1, 3, 8, 12, 17, 33, 64, 130, 257}) {
        Plan p;
        std::vector<int32_t> a(n), b(n);
        for (int r = 0; r < n; ++r) a[r] = r % 130, b[r] = (r * 7 + 3) % 130;
        p.AddGroup(0, a, 1);
        p.AddGroup(1, b, 2);
        ExpectMatches(130, {p}, 90 + n, what + ", groups of " + std::to_string(n) + " rows");
      }
    }
  }
};

// fp8 slots whose codes are all zero or subnormal (3/4) or the smallest
// normals (exponent 1; random signs; scale_inv 2^7 makes them weights of
// ordinary size), so that a code decoded wrongly moves the output (random
// weights hold too few such codes for that). The weights are exact in bf16,
// so the bound is 5e-3 (bf16 rounding of act and output only).
class Fp8SmallCodesTest : public HandMadeCodesTest {
 protected:
  Expert SmallCodes(const Geometry& g, int id) const {
    ExpertCodes w8;
    uint64_t state = 0x9E3779B97F4A7C15ull * (id + 1);
    for (auto [p, rows, cols] : {std::tuple{&w8.gate, g.I, g.H}, std::tuple{&w8.up, g.I, g.H}, std::tuple{&w8.down, g.H, g.I}}) {
      p->scheme = WeightQuant::kFp8Block, p->rows = rows, p->cols = cols, p->br = p->bc = 128, p->scale_cols = (cols + 127) / 128;
      p->scales.assign(static_cast<size_t>((rows + 127) / 128) * p->scale_cols, 128.0f);
      p->codes.resize(static_cast<size_t>(rows) * cols);
      for (uint8_t& c : p->codes) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t v = (state >> 33) % 32;
        c = static_cast<uint8_t>(v < 24 ? v % 8 : 8 + v % 8);  // 3/4 zero or subnormal, 1/4 the smallest normals
        if ((state >> 60) & 1) c |= 0x80;
      }
    }
    return HandPackedExpert(g, WeightFormat::kFp8, [&](const ExpertGeometry& eg, std::byte* dst) {
      EXPECT_TRUE(PackExpertCodes(eg, w8, dst).ok());
    });
  }
};

TEST_P(Fp8SmallCodesTest, DecodeExactly) {
  ExpectDecodedExactly([&](const Geometry& g, int id) { return SmallCodes(g, id); }, "small fp8 codes");
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8SmallCodesTest, ::testing::Values("cpu_fp8", "cuda_fp8"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// mxfp4 slots whose nibbles are uniform over all 16 E2M1 codes (the
// subnormal +-0.5 and -0 included) and whose E8M0 exponents vary per 32-k
// group and channel over 2^-10 .. 2^10: a code decoded wrongly or a scale
// row read for the wrong group or channel moves the output (quantized random
// weights use each group's top codes far more often). Weights are exact in
// bf16 (a code times a power of 2), so the bound is bf16 rounding of act and
// output: 5e-3.
class Mxfp4AllCodesTest : public HandMadeCodesTest {
 protected:
  Expert AllCodes(const Geometry& g, int id) const {
    uint64_t state = 0x9E3779B97F4A7C15ull * (id + 1);
    auto next = [&] { return state = state * 6364136223846793005ull + 1442695040888963407ull, uint32_t(state >> 33); };
    // Block of `channels` valid channels and K valid columns (of Kp): random codes there (padding stays zero,
    // as the packer leaves it), a random exponent per (32-k group, channel).
    auto fill = [&](std::byte* blk, int channels, int K, int Kp) {
      for (int c = 0; c < channels; ++c)
        for (int k = 0; k < K; ++k) {
          bool high;
          uint8_t& b = reinterpret_cast<uint8_t&>(blk[layout::Int4Offset(c, k, &high)]);
          const uint8_t n = next() & 0x0F;
          b = high ? static_cast<uint8_t>((b & 0x0F) | (n << 4)) : static_cast<uint8_t>((b & 0xF0) | n);
        }
      for (int i = 0; i < Kp / 32 * 16; ++i) blk[Kp * 8 + i] = std::byte(117 + next() % 21);
    };
    return HandPackedExpert(g, WeightFormat::kMxfp4, [&](const ExpertGeometry& eg, std::byte* dst) {
      for (int b = 0; b < 2 * eg.gate_up_groups(); ++b)
        fill(dst + b * eg.block_bytes(eg.Kh), std::min(16, g.I - 16 * (b / 2)), g.H, eg.Kh);
      for (int b = 0; b < eg.Hn / 16; ++b)
        fill(dst + eg.gate_up_bytes() + b * eg.block_bytes(eg.Ki), std::min(16, g.H - 16 * b), g.I, eg.Ki);
    });
  }
};

TEST_P(Mxfp4AllCodesTest, DecodeExactly) {
  ExpectDecodedExactly([&](const Geometry& g, int id) { return AllCodes(g, id); }, "all mxfp4 codes");
}

INSTANTIATE_TEST_SUITE_P(Backends, Mxfp4AllCodesTest, ::testing::Values("cpu_mxfp4", "cuda_mxfp4"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

INSTANTIATE_TEST_SUITE_P(Backends, DeviceBackendTest,
                         ::testing::Values("cpu", "cuda", "cpu_int8", "cuda_int8", "cpu_int4", "cuda_int4", "cpu_int4g32",
                                           "cuda_int4g32", "cpu_fp8", "cuda_fp8", "cpu_mxfp4", "cuda_mxfp4"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace moe
