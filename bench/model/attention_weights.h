// The numbers of the demo attention model (attention.h), defined once and
// shared by every implementation (cpu, cuda) and the reference, so all of them
// compute on identical data: the seeded weights of a layer, the RoPE table,
// the K/V values PrefillCache writes, and the router's top-k rule. Also the
// small parallel-for the host code uses.
//
// Pure functions of their arguments; safe from any thread. PrefillKvValue is
// also callable from CUDA device code.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/bf16.h"
#include "core/host_device.h"
#include "bench/model/attention.h"

namespace moe {

// Host copies of one layer's weights, bf16 row-major (y = W x for W [N, K]).
struct AttentionLayerWeights {
  std::vector<bf16_t> attn_norm;  // g1 [H]
  std::vector<bf16_t> wqkv;       // [q_dim + 2 * kv_dim, H]: Wq rows, then Wk rows, then Wv rows
  std::vector<bf16_t> wo;         // [H, q_dim]
  std::vector<bf16_t> moe_norm;   // g2 [H]
  std::vector<bf16_t> router;     // Wr [E, H]
};

// Layer `layer`'s weights for config.seed. Matrices are uniform with std
// 1/sqrt(fan_in), so every projection of an O(1) input is O(1); norm gains
// are uniform in [0.9, 1.1]. No value is zero. `threads` > 0 threads work on
// it (the caller's included).
AttentionLayerWeights GenerateAttentionLayerWeights(const AttentionConfig& config, int layer,
                                                    int threads);

// RoPE rotation of position p, pair i (dims i and i + head_dim/2) by angle
// p * rope_theta^(-2i/head_dim), computed in double: cos at
// [(p * head_dim/2 + i) * 2], sin right after it. [max_seq, head_dim/2, 2] f32.
std::vector<float> RopeTable(const AttentionConfig& config);

// SplitMix64's finalizer (a bijective 64-bit mix).
MOE_HOST_DEVICE inline uint64_t AttentionMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The value PrefillCache writes at dim d of the key (which == 0) or value
// (which == 1) of kv head `kv_head`, position `pos`, sequence slot `seq`,
// layer `layer`: an odd multiple of 1/64 in [-127/64, 127/64], uniform
// (std 1.15, never zero), exactly representable in bf16 so every
// implementation stores the same bits. Independent of max_seq and max_batch.
MOE_HOST_DEVICE inline float PrefillKvValue(uint64_t seed, int layer, int which, int seq,
                                            int kv_head, int pos, int d) {
  uint64_t x = AttentionMix64(seed ^ 0x6b76636163686521ull);
  x = AttentionMix64(x ^ ((static_cast<uint64_t>(layer) << 1) | static_cast<uint64_t>(which)));
  x = AttentionMix64(x ^ static_cast<uint64_t>(seq));
  x = AttentionMix64(x ^ ((static_cast<uint64_t>(kv_head) << 32) | static_cast<uint32_t>(pos)));
  const uint64_t r = AttentionMix64(x + static_cast<uint64_t>(d / 8)) >> (8 * (d % 8));
  return static_cast<float>(2 * static_cast<int>(r & 0x7f) - 127) * (1.0f / 64.0f);
}

// The router's rule: ids[0..k) = the k largest logits in descending order
// (ties: lower id first), weights[j] = softmax over those k (= the full
// softmax's top-k renormalised). The cuda kernel implements the same rule.
void RouterTopK(const float* logits, int num_experts, int k, int32_t* ids, float* weights);

// Runs fn(begin, end) over contiguous ranges covering [0, n), on at most
// `threads` threads and no more than one per `grain` items (the caller runs
// the first range); returns when all are done.
void ParallelFor(int64_t n, int threads, int64_t grain,
                 const std::function<void(int64_t begin, int64_t end)>& fn);

}  // namespace moe
