#include "cpu_expert_server/expert_service.h"

#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/wire.h"

namespace moe {

uint64_t MaxMessageBytes(const ModelSpec& spec, const ServiceLimits& limits) {
  const uint64_t per_token = uint64_t(spec.hidden) * 4 + uint64_t(spec.num_experts) * 8;
  return uint64_t(limits.max_tokens_per_request + 1) * per_token + (1u << 20);
}

ExpertServiceImpl::ExpertServiceImpl(const ModelSpec& spec, BatchHandler handler,
                                     ServiceLimits limits, moe::v1::ServerInfo info,
                                     ExpertServerMetrics* metrics)
    : spec_(spec), handler_(std::move(handler)), limits_(limits), info_(std::move(info)), metrics_(metrics) {}

namespace {

// Returns p if it is aligned for T, else a copy of the bytes in `copy`.
template <typename T>
const T* Aligned(const void* p, size_t count, std::vector<T>* copy) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) == 0) return static_cast<const T*>(p);
  copy->resize(count);
  std::memcpy(copy->data(), p, count * sizeof(T));
  return copy->data();
}

}  // namespace

absl::Status ExpertServiceImpl::Handle(const moe::v1::ForwardRequest& req,
                                       moe::v1::ForwardResponse* resp) {
  const int64_t H = spec_.hidden;
  absl::StatusOr<TensorView> tokens = DecodeTensor(req.tokens(), "tokens", DType::kBF16, {-1, H});
  if (!tokens.ok()) return tokens.status();
  const int64_t n = tokens->shape[0];
  if (n == 0) return absl::InvalidArgumentError("tokens: empty batch (0 tokens)");
  if (n > limits_.max_tokens_per_request)
    return absl::OutOfRangeError(absl::StrCat("tokens: ", n, " tokens exceed max_tokens_per_request ",
                                              limits_.max_tokens_per_request));
  absl::StatusOr<TensorView> ids = DecodeTensor(req.expert_ids(), "expert_ids", DType::kI32, {n, -1});
  if (!ids.ok()) return ids.status();
  const int64_t k = ids->shape[1];
  if (k == 0 || k > spec_.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("expert_ids.shape[1]: ", k, " pairs per token, must be in [1, ",
                                                   spec_.num_experts, "]"));
  absl::StatusOr<TensorView> weights =
      DecodeTensor(req.expert_weights(), "expert_weights", DType::kF32, {n, k});
  if (!weights.ok()) return weights.status();
  DType out_dtype;
  switch (req.output_dtype()) {
    case moe::v1::DTYPE_UNSPECIFIED:
    case moe::v1::DTYPE_BF16: out_dtype = DType::kBF16; break;
    case moe::v1::DTYPE_F32: out_dtype = DType::kF32; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("output_dtype: ", ProtoDTypeName(req.output_dtype()),
                                                     " not supported (BF16 or F32)"));
  }
  std::vector<bf16_t> tok_copy;
  std::vector<int32_t> id_copy;
  std::vector<float> w_copy;
  MoeBatch batch;
  batch.layer = static_cast<int>(req.layer());
  if (req.layer() >= static_cast<uint32_t>(spec_.num_layers))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", req.layer(), " out of range [0, ", spec_.num_layers, ")"));
  batch.n = static_cast<int>(n);
  batch.tokens = Aligned<bf16_t>(tokens->data, size_t(n * H), &tok_copy);
  batch.routing = RoutingView{static_cast<int>(n), static_cast<int>(k),
                              Aligned<int32_t>(ids->data, size_t(n * k), &id_copy),
                              Aligned<float>(weights->data, size_t(n * k), &w_copy)};

  moe::v1::Tensor* out = resp->mutable_output();
  out->set_dtype(ToProtoDType(out_dtype));
  out->clear_shape();
  out->add_shape(n);
  out->add_shape(H);
  std::string* data = out->mutable_data();
  data->resize(size_t(n * H) * DTypeSize(out_dtype));
  ForwardStats stats;
  if (absl::Status st = handler_(batch, out_dtype, data->data(), &stats); !st.ok()) {
    resp->clear_output();
    return st;
  }
  resp->set_request_id(req.request_id());
  resp->mutable_stats()->set_distinct_experts(stats.distinct_experts);
  resp->mutable_stats()->set_pairs(stats.pairs);
  resp->mutable_stats()->set_compute_ns(stats.compute_ns);
  resp->mutable_stats()->set_queue_ns(stats.queue_ns);
  return absl::OkStatus();
}

absl::Status ExpertServiceImpl::HandleAndRecord(const moe::v1::ForwardRequest& req,
                                                moe::v1::ForwardResponse* resp) {
  if (metrics_ == nullptr) return Handle(req, resp);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = Handle(req, resp);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  // Payload bytes: the messages as serialized (gRPC framing and HTTP/2 not counted).
  metrics_->RecordRequest(ExpertServerMetrics::Transport::kGrpc, st.code(), req.ByteSizeLong(),
                          st.ok() ? resp->ByteSizeLong() : 0, static_cast<uint64_t>(ns));
  return st;
}

grpc::Status ExpertServiceImpl::Forward(grpc::ServerContext*, const moe::v1::ForwardRequest* req,
                                        moe::v1::ForwardResponse* resp) {
  return ToGrpcStatus(HandleAndRecord(*req, resp));
}

grpc::Status ExpertServiceImpl::ForwardStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<moe::v1::ForwardStreamResponse, moe::v1::ForwardRequest>* stream) {
  moe::v1::ForwardRequest req;
  moe::v1::ForwardStreamResponse resp;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    if (draining_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining");
    streams_[ctx] = false;
  }
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      if (draining_) break;
      streams_[ctx] = true;  // idle: Drain() may cancel us while we wait
    }
    const bool got = stream->Read(&req);
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      streams_[ctx] = false;
    }
    if (!got) break;
    resp.Clear();
    resp.set_request_id(req.request_id());
    absl::Status st = HandleAndRecord(req, resp.mutable_response());
    resp.set_status_code(static_cast<int32_t>(st.code()));
    if (!st.ok()) {
      resp.set_status_message(std::string(st.message()));
      resp.clear_response();
    }
    if (!stream->Write(resp)) break;
  }
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.erase(ctx);
  if (draining_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining");
  return grpc::Status::OK;
}

void ExpertServiceImpl::Drain() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  draining_ = true;
  for (auto& [ctx, idle] : streams_) {
    if (idle) ctx->TryCancel();
  }
}

grpc::Status ExpertServiceImpl::GetInfo(grpc::ServerContext*, const moe::v1::GetInfoRequest*,
                                        moe::v1::ServerInfo* resp) {
  *resp = info_;
  return grpc::Status::OK;
}

}  // namespace moe
