#include "bench/model/attention_reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace moe {

namespace {

// The value an implementation stores when it writes `x` as bf16.
double RoundBf16(double x) { return Bf16ToF32(F32ToBf16(static_cast<float>(x))); }

double Dot(const bf16_t* w, const double* x, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(Bf16ToF32(w[i])) * x[i];
  return s;
}

// y = W x for W [N, K] bf16.
void MatVec(const std::vector<bf16_t>& w, int N, int K, const double* x, double* y) {
  for (int n = 0; n < N; ++n) y[n] = Dot(w.data() + static_cast<size_t>(n) * K, x, K);
}

// bf16(x / rms(x) * g).
void RmsNorm(const double* x, const std::vector<bf16_t>& g, int n, double eps, double* out) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  for (int i = 0; i < n; ++i) out[i] = RoundBf16(x[i] * inv * Bf16ToF32(g[i]));
}

}  // namespace

ReferenceAttention::ReferenceAttention(const AttentionConfig& config) : config_(config) {
  for (int l = 0; l < config_.num_layers; ++l)
    layers_.push_back(GenerateAttentionLayerWeights(config_, l, 1));
  const size_t n = static_cast<size_t>(config_.num_layers) * config_.max_batch * config_.max_seq *
                   config_.kv_dim();
  k_cache_.assign(n, 0.0);
  v_cache_.assign(n, 0.0);
}

size_t ReferenceAttention::KvIndex(int layer, int seq, int kv_head, int pos) const {
  const AttentionConfig& c = config_;
  return (((static_cast<size_t>(layer) * c.max_batch + seq) * c.num_kv_heads + kv_head) *
              c.max_seq +
          pos) *
         c.head_dim;
}

absl::Status ReferenceAttention::PrefillCache(int T, int len) {
  const AttentionConfig& c = config_;
  if (T < 0 || T > c.max_batch || len < 0 || len > c.max_seq)
    return absl::InvalidArgumentError(
        absl::StrCat("reference attention prefill: T = ", T, ", len = ", len, " out of range"));
  for (int l = 0; l < c.num_layers; ++l)
    for (int t = 0; t < T; ++t)
      for (int kvh = 0; kvh < c.num_kv_heads; ++kvh)
        for (int p = 0; p < len; ++p)
          for (int d = 0; d < c.head_dim; ++d) {
            k_cache_[KvIndex(l, t, kvh, p) + d] = PrefillKvValue(c.seed, l, 0, t, kvh, p, d);
            v_cache_[KvIndex(l, t, kvh, p) + d] = PrefillKvValue(c.seed, l, 1, t, kvh, p, d);
          }
  return absl::OkStatus();
}

// Long: the reference attention layer written out step by step in f64, as
// the test checks the GPU one against it.
absl::Status ReferenceAttention::Run(int layer, int T, const int32_t* pos, const bf16_t* h,
                                     Result* out) {
  const AttentionConfig& c = config_;
  if (layer < 0 || layer >= c.num_layers || T < 0 || T > c.max_batch)
    return absl::InvalidArgumentError(
        absl::StrCat("reference attention: layer = ", layer, ", T = ", T, " out of range"));
  for (int t = 0; t < T; ++t) {
    if (pos[t] < 0 || pos[t] >= c.max_seq)
      return absl::InvalidArgumentError(
          absl::StrCat("reference attention: pos[", t, "] = ", pos[t], " out of range"));
  }
  const AttentionLayerWeights& w = layers_[layer];
  const int H = c.hidden, hd = c.head_dim, half = hd / 2, E = c.num_experts, k = c.top_k;
  const int qkv_n = c.q_dim() + 2 * c.kv_dim();
  const int group = c.num_heads / c.num_kv_heads;
  out->h.assign(static_cast<size_t>(T) * H, 0.0);
  out->moe_in.assign(static_cast<size_t>(T) * H, 0.0);
  out->logits.assign(static_cast<size_t>(T) * E, 0.0);
  out->topk_ids.assign(static_cast<size_t>(T) * k, -1);
  out->topk_weights.assign(static_cast<size_t>(T) * k, 0.0);

  std::vector<double> x(H), a(H), qkv(qkv_n), o(c.q_dim()), y(H), scores(c.max_seq);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < H; ++i) x[i] = Bf16ToF32(h[static_cast<size_t>(t) * H + i]);
    RmsNorm(x.data(), w.attn_norm, H, c.rms_eps, a.data());
    MatVec(w.wqkv, qkv_n, H, a.data(), qkv.data());

    // RoPE (rotate-half) on every q and k head; angles in double.
    for (int head = 0; head < c.num_heads + c.num_kv_heads; ++head) {
      double* v = qkv.data() + static_cast<size_t>(head) * hd;
      for (int i = 0; i < half; ++i) {
        const double angle = pos[t] * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / hd);
        const double cs = std::cos(angle), sn = std::sin(angle);
        const double x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cs - x2 * sn;
        v[i + half] = x2 * cs + x1 * sn;
      }
    }
    const double* q = qkv.data();
    const double* kk = q + c.q_dim();
    const double* vv = kk + c.kv_dim();
    for (int kvh = 0; kvh < c.num_kv_heads; ++kvh) {
      for (int d = 0; d < hd; ++d) {
        k_cache_[KvIndex(layer, t, kvh, pos[t]) + d] = RoundBf16(kk[kvh * hd + d]);
        v_cache_[KvIndex(layer, t, kvh, pos[t]) + d] = RoundBf16(vv[kvh * hd + d]);
      }
    }

    // Attention per head: plain two-pass softmax over positions 0..pos[t].
    for (int head = 0; head < c.num_heads; ++head) {
      const int kvh = head / group;
      const double* qh = q + static_cast<size_t>(head) * hd;
      double m = -INFINITY;
      for (int p = 0; p <= pos[t]; ++p) {
        const double* kp = k_cache_.data() + KvIndex(layer, t, kvh, p);
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += qh[d] * kp[d];
        scores[p] = s / std::sqrt(static_cast<double>(hd));
        m = std::max(m, scores[p]);
      }
      double sum = 0.0;
      for (int p = 0; p <= pos[t]; ++p) sum += (scores[p] = std::exp(scores[p] - m));
      for (int d = 0; d < hd; ++d) {
        double acc = 0.0;
        for (int p = 0; p <= pos[t]; ++p)
          acc += scores[p] * v_cache_[KvIndex(layer, t, kvh, p) + d];
        o[static_cast<size_t>(head) * hd + d] = RoundBf16(acc / sum);
      }
    }

    MatVec(w.wo, H, c.q_dim(), o.data(), y.data());
    double* ht = out->h.data() + static_cast<size_t>(t) * H;
    for (int i = 0; i < H; ++i) ht[i] = RoundBf16(x[i] + y[i]);
    double* xt = out->moe_in.data() + static_cast<size_t>(t) * H;
    RmsNorm(ht, w.moe_norm, H, c.rms_eps, xt);

    double* lg = out->logits.data() + static_cast<size_t>(t) * E;
    MatVec(w.router, E, H, xt, lg);
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [lg](int32_t a_id, int32_t b_id) { return lg[a_id] > lg[b_id]; });
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += std::exp(lg[order[j]] - lg[order[0]]);
    for (int j = 0; j < k; ++j) {
      out->topk_ids[static_cast<size_t>(t) * k + j] = order[j];
      out->topk_weights[static_cast<size_t>(t) * k + j] =
          std::exp(lg[order[j]] - lg[order[0]]) / sum;
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
