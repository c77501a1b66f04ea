#include "gpu_worker/worker_service.h"

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "model/routing.h"
#include "transport/wire.h"

#include <algorithm>
#include <chrono>

namespace moe {

WorkerServiceImpl::WorkerServiceImpl(WorkerSessions& sessions, std::mutex& mu, std::string policy,
                                     std::vector<std::string> servers, WorkerLimits limits, WorkerMetrics* metrics)
    : sessions_(sessions),
      mu_(mu),
      policy_(std::move(policy)),
      servers_(std::move(servers)),
      limits_(limits),
      metrics_(metrics) {}

void WorkerServiceImpl::OnAssignment(const AssignmentUpdate& update) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  queue_.push_back(update);
}

void WorkerServiceImpl::Tick() {
  std::lock_guard<std::mutex> lock(mu_);
  ApplyPendingLocked();
  // The planner's learned rates, for the coordinator's status (once a second).
  const auto now = std::chrono::steady_clock::now();
  if (agent_ != nullptr && now - rates_sent_ >= std::chrono::seconds(1)) {
    agent_->SetPlannerRates(sessions_.primary().admin().PlannerRates());
    rates_sent_ = now;
  }
}

void WorkerServiceImpl::ApplyPendingLocked() {
  std::deque<AssignmentUpdate> updates;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    updates.swap(queue_);
  }
  for (const AssignmentUpdate& u : updates) {
    for (const LayerAssignment& la : u.layers)
      if (absl::Status st = sessions_.ApplyAssignment(la.layer, la.experts, la.pinned); !st.ok())
        LogWarning("worker", "assignment v", u.version, " layer ", la.layer, ": ", st.message());
    if (u.routes_changed) {
      // Servers the coordinator knows but does not route to (drained, down)
      // get no misses. A configured address it has never routed (e.g. a
      // Service name in front of remote servers) is left alone.
      for (const std::string& addr : servers_) {
        const std::string base = addr.substr(0, addr.find('#'));
        bool routed = false;
        for (const ServerRoute& r : u.routes)
          routed |= base == r.address || (!r.shm_socket.empty() && base == "unix://" + r.shm_socket);
        if (routed) known_.insert(base);
        if (known_.count(base) != 0) (void)sessions_.SetServerEnabled(base, routed);
      }
    }
    applied_version_ = std::max(applied_version_, u.version);
  }
  // Acknowledge once the copies of the applied assignment completed.
  if (agent_ != nullptr && applied_version_ > acked_version_ && sessions_.PendingCopies() == 0) {
    agent_->MarkApplied(applied_version_);
    acked_version_ = applied_version_;
    if (metrics_ != nullptr) metrics_->SetAssignmentVersion(acked_version_);
  }
}

// Long: validation of every field in the proto's names, then the one or two
// micro-batches started and completed in order; one request's whole path.
grpc::Status WorkerServiceImpl::ForwardLayer(grpc::ServerContext*, const moe::v1::ForwardLayerRequest* req,
                                             moe::v1::ForwardLayerResponse* resp) {
  const int H = sessions_.primary().model_info().hidden;
  const int n = req->batches_size();
  if (n < 1 || n > 2)
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("batches: ", n, " micro-batches (1 or 2)")));
  // The layer as the expert server checks it (an index is never printed as a negative number).
  const int num_layers = sessions_.primary().model_info().num_layers;
  if (req->layer() >= static_cast<uint32_t>(num_layers))
    return ToGrpcStatus(
        absl::InvalidArgumentError(absl::StrCat("layer: ", req->layer(), " out of range [0, ", num_layers, ")")));
  struct Decoded {
    int T = 0, k = 0;
    TensorView hidden, ids, weights;
    std::vector<bf16_t> out;
  };
  std::vector<Decoded> d(n);
  for (int i = 0; i < n; ++i) {
    const moe::v1::MicroBatch& b = req->batches(i);
    const std::string f = absl::StrCat("batches[", i, "].");
    absl::StatusOr<TensorView> hidden = DecodeTensor(b.hidden(), f + "hidden", DType::kBF16, {-1, H});
    if (!hidden.ok()) return ToGrpcStatus(hidden.status());
    const int64_t T = hidden->shape[0];
    // Codes as the expert server's for the same fault (ExpertServiceImpl::Handle).
    if (T == 0) return ToGrpcStatus(absl::InvalidArgumentError(f + "hidden: empty micro-batch (0 tokens)"));
    if (T > limits_.max_tokens)
      return ToGrpcStatus(absl::OutOfRangeError(
          absl::StrCat(f, "hidden: ", T, " tokens exceed max_tokens ", limits_.max_tokens)));
    absl::StatusOr<TensorView> ids = DecodeTensor(b.topk_ids(), f + "topk_ids", DType::kI32, {T, -1});
    if (!ids.ok()) return ToGrpcStatus(ids.status());
    const int64_t k = ids->shape[1];
    if (k == 0 || k > limits_.max_top_k)
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat(f, "topk_ids.shape[1]: ", k, " pairs per token, must be in [1, ", limits_.max_top_k, "]")));
    absl::StatusOr<TensorView> w = DecodeTensor(b.topk_weights(), f + "topk_weights", DType::kF32, {T, k});
    if (!w.ok()) return ToGrpcStatus(w.status());
    if (absl::Status st = ValidateRouting(RoutingView{static_cast<int>(T), static_cast<int>(k), ids->as<int32_t>(),
                                                      w->as<float>()},
                                          sessions_.primary().model_info().num_experts, {}, f + "topk_ids", f + "topk_weights");
        !st.ok())
      return ToGrpcStatus(st);
    d[i].T = static_cast<int>(T);
    d[i].k = static_cast<int>(k);
    d[i].hidden = *hidden;
    d[i].ids = *ids;
    d[i].weights = *w;
    d[i].out.resize(static_cast<size_t>(T) * H);
  }
  std::lock_guard<std::mutex> lock(mu_);
  ApplyPendingLocked();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<MoeSession::Pending> pending;
  std::vector<CallStats> done;  // a group's micro-batches, run one after the other
  absl::Status first;
  for (int i = 0; i < n && first.ok(); ++i) {
    const int layer = static_cast<int>(req->layer());
    absl::Status st;
    if (sessions_.size() > 1) {
      done.emplace_back();
      st = sessions_.Forward(layer, d[i].T, d[i].k, d[i].hidden.as<bf16_t>(), d[i].ids.as<int32_t>(),
                             d[i].weights.as<float>(), d[i].out.data(), &done.back());
    } else {
      absl::StatusOr<MoeSession::Pending> p = sessions_.primary().ForwardLayerAsync(
          layer, d[i].T, d[i].k, d[i].hidden.as<bf16_t>(), d[i].ids.as<int32_t>(), d[i].weights.as<float>(),
          d[i].out.data());
      if (p.ok()) pending.push_back(*p);
      st = p.status();
    }
    if (!st.ok())
      first = n == 1 ? st : absl::Status(st.code(), absl::StrCat("batches[", i, "]: ", st.message()));
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    CallStats st;
    absl::Status s = sessions_.primary().Wait(pending[i], &st);
    if (!s.ok() && first.ok()) first = s;
    if (s.ok()) done.push_back(st);
  }
  for (size_t i = 0; i < done.size() && first.ok(); ++i) {
    const CallStats& st = done[i];
    if (metrics_ != nullptr)
      metrics_->RecordCall(static_cast<int>(req->layer()), d[i].T, st,
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    moe::v1::LayerCallStats* ps = resp->add_stats();
    ps->set_hit_pairs(static_cast<uint32_t>(st.hit_pairs));
    ps->set_cpu_pairs(static_cast<uint32_t>(st.cpu_pairs));
    ps->set_cpu_experts(static_cast<uint32_t>(st.cpu_experts));
    ps->set_copied_pairs(static_cast<uint32_t>(st.copied_pairs));
    ps->set_copied_experts(static_cast<uint32_t>(st.copied_experts));
    ps->set_prefetched_pairs(static_cast<uint32_t>(st.prefetched_pairs));
    ps->set_prefetched_experts(static_cast<uint32_t>(st.prefetched_experts));
    ps->set_miss_tokens(static_cast<uint32_t>(st.miss_tokens));
    ps->set_failovers(static_cast<uint32_t>(st.failovers));
    ps->set_bytes_shipped(st.bytes_shipped);
    ps->set_seconds(st.seconds);
    ps->set_submit_seconds(st.submit_seconds);
    ps->set_wait_seconds(st.wait_seconds);
  }
  if (metrics_ != nullptr) metrics_->SetCopies(sessions_.copies_started());
  if (!first.ok()) {
    resp->Clear();
    return ToGrpcStatus(first);
  }
  for (int i = 0; i < n; ++i)
    EncodeTensor(DType::kBF16, {d[i].T, H}, d[i].out.data(), resp->add_outputs());
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::GetWorkerInfo(grpc::ServerContext*, const moe::v1::WorkerInfoRequest*,
                                              moe::v1::WorkerInfo* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  const ModelInfo& model = sessions_.primary().model_info();
  ModelSpec spec;  // the wire form of the session's model
  spec.model_type = model.model_type;
  spec.num_layers = model.num_layers;
  spec.moe_layers = model.moe_layers;
  spec.num_experts = model.num_experts;
  spec.top_k = model.top_k;
  spec.hidden = model.hidden;
  spec.intermediate = model.intermediate;
  spec.dtype = ParseDType(model.weight_dtype).value_or(DType::kBF16);
  ModelSpecToProto(spec, resp->mutable_model());
  resp->set_device(sessions_.primary().device());
  resp->set_slots_per_layer(sessions_.slots_per_layer());
  resp->set_policy(policy_);
  for (const std::string& s : servers_) resp->add_servers(s);
  for (int l : spec.moe_layers) {
    moe::v1::LayerCacheInfo* li = resp->add_layers();
    li->set_layer(l);
    for (int e : sessions_.CachedExperts(l)) li->add_slot_experts(e);
    li->set_hit_rate(sessions_.HitRate(l));
  }
  resp->set_cost_model(sessions_.primary().admin().DescribeCostModel());
  resp->set_model_identity(model.identity);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::ApplyAssignment(grpc::ServerContext*, const moe::v1::ApplyAssignmentRequest* req,
                                                moe::v1::ApplyAssignmentResponse*) {
  std::vector<int> experts(req->experts().begin(), req->experts().end());
  const int E = sessions_.primary().model_info().num_experts;
  for (size_t i = 0; i < experts.size(); ++i)
    if (experts[i] >= E)
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("experts[", i, "]: ", experts[i], " out of range [0, ", E, ")")));
  std::lock_guard<std::mutex> lock(mu_);
  return ToGrpcStatus(sessions_.ApplyAssignment(static_cast<int>(req->layer()), experts));
}

}  // namespace moe
