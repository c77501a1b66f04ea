// Reading and writing GGUF files (llama.cpp's model format, version 2 and 3):
// a header (magic "GGUF", version, tensor count, key/value count), the
// key/value metadata, the tensor table (name, dims with the contiguous one
// first, ggml type, offset) and the tensor data, each tensor at a multiple of
// general.alignment (32 by default) from the data section's start.
//
// A GgufFile is one file mapped read-only; Open validates all of it (every
// length, count, offset and size against the file's length; the tensors'
// types and alignment; no overlaps), so hostile or truncated input yields
// InvalidArgument naming the file and the key or tensor, never a crash. Its
// GgufTensors point straight into the mapping. WriteGguf streams a file to
// disk tensor by tensor. The ggml block codecs here (F32, F16, BF16, Q8_0,
// Q4_K, Q6_K, MXFP4) follow ggml's reference dequantize_row_* (gguf-py
// quants.py). An MXFP4 block is 17 bytes: the E8M0 exponent e, then 16 bytes
// whose low nibbles are values 0-15 and high nibbles values 16-31, each an
// E2M1 code; value = E2M1 * 2^(e - 127) (ggml: doubled E2M1 * 2^(e - 128)).
//
// Thread-safety: GgufFile is immutable after Open; the free functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/mapped_file.h"

namespace moe {

// ggml tensor types by their GGUF ids (the ones the expert path decodes).
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBF16 = 30, kMXFP4 = 39 };

// ggml's name of a type id ("Q4_K", "IQ2_XXS", ...); nullptr for an id ggml
// does not define.
const char* GgmlTypeName(uint32_t type);
// True for the types DequantizeGgml decodes.
bool GgmlTypeDecoded(uint32_t type);
// Elements per block and bytes per block of a type ggml defines (1 and the
// element size for the float ones); {0, 0} for an unknown id.
std::pair<int, int> GgmlBlock(uint32_t type);
// Bytes of a row of n elements (n a multiple of the block); 0 when it is not.
size_t GgmlRowBytes(uint32_t type, int64_t n);

// n values (a multiple of the type's block) of a decoded type at src, as f32.
void DequantizeGgml(GgmlType type, const std::byte* src, int64_t n, float* dst);
// The inverse, for writers: n values (a multiple of the block) into
// GgmlRowBytes(type, n) bytes. Q8_0 is ggml's reference quantizer (bit-exact);
// Q4_K and Q6_K a plain one (min/max of each sub-block, scales rounded to the
// 6/8-bit codes the format stores), not ggml's iterative search: valid
// blocks, somewhat coarser. MXFP4: the OCP scale and nearest E2M1 as
// model/quantization.h (gguf-py's too, but for exact ties, which it breaks
// toward the lower code, and an all-zero block's exponent).
void QuantizeGgml(GgmlType type, const float* src, int64_t n, std::byte* dst);

// One metadata value. Arrays keep their element type and count only (the
// expert path reads no array).
struct GgufArray {
  uint32_t type = 0;
  uint64_t count = 0;
};
using GgufValue = std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray>;

// One tensor of a mapped GGUF file. dims[0] is the contiguous dimension
// (ggml's ne[0]): a [rows, cols] row-major matrix has dims {cols, rows}.
struct GgufTensor {
  std::string name;
  uint32_t type = 0;
  std::vector<int64_t> dims;
  const std::byte* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
};

class GgufFile {
 public:
  // NotFound when the file does not exist; InvalidArgument (naming the file
  // and the key or tensor) when it is not a well-formed GGUF file.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& path() const { return file_->path(); }
  int fd() const { return file_->fd(); }
  int64_t OffsetOf(const std::byte* p) const { return file_->OffsetOf(p); }
  // All tensors, in table order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* Find(std::string_view name) const;  // nullptr if absent
  const GgufValue* Value(std::string_view key) const;    // nullptr if absent
  // Typed reads; NotFound naming the key when absent, InvalidArgument naming it
  // when it has another type (any integer type reads as an integer that fits).
  absl::StatusOr<int64_t> Int(std::string_view key) const;
  absl::StatusOr<std::string> String(std::string_view key) const;
  absl::StatusOr<double> Float(std::string_view key) const;
  absl::StatusOr<bool> Bool(std::string_view key) const;

 private:
  GgufFile() = default;
  absl::Status Parse();
  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// What WriteGguf writes: metadata (u32 for unsigned integers, i64 for signed
// ones, f32, bool, string) and the tensor table (`dims` contiguous first).
struct GgufTensorSpec {
  std::string name;
  GgmlType type;
  std::vector<int64_t> dims;
};
using GgufKv = std::pair<std::string, std::variant<uint32_t, int64_t, float, bool, std::string>>;

// Writes a GGUF v3 file at `path` (via "<path>.tmp", fsynced and renamed),
// alignment 32, without buffering it: fill(i, dst) produces the bytes of
// tensors[i] (zeroed beforehand). InvalidArgument for duplicate names, a
// contiguous dimension that is not a multiple of the type's block, or sizes
// that overflow; errno-derived errors for I/O failures.
absl::Status WriteGguf(const std::string& path, const std::vector<GgufKv>& kv,
                       const std::vector<GgufTensorSpec>& tensors,
                       const std::function<void(size_t, std::span<std::byte>)>& fill);

// True iff `path` names a GGUF file: it ends in ".gguf", or it is a regular
// file that starts with the GGUF magic.
bool LooksLikeGguf(const std::string& path);

}  // namespace moe
