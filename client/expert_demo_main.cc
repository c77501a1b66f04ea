// moe-expert-demo: pushes batches of random tokens through a running expert
// server and prints throughput and the error against the reference MoE.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "client/expert_client.h"
#include "core/flags.h"
#include "core/model_source.h"
#include "core/random_data.h"
#include "core/reference_moe.h"

int main(int argc, char** argv) {
  std::string server = "127.0.0.1:50051", model, tls_cert, tls_key, tls_ca;
  bool insecure = false;
  int64_t batches = 20, tokens = 32, check = 3, layer = -1, seed = 1;
  moe::FlagSet flags("moe-expert-demo", "--server ADDR --model URI [flags]\n"
                     "Sends batches through ForwardStream and checks them against the reference MoE.");
  flags.String("server", &server, "expert server address host:port");
  flags.String("model", &model, "the model the server runs (same URI or directory), for the reference");
  flags.Int("batches", &batches, "batches to send");
  flags.Int("tokens", &tokens, "tokens per batch");
  flags.Int("check", &check, "batches checked against the reference (the first ones)");
  flags.Int("layer", &layer, "MoE layer (-1 = cycle over the hosted layers)");
  flags.Int("seed", &seed, "random seed for tokens and routing");
  flags.String("tls-cert", &tls_cert, "PEM client certificate (mTLS)");
  flags.String("tls-key", &tls_key, "PEM client private key (mTLS)");
  flags.String("tls-ca", &tls_ca, "PEM CA bundle to verify the server");
  flags.Bool("insecure", &insecure, "plaintext gRPC (only when asked for; TLS flags otherwise)");
  flags.Parse(argc, argv);
  if (model.empty()) flags.Fail("--model is required");
  if (batches <= 0 || tokens <= 0) flags.Fail("--batches and --tokens must be > 0");

  absl::StatusOr<std::unique_ptr<moe::ModelSource>> source = moe::OpenModel(model);
  if (!source.ok()) flags.Fail(std::string(source.status().message()), 1);
  const moe::ModelSpec& spec = (*source)->spec();
  absl::StatusOr<std::unique_ptr<moe::ExpertClient>> connected =
      moe::ExpertClient::Connect(server, moe::TlsOptions{tls_cert, tls_key, tls_ca, insecure, ""});
  if (!connected.ok()) flags.Fail(std::string(connected.status().message()));
  std::unique_ptr<moe::ExpertClient>& client = *connected;
  absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
  if (!info.ok()) flags.Fail(absl::StrCat("GetInfo ", server, ": ", info.status().message()), 1);
  if (info->model().hidden_size() != static_cast<uint32_t>(spec.hidden) ||
      info->model().num_experts() != static_cast<uint32_t>(spec.num_experts))
    flags.Fail("the server runs a different model than --model", 1);
  std::vector<int> layers(info->hosted_layers().begin(), info->hosted_layers().end());
  std::vector<int> experts(info->hosted_experts().begin(), info->hosted_experts().end());
  std::printf("server %s: %s, kernel %s, %u threads, %.2f GiB of experts resident\n", server.c_str(),
              spec.Summary().c_str(), info->kernel().c_str(), info->threads(),
              static_cast<double>(info->weight_bytes()) / (1ull << 30));

  const int H = spec.hidden, k = std::min<int>(spec.top_k, static_cast<int>(experts.size()));
  moe::ReferenceMoe reference(**source);
  auto stream = client->OpenStream();
  double worst = 0;
  int64_t total_tokens = 0, total_pairs = 0;
  double seconds = 0;
  for (int64_t b = 0; b < batches; ++b) {
    const int l = layer >= 0 ? static_cast<int>(layer) : layers[b % layers.size()];
    std::vector<moe::bf16_t> x = moe::RandomActivations(size_t(tokens) * H, seed * 1000 + b);
    std::vector<int32_t> ids;
    std::vector<float> w;
    moe::RandomRouting(static_cast<int>(tokens), k, static_cast<int>(experts.size()), seed * 7919 + b, 1.0, &ids, &w);
    for (int32_t& e : ids) e = experts[e];
    moe::RoutingView r{static_cast<int>(tokens), k, ids.data(), w.data()};
    const auto t0 = std::chrono::steady_clock::now();
    stream->Write(moe::ExpertClient::MakeRequest(l, static_cast<int>(tokens), H, x.data(), r, b));
    absl::StatusOr<moe::v1::ForwardStreamResponse> resp = stream->Read();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!resp.ok()) flags.Fail(absl::StrCat("stream: ", resp.status().message()), 1);
    if (resp->status_code() != 0) flags.Fail(absl::StrCat("batch ", b, ": ", resp->status_message()), 1);
    total_tokens += tokens;
    total_pairs += resp->response().stats().pairs();
    if (b < check) {
      absl::StatusOr<std::vector<moe::bf16_t>> out = moe::OutputAsBf16(resp->response());
      std::vector<float> ref(size_t(tokens) * H), got(size_t(tokens) * H);
      if (absl::Status st = reference.Forward<float>(l, static_cast<int>(tokens), x.data(), r, ref.data()); !st.ok())
        flags.Fail(std::string(st.message()), 1);
      moe::Bf16ToF32(out->data(), got.data(), got.size());
      const double err = moe::RelativeL2Error(got.data(), ref.data(), got.size());
      worst = std::max(worst, err);
      std::printf("batch %3lld layer %2d: %lld tokens, %u experts, rel. error vs reference %.2e\n",
                  static_cast<long long>(b), l, static_cast<long long>(tokens),
                  resp->response().stats().distinct_experts(), err);
    }
  }
  (void)stream->Finish();
  std::printf("%lld batches, %lld tokens, %lld (token, expert) pairs in %.3f s: %.0f tokens/s, %.0f pairs/s, %.2f ms per batch\n",
              static_cast<long long>(batches), static_cast<long long>(total_tokens), static_cast<long long>(total_pairs),
              seconds, total_tokens / seconds, total_pairs / seconds, 1e3 * seconds / batches);
  std::printf("max relative error vs reference (bf16, tolerance 1e-2): %.2e %s\n", worst, worst <= 1e-2 ? "OK" : "FAIL");
  return worst <= 1e-2 ? 0 : 1;
}
