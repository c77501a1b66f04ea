// LayerDispatcher's host path (Submit / Complete): a call's routing to the
// host, its split, the misses shipped to the servers, the hits, the copied
// and prefetched experts on the device, and the merge of the partial sums.
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "model/routing.h"
#include "core/status_macros.h"
#include "gpu_worker/dispatcher_internal.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

// A context's send/recv buffers for `rows` rows (between its calls).
absl::Status GrowHostBuffers(DeviceBackend& backend, int hidden, InFlightCall& ctx, size_t rows) {
  for (std::vector<bf16_t>* b : {&ctx.send, &ctx.recv}) {
    backend.UnregisterHost(b->data());
    b->resize(rows * hidden);
    b->shrink_to_fit();
    MOE_RETURN_IF_ERROR(backend.RegisterHost(b->data(), b->size() * sizeof(bf16_t)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> LayerDispatcher::Submit(const LayerCall& call) {
  const Clock::time_point t_start = Clock::now();
  Impl& m = *impl_;
  MOE_ASSIGN_OR_RETURN(InFlightCall * free, FreeContext());
  InFlightCall& ctx = *free;
  // Validation: nothing is touched before the call is known to be sound.
  MOE_RETURN_IF_ERROR(CheckCall(call));
  // The engine's earlier work on its stream (which produced hidden/routing)
  // comes before ours: an event wait, no host sync of that stream.
  MOE_RETURN_IF_ERROR(backend_->WaitStream(call.stream));
  MOE_RETURN_IF_ERROR(CopyRouting(call, ctx.ids, ctx.weights));
  const int T = call.batch.n, k = std::max(call.batch.routing.k, 1);
  const RoutingView routing{T, k, ctx.ids.data(), ctx.weights.data()};
  MOE_RETURN_IF_ERROR(ValidateRouting(routing, spec_.num_experts, {}));
  if (config_.group.size > 1)  // another rank computes these pairs
    for (int32_t& e : ctx.ids)
      if (e >= 0 && !Owns(call.batch.layer, e)) e = -1;

  PollCopies();
  planner_.CallStarted();  // the link's idle window since the last call's own copies
  ctx.stats = CallStats{};
  MOE_RETURN_IF_ERROR(PlanCall(call.batch.layer, routing, ctx.plan));

  MOE_RETURN_IF_ERROR(backend_->BeginCall(ctx.context, T, call.batch.tokens, call.kind));
  ctx.busy = true;
  ctx.call = call;
  ctx.submitted = t_start;
  ctx.device_prior_s = -1;
  ctx.beside_copies = !m.pending.empty();
  // Hits only (none prefetched, whose copies the call may wait for): the device time is the call's time.
  if (ctx.plan.missed.empty() && planner_.rates().measured && m.prefetch[call.batch.layer & 1].layer != call.batch.layer) {
    ctx.device_prior_s = 0;
    for (int e : ctx.plan.accessed) ctx.device_prior_s += planner_.rates().DevicePrior(ctx.plan.hit_pairs[e]);
  }
  ctx.deadline = t_start + (call.deadline.count() > 0 ? call.deadline : config_.deadline);
  ctx.sent.clear();
  if (absl::Status st = Dispatch(ctx); !st.ok()) {
    Abort(ctx);
    return st;
  }
  ctx.stats.submit_seconds = Seconds(Clock::now() - t_start);
  return ctx.context;
}

absl::StatusOr<InFlightCall*> LayerDispatcher::FreeContext() {
  for (InFlightCall& c : impl_->contexts)
    if (!c.busy) return &c;
  return absl::ResourceExhaustedError(
      absl::StrCat("contexts: ", impl_->contexts.size(), " calls already in flight"));
}

absl::Status LayerDispatcher::CheckCall(const LayerCall& call) const {
  const MoeBatch& b = call.batch;
  if (b.layer < 0 || b.layer >= spec_.num_layers || layer_index_[b.layer] < 0)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", b.layer, " is not an MoE layer served here"));
  if (b.n < 0 || b.n > config_.max_tokens)
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: ", b.n, " is outside [0, ", config_.max_tokens, "]"));
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (b.n > 0 && (b.routing.k < 1 || b.routing.k > config_.max_top_k))
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids: k = ", b.routing.k, " is outside [1, ", config_.max_top_k, "]"));
  if (b.n > 0 && (b.tokens == nullptr || b.routing.ids == nullptr || b.routing.weights == nullptr ||
                  call.out == nullptr))
    return absl::InvalidArgumentError("hidden/topk_ids/topk_weights/out: null pointer");
  if (call.kind == MemoryKind::kDevice && !backend_->has_device_memory())
    return absl::InvalidArgumentError("kind: device pointers given to a backend without device memory");
  return absl::OkStatus();
}

// The call's routing in host memory (a copy of T*k ids/weights from the
// device when it lives there).
absl::Status LayerDispatcher::CopyRouting(const LayerCall& call, std::vector<int32_t>& ids,
                                          std::vector<float>& weights) {
  const RoutingView& r = call.batch.routing;
  const int T = call.batch.n, k = std::max(r.k, 1);
  ids.resize(static_cast<size_t>(T) * k);
  weights.resize(ids.size());
  if (T == 0) return absl::OkStatus();
  if (call.kind == MemoryKind::kDevice)
    return backend_->RoutingToHost(r.ids, r.weights, T * k, ids.data(), weights.data());
  std::memcpy(ids.data(), r.ids, ids.size() * sizeof(int32_t));
  std::memcpy(weights.data(), r.weights, weights.size() * sizeof(float));
  return absl::OkStatus();
}

// The split of a validated routing of `layer` (PlanMisses) into `plan`,
// against the slot map and the servers as they are now. Servers due a retry
// are reconnected first when the call has misses.
absl::Status LayerDispatcher::PlanCall(int layer, const RoutingView& routing, MissPlan& plan) {
  Impl& m = *impl_;
  const int E = spec_.num_experts;
  for (int e = 0; e < E; ++e) {
    const int slot = cache_->ReadySlot(layer, e);
    m.slot_buffer[e] = slot >= 0 ? SlotBuffer(layer, slot) : -1;
  }
  // The experts prefetched for this layer are computed from their prefetch
  // buffers with the hits; a prefetch for another layer of the parity is stale.
  std::fill(m.prefetched_now.begin(), m.prefetched_now.end(), false);
  Impl::Prefetch& pf = m.prefetch[layer & 1];
  if (pf.layer == layer) {
    for (int e = 0; e < E; ++e)
      if (pf.buffer[e] >= 0 && m.slot_buffer[e] < 0) {
        m.slot_buffer[e] = m.prefetch_base + pf.buffer[e];
        m.prefetched_now[e] = true;
      }
  } else if (pf.layer >= 0) {
    ReleasePrefetch(layer & 1, false);
  }
  bool any_miss = false;
  for (size_t i = 0, n = static_cast<size_t>(routing.n) * routing.k; i < n && !any_miss; ++i)
    any_miss = routing.ids[i] >= 0 && m.slot_buffer[routing.ids[i]] < 0;
  const Clock::time_point now = Clock::now();
  m.plan_servers.resize(m.servers.size());
  for (size_t i = 0; i < m.servers.size(); ++i) {
    Server& sv = m.servers[i];
    if (sv.transport == nullptr && sv.enabled && sv.down_until <= now && any_miss)
      if (!ConnectServer(i).ok()) sv.down_until = now + config_.server_retry;
    // A server that failed gets calls again once its transport says it is
    // connected (a gRPC channel is asked to connect now) and, after a server
    // deadline, once it answered a probe; checked every kReconnectPoll — not
    // a call sent into a channel still in back-off or into the silence.
    if (sv.transport != nullptr && (sv.failing || sv.silent) && sv.enabled && sv.down_until <= now) {
      const absl::Status up = sv.silent ? sv.transport->Probe(std::min<std::chrono::milliseconds>(
                                              config_.server_deadline, std::chrono::seconds(1)))
                                        : sv.transport->Reconnect();
      if (up.ok()) sv.silent = false;
      else sv.down_until = now + std::min<Clock::duration>(config_.server_retry, kReconnectPoll);
    }
    m.plan_servers[i] = PlanServer{sv.enabled && sv.transport != nullptr && sv.down_until <= now, &sv.hosts,
                                   sv.chunk_tokens, sv.slice};
  }
  MissPlanInput in;
  in.layer = layer;
  in.routing = routing;
  in.num_experts = E;
  in.slot_buffer = m.slot_buffer.data();
  in.servers = m.plan_servers.data();
  in.num_servers = static_cast<int>(m.plan_servers.size());
  in.hit_row_align = backend_->hit_row_align();
  in.copy_mode = config_.copy_mode;
  in.can_copy = CanCopyMisses();
  in.copy_min_tokens = config_.copy_min_tokens;
  return planner_.PlanCall(in, &plan);
}

// Ships the CPU misses, enqueues the hits, the copied experts and the cache
// admissions of a call whose routing Submit has planned.
absl::Status LayerDispatcher::Dispatch(InFlightCall& ctx) {
  Impl& m = *impl_;
  const int layer = ctx.call.batch.layer;
  // 1. The CPU misses, per server, before any device compute is enqueued.
  MOE_RETURN_IF_ERROR(ShipMisses(ctx));
  // 2. Hits: one grouped launch over the cached experts, then one over the
  // experts prefetched for this call, after their copies (RunHits).
  const int parity = layer & 1;
  const bool prefetched = m.prefetch[parity].layer == layer;
  const absl::Status hits = RunHits(ctx);
  if (prefetched) ReleasePrefetch(parity, true);
  MOE_RETURN_IF_ERROR(hits);
  // 3. Bookkeeping.
  m.access_pairs.clear();
  for (int e : ctx.plan.accessed) m.access_pairs.push_back(ctx.plan.hit_pairs[e] + ctx.plan.miss_pairs[e]);
  cache_->RecordAccess(layer, ctx.plan.accessed, m.access_pairs);
  std::vector<int32_t>& last = m.last_pairs[layer_index_[layer]];
  std::fill(last.begin(), last.end(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < ctx.plan.accessed.size(); ++i) {
    last[ctx.plan.accessed[i]] = m.access_pairs[i];
    total += m.access_pairs[i];
  }
  m.last_total[layer_index_[layer]] = total;
  if (config_.on_access)  // a prefetched expert was not cached: its pairs count as misses
    for (int e : ctx.plan.accessed) {
      if (ctx.plan.hit_pairs[e] > 0) config_.on_access(layer, e, ctx.plan.hit_pairs[e], !m.prefetched_now[e]);
      if (ctx.plan.miss_pairs[e] > 0) config_.on_access(layer, e, ctx.plan.miss_pairs[e], false);
    }
  // 4. Copy-instead-of-compute, then the next layer's prefetch behind it on the link.
  MOE_RETURN_IF_ERROR(ComputeCopies(ctx));
  if (!ctx.plan.copy_experts.empty() || prefetched) planner_.OwnCopiesQueued();
  MOE_ASSIGN_OR_RETURN(const int prefetches, StartPrefetch(ctx));
  if (config_.on_activity && (ctx.stats.cpu_pairs > 0 || ctx.stats.copied_pairs > 0)) {
    LayerActivity a;
    a.cpu_pairs = static_cast<uint64_t>(ctx.stats.cpu_pairs);
    a.copied_pairs = static_cast<uint64_t>(ctx.stats.copied_pairs);
    a.prefetched_pairs = static_cast<uint64_t>(ctx.stats.prefetched_pairs);
    const int link_copies = static_cast<int>(ctx.plan.copy_experts.size()) + prefetches;
    a.link_seconds = planner_.rates().measured ? planner_.rates().CopySeconds() * link_copies : 0.0;
    config_.on_activity(layer, a);
  }
  // 5. Admissions for later calls (after the compute above, so an evicted
  // slot is overwritten only once it was read).
  return StartAdmissions(ctx);
}

// Turns the plan's server batches into the call's sent batches and hands them
// to the transports: gathered straight into the transport's memory (staged)
// where it has some, else through the context's send buffer.
absl::Status LayerDispatcher::ShipMisses(InFlightCall& ctx) {
  Impl& m = *impl_;
  CallStats& stats = ctx.stats;
  const int H = spec_.hidden;
  stats.cpu_experts += ctx.plan.cpu_experts;
  for (int e : ctx.plan.missed)  // once per pair, however many slice holders compute a share of it
    if (ctx.plan.route_of[e] != 0) stats.cpu_pairs += ctx.plan.miss_pairs[e];
  // A token travels to every server one of its pairs goes to (to each slice
  // holder): the batches' rows may add up to more than the call's tokens.
  size_t rows = 0;
  for (const ServerBatch& b : ctx.plan.batches) rows += static_cast<size_t>(b.n);
  if (rows * H > ctx.send.size()) MOE_RETURN_IF_ERROR(GrowHostBuffers(*backend_, H, ctx, rows));
  size_t offset = 0;  // the batch's first row in the call's send/recv buffers
  for (ServerBatch& b : ctx.plan.batches) {
    SentBatch& sh = ctx.sent.emplace_back();
    stats.miss_tokens += b.n;
    stats.bytes_shipped += static_cast<uint64_t>(b.n) * (2 * H * sizeof(bf16_t) + b.k * 8);
    sh.host_offset = offset;
    offset += b.n;
    sh.batch = std::move(b);
  }
  const std::chrono::microseconds polling =
      ctx.call.batch.n <= config_.poll_max_tokens ? config_.poll_window : std::chrono::microseconds(0);
  for (SentBatch& sh : ctx.sent) {
    Server& server = m.servers[sh.batch.server];
    if (server.polling != polling) {
      server.transport->SetPolling(polling);
      server.polling = polling;
    }
    bf16_t* dst = nullptr;
    const Clock::time_point answer_by = ctx.ServerDeadline(config_.server_deadline);
    if (server.registered) {
      absl::StatusOr<StagingArea> staged = server.transport->Stage(sh.batch.n, sh.batch.k, answer_by);
      if (staged.ok()) {
        sh.staged = true;
        sh.stage = *staged;
        dst = sh.stage.tokens;
      }
    }
    if (dst == nullptr) dst = ctx.send.data() + sh.host_offset * H;
    MOE_RETURN_IF_ERROR(Gather(ctx, sh.batch.rows, dst));
    if (sh.staged) {
      std::memcpy(sh.stage.expert_ids, sh.batch.ids.data(), sh.batch.ids.size() * sizeof(int32_t));
      std::memcpy(sh.stage.expert_weights, sh.batch.weights.data(), sh.batch.weights.size() * sizeof(float));
      sh.sent_at = Clock::now();
      sh.done = server.transport->SubmitStaged(sh.stage, static_cast<uint32_t>(ctx.call.batch.layer), answer_by);
    } else {
      sh.sent_at = Clock::now();
      sh.done = server.transport->Submit(GatheredBatch(ctx.call.batch.layer, sh.batch, dst),
                                         ctx.recv.data() + sh.host_offset * H, answer_by);
    }
  }
  return absl::OkStatus();
}

// The call's rows `rows` gathered into host memory `dst`, complete on return.
absl::Status LayerDispatcher::Gather(InFlightCall& ctx, const std::vector<int32_t>& rows, bf16_t* dst) {
  MOE_ASSIGN_OR_RETURN(const uint64_t f,
                       backend_->GatherRows(ctx.context, rows.data(), static_cast<int>(rows.size()), dst));
  return backend_->WaitCompute(f);
}

// The plan's copied experts: under copy-every-miss admitted into the cache
// (the plain LRU offload) and computed from their new slots; the rest through
// the temporary buffers.
absl::Status LayerDispatcher::ComputeCopies(InFlightCall& ctx) {
  Impl& m = *impl_;
  const MissPlan& plan = ctx.plan;
  const int layer = ctx.call.batch.layer;
  // The link starts on them now, while the loops below are still enqueueing
  // (a bf16 call's per-expert cuBLAS launches kept the host here for 4-5 ms
  // at 2048 tokens; timed from the loops' end, the planner's link clock ran
  // that far behind the link, and the prefetch window it measures shrank
  // by as much; H100 host).
  planner_.CopiesQueued(static_cast<int>(plan.copy_experts.size()));
  std::vector<int> copy_list = plan.copy_experts;
  if (config_.copy_mode == CopyMode::kAlways && config_.policy != CachePolicy::kStatic &&
      !copy_list.empty()) {
    std::vector<SlotCopy> copies = cache_->PlanAdmissions(layer, copy_list, static_cast<int>(copy_list.size()));
    for (const SlotCopy& copy : copies) {
      absl::StatusOr<uint64_t> f =
          ComputeCopied(ctx, plan.copies, plan.copy_group(copy.expert), SlotBuffer(layer, copy.slot));
      if (!f.ok()) {
        cache_->AbortCopy(copy);
        return f.status();
      }
      m.pending.push_back({copy, *f, Clock::now()});
      ++copies_started_;
      copy_list.erase(std::find(copy_list.begin(), copy_list.end(), copy.expert));
    }
  }
  m.copy_groups.clear();
  for (int e : copy_list) m.copy_groups.push_back(plan.copy_group(e));
  return ComputeCopiedInBuffers(ctx, plan.copies, m.copy_groups);
}

// Prefetch, for prompts: a call that moved experts over the link (copied, or
// computed from a prefetch) starts copying the next served layer's experts
// into that layer's prefetch buffers right away, behind its own copies, so
// the link keeps working while this layer computes, its CPU share finishes
// and the next layer's attention runs; the next layer's call computes them
// after its cached hits (PlanCall, RunHits). Which and how many, from what the
// planner did: at most as many as this call moved, and only experts whose
// expected pairs in the next call (its last call's, scaled to this call's
// size) are at least those of the least-used expert this call moved — an
// expert the planner would copy too. Decode calls, whose experts the plan
// leaves to the CPU servers, prefetch nothing. Returns the copies started.
absl::StatusOr<int> LayerDispatcher::StartPrefetch(InFlightCall& ctx) {
  Impl& m = *impl_;
  if (!config_.prefetch || m.prefetch_base < 0 || config_.copy_mode != CopyMode::kAuto) return 0;
  int moved = 0;
  int32_t least = std::numeric_limits<int32_t>::max();
  for (int e : ctx.plan.copy_experts) {
    ++moved;
    least = std::min(least, ctx.plan.miss_pairs[e]);
  }
  for (int e : ctx.plan.accessed)
    if (m.prefetched_now[e] && ctx.plan.hit_pairs[e] > 0) {
      ++moved;
      least = std::min(least, ctx.plan.hit_pairs[e]);
    }
  if (moved == 0) return 0;
  const size_t index = layer_index_[ctx.call.batch.layer], next_index = (index + 1) % layers_.size();
  const int next = layers_[next_index], parity = next & 1;
  Impl::Prefetch& pf = m.prefetch[parity];
  if (pf.layer == next) return 0;  // another micro-batch's call started it
  if (pf.layer >= 0) ReleasePrefetch(parity, false);
  if (m.last_total[next_index] == 0) return 0;
  const double scale = static_cast<double>(m.last_total[index]) / static_cast<double>(m.last_total[next_index]);
  for (int e = 0; e < spec_.num_experts; ++e)
    m.prefetch_candidate[e] = cache_->SlotOf(next, e) < 0 && host_->Find(next, e) != nullptr;
  const CostModel& rates = planner_.rates();
  std::vector<int>& order = m.prefetch_order;
  ChoosePrefetch(m.last_pairs[next_index], m.prefetch_candidate, scale, least, moved, m.prefetch_per_parity,
                 planner_.PrefetchWindow(), rates.measured ? rates.CopySeconds() : 0.0, &order);
  const int n = static_cast<int>(order.size());
  if (n == 0) return 0;
  pf.layer = next;
  for (int i = 0; i < n; ++i) {
    const int ti = parity * m.prefetch_per_parity + i;
    MOE_ASSIGN_OR_RETURN(pf.last_fence, backend_->LoadExpert(m.prefetch_base + ti, host_->Find(next, order[i]),
                                                             m.prefetch_free[ti]));
    pf.buffer[order[i]] = ti;
  }
  planner_.CopiesQueued(n);
  return n;
}

// Gives back the prefetch of `parity`: consumed by a call (its buffers free
// once the compute enqueued so far, which reads them, has run) or stale
// (nothing read them; copies land in order, so a later copy into one of them
// lands after the prefetch's).
void LayerDispatcher::ReleasePrefetch(int parity, bool consumed) {
  Impl& m = *impl_;
  Impl::Prefetch& pf = m.prefetch[parity];
  const uint64_t after = consumed ? backend_->RecordCompute() : 0;
  for (int32_t& ti : pf.buffer) {
    if (ti < 0) continue;
    if (consumed) m.prefetch_free[ti] = after;
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
absl::Status LayerDispatcher::RunHits(InFlightCall& ctx) {
  Impl& m = *impl_;
  const ExpertGroups& hits = ctx.plan.hits;
  if (hits.num_groups() == 0) return absl::OkStatus();
  bool any = false;
  for (int g = 0; g < hits.num_groups() && !any; ++g) any = m.prefetched_now[hits.expert[g]];
  ctx.stats.hit_pairs = hits.total_pairs;
  if (!any) return backend_->RunExperts(ctx.context, ctx.plan.hit_plan());
  const int align = backend_->hit_row_align();
  ExpertGroups &cached = m.one_group, &fetched = m.prefetch_groups;
  ClearGroups(cached);
  ClearGroups(fetched);
  m.launch_buffers.clear();
  m.prefetch_launch_buffers.clear();
  double prior = 0;
  for (int g = 0; g < hits.num_groups(); ++g) {
    if (!m.prefetched_now[hits.expert[g]]) {
      AppendGroup(hits, g, align, cached);
      m.launch_buffers.push_back(ctx.plan.hit_buffer[g]);
      continue;
    }
    AppendGroup(hits, g, align, fetched);
    m.prefetch_launch_buffers.push_back(ctx.plan.hit_buffer[g]);
    prior += planner_.rates().CopyDevicePrior(hits.count[g]);
    ctx.stats.hit_pairs -= hits.count[g];
    ctx.stats.copied_pairs += hits.count[g];
    ++ctx.stats.copied_experts;
    ctx.stats.prefetched_pairs += hits.count[g];
    ++ctx.stats.prefetched_experts;
  }
  if (cached.num_groups() > 0)
    MOE_RETURN_IF_ERROR(backend_->RunExperts(ctx.context, HitPlan{&cached, m.launch_buffers.data()}));
  backend_->ComputeWaitCopy(m.prefetch[ctx.call.batch.layer & 1].last_fence);  // copies land in order
  const uint64_t start = backend_->MarkCompute();
  MOE_RETURN_IF_ERROR(backend_->RunExperts(ctx.context, HitPlan{&fetched, m.prefetch_launch_buffers.data()}));
  ctx.copy_launches.push_back({start, backend_->MarkCompute(), prior});
  return absl::OkStatus();
}

// Copies the expert of group g of `groups` (of the call's layer) into cache
// buffer `buffer` and computes the group's pairs there.
absl::StatusOr<uint64_t> LayerDispatcher::ComputeCopied(InFlightCall& ctx, const ExpertGroups& groups, int g,
                                                        int buffer) {
  Impl& m = *impl_;
  const int layer = ctx.call.batch.layer;
  const uint64_t after = backend_->RecordCompute();  // an evicted slot may still be read by earlier calls
  MOE_ASSIGN_OR_RETURN(const uint64_t f, backend_->LoadExpert(buffer, host_->Find(layer, groups.expert[g]), after));
  backend_->ComputeWaitCopy(f);
  ctx.copy_fences.push_back(f);
  ExpertGroups& one = m.one_group;
  ClearGroups(one);
  AppendGroup(groups, g, 1, one);  // the group alone, from row 0 (aligned for any backend)
  MOE_RETURN_IF_ERROR(backend_->RunExperts(ctx.context, HitPlan{&one, &buffer}));
  ctx.stats.copied_pairs += one.total_pairs;
  ++ctx.stats.copied_experts;
  return f;
}

// The layer parity's temporary buffers split in two halves that launches
// alternate between: a launch computes up to half of them at once, and the
// next launch's copies land in the other half while it runs. One expert per
// launch (before) left most of the device idle: at 128 rows per expert
// (2048-token prompts) the copied experts' compute outlasted their copies,
// and prompts mixing CPU work and copies ran slower than copying everything.
absl::Status LayerDispatcher::ComputeCopiedInBuffers(InFlightCall& ctx, const ExpertGroups& groups,
                                                     const std::vector<int>& gs) {
  Impl& m = *impl_;
  const int layer = ctx.call.batch.layer, parity = layer & 1, B = config_.miss_buffers;
  const int per_launch = std::max(1, B / 2), halves = B >= 2 ? 2 : 1, align = backend_->hit_row_align();
  ExpertGroups& launch = m.one_group;
  for (size_t i0 = 0; i0 < gs.size(); i0 += per_launch) {
    const size_t i1 = std::min(gs.size(), i0 + per_launch);
    const int first = parity * B + (m.temp_next[parity]++ % halves) * per_launch;  // the half's first buffer
    ClearGroups(launch);
    m.launch_buffers.clear();
    uint64_t last_copy = 0;
    double prior = 0;
    for (size_t i = i0; i < i1; ++i) {
      const int g = gs[i], ti = first + static_cast<int>(i - i0);
      MOE_ASSIGN_OR_RETURN(last_copy, backend_->LoadExpert(m.temp_base + ti, host_->Find(layer, groups.expert[g]),
                                                           m.temp_fence[ti]));
      ctx.copy_fences.push_back(last_copy);
      m.launch_buffers.push_back(m.temp_base + ti);
      AppendGroup(groups, g, align, launch);
      prior += planner_.rates().CopyDevicePrior(groups.count[g]);
    }
    ctx.stats.copied_pairs += launch.total_pairs;
    ctx.stats.copied_experts += static_cast<int>(i1 - i0);
    backend_->ComputeWaitCopy(last_copy);  // copies land in order: the last covers the launch's
    // The launch alone, timed on the compute queue (its start mark passes
    // once the copies landed and the work before it is done).
    const uint64_t start = backend_->MarkCompute();
    MOE_RETURN_IF_ERROR(backend_->RunExperts(ctx.context, HitPlan{&launch, m.launch_buffers.data()}));
    const uint64_t end = backend_->MarkCompute();
    const uint64_t done = backend_->RecordCompute();
    ctx.copy_launches.push_back({start, end, prior});
    for (size_t i = i0; i < i1; ++i) m.temp_fence[first + static_cast<int>(i - i0)] = done;
  }
  return absl::OkStatus();
}

// Gives back everything a failed call holds; its output is discarded.
void LayerDispatcher::Abort(InFlightCall& ctx) {
  Impl& m = *impl_;
  ctx.copy_fences.clear();
  ctx.copy_launches.clear();
  for (SentBatch& sh : ctx.sent) {
    if (sh.done.valid()) sh.done.wait();
    if (sh.staged) m.servers[sh.batch.server].transport->Release(sh.stage);
  }
  ctx.sent.clear();
  (void)backend_->FinishCall(ctx.context, nullptr, ctx.call.kind);
  ctx.busy = false;
}

absl::Status LayerDispatcher::Complete(int ticket, CallStats* out_stats) {
  Impl& m = *impl_;
  if (ticket < 0 || ticket >= static_cast<int>(m.contexts.size()) || !m.contexts[ticket].busy)
    return absl::InvalidArgumentError(absl::StrCat("ticket: ", ticket, " is not a call in flight"));
  InFlightCall& ctx = m.contexts[ticket];
  const Clock::time_point t0 = Clock::now();
  uint64_t last_fence = 0;
  const absl::Status result = AddPartials(ctx, &last_fence);
  // FinishCall waits for all of the call's device work, the reads of the
  // partial sums (AddRows) included: only then are the slots given back (one
  // sync per call instead of two).
  absl::Status fin = backend_->FinishCall(ctx.context, result.ok() ? ctx.call.out : nullptr, ctx.call.kind);
  if (!fin.ok() && last_fence != 0) (void)backend_->WaitCompute(last_fence);
  // The engine's later work on its stream sees the output.
  if (absl::Status sig = backend_->SignalStream(ctx.call.stream); fin.ok()) fin = sig;
  for (SentBatch& sh : ctx.sent) {
    if (sh.done.valid()) sh.done.wait();  // failed-early calls: nothing may still write
    if (sh.staged) m.servers[sh.batch.server].transport->Release(sh.stage);
    sh.staged = false;
  }
  ctx.sent.clear();
  ctx.busy = false;
  const Clock::time_point end = Clock::now();
  // The copies the call computed from (all done: FinishCall waited for the
  // compute that read them), timed on the copy queue: under load they take
  // longer than the start-up probe's (PCIe and the CPU servers share DRAM).
  for (uint64_t f : ctx.copy_fences) ObserveCopy(f, Seconds(end - ctx.submitted));
  ctx.copy_fences.clear();
  // Their launches, timed on the compute queue: the copied experts' device
  // cost, which the call's end time cannot separate from the link's.
  if (result.ok() && fin.ok())
    for (const InFlightCall::CopyLaunch& l : ctx.copy_launches)
      if (std::optional<double> s = backend_->ComputeSeconds(l.start, l.end))
        planner_.rates().ObserveCopyDevice(l.prior_s, *s);
  ctx.copy_launches.clear();
  // A hits-only call: Submit to here bounds the device time from above.
  if (ctx.device_prior_s > 0 && result.ok() && fin.ok())
    planner_.rates().ObserveDevice(ctx.device_prior_s, Seconds(end - ctx.submitted), true);
  if (result.ok() && fin.ok())
    planner_.rates().overlap.Observe(CopyOverlap::Shape(ctx.call.batch.n, static_cast<int>(ctx.plan.missed.size())), ctx.beside_copies,
                                     Seconds(end - ctx.submitted));
  // A call whose copies the outcomes could have overruled: its time, for its shape.
  if (ctx.plan.outcome_bucket >= 0 && result.ok() && fin.ok())
    planner_.host_outcomes().Observe(ctx.plan.outcome_bucket, ctx.plan.outcome_choice, Seconds(end - ctx.submitted));
  ctx.stats.wait_seconds = Seconds(end - t0);
  if (out_stats != nullptr) *out_stats = ctx.stats;
  if (!result.ok()) return result;
  return fin;
}

// Waits for every sent batch of the call (failing over those whose server
// failed) and adds the servers' partial sums; *last_fence: the fence after
// the last AddRows.
absl::Status LayerDispatcher::AddPartials(InFlightCall& ctx, uint64_t* last_fence) {
  Impl& m = *impl_;
  int timed_server = -1;
  for (size_t i = 0; i < ctx.sent.size(); ++i) {
    SentBatch& sh = ctx.sent[i];
    // The first batch a server got in this call is timed for the cost model
    // (later ones queue behind it); one already answered bounds it from above.
    const bool timed = sh.batch.server != timed_server;
    timed_server = sh.batch.server;
    const bool ready = sh.done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    // The transport's completion thread polls in decode; this thread spins
    // only briefly (a core more would compete with the server's pool).
    absl::Status st = AwaitResult(sh.done);
    if (timed && st.ok())
      planner_.rates().ObserveCpu(sh.batch.experts, sh.batch.pairs, Seconds(Clock::now() - sh.sent_at), ready);
    const bf16_t* partial = sh.staged ? sh.stage.output : ctx.recv.data() + sh.host_offset * spec_.hidden;
    if (st.ok()) {
      Server& sv = m.servers[sh.batch.server];
      if (sv.failing) {  // once per state change, as its failure was
        sv.failing = false;
        LogInfo("worker", "servers: ", sv.config.address, " answers again; its misses go to it");
      }
    }
    if (!st.ok()) MOE_RETURN_IF_ERROR(FailOver(ctx, i, std::move(st), &partial));
    if (partial != nullptr && sh.batch.n > 0) {
      MOE_ASSIGN_OR_RETURN(*last_fence, backend_->AddRows(ctx.context, sh.batch.rows.data(), sh.batch.n, partial));
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
