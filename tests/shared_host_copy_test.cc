// One host copy (issue 12, point 5), through the real path: a real
// moe-expert-server process with --shm-socket keeps its packed experts in a
// sealed memfd; an engine session (MoeSession, the device backend the machine
// has) maps it read-only instead of packing its own copy, fills its cache from
// it in the servers' precision, and its outputs (cached experts on the device,
// the rest on the server) match the reference MoE computed from the weights
// the packed experts stand for (dequantized). The process's own memory shows
// the difference: with sharing it gains no anonymous memory of the model's
// size; with --share-host-copy off it does (so the check can fail).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model/model_source.h"
#include "model/reference_moe.h"
#include "transport/shm_server.h"
#include "expert_compute/expert_store.h"
#include "moe/engine.h"
#include "tests/device_call.h"
#include "tests/test_support.h"

namespace moe {
namespace {

// 2 MoE layers x 32 experts, top-4, H=512, I=256.
const char kModel[] = "synthetic:demo:layers=2:seed=5";
constexpr int kSlots = 16;  // cache slots per layer: experts 0..15 are placed

// A moe-expert-server of kModel serving shared memory on `sock`, with
// `extra` flags; the process is killed when the result goes away.
struct ShmServerProcess {
  std::unique_ptr<Subprocess> proc;
  bool started = false;
};
ShmServerProcess StartShmServer(const std::string& sock, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {std::string("--model=") + kModel, "--shm-socket=" + sock};
  args.insert(args.end(), extra.begin(), extra.end());
  Subprocess* s = nullptr;
  const std::string addr = testing::StartExpertServer(&s, args);
  return {std::unique_ptr<Subprocess>(s), !addr.empty()};
}

// This process's memory in KiB: anonymous resident, and the size of the
// mapped memfd expert stores (mapped, not resident: the cpu backend touches
// only what it copies).
struct Resident {
  long anon = 0, store = 0;
};
Resident SelfResident() {
  std::ifstream f("/proc/self/smaps");
  std::string line, name;
  Resident r;
  bool anon = false, store = false;
  while (std::getline(f, line)) {
    if (line.rfind("Rss:", 0) == 0) {
      if (anon) r.anon += std::strtol(line.c_str() + 4, nullptr, 10);
    } else if (line.rfind("Size:", 0) == 0) {
      if (store) r.store += std::strtol(line.c_str() + 5, nullptr, 10);
    } else if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
               line.find(':') > line.find(' ')) {
      std::istringstream h(line);
      std::string field;
      for (int i = 0; i < 5; ++i) h >> field;  // range, perms, offset, dev, inode
      name.clear();
      std::getline(h >> std::ws, name);
      anon = name.empty() || name == "[heap]";
      store = name.rfind("/memfd:moe-expert-store", 0) == 0;
    }
  }
  return r;
}

class SharedHostCopyTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dtype_ = GetParam();
    sock_ = dir_.path() + "/experts.sock";
    server_ = StartShmServer(sock_, {"--threads=2", "--weight-dtype=" + dtype_});
    ASSERT_TRUE(server_.started) << "expert server did not start";
    absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(kModel);
    ASSERT_TRUE(src.ok()) << src.status();
    source_ = *std::move(src);
  }

  std::unique_ptr<MoeSession> Open(bool share) {
    SessionOptions o;
    o.model = kModel;
    o.servers = {"unix://" + sock_};
    o.cache_experts_per_layer = kSlots;
    o.policy = CachePolicy::kStatic;
    o.copy_mode = CopyMode::kNever;
    o.max_tokens = 16;
    o.share_host_copy = share;
    o.weight_dtype = *ParseWeightDtype(dtype_);
    o.cpu_threads = 2;
    absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // Places experts 0..15 of both layers, runs batches whose tokens reach
  // cached and uncached experts, and checks them against the reference
  // from the dequantized weights: host memory (the host split), and on the
  // cuda backend device memory too (the device-planned path: the GPU splits
  // the call and runs the cache's packed experts on its tensor cores).
  void ExpectCorrect(MoeSession& session) {
    ASSERT_NO_FATAL_FAILURE(ExpectCorrect(session, MemoryKind::kHost));
    if (std::string(session.device()) != "cuda") {
      std::printf("%s: device-pointer pass not run (the %s backend; it needs cuda)\n", dtype_.c_str(), session.device());
      return;
    }
#ifdef MOE_HAVE_CUDA
    ASSERT_NO_FATAL_FAILURE(ExpectCorrect(session, MemoryKind::kDevice));
#endif
  }
  void ExpectCorrect(MoeSession& session, MemoryKind kind) {
    const ModelSpec& spec = source_->spec();
    std::vector<int> half(kSlots);
    for (int e = 0; e < kSlots; ++e) half[e] = e;
    for (int layer : spec.moe_layers) ASSERT_TRUE(session.admin().ApplyAssignment(layer, half).ok());
    ASSERT_TRUE(session.admin().FlushCopies().ok());
    const ExpertGeometry g = *StorageGeometry(spec, dtype_);
    const double tolerance = g.format == WeightFormat::kInt4 ? 3e-2 : 1e-2;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-1, 1), uw(0.1f, 1.0f);
    const int k = spec.top_k, H = spec.hidden, I = spec.intermediate;
    // The device path takes decode-shaped calls: T * k at most the experts.
    const int T = kind == MemoryKind::kDevice ? std::min(12, spec.num_experts / k) : 12;
    for (int layer : spec.moe_layers) {
      std::vector<bf16_t> x(static_cast<size_t>(T) * H), out(x.size());
      for (bf16_t& v : x) v = F32ToBf16(u(rng));
      std::vector<int32_t> ids(static_cast<size_t>(T) * k);
      std::vector<float> w(ids.size());
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          ids[t * k + j] = (t * 5 + j * 8 + layer) % spec.num_experts;  // distinct per token; half cached
          w[t * k + j] = uw(rng);
        }
      CallStats stats;
      if (kind == MemoryKind::kHost) {
        ASSERT_TRUE(session.ForwardLayer(layer, T, k, x.data(), ids.data(), w.data(), out.data(), kind, &stats).ok());
      } else {
#ifdef MOE_HAVE_CUDA
        testing::DeviceCall dev(x, ids, w);
        ASSERT_TRUE(dev.ok());
        ASSERT_TRUE(session.ForwardLayer(layer, T, k, dev.x(), dev.ids(), dev.weights(), dev.out(), kind, &stats).ok());
        out = dev.Output();
#endif
      }
      EXPECT_GT(stats.hit_pairs, 0u) << "nothing ran from the cache";
      EXPECT_GT(stats.cpu_pairs, 0u) << "nothing ran on the server";
      // Reference: the packed experts' own values, in double.
      std::vector<double> ref(x.size(), 0.0), xd(H), act(I);
      std::vector<std::byte> packed(g.packed_bytes() + 64);
      std::byte* p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) / 64 * 64);
      std::vector<float> gate(static_cast<size_t>(I) * H), up(gate.size()), down(gate.size());
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) xd[h] = Bf16ToF32(x[static_cast<size_t>(t) * H + h]);
        for (int j = 0; j < k; ++j) {
          ExpertWeights ew;
          ASSERT_TRUE(source_->ReadExpert(layer, ids[t * k + j], &ew).ok());
          PackExpert(g, ew.gate.data(), ew.up.data(), ew.down.data(), p);
          UnpackExpert(g, p, gate.data(), up.data(), down.data());
          AddExpertOutput<double, float>(gate.data(), up.data(), down.data(), H, I, xd.data(), w[t * k + j], act.data(),
                                         ref.data() + static_cast<size_t>(t) * H);
        }
      }
      std::vector<float> got(out.size());
      Bf16ToF32(out.data(), got.data(), out.size());
      EXPECT_LE(RelativeL2Error(got.data(), ref.data(), ref.size()), tolerance)
          << "layer " << layer << ", " << dtype_ << (kind == MemoryKind::kDevice ? ", device path" : "");
    }
  }

  // KiB of `per_layer` experts of every MoE layer, packed in the test's format.
  long PackedKib(int per_layer) const {
    const ModelSpec& spec = source_->spec();
    const ExpertGeometry g = *StorageGeometry(spec, dtype_);
    return static_cast<long>(g.packed_bytes() * spec.moe_layers.size() * per_layer / 1024);
  }

  std::string dtype_, sock_;
  testing::TempDir dir_;
  ShmServerProcess server_;
  std::unique_ptr<ModelSource> source_;
};

TEST_P(SharedHostCopyTest, WorkerMapsTheServersStoreAndHoldsNoCopyOfItsOwn) {
  const long model_kib = PackedKib(source_->spec().num_experts);
  const Resident before = SelfResident();
  std::unique_ptr<MoeSession> shared = Open(/*share=*/true);
  ASSERT_NE(shared, nullptr);
  const Resident after = SelfResident();
  EXPECT_GE(after.store - before.store, model_kib * 9 / 10) << "the server's store is not mapped";
  // The cpu backend's cache slots are anonymous memory too.
  const long cache_kib = PackedKib(kSlots);
  EXPECT_LT(after.anon - before.anon, cache_kib + model_kib / 2) << "the worker packed a copy of its own";
  // What one copy moves, as the coordinator's copy budget counts it (issue 24):
  // the packed expert of the cache's format, not the bf16 size.
  const ExpertGeometry packed = *StorageGeometry(source_->spec(), dtype_);
  EXPECT_EQ(shared->model_info().expert_bytes, packed.packed_bytes()) << dtype_;
  if (dtype_ != "bf16") {
    EXPECT_LT(shared->model_info().expert_bytes, source_->spec().ExpertBf16Bytes() * 6 / 10) << dtype_;
  }
  ASSERT_NO_FATAL_FAILURE(ExpectCorrect(*shared));
}

TEST_P(SharedHostCopyTest, WithoutSharingTheWorkerPacksItsOwnCopy) {
  const long model_kib = PackedKib(source_->spec().num_experts);
  const Resident before = SelfResident();
  std::unique_ptr<MoeSession> own = Open(/*share=*/false);
  ASSERT_NE(own, nullptr);
  const Resident after = SelfResident();
  EXPECT_EQ(after.store, before.store) << "mapped a store although sharing is off";
  EXPECT_GE(after.anon - before.anon, model_kib * 9 / 10) << "no own copy: the memory check above cannot fail";
  ASSERT_NO_FATAL_FAILURE(ExpectCorrect(*own));
}

INSTANTIATE_TEST_SUITE_P(Formats, SharedHostCopyTest, ::testing::Values("bf16", "int8", "int4", "fp8"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The store request and its description, hostile or wrong.
TEST(SharedStoreInfo, RefusesDescriptionsThatDoNotFitTheModelOrTheMemory) {
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(kModel);
  ASSERT_TRUE(src.ok());
  const ModelSpec& spec = (*src)->spec();
  const ExpertGeometry g = ExpertGeometry::For(spec.hidden, spec.intermediate, WeightFormat::kInt8);
  // A well-formed description of layer 0 (or the first MoE layer), experts 0..3.
  auto blob = [&](int32_t hidden, int32_t format, uint64_t stride, std::vector<int32_t> layers,
                  std::vector<int32_t> experts) {
    struct {
      uint32_t magic, version;
      int32_t hidden, intermediate, format, group;
      uint64_t stride;
      uint32_t nl, ne;
    } h{0x53454f4d, 1, hidden, spec.intermediate, format, 0, stride, static_cast<uint32_t>(layers.size()),
        static_cast<uint32_t>(experts.size())};
    std::string s(reinterpret_cast<const char*>(&h), sizeof(h));
    for (int32_t v : layers) s.append(reinterpret_cast<const char*>(&v), 4);
    for (int32_t v : experts) s.append(reinterpret_cast<const char*>(&v), 4);
    return s;
  };
  const int l0 = spec.moe_layers[0];
  const uint64_t stride = (g.packed_bytes() + 63) / 64 * 64, bytes = 4 * stride;
  absl::StatusOr<SharedStoreInfo> ok = ParseSharedStoreInfo(blob(spec.hidden, 1, stride, {l0}, {0, 1, 2, 3}), spec, bytes);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->Offset(l0, 2), static_cast<int64_t>(2 * stride));
  EXPECT_EQ(ok->Offset(l0, 9), -1);
  EXPECT_EQ(ParseSharedStoreInfo(blob(spec.hidden, 1, stride, {l0}, {0, 1, 2, 3}), spec, bytes - 1).status().code(),
            absl::StatusCode::kInvalidArgument) << "table beyond the memory";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden + 1, 1, stride, {l0}, {0}), spec, bytes).ok()) << "hidden";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden, 7, stride, {l0}, {0}), spec, bytes).ok()) << "format";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden, 1, 64, {l0}, {0}), spec, bytes).ok()) << "stride < expert";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden, 1, stride, {l0}, {1, 0}), spec, bytes).ok()) << "order";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden, 1, stride, {l0}, {spec.num_experts}), spec, bytes).ok()) << "range";
  EXPECT_FALSE(ParseSharedStoreInfo(blob(spec.hidden, 1, stride, {l0}, {0}).substr(0, 20), spec, bytes).ok()) << "short";
  std::string extra = blob(spec.hidden, 1, stride, {l0}, {0});
  extra += "junk";
  EXPECT_FALSE(ParseSharedStoreInfo(extra, spec, bytes).ok()) << "trailing bytes";
}

TEST(SharedStoreInfo, ServerWithoutSharingRefusesTheStoreRequest) {
  testing::TempDir dir;
  const std::string sock = dir.path() + "/s.sock";
  const ShmServerProcess server = StartShmServer(sock, {"--threads=1", "--share-weights=false"});
  ASSERT_TRUE(server.started);
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(kModel);
  ASSERT_TRUE(src.ok());
  absl::StatusOr<SharedStoreFd> fd =
      FetchSharedStore(sock, (*src)->spec().hidden, ModelIdentity{}, std::chrono::seconds(5));
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition) << fd.status();
  // The wrong hidden size is refused by name.
  absl::StatusOr<SharedStoreFd> bad = FetchSharedStore(sock, 3, ModelIdentity{}, std::chrono::seconds(5));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("hidden"), std::string::npos) << bad.status();
}

// A server that shares: the memfd it hands out is sealed, so the client can
// neither write it nor map it writable.
TEST(SharedStoreInfo, TheStoreIsSealedReadOnly) {
  testing::TempDir dir;
  const std::string sock = dir.path() + "/s.sock";
  const ShmServerProcess server = StartShmServer(sock, {"--threads=1"});
  ASSERT_TRUE(server.started);
  absl::StatusOr<std::unique_ptr<ModelSource>> src = OpenModel(kModel);
  ASSERT_TRUE(src.ok());
  absl::StatusOr<SharedStoreFd> fd =
      FetchSharedStore(sock, (*src)->spec().hidden, ModelIdentity{}, std::chrono::seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_TRUE(ParseSharedStoreInfo(fd->info, (*src)->spec(), fd->bytes).ok());
  void* w = mmap(nullptr, fd->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
  EXPECT_EQ(w, MAP_FAILED) << "a writable mapping of the store was allowed";
  if (w != MAP_FAILED) munmap(w, fd->bytes);
  const char byte = 1;
  EXPECT_LT(pwrite(fd->fd, &byte, 1, 0), 0) << "write(2) to the store was allowed";
  EXPECT_NE(ftruncate(fd->fd, 0), 0) << "the store could be shrunk";
  close(fd->fd);
}

}  // namespace
}  // namespace moe
