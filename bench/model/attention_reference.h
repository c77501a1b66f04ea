// ReferenceAttention: the correctness oracle of AttentionStep. The same model
// (attention.h) on the same weights and prefill values (attention_weights.h),
// written as plain double-precision loops, one token and one head at a time,
// with RoPE angles and the router's softmax / top-k computed here in double
// rather than taken from the shared f32 helpers.
//
// It rounds to bf16 exactly where the implementations store bf16 (a =
// RMSNorm(h), the K/V cache, the attention output o, h, the MoE input x), so
// what remains between it and an implementation is f32-versus-double
// arithmetic. That keeps comparisons sharp: e.g. router logits agree to about
// 1e-5, so a top-k difference means a bug unless the reference's logits are a
// near-tie.
//
// Host memory only. Slow (tests only). Thread-safety: none; one thread drives it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "bench/model/attention.h"
#include "bench/model/attention_weights.h"

namespace moe {

class ReferenceAttention {
 public:
  // `config` must be valid (AttentionConfig::Validate). Generates every layer's weights.
  explicit ReferenceAttention(const AttentionConfig& config);

  // Same contract and contents as AttentionStep::PrefillCache.
  absl::Status PrefillCache(int T, int len);

  struct Result {
    std::vector<double> h;             // [T, H] after the residual (bf16 values)
    std::vector<double> moe_in;        // [T, H] the MoE input x (bf16 values)
    std::vector<double> logits;        // [T, E] router logits
    std::vector<int32_t> topk_ids;     // [T, k] descending, ties: lower id first
    std::vector<double> topk_weights;  // [T, k] softmax over the k
  };
  // One decode step of `layer`, as AttentionStep::Run, from host hidden
  // states `h` [T, H]; writes this object's own KV cache at pos[t].
  // InvalidArgument on out-of-range layer, T or pos.
  absl::Status Run(int layer, int T, const int32_t* pos, const bf16_t* h, Result* out);

 private:
  size_t KvIndex(int layer, int seq, int kv_head, int pos) const;

  AttentionConfig config_;
  std::vector<AttentionLayerWeights> layers_;
  std::vector<double> k_cache_, v_cache_;  // [layer][seq][kv_head][pos][head_dim], bf16 values
};

}  // namespace moe
