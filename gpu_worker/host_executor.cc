// HostExecutor (host_executor.h): a call's routing to the host, its plan,
// the misses shipped to the servers, the hits, the copied and prefetched
// experts on the device, and the merge of the partial sums.
#include "gpu_worker/host_executor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "model/routing.h"
#include "core/status_macros.h"

namespace moe {

HostExecutor::HostExecutor(DispatchContext& ctx, ServerSet& servers, CacheCopies& copies, const HostBuffers& buffers)
    : ctx_(ctx), servers_(servers), copies_(copies), buffers_(buffers) {
  const int E = ctx_.spec.num_experts;
  const size_t L = ctx_.layers.size();
  temp_fence_.assign(buffers_.temp_buffers, 0);
  prefetch_free_.assign(2 * static_cast<size_t>(buffers_.prefetch_per_parity), 0);
  for (Prefetch& p : prefetch_) p.buffer.assign(E, -1);
  last_pairs_.assign(L, std::vector<int32_t>(E, 0));
  last_total_.assign(L, 0);
  prefetch_candidate_.assign(E, false);
  slot_buffer_.resize(E);
}

HostExecutor::~HostExecutor() {
  for (HostCall& hc : calls_) {
    ReleaseSent(hc);
    if (!hc.send.empty()) ctx_.backend->UnregisterHost(hc.send.data());
    if (!hc.recv.empty()) ctx_.backend->UnregisterHost(hc.recv.data());
  }
}

absl::Status HostExecutor::Init() {
  const DispatcherConfig& c = ctx_.config;
  calls_.resize(c.contexts);
  for (size_t i = 0; i < calls_.size(); ++i) {
    HostCall& hc = calls_[i];
    hc.context = static_cast<int>(i);
    hc.prefetched.assign(ctx_.spec.num_experts, false);
    hc.send.resize(static_cast<size_t>(c.max_tokens) * ctx_.spec.hidden);
    hc.recv.resize(static_cast<size_t>(c.max_tokens) * ctx_.spec.hidden);
    MOE_RETURN_IF_ERROR(ctx_.backend->RegisterHost(hc.send.data(), hc.send.size() * sizeof(bf16_t)));
    MOE_RETURN_IF_ERROR(ctx_.backend->RegisterHost(hc.recv.data(), hc.recv.size() * sizeof(bf16_t)));
  }
  return absl::OkStatus();
}

bool HostExecutor::busy() const {
  return std::any_of(calls_.begin(), calls_.end(), [](const HostCall& hc) { return hc.busy; });
}

// A call's send/recv buffers for `rows` rows (between its calls).
absl::Status GrowHostBuffers(DeviceBackend& backend, int hidden, HostCall& hc, size_t rows) {
  for (std::vector<bf16_t>* b : {&hc.send, &hc.recv}) {
    backend.UnregisterHost(b->data());
    b->resize(rows * hidden);
    b->shrink_to_fit();
    MOE_RETURN_IF_ERROR(backend.RegisterHost(b->data(), b->size() * sizeof(bf16_t)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> HostExecutor::Submit(const LayerCall& call) {
  const Clock::time_point t_start = Clock::now();
  MOE_ASSIGN_OR_RETURN(HostCall * free, FreeCall());
  HostCall& hc = *free;
  // Validation: nothing is touched before the call is known to be sound.
  MOE_RETURN_IF_ERROR(CheckCall(call));
  // The engine's earlier work on its stream (which produced hidden/routing)
  // comes before ours: an event wait, no host sync of that stream.
  MOE_RETURN_IF_ERROR(ctx_.backend->WaitStream(call.stream));
  MOE_RETURN_IF_ERROR(CopyRouting(call, hc.ids, hc.weights));
  const int T = call.batch.n, k = std::max(call.batch.routing.k, 1);
  const RoutingView routing{T, k, hc.ids.data(), hc.weights.data()};
  MOE_RETURN_IF_ERROR(ValidateRouting(routing, ctx_.spec.num_experts, {}));
  if (ctx_.config.group.size > 1)  // another rank computes these pairs
    for (int32_t& e : hc.ids)
      if (e >= 0 && !ctx_.Owns(call.batch.layer, e)) e = -1;

  copies_.Poll();
  ctx_.planner.CallStarted();  // the link's idle window since the last call's own copies
  hc.stats = CallStats{};
  hc.call = call;
  MOE_RETURN_IF_ERROR(Plan(hc, routing));

  MOE_RETURN_IF_ERROR(ctx_.backend->BeginCall(hc.context, T, call.batch.tokens, call.kind));
  hc.busy = true;
  hc.submitted = t_start;
  hc.device_prior_s = -1;
  hc.beside_copies = copies_.any_in_flight();
  // Hits only (none prefetched, whose copies the call may wait for): the device time is the call's time.
  const CostModel& rates = ctx_.planner.rates();
  if (hc.plan.missed.empty() && rates.measured && prefetch_[call.batch.layer & 1].layer != call.batch.layer) {
    hc.device_prior_s = 0;
    for (int e : hc.plan.accessed) hc.device_prior_s += rates.DevicePrior(hc.plan.hit_pairs[e]);
  }
  hc.deadline = t_start + (call.deadline.count() > 0 ? call.deadline : ctx_.config.deadline);
  hc.sent.clear();
  if (absl::Status st = Dispatch(hc); !st.ok()) {
    Abort(hc);
    return st;
  }
  hc.stats.submit_seconds = Seconds(Clock::now() - t_start);
  return hc.context;
}

absl::StatusOr<HostCall*> HostExecutor::FreeCall() {
  for (HostCall& hc : calls_)
    if (!hc.busy) return &hc;
  return absl::ResourceExhaustedError(absl::StrCat("contexts: ", calls_.size(), " calls already in flight"));
}

absl::Status HostExecutor::CheckCall(const LayerCall& call) const {
  const MoeBatch& b = call.batch;
  const DispatcherConfig& c = ctx_.config;
  if (!ctx_.Serves(b.layer))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", b.layer, " is not an MoE layer served here"));
  if (b.n < 0 || b.n > c.max_tokens)
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", b.n, " is outside [0, ", c.max_tokens, "]"));
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(absl::StrCat("topk_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (b.n > 0 && (b.routing.k < 1 || b.routing.k > c.max_top_k))
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: k = ", b.routing.k, " is outside [1, ", c.max_top_k, "]"));
  if (b.n > 0 && (b.tokens == nullptr || b.routing.ids == nullptr || b.routing.weights == nullptr ||
                  call.out == nullptr))
    return absl::InvalidArgumentError("hidden/topk_ids/topk_weights/out: null pointer");
  if (call.kind == MemoryKind::kDevice && !ctx_.backend->has_device_memory())
    return absl::InvalidArgumentError("kind: device pointers given to a backend without device memory");
  return absl::OkStatus();
}

// The call's routing in host memory (a copy of T*k ids/weights from the
// device when it lives there).
absl::Status HostExecutor::CopyRouting(const LayerCall& call, std::vector<int32_t>& ids, std::vector<float>& weights) {
  const RoutingView& r = call.batch.routing;
  const int T = call.batch.n, k = std::max(r.k, 1);
  ids.resize(static_cast<size_t>(T) * k);
  weights.resize(ids.size());
  if (T == 0) return absl::OkStatus();
  if (call.kind == MemoryKind::kDevice)
    return ctx_.backend->RoutingToHost(r.ids, r.weights, T * k, ids.data(), weights.data());
  std::memcpy(ids.data(), r.ids, ids.size() * sizeof(int32_t));
  std::memcpy(weights.data(), r.weights, weights.size() * sizeof(float));
  return absl::OkStatus();
}

// The planner's split of the call's validated routing (Planner::PlanCall)
// into hc.plan, against the slot map (and this layer's prefetch buffers:
// their experts are computed with the hits; a prefetch for another layer of
// the parity is stale) and the servers as they are now.
absl::Status HostExecutor::Plan(HostCall& hc, const RoutingView& routing) {
  const int E = ctx_.spec.num_experts, layer = hc.call.batch.layer;
  for (int e = 0; e < E; ++e) {
    const int slot = ctx_.cache->ReadySlot(layer, e);
    slot_buffer_[e] = slot >= 0 ? ctx_.SlotBuffer(layer, slot) : -1;
  }
  std::fill(hc.prefetched.begin(), hc.prefetched.end(), false);
  Prefetch& pf = prefetch_[layer & 1];
  if (pf.layer == layer) {
    for (int e = 0; e < E; ++e)
      if (pf.buffer[e] >= 0 && slot_buffer_[e] < 0) {
        slot_buffer_[e] = buffers_.prefetch_base + pf.buffer[e];
        hc.prefetched[e] = true;
      }
  } else if (pf.layer >= 0) {
    ReleasePrefetch(layer & 1, false);
  }
  bool any_miss = false;
  for (size_t i = 0, n = static_cast<size_t>(routing.n) * routing.k; i < n && !any_miss; ++i)
    any_miss = routing.ids[i] >= 0 && slot_buffer_[routing.ids[i]] < 0;
  const std::vector<PlanServer>& servers = servers_.ForPlan(any_miss, Clock::now());
  MissPlanInput in;
  in.layer = layer;
  in.routing = routing;
  in.num_experts = E;
  in.slot_buffer = slot_buffer_.data();
  in.servers = servers.data();
  in.num_servers = static_cast<int>(servers.size());
  in.hit_row_align = ctx_.backend->hit_row_align();
  in.copy_mode = ctx_.config.copy_mode;
  in.can_copy = can_copy_misses();
  in.copy_min_tokens = ctx_.config.copy_min_tokens;
  return ctx_.planner.PlanCall(in, &hc.plan);
}

// Carries out the plan of a call Submit has planned: ships the CPU misses,
// enqueues the hits, the copied experts, the next layer's prefetch and the
// cache admissions.
absl::Status HostExecutor::Dispatch(HostCall& hc) {
  const int layer = hc.call.batch.layer;
  // 1. The CPU misses, per server, before any device compute is enqueued.
  MOE_RETURN_IF_ERROR(ShipMisses(hc));
  // 2. Hits: one grouped launch over the cached experts, then one over the
  // experts prefetched for this call, after their copies (RunHits).
  const int parity = layer & 1;
  const bool prefetched = prefetch_[parity].layer == layer;
  const absl::Status hits = RunHits(hc);
  if (prefetched) ReleasePrefetch(parity, true);
  MOE_RETURN_IF_ERROR(hits);
  RecordAccesses(hc);
  // 3. Copy-instead-of-compute, then the next layer's prefetch behind it on the link.
  MOE_RETURN_IF_ERROR(ComputeCopies(hc));
  if (!hc.plan.copy_experts.empty() || prefetched) ctx_.planner.OwnCopiesQueued();
  MOE_ASSIGN_OR_RETURN(const int prefetches, StartPrefetch(hc));
  ReportActivity(hc, prefetches);
  // 4. Admissions for later calls (after the compute above, so an evicted
  // slot is overwritten only once it was read).
  return copies_.AfterHostCall(layer, hc.call.batch.n, std::max(hc.call.batch.routing.k, 1), hc.ids.data(),
                               hc.plan.missed);
}

// The call's accesses: the cache's counters, the layer's last pairs (the
// prefetch's forecast) and on_access (a prefetched expert was not cached:
// its pairs count as misses).
void HostExecutor::RecordAccesses(HostCall& hc) {
  const int layer = hc.call.batch.layer;
  const MissPlan& plan = hc.plan;
  access_pairs_.clear();
  for (int e : plan.accessed) access_pairs_.push_back(plan.hit_pairs[e] + plan.miss_pairs[e]);
  ctx_.cache->RecordAccess(layer, plan.accessed, access_pairs_);
  std::vector<int32_t>& last = last_pairs_[ctx_.layer_index[layer]];
  std::fill(last.begin(), last.end(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < plan.accessed.size(); ++i) {
    last[plan.accessed[i]] = access_pairs_[i];
    total += access_pairs_[i];
  }
  last_total_[ctx_.layer_index[layer]] = total;
  if (ctx_.config.on_access)
    for (int e : plan.accessed) {
      if (plan.hit_pairs[e] > 0) ctx_.config.on_access(layer, e, plan.hit_pairs[e], !hc.prefetched[e]);
      if (plan.miss_pairs[e] > 0) ctx_.config.on_access(layer, e, plan.miss_pairs[e], false);
    }
}

// on_activity: the call's split of its uncached pairs and the link time of its copies.
void HostExecutor::ReportActivity(const HostCall& hc, int prefetches) {
  if (!ctx_.config.on_activity || (hc.stats.cpu_pairs == 0 && hc.stats.copied_pairs == 0)) return;
  LayerActivity a;
  a.cpu_pairs = static_cast<uint64_t>(hc.stats.cpu_pairs);
  a.copied_pairs = static_cast<uint64_t>(hc.stats.copied_pairs);
  a.prefetched_pairs = static_cast<uint64_t>(hc.stats.prefetched_pairs);
  const int link_copies = static_cast<int>(hc.plan.copy_experts.size()) + prefetches;
  const CostModel& rates = ctx_.planner.rates();
  a.link_seconds = rates.measured ? rates.CopySeconds() * link_copies : 0.0;
  ctx_.config.on_activity(hc.call.batch.layer, a);
}

// Turns the plan's server batches into the call's sent batches and hands them
// to the transports: gathered straight into the transport's memory (staged)
// where it has some, else through the context's send buffer.
absl::Status HostExecutor::ShipMisses(HostCall& hc) {
  CallStats& stats = hc.stats;
  const int H = ctx_.spec.hidden;
  stats.cpu_experts += hc.plan.cpu_experts;
  for (int e : hc.plan.missed)  // once per pair, however many slice holders compute a share of it
    if (hc.plan.route_of[e] != 0) stats.cpu_pairs += hc.plan.miss_pairs[e];
  // A token travels to every server one of its pairs goes to (to each slice
  // holder): the batches' rows may add up to more than the call's tokens.
  size_t rows = 0;
  for (const ServerBatch& b : hc.plan.batches) rows += static_cast<size_t>(b.n);
  if (rows * H > hc.send.size()) MOE_RETURN_IF_ERROR(GrowHostBuffers(*ctx_.backend, H, hc, rows));
  size_t offset = 0;  // the batch's first row in the call's send/recv buffers
  for (ServerBatch& b : hc.plan.batches) {
    SentBatch& sh = hc.sent.emplace_back();
    stats.miss_tokens += b.n;
    stats.bytes_shipped += static_cast<uint64_t>(b.n) * (2 * H * sizeof(bf16_t) + b.k * 8);
    sh.host_offset = offset;
    offset += b.n;
    sh.batch = std::move(b);
  }
  const std::chrono::microseconds polling =
      hc.call.batch.n <= ctx_.config.poll_max_tokens ? ctx_.config.poll_window : std::chrono::microseconds(0);
  for (SentBatch& sh : hc.sent) {
    servers_.SetPolling(sh.batch.server, polling);
    Server& server = servers_.at(sh.batch.server);
    bf16_t* dst = nullptr;
    const Clock::time_point answer_by = hc.ServerDeadline(ctx_.config.server_deadline);
    if (server.registered) {
      absl::StatusOr<StagingArea> staged = server.transport->Stage(sh.batch.n, sh.batch.k, answer_by);
      if (staged.ok()) {
        sh.staged = true;
        sh.stage = *staged;
        dst = sh.stage.tokens;
      }
    }
    if (dst == nullptr) dst = hc.send.data() + sh.host_offset * H;
    MOE_RETURN_IF_ERROR(Gather(hc, sh.batch.rows, dst));
    if (sh.staged) {
      std::memcpy(sh.stage.expert_ids, sh.batch.ids.data(), sh.batch.ids.size() * sizeof(int32_t));
      std::memcpy(sh.stage.expert_weights, sh.batch.weights.data(), sh.batch.weights.size() * sizeof(float));
      sh.sent_at = Clock::now();
      sh.done = server.transport->SubmitStaged(sh.stage, static_cast<uint32_t>(hc.call.batch.layer), answer_by);
    } else {
      sh.sent_at = Clock::now();
      sh.done = server.transport->Submit(GatheredBatch(hc.call.batch.layer, sh.batch, dst),
                                         hc.recv.data() + sh.host_offset * H, answer_by);
    }
  }
  return absl::OkStatus();
}

// The call's rows `rows` gathered into host memory `dst`, complete on return.
absl::Status HostExecutor::Gather(HostCall& hc, const std::vector<int32_t>& rows, bf16_t* dst) {
  MOE_ASSIGN_OR_RETURN(const uint64_t f,
                       ctx_.backend->GatherRows(hc.context, rows.data(), static_cast<int>(rows.size()), dst));
  return ctx_.backend->WaitCompute(f);
}

// The plan's copied experts: under copy-every-miss admitted into the cache
// (the plain LRU offload) and computed from their new slots; the rest through
// the temporary buffers.
absl::Status HostExecutor::ComputeCopies(HostCall& hc) {
  const MissPlan& plan = hc.plan;
  const int layer = hc.call.batch.layer;
  // The link starts on them now, while the loops below are still enqueueing
  // (a bf16 call's per-expert cuBLAS launches kept the host here for 4-5 ms
  // at 2048 tokens; timed from the loops' end, the planner's link clock ran
  // that far behind the link, and the prefetch window it measures shrank
  // by as much; H100 host).
  ctx_.planner.CopiesQueued(static_cast<int>(plan.copy_experts.size()));
  std::vector<int> copy_list = plan.copy_experts;
  if (ctx_.config.copy_mode == CopyMode::kAlways && ctx_.config.policy != CachePolicy::kStatic &&
      !copy_list.empty()) {
    std::vector<SlotCopy> copies = ctx_.cache->PlanAdmissions(layer, copy_list, static_cast<int>(copy_list.size()));
    for (const SlotCopy& copy : copies) {
      absl::StatusOr<uint64_t> f =
          ComputeCopied(hc, plan.copies, plan.copy_group(copy.expert), ctx_.SlotBuffer(layer, copy.slot));
      if (!f.ok()) {
        ctx_.cache->AbortCopy(copy);
        return f.status();
      }
      copies_.Track(copy, *f);
      copy_list.erase(std::find(copy_list.begin(), copy_list.end(), copy.expert));
    }
  }
  copy_groups_.clear();
  for (int e : copy_list) copy_groups_.push_back(plan.copy_group(e));
  return ComputeCopiedInBuffers(hc, plan.copies, copy_groups_);
}

// Prefetch, for prompts: a call that moved experts over the link (copied, or
// computed from a prefetch) starts copying the next served layer's experts
// into that layer's prefetch buffers right away, behind its own copies, so
// the link keeps working while this layer computes, its CPU share finishes
// and the next layer's attention runs; the next layer's call computes them
// after its cached hits (Plan, RunHits). Which and how many, from what the
// planner did: at most as many as this call moved, and only experts whose
// expected pairs in the next call (its last call's, scaled to this call's
// size) are at least those of the least-used expert this call moved — an
// expert the planner would copy too. Decode calls, whose experts the plan
// leaves to the CPU servers, prefetch nothing. Returns the copies started.
absl::StatusOr<int> HostExecutor::StartPrefetch(HostCall& hc) {
  if (!ctx_.config.prefetch || buffers_.prefetch_base < 0 || ctx_.config.copy_mode != CopyMode::kAuto) return 0;
  int moved = 0;
  int32_t least = std::numeric_limits<int32_t>::max();
  for (int e : hc.plan.copy_experts) {
    ++moved;
    least = std::min(least, hc.plan.miss_pairs[e]);
  }
  for (int e : hc.plan.accessed)
    if (hc.prefetched[e] && hc.plan.hit_pairs[e] > 0) {
      ++moved;
      least = std::min(least, hc.plan.hit_pairs[e]);
    }
  if (moved == 0) return 0;
  const size_t index = ctx_.layer_index[hc.call.batch.layer], next_index = (index + 1) % ctx_.layers.size();
  const int next = ctx_.layers[next_index], parity = next & 1;
  Prefetch& pf = prefetch_[parity];
  if (pf.layer == next) return 0;  // another micro-batch's call started it
  if (pf.layer >= 0) ReleasePrefetch(parity, false);
  if (last_total_[next_index] == 0) return 0;
  const double scale = static_cast<double>(last_total_[index]) / static_cast<double>(last_total_[next_index]);
  for (int e = 0; e < ctx_.spec.num_experts; ++e)
    prefetch_candidate_[e] = ctx_.cache->SlotOf(next, e) < 0 && ctx_.host->Find(next, e) != nullptr;
  const CostModel& rates = ctx_.planner.rates();
  std::vector<int>& order = prefetch_order_;
  ChoosePrefetch(last_pairs_[next_index], prefetch_candidate_, scale, least, moved, buffers_.prefetch_per_parity,
                 ctx_.planner.PrefetchWindow(), rates.measured ? rates.CopySeconds() : 0.0, &order);
  const int n = static_cast<int>(order.size());
  if (n == 0) return 0;
  pf.layer = next;
  for (int i = 0; i < n; ++i) {
    const int ti = parity * buffers_.prefetch_per_parity + i;
    MOE_ASSIGN_OR_RETURN(pf.last_fence, ctx_.backend->LoadExpert(buffers_.prefetch_base + ti, ctx_.host->Find(next, order[i]),
                                                             prefetch_free_[ti]));
    pf.buffer[order[i]] = ti;
  }
  ctx_.planner.CopiesQueued(n);
  return n;
}

// Gives back the prefetch of `parity`: consumed by a call (its buffers free
// once the compute enqueued so far, which reads them, has run) or stale
// (nothing read them; copies land in order, so a later copy into one of them
// lands after the prefetch's).
void HostExecutor::ReleasePrefetch(int parity, bool consumed) {
  Prefetch& pf = prefetch_[parity];
  const uint64_t after = consumed ? ctx_.backend->RecordCompute() : 0;
  for (int32_t& ti : pf.buffer) {
    if (ti < 0) continue;
    if (consumed) prefetch_free_[ti] = after;
    ti = -1;
  }
  pf.layer = -1;
}

namespace {
// A launch's groups: none yet.
void ClearGroups(ExpertGroups& launch) {
  launch.expert.clear();
  launch.row_begin.clear();
  launch.count.clear();
  launch.token.clear();
  launch.weight.clear();
  launch.total_rows = launch.total_pairs = 0;
}
// Appends group g of `from` to `launch`, padded so that the next group starts
// on a multiple of `align` rows.
void AppendGroup(const ExpertGroups& from, int g, int align, ExpertGroups& launch) {
  const int32_t begin = from.row_begin[g], count = from.count[g];
  launch.expert.push_back(from.expert[g]);
  launch.row_begin.push_back(static_cast<int32_t>(launch.token.size()));
  launch.count.push_back(count);
  launch.token.insert(launch.token.end(), from.token.begin() + begin, from.token.begin() + begin + count);
  launch.weight.insert(launch.weight.end(), from.weight.begin() + begin, from.weight.begin() + begin + count);
  while (launch.token.size() % align != 0) {
    launch.token.push_back(-1);
    launch.weight.push_back(0.f);
  }
  launch.total_rows = static_cast<int32_t>(launch.token.size());
  launch.total_pairs += count;
}
}  // namespace

// The plan's hits: the cached experts' groups in one launch, which waits for
// no copy; then, after their copies landed, the experts prefetched for this
// call (PlanCall gave them their prefetch buffers as slots) in a launch of
// their own, counted as copied and prefetched and timed as copied experts.
absl::Status HostExecutor::RunHits(HostCall& hc) {
  const ExpertGroups& hits = hc.plan.hits;
  if (hits.num_groups() == 0) return absl::OkStatus();
  bool any = false;
  for (int g = 0; g < hits.num_groups() && !any; ++g) any = hc.prefetched[hits.expert[g]];
  hc.stats.hit_pairs = hits.total_pairs;
  if (!any) return ctx_.backend->RunExperts(hc.context, hc.plan.hit_plan());
  const int align = ctx_.backend->hit_row_align();
  ExpertGroups &cached = one_group_, &fetched = prefetch_groups_;
  ClearGroups(cached);
  ClearGroups(fetched);
  launch_buffers_.clear();
  prefetch_launch_buffers_.clear();
  double prior = 0;
  for (int g = 0; g < hits.num_groups(); ++g) {
    if (!hc.prefetched[hits.expert[g]]) {
      AppendGroup(hits, g, align, cached);
      launch_buffers_.push_back(hc.plan.hit_buffer[g]);
      continue;
    }
    AppendGroup(hits, g, align, fetched);
    prefetch_launch_buffers_.push_back(hc.plan.hit_buffer[g]);
    prior += ctx_.planner.rates().CopyDevicePrior(hits.count[g]);
    hc.stats.hit_pairs -= hits.count[g];
    hc.stats.copied_pairs += hits.count[g];
    ++hc.stats.copied_experts;
    hc.stats.prefetched_pairs += hits.count[g];
    ++hc.stats.prefetched_experts;
  }
  if (cached.num_groups() > 0)
    MOE_RETURN_IF_ERROR(ctx_.backend->RunExperts(hc.context, HitPlan{&cached, launch_buffers_.data()}));
  ctx_.backend->ComputeWaitCopy(prefetch_[hc.call.batch.layer & 1].last_fence);  // copies land in order
  const uint64_t start = ctx_.backend->MarkCompute();
  MOE_RETURN_IF_ERROR(ctx_.backend->RunExperts(hc.context, HitPlan{&fetched, prefetch_launch_buffers_.data()}));
  hc.copy_launches.push_back({start, ctx_.backend->MarkCompute(), prior});
  return absl::OkStatus();
}

// Copies the expert of group g of `groups` (of the call's layer) into cache
// buffer `buffer` and computes the group's pairs there.
absl::StatusOr<uint64_t> HostExecutor::ComputeCopied(HostCall& hc, const ExpertGroups& groups, int g,
                                                        int buffer) {
  const int layer = hc.call.batch.layer;
  const uint64_t after = ctx_.backend->RecordCompute();  // an evicted slot may still be read by earlier calls
  MOE_ASSIGN_OR_RETURN(const uint64_t f, ctx_.backend->LoadExpert(buffer, ctx_.host->Find(layer, groups.expert[g]), after));
  ctx_.backend->ComputeWaitCopy(f);
  hc.copy_fences.push_back(f);
  ExpertGroups& one = one_group_;
  ClearGroups(one);
  AppendGroup(groups, g, 1, one);  // the group alone, from row 0 (aligned for any backend)
  MOE_RETURN_IF_ERROR(ctx_.backend->RunExperts(hc.context, HitPlan{&one, &buffer}));
  hc.stats.copied_pairs += one.total_pairs;
  ++hc.stats.copied_experts;
  return f;
}

// The layer parity's temporary buffers split in two halves that launches
// alternate between: a launch computes up to half of them at once, and the
// next launch's copies land in the other half while it runs. One expert per
// launch (before) left most of the device idle: at 128 rows per expert
// (2048-token prompts) the copied experts' compute outlasted their copies,
// and prompts mixing CPU work and copies ran slower than copying everything.
absl::Status HostExecutor::ComputeCopiedInBuffers(HostCall& hc, const ExpertGroups& groups,
                                                     const std::vector<int>& gs) {
  const int layer = hc.call.batch.layer, parity = layer & 1, B = ctx_.config.miss_buffers;
  const int per_launch = std::max(1, B / 2), halves = B >= 2 ? 2 : 1, align = ctx_.backend->hit_row_align();
  ExpertGroups& launch = one_group_;
  for (size_t i0 = 0; i0 < gs.size(); i0 += per_launch) {
    const size_t i1 = std::min(gs.size(), i0 + per_launch);
    const int first = parity * B + (temp_next_[parity]++ % halves) * per_launch;  // the half's first buffer
    ClearGroups(launch);
    launch_buffers_.clear();
    uint64_t last_copy = 0;
    double prior = 0;
    for (size_t i = i0; i < i1; ++i) {
      const int g = gs[i], ti = first + static_cast<int>(i - i0);
      MOE_ASSIGN_OR_RETURN(last_copy, ctx_.backend->LoadExpert(buffers_.temp_base + ti, ctx_.host->Find(layer, groups.expert[g]),
                                                           temp_fence_[ti]));
      hc.copy_fences.push_back(last_copy);
      launch_buffers_.push_back(buffers_.temp_base + ti);
      AppendGroup(groups, g, align, launch);
      prior += ctx_.planner.rates().CopyDevicePrior(groups.count[g]);
    }
    hc.stats.copied_pairs += launch.total_pairs;
    hc.stats.copied_experts += static_cast<int>(i1 - i0);
    ctx_.backend->ComputeWaitCopy(last_copy);  // copies land in order: the last covers the launch's
    // The launch alone, timed on the compute queue (its start mark passes
    // once the copies landed and the work before it is done).
    const uint64_t start = ctx_.backend->MarkCompute();
    MOE_RETURN_IF_ERROR(ctx_.backend->RunExperts(hc.context, HitPlan{&launch, launch_buffers_.data()}));
    const uint64_t end = ctx_.backend->MarkCompute();
    const uint64_t done = ctx_.backend->RecordCompute();
    hc.copy_launches.push_back({start, end, prior});
    for (size_t i = i0; i < i1; ++i) temp_fence_[first + static_cast<int>(i - i0)] = done;
  }
  return absl::OkStatus();
}

// Waits for the call's sent batches (nothing may still write) and gives
// their staged memory back.
void HostExecutor::ReleaseSent(HostCall& hc) {
  for (SentBatch& sh : hc.sent) {
    if (sh.done.valid()) sh.done.wait();
    if (sh.staged) servers_.at(sh.batch.server).transport->Release(sh.stage);
    sh.staged = false;
  }
  hc.sent.clear();
}

// Gives back everything a failed call holds; its output is discarded.
void HostExecutor::Abort(HostCall& hc) {
  hc.copy_fences.clear();
  hc.copy_launches.clear();
  ReleaseSent(hc);
  (void)ctx_.backend->FinishCall(hc.context, nullptr, hc.call.kind);
  hc.busy = false;
}

absl::Status HostExecutor::Complete(int ticket, CallStats* out_stats) {
  if (ticket < 0 || ticket >= static_cast<int>(calls_.size()) || !calls_[ticket].busy)
    return absl::InvalidArgumentError(absl::StrCat("ticket: ", ticket, " is not a call in flight"));
  HostCall& hc = calls_[ticket];
  const Clock::time_point t0 = Clock::now();
  uint64_t last_fence = 0;
  const absl::Status result = AddPartials(hc, &last_fence);
  // FinishCall waits for all of the call's device work, the reads of the
  // partial sums (AddRows) included: only then are the slots given back (one
  // sync per call instead of two).
  absl::Status fin = ctx_.backend->FinishCall(hc.context, result.ok() ? hc.call.out : nullptr, hc.call.kind);
  if (!fin.ok() && last_fence != 0) (void)ctx_.backend->WaitCompute(last_fence);
  // The engine's later work on its stream sees the output.
  if (absl::Status sig = ctx_.backend->SignalStream(hc.call.stream); fin.ok()) fin = sig;
  ReleaseSent(hc);
  hc.busy = false;
  const Clock::time_point end = Clock::now();
  ObserveOutcome(hc, result.ok() && fin.ok(), end);
  hc.stats.wait_seconds = Seconds(end - t0);
  if (out_stats != nullptr) *out_stats = hc.stats;
  if (!result.ok()) return result;
  return fin;
}

// What the call's outcome teaches the planner's rates (all of its device
// work done: FinishCall waited for it).
void HostExecutor::ObserveOutcome(HostCall& hc, bool ok, Clock::time_point end) {
  CostModel& rates = ctx_.planner.rates();
  const double took = Seconds(end - hc.submitted);
  // The copies the call computed from, timed on the copy queue: under load
  // they take longer than the start-up probe's (PCIe and the CPU servers
  // share DRAM).
  for (uint64_t f : hc.copy_fences) copies_.ObserveCopy(f, took);
  hc.copy_fences.clear();
  // Their launches, timed on the compute queue: the copied experts' device
  // cost, which the call's end time cannot separate from the link's.
  if (ok)
    for (const HostCall::CopyLaunch& l : hc.copy_launches)
      if (std::optional<double> s = ctx_.backend->ComputeSeconds(l.start, l.end)) rates.ObserveCopyDevice(l.prior_s, *s);
  hc.copy_launches.clear();
  if (!ok) return;
  // A hits-only call: Submit to here bounds the device time from above.
  if (hc.device_prior_s > 0) rates.ObserveDevice(hc.device_prior_s, took, true);
  rates.overlap.Observe(CopyOverlap::Shape(hc.call.batch.n, static_cast<int>(hc.plan.missed.size())),
                        hc.beside_copies, took);
  // A call whose copies the outcomes could have overruled: its time, for its shape.
  if (hc.plan.outcome_bucket >= 0)
    ctx_.planner.host_outcomes().Observe(hc.plan.outcome_bucket, hc.plan.outcome_choice, took);
}

// Waits for every sent batch of the call (failing over those whose server
// failed) and adds the servers' partial sums; *last_fence: the fence after
// the last AddRows.
absl::Status HostExecutor::AddPartials(HostCall& hc, uint64_t* last_fence) {
  int timed_server = -1;
  for (size_t i = 0; i < hc.sent.size(); ++i) {
    SentBatch& sh = hc.sent[i];
    // The first batch a server got in this call is timed for the cost model
    // (later ones queue behind it); one already answered bounds it from above.
    const bool timed = sh.batch.server != timed_server;
    timed_server = sh.batch.server;
    const bool ready = sh.done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    // The transport's completion thread polls in decode; this thread spins
    // only briefly (a core more would compete with the server's pool).
    absl::Status st = AwaitResult(sh.done);
    if (timed && st.ok())
      ctx_.planner.rates().ObserveCpu(sh.batch.experts, sh.batch.pairs, Seconds(Clock::now() - sh.sent_at), ready);
    const bf16_t* partial = sh.staged ? sh.stage.output : hc.recv.data() + sh.host_offset * ctx_.spec.hidden;
    if (st.ok()) servers_.Answered(sh.batch.server);
    if (!st.ok()) MOE_RETURN_IF_ERROR(FailOver(hc, i, std::move(st), &partial));
    if (partial != nullptr && sh.batch.n > 0) {
      MOE_ASSIGN_OR_RETURN(*last_fence, ctx_.backend->AddRows(hc.context, sh.batch.rows.data(), sh.batch.n, partial));
    }
  }
  return absl::OkStatus();
}

// SentBatch `index` of the call failed with `st`: a server failure
// (UNAVAILABLE / DEADLINE_EXCEEDED: no answer within server_deadline / ...)
// is failed over as the servers decide (ServerSet::FailOver: another holder
// of its experts while the call's deadline allows, else the device from host
// copies when copy_fallback allows, else UNAVAILABLE); any other error (the
// server rejected the batch: a bug or bad input) is returned as is. On OK
// *partial is the output to add, null when computed on the device.
absl::Status HostExecutor::FailOver(HostCall& hc, size_t index, absl::Status st, const bf16_t** partial) {
  SentBatch& sh = hc.sent[index];
  const int H = ctx_.spec.hidden, layer = hc.call.batch.layer;
  while (!st.ok()) {
    if (!IsServerFailure(st)) return st;
    ++hc.stats.failovers;
    if (sh.staged) {
      servers_.at(sh.batch.server).transport->Release(sh.stage);
      sh.staged = false;
    }
    const FailoverStep step =
        servers_.FailOver(layer, sh.batch, st, hc.deadline, can_copy_misses() && ctx_.config.copy_fallback);
    switch (step.action) {
      case FailoverChoice::kResend: {
        sh.batch.server = step.server;
        bf16_t* dst = hc.send.data() + sh.host_offset * H;
        MOE_RETURN_IF_ERROR(Gather(hc, sh.batch.rows, dst));
        bf16_t* out = hc.recv.data() + sh.host_offset * H;
        sh.done = servers_.at(step.server).transport->Submit(GatheredBatch(layer, sh.batch, dst), out,
                                                             hc.ServerDeadline(ctx_.config.server_deadline));
        st = AwaitResult(sh.done);
        *partial = out;
        continue;
      }
      case FailoverChoice::kDevice:
        MOE_RETURN_IF_ERROR(ComputeServerBatchOnDevice(hc, sh.batch));
        hc.stats.cpu_pairs -= sh.batch.pairs;  // computed on the device instead
        *partial = nullptr;                    // nothing to add
        return absl::OkStatus();
      case FailoverChoice::kFail:
        return step.status;
    }
  }
  return absl::OkStatus();
}

// A failed server batch computed on the device, expert by expert, from host copies.
absl::Status HostExecutor::ComputeServerBatchOnDevice(HostCall& hc, const ServerBatch& b) {
  ExpertGroups& groups = failover_groups_;
  GroupByExpert(RoutingView{b.n, b.k, b.ids.data(), b.weights.data()}, ctx_.spec.num_experts, 1, &groups);
  for (int32_t& t : groups.token)
    if (t >= 0) t = b.rows[t];  // batch rows -> the call's tokens
  copy_groups_.resize(groups.num_groups());
  std::iota(copy_groups_.begin(), copy_groups_.end(), 0);
  return ComputeCopiedInBuffers(hc, groups, copy_groups_);
}

}  // namespace moe
