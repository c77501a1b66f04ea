// Routing helpers: the router's choice of experts from its logits
// (SelectExperts, in the family's RoutingMode), validation of (token, expert,
// weight) pairs and grouping of pairs by expert, the first step of every MoE
// backend. Validation never
// trusts its input; grouping assumes validated input and reuses the capacity
// of its output, so steady-state calls do not allocate.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moe {

// How a family's router turns the logits of all experts into k (expert,
// weight) pairs per token.
enum class RoutingMode : uint8_t {
  kSoftmaxTopK,  // softmax over all experts, the k largest probabilities (Qwen, Mixtral, OLMoE),
                 // renormalized to sum 1 when asked (Mixtral, Qwen3's norm_topk_prob)
  kTopKSoftmax,  // the k largest logits, softmax over those k (GPT-OSS's GptOssTopKRouter)
};
// "softmax_topk", "topk_softmax".
const char* RoutingModeName(RoutingMode mode);

// For each of n tokens, the k experts with the largest logits[t, :] (E of
// them; ties: the lower id first), in descending order, and their weights as
// `mode` says, into ids[t*k + j] and weights[t*k + j]. renormalize applies to
// kSoftmaxTopK only (kTopKSoftmax's weights already sum to 1). Requires
// 1 <= k <= E. Computed in double, weights stored as float.
void SelectExperts(const float* logits, int n, int num_experts, int k, RoutingMode mode, bool renormalize,
                   int32_t* ids, float* weights);

// Routing of n tokens with up to k pairs each: ids[t*k+j] is an expert or -1
// (unused slot), weights[t*k+j] its routing weight.
struct RoutingView {
  int n = 0;
  int k = 0;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
};

// InvalidArgument naming the field (expert_ids[t,j] / expert_weights[t,j], or
// the caller's field names, e.g. a proto's batches[0].topk_ids) when an id is
// outside [0, num_experts) or not hosted, repeats within a token, or a used
// pair's weight is NaN/Inf. `hosted` may be empty (all hosted).
absl::Status ValidateRouting(const RoutingView& r, int num_experts,
                             const std::function<bool(int)>& hosted,
                             absl::string_view ids_field = "expert_ids",
                             absl::string_view weights_field = "expert_weights");

// Pairs grouped by expert, experts in ascending order. Group g owns rows
// [row_begin[g], row_begin[g] + count[g]); row_begin is a multiple of the
// requested alignment and rows between groups are padding (token -1, weight 0).
struct ExpertGroups {
  std::vector<int32_t> expert;
  std::vector<int32_t> row_begin;
  std::vector<int32_t> count;
  std::vector<int32_t> token;   // per row
  std::vector<float> weight;    // per row
  int32_t total_rows = 0;
  int32_t total_pairs = 0;
  std::vector<int32_t> scratch;  // per-expert counters, reused

  int num_groups() const { return static_cast<int>(expert.size()); }
};

void GroupByExpert(const RoutingView& r, int num_experts, int row_align, ExpertGroups* out);

}  // namespace moe
