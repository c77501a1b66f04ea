#include "cpu_compute/expert_kernel.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

ExpertGeometry ExpertGeometry::For(int hidden, int intermediate) {
  ExpertGeometry g;
  g.H = hidden;
  g.I = intermediate;
  g.Kh = (hidden + 31) / 32 * 32;
  g.Ki = (intermediate + 31) / 32 * 32;
  g.Hn = g.Kh;
  return g;
}

namespace {

// Packs rows [n0, n0+16) of W [N, K] (row-major, K valid columns) into one
// block of Kp/2 rows of 16 (even, odd) pairs; rows >= N and columns >= K are zero.
void PackBlock(const bf16_t* w, int N, int K, int n0, int Kp, bf16_t* dst) {
  for (int p = 0; p < Kp / 2; ++p) {
    for (int c = 0; c < 16; ++c) {
      const int n = n0 + c;
      for (int q = 0; q < 2; ++q) {
        const int k = 2 * p + q;
        dst[(p * 16 + c) * 2 + q] = (n < N && k < K) ? w[static_cast<size_t>(n) * K + k] : 0;
      }
    }
  }
}

}  // namespace

void PackExpert(const ExpertGeometry& g, const bf16_t* gate, const bf16_t* up, const bf16_t* down,
                std::byte* dst) {
  bf16_t* out = reinterpret_cast<bf16_t*>(dst);
  const size_t blk = static_cast<size_t>(g.Kh) * 16;  // bf16 per gate/up block
  for (int c = 0; c < g.gate_up_groups(); ++c) {
    PackBlock(gate, g.I, g.H, 16 * c, g.Kh, out + (2 * c) * blk);
    PackBlock(up, g.I, g.H, 16 * c, g.Kh, out + (2 * c + 1) * blk);
  }
  bf16_t* d = out + g.gate_up_bytes() / 2;
  const size_t dblk = static_cast<size_t>(g.Ki) * 16;
  for (int b = 0; b < g.Hn / 16; ++b) PackBlock(down, g.H, g.I, 16 * b, g.Ki, d + b * dblk);
}

absl::StatusOr<std::unique_ptr<ExpertKernel>> MakeExpertKernel(std::string_view name,
                                                              const CpuFeatures& cpu) {
  if (name == "auto") {
    if (cpu.HasAmxBf16()) return MakeAmxKernel();
    if (cpu.HasAvx512Bf16()) return MakeAvx512Kernel();
    return MakeReferenceKernel();
  }
  if (name == "reference") return MakeReferenceKernel();
  if (name == "avx512") {
    if (!cpu.HasAvx512Bf16())
      return absl::FailedPreconditionError(
          absl::StrCat("kernel avx512 needs AVX-512-BF16; this CPU has: ", cpu.Summary()));
    return MakeAvx512Kernel();
  }
  if (name == "amx") {
    if (!cpu.HasAmxBf16())
      return absl::FailedPreconditionError(
          absl::StrCat("kernel amx needs AMX-BF16 enabled by the OS; this CPU has: ", cpu.Summary()));
    return MakeAmxKernel();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kernel '", std::string(name), "' (auto, amx, avx512, reference)"));
}

}  // namespace moe
