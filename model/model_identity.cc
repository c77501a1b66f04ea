#include "model/model_identity.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moe {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full, kP3 = 0x165667B19E3779F9ull,
                   kP4 = 0x85EBCA77C2B2AE63ull, kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts only (x86-64, aarch64 as we build them)
}
inline uint32_t Read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t Round(uint64_t acc, uint64_t in) { return Rotl(acc + in * kP2, 31) * kP1; }
inline uint64_t MergeRound(uint64_t acc, uint64_t v) { return (acc ^ Round(0, v)) * kP1 + kP4; }

constexpr char kMismatchPrefix[] = "model identity: ";

}  // namespace

uint64_t Hash64(const void* data, size_t n, uint64_t seed) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    for (const uint8_t* const limit = end - 32; p <= limit; p += 32) {
      v1 = Round(v1, Read64(p));
      v2 = Round(v2, Read64(p + 8));
      v3 = Round(v3, Read64(p + 16));
      v4 = Round(v4, Read64(p + 24));
    }
    h = Rotl(v1, 1) + Rotl(v2, 7) + Rotl(v3, 12) + Rotl(v4, 18);
    h = MergeRound(MergeRound(MergeRound(MergeRound(h, v1), v2), v3), v4);
  } else {
    h = seed + kP5;
  }
  h += n;
  for (; end - p >= 8; p += 8) h = Rotl(h ^ Round(0, Read64(p)), 27) * kP1 + kP4;
  if (end - p >= 4) {
    h = Rotl(h ^ (uint64_t{Read32(p)} * kP1), 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) h = Rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

std::string IdentityHex(uint64_t digest) {
  return digest == 0 ? std::string("none") : absl::StrFormat("%016x", digest);
}

std::string ModelIdentity::ToString() const {
  return absl::StrCat(IdentityHex(digest), " (", model.empty() ? std::string("model not reported") : model, ")");
}

namespace {

// True iff both report their math and it differs.
bool MathDiffers(const ModelIdentity& a, const ModelIdentity& b) {
  const bool reported = !a.expert_math.empty() && !b.expert_math.empty();
  return reported && (a.expert_math != b.expert_math || a.routing != b.routing);
}

}  // namespace

absl::Status ModelMismatchError(const ModelIdentity& ours, const ModelIdentity& theirs, absl::string_view our_side,
                                absl::string_view their_side) {
  if (MathDiffers(ours, theirs))
    return absl::FailedPreconditionError(absl::StrCat(
        kMismatchPrefix, our_side, " serves ", ours.ToString(), ", ", their_side, " serves ", theirs.ToString(),
        "; their expert math differs: ", our_side, " computes ", ours.expert_math, " with ", ours.routing,
        " routing, ", their_side, " computes ", theirs.expert_math, " with ", theirs.routing,
        " routing (their config.json differ: model_type or swiglu_limit); the experts of two models are never mixed"));
  return absl::FailedPreconditionError(absl::StrCat(
      kMismatchPrefix, our_side, " serves ", ours.ToString(), ", ", their_side, " serves ", theirs.ToString(),
      theirs.digest == 0 ? "; a peer that reports no model identity cannot be checked (an older version?)"
                         : "; the experts of two models are never mixed: give both the same --model"));
}

bool SameModel(const ModelIdentity& ours, const ModelIdentity& theirs) {
  return ours.digest != 0 && ours.digest == theirs.digest && !MathDiffers(ours, theirs);
}

absl::Status CheckSameModel(const ModelIdentity& ours, const ModelIdentity& theirs, absl::string_view our_side,
                            absl::string_view their_side) {
  if (SameModel(ours, theirs)) return absl::OkStatus();
  return ModelMismatchError(ours, theirs, our_side, their_side);
}

bool IsModelMismatch(const absl::Status& st) {
  return absl::IsFailedPrecondition(st) && st.message().find(kMismatchPrefix) != absl::string_view::npos;
}

uint64_t DigestExpertTensors(const std::vector<uint64_t>& header, const std::vector<StoredTensor>& tensors,
                             int threads) {
  // Every chunk of every tensor, hashed independently.
  struct Chunk {
    const std::byte* data;
    size_t bytes;
    int fd;  // -1: hash the mapping
    int64_t offset;
  };
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    first_chunk[t] = chunks.size();
    const StoredTensor& s = tensors[t];
    const int fd = s.offset >= 0 ? s.fd : -1;
    for (size_t off = 0; off < s.nbytes; off += kIdentityChunkBytes)
      chunks.push_back({s.data + off, std::min(kIdentityChunkBytes, s.nbytes - off), fd,
                        s.offset + static_cast<int64_t>(off)});
  }
  first_chunk[tensors.size()] = chunks.size();
  std::vector<uint64_t> digests(chunks.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    std::vector<std::byte> buffer;
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
      const Chunk& c = chunks[i];
      const std::byte* bytes = c.data;
      if (c.fd >= 0) {
        buffer.resize(c.bytes);
        size_t got = 0;
        while (got < c.bytes) {
          const ssize_t n = pread(c.fd, buffer.data() + got, c.bytes - got, c.offset + static_cast<int64_t>(got));
          if (n <= 0) break;
          got += static_cast<size_t>(n);
        }
        if (got == c.bytes) bytes = buffer.data();  // else (a read error): the mapping's bytes, the same ones
      }
      digests[i] = Hash64(bytes, c.bytes);
    }
  };
  size_t total = 0;
  for (const StoredTensor& s : tensors) total += s.nbytes;
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  // Threads only where there is enough to share (a tiny model hashes in microseconds).
  const size_t n = std::min({threads > 0 ? static_cast<size_t>(threads) : hw, chunks.size(),
                             std::max<size_t>(1, total / (size_t{16} << 20))});
  std::vector<std::thread> pool;
  for (size_t i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  // The record: header, then per tensor its dtype, rank, shape, bytes and chunk digests.
  std::vector<uint64_t> record(header);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const StoredTensor& s = tensors[t];
    const char* dtype = DTypeName(s.dtype);
    record.push_back(Hash64(dtype, std::strlen(dtype)));
    record.push_back(s.shape.size());
    for (int64_t d : s.shape) record.push_back(static_cast<uint64_t>(d));
    record.push_back(s.nbytes);
    record.insert(record.end(), digests.begin() + first_chunk[t], digests.begin() + first_chunk[t + 1]);
  }
  const uint64_t h = Hash64(record.data(), record.size() * sizeof(uint64_t));
  return h != 0 ? h : 1;  // 0 means unknown
}

}  // namespace moe
