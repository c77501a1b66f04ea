// MXFP4 (model/quantization.h): the E2M1 / E8M0 codecs and the OCP scale
// choice, GPT-OSS's `X_blocks` / `X_scales` layout and GGUF's MXFP4 blocks
// against hand-computed values (gguf-py's decoding needs numpy, which this
// machine lacks: its bit formula is ported below instead), checkpoints
// (per-expert and fused 3-D safetensors, GGUF) read with their values exact
// and stored natively at 4.25 bits per weight, and refusals of bad block or
// scale tensors that name the tensor. The kernels: kernel_test.cc; the
// server round trip: quantization_test.cc.
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_model.h"
#include "model/model_source.h"
#include "model/quantization.h"
#include "model/safetensors.h"
#include "model/synthetic_model.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/numa_binding.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace moe {
namespace {

constexpr float kE2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

TEST(Mxfp4Codec, E2M1ValuesRoundToNearestEvenAndSaturate) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(std::bit_cast<uint32_t>(E2M1ToF32(static_cast<uint8_t>(c))), std::bit_cast<uint32_t>(kE2M1[c])) << c;
    EXPECT_EQ(F32ToE2M1(kE2M1[c]), c);
    EXPECT_EQ(kE2M1Doubled[c], static_cast<int>(2 * kE2M1[c]));
  }
  // Midpoints go to the even code (mantissa bit 0), as round-to-nearest-even.
  struct Tie { float v; int code; };
  for (const Tie t : {Tie{0.25f, 0}, Tie{0.75f, 2}, Tie{1.25f, 2}, Tie{1.75f, 4}, Tie{2.5f, 4}, Tie{3.5f, 6},
                      Tie{5.0f, 6}, Tie{-0.75f, 10}, Tie{0.26f, 1}, Tie{5.01f, 7}, Tie{7.99f, 7}, Tie{1e30f, 7},
                      Tie{-100.0f, 15}, Tie{0.1f, 0}})
    EXPECT_EQ(F32ToE2M1(t.v), t.code) << t.v;
}

TEST(Mxfp4Codec, OcpScaleIsFloorLog2OfTheMaxMinusTwo) {
  EXPECT_EQ(Mxfp4ScaleFor(6.0f), 127);   // 6 = 1.5 * 2^2: scale 1
  EXPECT_EQ(Mxfp4ScaleFor(4.0f), 127);
  EXPECT_EQ(Mxfp4ScaleFor(3.99f), 126);  // 3.99 / 0.5 = 7.98: saturates to 6 (OCP's choice)
  EXPECT_EQ(Mxfp4ScaleFor(8.0f), 128);
  EXPECT_EQ(Mxfp4ScaleFor(0.03125f), 120);
  EXPECT_EQ(Mxfp4ScaleFor(0.0f), 127);     // an all-zero block
  EXPECT_EQ(Mxfp4ScaleFor(1e-40f), 0);     // clamped to 2^-127
  EXPECT_EQ(Mxfp4ScaleFor(3e38f), 252);    // f32's largest exponent, 127, minus 2
  EXPECT_EQ(E8M0ToF32(127), 1.0f);
  EXPECT_EQ(E8M0ToF32(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(E8M0ToF32(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8M0ToF32(255)));
}

// X_blocks as transformers' convert_moe_packed_tensors reads them: byte j of a
// block holds value 2j in its low nibble and 2j + 1 in its high one.
TEST(Mxfp4Codec, BlocksAreGptOssLayout) {
  const int cols = 64;
  std::vector<bf16_t> w(cols);
  for (int c = 0; c < cols; ++c) w[c] = F32ToBf16(kE2M1[c % 16] * (c < 32 ? 2.0f : 0.25f));
  std::vector<uint8_t> blocks(cols / 2), scales(cols / 32);
  QuantizeMxfp4(w.data(), 1, cols, blocks.data(), scales.data());
  EXPECT_EQ(scales[0], 128);  // max 12 = 6 * 2^1
  EXPECT_EQ(scales[1], 125);  // max 1.5 = 6 * 2^-2
  for (int j = 0; j < 32; ++j) EXPECT_EQ(blocks[j], ((2 * j) % 16) | (((2 * j + 1) % 16) << 4)) << j;
  std::vector<bf16_t> back(cols);
  DequantizeMxfp4(blocks.data(), scales.data(), 1, cols, back.data());
  EXPECT_EQ(back, w);
  // Hand-made: 0x71 = value 0 code 1 (0.5), value 1 code 7 (6); 0xF8 = -0, -6; scale 2^3.
  const uint8_t b[16] = {0x71, 0xF8}, s[1] = {130};
  DequantizeMxfp4(b, s, 1, 32, back.data());
  EXPECT_EQ(Bf16ToF32(back[0]), 4.0f);
  EXPECT_EQ(Bf16ToF32(back[1]), 48.0f);
  EXPECT_EQ(Bf16ToF32(back[2]), 0.0f);
  EXPECT_EQ(Bf16ToF32(back[3]), -48.0f);
}

// ggml's e8m0_to_fp32_half (gguf-py quants.py MXFP4), bit for bit: the scale
// halved, for ggml's doubled E2M1 values.
float GgmlE8m0Half(uint8_t x) {
  const uint32_t bits = x < 2 ? uint32_t{0x00200000} << x : uint32_t{x - 1u} << 23;
  return std::bit_cast<float>(bits);
}

TEST(GgufMxfp4, DecodesAsGgufPyAndHandComputedBlocks) {
  // One block, scale 2^2: low nibbles (values 0-15) codes 0..15, high ones
  // (values 16-31) codes 15..0.
  std::byte blk[17];
  blk[0] = std::byte{129};
  for (int i = 0; i < 16; ++i) blk[1 + i] = std::byte(static_cast<uint8_t>(i | (15 - i) << 4));
  float v[32];
  DequantizeGgml(GgmlType::kMXFP4, blk, 32, v);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(v[i], 4.0f * kE2M1[i]) << i;
    EXPECT_EQ(v[16 + i], 4.0f * kE2M1[15 - i]) << 16 + i;
  }
  EXPECT_FALSE(std::signbit(v[8])) << "code 8: ggml's +0 (GPT-OSS's safetensors table has -0)";
  EXPECT_EQ(GgmlBlock(static_cast<uint32_t>(GgmlType::kMXFP4)), (std::pair<int, int>{32, 17}));
  // gguf-py's dequantize_blocks, every exponent and code (subnormal scales included).
  std::vector<std::byte> all(256 * 17);
  for (int e = 0; e < 255; ++e) {
    all[size_t(e) * 17] = std::byte(static_cast<uint8_t>(e));
    for (int i = 0; i < 16; ++i) all[size_t(e) * 17 + 1 + i] = std::byte(static_cast<uint8_t>((i + e) % 16 | (i << 4)));
  }
  std::vector<float> out(255 * 32);
  DequantizeGgml(GgmlType::kMXFP4, all.data(), 255 * 32, out.data());
  for (int e = 0; e < 255; ++e)
    for (int i = 0; i < 16; ++i) {
      // bit for bit (the sign of zero included)
      ASSERT_EQ(std::bit_cast<uint32_t>(out[size_t(e) * 32 + i]),
                std::bit_cast<uint32_t>(kE2M1Doubled[(i + e) % 16] * GgmlE8m0Half(static_cast<uint8_t>(e)))) << e;
      ASSERT_EQ(std::bit_cast<uint32_t>(out[size_t(e) * 32 + 16 + i]),
                std::bit_cast<uint32_t>(kE2M1Doubled[i] * GgmlE8m0Half(static_cast<uint8_t>(e)))) << e;
    }
  // Our writer's blocks decode back to the values they were made from when those are MXFP4 values.
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = kE2M1[(7 * i) % 16] * (i < 32 ? 0.125f : 64.0f);
  x[5] = 6 * 0.125f, x[40] = -6 * 64.0f;  // each block's largest magnitude is 6 x its scale
  std::vector<std::byte> q(GgmlRowBytes(static_cast<uint32_t>(GgmlType::kMXFP4), 64));
  QuantizeGgml(GgmlType::kMXFP4, x.data(), 64, q.data());
  std::vector<float> y(64);
  DequantizeGgml(GgmlType::kMXFP4, q.data(), 64, y.data());
  EXPECT_EQ(x, y);
}

// Every expert's packed (native) form stands for exactly the weights the source reads.
void ExpectStoredExactly(const ModelSource& source, const ExpertGeometry& g) {
  absl::StatusOr<std::unique_ptr<NumaBinding>> numa = NumaBinding::Create("auto", 2);
  ASSERT_TRUE(numa.ok()) << numa.status();
  ComputePool pool(**numa);
  const ModelSpec& spec = source.spec();
  HostedSet hosted{spec.moe_layers, {}};
  for (int e = 0; e < spec.num_experts; ++e) hosted.experts.push_back(e);
  absl::StatusOr<std::unique_ptr<ExpertStore>> store = ExpertStore::Load(source, g, hosted, **numa, pool);
  ASSERT_TRUE(store.ok()) << store.status();
  const int H = spec.hidden, I = spec.intermediate;
  std::vector<float> back(size_t(3) * I * H);
  ExpertWeights w;
  for (int l : spec.moe_layers)
    for (int e = 0; e < spec.num_experts; ++e) {
      ASSERT_TRUE(source.ReadExpert(l, e, &w).ok());
      UnpackExpert(g, (*store)->Find(l, e), back.data(), back.data() + size_t(I) * H, back.data() + size_t(2) * I * H);
      const std::vector<bf16_t>* parts[3] = {&w.gate, &w.up, &w.down};
      for (int m = 0; m < 3; ++m)
        for (size_t i = 0; i < parts[m]->size(); ++i)
          ASSERT_EQ(back[size_t(m) * I * H + i], Bf16ToF32((*parts[m])[i])) << l << "/" << e << " matrix " << m << " at " << i;
    }
  // 4.25 bits per weight (plus each expert's page rounding).
  const double bf16 = ExpertStore::BytesNeeded(ExpertGeometry::For(H, I), hosted);
  EXPECT_NEAR((*store)->resident_bytes() / bf16, 4.25 / 16, 0.01);
}

ModelSpec SmallSpec(int experts) {
  ModelSpec spec = *PresetSpec("demo", 1);  // qwen3_moe, H = 512, I = 256
  spec.num_experts = experts;
  spec.top_k = 2;
  spec.quant.scheme = WeightQuant::kMxfp4;
  return spec;
}

TEST(Mxfp4Checkpoint, PerExpertTensorsReadExactlyAndStoredNatively) {
  testing::TempDir dir;
  const ModelSpec spec = SmallSpec(4);
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), spec, 11, 1 << 20).ok());
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(dir.path() + "/config.json"));
  EXPECT_EQ(config["quantization_config"], nlohmann::json({{"quant_method", "mxfp4"}}));
  absl::StatusOr<std::unique_ptr<ModelSource>> file = OpenModel(dir.path());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->spec().quant.scheme, WeightQuant::kMxfp4);
  EXPECT_NE((*file)->spec().Summary().find("mxfp4"), std::string::npos) << (*file)->spec().Summary();
  // The same values as the synthetic model of that dtype, and not the bf16 ones.
  std::unique_ptr<ModelSource> synth = *OpenModel("synthetic:demo:layers=1:experts=4:top_k=2:seed=11:dtype=mxfp4");
  std::unique_ptr<ModelSource> plain = *OpenModel("synthetic:demo:layers=1:experts=4:top_k=2:seed=11");
  ExpertWeights a, b, c;
  for (int e = 0; e < 4; ++e) {
    ASSERT_TRUE((*file)->ReadExpert(spec.moe_layers[0], e, &a).ok());
    ASSERT_TRUE(synth->ReadExpert(spec.moe_layers[0], e, &b).ok());
    ASSERT_TRUE(plain->ReadExpert(spec.moe_layers[0], e, &c).ok());
    EXPECT_EQ(a.gate, b.gate);
    EXPECT_EQ(a.down, b.down);
    EXPECT_NE(a.up, c.up);
  }
  absl::StatusOr<ExpertGeometry> g = StorageGeometry((*file)->spec(), "auto");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->format, WeightFormat::kMxfp4);
  EXPECT_STREQ(WeightFormatName(g->format), "mxfp4");  // what servers register and moectl status shows (FORMAT)
  ExpectStoredExactly(**file, *g);
}

// A checkpoint written tensor by tensor: config.json of `spec` and `tensors`
// whose bytes come from `fill`.
void WriteModel(const std::string& dir, const ModelSpec& spec, const std::vector<TensorSpec>& tensors,
                const std::function<void(size_t, std::span<std::byte>)>& fill) {
  ASSERT_TRUE(WriteCheckpoint(dir, tensors, size_t{1} << 30, fill).ok());
  std::ofstream(dir + "/config.json") << ConfigFromModelSpec(spec).dump();
}

// Random MXFP4 bytes: any code, exponents in [118, 130].
void RandomMxfp4(std::span<std::byte> dst, bool scales, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::byte& b : dst) b = std::byte(static_cast<uint8_t>(scales ? 118 + rng() % 13 : rng() % 256));
}

// GPT-OSS's fused layout: {prefix}gate_up_proj_blocks [E, 2I, H/32, 16] (gate
// rows first for a SiLU family), down_proj_blocks [E, H, I/32, 16], scales beside.
TEST(Mxfp4Checkpoint, FusedTensorsReadAsTheirExperts) {
  testing::TempDir dir;
  const ModelSpec spec = SmallSpec(3);
  const int64_t E = 3, H = spec.hidden, I = spec.intermediate;
  const std::string p = absl::StrCat("model.layers.", spec.moe_layers[0], ".mlp.experts.");
  const std::vector<TensorSpec> tensors = {
      {p + "gate_up_proj_blocks", DType::kU8, {E, 2 * I, H / 32, 16}}, {p + "gate_up_proj_scales", DType::kU8, {E, 2 * I, H / 32}},
      {p + "down_proj_blocks", DType::kU8, {E, H, I / 32, 16}}, {p + "down_proj_scales", DType::kU8, {E, H, I / 32}}};
  std::vector<std::vector<std::byte>> bytes(4);
  WriteModel(dir.path(), spec, tensors, [&](size_t i, std::span<std::byte> dst) {
    RandomMxfp4(dst, i % 2 == 1, 40 + i);
    bytes[i].assign(dst.begin(), dst.end());
  });
  absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  const auto u8 = [&](int i) { return reinterpret_cast<const uint8_t*>(bytes[i].data()); };
  ExpertWeights w;
  std::vector<bf16_t> gate_up(size_t(2) * I * H), down(size_t(H) * I);
  for (int e = 0; e < E; ++e) {
    ASSERT_TRUE((*m)->ReadExpert(spec.moe_layers[0], e, &w).ok());
    DequantizeMxfp4(u8(0) + e * I * H, u8(1) + e * 2 * I * H / 32, 2 * I, H, gate_up.data());
    DequantizeMxfp4(u8(2) + e * I * H / 2, u8(3) + e * H * I / 32, H, I, down.data());
    EXPECT_TRUE(std::equal(w.gate.begin(), w.gate.end(), gate_up.begin()));
    EXPECT_TRUE(std::equal(w.up.begin(), w.up.end(), gate_up.begin() + I * H));
    EXPECT_EQ(w.down, down);
  }
  ExpectStoredExactly(**m, *StorageGeometry((*m)->spec(), "auto"));
}

// Wrong shapes, dtypes and NaN exponents of X_blocks / X_scales, per expert
// and fused: InvalidArgument naming the tensor.
TEST(Mxfp4Checkpoint, BadBlocksAndScalesAreRefusedNamingTheTensor) {
  const ModelSpec spec = SmallSpec(2);
  const int64_t H = spec.hidden, I = spec.intermediate;
  const int l = spec.moe_layers[0];
  struct Case {
    std::string what, name;
    std::function<void(std::vector<TensorSpec>&)> edit;
    bool nan = false;
  };
  const std::string gate = absl::StrCat("model.layers.", l, ".mlp.experts.1.gate_proj");
  const std::vector<Case> cases = {
      {"blocks of 16 values", gate + "_blocks", [&](auto& t) { t[0].shape = {I, H / 16, 8}; }},
      {"scales per 16", gate + "_scales", [&](auto& t) { t[1].shape = {I, H / 16}; }},
      {"scales as bf16", gate + "_scales", [&](auto& t) { t[1].dtype = DType::kBF16; }},
      {"a NaN exponent", gate + "_scales", [](auto&) {}, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    testing::TempDir dir;
    std::vector<TensorSpec> tensors;
    for (int e : {1, 0})  // expert 1 first: the edits apply to its gate
      for (Projection pr : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const std::string name = ExpertTensorName(spec.naming, l, e, pr);
        const int64_t rows = pr == Projection::kDown ? H : I, cols = pr == Projection::kDown ? I : H;
        tensors.push_back({Mxfp4PartName(name, "blocks"), DType::kU8, {rows, cols / 32, 16}});
        tensors.push_back({Mxfp4PartName(name, "scales"), DType::kU8, {rows, cols / 32}});
      }
    c.edit(tensors);
    WriteModel(dir.path(), spec, tensors, [&](size_t i, std::span<std::byte> dst) {
      RandomMxfp4(dst, i % 2 == 1, i);
      if (c.nan && i == 1) dst[dst.size() / 2] = std::byte{255};
    });
    absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(dir.path());
    ASSERT_TRUE(m.ok()) << m.status();
    ExpertWeights w;
    const absl::Status st = (*m)->ReadExpert(l, 1, &w);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(c.name), std::string::npos) << st;
  }
  // Fused: the scales' shape disagrees with the blocks'.
  testing::TempDir dir;
  const std::string p = absl::StrCat("model.layers.", l, ".mlp.experts.");
  const std::vector<TensorSpec> fused = {
      {p + "gate_up_proj_blocks", DType::kU8, {2, 2 * I, H / 32, 16}}, {p + "gate_up_proj_scales", DType::kU8, {2, 2 * I, H / 32 + 1}},
      {p + "down_proj_blocks", DType::kU8, {2, H, I / 32, 16}}, {p + "down_proj_scales", DType::kU8, {2, H, I / 32}}};
  WriteModel(dir.path(), spec, fused, [&](size_t i, std::span<std::byte> dst) { RandomMxfp4(dst, i % 2 == 1, i); });
  const absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(dir.path());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find(p + "gate_up_proj_scales"), std::string::npos) << m.status();
  // Input columns that are not whole blocks of 32: no such checkpoint or synthetic model.
  ModelSpec odd = spec;
  odd.hidden = 80;
  const absl::Status write = WriteSyntheticCheckpoint(dir.path() + "/odd", odd, 1, 1 << 20);
  EXPECT_EQ(write.code(), absl::StatusCode::kInvalidArgument) << write;
  EXPECT_NE(write.message().find("blocks of 32"), std::string::npos) << write;
  EXPECT_EQ(OpenModel("synthetic:tiny:dtype=mxfp4").status().code(), absl::StatusCode::kInvalidArgument);  // I = 80
}

// A GGUF of MXFP4 experts: decoded into the same native storage, its values
// exact, kept as mxfp4 by --weight-dtype auto.
TEST(GgufMxfp4, ExpertsStoredNativelyWithTheirValues) {
  testing::TempDir dir;
  ModelSpec spec = SmallSpec(4);
  spec.quant = QuantConfig{};
  const std::string path = dir.path() + "/m.gguf";
  ASSERT_TRUE(WriteSyntheticGguf(path, spec, 9, GgmlType::kMXFP4).ok());
  absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(path);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->spec().quant.gguf_mxfp4);
  absl::StatusOr<ExpertGeometry> g = StorageGeometry((*m)->spec(), "auto");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->format, WeightFormat::kMxfp4);
  // Its values are the GGUF blocks' (decoded by DequantizeGgml) ...
  const std::unique_ptr<GgufFile> file = *GgufFile::Open(path);
  const GgufTensor* t = file->Find(absl::StrCat("blk.", spec.moe_layers[0], ".ffn_down_exps.weight"));
  ASSERT_NE(t, nullptr);
  const int64_t n = int64_t{spec.hidden} * spec.intermediate;
  std::vector<float> f(n);
  DequantizeGgml(GgmlType::kMXFP4, t->data + GgmlRowBytes(t->type, n) * 2, n, f.data());  // expert 2
  ExpertWeights w;
  ASSERT_TRUE((*m)->ReadExpert(spec.moe_layers[0], 2, &w).ok());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bf16ToF32(w.down[i]), f[i]) << i;
  // ... and the same values as the safetensors checkpoint of the same seed (one
  // quantizer; a zero code's sign aside: ggml decodes code 8 as +0, GPT-OSS's table as -0).
  std::unique_ptr<ModelSource> synth = *OpenModel("synthetic:demo:layers=1:experts=4:top_k=2:seed=9:dtype=mxfp4");
  ExpertWeights s;
  ASSERT_TRUE(synth->ReadExpert(spec.moe_layers[0], 2, &s).ok());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bf16ToF32(w.down[i]), Bf16ToF32(s.down[i])) << i;
  ExpectStoredExactly(**m, *g);
}

}  // namespace
}  // namespace moe
