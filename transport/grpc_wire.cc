#include "transport/grpc_wire.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace moe {

using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using WFL = google::protobuf::internal::WireFormatLite;

// ---- MessageBufferPool

void MessageBufferPool::Buffer::Free::operator()(std::byte* p) const { std::free(p); }

MessageBufferPool::Buffer::~Buffer() {
  if (mem_ && pool_) pool_->Put(std::move(mem_), capacity_);
}

grpc::Slice MessageBufferPool::Buffer::TakeSlice(size_t used) {
  struct Owner {
    std::shared_ptr<MessageBufferPool> pool;
    std::unique_ptr<std::byte, Free> mem;
    size_t capacity;
  };
  std::byte* p = mem_.get();
  auto* owner = new Owner{std::move(pool_), std::move(mem_), capacity_};
  capacity_ = size_ = 0;
  return grpc::Slice(
      p, std::min(used, owner->capacity),
      [](void* user) {
        auto* o = static_cast<Owner*>(user);
        if (o->pool) o->pool->Put(std::move(o->mem), o->capacity);
        delete o;
      },
      owner);
}

std::shared_ptr<MessageBufferPool> MessageBufferPool::Create(size_t max_cached) {
  return std::shared_ptr<MessageBufferPool>(new MessageBufferPool(max_cached));
}

MessageBufferPool::Buffer MessageBufferPool::Get(size_t bytes) {
  Buffer b;
  b.pool_ = shared_from_this();
  b.size_ = bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest cached buffer that fits.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= bytes && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      b.mem_ = std::move(best->first);
      b.capacity_ = best->second;
      free_.erase(best);
      return b;
    }
  }
  // Rounded up so that slightly different sizes reuse one buffer.
  b.capacity_ = std::max<size_t>(64, (bytes + 4095) / 4096 * 4096);
  b.mem_.reset(static_cast<std::byte*>(std::aligned_alloc(64, b.capacity_)));
  if (!b.mem_) throw std::bad_alloc();
  return b;
}

void MessageBufferPool::Put(std::unique_ptr<std::byte, Buffer::Free> mem, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < max_cached_) {
    free_.emplace_back(std::move(mem), capacity);
    return;
  }
  // Full: keep the larger buffers (they are the costly ones to fault in).
  auto smallest = std::min_element(free_.begin(), free_.end(),
                                   [](const auto& a, const auto& b) { return a.second < b.second; });
  if (smallest != free_.end() && smallest->second < capacity) *smallest = {std::move(mem), capacity};
}

size_t MessageBufferPool::cached() {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

// ---- encoding

namespace {

constexpr uint32_t Tag(int field, WFL::WireType type) { return WFL::MakeTag(field, type); }
size_t VarintSize(uint64_t v) { return CodedOutputStream::VarintSize64(v); }

// Writes through a raw pointer; with p == nullptr it only counts (sizes first,
// then the same calls write).
struct Writer {
  uint8_t* p = nullptr;
  size_t n = 0;
  void Varint(uint64_t v) {
    if (p != nullptr) p = CodedOutputStream::WriteVarint64ToArray(v, p);
    n += VarintSize(v);
  }
  void Raw(const void* data, size_t bytes) {
    if (p != nullptr && bytes > 0) {
      std::memcpy(p, data, bytes);
      p += bytes;
    }
    n += bytes;
  }
  // A varint field, left out when zero (proto3 does the same).
  void VarintField(int field, uint64_t v) {
    if (v == 0) return;
    Varint(Tag(field, WFL::WIRETYPE_VARINT));
    Varint(v);
  }
  // A fixed64 field, left out when zero.
  void Fixed64Field(int field, uint64_t v) {
    if (v == 0) return;
    Varint(Tag(field, WFL::WIRETYPE_FIXED64));
    if (p != nullptr) p = CodedOutputStream::WriteLittleEndian64ToArray(v, p);
    n += 8;
  }
  void LengthPrefix(int field, size_t len) {
    Varint(Tag(field, WFL::WIRETYPE_LENGTH_DELIMITED));
    Varint(len);
  }
};

// Bytes of a Tensor message's fields before its data: dtype and packed shape.
void TensorHead(Writer& w, int dtype, absl::Span<const int64_t> shape, size_t data_bytes) {
  w.VarintField(1, static_cast<uint64_t>(dtype));
  if (!shape.empty()) {
    size_t packed = 0;
    for (int64_t d : shape) packed += VarintSize(static_cast<uint64_t>(d));
    w.LengthPrefix(2, packed);
    for (int64_t d : shape) w.Varint(static_cast<uint64_t>(d));
  }
  if (data_bytes > 0) w.LengthPrefix(3, data_bytes);
}

size_t TensorSize(int dtype, absl::Span<const int64_t> shape, size_t data_bytes) {
  Writer count;
  TensorHead(count, dtype, shape, data_bytes);
  return count.n + data_bytes;
}

// A whole Tensor field (tag, length, message).
void TensorField(Writer& w, int field, DType dtype, int64_t rows, int64_t cols, const void* data) {
  const int pd = ToProtoDType(dtype);
  const int64_t shape[2] = {rows, cols};
  const size_t bytes = static_cast<size_t>(rows * cols) * DTypeSize(dtype);
  w.LengthPrefix(field, TensorSize(pd, shape, bytes));
  TensorHead(w, pd, shape, bytes);
  w.Raw(data, bytes);
}

// A ForwardRequest's fields in order, in two parts around the tokens'
// bytes: Head (request id, layer, the tokens tensor up to its data) and Tail
// (routing, slice, model identity).
void ForwardRequestHead(Writer& w, uint32_t layer, int n, int hidden, uint64_t id) {
  w.VarintField(1, id);
  w.VarintField(2, layer);
  const int pd = ToProtoDType(DType::kBF16);
  const int64_t shape[2] = {n, hidden};
  const size_t bytes = size_t(n) * size_t(hidden) * sizeof(bf16_t);
  w.LengthPrefix(3, TensorSize(pd, shape, bytes));
  TensorHead(w, pd, shape, bytes);
}

void ForwardRequestTail(Writer& w, const RoutingView& r, ExpertSlice slice, uint64_t model_identity, StripeOf stripe) {
  TensorField(w, 4, DType::kI32, r.n, r.k, r.ids);
  TensorField(w, 5, DType::kF32, r.n, r.k, r.weights);
  if (!slice.whole()) {
    if (slice.index != 0) w.VarintField(7, static_cast<uint64_t>(slice.index));
    w.VarintField(8, static_cast<uint64_t>(slice.count));
  }
  w.Fixed64Field(9, model_identity);
  if (stripe.striped()) {
    w.Fixed64Field(10, stripe.group);
    w.VarintField(11, static_cast<uint64_t>(stripe.count));
  }
}

}  // namespace

grpc::ByteBuffer EncodeForwardRequestBuffer(uint32_t layer, int n, int hidden, const bf16_t* tokens,
                                            const RoutingView& routing, uint64_t request_id,
                                            MessageBufferPool& pool, ExpertSlice share, uint64_t model_identity,
                                            std::shared_ptr<const void> tokens_owner, StripeOf stripe) {
  const size_t token_bytes = size_t(n) * size_t(hidden) * sizeof(bf16_t);
  Writer head_size, tail_size;
  ForwardRequestHead(head_size, layer, n, hidden, request_id);
  ForwardRequestTail(tail_size, routing, share, model_identity, stripe);
  if (tokens_owner == nullptr || token_bytes == 0) {  // one slice, the tokens copied into it
    MessageBufferPool::Buffer buf = pool.Get(head_size.n + token_bytes + tail_size.n);
    Writer w{reinterpret_cast<uint8_t*>(buf.data())};
    ForwardRequestHead(w, layer, n, hidden, request_id);
    w.Raw(tokens, token_bytes);
    ForwardRequestTail(w, routing, share, model_identity, stripe);
    grpc::Slice slice = buf.TakeSlice(w.n);
    return grpc::ByteBuffer(&slice, 1);
  }
  // Three slices: the head and tail in pooled buffers, the tokens where
  // they are, their owner held until gRPC releases the slice.
  MessageBufferPool::Buffer head = pool.Get(head_size.n), tail = pool.Get(tail_size.n);
  Writer hw{reinterpret_cast<uint8_t*>(head.data())}, tw{reinterpret_cast<uint8_t*>(tail.data())};
  ForwardRequestHead(hw, layer, n, hidden, request_id);
  ForwardRequestTail(tw, routing, share, model_identity, stripe);
  auto* owner = new std::shared_ptr<const void>(std::move(tokens_owner));
  grpc::Slice slices[3] = {
      head.TakeSlice(hw.n),
      grpc::Slice(const_cast<bf16_t*>(tokens), token_bytes,
                  [](void* o) { delete static_cast<std::shared_ptr<const void>*>(o); }, owner),
      tail.TakeSlice(tw.n)};
  return grpc::ByteBuffer(slices, 3);
}

grpc::ByteBuffer EncodeForwardStreamResponse(uint64_t request_id, const absl::Status& status, DType out_dtype,
                                             int64_t n, int64_t hidden, MessageBufferPool::Buffer output,
                                             const moe::v1::ForwardStats& stats) {
  if (!status.ok()) {
    moe::v1::ForwardStreamResponse r;  // small: protobuf's own serializer
    r.set_request_id(request_id);
    r.set_status_code(static_cast<int32_t>(status.code()));
    r.set_status_message(std::string(status.message()));
    grpc::Slice s(r.SerializeAsString());
    return grpc::ByteBuffer(&s, 1);
  }
  const int64_t shape[2] = {n, hidden};
  const int pd = ToProtoDType(out_dtype);
  const size_t data_bytes = static_cast<size_t>(n * hidden) * DTypeSize(out_dtype);
  const std::string stats_bytes = stats.SerializeAsString();
  const size_t tensor = TensorSize(pd, shape, data_bytes);
  // ForwardResponse: request_id, output (tensor), stats (always present, as
  // the service sets it).
  Writer fr;
  fr.VarintField(1, request_id);
  fr.LengthPrefix(2, tensor);
  const size_t response = fr.n + tensor + 1 + VarintSize(stats_bytes.size()) + stats_bytes.size();
  // Head: envelope fields, ForwardResponse prefix, its request_id, output
  // prefix and tensor head; then the data; then the stats field.
  uint8_t head[128];
  Writer w{head};
  w.VarintField(1, request_id);
  w.LengthPrefix(4, response);
  w.VarintField(1, request_id);
  w.LengthPrefix(2, tensor);
  TensorHead(w, pd, shape, data_bytes);
  std::string tail;
  tail.push_back(static_cast<char>(Tag(3, WFL::WIRETYPE_LENGTH_DELIMITED)));
  uint8_t len[10];
  tail.append(reinterpret_cast<char*>(len), CodedOutputStream::WriteVarint64ToArray(stats_bytes.size(), len) - len);
  tail += stats_bytes;
  grpc::Slice slices[3] = {grpc::Slice(head, w.n), output.TakeSlice(data_bytes), grpc::Slice(tail)};
  return grpc::ByteBuffer(slices, 3);
}

// ---- parsing

namespace {

// Reads one Tensor message (the stream limited to it). The data goes into
// `storage` when given, else only its offset in the message is noted.
bool ReadTensor(CodedInputStream& in, WireTensor* t, std::vector<uint64_t>* storage, int64_t* data_offset) {
  t->shape.clear();
  while (uint32_t tag = in.ReadTag()) {
    const int field = WFL::GetTagFieldNumber(tag);
    const auto type = WFL::GetTagWireType(tag);
    uint64_t v = 0;
    if (field == 1 && type == WFL::WIRETYPE_VARINT) {
      if (!in.ReadVarint64(&v)) return false;
      t->dtype = static_cast<int>(v);
    } else if (field == 2 && type == WFL::WIRETYPE_LENGTH_DELIMITED) {  // packed
      uint32_t len = 0;
      if (!in.ReadVarint32(&len)) return false;
      const auto limit = in.PushLimit(static_cast<int>(len));
      while (in.BytesUntilLimit() > 0) {
        if (!in.ReadVarint64(&v) || t->shape.size() >= 8) return false;
        t->shape.push_back(static_cast<int64_t>(v));
      }
      in.PopLimit(limit);
    } else if (field == 2 && type == WFL::WIRETYPE_VARINT) {  // unpacked
      if (!in.ReadVarint64(&v) || t->shape.size() >= 8) return false;
      t->shape.push_back(static_cast<int64_t>(v));
    } else if (field == 3 && type == WFL::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t len = 0;
      if (!in.ReadVarint32(&len) || static_cast<int64_t>(len) > in.BytesUntilLimit()) return false;
      t->bytes = len;
      if (storage != nullptr) {
        storage->resize((len + 7) / 8);
        if (!in.ReadRaw(storage->data(), static_cast<int>(len))) return false;
        t->data = storage->data();
      } else {
        *data_offset = in.CurrentPosition();
        if (!in.Skip(static_cast<int>(len))) return false;
      }
    } else if (!WFL::SkipField(&in, tag)) {
      return false;
    }
  }
  return in.ConsumedEntireMessage();
}

// Runs `body` on the length-delimited sub-message that follows.
template <typename Body>
bool SubMessage(CodedInputStream& in, Body body) {
  uint32_t len = 0;
  if (!in.ReadVarint32(&len) || static_cast<int64_t>(len) > in.BytesUntilLimit()) return false;
  const auto limit = in.PushLimit(static_cast<int>(len));
  const bool ok = body() && in.BytesUntilLimit() == 0;
  in.PopLimit(limit);
  return ok;
}

// The whole message as the outermost limit, so that a length field can be
// checked against the bytes that are really there.
void LimitToMessage(CodedInputStream& in, const grpc::ByteBuffer& message) {
  in.SetTotalBytesLimit(INT32_MAX);
  in.PushLimit(static_cast<int>(std::min<size_t>(message.Length(), INT32_MAX)));
}

}  // namespace

absl::Status ParseForwardRequest(grpc::ByteBuffer& message, ForwardRequestStorage& storage,
                                 WireForwardRequest* out) {
  *out = WireForwardRequest();
  grpc::ProtoBufferReader reader(&message);
  CodedInputStream in(&reader);
  LimitToMessage(in, message);
  const char* bad = nullptr;
  while (uint32_t tag = in.ReadTag()) {
    const int field = WFL::GetTagFieldNumber(tag);
    const auto type = WFL::GetTagWireType(tag);
    uint64_t v = 0;
    if (type == WFL::WIRETYPE_VARINT && (field == 1 || field == 2 || field == 6 || field == 7 || field == 8 || field == 11)) {
      if (!in.ReadVarint64(&v)) { bad = "a truncated varint"; break; }
      if (field == 1) out->request_id = v;
      if (field == 2) out->layer = static_cast<uint32_t>(v);
      if (field == 6) out->output_dtype = static_cast<int>(v);
      if (field == 7) out->slice.index = static_cast<int>(std::min<uint64_t>(v, 1u << 20));
      if (field == 8 && v > 0) out->slice.count = static_cast<int>(std::min<uint64_t>(v, 1u << 20));
      if (field == 11) out->stripe.count = static_cast<int>(std::min<uint64_t>(v, 1u << 20));
    } else if (type == WFL::WIRETYPE_FIXED64 && (field == 9 || field == 10)) {
      if (!in.ReadLittleEndian64(&v)) { bad = "a truncated fixed64"; break; }
      (field == 9 ? out->model_identity : out->stripe.group) = v;
    } else if (type == WFL::WIRETYPE_LENGTH_DELIMITED && field >= 3 && field <= 5) {
      WireTensor* t = field == 3 ? &out->tokens : field == 4 ? &out->expert_ids : &out->expert_weights;
      std::vector<uint64_t>* s = field == 3 ? &storage.tokens : field == 4 ? &storage.expert_ids : &storage.expert_weights;
      if (!SubMessage(in, [&] { return ReadTensor(in, t, s, nullptr); })) {
        bad = field == 3 ? "a malformed tokens tensor" : field == 4 ? "a malformed expert_ids tensor"
                                                                     : "a malformed expert_weights tensor";
        break;
      }
    } else if (!WFL::SkipField(&in, tag)) {
      bad = "a malformed field";
      break;
    }
  }
  if (bad == nullptr && !in.ConsumedEntireMessage()) bad = "a malformed tag";
  if (bad != nullptr) return absl::InvalidArgumentError(absl::StrCat("request: not a ForwardRequest (", bad, ")"));
  return absl::OkStatus();
}

absl::Status ScanForwardStreamResponse(grpc::ByteBuffer& message, StreamResponseInfo* info) {
  *info = StreamResponseInfo();
  grpc::ProtoBufferReader reader(&message);
  CodedInputStream in(&reader);
  LimitToMessage(in, message);
  bool ok = true;
  while (ok) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    const int field = WFL::GetTagFieldNumber(tag);
    const auto type = WFL::GetTagWireType(tag);
    uint64_t v = 0;
    if (field == 1 && type == WFL::WIRETYPE_VARINT) {
      ok = in.ReadVarint64(&v);
      info->request_id = v;
    } else if (field == 2 && type == WFL::WIRETYPE_VARINT) {
      ok = in.ReadVarint64(&v);
      info->status_code = static_cast<int32_t>(v);
    } else if (field == 3 && type == WFL::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t len = 0;
      ok = in.ReadVarint32(&len) && len <= 1u << 20 && in.ReadString(&info->status_message, static_cast<int>(len));
    } else if (field == 4 && type == WFL::WIRETYPE_LENGTH_DELIMITED) {
      ok = SubMessage(in, [&] {
        while (uint32_t t = in.ReadTag()) {
          if (WFL::GetTagFieldNumber(t) == 2 && WFL::GetTagWireType(t) == WFL::WIRETYPE_LENGTH_DELIMITED) {
            WireTensor out;
            if (!SubMessage(in, [&] { return ReadTensor(in, &out, nullptr, &info->data_offset); })) return false;
            info->output_dtype = out.dtype;
            info->output_shape = out.shape;
            info->data_bytes = out.bytes;
          } else if (!WFL::SkipField(&in, t)) {
            return false;
          }
        }
        return in.ConsumedEntireMessage();
      });
    } else {
      ok = WFL::SkipField(&in, tag);
    }
  }
  if (!ok || !in.ConsumedEntireMessage())
    return absl::InternalError("malformed response: not a ForwardStreamResponse");
  return absl::OkStatus();
}

absl::Status CopyStreamResponseOutput(grpc::ByteBuffer& message, const StreamResponseInfo& info, int n, int hidden,
                                      bf16_t* out) {
  const bool f32 = info.output_dtype == moe::v1::DTYPE_F32;
  WireTensor t;
  t.dtype = info.output_dtype;
  t.shape = info.output_shape;
  t.bytes = info.data_bytes;
  absl::StatusOr<TensorView> v = DecodeTensor(t, "output", f32 ? DType::kF32 : DType::kBF16, {n, hidden});
  if (!v.ok()) return absl::InternalError(absl::StrCat("malformed response: ", v.status().message()));
  if (info.data_bytes == 0) return absl::OkStatus();
  grpc::ProtoBufferReader reader(&message);
  CodedInputStream in(&reader);
  LimitToMessage(in, message);
  std::vector<float> tmp;
  void* dst = out;
  if (f32) {
    tmp.resize(static_cast<size_t>(n) * hidden);
    dst = tmp.data();
  }
  if (info.data_offset < 0 || !in.Skip(static_cast<int>(info.data_offset)) ||
      !in.ReadRaw(dst, static_cast<int>(info.data_bytes)))
    return absl::InternalError("malformed response: output data truncated");
  if (f32) F32ToBf16(tmp.data(), out, tmp.size());
  return absl::OkStatus();
}

}  // namespace moe
