// The gRPC data path's messages (moe.v1 ForwardRequest and
// ForwardStreamResponse) written and read straight between tensor memory and
// grpc::ByteBuffer slices. The bytes are exactly protobuf's: a peer built on
// the generated classes reads and writes the same messages. What is saved is
// protobuf's intermediate std::string copies (and their page faults): a
// tensor is copied at most once when sent (into a pooled buffer gRPC takes
// as a slice; not at all when its memory can be lent to gRPC) and once when
// received (out of gRPC's slices into its destination).
// Malformed input is an error naming what is wrong, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "model/routing.h"
#include "core/tensor.h"
#include "transport/wire.h"
#include "grpcpp/support/byte_buffer.h"

namespace moe {

// Message buffers recycled across messages. A buffer given to gRPC as a slice
// comes back to the pool when gRPC releases the slice (on whatever thread),
// so a steady stream of large messages allocates and page-faults nothing.
// Slices keep the pool alive. Thread-safe.
class MessageBufferPool : public std::enable_shared_from_this<MessageBufferPool> {
 public:
  // Keeps at most `max_cached` free buffers.
  static std::shared_ptr<MessageBufferPool> Create(size_t max_cached = 8);

  // Owned memory of at least size() bytes, 64-byte aligned; back to the
  // pool when destroyed unless handed to gRPC with TakeSlice.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&&) noexcept = default;
    Buffer& operator=(Buffer&&) noexcept = default;
    ~Buffer();
    std::byte* data() const { return mem_.get(); }
    size_t size() const { return size_; }
    // The first `used` bytes as a slice; the buffer is empty afterwards.
    grpc::Slice TakeSlice(size_t used);

   private:
    friend class MessageBufferPool;
    struct Free { void operator()(std::byte* p) const; };
    std::shared_ptr<MessageBufferPool> pool_;
    std::unique_ptr<std::byte, Free> mem_;
    size_t capacity_ = 0, size_ = 0;
  };

  Buffer Get(size_t bytes);
  size_t cached();

 private:
  explicit MessageBufferPool(size_t max_cached) : max_cached_(max_cached) {}
  void Put(std::unique_ptr<std::byte, Buffer::Free> mem, size_t capacity);

  std::mutex mu_;
  size_t max_cached_;
  std::vector<std::pair<std::unique_ptr<std::byte, Buffer::Free>, size_t>> free_;
};

// A ForwardRequest: the same bytes as protobuf's serialization of
// EncodeForwardRequest's message. Without `tokens_owner`, one slice with the
// tokens copied in. With it, the tokens are not copied: their slice points
// at `tokens`, which must stay unchanged until gRPC releases it (after the
// write completes, possibly after the answer arrived); `tokens_owner` is
// held until then, so the memory outlives every use. `stripe`: this request
// is one stripe of a larger batch (ForwardRequest.stripe_group/count).
grpc::ByteBuffer EncodeForwardRequestBuffer(uint32_t layer, int n, int hidden, const bf16_t* tokens,
                                            const RoutingView& routing, uint64_t request_id,
                                            MessageBufferPool& pool, ExpertSlice slice = {},
                                            uint64_t model_identity = 0,
                                            std::shared_ptr<const void> tokens_owner = nullptr,
                                            StripeOf stripe = {});

// Storage a parsed request's tensors are copied into (8-byte aligned; reused
// from request to request).
struct ForwardRequestStorage {
  std::vector<uint64_t> tokens, expert_ids, expert_weights;
};

// Parses a ForwardRequest; the tensors' bytes are copied into `storage` and
// `out` points at them. INVALID_ARGUMENT naming the problem if the bytes are
// not a ForwardRequest (out->request_id is set if it was read before).
absl::Status ParseForwardRequest(grpc::ByteBuffer& message, ForwardRequestStorage& storage,
                                 WireForwardRequest* out);

// A ForwardStreamResponse for `request_id`: with `status` not OK, its code and
// message; else the response: `output` (n x hidden of out_dtype, written by
// the caller) and the stats. Protobuf's bytes, in up to three slices.
grpc::ByteBuffer EncodeForwardStreamResponse(uint64_t request_id, const absl::Status& status, DType out_dtype,
                                             int64_t n, int64_t hidden, MessageBufferPool::Buffer output,
                                             const moe::v1::ForwardStats& stats);

// What a ForwardStreamResponse says, its output tensor located but not copied.
struct StreamResponseInfo {
  uint64_t request_id = 0;
  int32_t status_code = 0;
  std::string status_message;
  int output_dtype = 0;             // proto DType value
  std::vector<int64_t> output_shape;
  int64_t data_offset = -1;          // of the output's bytes in the message; -1: none
  size_t data_bytes = 0;
};
// INTERNAL naming the problem if `message` is not a ForwardStreamResponse.
absl::Status ScanForwardStreamResponse(grpc::ByteBuffer& message, StreamResponseInfo* info);
// Copies the response's [n, hidden] output (BF16, or F32 converted) into out;
// INTERNAL if it is not that shape or dtype.
absl::Status CopyStreamResponseOutput(grpc::ByteBuffer& message, const StreamResponseInfo& info, int n, int hidden,
                                      bf16_t* out);

}  // namespace moe
