// quant_accuracy: how far quantized experts' MoE output is from the bf16
// model's — one MoE layer of a synthetic model:
//   - checkpoints: its weights as an fp8 (block 128x128) or int4
//     (compressed-tensors, group 128) checkpoint gives them back
//     (model/quantization.h), through the reference MoE in f64;
//   - storage: the experts packed as a CPU server stores them (--weight-dtype
//     int8 / int4, activations quantized per row by the executor) and
//     computed by the real executor and kernel ("auto"), from the bf16 model
//     and from the fp8 / int4 checkpoint (what --weight-dtype=auto serves).
// Prints a Markdown table: cosine similarity, relative L2 error, and the worst
// token's relative error, against the bf16 model's f64 reference output.
// Then a second table: what quantizing the activations alone costs (the
// inputs of gate/up and of down, each alone and both, as int8 kernels must), mode by mode, for
// Gaussian and heavy-tailed (Student's t, 3 degrees) activations: the hi/lo
// pair the executor uses, one int8 row per token, and one int8 row per token
// with a scale per block of K (llama.cpp's Q8_0 blocks are 32).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/flags.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/moe_executor.h"
#include "expert_compute/numa_binding.h"

namespace {

// How an int8 kernel's activations approximate a row v of K values (in place).
enum class ActQuant { kExact, kHiLo, kPerToken, kBlock32, kBlock64, kBlock128 };
const char* ActQuantName(ActQuant q) {
  switch (q) {
    case ActQuant::kExact: return "exact";
    case ActQuant::kHiLo: return "hi/lo int8 pair per token (the executor's)";
    case ActQuant::kPerToken: return "int8 per token";
    case ActQuant::kBlock32: return "int8 per token and 32-K block";
    case ActQuant::kBlock64: return "int8 per token and 64-K block";
    case ActQuant::kBlock128: return "int8 per token and 128-K block";
  }
  return "?";
}
void Quantize(ActQuant q, std::vector<double>& v) {
  const int K = static_cast<int>(v.size());
  int block = K;
  if (q == ActQuant::kExact) return;
  if (q == ActQuant::kBlock32) block = 32;
  if (q == ActQuant::kBlock64) block = 64;
  if (q == ActQuant::kBlock128) block = 128;
  for (int b0 = 0; b0 < K; b0 += block) {
    const int b1 = std::min(K, b0 + block);
    double amax = 0;
    for (int k = b0; k < b1; ++k) amax = std::max(amax, std::fabs(v[k]));
    const double s = amax / 127;
    if (s == 0) continue;
    for (int k = b0; k < b1; ++k) {
      const double h = std::nearbyint(v[k] / s);
      if (q == ActQuant::kHiLo) {  // as QuantizeRows: lo = round((v/s - hi) * 254), clamped
        const double lo = std::clamp(std::nearbyint((v[k] / s - h) * 254), -127.0, 127.0);
        v[k] = s * (h + lo / 254);
      } else {
        v[k] = s * h;
      }
    }
  }
}

// The second table: the f64 MoE of the model's weights with its activation
// inputs (x into gate/up, silu(gate) * up into down) quantized per mode, each
// alone and both, against exact ones: which input a mode's error comes from.
void ActivationModes(const moe::ModelSource& model, int layer, int n, int64_t seed, const moe::RoutingView& r) {
  const moe::ModelSpec& spec = model.spec();
  const int H = spec.hidden, I = spec.intermediate;
  std::printf("\n## Activation quantization alone: MoE output vs exact activations\n\n"
              "Same layer, weights and routing; f64 throughout; x (into gate/up), silu(gate)*up (into down) or "
              "both quantized per mode; relative L2 error over the batch.\n\n"
              "| activations | mode | x only | silu(gate)*up only | both |\n| --- | --- | --- | --- | --- |\n");
  std::vector<moe::ExpertWeights> w(spec.num_experts);
  for (int e = 0; e < spec.num_experts; ++e)
    if (absl::Status st = model.ReadExpert(layer, e, &w[e]); !st.ok()) {
      std::fprintf(stderr, "quant_accuracy: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  for (const char* dist : {"Gaussian", "Student t (3 d.o.f.)"}) {
    // Activations with the same scale as the first table's (unit variance).
    std::mt19937_64 rng(static_cast<uint64_t>(seed) + 7);
    std::normal_distribution<double> normal(0, 1);
    std::student_t_distribution<double> t3(3);
    std::vector<double> x(static_cast<size_t>(n) * H);
    for (double& v : x) v = dist[0] == 'G' ? normal(rng) : t3(rng) / std::sqrt(3.0);
    auto moe_out = [&](ActQuant qx, ActQuant qa) {
      std::vector<double> out(static_cast<size_t>(n) * H, 0.0), xt(H), act(I);
      for (int t = 0; t < n; ++t) {
        std::copy_n(x.begin() + static_cast<size_t>(t) * H, H, xt.begin());
        Quantize(qx, xt);
        for (int j = 0; j < r.k; ++j) {
          const int e = r.ids[static_cast<size_t>(t) * r.k + j];
          if (e < 0) continue;
          const moe::ExpertWeights& ew = w[e];
          for (int i = 0; i < I; ++i) {
            double g = 0, u = 0;
            for (int h = 0; h < H; ++h) {
              g += moe::Bf16ToF32(ew.gate[static_cast<size_t>(i) * H + h]) * xt[h];
              u += moe::Bf16ToF32(ew.up[static_cast<size_t>(i) * H + h]) * xt[h];
            }
            act[i] = g / (1 + std::exp(-g)) * u;
          }
          Quantize(qa, act);
          const double wt = r.weights[static_cast<size_t>(t) * r.k + j];
          for (int h = 0; h < H; ++h) {
            double y = 0;
            for (int i = 0; i < I; ++i) y += moe::Bf16ToF32(ew.down[static_cast<size_t>(h) * I + i]) * act[i];
            out[static_cast<size_t>(t) * H + h] += wt * y;
          }
        }
      }
      return out;
    };
    const std::vector<double> exact = moe_out(ActQuant::kExact, ActQuant::kExact);
    for (ActQuant q : {ActQuant::kHiLo, ActQuant::kPerToken, ActQuant::kBlock32, ActQuant::kBlock64,
                       ActQuant::kBlock128}) {
      auto error = [&](ActQuant qx, ActQuant qa) {
        const std::vector<double> got = moe_out(qx, qa);
        return moe::RelativeL2Error(got.data(), exact.data(), got.size());
      };
      std::printf("| %s | %s | %.4f | %.4f | %.4f |\n", dist, ActQuantName(q), error(q, ActQuant::kExact),
                  error(ActQuant::kExact, q), error(q, q));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "qwen3-30b-a3b";
  int64_t tokens = 64, seed = 1;
  int64_t threads = 0;
  moe::FlagSet flags("quant_accuracy",
                     "[flags]\nMoE output of fp8 / int4 checkpoints and int8 / int4 storage vs bf16 (reference MoE, f64).");
  flags.Int("threads", &threads, "executor threads (0 = one per core)");
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
  auto report = [&](const std::string& what, const std::vector<double>& got) {
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
    std::printf("| %s | %.6f | %.4f | %.4f |\n", what.c_str(), dot / std::sqrt(nq * nr), std::sqrt(nd / nr), worst);
  };
  // The experts of `layer` stored in `format` and run by the real executor.
  absl::StatusOr<std::unique_ptr<moe::NumaBinding>> numa = moe::NumaBinding::Create("auto", static_cast<int>(threads));
  if (!numa.ok()) flags.Fail(std::string(numa.status().message()), 1);
  moe::ComputePool pool(**numa);
  auto stored = [&](const moe::ModelSource& m, moe::WeightFormat format, std::string* kernel_name) {
    moe::HostedSet hosted{{layer}, {}};
    for (int e = 0; e < spec.num_experts; ++e) hosted.experts.push_back(e);
    const moe::ExpertGeometry g = moe::ExpertGeometry::For(H, spec.intermediate, format);
    absl::StatusOr<std::unique_ptr<moe::ExpertStore>> store = moe::ExpertStore::Load(m, g, hosted, **numa, pool);
    absl::StatusOr<std::unique_ptr<moe::ExpertKernel>> kernel = moe::MakeExpertKernel("auto", moe::CpuFeatures::Get(), format);
    if (!store.ok() || !kernel.ok()) flags.Fail(std::string((store.ok() ? kernel.status() : store.status()).message()), 1);
    *kernel_name = (*kernel)->name();
    moe::MoeExecutor exec(**store, **kernel, pool);
    std::vector<float> out(static_cast<size_t>(n) * H);
    absl::Status st = exec.Forward(moe::MoeBatch{layer, n, x.data(), routing}, moe::DType::kF32, out.data(), nullptr);
    if (!st.ok()) flags.Fail(std::string(st.message()), 1);
    return std::vector<double>(out.begin(), out.end());
  };
  for (const char* dtype : {"fp8", "int4"}) {
    absl::StatusOr<std::unique_ptr<moe::ModelSource>> q = moe::OpenModel(absl::StrCat(base, ":dtype=", dtype));
    if (!q.ok()) flags.Fail(std::string(q.status().message()), 1);
    std::vector<double> got;
    forward(**q, &got);
    report(absl::StrCat(dtype, " checkpoint (reference MoE)"), got);
  }
  std::string kernel;
  for (moe::WeightFormat f :
       {moe::WeightFormat::kBf16, moe::WeightFormat::kInt8, moe::WeightFormat::kInt4, moe::WeightFormat::kFp8}) {
    std::vector<double> got = stored(**bf16, f, &kernel);
    report(absl::StrCat("bf16 model stored ", moe::WeightFormatName(f), " (", kernel, " kernel)"), got);
  }
  for (auto [dtype, f] : {std::pair{"fp8", moe::WeightFormat::kInt8}, std::pair{"fp8", moe::WeightFormat::kFp8},
                          std::pair{"int4", moe::WeightFormat::kInt4}}) {
    std::unique_ptr<moe::ModelSource> q = *moe::OpenModel(absl::StrCat(base, ":dtype=", dtype));
    std::vector<double> got = stored(*q, f, &kernel);
    report(absl::StrCat(dtype, " checkpoint stored ", moe::WeightFormatName(f), " (", kernel, " kernel)"), got);
  }
  ActivationModes(**bf16, layer, n, seed, routing);
  return 0;
}
