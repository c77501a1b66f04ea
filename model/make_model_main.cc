// moe-make-model: writes a synthetic MoE checkpoint for one of the named
// presets: a safetensors directory (config.json + sharded safetensors with an
// index) or one GGUF file (--format gguf, or an --out ending in .gguf).
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/flags.h"
#include "model/gguf_model.h"
#include "model/synthetic_model.h"

int main(int argc, char** argv) {
  std::string preset = "tiny", out, dtype = "bf16", format = "auto";
  int64_t layers = -1, seed = 0, shard_mib = 2048, int4_group = 0;
  moe::FlagSet flags("moe-make-model",
                     "--preset NAME --out DIR|FILE.gguf [--layers N] [--seed S] [--shard-mib M] [--format safetensors|gguf]\n"
                     "      [--dtype bf16|f16|f32|fp8|int4|mxfp4 | (gguf) bf16|f16|f32|q8_0|q4_k|q6_k|mxfp4] [--int4-group G]\n"
                     "Writes a synthetic checkpoint with seeded random expert weights: a safetensors directory\n"
                     "(config.json + shards) or a GGUF file holding the experts and the preset's architecture metadata\n"
                     "(qwen3moe, deepseek2, olmoe, kimi-linear, llama for Mixtral, gpt-oss), which --model FILE.gguf\n"
                     "reads. Families: deepseek_v3, qwen3_moe, mixtral, olmoe, kimi_linear (SiLU experts) and gpt_oss\n"
                     "(tiny-gpt-oss, gpt-oss-20b, gpt-oss-120b: experts with biases, a clamped SwiGLU (alpha 1.702,\n"
                     "swiglu_limit 7), top-k then softmax routing; safetensors as openai/gpt-oss publishes its bf16\n"
                     "form, gate and up interleaved in one fused tensor, --dtype bf16, f16 or f32; GGUF in llama.cpp's\n"
                     "gpt-oss layout, gate and up separate, F32 expert biases and router, any GGUF --dtype whose block\n"
                     "divides H and I: bf16 for tiny-gpt-oss, mxfp4 or q8_0 too for gpt-oss-20b/120b).\n"
                     "Presets: " + absl::StrJoin(moe::PresetNames(), ", "));
  flags.String("preset", &preset, "model geometry: " + absl::StrJoin(moe::PresetNames(), ", "));
  flags.String("out", &out, "output directory (created), or the GGUF file to write");
  flags.String("format", &format, "safetensors, gguf, or auto (gguf when --out ends in .gguf)");
  flags.Int("layers", &layers, "keep only the first N decoder layers (-1 = all)");
  flags.Int("seed", &seed, "random seed; the same seed gives the same weights as synthetic:PRESET:seed=S");
  flags.Int("shard-mib", &shard_mib, "maximum tensor data per shard file, MiB (safetensors)");
  flags.String("dtype", &dtype,
               "expert weights in the files. safetensors: bf16, f16, f32, or quantized as real checkpoints are:\n"
               "      fp8 (E4M3, 128x128 block scales, like DeepSeek-V3), int4 (compressed-tensors pack-quantized,\n"
               "      symmetric, --int4-group columns per scale) or mxfp4 (OCP MXFP4 as GPT-OSS publishes it: X_blocks [rows, cols/32, 16] E2M1\n"
               "      nibbles, low first, and X_scales [rows, cols/32] E8M0; quantization_config quant_method mxfp4;\n"
               "      H and I multiples of 32). gguf: bf16, f16, f32, q8_0 or mxfp4 (H and I multiples of 32),\n"
               "      q4_k or q6_k (multiples of 256)");
  flags.Int("int4-group", &int4_group,
            "safetensors --dtype int4: columns per scale (0: 128; 32 is Kimi-K2's; a row's last group may be partial)");
  flags.Parse(argc, argv);
  if (out.empty()) flags.Fail("--out is required");
  if (layers == 0 || layers < -1) flags.Fail("--layers must be a positive number or -1");
  if (shard_mib <= 0) flags.Fail("--shard-mib must be > 0");
  if (format == "auto") format = out.size() > 5 && out.compare(out.size() - 5, 5, ".gguf") == 0 ? "gguf" : "safetensors";
  if (format != "gguf" && format != "safetensors") flags.Fail("--format must be safetensors, gguf or auto");
  absl::StatusOr<moe::ModelSpec> spec = moe::PresetSpec(preset, static_cast<int>(layers));
  if (!spec.ok()) flags.Fail(std::string(spec.status().message()));
  absl::Status st;
  if (format == "gguf") {
    if (int4_group != 0) flags.Fail("--int4-group is for safetensors --dtype int4 (GGUF blocks have their own sizes)");
    absl::StatusOr<moe::GgmlType> type = moe::ParseGgmlType(dtype);
    if (!type.ok()) flags.Fail(absl::StrCat("--dtype: ", type.status().message()));
    st = moe::WriteSyntheticGguf(out, *spec, static_cast<uint64_t>(seed), *type);
  } else {
    if (dtype == "f32") spec->dtype = moe::DType::kF32;
    else if (dtype == "f16") spec->dtype = moe::DType::kF16;
    else if (dtype == "fp8") spec->quant.scheme = moe::WeightQuant::kFp8Block;
    else if (dtype == "int4") spec->quant.scheme = moe::WeightQuant::kInt4Group;
    else if (dtype == "mxfp4") spec->quant.scheme = moe::WeightQuant::kMxfp4;
    else if (dtype != "bf16") flags.Fail("--dtype must be bf16, f16, f32, fp8, int4 or mxfp4 (q8_0, q4_k, q6_k: --format gguf)");
    if (int4_group != 0 && dtype != "int4") flags.Fail("--int4-group is for --dtype int4");
    if (int4_group < 0 || int4_group > 4096) flags.Fail("--int4-group must be in [1, 4096] (0: 128)");
    if (int4_group > 0) spec->quant.group_size = static_cast<int>(int4_group);
    st = moe::WriteSyntheticCheckpoint(out, *spec, static_cast<uint64_t>(seed), static_cast<size_t>(shard_mib) << 20);
  }
  if (!st.ok()) flags.Fail(std::string(st.message()), 1);
  std::printf("wrote %s (%s, %s): %s\n", out.c_str(), format.c_str(), dtype.c_str(), spec->Summary().c_str());
  return 0;
}
