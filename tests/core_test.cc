// core: bf16/f16 conversions, model specs from config.json, expert naming,
// synthetic models and checkpoints, model sources, routing, reference MoE.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "core/bf16.h"
#include "core/flags.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "model/synthetic_model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace moe {
namespace {

TEST(Bf16, RoundTripAndRounding) {
  EXPECT_EQ(Bf16ToF32(F32ToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToF32(F32ToBf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(Bf16ToF32(F32ToBf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(Bf16ToF32(F32ToBf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(NAN))));
  EXPECT_TRUE(std::isinf(Bf16ToF32(F32ToBf16(INFINITY))));
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 10);
  for (int i = 0; i < 10000; ++i) {
    const float f = d(rng);
    EXPECT_LE(std::fabs(Bf16ToF32(F32ToBf16(f)) - f), std::fabs(f) / 256) << f;
  }
}

TEST(F16, RoundTrip) {
  for (float f : {0.0f, 1.0f, -3.25f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 1e-6f}) {
    EXPECT_NEAR(F16ToF32(F32ToF16(f)), f, std::fabs(f) / 1024 + 6e-8) << f;
  }
  EXPECT_TRUE(std::isinf(F16ToF32(F32ToF16(1e6f))));
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(NAN))));
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive f16 survives f32 and back
    EXPECT_EQ(F32ToF16(F16ToF32(static_cast<uint16_t>(h))), h);
  }
}

TEST(ModelSpec, FromDeepSeekConfig) {
  nlohmann::json c = {{"model_type", "deepseek_v3"}, {"num_hidden_layers", 61}, {"hidden_size", 7168},
                      {"moe_intermediate_size", 2048}, {"intermediate_size", 18432},
                      {"n_routed_experts", 256}, {"num_experts_per_tok", 8},
                      {"first_k_dense_replace", 3}, {"moe_layer_freq", 1}};
  absl::StatusOr<ModelSpec> s = ModelSpecFromConfig(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->intermediate, 2048);  // moe_intermediate_size wins over the dense one
  EXPECT_EQ(s->num_experts, 256);
  EXPECT_EQ(s->moe_layers.size(), 58u);
  EXPECT_EQ(s->moe_layers.front(), 3);
  EXPECT_FALSE(s->IsMoeLayer(2));
  EXPECT_EQ(s->naming, ExpertNaming::kMlpExperts);
}

TEST(ModelSpec, FromQwenAndMixtralConfigs) {
  nlohmann::json q = {{"model_type", "qwen3_moe"}, {"num_hidden_layers", 48}, {"hidden_size", 2048},
                      {"moe_intermediate_size", 768}, {"num_experts", 128}, {"num_experts_per_tok", 8},
                      {"decoder_sparse_step", 1}, {"mlp_only_layers", {0, 5}}};
  absl::StatusOr<ModelSpec> s = ModelSpecFromConfig(q);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->moe_layers.size(), 46u);
  EXPECT_FALSE(s->IsMoeLayer(5));
  nlohmann::json m = {{"model_type", "mixtral"}, {"num_hidden_layers", 32}, {"hidden_size", 4096},
                      {"intermediate_size", 14336}, {"num_local_experts", 8}, {"num_experts_per_tok", 2}};
  s = ModelSpecFromConfig(m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->naming, ExpertNaming::kBlockSparseMoe);
  EXPECT_EQ(s->intermediate, 14336);
  EXPECT_EQ(s->moe_layers.size(), 32u);
  nlohmann::json bad = m;
  bad.erase("num_local_experts");
  s = ModelSpecFromConfig(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("num_local_experts"), std::string::npos) << s.status();
}

TEST(ModelSpec, ExpertNames) {
  EXPECT_EQ(ExpertTensorName(ExpertNaming::kMlpExperts, 3, 17, Projection::kGate),
            "model.layers.3.mlp.experts.17.gate_proj.weight");
  EXPECT_EQ(ExpertTensorName(ExpertNaming::kMlpExperts, 3, 17, Projection::kDown),
            "model.layers.3.mlp.experts.17.down_proj.weight");
  EXPECT_EQ(ExpertTensorName(ExpertNaming::kBlockSparseMoe, 0, 7, Projection::kUp),
            "model.layers.0.block_sparse_moe.experts.7.w3.weight");
  EXPECT_EQ(ExpertTensorName(ExpertNaming::kBlockSparseMoe, 0, 7, Projection::kDown),
            "model.layers.0.block_sparse_moe.experts.7.w2.weight");
}

TEST(Synthetic, UriParsing) {
  absl::StatusOr<SyntheticModelUri> u = ParseSyntheticUri("synthetic:deepseek-v3:layers=4:seed=9");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->preset, "deepseek-v3");
  EXPECT_EQ(u->layers, 4);
  EXPECT_EQ(u->seed, 9u);
  EXPECT_FALSE(ParseSyntheticUri("synthetic:nope").ok());
  EXPECT_FALSE(ParseSyntheticUri("synthetic:tiny:layers=x").ok());
  EXPECT_FALSE(ParseSyntheticUri("synthetic:deepseek-v3:layers=2").ok());  // only dense layers left
  absl::StatusOr<ModelSpec> s = PresetSpec("qwen3-30b-a3b");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->hidden, 2048);
  EXPECT_EQ(s->intermediate, 768);
  EXPECT_EQ(s->num_experts, 128);
  EXPECT_EQ(s->top_k, 8);
}

TEST(Synthetic, RealisticScaleAndDeterminism) {
  std::vector<bf16_t> a(768 * 2048), b(a.size());
  GenerateExpertMatrix(5, 3, 7, Projection::kGate, 768, 2048, a.data());
  GenerateExpertMatrix(5, 3, 7, Projection::kGate, 768, 2048, b.data());
  EXPECT_EQ(a, b);
  GenerateExpertMatrix(5, 3, 8, Projection::kGate, 768, 2048, b.data());
  EXPECT_NE(a, b);
  double sum2 = 0;
  int zeros = 0;
  for (bf16_t v : a) {
    const double f = Bf16ToF32(v);
    sum2 += f * f;
    zeros += f == 0;
  }
  const double std = std::sqrt(sum2 / a.size());
  EXPECT_NEAR(std, 1.0 / std::sqrt(2048.0), 0.05 / std::sqrt(2048.0));
  EXPECT_LT(zeros, 100);
}

// A checkpoint written by the generator reads back (through the real safetensors
// path, in every dtype) as the same weights the in-memory synthetic model builds.
TEST(ModelSource, CheckpointMatchesSyntheticInEveryDtype) {
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    testing::TempDir dir;
    absl::StatusOr<ModelSpec> spec = PresetSpec("tiny");
    ASSERT_TRUE(spec.ok());
    spec->dtype = dt;
    ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), *spec, 11, 64 << 10).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> ck = OpenModel(dir.path());
    ASSERT_TRUE(ck.ok()) << ck.status();
    absl::StatusOr<std::unique_ptr<ModelSource>> syn = OpenModel("synthetic:tiny:seed=11");
    ASSERT_TRUE(syn.ok()) << syn.status();
    EXPECT_EQ((*ck)->spec().moe_layers, std::vector<int>({1, 2}));  // layer 0 is dense
    ExpertWeights a, b;
    ASSERT_TRUE((*ck)->ReadExpert(2, 5, &a).ok());
    ASSERT_TRUE((*syn)->ReadExpert(2, 5, &b).ok());
    if (dt == DType::kF16) {  // bf16 -> f16 -> bf16 may round in the last bit
      for (size_t i = 0; i < a.gate.size(); ++i)
        ASSERT_NEAR(Bf16ToF32(a.gate[i]), Bf16ToF32(b.gate[i]), std::fabs(Bf16ToF32(b.gate[i])) / 64 + 1e-6);
    } else {
      EXPECT_EQ(a.gate, b.gate);
      EXPECT_EQ(a.up, b.up);
      EXPECT_EQ(a.down, b.down);
    }
    EXPECT_FALSE((*ck)->ReadExpert(0, 0, &a).ok());  // dense layer
    EXPECT_FALSE((*ck)->ReadExpert(1, 8, &a).ok());  // expert out of range
  }
}

// A family whose model type implies the other naming but whose checkpoint
// keeps Mixtral's (PhiMoE, MiniMax): the tensors decide. And the config keys of
// other families (ERNIE 4.5: moe_num_experts / moe_k; Hunyuan: per-layer lists).
TEST(ModelSource, NamingFromTheTensorsAndOtherFamiliesConfigKeys) {
  testing::TempDir dir;
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-mixtral");
  ASSERT_TRUE(spec.ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), *spec, 2, 1 << 20).ok());
  nlohmann::json config = ConfigFromModelSpec(*spec);
  config["model_type"] = "phimoe";
  std::ofstream(dir.path() + "/config.json") << config.dump();
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ((*src)->spec().naming, ExpertNaming::kBlockSparseMoe);
  EXPECT_EQ((*src)->spec().moe_layers, spec->moe_layers);
  ExpertWeights got, want;
  ASSERT_TRUE((*src)->ReadExpert(1, 3, &got).ok());
  ASSERT_TRUE((*OpenModel("synthetic:tiny-mixtral:seed=2"))->ReadExpert(1, 3, &want).ok());
  EXPECT_EQ(got.down, want.down);

  nlohmann::json ernie = {{"model_type", "ernie4_5_moe"}, {"num_hidden_layers", 4}, {"hidden_size", 64},
                          {"moe_intermediate_size", 32}, {"moe_num_experts", 8}, {"moe_k", 2}};
  absl::StatusOr<ModelSpec> e = ModelSpecFromConfig(ernie);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->num_experts, 8);
  EXPECT_EQ(e->top_k, 2);
  nlohmann::json hunyuan = {{"model_type", "hunyuan_v1_moe"}, {"num_hidden_layers", 2}, {"hidden_size", 64},
                            {"intermediate_size", 32}, {"num_experts", 8}, {"moe_topk", {2, 2}}};
  absl::StatusOr<ModelSpec> h = ModelSpecFromConfig(hunyuan);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->top_k, 2);
  hunyuan["num_experts_per_tok"] = 1;  // both keys, as Hunyuan's config has them: its router's moe_topk
  h = ModelSpecFromConfig(hunyuan);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->top_k, 2);
  hunyuan["moe_topk"] = {2, 4};  // differs per layer: refused, naming the key
  h = ModelSpecFromConfig(hunyuan);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("moe_topk"), std::string::npos) << h.status();
}

TEST(ModelSource, MixtralNamingCheckpoint) {
  testing::TempDir dir;
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-mixtral");
  ASSERT_TRUE(spec.ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), *spec, 2, 1 << 20).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok());
  EXPECT_NE((*ck)->Find("model.layers.1.block_sparse_moe.experts.3.w2.weight"), nullptr);
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ((*src)->spec().naming, ExpertNaming::kBlockSparseMoe);
  ExpertWeights w;
  EXPECT_TRUE((*src)->ReadExpert(1, 3, &w).ok());
}

// Fused 3-D expert tensors (one gate_up_proj and one down_proj per layer) in
// the three layouts checkpoints use load to exactly the per-expert weights.
TEST(ModelSource, LoadsFusedThreeDExpertTensors) {
  absl::StatusOr<std::unique_ptr<ModelSource>> syn = OpenModel("synthetic:tiny:seed=3");
  ASSERT_TRUE(syn.ok());
  const ModelSpec& spec = (*syn)->spec();
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  // Under the naming the model type implies, or the other one (PhiMoE keeps
  // Mixtral's block_sparse_moe module; Granite names them input/output_linear).
  struct Layout {
    const char *model_type, *module, *gate_up, *down;
    bool x_times_w;
  };
  for (Layout lay : {Layout{"qwen3_moe", "mlp.experts.", "gate_up_proj", "down_proj", false},
                     Layout{"llama4_text", "mlp.experts.", "gate_up_proj", "down_proj", true},
                     Layout{"phimoe", "block_sparse_moe.experts.", "gate_up_proj", "down_proj", false},
                     Layout{"granitemoe", "block_sparse_moe.", "input_linear.weight", "output_linear.weight", false}}) {
    SCOPED_TRACE(lay.model_type);
    testing::TempDir dir;
    nlohmann::json config = ConfigFromModelSpec(spec);
    config["model_type"] = lay.model_type;
    std::ofstream(dir.path() + "/config.json") << config.dump();
    std::vector<TensorSpec> specs;
    for (int l : spec.moe_layers) {
      const std::string p = "model.layers." + std::to_string(l) + "." + lay.module;
      specs.push_back({p + lay.gate_up, DType::kBF16,
                       lay.x_times_w ? std::vector<int64_t>{E, H, 2 * I} : std::vector<int64_t>{E, 2 * I, H}});
      specs.push_back({p + lay.down, DType::kBF16,
                       lay.x_times_w ? std::vector<int64_t>{E, I, H} : std::vector<int64_t>{E, H, I}});
    }
    ASSERT_TRUE(WriteCheckpoint(dir.path(), specs, 1 << 20, [&](size_t i, std::span<std::byte> dst) {
                  bf16_t* v = reinterpret_cast<bf16_t*>(dst.data());
                  const int l = spec.moe_layers[i / 2];
                  for (int64_t e = 0; e < E; ++e) {
                    ExpertWeights w;
                    ASSERT_TRUE((*syn)->ReadExpert(l, static_cast<int>(e), &w).ok());
                    bf16_t* x = v + e * 2 * I * H;
                    for (int64_t r = 0; r < I; ++r)
                      for (int64_t h = 0; h < H; ++h) {
                        if (i % 2 == 1) {  // down [H,I] or its transpose
                          if (lay.x_times_w) v[e * I * H + r * H + h] = w.down[h * I + r];
                          else v[e * H * I + h * I + r] = w.down[h * I + r];
                        } else if (!lay.x_times_w) {
                          x[r * H + h] = w.gate[r * H + h];
                          x[(I + r) * H + h] = w.up[r * H + h];
                        } else {
                          x[h * 2 * I + r] = w.gate[r * H + h];
                          x[h * 2 * I + I + r] = w.up[r * H + h];
                        }
                      }
                  }
                }).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
    ASSERT_TRUE(src.ok()) << src.status();
    EXPECT_EQ((*src)->spec().moe_layers, spec.moe_layers);
    for (int l : spec.moe_layers)
      for (int e = 0; e < E; ++e) {
        ExpertWeights got, want;
        ASSERT_TRUE((*src)->ReadExpert(l, e, &got).ok());
        ASSERT_TRUE((*syn)->ReadExpert(l, e, &want).ok());
        EXPECT_EQ(got.gate, want.gate) << "layer " << l << " expert " << e;
        EXPECT_EQ(got.up, want.up) << "layer " << l << " expert " << e;
        EXPECT_EQ(got.down, want.down) << "layer " << l << " expert " << e;
      }
  }
  // Expert biases in a family without them are refused in one line naming
  // the tensor (served as plain SwiGLU experts they would be wrong); GPT-OSS
  // tensors of the wrong orientation (gate_up [E, 2I, H]) in one line naming
  // the family.
  for (const char* model_type : {"gpt_oss", "qwen3_moe"}) {
    testing::TempDir dir;
    nlohmann::json config = ConfigFromModelSpec(spec);
    config["model_type"] = model_type;
    std::ofstream(dir.path() + "/config.json") << config.dump();
    std::vector<TensorSpec> specs;
    for (int l : spec.moe_layers) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
      specs.push_back({p + "gate_up_proj", DType::kBF16, {E, 2 * I, H}});
      specs.push_back({p + "gate_up_proj_bias", DType::kBF16, {E, 2 * I}});
      specs.push_back({p + "down_proj", DType::kBF16, {E, H, I}});
    }
    ASSERT_TRUE(WriteCheckpoint(dir.path(), specs, 1 << 20, [](size_t, std::span<std::byte> d) {
                  std::fill(d.begin(), d.end(), std::byte{0x3c});
                }).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> refused = OpenModel(dir.path());
    ASSERT_FALSE(refused.ok()) << model_type;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(std::string(model_type) == "gpt_oss" ? "gpt_oss" : "gate_up_proj_bias"),
              std::string::npos)
        << refused.status();
    EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
  }
  // A fused tensor of the wrong shape refuses the model, naming it.
  testing::TempDir dir;
  std::ofstream(dir.path() + "/config.json") << ConfigFromModelSpec(spec).dump();
  ASSERT_TRUE(WriteCheckpoint(dir.path(),
                              {{"model.layers.1.mlp.experts.gate_up_proj", DType::kBF16, {E, 2 * I, H + 1}},
                               {"model.layers.1.mlp.experts.down_proj", DType::kBF16, {E, H, I}}},
                              1 << 20, [](size_t, std::span<std::byte>) {})
                  .ok());
  absl::StatusOr<std::unique_ptr<ModelSource>> bad = OpenModel(dir.path());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("gate_up_proj"), std::string::npos) << bad.status();
}

TEST(ModelSource, RejectsNanWeightsAndWrongShapes) {
  testing::TempDir dir;
  ModelSpec spec = *PresetSpec("tiny");
  // Write the tiny model by hand with a NaN in one tensor and a wrong shape in another.
  nlohmann::json config = ConfigFromModelSpec(spec);
  std::ofstream(dir.path() + "/config.json") << config.dump();
  std::vector<TensorSpec> specs;
  for (int l : spec.moe_layers)
    for (int e = 0; e < spec.num_experts; ++e)
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        std::vector<int64_t> shape = p == Projection::kDown ? std::vector<int64_t>{spec.hidden, spec.intermediate}
                                                            : std::vector<int64_t>{spec.intermediate, spec.hidden};
        if (l == 2 && e == 1 && p == Projection::kUp) shape = {spec.hidden, spec.intermediate};
        specs.push_back({ExpertTensorName(spec.naming, l, e, p), DType::kF32, shape});
      }
  ASSERT_TRUE(WriteCheckpoint(dir.path(), specs, 1 << 20, [&](size_t i, std::span<std::byte> dst) {
                float* f = reinterpret_cast<float*>(dst.data());
                for (size_t j = 0; j < dst.size() / 4; ++j) f[j] = 0.01f * static_cast<float>((j % 7) + 1);
                if (specs[i].name == ExpertTensorName(spec.naming, 1, 3, Projection::kDown)) f[5] = NAN;
                if (specs[i].name == ExpertTensorName(spec.naming, 1, 4, Projection::kGate)) f[0] = INFINITY;
              }).ok());
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
  ASSERT_TRUE(src.ok()) << src.status();
  ExpertWeights w;
  EXPECT_TRUE((*src)->ReadExpert(1, 2, &w).ok());
  absl::Status st = (*src)->ReadExpert(1, 3, &w);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("NaN"), std::string::npos) << st;
  st = (*src)->ReadExpert(1, 4, &w);
  EXPECT_NE(st.message().find("Inf"), std::string::npos) << st;
  st = (*src)->ReadExpert(2, 1, &w);
  EXPECT_NE(st.message().find("shape"), std::string::npos) << st;
}

TEST(ModelSource, MissingOrBrokenConfig) {
  testing::TempDir dir;
  EXPECT_EQ(OpenModel(dir.path()).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir.path() + "/config.json") << "{not json";
  EXPECT_EQ(OpenModel(dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Routing, ValidationNamesTheField) {
  std::vector<int32_t> ids = {0, 1, 2, 3};
  std::vector<float> w = {0.5f, 0.5f, 0.3f, 0.7f};
  RoutingView r{2, 2, ids.data(), w.data()};
  EXPECT_TRUE(ValidateRouting(r, 4, nullptr).ok());
  ids[3] = 4;
  EXPECT_NE(ValidateRouting(r, 4, nullptr).message().find("expert_ids[1,1]"), std::string::npos);
  ids[3] = 2;
  EXPECT_NE(ValidateRouting(r, 4, nullptr).message().find("repeats"), std::string::npos);
  ids[3] = 3;
  w[2] = NAN;
  EXPECT_NE(ValidateRouting(r, 4, nullptr).message().find("expert_weights[1,0]"), std::string::npos);
  w[2] = 0.3f;
  EXPECT_NE(ValidateRouting(r, 4, [](int e) { return e != 3; }).message().find("not hosted"), std::string::npos);
  ids[1] = -1;  // unused slot
  EXPECT_TRUE(ValidateRouting(r, 4, nullptr).ok());
}

TEST(Routing, GroupByExpertWithAlignment) {
  std::vector<int32_t> ids = {2, 0, 2, -1, 1, 2};
  std::vector<float> w = {0.1f, 0.2f, 0.3f, 0.0f, 0.5f, 0.6f};
  ExpertGroups g;
  GroupByExpert(RoutingView{3, 2, ids.data(), w.data()}, 4, 16, &g);
  ASSERT_EQ(g.num_groups(), 3);
  EXPECT_EQ(g.expert, std::vector<int32_t>({0, 1, 2}));
  EXPECT_EQ(g.count, std::vector<int32_t>({1, 1, 3}));
  EXPECT_EQ(g.row_begin, std::vector<int32_t>({0, 16, 32}));
  EXPECT_EQ(g.total_rows, 48);
  EXPECT_EQ(g.total_pairs, 5);
  EXPECT_EQ(g.token[32], 0);
  EXPECT_EQ(g.token[33], 1);
  EXPECT_EQ(g.token[34], 2);
  EXPECT_EQ(g.token[35], -1);
  EXPECT_FLOAT_EQ(g.weight[34], 0.6f);
}

TEST(ReferenceMoe, FloatMatchesDoubleAndLinearity) {
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel("synthetic:tiny:seed=4");
  ASSERT_TRUE(src.ok());
  ReferenceMoe ref(**src);
  const int n = 5, H = (*src)->spec().hidden;
  std::vector<bf16_t> x = RandomActivations(size_t(n) * H, 3);
  std::vector<int32_t> ids;
  std::vector<float> w;
  RandomRouting(n, 2, 8, 9, 0.0, &ids, &w);
  std::vector<float> f(n * H);
  std::vector<double> d(n * H);
  ASSERT_TRUE(ref.Forward<float>(1, n, x.data(), RoutingView{n, 2, ids.data(), w.data()}, f.data()).ok());
  ASSERT_TRUE(ref.Forward<double>(1, n, x.data(), RoutingView{n, 2, ids.data(), w.data()}, d.data()).ok());
  EXPECT_LT(RelativeL2Error(f.data(), d.data(), f.size()), 1e-5);
  // Splitting the pairs of each token over two calls and adding gives the same result.
  std::vector<int32_t> a = ids, b = ids;
  for (int t = 0; t < n; ++t) { a[2 * t + 1] = -1; b[2 * t] = -1; }
  std::vector<double> da(n * H), db(n * H);
  ASSERT_TRUE(ref.Forward<double>(1, n, x.data(), RoutingView{n, 2, a.data(), w.data()}, da.data()).ok());
  ASSERT_TRUE(ref.Forward<double>(1, n, x.data(), RoutingView{n, 2, b.data(), w.data()}, db.data()).ok());
  for (size_t i = 0; i < d.size(); ++i) ASSERT_NEAR(da[i] + db[i], d[i], 1e-9 + 1e-9 * std::fabs(d[i]));
  double norm = 0;
  for (double v : d) norm += v * v;
  EXPECT_GT(norm, 0.0);
}

TEST(Flags, IndexLists) {
  absl::StatusOr<std::vector<int>> v = ParseIndexList("3-5,1,4", 10, "layers");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, std::vector<int>({1, 3, 4, 5}));
  EXPECT_FALSE(ParseIndexList("3-12", 10, "layers").ok());
  EXPECT_FALSE(ParseIndexList("x", 10, "layers").ok());
  EXPECT_NE(ParseIndexList("5-3", 10, "experts").status().message().find("--experts"), std::string::npos);
}

// The flags of the FlagSet tests below, registered on `f`.
struct TestFlags {
  std::string name = "a";
  int64_t count = 4;
  double ratio = 0.5;
  bool fast = false, share = true;

  explicit TestFlags(FlagSet& f) {
    f.String("name", &name, "a string");
    f.Int("count", &count, "an integer");
    f.Double("ratio", &ratio, "a double");
    f.Bool("fast", &fast, "off by default");
    f.Bool("share", &share, "on by default");
  }
};

// f.Parse of "prog ARGS...".
std::vector<std::string> ParseArgs(FlagSet& f, std::vector<std::string> args) {
  std::string prog = "prog";
  std::vector<char*> argv = {prog.data()};
  for (std::string& a : args) argv.push_back(a.data());
  return f.Parse(static_cast<int>(argv.size()), argv.data());
}

// Writes `text` to DIR/name and returns the path.
std::string WriteFile(const testing::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(Flags, ValuesBooleansAndPositionals) {
  FlagSet f("prog", "[flags] ARGS");
  TestFlags v(f);
  const std::vector<std::string> rest =
      ParseArgs(f, {"one", "--name=x", "--count", "-7", "--ratio", "0.25", "--fast", "two", "--count=010", "-5",
                    "--", "--share=false"});
  EXPECT_EQ(v.name, "x");
  EXPECT_EQ(v.count, 10);  // the last one counts; decimal, not octal
  EXPECT_EQ(v.ratio, 0.25);
  EXPECT_TRUE(v.fast);
  EXPECT_TRUE(v.share);  // after "--": a positional
  EXPECT_EQ(rest, std::vector<std::string>({"one", "two", "-5", "--share=false"}));

  FlagSet g("prog", "");
  TestFlags w(g);
  EXPECT_TRUE(ParseArgs(g, {"--name=", "--fast=false", "--share=yes"}).empty());
  EXPECT_EQ(w.name, "");  // "--name=" is empty, it does not take the next argument
  EXPECT_FALSE(w.fast);
  EXPECT_TRUE(w.share);
}

TEST(Flags, NoNameTurnsABooleanOff) {
  FlagSet f("prog", "");
  TestFlags v(f);
  ParseArgs(f, {"--no-share", "--fast", "--no-fast"});
  EXPECT_FALSE(v.share);
  EXPECT_FALSE(v.fast);
  FlagSet g("prog", "");
  TestFlags w(g);
  ParseArgs(g, {"--no-fast", "--fast"});
  EXPECT_TRUE(w.fast);
}

TEST(Flags, CommandLineWinsOverConfigWhateverTheOrder) {
  testing::TempDir dir;
  const std::string config = WriteFile(
      dir, "c.json", R"({"name": "file", "count": 9, "ratio": 2, "fast": true, "no-share": true})");
  FlagSet f("prog", "");
  TestFlags v(f);
  ParseArgs(f, {"--count=1", "--config", config, "--name", "cli"});
  EXPECT_EQ(v.name, "cli");
  EXPECT_EQ(v.count, 1);
  EXPECT_EQ(v.ratio, 2.0);
  EXPECT_TRUE(v.fast);
  EXPECT_FALSE(v.share);
  FlagSet g("prog", "");
  TestFlags w(g);
  ParseArgs(g, {"--config=" + config, "--no-fast", "--share"});
  EXPECT_EQ(w.name, "file");
  EXPECT_EQ(w.count, 9);
  EXPECT_FALSE(w.fast);
  EXPECT_TRUE(w.share);
}

TEST(Flags, BadConfigFilesExit2WithOneLine) {
  testing::TempDir dir;
  const std::string unknown = WriteFile(dir, "unknown.json", R"({"count": 2, "bogus": 1})");
  const std::string array = WriteFile(dir, "array.json", "[1, 2]");
  const std::string bad_value = WriteFile(dir, "bad.json", R"({"count": "many"})");
  const auto parse = [](const std::vector<std::string>& args) {
    FlagSet f("prog", "");
    TestFlags v(f);
    ParseArgs(f, args);
  };
  EXPECT_EXIT(parse({"--config", unknown}), ::testing::ExitedWithCode(2),
              "^prog: --config .*/unknown.json: unknown flag 'bogus'\n$");
  EXPECT_EXIT(parse({"--config", array}), ::testing::ExitedWithCode(2),
              "^prog: --config .*/array.json: not a JSON object\n$");
  EXPECT_EXIT(parse({"--config", dir.path() + "/none.json"}), ::testing::ExitedWithCode(2),
              "^prog: --config: cannot read '.*/none.json'\n$");
  EXPECT_EXIT(parse({"--config="}), ::testing::ExitedWithCode(2), "^prog: --config: cannot read ''\n$");
  EXPECT_EXIT(parse({"--config", bad_value}), ::testing::ExitedWithCode(2),
              "^prog: --count: not an integer: 'many'\n$");
}

TEST(Flags, BadCommandLinesExit2WithOneLine) {
  const auto parse = [](const std::vector<std::string>& args) {
    FlagSet f("prog", "");
    TestFlags v(f);
    ParseArgs(f, args);
  };
  EXPECT_EXIT(parse({"--count=abc"}), ::testing::ExitedWithCode(2), "^prog: --count: not an integer: 'abc'\n$");
  EXPECT_EXIT(parse({"--count", "1.5"}), ::testing::ExitedWithCode(2), "^prog: --count: not an integer: '1.5'\n$");
  EXPECT_EXIT(parse({"--ratio=x"}), ::testing::ExitedWithCode(2), "^prog: --ratio: not a number: 'x'\n$");
  EXPECT_EXIT(parse({"--fast=maybe"}), ::testing::ExitedWithCode(2), "^prog: --fast: not a boolean: 'maybe'\n$");
  EXPECT_EXIT(parse({"--bogus=1"}), ::testing::ExitedWithCode(2), "^prog: unknown flag --bogus \\(see --help\\)\n$");
  EXPECT_EXIT(parse({"-q"}), ::testing::ExitedWithCode(2), "^prog: unknown flag -q \\(see --help\\)\n$");
  EXPECT_EXIT(parse({"--fast", "--count"}), ::testing::ExitedWithCode(2), "^prog: --count needs a value\n$");
  for (const char* help : {"--help", "-h"}) {
    EXPECT_EXIT((std::freopen("/dev/null", "w", stdout), parse({help})), ::testing::ExitedWithCode(0), "^$");
  }
}

TEST(Flags, HelpShowsEveryFlagWithItsDefaultAndWrapsLongHelp) {
  FlagSet f("prog", "[flags] FILE");
  TestFlags v(f);
  std::string long_help;
  for (int i = 0; i < 30; ++i) long_help += "word" + std::to_string(i) + " ";
  int64_t big = 7;
  f.Int("big", &big, long_help);
  std::string pre_wrapped = "x";
  f.String("pre-wrapped", &pre_wrapped, "alpha beta\n      gamma\n\nnext paragraph");
  const std::string text = f.HelpText();
  EXPECT_EQ(text.rfind("Usage: prog [flags] FILE\n", 0), 0u) << text;
  for (const char* line : {"  --name TEXT  (default: a)\n      a string\n", "  --count INT  (default: 4)\n",
                           "  --ratio FLOAT  (default: 0.5)\n", "  --fast, --no-fast  (default: false)\n",
                           "  --share, --no-share  (default: true)\n", "  --config FILE\n", "  -h, --help\n",
                           "      alpha beta gamma\n\n      next paragraph\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  std::istringstream lines(text);
  int help_lines = 0;
  for (std::string line; std::getline(lines, line);) {
    EXPECT_LE(line.size(), 80u) << line;
    help_lines += line.find("word") != std::string::npos;
  }
  EXPECT_GE(help_lines, 3) << text;
  EXPECT_NE(text.find("word29"), std::string::npos);
}


// GPT-OSS as moe-make-model writes it (openai/gpt-oss's bf16 layout: gate
// and up interleaved in gate_up_proj [E, H, 2I], biases, down_proj [E, I,
// H]): the config gives the family's math and routing, the reader gives
// back the generator's weights and biases, and the reference MoE matches
// transformers' GptOssExperts computed here from the raw tensors in f64.
TEST(GptOss, CheckpointLoadsAndTheReferenceComputesItsMath) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gpt-oss");
  ASSERT_TRUE(spec.ok()) << spec.status();
  testing::TempDir dir;
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), *spec, 5, 1 << 20).ok());
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
  ASSERT_TRUE(src.ok()) << src.status();
  const ModelSpec& s = (*src)->spec();
  EXPECT_EQ(s.model_type, "gpt_oss");
  EXPECT_EQ(s.activation, ExpertActivation::ClampedSwiglu(1.702f, 7.0f));
  EXPECT_TRUE(s.expert_biases);
  EXPECT_EQ(s.routing, RoutingMode::kTopKSoftmax);
  EXPECT_EQ(ExpertMathName(s), "clamped_swiglu(alpha=1.702, limit=7)+bias");
  std::unique_ptr<ModelSource> synthetic = MakeSyntheticSource(*spec, 5);
  for (int l : s.moe_layers)
    for (int e = 0; e < s.num_experts; e += 3) {
      ExpertWeights got, want;
      ASSERT_TRUE((*src)->ReadExpert(l, e, &got).ok());
      ASSERT_TRUE(synthetic->ReadExpert(l, e, &want).ok());
      EXPECT_EQ(got.gate, want.gate);
      EXPECT_EQ(got.up, want.up);
      EXPECT_EQ(got.down, want.down);
      ASSERT_EQ(got.gate_bias.size(), size_t(s.intermediate));
      EXPECT_EQ(got.gate_bias, want.gate_bias);
      EXPECT_EQ(got.up_bias, want.up_bias);
      EXPECT_EQ(got.down_bias, want.down_bias);
      EXPECT_NE(got.gate_bias, got.up_bias);
    }
  // transformers' math on the stored tensors: gate_up = x @ W + b; gate =
  // [..., ::2], up = [..., 1::2]; clamp; (up + 1) * gate * sigmoid(1.702 gate);
  // out = act @ down + b, times the routing weight (top-k of the router's
  // logits, softmax over the k).
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok());
  const int H = s.hidden, I = s.intermediate, E = s.num_experts, k = s.top_k, n = 5, l = s.moe_layers.back();
  auto value = [&](const char* name, size_t i) {
    const TensorInfo* t = (*ckpt)->Find("model.layers." + std::to_string(l) + ".mlp." + name);
    EXPECT_NE(t, nullptr) << name;
    return static_cast<double>(Bf16ToF32(reinterpret_cast<const bf16_t*>(t->data)[i]));
  };
  std::vector<bf16_t> x = RandomActivations(size_t(n) * H, 9);
  for (bf16_t& v : x) v = F32ToBf16(Bf16ToF32(v) * 6.0f);  // some gate / up values past the limit
  std::vector<float> logits(size_t(n) * E);
  for (int t = 0; t < n; ++t)
    for (int e = 0; e < E; ++e) {
      double z = value("router.bias", e);
      for (int h = 0; h < H; ++h) z += value("router.weight", size_t(e) * H + h) * Bf16ToF32(x[size_t(t) * H + h]);
      logits[size_t(t) * E + e] = static_cast<float>(z);
    }
  std::vector<int32_t> ids(size_t(n) * k);
  std::vector<float> w(size_t(n) * k);
  SelectExperts(logits.data(), n, E, k, s.routing, false, ids.data(), w.data());
  std::vector<double> want(size_t(n) * H, 0.0), got(size_t(n) * H);
  bool clamped = false;
  for (int t = 0; t < n; ++t) {
    double wsum = 0;
    for (int j = 0; j < k; ++j) wsum += w[size_t(t) * k + j];
    EXPECT_NEAR(wsum, 1.0, 1e-6);
    for (int j = 0; j < k; ++j) {
      const size_t e = ids[size_t(t) * k + j];
      std::vector<double> act(I);
      for (int i = 0; i < I; ++i) {
        double g = value("experts.gate_up_proj_bias", e * 2 * I + 2 * i), u = value("experts.gate_up_proj_bias", e * 2 * I + 2 * i + 1);
        for (int h = 0; h < H; ++h) {
          const double xv = Bf16ToF32(x[size_t(t) * H + h]);
          g += xv * value("experts.gate_up_proj", (e * H + h) * 2 * I + 2 * i);
          u += xv * value("experts.gate_up_proj", (e * H + h) * 2 * I + 2 * i + 1);
        }
        clamped |= g > 7 || std::abs(u) > 7;
        g = std::min(g, 7.0), u = std::clamp(u, -7.0, 7.0);
        act[i] = (u + 1) * g / (1 + std::exp(-1.702 * g));
      }
      for (int h = 0; h < H; ++h) {
        double y = value("experts.down_proj_bias", e * H + h);
        for (int i = 0; i < I; ++i) y += act[i] * value("experts.down_proj", (e * I + i) * H + h);
        want[size_t(t) * H + h] += w[size_t(t) * k + j] * y;
      }
    }
  }
  EXPECT_TRUE(clamped) << "no value reached the clamp";
  ReferenceMoe reference(**src);
  ASSERT_TRUE(reference.Forward<double>(l, n, x.data(), RoutingView{n, k, ids.data(), w.data()}, got.data()).ok());
  EXPECT_LE(RelativeL2Error(got.data(), want.data(), got.size()), 1e-5);
}

// A GPT-OSS checkpoint missing a bias, or with one of the wrong shape, is
// refused at load in one line naming the tensor.
TEST(GptOss, MissingOrMisshapenBiasIsNamed) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gpt-oss");
  ASSERT_TRUE(spec.ok());
  const int64_t E = spec->num_experts, H = spec->hidden, I = spec->intermediate;
  struct Case { const char* bias; std::vector<int64_t> shape; };  // shape {} : the tensor is missing
  for (const Case& c : {Case{"down_proj_bias", {}}, Case{"gate_up_proj_bias", {}},
                        Case{"down_proj_bias", {E, H + 1}}, Case{"gate_up_proj_bias", {E, I}}}) {
    SCOPED_TRACE(std::string(c.bias) + (c.shape.empty() ? " missing" : " misshapen"));
    testing::TempDir dir;
    std::ofstream(dir.path() + "/config.json") << ConfigFromModelSpec(*spec).dump();
    std::vector<TensorSpec> specs;
    for (int l : spec->moe_layers) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
      specs.push_back({p + "gate_up_proj", DType::kBF16, {E, H, 2 * I}});
      specs.push_back({p + "down_proj", DType::kBF16, {E, I, H}});
      for (auto [name, shape] : {std::pair{"gate_up_proj_bias", std::vector<int64_t>{E, 2 * I}},
                                 std::pair{"down_proj_bias", std::vector<int64_t>{E, H}}}) {
        if (std::string(name) == c.bias && c.shape.empty()) continue;
        specs.push_back({p + name, DType::kBF16, std::string(name) == c.bias ? c.shape : shape});
      }
    }
    ASSERT_TRUE(WriteCheckpoint(dir.path(), specs, 1 << 20, [](size_t, std::span<std::byte> d) {
                  std::fill(d.begin(), d.end(), std::byte{0x3c});
                }).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> refused = OpenModel(dir.path());
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(std::string("model.layers.0.mlp.experts.") + c.bias), std::string::npos)
        << refused.status();
    EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
  }
}

// A GPT-OSS checkpoint as transformers 5.17's save_pretrained writes a
// GptOssForCausalLM (bf16): its config.json keys ("dtype", not "torch_dtype";
// num_experts_per_tok, not experts_per_token; swiglu_limit present or not),
// every tensor of the model beside the experts, and the experts as the module
// holds them: gate_up_proj [E, H, 2I] used as x @ W with gate the even columns
// and up the odd (GptOssExperts._apply_gate: gate_up[..., ::2], [..., 1::2]),
// gate_up_proj_bias [E, 2I] likewise, down_proj [E, I, H], down_proj_bias
// [E, H]. The loader must give back each expert's [I, H] gate and up, [H, I]
// down and its biases from exactly those elements.
TEST(GptOss, LoadsTheCheckpointTransformersSaves) {
  const int64_t L = 3, E = 8, k = 2, H = 64, I = 96, V = 128, heads = 4, kv = 2, hd = 16;
  for (const bool with_limit : {true, false}) {
    SCOPED_TRACE(with_limit ? "swiglu_limit 7.0 in config.json" : "no swiglu_limit in config.json");
    testing::TempDir dir;
    nlohmann::json config = {
        {"architectures", {"GptOssForCausalLM"}}, {"attention_bias", true}, {"attention_dropout", 0.0},
        {"bos_token_id", 1}, {"dtype", "bfloat16"}, {"eos_token_id", 2}, {"head_dim", hd},
        {"hidden_act", "silu"}, {"hidden_size", H}, {"initializer_range", 0.02}, {"intermediate_size", I},
        {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}},
        {"max_position_embeddings", 256}, {"model_type", "gpt_oss"}, {"num_attention_heads", heads},
        {"num_experts_per_tok", k}, {"num_hidden_layers", L}, {"num_key_value_heads", kv},
        {"num_local_experts", E}, {"output_router_logits", false}, {"pad_token_id", 0},
        {"rms_norm_eps", 1e-5}, {"router_aux_loss_coef", 0.001}, {"sliding_window", 128},
        {"rope_parameters", {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                             {"truncate", false}, {"original_max_position_embeddings", 4096},
                             {"rope_theta", 150000.0}}},
        {"tie_word_embeddings", false}, {"transformers_version", "5.17.0"}, {"use_cache", true},
        {"vocab_size", V}};
    if (with_limit) config["swiglu_limit"] = 7.0;
    std::ofstream(dir.path() + "/config.json") << config.dump(2);
    std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", DType::kBF16, {V, H}},
                                     {"model.norm.weight", DType::kBF16, {H}},
                                     {"lm_head.weight", DType::kBF16, {V, H}}};
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
               {"input_layernorm.weight", {H}}, {"post_attention_layernorm.weight", {H}},
               {"self_attn.q_proj.weight", {heads * hd, H}}, {"self_attn.q_proj.bias", {heads * hd}},
               {"self_attn.k_proj.weight", {kv * hd, H}}, {"self_attn.k_proj.bias", {kv * hd}},
               {"self_attn.v_proj.weight", {kv * hd, H}}, {"self_attn.v_proj.bias", {kv * hd}},
               {"self_attn.o_proj.weight", {H, heads * hd}}, {"self_attn.o_proj.bias", {H}},
               {"self_attn.sinks", {heads}}, {"mlp.router.weight", {E, H}}, {"mlp.router.bias", {E}},
               {"mlp.experts.gate_up_proj", {E, H, 2 * I}}, {"mlp.experts.gate_up_proj_bias", {E, 2 * I}},
               {"mlp.experts.down_proj", {E, I, H}}, {"mlp.experts.down_proj_bias", {E, H}}})
        specs.push_back({p + name, DType::kBF16, shape});
    }
    // Tensor t's element j: a bf16 value unique enough to tell any two elements of an expert apart.
    auto value = [](size_t t, size_t j) {
      return F32ToBf16(static_cast<float>((t * 7919 + j * 104729) % 20011) / 20011.0f - 0.5f);
    };
    std::map<std::string, size_t> index;
    for (size_t t = 0; t < specs.size(); ++t) index[specs[t].name] = t;
    ASSERT_TRUE(WriteCheckpoint(dir.path(), specs, 1 << 18, [&](size_t t, std::span<std::byte> d) {
                  auto* v = reinterpret_cast<bf16_t*>(d.data());
                  for (size_t j = 0; j < d.size() / 2; ++j) v[j] = value(t, j);
                }, {{"format", "pt"}}).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(dir.path());
    ASSERT_TRUE(src.ok()) << src.status();
    const ModelSpec& s = (*src)->spec();
    EXPECT_EQ(s.model_type, "gpt_oss");
    EXPECT_EQ(s.num_layers, L);
    EXPECT_EQ(s.num_experts, E);
    EXPECT_EQ(s.top_k, k);
    EXPECT_EQ(s.hidden, H);
    EXPECT_EQ(s.intermediate, I);
    EXPECT_EQ(s.moe_layers, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(ExpertMathName(s), "clamped_swiglu(alpha=1.702, limit=7)+bias");
    EXPECT_EQ(s.routing, RoutingMode::kTopKSoftmax);
    for (int l = 0; l < L; ++l)
      for (int e = 0; e < E; e += 3) {
        SCOPED_TRACE("layer " + std::to_string(l) + " expert " + std::to_string(e));
        ExpertWeights w;
        ASSERT_TRUE((*src)->ReadExpert(l, e, &w).ok());
        const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
        const size_t gu = index[p + "gate_up_proj"], gub = index[p + "gate_up_proj_bias"],
                     dn = index[p + "down_proj"], dnb = index[p + "down_proj_bias"];
        int wrong = 0;
        for (int64_t i = 0; i < I; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            const size_t col = size_t((e * H + h) * 2 * I);  // gate_up_proj[e, h, :]
            wrong += Bf16ToF32(w.gate[i * H + h]) != Bf16ToF32(value(gu, col + 2 * i));
            wrong += Bf16ToF32(w.up[i * H + h]) != Bf16ToF32(value(gu, col + 2 * i + 1));
            wrong += Bf16ToF32(w.down[h * I + i]) != Bf16ToF32(value(dn, size_t((e * I + i) * H + h)));
          }
          wrong += Bf16ToF32(w.gate_bias[i]) != Bf16ToF32(value(gub, size_t(e * 2 * I + 2 * i)));
          wrong += Bf16ToF32(w.up_bias[i]) != Bf16ToF32(value(gub, size_t(e * 2 * I + 2 * i + 1)));
        }
        for (int64_t h = 0; h < H; ++h)
          wrong += Bf16ToF32(w.down_bias[h]) != Bf16ToF32(value(dnb, size_t(e * H + h)));
        EXPECT_EQ(wrong, 0);
      }
  }
}

TEST(Routing, TopKThenSoftmaxAndSoftmaxThenTopK) {
  const float logits[2 * 5] = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 0.0f, 0.0f, 0.0f, 4.0f, -1.0f};
  int32_t ids[4];
  float w[4];
  SelectExperts(logits, 2, 5, 2, RoutingMode::kTopKSoftmax, false, ids, w);
  EXPECT_EQ(ids[0], 1);  // ties: the lower id first
  EXPECT_EQ(ids[1], 3);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  EXPECT_EQ(ids[2], 3);
  EXPECT_FLOAT_EQ(w[2], static_cast<float>(1 / (1 + std::exp(-4.0))));
  SelectExperts(logits, 2, 5, 2, RoutingMode::kSoftmaxTopK, false, ids, w);
  const double den = std::exp(1.0) + 2 * std::exp(3.0) + std::exp(-2.0) + std::exp(0.5);
  EXPECT_EQ(ids[0], 1);
  EXPECT_FLOAT_EQ(w[0], static_cast<float>(std::exp(3.0) / den));
  SelectExperts(logits, 2, 5, 2, RoutingMode::kSoftmaxTopK, true, ids, w);
  EXPECT_FLOAT_EQ(w[0] + w[1], 1.0f);
  EXPECT_STREQ(RoutingModeName(RoutingMode::kTopKSoftmax), "topk_softmax");
  // swiglu_limit comes from the config; a bad one is refused naming it.
  ModelSpec spec;
  spec.model_type = "gpt_oss";
  ASSERT_TRUE(ExpertMathForModelType(nlohmann::json{{"swiglu_limit", 5.5}}, &spec).ok());
  EXPECT_EQ(spec.activation.limit, 5.5f);
  absl::Status bad = ExpertMathForModelType(nlohmann::json{{"swiglu_limit", -1}}, &spec);
  EXPECT_NE(bad.message().find("swiglu_limit"), std::string::npos) << bad;
}

}  // namespace
}  // namespace moe
