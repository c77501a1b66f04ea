// ExpertKernel: the compute of one SwiGLU expert on the CPU, behind one
// interface with three implementations picked at run time:
//   amx       AMX-BF16 / AMX-INT8 tiles (Sapphire Rapids and later)
//   avx512    AVX-512-BF16 (vdpbf16ps) / AVX-512-VNNI (vpdpbusd) dot products
//   reference portable scalar code (any x86-64)
//
// All three read one packed weight layout per storage format (bf16, int8,
// int4, fp8, mxfp4), written once at load by PackExpert / PackExpertCodes (never at
// call time). The bf16
// layout stores a matrix W [N, K]
// (y = W x) as N/16 blocks of 16 rows; inside a block, K/2 rows of 64 bytes,
// row p holding (W[n,2p], W[n,2p+1]) for the block's 16 n. A 1 KiB run of 16
// such rows is exactly one AMX B tile (VNNI) and each 64-byte row one zmm for
// vdpbf16ps. Gate and up are interleaved block by block (gate block j, then up
// block j) so one pass computes both and applies silu(g)*u in registers
// ("fused gate+up"); the down projection stores weight*y into one f32 row per
// input row (MoeExecutor then sums each token's rows). The activation and the
// biases are the model's (ExpertGeometry::activation, ::biases): one epilogue
// for every format and kernel (simd_avx512.h's GateUpEpilogue / DownEpilogue,
// the scalar ActivateGateUp).
//
// Kernels are stateless and const: any number of threads may call them at once
// on disjoint outputs. Driving them (grouping, threading) is MoeExecutor's job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "expert_compute/cpu_features.h"
#include "core/expert_activation.h"

namespace moe {

struct ExpertCodes;  // model/model_source.h (kept out: CUDA files include this header)

// How a packed expert stores its weights: the storage precision is a
// property of the packed experts (ExpertGeometry::format), not of the
// executor; one kernel object computes every format its CPU supports.
enum class WeightFormat : uint8_t {
  kBf16,  // bf16 pairs (layout above)
  kInt8,  // int8, one f32 scale per output channel (symmetric, q in [-127, 127])
  kInt4,  // int4, one f32 scale per output channel and group of `group` k (q in [-8, 7]): an int4
          // checkpoint's own codes and group scales (PackExpertCodes), or bf16 weights quantized
          // with scale = max(max/7, -min/8) (PackExpert)
  kFp8,   // OCP FP8 E4M3 codes, one f32 scale per output channel and group of `group` k: an FP8
          // checkpoint's own bytes and block scales (PackExpertCodes), or bf16 weights quantized
          // with scale = max|w| / 448 (PackExpert)
  kMxfp4, // OCP MXFP4: E2M1 codes (int4's nibble layout), one E8M0 byte per output channel and
          // 32 k (group 32): 4.25 bits per weight. Computed as int4 is (int8 activations), the
          // nibbles mapped to 2 x E2M1 (integers in [-12, 12]) and the scale halved.
};
// "bf16", "int8", "int4", "fp8", "mxfp4".
const char* WeightFormatName(WeightFormat f);

// The byte layouts (kInt8, kInt4, kFp8). A matrix W [N, K] is N/16 blocks of 16
// output channels; each block holds K/64 k-chunks, then its scales:
//   kInt8 chunk: 16 rows of 64 bytes (1 KiB, one AMX int8 B tile): row p
//        holds, for channels n = 0..15, the bytes W[n, 64c+4p .. 64c+4p+3].
//        After the K/64 chunks: 16 f32 scales, then 16 int32 column sums
//        (sum over k of q[n, k], what u8 x s8 dot products subtract).
//   kInt4 chunk: 8 rows of 64 bytes (512 B): byte b of row i holds tile row
//        2i's byte b in its low nibble and tile row 2i+1's in its high nibble,
//        each as q + 8 (0..15). After the chunks: K/group groups of 16 f32
//        scales (group-major).
//   kFp8 chunk: as kInt8's, each byte an E4M3 code. After the chunks: K/group
//        groups of 16 f32 scales (group-major), as kInt4.
//   kMxfp4 chunk: as kInt4's, each nibble an E2M1 code (sign bit 3). After
//        the chunks: K/32 groups of 16 E8M0 bytes (group-major), padded to a
//        multiple of 64 bytes. W[n, k] = E2M1(code) * 2^(e - 127).
// Block bytes: kInt8 16K + 128, kInt4 8K + 64 K/group, kFp8 16K + 64 K/group,
// kMxfp4 8K + K/2 rounded up to 64; gate and up blocks
// interleave as in bf16 (gate block c, up block c), then down's Hn/16 blocks.
// Experts with biases (ExpertGeometry::biases, every format) end with them
// in f32: gate [Ki], up [Ki], down [Hn], zero past I and H (bias_bytes()).
// K (Kh, Ki) is padded to a multiple of 64 (and of `group`) with zeros.
// W[n, k] = scale * q.

struct ExpertGeometry {
  int H = 0, I = 0;
  int Kh = 0;  // H rounded up (32 bf16; 64, and the group for int4/fp8): the K of gate/up
  int Ki = 0;  // I rounded up likewise: the K of down
  int Hn = 0;  // H rounded up to 32: the N of down
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;  // k per scale group: kInt4 32 or a multiple of 64 (layout::Int4GroupServed); kFp8 a multiple of 64; kMxfp4 32; else 0
  // The model's expert math (ModelSpec::activation, ::expert_biases): what
  // GateUp's epilogue applies, and whether each packed expert ends with its
  // biases (added to gate and up before the activation, to down's output
  // before the routing weight). Default: SiLU, no biases.
  ExpertActivation activation;
  bool biases = false;

  // bf16 geometry (the GPU worker's cache, and the default).
  static ExpertGeometry For(int hidden, int intermediate);
  // Any format; `group` only for kInt4 and kFp8 (0: their default; kMxfp4's is 32).
  static ExpertGeometry For(int hidden, int intermediate, WeightFormat format, int group = 0);
  static constexpr int kDefaultInt4Group = 128;
  static constexpr int kDefaultFp8Group = 128;  // DeepSeek-V3's and Qwen3-FP8's 128x128 blocks

  // Stored in a byte layout (not bf16 pairs).
  bool quantized() const { return format != WeightFormat::kBf16; }
  // Multiplied with int8-quantized activations (KernelRows q): kInt8, kInt4,
  // kMxfp4. bf16 and fp8 weights meet bf16 activations.
  bool int_activations() const {
    return format == WeightFormat::kInt8 || format == WeightFormat::kInt4 || format == WeightFormat::kMxfp4;
  }
  // kInt4 and kMxfp4: nibbles in kInt4's layout, scales per group of k.
  bool nibbles() const { return format == WeightFormat::kInt4 || format == WeightFormat::kMxfp4; }
  // Activation column groups of 16 computed by GateUp (covers Ki).
  int gate_up_groups() const { return Ki / 16; }
  // Output column groups of 32 computed by Down (covers Hn).
  int down_groups() const { return Hn / 32; }
  // Bytes of one packed 16-channel block of a matrix with K columns.
  size_t block_bytes(int K) const;
  size_t gate_up_bytes() const { return 2 * static_cast<size_t>(gate_up_groups()) * block_bytes(Kh); }
  size_t down_bytes() const { return static_cast<size_t>(Hn / 16) * block_bytes(Ki); }
  size_t bias_bytes() const { return biases ? (2 * static_cast<size_t>(Ki) + Hn) * sizeof(float) : 0; }
  size_t packed_bytes() const { return gate_up_bytes() + down_bytes() + bias_bytes(); }
  // A packed expert's f32 biases (gate; up at + Ki; down at + 2 Ki), or null without.
  const float* bias(const std::byte* packed) const {
    return biases ? reinterpret_cast<const float*>(packed + gate_up_bytes() + down_bytes()) : nullptr;
  }
  // The same geometry for a model's experts: its activation and biases.
  ExpertGeometry WithExpertMath(const ExpertActivation& a, bool with_biases) const {
    ExpertGeometry g = *this;
    g.activation = a;
    g.biases = with_biases;
    return g;
  }

  // Row strides of the rows the kernels read and write (KernelRows, act):
  // K plus kRowPad elements (bytes for the int8 rows), so that a 16-row AMX
  // tile never has its rows a multiple of 4 KiB apart, all in one L1 set (K =
  // 2048 put 16 rows in one 12-way set; the padded loop ran 15% faster on the
  // AMX host). Padding columns are never read.
  static constexpr int kRowPad = 64;
  int ldx() const { return Kh + kRowPad; }  // GateUp's input rows
  int lda() const { return Ki + kRowPad; }  // act rows: GateUp's output, Down's input
};

// Writes the packed form of one expert (row-major bf16 gate/up [I,H], down [H,I])
// into dst (geometry.packed_bytes() bytes, 64-byte aligned), quantizing for
// the byte formats (int8, int4, fp8). Padding is zero. With g.biases, the
// biases (gate/up [I], down [H]; bf16, kept exactly in f32) follow; without,
// they are ignored (may be null).
void PackExpert(const ExpertGeometry& g, const bf16_t* gate, const bf16_t* up, const bf16_t* down,
                std::byte* dst, const bf16_t* gate_bias = nullptr, const bf16_t* up_bias = nullptr,
                const bf16_t* down_bias = nullptr);
// Writes g.bias_bytes() of biases at `dst` (a packed expert's bias(), as
// PackExpert lays them out). Null biases are zeros.
void PackBiases(const ExpertGeometry& g, const bf16_t* gate_bias, const bf16_t* up_bias, const bf16_t* down_bias,
                std::byte* dst);
// Whether a quantized checkpoint's expert `w` can be packed as it is in g
// (CodesFit) and writes it (PackExpertCodes): an FP8 checkpoint's as kFp8, an
// int4 one's as kInt4, with its own codes and scales — no value changes
// (biases, when g has them, by PackBiases after it). They fit when the
// formats agree and no scale group of g straddles two of the checkpoint's
// blocks (g.group divides the block's columns and the slice's first column);
// else PackExpertCodes is InvalidArgument, naming why.
absl::Status CodesFit(const ExpertGeometry& g, const ExpertCodes& w);
absl::Status PackExpertCodes(const ExpertGeometry& g, const ExpertCodes& w, std::byte* dst);
// The weights a packed expert stands for (scale * q for the integer
// formats), row-major f32: gate/up [I, H], down [H, I]; with g.biases and a
// non-null `biases`, its biases gate [I], up [I], down [H] into biases[0..2].
// For references.
void UnpackExpert(const ExpertGeometry& g, const std::byte* packed, float* gate, float* up, float* down,
                  float* const* biases = nullptr);

// Activation rows as the kernels read them: bf16 rows for kBf16 and kFp8. For the
// integer formats each row x is quantized per row into two int8 rows, hi and
// lo (rows 2r and 2r+1 of q):
//   s = max|x| / 127,  hi = round(x / s),  lo = round((x - s hi) / (s / 254)),
// so x = s (hi + lo / 254) to ~15 bits, and x . w = s (hi . w + (lo . w) / 254)
// from two int8 dot products with the same weights. One int8 row alone
// (per-token int8) costs 1-2.5% relative error at real shapes; the pair keeps
// the kernels within the weights' own quantization error, and the second dot
// product is free where decode is bound by reading the weights. An all-zero
// row has s = 0. sum32 holds, per int8 row, the sum of its codes over every
// 32-column chunk (what u8-weight dot products subtract: int4 per group of
// >= 64, mxfp4 per 32). Rows are ld apart
// (elements for bf16, bytes for each int8 row: ldx() for GateUp's input,
// lda() for Down's), sum32's rows K/32 apart (K = Kh, Ki);
// pointers start at the call's row 0 (int8 row 0).
constexpr float kLoScale = 1.0f / 254.0f;
struct KernelRows {
  const bf16_t* bf16 = nullptr;   // [m, ld]
  const int8_t* q = nullptr;      // [2m, ld]: hi, lo of row 0, hi, lo of row 1, ...
  const float* scale = nullptr;   // [m]
  const int32_t* sum32 = nullptr; // [2m, K/32]
  KernelRows At(int row, int ld, int K) const;  // the same rows from `row` on
};

// Quantizes rows r < m of x (K bf16 columns, K a multiple of 64, rows ld
// apart) as KernelRows describes, q's int8 rows ld bytes apart (AVX-512 when
// the CPU has it). Thread-safe on disjoint rows.
void QuantizeRows(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32);

class ExpertKernel {
 public:
  virtual ~ExpertKernel() = default;
  virtual const char* name() const = 0;
  // Row granularity for experts packed in format f: each expert's gathered
  // rows are padded to a multiple of it.
  virtual int row_block(WeightFormat f) const = 0;

  // Whether this kernel computes experts packed in format f on this CPU.
  virtual bool Supports(WeightFormat f) const = 0;

  // act[r, 16c .. 16c+16) = bf16(ActivateGateUp(g.activation, x_r . gate_c + bg_c,
  // x_r . up_c + bu_c)) (core/expert_activation.h; biases when g.biases) for all r < m
  // and activation groups c in [c0, c1). x has mp rows of Kh columns (ldx()
  // apart) and act mp rows of Ki columns (lda() apart), where mp is m rounded
  // up to row_block(g.format); x's padding (rows >= m, columns >= H) is zero.
  // Rows in [m, mp) of act may be written.
  virtual void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m,
                      bf16_t* act, int c0, int c1) const = 0;

  // For output groups c in [c0, c1) (columns [32c, 32c+32) clipped to H) and
  // rows r < m:  out[r * ldo + col] = weight[r] * (act_r . down_col + bd_col)
  // (bd: the down bias when g.biases, else 0). act
  // (rows of Ki columns, lda() apart) has mp rows as above; out's other rows
  // and columns are not written. Each row gets its own output row: rows of
  // one token (several experts) never write the same memory, so any split of
  // rows and columns between threads is safe.
  virtual void Down(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                    const float* weight, float* out, int ldo, int c0, int c1) const = 0;
};

// "auto" picks amx, else avx512, else reference — the first that supports
// `format` on this CPU (amx: AMX-BF16 / AMX-INT8; avx512: AVX-512-BF16 /
// AVX-512-VNNI). Naming a kernel the CPU lacks for `format` is
// FailedPrecondition; an unknown name is InvalidArgument.
absl::StatusOr<std::unique_ptr<ExpertKernel>> MakeExpertKernel(std::string_view name, const CpuFeatures& cpu,
                                                              WeightFormat format = WeightFormat::kBf16);

// Implementations (one per file); the factory above is the only caller. Each
// is told which formats the CPU lets it run.
std::unique_ptr<ExpertKernel> MakeReferenceKernel();
std::unique_ptr<ExpertKernel> MakeAvx512Kernel(bool bf16, bool int8);
std::unique_ptr<ExpertKernel> MakeAmxKernel(bool bf16, bool int8);
// QuantizeRows' two implementations (kernel_avx512.cc and expert_kernel.cc).
void QuantizeRowsAvx512(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32);
void QuantizeRowsScalar(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32);

}  // namespace moe
