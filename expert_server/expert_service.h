// ExpertServiceImpl: the gRPC face of the CPU expert server (moe.v1.ExpertService).
// Decodes and validates requests (INVALID_ARGUMENT / OUT_OF_RANGE naming the
// field), runs them on the MoeExecutor and encodes the partial outputs.
// With an ExpertServerMetrics, Forward and ForwardStream record every answered
// request (transport "grpc"). gRPC calls its methods from many threads at
// once; that is safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "model/model_spec.h"
#include "transport/grpc_wire.h"
#include "expert_server/expert_metrics.h"
#include "expert_compute/moe_executor.h"
#include "moe/v1/expert.grpc.pb.h"

namespace moe {

// Computes one decoded, shape-checked batch into out ([n, H] of out_dtype).
// The expert server passes MoeExecutor::Forward; benchmarks pass an echo.
using BatchHandler =
    std::function<absl::Status(const MoeBatch& batch, DType out_dtype, void* out, ForwardStats* stats)>;

struct ServiceLimits {
  int max_tokens_per_request = 8192;
};

// The largest gRPC message a request within `limits` can take for `spec`
// (tokens, a full [n, num_experts] routing, framing), with headroom.
uint64_t MaxMessageBytes(const ModelSpec& spec, const ServiceLimits& limits);

// ForwardStream is served by callback reactors (StreamReactor): an open
// stream holds no thread while it waits for its next request (a thread per
// stream let one client's 3,000 idle streams cost the server 3,013 threads);
// requests are computed by kStreamWorkers threads shared by every stream,
// except small ones (kInlineRequestBytes), of which up to InlineRequestLimit()
// at once are computed on the gRPC callback thread that read them (no
// hand-off). Worker threads are named "moe-stream".
class ExpertServiceImpl final : public moe::v1::ExpertService::WithRawCallbackMethod_ForwardStream<
                                    moe::v1::ExpertService::Service> {
 public:
  // `metrics` (may be null: none recorded) must outlive the service.
  ExpertServiceImpl(const ModelSpec& spec, BatchHandler handler, ServiceLimits limits,
                    moe::v1::ServerInfo info, ExpertServerMetrics* metrics = nullptr);
  ~ExpertServiceImpl() override;

  grpc::Status Forward(grpc::ServerContext* ctx, const moe::v1::ForwardRequest* req,
                       moe::v1::ForwardResponse* resp) override;
  // ForwardStream's messages as raw bytes (grpc_wire.h): the same wire
  // format, without protobuf's copies of the tensors. One request of a
  // stream at a time, answered in order.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::Status GetInfo(grpc::ServerContext* ctx, const moe::v1::GetInfoRequest* req,
                       moe::v1::ServerInfo* resp) override;

  // Starts draining: open streams finish the request they are computing;
  // every request still arriving on them (queued behind it, or sent before the
  // client saw the drain) is answered UNAVAILABLE "server is draining"; after
  // kDrainGrace every stream ends with status UNAVAILABLE "server is
  // draining" once its request in progress is answered (never CANCELLED).
  // Unary calls in flight complete. Blocks for kDrainGrace. Call before
  // grpc::Server::Shutdown.
  void Drain();
  static constexpr std::chrono::milliseconds kDrainGrace{200};
  // Threads computing stream requests, shared by all streams.
  static constexpr int kStreamWorkers = 16;
  // Requests of at most this many bytes (~17 tokens at H = 7168) are
  // computed where gRPC delivered them, up to InlineRequestLimit() at once
  // across all streams.
  static constexpr size_t kInlineRequestBytes = 256 << 10;
  // A quarter of the hardware threads, 1 to 4: at most half of the threads
  // gRPC 1.51 polls and runs callbacks on (half the cores, at least 2), so
  // that computation never holds all of them and every stream's reads go
  // on; a hostile client holds no more than that.
  static int InlineRequestLimit();

  // The whole request path without gRPC: decode, validate, compute, encode.
  // Records no metrics.
  absl::Status Handle(const moe::v1::ForwardRequest& req, moe::v1::ForwardResponse* resp);

 private:
  // A validated request: the batch (tensors aligned, copied if they were
  // not) and the output dtype.
  struct Prepared {
    MoeBatch batch;
    DType out_dtype = DType::kBF16;
    int64_t n = 0;
    std::vector<bf16_t> tok_copy;
    std::vector<int32_t> id_copy;
    std::vector<float> w_copy;
  };
  // Validates `req` (INVALID_ARGUMENT / OUT_OF_RANGE naming the field).
  absl::Status Prepare(const WireForwardRequest& req, Prepared* out) const;
  // Records an answered request in metrics_ (when set): bytes in and out, time since t0.
  void Record(const absl::Status& st, size_t in_bytes, size_t out_bytes,
              std::chrono::steady_clock::time_point t0) const;
  // One ForwardStream message in, its answer out (recorded in metrics_).
  // Bytes that are no ForwardRequest and carry no request id to answer set
  // *end_stream: the stream ends with that status.
  // The UNAVAILABLE "server is draining" answer to a stream message.
  grpc::ByteBuffer DrainingAnswer(grpc::ByteBuffer& in, ForwardRequestStorage& storage);
  grpc::ByteBuffer HandleStreamMessage(grpc::ByteBuffer& in, ForwardRequestStorage& storage,
                                       absl::Status* end_stream);

  class StreamReactor;
  // Runs `job` on a stream worker.
  void RunOnStreamWorker(std::function<void()> job);
  bool DrainPastGrace() const;  // streams_mu_ held
  // Claims one of the InlineRequestLimit() places (false: all taken).
  bool TryEnterInline();
  std::atomic<int> inline_requests_{0};

  const ModelSpec& spec_;
  BatchHandler handler_;
  ServiceLimits limits_;
  moe::v1::ServerInfo info_;
  const ExpertSlice slice_;  // the share every request must expect (info_'s)
  ExpertServerMetrics* metrics_;
  std::mutex streams_mu_;
  bool draining_ = false;
  std::chrono::steady_clock::time_point drain_started_{};  // guarded by streams_mu_
  std::set<StreamReactor*> streams_;  // open streams (guarded by streams_mu_)
  // The stream workers and their queue.
  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_workers_ = false;
  std::vector<std::thread> workers_;
  std::shared_ptr<MessageBufferPool> pool_ = MessageBufferPool::Create(16);  // response buffers
};

}  // namespace moe
