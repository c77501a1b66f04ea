#include "model/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {

const char* RoutingModeName(RoutingMode mode) {
  return mode == RoutingMode::kTopKSoftmax ? "topk_softmax" : "softmax_topk";
}

void SelectExperts(const float* logits, int n, int num_experts, int k, RoutingMode mode, bool renormalize,
                   int32_t* ids, float* weights) {
  std::vector<int> order(num_experts);
  std::vector<double> p(num_experts);
  for (int t = 0; t < n; ++t) {
    const float* l = logits + static_cast<size_t>(t) * num_experts;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    // Softmax over all experts (kSoftmaxTopK) or over the chosen k: exp(l - max) / sum.
    const int over = mode == RoutingMode::kTopKSoftmax ? k : num_experts;
    const double top = l[order[0]];
    double sum = 0;
    for (int j = 0; j < over; ++j) sum += p[j] = std::exp(static_cast<double>(l[order[j]]) - top);
    double kept = 0;
    for (int j = 0; j < k; ++j) kept += p[j];
    const double den = mode == RoutingMode::kSoftmaxTopK && !renormalize ? sum : kept;
    for (int j = 0; j < k; ++j) {
      ids[static_cast<size_t>(t) * k + j] = order[j];
      weights[static_cast<size_t>(t) * k + j] = static_cast<float>(p[j] / den);
    }
  }
}

absl::Status ValidateRouting(const RoutingView& r, int num_experts,
                             const std::function<bool(int)>& hosted, absl::string_view ids_field,
                             absl::string_view weights_field) {
  for (int t = 0; t < r.n; ++t) {
    const int32_t* ids = r.ids + static_cast<size_t>(t) * r.k;
    const float* w = r.weights + static_cast<size_t>(t) * r.k;
    for (int j = 0; j < r.k; ++j) {
      const int32_t e = ids[j];
      if (e == -1) continue;
      if (e < 0 || e >= num_experts)
        return absl::InvalidArgumentError(absl::StrCat(ids_field, "[", t, ",", j, "]: expert ", e,
                                                       " out of range [0, ", num_experts, ")"));
      if (hosted && !hosted(e))
        return absl::InvalidArgumentError(
            absl::StrCat(ids_field, "[", t, ",", j, "]: expert ", e, " is not hosted by this server"));
      for (int i = 0; i < j; ++i) {
        if (ids[i] == e)
          return absl::InvalidArgumentError(absl::StrCat(ids_field, "[", t, ",", j, "]: expert ", e,
                                                         " repeats ", ids_field, "[", t, ",", i, "]"));
      }
      if (!std::isfinite(w[j]))
        return absl::InvalidArgumentError(
            absl::StrCat(weights_field, "[", t, ",", j, "]: weight is not finite"));
    }
  }
  return absl::OkStatus();
}

void GroupByExpert(const RoutingView& r, int num_experts, int row_align, ExpertGroups* out) {
  std::vector<int32_t>& cnt = out->scratch;
  cnt.assign(num_experts, 0);
  int32_t pairs = 0;
  for (size_t i = 0, n = static_cast<size_t>(r.n) * r.k; i < n; ++i) {
    if (r.ids[i] >= 0) {
      ++cnt[r.ids[i]];
      ++pairs;
    }
  }
  out->expert.clear();
  out->row_begin.clear();
  out->count.clear();
  int32_t rows = 0;
  for (int e = 0; e < num_experts; ++e) {
    if (cnt[e] == 0) continue;
    out->expert.push_back(e);
    out->row_begin.push_back(rows);
    out->count.push_back(cnt[e]);
    rows += (cnt[e] + row_align - 1) / row_align * row_align;
  }
  out->total_rows = rows;
  out->total_pairs = pairs;
  out->token.assign(rows, -1);
  out->weight.assign(rows, 0.0f);
  // Reuse cnt as the next free row of each expert.
  for (int g = 0; g < out->num_groups(); ++g) cnt[out->expert[g]] = out->row_begin[g];
  for (int t = 0; t < r.n; ++t) {
    for (int j = 0; j < r.k; ++j) {
      const size_t i = static_cast<size_t>(t) * r.k + j;
      const int32_t e = r.ids[i];
      if (e < 0) continue;
      const int32_t row = cnt[e]++;
      out->token[row] = t;
      out->weight[row] = r.weights[i];
    }
  }
}

}  // namespace moe
