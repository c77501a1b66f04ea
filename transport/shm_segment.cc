#include "transport/shm_segment.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "core/cpu_relax.h"
#include "core/status_macros.h"

namespace moe::shm {
namespace {

constexpr uint64_t RoundUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Reads a shared field exactly once (the peer may change it concurrently).
template <typename T>
T ReadOnce(const T& field) {
  return __atomic_load_n(&field, __ATOMIC_RELAXED);
}

uint32_t* RingEntries(RingHeader* ring) { return reinterpret_cast<uint32_t*>(ring + 1); }

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

absl::Status Range(const char* field, uint64_t v, uint64_t max) {
  if (v >= 1 && v <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", v, " must be in [1, ", max, "]"));
}

}  // namespace

absl::Status ValidateGeometryArgs(uint32_t hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t num_slots) {
  for (absl::Status s : {Range("hidden", hidden, kMaxHidden),
                         Range("max_tokens_per_slot", max_tokens, kMaxTokensPerSlot),
                         Range("max_pairs_per_token", max_pairs, kMaxPairsPerToken),
                         Range("num_slots", num_slots, kMaxSlots)})
    if (!s.ok()) return s;
  if ((num_slots & (num_slots - 1)) != 0)
    return absl::InvalidArgumentError(absl::StrCat("num_slots: ", num_slots, " is not a power of two"));
  const uint64_t total = Geometry(hidden, max_tokens, max_pairs, num_slots).total_bytes;
  if (total > kMaxSegmentBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("segment: ", total, " bytes exceed the limit of ", kMaxSegmentBytes));
  return absl::OkStatus();
}

SegmentGeometry Geometry(uint32_t hidden, uint32_t max_tokens, uint32_t max_pairs, uint32_t num_slots) {
  SegmentGeometry g;
  g.hidden = hidden;
  g.max_tokens = max_tokens;
  g.max_pairs = max_pairs;
  g.num_slots = num_slots;
  g.header_bytes = kHeaderBytes;
  g.ring_bytes = RoundUp(sizeof(RingHeader) + uint64_t{num_slots} * sizeof(uint32_t));
  g.submit_ring_offset = kHeaderBytes;
  g.complete_ring_offset = g.submit_ring_offset + g.ring_bytes;
  g.device_submit_ring_offset = g.complete_ring_offset + g.ring_bytes;
  g.device_complete_ring_offset = g.device_submit_ring_offset + g.ring_bytes;
  g.slots_offset = g.device_complete_ring_offset + g.ring_bytes;
  const uint64_t activations = uint64_t{max_tokens} * hidden * sizeof(bf16_t);
  const uint64_t pairs = uint64_t{max_tokens} * max_pairs;
  g.tokens_offset = RoundUp(sizeof(SlotHeader));
  g.ids_offset = g.tokens_offset + RoundUp(activations);
  g.weights_offset = g.ids_offset + RoundUp(pairs * sizeof(int32_t));
  g.output_offset = g.weights_offset + RoundUp(pairs * sizeof(float));
  g.slot_stride = g.output_offset + RoundUp(activations);
  g.total_bytes = g.slots_offset + g.slot_stride * num_slots;
  return g;
}

absl::StatusOr<Segment> Segment::Create(void* base, size_t bytes, uint32_t hidden, uint32_t max_tokens,
                                        uint32_t max_pairs, uint32_t num_slots, ExpertSlice slice) {
  if (slice.count < 1 || slice.count > kMaxSlices || slice.index < 0 || slice.index >= slice.count)
    return absl::InvalidArgumentError(absl::StrCat("segment: slice ", slice.index, "/", slice.count, " out of range"));
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kAlign != 0)
    return absl::InvalidArgumentError("segment: base must be non-null and 64-byte aligned");
  MOE_RETURN_IF_ERROR(ValidateGeometryArgs(hidden, max_tokens, max_pairs, num_slots));
  const SegmentGeometry g = Geometry(hidden, max_tokens, max_pairs, num_slots);
  if (bytes < g.total_bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("segment: ", bytes, " bytes mapped, the geometry needs ", g.total_bytes));
  auto* p = static_cast<uint8_t*>(base);
  std::memset(p, 0, g.slots_offset);  // header and rings
  auto* h = new (p) SegmentHeader{};
  h->version = kVersion;
  h->header_bytes = kHeaderBytes;
  h->hidden = hidden;
  h->max_tokens = max_tokens;
  h->max_pairs = max_pairs;
  h->num_slots = num_slots;
  h->slot_stride = g.slot_stride;
  h->submit_ring_offset = g.submit_ring_offset;
  h->complete_ring_offset = g.complete_ring_offset;
  h->device_submit_ring_offset = g.device_submit_ring_offset;
  h->device_complete_ring_offset = g.device_complete_ring_offset;
  h->slots_offset = g.slots_offset;
  h->total_bytes = g.total_bytes;
  h->slice_index = static_cast<uint32_t>(slice.index);
  h->slice_count = static_cast<uint32_t>(slice.count);
  new (p + g.submit_ring_offset) RingHeader{};
  new (p + g.complete_ring_offset) RingHeader{};
  new (p + g.device_submit_ring_offset) RingHeader{};
  new (p + g.device_complete_ring_offset) RingHeader{};
  for (uint32_t i = 0; i < num_slots; ++i) std::memset(p + g.slots_offset + i * g.slot_stride, 0, sizeof(SlotHeader));
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);  // last: the header is complete
  return Segment(p, g, slice);
}

absl::StatusOr<Segment> Segment::Attach(void* base, size_t bytes, uint32_t expected_hidden) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat("segment: ", parts...)); };
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kAlign != 0)
    return bad("base must be non-null and 64-byte aligned");
  if (bytes < kHeaderBytes) return bad(bytes, " bytes mapped, smaller than the ", kHeaderBytes, "-byte header");
  const auto& h = *static_cast<const SegmentHeader*>(base);
  const uint64_t magic = __atomic_load_n(&h.magic, __ATOMIC_ACQUIRE);
  if (magic != kMagic) return bad("bad magic 0x", absl::Hex(magic), " (not a MOESHM01 segment)");
  const uint32_t version = ReadOnce(h.version), header_bytes = ReadOnce(h.header_bytes);
  if (version != kVersion) return bad("version ", version, ", expected ", kVersion);
  if (header_bytes != kHeaderBytes) return bad("header_bytes ", header_bytes, ", expected ", kHeaderBytes);
  const uint32_t H = ReadOnce(h.hidden), T = ReadOnce(h.max_tokens), K = ReadOnce(h.max_pairs),
                 S = ReadOnce(h.num_slots);
  if (absl::Status s = ValidateGeometryArgs(H, T, K, S); !s.ok()) return bad("header: ", s.message());
  if (H != expected_hidden) return bad("hidden ", H, " but this worker expects ", expected_hidden);
  const SegmentGeometry g = Geometry(H, T, K, S);
  const struct {
    const char* name;
    uint64_t stored, want;
  } fields[] = {{"slot_stride", ReadOnce(h.slot_stride), g.slot_stride},
                {"submit_ring_offset", ReadOnce(h.submit_ring_offset), g.submit_ring_offset},
                {"complete_ring_offset", ReadOnce(h.complete_ring_offset), g.complete_ring_offset},
                {"device_submit_ring_offset", ReadOnce(h.device_submit_ring_offset), g.device_submit_ring_offset},
                {"device_complete_ring_offset", ReadOnce(h.device_complete_ring_offset), g.device_complete_ring_offset},
                {"slots_offset", ReadOnce(h.slots_offset), g.slots_offset},
                {"total_bytes", ReadOnce(h.total_bytes), g.total_bytes}};
  for (const auto& f : fields)
    if (f.stored != f.want) return bad(f.name, " ", f.stored, " disagrees with the geometry (", f.want, ")");
  if (bytes < g.total_bytes) return bad(bytes, " bytes mapped, the geometry needs ", g.total_bytes);
  const uint32_t si = ReadOnce(h.slice_index), sc = ReadOnce(h.slice_count);
  if (sc < 1 || sc > static_cast<uint32_t>(kMaxSlices) || si >= sc)
    return bad("slice ", si, "/", sc, " out of range (1 to ", kMaxSlices, " slices)");
  return Segment(static_cast<uint8_t*>(base), g, ExpertSlice{static_cast<int>(si), static_cast<int>(sc)});
}

RequestSlot Segment::slot(uint32_t index) const {
  assert(index < geo_.num_slots);
  uint8_t* s = base_ + geo_.slots_offset + (index & (geo_.num_slots - 1)) * geo_.slot_stride;
  return RequestSlot{reinterpret_cast<SlotHeader*>(s), reinterpret_cast<bf16_t*>(s + geo_.tokens_offset),
                  reinterpret_cast<int32_t*>(s + geo_.ids_offset), reinterpret_cast<float*>(s + geo_.weights_offset),
                  reinterpret_cast<bf16_t*>(s + geo_.output_offset)};
}

absl::Status Segment::ValidateSlotIndex(uint32_t index) const {
  if (index < geo_.num_slots) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("slot index ", index, " out of range [0, ", geo_.num_slots, ")"));
}

bool Segment::Push(RingHeader* ring, uint32_t value) const {
  const uint64_t tail = ring->tail.load(std::memory_order_relaxed);
  const uint64_t head = ring->head.load(std::memory_order_acquire);
  if (tail - head >= geo_.num_slots) return false;
  __atomic_store_n(&RingEntries(ring)[tail & (geo_.num_slots - 1)], value, __ATOMIC_RELAXED);
  ring->tail.store(tail + 1, std::memory_order_release);
  return true;
}

std::optional<uint32_t> Segment::Pop(RingHeader* ring) const {
  const uint64_t head = ring->head.load(std::memory_order_relaxed);
  const uint64_t tail = ring->tail.load(std::memory_order_acquire);
  if (head == tail) return std::nullopt;
  const uint32_t v = __atomic_load_n(&RingEntries(ring)[head & (geo_.num_slots - 1)], __ATOMIC_RELAXED);
  ring->head.store(head + 1, std::memory_order_release);
  return v;
}

void Segment::MarkClosed(Side self) const {
  SegmentHeader* h = header();
  (self == Side::kClient ? h->client_closed : h->server_closed).store(1, std::memory_order_release);
  if (self == Side::kClient) {
    RingRequest();
  } else {
    RingResponse();
  }
}

bool Segment::PeerClosed(Side self) const {
  const SegmentHeader* h = header();
  return (self == Side::kClient ? h->server_closed : h->client_closed).load(std::memory_order_acquire) != 0;
}

void Ring(std::atomic<uint32_t>& word, std::atomic<uint32_t>* sleepers) {
  // seq_cst on both sides (Dekker): either the ringer sees the sleeper, or the
  // sleeper's FUTEX_WAIT sees the new word and does not sleep.
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers != nullptr && sleepers->load(std::memory_order_seq_cst) == 0) return;
  Futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

void Segment::RingRequest() const { Ring(header()->request_doorbell, &header()->request_sleepers); }
void Segment::RingResponse() const { Ring(header()->response_doorbell, &header()->response_sleepers); }

bool Segment::WaitRequest(uint32_t seen, std::chrono::steady_clock::time_point deadline,
                          std::chrono::nanoseconds spin) const {
  return WaitDoorbell(header()->request_doorbell, seen, deadline, spin, &header()->request_sleepers);
}

bool Segment::WaitResponse(uint32_t seen, std::chrono::steady_clock::time_point deadline,
                           std::chrono::nanoseconds spin) const {
  return WaitDoorbell(header()->response_doorbell, seen, deadline, spin, &header()->response_sleepers);
}

void Segment::SetClientPollUntil(std::chrono::steady_clock::time_point until) const {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(until.time_since_epoch()).count();
  header()->client_poll_until_ns.store(static_cast<uint64_t>(std::max<int64_t>(0, ns)), std::memory_order_relaxed);
}

std::chrono::steady_clock::time_point Segment::ClientPollUntil() const {
  const uint64_t ns = header()->client_poll_until_ns.load(std::memory_order_relaxed);
  return std::chrono::steady_clock::time_point(
      std::chrono::nanoseconds(static_cast<int64_t>(std::min<uint64_t>(ns, uint64_t{1} << 62))));
}

void Segment::SetDevicePoll(std::chrono::nanoseconds poll) const {
  header()->device_poll_ns.store(static_cast<uint64_t>(std::max<int64_t>(1, poll.count())), std::memory_order_release);
}

std::chrono::nanoseconds Segment::DevicePoll() const {
  const uint64_t ns = header()->device_poll_ns.load(std::memory_order_acquire);
  return std::chrono::nanoseconds(static_cast<int64_t>(std::min<uint64_t>(ns, uint64_t{1} << 62)));
}

std::chrono::nanoseconds DeviceNap(std::chrono::nanoseconds idle, std::chrono::nanoseconds poll) {
  if (idle < poll) return std::chrono::nanoseconds(0);
  return std::chrono::nanoseconds(idle < std::chrono::seconds(1) ? kDeviceNapNs : kDeviceIdleNapNs);
}

bool WaitDoorbell(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::steady_clock::time_point deadline,
                  std::chrono::nanoseconds spin, std::atomic<uint32_t>* sleepers) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point spin_until = Clock::now() + spin;
  SpinYielder yielder;  // a server connection polls for milliseconds: a thread sharing its CPU still runs
  for (;;) {
    if (word.load(std::memory_order_acquire) != seen) return true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return false;
    if (now < spin_until) {
      for (int i = 0; i < 2; ++i) CpuRelax();  // a pause is ~140 cycles on Sapphire Rapids
      yielder.Tick(now);
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    const timespec ts{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    if (sleepers != nullptr) sleepers->fetch_add(1, std::memory_order_seq_cst);
    if (word.load(std::memory_order_seq_cst) == seen)
      Futex(&word, FUTEX_WAIT, seen, &ts);  // EAGAIN (changed), EINTR, ETIMEDOUT: all re-checked above
    if (sleepers != nullptr) sleepers->fetch_sub(1, std::memory_order_seq_cst);
  }
}

void WriteRequestHeader(const RequestSlot& s, uint64_t request_id, uint32_t layer, uint32_t n_tokens, uint32_t k) {
  s.header->request_id = request_id;
  s.header->layer = layer;
  s.header->n_tokens = n_tokens;
  s.header->k = k;
  s.header->status_code = 0;
  s.header->message_len = 0;
}

void WriteResponseStatus(const RequestSlot& s, const absl::Status& status) {
  const size_t len = std::min<size_t>(status.message().size(), kMaxMessageLen);
  if (len > 0) std::memcpy(s.header->message, status.message().data(), len);
  s.header->message_len = static_cast<uint32_t>(len);
  s.header->status_code = static_cast<int32_t>(status.code());
}

absl::Status ValidateRequestSlot(const Segment& seg, uint32_t slot, int num_experts, int num_layers,
                                 ValidatedRequest* out, const std::function<bool(int)>& hosted) {
  MOE_RETURN_IF_ERROR(seg.ValidateSlotIndex(slot));
  const SegmentGeometry& g = seg.geometry();
  const RequestSlot v = seg.slot(slot);
  const uint64_t request_id = ReadOnce(v.header->request_id);
  const uint32_t layer = ReadOnce(v.header->layer), n = ReadOnce(v.header->n_tokens), k = ReadOnce(v.header->k);
  if (n == 0) return absl::InvalidArgumentError("n_tokens: empty batch (0 tokens)");
  if (n > g.max_tokens)
    return absl::InvalidArgumentError(absl::StrCat("n_tokens: ", n, " exceeds the slot's ", g.max_tokens));
  if (k == 0 || k > g.max_pairs)
    return absl::InvalidArgumentError(
        absl::StrCat("k: ", k, " pairs per token, must be in [1, ", g.max_pairs, "]"));
  if (num_layers < 0 || layer >= static_cast<uint32_t>(num_layers))
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " out of range [0, ", num_layers, ")"));
  const size_t pairs = size_t{n} * k;
  out->request_id = request_id;
  out->layer = layer;
  out->n_tokens = static_cast<int>(n);
  out->k = static_cast<int>(k);
  out->ids.assign(v.ids, v.ids + pairs);  // private copies: validated values cannot change underneath
  out->weights.assign(v.weights, v.weights + pairs);
  return ValidateRouting(out->routing(), num_experts, hosted);
}

absl::Status ValidateResponseSlot(const Segment& seg, uint32_t slot, ValidatedResponse* out) {
  MOE_RETURN_IF_ERROR(seg.ValidateSlotIndex(slot));
  const SlotHeader& h = *seg.slot(slot).header;
  const int32_t code = ReadOnce(h.status_code);
  const uint32_t len = ReadOnce(h.message_len);
  if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated))
    return absl::InvalidArgumentError(absl::StrCat("status_code: ", code, " is not a gRPC status code [0, 16]"));
  if (len > kMaxMessageLen)
    return absl::InvalidArgumentError(absl::StrCat("message_len: ", len, " exceeds ", kMaxMessageLen));
  out->request_id = ReadOnce(h.request_id);
  out->status = absl::Status(static_cast<absl::StatusCode>(code), std::string(h.message, len));
  return absl::OkStatus();
}

}  // namespace moe::shm
