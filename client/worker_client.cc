#include "client/worker_client.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/grpc_channel.h"
#include "transport/wire.h"

namespace moe {
namespace {
void SetDeadline(grpc::ClientContext* ctx, int timeout_ms) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
}
}  // namespace

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(const std::string& address,
                                                                   const TlsOptions& tls) {
  auto c = std::unique_ptr<WorkerClient>(new WorkerClient());
  MOE_ASSIGN_OR_RETURN(c->channel_, MakeChannel(address, 512u << 20, tls));
  c->stub_ = moe::v1::WorkerService::NewStub(c->channel_);
  return c;
}

absl::StatusOr<moe::v1::WorkerInfo> WorkerClient::GetInfo(int timeout_ms) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout_ms);
  moe::v1::WorkerInfo info;
  if (grpc::Status st = stub_->GetWorkerInfo(&ctx, moe::v1::WorkerInfoRequest(), &info); !st.ok())
    return FromGrpcStatus(st);
  hidden_ = static_cast<int>(info.model().hidden_size());
  return info;
}

absl::Status WorkerClient::ForwardLayer(int layer, std::vector<WorkerBatch*> batches, int timeout_ms) {
  if (hidden_ == 0)
    if (absl::StatusOr<moe::v1::WorkerInfo> i = GetInfo(timeout_ms); !i.ok()) return i.status();
  moe::v1::ForwardLayerRequest req;
  req.set_layer(layer);
  for (const WorkerBatch* b : batches) {
    moe::v1::MicroBatch* m = req.add_batches();
    EncodeTensor(DType::kBF16, {b->T, hidden_}, b->hidden, m->mutable_hidden());
    EncodeTensor(DType::kI32, {b->T, b->k}, b->topk_ids, m->mutable_topk_ids());
    EncodeTensor(DType::kF32, {b->T, b->k}, b->topk_weights, m->mutable_topk_weights());
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout_ms);
  moe::v1::ForwardLayerResponse resp;
  if (grpc::Status st = stub_->ForwardLayer(&ctx, req, &resp); !st.ok()) return FromGrpcStatus(st);
  if (resp.outputs_size() != static_cast<int>(batches.size()))
    return absl::InternalError(absl::StrCat("worker returned ", resp.outputs_size(), " outputs for ", batches.size()));
  for (size_t i = 0; i < batches.size(); ++i) {
    WorkerBatch* b = batches[i];
    absl::StatusOr<TensorView> out =
        DecodeTensor(resp.outputs(static_cast<int>(i)), absl::StrCat("outputs[", i, "]"), DType::kBF16, {b->T, hidden_});
    if (!out.ok()) return absl::InternalError(out.status().message());
    std::memcpy(b->out, out->data, out->nbytes());
    if (static_cast<int>(i) < resp.stats_size()) b->stats = resp.stats(static_cast<int>(i));
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::ApplyAssignment(int layer, const std::vector<int>& experts, int timeout_ms) {
  moe::v1::ApplyAssignmentRequest req;
  req.set_layer(layer);
  for (int e : experts) req.add_experts(e);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout_ms);
  moe::v1::ApplyAssignmentResponse resp;
  return FromGrpcStatus(stub_->ApplyAssignment(&ctx, req, &resp));
}

}  // namespace moe
