#include "tests/shm_fuzz_one.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "transport/shm_segment.h"

namespace moe::shm {

int ShmFuzzOne(const uint8_t* data, size_t size) {
  constexpr uint32_t H = 8, T = 4, K = 2, S = 4;
  constexpr int kExperts = 8, kLayers = 2;
  const SegmentGeometry g = Geometry(H, T, K, S);
  std::vector<uint64_t> storage(g.total_bytes / 8 + 16);
  auto* buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  absl::StatusOr<Segment> server = Segment::Create(buf, g.total_bytes, H, T, K, S);
  if (!server.ok()) __builtin_trap();
  const RequestSlot s0 = server->slot(0);
  WriteRequestHeader(s0, 7, 1, T, K);
  for (uint32_t i = 0; i < T * K; ++i) {
    s0.ids[i] = static_cast<int32_t>(i % kExperts);
    s0.weights[i] = 0.5f;
  }
  server->TryPushSubmit(0);
  server->TryPushComplete(0);

  // data: [mapped-size trim byte] then 3-byte patches (region, offset, value).
  size_t mapped = g.total_bytes;
  if (size > 0 && (data[0] & 0x80)) mapped -= std::min<size_t>(mapped, (data[0] & 0x7fu) * 64u);
  for (size_t i = 1; i + 3 <= size; i += 3) {
    const uint8_t region = data[i] % 4, off = data[i + 1], value = data[i + 2];
    const uint32_t r = off >> 2;
    size_t at;
    switch (region) {
      case 0: at = off % 128; break;  // header fields
      case 1: at = g.slots_offset + (off % S) * g.slot_stride + (off >> 2) % 32; break;  // slot headers
      case 2:  // head bytes [0,8), tail bytes [64,72), entry bytes [128,144) of either ring
        at = g.submit_ring_offset + (off & 3) * g.ring_bytes + (r % 32 < 8 ? 0 : r % 32 < 16 ? 56 : 112) + r % 32;
        break;
      default: at = g.slots_offset + g.ids_offset + off % 96; break;  // slot 0 ids / weights
    }
    buf[at] = value;
  }

  ValidatedRequest req;
  ValidatedResponse resp;
  // A patched header may still describe another consistent geometry that fits.
  if (absl::StatusOr<Segment> client = Segment::Attach(buf, mapped, H); client.ok()) {
    const SegmentGeometry& c = client->geometry();
    if (c.hidden != H || c.total_bytes > mapped ||
        !ValidateGeometryArgs(c.hidden, c.max_tokens, c.max_pairs, c.num_slots).ok())
      __builtin_trap();
    for (uint32_t i = 0; i < c.num_slots; ++i) {
      (void)ValidateResponseSlot(*client, i, &resp);
      (void)ValidateRequestSlot(*client, i, kExperts, kLayers, &req);
    }
  }
  for (int i = 0; i < 2 * static_cast<int>(S); ++i) {
    for (std::optional<uint32_t> idx : {server->TryPopSubmit(), server->TryPopComplete(), server->TryPopDeviceSubmit()}) {
      if (!idx) continue;
      if (server->ValidateSlotIndex(*idx).ok() != (*idx < S)) __builtin_trap();
      if (ValidateRequestSlot(*server, *idx, kExperts, kLayers, &req).ok()) {
        if (req.n_tokens < 1 || req.n_tokens > int{T} || req.k < 1 || req.k > int{K} || req.layer >= uint32_t{kLayers})
          __builtin_trap();
        for (int32_t e : req.ids)
          if (e < -1 || e >= kExperts) __builtin_trap();
      }
      (void)ValidateResponseSlot(*server, *idx, &resp);
    }
  }
  return 0;
}

}  // namespace moe::shm
