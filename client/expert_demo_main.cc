// moe-expert-demo: pushes batches of random tokens through a running expert
// server (ExpertService.ForwardStream) or a running GPU worker
// (WorkerService.ForwardLayer, --worker) and prints throughput and the error
// against the reference MoE. Exit 0 only when every checked batch is within
// the bf16 tolerance (1e-2); the container check uses it this way.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/expert_client.h"
#include "client/worker_client.h"
#include "core/flags.h"
#include "core/model_source.h"
#include "core/random_data.h"
#include "core/reference_moe.h"

int main(int argc, char** argv) {
  std::string server = "127.0.0.1:50051", worker, model, tls_cert, tls_key, tls_ca;
  bool insecure = false;
  int64_t batches = 20, tokens = 32, check = 3, layer = -1, seed = 1;
  moe::FlagSet flags("moe-expert-demo", "(--server ADDR | --worker ADDR) --model URI [flags]\n"
                     "Sends batches through an expert server's ForwardStream, or a GPU worker's ForwardLayer,\n"
                     "and checks them against the reference MoE (exit 1 if an error exceeds 1e-2).");
  flags.String("server", &server, "expert server address host:port");
  flags.String("worker", &worker, "send to this GPU worker (host:port, WorkerService.ForwardLayer) instead of --server");
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
  const moe::TlsOptions tls{tls_cert, tls_key, tls_ca, insecure, ""};
  // One batch through the chosen target: fills `got` [n,H] (f32) and `pairs`.
  std::function<absl::Status(int, int, const moe::bf16_t*, const moe::RoutingView&, int64_t, std::vector<float>*,
                             int64_t*)>
      forward;
  std::vector<int> layers, experts;
  std::unique_ptr<moe::ExpertClient> client;
  std::unique_ptr<moe::ExpertClient::StreamSession> stream;
  std::unique_ptr<moe::WorkerClient> worker_client;
  // The target must run the model --model names (its reference is computed here).
  auto check_model = [&](const moe::v1::ModelSpec& m, const char* who) {
    if (m.hidden_size() != static_cast<uint32_t>(spec.hidden) || m.num_experts() != static_cast<uint32_t>(spec.num_experts))
      flags.Fail(absl::StrCat("the ", who, " runs a different model than --model"), 1);
  };
  if (worker.empty()) {
    absl::StatusOr<std::unique_ptr<moe::ExpertClient>> connected = moe::ExpertClient::Connect(server, tls);
    if (!connected.ok()) flags.Fail(std::string(connected.status().message()));
    client = std::move(*connected);
    absl::StatusOr<moe::v1::ServerInfo> info = client->GetInfo();
    if (!info.ok()) flags.Fail(absl::StrCat("GetInfo ", server, ": ", info.status().message()), 1);
    check_model(info->model(), "server");
    layers.assign(info->hosted_layers().begin(), info->hosted_layers().end());
    experts.assign(info->hosted_experts().begin(), info->hosted_experts().end());
    std::printf("server %s: %s, kernel %s, %u threads, %.2f GiB of experts resident\n", server.c_str(),
                spec.Summary().c_str(), info->kernel().c_str(), info->threads(),
                static_cast<double>(info->weight_bytes()) / (1ull << 30));
    stream = client->OpenStream();
    forward = [&](int l, int n, const moe::bf16_t* x, const moe::RoutingView& r, int64_t id, std::vector<float>* got,
                  int64_t* pairs) -> absl::Status {
      stream->Write(moe::ExpertClient::MakeRequest(l, n, spec.hidden, x, r, id));
      absl::StatusOr<moe::v1::ForwardStreamResponse> resp = stream->Read();
      if (!resp.ok()) return resp.status();
      if (resp->status_code() != 0)
        return absl::Status(static_cast<absl::StatusCode>(resp->status_code()), resp->status_message());
      *pairs = resp->response().stats().pairs();
      absl::StatusOr<std::vector<moe::bf16_t>> out = moe::OutputAsBf16(resp->response());
      if (!out.ok()) return out.status();
      got->resize(out->size());
      moe::Bf16ToF32(out->data(), got->data(), got->size());
      return absl::OkStatus();
    };
  } else {
    absl::StatusOr<std::unique_ptr<moe::WorkerClient>> connected = moe::WorkerClient::Connect(worker, tls);
    if (!connected.ok()) flags.Fail(std::string(connected.status().message()));
    worker_client = std::move(*connected);
    absl::StatusOr<moe::v1::WorkerInfo> info = worker_client->GetInfo();
    if (!info.ok()) flags.Fail(absl::StrCat("GetWorkerInfo ", worker, ": ", info.status().message()), 1);
    check_model(info->model(), "worker");
    for (const moe::v1::LayerCacheInfo& l : info->layers()) layers.push_back(static_cast<int>(l.layer()));
    for (int e = 0; e < spec.num_experts; ++e) experts.push_back(e);
    std::printf("worker %s: %s, device %s, %u cache slots per layer, servers %s\n", worker.c_str(),
                spec.Summary().c_str(), info->device().c_str(), info->slots_per_layer(),
                absl::StrJoin(info->servers(), ",").c_str());
    forward = [&](int l, int n, const moe::bf16_t* x, const moe::RoutingView& r, int64_t, std::vector<float>* got,
                  int64_t* pairs) -> absl::Status {
      std::vector<moe::bf16_t> out(size_t(n) * spec.hidden);
      moe::WorkerBatch batch{n, r.k, x, r.ids, r.weights, out.data(), {}};
      if (absl::Status st = worker_client->ForwardLayer(l, {&batch}); !st.ok()) return st;
      *pairs = int64_t{batch.stats.hit_pairs()} + batch.stats.cpu_pairs() + batch.stats.copied_pairs();
      got->resize(out.size());
      moe::Bf16ToF32(out.data(), got->data(), got->size());
      return absl::OkStatus();
    };
  }
  if (layers.empty()) flags.Fail("the target hosts no MoE layer", 1);

  const int H = spec.hidden, k = std::min<int>(spec.top_k, static_cast<int>(experts.size()));
  moe::ReferenceMoe reference(**source);
  double worst = 0;
  int64_t total_tokens = 0, total_pairs = 0;
  double seconds = 0;
  std::vector<float> got;
  for (int64_t b = 0; b < batches; ++b) {
    const int l = layer >= 0 ? static_cast<int>(layer) : layers[b % layers.size()];
    std::vector<moe::bf16_t> x = moe::RandomActivations(size_t(tokens) * H, seed * 1000 + b);
    std::vector<int32_t> ids;
    std::vector<float> w;
    moe::RandomRouting(static_cast<int>(tokens), k, static_cast<int>(experts.size()), seed * 7919 + b, 1.0, &ids, &w);
    for (int32_t& e : ids) e = experts[e];
    moe::RoutingView r{static_cast<int>(tokens), k, ids.data(), w.data()};
    int64_t pairs = 0;
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = forward(l, static_cast<int>(tokens), x.data(), r, b, &got, &pairs);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) flags.Fail(absl::StrCat("batch ", b, ": ", st.ToString()), 1);
    total_tokens += tokens;
    total_pairs += pairs;
    if (b < check) {
      std::vector<float> ref(size_t(tokens) * H);
      if (absl::Status st = reference.Forward<float>(l, static_cast<int>(tokens), x.data(), r, ref.data()); !st.ok())
        flags.Fail(std::string(st.message()), 1);
      const double err = moe::RelativeL2Error(got.data(), ref.data(), got.size());
      worst = std::max(worst, err);
      std::printf("batch %3lld layer %2d: %lld tokens, rel. error vs reference %.2e\n", static_cast<long long>(b), l,
                  static_cast<long long>(tokens), err);
    }
  }
  if (stream) (void)stream->Finish();
  std::printf("%lld batches, %lld tokens, %lld (token, expert) pairs in %.3f s: %.0f tokens/s, %.0f pairs/s, %.2f ms per batch\n",
              static_cast<long long>(batches), static_cast<long long>(total_tokens), static_cast<long long>(total_pairs),
              seconds, total_tokens / seconds, total_pairs / seconds, 1e3 * seconds / batches);
  std::printf("max relative error vs reference (bf16, tolerance 1e-2): %.2e %s\n", worst, worst <= 1e-2 ? "OK" : "FAIL");
  return worst <= 1e-2 ? 0 : 1;
}
