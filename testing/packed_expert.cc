#include "testing/packed_expert.h"

#include <cstdlib>
#include <vector>

#include "model/synthetic_model.h"

namespace moe {

PackedExpert MakePackedExpert(int hidden, int intermediate, WeightFormat format, uint64_t seed, int id,
                              bool biases, int group) {
  const size_t ih = static_cast<size_t>(intermediate) * hidden;
  std::vector<bf16_t> w(3 * ih);
  GenerateExpertMatrix(seed, 0, id, Projection::kGate, intermediate, hidden, w.data());
  GenerateExpertMatrix(seed, 0, id, Projection::kUp, intermediate, hidden, w.data() + ih);
  GenerateExpertMatrix(seed, 0, id, Projection::kDown, hidden, intermediate, w.data() + 2 * ih);
  // The activation does not change the packed bytes; the biases do.
  const ExpertGeometry g = ExpertGeometry::For(hidden, intermediate, format, group).WithExpertMath({}, biases);
  std::vector<bf16_t> b(biases ? 2 * static_cast<size_t>(intermediate) + hidden : 0);
  if (biases) {
    GenerateExpertBias(seed, 0, id, Projection::kGate, intermediate, b.data());
    GenerateExpertBias(seed, 0, id, Projection::kUp, intermediate, b.data() + intermediate);
    GenerateExpertBias(seed, 0, id, Projection::kDown, hidden, b.data() + 2 * intermediate);
  }
  PackedExpert p;
  p.size = g.packed_bytes();
  p.bytes.reset(static_cast<std::byte*>(std::aligned_alloc(64, (p.size + 63) / 64 * 64)), std::free);
  PackExpert(g, w.data(), w.data() + ih, w.data() + 2 * ih, p.bytes.get(), biases ? b.data() : nullptr,
             biases ? b.data() + intermediate : nullptr, biases ? b.data() + 2 * intermediate : nullptr);
  return p;
}

}  // namespace moe
