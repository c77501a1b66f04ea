// What the CPU (and the OS) let us use: AVX-512 (F/BW/VL/BF16/VNNI) and AMX
// (TILE/BF16/INT8). Detected once with cpuid/xgetbv; for AMX the process also asks
// Linux for permission to use tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
// Thread-safe: Get() computes the value once.
#pragma once

#include <string>

namespace moe {

struct CpuFeatures {
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false, avx512_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx512 = false;   // XCR0 enables ZMM state
  bool os_amx = false;      // XCR0 enables tile state and Linux granted permission
  std::string brand;

  bool HasAvx512Bf16() const { return avx512f && avx512bw && avx512vl && avx512_bf16 && os_avx512; }
  bool HasAmxBf16() const { return amx_tile && amx_bf16 && os_amx && HasAvx512Bf16(); }
  // The integer kernels: vpdpbusd (and AMX-INT8 tiles).
  bool HasAvx512Vnni() const { return avx512f && avx512bw && avx512vl && avx512_vnni && os_avx512; }
  bool HasAmxInt8() const { return amx_tile && amx_int8 && os_amx && HasAvx512Vnni(); }
  // e.g. "avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16"
  std::string Summary() const;

  static const CpuFeatures& Get();
};

}  // namespace moe
