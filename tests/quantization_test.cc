// Quantized checkpoints (model/quantization.h): the FP8 E4M3 codec, the int4
// packing as compressed-tensors defines it, quantize/dequantize error bounds,
// quantization_config parsing, checkpoints in both formats written by
// moe-make-model and read back (bit-identical to synthetic:...:dtype=), refusals
// that name the tensor, and a real moe-expert-server computing on them.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "client/expert_client.h"
#include "model/model_source.h"
#include "model/quantization.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "expert_compute/expert_store.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace moe {
namespace {

TEST(Fp8E4M3, DecodesKnownCodesAndRoundTripsEveryCode) {
  EXPECT_EQ(Fp8E4M3ToF32(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0xb8), -1.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToF32(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0xff)));
  int checked = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(F32ToFp8E4M3(Fp8E4M3ToF32(static_cast<uint8_t>(c))), c) << "code " << c;
    ++checked;
  }
  EXPECT_EQ(checked, 254);
}

TEST(Fp8E4M3, RoundsHalfToEvenAndSaturates) {
  EXPECT_EQ(F32ToFp8E4M3(1.0625f), 0x38);   // halfway 1.0 / 1.125 -> even (1.0)
  EXPECT_EQ(F32ToFp8E4M3(1.1875f), 0x3a);   // halfway 1.125 / 1.25 -> even (1.25)
  EXPECT_EQ(F32ToFp8E4M3(1.07f), 0x39);     // nearer 1.125
  EXPECT_EQ(F32ToFp8E4M3(1000.f), 0x7e);    // saturates to 448
  EXPECT_EQ(F32ToFp8E4M3(-1e9f), 0xfe);
  EXPECT_EQ(F32ToFp8E4M3(460.f), 0x7e);
  EXPECT_EQ(F32ToFp8E4M3(std::ldexp(1.5f, -9)), 0x02);  // subnormal halfway 1/2 quanta -> even (2)
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(F32ToFp8E4M3(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Int4Group, PackingIsCompressedTensorsLayout) {
  // One row of 16 values in two int32 words: value j of a word sits in bits
  // [4j, 4j+4) as q + 8. Word 0 = 0x76543210 holds q = -8..-1, word 1 =
  // 0xfedcba98 holds q = 0..7.
  const int32_t packed[2] = {0x76543210, static_cast<int32_t>(0xfedcba98u)};
  const float scales[2] = {0.5f, 2.0f};  // group 8: one scale per word
  bf16_t out[16];
  DequantizeInt4Group(packed, scales, 1, 16, 8, out);
  for (int c = 0; c < 16; ++c) {
    const float want = static_cast<float>(c - 8) * (c < 8 ? 0.5f : 2.0f);
    EXPECT_EQ(Bf16ToF32(out[c]), want) << "column " << c;
  }
  // The quantizer writes a layout the dequantizer reads back: with the
  // symmetric scale max|w| / 7.5 every value comes back within half a step.
  std::vector<bf16_t> w(16);
  for (int c = 0; c < 16; ++c) w[c] = F32ToBf16(static_cast<float>(c - 8) * 0.25f);
  int32_t q[2];
  float s[1];
  QuantizeInt4Group(w.data(), 1, 16, 16, q, s);
  std::vector<bf16_t> back(16);
  DequantizeInt4Group(q, s, 1, 16, 16, back.data());
  for (int c = 0; c < 16; ++c) EXPECT_NEAR(Bf16ToF32(back[c]), Bf16ToF32(w[c]), 0.5f * s[0] + 1e-6) << c;
}

double QuantError(const QuantConfig& q, int rows, int cols, uint64_t seed) {
  std::vector<bf16_t> w = RandomActivations(static_cast<size_t>(rows) * cols, seed, 0.05f);
  std::vector<bf16_t> d = w;
  QuantizeDequantize(q, rows, cols, d.data());
  std::vector<float> a(w.size()), b(w.size());
  Bf16ToF32(d.data(), a.data(), a.size());
  Bf16ToF32(w.data(), b.data(), b.size());
  return RelativeL2Error(a.data(), b.data(), a.size());
}

TEST(Quantize, ErrorWithinTheFormatsResolutionOnPartialBlocks) {
  QuantConfig fp8{WeightQuant::kFp8Block, 128, 128, 128};
  QuantConfig int4{WeightQuant::kInt4Group, 128, 128, 128};
  for (auto [rows, cols] : {std::pair{256, 384}, std::pair{200, 300}, std::pair{96, 80}}) {
    const double e8 = QuantError(fp8, rows, cols, rows);
    const double e4 = QuantError(int4, rows, cols, cols);
    // fp8: 3 mantissa bits, ~2% rms; int4: 16 levels per group, ~7-9% rms on Gaussian data.
    EXPECT_GT(e8, 1e-3) << rows << "x" << cols << ": no quantization happened";
    EXPECT_LT(e8, 0.035) << rows << "x" << cols;
    EXPECT_GT(e4, e8) << rows << "x" << cols;
    EXPECT_LT(e4, 0.12) << rows << "x" << cols;
  }
}

TEST(QuantConfig, ReadsFp8AndCompressedTensorsAndRefusesOthersByKey) {
  auto parse = [](const char* text) { return QuantConfigFromJson(nlohmann::json::parse(text)); };
  absl::StatusOr<QuantConfig> q = parse(R"({"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
      "quant_method": "fp8", "weight_block_size": [128, 64]}})");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->scheme, WeightQuant::kFp8Block);
  EXPECT_EQ(q->block_rows, 128);
  EXPECT_EQ(q->block_cols, 64);
  q = parse(R"({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "symmetric": true, "strategy": "group", "group_size": 32}}}, "ignore": ["lm_head"]}})");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->scheme, WeightQuant::kInt4Group);
  EXPECT_EQ(q->group_size, 32);
  EXPECT_EQ(parse(R"({"torch_dtype": "bfloat16"})")->scheme, WeightQuant::kNone);
  // Round trip of what moe-make-model writes.
  for (const QuantConfig& c : {QuantConfig{WeightQuant::kFp8Block, 128, 128, 128},
                               QuantConfig{WeightQuant::kInt4Group, 128, 128, 64}}) {
    nlohmann::json j;
    j["quantization_config"] = QuantConfigToJson(c);
    absl::StatusOr<QuantConfig> back = QuantConfigFromJson(j);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->Describe(), c.Describe());
  }
  struct Bad { const char* json; const char* key; };
  for (const Bad& b : {Bad{R"({"quantization_config": {"quant_method": "awq"}})", "quant_method"},
                       Bad{R"({"quantization_config": {"quant_method": "fp8"}})", "weight_block_size"},
                       Bad{R"({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                              "weight_block_size": [128, 128]}})", "fmt"},
                       Bad{R"({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": true,
                              "strategy": "group", "group_size": 128}}}}})", "num_bits"},
                       Bad{R"({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": false,
                              "strategy": "group", "group_size": 128}}}}})", "symmetric"},
                       Bad{R"({"quantization_config": {"quant_method": "compressed-tensors",
                              "format": "float-quantized"}})", "format"}}) {
    absl::StatusOr<QuantConfig> r = parse(b.json);
    ASSERT_FALSE(r.ok()) << b.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.key), std::string::npos) << r.status();
  }
}

// Reads every expert of both models and compares them bit for bit.
void ExpectSameWeights(const ModelSource& a, const ModelSource& b) {
  ExpertWeights x, y;
  for (int l : a.spec().moe_layers)
    for (int e = 0; e < a.spec().num_experts; ++e) {
      ASSERT_TRUE(a.ReadExpert(l, e, &x).ok());
      ASSERT_TRUE(b.ReadExpert(l, e, &y).ok());
      ASSERT_EQ(x.gate, y.gate) << l << "/" << e;
      ASSERT_EQ(x.up, y.up) << l << "/" << e;
      ASSERT_EQ(x.down, y.down) << l << "/" << e;
    }
}

TEST(QuantizedCheckpoint, WrittenAndReadBackAsTheSyntheticModel) {
  for (const char* dtype : {"fp8", "int4"}) {
    SCOPED_TRACE(dtype);
    testing::TempDir dir;
    ModelSpec spec = *PresetSpec("tiny");
    spec.quant.scheme = *ParseWeightQuant(dtype);
    ASSERT_TRUE(WriteSyntheticCheckpoint(dir.path(), spec, 11, 16 << 10).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> file = OpenModel(dir.path());
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->spec().quant.scheme, spec.quant.scheme);
    EXPECT_NE((*file)->spec().Summary().find(dtype), std::string::npos) << (*file)->spec().Summary();
    absl::StatusOr<std::unique_ptr<ModelSource>> synth = OpenModel(absl::StrCat("synthetic:tiny:seed=11:dtype=", dtype));
    ASSERT_TRUE(synth.ok()) << synth.status();
    ExpectSameWeights(**file, **synth);
    // Quantized, not a copy of the bf16 weights: close to them, not equal.
    std::unique_ptr<ModelSource> plain = *OpenModel("synthetic:tiny:seed=11");
    ExpertWeights q, p;
    ASSERT_TRUE((*file)->ReadExpert(spec.moe_layers[0], 3, &q).ok());
    ASSERT_TRUE(plain->ReadExpert(spec.moe_layers[0], 3, &p).ok());
    EXPECT_NE(q.gate, p.gate);
    std::vector<float> a(q.down.size()), b(p.down.size());
    Bf16ToF32(q.down.data(), a.data(), a.size());
    Bf16ToF32(p.down.data(), b.data(), b.size());
    EXPECT_LT(RelativeL2Error(a.data(), b.data(), a.size()), std::string(dtype) == "fp8" ? 0.035 : 0.12);
  }
  EXPECT_FALSE(OpenModel("synthetic:tiny:dtype=int3").ok());
}

// Byte offset of a tensor's data in a single-file checkpoint.
size_t TensorOffset(const std::string& file, const std::string& name) {
  std::ifstream in(file, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  return 8 + n + nlohmann::json::parse(header)[name]["data_offsets"][0].get<size_t>();
}

void Patch(const std::string& file, size_t offset, const void* bytes, size_t n) {
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

// Writes a one-file tiny checkpoint of `dtype`, lets `corrupt` change it, and
// returns what reading expert 0 of the first MoE layer says.
absl::Status ReadCorrupted(const std::string& dtype,
                           const std::function<void(const std::string& dir, const std::string& file)>& corrupt) {
  testing::TempDir dir;
  ModelSpec spec = *PresetSpec("tiny");
  spec.quant.scheme = *ParseWeightQuant(dtype);
  EXPECT_TRUE(WriteSyntheticCheckpoint(dir.path(), spec, 5, size_t{1} << 30).ok());
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    if (e.path().extension() == ".safetensors") file = e.path().string();
  corrupt(dir.path(), file);
  absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(dir.path());
  if (!m.ok()) return m.status();
  ExpertWeights w;
  return (*m)->ReadExpert(spec.moe_layers[0], 0, &w);
}

void EditConfig(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump();
}

TEST(QuantizedCheckpoint, InconsistentScalesAndShapesAreRefusedNamingTheTensor) {
  const std::string gate = "model.layers.1.mlp.experts.0.gate_proj";
  struct Case { std::string dtype, what, name; std::function<void(const std::string&, const std::string&)> corrupt; };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t wrong_shape[2] = {80, 95};
  std::vector<Case> cases = {
      {"fp8", "block size disagrees with the scales", gate + ".weight_scale_inv",
       [](const std::string& dir, const std::string&) {
         EditConfig(dir, [](nlohmann::json& j) { j["quantization_config"]["weight_block_size"] = {32, 32}; });
       }},
      {"fp8", "NaN scale", gate + ".weight_scale_inv",
       [&](const std::string&, const std::string& file) {
         Patch(file, TensorOffset(file, gate + ".weight_scale_inv"), &nan, 4);
       }},
      {"int4", "group size disagrees with the scales", gate + ".weight_scale",
       [](const std::string& dir, const std::string&) {
         EditConfig(dir, [](nlohmann::json& j) {
           j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16;
         });
       }},
      {"int4", "weight_shape disagrees with the model", gate + ".weight_shape",
       [&](const std::string&, const std::string& file) {
         Patch(file, TensorOffset(file, gate + ".weight_shape"), wrong_shape, sizeof(wrong_shape));
       }},
      {"int4", "config says fp8 for int4 tensors", "gate_proj.weight",
       [](const std::string& dir, const std::string&) {
         EditConfig(dir, [](nlohmann::json& j) {
           j["quantization_config"] = QuantConfigToJson(QuantConfig{WeightQuant::kFp8Block, 128, 128, 128});
         });
       }},
  };
  for (const Case& c : cases) {
    absl::Status st = ReadCorrupted(c.dtype, c.corrupt);
    EXPECT_FALSE(st.ok()) << c.what;
    EXPECT_NE(st.message().find(c.name), std::string::npos) << c.what << ": " << st;
  }
}

// The real path: moe-make-model writes the checkpoint, a real
// moe-expert-server loads it in the storage precision asked for
// (--weight-dtype; auto: fp8 -> fp8 and int4 -> int4 with the checkpoint's own
// codes and scales; fp8: an fp8 checkpoint's own codes and scales) and its outputs match the reference MoE over the checkpoint's
// dequantized weights within 1e-2, on random data.
TEST(QuantizedCheckpoint, ExpertServerComputesOnFp8AndInt4Checkpoints) {
  struct Case {
    const char *dtype, *weight_dtype;
    WeightFormat stored;
    const char* preset = "tiny";  // mxfp4: demo's one MoE layer (tiny's I = 80 is not whole blocks of 32)
    int int4_group = 128;         // --int4-group (32: Kimi-K2's, kept as int4 groups of 32)
  };
  for (const Case& c : {Case{"fp8", "auto", WeightFormat::kFp8}, Case{"fp8", "int8", WeightFormat::kInt8}, Case{"int4", "auto", WeightFormat::kInt4},
                        Case{"int4", "auto", WeightFormat::kInt4, "tiny", 32},
                        Case{"fp8", "bf16", WeightFormat::kBf16}, Case{"bf16", "int8", WeightFormat::kInt8},
                        Case{"fp8", "fp8", WeightFormat::kFp8}, Case{"bf16", "fp8", WeightFormat::kFp8},
                        Case{"mxfp4", "auto", WeightFormat::kMxfp4, "demo"}, Case{"bf16", "mxfp4", WeightFormat::kMxfp4, "demo"}}) {
    SCOPED_TRACE(absl::StrCat(c.dtype, " checkpoint, --weight-dtype=", c.weight_dtype, " int4 group ", c.int4_group));
    testing::TempDir dir;
    const std::string out = dir.path() + "/m";
    std::vector<std::string> make_args = {absl::StrCat("--preset=", c.preset), "--seed=4", absl::StrCat("--dtype=", c.dtype),
                                          "--out=" + out};
    if (std::string(c.preset) == "demo") make_args.push_back("--layers=1");
    if (std::string(c.dtype) == "int4") make_args.push_back(absl::StrCat("--int4-group=", c.int4_group));
    Subprocess make(testing::BinaryPath("moe-make-model"), make_args);
    ASSERT_EQ(make.Wait(std::chrono::seconds(60)), 0);
    Subprocess* server = nullptr;
    const std::string addr = testing::StartExpertServer(
        &server, {"--model=" + out, "--threads=2", "--max-tokens=64", absl::StrCat("--weight-dtype=", c.weight_dtype)});
    std::unique_ptr<Subprocess> owned(server);
    ASSERT_FALSE(addr.empty()) << "moe-expert-server did not start";
    std::unique_ptr<ExpertClient> client = *ExpertClient::Connect(addr, testing::PlaintextTls());
    std::unique_ptr<ModelSource> source = *OpenModel(out);
    const int H = source->spec().hidden, n = 17, k = 2;
    std::vector<bf16_t> x = RandomActivations(size_t(n) * H, 3);
    std::vector<int32_t> ids;
    std::vector<float> w;
    RandomRouting(n, k, source->spec().num_experts, 4, 1.0, &ids, &w);
    const RoutingView r{n, k, ids.data(), w.data()};
    const int layer = source->spec().moe_layers[0];
    absl::StatusOr<std::vector<bf16_t>> got = client->Forward(ExpertClient::MakeRequest(layer, n, H, x.data(), r, 1));
    ASSERT_TRUE(got.ok()) << got.status();
    std::vector<double> ref(size_t(n) * H);
    ASSERT_TRUE(ReferenceMoe(*source).Forward<double>(layer, n, x.data(), r, ref.data()).ok());
    std::vector<float> f(got->size());
    Bf16ToF32(got->data(), f.data(), f.size());
    double norm = 0;
    for (float v : f) norm += double(v) * v;
    EXPECT_GT(norm, 0) << "all-zero output";
    // A bf16 model stored as fp8 is quantized (E4M3: 3 mantissa bits, ~2.5%
    // RMS per weight), as mxfp4 more so (E2M1: ~14%; kernel_test.cc
    // Mxfp4Quantization measures 0.19 at GPT-OSS's shape); every other case
    // keeps the checkpoint's values (an MXFP4 checkpoint's exactly) or
    // quantizes to int8.
    const bool requantized_fp8 = c.stored == WeightFormat::kFp8 && std::string(c.dtype) != "fp8";
    const bool requantized_mxfp4 = c.stored == WeightFormat::kMxfp4 && std::string(c.dtype) != "mxfp4";
    EXPECT_LE(RelativeL2Error(f.data(), ref.data(), f.size()), requantized_mxfp4 ? 0.22 : requantized_fp8 ? 6e-2 : 1e-2);
    // The server holds the packed size of the precision it was asked for.
    absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    HostedSet hosted{source->spec().moe_layers, {}};
    for (int e = 0; e < source->spec().num_experts; ++e) hosted.experts.push_back(e);
    EXPECT_EQ(info->weight_bytes(),
              ExpertStore::BytesNeeded(ExpertGeometry::For(H, source->spec().intermediate, c.stored,
                                                           c.stored == WeightFormat::kInt4 ? c.int4_group : 0),
                                       hosted));
    EXPECT_EQ(info->weight_format(), WeightFormatName(c.stored));
    if (c.stored == WeightFormat::kMxfp4)  // 4.25 bits per weight: what the server holds, next to bf16
      EXPECT_NEAR(static_cast<double>(info->weight_bytes()) /
                      ExpertStore::BytesNeeded(ExpertGeometry::For(H, source->spec().intermediate), hosted),
                  4.25 / 16, 0.01);
  }
  // A precision the server does not store: exit 2, naming the flag.
  testing::TempDir dir;
  Subprocess bad(testing::BinaryPath("moe-expert-server"),
                 {"--model=synthetic:tiny", "--weight-dtype=fp16", "--insecure", "--threads=1"}, dir.path() + "/err");
  const int st = bad.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(WIFEXITED(st)) << st;
  EXPECT_EQ(WEXITSTATUS(st), 2);
  std::ifstream err(dir.path() + "/err");
  const std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("--weight-dtype"), std::string::npos) << text;
  // moe-make-model: an int4 group out of range, or one for another dtype: exit 2, naming the flag.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--dtype=int4", "--int4-group=-1"},
                                               std::vector<std::string>{"--dtype=bf16", "--int4-group=32"}}) {
    std::vector<std::string> full = args;
    full.push_back("--out=" + dir.path() + "/never");
    Subprocess make(testing::BinaryPath("moe-make-model"), full, dir.path() + "/make_err");
    const int ms = make.Wait(std::chrono::seconds(30));
    ASSERT_TRUE(WIFEXITED(ms)) << ms;
    EXPECT_EQ(WEXITSTATUS(ms), 2) << args[0] << " " << args[1];
    std::ifstream merr(dir.path() + "/make_err");
    const std::string mtext((std::istreambuf_iterator<char>(merr)), std::istreambuf_iterator<char>());
    EXPECT_NE(mtext.find("--int4-group"), std::string::npos) << mtext;
  }
}

}  // namespace
}  // namespace moe
