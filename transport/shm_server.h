// ShmServer: the expert server's shared-memory endpoint. Listens on a Unix
// socket (mode 0660, or 0666 when uids other than its own are allowed: the
// uid check below is what admits a client); it refuses to start on a path
// where a live server answers, replaces only a stale socket of its own uid,
// and on Stop removes the socket file only while it is still its own. Each
// connecting client (uid checked with SO_PEERCRED) sends a Hello with the
// slot geometry it wants and its model identity (one of another model than
// Options::model is refused), within handshake_timeout, on the connection's own
// thread (a slow or silent client never delays another), gets a fresh memfd
// segment (sealed against resizing) over SCM_RIGHTS, and from then on talks
// through the segment's rings and doorbells. That thread validates each
// request slot (shm::ValidateRequestSlot), calls the handler, which writes the
// output straight into the slot, and completes it. A client that goes away
// (socket closed) has its segment unmapped and its thread ended.
// Start/Stop from one thread; the handler and on_request are called from
// connection threads.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"
#include "transport/unix_socket.h"

namespace moe {

// Handshake messages on the socket (little-endian, fixed size). Both carry
// their side's model (model/model_identity.h): the server refuses a hello
// whose model_identity is another model's (0: the client asserts none), and
// the client refuses a reply whose model_identity is not its own model's
// (CheckShmReplyModel), each naming both identities and both models.
// Both carry their side's expert math and routing too (ModelIdentity's
// expert_math / routing; empty: not reported).
inline constexpr size_t kShmModelTextBytes = 256;  // the model's --model, NUL-terminated, cut to fit
inline constexpr size_t kShmMathTextBytes = 64;    // ExpertMathName / RoutingModeName, NUL-terminated
struct ShmHello {
  uint32_t magic;  // kShmHelloMagic
  uint32_t version;
  uint32_t hidden, max_tokens, max_pairs, slots;
  uint64_t model_identity;
  char model[kShmModelTextBytes];
  char expert_math[kShmMathTextBytes];
  char routing[kShmMathTextBytes];
};
struct ShmReply {
  uint32_t magic;
  int32_t status_code;  // 0: the segment fd is attached
  uint64_t segment_bytes;
  char message[200];
  uint64_t model_identity;  // the server's (0 in a refusal at accept: the uid is not told)
  char model[kShmModelTextBytes];
  char expert_math[kShmMathTextBytes];
  char routing[kShmMathTextBytes];
};
inline constexpr uint32_t kShmHelloMagic = 0x484d4f4d;  // "MOMH"
// 2: the hello and the reply carry their side's model identity.
// 3: and their expert math and routing.
inline constexpr uint32_t kShmProtocolVersion = 3;

// A hello for `model` (its text cut to fit).
ShmHello MakeShmHello(uint32_t magic, int hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t slots,
                      const ModelIdentity& model);
// The text a peer wrote: up to its NUL, other than printable ASCII as '?'
// (a peer's bytes go into our log lines).
template <size_t N>
std::string ShmModelText(const char (&text)[N]) {
  std::string out(text, strnlen(text, N));
  for (char& ch : out)
    if (ch < 0x20 || ch > 0x7e) ch = '?';
  return out;
}
// The identity a peer's hello or reply (`M`: ShmHello or ShmReply) tells.
template <typename M>
ModelIdentity ShmPeerModel(const M& m) {
  return ModelIdentity{m.model_identity, ShmModelText(m.model), ShmModelText(m.expert_math), ShmModelText(m.routing)};
}
// Writes `model` into a hello or reply (texts cut to fit).
template <typename M>
void SetShmModel(const ModelIdentity& model, M* m) {
  m->model_identity = model.digest;
  std::snprintf(m->model, sizeof(m->model), "%s", model.model.c_str());
  std::snprintf(m->expert_math, sizeof(m->expert_math), "%s", model.expert_math.c_str());
  std::snprintf(m->routing, sizeof(m->routing), "%s", model.routing.c_str());
}
// The client's check of a reply from the server on `socket_path` against its
// own model (none when ours.digest is 0). A refusal that tells no model (the
// uid was refused at accept) is left to the caller to report.
absl::Status CheckShmReplyModel(const ShmReply& reply, const ModelIdentity& ours, const std::string& socket_path);
// A hello with this magic (same struct; only `version` and `hidden` are read)
// asks for the server's shared expert store instead of a segment: the reply
// (magic kShmStoreMagic, segment_bytes = the description's length) carries
// the store's sealed memfd, the description follows on the socket, and the
// connection ends. A server without one refuses with FAILED_PRECONDITION.
inline constexpr uint32_t kShmStoreMagic = 0x534d4f4d;  // "MOMS"

// The client side of the store request: the memfd (the caller's to close)
// and the server's description of what is where (opaque here; see
// expert_compute/expert_store.h, SharedStoreInfo).
struct SharedStoreFd {
  int fd = -1;
  uint64_t bytes = 0;  // the memfd's size (fstat), not the server's word
  std::string info;
};
// `model`: the client's (checked as a segment's hello is; digest 0: not checked).
absl::StatusOr<SharedStoreFd> FetchSharedStore(const std::string& socket_path, int hidden, const ModelIdentity& model,
                                               std::chrono::milliseconds timeout);

// Computes one request: writes [batch.n, H] bf16 into out.
using ShmHandler = std::function<absl::Status(const MoeBatch& batch, bf16_t* out)>;

// One request the server answered, for the caller's metrics.
struct ShmRequestRecord {
  absl::StatusCode code = absl::StatusCode::kOk;
  uint64_t bytes_received = 0;  // tokens + routing read from the slot (0 when the slot failed validation)
  uint64_t bytes_sent = 0;      // output written into the slot (0 unless OK)
  uint64_t handle_ns = 0;       // validation + handler
};

class ShmServer {
 public:
  struct Options {
    std::string socket_path;
    int hidden = 0;
    int num_layers = 0;
    int num_experts = 0;
    std::function<bool(int)> hosted;  // expert hosted? (empty: all)
    ModelIdentity model;              // the served model: told in every reply, a hello of another refused
    ExpertSlice slice;                // the share of every expert it holds (told to clients in the segment)
    std::vector<uid_t> allowed_uids;  // empty: the server's own uid
    uint32_t max_slot_tokens = 4096;  // caps on what a client may ask for
    // How long a connection's thread spins for the next request before it
    // sleeps on the doorbell futex.
    std::chrono::microseconds idle_spin{100};
    // A client in polling mode (ExpertTransport::SetPolling) asks the thread to
    // keep polling until a deadline it sets; honoured for at most this long
    // after the connection's last request (0: never), then it sleeps.
    std::chrono::microseconds max_client_poll{10000};
    // Called (from a connection's thread) whenever it polls for a client's
    // next request until a deadline (the client's poll window, as above): the
    // server keeps its compute threads hot as long (ComputePool::KeepHotUntil).
    std::function<void(std::chrono::steady_clock::time_point)> on_poll;
    // Connections polling through their client's poll window at once (a
    // decoding client's, or a GPU's on its device rings); the others do not
    // spin through it: they sleep on the doorbell (a client on the host rings
    // it) or in naps of shm::kDeviceNapNs (a GPU cannot ring), and do not keep
    // the compute threads hot. Several clients of one server (GPUs, worker
    // processes) would otherwise spin a core each beside the compute threads.
    // (idle_spin after a request, outside any window, applies to all.) 0: no limit.
    int max_polling = 0;
    uint32_t max_slots = kShmServerMaxSlots;
    // A client must complete its hello within this; connections beyond
    // max_connections (handshaking or served) are refused.
    std::chrono::milliseconds handshake_timeout{2000};
    size_t max_connections = 256;
    // Connections one uid may hold (handshaking or served); 0: max_connections
    // split evenly over allowed_uids. Peer credentials (SO_PEERCRED) are
    // checked at accept, before anything else: a uid that is not allowed, or
    // over its cap, gets its refusal (one line; logged at most once a second
    // per uid) and never holds a slot. At most kMaxRefusing such connections
    // wait for their hello at a time; beyond that they are closed at once.
    size_t max_connections_per_uid = 0;
    // The expert store handed to clients that ask for it (kShmStoreMagic):
    // a sealed memfd (not owned; valid while the server runs) and its
    // description (at most 1 MiB). -1: none.
    int shared_store_fd = -1;
    std::string shared_store_info;
    // Called after every completed request (empty: nothing); must be cheap.
    std::function<void(const ShmRequestRecord&)> on_request;
  };

  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(Options options, ShmHandler handler);
  ~ShmServer();  // Stop()
  // Stops accepting, ends every connection (their in-flight request finishes).
  void Stop();

 private:
  struct Connection;
  ShmServer(Options o, ShmHandler h);
  void Accept(int sock);  // the listener's thread
  // Accept's refusal of `c` (refused at accept: counted in no cap but
  // kMaxRefusing): rate-limited log, then the reply on c's own thread.
  void RefuseAtAccept(std::unique_ptr<Connection> c, uid_t uid, absl::Status why);  // with mu_ held
  void ReapFinished();    // with mu_ held
  void RunConnection(Connection* c);
  void Serve(Connection* c);
  bool ServeSlot(Connection* c, uint32_t idx, bool device, shm::ValidatedRequest* req);
  absl::Status Handshake(Connection* c);
  // Answers a store request (kShmStoreMagic) on c's socket.
  absl::Status SendSharedStore(Connection* c);

  Options opt_;
  ShmHandler handler_;
  std::unique_ptr<unix_socket::Listener> listener_;
  std::atomic<bool> stop_{false};
  std::atomic<int> polling_{0};  // connections polling now (Options::max_polling)
  std::mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_;
  // Refusals logged per uid: the last line's time and how many since (mu_).
  struct RefusalLog {
    std::chrono::steady_clock::time_point last{};
    uint64_t suppressed = 0;
  };
  std::map<uid_t, RefusalLog> refusal_log_;
  void LogRefusal(uid_t uid, const absl::Status& why);
};

}  // namespace moe
