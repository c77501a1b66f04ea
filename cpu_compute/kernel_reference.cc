// The portable kernel: plain loops over the packed layout, f32 accumulation.
#include <cmath>

#include "cpu_compute/expert_kernel.h"

namespace moe {
namespace {

// y[c] = sum_k x[k] * W[c, k] for the 16 rows c of one packed block.
inline void BlockDot(const bf16_t* blk, const bf16_t* x, int Kp, float y[16]) {
  for (int c = 0; c < 16; ++c) y[c] = 0.0f;
  for (int p = 0; p < Kp / 2; ++p) {
    const float x0 = Bf16ToF32(x[2 * p]), x1 = Bf16ToF32(x[2 * p + 1]);
    const bf16_t* row = blk + p * 32;
    for (int c = 0; c < 16; ++c) y[c] += Bf16ToF32(row[2 * c]) * x0 + Bf16ToF32(row[2 * c + 1]) * x1;
  }
}

class ReferenceKernel final : public ExpertKernel {
 public:
  const char* name() const override { return "reference"; }
  int row_block() const override { return 1; }

  void GateUp(const ExpertGeometry& g, const std::byte* packed, const bf16_t* x, int m, bf16_t* act,
              int c0, int c1) const override {
    const bf16_t* w = reinterpret_cast<const bf16_t*>(packed);
    const size_t blk = static_cast<size_t>(g.Kh) * 16;
    float gv[16], uv[16];
    for (int c = c0; c < c1; ++c) {
      for (int r = 0; r < m; ++r) {
        const bf16_t* xr = x + static_cast<size_t>(r) * g.Kh;
        BlockDot(w + (2 * c) * blk, xr, g.Kh, gv);
        BlockDot(w + (2 * c + 1) * blk, xr, g.Kh, uv);
        for (int j = 0; j < 16; ++j) {
          act[static_cast<size_t>(r) * g.Ki + 16 * c + j] =
              F32ToBf16(gv[j] / (1.0f + std::exp(-gv[j])) * uv[j]);
        }
      }
    }
  }

  void DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const bf16_t* act, int m,
                      const int32_t* token, const float* weight, float* out, int ldo, int c0,
                      int c1) const override {
    const bf16_t* d = reinterpret_cast<const bf16_t*>(packed + g.gate_up_bytes());
    const size_t blk = static_cast<size_t>(g.Ki) * 16;
    float y[16];
    for (int c = c0; c < c1; ++c) {
      for (int half = 0; half < 2; ++half) {
        const int b = 2 * c + half;
        for (int r = 0; r < m; ++r) {
          if (token[r] < 0) continue;
          BlockDot(d + b * blk, act + static_cast<size_t>(r) * g.Ki, g.Ki, y);
          float* o = out + static_cast<size_t>(token[r]) * ldo;
          for (int j = 0; j < 16; ++j) {
            const int col = 16 * b + j;
            if (col < g.H) o[col] += weight[r] * y[j];
          }
        }
      }
    }
  }
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeReferenceKernel() { return std::make_unique<ReferenceKernel>(); }

}  // namespace moe
