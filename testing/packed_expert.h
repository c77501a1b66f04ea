// A synthetic expert packed as the CPU kernels, the host copy and the GPU
// cache take it: for the backend tests and the GPU kernel benchmark.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "expert_compute/expert_kernel.h"

namespace moe {

struct PackedExpert {
  std::shared_ptr<std::byte> bytes;  // 64-byte aligned, size rounded up to 64
  size_t size = 0;                   // ExpertGeometry::packed_bytes()
  const std::byte* data() const { return bytes.get(); }
};

// Expert `id` of layer 0 with GenerateExpertMatrix's weights for `seed`
// (gate [I,H], up [I,H], down [H,I]), packed in `format`; with `biases`,
// GenerateExpertBias's gate [I], up [I] and down [H] biases after them
// (ExpertGeometry::WithExpertMath(..., true): a GPT-OSS expert). `group`:
// int4's and fp8's scale group (0: the format's default).
PackedExpert MakePackedExpert(int hidden, int intermediate, WeightFormat format, uint64_t seed, int id,
                              bool biases = false, int group = 0);

}  // namespace moe
