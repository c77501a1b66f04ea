// ExpertPredictor: an online, per-worker model of which experts each served
// MoE layer will route to at its next run — learned from the routing the
// worker sees, no model weights needed. It feeds AdmissionPolicy's prefetch.
//
// Layers run in a fixed cyclic order (the served layers ascending; after the
// last comes the first layer of the next forward pass). When layer l's
// routing is observed, the experts of the layers `lag` = 1..2 after it are
// predicted per token from:
//   - cross-layer transitions: P(expert b at l+lag | expert a at l), counted
//     per token over everything observed (and, for lag 1, also from the
//     layer before l, lag 2), the k experts of a token averaged;
//   - the target layer's own recent use: used at its previous run, and two
//     exponentially decayed use frequencies (fast and slow);
// combined per (target layer, lag) by a linear model whose weights are
// refitted after every run of the target layer (recursive least squares with
// forgetting, ridge towards an even mix). A batch's probability that expert e
// is used is 1 - prod_t (1 - q_t(e)). Nothing is tuned to a model or trace.
//
// Engine hint: an engine that computed the next layer's router logits on the
// current hidden state may hand them over (Hint); the hinted top-k experts
// then get at least the hint's measured precision as probability.
//
// Not thread-safe: the dispatcher thread (or the replay) owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

struct ExpertPredictorConfig {
  std::vector<int> layers;  // served MoE layers, ascending (the run order)
  int num_experts = 0;
};

// Lag-1 prediction quality of one layer since start: the predicted set of a
// run is its round(sum of probabilities) most likely experts.
struct PredictionQuality {
  uint64_t runs = 0;
  uint64_t predicted = 0;  // experts predicted
  uint64_t correct = 0;    // predicted and used
  uint64_t used = 0;       // experts used
  double precision() const { return predicted ? double(correct) / double(predicted) : 0.0; }
  double recall() const { return used ? double(correct) / double(used) : 0.0; }
};

// The cross-layer estimate of the experts the tokens of one layer run route
// to at a later layer: per token t and target expert b, q(t, b) is the mean
// over the token's experts a (those with count[a] > 0) of trans[a][b] /
// count[a] (trans: E rows of E, the transitions a -> b seen; count: the
// tokens with a seen). pairs[b] = sum_t q(t, b); prob[b] = 1 - prod_t (1 -
// q(t, b)), token by token for up to `max_exact` tokens. A larger batch (a
// prompt: O(T k E) took ~20 ms a layer at 8192 tokens, on the call's path)
// sums its pairs by expert (exact, O(T k + E^2)) and takes prob[b] = 1 -
// exp(-pairs[b]), the Poisson form: the product's upper bound (1 - x <=
// e^-x), close to it while each q is small (k experts a token: q <= 1/k for
// a one-to-one transition). ExpertPredictor's, declared here for its tests.
struct CrossScratch {
  std::vector<float> q;
  std::vector<double> miss, weight;
};
void CrossLayerEstimate(const std::vector<std::vector<int>>& tokens, const float* count, const float* trans, int E,
                        size_t max_exact, CrossScratch* scratch, std::vector<double>* prob,
                        std::vector<double>* pairs);

class ExpertPredictor {
 public:
  static constexpr int kMaxLag = 2;
  static constexpr size_t kCrossTokens = 256;  // CrossLayerEstimate's max_exact

  static absl::StatusOr<std::unique_ptr<ExpertPredictor>> Create(const ExpertPredictorConfig& config);

  // Records one run of `layer`: T tokens, k ids each ([T,k] row-major, -1 =
  // unused). Scores the predictions made for this run, refits, learns the
  // transitions from the layers observed before it, and predicts the next
  // kMaxLag layers. InvalidArgument for a layer not served or an id out of range.
  absl::Status Observe(int layer, int T, int k, const int32_t* ids);

  // Router logits [T, num_experts] of `layer`'s coming run, from the engine
  // (each token's top-k are taken as the hinted experts). Used by the next
  // Predict of that layer, then dropped.
  absl::Status Hint(int layer, int T, int k, const float* logits);

  // P(expert used at the next run of `layer`), num_experts entries, as
  // predicted when the layer `lag` runs before it was observed (zeros before
  // any). `expected_pairs` (optional) gets the expected (token, expert) pairs.
  std::vector<double> Predict(int layer, int lag, std::vector<double>* expected_pairs = nullptr) const;

  // The served layer `lag` runs after `layer` (cyclic).
  int LayerAfter(int layer, int lag) const;
  const PredictionQuality& quality(int layer) const { return quality_[pos_[layer]]; }
  const std::vector<int>& layers() const { return config_.layers; }

 private:
  static constexpr int kFeatures = 6;  // bias, cross (lag), cross (lag+1), last run, fast and slow frequency
  struct Fit {
    std::vector<double> a;  // kFeatures^2, decayed sum of x x^T
    std::vector<double> b;  // kFeatures, decayed sum of x y
    std::vector<double> w;  // current weights
  };
  struct LayerState {
    std::vector<float> last;                // used at the previous run (0/1)
    std::vector<float> fast, slow;          // decayed use frequencies
    std::vector<std::vector<int>> tokens;   // last run's experts per token
    // [lag-1]: features (E x kFeatures) and predictions made for this layer's next run
    std::vector<std::vector<double>> features, prob, pairs;
    std::vector<bool> valid;
    std::vector<Fit> fit;                   // [lag-1]
    std::vector<bool> hinted;               // engine hint for the coming run
    bool has_hint = false;
    uint64_t runs = 0;
  };
  explicit ExpertPredictor(const ExpertPredictorConfig& c);
  // Transition counts from served position p to p+lag (cyclic).
  // Where the row of transitions from expert a at position p to each expert
  // at p+lag starts in trans_.
  size_t TransRowIndex(int lag, int p, int a) const { return ((static_cast<size_t>(lag - 1) * n_ + p) * e_ + a) * e_; }
  float& Trans(int lag, int p, int a, int b) { return trans_[TransRowIndex(lag, p, a) + b]; }
  // Per-expert batch probability (and expected pairs) that the tokens of
  // position `from` route to each expert at from+lag.
  void Cross(int from, int lag, std::vector<double>* prob, std::vector<double>* pairs) const;
  void PredictAhead(int from);
  void ScoreRun(int p, const std::vector<uint8_t>& used);  // Observe's steps
  void Refit(LayerState& s, const std::vector<uint8_t>& used);
  void Learn(int from, int lag, int to);
  static void Solve(Fit& f);

  ExpertPredictorConfig config_;
  int n_ = 0, e_ = 0;
  std::vector<int> pos_;  // model layer -> served position, or -1
  std::vector<float> trans_, from_;  // from_[(lag-1, p, a)]: tokens with a at p followed at p+lag
  mutable CrossScratch cross_scratch_;
  std::vector<double> ahead_[4];  // PredictAhead's scratch
  std::vector<uint8_t> scratch_used_;  // Observe's
  std::vector<std::vector<int>> scratch_tokens_;
  std::vector<LayerState> state_;
  std::vector<PredictionQuality> quality_;
  std::vector<int> recent_;  // positions observed, most recent last (at most kMaxLag + 1)
  double hint_correct_ = 1, hint_total_ = 1;  // hint precision (optimistic prior of one)
};

}  // namespace moe
