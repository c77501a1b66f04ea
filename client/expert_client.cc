#include "client/expert_client.h"

#include <chrono>
#include <cstring>

#include "core/tensor.h"
#include "transport/grpc_channel.h"
#include "transport/wire.h"
#include "grpcpp/grpcpp.h"

namespace moe {

namespace {
std::chrono::system_clock::time_point Deadline(int timeout_ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
}
}  // namespace

absl::StatusOr<std::unique_ptr<ExpertClient>> ExpertClient::Connect(const std::string& address,
                                                                    const TlsOptions& tls, int max_message_bytes) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(address, max_message_bytes, tls);
  if (!channel.ok()) return channel.status();
  auto c = std::unique_ptr<ExpertClient>(new ExpertClient());
  c->channel_ = *std::move(channel);
  c->stub_ = moe::v1::ExpertService::NewStub(c->channel_);
  return c;
}

absl::StatusOr<moe::v1::ServerInfo> ExpertClient::GetInfo(int timeout_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(timeout_ms));
  ctx.set_wait_for_ready(true);
  moe::v1::ServerInfo info;
  grpc::Status st = stub_->GetInfo(&ctx, moe::v1::GetInfoRequest(), &info);
  if (!st.ok()) return FromGrpcStatus(st);
  return info;
}

moe::v1::ForwardRequest ExpertClient::MakeRequest(int layer, int n, int hidden, const bf16_t* tokens,
                                                  const RoutingView& routing, uint64_t request_id) {
  moe::v1::ForwardRequest req;
  EncodeForwardRequest(static_cast<uint32_t>(layer), n, hidden, tokens, routing, request_id, &req);
  return req;
}

absl::Status ExpertClient::Call(const moe::v1::ForwardRequest& req, moe::v1::ForwardResponse* resp,
                                int timeout_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(timeout_ms));
  return FromGrpcStatus(stub_->Forward(&ctx, req, resp));
}

absl::StatusOr<std::vector<bf16_t>> ExpertClient::Forward(const moe::v1::ForwardRequest& req, int timeout_ms) {
  moe::v1::ForwardResponse resp;
  if (absl::Status st = Call(req, &resp, timeout_ms); !st.ok()) return st;
  return OutputAsBf16(resp);
}

absl::StatusOr<std::vector<bf16_t>> OutputAsBf16(const moe::v1::ForwardResponse& resp) {
  const moe::v1::Tensor& t = resp.output();
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < 0)
    return absl::InternalError("malformed response: output is not [n, H]");
  std::vector<bf16_t> out(static_cast<size_t>(t.shape(0) * t.shape(1)));
  if (absl::Status st = DecodeForwardOutput(resp, static_cast<int>(t.shape(0)), static_cast<int>(t.shape(1)), out.data());
      !st.ok())
    return st;
  return out;
}

std::unique_ptr<ExpertClient::StreamSession> ExpertClient::OpenStream() {
  auto s = std::unique_ptr<StreamSession>(new StreamSession());
  s->ctx_ = std::make_unique<grpc::ClientContext>();
  s->rw_ = stub_->ForwardStream(s->ctx_.get());
  return s;
}

ExpertClient::StreamSession::~StreamSession() {
  if (!finished_) {
    ctx_->TryCancel();
    (void)rw_->Finish();
  }
}

bool ExpertClient::StreamSession::Write(const moe::v1::ForwardRequest& req) { return rw_->Write(req); }

absl::StatusOr<moe::v1::ForwardStreamResponse> ExpertClient::StreamSession::Read() {
  moe::v1::ForwardStreamResponse resp;
  if (!rw_->Read(&resp)) return absl::UnavailableError("stream ended");
  return resp;
}

absl::Status ExpertClient::StreamSession::Finish() {
  rw_->WritesDone();
  finished_ = true;
  return FromGrpcStatus(rw_->Finish());
}

}  // namespace moe
