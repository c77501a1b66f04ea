#include "expert_compute/expert_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "model/model_source.h"
#include "model/quantization.h"
#include "expert_compute/packed_layout.h"

namespace moe {

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBf16: return "bf16";
    case WeightFormat::kInt8: return "int8";
    case WeightFormat::kInt4: return "int4";
    case WeightFormat::kFp8: return "fp8";
    case WeightFormat::kMxfp4: return "mxfp4";
  }
  return "?";
}

namespace {
int RoundUp(int v, int m) { return (v + m - 1) / m * m; }
}  // namespace

ExpertGeometry ExpertGeometry::For(int hidden, int intermediate) {
  return For(hidden, intermediate, WeightFormat::kBf16);
}

ExpertGeometry ExpertGeometry::For(int hidden, int intermediate, WeightFormat format, int group) {
  ExpertGeometry g;
  g.H = hidden;
  g.I = intermediate;
  g.format = format;
  int k_align = 32;
  if (format == WeightFormat::kInt8) k_align = 64;
  if (format == WeightFormat::kInt4 || format == WeightFormat::kFp8) {
    g.group = group > 0 ? group : format == WeightFormat::kInt4 ? kDefaultInt4Group : kDefaultFp8Group;
    k_align = std::max(64, g.group);
  }
  if (format == WeightFormat::kMxfp4) {
    g.group = kMxfp4Block;
    k_align = 64;  // int4's 64-k chunks
  }
  g.Kh = RoundUp(hidden, k_align);
  g.Ki = RoundUp(intermediate, k_align);
  g.Hn = RoundUp(hidden, 32);
  return g;
}

size_t ExpertGeometry::block_bytes(int K) const {
  switch (format) {
    case WeightFormat::kBf16: return static_cast<size_t>(K) * 32;
    case WeightFormat::kInt8: return static_cast<size_t>(K) * 16 + 128;
    case WeightFormat::kInt4: return static_cast<size_t>(K) * 8 + static_cast<size_t>(K / group) * 64;
    case WeightFormat::kFp8: return static_cast<size_t>(K) * 16 + static_cast<size_t>(K / group) * 64;
    case WeightFormat::kMxfp4: return static_cast<size_t>(K) * 8 + layout::Mxfp4ScaleBytes(K);
  }
  return 0;
}

KernelRows KernelRows::At(int row, int ld, int K) const {
  KernelRows r;
  const size_t off = static_cast<size_t>(row) * ld;
  if (bf16 != nullptr) r.bf16 = bf16 + off;
  if (q != nullptr) r.q = q + 2 * off;
  if (scale != nullptr) r.scale = scale + row;
  if (sum32 != nullptr) r.sum32 = sum32 + static_cast<size_t>(2 * row) * (K / 32);
  return r;
}

namespace {

// W[n, k] of a row-major [N, K] matrix as f32, zero outside it.
inline float At(const bf16_t* w, int N, int K, int n, int k) {
  return n < N && k < K ? Bf16ToF32(w[static_cast<size_t>(n) * K + k]) : 0.0f;
}

// bf16: rows [n0, n0+16) of W [N, K] as Kp/2 rows of 16 (even, odd) pairs.
void PackBf16Block(const bf16_t* w, int N, int K, int n0, int Kp, std::byte* out) {
  bf16_t* dst = reinterpret_cast<bf16_t*>(out);
  for (int p = 0; p < Kp / 2; ++p) {
    for (int c = 0; c < 16; ++c) {
      const int n = n0 + c;
      for (int q = 0; q < 2; ++q) {
        const int k = 2 * p + q;
        dst[layout::Bf16Index(c, k)] = (n < N && k < K) ? w[static_cast<size_t>(n) * K + k] : 0;
      }
    }
  }
}

void PackInt8Block(const bf16_t* w, int N, int K, int n0, int Kp, std::byte* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  float* scale = reinterpret_cast<float*>(out + size_t(Kp) * 16);
  int32_t* colsum = reinterpret_cast<int32_t*>(scale + 16);
  for (int c = 0; c < 16; ++c) {
    float amax = 0.0f;
    for (int k = 0; k < K; ++k) amax = std::max(amax, std::fabs(At(w, N, K, n0 + c, k)));
    const float s = amax / 127.0f;
    scale[c] = s;
    int32_t sum = 0;
    for (int k = 0; k < Kp; ++k) {
      const float v = At(w, N, K, n0 + c, k);
      const int qi = s > 0 ? std::clamp(static_cast<int>(std::nearbyint(v / s)), -127, 127) : 0;
      q[layout::Int8Offset(c, k)] = static_cast<int8_t>(qi);
      sum += qi;
    }
    colsum[c] = sum;
  }
}

void PackInt4Block(const bf16_t* w, int N, int K, int n0, int Kp, int group, std::byte* out) {
  uint8_t* q = reinterpret_cast<uint8_t*>(out);
  std::memset(q, 0x88, size_t(Kp) * 8);  // q = 0 everywhere (padding included)
  float* scale = reinterpret_cast<float*>(out + size_t(Kp) * 8);
  for (int gi = 0; gi < Kp / group; ++gi) {
    for (int c = 0; c < 16; ++c) {
      // The finest grid s * [-8, 7] that holds the group without clipping
      // (an int4 checkpoint's own codes and scales take PackExpertCodes).
      float pos = 0.0f, neg = 0.0f;
      for (int k = gi * group; k < (gi + 1) * group; ++k) {
        const float v = At(w, N, K, n0 + c, k);
        pos = std::max(pos, v);
        neg = std::max(neg, -v);
      }
      const float s = std::max(pos / 7.0f, neg / 8.0f);
      scale[gi * 16 + c] = s;
      for (int k = gi * group; k < (gi + 1) * group; ++k) {
        const float v = At(w, N, K, n0 + c, k);
        layout::SetInt4Code(out, c, k, s > 0 ? std::clamp(static_cast<int>(std::nearbyint(v / s)), -8, 7) : 0);
      }
    }
  }
}

// mxfp4 from bf16: per channel and 32 k, the OCP scale (Mxfp4ScaleFor) and
// codes rounded to nearest. An MXFP4 checkpoint's values (dequantized at load,
// exact in bf16) come back exactly: the scale its largest code implies may be
// smaller than the stored one by up to 2^3, and every code times that power
// of two is again a code. Padding: code 0, exponent 127.
void PackMxfp4Block(const bf16_t* w, int N, int K, int n0, int Kp, std::byte* out) {
  uint8_t* q = reinterpret_cast<uint8_t*>(out);
  std::memset(q, 0, size_t(Kp) * 8 + layout::Mxfp4ScaleBytes(Kp));
  uint8_t* scale = q + size_t(Kp) * 8;
  float v[kMxfp4Block];
  uint8_t codes[kMxfp4Block];
  for (int gi = 0; gi < Kp / kMxfp4Block; ++gi)
    for (int c = 0; c < 16; ++c) {
      const int k0 = gi * kMxfp4Block;
      for (int j = 0; j < kMxfp4Block; ++j) v[j] = At(w, N, K, n0 + c, k0 + j);
      scale[gi * 16 + c] = QuantizeMxfp4Block(v, codes);
      // layout::Int4Offset: k and k + 4 of each 8 share a byte (low, high nibble), 4 bytes per channel.
      for (int j8 = 0; j8 < kMxfp4Block; j8 += 8) {
        const int k = k0 + j8;
        uint8_t* b = q + size_t(k / 64) * 512 + size_t((k % 64) / 8) * 64 + c * 4;
        for (int j = 0; j < 4; ++j) b[j] = static_cast<uint8_t>(codes[j8 + j] | codes[j8 + 4 + j] << 4);
      }
    }
}

// fp8 from bf16: per channel and group, scale = max|w| / 448 (E4M3's largest
// finite value), codes rounded to nearest even.
void PackFp8Block(const bf16_t* w, int N, int K, int n0, int Kp, int group, std::byte* out) {
  uint8_t* q = reinterpret_cast<uint8_t*>(out);
  float* scale = reinterpret_cast<float*>(out + size_t(Kp) * 16);
  for (int gi = 0; gi < Kp / group; ++gi)
    for (int c = 0; c < 16; ++c) {
      float amax = 0.0f;
      for (int k = gi * group; k < (gi + 1) * group; ++k) amax = std::max(amax, std::fabs(At(w, N, K, n0 + c, k)));
      const float s = amax / 448.0f;
      scale[gi * 16 + c] = s;
      for (int k = gi * group; k < (gi + 1) * group; ++k)
        q[layout::Int8Offset(c, k)] = s > 0 ? F32ToFp8E4M3(At(w, N, K, n0 + c, k) / s) : 0;
    }
}

void PackBlock(const ExpertGeometry& g, const bf16_t* w, int N, int K, int n0, int Kp, std::byte* out) {
  switch (g.format) {
    case WeightFormat::kBf16: return PackBf16Block(w, N, K, n0, Kp, out);
    case WeightFormat::kInt8: return PackInt8Block(w, N, K, n0, Kp, out);
    case WeightFormat::kInt4: return PackInt4Block(w, N, K, n0, Kp, g.group, out);
    case WeightFormat::kFp8: return PackFp8Block(w, N, K, n0, Kp, g.group, out);
    case WeightFormat::kMxfp4: return PackMxfp4Block(w, N, K, n0, Kp, out);
  }
}

// The checkpoint's codes of rows [n0, n0+16) of w (fp8 bytes, or int4
// nibbles), its scale per channel and group (constant inside a group:
// CodesFit checks); padding is code 0, scale 0.
void CopyCodedBlock(const ExpertGeometry& g, const CodedProjection& w, int n0, int Kp, std::byte* out) {
  const bool int4 = g.format == WeightFormat::kInt4;
  uint8_t* q = reinterpret_cast<uint8_t*>(out);
  if (int4) std::memset(q, 0x88, size_t(Kp) * 8);  // q = 0 (nibbles hold q + 8)
  float* scale = reinterpret_cast<float*>(out + size_t(Kp) * (int4 ? 8 : 16));
  for (int c = 0; c < 16; ++c) {
    const int n = n0 + c;
    for (int gi = 0; gi < Kp / g.group; ++gi)
      scale[gi * 16 + c] = n < w.rows && gi * g.group < w.cols ? w.Scale(n, gi * g.group) : 0.0f;
    for (int k = 0; k < Kp; ++k) {
      const uint8_t code = n < w.rows && k < w.cols ? w.codes[size_t(n) * w.cols + k] : 0;
      if (int4) layout::SetInt4Code(out, c, k, static_cast<int8_t>(code));
      else q[layout::Int8Offset(c, k)] = code;
    }
  }
}

// W [N, K] from its packed blocks, block b at blocks + b * stride.
void UnpackMatrix(const ExpertGeometry& g, const std::byte* blocks, size_t stride, int N, int K, int Kp, float* w) {
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) w[size_t(n) * K + k] = layout::Value(g, blocks + (n / 16) * stride, Kp, n % 16, k);
}

}  // namespace

void PackBiases(const ExpertGeometry& g, const bf16_t* gate_bias, const bf16_t* up_bias, const bf16_t* down_bias,
                std::byte* dst) {
  float* b = reinterpret_cast<float*>(dst);
  for (auto [src, n, at, len] : {std::tuple{gate_bias, g.I, 0, g.Ki}, std::tuple{up_bias, g.I, g.Ki, g.Ki},
                                 std::tuple{down_bias, g.H, 2 * g.Ki, g.Hn}})
    for (int i = 0; i < len; ++i) b[at + i] = src != nullptr && i < n ? Bf16ToF32(src[i]) : 0.0f;
}

void PackExpert(const ExpertGeometry& g, const bf16_t* gate, const bf16_t* up, const bf16_t* down,
                std::byte* dst, const bf16_t* gate_bias, const bf16_t* up_bias, const bf16_t* down_bias) {
  if (g.biases) PackBiases(g, gate_bias, up_bias, down_bias, dst + g.gate_up_bytes() + g.down_bytes());
  const size_t gub = g.block_bytes(g.Kh), db = g.block_bytes(g.Ki);
  for (int c = 0; c < g.gate_up_groups(); ++c) {
    PackBlock(g, gate, g.I, g.H, 16 * c, g.Kh, dst + (2 * c) * gub);
    PackBlock(g, up, g.I, g.H, 16 * c, g.Kh, dst + (2 * c + 1) * gub);
  }
  std::byte* d = dst + g.gate_up_bytes();
  for (int b = 0; b < g.Hn / 16; ++b) PackBlock(g, down, g.H, g.I, 16 * b, g.Ki, d + b * db);
}

absl::Status CodesFit(const ExpertGeometry& g, const ExpertCodes& w) {
  const WeightQuant want = g.format == WeightFormat::kFp8   ? WeightQuant::kFp8Block
                           : g.format == WeightFormat::kInt4 ? WeightQuant::kInt4Group
                                                             : WeightQuant::kNone;
  const char* what = g.format == WeightFormat::kFp8 ? "fp8" : "int4";
  for (const CodedProjection* p : {&w.gate, &w.up, &w.down}) {
    if (want == WeightQuant::kNone || p->scheme != want)
      return absl::InvalidArgumentError(absl::StrCat("packed ", WeightFormatName(g.format),
                                                     " experts: the checkpoint's codes are another format"));
    if (p->br != 1 && want == WeightQuant::kInt4Group)
      return absl::InvalidArgumentError(absl::StrCat("int4 experts: the checkpoint's scales span ", p->br,
                                                     " rows; the packed groups take one scale per row"));
    if (p->bc % g.group != 0 || p->c0 % g.group != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          what, " experts: scale groups of ", g.group, " columns do not fit the checkpoint's blocks of ", p->bc,
          " columns", p->c0 != 0 ? absl::StrCat(" from column ", p->c0) : "",
          want == WeightQuant::kFp8Block ? " (use --weight-dtype int8)" : ""));
  }
  if (w.gate.rows != g.I || w.gate.cols != g.H || w.up.rows != g.I || w.up.cols != g.H || w.down.rows != g.H ||
      w.down.cols != g.I)
    return absl::InvalidArgumentError(absl::StrCat(what, " experts: shapes do not match H=", g.H, " I=", g.I));
  const float largest = want == WeightQuant::kFp8Block ? 448.0f : 8.0f;  // the largest code's magnitude
  for (const CodedProjection* p : {&w.gate, &w.up, &w.down})
    for (float s : p->scales)
      if (!std::isfinite(s * largest))
        return absl::InvalidArgumentError(absl::StrCat(what, " experts: scale ", s, " makes weights overflow f32"));
  return absl::OkStatus();
}

absl::Status PackExpertCodes(const ExpertGeometry& g, const ExpertCodes& w, std::byte* dst) {
  MOE_RETURN_IF_ERROR(CodesFit(g, w));
  const size_t gub = g.block_bytes(g.Kh), db = g.block_bytes(g.Ki);
  for (int c = 0; c < g.gate_up_groups(); ++c) {
    CopyCodedBlock(g, w.gate, 16 * c, g.Kh, dst + (2 * c) * gub);
    CopyCodedBlock(g, w.up, 16 * c, g.Kh, dst + (2 * c + 1) * gub);
  }
  std::byte* d = dst + g.gate_up_bytes();
  for (int b = 0; b < g.Hn / 16; ++b) CopyCodedBlock(g, w.down, 16 * b, g.Ki, d + b * db);
  return absl::OkStatus();
}

void UnpackExpert(const ExpertGeometry& g, const std::byte* packed, float* gate, float* up, float* down,
                  float* const* biases) {
  const size_t gub = g.block_bytes(g.Kh);  // gate and up blocks interleave: every other block
  UnpackMatrix(g, packed, 2 * gub, g.I, g.H, g.Kh, gate);
  UnpackMatrix(g, packed + gub, 2 * gub, g.I, g.H, g.Kh, up);
  UnpackMatrix(g, packed + g.gate_up_bytes(), g.block_bytes(g.Ki), g.H, g.I, g.Ki, down);
  if (const float* b = g.bias(packed); b != nullptr && biases != nullptr) {
    std::copy_n(b, g.I, biases[0]);
    std::copy_n(b + g.Ki, g.I, biases[1]);
    std::copy_n(b + 2 * g.Ki, g.H, biases[2]);
  }
}

void QuantizeRowsScalar(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32) {
  for (int r = 0; r < m; ++r) {
    const bf16_t* xr = x + size_t(r) * ld;
    float amax = 0.0f;
    for (int k = 0; k < K; ++k) amax = std::max(amax, std::fabs(Bf16ToF32(xr[k])));
    const float s = amax / 127.0f;
    const float inv = s > 0 ? 1.0f / s : 0.0f;
    scale[r] = s;
    int8_t* hi = q + size_t(2 * r) * ld;
    int8_t* lo = hi + ld;
    for (int c = 0; c < K / 32; ++c) {
      int32_t sh = 0, sl = 0;
      for (int k = 32 * c; k < 32 * c + 32; ++k) {
        const float v = Bf16ToF32(xr[k]) * inv;  // in [-127, 127]
        const float h = std::nearbyint(v);
        const int qh = static_cast<int>(h);
        const int ql = std::clamp(static_cast<int>(std::nearbyint((v - h) * 254.0f)), -127, 127);
        hi[k] = static_cast<int8_t>(qh);
        lo[k] = static_cast<int8_t>(ql);
        sh += qh;
        sl += ql;
      }
      sum32[size_t(2 * r) * (K / 32) + c] = sh;
      sum32[size_t(2 * r + 1) * (K / 32) + c] = sl;
    }
  }
}

void QuantizeRows(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32) {
  if (CpuFeatures::Get().HasAvx512Bf16()) return QuantizeRowsAvx512(x, m, K, ld, q, scale, sum32);
  QuantizeRowsScalar(x, m, K, ld, q, scale, sum32);
}

absl::StatusOr<std::unique_ptr<ExpertKernel>> MakeExpertKernel(std::string_view name, const CpuFeatures& cpu,
                                                              WeightFormat format) {
  const bool bf16 = format == WeightFormat::kBf16 || format == WeightFormat::kFp8;  // fp8 runs as bf16 after conversion; mxfp4 as int4
  const bool avx512 = bf16 ? cpu.HasAvx512Bf16() : cpu.HasAvx512Vnni();
  const bool amx = bf16 ? cpu.HasAmxBf16() : cpu.HasAmxInt8();
  const bool avx512_int8 = cpu.HasAvx512Vnni(), amx_int8 = cpu.HasAmxInt8();
  if (name == "auto") {
    std::unique_ptr<ExpertKernel> k;
    if (amx) k = MakeAmxKernel(cpu.HasAmxBf16(), amx_int8);
    if ((!k || !k->Supports(format)) && avx512) k = MakeAvx512Kernel(cpu.HasAvx512Bf16(), avx512_int8);
    if (!k || !k->Supports(format)) k = MakeReferenceKernel();
    return k;
  }
  if (name == "reference") return MakeReferenceKernel();
  if (name == "avx512") {
    if (!avx512)
      return absl::FailedPreconditionError(absl::StrCat("kernel avx512 needs ", bf16 ? "AVX-512-BF16" : "AVX-512-VNNI",
                                                        " for ", WeightFormatName(format),
                                                        " weights; this CPU has: ", cpu.Summary()));
    return MakeAvx512Kernel(cpu.HasAvx512Bf16(), avx512_int8);
  }
  if (name == "amx") {
    if (!amx)
      return absl::FailedPreconditionError(absl::StrCat("kernel amx needs ", bf16 ? "AMX-BF16" : "AMX-INT8",
                                                        " enabled by the OS for ", WeightFormatName(format),
                                                        " weights; this CPU has: ", cpu.Summary()));
    return MakeAmxKernel(cpu.HasAmxBf16(), amx_int8);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kernel '", std::string(name), "' (auto, amx, avx512, reference)"));
}

}  // namespace moe
