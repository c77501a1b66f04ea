#include "model/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/bf16.h"
#include "model/quantization.h"
#include "core/status_macros.h"

namespace moe {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kQK = 256;                  // k-quant super-block
// Caps on what a header may claim before we allocate for it (real files: a
// few thousand tensors, ~50 keys, names < 100 bytes, arrays < 300k entries).
constexpr uint64_t kMaxTensors = 1u << 20, kMaxKeys = 1u << 16, kMaxStringBytes = 1u << 20, kMaxDims = 4;

struct TypeInfo {
  uint32_t id;
  const char* name;
  int block, bytes;
};
// ggml's types (gguf-py constants.py GGML_QUANT_SIZES).
constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},          {2, "Q4_0", 32, 18},       {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},       {8, "Q8_0", 32, 34},       {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},    {12, "Q4_K", 256, 144},    {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},    {16, "IQ2_XXS", 256, 66},  {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},    {20, "IQ4_NL", 32, 18},    {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136},  {24, "I8", 1, 1},          {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},         {28, "F64", 1, 8},         {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},    {35, "TQ2_0", 256, 66},    {39, "MXFP4", 32, 17},
    {40, "NVFP4", 64, 36},    {41, "Q1_0", 128, 18},     {42, "Q2_0", 64, 18},
};

const TypeInfo* FindType(uint32_t id) {
  for (const TypeInfo& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

// GGUF metadata value types.
enum : uint32_t { kU8, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64 };
int ScalarBytes(uint32_t t) {
  switch (t) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    default: return 0;
  }
}

// Bounds-checked little-endian reads from [p, end); every failure names what
// was being read.
class Cursor {
 public:
  Cursor(const std::byte* p, const std::byte* end) : begin_(p), p_(p), end_(end) {}
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  template <typename T>
  absl::StatusOr<T> Read(const std::string& what) {
    if (left() < sizeof(T)) return Truncated(what);
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> String(const std::string& what) {
    MOE_ASSIGN_OR_RETURN(const uint64_t n, Read<uint64_t>(what + " (length)"));
    if (n > kMaxStringBytes)
      return absl::InvalidArgumentError(absl::StrCat(what, ": string of ", n, " bytes (more than 1 MiB)"));
    if (left() < n) return Truncated(what);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  absl::Status Skip(uint64_t n, const std::string& what) {
    if (left() < n) return Truncated(what);
    p_ += n;
    return absl::OkStatus();
  }

 private:
  absl::Status Truncated(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the file ends at byte ", end_ - begin_,
                                                   " (truncated, or a length that runs past its end)"));
  }
  const std::byte* begin_;
  const std::byte* p_;
  const std::byte* end_;
};

// One value of metadata type `t` (arrays: their elements are skipped over, strings ones checked).
absl::StatusOr<GgufValue> ReadValue(Cursor& c, uint32_t t, const std::string& what, bool in_array = false) {
  switch (t) {
    case kU8: { MOE_ASSIGN_OR_RETURN(uint8_t v, c.Read<uint8_t>(what)); return GgufValue(uint64_t{v}); }
    case kU16: { MOE_ASSIGN_OR_RETURN(uint16_t v, c.Read<uint16_t>(what)); return GgufValue(uint64_t{v}); }
    case kU32: { MOE_ASSIGN_OR_RETURN(uint32_t v, c.Read<uint32_t>(what)); return GgufValue(uint64_t{v}); }
    case kU64: { MOE_ASSIGN_OR_RETURN(uint64_t v, c.Read<uint64_t>(what)); return GgufValue(v); }
    case kI8: { MOE_ASSIGN_OR_RETURN(int8_t v, c.Read<int8_t>(what)); return GgufValue(int64_t{v}); }
    case kI16: { MOE_ASSIGN_OR_RETURN(int16_t v, c.Read<int16_t>(what)); return GgufValue(int64_t{v}); }
    case kI32: { MOE_ASSIGN_OR_RETURN(int32_t v, c.Read<int32_t>(what)); return GgufValue(int64_t{v}); }
    case kI64: { MOE_ASSIGN_OR_RETURN(int64_t v, c.Read<int64_t>(what)); return GgufValue(v); }
    case kF32: { MOE_ASSIGN_OR_RETURN(float v, c.Read<float>(what)); return GgufValue(double{v}); }
    case kF64: { MOE_ASSIGN_OR_RETURN(double v, c.Read<double>(what)); return GgufValue(v); }
    case kBool: {
      MOE_ASSIGN_OR_RETURN(uint8_t v, c.Read<uint8_t>(what));
      if (v > 1) return absl::InvalidArgumentError(absl::StrCat(what, ": bool value ", int{v}));
      return GgufValue(v == 1);
    }
    case kString: { MOE_ASSIGN_OR_RETURN(std::string s, c.String(what)); return GgufValue(std::move(s)); }
    case kArray: {
      if (in_array) return absl::InvalidArgumentError(absl::StrCat(what, ": array of arrays"));
      MOE_ASSIGN_OR_RETURN(const uint32_t et, c.Read<uint32_t>(what + " (element type)"));
      MOE_ASSIGN_OR_RETURN(const uint64_t n, c.Read<uint64_t>(what + " (element count)"));
      if (et == kString) {  // each element has its own length
        if (n > c.left() / 8) return absl::InvalidArgumentError(absl::StrCat(what, ": ", n, " strings cannot fit in the file"));
        for (uint64_t i = 0; i < n; ++i) MOE_RETURN_IF_ERROR(c.String(what).status());
      } else {
        const int b = ScalarBytes(et);
        if (b == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": unknown array element type ", et));
        if (n > c.left() / static_cast<uint64_t>(b))
          return absl::InvalidArgumentError(absl::StrCat(what, ": array of ", n, " elements runs past the end of the file"));
        MOE_RETURN_IF_ERROR(c.Skip(n * static_cast<uint64_t>(b), what));
      }
      return GgufValue(GgufArray{et, n});
    }
    default: return absl::InvalidArgumentError(absl::StrCat(what, ": unknown value type ", t));
  }
}

inline float F16At(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}
inline void PutF16(std::byte* p, float f) {
  const uint16_t h = F32ToF16(f);
  std::memcpy(p, &h, 2);
}

// Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes.
inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace

const char* GgmlTypeName(uint32_t type) {
  const TypeInfo* t = FindType(type);
  return t == nullptr ? nullptr : t->name;
}

bool GgmlTypeDecoded(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16: case GgmlType::kQ8_0: case GgmlType::kQ4_K:
    case GgmlType::kQ6_K: case GgmlType::kMXFP4: return true;
  }
  return false;
}

std::pair<int, int> GgmlBlock(uint32_t type) {
  const TypeInfo* t = FindType(type);
  return t == nullptr ? std::pair{0, 0} : std::pair{t->block, t->bytes};
}

size_t GgmlRowBytes(uint32_t type, int64_t n) {
  const auto [block, bytes] = GgmlBlock(type);
  if (block == 0 || n < 0 || n % block != 0) return 0;
  return static_cast<size_t>(n / block) * static_cast<size_t>(bytes);
}

void DequantizeGgml(GgmlType type, const std::byte* src, int64_t n, float* dst) {
  switch (type) {
    case GgmlType::kF32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = F16At(src + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = Bf16ToF32(bf16_t{b});
      }
      return;
    case GgmlType::kQ8_0:  // d (f16), 32 x int8
      for (int64_t b = 0; b < n / 32; ++b, src += 34) {
        const float d = F16At(src);
        for (int i = 0; i < 32; ++i) dst[b * 32 + i] = d * static_cast<float>(static_cast<int8_t>(src[2 + i]));
      }
      return;
    case GgmlType::kQ4_K:  // d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
      for (int64_t b = 0; b < n / kQK; ++b, src += 144) {
        const float d = F16At(src), dmin = F16At(src + 2);
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(src + 4);
        const uint8_t* qs = scales + 12;
        float* y = dst + b * kQK;
        for (int j = 0; j < 8; ++j) {  // sub-block j: nibble (j % 2) of bytes [32 (j / 2), +32)
          int sc, m;
          ScaleMinK4(j, scales, &sc, &m);
          const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
          const uint8_t* q = qs + 32 * (j / 2);
          for (int i = 0; i < 32; ++i) y[32 * j + i] = d1 * static_cast<float>((q[i] >> (4 * (j % 2))) & 0xF) - m1;
        }
      }
      return;
    case GgmlType::kMXFP4:  // e (E8M0), 16 bytes: values i (low nibble) and i + 16 (high)
      for (int64_t b = 0; b < n / 32; ++b, src += 17) {
        // ggml's integer table of doubled values and halved scale (code 8 is +0 there, not -0)
        const float d = 0.5f * E8M0ToF32(static_cast<uint8_t>(src[0]));
        for (int i = 0; i < 16; ++i) {
          const uint8_t q = static_cast<uint8_t>(src[1 + i]);
          dst[b * 32 + i] = static_cast<float>(kE2M1Doubled[q & 0xF]) * d;
          dst[b * 32 + 16 + i] = static_cast<float>(kE2M1Doubled[q >> 4]) * d;
        }
      }
      return;
    case GgmlType::kQ6_K:  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d (f16)
      for (int64_t b = 0; b < n / kQK; ++b, src += 210) {
        const uint8_t* ql = reinterpret_cast<const uint8_t*>(src);
        const uint8_t* qh = ql + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(qh + 64);
        const float d = F16At(src + 208);
        float* y = dst + b * kQK;
        for (int idx = 0; idx < kQK; ++idx) {
          const int h = idx / 128, j = idx % 128;
          const int lo = (ql[h * 64 + j % 64] >> (4 * (j / 64))) & 0xF;
          const int hi = (qh[h * 32 + j % 32] >> (2 * (j / 32))) & 3;
          y[idx] = d * static_cast<float>(sc[idx / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
        }
      }
      return;
  }
}

namespace {

// ggml's quantize_row_q8_0_ref.
void QuantizeQ8_0(const float* src, int64_t n, std::byte* dst) {
  for (int64_t b = 0; b < n / 32; ++b, dst += 34) {
    const float* x = src + b * 32;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127, id = d != 0 ? 1 / d : 0;
    PutF16(dst, d);
    for (int i = 0; i < 32; ++i) dst[2 + i] = static_cast<std::byte>(static_cast<int8_t>(std::round(x[i] * id)));
  }
}

// Per sub-block of 32: step (max - min) / 15 and offset -min (the range
// holds 0), both coded in 6 bits against the super-block's d and dmin.
void QuantizeQ4K(const float* src, int64_t n, std::byte* dst) {
  for (int64_t b = 0; b < n / kQK; ++b, dst += 144) {
    const float* x = src + b * kQK;
    float scale[8], mn[8];  // per sub-block: step and (non-negative) offset
    for (int j = 0; j < 8; ++j) {
      float lo = 0, hi = 0;  // the range includes 0, as ggml's does
      for (int i = 0; i < 32; ++i) lo = std::min(lo, x[32 * j + i]), hi = std::max(hi, x[32 * j + i]);
      scale[j] = (hi - lo) / 15;
      mn[j] = -lo;
    }
    const float smax = *std::max_element(scale, scale + 8), mmax = *std::max_element(mn, mn + 8);
    const float d = F16ToF32(F32ToF16(smax / 63)), dmin = F16ToF32(F32ToF16(mmax / 63));
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = static_cast<uint8_t>(d > 0 ? std::clamp(static_cast<int>(std::lround(scale[j] / d)), 0, 63) : 0);
      m[j] = static_cast<uint8_t>(dmin > 0 ? std::clamp(static_cast<int>(std::lround(mn[j] / dmin)), 0, 63) : 0);
    }
    PutF16(dst, d);
    PutF16(dst + 2, dmin);
    uint8_t* s = reinterpret_cast<uint8_t*>(dst + 4);
    for (int j = 0; j < 4; ++j) {
      s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      s[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
      s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
    uint8_t* qs = s + 12;
    std::memset(qs, 0, 128);
    for (int j = 0; j < 8; ++j) {
      const float d1 = d * sc[j], m1 = dmin * m[j];
      for (int i = 0; i < 32; ++i) {
        const int q = d1 > 0 ? std::clamp(static_cast<int>(std::lround((x[32 * j + i] + m1) / d1)), 0, 15) : 0;
        qs[32 * (j / 2) + i] |= static_cast<uint8_t>(q << (4 * (j % 2)));
      }
    }
  }
}

// Per sub-block of 16: step max|x| / 31, coded in 8 bits against d.
void QuantizeQ6K(const float* src, int64_t n, std::byte* dst) {
  for (int64_t b = 0; b < n / kQK; ++b, dst += 210) {
    const float* x = src + b * kQK;
    float scale[16];
    for (int j = 0; j < 16; ++j) {
      float amax = 0;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * j + i]));
      scale[j] = amax / 31;
    }
    const float d = F16ToF32(F32ToF16(*std::max_element(scale, scale + 16) / 127));
    uint8_t* ql = reinterpret_cast<uint8_t*>(dst);
    uint8_t* qh = ql + 128;
    int8_t* sc = reinterpret_cast<int8_t*>(qh + 64);
    std::memset(ql, 0, 192);
    for (int j = 0; j < 16; ++j)
      sc[j] = static_cast<int8_t>(d > 0 ? std::clamp(static_cast<int>(std::lround(scale[j] / d)), 0, 127) : 0);
    PutF16(dst + 208, d);
    for (int idx = 0; idx < kQK; ++idx) {
      const float step = d * sc[idx / 16];
      const int q = (step > 0 ? std::clamp(static_cast<int>(std::lround(x[idx] / step)), -32, 31) : 0) + 32;
      const int h = idx / 128, j = idx % 128;
      ql[h * 64 + j % 64] |= static_cast<uint8_t>((q & 0xF) << (4 * (j / 64)));
      qh[h * 32 + j % 32] |= static_cast<uint8_t>((q >> 4) << (2 * (j / 32)));
    }
  }
}

// MXFP4 blocks of 32: the OCP scale of the block's largest magnitude, each
// value's nearest E2M1 code (model/quantization.h).
void QuantizeMxfp4Blocks(const float* src, int64_t n, std::byte* dst) {
  uint8_t codes[32];
  for (int64_t b = 0; b < n / 32; ++b, dst += 17) {
    dst[0] = std::byte{QuantizeMxfp4Block(src + b * 32, codes)};
    for (int i = 0; i < 16; ++i) dst[1 + i] = std::byte(static_cast<uint8_t>(codes[i] | codes[16 + i] << 4));
  }
}

}  // namespace

void QuantizeGgml(GgmlType type, const float* src, int64_t n, std::byte* dst) {
  switch (type) {
    case GgmlType::kF32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) PutF16(dst + 2 * i, src[i]);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const bf16_t b = F32ToBf16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    case GgmlType::kQ8_0: QuantizeQ8_0(src, n, dst); return;
    case GgmlType::kMXFP4: QuantizeMxfp4Blocks(src, n, dst); return;
    case GgmlType::kQ4_K: QuantizeQ4K(src, n, dst); return;
    case GgmlType::kQ6_K: QuantizeQ6K(src, n, dst); return;
  }
}

// ---------------------------------------------------------------- GgufFile

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  MOE_ASSIGN_OR_RETURN(f->file_, MappedFile::Open(path));
  if (absl::Status st = f->Parse(); !st.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", st.message()));
  return f;
}

// Long: the header, the metadata and the tensor table, each checked against the file.
absl::Status GgufFile::Parse() {
  const std::byte* base = file_->data();
  const size_t size = file_->size();
  Cursor c(base, base + size);
  MOE_ASSIGN_OR_RETURN(const uint32_t magic, c.Read<uint32_t>("GGUF magic"));
  if (magic != kMagic) return absl::InvalidArgumentError("not a GGUF file (bad magic)");
  MOE_ASSIGN_OR_RETURN(version_, c.Read<uint32_t>("GGUF version"));
  if (version_ != 2 && version_ != 3)
    return absl::InvalidArgumentError(absl::StrCat("GGUF version ", version_, " not supported (2, 3)"));
  MOE_ASSIGN_OR_RETURN(const uint64_t n_tensors, c.Read<uint64_t>("tensor count"));
  MOE_ASSIGN_OR_RETURN(const uint64_t n_kv, c.Read<uint64_t>("metadata key count"));
  if (n_tensors > kMaxTensors || n_tensors > size / 24)
    return absl::InvalidArgumentError(absl::StrCat("tensor count ", n_tensors, " is absurd for a file of ", size, " bytes"));
  if (n_kv > kMaxKeys || n_kv > size / 12)
    return absl::InvalidArgumentError(absl::StrCat("metadata key count ", n_kv, " is absurd for a file of ", size, " bytes"));
  for (uint64_t i = 0; i < n_kv; ++i) {
    MOE_ASSIGN_OR_RETURN(std::string key, c.String(absl::StrCat("metadata key ", i)));
    MOE_ASSIGN_OR_RETURN(const uint32_t t, c.Read<uint32_t>(absl::StrCat("metadata ", key, " (type)")));
    MOE_ASSIGN_OR_RETURN(GgufValue v, ReadValue(c, t, absl::StrCat("metadata ", key)));
    if (!kv_.emplace(key, std::move(v)).second) return absl::InvalidArgumentError(absl::StrCat("metadata ", key, ": key repeated"));
  }
  uint64_t alignment = kDefaultAlignment;
  if (Value("general.alignment") != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t a, Int("general.alignment"));
    if (a <= 0 || a > 65536 || (a & (a - 1)) != 0)
      return absl::InvalidArgumentError(absl::StrCat("metadata general.alignment: ", a, " is not a power of two <= 65536"));
    alignment = static_cast<uint64_t>(a);
  }
  std::vector<uint64_t> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    MOE_ASSIGN_OR_RETURN(t.name, c.String(absl::StrCat("tensor ", i, " name")));
    const std::string what = absl::StrCat("tensor ", t.name);
    MOE_ASSIGN_OR_RETURN(const uint32_t n_dims, c.Read<uint32_t>(what + " (dimension count)"));
    if (n_dims == 0 || n_dims > kMaxDims)
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", n_dims, " dimensions (1 to ", kMaxDims, ")"));
    uint64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      MOE_ASSIGN_OR_RETURN(const uint64_t v, c.Read<uint64_t>(what + " (dimension)"));
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || __builtin_mul_overflow(elems, v, &elems))
        return absl::InvalidArgumentError(absl::StrCat(what, ": its dimensions overflow"));
      t.dims.push_back(static_cast<int64_t>(v));
    }
    MOE_ASSIGN_OR_RETURN(t.type, c.Read<uint32_t>(what + " (type)"));
    MOE_ASSIGN_OR_RETURN(const uint64_t offset, c.Read<uint64_t>(what + " (offset)"));
    const TypeInfo* ti = FindType(t.type);
    if (ti == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": unknown ggml type id ", t.type));
    if (t.dims[0] % ti->block != 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": contiguous dimension ", t.dims[0], " is not a multiple of ",
                                                     ti->name, "'s block of ", ti->block));
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(elems / static_cast<uint64_t>(ti->block), static_cast<uint64_t>(ti->bytes), &nbytes))
      return absl::InvalidArgumentError(absl::StrCat(what, ": its size overflows"));
    if (offset % alignment != 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " is not a multiple of the alignment ", alignment));
    t.nbytes = static_cast<size_t>(nbytes);
    offsets.push_back(offset);
    if (!by_name_.emplace(t.name, tensors_.size()).second)
      return absl::InvalidArgumentError(absl::StrCat(what, ": name repeated"));
    tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.offset() + alignment - 1) / alignment * alignment;
  const uint64_t data_size = data_start <= size ? size - data_start : 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    GgufTensor& t = tensors_[i];
    if (offsets[i] > data_size || t.nbytes > data_size - offsets[i])
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": bytes [", offsets[i], ", ", offsets[i] + t.nbytes,
                                                     ") of the data section run past its end (", data_size,
                                                     " bytes; truncated file?)"));
    t.data = base + data_start + offsets[i];
  }
  std::vector<const GgufTensor*> order;
  for (const GgufTensor& t : tensors_)
    if (t.nbytes > 0) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const GgufTensor* a, const GgufTensor* b) { return a->data < b->data; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->data < order[i - 1]->data + order[i - 1]->nbytes)
      return absl::InvalidArgumentError(absl::StrCat("tensors ", order[i - 1]->name, " and ", order[i]->name, " overlap"));
  return absl::OkStatus();
}

const GgufTensor* GgufFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::Value(std::string_view key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

absl::StatusOr<int64_t> GgufFile::Int(std::string_view key) const {
  const GgufValue* v = Value(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("no metadata key ", std::string(key)));
  if (const uint64_t* u = std::get_if<uint64_t>(v)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return absl::InvalidArgumentError(absl::StrCat("metadata ", std::string(key), ": ", *u, " out of range"));
    return static_cast<int64_t>(*u);
  }
  if (const int64_t* i = std::get_if<int64_t>(v)) return *i;
  return absl::InvalidArgumentError(absl::StrCat("metadata ", std::string(key), ": not an integer"));
}

absl::StatusOr<std::string> GgufFile::String(std::string_view key) const {
  const GgufValue* v = Value(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("no metadata key ", std::string(key)));
  if (const std::string* s = std::get_if<std::string>(v)) return *s;
  return absl::InvalidArgumentError(absl::StrCat("metadata ", std::string(key), ": not a string"));
}

absl::StatusOr<double> GgufFile::Float(std::string_view key) const {
  const GgufValue* v = Value(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("no metadata key ", std::string(key)));
  if (const double* d = std::get_if<double>(v)) return *d;
  return absl::InvalidArgumentError(absl::StrCat("metadata ", std::string(key), ": not a float"));
}

absl::StatusOr<bool> GgufFile::Bool(std::string_view key) const {
  const GgufValue* v = Value(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("no metadata key ", std::string(key)));
  if (const bool* b = std::get_if<bool>(v)) return *b;
  return absl::InvalidArgumentError(absl::StrCat("metadata ", std::string(key), ": not a bool"));
}

// ---------------------------------------------------------------- WriteGguf

namespace {
class Bytes {
 public:
  template <typename T>
  void Put(T v) {
    const size_t n = s_.size();
    s_.resize(n + sizeof(T));
    std::memcpy(s_.data() + n, &v, sizeof(T));
  }
  void PutString(const std::string& v) {
    Put<uint64_t>(v.size());
    s_ += v;
  }
  std::string& str() { return s_; }

 private:
  std::string s_;
};
}  // namespace

absl::Status WriteGguf(const std::string& path, const std::vector<GgufKv>& kv,
                       const std::vector<GgufTensorSpec>& tensors,
                       const std::function<void(size_t, std::span<std::byte>)>& fill) {
  Bytes h;
  h.Put<uint32_t>(kMagic);
  h.Put<uint32_t>(3);
  h.Put<uint64_t>(tensors.size());
  h.Put<uint64_t>(kv.size());
  for (const auto& [key, value] : kv) {
    h.PutString(key);
    if (const uint32_t* u = std::get_if<uint32_t>(&value)) h.Put<uint32_t>(kU32), h.Put<uint32_t>(*u);
    else if (const int64_t* i = std::get_if<int64_t>(&value)) h.Put<uint32_t>(kI64), h.Put<int64_t>(*i);
    else if (const float* f = std::get_if<float>(&value)) h.Put<uint32_t>(kF32), h.Put<float>(*f);
    else if (const bool* b = std::get_if<bool>(&value)) h.Put<uint32_t>(kBool), h.Put<uint8_t>(*b ? 1 : 0);
    else h.Put<uint32_t>(kString), h.PutString(std::get<std::string>(value));
  }
  std::set<std::string> names;
  std::vector<size_t> nbytes;
  uint64_t offset = 0;
  for (const GgufTensorSpec& t : tensors) {
    if (!names.insert(t.name).second) return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name ", t.name));
    if (t.dims.empty() || t.dims.size() > kMaxDims)
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": 1 to 4 dimensions"));
    uint64_t rows = 1;
    for (size_t d = 1; d < t.dims.size(); ++d)
      if (t.dims[d] < 0 || __builtin_mul_overflow(rows, static_cast<uint64_t>(t.dims[d]), &rows))
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": bad dimensions"));
    const size_t row = GgmlRowBytes(static_cast<uint32_t>(t.type), t.dims[0]);
    if (row == 0 && t.dims[0] != 0)
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": ", t.dims[0], " columns are not a multiple of ",
                                                     GgmlTypeName(static_cast<uint32_t>(t.type)), "'s block of ",
                                                     GgmlBlock(static_cast<uint32_t>(t.type)).first));
    uint64_t n = 0;
    if (__builtin_mul_overflow(rows, static_cast<uint64_t>(row), &n))
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": its size overflows"));
    h.PutString(t.name);
    h.Put<uint32_t>(static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) h.Put<uint64_t>(static_cast<uint64_t>(d));
    h.Put<uint32_t>(static_cast<uint32_t>(t.type));
    h.Put<uint64_t>(offset);
    nbytes.push_back(static_cast<size_t>(n));
    offset += (n + kDefaultAlignment - 1) / kDefaultAlignment * kDefaultAlignment;
  }
  h.str().append((kDefaultAlignment - h.str().size() % kDefaultAlignment) % kDefaultAlignment, '\0');
  AtomicFile out(path);
  MOE_RETURN_IF_ERROR(out.Open());
  MOE_RETURN_IF_ERROR(out.Write(h.str().data(), h.str().size()));
  std::vector<std::byte> buf;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t padded = (nbytes[i] + kDefaultAlignment - 1) / kDefaultAlignment * kDefaultAlignment;
    buf.assign(padded, std::byte{0});
    fill(i, std::span<std::byte>(buf.data(), nbytes[i]));
    MOE_RETURN_IF_ERROR(out.Write(buf.data(), buf.size()));
  }
  MOE_RETURN_IF_ERROR(out.Commit());
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir);
}

bool LooksLikeGguf(const std::string& path) {
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".gguf") == 0) return true;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  uint32_t magic = 0;
  in.read(reinterpret_cast<char*>(&magic), 4);
  return in && magic == kMagic;
}

}  // namespace moe
