// ExpertKernel: the compute of one SwiGLU expert on the CPU, behind one
// interface with three implementations picked at run time:
//   amx       AMX-BF16 tiles (Sapphire Rapids and later)
//   avx512    AVX-512-BF16 dot products (vdpbf16ps)
//   reference portable scalar code (any x86-64)
//
// All three read one packed weight layout, written once at load by
// PackExpert (never at call time). The layout stores a matrix W [N, K]
// (y = W x) as N/16 blocks of 16 rows; inside a block, K/2 rows of 64 bytes,
// row p holding (W[n,2p], W[n,2p+1]) for the block's 16 n. A 1 KiB run of 16
// such rows is exactly one AMX B tile (VNNI) and each 64-byte row one zmm for
// vdpbf16ps. Gate and up are interleaved block by block (gate block j, then up
// block j) so one pass computes both and applies silu(g)*u in registers
// ("fused gate+up"); the down projection adds weight*y straight into the f32
// output rows of the tokens ("fused weighted accumulation").
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
#include "cpu_compute/cpu_features.h"

namespace moe {

// Padded geometry of one expert as the kernels see it.
struct ExpertGeometry {
  int H = 0, I = 0;
  int Kh = 0;  // H rounded up to 32: the K of gate/up, the row stride of gathered inputs
  int Ki = 0;  // I rounded up to 32: the K of down, the row stride of activations
  int Hn = 0;  // H rounded up to 32: the N of down

  static ExpertGeometry For(int hidden, int intermediate);
  // Activation column groups of 16 computed by GateUp (covers Ki).
  int gate_up_groups() const { return Ki / 16; }
  // Output column groups of 32 computed by DownAccumulate (covers Hn).
  int down_groups() const { return Hn / 32; }
  size_t gate_up_bytes() const { return static_cast<size_t>(2 * Ki) * Kh * 2; }
  size_t down_bytes() const { return static_cast<size_t>(Hn) * Ki * 2; }
  size_t packed_bytes() const { return gate_up_bytes() + down_bytes(); }
};

// Writes the packed form of one expert (row-major bf16 gate/up [I,H], down [H,I])
// into dst (geometry.packed_bytes() bytes, 64-byte aligned). Padding is zero.
void PackExpert(const ExpertGeometry& g, const bf16_t* gate, const bf16_t* up, const bf16_t* down,
                std::byte* dst);

class ExpertKernel {
 public:
  virtual ~ExpertKernel() = default;
  virtual const char* name() const = 0;
  // Row granularity: each expert's gathered rows are padded to a multiple of it.
  virtual int row_block() const = 0;

  // act[r, 16c .. 16c+16) = bf16(silu(x_r . gate_c) * (x_r . up_c)) for all r < m
  // and activation groups c in [c0, c1). x is [mp, Kh] bf16 and act [mp, Ki],
  // where mp is m rounded up to row_block(); x's padding (rows >= m, columns
  // >= H) is zero. Rows in [m, mp) of act may be written.
  virtual void GateUp(const ExpertGeometry& g, const std::byte* packed, const bf16_t* x, int m,
                      bf16_t* act, int c0, int c1) const = 0;

  // For output groups c in [c0, c1) (columns [32c, 32c+32) clipped to H) and
  // rows r < m with token[r] >= 0:  out[token[r] * ldo + col] += weight[r] * (act_r . down_col).
  // act, token and weight have mp rows as above (padding rows: token -1).
  virtual void DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const bf16_t* act,
                              int m, const int32_t* token, const float* weight, float* out,
                              int ldo, int c0, int c1) const = 0;
};

// "auto" picks amx, else avx512, else reference. Naming a kernel the CPU lacks
// is FailedPrecondition; an unknown name is InvalidArgument.
absl::StatusOr<std::unique_ptr<ExpertKernel>> MakeExpertKernel(std::string_view name,
                                                              const CpuFeatures& cpu);

// Implementations (one per file); the factory above is the only caller.
std::unique_ptr<ExpertKernel> MakeReferenceKernel();
std::unique_ptr<ExpertKernel> MakeAvx512Kernel();
std::unique_ptr<ExpertKernel> MakeAmxKernel();

}  // namespace moe
