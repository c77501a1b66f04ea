// AttentionConfig, the argument checks of AttentionStep, the factory, and the
// cpu implementation (plain f32 loops over host memory, split across
// std::threads; for machines without a GPU and for tests).
#include "bench/model/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/model_spec.h"
#include "core/status_macros.h"
#include "bench/model/attention_weights.h"

namespace moe {

// ---- AttentionConfig -------------------------------------------------------

absl::Status AttentionConfig::Validate() const {
  auto positive = [](const char* field, int v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("attention: ", field, " = ", v, " must be > 0"));
  };
  for (auto [field, v] : {std::pair<const char*, int>{"hidden", hidden},
                          {"num_heads", num_heads},
                          {"num_kv_heads", num_kv_heads},
                          {"head_dim", head_dim},
                          {"num_experts", num_experts},
                          {"top_k", top_k},
                          {"num_layers", num_layers},
                          {"max_batch", max_batch},
                          {"max_seq", max_seq}}) {
    MOE_RETURN_IF_ERROR(positive(field, v));
  }
  if (num_heads % num_kv_heads != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("attention: num_heads = ", num_heads,
                     " is not a multiple of num_kv_heads = ", num_kv_heads));
  if (head_dim % 2 != 0 || head_dim > 256)
    return absl::InvalidArgumentError(
        absl::StrCat("attention: head_dim = ", head_dim, " must be even and <= 256"));
  if (top_k > num_experts || top_k > 32)
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: top_k = ", top_k, " must be <= num_experts = ", num_experts, " and <= 32"));
  if (!(rms_eps > 0.0f) || !std::isfinite(rms_eps))
    return absl::InvalidArgumentError(
        absl::StrCat("attention: rms_eps = ", rms_eps, " must be > 0"));
  if (!(rope_theta > 1.0f) || !std::isfinite(rope_theta))
    return absl::InvalidArgumentError(
        absl::StrCat("attention: rope_theta = ", rope_theta, " must be > 1"));
  if (cpu_threads < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("attention: cpu_threads = ", cpu_threads, " must be >= 0"));
  return absl::OkStatus();
}

size_t AttentionConfig::WeightBytes() const {
  const size_t H = static_cast<size_t>(hidden);
  const size_t per_layer = 2 * H + (static_cast<size_t>(q_dim()) + 2 * kv_dim()) * H + H * q_dim() +
                           static_cast<size_t>(num_experts) * H;
  return 2 * per_layer * num_layers;
}

size_t AttentionConfig::KvCacheBytes() const {
  return 2 * 2 * static_cast<size_t>(num_layers) * max_batch * max_seq * kv_dim();
}

std::string AttentionConfig::Summary() const {
  return absl::StrCat("attention: ", num_layers, " layers, H=", hidden, ", ", num_heads,
                      " heads / ", num_kv_heads, " kv heads x ", head_dim, ", E=", num_experts,
                      " top-", top_k, ", max_batch=", max_batch, ", max_seq=", max_seq,
                      ", weights ", WeightBytes() >> 20, " MiB, KV cache ", KvCacheBytes() >> 20,
                      " MiB");
}

absl::StatusOr<AttentionConfig> AttentionConfigFor(const ModelSpec& spec, int max_batch,
                                                   int max_seq, uint64_t seed) {
  MOE_RETURN_IF_ERROR(spec.Validate());
  AttentionConfig c;
  c.hidden = spec.hidden;
  c.num_experts = spec.num_experts;
  c.top_k = spec.top_k;
  c.num_layers = spec.num_layers;
  c.max_batch = max_batch;
  c.max_seq = max_seq;
  c.seed = seed;
  const std::string& type = spec.model_type;
  if (type.rfind("qwen3", 0) == 0 && spec.hidden == 2048) {
    c.num_heads = 32, c.num_kv_heads = 4, c.head_dim = 128;  // Qwen3-30B-A3B
  } else if (type.rfind("mixtral", 0) == 0 && spec.hidden == 4096) {
    c.num_heads = 32, c.num_kv_heads = 8, c.head_dim = 128;  // Mixtral 8x7B
  } else if (type == "olmoe" && spec.hidden == 2048) {
    c.num_heads = 16, c.num_kv_heads = 16, c.head_dim = 128;  // OLMoE-1B-7B (multi-head)
  } else if (type.rfind("gpt_oss", 0) == 0 && spec.hidden == 2880) {
    c.num_heads = 64, c.num_kv_heads = 8, c.head_dim = 64;  // GPT-OSS-20B/120B (full attention on every layer here)
  } else if (type.rfind("deepseek", 0) == 0 && spec.hidden == 7168) {
    c.num_heads = 56, c.num_kv_heads = 8, c.head_dim = 128;  // GQA stand-in for MLA
  } else {
    for (int hd : {128, 64, 32, 16, 8}) {
      if (spec.hidden % hd == 0 && spec.hidden / hd >= 2) {
        c.head_dim = hd;
        break;
      }
    }
    if (c.head_dim == 0)
      return absl::InvalidArgumentError(absl::StrCat("attention: hidden = ", spec.hidden,
                                                     " has no head_dim in {128, 64, 32, 16, 8}"));
    c.num_heads = spec.hidden / c.head_dim;
    c.num_kv_heads = c.num_heads;
    for (int kv = 1; kv <= c.num_heads; ++kv) {
      if (c.num_heads % kv == 0 && c.num_heads / kv <= 4) {
        c.num_kv_heads = kv;
        break;
      }
    }
  }
  MOE_RETURN_IF_ERROR(c.Validate());
  return c;
}

// ---- AttentionStep argument checks ------------------------------------------

absl::Status AttentionStep::PrefillCache(int T, int len) {
  if (T < 0 || T > config_.max_batch)
    return absl::InvalidArgumentError(absl::StrCat(
        "attention prefill: T = ", T, " outside [0, max_batch=", config_.max_batch, "]"));
  if (len < 0 || len > config_.max_seq)
    return absl::InvalidArgumentError(absl::StrCat("attention prefill: len = ", len,
                                                   " outside [0, max_seq=", config_.max_seq, "]"));
  if (T == 0 || len == 0) return absl::OkStatus();
  return DoPrefillCache(T, len);
}

absl::Status AttentionStep::Run(int layer, int T, const int32_t* pos, bf16_t* h, bf16_t* moe_in,
                                int32_t* topk_ids, float* topk_weights) {
  if (layer < 0 || layer >= config_.num_layers)
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: layer = ", layer, " outside [0, num_layers=", config_.num_layers, ")"));
  if (T < 0 || T > config_.max_batch)
    return absl::InvalidArgumentError(
        absl::StrCat("attention: T = ", T, " outside [0, max_batch=", config_.max_batch, "]"));
  if (T == 0) return absl::OkStatus();
  if (pos == nullptr || h == nullptr || moe_in == nullptr || topk_ids == nullptr ||
      topk_weights == nullptr) {
    const char* field = pos == nullptr        ? "pos"
                        : h == nullptr        ? "h"
                        : moe_in == nullptr   ? "moe_in"
                        : topk_ids == nullptr ? "topk_ids"
                                              : "topk_weights";
    return absl::InvalidArgumentError(absl::StrCat("attention: ", field, " is null"));
  }
  for (int t = 0; t < T; ++t) {
    if (pos[t] < 0 || pos[t] >= config_.max_seq)
      return absl::InvalidArgumentError(absl::StrCat(
          "attention: pos[", t, "] = ", pos[t], " outside [0, max_seq=", config_.max_seq, ")"));
  }
  return DoRun(layer, T, pos, h, moe_in, topk_ids, topk_weights);
}

// ---- factory ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AttentionStep>> MakeAttentionStep(const std::string& backend,
                                                                 const AttentionConfig& config) {
  if (backend != "cpu" && backend != "cuda")
    return absl::InvalidArgumentError(
        absl::StrCat("attention: unknown backend '", backend, "' (cpu or cuda)"));
  MOE_RETURN_IF_ERROR(config.Validate());
  if (backend == "cpu") return MakeCpuAttentionStep(config);
#ifdef MOE_HAVE_CUDA
  return MakeCudaAttentionStep(config);
#else
  return absl::FailedPreconditionError(
      "attention: cuda backend unavailable: this build has no CUDA support (nvcc was not found "
      "at configure time)");
#endif
}

// ---- cpu implementation ---------------------------------------------------------

namespace {

float DotBf16(const bf16_t* w, const float* x, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += Bf16ToF32(w[i]) * x[i];
  return s;
}

// out[i] = bf16(x[i] / rms(x) * g[i]), f32 math.
void RmsNorm(const float* x, const bf16_t* g, int n, float eps, bf16_t* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = F32ToBf16(x[i] * inv * Bf16ToF32(g[i]));
}

class CpuAttentionStep final : public AttentionStep {
 public:
  explicit CpuAttentionStep(const AttentionConfig& c)
      : AttentionStep(c),
        threads_(c.cpu_threads > 0 ? c.cpu_threads
                                   : std::max(1u, std::thread::hardware_concurrency())),
        rope_(RopeTable(c)) {
    layers_.reserve(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l)
      layers_.push_back(GenerateAttentionLayerWeights(c, l, threads_));
    const size_t kv_elems =
        static_cast<size_t>(c.num_layers) * c.max_batch * c.max_seq * c.kv_dim();
    k_cache_.assign(kv_elems, 0);
    v_cache_.assign(kv_elems, 0);
    const size_t B = static_cast<size_t>(c.max_batch);
    a_.resize(B * c.hidden);
    af_.resize(B * c.hidden);
    qkv_.resize(B * (c.q_dim() + 2 * c.kv_dim()));
    o_.resize(B * c.q_dim());
    of_.resize(B * c.q_dim());
    y_.resize(B * c.hidden);
    logits_.resize(B * c.num_experts);
  }

  const char* name() const override { return "cpu"; }
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }

 protected:
  absl::Status DoPrefillCache(int T, int len) override {
    const AttentionConfig& c = config();
    const int64_t rows = static_cast<int64_t>(c.num_layers) * T * c.num_kv_heads;
    ParallelFor(rows, threads_, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int kvh = static_cast<int>(r % c.num_kv_heads);
        const int t = static_cast<int>(r / c.num_kv_heads % T);
        const int l = static_cast<int>(r / c.num_kv_heads / T);
        for (int p = 0; p < len; ++p) {
          const size_t at = KvIndex(l, t, kvh, p);
          for (int d = 0; d < c.head_dim; ++d) {
            k_cache_[at + d] = F32ToBf16(PrefillKvValue(c.seed, l, 0, t, kvh, p, d));
            v_cache_[at + d] = F32ToBf16(PrefillKvValue(c.seed, l, 1, t, kvh, p, d));
          }
        }
      }
    });
    return absl::OkStatus();
  }

  // Long: the bench model's attention layer as one sequence of launches on
  // one stream (norm, QKV, RoPE, cache, attention, output, router), in order.
  absl::Status DoRun(int layer, int T, const int32_t* pos, bf16_t* h, bf16_t* moe_in,
                     int32_t* topk_ids, float* topk_weights) override {
    const AttentionConfig& c = config();
    const AttentionLayerWeights& w = layers_[layer];
    const int H = c.hidden, hd = c.head_dim, half = hd / 2;
    const int qkv_n = c.q_dim() + 2 * c.kv_dim();
    const int group = c.num_heads / c.num_kv_heads;
    // Rows of a [N, K] GEMM per thread: at least ~64K multiply-adds each.
    auto grain = [T](int K) { return std::max<int64_t>(1, (int64_t{1} << 16) / (int64_t{K} * T)); };

    // a = RMSNorm(h; g1), kept as bf16 (the GEMM input) and its f32 value.
    Bf16ToF32(h, af_.data(), static_cast<size_t>(T) * H);
    for (int t = 0; t < T; ++t) {
      RmsNorm(af_.data() + static_cast<size_t>(t) * H, w.attn_norm.data(), H, c.rms_eps,
              a_.data() + static_cast<size_t>(t) * H);
    }
    Bf16ToF32(a_.data(), af_.data(), static_cast<size_t>(T) * H);

    // qkv = Wqkv a (f32).
    ParallelFor(qkv_n, threads_, grain(H), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const bf16_t* wr = w.wqkv.data() + static_cast<size_t>(n) * H;
        for (int t = 0; t < T; ++t)
          qkv_[static_cast<size_t>(t) * qkv_n + n] =
              DotBf16(wr, af_.data() + static_cast<size_t>(t) * H, H);
      }
    });

    // RoPE on q and k; k, v appended to the cache at pos[t].
    for (int t = 0; t < T; ++t) {
      float* q = qkv_.data() + static_cast<size_t>(t) * qkv_n;
      float* k = q + c.q_dim();
      const float* v = k + c.kv_dim();
      const float* rot = rope_.data() + static_cast<size_t>(pos[t]) * half * 2;
      for (int head = 0; head < c.num_heads + c.num_kv_heads; ++head) {
        float* x = q + static_cast<size_t>(head) * hd;  // k heads follow the q heads
        for (int i = 0; i < half; ++i) {
          const float cs = rot[2 * i], sn = rot[2 * i + 1];
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * cs - x2 * sn;
          x[i + half] = x2 * cs + x1 * sn;
        }
      }
      for (int kvh = 0; kvh < c.num_kv_heads; ++kvh) {
        const size_t at = KvIndex(layer, t, kvh, pos[t]);
        for (int d = 0; d < hd; ++d) {
          k_cache_[at + d] = F32ToBf16(k[kvh * hd + d]);
          v_cache_[at + d] = F32ToBf16(v[kvh * hd + d]);
        }
      }
    }

    // o = softmax(q K / sqrt(hd)) V per (token, head), stored bf16.
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    ParallelFor(static_cast<int64_t>(T) * c.num_heads, threads_, 4, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores(c.max_seq), acc(hd);
      for (int64_t i = i0; i < i1; ++i) {
        const int t = static_cast<int>(i / c.num_heads), head = static_cast<int>(i % c.num_heads);
        const float* q =
            qkv_.data() + static_cast<size_t>(t) * qkv_n + static_cast<size_t>(head) * hd;
        const int kvh = head / group, n = pos[t] + 1;
        const bf16_t* K = k_cache_.data() + KvIndex(layer, t, kvh, 0);
        const bf16_t* V = v_cache_.data() + KvIndex(layer, t, kvh, 0);
        float m = -INFINITY;
        for (int p = 0; p < n; ++p) {
          scores[p] = DotBf16(K + static_cast<size_t>(p) * hd, q, hd) * scale;
          m = std::max(m, scores[p]);
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int p = 0; p < n; ++p) {
          const float e = std::exp(scores[p] - m);
          sum += e;
          const bf16_t* vp = V + static_cast<size_t>(p) * hd;
          for (int d = 0; d < hd; ++d) acc[d] += e * Bf16ToF32(vp[d]);
        }
        bf16_t* o = o_.data() + static_cast<size_t>(t) * c.q_dim() + static_cast<size_t>(head) * hd;
        for (int d = 0; d < hd; ++d) o[d] = F32ToBf16(acc[d] / sum);
      }
    });
    Bf16ToF32(o_.data(), of_.data(), static_cast<size_t>(T) * c.q_dim());

    // y = Wo o (f32).
    ParallelFor(H, threads_, grain(c.q_dim()), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const bf16_t* wr = w.wo.data() + static_cast<size_t>(n) * c.q_dim();
        for (int t = 0; t < T; ++t)
          y_[static_cast<size_t>(t) * H + n] =
              DotBf16(wr, of_.data() + static_cast<size_t>(t) * c.q_dim(), c.q_dim());
      }
    });

    // h = bf16(h + y); x = RMSNorm(h; g2) from the stored bf16 h.
    for (int t = 0; t < T; ++t) {
      bf16_t* ht = h + static_cast<size_t>(t) * H;
      float* hf = af_.data() + static_cast<size_t>(t) * H;  // reused as f32 scratch
      for (int i = 0; i < H; ++i) {
        ht[i] = F32ToBf16(Bf16ToF32(ht[i]) + y_[static_cast<size_t>(t) * H + i]);
        hf[i] = Bf16ToF32(ht[i]);
      }
      RmsNorm(hf, w.moe_norm.data(), H, c.rms_eps, moe_in + static_cast<size_t>(t) * H);
    }

    // Router: logits = Wr x; top-k.
    Bf16ToF32(moe_in, af_.data(), static_cast<size_t>(T) * H);
    ParallelFor(c.num_experts, threads_, grain(H), [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        const bf16_t* wr = w.router.data() + static_cast<size_t>(e) * H;
        for (int t = 0; t < T; ++t)
          logits_[static_cast<size_t>(t) * c.num_experts + e] =
              DotBf16(wr, af_.data() + static_cast<size_t>(t) * H, H);
      }
    });
    for (int t = 0; t < T; ++t) {
      RouterTopK(logits_.data() + static_cast<size_t>(t) * c.num_experts, c.num_experts, c.top_k,
                 topk_ids + static_cast<size_t>(t) * c.top_k,
                 topk_weights + static_cast<size_t>(t) * c.top_k);
    }
    return absl::OkStatus();
  }

 private:
  // Element index of K/V [layer][seq][kv_head][pos][0].
  size_t KvIndex(int layer, int seq, int kv_head, int pos) const {
    const AttentionConfig& c = config();
    return (
        (((static_cast<size_t>(layer) * c.max_batch + seq) * c.num_kv_heads + kv_head) * c.max_seq +
         pos) *
        c.head_dim);
  }

  const int threads_;
  const std::vector<float> rope_;
  std::vector<AttentionLayerWeights> layers_;
  std::vector<bf16_t> k_cache_, v_cache_;
  // Scratch of one call, max_batch rows each.
  std::vector<bf16_t> a_, o_;
  std::vector<float> af_, qkv_, of_, y_, logits_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionStep>> MakeCpuAttentionStep(const AttentionConfig& config) {
  return std::unique_ptr<AttentionStep>(new CpuAttentionStep(config));
}

}  // namespace moe
