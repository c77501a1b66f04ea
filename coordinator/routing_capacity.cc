#include "coordinator/routing_capacity.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<RoutingDemand> CheckCounts(const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts,
                                          int num_layers, const std::vector<bool>& cached,
                                          const RoutingCapacity& capacity) {
  const uint32_t nl = static_cast<uint32_t>(num_layers), ne = static_cast<uint32_t>(capacity.num_experts);
  const double tokens = capacity.tokens_per_second;
  const double pairs_rate = tokens * capacity.top_k;
  RoutingDemand worst;
  auto demand = [&worst](const std::string& field, double amount, double per_second, const char* what) {
    const double seconds = amount / per_second;
    if (seconds > worst.seconds) worst = {seconds, field, amount, per_second, what};
  };
  std::vector<bool> seen_layer(nl, false);
  std::vector<int> listed_by(ne, -1);  // the counts entry that last listed the expert
  double bytes = 0, link_us = 0;       // one set of links for every layer
  for (int i = 0; i < counts.size(); ++i) {
    const moe::v1::LayerCounts& c = counts[i];
    const std::string field = absl::StrCat("counts[", i, "]");
    if (c.layer() >= nl)
      return absl::InvalidArgumentError(absl::StrCat(field, ".layer: ", c.layer(), " out of range [0, ", nl, ")"));
    if (c.layer() >= cached.size() || !cached[c.layer()])
      return absl::InvalidArgumentError(absl::StrCat(field, ".layer: ", c.layer(),
                                                     " is not an MoE layer this worker caches (its cached_layers)"));
    if (seen_layer[c.layer()])
      return absl::InvalidArgumentError(absl::StrCat(field, ".layer: ", c.layer(), " listed twice"));
    seen_layer[c.layer()] = true;
    if (c.pairs_size() != c.experts_size())
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".pairs: ", c.pairs_size(), " entries for ", c.experts_size(), " experts"));
    if (c.hits_size() != 0 && c.hits_size() != c.experts_size())
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".hits: ", c.hits_size(), " entries for ", c.experts_size(), " experts"));
    if (c.predicted_used() > c.predicted())
      return absl::InvalidArgumentError(absl::StrCat(field, ".predicted_used: ", c.predicted_used(),
                                                     " exceeds predicted ", c.predicted()));
    double layer_pairs = 0;
    for (int j = 0; j < c.experts_size(); ++j) {
      const uint32_t e = c.experts(j);
      if (e >= ne)
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".experts[", j, "]: ", e, " out of range [0, ", ne, ")"));
      if (listed_by[e] == i)
        return absl::InvalidArgumentError(absl::StrCat(field, ".experts[", j, "]: ", e, " listed twice"));
      listed_by[e] = i;
      if (c.hits_size() != 0 && c.hits(j) > c.pairs(j))
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".hits[", j, "]: ", c.hits(j), " exceeds pairs ", c.pairs(j)));
      const double pairs = static_cast<double>(c.pairs(j));
      layer_pairs += pairs;
      // A token is routed to an expert at most once.
      demand(absl::StrCat(field, ".pairs[", j, "]"), pairs, tokens, "pairs of one expert");
    }
    demand(field + ".pairs", layer_pairs, pairs_rate, "pairs in the layer");
    demand(field + ".cpu_pairs", static_cast<double>(c.cpu_pairs()), pairs_rate, "pairs computed on CPU servers");
    demand(field + ".copied_pairs", static_cast<double>(c.copied_pairs()), pairs_rate, "pairs copied to the GPU");
    demand(field + ".prefetched_pairs", static_cast<double>(c.prefetched_pairs()), pairs_rate, "pairs prefetched");
    demand(field + ".cache_copies", static_cast<double>(c.cache_copies()), pairs_rate, "cache copies");
    demand(field + ".predicted", static_cast<double>(c.predicted()), tokens * capacity.num_experts,
           "predicted experts");
    bytes += static_cast<double>(c.copy_bytes());
    link_us += static_cast<double>(c.link_microseconds());
  }
  demand("counts[*].copy_bytes", bytes, kMaxCopyBytesPerSecond, "bytes copied host->GPU");
  demand("counts[*].link_microseconds", link_us, kMaxLinksPerWorker * 1e6, "microseconds of link time");
  return worst;
}

}  // namespace moe
