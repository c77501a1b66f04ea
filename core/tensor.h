// Element types and non-owning tensor views shared by every component.
//
// A TensorView is a pointer plus dtype and shape over row-major memory it does
// not own; it is a cheap value and safe to copy between threads (the memory's
// lifetime is the caller's business).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

enum class DType : uint8_t { kBF16, kF16, kF32, kI32, kF64, kI64, kU8, kF8E4M3 };

// Bytes per element.
size_t DTypeSize(DType t);
// Safetensors spelling: "BF16", "F16", "F32", "I32", "F64", "I64", "U8".
const char* DTypeName(DType t);
// Parses the safetensors spelling; InvalidArgument for anything else.
absl::StatusOr<DType> ParseDType(std::string_view name);

// Number of elements of a shape (1 for a scalar shape {}).
int64_t NumElements(std::span<const int64_t> shape);
std::string ShapeString(std::span<const int64_t> shape);

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const { return NumElements(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
};

}  // namespace moe
