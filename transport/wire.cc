#include "transport/wire.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {

moe::v1::DType ToProtoDType(DType t) {
  switch (t) {
    case DType::kBF16: return moe::v1::DTYPE_BF16;
    case DType::kF16: return moe::v1::DTYPE_F16;
    case DType::kF32: return moe::v1::DTYPE_F32;
    case DType::kI32: return moe::v1::DTYPE_I32;
    default: return moe::v1::DTYPE_UNSPECIFIED;
  }
}

absl::StatusOr<DType> FromProtoDType(moe::v1::DType t) {
  switch (t) {
    case moe::v1::DTYPE_BF16: return DType::kBF16;
    case moe::v1::DTYPE_F16: return DType::kF16;
    case moe::v1::DTYPE_F32: return DType::kF32;
    case moe::v1::DTYPE_I32: return DType::kI32;
    default: return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", static_cast<int>(t)));
  }
}

std::string ProtoDTypeName(moe::v1::DType t) {
  const std::string& name = moe::v1::DType_Name(t);
  return name.empty() ? absl::StrCat("unknown value ", static_cast<int>(t)) : name;
}

void EncodeTensor(DType dtype, const std::vector<int64_t>& shape, const void* data,
                  moe::v1::Tensor* out) {
  out->set_dtype(ToProtoDType(dtype));
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->set_data(static_cast<const char*>(data), NumElements(shape) * DTypeSize(dtype));
}

namespace {
WireTensor ViewOf(const moe::v1::Tensor& t) {
  WireTensor w;
  w.dtype = t.dtype();
  w.shape.assign(t.shape().begin(), t.shape().end());
  w.data = t.data().data();
  w.bytes = t.data().size();
  return w;
}
}  // namespace

WireForwardRequest ViewOf(const moe::v1::ForwardRequest& req) {
  WireForwardRequest w;
  w.request_id = req.request_id();
  w.layer = req.layer();
  w.tokens = ViewOf(req.tokens());
  w.expert_ids = ViewOf(req.expert_ids());
  w.expert_weights = ViewOf(req.expert_weights());
  w.output_dtype = req.output_dtype();
  if (req.slice_count() > 0)
    w.slice = ExpertSlice{static_cast<int>(std::min<uint32_t>(req.slice_index(), 1u << 20)),
                          static_cast<int>(std::min<uint32_t>(req.slice_count(), 1u << 20))};
  w.model_identity = req.model_identity();
  w.stripe = StripeOf{req.stripe_group(), static_cast<int>(std::min<uint32_t>(req.stripe_count(), 1u << 20))};
  return w;
}

absl::StatusOr<TensorView> DecodeTensor(const WireTensor& t, const std::string& field, DType want,
                                        const std::vector<int64_t>& want_shape) {
  const auto proto_dtype = static_cast<moe::v1::DType>(t.dtype);
  absl::StatusOr<DType> dt = FromProtoDType(proto_dtype);
  if (!dt.ok() || *dt != want)
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected ", DTypeName(want), ", got ",
                                                   ProtoDTypeName(proto_dtype)));
  if (t.shape.size() != want_shape.size())
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected rank ", want_shape.size(),
                                                   ", got rank ", t.shape.size()));
  TensorView v;
  v.dtype = want;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    const int64_t d = t.shape[i];
    if (d < 0 || d > (int64_t{1} << 31))
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", i, "]: bad size ", d));
    if (want_shape[i] >= 0 && d != want_shape[i])
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", i, "]: expected ", want_shape[i],
                                                     ", got ", d));
    v.shape.push_back(d);
  }
  if (v.nbytes() != t.bytes)
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", t.bytes, " bytes, shape ",
                                                   ShapeString(v.shape), " of ", DTypeName(want),
                                                   " needs ", v.nbytes()));
  v.data = t.data;
  return v;
}

absl::StatusOr<TensorView> DecodeTensor(const moe::v1::Tensor& t, const std::string& field, DType want,
                                        const std::vector<int64_t>& want_shape) {
  return DecodeTensor(ViewOf(t), field, want, want_shape);
}

void EncodeForwardRequest(uint32_t layer, int n, int hidden, const bf16_t* tokens, const RoutingView& routing,
                          uint64_t request_id, moe::v1::ForwardRequest* req, ExpertSlice slice,
                          uint64_t model_identity) {
  req->set_request_id(request_id);
  req->set_model_identity(model_identity);
  if (!slice.whole()) {
    req->set_slice_index(static_cast<uint32_t>(slice.index));
    req->set_slice_count(static_cast<uint32_t>(slice.count));
  }
  req->set_layer(layer);
  EncodeTensor(DType::kBF16, {n, hidden}, tokens, req->mutable_tokens());
  EncodeTensor(DType::kI32, {routing.n, routing.k}, routing.ids, req->mutable_expert_ids());
  EncodeTensor(DType::kF32, {routing.n, routing.k}, routing.weights, req->mutable_expert_weights());
}

absl::Status DecodeForwardOutput(const moe::v1::ForwardResponse& resp, int n, int hidden, bf16_t* out) {
  const bool f32 = resp.output().dtype() == moe::v1::DTYPE_F32;
  absl::StatusOr<TensorView> v =
      DecodeTensor(resp.output(), "output", f32 ? DType::kF32 : DType::kBF16, {n, hidden});
  if (!v.ok()) return absl::InternalError(absl::StrCat("malformed response: ", v.status().message()));
  if (!f32) {
    std::memcpy(out, v->data, v->nbytes());
  } else {
    std::vector<float> tmp(static_cast<size_t>(v->numel()));  // data may be unaligned for float
    std::memcpy(tmp.data(), v->data, v->nbytes());
    F32ToBf16(tmp.data(), out, tmp.size());
  }
  return absl::OkStatus();
}

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

void ModelSpecToProto(const ModelSpec& spec, moe::v1::ModelSpec* ms) {
  ms->set_model_type(spec.model_type);
  ms->set_num_layers(spec.num_layers);
  for (int l : spec.moe_layers) ms->add_moe_layers(l);
  ms->set_num_experts(spec.num_experts);
  ms->set_top_k(spec.top_k);
  ms->set_hidden_size(spec.hidden);
  ms->set_intermediate_size(spec.intermediate);
  ms->set_weight_dtype(ToProtoDType(spec.dtype));
  ms->set_expert_math(ExpertMathName(spec));
  ms->set_routing(RoutingModeName(spec.routing));
}

}  // namespace moe
