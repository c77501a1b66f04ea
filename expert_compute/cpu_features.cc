#include "expert_compute/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace moe {

namespace {

uint64_t Xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx512f = b & (1u << 16);
  f.avx512bw = b & (1u << 30);
  f.avx512vl = b & (1u << 31);
  f.avx512_vnni = c & (1u << 11);
  f.amx_bf16 = d & (1u << 22);
  f.amx_int8 = d & (1u << 25);
  f.amx_tile = d & (1u << 24);
  unsigned a1 = 0, b1, c1, d1;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512_bf16 = a1 & (1u << 5);
  unsigned c0 = 0, d0, a0, b0;
  __get_cpuid(1, &a0, &b0, &c0, &d0);
  const bool osxsave = c0 & (1u << 27);
  if (osxsave) {
    const uint64_t xcr0 = Xgetbv0();
    f.os_avx512 = (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
    // XTILECFG (bit 17) and XTILEDATA (bit 18), plus Linux's per-process permission.
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    f.os_amx = f.amx_tile && (xcr0 & (3ull << 17)) == (3ull << 17) &&
               syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  char brand[49] = {};
  unsigned* p = reinterpret_cast<unsigned*>(brand);
  if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000004) {
    for (unsigned i = 0; i < 3; ++i) __get_cpuid(0x80000002 + i, &p[4 * i], &p[4 * i + 1], &p[4 * i + 2], &p[4 * i + 3]);
  }
  f.brand = brand;
  while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
  return f;
}

}  // namespace

std::string CpuFeatures::Summary() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512_bf16, "avx512_bf16");
  add(avx512_vnni, "avx512_vnni");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  add(amx_int8, "amx_int8");
  if (amx_tile && !os_amx) s += " (amx not enabled by the OS)";
  return s.empty() ? "baseline x86-64" : s;
}

const CpuFeatures& CpuFeatures::Get() {
  static const CpuFeatures f = Detect();
  return f;
}

}  // namespace moe
