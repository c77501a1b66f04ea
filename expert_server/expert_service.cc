#include "expert_server/expert_service.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/model_identity.h"
#include "core/status_macros.h"
#include "transport/wire.h"

namespace moe {

uint64_t MaxMessageBytes(const ModelSpec& spec, const ServiceLimits& limits) {
  const uint64_t per_token = uint64_t(spec.hidden) * 4 + uint64_t(spec.num_experts) * 8;
  return uint64_t(limits.max_tokens_per_request + 1) * per_token + (1u << 20);
}

ExpertServiceImpl::ExpertServiceImpl(const ModelSpec& spec, BatchHandler handler,
                                     ServiceLimits limits, moe::v1::ServerInfo info,
                                     ExpertServerMetrics* metrics)
    : spec_(spec),
      handler_(std::move(handler)),
      limits_(limits),
      info_(std::move(info)),
      slice_{static_cast<int>(info_.slice_index()), std::max(1, static_cast<int>(info_.slice_count()))},
      metrics_(metrics) {
  for (int i = 0; i < kStreamWorkers; ++i)
    workers_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "moe-stream");
      std::unique_lock<std::mutex> lock(jobs_mu_);
      for (;;) {
        jobs_cv_.wait(lock, [this] { return stop_workers_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, nothing left
        std::function<void()> job = std::move(jobs_.front());
        jobs_.pop_front();
        lock.unlock();
        job();
        lock.lock();
      }
    });
}

// The gRPC server has shut down (every stream is done) before this runs.
ExpertServiceImpl::~ExpertServiceImpl() {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    stop_workers_ = true;
  }
  jobs_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ExpertServiceImpl::RunOnStreamWorker(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    jobs_.push_back(std::move(job));
  }
  jobs_cv_.notify_one();
}

namespace {

// Returns p if it is aligned for T, else a copy of the bytes in `copy`.
template <typename T>
const T* Aligned(const void* p, size_t count, std::vector<T>* copy) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) == 0) return static_cast<const T*>(p);
  copy->resize(count);
  std::memcpy(copy->data(), p, count * sizeof(T));
  return copy->data();
}

void FillStats(const ForwardStats& stats, moe::v1::ForwardStats* out) {
  out->set_distinct_experts(stats.distinct_experts);
  out->set_pairs(stats.pairs);
  out->set_compute_ns(stats.compute_ns);
  out->set_queue_ns(stats.queue_ns);
}

}  // namespace

absl::Status ExpertServiceImpl::Prepare(const WireForwardRequest& req, Prepared* p) const {
  const int64_t H = spec_.hidden;
  MOE_ASSIGN_OR_RETURN(const TensorView tokens, DecodeTensor(req.tokens, "tokens", DType::kBF16, {-1, H}));
  const int64_t n = tokens.shape[0];
  if (n == 0) return absl::InvalidArgumentError("tokens: empty batch (0 tokens)");
  if (n > limits_.max_tokens_per_request)
    return absl::OutOfRangeError(absl::StrCat("tokens: ", n, " tokens exceed max_tokens_per_request ",
                                              limits_.max_tokens_per_request));
  MOE_ASSIGN_OR_RETURN(const TensorView ids, DecodeTensor(req.expert_ids, "expert_ids", DType::kI32, {n, -1}));
  const int64_t k = ids.shape[1];
  if (k == 0 || k > spec_.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("expert_ids.shape[1]: ", k, " pairs per token, must be in [1, ",
                                                   spec_.num_experts, "]"));
  MOE_ASSIGN_OR_RETURN(const TensorView weights,
                       DecodeTensor(req.expert_weights, "expert_weights", DType::kF32, {n, k}));
  switch (static_cast<moe::v1::DType>(req.output_dtype)) {
    case moe::v1::DTYPE_UNSPECIFIED:
    case moe::v1::DTYPE_BF16: p->out_dtype = DType::kBF16; break;
    case moe::v1::DTYPE_F32: p->out_dtype = DType::kF32; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "output_dtype: ", ProtoDTypeName(static_cast<moe::v1::DType>(req.output_dtype)), " not supported (BF16 or F32)"));
  }
  if (req.layer >= static_cast<uint32_t>(spec_.num_layers))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", req.layer, " out of range [0, ", spec_.num_layers, ")"));
  if (!(req.slice == slice_))
    return absl::FailedPreconditionError(absl::StrCat("slice_index/slice_count: this server holds slice ",
                                                      slice_.ToString(), " of every expert, the request expects ",
                                                      req.slice.ToString()));
  if (req.model_identity != 0 && req.model_identity != info_.model_identity())
    return absl::FailedPreconditionError(absl::StrCat(
        "model identity: this expert server serves ",
        ModelIdentity{info_.model_identity(), info_.model_path()}.ToString(), ", the request is for model ",
        IdentityHex(req.model_identity), " (model_identity); the experts of two models are never mixed"));
  if (req.stripe.count < 0 || req.stripe.count > StripeOf::kMaxCount)
    return absl::InvalidArgumentError(absl::StrCat("stripe_count: ", req.stripe.count, " stripes, at most ",
                                                   StripeOf::kMaxCount));
  // The stripes of a batch are computed as one batch: together within
  // max_tokens_per_request, as the batch itself would have to be (a client's
  // stripes differ by at most one row).
  if (req.stripe.striped() &&
      n > (limits_.max_tokens_per_request + req.stripe.count - 1) / req.stripe.count)
    return absl::OutOfRangeError(absl::StrCat("tokens: ", n, " tokens in one of ", req.stripe.count,
                                              " stripes exceed max_tokens_per_request ",
                                              limits_.max_tokens_per_request, " for the batch"));
  p->n = n;
  p->batch.stripe = req.stripe;
  p->batch.layer = static_cast<int>(req.layer);
  p->batch.n = static_cast<int>(n);
  p->batch.tokens = Aligned<bf16_t>(tokens.data, size_t(n * H), &p->tok_copy);
  p->batch.routing = RoutingView{static_cast<int>(n), static_cast<int>(k),
                                 Aligned<int32_t>(ids.data, size_t(n * k), &p->id_copy),
                                 Aligned<float>(weights.data, size_t(n * k), &p->w_copy)};
  return absl::OkStatus();
}

absl::Status ExpertServiceImpl::Handle(const moe::v1::ForwardRequest& req,
                                       moe::v1::ForwardResponse* resp) {
  Prepared p;
  MOE_RETURN_IF_ERROR(Prepare(ViewOf(req), &p));
  const int64_t H = spec_.hidden;
  moe::v1::Tensor* out = resp->mutable_output();
  out->set_dtype(ToProtoDType(p.out_dtype));
  out->clear_shape();
  out->add_shape(p.n);
  out->add_shape(H);
  std::string* data = out->mutable_data();
  data->resize(size_t(p.n * H) * DTypeSize(p.out_dtype));
  ForwardStats stats;
  if (absl::Status st = handler_(p.batch, p.out_dtype, data->data(), &stats); !st.ok()) {
    resp->clear_output();
    return st;
  }
  resp->set_request_id(req.request_id());
  FillStats(stats, resp->mutable_stats());
  return absl::OkStatus();
}

void ExpertServiceImpl::Record(const absl::Status& st, size_t in_bytes, size_t out_bytes,
                               std::chrono::steady_clock::time_point t0) const {
  if (metrics_ == nullptr) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  // Payload bytes: the messages as serialized (gRPC framing and HTTP/2 not counted).
  metrics_->RecordRequest(ExpertServerMetrics::Transport::kGrpc, st.code(), in_bytes, st.ok() ? out_bytes : 0,
                          static_cast<uint64_t>(ns));
}

grpc::Status ExpertServiceImpl::Forward(grpc::ServerContext*, const moe::v1::ForwardRequest* req,
                                        moe::v1::ForwardResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = Handle(*req, resp);
  if (metrics_ != nullptr) Record(st, req->ByteSizeLong(), resp->ByteSizeLong(), t0);
  return ToGrpcStatus(st);
}

grpc::ByteBuffer ExpertServiceImpl::HandleStreamMessage(grpc::ByteBuffer& in, ForwardRequestStorage& storage,
                                                        absl::Status* end_stream) {
  const auto t0 = std::chrono::steady_clock::now();
  WireForwardRequest req;
  absl::Status st = ParseForwardRequest(in, storage, &req);
  // Bytes that are no ForwardRequest and carry no id to answer to end the
  // stream (the client cannot match an answer); any other error is answered.
  if (!st.ok() && req.request_id == 0) *end_stream = st;
  Prepared p;
  if (st.ok()) st = Prepare(req, &p);
  MessageBufferPool::Buffer out;
  ForwardStats stats;
  if (st.ok()) {
    out = pool_->Get(size_t(p.n * spec_.hidden) * DTypeSize(p.out_dtype));
    st = handler_(p.batch, p.out_dtype, out.data(), &stats);
  }
  moe::v1::ForwardStats proto_stats;
  FillStats(stats, &proto_stats);
  grpc::ByteBuffer answer =
      EncodeForwardStreamResponse(req.request_id, st, p.out_dtype, p.n, spec_.hidden, std::move(out), proto_stats);
  Record(st, in.Length(), answer.Length(), t0);
  return answer;
}

// One ForwardStream: read a request, compute it (on gRPC's callback thread
// when small, else on a stream worker) or answer it "draining", write the
// answer, read the next. gRPC calls the On* methods; Finish ends the stream
// once, after which OnDone frees it.
// Decisions are taken under the service's streams_mu_, gRPC is called after
// it is released (gRPC may run a reaction inline, within a Start* call).
class ExpertServiceImpl::StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit StreamReactor(ExpertServiceImpl* service) : service_(service) {
    Step step;
    {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      if (service_->draining_) {
        step = EndLocked(Draining());
      } else {
        service_->streams_.insert(this);
        step = ReadLocked();
      }
    }
    Take(step);
  }

  void OnReadDone(bool ok) override {
    Step step;
    {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      if (finished_) return;
      if (!ok) {  // the client closed its side (or went away)
        step = EndLocked(service_->draining_ ? Draining() : grpc::Status::OK);
      } else if (service_->draining_) {
        // A request still arriving (queued behind the one computed, or sent
        // before the client saw the drain) is answered UNAVAILABLE "server is
        // draining", so the client knows to go elsewhere.
        out_ = service_->DrainingAnswer(in_, storage_);
        step = WriteLocked();
      } else {
        computing_ = true;
      }
    }
    if (step.what != Step::kNone) return Take(step);
    auto compute = [this] {
      absl::Status end_stream;
      grpc::ByteBuffer answer = service_->HandleStreamMessage(in_, storage_, &end_stream);
      Step next;
      {
        std::lock_guard<std::mutex> lock(service_->streams_mu_);
        computing_ = false;
        if (!end_stream.ok()) {  // bytes that are no request and carry no id: the stream ends
          next = EndLocked(ToGrpcStatus(end_stream));
        } else {
          out_ = std::move(answer);
          next = WriteLocked();
        }
      }
      Take(next);
    };
    // A small request is computed right here, on gRPC's callback thread: the
    // hand-off to a stream worker (a queue and a thread wake-up) cost
    // ~40-60 us of a ~120 us round trip. Only InlineRequestLimit() at once,
    // so that computation never holds all of gRPC's threads; the rest go to
    // the workers.
    if (in_.Length() <= kInlineRequestBytes && service_->TryEnterInline()) {
      compute();
      service_->inline_requests_.fetch_sub(1, std::memory_order_relaxed);
    } else {
      service_->RunOnStreamWorker(std::move(compute));
    }
  }

  void OnWriteDone(bool ok) override {
    Step step;
    {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      writing_ = false;
      if (finished_) return;
      if (!ok) {
        step = EndLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream broke while writing an answer"));
      } else if (service_->DrainPastGrace()) {
        step = EndLocked(Draining());
      } else {
        step = ReadLocked();
      }
    }
    Take(step);
  }

  // Past the drain's grace: a stream waiting for its next request is to end
  // UNAVAILABLE "server is draining" (true: call Finish below, without
  // streams_mu_); one computing or writing ends after its answer
  // (OnWriteDone). streams_mu_ held.
  bool EndIfWaitingLocked() {
    if (finished_ || computing_ || writing_) return false;
    finished_ = true;
    if (!issuing_read_) return true;
    finish_when_issued_ = true;  // Take calls Finish once its StartRead returned
    return false;
  }
  void FinishDraining() { Finish(Draining()); }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      service_->streams_.erase(this);
      if (issuing_read_) {  // Take still reads our fields once StartRead returns: it deletes us
        done_when_issued_ = true;
        return;
      }
    }
    delete this;
  }

 private:
  struct Step {
    enum What { kNone, kRead, kWrite, kFinish } what = kNone;
    grpc::Status status;
  };
  static grpc::Status Draining() { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining"); }
  Step ReadLocked() { return Step{Step::kRead, {}}; }
  Step WriteLocked() {
    writing_ = true;
    return Step{Step::kWrite, {}};
  }
  Step EndLocked(const grpc::Status& status) {
    if (finished_) return Step{};
    finished_ = true;
    return Step{Step::kFinish, status};
  }
  void Take(const Step& step) {
    switch (step.what) {
      case Step::kNone: break;
      case Step::kRead: {
        // Drain may end the stream meanwhile: it leaves the Finish to us
        // then, so that no read starts after it.
        {
          std::lock_guard<std::mutex> lock(service_->streams_mu_);
          if (finished_) return;
          issuing_read_ = true;
        }
        StartRead(&in_);
        bool finish, done;
        {
          std::lock_guard<std::mutex> lock(service_->streams_mu_);
          issuing_read_ = false;
          finish = finish_when_issued_;
          done = done_when_issued_;
        }
        if (done) {  // the read completed, the stream ended and OnDone ran meanwhile
          delete this;
          return;
        }
        if (finish) Finish(Draining());
        break;
      }
      case Step::kWrite: StartWrite(&out_); break;
      case Step::kFinish: Finish(step.status); break;
    }
  }

  ExpertServiceImpl* const service_;
  grpc::ByteBuffer in_, out_;
  ForwardRequestStorage storage_;
  // Guarded by service_->streams_mu_:
  bool computing_ = false, writing_ = false, finished_ = false;
  bool issuing_read_ = false, finish_when_issued_ = false, done_when_issued_ = false;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::ForwardStream(
    grpc::CallbackServerContext*) {
  return new StreamReactor(this);
}

int ExpertServiceImpl::InlineRequestLimit() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 4, 1, 4);
}

bool ExpertServiceImpl::TryEnterInline() {
  static const int limit = InlineRequestLimit();
  if (inline_requests_.fetch_add(1, std::memory_order_relaxed) < limit) return true;
  inline_requests_.fetch_sub(1, std::memory_order_relaxed);
  return false;
}

bool ExpertServiceImpl::DrainPastGrace() const {
  return draining_ && std::chrono::steady_clock::now() - drain_started_ >= kDrainGrace;
}

grpc::ByteBuffer ExpertServiceImpl::DrainingAnswer(grpc::ByteBuffer& in, ForwardRequestStorage& storage) {
  WireForwardRequest req;
  (void)ParseForwardRequest(in, storage, &req);  // for its id; the request is not computed
  return EncodeForwardStreamResponse(req.request_id, absl::UnavailableError("server is draining"), DType::kBF16, 0,
                                     spec_.hidden, MessageBufferPool::Buffer(), moe::v1::ForwardStats());
}

void ExpertServiceImpl::Drain() {
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    draining_ = true;
    drain_started_ = std::chrono::steady_clock::now();
  }
  // Requests the clients sent before they saw the drain are still arriving:
  // they get their UNAVAILABLE answers (ForwardStreamRaw) during this grace —
  // on the streams already open, and on streams gRPC accepted whose handler
  // has not started yet (refused whole, UNAVAILABLE, when it starts; without
  // the grace the server's shutdown would cancel them, and a busy host can
  // take that long to start a handler). Then the streams waiting for more are
  // ended (the gRPC server's shutdown would otherwise wait the whole drain
  // deadline for them).
  std::this_thread::sleep_for(kDrainGrace);
  std::vector<StreamReactor*> waiting;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    for (StreamReactor* stream : streams_)
      if (stream->EndIfWaitingLocked()) waiting.push_back(stream);
  }
  // Each lives until its Finish (OnDone comes after it).
  for (StreamReactor* stream : waiting) stream->FinishDraining();
}

grpc::Status ExpertServiceImpl::GetInfo(grpc::ServerContext*, const moe::v1::GetInfoRequest*,
                                        moe::v1::ServerInfo* resp) {
  *resp = info_;
  return grpc::Status::OK;
}

}  // namespace moe
