// quant_accuracy: how far a quantized checkpoint's MoE output is from the bf16
// model's — one MoE layer of a synthetic model, its weights as an fp8
// (block 128x128) or int4 (compressed-tensors, group 128) checkpoint gives them
// back (core/quantization.h), the reference MoE in f64 on random activations
// and routing. Prints a Markdown table: cosine similarity, relative L2 error,
// and the worst token's relative error, against the bf16 output.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "core/model_source.h"
#include "core/random_data.h"
#include "core/reference_moe.h"

int main(int argc, char** argv) {
  std::string preset = "qwen3-30b-a3b";
  int64_t tokens = 64, seed = 1;
  moe::FlagSet flags("quant_accuracy", "[flags]\nMoE output of fp8 / int4 checkpoints vs bf16 (reference MoE, f64).");
  flags.String("preset", &preset, "model geometry (synthetic preset)");
  flags.Int("tokens", &tokens, "tokens of the batch");
  flags.Int("seed", &seed, "weights, activations and routing seed");
  flags.Parse(argc, argv);
  if (tokens <= 0) flags.Fail("--tokens must be > 0");
  const std::string base = absl::StrCat("synthetic:", preset, ":layers=1:seed=", seed);
  absl::StatusOr<std::unique_ptr<moe::ModelSource>> bf16 = moe::OpenModel(base);
  if (!bf16.ok()) flags.Fail(std::string(bf16.status().message()));
  const moe::ModelSpec& spec = (*bf16)->spec();
  if (spec.moe_layers.empty()) flags.Fail("the preset's first layer has no experts");
  const int layer = spec.moe_layers[0], n = static_cast<int>(tokens), H = spec.hidden, k = spec.top_k;
  const std::vector<moe::bf16_t> x = moe::RandomActivations(static_cast<size_t>(n) * H, seed + 1);
  std::vector<int32_t> ids;
  std::vector<float> w;
  moe::RandomRouting(n, k, spec.num_experts, seed + 2, 1.0, &ids, &w);
  const moe::RoutingView routing{n, k, ids.data(), w.data()};
  auto forward = [&](const moe::ModelSource& m, std::vector<double>* out) {
    out->assign(static_cast<size_t>(n) * H, 0.0);
    absl::Status st = moe::ReferenceMoe(m).Forward<double>(layer, n, x.data(), routing, out->data());
    if (!st.ok()) flags.Fail(std::string(st.message()), 1);
  };
  std::vector<double> ref;
  forward(**bf16, &ref);
  std::printf("## Quantized checkpoints vs bf16: MoE output of one %s layer\n\n", preset.c_str());
  std::printf("%s, layer %d, %d tokens, top-%d, Zipf(1.0) routing, seed %lld; reference MoE in f64 over each "
              "model's weights as its checkpoint gives them back.\n\n",
              spec.Summary().c_str(), layer, n, k, static_cast<long long>(seed));
  std::printf("| weights | cosine similarity | relative L2 error | worst token's relative error |\n");
  std::printf("| --- | --- | --- | --- |\n");
  for (const char* dtype : {"fp8", "int4"}) {
    absl::StatusOr<std::unique_ptr<moe::ModelSource>> q = moe::OpenModel(absl::StrCat(base, ":dtype=", dtype));
    if (!q.ok()) flags.Fail(std::string(q.status().message()), 1);
    std::vector<double> got;
    forward(**q, &got);
    double dot = 0, nq = 0, nr = 0, nd = 0, worst = 0;
    for (int t = 0; t < n; ++t) {
      double td = 0, tr = 0;
      for (int h = 0; h < H; ++h) {
        const double a = got[size_t(t) * H + h], b = ref[size_t(t) * H + h];
        dot += a * b;
        nq += a * a;
        nr += b * b;
        td += (a - b) * (a - b);
        tr += b * b;
      }
      nd += td;
      if (tr > 0) worst = std::max(worst, std::sqrt(td / tr));
    }
    std::printf("| %s | %.6f | %.4f | %.4f |\n", dtype, dot / std::sqrt(nq * nr), std::sqrt(nd / nr), worst);
  }
  return 0;
}
