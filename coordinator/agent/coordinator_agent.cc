#include "coordinator/agent/coordinator_agent.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/atomic_max.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "transport/grpc_channel.h"
#include "transport/wire.h"
#include "moe/v1/coordinator.grpc.pb.h"

namespace moe {

namespace {

constexpr uint64_t kMaxMessageBytes = 64u << 20;

std::string LocalHostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

template <typename Field>
std::vector<int> ToInts(const Field& f) {
  return std::vector<int>(f.begin(), f.end());
}

// Connection, back-off, stop and wake-ups shared by both agents.
class AgentLink {
 public:
  AgentLink(std::string address, std::shared_ptr<grpc::Channel> channel, AgentOptions options, std::string who)
      : address_(std::move(address)),
        stub_(moe::v1::CoordinatorService::NewStub(channel)),
        options_(options),
        who_(std::move(who)) {}

  moe::v1::CoordinatorService::Stub& stub() { return *stub_; }
  const AgentOptions& options() const { return options_; }
  const std::string& who() const { return who_; }

  void SetDeadline(grpc::ClientContext& ctx) const {
    ctx.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
  }
  // Registration waits (up to the deadline) for the channel to connect: a
  // synchronous client only makes connection progress while a call polls, so
  // a fail-fast call would see a restarted coordinator only seconds later.
  void SetRegistrationDeadline(grpc::ClientContext& ctx) const {
    SetDeadline(ctx);
    ctx.set_wait_for_ready(true);
  }

  // Calls `session` again and again until Stop(); each call registers and
  // serves until something fails. Between calls: exponential back-off, reset
  // after every successful registration.
  void Run(const std::function<absl::Status(bool* registered)>& session) {
    std::chrono::milliseconds backoff = options_.min_backoff;
    bool reported = false;  // the current outage was logged
    while (!stopping()) {
      bool registered = false;
      const absl::Status st = session(&registered);
      connected.store(false);
      if (stopping()) break;
      if (registered) {
        backoff = options_.min_backoff;
        reported = false;
      }
      if (!reported) {
        LogWarning(who_, "coordinator ", address_, ": ", st.ToString(),
                   "; serving on as is, retrying with back-off up to ", options_.max_backoff.count(), " ms");
        reported = true;
      }
      if (!Sleep(backoff, nullptr)) break;
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }

  // Waits up to `d`, or until *wake turns true (when given) or Stop(). False when stopping.
  bool Sleep(std::chrono::milliseconds d, const std::atomic<bool>* wake) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, d, [&] { return stop_ || (wake != nullptr && wake->load()); });
    return !stop_;
  }
  void Wake() {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }
  bool stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }
  // A long-lived call that Stop() must cancel.
  void SetActiveCall(grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    active_ = ctx;
    if (stop_ && active_ != nullptr) active_->TryCancel();
  }
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (active_ != nullptr) active_->TryCancel();
    cv_.notify_all();
  }

  std::atomic<bool> connected{false};
  std::atomic<int> sessions{0};

 private:
  const std::string address_;
  std::unique_ptr<moe::v1::CoordinatorService::Stub> stub_;
  const AgentOptions options_;
  const std::string who_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  grpc::ClientContext* active_ = nullptr;
};

absl::Status CheckOptions(const AgentOptions& o) {
  if (o.rpc_timeout.count() <= 0) return absl::InvalidArgumentError("rpc_timeout must be > 0");
  if (o.min_backoff.count() <= 0 || o.max_backoff < o.min_backoff)
    return absl::InvalidArgumentError("backoff: need 0 < min_backoff <= max_backoff");
  return absl::OkStatus();
}

std::chrono::milliseconds HeartbeatInterval(const AgentOptions& o, uint32_t suggested_ms) {
  if (o.heartbeat_interval.count() > 0) return o.heartbeat_interval;
  return std::chrono::milliseconds(std::max<uint32_t>(suggested_ms, 10));
}

}  // namespace

// ---------------------------------------------------------------- worker agent

class CoordinatorAgent::Impl {
 public:
  Impl(const std::string& address, std::shared_ptr<grpc::Channel> channel, WorkerRegistration reg,
       AssignmentCallback cb, AgentOptions options)
      : reg_(std::move(reg)),
        cb_(std::move(cb)),
        link_(address, std::move(channel), options, "agent " + reg_.worker_id),
        cells_(static_cast<size_t>(reg_.num_layers) * reg_.num_experts),
        pairs_(cells_),
        hits_(cells_),
        pending_pairs_(cells_, 0),
        pending_hits_(cells_, 0),
        activity_(static_cast<size_t>(reg_.num_layers) * kActivityFields),
        pending_activity_(activity_.size(), 0),
        delivered_(reg_.num_layers) {
    if (reg_.hostname.empty()) reg_.hostname = LocalHostname();
    thread_ = std::thread([this] { link_.Run([this](bool* registered) { return Session(registered); }); });
  }
  ~Impl() {
    link_.Stop();
    if (thread_.joinable()) thread_.join();
  }

  void RecordAccess(int layer, int expert, uint64_t pairs, bool hit) {
    if (layer < 0 || layer >= reg_.num_layers || expert < 0 || expert >= reg_.num_experts) return;
    const size_t i = static_cast<size_t>(layer) * reg_.num_experts + expert;
    pairs_[i].fetch_add(pairs, std::memory_order_relaxed);
    if (hit) hits_[i].fetch_add(pairs, std::memory_order_relaxed);
  }
  void RecordLayerActivity(int layer, const LayerActivity& a) {
    if (layer < 0 || layer >= reg_.num_layers) return;
    const uint64_t link_us = a.link_seconds > 0 ? static_cast<uint64_t>(a.link_seconds * 1e6 + 0.5) : 0;
    const uint64_t v[kActivityFields] = {a.cache_copies, a.copy_bytes, a.predicted, a.predicted_used,
                                         a.cpu_pairs, a.copied_pairs, link_us, a.prefetched_pairs};
    for (int f = 0; f < kActivityFields; ++f)
      if (v[f]) activity_[static_cast<size_t>(layer) * kActivityFields + f].fetch_add(v[f], std::memory_order_relaxed);
  }
  void MarkApplied(uint64_t version) { AtomicMax(applied_, version); }
  void SetPlannerRates(std::map<std::string, double> rates) {
    std::lock_guard<std::mutex> lock(mu_);
    planner_rates_ = std::move(rates);
  }
  bool connected() const { return link_.connected.load(); }
  uint64_t received_version() const { return received_.load(); }
  uint64_t applied_version() const { return applied_.load(); }
  int sessions() const { return link_.sessions.load(); }
  std::vector<ServerRoute> routes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return routes_;
  }

 private:
  moe::v1::RegisterWorkerRequest Registration() const {
    moe::v1::RegisterWorkerRequest r;
    r.set_worker_id(reg_.worker_id);
    r.set_address(reg_.address);
    r.set_hostname(reg_.hostname);
    r.set_num_layers(reg_.num_layers);
    r.set_num_experts(reg_.num_experts);
    r.set_slots_per_layer(reg_.slots_per_layer);
    r.set_expert_bytes(reg_.expert_bytes);
    r.set_gpu_memory_bytes(reg_.gpu_memory_bytes);
    r.set_numa_node(reg_.numa_node);
    for (int l : reg_.cached_layers) r.add_cached_layers(l);
    if (reg_.group.size > 1) {
      r.set_tp_rank(static_cast<uint32_t>(reg_.group.rank));
      r.set_tp_size(static_cast<uint32_t>(reg_.group.size));
    }
    r.set_max_tokens_per_second(reg_.max_tokens_per_second);
    if (reg_.top_k > 0) r.set_top_k(static_cast<uint32_t>(std::min(reg_.top_k, reg_.num_experts)));
    r.set_model_identity(reg_.model.digest);
    r.set_model_path(reg_.model.model);
    // What the worker holds or is moving to: placement resumes from it.
    std::lock_guard<std::mutex> lock(mu_);
    r.set_current_version(received_.load());
    for (int l = 0; l < reg_.num_layers; ++l) {
      if (delivered_[l].empty()) continue;
      moe::v1::LayerAssignment* la = r.add_current();
      la->set_layer(l);
      for (int e : delivered_[l]) la->add_experts(e);
    }
    return r;
  }

  // Applies one stream message to the delivered state and hands it to the
  // worker. False when a delta does not follow the version we hold (resync).
  bool Handle(const moe::v1::CacheAssignment& msg) {
    AssignmentUpdate u;
    u.version = msg.version();
    u.full = msg.full();
    u.routes_changed = msg.routes_changed();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!msg.full() && msg.base_version() != received_.load()) return false;
      if (msg.full()) {
        for (auto& s : delivered_) s.clear();
      }
      for (const auto& la : msg.layers()) {
        if (la.layer() >= static_cast<uint32_t>(reg_.num_layers)) continue;
        delivered_[la.layer()] = ToInts(la.experts());
        u.layers.push_back({static_cast<int>(la.layer()), delivered_[la.layer()], ToInts(la.pinned())});
      }
      if (msg.routes_changed()) {
        routes_.clear();
        for (const auto& r : msg.routes()) {
          routes_.push_back({r.server_id(), r.address(), r.shm_socket(), r.hostname(), r.numa_node(),
                             ToInts(r.hosted_layers()), ToInts(r.hosted_experts())});
        }
        u.routes = routes_;
      }
      received_.store(msg.version());
    }
    if (cb_) cb_(u);
    return true;
  }

  absl::Status Heartbeat(uint64_t session) {
    moe::v1::HeartbeatRequest hb;
    hb.set_worker_id(reg_.worker_id);
    hb.set_session(session);
    hb.set_applied_version(applied_.load());
    {
      std::lock_guard<std::mutex> lock(mu_);
      hb.mutable_planner_rates()->insert(planner_rates_.begin(), planner_rates_.end());
    }
    const int ne = reg_.num_experts;
    for (int l = 0; l < reg_.num_layers; ++l) {
      moe::v1::LayerCounts* lc = nullptr;
      for (int e = 0; e < ne; ++e) {
        const size_t i = static_cast<size_t>(l) * ne + e;
        pending_pairs_[i] += pairs_[i].exchange(0, std::memory_order_relaxed);
        pending_hits_[i] += hits_[i].exchange(0, std::memory_order_relaxed);
        if (pending_pairs_[i] == 0) continue;
        if (lc == nullptr) {
          lc = hb.add_counts();
          lc->set_layer(l);
        }
        lc->add_experts(e);
        lc->add_pairs(pending_pairs_[i]);
        lc->add_hits(std::min(pending_hits_[i], pending_pairs_[i]));
      }
      uint64_t* a = &pending_activity_[static_cast<size_t>(l) * kActivityFields];
      bool any = false;
      for (int f = 0; f < kActivityFields; ++f) {
        a[f] += activity_[static_cast<size_t>(l) * kActivityFields + f].exchange(0, std::memory_order_relaxed);
        any |= a[f] != 0;
      }
      if (!any) continue;
      if (lc == nullptr) {
        lc = hb.add_counts();
        lc->set_layer(l);
      }
      lc->set_cache_copies(a[0]);
      lc->set_copy_bytes(a[1]);
      lc->set_predicted(a[2]);
      lc->set_predicted_used(std::min(a[3], a[2]));
      lc->set_cpu_pairs(a[4]);
      lc->set_copied_pairs(a[5]);
      lc->set_link_microseconds(a[6]);
      lc->set_prefetched_pairs(a[7]);
    }
    grpc::ClientContext ctx;
    link_.SetDeadline(ctx);
    moe::v1::HeartbeatResponse resp;
    const grpc::Status st = link_.stub().Heartbeat(&ctx, hb, &resp);
    const bool counts_refused = st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                                st.error_message().rfind("counts", 0) == 0;
    if (!st.ok() && !counts_refused) return FromGrpcStatus(st);  // counts stay pending for the next attempt
    if (counts_refused) {
      // Sending them again would be refused again (e.g. a backlog beyond what
      // the coordinator accepts after an outage): they are dropped, the
      // session goes on; popularity rebuilds from the next ones.
      if (!counts_refusal_logged_)
        LogWarning(link_.who(), "the coordinator refused our access counts; dropped (logged once): ",
                   st.error_message());
      counts_refusal_logged_ = true;
      std::fill(pending_hits_.begin(), pending_hits_.end(), 0);
    }
    // A hit whose pairs the exchange above missed (the two counters are read
    // apart) stays pending until its pairs are sent, not dropped.
    for (size_t i = 0; i < pending_pairs_.size(); ++i) {
      pending_hits_[i] -= std::min(pending_hits_[i], pending_pairs_[i]);
      pending_pairs_[i] = 0;
    }
    std::fill(pending_activity_.begin(), pending_activity_.end(), 0);
    return absl::OkStatus();
  }

  absl::Status Session(bool* registered) {
    moe::v1::RegisterWorkerRequest req = Registration();
    req.set_session(last_session_);  // ours while our lease lives: the id stays ours
    moe::v1::RegisterWorkerResponse reg;
    {
      grpc::ClientContext ctx;
      link_.SetRegistrationDeadline(ctx);
      link_.SetActiveCall(&ctx);  // waits for the channel: Stop() must be able to cut it short
      const grpc::Status st = link_.stub().RegisterWorker(&ctx, req, &reg);
      link_.SetActiveCall(nullptr);
      if (!st.ok()) return FromGrpcStatus(st);
    }
    *registered = true;
    last_session_ = reg.session();
    link_.sessions.fetch_add(1);
    const auto interval = HeartbeatInterval(link_.options(), reg.heartbeat_interval_ms());
    LogInfo(link_.who(), "registered (session ", reg.session(), ", holding version ", req.current_version(),
            "), heartbeat every ", interval.count(), " ms");

    moe::v1::WatchAssignmentsRequest wreq;
    wreq.set_worker_id(reg_.worker_id);
    wreq.set_session(reg.session());
    grpc::ClientContext wctx;
    link_.SetActiveCall(&wctx);
    std::unique_ptr<grpc::ClientReader<moe::v1::CacheAssignment>> reader =
        link_.stub().WatchAssignments(&wctx, wreq);
    std::atomic<bool> stream_done{false};
    absl::Status stream_status;
    std::thread reader_thread([&] {
      moe::v1::CacheAssignment msg;
      bool first = true;
      while (reader->Read(&msg)) {
        if ((first && !msg.full()) || !Handle(msg)) {
          stream_status = absl::DataLossError(absl::StrCat("assignment version ", msg.version(), " does not follow ",
                                                           received_.load(), ": resync"));
          break;
        }
        if (first) link_.connected.store(true);
        first = false;
      }
      stream_done.store(true);
      link_.Wake();
    });
    absl::Status st;
    while (link_.Sleep(interval, &stream_done) && !stream_done.load()) {
      st = Heartbeat(reg.session());
      if (!st.ok()) break;
    }
    wctx.TryCancel();
    reader_thread.join();
    const grpc::Status finished = reader->Finish();
    link_.SetActiveCall(nullptr);
    link_.connected.store(false);
    if (!st.ok()) return st;
    if (!stream_status.ok()) return stream_status;
    return finished.ok() ? absl::UnavailableError("assignment stream ended") : FromGrpcStatus(finished);
  }

  WorkerRegistration reg_;
  AssignmentCallback cb_;
  AgentLink link_;
  const size_t cells_;
  std::vector<std::atomic<uint64_t>> pairs_, hits_;        // recorded since the last collection
  std::vector<uint64_t> pending_pairs_, pending_hits_;    // collected, not yet acknowledged (session thread)
  // copies, bytes, predicted, predicted_used, cpu_pairs, copied_pairs, link microseconds, prefetched_pairs
  static constexpr int kActivityFields = 8;
  std::vector<std::atomic<uint64_t>> activity_;           // [layer][field] since the last collection
  std::vector<uint64_t> pending_activity_;                // collected, not yet acknowledged
  uint64_t last_session_ = 0;  // our latest session (session thread): re-registering with it keeps our id
  bool counts_refusal_logged_ = false;  // session thread
  std::atomic<uint64_t> applied_{0}, received_{0};
  mutable std::mutex mu_;
  std::vector<std::vector<int>> delivered_;               // [layer] as of received_
  std::vector<ServerRoute> routes_;
  std::map<std::string, double> planner_rates_;  // sent with every heartbeat (mu_)
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<CoordinatorAgent>> CoordinatorAgent::Start(const std::string& coordinator_address,
                                                                           const TlsOptions& tls,
                                                                           const WorkerRegistration& reg,
                                                                           AssignmentCallback on_assignment,
                                                                           AgentOptions options) {
  if (coordinator_address.empty()) return absl::InvalidArgumentError("coordinator address: must not be empty");
  if (reg.worker_id.empty()) return absl::InvalidArgumentError("worker_id: must not be empty");
  if (reg.num_layers <= 0) return absl::InvalidArgumentError("num_layers: must be > 0");
  if (reg.num_experts <= 0) return absl::InvalidArgumentError("num_experts: must be > 0");
  if (reg.slots_per_layer < 0 || reg.slots_per_layer > reg.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("slots_per_layer: ", reg.slots_per_layer, " not in [0, ",
                                                   reg.num_experts, "]"));
  for (int l : reg.cached_layers) {
    if (l < 0 || l >= reg.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("cached_layers: ", l, " out of range [0, ", reg.num_layers, ")"));
  }
  MOE_RETURN_IF_ERROR(CheckOptions(options));
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(coordinator_address, kMaxMessageBytes, tls));
  return std::unique_ptr<CoordinatorAgent>(new CoordinatorAgent(
      std::make_unique<Impl>(coordinator_address, channel, reg, std::move(on_assignment), options)));
}

CoordinatorAgent::CoordinatorAgent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CoordinatorAgent::~CoordinatorAgent() = default;
void CoordinatorAgent::RecordAccess(int layer, int expert, uint64_t pairs, bool hit) {
  impl_->RecordAccess(layer, expert, pairs, hit);
}

void CoordinatorAgent::RecordLayerActivity(int layer, const LayerActivity& activity) {
  impl_->RecordLayerActivity(layer, activity);
}
void CoordinatorAgent::MarkApplied(uint64_t version) { impl_->MarkApplied(version); }
void CoordinatorAgent::SetPlannerRates(std::map<std::string, double> rates) {
  impl_->SetPlannerRates(std::move(rates));
}
bool CoordinatorAgent::connected() const { return impl_->connected(); }
uint64_t CoordinatorAgent::received_version() const { return impl_->received_version(); }
uint64_t CoordinatorAgent::applied_version() const { return impl_->applied_version(); }
int CoordinatorAgent::sessions() const { return impl_->sessions(); }
std::vector<ServerRoute> CoordinatorAgent::routes() const { return impl_->routes(); }

// ---------------------------------------------------------------- expert server agent

class ExpertServerAgent::Impl {
 public:
  Impl(const std::string& address, std::shared_ptr<grpc::Channel> channel, ExpertServerRegistration reg,
       std::function<uint32_t()> inflight, AgentOptions options)
      : reg_(std::move(reg)),
        inflight_(std::move(inflight)),
        link_(address, std::move(channel), options, "agent " + reg_.server_id) {
    if (reg_.hostname.empty()) reg_.hostname = LocalHostname();
    thread_ = std::thread([this] { link_.Run([this](bool* registered) { return Session(registered); }); });
  }
  ~Impl() {
    link_.Stop();
    if (thread_.joinable()) thread_.join();
  }
  bool connected() const { return link_.connected.load(); }
  bool draining() const { return draining_.load(); }
  bool drained() const { return drained_.load(); }
  int sessions() const { return link_.sessions.load(); }

 private:
  void SetDrainState(bool draining, bool drained) {
    if (draining != draining_.exchange(draining))
      LogInfo(link_.who(), draining ? "drain requested: workers stop routing here" : "drain cancelled");
    if (drained != drained_.exchange(drained) && drained) LogInfo(link_.who(), "drained");
  }

  absl::Status Session(bool* registered) {
    moe::v1::RegisterExpertServerRequest req;
    req.set_server_id(reg_.server_id);
    req.set_address(reg_.address);
    req.set_shm_socket(reg_.shm_socket);
    req.set_hostname(reg_.hostname);
    req.set_numa_node(reg_.numa_node);
    req.set_num_layers(reg_.num_layers);
    req.set_num_experts(reg_.num_experts);
    for (int l : reg_.hosted_layers) req.add_hosted_layers(l);
    for (int e : reg_.hosted_experts) req.add_hosted_experts(e);
    if (!reg_.slice.whole()) {
      req.set_slice_index(static_cast<uint32_t>(reg_.slice.index));
      req.set_slice_count(static_cast<uint32_t>(reg_.slice.count));
    }
    req.set_weight_bytes(reg_.weight_bytes);
    req.set_kernel(reg_.kernel);
    req.set_model_identity(reg_.model.digest);
    req.set_model_path(reg_.model.model);
    req.set_model_type(reg_.model_type);
    req.set_expert_math(reg_.model.expert_math);
    req.set_routing(reg_.model.routing);
    req.set_weight_format(reg_.weight_format);
    moe::v1::RegisterExpertServerResponse reg;
    {
      grpc::ClientContext ctx;
      link_.SetRegistrationDeadline(ctx);
      link_.SetActiveCall(&ctx);  // waits for the channel: Stop() must be able to cut it short
      const grpc::Status st = link_.stub().RegisterExpertServer(&ctx, req, &reg);
      link_.SetActiveCall(nullptr);
      if (!st.ok()) return FromGrpcStatus(st);
    }
    *registered = true;
    link_.sessions.fetch_add(1);
    link_.connected.store(true);
    SetDrainState(reg.draining(), false);
    const auto interval = HeartbeatInterval(link_.options(), reg.heartbeat_interval_ms());
    LogInfo(link_.who(), "registered (session ", reg.session(), "), heartbeat every ", interval.count(), " ms");
    while (link_.Sleep(interval, nullptr)) {
      moe::v1::HeartbeatRequest hb;
      hb.set_server_id(reg_.server_id);
      hb.set_session(reg.session());
      hb.set_inflight_requests(inflight_ ? inflight_() : 0);
      moe::v1::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      link_.SetDeadline(ctx);
      const grpc::Status st = link_.stub().Heartbeat(&ctx, hb, &resp);
      if (!st.ok()) return FromGrpcStatus(st);
      SetDrainState(resp.draining(), resp.drained());
    }
    return absl::CancelledError("stopping");
  }

  ExpertServerRegistration reg_;
  std::function<uint32_t()> inflight_;
  AgentLink link_;
  std::atomic<bool> draining_{false}, drained_{false};
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<ExpertServerAgent>> ExpertServerAgent::Start(
    const std::string& coordinator_address, const TlsOptions& tls, const ExpertServerRegistration& reg,
    std::function<uint32_t()> inflight, AgentOptions options) {
  if (coordinator_address.empty()) return absl::InvalidArgumentError("coordinator address: must not be empty");
  if (reg.server_id.empty()) return absl::InvalidArgumentError("server_id: must not be empty");
  if (reg.address.empty()) return absl::InvalidArgumentError("address: must not be empty");
  if (reg.num_layers <= 0 || reg.num_experts <= 0)
    return absl::InvalidArgumentError("num_layers, num_experts: must be > 0");
  MOE_RETURN_IF_ERROR(CheckOptions(options));
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(coordinator_address, kMaxMessageBytes, tls));
  return std::unique_ptr<ExpertServerAgent>(new ExpertServerAgent(
      std::make_unique<Impl>(coordinator_address, channel, reg, std::move(inflight), options)));
}

ExpertServerAgent::ExpertServerAgent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertServerAgent::~ExpertServerAgent() = default;
bool ExpertServerAgent::connected() const { return impl_->connected(); }
bool ExpertServerAgent::draining() const { return impl_->draining(); }
bool ExpertServerAgent::drained() const { return impl_->drained(); }
int ExpertServerAgent::sessions() const { return impl_->sessions(); }

}  // namespace moe
