// Layout and safe accessors of one shared-memory (memfd) segment between
// exactly one client (the GPU worker) and one server (the CPU expert server).
//
//   [0, 4 KiB)        SegmentHeader: magic, version, geometry, doorbells, closed flags
//   submit ring       RingHeader + S u32 slot indices (client -> server)
//   complete ring     RingHeader + S u32 slot indices (server -> client)
//   device submit     RingHeader + S u32 slot indices (the client's GPU -> server)
//   device complete   RingHeader + S u32 slot indices (server -> the client's GPU)
//   S slots           SlotHeader, tokens [T,H] bf16, ids [T,K] i32,
//                     weights [T,K] f32, output [T,H] bf16
// Every region starts on a 64-byte boundary. A request of n tokens with k
// pairs each uses the first n*H tokens, n*k ids / weights (row-major [n,k])
// and n*H outputs of its slot.
//
// Protocol: the client fills a free slot, pushes its index on `submit` and
// rings `request_doorbell`; the server pops it, validates it
// (ValidateRequestSlot), writes output and status, pushes the index on
// `complete` and rings `response_doorbell`. Which slots are free is the
// client's bookkeeping. Each doorbell has a sleeper count: a waiter registers
// before FUTEX_WAIT, and a ringer skips the wake syscall when nobody sleeps
// (the common case while both sides poll).
//
// Device rings: a second submit/complete pair whose producer and consumer on
// the client side is the client's GPU (kernels writing through the mapping),
// which can ring no futex. The client reserves slots for them (its own
// bookkeeping) and publishes `device_poll_ns` (> 0 once it uses them): after
// each device request the server polls both submit rings that long (capped
// by its own budget), and while the device ring was used in the last second it
// never sleeps longer than kDeviceNapNs at a time (then kDeviceIdleNapNs), so
// a request the GPU pushes is picked up without a wake-up call.
//
// Polling mode: the client publishes `client_poll_until_ns` (CLOCK_MONOTONIC,
// the clock of std::chrono::steady_clock on Linux), e.g. now + 2 ms at every
// decode batch; until then the server polls the submit ring instead of
// sleeping (capped by the server's own budget), so the next layer's batch is
// picked up in nanoseconds, not after a futex wake-up.
//
// Thread/process safety: Segment is a non-owning view (cheap to copy) over a
// mapping whose lifetime is the caller's. Its geometry is copied into the view
// once (Create / Attach) and never re-read from shared memory, so a peer that
// scribbles over the header cannot make accessors go out of bounds. Each ring
// is single-producer/single-consumer: at most one thread of one process may
// push and one thread of the other side may pop. Everything the peer writes is
// untrusted: popped indices go through ValidateSlotIndex, slot headers through
// ValidateRequestSlot / ValidateResponseSlot, which read each shared field
// exactly once and copy what later code indexes with (routing) out of shared
// memory. Doorbells work across processes (non-private futexes).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/model_spec.h"
#include "model/routing.h"

namespace moe::shm {

inline constexpr uint64_t kMagic = 0x31304d4853454f4dull;  // "MOESHM01" in memory order
// 2: doorbell sleeper counts, client polling deadline; 3: device rings; 4: the server's expert slice
inline constexpr uint32_t kVersion = 4;
// Longest sleep of a server connection whose device ring is in use (see above):
// within a second of the last request, then afterwards.
inline constexpr int64_t kDeviceNapNs = 50'000;
inline constexpr int64_t kDeviceIdleNapNs = 1'000'000;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kAlign = 64;
inline constexpr uint32_t kMaxMessageLen = 200;
// Limits enforced by ValidateGeometryArgs (they keep all arithmetic in u64).
inline constexpr uint32_t kMaxHidden = 1u << 16;
inline constexpr uint32_t kMaxTokensPerSlot = 1u << 16;
inline constexpr uint32_t kMaxPairsPerToken = 1024;
inline constexpr uint32_t kMaxSlots = 1u << 16;
inline constexpr uint64_t kMaxSegmentBytes = 64ull << 30;

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free (address-free)");

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint32_t hidden;       // H
  uint32_t max_tokens;   // T, per slot
  uint32_t max_pairs;    // K, per token
  uint32_t num_slots;    // S, a power of two
  uint64_t slot_stride;
  uint64_t submit_ring_offset;
  uint64_t complete_ring_offset;
  uint64_t device_submit_ring_offset;
  uint64_t device_complete_ring_offset;
  uint64_t slots_offset;
  uint64_t total_bytes;
  uint32_t slice_index;  // the server's share of every expert (ExpertSlice, model/model_spec.h)
  uint32_t slice_count;  // 1: whole experts
  alignas(64) std::atomic<uint32_t> request_doorbell;   // client -> server
  alignas(64) std::atomic<uint32_t> response_doorbell;  // server -> client
  alignas(64) std::atomic<uint32_t> client_closed;
  std::atomic<uint32_t> server_closed;
  alignas(64) std::atomic<uint32_t> request_sleepers;   // server threads in FUTEX_WAIT on request_doorbell
  alignas(64) std::atomic<uint32_t> response_sleepers;  // client threads in FUTEX_WAIT on response_doorbell
  alignas(64) std::atomic<uint64_t> client_poll_until_ns;  // polling mode (see above); 0 = off
  std::atomic<uint64_t> device_poll_ns;                   // device rings in use (see above); 0 = not
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

// Followed, at +sizeof(RingHeader), by `num_slots` u32 entries.
struct RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // consumer's
  alignas(64) std::atomic<uint64_t> tail;  // producer's
};
static_assert(sizeof(RingHeader) == 128);

struct SlotHeader {
  uint64_t request_id;
  uint32_t layer;
  uint32_t n_tokens;
  uint32_t k;
  int32_t status_code;  // absl::StatusCode (= gRPC code), written by the server
  uint32_t message_len;
  char message[kMaxMessageLen];
};

// All offsets in bytes; ring and slot offsets from the segment base, the
// *_offset fields of a slot's regions from the slot's start.
struct SegmentGeometry {
  uint32_t hidden = 0, max_tokens = 0, max_pairs = 0, num_slots = 0;
  uint64_t header_bytes = 0;
  uint64_t submit_ring_offset = 0, complete_ring_offset = 0, ring_bytes = 0;
  uint64_t device_submit_ring_offset = 0, device_complete_ring_offset = 0;
  uint64_t slots_offset = 0, slot_stride = 0;
  uint64_t tokens_offset = 0, ids_offset = 0, weights_offset = 0, output_offset = 0;
  uint64_t total_bytes = 0;
  bool operator==(const SegmentGeometry&) const = default;
};

// InvalidArgument unless 1 <= H <= kMaxHidden, 1 <= T <= kMaxTokensPerSlot,
// 1 <= K <= kMaxPairsPerToken, S a power of two <= kMaxSlots and the total
// segment size <= kMaxSegmentBytes.
absl::Status ValidateGeometryArgs(uint32_t hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t num_slots);
// Pure layout function. Precondition: ValidateGeometryArgs passed (within the
// limits nothing overflows).
SegmentGeometry Geometry(uint32_t hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t num_slots);

struct RequestSlot {
  SlotHeader* header = nullptr;
  bf16_t* tokens = nullptr;   // [T,H]
  int32_t* ids = nullptr;     // [T,K]
  float* weights = nullptr;   // [T,K]
  bf16_t* output = nullptr;   // [T,H]
};

enum class Side { kClient, kServer };

class Segment {
 public:
  // Server side: lays out a fresh segment over [base, base+bytes) (64-byte
  // aligned, bytes >= Geometry(...).total_bytes, memory not shared yet).
  static absl::StatusOr<Segment> Create(void* base, size_t bytes, uint32_t hidden, uint32_t max_tokens,
                                        uint32_t max_pairs, uint32_t num_slots, ExpertSlice slice = {});
  // Client side: validates the whole header of a mapping received from the
  // server (magic, version, geometry recomputed from H/T/K/S equal to the
  // stored offsets and within `bytes`, H == expected_hidden); InvalidArgument
  // otherwise. Never reads outside [base, base+bytes).
  static absl::StatusOr<Segment> Attach(void* base, size_t bytes, uint32_t expected_hidden);

  const SegmentGeometry& geometry() const { return geo_; }
  // The server's share of every expert it hosts (checked at Attach).
  ExpertSlice slice() const { return slice_; }
  uint32_t num_slots() const { return geo_.num_slots; }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }

  // Precondition: index < num_slots() (checked by assert; masked otherwise).
  RequestSlot slot(uint32_t index) const;
  // InvalidArgument unless index < num_slots(); use on every popped index.
  absl::Status ValidateSlotIndex(uint32_t index) const;

  // SPSC rings. Push returns false when full; pop returns the raw, untrusted
  // value (nullopt when empty).
  bool TryPushSubmit(uint32_t slot) const { return Push(submit_ring(), slot); }
  std::optional<uint32_t> TryPopSubmit() const { return Pop(submit_ring()); }
  bool TryPushComplete(uint32_t slot) const { return Push(complete_ring(), slot); }
  std::optional<uint32_t> TryPopComplete() const { return Pop(complete_ring()); }
  // The device pair (server side; the client's GPU works the other ends).
  std::optional<uint32_t> TryPopDeviceSubmit() const { return Pop(ring(geo_.device_submit_ring_offset)); }
  bool TryPushDeviceComplete(uint32_t slot) const { return Push(ring(geo_.device_complete_ring_offset), slot); }
  // Client side: the device rings are in use; the server polls `poll` after each device request.
  void SetDevicePoll(std::chrono::nanoseconds poll) const;
  std::chrono::nanoseconds DevicePoll() const;  // untrusted on the server side
  uint8_t* base() const { return base_; }

  std::atomic<uint32_t>& request_doorbell() const { return header()->request_doorbell; }
  std::atomic<uint32_t>& response_doorbell() const { return header()->response_doorbell; }
  // The doorbells with their sleeper counts (what the transports use): a ring
  // costs no syscall while the other side polls.
  void RingRequest() const;
  void RingResponse() const;
  bool WaitRequest(uint32_t seen, std::chrono::steady_clock::time_point deadline, std::chrono::nanoseconds spin) const;
  bool WaitResponse(uint32_t seen, std::chrono::steady_clock::time_point deadline, std::chrono::nanoseconds spin) const;
  // Polling mode. The client sets the deadline; the server reads it (an
  // untrusted value: the server bounds how long it honours it).
  void SetClientPollUntil(std::chrono::steady_clock::time_point until) const;
  std::chrono::steady_clock::time_point ClientPollUntil() const;
  // Sets `self`'s closed flag and rings the peer's doorbell so a waiter wakes.
  void MarkClosed(Side self) const;
  bool PeerClosed(Side self) const;

 private:
  Segment(uint8_t* base, const SegmentGeometry& geo, ExpertSlice slice) : base_(base), geo_(geo), slice_(slice) {}
  RingHeader* ring(uint64_t offset) const { return reinterpret_cast<RingHeader*>(base_ + offset); }
  RingHeader* submit_ring() const { return ring(geo_.submit_ring_offset); }
  RingHeader* complete_ring() const { return ring(geo_.complete_ring_offset); }
  bool Push(RingHeader* ring, uint32_t value) const;
  std::optional<uint32_t> Pop(RingHeader* ring) const;

  uint8_t* base_;
  SegmentGeometry geo_;
  ExpertSlice slice_;
};

// Doorbells. Usage (waiter): `seen = word.load(acquire)`, check the ring, and
// only if it is empty `WaitDoorbell(word, seen, deadline)`; ringer: push, then
// Ring(word). Ring increments the word and FUTEX_WAKEs all waiters (shared,
// not PRIVATE: the word lives in memory mapped by two processes).
// With `sleepers` (every waiter and ringer of that word must pass the same
// one) the ringer wakes only when a waiter is registered in it.
void Ring(std::atomic<uint32_t>& word, std::atomic<uint32_t>* sleepers = nullptr);
// Returns true once word != seen, false at the deadline. Spins `spin` (pause)
// before sleeping in FUTEX_WAIT.
bool WaitDoorbell(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::steady_clock::time_point deadline,
                  std::chrono::nanoseconds spin = std::chrono::microseconds(20),
                  std::atomic<uint32_t>* sleepers = nullptr);

// How long a side that serves device rings may sleep now, `idle` after its
// last request: 0 (keep polling) within `poll`, kDeviceNapNs within a
// second, kDeviceIdleNapNs after that (see "Device rings" above).
std::chrono::nanoseconds DeviceNap(std::chrono::nanoseconds idle, std::chrono::nanoseconds poll);

// Slot header writers (plain stores; publish by pushing the index).
void WriteRequestHeader(const RequestSlot& s, uint64_t request_id, uint32_t layer, uint32_t n_tokens, uint32_t k);
// Writes code and message (truncated to kMaxMessageLen).
void WriteResponseStatus(const RequestSlot& s, const absl::Status& status);

// A request header and routing copied out of shared memory and validated.
// The tokens stay in the slot (a racing client only garbles its own result).
struct ValidatedRequest {
  uint64_t request_id = 0;
  uint32_t layer = 0;
  int n_tokens = 0;
  int k = 0;
  std::vector<int32_t> ids;     // [n,k], capacity reused across calls
  std::vector<float> weights;   // [n,k]
  RoutingView routing() const { return RoutingView{n_tokens, k, ids.data(), weights.data()}; }
};

// Server-side check of slot `slot` written by an untrusted client: the index,
// 1 <= n_tokens <= T, 1 <= k <= K, layer < num_layers, then ValidateRouting
// (ids in range / hosted, no duplicate per token, finite weights) on a private
// copy placed in *out. InvalidArgument naming the field otherwise.
absl::Status ValidateRequestSlot(const Segment& seg, uint32_t slot, int num_experts, int num_layers,
                                 ValidatedRequest* out, const std::function<bool(int)>& hosted = {});

struct ValidatedResponse {
  uint64_t request_id = 0;
  absl::Status status;  // the server's verdict on the request
};
// Client-side check of a completed slot: index, status_code in [0, 16],
// message_len <= kMaxMessageLen. Fills *out; the returned status is about the
// slot's well-formedness, out->status is what the server reported.
absl::Status ValidateResponseSlot(const Segment& seg, uint32_t slot, ValidatedResponse* out);

}  // namespace moe::shm
