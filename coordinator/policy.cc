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

absl::Status ParseNumber(const std::string& key, const std::string& value, double* out) {
  double v;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v))
    return absl::InvalidArgumentError(absl::StrCat(key, ": not a number: '", value, "'"));
  *out = v;
  return absl::OkStatus();
}

absl::Status OutOfRange(const char* key, double v, const char* range) {
  std::string flag = key;
  for (char& c : flag)
    if (c == '_') c = '-';
  return absl::InvalidArgumentError(absl::StrCat(key, " (--", flag, "): ", v, " is outside ", range));
}

}  // namespace

absl::Status CoordinatorPolicy::Check() const {
  if (!(half_life_seconds >= 0.01 && half_life_seconds <= 86400))
    return OutOfRange("half_life_seconds", half_life_seconds, "[0.01, 86400]");
  if (!(hysteresis_margin >= 0 && hysteresis_margin <= 1e6))
    return OutOfRange("hysteresis_margin", hysteresis_margin, "[0, 1e6]");
  if (!(copy_cost_hits >= 0 && copy_cost_hits <= 1e12)) return OutOfRange("copy_cost_hits", copy_cost_hits, "[0, 1e12]");
  if (!(replicate_share > 0 && replicate_share <= 1)) return OutOfRange("replicate_share", replicate_share, "(0, 1]");
  if (!std::isfinite(copy_budget_gbps)) return OutOfRange("copy_budget_gbps", copy_budget_gbps, "the finite numbers");
  // A period shorter than 10 ms would rebalance on every loop of the
  // coordinator (1e-300 was accepted): off (<= 0) or [0.01, 86400] s.
  if (rebalance_interval_seconds > 0 && !(rebalance_interval_seconds >= 0.01 && rebalance_interval_seconds <= 86400))
    return OutOfRange("rebalance_interval_seconds", rebalance_interval_seconds, "[0.01, 86400] (or <= 0: off)");
  return absl::OkStatus();
}

absl::Status CoordinatorPolicy::Set(const std::string& key, const std::string& value) {
  CoordinatorPolicy p = *this;
  absl::Status st;
  if (key == "half_life_seconds") {
    st = ParseNumber(key, value, &p.half_life_seconds);
  } else if (key == "placement") {
    st = ParsePlacementMode(value, &p.placement);
  } else if (key == "copy_budget_gbps") {
    st = ParseNumber(key, value, &p.copy_budget_gbps);
  } else if (key == "hysteresis_margin") {
    st = ParseNumber(key, value, &p.hysteresis_margin);
  } else if (key == "copy_cost_hits") {
    st = ParseNumber(key, value, &p.copy_cost_hits);
  } else if (key == "replicate_share") {
    st = ParseNumber(key, value, &p.replicate_share);
  } else if (key == "rebalance_interval_seconds") {
    st = ParseNumber(key, value, &p.rebalance_interval_seconds);
  } else {
    std::string known;
    for (const std::string& k : Keys()) absl::StrAppend(&known, known.empty() ? "" : ", ", k);
    return absl::InvalidArgumentError(absl::StrCat("unknown policy key '", key, "' (known: ", known, ")"));
  }
  if (st.ok()) st = p.Check();
  if (st.ok()) *this = p;
  return st;
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
