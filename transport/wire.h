// Glue between the wire contract (proto/moe/v1) and in-memory views: tensor
// encoding/decoding with validation that names the field, and the 1:1 mapping
// of absl::Status to grpc::Status used at every service edge. Thread-safe.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/model_spec.h"
#include "model/moe_batch.h"
#include "model/routing.h"
#include "core/tensor.h"
#include "grpcpp/support/status.h"
#include "moe/v1/expert.pb.h"

namespace moe {

moe::v1::DType ToProtoDType(DType t);
absl::StatusOr<DType> FromProtoDType(moe::v1::DType t);
// The proto's name of a dtype value, or "unknown value N" for one the proto
// does not define (protobuf's own name is then empty).
std::string ProtoDTypeName(moe::v1::DType t);

// A tensor as a message carries it (protobuf's or one parsed straight from
// the wire): proto dtype value, shape, bytes (not owned).
struct WireTensor {
  int dtype = 0;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};
// A ForwardRequest's fields, its tensors not owned.
struct WireForwardRequest {
  uint64_t request_id = 0;
  uint32_t layer = 0;
  WireTensor tokens, expert_ids, expert_weights;
  int output_dtype = 0;
  ExpertSlice slice;  // slice_count 0 on the wire: whole
  uint64_t model_identity = 0;  // the client's model (0: not checked)
  StripeOf stripe;              // one stripe of a client's batch (group 0: not striped)
};
WireForwardRequest ViewOf(const moe::v1::ForwardRequest& req);

// Fills `out` with dtype, shape and a copy of the bytes.
void EncodeTensor(DType dtype, const std::vector<int64_t>& shape, const void* data,
                  moe::v1::Tensor* out);

// Checks `t` against the expected dtype and shape (-1 = any size in that
// dimension) and that its byte size matches; returns a view of its bytes.
// InvalidArgument naming `field` otherwise.
absl::StatusOr<TensorView> DecodeTensor(const WireTensor& t, const std::string& field, DType want,
                                        const std::vector<int64_t>& want_shape);
absl::StatusOr<TensorView> DecodeTensor(const moe::v1::Tensor& t, const std::string& field, DType want,
                                        const std::vector<int64_t>& want_shape);

// Fills `req` with one layer's batch: tokens [n, hidden] bf16 and the routing [n, k].
// `slice`: the share of each expert the server is expected to hold;
// `model_identity`: the model the client computes with (0: none checked).
void EncodeForwardRequest(uint32_t layer, int n, int hidden, const bf16_t* tokens, const RoutingView& routing,
                          uint64_t request_id, moe::v1::ForwardRequest* req, ExpertSlice slice = {},
                          uint64_t model_identity = 0);
// Copies a response's [n, hidden] output (BF16, or F32 converted to bf16) into
// out; Internal error naming the problem if the response does not match.
absl::Status DecodeForwardOutput(const moe::v1::ForwardResponse& resp, int n, int hidden, bf16_t* out);

// The model geometry as the wire carries it (ServerInfo, WorkerInfo).
void ModelSpecToProto(const ModelSpec& spec, moe::v1::ModelSpec* out);

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace moe
