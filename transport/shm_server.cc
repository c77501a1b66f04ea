#include "transport/shm_server.h"

#include <pthread.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "transport/shm_segment.h"
#include "transport/unix_socket.h"

namespace moe {

// Connections refused at accept that may wait for their hello at once.
constexpr size_t kMaxRefusing = 8;

struct ShmServer::Connection {
  int sock = -1;
  uid_t uid = 0;
  absl::Status refused;  // not OK: refused at accept (RefuseAtAccept), holds no slot
  int memfd = -1;
  void* base = nullptr;
  size_t bytes = 0;
  std::optional<shm::Segment> seg;
  std::thread thread;
  std::atomic<bool> done{false};
  ~Connection() {
    if (base != nullptr) munmap(base, bytes);
    if (memfd >= 0) close(memfd);
    if (sock >= 0) close(sock);
  }
};

ShmServer::ShmServer(Options o, ShmHandler h) : opt_(std::move(o)), handler_(std::move(h)) {}

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(Options o, ShmHandler handler) {
  if (o.allowed_uids.empty()) o.allowed_uids.push_back(getuid());
  // Other allowed uids cannot be expected to share our group: let them reach
  // the socket and admit them by SO_PEERCRED, which is the check that counts.
  const bool others = std::any_of(o.allowed_uids.begin(), o.allowed_uids.end(), [](uid_t u) { return u != getuid(); });
  std::unique_ptr<ShmServer> s(new ShmServer(std::move(o), std::move(handler)));
  MOE_ASSIGN_OR_RETURN(s->listener_, unix_socket::Listener::Start(s->opt_.socket_path, others ? 0666 : 0660,
                                                                 [p = s.get()](int sock) { p->Accept(sock); }));
  return s;
}

ShmServer::~ShmServer() { Stop(); }

void ShmServer::Stop() {
  if (stop_.exchange(true)) return;
  if (listener_) listener_->Stop();  // no new connection from here; the socket file is gone
  std::list<std::unique_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : connections_) {
      if (c->seg) c->seg->MarkClosed(shm::Side::kServer);  // wakes its thread
      if (c->sock >= 0) shutdown(c->sock, SHUT_RDWR);       // ends a handshake in progress
    }
    conns.swap(connections_);
  }
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
}

void ShmServer::Accept(int sock) {
  auto c = std::make_unique<Connection>();
  c->sock = sock;
  Connection* raw = c.get();
  // Peer credentials first: a uid that may not use this socket never holds a slot.
  const absl::StatusOr<uid_t> uid = unix_socket::PeerUid(sock);
  std::lock_guard<std::mutex> lock(mu_);
  ReapFinished();
  if (!uid.ok()) return;  // ~Connection closes the socket
  c->uid = *uid;
  size_t served = 0, of_uid = 0;
  for (const auto& other : connections_) {
    if (!other->refused.ok()) continue;
    ++served;
    of_uid += other->uid == *uid;
  }
  const size_t per_uid = opt_.max_connections_per_uid > 0
                             ? opt_.max_connections_per_uid
                             : std::max<size_t>(1, opt_.max_connections / std::max<size_t>(1, opt_.allowed_uids.size()));
  if (std::find(opt_.allowed_uids.begin(), opt_.allowed_uids.end(), *uid) == opt_.allowed_uids.end())
    return RefuseAtAccept(std::move(c), *uid,
                          absl::PermissionDeniedError(absl::StrCat("uid ", *uid, " is not allowed on this socket")));
  if (of_uid >= per_uid)
    return RefuseAtAccept(std::move(c), *uid, absl::ResourceExhaustedError(absl::StrCat(
                                                  "uid ", *uid, " holds ", of_uid, " connections, its cap on this socket")));
  if (served >= opt_.max_connections)
    return RefuseAtAccept(std::move(c), *uid, absl::ResourceExhaustedError(absl::StrCat(
                                                  served, " connections open, the cap on this socket")));
  // The handshake runs on the connection's thread: a client that stalls
  // in its hello holds only itself, for at most handshake_timeout.
  raw->thread = std::thread([this, raw] { RunConnection(raw); });
  connections_.push_back(std::move(c));
}

// At most one line per uid and second: a client that opens and drops
// connections as fast as it can (an allowed uid too) cannot flood the log
// (72,935 lines in 10 s were seen). mu_ held.
void ShmServer::LogRefusal(uid_t uid, const absl::Status& why) {
  RefusalLog& log = refusal_log_[uid];
  const Clock::time_point now = Clock::now();
  if (now - log.last >= std::chrono::seconds(1)) {
    LogWarning("shm", "refused a client on ", opt_.socket_path, ": ", why.message(),
               log.suppressed > 0 ? absl::StrCat(" (and ", log.suppressed, " more refusals of uid ", uid, " since)") : "");
    log.last = now;
    log.suppressed = 0;
  } else {
    ++log.suppressed;
  }
}

void ShmServer::RefuseAtAccept(std::unique_ptr<Connection> c, uid_t uid, absl::Status why) {
  LogRefusal(uid, why);
  size_t refusing = 0;
  for (const auto& other : connections_) refusing += !other->refused.ok();
  if (refusing >= kMaxRefusing) return;  // ~Connection closes the socket: no reason, no wait
  c->refused = std::move(why);
  Connection* raw = c.get();
  raw->thread = std::thread([this, raw] { RunConnection(raw); });
  connections_.push_back(std::move(c));
}

void ShmServer::ReapFinished() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void ShmServer::RunConnection(Connection* c) {
  pthread_setname_np(pthread_self(), "moe-shm-conn");
  absl::Status st = Handshake(c);
  if (!st.ok() || !c->seg) {  // refused, or a store request (answered)
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok() && c->refused.ok()) LogRefusal(c->uid, st);  // (refusals at accept were logged there)
    shutdown(c->sock, SHUT_RDWR);
    close(c->sock);  // now, not when the connection is reaped at the next accept
    c->sock = -1;
    c->done.store(true);
    return;
  }
  Serve(c);
}

absl::Status ShmServer::SendSharedStore(Connection* c) {
  ShmReply reply{};
  reply.magic = kShmStoreMagic;
  SetShmModel(opt_.model, &reply);
  if (opt_.shared_store_fd < 0) {
    reply.status_code = static_cast<int32_t>(absl::StatusCode::kFailedPrecondition);
    std::snprintf(reply.message, sizeof(reply.message), "this server shares no expert store");
    return unix_socket::Send(c->sock, &reply, sizeof(reply));
  }
  reply.segment_bytes = opt_.shared_store_info.size();
  MOE_RETURN_IF_ERROR(unix_socket::Send(c->sock, &reply, sizeof(reply), opt_.shared_store_fd));
  return unix_socket::Send(c->sock, opt_.shared_store_info.data(), opt_.shared_store_info.size());
}

ShmHello MakeShmHello(uint32_t magic, int hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t slots,
                      const ModelIdentity& model) {
  ShmHello hello{};
  hello.magic = magic;
  hello.version = kShmProtocolVersion;
  hello.hidden = static_cast<uint32_t>(hidden);
  hello.max_tokens = max_tokens;
  hello.max_pairs = max_pairs;
  hello.slots = slots;
  SetShmModel(model, &hello);
  return hello;
}

absl::Status CheckShmReplyModel(const ShmReply& reply, const ModelIdentity& ours, const std::string& socket_path) {
  if (ours.digest == 0 || (reply.status_code != 0 && reply.model_identity == 0)) return absl::OkStatus();
  return CheckSameModel(ours, ShmPeerModel(reply), "this worker",
                        absl::StrCat("the expert server on unix://", socket_path));
}

absl::Status ShmServer::Handshake(Connection* c) {
  ShmReply reply{};
  reply.magic = kShmHelloMagic;
  auto refuse = [&](absl::Status st) {
    reply.status_code = static_cast<int32_t>(st.code());
    std::snprintf(reply.message, sizeof(reply.message), "%s", std::string(st.message()).c_str());
    (void)unix_socket::Send(c->sock, &reply, sizeof(reply));
    return st;
  };
  // Read the hello before any refusal: closing a Unix socket with unread data
  // resets it, and the client would see ECONNRESET instead of our reason. A
  // connection refused at accept waits a short while only.
  ShmHello hello{};
  const int wait_ms = static_cast<int>(c->refused.ok() ? opt_.handshake_timeout.count()
                                                        : std::min<int64_t>(250, opt_.handshake_timeout.count()));
  if (absl::Status st = unix_socket::Receive(c->sock, &hello, sizeof(hello), nullptr, wait_ms); !st.ok())
    return c->refused.ok() ? st : c->refused;
  if (!c->refused.ok()) return refuse(c->refused);  // the uid was checked at accept (Accept)
  // An allowed client learns our model, so that it can name it when it refuses us.
  SetShmModel(opt_.model, &reply);
  const bool store_request = hello.magic == kShmStoreMagic;
  if ((!store_request && hello.magic != kShmHelloMagic) || hello.version != kShmProtocolVersion)
    return refuse(absl::InvalidArgumentError("hello: bad magic or protocol version"));
  if (static_cast<int>(hello.hidden) != opt_.hidden)
    return refuse(absl::InvalidArgumentError(absl::StrCat("hello.hidden: ", hello.hidden, ", the model has ", opt_.hidden)));
  // A client of another model (a worker whose --model is not ours) gets no
  // segment and no store: its cached hits and our misses would not add up.
  if (hello.model_identity != 0 && !SameModel(opt_.model, ShmPeerModel(hello)))
    return refuse(ModelMismatchError(opt_.model, ShmPeerModel(hello),
                                     "this expert server", absl::StrCat("the client (uid ", c->uid, ")")));
  if (store_request) return SendSharedStore(c);
  if (hello.max_tokens > opt_.max_slot_tokens || hello.slots > opt_.max_slots)
    return refuse(absl::OutOfRangeError(absl::StrCat("hello: asks for ", hello.slots, " slots of ", hello.max_tokens,
                                                     " tokens; this server allows ", opt_.max_slots, " of ",
                                                     opt_.max_slot_tokens)));
  if (absl::Status st = shm::ValidateGeometryArgs(hello.hidden, hello.max_tokens, hello.max_pairs, hello.slots); !st.ok())
    return refuse(st);
  const shm::SegmentGeometry geo = shm::Geometry(hello.hidden, hello.max_tokens, hello.max_pairs, hello.slots);
  c->memfd = memfd_create("moe-expert-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (c->memfd < 0 || ftruncate(c->memfd, static_cast<off_t>(geo.total_bytes)) != 0)
    return refuse(absl::ResourceExhaustedError("cannot create the shared-memory segment"));
  // The client must not shrink the file under us (that would turn our accesses into SIGBUS).
  fcntl(c->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  c->bytes = geo.total_bytes;
  c->base = mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
  if (c->base == MAP_FAILED) {
    c->base = nullptr;
    return refuse(absl::ResourceExhaustedError("cannot map the shared-memory segment"));
  }
  absl::StatusOr<shm::Segment> seg =
      shm::Segment::Create(c->base, c->bytes, hello.hidden, hello.max_tokens, hello.max_pairs, hello.slots,
                           opt_.slice);
  if (!seg.ok()) return refuse(seg.status());
  {
    std::lock_guard<std::mutex> lock(mu_);  // Stop reads it
    c->seg = *seg;
  }
  reply.status_code = 0;
  reply.segment_bytes = c->bytes;
  return unix_socket::Send(c->sock, &reply, sizeof(reply), c->memfd);
}

// Serves slot `idx` popped from the host (device = false) or the device
// submit ring and completes it on the matching ring; false: drop the client.
bool ShmServer::ServeSlot(Connection* c, uint32_t idx, bool device, shm::ValidatedRequest* req) {
  const shm::Segment& seg = *c->seg;
  if (!seg.ValidateSlotIndex(idx).ok()) {
    LogWarning("shm", "client wrote slot index ", idx, " out of range; dropping it");
    return false;
  }
  const shm::RequestSlot slot = seg.slot(idx);
  const Clock::time_point t0 = opt_.on_request ? Clock::now() : Clock::time_point();
  absl::Status st = shm::ValidateRequestSlot(seg, idx, opt_.num_experts, opt_.num_layers, req, opt_.hosted);
  const bool valid = st.ok();
  if (valid) {
    MoeBatch b;
    b.layer = static_cast<int>(req->layer);
    b.n = req->n_tokens;
    b.tokens = slot.tokens;
    b.routing = req->routing();
    st = handler_(b, slot.output);
  }
  shm::WriteResponseStatus(slot, st);
  if (opt_.on_request) {
    ShmRequestRecord r;
    r.code = st.code();
    const uint64_t token_bytes = uint64_t(req->n_tokens) * uint64_t(opt_.hidden) * sizeof(bf16_t);
    if (valid) r.bytes_received = token_bytes + uint64_t(req->n_tokens) * uint64_t(req->k) * (sizeof(int32_t) + sizeof(float));
    if (st.ok()) r.bytes_sent = token_bytes;
    r.handle_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
    opt_.on_request(r);
  }
  if (!(device ? seg.TryPushDeviceComplete(idx) : seg.TryPushComplete(idx))) {
    // More completions than slots: the client broke the protocol.
    LogWarning("shm", "completion ring full; dropping the client");
    return false;
  }
  if (!device) seg.RingResponse();  // the GPU polls its ring
  return true;
}

void ShmServer::Serve(Connection* c) {
  const shm::Segment& seg = *c->seg;
  shm::ValidatedRequest req;
  auto& bell = seg.request_doorbell();
  Clock::time_point last_request{}, last_device_request{};
  bool device_naps = false;  // timer slack lowered for the device ring's short naps
  unix_socket::PeerClosedProbe peer(c->sock);
  while (!stop_.load()) {
    const uint32_t seen = bell.load(std::memory_order_acquire);
    bool worked = false;
    for (bool more = true; more;) {
      more = false;
      if (std::optional<uint32_t> idx = seg.TryPopSubmit()) {
        more = worked = true;
        last_request = Clock::now();
        if (!ServeSlot(c, *idx, false, &req)) goto disconnect;
      }
      if (std::optional<uint32_t> idx = seg.TryPopDeviceSubmit()) {
        more = worked = true;
        if (!ServeSlot(c, *idx, true, &req)) goto disconnect;
        // The poll window runs from the answer: the GPU's next request (the
        // next layer's) follows it, however long this one took.
        last_request = last_device_request = Clock::now();
      }
    }
    if (seg.PeerClosed(shm::Side::kServer) || peer.Closed()) break;
    // Spin a while before sleeping: in decode the next layer's batch follows
    // within microseconds; a client in polling mode asks for longer. A client
    // whose GPU pushes requests (device rings) cannot wake us: poll after its
    // requests, and nap briefly instead of sleeping until a doorbell.
    if (!worked) {
      const Clock::time_point now = Clock::now();
      std::chrono::nanoseconds spin = opt_.idle_spin;
      Clock::time_point poll_until = std::min(seg.ClientPollUntil(), last_request + opt_.max_client_poll);
      Clock::time_point wake = now + std::chrono::milliseconds(50);
      const std::chrono::nanoseconds device_poll = seg.DevicePoll();
      if (device_poll.count() > 0) {
        if (!device_naps) {
          prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: naps of kDeviceNapNs stay that short
          device_naps = true;
        }
        const std::chrono::nanoseconds poll = std::min<std::chrono::nanoseconds>(device_poll, opt_.max_client_poll);
        poll_until = std::max(poll_until, last_device_request + poll);
        wake = now + std::max(shm::DeviceNap(now - last_request, poll), std::chrono::nanoseconds(shm::kDeviceNapNs));
      }
      // Polling through a client's window is a core's work: at most
      // max_polling connections at once; the others do not spin through it
      // (a host client's ring wakes them, a GPU's request waits for the next
      // nap). The short idle spin after a request outside any window stays.
      bool polling = false;
      if (poll_until > now) {
        polling = opt_.max_polling <= 0 || polling_.fetch_add(1, std::memory_order_acq_rel) < opt_.max_polling;
        if (!polling) {
          polling_.fetch_sub(1, std::memory_order_acq_rel);
          spin = std::chrono::nanoseconds(0);
          if (device_poll.count() > 0) wake = now + std::chrono::nanoseconds(shm::kDeviceNapNs);
        }
      }
      if (polling) {
        spin = std::max(spin, std::chrono::duration_cast<std::chrono::nanoseconds>(poll_until - now));
        if (opt_.on_poll) opt_.on_poll(poll_until);
      }
      seg.WaitRequest(seen, std::max(wake, now + spin), spin);
      if (polling && opt_.max_polling > 0) polling_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
disconnect:
  seg.MarkClosed(shm::Side::kServer);
  shutdown(c->sock, SHUT_RDWR);
  // Free the client's segment now, not when the connection is reaped.
  std::lock_guard<std::mutex> lock(mu_);
  c->seg.reset();
  munmap(c->base, c->bytes);
  c->base = nullptr;
  close(c->memfd);
  c->memfd = -1;
  close(c->sock);  // the socket too: a closed session holds no descriptor until the next accept
  c->sock = -1;
  c->done.store(true);
}

absl::StatusOr<SharedStoreFd> FetchSharedStore(const std::string& socket_path, int hidden, const ModelIdentity& model,
                                               std::chrono::milliseconds timeout) {
  MOE_ASSIGN_OR_RETURN(const int sock, unix_socket::Connect(socket_path));
  absl::Cleanup close_sock = [sock] { close(sock); };
  const ShmHello hello = MakeShmHello(kShmStoreMagic, hidden, 0, 0, 0, model);
  MOE_RETURN_IF_ERROR(unix_socket::Send(sock, &hello, sizeof(hello)));
  ShmReply reply{};
  SharedStoreFd out;
  MOE_RETURN_IF_ERROR(unix_socket::Receive(sock, &reply, sizeof(reply), &out.fd, static_cast<int>(timeout.count())));
  absl::Cleanup close_fd = [&out] {  // on every error below
    if (out.fd >= 0) close(out.fd);
  };
  reply.message[sizeof(reply.message) - 1] = '\0';
  MOE_RETURN_IF_ERROR(CheckShmReplyModel(reply, model, socket_path));  // a store of another model is never mapped
  if (reply.status_code != 0)
    return absl::Status(StatusCodeFromWire(reply.status_code, absl::StatusCode::kUnavailable),
                        absl::StrCat("expert server on ", socket_path, ": ", reply.message));
  if (reply.magic != kShmStoreMagic || out.fd < 0)
    return absl::UnavailableError(absl::StrCat("expert server on ", socket_path, ": no store in its answer"));
  if (reply.segment_bytes > (uint64_t{1} << 20))
    return absl::InvalidArgumentError(absl::StrCat("expert server on ", socket_path, ": store description of ",
                                                   reply.segment_bytes, " bytes"));
  out.info.resize(reply.segment_bytes);
  if (!out.info.empty())
    MOE_RETURN_IF_ERROR(unix_socket::Receive(sock, out.info.data(), out.info.size(), nullptr,
                                             static_cast<int>(timeout.count())));
  struct stat st {};
  if (fstat(out.fd, &st) != 0) return absl::InternalError(absl::StrCat("fstat of the store: ", std::strerror(errno)));
  out.bytes = static_cast<uint64_t>(st.st_size);
  MOE_RETURN_IF_ERROR(unix_socket::CheckResizeSealed(out.fd, out.bytes, absl::StrCat("expert server on ", socket_path, ": store")));
  std::move(close_fd).Cancel();
  return out;
}

}  // namespace moe
