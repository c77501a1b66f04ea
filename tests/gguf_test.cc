// GGUF (model/gguf.h, model/gguf_model.h): the block codecs against hand-made
// blocks, the container reader on files our writer makes and on hand-built
// hostile ones (every refusal names the key or tensor), moe-make-model's GGUF
// read back bit-identical to the synthetic model, architectures and types we
// do not compute refused in one line (gpt-oss's own: tests/gpt_oss_test.cc), a real moe-expert-server serving GGUF
// experts (bf16, Q8_0, Q6_K, Q4_K) against an f64 reference over the file's
// own dequantized values, and a cross-check with llama.cpp's gguf-py on a
// file its make_model.py writes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/expert_client.h"
#include "model/gguf.h"
#include "model/gguf_model.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "model/synthetic_model.h"
#include "expert_compute/expert_store.h"
#include "gpu_worker/host_expert_store.h"
#include "gtest/gtest.h"
#include "testing/random_data.h"
#include "tests/test_support.h"

namespace moe {
namespace {

std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale = 0.05f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(GgmlCodec, DecodesHandMadeBlocks) {
  // Q8_0: d = 0.5 (f16 0x3800), q = -3..28.
  std::vector<std::byte> q8(34);
  const uint16_t half = 0x3800;
  std::memcpy(q8.data(), &half, 2);
  for (int i = 0; i < 32; ++i) q8[2 + i] = static_cast<std::byte>(static_cast<int8_t>(i - 3));
  std::vector<float> y(256);
  DequantizeGgml(GgmlType::kQ8_0, q8.data(), 32, y.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.5f * (i - 3)) << i;
  // Q4_K: d = 1, dmin = 0.5; sub-block 5 has scale (high bits in byte 1, low in byte 9) 0x25 = 37 and min 0x13 = 19.
  std::vector<std::byte> q4(144, std::byte{0});
  const uint16_t one = 0x3c00;
  std::memcpy(q4.data(), &one, 2);
  std::memcpy(q4.data() + 2, &half, 2);
  uint8_t* s = reinterpret_cast<uint8_t*>(q4.data() + 4);
  s[1] = 2 << 6;               // scale 5's high 2 bits (0x25 >> 4 = 2)
  s[5] = 1 << 6;               // min 5's high 2 bits (0x13 >> 4 = 1)
  s[9] = 0x5 | (0x3 << 4);     // scale 5's low 4 bits, min 5's low 4 bits
  for (int i = 0; i < 32; ++i) s[12 + 64 + i] = static_cast<uint8_t>((i % 16) << 4);  // sub-block 5: high nibbles of bytes 64..95
  DequantizeGgml(GgmlType::kQ4_K, q4.data(), 256, y.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[160 + i], 37.f * (i % 16) - 0.5f * 19) << i;
  EXPECT_EQ(y[0], 0.f);
  // Q6_K: d = 1, scale of sub-block 9 = -2; element 150 (h 1, j 22): low nibble in ql[64 + 22], high 2 bits in qh[32 + 22].
  std::vector<std::byte> q6(210, std::byte{0});
  std::memcpy(q6.data() + 208, &one, 2);
  reinterpret_cast<int8_t*>(q6.data() + 192)[9] = -2;
  q6[64 + 22] = std::byte{0x7};
  q6[128 + 32 + 22] = std::byte{0x2};  // q = 0x7 | 2 << 4 = 39 -> 39 - 32 = 7
  DequantizeGgml(GgmlType::kQ6_K, q6.data(), 256, y.data());
  EXPECT_EQ(y[150], -2.f * 7);
  EXPECT_EQ(y[151], 64.f);  // sub-block 9, code 0: (0 - 32) * -2
}

TEST(GgmlCodec, QuantizersRoundTripWithinTheirPrecision) {
  const std::vector<float> x = RandomFloats(4096, 7);
  for (auto [type, bound] : {std::pair{GgmlType::kQ8_0, 1e-2}, std::pair{GgmlType::kQ6_K, 3e-2},
                             std::pair{GgmlType::kQ4_K, 1.2e-1}, std::pair{GgmlType::kBF16, 5e-3}}) {
    std::vector<std::byte> q(GgmlRowBytes(static_cast<uint32_t>(type), 4096));
    QuantizeGgml(type, x.data(), 4096, q.data());
    std::vector<float> y(4096);
    DequantizeGgml(type, q.data(), 4096, y.data());
    const double err = RelativeL2Error(y.data(), x.data(), x.size());
    EXPECT_LE(err, bound) << GgmlTypeName(static_cast<uint32_t>(type));
    EXPECT_GT(err, 0) << GgmlTypeName(static_cast<uint32_t>(type));
  }
}

// A GGUF built byte by byte, to be broken on purpose.
struct RawGguf {
  uint32_t magic = 0x46554747, version = 3;
  uint64_t n_tensors_claimed = 1, n_kv_claimed = 2;
  uint64_t name_length_extra = 0;  // added to the first key's length field
  uint32_t tensor_type = 0;        // F32
  uint64_t tensor_offset = 0;
  uint64_t dim0 = 8, dim1 = 4;
  size_t truncate = 0;             // bytes cut from the end
  std::string Bytes() const {
    std::string s;
    auto put = [&](auto v) { s.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    auto str = [&](const std::string& v, uint64_t extra = 0) {
      put(uint64_t{v.size() + extra});
      s += v;
    };
    put(magic), put(version), put(n_tensors_claimed), put(n_kv_claimed);
    str("general.architecture", name_length_extra), put(uint32_t{8}), str("qwen3moe");
    str("qwen3moe.block_count"), put(uint32_t{4}), put(uint32_t{1});
    str("blk.0.ffn_gate_exps.weight"), put(uint32_t{2}), put(dim0), put(dim1), put(tensor_type), put(tensor_offset);
    s.append((32 - s.size() % 32) % 32, '\0');
    s.append(dim0 * dim1 * 4, '\x01');
    return s.substr(0, s.size() - truncate);
  }
};

absl::Status OpenRaw(const RawGguf& g) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/x.gguf";
  std::ofstream(path, std::ios::binary) << g.Bytes();
  return GgufFile::Open(path).status();
}

TEST(GgufFile, ReadsAWellFormedFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/x.gguf";
  std::ofstream(path, std::ios::binary) << RawGguf{}.Bytes();
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*(*f)->String("general.architecture"), "qwen3moe");
  EXPECT_EQ(*(*f)->Int("qwen3moe.block_count"), 1);
  EXPECT_TRUE(absl::IsNotFound((*f)->Int("qwen3moe.expert_count").status()));
  EXPECT_TRUE(absl::IsInvalidArgument((*f)->Int("general.architecture").status()));
  const GgufTensor* t = (*f)->Find("blk.0.ffn_gate_exps.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dims, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(t->nbytes, 128u);
}

TEST(GgufFile, HostileOrTruncatedFilesAreRefusedNamingTheKeyOrTensor) {
  struct Case { const char* what; RawGguf g; const char* names; };
  RawGguf bad_magic, bad_version, past_end, huge_tensors, huge_kv, huge_string, unknown_type, misaligned, truncated,
      cut_header, odd_q8;
  bad_magic.magic = 0x12345678;
  bad_version.version = 1;
  past_end.tensor_offset = 1 << 20;
  huge_tensors.n_tensors_claimed = uint64_t{1} << 40;
  huge_kv.n_kv_claimed = uint64_t{1} << 40;
  huge_string.name_length_extra = uint64_t{1} << 50;
  unknown_type.tensor_type = 77;
  misaligned.tensor_offset = 4;
  truncated.truncate = 20;      // inside the tensor's data
  cut_header.truncate = 170;    // inside the tensor table
  odd_q8.tensor_type = 8;       // Q8_0 rows of 8 values
  for (const Case& c : {Case{"bad magic", bad_magic, "bad magic"}, Case{"version 1", bad_version, "version 1"},
                        Case{"offset past the end", past_end, "blk.0.ffn_gate_exps.weight"},
                        Case{"absurd tensor count", huge_tensors, "tensor count"},
                        Case{"absurd key count", huge_kv, "key count"},
                        Case{"absurd string length", huge_string, "metadata key 0"},
                        Case{"unknown type", unknown_type, "blk.0.ffn_gate_exps.weight: unknown ggml type id 77"},
                        Case{"misaligned offset", misaligned, "blk.0.ffn_gate_exps.weight"},
                        Case{"truncated data", truncated, "blk.0.ffn_gate_exps.weight"},
                        Case{"truncated table", cut_header, "blk.0.ffn_gate_exps.weight"},
                        Case{"row not a multiple of the block", odd_q8, "Q8_0"}}) {
    const absl::Status st = OpenRaw(c.g);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << c.what << ": " << st;
    EXPECT_NE(st.message().find(c.names), std::string::npos) << c.what << ": " << st;
  }
  // Every prefix of a good file is refused, none crashes.
  const std::string good = RawGguf{}.Bytes();
  testing::TempDir dir;
  for (size_t n = 0; n < good.size(); n += 7) {
    const std::string path = dir.path() + "/p.gguf";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, n);
    EXPECT_FALSE(GgufFile::Open(path).ok()) << n;
  }
}

TEST(GgufModel, MakeModelGgufReadsBackAsTheSyntheticModel) {
  testing::TempDir dir;
  // qwen3moe; deepseek2 with a leading dense layer; llama with experts (Mixtral).
  for (auto [preset, arch] : {std::pair{"demo", "qwen3moe"}, std::pair{"tiny", "deepseek2"}, std::pair{"tiny-mixtral", "llama"}}) {
    const std::string out = dir.path() + "/" + preset + ".gguf";
    Subprocess make(testing::BinaryPath("moe-make-model"),
                    {absl::StrCat("--preset=", preset), "--layers=2", "--seed=9", "--dtype=bf16", "--out=" + out});
    ASSERT_EQ(make.Wait(std::chrono::seconds(120)), 0) << preset;
    absl::StatusOr<std::unique_ptr<ModelSource>> file = OpenModel(out);
    ASSERT_TRUE(file.ok()) << file.status();
    std::unique_ptr<ModelSource> synth = *OpenModel(absl::StrCat("synthetic:", preset, ":layers=2:seed=9"));
    const ModelSpec &a = (*file)->spec(), &b = synth->spec();
    EXPECT_EQ(a.model_type, b.model_type);
    EXPECT_EQ(a.num_layers, b.num_layers);
    EXPECT_EQ(a.moe_layers, b.moe_layers);  // tiny: layer 0 dense
    EXPECT_EQ(std::tie(a.num_experts, a.top_k, a.hidden, a.intermediate), std::tie(b.num_experts, b.top_k, b.hidden, b.intermediate));
    ExpertWeights x, y;
    for (int e : {0, b.num_experts - 1}) {
      ASSERT_TRUE((*file)->ReadExpert(a.moe_layers.back(), e, &x).ok());
      ASSERT_TRUE(synth->ReadExpert(a.moe_layers.back(), e, &y).ok());
      EXPECT_EQ(x.gate, y.gate);
      EXPECT_EQ(x.up, y.up);
      EXPECT_EQ(x.down, y.down);
    }
    EXPECT_NE((*file)->Describe().find(absl::StrCat("(", arch, ",")), std::string::npos) << (*file)->Describe();
    EXPECT_EQ(a.naming, b.naming);
    if (std::string(preset) == "tiny") {
      EXPECT_NE((*file)->Describe().find("sigmoid"), std::string::npos);
    }
  }
  {  // glm4moe (GLM-4.5: sigmoid routing, a leading dense layer), through our writer
    ModelSpec glm = *PresetSpec("tiny");
    glm.model_type = "glm4_moe";
    const std::string path = dir.path() + "/glm.gguf";
    ASSERT_TRUE(WriteSyntheticGguf(path, glm, 9, GgmlType::kF16).ok());
    absl::StatusOr<std::unique_ptr<ModelSource>> m = OpenModel(path);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ((*m)->spec().model_type, "glm4_moe");
    EXPECT_EQ((*m)->spec().moe_layers, glm.moe_layers);
    EXPECT_EQ((*m)->spec().dtype, DType::kF16);
    EXPECT_NE((*m)->Describe().find("(glm4moe, experts F16; routing sigmoid top-2, normalized"), std::string::npos)
        << (*m)->Describe();
  }
  // A Q8_0 file is another model (identity), stable across opens; the geometry check refuses tiny.
  const std::string q8 = dir.path() + "/q8.gguf";
  Subprocess make(testing::BinaryPath("moe-make-model"), {"--preset=demo", "--layers=2", "--seed=9", "--dtype=q8_0", "--out=" + q8});
  ASSERT_EQ(make.Wait(std::chrono::seconds(120)), 0);
  const uint64_t id8 = (*OpenModel(q8))->Identity();
  EXPECT_EQ(id8, (*OpenModel(q8))->Identity());
  EXPECT_NE(id8, (*OpenModel(dir.path() + "/demo.gguf"))->Identity());
  EXPECT_EQ((*OpenModel(q8))->spec().quant.Describe(), "gguf Q8_0");
  {  // one byte of one expert's blocks changed: another model
    std::unique_ptr<GgufFile> g = *GgufFile::Open(q8);
    const GgufTensor* t = g->Find("blk.1.ffn_down_exps.weight");
    const int64_t at = g->OffsetOf(t->data) + static_cast<int64_t>(t->nbytes) - 1;
    std::fstream f(q8, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(at);
    const char was = static_cast<char>(f.get());
    f.seekp(at);
    f.put(static_cast<char>(was ^ 1));
  }
  EXPECT_NE((*OpenModel(q8))->Identity(), id8);
  EXPECT_FALSE(WriteSyntheticGguf(dir.path() + "/t.gguf", *PresetSpec("tiny"), 1, GgmlType::kQ8_0).ok());
}

// A qwen3moe GGUF of `spec` whose metadata `edit` changes, for refusals.
absl::Status OpenEdited(const std::function<void(std::vector<GgufKv>&, std::vector<GgufTensorSpec>&)>& edit) {
  testing::TempDir dir;
  std::vector<GgufKv> kv = {{"general.architecture", std::string("qwen3moe")}, {"qwen3moe.block_count", uint32_t{1}},
                            {"qwen3moe.embedding_length", uint32_t{256}}, {"qwen3moe.expert_count", uint32_t{2}},
                            {"qwen3moe.expert_used_count", uint32_t{1}},
                            {"qwen3moe.expert_feed_forward_length", uint32_t{256}}};
  std::vector<GgufTensorSpec> t = {{"blk.0.ffn_gate_exps.weight", GgmlType::kF16, {256, 256, 2}},
                                   {"blk.0.ffn_up_exps.weight", GgmlType::kF16, {256, 256, 2}},
                                   {"blk.0.ffn_down_exps.weight", GgmlType::kF16, {256, 256, 2}}};
  edit(kv, t);
  const std::string path = dir.path() + "/m.gguf";
  std::vector<uint32_t> types;
  for (const auto& s : t) types.push_back(static_cast<uint32_t>(s.type));
  EXPECT_TRUE(WriteGguf(path, kv, t, [](size_t, std::span<std::byte>) {}).ok());
  return OpenModel(path).status();
}

TEST(GgufModel, ArchitecturesTypesAndShapesWeDoNotComputeAreRefusedInOneLine) {
  EXPECT_TRUE(OpenEdited([](auto&, auto&) {}).ok());
  struct Case { const char* what; std::function<void(std::vector<GgufKv>&, std::vector<GgufTensorSpec>&)> edit; const char* names; };
  const std::vector<Case> cases = {
      {"gpt-oss without its biases", [](auto& kv, auto&) {
         kv[0].second = std::string("gpt-oss");
         for (auto& [k, v] : kv)
           if (k.rfind("qwen3moe.", 0) == 0) k = "gpt-oss." + k.substr(9);
       }, "no tensor blk.0.ffn_gate_exps.bias (gpt-oss experts carry biases)"},
      {"unknown architecture", [](auto& kv, auto&) { kv[0].second = std::string("grok"); }, "architecture grok"},
      {"a missing key", [](auto& kv, auto&) { kv.erase(kv.begin() + 3); }, "qwen3moe.expert_count"},
      {"expert count disagrees", [](auto& kv, auto&) { kv[3].second = uint32_t{3}; }, "blk.0.ffn_gate_exps.weight: dims"},
      {"a type we do not decode", [](auto&, auto& t) { t[2].type = static_cast<GgmlType>(2); },
       "blk.0.ffn_down_exps.weight: type Q4_0 is not one this service reads"},
      {"a missing projection", [](auto&, auto& t) { t[1].name = "blk.0.ffn_up_shexp.weight"; }, "no tensor blk.0.ffn_up_exps.weight"},
      {"expert biases", [](auto&, auto& t) { t.push_back({"blk.0.ffn_gate_exps.bias", GgmlType::kF32, {256, 2}}); },
       "blk.0.ffn_gate_exps.bias"},
      {"no expert tensors", [](auto&, auto& t) { for (auto& x : t) x.name = x.name.substr(0, x.name.size() - 7) + "dense"; },
       "no expert tensors (blk.N.ffn_gate_exps.weight)"},
  };
  for (const Case& c : cases) {
    const absl::Status st = OpenEdited(c.edit);
    EXPECT_FALSE(st.ok()) << c.what;
    EXPECT_NE(st.message().find(c.names), std::string::npos) << c.what << ": " << st;
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << c.what;
  }
}

// The expert output of (layer, x, routing) from float weights (the file's own
// dequantized values), in f64.
std::vector<double> ExactReference(const std::string& path, int layer, int n, const std::vector<bf16_t>& x,
                                   const RoutingView& r) {
  std::unique_ptr<GgufFile> f = *GgufFile::Open(path);
  std::unique_ptr<ModelSource> src = *OpenModel(path);
  const int H = src->spec().hidden, I = src->spec().intermediate;
  std::vector<double> out(size_t(n) * H, 0.0), xt(H), act(I);
  std::vector<float> g(size_t(I) * H), u(size_t(I) * H), d(size_t(H) * I);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) xt[h] = Bf16ToF32(x[size_t(t) * H + h]);
    for (int j = 0; j < r.k; ++j) {
      const int e = r.ids[t * r.k + j];
      for (auto [name, dst] : {std::pair{"gate", &g}, std::pair{"up", &u}, std::pair{"down", &d}}) {
        const GgufTensor* tn = f->Find(absl::StrCat("blk.", layer, ".ffn_", name, "_exps.weight"));
        const size_t slab = tn->nbytes / static_cast<size_t>(src->spec().num_experts);
        DequantizeGgml(static_cast<GgmlType>(tn->type), tn->data + slab * e, static_cast<int64_t>(dst->size()), dst->data());
      }
      AddExpertOutput<double, float>(g.data(), u.data(), d.data(), H, I, xt.data(), r.weights[t * r.k + j], act.data(),
                                     out.data() + size_t(t) * H);
    }
  }
  return out;
}

// The real path on real shapes: a GGUF of Qwen3-30B-A3B's expert geometry (8
// of its experts, one layer) in each type, served by a real moe-expert-server
// with --weight-dtype auto; its outputs against the f64 reference over the
// file's own dequantized values. Q8_0's per-32 block scales become the
// server's per-channel int8 scales (a re-quantization), Q6_K's and Q4_K's
// too (auto: int8). Q4_K asked for as int4: its asymmetric sub-blocks of 32
// become symmetric groups of 128, a second 4-bit rounding (measured 0.12,
// over the 3e-2 bound: why auto stores Q4_K as int8); its bound here only
// catches a broken path.
// A real moe-expert-server on the GGUF at `path` with --weight-dtype
// `weight_dtype`: checks it stores `stored`, and returns its relative error on
// random tokens against the f64 reference over the file's own values (-1 when
// a step failed).
double ServedError(const std::string& path, const char* weight_dtype, const char* stored) {
  Subprocess* server = nullptr;
  const std::string addr = testing::StartExpertServer(
      &server, {"--model=" + path, "--threads=2", "--max-tokens=64", absl::StrCat("--weight-dtype=", weight_dtype)});
  std::unique_ptr<Subprocess> owned(server);
  if (addr.empty()) return ADD_FAILURE() << "moe-expert-server did not start", -1;
  std::unique_ptr<ExpertClient> client = *ExpertClient::Connect(addr, testing::PlaintextTls());
  absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
  if (!info.ok()) return ADD_FAILURE() << info.status(), -1;
  EXPECT_EQ(info->weight_format(), stored);
  const ModelSpec spec = (*OpenModel(path))->spec();
  const int H = spec.hidden, n = 9, k = std::min(4, spec.num_experts), layer = spec.moe_layers.back();
  std::vector<bf16_t> x = RandomActivations(size_t(n) * H, 5);
  std::vector<int32_t> ids;
  std::vector<float> w;
  RandomRouting(n, k, spec.num_experts, 6, 1.0, &ids, &w);
  const RoutingView r{n, k, ids.data(), w.data()};
  absl::StatusOr<std::vector<bf16_t>> got = client->Forward(ExpertClient::MakeRequest(layer, n, H, x.data(), r, 1));
  if (!got.ok()) return ADD_FAILURE() << got.status(), -1;
  std::vector<float> f(got->size());
  Bf16ToF32(got->data(), f.data(), f.size());
  const std::vector<double> ref = ExactReference(path, layer, n, x, r);
  return RelativeL2Error(f.data(), ref.data(), f.size());
}

TEST(GgufModel, ExpertServerServesGgufExpertsWithinTheBound) {
  struct Case { GgmlType type; const char* weight_dtype; const char* stored; double bound; };
  for (const Case& c : {Case{GgmlType::kBF16, "auto", "bf16", 1e-2}, Case{GgmlType::kQ8_0, "auto", "int8", 1e-2},
                        Case{GgmlType::kQ6_K, "auto", "int8", 1e-2}, Case{GgmlType::kQ4_K, "auto", "int8", 1e-2},
                        Case{GgmlType::kQ4_K, "int4", "int4", 0.2}}) {
    const char* tname = GgmlTypeName(static_cast<uint32_t>(c.type));
    SCOPED_TRACE(absl::StrCat(tname, " --weight-dtype=", c.weight_dtype));
    testing::TempDir dir;
    const std::string path = dir.path() + "/m.gguf";
    ModelSpec spec = *PresetSpec("qwen3-30b-a3b", 1);
    spec.num_experts = 8;
    ASSERT_TRUE(WriteSyntheticGguf(path, spec, 3, c.type).ok());
    const double err = ServedError(path, c.weight_dtype, c.stored);
    std::printf("[gguf] %s served as %s (--weight-dtype %s): relative error %.3g vs the f64 reference (bound %.0e)\n", tname,
                c.stored, c.weight_dtype, err, c.bound);
    EXPECT_GT(err, 0);
    EXPECT_LE(err, c.bound);
  }
  // moe-make-model's GGUF through the binary, on the demo preset (qwen3moe, two layers; tiny's I = 80 is
  // not a multiple of Q8_0's block of 32).
  for (const char* dtype : {"bf16", "q8_0"}) {
    SCOPED_TRACE(absl::StrCat("moe-make-model --dtype ", dtype));
    testing::TempDir dir;
    const std::string path = dir.path() + "/demo.gguf";
    Subprocess make(testing::BinaryPath("moe-make-model"),
                    {"--preset=demo", "--layers=2", "--seed=8", absl::StrCat("--dtype=", dtype), "--out=" + path});
    ASSERT_EQ(make.Wait(std::chrono::seconds(60)), 0);
    const double err = ServedError(path, "auto", std::string(dtype) == "bf16" ? "bf16" : "int8");
    std::printf("[gguf] moe-make-model demo %s: relative error %.3g\n", dtype, err);
    EXPECT_GT(err, 0);
    EXPECT_LE(err, 1e-2);
  }
}

// The GPU worker's own host copy opens a GGUF the way the server does
// (OpenModel, StorageGeometry's auto): Q8_0 packed as int8, each expert the
// packing of the file's dequantized values.
TEST(GgufModel, WorkerHostCopyPacksGgufExperts) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/m.gguf";
  ASSERT_TRUE(WriteSyntheticGguf(path, *PresetSpec("demo", 2), 4, GgmlType::kQ8_0).ok());
  std::unique_ptr<ModelSource> src = *OpenModel(path);
  const ModelIdentity id{src->Identity(), path};
  absl::StatusOr<std::unique_ptr<HostExpertStore>> host =
      HostExpertStore::Open(*src, id, src->spec().moe_layers, {}, "auto", /*share=*/false, nullptr);
  ASSERT_TRUE(host.ok()) << host.status();
  const ExpertGeometry& g = (*host)->geometry();
  EXPECT_EQ(g.format, WeightFormat::kInt8);
  ExpertWeights w;
  ASSERT_TRUE(src->ReadExpert(1, 31, &w).ok());
  const size_t bytes = (g.packed_bytes() + 63) / 64 * 64;
  std::unique_ptr<std::byte, decltype(&std::free)> packed(static_cast<std::byte*>(std::aligned_alloc(64, bytes)), &std::free);
  PackExpert(g, w.gate.data(), w.up.data(), w.down.data(), packed.get());
  EXPECT_EQ(std::memcmp((*host)->Find(1, 31), packed.get(), g.packed_bytes()), 0);
}

// A python3 with numpy, or "".
std::string PythonWithNumpy() {
  for (const char* py : {"/usr/bin/python3", "python3"})
    if (std::system(absl::StrCat(py, " -c 'import numpy' >/dev/null 2>&1").c_str()) == 0) return py;
  return "";
}

std::vector<float> ReadF32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> v;
  float x;
  while (in.read(reinterpret_cast<char*>(&x), 4)) v.push_back(x);
  return v;
}

// gguf-py's reading of `path` (geometry lines and expert (layer, expert)'s
// values) against ours.
void CrossCheck(const std::string& py, const std::string& gguf_py, const std::string& path, int layer, int expert,
                const std::string& dir) {
  const std::string lines = dir + "/lines.txt", prefix = dir + "/ref";
  const std::string cmd = absl::StrCat(py, " ", MOE_SOURCE_DIR, "/tests/gguf_reference.py ", gguf_py, " read ", path, " ",
                                       layer, " ", expert, " ", prefix, " > ", lines);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::unique_ptr<ModelSource> src = *OpenModel(path);
  const ModelSpec& s = src->spec();
  std::ifstream in(lines);
  std::string key, value;
  int checked = 0;
  while (in >> key >> value) {
    std::string rest;
    std::getline(in, rest);
    auto ends = [&](const char* k) { return key.size() > std::strlen(k) && key.compare(key.size() - std::strlen(k), std::strlen(k), k) == 0; };
    const int v = std::atoi(value.c_str());
    for (auto [k, ours] : {std::pair{".block_count", s.num_layers}, std::pair{".embedding_length", s.hidden},
                           std::pair{".expert_count", s.num_experts}, std::pair{".expert_used_count", s.top_k},
                           std::pair{".expert_feed_forward_length", s.intermediate}}) {
      if (!ends(k)) continue;
      EXPECT_EQ(v, ours) << key;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 5);
  ExpertWeights w;
  ASSERT_TRUE(src->ReadExpert(layer, expert, &w).ok());
  std::unique_ptr<GgufFile> f = *GgufFile::Open(path);
  for (auto [name, ours] : {std::pair{"gate", &w.gate}, std::pair{"up", &w.up}, std::pair{"down", &w.down}}) {
    const std::vector<float> ref = ReadF32(absl::StrCat(prefix, ".", name, ".f32"));
    ASSERT_EQ(ref.size(), ours->size()) << name;
    // Our f32 dequantization equals gguf-py's; ReadExpert's bf16 is its rounding.
    const GgufTensor* t = f->Find(absl::StrCat("blk.", layer, ".ffn_", name, "_exps.weight"));
    std::vector<float> exact(ref.size());
    DequantizeGgml(static_cast<GgmlType>(t->type), t->data + t->nbytes / s.num_experts * expert,
                   static_cast<int64_t>(exact.size()), exact.data());
    size_t differ = 0;
    for (size_t i = 0; i < ref.size(); ++i) differ += exact[i] != ref[i] && std::fabs(exact[i] - ref[i]) > 1e-6f * std::fabs(ref[i]);
    EXPECT_EQ(differ, 0u) << name;
    for (size_t i = 0; i < ref.size(); ++i)
      if ((*ours)[i] != F32ToBf16(ref[i])) {
        ADD_FAILURE() << name << " value " << i << ": ours " << Bf16ToF32((*ours)[i]) << ", gguf-py " << ref[i];
        break;
      }
    double norm = 0;
    for (float v : ref) norm += double(v) * v;
    EXPECT_GT(norm, 0) << name;
  }
}

TEST(GgufCrossCheck, OurReaderAgreesWithGgufPy) {
  const std::string shared = std::string(MOE_SOURCE_DIR) + "/../shared/peers/llama";
  const std::string gguf_py = shared + "/gguf-py";
  if (!std::filesystem::exists(shared + "/make_model.py") || !std::filesystem::exists(gguf_py))
    GTEST_SKIP() << "../shared/peers/llama (make_model.py, gguf-py) is missing";
  const std::string py = PythonWithNumpy();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy (apt-get install python3-numpy)";
  testing::TempDir dir;
  // 1. A file llama.cpp's tools write: make_model.py (Qwen3-30B-A3B geometry,
  // its full vocabulary and all 128 experts; one layer is its smallest, ~1.3 GB at Q8_0).
  const std::string vocab = dir.path() + "/vocab.gguf", model = dir.path() + "/qwen3.gguf";
  ASSERT_EQ(std::system(absl::StrCat(py, " ", MOE_SOURCE_DIR, "/tests/gguf_reference.py ", gguf_py, " vocab ", vocab).c_str()), 0);
  const std::string make = absl::StrCat(py, " ", shared, "/make_model.py ", model, " --layers 1 --type q8_0 --pool-mib 16 --vocab ",
                                        vocab, " --gguf-py ", gguf_py, " > ", dir.path(), "/make.log 2>&1");
  ASSERT_EQ(std::system(make.c_str()), 0) << make;
  {
    SCOPED_TRACE("make_model.py q8_0");
    CrossCheck(py, gguf_py, model, 0, 77, dir.path());
  }
  std::filesystem::remove(model);
  // 2. Our writer's k-quants, MXFP4 and BF16, read by gguf-py.
  for (GgmlType t : {GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kMXFP4, GgmlType::kBF16}) {
    SCOPED_TRACE(GgmlTypeName(static_cast<uint32_t>(t)));
    ModelSpec spec = *PresetSpec("demo", 2);
    const std::string path = dir.path() + "/ours.gguf";
    ASSERT_TRUE(WriteSyntheticGguf(path, spec, 2, t).ok());
    CrossCheck(py, gguf_py, path, 1, 5, dir.path());
  }
}

}  // namespace
}  // namespace moe
