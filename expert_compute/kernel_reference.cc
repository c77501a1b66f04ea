// The portable kernel: plain loops over the packed layouts. bf16, fp8: f32
// accumulation of the exact weights (fp8: code x scale in f32). int8/int4/mxfp4:
// exact int32 dot products of the quantized activation rows with the weight
// codes (mxfp4: 2 x E2M1), scaled per row, channel (and group) in f32 — the
// arithmetic the SIMD kernels must reproduce.
#include <cmath>

#include "expert_compute/expert_kernel.h"
#include "expert_compute/packed_layout.h"

namespace moe {
namespace {

// y[c] = sum_k x_r[k] * W[c, k] for the 16 channels c of one packed block
// with Kp columns (row r of x; rows ld apart).
void BlockDot(const ExpertGeometry& g, const std::byte* blk, int Kp, const KernelRows& x, int ld, int r,
              float y[16]) {
  if (!g.int_activations()) {  // bf16, fp8: f32 weights x bf16 rows
    const bf16_t* xr = x.bf16 + size_t(r) * ld;
    for (int c = 0; c < 16; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < Kp; ++k) acc += layout::Value(g, blk, Kp, c, k) * Bf16ToF32(xr[k]);
      y[c] = acc;
    }
    return;
  }
  const int8_t* hi = x.q + size_t(2 * r) * ld;
  const int8_t* lo = hi + ld;
  const bool grouped = g.format != WeightFormat::kInt8;
  const int group = grouped ? g.group : Kp;
  for (int c = 0; c < 16; ++c) {
    float acc = 0.0f;
    for (int k0 = 0; k0 < Kp; k0 += group) {
      int32_t dh = 0, dl = 0;
      for (int k = k0; k < k0 + group; ++k) {
        const int w = layout::Code(g, blk, c, k);
        dh += w * hi[k];
        dl += w * lo[k];
      }
      const float dot = static_cast<float>(dh) + static_cast<float>(dl) * kLoScale;
      // int8: one group, its per-channel scales
      acc += dot * (grouped ? layout::GroupScale(g, blk, Kp, c, k0) : layout::Scales(g, blk, Kp)[c]);
    }
    y[c] = acc * x.scale[r];
  }
}

class ReferenceKernel final : public ExpertKernel {
 public:
  const char* name() const override { return "reference"; }
  int row_block(WeightFormat) const override { return 1; }
  bool Supports(WeightFormat) const override { return true; }

  void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m, bf16_t* act,
              int c0, int c1) const override {
    const size_t blk = g.block_bytes(g.Kh);
    const float* bias = g.bias(packed);
    float gv[16], uv[16];
    for (int c = c0; c < c1; ++c) {
      for (int r = 0; r < m; ++r) {
        BlockDot(g, packed + (2 * c) * blk, g.Kh, x, g.ldx(), r, gv);
        BlockDot(g, packed + (2 * c + 1) * blk, g.Kh, x, g.ldx(), r, uv);
        for (int j = 0; j < 16; ++j) {
          if (bias != nullptr) gv[j] += bias[16 * c + j], uv[j] += bias[g.Ki + 16 * c + j];
          act[static_cast<size_t>(r) * g.lda() + 16 * c + j] = F32ToBf16(ActivateGateUp(g.activation, gv[j], uv[j]));
        }
      }
    }
  }

  void Down(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m, const float* weight,
            float* out, int ldo, int c0, int c1) const override {
    const std::byte* d = packed + g.gate_up_bytes();
    const size_t blk = g.block_bytes(g.Ki);
    const float* bias = g.bias(packed);
    float y[16];
    for (int c = c0; c < c1; ++c) {
      for (int half = 0; half < 2; ++half) {
        const int b = 2 * c + half;
        for (int r = 0; r < m; ++r) {
          BlockDot(g, d + b * blk, g.Ki, act, g.lda(), r, y);
          float* o = out + static_cast<size_t>(r) * ldo;
          for (int j = 0; j < 16; ++j) {
            const int col = 16 * b + j;
            if (col < g.H) o[col] = weight[r] * (bias != nullptr ? y[j] + bias[2 * g.Ki + col] : y[j]);
          }
        }
      }
    }
  }
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeReferenceKernel() { return std::make_unique<ReferenceKernel>(); }

}  // namespace moe
