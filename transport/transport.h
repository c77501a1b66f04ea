// ExpertTransport: how a GPU worker ships one layer's miss batch (a MoeBatch)
// to a CPU expert server and gets the partial output back. One interface, used by every
// caller; two implementations picked by the address:
//   unix:///path/to/socket  -> shared memory (same host; memfd ring, futex doorbells)
//   host:port               -> gRPC (one long-lived ForwardStream per transport)
//
// Lifecycle: ConnectTransport() -> Submit() any number of times, from any
// number of threads, with several batches in flight -> destroy. Every
// submitted batch completes by its deadline: OK with the output written,
// DEADLINE_EXCEEDED, UNAVAILABLE (server gone; the transport reconnects on a
// later Submit), or the server's own error (e.g. INVALID_ARGUMENT). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/model_identity.h"
#include "model/moe_batch.h"
#include "transport/shm_segment.h"
#include "moe/types.h"

namespace moe {

using Clock = std::chrono::steady_clock;

// The request slots an expert server grants one shm client by default
// (ShmServer::Options::max_slots).
inline constexpr int kShmServerMaxSlots = 256;

struct TransportOptions {
  int hidden = 0;                  // H of the model (required)
  // The model this client computes with (a GPU worker's own --model). Sent in
  // the shm hello and in every gRPC request and checked against the server's
  // (the shm reply, GetInfo) at every (re)connect: a server of another model,
  // or of other expert math or routing, is refused, naming both identities and
  // both models (model/model_identity.h).
  // digest 0: nothing checked (a client with no model of its own: a benchmark).
  ModelIdentity model;
  // shm: slot geometry the client asks the server for. A GPU worker's
  // dispatcher raises slots (then max_tokens_per_slot) to what its calls in
  // flight can hold at once (LayerDispatcher::Init).
  int max_tokens_per_slot = 256;
  int max_pairs_per_token = 8;
  int slots = 16;
  // Slots kept for the client's GPU, which works the segment's device rings
  // itself (ExpertTransport::DeviceRings); the others serve Stage / Submit.
  int device_slots = 0;
  // gRPC
  TlsOptions tls;
  bool grpc_unary = false;         // unary Forward per batch instead of the stream
  int grpc_streams = 8;            // ForwardStreams per transport (a connection each): a batch on the first idle one, a large one striped over all
                                   // (the server computes one batch per stream at a time)
  uint64_t max_message_bytes = 256u << 20;
  std::chrono::milliseconds connect_timeout{5000};
};

// Room for one batch in memory the transport owns (not a batch itself: the
// caller fills it), so a producer (e.g. a GPU copy engine) writes the inputs
// exactly where the server will read them and reads the output where the
// server wrote it. For shm these are a slot of the shared segment itself — no
// host copy on either side; for gRPC they are staging buffers that feed the
// message.
struct StagingArea {
  bf16_t* tokens = nullptr;          // [n, H]   filled by the caller
  int32_t* expert_ids = nullptr;     // [n, k]
  float* expert_weights = nullptr;   // [n, k]
  const bf16_t* output = nullptr;    // [n, H]   valid once SubmitStaged's future is OK, until Release
  int n = 0;
  int k = 0;
  uint64_t handle = 0;
};

class ExpertTransport {
 public:
  virtual ~ExpertTransport() = default;

  // Zero-copy path: Stage() reserves room for n tokens x k pairs (for shm at
  // most max_tokens_per_slot tokens: one slot), the caller fills it,
  // SubmitStaged() sends it, and Release() gives the room back (always call
  // it, also after an error or a deadline).
  virtual absl::StatusOr<StagingArea> Stage(int n, int k, Clock::time_point deadline) = 0;
  virtual std::future<absl::Status> SubmitStaged(const StagingArea& staged, uint32_t layer,
                                                 Clock::time_point deadline) = 0;
  virtual void Release(const StagingArea& staged) = 0;
  // The host memory staged batches live in, for cudaHostRegister (shm: the
  // whole mapped segment); {nullptr, 0} when it is not one fixed region.
  virtual std::pair<void*, size_t> HostMapping() const { return {nullptr, 0}; }

  // shm with TransportOptions::device_slots > 0: the connected segment for a
  // GPU that works its device rings (shm_segment.h), the slots kept for it
  // ([first_slot, first_slot + slots)) and the connection's generation
  // (another segment after every reconnect); nullopt otherwise. A segment
  // stays mapped after a reconnect until ReleaseDeviceSegments.
  struct DeviceRings {
    shm::Segment segment;
    size_t bytes = 0;
    uint64_t generation = 0;
    uint32_t first_slot = 0, slots = 0;
  };
  virtual std::optional<DeviceRings> DeviceRingsOf() const { return std::nullopt; }
  // The connection's generation (DeviceRings::generation) without a lock: a
  // change says the device rings moved to another segment. 0: none.
  virtual uint64_t Generation() const { return 0; }
  // The share of every expert the server holds (--slice; learned at connect:
  // the shm segment's header, gRPC's GetInfo): its answers are partial
  // outputs, one term of the sum over slices. Fixed for the transport's life;
  // every request carries it and a server holding another share refuses it.
  virtual ExpertSlice slice() const { return {}; }
  // Unmaps the segments of earlier connections kept for the GPU (call once
  // no device work can still write to them).
  virtual void ReleaseDeviceSegments() {}
  // Connects again if the server went away (the next Submit would too); OK when connected.
  virtual absl::Status Reconnect() { return absl::OkStatus(); }
  // A sign of life from a server that stopped answering while its connection
  // stayed up (a stalled process, a link gone silent): OK once a small round
  // trip (gRPC: GetInfo, at most `timeout`) started by an earlier call has
  // been answered; otherwise starts one, unless one is in flight, and returns
  // UNAVAILABLE at once. A caller polls it before sending real batches to a
  // server whose batches timed out, so that each retry does not cost a whole
  // server deadline. Default: Reconnect() (a same-host server that stalls is
  // a stopped process, whose socket says so).
  virtual absl::Status Probe(std::chrono::milliseconds timeout) {
    (void)timeout;
    return Reconnect();
  }

  // Copies the batch out before returning (the caller may reuse its buffers);
  // `out` ([n, H] bf16) must stay valid until the future is ready.
  virtual std::future<absl::Status> Submit(const MoeBatch& batch, bf16_t* out,
                                           Clock::time_point deadline) = 0;
  virtual const char* kind() const = 0;  // "shm", "grpc-stream" or "grpc-unary"
  // Requests written to the server since Connect: one per Submit, or one per
  // stripe of a batch striped over gRPC streams. 0 where a transport does not
  // count them (shm). Thread-safe.
  virtual uint64_t requests_sent() const { return 0; }

  // Polling mode, for a caller that sends batches back to back (a GPU worker
  // decoding: one batch per layer, a millisecond apart). While `window` > 0,
  // every submitted batch asks both sides to poll for up to `window` after it
  // instead of sleeping on a futex — the server's request loop for the next
  // batch (shm: bounded by the server's own cap), this transport's completion
  // path for the answers in flight; past the window both fall back to
  // sleeping. 0 (the default) turns it off.
  // Transports without a polling side (gRPC) ignore it. Thread-safe.
  virtual void SetPolling(std::chrono::microseconds window) { (void)window; }
};

// A status code a peer sent as a number: a canonical error code (1..16) as
// itself, anything else (a misbehaving peer) as `otherwise`.
inline absl::StatusCode StatusCodeFromWire(int64_t code, absl::StatusCode otherwise) {
  return code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code) : otherwise;
}

// Waits for a transport future, polling it for up to `spin` first: a caller
// with a core to spare (a GPU worker waiting for a decode layer's misses) saves
// the scheduler wake-up, which costs more than a same-host round trip.
absl::Status AwaitResult(std::future<absl::Status>& f,
                         std::chrono::nanoseconds spin = std::chrono::microseconds(200));

// The socket path of a unix://PATH address (shared memory, same host);
// nullopt for host:port.
std::optional<std::string> UnixSocketPath(const std::string& address);

// Picks the implementation from the address scheme (see above).
absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectTransport(const std::string& address,
                                                                 const TransportOptions& options);

// Implementations (one per file); ConnectTransport is the only caller.
absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectGrpcTransport(const std::string& address,
                                                                     const TransportOptions& options);
absl::StatusOr<std::unique_ptr<ExpertTransport>> ConnectShmTransport(const std::string& socket_path,
                                                                    const TransportOptions& options);

}  // namespace moe
