#include "gpu_worker/expert_predictor.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

// Time constants in runs of a layer: generic, not fitted to any trace.
constexpr double kFastHalfLife = 4;    // recent-use frequency
constexpr double kSlowHalfLife = 64;   // long-run frequency
constexpr double kFitHalfLife = 64;    // the linear model forgets older runs
constexpr double kRidge = 1.0;         // pull towards the prior weights (in runs' worth of one expert)
constexpr float kTransitionCap = 4096; // a transition row is halved past this many tokens (drift)
// Prior weights: bias, cross (lag), cross (lag+1), last run, fast, slow.
constexpr double kPrior[6] = {0.0, 0.4, 0.1, 0.3, 0.1, 0.1};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertPredictor>> ExpertPredictor::Create(const ExpertPredictorConfig& c) {
  if (c.layers.empty() || c.num_experts <= 0)
    return absl::InvalidArgumentError("expert predictor: layers and num_experts must be non-empty / > 0");
  for (size_t i = 0; i < c.layers.size(); ++i)
    if (c.layers[i] < 0 || (i > 0 && c.layers[i] <= c.layers[i - 1]))
      return absl::InvalidArgumentError("expert predictor: layers must be ascending and >= 0");
  return std::unique_ptr<ExpertPredictor>(new ExpertPredictor(c));
}

ExpertPredictor::ExpertPredictor(const ExpertPredictorConfig& c)
    : config_(c), n_(static_cast<int>(c.layers.size())), e_(c.num_experts) {
  pos_.assign(c.layers.back() + 1, -1);
  for (int i = 0; i < n_; ++i) pos_[c.layers[i]] = i;
  trans_.assign(static_cast<size_t>(kMaxLag) * n_ * e_ * e_, 0.0f);
  from_.assign(static_cast<size_t>(kMaxLag) * n_ * e_, 0.0f);
  state_.resize(n_);
  quality_.resize(n_);
  for (LayerState& s : state_) {
    s.last.assign(e_, 0.0f);
    s.fast.assign(e_, 0.0f);
    s.slow.assign(e_, 0.0f);
    s.features.assign(kMaxLag, std::vector<double>(static_cast<size_t>(e_) * kFeatures, 0.0));
    s.prob.assign(kMaxLag, std::vector<double>(e_, 0.0));
    s.pairs = s.prob;
    s.valid.assign(kMaxLag, false);
    s.fit.resize(kMaxLag);
    for (Fit& f : s.fit) {
      f.a.assign(kFeatures * kFeatures, 0.0);
      f.b.assign(kFeatures, 0.0);
      f.w.assign(kPrior, kPrior + kFeatures);
    }
    s.hinted.assign(e_, false);
  }
}

int ExpertPredictor::LayerAfter(int layer, int lag) const {
  return config_.layers[(pos_[layer] + lag) % n_];
}

void ExpertPredictor::Solve(Fit& f) {
  // (A + ridge I) w = b + ridge prior, by Gaussian elimination with pivoting.
  double m[kFeatures][kFeatures + 1];
  for (int i = 0; i < kFeatures; ++i) {
    for (int j = 0; j < kFeatures; ++j) m[i][j] = f.a[i * kFeatures + j] + (i == j ? kRidge : 0.0);
    m[i][kFeatures] = f.b[i] + kRidge * kPrior[i];
  }
  for (int c = 0; c < kFeatures; ++c) {
    int piv = c;
    for (int r = c + 1; r < kFeatures; ++r)
      if (std::fabs(m[r][c]) > std::fabs(m[piv][c])) piv = r;
    if (std::fabs(m[piv][c]) < 1e-12) return;  // keep the previous weights
    if (piv != c)
      for (int j = 0; j <= kFeatures; ++j) std::swap(m[c][j], m[piv][j]);
    for (int r = 0; r < kFeatures; ++r) {
      if (r == c) continue;
      const double g = m[r][c] / m[c][c];
      for (int j = c; j <= kFeatures; ++j) m[r][j] -= g * m[c][j];
    }
  }
  for (int i = 0; i < kFeatures; ++i) f.w[i] = m[i][kFeatures] / m[i][i];
}

namespace {

// Cross's inner loops, compiled for AVX-512, AVX2 and the baseline (the
// loader picks one for the host).
__attribute__((target_clones("avx512f", "avx2", "default"))) void AddScaledRow(const float* row, float scale,
                                                                               float* q, int n) {
  for (int b = 0; b < n; ++b) q[b] += row[b] * scale;
}
__attribute__((target_clones("avx512f", "avx2", "default"))) void AddToken(const float* q, float scale, double* miss,
                                                                           double* pairs, int n) {
  for (int b = 0; b < n; ++b) {
    const double qb = std::min(1.0, static_cast<double>(q[b] * scale));
    miss[b] *= 1.0 - qb;
    pairs[b] += qb;
  }
}

}  // namespace

void CrossLayerEstimate(const std::vector<std::vector<int>>& tokens, const float* count, const float* trans, int E,
                        size_t max_exact, CrossScratch* scratch, std::vector<double>* prob,
                        std::vector<double>* pairs) {
  prob->assign(E, 0.0);
  pairs->assign(E, 0.0);
  if (tokens.size() > max_exact) {
    // Pairs summed by expert: weight[a] = sum over a's tokens of 1 / known.
    std::vector<double>& weight = scratch->weight;
    weight.assign(E, 0.0);
    for (const std::vector<int>& tok : tokens) {
      int known = 0;
      for (int a : tok) known += count[a] > 0;
      for (int a : tok)
        if (count[a] > 0) weight[a] += 1.0 / known;
    }
    for (int a = 0; a < E; ++a) {
      if (weight[a] <= 0) continue;
      const float* row = trans + static_cast<size_t>(a) * E;
      const double w = weight[a] / count[a];
      for (int b = 0; b < E; ++b) (*pairs)[b] += w * row[b];
    }
    for (int b = 0; b < E; ++b) (*prob)[b] = 1.0 - std::exp(-(*pairs)[b]);
    return;
  }
  std::vector<double>& miss = scratch->miss;
  std::vector<float>& q = scratch->q;
  miss.assign(E, 1.0);
  q.resize(E);
  for (const std::vector<int>& tok : tokens) {
    std::fill(q.begin(), q.end(), 0.0f);
    int known = 0;
    for (int a : tok) {
      if (count[a] <= 0) continue;
      ++known;
      AddScaledRow(trans + static_cast<size_t>(a) * E, 1.0f / count[a], q.data(), E);
    }
    if (known > 0) AddToken(q.data(), 1.0f / static_cast<float>(known), miss.data(), pairs->data(), E);
  }
  for (int b = 0; b < E; ++b) (*prob)[b] = 1.0 - miss[b];
}

void ExpertPredictor::Cross(int from, int lag, std::vector<double>* prob, std::vector<double>* pairs) const {
  CrossLayerEstimate(state_[from].tokens, &from_[(static_cast<size_t>(lag - 1) * n_ + from) * e_],
                     &trans_[TransRowIndex(lag, from, 0)], e_, kCrossTokens, &cross_scratch_, prob, pairs);
}

void ExpertPredictor::Learn(int from, int lag, int to) {
  const auto& src = state_[from].tokens;
  const auto& dst = state_[to].tokens;
  if (src.size() != dst.size()) return;  // not the same tokens (another batch)
  for (size_t t = 0; t < src.size(); ++t)
    for (int a : src[t]) {
      float& n = from_[(static_cast<size_t>(lag - 1) * n_ + from) * e_ + a];
      if (n >= kTransitionCap) {
        n *= 0.5f;
        for (int b = 0; b < e_; ++b) Trans(lag, from, a, b) *= 0.5f;
      }
      n += 1.0f;
      for (int b : dst[t]) Trans(lag, from, a, b) += 1.0f;
    }
}

void ExpertPredictor::PredictAhead(int from) {
  std::vector<double>&c1 = ahead_[0], &p1 = ahead_[1], &c2 = ahead_[2], &p2 = ahead_[3];
  // The position observed before `from`, when it is the one just before it in
  // the run order (the same forward pass, same tokens).
  const int before = recent_.size() >= 2 ? recent_[recent_.size() - 2] : -1;
  const bool have_before = before >= 0 && before == (from + n_ - 1) % n_ &&
                           state_[before].tokens.size() == state_[from].tokens.size();
  for (int lag = 1; lag <= kMaxLag; ++lag) {
    const int to = (from + lag) % n_;
    LayerState& s = state_[to];
    Cross(from, lag, &c1, &p1);
    if (have_before && lag + 1 <= kMaxLag) {
      Cross(before, lag + 1, &c2, &p2);
    } else {
      c2.assign(e_, 0.0);
    }
    std::vector<double>& x = s.features[lag - 1];
    const Fit& f = s.fit[lag - 1];
    for (int e = 0; e < e_; ++e) {
      double* xe = &x[static_cast<size_t>(e) * kFeatures];
      xe[0] = 1.0;
      xe[1] = c1[e];
      xe[2] = c2[e];
      xe[3] = s.last[e];
      xe[4] = s.fast[e];
      xe[5] = s.slow[e];
      double p = 0;
      for (int j = 0; j < kFeatures; ++j) p += f.w[j] * xe[j];
      p = std::clamp(p, 0.0, 1.0);
      s.prob[lag - 1][e] = p;
      // Expected pairs: the cross-layer estimate when it has one, scaled to p.
      s.pairs[lag - 1][e] = c1[e] > 0 ? p * std::max(1.0, p1[e] / c1[e]) : p;
    }
    s.valid[lag - 1] = true;
  }
}

// Scores position p's lag-1 prediction (and the engine's hint) against the
// experts this run used.
void ExpertPredictor::ScoreRun(int p, const std::vector<uint8_t>& used) {
  LayerState& s = state_[p];
  if (s.valid[0]) {
    const std::vector<double>& prob = s.prob[0];
    const int m = static_cast<int>(std::lround(std::accumulate(prob.begin(), prob.end(), 0.0)));
    std::vector<int> order(e_);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + std::min(m, e_), order.end(),
                      [&](int a, int b) { return prob[a] > prob[b]; });
    PredictionQuality& q = quality_[p];
    ++q.runs;
    for (int i = 0; i < std::min(m, e_); ++i) {
      ++q.predicted;
      q.correct += used[order[i]];
    }
    for (int e = 0; e < e_; ++e) q.used += used[e];
  }
  if (s.has_hint) {
    for (int e = 0; e < e_; ++e)
      if (s.hinted[e]) {
        hint_total_ += 1;
        hint_correct_ += used[e];
      }
    s.has_hint = false;
  }
}

// Refits each lag's model of a position on what this run routed to.
void ExpertPredictor::Refit(LayerState& s, const std::vector<uint8_t>& used) {
  const double forget = std::exp2(-1.0 / kFitHalfLife);
  for (int lag = 1; lag <= kMaxLag; ++lag) {
    if (!s.valid[lag - 1]) continue;
    Fit& f = s.fit[lag - 1];
    // This run's X^T X (one triangle: it is symmetric) and X^T used, in
    // locals the compiler keeps in registers, then added to the decayed sums.
    double a[kFeatures][kFeatures] = {}, b[kFeatures] = {};
    const std::vector<double>& x = s.features[lag - 1];
    for (int e = 0; e < e_; ++e) {
      const double* xe = &x[static_cast<size_t>(e) * kFeatures];
      for (int i = 0; i < kFeatures; ++i) {
        b[i] += xe[i] * used[e];
        for (int j = 0; j <= i; ++j) a[i][j] += xe[i] * xe[j];
      }
    }
    for (int i = 0; i < kFeatures; ++i) {
      f.b[i] = f.b[i] * forget + b[i];
      for (int j = 0; j < kFeatures; ++j)
        f.a[i * kFeatures + j] = f.a[i * kFeatures + j] * forget + (j <= i ? a[i][j] : a[j][i]);
    }
    Solve(f);
    s.valid[lag - 1] = false;
  }
}

absl::Status ExpertPredictor::Observe(int layer, int T, int k, const int32_t* ids) {
  if (layer < 0 || layer >= static_cast<int>(pos_.size()) || pos_[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("predictor: layer ", layer, " is not served"));
  if (T < 0 || k < 0 || (T > 0 && k > 0 && ids == nullptr))
    return absl::InvalidArgumentError("predictor: bad routing shape");
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i)
    if (ids[i] < -1 || ids[i] >= e_)
      return absl::InvalidArgumentError(absl::StrCat("predictor: expert id ", ids[i], " out of range"));
  const int p = pos_[layer];
  LayerState& s = state_[p];
  std::vector<uint8_t>& used = scratch_used_;
  used.assign(e_, 0);
  // The tokens' distinct experts, into the rows the state held before (their
  // capacity is reused: no allocation per run once warm).
  std::vector<std::vector<int>>& tokens = scratch_tokens_;
  tokens.resize(T);
  for (std::vector<int>& tok : tokens) tok.clear();
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      const int e = ids[static_cast<size_t>(t) * k + j];
      if (e < 0 || std::find(tokens[t].begin(), tokens[t].end(), e) != tokens[t].end()) continue;
      tokens[t].push_back(e);
      used[e] = 1;
    }
  }
  ScoreRun(p, used);
  Refit(s, used);
  // Temporal state, then transitions from the positions observed before.
  const float df = static_cast<float>(std::exp2(-1.0 / kFastHalfLife));
  const float ds = static_cast<float>(std::exp2(-1.0 / kSlowHalfLife));
  for (int e = 0; e < e_; ++e) {
    s.last[e] = used[e];
    s.fast[e] = s.fast[e] * df + used[e] * (1 - df);
    s.slow[e] = s.slow[e] * ds + used[e] * (1 - ds);
  }
  std::swap(s.tokens, tokens);
  ++s.runs;
  for (int lag = 1; lag <= kMaxLag && lag <= static_cast<int>(recent_.size()); ++lag) {
    const int from = recent_[recent_.size() - lag];
    if (from == (p + n_ * kMaxLag - lag) % n_) Learn(from, lag, p);
  }
  recent_.push_back(p);
  if (recent_.size() > kMaxLag + 1) recent_.erase(recent_.begin());
  PredictAhead(p);
  return absl::OkStatus();
}

absl::Status ExpertPredictor::Hint(int layer, int T, int k, const float* logits) {
  if (layer < 0 || layer >= static_cast<int>(pos_.size()) || pos_[layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("router logits: layer ", layer, " is not served"));
  if (T < 0 || k < 1 || k > e_ || (T > 0 && logits == nullptr))
    return absl::InvalidArgumentError(absl::StrCat("router logits: bad shape (T=", T, ", k=", k, ")"));
  LayerState& s = state_[pos_[layer]];
  s.hinted.assign(e_, false);
  std::vector<int> order(e_);
  for (int t = 0; t < T; ++t) {
    const float* row = logits + static_cast<size_t>(t) * e_;
    for (int e = 0; e < e_; ++e)
      if (!std::isfinite(row[e]))
        return absl::InvalidArgumentError(absl::StrCat("router logits: token ", t, " expert ", e, " not finite"));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) { return row[a] > row[b]; });
    for (int j = 0; j < k; ++j) s.hinted[order[j]] = true;
  }
  s.has_hint = true;
  return absl::OkStatus();
}

std::vector<double> ExpertPredictor::Predict(int layer, int lag, std::vector<double>* expected_pairs) const {
  std::vector<double> prob(e_, 0.0);
  if (expected_pairs) expected_pairs->assign(e_, 0.0);
  if (layer < 0 || layer >= static_cast<int>(pos_.size()) || pos_[layer] < 0 || lag < 1 || lag > kMaxLag)
    return prob;
  const LayerState& s = state_[pos_[layer]];
  if (s.valid[lag - 1]) {
    prob = s.prob[lag - 1];
    if (expected_pairs) *expected_pairs = s.pairs[lag - 1];
  }
  if (s.has_hint) {
    const double precision = hint_correct_ / hint_total_;
    for (int e = 0; e < e_; ++e) {
      const double p = s.hinted[e] ? std::max(prob[e], precision) : prob[e] * (1.0 - precision);
      if (expected_pairs && prob[e] > 0) (*expected_pairs)[e] *= p / prob[e];
      if (expected_pairs && prob[e] <= 0) (*expected_pairs)[e] = p;
      prob[e] = p;
    }
  }
  return prob;
}

}  // namespace moe
