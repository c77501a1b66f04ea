// The AMX tile configuration every AMX user here loads: palette 1, tiles 0-7
// each 16 rows of 64 bytes (bf16: 16 x 32; int8: 16 x 64) by default. Shared by the amx
// kernel (kernel_amx.cc) and the tile-loop ceiling of bench/amx_peak.cc.
// Call only where CpuFeatures::HasAmxBf16() or HasAmxInt8() holds.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moe {

struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// k_bytes < 64 (int8 only; the amx kernel's mxfp4 uses 32): tiles 4-5 (A)
// are 16 rows of k_bytes, tiles 6-7 (B) k_bytes / 4 rows of 64, so one
// tdpbssd sums k_bytes k (one MXFP4 scale block); tiles 0-3 are unchanged.
__attribute__((target("amx-tile"))) inline void ConfigureAmxTiles(int k_bytes = 64) {
  AmxTileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  cfg.colsb[4] = cfg.colsb[5] = static_cast<uint16_t>(k_bytes);
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(k_bytes / 4);
  // ldtilecfg with cfg as a memory operand: GCC 12's _tile_loadconfig does not
  // tell the optimizer that it reads cfg, which let it drop the stores above
  // as dead (bench/amx_peak.cc's tile loop loaded an all-zero configuration
  // and its first tilezero raised #UD).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

}  // namespace moe
