#include "bench/dram_bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kGiB = uint64_t{1} << 30;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
void Die(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::exit(1);
}


// ---------------------------------------------------------------------------
// DRAM read bandwidth

__attribute__((target("avx512f"))) float SumAvx512(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  alignas(64) float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float s = 0;
  for (float v : lanes) s += v;
  return s;
}

float SumPlain(const float* p, size_t n) {
  float a[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  }
  float s = 0;
  for (float v : a) s += v;
  return s;
}

}  // namespace

// Median GB/s of all pool threads summing their slices of one buffer.
DramBandwidth MeasureDramBandwidth(const NumaBinding& numa, ComputePool& pool, double gib, bool avx512) {
  const int T = pool.size();
  const uint64_t unit = uint64_t{256} * T;  // whole 64-float blocks per thread
  uint64_t bytes = static_cast<uint64_t>(gib * kGiB);
  if (const uint64_t avail = AvailableMemoryBytes(); avail != 0) bytes = std::min(bytes, avail / 4);
  bytes = std::max(unit, bytes / unit * unit);
  NodeBuffer buf(numa, bytes);
  float* data = reinterpret_cast<float*>(buf.data());
  const size_t per_thread = bytes / 4 / T;
  pool.Run([&](int t, int) { std::fill_n(data + t * per_thread, per_thread, 1.0f); });  // first touch
  std::vector<float> sums(static_cast<size_t>(T) * 16);
  auto sum = [&](int t, int) {
    const float* p = data + t * per_thread;
    sums[t * 16] = avx512 ? SumAvx512(p, per_thread) : SumPlain(p, per_thread);
  };
  constexpr int kRuns = 7;
  pool.Run(sum);  // warm-up
  std::vector<double> gbps;
  for (int r = 0; r < kRuns; ++r) {
    const Clock::time_point t0 = Clock::now();
    pool.Run(sum);
    gbps.push_back(static_cast<double>(bytes) / Seconds(t0) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  float checksum = 0;
  for (int t = 0; t < T; ++t) checksum += sums[t * 16];
  if (!(checksum > 0)) Die("DRAM bandwidth: the sum of ones is not positive");
  DramBandwidth r;
  r.gbps = gbps[kRuns / 2];
  r.max_gbps = gbps.back();
  r.bytes = static_cast<double>(bytes);
  r.runs = kRuns;
  r.note = absl::StrCat(static_cast<double>(bytes) / kGiB, " GiB, ", T, " threads, min ", gbps.front(),
                        " max ", gbps.back(), " GB/s");
  return r;
}


}  // namespace moe
