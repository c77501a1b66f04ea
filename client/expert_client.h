// ExpertClient: a blocking client for one CPU expert server (moe.v1.ExpertService)
// over gRPC — unary Forward, a long-lived ForwardStream, GetInfo. Used by the
// demo, the tests and benchmarks; the GPU worker's transport builds on the same
// wire helpers. Forward/GetInfo are thread-safe; a StreamSession is used by one
// thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/routing.h"
#include "transport/transport.h"
#include "moe/v1/expert.grpc.pb.h"

namespace moe {

class ExpertClient {
 public:
  // A channel to host:port (connected lazily) with TLS / mTLS from `tls`
  // (plaintext only with tls.insecure); max_message_bytes bounds both directions.
  static absl::StatusOr<std::unique_ptr<ExpertClient>> Connect(const std::string& address,
                                                               const TlsOptions& tls,
                                                               int max_message_bytes = 256 << 20);

  absl::StatusOr<moe::v1::ServerInfo> GetInfo(int timeout_ms = 10000);

  // Builds the request of one layer's batch: tokens [n, H] bf16, routing [n, k].
  static moe::v1::ForwardRequest MakeRequest(int layer, int n, int hidden, const bf16_t* tokens,
                                             const RoutingView& routing, uint64_t request_id = 0);

  // Unary Forward; returns the output [n, H] as bf16.
  absl::StatusOr<std::vector<bf16_t>> Forward(const moe::v1::ForwardRequest& req, int timeout_ms = 60000);
  // The raw call, for callers that want the full response or a bad request's status.
  absl::Status Call(const moe::v1::ForwardRequest& req, moe::v1::ForwardResponse* resp,
                    int timeout_ms = 60000);

  // One bidirectional ForwardStream: write requests, read responses in order.
  class StreamSession {
   public:
    ~StreamSession();
    bool Write(const moe::v1::ForwardRequest& req);
    // Next response; Unavailable once the stream has ended.
    absl::StatusOr<moe::v1::ForwardStreamResponse> Read();
    // Half-closes and returns the stream's final status.
    absl::Status Finish();

   private:
    friend class ExpertClient;
    std::unique_ptr<grpc::ClientContext> ctx_;
    std::unique_ptr<grpc::ClientReaderWriter<moe::v1::ForwardRequest, moe::v1::ForwardStreamResponse>> rw_;
    bool finished_ = false;
  };
  std::unique_ptr<StreamSession> OpenStream();

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::ExpertService::Stub> stub_;
};

// Output tensor of a response as bf16 values (converting from F32 if needed).
absl::StatusOr<std::vector<bf16_t>> OutputAsBf16(const moe::v1::ForwardResponse& resp);

}  // namespace moe
