#include "coordinator/policy.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace moe {

absl::Status ParsePlacementMode(const std::string& text, PlacementMode* out) {
  if (text == "per-worker") {
    *out = PlacementMode::kPerWorker;
  } else if (text == "union") {
    *out = PlacementMode::kUnion;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("placement: '", text, "' (expected per-worker or union)"));
  }
  return absl::OkStatus();
}

const char* PlacementModeName(PlacementMode mode) {
  return mode == PlacementMode::kUnion ? "union" : "per-worker";
}

const std::vector<std::string>& CoordinatorPolicy::Keys() {
  static const std::vector<std::string> keys = {
      "half_life_seconds", "placement",      "copy_budget_gbps",          "hysteresis_margin",
      "copy_cost_hits",    "replicate_share", "rebalance_interval_seconds"};
  return keys;
}

namespace {

absl::Status ParseNumber(const std::string& key, const std::string& value, double lo, bool lo_open, double* out) {
  double v;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v))
    return absl::InvalidArgumentError(absl::StrCat(key, ": not a number: '", value, "'"));
  if (lo_open ? !(v > lo) : !(v >= lo))
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", value, " must be ", lo_open ? "> " : ">= ", lo));
  *out = v;
  return absl::OkStatus();
}

}  // namespace

absl::Status CoordinatorPolicy::Set(const std::string& key, const std::string& value) {
  constexpr double kAny = -1e300;
  if (key == "half_life_seconds") return ParseNumber(key, value, 0, true, &half_life_seconds);
  if (key == "placement") return ParsePlacementMode(value, &placement);
  if (key == "copy_budget_gbps") return ParseNumber(key, value, kAny, false, &copy_budget_gbps);
  if (key == "hysteresis_margin") return ParseNumber(key, value, 0, false, &hysteresis_margin);
  if (key == "copy_cost_hits") return ParseNumber(key, value, 0, false, &copy_cost_hits);
  if (key == "replicate_share") return ParseNumber(key, value, 0, true, &replicate_share);
  if (key == "rebalance_interval_seconds") return ParseNumber(key, value, kAny, false, &rebalance_interval_seconds);
  std::string known;
  for (const std::string& k : Keys()) absl::StrAppend(&known, known.empty() ? "" : ", ", k);
  return absl::InvalidArgumentError(absl::StrCat("unknown policy key '", key, "' (known: ", known, ")"));
}

std::map<std::string, std::string> CoordinatorPolicy::ToMap() const {
  return {{"half_life_seconds", absl::StrCat(half_life_seconds)},
          {"placement", PlacementModeName(placement)},
          {"copy_budget_gbps", absl::StrCat(copy_budget_gbps)},
          {"hysteresis_margin", absl::StrCat(hysteresis_margin)},
          {"copy_cost_hits", absl::StrCat(copy_cost_hits)},
          {"replicate_share", absl::StrCat(replicate_share)},
          {"rebalance_interval_seconds", absl::StrCat(rebalance_interval_seconds)}};
}

}  // namespace moe
