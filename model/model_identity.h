// ModelIdentity: which model's experts a process computes with, as a 64-bit
// digest of their content, so that two processes that are to add up one MoE
// layer (a GPU worker's cached hits and its CPU expert servers' misses) can
// tell whether they hold the same model before they do. Every expert server
// and worker derives it at load (ModelSource::Identity) and exchanges it in
// every handshake: gRPC GetInfo and every ForwardRequest, the shared-memory
// hello and its reply, coordinator registration. A mismatch is refused with
// ModelMismatchError, which names both identities and both models.
//
// What the digest covers (ModelSource::Identity):
//   checkpoint  the stored bytes of every routed expert tensor of every MoE
//               layer (weights, and an fp8/int4 checkpoint's scales and
//               shapes) with each tensor's dtype and shape, in (layer,
//               expert, projection) order, and the geometry (H, I, E, the MoE
//               layers). Not the names, the sharding or config.json: a copy or
//               a re-sharded checkpoint is the same model; a fine-tune, another
//               seed, a requantization or another file dtype is another.
//   gguf        the stored bytes of each MoE layer's three expert tensors
//               (blk.{l}.ffn_{gate,up,down}_exps.weight: all its experts'
//               blocks, as the file holds them) with their ggml types and
//               dims, and the geometry. Not the metadata nor the other
//               tensors. The same weights as safetensors are another form.
//   synthetic   the definition its weights are a pure function of: the
//               generator, the seed, the geometry and the quantization
//               (synthetic:tiny and synthetic:tiny:layers=3 are one model).
//               moe-make-model's checkpoint of it holds the same values but is
//               another form (stored bytes): give both sides the same --model.
//   a slice     the whole model's: the slice is checked on its own.
// The serving precision (--weight-dtype) is not part of it: a server packing
// int8 and a worker caching bf16 of one checkpoint have one identity.
//
// Hash64 is XXH64 (a published, unsalted algorithm: the same bytes give the
// same value in every process and on every machine, unlike absl::Hash, which
// is salted per process). It is no cryptographic hash: it tells apart models
// that differ by accident, not ones forged to collide (a peer that lies about
// its identity is out of its reach; SECURITY.md). Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace moe {

// XXH64 of `n` bytes at `data` with `seed`.
uint64_t Hash64(const void* data, size_t n, uint64_t seed = 0);

// What a process serves: the digest, the model as it was given (--model: a
// checkpoint directory, a GGUF file or a synthetic: URI), for messages, and
// what its experts compute: the expert math (ExpertMathName,
// model/model_spec.h) and the router's mode (RoutingModeName). The math comes
// from config.json (model_type, swiglu_limit), which a checkpoint's digest
// does not cover: two copies of one checkpoint whose configs disagree have
// one digest and compute different layers, so the math is compared beside it.
struct ModelIdentity {
  ModelIdentity() = default;
  ModelIdentity(uint64_t digest, std::string model, std::string expert_math = "", std::string routing = "")
      : digest(digest), model(std::move(model)), expert_math(std::move(expert_math)), routing(std::move(routing)) {}

  uint64_t digest = 0;  // 0: unknown (a peer that reports none)
  std::string model;
  std::string expert_math;  // "" : not reported (not compared)
  std::string routing;      // "" : not reported (not compared)
  // "0123456789abcdef (MODEL)"; "none (MODEL)" when unknown.
  std::string ToString() const;
};

// 16 lowercase hex digits; "none" for 0.
std::string IdentityHex(uint64_t digest);

// True iff `theirs` is `ours`' model: equal digests, both known, and the same
// expert math and routing where both report them.
bool SameModel(const ModelIdentity& ours, const ModelIdentity& theirs);
// OK when SameModel; otherwise FailedPrecondition "model identity: <our_side>
// serves D1 (M1), <their_side> serves D2 (M2); ..." — naming both sides'
// expert math and routing when those differ ("... computes
// clamped_swiglu(alpha=1.702, limit=7)+bias with topk_softmax routing, ...")
// — a peer that reports no digest is refused too, as a peer whose model
// cannot be checked. `our_side` / `their_side` name the two ends ("this
// worker", "the expert server on unix:///run/s.sock").
absl::Status CheckSameModel(const ModelIdentity& ours, const ModelIdentity& theirs, absl::string_view our_side,
                            absl::string_view their_side);
// The FailedPrecondition above, for a caller that already knows they differ.
absl::Status ModelMismatchError(const ModelIdentity& ours, const ModelIdentity& theirs, absl::string_view our_side,
                                absl::string_view their_side);
// True iff `st` is a ModelMismatchError (any side's).
bool IsModelMismatch(const absl::Status& st);

// One expert tensor as its checkpoint stores it, for DigestExpertTensors:
// its bytes at `data` (a mapping), also at `offset` of the open file `fd` when
// fd >= 0 — read(2) from there (a page-cached file reads ~4x faster than a
// fresh mapping faults in, measured on the 2-core VM), the mapping when the
// read fails.
struct StoredTensor {
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  int fd = -1;
  int64_t offset = -1;
};

// The digest of a model whose experts are `tensors` (in the order above) of
// the geometry `header` (H, I, E, MoE layers ...): each tensor's bytes are
// hashed in chunks of kIdentityChunkBytes on up to `threads` threads (0: one
// per core), so the value does not depend on the thread count nor on how the
// bytes were read.
inline constexpr size_t kIdentityChunkBytes = size_t{4} << 20;
uint64_t DigestExpertTensors(const std::vector<uint64_t>& header, const std::vector<StoredTensor>& tensors,
                             int threads = 0);

}  // namespace moe
