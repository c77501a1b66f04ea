#include "core/tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF64: case DType::kI64: return 8;
    case DType::kU8: case DType::kF8E4M3: return 1;
  }
  return 0;
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kI32: return "I32";
    case DType::kF64: return "F64";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kF64,
                  DType::kI64, DType::kU8, DType::kF8E4M3}) {
    if (name == DTypeName(t)) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", std::string(name), "'"));
}

int64_t NumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace moe
