// AttentionStep: the decoder attention of the GPU worker's bundled
// benchmark/demo model. The GPU worker runs attention and the router itself
// and sends only expert misses to CPU servers, so a benchmark needs real GPU
// work before every MoE layer for the CPU expert work to overlap with. The
// model is synthetic (seeded random weights of realistic scale), its math is
// the standard one, and both implementations are tested against a
// double-precision reference (attention_reference.h).
//
// One decode step of layer l for a batch of T tokens, where token t is the
// next token of sequence slot t, at position pos[t] (continuous batching: each
// token is its own sequence; slot t keeps a KV cache of max_seq positions):
//   a   = RMSNorm(h_t; g1_l)                    f32 math, stored bf16
//   q,k,v = Wq a, Wk a, Wv a                    f32; GQA: num_heads query heads,
//                                               num_kv_heads key/value heads
//   RoPE (rotate-half, base rope_theta) on q and k at position pos[t]
//   K[t, pos[t]], V[t, pos[t]] = k, v           bf16 KV cache
//   o   = per query head h: softmax_{p <= pos[t]}(q_h . K_p / sqrt(head_dim)) V_p,
//         using kv head h / (num_heads / num_kv_heads); stored bf16
//   h_t += Wo o                                 residual, stored bf16
//   x_t = RMSNorm(h_t; g2_l)                    the MoE input, bf16 (computed
//                                               from the stored bf16 h_t)
//   logits = Wr x_t [E]; topk_ids [T,k] int32, topk_weights [T,k] f32: the k
//         largest of softmax(logits), in descending order (ties: lower id
//         first), weights renormalised to sum to 1 over the k (Mixtral/Qwen3).
// Weights are bf16 row-major, generated from `seed` (attention_weights.h);
// all math is f32. Qwen3's per-head q/k norms, DeepSeek's MLA and its grouped
// sigmoid router are not modelled: every model gets this GQA block and a
// softmax router.
//
// Lifecycle: MakeAttentionStep(backend, config) generates the weights, uploads
// them (cuda) and allocates a zeroed KV cache; then any sequence of
// PrefillCache / Run calls. Positions a Run attends over that neither
// PrefillCache nor an earlier Run wrote hold zeros.
//
// Thread-safety: none. One thread drives an AttentionStep. Different
// AttentionStep objects are independent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "gpu_worker/device_backend.h"

namespace moe {

// model/model_spec.h (not included here: it needs C++20, and nvcc compiles this
// header as C++17).
struct ModelSpec;

struct AttentionConfig {
  int hidden = 0;        // H
  int num_heads = 0;     // query heads
  int num_kv_heads = 0;  // key/value heads; num_heads % num_kv_heads == 0
                         // (cuda: num_heads / num_kv_heads <= 32)
  int head_dim = 0;      // even and <= 256
  int num_experts = 0;   // E, router outputs
  int top_k = 0;         // k <= min(E, 32)
  int num_layers = 0;
  int max_batch = 0;  // largest T of a call; also the number of sequence slots
  int max_seq = 0;    // KV cache positions per sequence slot
  float rms_eps = 1e-6f;
  float rope_theta = 10000.0f;
  uint64_t seed = 0;    // weights and PrefillCache contents
  int cpu_threads = 0;  // cpu backend: 0 = std::thread::hardware_concurrency()
  int cuda_device = 0;  // cuda backend

  // InvalidArgument naming the first bad field.
  absl::Status Validate() const;
  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Bytes of the bf16 weights of all layers (norm gains, Wq/Wk/Wv, Wo, Wr).
  size_t WeightBytes() const;
  // Bytes of the bf16 KV cache: 2 * layers * max_batch * max_seq * kv_dim * 2.
  size_t KvCacheBytes() const;
  std::string Summary() const;
};

// Attention geometry for a model: real head counts where the model has GQA
// (qwen3_moe H=2048: 32 heads, 4 kv heads, head_dim 128; mixtral H=4096: 32/8/128;
// gpt_oss H=2880: 64/8/64, without its sliding window, sinks and biases),
// a GQA stand-in of the same hidden size for DeepSeek's MLA (H=7168: 56 heads,
// 8 kv heads, head_dim 128), and for other sizes head_dim = the largest of
// 128, 64, 32, 16, 8 dividing H with at least 2 heads, num_heads = H / head_dim,
// num_kv_heads = the fewest dividing num_heads with at most 4 query heads per
// kv head. Every decoder layer of the spec gets an attention layer; E, k come
// from the spec. rope_theta stays 10000 for all.
absl::StatusOr<AttentionConfig> AttentionConfigFor(const ModelSpec& spec, int max_batch,
                                                   int max_seq, uint64_t seed);

// The interface is non-virtual (arguments are checked once, here); the
// implementations provide DoPrefillCache / DoRun.
class AttentionStep {
 public:
  explicit AttentionStep(const AttentionConfig& config) : config_(config) {}
  virtual ~AttentionStep() = default;
  AttentionStep(const AttentionStep&) = delete;
  AttentionStep& operator=(const AttentionStep&) = delete;

  virtual const char* name() const = 0;  // "cpu" or "cuda"
  // Where Run's array arguments live: host memory (cpu) or device memory of
  // config().cuda_device (cuda).
  virtual MemoryKind memory_kind() const = 0;
  const AttentionConfig& config() const { return config_; }

  // Fills KV cache positions [0, len) of sequence slots [0, T) of every layer
  // with deterministic random K/V (PrefillKvValue in attention_weights.h:
  // uniform, std about 1.15, the scale of this model's own post-RoPE keys and
  // values), so decode steps at pos >= len attend over a realistic context.
  // InvalidArgument unless 0 <= T <= max_batch and 0 <= len <= max_seq.
  // Returns once the cache is written.
  absl::Status PrefillCache(int T, int len);

  // One decode step of `layer` (see the top of this file) for T tokens.
  //   pos           [T] host memory: token t's position in sequence slot t
  //   h             [T, H] bf16, inout: hidden states before / after attention
  //   moe_in        [T, H] bf16, out: the MoE input x
  //   topk_ids      [T, top_k] int32, out
  //   topk_weights  [T, top_k] f32, out
  // Every array but `pos` is in memory_kind() memory. InvalidArgument naming
  // the field when layer (0 <= layer < num_layers), T (0 <= T <= max_batch)
  // or a pos[t] (0 <= pos[t] < max_seq) is out of range or a pointer is null;
  // nothing is written then. T == 0 does nothing.
  // The cuda implementation works on its own stream: `h` must be complete
  // (no writes pending on other streams) when Run is called, and Run
  // synchronizes its stream before returning, so every output is complete
  // on return.
  absl::Status Run(int layer, int T, const int32_t* pos, bf16_t* h, bf16_t* moe_in,
                   int32_t* topk_ids, float* topk_weights);

 protected:
  // Called with checked arguments (T > 0 for DoRun).
  virtual absl::Status DoPrefillCache(int T, int len) = 0;
  virtual absl::Status DoRun(int layer, int T, const int32_t* pos, bf16_t* h, bf16_t* moe_in,
                             int32_t* topk_ids, float* topk_weights) = 0;

 private:
  const AttentionConfig config_;
};

// `backend`: "cpu" or "cuda" (InvalidArgument otherwise). "cuda" is
// FailedPrecondition with the reason when CUDA is not compiled in or no GPU is
// usable; other CUDA failures (e.g. out of memory) keep their own codes.
absl::StatusOr<std::unique_ptr<AttentionStep>> MakeAttentionStep(const std::string& backend,
                                                                 const AttentionConfig& config);

// Implementations; MakeAttentionStep is their only caller. `config` is valid.
absl::StatusOr<std::unique_ptr<AttentionStep>> MakeCpuAttentionStep(const AttentionConfig& config);
#ifdef MOE_HAVE_CUDA
absl::StatusOr<std::unique_ptr<AttentionStep>> MakeCudaAttentionStep(const AttentionConfig& config);
#endif

}  // namespace moe
