// Shared-memory implementation of ExpertTransport (client side). Connects to
// the server's Unix socket, receives a memfd segment, and submits batches by
// writing them into free slots and pushing the slot indexes on the submit
// ring. A batch larger than one slot is split over several slots (taken all
// at once, so concurrent large batches cannot deadlock) and reassembled; one
// larger than the whole segment (slots x max_tokens_per_slot) is refused with
// INVALID_ARGUMENT. A completion thread waits on the response doorbell, and
// notices a dead server (socket closed) within ~20 ms: every in-flight batch
// then fails with UNAVAILABLE, and the next Submit reconnects.
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/pending_requests.h"
#include "transport/shm_segment.h"
#include "transport/shm_server.h"
#include "transport/transport.h"
#include "transport/unix_socket.h"

namespace moe {
namespace {

// One connection: socket + mapped segment + completion thread.
struct ShmConnection {
  int sock = -1;
  void* base = nullptr;
  size_t bytes = 0;
  std::optional<shm::Segment> seg;
  std::vector<uint32_t> free_slots;
  std::atomic<bool> dead{false};
  bool finished = false;  // the completion thread is past its last use of mu_ (guarded by mu_)
  std::thread completer;
  uint64_t generation = 0;
  ~ShmConnection() {
    if (base != nullptr) munmap(base, bytes);
    if (sock >= 0) close(sock);
  }
};

class ShmTransport final : public ExpertTransport {
 public:
  ShmTransport(std::string path, const TransportOptions& o) : path_(std::move(path)), opt_(o) {}
  ~ShmTransport() override {
    std::unique_lock<std::mutex> lock(mu_);
    closing_ = true;
    std::shared_ptr<ShmConnection> c = conn_;
    lock.unlock();
    if (c) {
      c->dead.store(true);
      if (c->seg) c->seg->MarkClosed(shm::Side::kClient);
      if (c->completer.joinable()) c->completer.join();
    }
    for (auto& old : retired_) {
      if (old->completer.joinable()) old->completer.join();
    }
  }

  const char* kind() const override { return "shm"; }

  std::optional<DeviceRings> DeviceRingsOf() const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!conn_ || opt_.device_slots <= 0) return std::nullopt;
    const uint32_t S = conn_->seg->num_slots();
    return DeviceRings{*conn_->seg, conn_->bytes, conn_->generation, S - static_cast<uint32_t>(opt_.device_slots),
                       static_cast<uint32_t>(opt_.device_slots)};
  }

  uint64_t Generation() const override { return current_generation_.load(std::memory_order_acquire); }
  ExpertSlice slice() const override { return slice_; }

  void ReleaseDeviceSegments() override {
    std::vector<std::shared_ptr<ShmConnection>> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(device_kept_);
    }
  }

  absl::Status Reconnect() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (conn_ && !conn_->dead.load()) return absl::OkStatus();
    return ConnectLocked();
  }

  std::pair<void*, size_t> HostMapping() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return conn_ ? std::pair<void*, size_t>{conn_->base, conn_->bytes} : std::pair<void*, size_t>{nullptr, 0};
  }

  absl::StatusOr<StagingArea> Stage(int n, int k, Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!retired_.empty()) ReapRetiredLocked();
    if (!conn_ || conn_->dead.load()) {
      if (absl::Status st = ConnectLocked(); !st.ok()) return st;
    }
    std::shared_ptr<ShmConnection> c = conn_;
    const shm::SegmentGeometry& g = c->seg->geometry();
    if (n < 1 || n > static_cast<int>(g.max_tokens) || k < 1 || k > static_cast<int>(g.max_pairs))
      return absl::InvalidArgumentError(absl::StrCat("Stage: ", n, " tokens x ", k, " pairs; a slot holds 1..",
                                                     g.max_tokens, " tokens x 1..", g.max_pairs, " pairs"));
    if (!slots_cv_.wait_until(lock, deadline, [&] { return c->dead.load() || !c->free_slots.empty(); }))
      return absl::DeadlineExceededError("no free shared-memory slot before the deadline");
    if (c->dead.load()) return absl::UnavailableError(absl::StrCat("expert server on ", path_, " is gone"));
    const uint32_t slot = c->free_slots.back();
    c->free_slots.pop_back();
    const shm::RequestSlot v = c->seg->slot(slot);
    const uint64_t handle = (c->generation << 32) | slot;
    staged_[handle] = StagedSlot{c, slot, n, k, false, false};
    return StagingArea{v.tokens, v.ids, v.weights, v.output, n, k, handle};
  }

  std::future<absl::Status> SubmitStaged(const StagingArea& s, uint32_t layer, Clock::time_point deadline) override {
    std::future<absl::Status> fut;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = staged_.find(s.handle);
    if (it == staged_.end() || it->second.submitted)
      return Ready(absl::InvalidArgumentError("SubmitStaged: unknown, released or already submitted handle"));
    StagedSlot& st = it->second;
    if (st.conn->dead.load()) return Ready(absl::UnavailableError(absl::StrCat("expert server on ", path_, " is gone")));
    st.submitted = true;
    const uint64_t id = pending_.Add(nullptr, st.n, st.conn->generation, deadline, &fut);
    Batch& b = batches_[id];
    in_flight_.store(batches_.size());
    b.conn = st.conn;
    b.remaining = 1;
    b.staged_handle = s.handle;
    b.slots.push_back({st.slot, 0, st.n});
    shm::WriteRequestHeader(st.conn->seg->slot(st.slot), id, layer, static_cast<uint32_t>(st.n),
                            static_cast<uint32_t>(st.k));
    slot_batch_[{st.conn->generation, st.slot}] = id;
    st.conn->seg->TryPushSubmit(st.slot);
    Announce(*st.conn->seg);
    return fut;
  }

  void Release(const StagingArea& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = staged_.find(s.handle);
    if (it == staged_.end()) return;
    StagedSlot& st = it->second;
    if (st.submitted && !st.completed && !st.conn->dead.load()) {  // the server still owns the slot
      st.released = true;
      return;
    }
    if (!st.conn->dead.load()) st.conn->free_slots.push_back(st.slot);
    staged_.erase(it);
    slots_cv_.notify_all();
  }

  void SetPolling(std::chrono::microseconds window) override {
    poll_window_ns_.store(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(window).count()),
                          std::memory_order_relaxed);
  }

  absl::Status Open() {
    std::lock_guard<std::mutex> lock(mu_);
    return ConnectLocked();
  }

  std::future<absl::Status> Submit(const MoeBatch& b, bf16_t* out, Clock::time_point deadline) override {
    std::future<absl::Status> fut;
    std::unique_lock<std::mutex> lock(mu_);
    if (!retired_.empty()) ReapRetiredLocked();
    if (!conn_ || conn_->dead.load()) {
      if (absl::Status st = ConnectLocked(); !st.ok()) return Ready(st);
    }
    std::shared_ptr<ShmConnection> c = conn_;
    const shm::SegmentGeometry& g = c->seg->geometry();
    if (b.routing.k < 1 || b.routing.k > static_cast<int>(g.max_pairs))
      return Ready(absl::InvalidArgumentError(absl::StrCat("expert_ids.shape[1]: ", b.routing.k,
                                                           " pairs per token, the segment holds ", g.max_pairs)));
    if (b.n < 1) return Ready(absl::InvalidArgumentError("tokens: empty batch (0 tokens)"));
    const int T = static_cast<int>(g.max_tokens);
    const int chunks = (b.n + T - 1) / T;
    if (chunks > static_cast<int>(g.num_slots))
      return Ready(absl::InvalidArgumentError(absl::StrCat("tokens: ", b.n, " tokens exceed the segment's ",
                                                           g.num_slots, " slots x ", T, " tokens")));
    // Take all the slots the batch needs at once.
    if (!slots_cv_.wait_until(lock, deadline, [&] {
          return c->dead.load() || static_cast<int>(c->free_slots.size()) >= chunks;
        }))
      return Ready(absl::DeadlineExceededError("no free shared-memory slot before the deadline"));
    if (c->dead.load()) return Ready(absl::UnavailableError(absl::StrCat("expert server on ", path_, " is gone")));
    const uint64_t id = pending_.Add(out, b.n, c->generation, deadline, &fut);
    Batch& batch = batches_[id];
    in_flight_.store(batches_.size());
    batch.conn = c;
    batch.remaining = chunks;
    for (int ch = 0; ch < chunks; ++ch) {
      const uint32_t slot = c->free_slots.back();
      c->free_slots.pop_back();
      const int t0 = ch * T, n = std::min(T, b.n - t0);
      batch.slots.push_back({slot, t0, n});
      const shm::RequestSlot v = c->seg->slot(slot);
      std::memcpy(v.tokens, b.tokens + size_t(t0) * opt_.hidden, size_t(n) * opt_.hidden * 2);
      std::memcpy(v.ids, b.routing.ids + size_t(t0) * b.routing.k, size_t(n) * b.routing.k * 4);  // [n, k] row-major
      std::memcpy(v.weights, b.routing.weights + size_t(t0) * b.routing.k, size_t(n) * b.routing.k * 4);
      shm::WriteRequestHeader(v, id, static_cast<uint32_t>(b.layer), static_cast<uint32_t>(n), static_cast<uint32_t>(b.routing.k));
      slot_batch_[{c->generation, slot}] = id;
      c->seg->TryPushSubmit(slot);  // cannot be full: at most num_slots slots are ever out
    }
    Announce(*c->seg);
    return fut;
  }

 private:
  struct Chunk { uint32_t slot; int t0, n; };
  struct Batch {
    std::shared_ptr<ShmConnection> conn;
    std::vector<Chunk> slots;
    int remaining = 0;
    absl::Status status;
    uint64_t staged_handle = 0;  // non-zero: a staged batch (output stays in the slot)
  };
  struct StagedSlot {
    std::shared_ptr<ShmConnection> conn;
    uint32_t slot;
    int n, k;
    bool submitted, completed;
    bool released = false;
  };

  // Rings the server for a pushed request; in polling mode first moves the
  // poll deadline of both sides to now + window.
  void Announce(const shm::Segment& seg) {
    const int64_t window = poll_window_ns_.load(std::memory_order_relaxed);
    if (window > 0) {
      const Clock::time_point until = Clock::now() + std::chrono::nanoseconds(window);
      seg.SetClientPollUntil(until);
      poll_until_ns_.store(until.time_since_epoch().count(), std::memory_order_relaxed);
    }
    seg.RingRequest();
  }

  static std::future<absl::Status> Ready(absl::Status st) {
    std::promise<absl::Status> p;
    p.set_value(std::move(st));
    return p.get_future();
  }

  // Joins the completion threads of retired connections that are done (they
  // no longer need mu_) and drops them, unmapping their segments once no
  // staged slot holds them: a dead server's segment does not stay resident
  // until the next reconnect. With device slots the segment stays mapped
  // until ReleaseDeviceSegments: a GPU may have the old segment's address in
  // a call in flight (its writes must land in memory that is still ours).
  void ReapRetiredLocked() {
    for (auto it = retired_.begin(); it != retired_.end();) {
      if ((*it)->finished) {
        (*it)->completer.join();
        if (opt_.device_slots > 0) device_kept_.push_back(*it);
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }

  absl::Status ConnectLocked() {
    if (closing_) return absl::CancelledError("transport closed");
    if (conn_) retired_.push_back(conn_);
    ReapRetiredLocked();
    conn_.reset();
    auto c = std::make_shared<ShmConnection>();
    absl::StatusOr<int> sock = unix_socket::Connect(path_);
    if (!sock.ok()) return absl::UnavailableError(absl::StrCat("expert server on ", path_, ": ", sock.status().message()));
    c->sock = *sock;
    const ShmHello hello = MakeShmHello(kShmHelloMagic, opt_.hidden, static_cast<uint32_t>(opt_.max_tokens_per_slot),
                                        static_cast<uint32_t>(opt_.max_pairs_per_token),
                                        static_cast<uint32_t>(opt_.slots), opt_.model);
    if (absl::Status st = unix_socket::Send(c->sock, &hello, sizeof(hello)); !st.ok()) return st;
    ShmReply reply{};
    int fd = -1;
    if (absl::Status st = unix_socket::Receive(c->sock, &reply, sizeof(reply), &fd,
                                               static_cast<int>(opt_.connect_timeout.count()));
        !st.ok())
      return absl::UnavailableError(absl::StrCat("expert server on ", path_, ": ", st.message()));
    reply.message[sizeof(reply.message) - 1] = '\0';
    if (reply.magic != kShmHelloMagic || reply.status_code != 0 || fd < 0) {
      if (fd >= 0) close(fd);
      // A refusal of our model is told with both sides' (the server's 200
      // bytes of message may not hold two paths).
      if (reply.magic == kShmHelloMagic) MOE_RETURN_IF_ERROR(CheckShmReplyModel(reply, opt_.model, path_));
      const absl::StatusCode code = StatusCodeFromWire(reply.status_code, absl::StatusCode::kUnavailable);
      return absl::Status(code, absl::StrCat("expert server on ", path_, " refused: ", reply.message));
    }
    c->bytes = reply.segment_bytes;
    if (absl::Status st = unix_socket::CheckResizeSealed(fd, c->bytes, absl::StrCat("expert server on ", path_, ": segment"));
        !st.ok()) {
      close(fd);
      return st;
    }
    // The server's model must be ours, at every (re)connect: one restarted
    // with another --model under this socket is refused too.
    if (absl::Status st = CheckShmReplyModel(reply, opt_.model, path_); !st.ok()) {
      close(fd);
      return st;
    }
    c->base = mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (c->base == MAP_FAILED) {
      c->base = nullptr;
      return absl::UnavailableError("cannot map the server's segment");
    }
    absl::StatusOr<shm::Segment> seg = shm::Segment::Attach(c->base, c->bytes, static_cast<uint32_t>(opt_.hidden));
    if (!seg.ok()) return seg.status();
    // The share of each expert the server holds is fixed for the transport's
    // life: a server restarted with another --slice is refused (its partials
    // would be added as the old share's).
    if (generation_ > 0 && !(seg->slice() == slice_))
      return absl::FailedPreconditionError(absl::StrCat("expert server on ", path_, " now holds slice ",
                                                        seg->slice().ToString(), " of every expert, was ",
                                                        slice_.ToString(), "; restart the worker to use it"));
    slice_ = seg->slice();
    c->seg = *seg;
    // The highest device_slots slots are the GPU's (DeviceRingsOf).
    for (uint32_t s = 0; s + static_cast<uint32_t>(std::max(opt_.device_slots, 0)) < c->seg->num_slots(); ++s)
      c->free_slots.push_back(s);
    c->generation = ++generation_;
    current_generation_.store(c->generation, std::memory_order_release);
    c->completer = std::thread([this, c] { CompleteLoop(c); });
    conn_ = c;
    return absl::OkStatus();
  }

  void CompleteLoop(std::shared_ptr<ShmConnection> c) {
    pthread_setname_np(pthread_self(), "moe-shm-done");
    const shm::Segment& seg = *c->seg;
    auto& bell = seg.response_doorbell();
    constexpr auto kInFlightSpin = std::chrono::microseconds(200);
    shm::ValidatedResponse resp;
    unix_socket::PeerClosedProbe peer(c->sock);
    while (!c->dead.load()) {
      const uint32_t seen = bell.load(std::memory_order_acquire);
      bool worked = false;
      while (std::optional<uint32_t> idx = seg.TryPopComplete()) {
        worked = true;
        if (!shm::ValidateResponseSlot(seg, *idx, &resp).ok()) {
          c->dead.store(true);  // a corrupt server: drop the connection
          break;
        }
        if (std::optional<Fulfil> f = OnChunkDone(c, *idx, resp.status)) f->entry.Finish(f->status);
      }
      if (seg.PeerClosed(shm::Side::kClient) || peer.Closed()) c->dead.store(true);
      // Spin while batches are out (the answer is microseconds away) — in
      // polling mode through the whole window, not only kInFlightSpin — and
      // sleep when none is (nothing can arrive; the server side polls for the
      // next batch). Spinning between batches too would save the futex
      // wake-up of the next answer (staged n = 1 on the AMX host: 14 -> 4-7
      // us in bench/transport), but end to end it takes the core that a
      // same-host server's pool (all cores but one) needs: moe_layer at T = 1
      // went from 15.1 to 17-29 ms per 16-layer step at 0% cache and from 8.1
      // to 17-21 ms at 25%, with a spread of 2x between runs.
      if (!worked && !c->dead.load()) {
        const Clock::time_point now = Clock::now();
        std::chrono::nanoseconds spin(0);
        if (in_flight_.load() > 0) {
          spin = kInFlightSpin;
          const Clock::time_point poll_until{Clock::duration(poll_until_ns_.load(std::memory_order_relaxed))};
          if (poll_until > now) spin = std::max(spin, std::chrono::duration_cast<std::chrono::nanoseconds>(poll_until - now));
        }
        seg.WaitResponse(seen, now + std::chrono::milliseconds(20), spin);
      }
    }
    // Fail everything still out on this connection.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = batches_.begin(); it != batches_.end();) {
      if (it->second.conn == c) {
        pending_.Complete(it->first, absl::UnavailableError(absl::StrCat("expert server on ", path_, " is gone")));
        it = batches_.erase(it);
      } else {
        ++it;
      }
    }
    in_flight_.store(batches_.size());
    pending_.FailGeneration(c->generation, absl::UnavailableError(absl::StrCat("expert server on ", path_, " is gone")));
    // Staged slots the caller already released (it gave up while the server
    // still held them) would otherwise keep the dead connection, and its
    // mapped segment, alive for good; slots it still holds go at its Release.
    for (auto it = staged_.begin(); it != staged_.end();) {
      it = it->second.conn == c && it->second.released ? staged_.erase(it) : std::next(it);
    }
    for (auto it = slot_batch_.begin(); it != slot_batch_.end();) {
      it = it->first.first == c->generation ? slot_batch_.erase(it) : std::next(it);
    }
    slots_cv_.notify_all();
    c->finished = true;
  }

  // A finished batch's promise, fulfilled by the completion thread once mu_ is
  // released: a caller woken while mu_ is still held would block on it at once
  // (Release, the next Stage) — a futex sleep and wake-up inside the round trip.
  struct Fulfil {
    PendingRequests::Entry entry;
    absl::Status status;
  };

  std::optional<Fulfil> OnChunkDone(const std::shared_ptr<ShmConnection>& c, uint32_t slot, const absl::Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    auto sb = slot_batch_.find({c->generation, slot});
    if (sb == slot_batch_.end()) {  // a slot we did not submit: protocol error
      c->dead.store(true);
      return std::nullopt;
    }
    const uint64_t id = sb->second;
    slot_batch_.erase(sb);
    Batch& b = batches_[id];
    if (!st.ok() && b.status.ok()) b.status = st;
    if (--b.remaining > 0) return std::nullopt;
    std::optional<PendingRequests::Entry> e = pending_.Take(id);  // nullopt: the caller gave up
    if (b.staged_handle != 0) {  // zero-copy: the output stays in the slot until Release
      auto st = staged_.find(b.staged_handle);
      if (st != staged_.end()) {
        st->second.completed = true;
        if (st->second.released) {
          c->free_slots.push_back(st->second.slot);
          staged_.erase(st);
          slots_cv_.notify_all();
        }
      }
    } else {
      // Last chunk: hand the output over (if the caller still waits), free the slots.
      if (e && b.status.ok()) {
        for (const Chunk& ch : b.slots) {
          std::memcpy(e->out + size_t(ch.t0) * opt_.hidden, c->seg->slot(ch.slot).output,
                      size_t(ch.n) * opt_.hidden * 2);
        }
      }
      for (const Chunk& ch : b.slots) c->free_slots.push_back(ch.slot);
      slots_cv_.notify_all();
    }
    absl::Status status = std::move(b.status);
    batches_.erase(id);
    in_flight_.store(batches_.size());
    if (!e) return std::nullopt;
    return Fulfil{*std::move(e), std::move(status)};
  }

  const std::string path_;
  const TransportOptions opt_;
  PendingRequests pending_;
  mutable std::mutex mu_;
  std::condition_variable slots_cv_;
  bool closing_ = false;
  std::shared_ptr<ShmConnection> conn_;
  std::vector<std::shared_ptr<ShmConnection>> retired_;
  std::vector<std::shared_ptr<ShmConnection>> device_kept_;  // dead, still mapped (see ReapRetiredLocked)
  uint64_t generation_ = 0;
  ExpertSlice slice_;  // the server's, from the first segment (fixed after)
  std::atomic<uint64_t> current_generation_{0};  // generation_ of conn_, for Generation() without mu_
  std::map<uint64_t, Batch> batches_;
  std::atomic<size_t> in_flight_{0};  // batches_.size(), read by the completion thread
  std::atomic<int64_t> poll_window_ns_{0};  // SetPolling
  std::atomic<int64_t> poll_until_ns_{0};   // steady_clock ticks: the completion thread polls until then
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> slot_batch_;  // (generation, slot) -> batch id
  std::map<uint64_t, StagedSlot> staged_;                          // handle -> staged slot
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectShmTransport(const std::string& socket_path,
                                                                    const TransportOptions& o) {
  if (o.hidden <= 0) return absl::InvalidArgumentError("transport: hidden size must be set");
  if (o.device_slots < 0 || o.device_slots >= o.slots)
    return absl::InvalidArgumentError(absl::StrCat("transport: device_slots ", o.device_slots, " must be in [0, slots ",
                                                   o.slots, ")"));
  auto t = std::make_unique<ShmTransport>(socket_path, o);
  if (absl::Status st = t->Open(); !st.ok()) return st;
  return std::unique_ptr<ExpertTransport>(std::move(t));
}

}  // namespace moe
