// grpc_wire: the raw-ByteBuffer encoding of the gRPC data path is byte for
// byte protobuf's (so clients and servers built on the generated classes
// interoperate), parses protobuf's bytes however gRPC slices them, refuses
// malformed bytes with an error (never a crash), and recycles its buffers.
#include "transport/grpc_wire.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "testing/random_data.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

// `bytes` as a ByteBuffer cut into slices of the given sizes (the rest in one).
grpc::ByteBuffer Sliced(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    if (at >= bytes.size()) break;
    const size_t len = std::min(c, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, len);
    at += len;
  }
  if (at < bytes.size()) slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Bytes(grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string s;
  for (const grpc::Slice& sl : slices) s.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return s;
}

struct Batch {
  int n, k, H;
  std::vector<bf16_t> tokens;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  RoutingView routing() const { return RoutingView{n, k, ids.data(), weights.data()}; }
};

Batch RandomBatch(int n, int k, int H, uint64_t seed) {
  Batch b{n, k, H, RandomActivations(size_t(n) * H, seed), {}, {}};
  RandomRouting(n, k, 64, seed + 1, 1.0, &b.ids, &b.weights);
  return b;
}

TEST(GrpcWire, RequestBytesAreProtobufsAndParseBack) {
  auto pool = MessageBufferPool::Create();
  for (auto [n, k, H, layer, id] : std::vector<std::tuple<int, int, int, uint32_t, uint64_t>>{
           {1, 1, 8, 0, 0}, {3, 4, 64, 5, 1}, {17, 8, 200, 47, uint64_t{1} << 40}, {256, 8, 512, 1, 77}}) {
    SCOPED_TRACE(testing::Message() << "n=" << n << " k=" << k << " H=" << H);
    const Batch b = RandomBatch(n, k, H, n * 31 + k);
    const uint64_t model = n == 1 ? 0 : 0xfedcba9876543210ull ^ static_cast<uint64_t>(n);  // fixed64; 0 left out
    // Every other case one stripe of a larger batch (fields 10 and 11; left out when not striped).
    const StripeOf stripe = n % 2 == 1 ? StripeOf{0x0123456789abcdefull ^ id, 3} : StripeOf{};
    moe::v1::ForwardRequest proto;
    EncodeForwardRequest(layer, n, H, b.tokens.data(), b.routing(), id, &proto, {}, model);
    if (stripe.striped()) {
      proto.set_stripe_group(stripe.group);
      proto.set_stripe_count(static_cast<uint32_t>(stripe.count));
    }
    grpc::ByteBuffer ours =
        EncodeForwardRequestBuffer(layer, n, H, b.tokens.data(), b.routing(), id, *pool, {}, model, nullptr, stripe);
    const std::string theirs = proto.SerializeAsString();
    EXPECT_EQ(Bytes(ours), theirs);
    {  // The tokens lent, not copied: the same bytes, the owner held until the message is gone.
      auto owner = std::make_shared<int>(0);
      grpc::ByteBuffer lent = EncodeForwardRequestBuffer(layer, n, H, b.tokens.data(), b.routing(), id, *pool, {},
                                                          model, owner, stripe);
      EXPECT_EQ(Bytes(lent), theirs);
      EXPECT_EQ(owner.use_count(), 2);
      lent.Clear();
      EXPECT_EQ(owner.use_count(), 1);
    }
    // Protobuf's bytes, cut into awkward slices, parse to the same tensors.
    for (std::vector<size_t> cuts : {std::vector<size_t>{}, {1, 1, 3, 7}, {13, 4096, 5}, {2, 2, 2, 2, 2, 2, 2, 2, 2}}) {
      grpc::ByteBuffer in = Sliced(theirs, cuts);
      ForwardRequestStorage storage;
      WireForwardRequest req;
      ASSERT_TRUE(ParseForwardRequest(in, storage, &req).ok());
      EXPECT_EQ(req.request_id, id);
      EXPECT_EQ(req.model_identity, model);
      EXPECT_EQ(req.stripe.group, stripe.group);
      EXPECT_EQ(req.stripe.count, stripe.count);
      EXPECT_EQ(req.layer, layer);
      EXPECT_EQ(req.tokens.dtype, moe::v1::DTYPE_BF16);
      EXPECT_EQ(req.tokens.shape, (std::vector<int64_t>{n, H}));
      ASSERT_EQ(req.tokens.bytes, b.tokens.size() * 2);
      EXPECT_EQ(std::memcmp(req.tokens.data, b.tokens.data(), req.tokens.bytes), 0);
      ASSERT_EQ(req.expert_ids.bytes, b.ids.size() * 4);
      EXPECT_EQ(std::memcmp(req.expert_ids.data, b.ids.data(), req.expert_ids.bytes), 0);
      ASSERT_EQ(req.expert_weights.bytes, b.weights.size() * 4);
      EXPECT_EQ(std::memcmp(req.expert_weights.data, b.weights.data(), req.expert_weights.bytes), 0);
      EXPECT_TRUE(DecodeTensor(req.tokens, "tokens", DType::kBF16, {n, H}).ok());
    }
  }
}

TEST(GrpcWire, UnknownFieldsAreSkippedAndOutputDtypeRead) {
  const Batch b = RandomBatch(2, 2, 16, 5);
  moe::v1::ForwardRequest proto;
  EncodeForwardRequest(3, 2, 16, b.tokens.data(), b.routing(), 9, &proto);
  proto.set_output_dtype(moe::v1::DTYPE_F32);
  // Fields this version does not know (a newer client): varint 20, bytes 21.
  std::string bytes = proto.SerializeAsString() + std::string("\xa0\x01\x07\xaa\x01\x03xyz", 9);
  grpc::ByteBuffer in = Sliced(bytes, {5});
  ForwardRequestStorage storage;
  WireForwardRequest req;
  ASSERT_TRUE(ParseForwardRequest(in, storage, &req).ok());
  EXPECT_EQ(req.output_dtype, moe::v1::DTYPE_F32);
  EXPECT_EQ(req.request_id, 9u);
  EXPECT_EQ(req.tokens.bytes, b.tokens.size() * 2);
}

TEST(GrpcWire, MalformedRequestsAreRefusedNotCrashed) {
  const Batch b = RandomBatch(4, 2, 32, 8);
  moe::v1::ForwardRequest proto;
  EncodeForwardRequest(1, 4, 32, b.tokens.data(), b.routing(), 12, &proto);
  const std::string good = proto.SerializeAsString();
  ForwardRequestStorage storage;
  WireForwardRequest req;
  // Every truncation of a valid message is an error (a message cut inside a
  // tensor) or parses to something DecodeTensor then refuses.
  for (size_t len = 1; len < good.size(); len += 7) {
    grpc::ByteBuffer in = Sliced(good.substr(0, len), {3});
    const absl::Status st = ParseForwardRequest(in, storage, &req);
    if (st.ok()) {
      EXPECT_FALSE(DecodeTensor(req.tokens, "tokens", DType::kBF16, {4, 32}).ok() &&
                   DecodeTensor(req.expert_ids, "expert_ids", DType::kI32, {4, 2}).ok() &&
                   DecodeTensor(req.expert_weights, "expert_weights", DType::kF32, {4, 2}).ok())
          << "a truncated message (" << len << " of " << good.size() << " bytes) decoded whole";
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("ForwardRequest"), std::string::npos) << st.message();
    }
  }
  // A length prefix far beyond the message, a zero tag, random bytes.
  for (const std::string& bad : {std::string("\x1a\xff\xff\xff\x0f", 5), std::string("\x00\x01", 2),
                                 std::string("\x1a\x05\x1a\xff\xff\xff\x7f", 7)}) {
    grpc::ByteBuffer in = Sliced(bad, {});
    EXPECT_EQ(ParseForwardRequest(in, storage, &req).code(), absl::StatusCode::kInvalidArgument);
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 300; ++i) {
    std::string junk(1 + rng() % 200, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    grpc::ByteBuffer in = Sliced(junk, {1 + rng() % 16});
    storage = ForwardRequestStorage();
    (void)ParseForwardRequest(in, storage, &req);  // any status; no crash, no huge allocation
    EXPECT_LE(storage.tokens.size() * 8, junk.size() + 8);
  }
}

TEST(GrpcWire, ResponseBytesAreProtobufsAndCopyOut) {
  auto pool = MessageBufferPool::Create();
  const int n = 5, H = 48;
  for (DType dt : {DType::kBF16, DType::kF32}) {
    std::vector<float> values(size_t(n) * H);
    std::mt19937 rng(11);
    std::normal_distribution<float> dist;
    for (float& v : values) v = dist(rng);
    std::vector<bf16_t> as_bf16(values.size());
    F32ToBf16(values.data(), as_bf16.data(), values.size());
    MessageBufferPool::Buffer out = pool->Get(values.size() * DTypeSize(dt));
    if (dt == DType::kF32) {
      std::memcpy(out.data(), values.data(), values.size() * 4);
    } else {
      std::memcpy(out.data(), as_bf16.data(), values.size() * 2);
    }
    moe::v1::ForwardStats stats;
    stats.set_distinct_experts(7);
    stats.set_pairs(12);
    stats.set_compute_ns(123456);
    grpc::ByteBuffer ours = EncodeForwardStreamResponse(42, absl::OkStatus(), dt, n, H, std::move(out), stats);
    moe::v1::ForwardStreamResponse proto;
    proto.set_request_id(42);
    moe::v1::ForwardResponse* r = proto.mutable_response();
    r->set_request_id(42);
    EncodeTensor(dt, {n, H}, dt == DType::kF32 ? static_cast<const void*>(values.data()) : as_bf16.data(),
                 r->mutable_output());
    *r->mutable_stats() = stats;
    const std::string theirs = proto.SerializeAsString();
    EXPECT_EQ(Bytes(ours), theirs);
    // Protobuf's bytes in odd slices: located, then copied out as bf16.
    grpc::ByteBuffer in = Sliced(theirs, {3, 5, 100, 1});
    StreamResponseInfo info;
    ASSERT_TRUE(ScanForwardStreamResponse(in, &info).ok());
    EXPECT_EQ(info.request_id, 42u);
    EXPECT_EQ(info.status_code, 0);
    std::vector<bf16_t> got(size_t(n) * H);
    ASSERT_TRUE(CopyStreamResponseOutput(in, info, n, H, got.data()).ok());
    EXPECT_EQ(std::memcmp(got.data(), as_bf16.data(), got.size() * 2), 0);
    // The wrong shape for the request is an error, not a partial copy.
    EXPECT_EQ(CopyStreamResponseOutput(in, info, n + 1, H, got.data()).code(), absl::StatusCode::kInternal);
  }
  // An error answer: code and message, no output.
  grpc::ByteBuffer err = EncodeForwardStreamResponse(8, absl::InvalidArgumentError("layer: 99 out of range"),
                                                     DType::kBF16, 0, H, MessageBufferPool::Buffer(), {});
  StreamResponseInfo info;
  ASSERT_TRUE(ScanForwardStreamResponse(err, &info).ok());
  EXPECT_EQ(info.request_id, 8u);
  EXPECT_EQ(info.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(info.status_message, "layer: 99 out of range");
  EXPECT_LT(info.data_offset, 0);
  grpc::ByteBuffer junk = Sliced(std::string("\x22\x40\x12", 3), {});
  EXPECT_EQ(ScanForwardStreamResponse(junk, &info).code(), absl::StatusCode::kInternal);
}

TEST(GrpcWire, BuffersComeBackWhenGrpcReleasesTheirSlices) {
  auto pool = MessageBufferPool::Create(4);
  const Batch b = RandomBatch(64, 8, 256, 2);
  {
    grpc::ByteBuffer m = EncodeForwardRequestBuffer(0, 64, 256, b.tokens.data(), b.routing(), 1, *pool);
    EXPECT_EQ(pool->cached(), 0u);  // still referenced by the message
    grpc::ByteBuffer copy = m;      // gRPC's own copies share the slice
    m.Clear();
    EXPECT_EQ(pool->cached(), 0u);
  }
  EXPECT_EQ(pool->cached(), 1u);
  // The next message of that size reuses it.
  grpc::ByteBuffer again = EncodeForwardRequestBuffer(0, 64, 256, b.tokens.data(), b.routing(), 2, *pool);
  EXPECT_EQ(pool->cached(), 0u);
  // An unused buffer goes back too; the pool keeps at most 4.
  std::vector<MessageBufferPool::Buffer> many;
  for (int i = 0; i < 6; ++i) many.push_back(pool->Get(1000 + i));
  many.clear();
  EXPECT_EQ(pool->cached(), 4u);
}

}  // namespace
}  // namespace moe
