// moe-make-model: writes a synthetic MoE checkpoint (config.json + sharded
// safetensors with an index) for one of the named presets.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/flags.h"
#include "core/synthetic_model.h"

int main(int argc, char** argv) {
  std::string preset = "tiny", out, dtype = "bf16";
  int64_t layers = -1, seed = 0, shard_mib = 2048;
  moe::FlagSet flags("moe-make-model",
                     "--preset NAME --out DIR [--layers N] [--seed S] [--shard-mib M] [--dtype bf16|f16|f32|fp8|int4]\n"
                     "Writes a synthetic checkpoint with seeded random expert weights.\nPresets: " +
                         absl::StrJoin(moe::PresetNames(), ", "));
  flags.String("preset", &preset, "model geometry: " + absl::StrJoin(moe::PresetNames(), ", "));
  flags.String("out", &out, "output directory (created)");
  flags.Int("layers", &layers, "keep only the first N decoder layers (-1 = all)");
  flags.Int("seed", &seed, "random seed; the same seed gives the same weights as synthetic:PRESET:seed=S");
  flags.Int("shard-mib", &shard_mib, "maximum tensor data per shard file, MiB");
  flags.String("dtype", &dtype,
               "expert weights in the files: bf16, f16, f32, or quantized as real checkpoints are: fp8 (E4M3,\n"
               "      128x128 block scales, like DeepSeek-V3) or int4 (compressed-tensors pack-quantized, group 128)");
  flags.Parse(argc, argv);
  if (out.empty()) flags.Fail("--out is required");
  if (layers == 0 || layers < -1) flags.Fail("--layers must be a positive number or -1");
  if (shard_mib <= 0) flags.Fail("--shard-mib must be > 0");
  absl::StatusOr<moe::ModelSpec> spec = moe::PresetSpec(preset, static_cast<int>(layers));
  if (!spec.ok()) flags.Fail(std::string(spec.status().message()));
  if (dtype == "f32") spec->dtype = moe::DType::kF32;
  else if (dtype == "f16") spec->dtype = moe::DType::kF16;
  else if (dtype == "fp8") spec->quant.scheme = moe::WeightQuant::kFp8Block;
  else if (dtype == "int4") spec->quant.scheme = moe::WeightQuant::kInt4Group;
  else if (dtype != "bf16") flags.Fail("--dtype must be bf16, f16, f32, fp8 or int4");
  absl::Status st = moe::WriteSyntheticCheckpoint(out, *spec, static_cast<uint64_t>(seed),
                                                  static_cast<size_t>(shard_mib) << 20);
  if (!st.ok()) flags.Fail(std::string(st.message()), 1);
  std::printf("wrote %s: %s\n", out.c_str(), spec->Summary().c_str());
  return 0;
}
