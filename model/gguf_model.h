// MoE models in GGUF files (llama.cpp's format, model/gguf.h): the model source
// behind `--model FILE.gguf`, and the writer behind `moe-make-model --format
// gguf`.
//
// Read: the architectures whose experts are FFNs of three fused tensors per
// layer, blk.{l}.ffn_{gate,up,down}_exps.weight (ggml dims [H, I, E], [H, I,
// E], [I, H, E]): SiLU-gated in qwen3moe, qwen2moe, deepseek2 (DeepSeek-V2/V3,
// Kimi-K2), glm4moe (GLM-4.5/4.6), olmoe, kimi-linear, and llama with experts
// (Mixtral); and gpt-oss (GPT-OSS-20B/120B as llama.cpp's converter writes
// it: gate and up de-interleaved into separate tensors, each with its bias
// blk.{l}.ffn_{gate,up,down}_exps.bias [I, E], [I, E], [H, E], required; the
// expert math is GPT-OSS's clamped SwiGLU, alpha 1.702, limit 7, which
// llama.cpp's graph fixes and no key carries, and its routing top-k then
// softmax). Any other architecture is refused, as are expert biases of a
// family without them and fused ffn_gate_up_exps. The geometry comes
// from {arch}.block_count, embedding_length, expert_count, expert_used_count,
// expert_feed_forward_length (feed_forward_length for llama), the MoE layers
// from the tensors present (leading dense layers have none; checked against
// leading_dense_block_count); the routing metadata (expert_gating_func,
// expert_weights_norm, expert_weights_scale, expert_shared_count) is read and
// named in Describe(): the service's callers route, it only computes experts.
// Expert tensor types: F32, F16, BF16, Q8_0, Q4_K, Q6_K (others are refused at
// open, naming the tensor and type). ReadExpert dequantizes one expert (ggml's
// reference dequantization) into bf16; the spec says which quantization the
// file holds (QuantConfig kGgufBlock) so that --weight-dtype auto stores it in
// the nearest packed format (expert_store.h StorageGeometry).
//
// Thread-safety: the source is immutable after OpenGgufModel; ReadExpert may
// run on any number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/gguf.h"
#include "model/model_source.h"

namespace moe {

// Opens a GGUF MoE model. NotFound for a missing file; InvalidArgument naming
// the file and the key, tensor, type or architecture otherwise.
absl::StatusOr<std::unique_ptr<ModelSource>> OpenGgufModel(const std::string& path);

// The GGUF architecture name of a model_type ("qwen3_moe" -> "qwen3moe",
// "deepseek_v3" -> "deepseek2", "mixtral" -> "llama", ...); InvalidArgument for
// one without a GGUF architecture.
absl::StatusOr<std::string> GgufArchitecture(const std::string& model_type);

// Parses a GGUF expert type for writers: "bf16", "f16", "f32", "q8_0",
// "q4_k", "q6_k" (any case); InvalidArgument otherwise.
absl::StatusOr<GgmlType> ParseGgmlType(const std::string& name);

// Writes `path`: a GGUF of every expert of every MoE layer of `spec` with
// weights from GenerateExpertMatrix (the synthetic:PRESET:seed=S values),
// stored as `type`, and the architecture's metadata; a gpt_oss spec also gets
// its expert biases (GenerateExpertBias) and router (GenerateRouter:
// ffn_gate_inp.weight [H, E], .bias [E]) as F32, in llama.cpp's gpt-oss
// layout. Only the expert tensors and routers (no attention, embeddings):
// a model for this service, not for llama.cpp (bench/make_peer_gguf.py
// writes whole models). InvalidArgument when spec's H or I is not a multiple
// of the type's block (32 for Q8_0 and MXFP4, 256 for Q4_K / Q6_K), its
// model_type has no GGUF architecture, or a gpt_oss spec's expert math is not
// the one gpt-oss GGUF files imply.
absl::Status WriteSyntheticGguf(const std::string& path, const ModelSpec& spec, uint64_t seed, GgmlType type);

}  // namespace moe
