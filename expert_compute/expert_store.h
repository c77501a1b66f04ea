// ExpertStore: the packed weights of the experts this server hosts, resident
// in memory bound to its NUMA node. Built once at start (packing in parallel on
// the compute pool); read-only afterwards, so lookups are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_source.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/numa_binding.h"

namespace moe {

// Which MoE layers and experts a server hosts (the same experts in every layer).
struct HostedSet {
  std::vector<int> layers;   // ascending MoE layer indexes
  std::vector<int> experts;  // ascending expert ids
};

// Packed expert weights as MoeExecutor reads them: (layer, expert) -> packed
// bytes (PackExpert layout). Implemented by the server's ExpertStore and by the
// GPU worker's cpu backend (its cache buffers). Lookups are thread-safe.
class PackedExperts {
 public:
  virtual ~PackedExperts() = default;
  virtual const ExpertGeometry& geometry() const = 0;
  // Packed weights of (layer, expert), or nullptr when not hosted.
  virtual const std::byte* Find(int layer, int expert) const = 0;
  virtual bool HostsLayer(int layer) const = 0;
  virtual bool HostsExpert(int expert) const = 0;
  virtual int num_experts() const = 0;
};

// The packed geometry a server stores `spec`'s experts in, from
// --weight-dtype: "bf16", "int8", "int4", "fp8", "mxfp4" or "auto" (the
// checkpoint's precision class: an MXFP4 checkpoint (safetensors, or a GGUF
// whose experts are all MXFP4) -> mxfp4, 4.25 bits per weight, its values
// exact; an fp8 checkpoint -> fp8, its own codes and block scales,
// exact (int8 when its blocks are not a multiple of 64 columns wide:
// requantizing fp8 to per-channel int8 misses the 1e-2 bound, 1.14e-2 on
// DeepSeek-V3-shaped experts, though it decodes ~1.4x faster on the CPU; ask
// for int8 to trade that accuracy for speed); an int4 one -> int4 with its
// group size when a multiple of 64, else 128; a GGUF's block-quantized
// experts (Q8_0, Q6_K, Q4_K) -> int8, per-channel scales: a re-quantization
// of their per-32 / per-16 block scales, ~0.8e-2 relative error; Q4_K too,
// as int4's symmetric groups of >= 64 cannot hold its asymmetric sub-blocks
// of 32 (0.12 as int4: ask --weight-dtype int4 to trade that for memory);
// anything else -> bf16). fp8
// keeps an fp8 checkpoint's codes and block scales as they are (scale groups
// = its block columns); other checkpoints are quantized to fp8 per channel
// and 128 columns. mxfp4 quantizes any other checkpoint per 32 columns with
// the OCP scale (model/quantization.h Mxfp4ScaleFor), round to nearest.
// InvalidArgument naming --weight-dtype for other values.
absl::StatusOr<ExpertGeometry> StorageGeometry(const ModelSpec& spec, std::string_view weight_dtype);
// The check StorageGeometry makes of the name alone (for flag parsing, before
// the model is open).
absl::Status CheckWeightDtype(std::string_view weight_dtype);

// How a server's packed store is described to a same-host GPU worker that
// maps it (one host copy of the model): its geometry and table. Expert
// (layers[i], experts[j]) sits at byte (i * experts.size() + j) * stride.
struct SharedStoreInfo {
  ExpertGeometry geometry;
  uint64_t stride = 0;
  std::vector<int> layers, experts;
  // The expert's offset in the store, or -1 when it is not in it.
  int64_t Offset(int layer, int expert) const;
};
// Checks a description received from a server against the model (`spec`)
// and the size of the memory that came with it: the geometry is recomputed,
// never trusted; layers and experts must be in range and ascending; the table
// must fit in `store_bytes`. InvalidArgument naming the field otherwise.
absl::StatusOr<SharedStoreInfo> ParseSharedStoreInfo(std::string_view blob, const ModelSpec& spec,
                                                     uint64_t store_bytes);

class ExpertStore : public PackedExperts {
 public:
  // Bytes the packed weights of `hosted` occupy.
  static uint64_t BytesNeeded(const ExpertGeometry& g, const HostedSet& hosted);

  // Checks that the packed weights (in `geometry`'s format, see
  // StorageGeometry) fit in available memory (refusing with the bytes needed
  // and available otherwise), then reads and packs every hosted expert. Any
  // weight error (NaN/Inf, wrong shape, missing tensor) fails the load.
  // `shareable`: the store lives in a memfd, sealed read-only once packed,
  // that shared_fd() hands to same-host GPU workers (SharedInfo() says
  // what is where).
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Load(const ModelSource& source,
                                                          const ExpertGeometry& geometry, HostedSet hosted,
                                                          const NumaBinding& numa,
                                                          ComputePool& pool, bool shareable = false);
  ~ExpertStore() override;

  const ExpertGeometry& geometry() const override { return geometry_; }
  const HostedSet& hosted() const { return hosted_; }
  // Packed weights of (layer, expert), or nullptr when not hosted.
  const std::byte* Find(int layer, int expert) const override;
  bool HostsLayer(int layer) const override;
  bool HostsExpert(int expert) const override;
  uint64_t resident_bytes() const { return bytes_; }
  // The whole store: resident_bytes() from here (what a GPU worker pins).
  std::byte* data() const { return base_; }
  int num_experts() const override { return num_experts_; }
  // The sealed memfd of a shareable store (-1 otherwise) and its description.
  int shared_fd() const { return fd_; }
  std::string SharedInfo() const;

 private:
  ExpertStore() = default;
  const NumaBinding* numa_ = nullptr;
  ExpertGeometry geometry_;
  HostedSet hosted_;
  int num_layers_ = 0, num_experts_ = 0;
  std::vector<int> layer_slot_;   // model layer -> index into hosted_.layers, or -1
  std::vector<int> expert_slot_;  // expert id -> index into hosted_.experts, or -1
  std::byte* base_ = nullptr;
  uint64_t bytes_ = 0;
  size_t stride_ = 0;             // bytes per packed expert (64-aligned)
  int fd_ = -1;                   // shareable: the memfd the store lives in
};

}  // namespace moe
