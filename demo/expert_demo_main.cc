// moe-expert-demo: pushes batches of random tokens through a running expert
// server (ExpertService.ForwardStream) or a running GPU worker
// (WorkerService.ForwardLayer, --worker) and prints throughput and the error
// against the reference MoE. Exit 0 only when every checked batch is within
// the bf16 tolerance (1e-2); the container check uses it this way.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/expert_client.h"
#include "client/worker_client.h"
#include "core/flags.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "core/status_macros.h"

namespace moe {
namespace {

struct Options {
  std::string server = "127.0.0.1:50051", worker, model;
  TlsOptions tls;
  int64_t batches = 20, tokens = 32, check = 3, layer = -1, seed = 1;
};

Options ParseFlags(FlagSet& flags, int argc, char** argv) {
  Options o;
  flags.String("server", &o.server, "expert server address host:port");
  flags.String("worker", &o.worker, "send to this GPU worker (host:port, WorkerService.ForwardLayer) instead of --server");
  flags.String("model", &o.model, "the model the server runs (same URI or directory), for the reference");
  flags.Int("batches", &o.batches, "batches to send");
  flags.Int("tokens", &o.tokens, "tokens per batch");
  flags.Int("check", &o.check, "batches checked against the reference (the first ones)");
  flags.Int("layer", &o.layer, "MoE layer (-1 = cycle over the hosted layers)");
  flags.Int("seed", &o.seed, "random seed for tokens and routing");
  flags.String("tls-cert", &o.tls.cert_file, "PEM client certificate (mTLS)");
  flags.String("tls-key", &o.tls.key_file, "PEM client private key (mTLS)");
  flags.String("tls-ca", &o.tls.ca_file, "PEM CA bundle to verify the server");
  flags.Bool("insecure", &o.tls.insecure, "plaintext gRPC (only when asked for; TLS flags otherwise)");
  flags.Parse(argc, argv);
  if (o.model.empty()) flags.Fail("--model is required");
  if (o.batches <= 0 || o.tokens <= 0) flags.Fail("--batches and --tokens must be > 0");
  return o;
}

// Where the batches go: an expert server's ForwardStream or a GPU worker's
// ForwardLayer, with what it hosts.
class Target {
 public:
  virtual ~Target() = default;
  // One batch: fills `got` [n,H] (f32) and `pairs`.
  virtual absl::Status Forward(int layer, int n, const bf16_t* x, const RoutingView& r, int64_t id,
                               std::vector<float>* got, int64_t* pairs) = 0;
  virtual void Finish() {}

  std::vector<int> layers, experts;
};

// The target must run the model --model names (its reference is computed here).
void CheckModel(const FlagSet& flags, const ModelSpec& spec, const moe::v1::ModelSpec& m, const char* who) {
  if (m.hidden_size() != static_cast<uint32_t>(spec.hidden) || m.num_experts() != static_cast<uint32_t>(spec.num_experts))
    flags.Fail(absl::StrCat("the ", who, " runs a different model than --model"), 1);
}

class ExpertServerTarget final : public Target {
 public:
  // Connects to --server and prints what it serves; exits on failure.
  ExpertServerTarget(const Options& o, const ModelSpec& spec, const FlagSet& flags) : spec_(spec) {
    absl::StatusOr<std::unique_ptr<ExpertClient>> connected = ExpertClient::Connect(o.server, o.tls);
    if (!connected.ok()) flags.Fail(std::string(connected.status().message()));
    client_ = std::move(*connected);
    absl::StatusOr<moe::v1::ServerInfo> info = client_->GetInfo();
    if (!info.ok()) flags.Fail(absl::StrCat("GetInfo ", o.server, ": ", info.status().message()), 1);
    CheckModel(flags, spec, info->model(), "server");
    layers.assign(info->hosted_layers().begin(), info->hosted_layers().end());
    experts.assign(info->hosted_experts().begin(), info->hosted_experts().end());
    std::printf("server %s: %s, kernel %s, %u threads, %.2f GiB of %s experts resident\n", o.server.c_str(),
                spec.Summary().c_str(), info->kernel().c_str(), info->threads(),
                static_cast<double>(info->weight_bytes()) / (1ull << 30), info->weight_format().c_str());
    stream_ = client_->OpenStream();
  }

  absl::Status Forward(int l, int n, const bf16_t* x, const RoutingView& r, int64_t id, std::vector<float>* got,
                       int64_t* pairs) override {
    stream_->Write(ExpertClient::MakeRequest(l, n, spec_.hidden, x, r, id));
    MOE_ASSIGN_OR_RETURN(moe::v1::ForwardStreamResponse resp, stream_->Read());
    if (resp.status_code() != 0)
      return absl::Status(static_cast<absl::StatusCode>(resp.status_code()), resp.status_message());
    *pairs = resp.response().stats().pairs();
    MOE_ASSIGN_OR_RETURN(std::vector<bf16_t> out, OutputAsBf16(resp.response()));
    got->resize(out.size());
    Bf16ToF32(out.data(), got->data(), got->size());
    return absl::OkStatus();
  }

  void Finish() override { (void)stream_->Finish(); }

 private:
  const ModelSpec& spec_;
  std::unique_ptr<ExpertClient> client_;
  std::unique_ptr<ExpertClient::StreamSession> stream_;
};

class WorkerTarget final : public Target {
 public:
  // Connects to --worker and prints what it serves; exits on failure.
  WorkerTarget(const Options& o, const ModelSpec& spec, const FlagSet& flags) : spec_(spec) {
    absl::StatusOr<std::unique_ptr<WorkerClient>> connected = WorkerClient::Connect(o.worker, o.tls);
    if (!connected.ok()) flags.Fail(std::string(connected.status().message()));
    client_ = std::move(*connected);
    absl::StatusOr<moe::v1::WorkerInfo> info = client_->GetInfo();
    if (!info.ok()) flags.Fail(absl::StrCat("GetWorkerInfo ", o.worker, ": ", info.status().message()), 1);
    CheckModel(flags, spec, info->model(), "worker");
    for (const moe::v1::LayerCacheInfo& l : info->layers()) layers.push_back(static_cast<int>(l.layer()));
    for (int e = 0; e < spec.num_experts; ++e) experts.push_back(e);
    std::printf("worker %s: %s, device %s, %u cache slots per layer, servers %s\n", o.worker.c_str(),
                spec.Summary().c_str(), info->device().c_str(), info->slots_per_layer(),
                absl::StrJoin(info->servers(), ",").c_str());
  }

  absl::Status Forward(int l, int n, const bf16_t* x, const RoutingView& r, int64_t, std::vector<float>* got,
                       int64_t* pairs) override {
    std::vector<bf16_t> out(size_t(n) * spec_.hidden);
    WorkerBatch batch{n, r.k, x, r.ids, r.weights, out.data(), {}};
    MOE_RETURN_IF_ERROR(client_->ForwardLayer(l, {&batch}));
    *pairs = int64_t{batch.stats.hit_pairs()} + batch.stats.cpu_pairs() + batch.stats.copied_pairs();
    got->resize(out.size());
    Bf16ToF32(out.data(), got->data(), got->size());
    return absl::OkStatus();
  }

 private:
  const ModelSpec& spec_;
  std::unique_ptr<WorkerClient> client_;
};

// Sends --batches batches, checks the first --check against the reference and
// prints throughput; returns the worst relative error.
double SendBatches(const Options& o, const ModelSource& source, Target& target, const FlagSet& flags) {
  const ModelSpec& spec = source.spec();
  const int H = spec.hidden, k = std::min<int>(spec.top_k, static_cast<int>(target.experts.size()));
  const int tokens = static_cast<int>(o.tokens);
  ReferenceMoe reference(source);
  double worst = 0, seconds = 0;
  int64_t total_tokens = 0, total_pairs = 0;
  std::vector<float> got;
  for (int64_t b = 0; b < o.batches; ++b) {
    const int l = o.layer >= 0 ? static_cast<int>(o.layer) : target.layers[b % target.layers.size()];
    std::vector<bf16_t> x = RandomActivations(size_t(tokens) * H, o.seed * 1000 + b);
    std::vector<int32_t> ids;
    std::vector<float> w;
    RandomRouting(tokens, k, static_cast<int>(target.experts.size()), o.seed * 7919 + b, 1.0, &ids, &w);
    for (int32_t& e : ids) e = target.experts[e];
    RoutingView r{tokens, k, ids.data(), w.data()};
    int64_t pairs = 0;
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = target.Forward(l, tokens, x.data(), r, b, &got, &pairs);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) flags.Fail(absl::StrCat("batch ", b, ": ", st.ToString()), 1);
    total_tokens += tokens;
    total_pairs += pairs;
    if (b < o.check) {
      std::vector<float> ref(size_t(tokens) * H);
      if (absl::Status st = reference.Forward<float>(l, tokens, x.data(), r, ref.data()); !st.ok())
        flags.Fail(std::string(st.message()), 1);
      const double err = RelativeL2Error(got.data(), ref.data(), got.size());
      worst = std::max(worst, err);
      std::printf("batch %3lld layer %2d: %lld tokens, rel. error vs reference %.2e\n", static_cast<long long>(b), l,
                  static_cast<long long>(tokens), err);
    }
  }
  target.Finish();
  std::printf("%lld batches, %lld tokens, %lld (token, expert) pairs in %.3f s: %.0f tokens/s, %.0f pairs/s, %.2f ms per batch\n",
              static_cast<long long>(o.batches), static_cast<long long>(total_tokens), static_cast<long long>(total_pairs),
              seconds, total_tokens / seconds, total_pairs / seconds, 1e3 * seconds / o.batches);
  return worst;
}

int Main(int argc, char** argv) {
  FlagSet flags("moe-expert-demo", "(--server ADDR | --worker ADDR) --model URI [flags]\n"
                "Sends batches through an expert server's ForwardStream, or a GPU worker's ForwardLayer,\n"
                "and checks them against the reference MoE (exit 1 if an error exceeds 1e-2).");
  const Options o = ParseFlags(flags, argc, argv);
  absl::StatusOr<std::unique_ptr<ModelSource>> source = OpenModel(o.model);
  if (!source.ok()) flags.Fail(std::string(source.status().message()), 1);
  const ModelSpec& spec = (*source)->spec();
  std::unique_ptr<Target> target;
  if (o.worker.empty()) {
    target = std::make_unique<ExpertServerTarget>(o, spec, flags);
  } else {
    target = std::make_unique<WorkerTarget>(o, spec, flags);
  }
  if (target->layers.empty()) flags.Fail("the target hosts no MoE layer", 1);
  const double worst = SendBatches(o, **source, *target, flags);
  std::printf("max relative error vs reference (bf16, tolerance 1e-2): %.2e %s\n", worst, worst <= 1e-2 ? "OK" : "FAIL");
  return worst <= 1e-2 ? 0 : 1;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
