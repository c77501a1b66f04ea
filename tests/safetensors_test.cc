#include "model/safetensors.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {

namespace fs = std::filesystem;

// gtest assertion: `status` has a message containing `word`.
::testing::AssertionResult MessageHas(const absl::Status& status, const std::string& word) {
  if (std::string(status.message()).find(word) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << word << "' not in: " << status;
}

// A fresh directory under /tmp, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/safetensors_test_XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    EXPECT_NE(p, nullptr);
    path_ = p ? p : "/nonexistent";
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadFile(const std::string& path) {
  std::stringstream s;
  s << std::ifstream(path, std::ios::binary).rdbuf();
  return s.str();
}

// A safetensors file: little-endian header length, header, then `data`.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  return out + header + data;
}

std::vector<std::byte> RandomBytes(size_t n, std::mt19937& rng) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(1 + rng() % 255);  // never zero
  return v;
}

bool SameBytes(const TensorInfo* t, const std::vector<std::byte>& want) {
  return t != nullptr && t->nbytes == want.size() && std::memcmp(t->data, want.data(), want.size()) == 0;
}

// Writes `specs` with random contents; returns the contents.
std::vector<std::vector<std::byte>> WriteRandom(const std::string& dir, const std::vector<TensorSpec>& specs,
                                                size_t max_shard_bytes,
                                                const std::map<std::string, std::string>& metadata = {}) {
  std::mt19937 rng(42);
  std::vector<std::vector<std::byte>> contents;
  for (const TensorSpec& s : specs)
    contents.push_back(RandomBytes(static_cast<size_t>(NumElements(s.shape)) * DTypeSize(s.dtype), rng));
  absl::Status st = WriteCheckpoint(
      dir, specs, max_shard_bytes,
      [&](size_t i, std::span<std::byte> dst) {
        ASSERT_EQ(dst.size(), contents[i].size());
        std::memcpy(dst.data(), contents[i].data(), dst.size());
      },
      metadata);
  EXPECT_TRUE(st.ok()) << st;
  return contents;
}

TEST(SafetensorsTest, RoundTripSeveralDtypes) {
  TempDir dir;
  const std::vector<TensorSpec> specs = {
      {"layers.0.w_bf16", DType::kBF16, {3, 5}},
      {"layers.0.w_f16", DType::kF16, {7}},
      {"layers.0.w_f32", DType::kF32, {4, 4}},
      {"a.i32", DType::kI32, {2, 3, 2}},
      {"scalar", DType::kF32, {}},
  };
  auto contents = WriteRandom(dir.path(), specs, size_t{1} << 30);
  // One shard, still under the sharded name, plus an index.
  EXPECT_TRUE(fs::exists(dir / "model-00001-of-00001.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));

  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->num_tensors(), specs.size());
  EXPECT_EQ((*ckpt)->names(), (std::vector<std::string>{"a.i32", "layers.0.w_bf16", "layers.0.w_f16",
                                                          "layers.0.w_f32", "scalar"}));
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorInfo* t = (*ckpt)->Find(specs[i].name);
    ASSERT_NE(t, nullptr) << specs[i].name;
    EXPECT_EQ(t->name, specs[i].name);
    EXPECT_EQ(t->dtype, specs[i].dtype);
    EXPECT_EQ(t->shape, specs[i].shape);
    EXPECT_TRUE(SameBytes(t, contents[i])) << specs[i].name;
  }
  EXPECT_EQ((*ckpt)->Find("nope"), nullptr);

  // Data starts 8-byte aligned.
  std::string raw = ReadFile(dir / "model-00001-of-00001.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(SafetensorsTest, ShardsAndIndex) {
  TempDir dir;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 7; ++i) specs.push_back({"t" + std::to_string(i), DType::kF32, {25}});  // 100 bytes
  specs.insert(specs.begin() + 3, {"big", DType::kI32, {300}});                               // 1200 bytes
  auto contents = WriteRandom(dir.path(), specs, 250);

  // {t0,t1} {t2} {big} {t3,t4} {t5,t6}: filled in order, the oversized tensor alone.
  const std::map<std::string, int> want_shard = {{"t0", 1}, {"t1", 1}, {"t2", 2}, {"big", 3},
                                                 {"t3", 4}, {"t4", 4}, {"t5", 5}, {"t6", 5}};
  for (int k = 1; k <= 5; ++k)
    EXPECT_TRUE(fs::exists(dir / ("model-0000" + std::to_string(k) + "-of-00005.safetensors"))) << k;
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();

  auto index = nlohmann::json::parse(ReadFile(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 1900);
  ASSERT_EQ(index["weight_map"].size(), specs.size());
  for (const auto& [name, k] : want_shard) {
    std::string shard = "model-0000" + std::to_string(k) + "-of-00005.safetensors";
    EXPECT_EQ(index["weight_map"][name], shard) << name;
    auto f = SafetensorsFile::Open(dir / shard);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_NE((*f)->Find(name), nullptr) << name;
  }

  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ((*ckpt)->num_tensors(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i)
    EXPECT_TRUE(SameBytes((*ckpt)->Find(specs[i].name), contents[i])) << specs[i].name;
}

TEST(SafetensorsTest, SingleFileWithoutIndex) {
  TempDir dir;
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("empty":{"dtype":"BF16","shape":[0,3],"data_offsets":[12,12]}})";
  const std::string data = "ABCDEFGHIJKL";
  WriteFile(dir / "model.safetensors", RawFile(header, data));
  WriteFile(dir / "ignored.safetensors", "garbage");  // model.safetensors takes precedence

  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->names(), (std::vector<std::string>{"a", "b", "empty"}));
  const TensorInfo* a = (*ckpt)->Find("a");
  const TensorInfo* b = (*ckpt)->Find("b");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(a->data), a->nbytes), "ABCDEFGH");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(b->data), b->nbytes), "IJKL");
  EXPECT_EQ(b->dtype, DType::kF16);
  EXPECT_EQ((*ckpt)->Find("empty")->nbytes, 0u);

  auto f = SafetensorsFile::Open(dir / "model.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ((*f)->tensors().size(), 3u);
  EXPECT_EQ((*f)->tensors()[0].name, "a");  // in file order
}

TEST(SafetensorsTest, AllFilesWithoutIndex) {
  TempDir dir;
  WriteFile(dir / "x.safetensors", RawFile(R"({"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", "xyz"));
  WriteFile(dir / "y.safetensors", RawFile(R"({"y":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", "01234567"));
  WriteFile(dir / "notes.txt", "not a tensor file");
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->names(), (std::vector<std::string>{"x", "y"}));

  // The same tensor name in two files is ambiguous.
  WriteFile(dir / "z.safetensors", RawFile(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "q"));
  auto dup = Checkpoint::Open(dir.path());
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(dup.status(), "'x'"));
  EXPECT_TRUE(MessageHas(dup.status(), "z.safetensors"));
}

TEST(SafetensorsTest, MetadataRoundTrip) {
  TempDir dir;
  const std::map<std::string, std::string> md = {{"format", "pt"}, {"model", "tiny-moe"}, {"note", "a \"quoted\" ü"}};
  WriteRandom(dir.path(), {{"w", DType::kBF16, {4}}, {"v", DType::kF32, {2}}}, 8, md);
  for (const char* shard : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    auto f = SafetensorsFile::Open(dir / shard);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->metadata(), md);
    EXPECT_EQ((*f)->path(), dir / shard);
  }
}

TEST(SafetensorsTest, EmptyCheckpoint) {
  TempDir dir;
  WriteRandom(dir.path(), {}, 100);
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->num_tensors(), 0u);
}

TEST(SafetensorsTest, WriteRejectsBadSpecs) {
  TempDir dir;
  auto noop = [](size_t, std::span<std::byte>) {};
  absl::Status s = WriteCheckpoint(dir.path(), {{"a", DType::kF32, {1}}, {"a", DType::kF32, {2}}}, 100, noop);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(s, "duplicate"));
  s = WriteCheckpoint(dir.path(), {{"a", DType::kF32, {-1}}}, 100, noop);
  EXPECT_TRUE(MessageHas(s, "negative"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
}

// Opens `bytes` as a file and expects InvalidArgument naming the file and `word`.
void ExpectInvalid(const std::string& bytes, const std::string& word) {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  WriteFile(path, bytes);
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok()) << "accepted a file that should fail with '" << word << "'";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_TRUE(MessageHas(f.status(), path));
  EXPECT_TRUE(MessageHas(f.status(), word));
  // Same error through a checkpoint directory.
  EXPECT_EQ(Checkpoint::Open(dir.path()).status(), f.status());
}

std::string OneTensor(const std::string& entry, size_t data_bytes = 8) {
  return RawFile(R"({"t":)" + entry + "}", std::string(data_bytes, 'd'));
}

TEST(SafetensorsTest, RejectsTruncatedHeader) {
  ExpectInvalid(std::string("\x05\0\0\0\0", 5), "short");
  ExpectInvalid(std::string("\xff\0\0\0\0\0\0\0{}", 10), "header length");
  ExpectInvalid(std::string("\xff\xff\xff\xff\xff\xff\xff\xff{}", 10), "header length");
}

TEST(SafetensorsTest, RejectsBadJson) {
  ExpectInvalid(RawFile("{\"t\": [1, 2", ""), "JSON");
  ExpectInvalid(RawFile("\xc3\x28 not json", ""), "JSON");
  ExpectInvalid(RawFile("[1,2,3]", ""), "not an object");
  ExpectInvalid(RawFile(R"({"t":5})", ""), "not an object");
  ExpectInvalid(RawFile(R"({"__metadata__":{"k":1}})", ""), "__metadata__");
}

TEST(SafetensorsTest, RejectsBadEntries) {
  ExpectInvalid(OneTensor(R"({"shape":[2],"data_offsets":[0,8]})"), "dtype");
  ExpectInvalid(OneTensor(R"({"dtype":32,"shape":[2],"data_offsets":[0,8]})"), "dtype");
  ExpectInvalid(OneTensor(R"({"dtype":"Q4","shape":[2],"data_offsets":[0,8]})"), "Q4");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","data_offsets":[0,8]})"), "shape");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})"), "shape");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"), "shape");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), "negative");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]})"),
                "overflow");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2]})"), "data_offsets");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"), "data_offsets");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), "data_offsets");
}

TEST(SafetensorsTest, RejectsBadOffsets) {
  // End beyond the file.
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})", 8), "data_offsets");
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,0]})"),
                "data_offsets");
  // Begin after end.
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"), "data_offsets");
  // Size disagrees with dtype * shape.
  ExpectInvalid(OneTensor(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), "mismatch");
  ExpectInvalid(OneTensor(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,8]})"), "mismatch");
}

TEST(SafetensorsTest, RejectsOverlappingTensors) {
  ExpectInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        std::string(12, 'd')),
                "overlap");
  ExpectInvalid(RawFile(R"({"a":{"dtype":"U8","shape":[12],"data_offsets":[0,12]},)"
                        R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                        std::string(12, 'd')),
                "overlap");
}

TEST(SafetensorsTest, IndexProblems) {
  TempDir dir;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 3; ++i) specs.push_back({"t" + std::to_string(i), DType::kF32, {4}});
  WriteRandom(dir.path(), specs, 16);  // one tensor per shard
  const std::string index_path = dir / "model.safetensors.index.json";
  const std::string index_text = ReadFile(index_path);

  // A tensor the index places in a shard that lacks it.
  auto index = nlohmann::json::parse(index_text);
  index["weight_map"]["ghost"] = "model-00002-of-00003.safetensors";
  WriteFile(index_path, index.dump());
  auto ghost = Checkpoint::Open(dir.path());
  EXPECT_EQ(ghost.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(ghost.status(), "ghost"));
  EXPECT_TRUE(MessageHas(ghost.status(), "model-00002-of-00003.safetensors"));

  // A shard that does not exist.
  WriteFile(index_path, index_text);
  ASSERT_TRUE(Checkpoint::Open(dir.path()).ok());
  fs::remove(dir / "model-00002-of-00003.safetensors");
  auto missing = Checkpoint::Open(dir.path());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(MessageHas(missing.status(), "model-00002-of-00003.safetensors"));
  EXPECT_TRUE(MessageHas(missing.status(), "t1"));

  // A malformed index, and one pointing outside the directory.
  WriteFile(index_path, "{\"weight_map\": ");
  EXPECT_EQ(Checkpoint::Open(dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
  WriteFile(index_path, R"({"weight_map":{"t0":"../etc/passwd"}})");
  EXPECT_EQ(Checkpoint::Open(dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, EmptyOrMissingDirectory) {
  TempDir dir;
  EXPECT_EQ(Checkpoint::Open(dir.path()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Checkpoint::Open(dir / "absent").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir / "absent.safetensors").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe
