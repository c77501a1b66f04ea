#include "bench/model/attention_weights.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace moe {

namespace {

// Which tensor of a layer a generator stream belongs to.
enum class AttentionTensor : uint64_t { kAttnNorm = 1, kWqkv, kWo, kMoeNorm, kRouter };

// n values uniform on (-1, 1) times `scale`, plus `offset`, as bf16: the
// stream of (seed, layer, tensor). Each 64-bit hash gives 4 values of 16 bits;
// u = (2r + 1 - 65536) / 65536 is an odd multiple of 2^-16, never 0.
void FillUniform(uint64_t seed, int layer, AttentionTensor tensor, float scale, float offset,
                 int threads, std::vector<bf16_t>* out, size_t n) {
  out->resize(n);
  const uint64_t key =
      AttentionMix64(AttentionMix64(seed ^ 0x617474656e74696full) ^
                     ((static_cast<uint64_t>(layer) << 8) | static_cast<uint64_t>(tensor)));
  bf16_t* dst = out->data();
  const int64_t blocks = static_cast<int64_t>((n + 3) / 4);
  ParallelFor(blocks, threads, int64_t{1} << 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint64_t r = AttentionMix64(key + static_cast<uint64_t>(b));
      for (size_t i = static_cast<size_t>(b) * 4; i < std::min(n, static_cast<size_t>(b) * 4 + 4);
           ++i, r >>= 16) {
        const float u =
            static_cast<float>(2 * static_cast<int>(r & 0xffff) + 1 - 65536) * (1.0f / 65536.0f);
        dst[i] = F32ToBf16(u * scale + offset);
      }
    }
  });
}

}  // namespace

AttentionLayerWeights GenerateAttentionLayerWeights(const AttentionConfig& c, int layer,
                                                    int threads) {
  AttentionLayerWeights w;
  const size_t H = static_cast<size_t>(c.hidden);
  const size_t qkv_rows = static_cast<size_t>(c.q_dim()) + 2 * static_cast<size_t>(c.kv_dim());
  // Uniform on [-a, a] has std a / sqrt(3): a = sqrt(3 / fan_in) gives std 1/sqrt(fan_in).
  auto amplitude = [](size_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  FillUniform(c.seed, layer, AttentionTensor::kAttnNorm, 0.1f, 1.0f, threads, &w.attn_norm, H);
  FillUniform(c.seed, layer, AttentionTensor::kWqkv, amplitude(H), 0.0f, threads, &w.wqkv,
              qkv_rows * H);
  FillUniform(c.seed, layer, AttentionTensor::kWo, amplitude(c.q_dim()), 0.0f, threads, &w.wo,
              H * c.q_dim());
  FillUniform(c.seed, layer, AttentionTensor::kMoeNorm, 0.1f, 1.0f, threads, &w.moe_norm, H);
  FillUniform(c.seed, layer, AttentionTensor::kRouter, amplitude(H), 0.0f, threads, &w.router,
              static_cast<size_t>(c.num_experts) * H);
  return w;
}

std::vector<float> RopeTable(const AttentionConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<float> table(static_cast<size_t>(c.max_seq) * half * 2);
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(static_cast<double>(c.rope_theta), -2.0 * i / c.head_dim);
    for (int p = 0; p < c.max_seq; ++p) {
      const double angle = p * inv_freq;
      const size_t at = (static_cast<size_t>(p) * half + i) * 2;
      table[at] = static_cast<float>(std::cos(angle));
      table[at + 1] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

void RouterTopK(const float* logits, int num_experts, int k, int32_t* ids, float* weights) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < num_experts; ++e) {
      if (std::find(ids, ids + j, e) != ids + j) continue;
      // Strictly greater: among equal logits the lower id (seen first) wins.
      if (best < 0 || logits[e] > logits[best]) best = e;
    }
    ids[j] = best;
  }
  const float top = logits[ids[0]];
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += (weights[j] = std::exp(logits[ids[j]] - top));
  for (int j = 0; j < k; ++j) weights[j] /= sum;
}

void ParallelFor(int64_t n, int threads, int64_t grain,
                 const std::function<void(int64_t begin, int64_t end)>& fn) {
  if (n <= 0) return;
  const int64_t by_grain = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, by_grain));
  if (parts == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(parts - 1);
  for (int64_t p = 1; p < parts; ++p) {
    pool.emplace_back([&fn, n, parts, p] { fn(n * p / parts, n * (p + 1) / parts); });
  }
  fn(0, n / parts);
  for (std::thread& t : pool) t.join();
}

}  // namespace moe
