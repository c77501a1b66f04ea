// gRPC implementation of ExpertTransport: long-lived bidirectional
// ForwardStreams (grpc_streams of them, each on a connection of its own),
// all driven through gRPC's completion-queue async API by one thread
// (Submit queues the message and returns; writes go out one at a time in
// order, a read is always posted), requests matched to responses by request
// id. Messages are raw ByteBuffers (grpc_wire.h): the
// same bytes as protobuf's; a request's tokens are copied once on their way
// out by Submit and not at all by SubmitStaged (gRPC writes them from the
// staging area), the output once on its way in. With grpc_unary,
// one callback-API unary call per batch (protobuf messages).
// A large batch is striped: its rows split into up to one request per stream,
// at least kMinStripeBytes each, sent at once over the streams' connections
// (one gRPC connection moves ~1-1.6 GB/s however large the message; over
// eight a 7.4 MB round trip went from 4.1x to 1.7x the Unix socket's), each answered on its own stream straight into its rows of
// the output, one future for all of them; the server computes the stripes of
// one batch together (ForwardRequest.stripe_group, MoeExecutor).
// A broken stream fails its in-flight requests with UNAVAILABLE and the next
// Submit opens a new one (the channel reconnects underneath).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "core/tensor.h"
#include "transport/grpc_channel.h"
#include "transport/grpc_wire.h"
#include "grpcpp/generic/generic_stub.h"
#include "transport/pending_requests.h"
#include "transport/transport.h"
#include "transport/wire.h"
#include "moe/v1/expert.grpc.pb.h"

namespace moe {
namespace {

// Least request bytes of a stripe: a batch of fewer than two times this
// goes whole (a stripe's own cost, a message each way and a request id, is
// ~100 us of gRPC's; on the AMX host a 115 KB batch in two stripes took
// 166-209 us against 198-204 whole, a 0.9 MB one in four 0.48-0.62 ms
// against 1.15-1.19).
constexpr size_t kMinStripeBytes = 48 << 10;

void EncodeBatch(const MoeBatch& b, int hidden, uint64_t id, ExpertSlice slice, moe::v1::ForwardRequest* req) {
  EncodeForwardRequest(static_cast<uint32_t>(b.layer), b.n, hidden, b.tokens, b.routing, id, req, slice);
}

std::chrono::system_clock::time_point ToSystem(Clock::time_point t) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
}

class GrpcTransport final : public ExpertTransport {
 public:
  // `channels`: one per stream (at least one); unary calls use the first.
  GrpcTransport(std::string address, std::vector<std::shared_ptr<grpc::Channel>> channels, const TransportOptions& o,
                ExpertSlice slice)
      : slice_(slice),
        model_(o.model),
        address_(std::move(address)),
        channels_(std::move(channels)),
        stub_(moe::v1::ExpertService::NewStub(channels_[0])),
        hidden_(o.hidden),
        unary_(o.grpc_unary),
        streams_(channels_.size()) {
    for (const auto& ch : channels_) generics_.push_back(std::make_unique<grpc::GenericStub>(ch));
  }

  ~GrpcTransport() override {
    {  // a probe in flight calls back into this object (cancelled outside the lock its callback takes)
      std::shared_ptr<ProbeCall> p;
      {
        std::lock_guard<std::mutex> lock(probe_mu_);
        p = probe_;
      }
      if (p != nullptr) p->ctx.TryCancel();
      std::unique_lock<std::mutex> lock(probe_mu_);
      probe_cv_.wait(lock, [&] { return probe_ == nullptr; });
    }
    stop_connector_ = true;
    if (connector_.joinable()) connector_.join();
    std::vector<std::shared_ptr<Stream>> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : streams_)
        if (s) streams.push_back(std::move(s));
      streams.insert(streams.end(), retired_.begin(), retired_.end());
      retired_.clear();
    }
    for (auto& s : streams) s->ctx.TryCancel();
    {  // each stream ends once its cancelled operations came back
      std::unique_lock<std::mutex> lock(mu_);
      streams_cv_.wait(lock, [&] {
        return std::all_of(streams.begin(), streams.end(), [](const std::shared_ptr<Stream>& s) { return s->done; });
      });
    }
    cq_.Shutdown();
    if (driver_.joinable()) driver_.join();
    // Unary calls still in flight hold a reference to nothing but their own
    // state; wait for them so their callbacks do not outlive pending_.
    std::unique_lock<std::mutex> lock(mu_);
    unary_cv_.wait(lock, [&] { return unary_in_flight_ == 0; });
  }

  const char* kind() const override { return unary_ ? "grpc-unary" : "grpc-stream"; }
  uint64_t requests_sent() const override { return requests_sent_.load(std::memory_order_relaxed); }
  ExpertSlice slice() const override { return slice_; }

  // OK when every channel is connected; otherwise UNAVAILABLE at once, and a
  // connector thread drives the channels' reconnection until they are: gRPC
  // makes progress on a connection attempt only while someone polls for it
  // (else its backup poller, every 5 s), so asking the channel to connect is
  // not enough — a restarted server was seen ~2 s late that way.
  absl::Status Reconnect() override {
    bool ready = true;
    for (const auto& ch : channels_) ready = ch->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY && ready;
    if (ready) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(connector_mu_);
    if (!connecting_.load()) {
      if (connector_.joinable()) connector_.join();  // the last one ended (connected, then lost again)
      connecting_ = true;
      connector_ = std::thread([this] {
        for (const auto& ch : channels_)
          while (!stop_connector_.load() &&
                 !ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::milliseconds(100))) {
          }
        connecting_ = false;
      });
    }
    return absl::UnavailableError(absl::StrCat("expert server ", address_, ": not connected"));
  }

  absl::Status Probe(std::chrono::milliseconds timeout) override {
    MOE_RETURN_IF_ERROR(Reconnect());  // not connected: the connector thread drives it
    std::shared_ptr<ProbeCall> p;
    {
      std::lock_guard<std::mutex> lock(probe_mu_);
      if (probe_answered_) {
        probe_answered_ = false;
        return absl::OkStatus();
      }
      if (probe_ == nullptr) {
        p = probe_ = std::make_shared<ProbeCall>();
        p->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
      }
    }
    if (p != nullptr)  // started outside the lock: gRPC may run the callback at once
      stub_->async()->GetInfo(&p->ctx, &p->req, &p->info, [this, p](grpc::Status st) {
        std::lock_guard<std::mutex> lock(probe_mu_);
        probe_answered_ = st.ok();
        probe_.reset();
        probe_cv_.notify_all();
      });
    return absl::UnavailableError(absl::StrCat("expert server ", address_, ": no sign of life yet (probing)"));
  }

  absl::StatusOr<StagingArea> Stage(int n, int k, Clock::time_point) override {
    if (n < 1 || k < 1) return absl::InvalidArgumentError("Stage: n and k must be >= 1");
    auto buf = std::make_shared<Staging>();
    buf->tokens.resize(size_t(n) * hidden_);
    buf->ids.resize(size_t(n) * k);
    buf->weights.resize(size_t(n) * k);
    buf->output.resize(size_t(n) * hidden_);
    StagingArea s{buf->tokens.data(), buf->ids.data(), buf->weights.data(), buf->output.data(), n, k, 0};
    std::lock_guard<std::mutex> lock(mu_);
    s.handle = ++next_staging_;
    staging_[s.handle] = std::move(buf);
    return s;
  }

  // The stream sends the staged tokens without copying them: gRPC holds
  // the staging area (not freed by Release) until it has written them.
  std::future<absl::Status> SubmitStaged(const StagingArea& s, uint32_t layer, Clock::time_point deadline) override {
    std::shared_ptr<Staging> staged;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = staging_.find(s.handle);
      if (it == staging_.end()) {
        std::promise<absl::Status> p;
        p.set_value(absl::InvalidArgumentError("SubmitStaged: unknown or released handle"));
        return p.get_future();
      }
      staged = it->second;
    }
    const MoeBatch b{static_cast<int>(layer), s.n, s.tokens, RoutingView{s.n, s.k, s.expert_ids, s.expert_weights}};
    bf16_t* out = staged->output.data();
    return unary_ ? SubmitUnary(b, out, deadline) : SubmitStream(b, out, deadline, std::move(staged));
  }

  void Release(const StagingArea& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    staging_.erase(s.handle);
  }

  std::future<absl::Status> Submit(const MoeBatch& b, bf16_t* out, Clock::time_point deadline) override {
    return unary_ ? SubmitUnary(b, out, deadline) : SubmitStream(b, out, deadline);
  }

 private:
  enum Op : intptr_t { kStart = 0, kWrite, kRead, kFinish };
  struct Stream;
  struct OpTag {
    Stream* stream;
    Op op;
  };
  // One ForwardStream; its operations complete on the transport's queue.
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw;
    OpTag tags[4];
    uint64_t generation = 0;
    // Guarded by GrpcTransport::mu_:
    bool started = false;   // StartCall completed
    bool broken = false;    // no new requests on this stream
    bool writing = false;   // a Write is out
    bool reading = false;   // a Read is out
    bool finishing = false; // Finish called
    bool finished = false;  // Finish came back
    int ops = 0;            // operations out on the queue
    // Requests sent and not yet answered: up under mu_ when one is queued,
    // down by the driver thread when an answer is read, before its caller
    // learns of it (a caller that sends its next batch at once finds the
    // stream idle).
    std::atomic<int> outstanding{0};
    std::deque<grpc::ByteBuffer> queue;  // messages not yet written
    grpc::ByteBuffer in;    // the posted Read's message (driver thread)
    grpc::Status status;    // Finish's
    bool done = false;      // finished with nothing out: its requests failed, the driver is done with it
  };
  static void* TagOf(Stream& s, Op op) { return &s.tags[op]; }

  // Stripes of a batch of n rows of `row_bytes` each over `streams`.
  static int StripesOf(int n, size_t row_bytes, size_t streams) {
    const size_t by_size = std::max<size_t>(1, size_t(n) * row_bytes / kMinStripeBytes);
    return static_cast<int>(std::max<size_t>(1, std::min({by_size, streams, size_t(n), size_t(StripeOf::kMaxCount)})));
  }

  // With `tokens_owner`, b.tokens are lent to gRPC (EncodeForwardRequestBuffer).
  std::future<absl::Status> SubmitStream(const MoeBatch& b, bf16_t* out, Clock::time_point deadline,
                                         std::shared_ptr<const void> tokens_owner = nullptr) {
    const size_t row_bytes = size_t(hidden_) * sizeof(bf16_t) + size_t(b.routing.k) * 8;
    const int stripes = StripesOf(b.n, row_bytes, streams_.size());
    std::future<absl::Status> fut;
    std::shared_ptr<PendingRequests::Group> group;
    StripeOf stripe;
    if (stripes > 1) {
      group = std::make_shared<PendingRequests::Group>(stripes);
      fut = group->future();
      stripe = StripeOf{stripe_salt_ ^ next_stripe_group_.fetch_add(1, std::memory_order_relaxed), stripes};
      if (stripe.group == 0) stripe.group = stripe_salt_ | 1;
    }
    std::lock_guard<std::mutex> lock(mu_);
    requests_sent_.fetch_add(static_cast<uint64_t>(stripes), std::memory_order_relaxed);
    for (int i = 0; i < stripes; ++i) {
      const int r0 = static_cast<int>(int64_t(b.n) * i / stripes), r1 = static_cast<int>(int64_t(b.n) * (i + 1) / stripes);
      const size_t slot = stripes > 1 ? size_t(i) : StreamForBatchLocked();
      std::shared_ptr<Stream>& s = streams_[slot];
      if (!s || s->broken) OpenStreamLocked(s, *generics_[slot]);
      ++s->outstanding;
      const uint64_t id = group != nullptr ? pending_.AddToGroup(out + size_t(r0) * hidden_, r1 - r0, s->generation, deadline, group)
                                           : pending_.Add(out, b.n, s->generation, deadline, &fut);
      const RoutingView r{r1 - r0, b.routing.k, b.routing.ids + size_t(r0) * b.routing.k,
                          b.routing.weights + size_t(r0) * b.routing.k};
      s->queue.push_back(EncodeForwardRequestBuffer(static_cast<uint32_t>(b.layer), r1 - r0, hidden_,
                                                    b.tokens + size_t(r0) * hidden_, r, id, *pool_, slice_,
                                                    model_.digest, tokens_owner, stripe));
      WriteNextLocked(*s);
    }
    return fut;
  }

  // A whole batch's stream: the first with nothing outstanding (a lone
  // caller keeps using one warm stream: a stream idle since long wakes up
  // slowly, 147 against 72 us per 1-token round trip when batches took turns
  // over four), else the next in turn.
  size_t StreamForBatchLocked() {
    for (size_t i = 0; i < streams_.size(); ++i)
      if (!streams_[i] || streams_[i]->broken || streams_[i]->outstanding.load(std::memory_order_relaxed) == 0) return i;
    return next_stream_++ % streams_.size();
  }

  // Starts the next queued write unless one is out (gRPC allows one at a time).
  void WriteNextLocked(Stream& s) {
    if (!s.started || s.writing || s.broken || s.queue.empty()) return;
    s.writing = true;
    ++s.ops;
    s.rw->Write(s.queue.front(), TagOf(s, kWrite));  // the ByteBuffer's slices are referenced, not copied
    s.queue.pop_front();
  }

  // Once broken with nothing out, asks for the stream's status.
  void MaybeFinishLocked(Stream& s) {
    if (!s.broken || s.finishing || s.writing || s.reading) return;
    s.finishing = true;
    ++s.ops;
    s.rw->Finish(&s.status, TagOf(s, kFinish));
  }

  // (Re)opens the stream in `slot`, on `stub`'s channel.
  void OpenStreamLocked(std::shared_ptr<Stream>& slot, grpc::GenericStub& stub) {
    if (slot) {
      slot->broken = true;
      slot->ctx.TryCancel();
      retired_.push_back(slot);
    }
    // Forget the streams that have ended (the driver is done with them).
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(), [](const auto& r) { return r->done; }),
                   retired_.end());
    auto s = std::make_shared<Stream>();
    for (Op op : {kStart, kWrite, kRead, kFinish}) s->tags[op] = OpTag{s.get(), op};
    s->generation = ++generation_;
    s->rw = stub.PrepareCall(&s->ctx, "/moe.v1.ExpertService/ForwardStream", &cq_);
    ++s->ops;
    s->rw->StartCall(TagOf(*s, kStart));
    slot = s;
  }

  // The one thread that drives every stream's operations: one poller for the
  // transport's connections (a thread per stream made each a poller of
  // gRPC's one epoll set, and an answer read by another stream's thread
  // crossed to its own: 118-127 us per 1-token round trip over four or eight
  // streams against 75 over one, GPU host).
  void Drive() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      Stream& s = *static_cast<OpTag*>(tag)->stream;
      const Op op = static_cast<OpTag*>(tag)->op;
      if (op == kRead && ok) {
        int left = s.outstanding.load(std::memory_order_relaxed);
        while (left > 0 && !s.outstanding.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
        }
      }
      const bool corrupt = op == kRead && ok && !OnResponse(s.in);  // outside mu_: it copies the output
      std::unique_lock<std::mutex> lock(mu_);
      --s.ops;
      if (corrupt && !s.broken) {  // a server that sends garbage: drop the stream
        s.broken = true;
        s.ctx.TryCancel();
      }
      switch (op) {
        case kStart:
          s.started = true;
          if (!ok) s.broken = true;
          break;
        case kWrite:
          s.writing = false;
          if (!ok) s.broken = true;
          break;
        case kRead:
          s.reading = false;
          if (!ok) s.broken = true;
          break;
        case kFinish:
          s.finished = true;
          break;
      }
      if (!s.finished) {
        if (!s.broken && !s.reading) {
          s.in.Clear();
          s.reading = true;
          ++s.ops;
          s.rw->Read(&s.in, TagOf(s, kRead));
        }
        WriteNextLocked(s);
        MaybeFinishLocked(s);
      }
      if (!s.finished || s.ops > 0) continue;
      // Ended: its requests still out fail, then nothing here touches it again.
      const uint64_t generation = s.generation;
      const std::string why = s.status.ok() ? "closed" : s.status.error_message();
      lock.unlock();
      pending_.FailGeneration(generation, absl::UnavailableError(absl::StrCat("stream to ", address_, " ended: ", why)));
      lock.lock();
      s.done = true;
      streams_cv_.notify_all();
    }
  }

  // Completes the request a response answers; false if it is no response.
  bool OnResponse(grpc::ByteBuffer& message) {
    StreamResponseInfo info;
    if (!ScanForwardStreamResponse(message, &info).ok()) return false;
    std::optional<PendingRequests::Entry> e = pending_.Take(info.request_id);
    if (!e) return true;  // timed out already
    const absl::StatusCode code = StatusCodeFromWire(info.status_code, absl::StatusCode::kUnknown);
    e->Finish(info.status_code == 0 ? CopyStreamResponseOutput(message, info, e->n, hidden_, e->out)
                                            : WithOurModel(absl::Status(code, info.status_message)));
    return true;
  }

  // A server's refusal of our model (it restarted with another --model under
  // this address, since our GetInfo) names its side; this adds ours.
  absl::Status WithOurModel(absl::Status st) const {
    if (!IsModelMismatch(st)) return st;
    return absl::Status(st.code(), absl::StrCat(st.message(), " [this worker: ", model_.ToString(), "; expert server ",
                                                address_, "]"));
  }

  struct UnaryCall {
    grpc::ClientContext ctx;
    moe::v1::ForwardRequest req;
    moe::v1::ForwardResponse resp;
    uint64_t id = 0;
  };

  std::future<absl::Status> SubmitUnary(const MoeBatch& b, bf16_t* out, Clock::time_point deadline) {
    std::future<absl::Status> fut;
    auto* call = new UnaryCall();
    call->id = pending_.Add(out, b.n, 0, deadline, &fut);
    EncodeBatch(b, hidden_, call->id, slice_, &call->req);
    call->req.set_model_identity(model_.digest);
    call->ctx.set_deadline(ToSystem(deadline));
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++unary_in_flight_;
    }
    requests_sent_.fetch_add(1, std::memory_order_relaxed);
    stub_->async()->Forward(&call->ctx, &call->req, &call->resp, [this, call](grpc::Status st) {
      if (std::optional<PendingRequests::Entry> e = pending_.Take(call->id)) {
        e->Finish(st.ok() ? DecodeForwardOutput(call->resp, e->n, hidden_, e->out)
                                  : WithOurModel(FromGrpcStatus(st)));
      }
      delete call;
      std::lock_guard<std::mutex> lock(mu_);
      if (--unary_in_flight_ == 0) unary_cv_.notify_all();
    });
    return fut;
  }

  const ExpertSlice slice_;
  const ModelIdentity model_;  // every request carries its digest; the server refuses another model's
  const std::string address_;
  struct ProbeCall {
    grpc::ClientContext ctx;
    moe::v1::GetInfoRequest req;
    moe::v1::ServerInfo info;
  };
  std::mutex probe_mu_;  // Probe's GetInfo: at most one in flight
  std::condition_variable probe_cv_;
  std::shared_ptr<ProbeCall> probe_;
  bool probe_answered_ = false;
  std::mutex connector_mu_;  // Reconnect's connector thread
  std::thread connector_;
  std::atomic<bool> connecting_{false}, stop_connector_{false};
  const std::vector<std::shared_ptr<grpc::Channel>> channels_;  // a connection per stream
  std::unique_ptr<moe::v1::ExpertService::Stub> stub_;
  std::vector<std::unique_ptr<grpc::GenericStub>> generics_;  // one per channel
  const int hidden_;
  const bool unary_;
  PendingRequests pending_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Stream>> streams_;  // one per channel, opened on first use
  size_t next_stream_ = 0;
  std::vector<std::shared_ptr<Stream>> retired_;
  std::condition_variable streams_cv_;  // a stream is done (the destructor waits for all)
  grpc::CompletionQueue cq_;            // every stream's operations
  std::thread driver_{[this] { Drive(); }};
  uint64_t generation_ = 0;
  std::shared_ptr<MessageBufferPool> pool_ = MessageBufferPool::Create(8);  // request buffers
  // Stripe groups: unique per batch and, by the random salt, per transport
  // (the server groups stripes by this id alone).
  const uint64_t stripe_salt_ = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  std::atomic<uint64_t> next_stripe_group_{1};
  std::atomic<uint64_t> requests_sent_{0};
  int unary_in_flight_ = 0;
  struct Staging { std::vector<bf16_t> tokens, output; std::vector<int32_t> ids; std::vector<float> weights; };
  std::map<uint64_t, std::shared_ptr<Staging>> staging_;
  uint64_t next_staging_ = 0;
  std::condition_variable unary_cv_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectGrpcTransport(const std::string& address,
                                                                     const TransportOptions& o) {
  if (o.hidden <= 0) return absl::InvalidArgumentError("transport: hidden size must be set");
  // A connection per stream (unary calls: one): streams sharing one
  // connection are read, parsed and written one after another by gRPC.
  const int connections = o.grpc_unary ? 1 : std::max(1, o.grpc_streams);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < connections; ++i) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> c =
        MakeChannel(address, o.max_message_bytes, o.tls, /*own_connection=*/true);
    if (!c.ok()) return c.status();
    channels.push_back(*std::move(c));
  }
  const std::shared_ptr<grpc::Channel>& ch = channels[0];
  // Connect now, so a wrong address or credentials fail here, not on the first batch.
  const auto connect_by = std::chrono::system_clock::now() + o.connect_timeout;
  for (const auto& c : channels)
    if (!c->WaitForConnected(connect_by))
      return absl::UnavailableError(absl::StrCat("cannot connect to expert server ", address));
  // The share of each expert the server holds (ServerInfo.slice_*): every
  // request says it expects that one, so a server restarted with another
  // --slice refuses rather than answering as the old share.
  ExpertSlice slice;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + o.connect_timeout);
    moe::v1::ServerInfo info;
    const grpc::Status st = moe::v1::ExpertService::NewStub(ch)->GetInfo(&ctx, moe::v1::GetInfoRequest(), &info);
    if (!st.ok())
      return absl::Status(FromGrpcStatus(st).code(), absl::StrCat("expert server ", address, ": GetInfo: ", st.error_message()));
    if (info.slice_count() > 1) {
      if (info.slice_count() > static_cast<uint32_t>(kMaxSlices) || info.slice_index() >= info.slice_count())
        return absl::InvalidArgumentError(absl::StrCat("expert server ", address, ": slice ", info.slice_index(), "/",
                                                       info.slice_count(), " out of range"));
      slice = ExpertSlice{static_cast<int>(info.slice_index()), static_cast<int>(info.slice_count())};
    }
    // The server's model must be ours, its expert math and routing too
    // (every request carries our digest, so a server restarted with another
    // --model is refused as well).
    if (o.model.digest != 0)
      MOE_RETURN_IF_ERROR(CheckSameModel(o.model,
                                         ModelIdentity{info.model_identity(), info.model_path(),
                                                       info.model().expert_math(), info.model().routing()},
                                         "this worker",
                                         absl::StrCat("the expert server at ", address)));
  }
  return std::unique_ptr<ExpertTransport>(new GrpcTransport(address, std::move(channels), o, slice));
}

absl::Status AwaitResult(std::future<absl::Status>& f, std::chrono::nanoseconds spin) {
  const auto until = Clock::now() + spin;
  while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready && Clock::now() < until) {
  }
  return f.get();
}

std::optional<std::string> UnixSocketPath(const std::string& address) {
  constexpr const char kUnix[] = "unix://";
  if (address.rfind(kUnix, 0) != 0) return std::nullopt;
  return address.substr(sizeof(kUnix) - 1);
}

absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectTransport(const std::string& address,
                                                                 const TransportOptions& options) {
  if (std::optional<std::string> path = UnixSocketPath(address)) return ConnectShmTransport(*path, options);
  return ConnectGrpcTransport(address, options);
}

}  // namespace moe
