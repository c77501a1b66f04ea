// expert_kernels: how fast the CPU expert kernels run through the real path
// (PackExpert-packed weights, MoeExecutor::Forward on the pinned ComputePool),
// for each storage format of --formats (bf16, int8, int4), side by side with
// oneDNN's matmuls (bf16 with bf16, int8 with int8) and the DRAM read bandwidth
// measured in the same run. Method: /work/shared/PERF.md ("How to benchmark").
//
//  1. Machine: CPU brand and ISA, NUMA binding, threads, L3, oneDNN, date.
//  2. DRAM read bandwidth: every pool thread (pinned) sums its slice of a
//     --bw-gib buffer with AVX-512 loads; median of >= 5 runs; GB = 1e9 bytes.
//     With AMX-BF16 (and not --no-peak): the bf16 kernels' ceiling, the bare
//     2x2 tile loop (bench/amx_peak.h) with its operands in L1 or streamed
//     from L2, at 1 thread, half and all of the pool's; median of 5 runs.
//     With AMX-INT8 also the int8 loop with one activation row per token,
//     its sums kept in the tiles or scaled per 128-K or 64-K block.
//  Then, per shape and format, with the kernels that Supports() the format:
//  3. Per expert: m tokens all routed (k = 1) to one expert, rotated call by
//     call over C copies with C x packed expert bytes >= max(1 GiB, 3 x L3), so
//     weights come from DRAM. The copies are expert 0 of the model packed once
//     by PackExpert in the format's geometry (ExpertGeometry::For(H, I, format),
//     int4 group 128), then copied: same values, distinct memory. Each kernel
//     is first checked on random data against an f64 reference (bf16:
//     ReferenceMoe; int8/int4: the MoE of the weights the packed experts stand
//     for, UnpackExpert, as kernel_test does): relative L2 error <= 1e-2
//     (int4: 3e-2), else FAIL and exit 1.
//     oneDNN (bf16): gate+up as one matmul [m,H]x[H,2I], then down [m,I]x[I,H],
//     bf16 in and out, weights in the blocked layout oneDNN picks (reordered
//     once), rotated over copies likewise. SiLU*mul is NOT timed for oneDNN
//     (down reads a fixed random activation); our kernels include it.
//     onednn-int8 (int8): the same two plain matmuls with u8 activations, s8
//     weights and f32 out scaled per output channel: a plain int8 matmul, not
//     our chain (no activation quantization, no hi/lo pair, no SiLU*mul).
//  4. Whole layer: as many experts of one MoE layer as fit in 60% of
//     MemAvailable (or --layer-experts) hosted in one ExpertStore in the
//     format. decode = 8 tokens x top-8 over 64 distinct experts (spread;
//     rotated over disjoint sets call by call); prefill = --prefill-tokens (512) x top-8
//     uniform over all experts of the model, pairs to unhosted experts dropped
//     (what a server hosting a subset sees). oneDNN rows: the per-expert
//     matmuls looped over the distinct experts, weights from the rotation.
// Timing: 3 warm-up calls, then the median of >= 10 calls (5 with --quick)
// lasting >= --min-seconds in total. FLOPs = 2 x pairs x 3 x H x I; weight
// bytes per call = distinct experts x packed expert bytes (int scales and sums
// included; oneDNN: its blocked weights), weight GB/s = those bytes / time.
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/flags.h"
#include "core/log.h"
#include "model/model_source.h"
#include "testing/random_data.h"
#include "model/reference_moe.h"
#include "model/routing.h"
#include "model/synthetic_model.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/cpu_features.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/moe_executor.h"
#include "expert_compute/numa_binding.h"
#include "expert_compute/packed_index.h"
#include "bench/amx_peak.h"
#include "bench/dram_bandwidth.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSeed = 2026;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr double kMaxError = 1e-2, kMaxErrorInt4 = 3e-2;
constexpr int kReferenceMaxTokens = 16;  // the scalar kernel is timed up to this m only
constexpr int kDecodeTokens = 8, kDecodeExperts = 64, kTopK = 8;

struct Options {
  std::string shapes = "deepseek-v3,qwen3-30b-a3b";
  std::string tokens = "1,4,16,64,256,1024";
  std::string prefill_tokens = "512";  // tokens of each whole-layer prefill case
  std::vector<int> prefill_list;       // --prefill-tokens, parsed
  std::string formats = "bf16";
  std::vector<WeightFormat> format_list;  // --formats, parsed
  std::string kernels;
  std::string numa_node = "auto";
  std::string csv;
  int64_t threads = 0;
  int64_t layer_experts = 0;
  int64_t int4_group = ExpertGeometry::kDefaultInt4Group;
  double bw_gib = 4;
  double min_seconds = 0.5;
  bool quick = false;
  bool with_reference = false;
  bool peak = true;
  int min_runs = 10;
  std::string command;  // for the report
};

// One measured configuration: a row of a Markdown table and of the CSV.
struct Result {
  std::string section, shape, case_name, format, impl;
  int tokens = 0;                      // m per expert, or tokens of the layer batch
  int hosted = 0;                      // experts hosted (whole layer)
  double distinct = 0;                 // experts touched per call
  double seconds = 0;                  // median per call
  double flops = 0, weight_bytes = 0;  // per call
  int runs = 0;
  std::string note;
};

// Set-up of one shape in one format, for the shapes table.
struct ShapeInfo {
  std::string shape, format;
  int H = 0, I = 0, copies = 0, hosted = 0, num_experts = 0;
  double expert_mb = 0, copies_load_s = 0, layer_load_s = 0;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "expert_kernels: %s\n", what.c_str());
  std::exit(1);
}
void DieIf(const absl::Status& st, const char* what) {
  if (!st.ok()) Die(absl::StrCat(what, ": ", st.ToString()));
}
template <typename T>
T ValueOrDie(absl::StatusOr<T> v, const char* what) {
  DieIf(v.status(), what);
  return *std::move(v);
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// 3 significant digits, no exponent below 1000.
std::string Num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, v >= 1000 ? "%.0f" : "%.3g", v);
  return b;
}

std::vector<std::string> SplitList(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipEmpty());
}

std::vector<int> ParseInts(const std::string& text, const char* flag) {
  std::vector<int> out;
  for (const std::string& s : SplitList(text)) {
    int v;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) Die(absl::StrCat("--", flag, ": bad count '", s, "'"));
    out.push_back(v);
  }
  if (out.empty()) Die(absl::StrCat("--", flag, ": empty list"));
  return out;
}

// --formats: bf16, int8, int4, fp8, mxfp4 (comma list, each at most once, at least one).
absl::StatusOr<std::vector<WeightFormat>> ParseFormats(const std::string& text) {
  std::vector<WeightFormat> out;
  for (const std::string& s : SplitList(text)) {
    WeightFormat f;
    if (s == "bf16") {
      f = WeightFormat::kBf16;
    } else if (s == "int8") {
      f = WeightFormat::kInt8;
    } else if (s == "int4") {
      f = WeightFormat::kInt4;
    } else if (s == "fp8") {
      f = WeightFormat::kFp8;
    } else if (s == "mxfp4") {
      f = WeightFormat::kMxfp4;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--formats: unknown format '", s, "' (bf16, int8, int4, fp8, mxfp4)"));
    }
    if (std::find(out.begin(), out.end(), f) != out.end())
      return absl::InvalidArgumentError(absl::StrCat("--formats: '", s, "' listed twice"));
    out.push_back(f);
  }
  if (out.empty()) return absl::InvalidArgumentError("--formats: empty (a comma list of bf16, int8, int4, fp8, mxfp4)");
  return out;
}

std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Copies (>= 2) of `bytes` that together hold at least `rotated` bytes.
int CopiesFor(uint64_t rotated, uint64_t bytes) {
  return static_cast<int>(std::max<uint64_t>(2, (rotated + bytes - 1) / bytes));
}
size_t Round4K(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// L3 bytes (per package) from sysconf, else sysfs; 0 if unknown.
uint64_t L3CacheBytes() {
  const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (v > 0) return static_cast<uint64_t>(v);
  std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index3/size");
  uint64_t kb = 0;
  return in >> kb ? kb * 1024 : 0;  // "32768K"
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm;
  gmtime_r(&t, &tm);
  char b[64];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M UTC", &tm);
  return b;
}

// Warm-up calls, then timed calls until >= min_runs and >= min_seconds in
// total. call(i) gets a running index (for rotation). Returns the median
// seconds per call and the number of timed calls.
template <typename Call>
std::pair<double, int> TimeMedian(const Options& o, Call&& call) {
  constexpr int kWarmup = 3, kMaxRuns = 100000;
  int i = 0;
  for (; i < kWarmup; ++i) call(i);
  std::vector<double> s;
  double total = 0;
  while ((static_cast<int>(s.size()) < o.min_runs || total < o.min_seconds) &&
         static_cast<int>(s.size()) < kMaxRuns) {
    const Clock::time_point t0 = Clock::now();
    call(i++);
    s.push_back(Seconds(t0));
    total += s.back();
  }
  std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
  return {s[s.size() / 2], static_cast<int>(s.size())};
}

// MoeExecutor's phase times (ForwardStats) summed over the timed calls.
struct PhaseTimes {
  double ns[4] = {0, 0, 0, 0};
  void Add(const ForwardStats& s) {
    ns[0] += s.gather_ns;
    ns[1] += s.gate_up_ns;
    ns[2] += s.down_ns;
    ns[3] += s.combine_ns;
  }
  // ", gather/gate-up/down/combine a/b/c/d%" (shares of their sum).
  std::string Note() const {
    const double all = std::max(1.0, ns[0] + ns[1] + ns[2] + ns[3]);
    return absl::StrCat(", gather/gate-up/down/combine ", Num(100 * ns[0] / all), "/", Num(100 * ns[1] / all), "/",
                        Num(100 * ns[2] / all), "/", Num(100 * ns[3] / all), "%");
  }
};

// DRAM read bandwidth (bench/dram_bandwidth.h)

double MeasureDramBandwidth(const Options& o, const NumaBinding& numa, ComputePool& pool, bool avx512,
                            Result* result) {
  const DramBandwidth bw = MeasureDramBandwidth(numa, pool, o.bw_gib, avx512);
  result->section = "dram";
  result->impl = avx512 ? "avx512 loads" : "scalar loads";
  result->seconds = bw.bytes / bw.gbps / 1e9;
  result->weight_bytes = bw.bytes;
  result->runs = bw.runs;
  result->note = bw.note;
  return bw.gbps;
}

// Median seconds of ComputePool::Run with an empty task: the fixed cost of the
// one parallel region of every MoeExecutor::Forward.
double MeasureDispatch(ComputePool& pool) {
  std::vector<double> s;
  for (int i = 0; i < 1001; ++i) {
    const Clock::time_point t0 = Clock::now();
    pool.Run([](int, int) {});
    s.push_back(Seconds(t0));
  }
  std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
  return s[s.size() / 2];
}

// ---------------------------------------------------------------------------
// Packed weights and the reference they are checked against

// Copies (>= 2, `rotated` bytes' worth) of one expert packed by PackExpert in
// geometry g, hosted as experts 0..copies-1 of `layer`: packed once, then
// copied (same values, distinct memory, which is what matters for caching).
class PackedCopies : public PackedExperts {
 public:
  PackedCopies(const ExpertGeometry& g, const ExpertWeights& w, int layer, uint64_t rotated,
               const NumaBinding& numa, ComputePool& pool)
      : g_(g),
        layer_(layer),
        copies_(CopiesFor(rotated, g.packed_bytes())),
        stride_(Round4K(g.packed_bytes())),
        buf_(numa, stride_ * copies_) {
    std::memset(buf_.data(), 0, stride_);
    PackExpert(g_, w.gate.data(), w.up.data(), w.down.data(), buf_.data());
    pool.Run([&](int t, int nt) {
      for (int c = 1 + t; c < copies_; c += nt) std::memcpy(buf_.data() + c * stride_, buf_.data(), stride_);
    });
  }
  const ExpertGeometry& geometry() const override { return g_; }
  const std::byte* Find(int layer, int expert) const override {
    return HostsLayer(layer) && HostsExpert(expert) ? buf_.data() + expert * stride_ : nullptr;
  }
  bool HostsLayer(int layer) const override { return layer == layer_; }
  bool HostsExpert(int expert) const override { return expert >= 0 && expert < copies_; }
  int num_experts() const override { return copies_; }

 private:
  const ExpertGeometry g_;
  const int layer_, copies_;
  const size_t stride_;
  NodeBuffer buf_;
};

// The f64 MoE output the executor is checked against: ReferenceMoe over the
// model's weights for bf16 experts; for int8/int4 the MoE of the weights the
// packed experts stand for (UnpackExpert, as kernel_test does), so the check
// sees the kernel's error (activation quantization included), not the format's.
class Reference {
 public:
  Reference(const ModelSource& source, const PackedExperts& packed) : moe_(source), packed_(packed) {}
  double tolerance() const {
    return packed_.geometry().format == WeightFormat::kInt4 ? kMaxErrorInt4 : kMaxError;
  }
  // out[H]: token x's output under its k pairs (ids -1: dropped).
  void Row(int layer, const bf16_t* x, int k, const int32_t* ids, const float* weights, double* out) {
    const ExpertGeometry& g = packed_.geometry();
    if (!g.quantized()) {
      DieIf(moe_.Forward<double>(layer, 1, x, RoutingView{1, k, ids, weights}, out), "ReferenceMoe");
      return;
    }
    const int H = g.H, I = g.I;
    w_.resize(size_t{3} * I * H);
    xf_.resize(H);
    act_.resize(I);
    for (int h = 0; h < H; ++h) xf_[h] = Bf16ToF32(x[h]);
    std::fill(out, out + H, 0.0);
    float *gate = w_.data(), *up = gate + size_t{1} * I * H, *down = up + size_t{1} * I * H;
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0) continue;
      UnpackExpert(g, packed_.Find(layer, ids[j]), gate, up, down);
      AddExpertOutput<double>(gate, up, down, H, I, xf_.data(), weights[j], act_.data(), out);
    }
  }

 private:
  ReferenceMoe moe_;
  const PackedExperts& packed_;
  std::vector<float> w_;
  std::vector<double> xf_, act_;
};

// ---------------------------------------------------------------------------
// oneDNN side by side

// oneDNN's plain matmuls for one expert shape in one precision, over copies
// (>= 2, `rotated` bytes' worth) of the weights in the blocked layout oneDNN
// picks for m = 1 (copy 0 reordered once, then copied: same values, distinct
// memory). Primitives for each m are made on first use; an m for which oneDNN
// would pick another layout gets the copies' layout forced (dnnl::error if
// refused). Either precision times gate+up [m,H]x[H,2I] then down [m,I]x[I,H]
// back to back, without the SiLU*mul between them (down reads a fixed random
// activation):
//   kBf16  bf16 in and out; the expert's weights.
//   kInt8  u8 in, s8 weights, f32 out scaled by one f32 per output channel
//          (output scales set in the primitive, shared by the copies: oneDNN
//          2.6 leaves brgemm for gemm:jit with runtime scales). Inputs and
//          weights are random bytes: a plain int8 matmul pair, not our chain
//          (no activation quantization, no hi/lo pair, no SiLU*mul).
class DnnlExpert {
 public:
  enum class Precision { kBf16, kInt8 };

  DnnlExpert(Precision precision, const ExpertWeights& w, int H, int I, uint64_t rotated,
             const NumaBinding& numa, ComputePool& pool, dnnl::engine& engine, dnnl::stream& stream)
      : int8_(precision == Precision::kInt8), engine_(engine), stream_(stream), H_(H), I_(I) {
    gate_up_md_ = Desc(1, H_, 2 * I_, Any(H_, 2 * I_)).weights_desc();
    down_md_ = Desc(1, I_, H_, Any(I_, H_)).weights_desc();
    const size_t gu_bytes = Round4K(gate_up_md_.get_size());
    const size_t stride = gu_bytes + Round4K(down_md_.get_size());
    copies_ = CopiesFor(rotated, stride);
    buf_ = std::make_unique<NodeBuffer>(numa, stride * copies_);
    for (int c = 0; c < copies_; ++c) {
      gate_up_w_.emplace_back(gate_up_md_, engine_, buf_->data() + c * stride);
      down_w_.emplace_back(down_md_, engine_, buf_->data() + c * stride + gu_bytes);
    }
    ReorderFirstCopy(w);
    pool.Run([&](int t, int nt) {
      for (int c = 1 + t; c < copies_; c += nt) std::memcpy(buf_->data() + c * stride, buf_->data(), stride);
    });
  }

  const char* name() const { return int8_ ? "onednn-int8" : "oneDNN"; }
  // Bytes of one copy's weights as oneDNN stores them (read per call).
  double weight_bytes() const { return static_cast<double>(gate_up_md_.get_size() + down_md_.get_size()); }
  // The implementation oneDNN picked for m rows, e.g. "brg:avx512_core_amx_bf16".
  std::string Impl(int m) { return For(m).impl; }
  // Queues gate+up then down for m rows with weight copy `copy` (mod copies).
  void Run(int m, int copy) {
    Matmuls& mm = For(m);
    const int c = copy % copies_;
    mm.gate_up.execute(stream_,
                       {{DNNL_ARG_SRC, mm.src}, {DNNL_ARG_WEIGHTS, gate_up_w_[c]}, {DNNL_ARG_DST, mm.mid}});
    mm.down.execute(stream_,
                    {{DNNL_ARG_SRC, mm.act}, {DNNL_ARG_WEIGHTS, down_w_[c]}, {DNNL_ARG_DST, mm.dst}});
  }
  void Wait() { stream_.wait(); }

 private:
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  struct Matmuls {
    dnnl::matmul gate_up, down;
    dnnl::memory src, mid, act, dst;
    std::string impl;
  };

  dt SrcType() const { return int8_ ? dt::u8 : dt::bf16; }
  dt WeightType() const { return int8_ ? dt::s8 : dt::bf16; }
  dt DstType() const { return int8_ ? dt::f32 : dt::bf16; }
  dnnl::memory::desc Any(int K, int N) const { return {{K, N}, WeightType(), tag::any}; }
  dnnl::matmul::primitive_desc Desc(int m, int K, int N, const dnnl::memory::desc& weights) {
    const dnnl::memory::desc src({m, K}, SrcType(), tag::ab);
    const dnnl::memory::desc dst({m, N}, DstType(), tag::ab);
    dnnl::primitive_attr attr;
    if (int8_) attr.set_output_scales(1 << 1, Scales(N));
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, engine_);
  }
  // oneDNN's choice for m rows, or the copies' layout when it would choose another.
  dnnl::matmul::primitive_desc Pick(int m, int K, int N, const dnnl::memory::desc& layout) {
    dnnl::matmul::primitive_desc pd = Desc(m, K, N, Any(K, N));
    return pd.weights_desc() == layout ? pd : Desc(m, K, N, layout);
  }
  // Copy 0 of the weights, reordered from plain W [N, K] (bf16: the expert's
  // gate rows then up rows, and down; int8: random s8).
  void ReorderFirstCopy(const ExpertWeights& w) {
    std::vector<bf16_t> gate_up(w.gate);
    gate_up.insert(gate_up.end(), w.up.begin(), w.up.end());
    std::vector<uint8_t> gu8, down8;
    void* gu_data = gate_up.data();
    void* down_data = const_cast<bf16_t*>(w.down.data());
    if (int8_) {
      gu8 = RandomBytes(size_t{2} * I_ * H_, kSeed + 11);
      down8 = RandomBytes(size_t{1} * I_ * H_, kSeed + 12);
      gu_data = gu8.data();
      down_data = down8.data();
    }
    dnnl::memory plain_gu({{H_, 2 * I_}, WeightType(), tag::ba}, engine_, gu_data);
    dnnl::memory plain_down({{I_, H_}, WeightType(), tag::ba}, engine_, down_data);
    dnnl::reorder(plain_gu, gate_up_w_[0]).execute(stream_, plain_gu, gate_up_w_[0]);
    dnnl::reorder(plain_down, down_w_[0]).execute(stream_, plain_down, down_w_[0]);
    stream_.wait();
  }
  static std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; i += 8) {
      const uint64_t r = rng();
      std::memcpy(v.data() + i, &r, std::min<size_t>(8, n - i));
    }
    return v;
  }
  dnnl::memory Random(const dnnl::memory::desc& md, uint64_t seed) {
    dnnl::memory mem(md, engine_);
    if (md.data_type() == dt::bf16) {
      const std::vector<bf16_t> v = RandomActivations(md.get_size() / 2, seed);
      std::memcpy(mem.get_data_handle(), v.data(), md.get_size());
    } else {
      const std::vector<uint8_t> v = RandomBytes(md.get_size(), seed);
      std::memcpy(mem.get_data_handle(), v.data(), md.get_size());
    }
    return mem;
  }
  // n per-channel scales around 1/127 (the values do not change the time).
  static std::vector<float> Scales(int n) {
    std::vector<float> s(n);
    for (int i = 0; i < n; ++i) s[i] = (1.0f + (i % 7) / 8.0f) / 127.0f;
    return s;
  }
  Matmuls& For(int m) {
    auto it = matmuls_.find(m);
    if (it != matmuls_.end()) return it->second;
    const dnnl::matmul::primitive_desc gu = Pick(m, H_, 2 * I_, gate_up_md_);
    const dnnl::matmul::primitive_desc down = Pick(m, I_, H_, down_md_);
    Matmuls mm{dnnl::matmul(gu),
               dnnl::matmul(down),
               Random(gu.src_desc(), kSeed + m),
               dnnl::memory(gu.dst_desc(), engine_),
               Random(down.src_desc(), kSeed + 7 * m),
               dnnl::memory(down.dst_desc(), engine_),
               gu.impl_info_str()};
    if (std::string(down.impl_info_str()) != mm.impl) mm.impl += absl::StrCat(" / ", down.impl_info_str());
    return matmuls_.emplace(m, std::move(mm)).first->second;
  }

  const bool int8_;
  dnnl::engine& engine_;
  dnnl::stream& stream_;
  const int H_, I_;
  int copies_ = 0;
  dnnl::memory::desc gate_up_md_, down_md_;
  std::unique_ptr<NodeBuffer> buf_;
  std::vector<dnnl::memory> gate_up_w_, down_w_;
  std::map<int, Matmuls> matmuls_;
};

// ---------------------------------------------------------------------------
// The benchmark

// A routing of n tokens x k pairs (ids -1 for pairs not sent to this server).
struct Routing {
  int n = 0, k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  RoutingView view() const { return {n, k, ids.data(), weights.data()}; }
};

using Kernels = std::vector<std::unique_ptr<ExpertKernel>>;

class Benchmark {
 public:
  explicit Benchmark(Options o) : o_(std::move(o)), cpu_(CpuFeatures::Get()) {
    numa_ = ValueOrDie(NumaBinding::Create(o_.numa_node, static_cast<int>(o_.threads)), "NUMA binding");
    pool_ = std::make_unique<ComputePool>(*numa_);
    SelectKernels();
    PinOneDnnThreads();
    l3_bytes_ = L3CacheBytes();
  }

  void Run() {
    Result bw;
    dram_gbps_ = MeasureDramBandwidth(o_, *numa_, *pool_, cpu_.avx512f && cpu_.os_avx512, &bw);
    results_.push_back(bw);
    LogInfo("bench", "DRAM read bandwidth ", Num(dram_gbps_), " GB/s (", bw.note, ")");
    dispatch_s_ = MeasureDispatch(*pool_);
    if (cpu_.HasAmxBf16() && o_.peak) amx_peaks_ = MeasureAmxPeaks(*pool_, o_.quick ? 0.02 : 0.1, cpu_.HasAmxInt8());
    for (const std::string& shape : SplitList(o_.shapes)) RunShape(shape);
  }

  // Prints every section as Markdown; writes the CSV. Returns the exit code.
  int Report() const;

 private:
  void SelectKernels();
  void PinOneDnnThreads();
  void RunShape(const std::string& shape);
  void RunFormat(const ModelSpec& spec, const ModelSource& source, WeightFormat format, const Kernels& kernels,
                 const std::vector<bf16_t>& tokens, ShapeInfo info);
  std::unique_ptr<DnnlExpert> MakeDnnl(WeightFormat format, const ExpertWeights& w, const ModelSpec& spec);
  void PerExpertCases(const ModelSpec& spec, const ModelSource& source, const Kernels& kernels,
                      const PackedExperts& copies, DnnlExpert* dnnl, const std::vector<bf16_t>& tokens,
                      const Result& base);
  void WholeLayerCases(const ModelSpec& spec, const ModelSource& source, const Kernels& kernels,
                       const ExpertGeometry& g, DnnlExpert* dnnl, const std::vector<bf16_t>& tokens,
                       ShapeInfo* info);
  void LayerCase(const ModelSpec& spec, const ExpertStore& store, Reference& ref, const Kernels& kernels,
                 DnnlExpert* dnnl, const std::vector<bf16_t>& tokens, const std::vector<Routing>& routings,
                 Result base);
  std::unique_ptr<ExpertStore> LoadStore(const ModelSource& source, const ExpertGeometry& g, int layer,
                                         int experts, double* seconds);
  // Relative L2 error of the executor's f32 output against the reference on
  // token rows `rows` of `batch`; records FAIL above the format's bound.
  std::string Check(MoeExecutor& ex, Reference& ref, const MoeBatch& batch, int H, std::vector<int> rows,
                    const std::string& what);
  // Fills the derived columns of r (FLOPs, weight bytes) and keeps it.
  void Add(Result r, const ModelSpec& spec, double pairs, double distinct, double expert_bytes);
  // Rows of one section, by shape (in --shapes order), then case, then m.
  std::vector<const Result*> Sorted(const std::string& section) const;
  void PrintSetup() const;
  void WriteCsv() const;

  Options o_;
  const CpuFeatures& cpu_;
  std::unique_ptr<NumaBinding> numa_;
  std::unique_ptr<ComputePool> pool_;
  std::vector<std::pair<WeightFormat, Kernels>> kernels_;  // per format of --formats
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  std::string onednn_threads_;
  uint64_t l3_bytes_ = 0;
  double dram_gbps_ = 0;
  double dispatch_s_ = 0;
  std::vector<AmxPeak> amx_peaks_;
  std::vector<Result> results_;
  std::vector<ShapeInfo> shapes_;
  int failures_ = 0;
};

// Per format, the kernels that Supports() it on this CPU: amx and avx512 (and
// reference with --with-reference), or the --kernels named (each must).
void Benchmark::SelectKernels() {
  std::vector<std::string> names = SplitList(o_.kernels);
  if (o_.kernels.empty()) {
    names = {"amx", "avx512"};
    if (o_.with_reference) names.push_back("reference");
  }
  for (WeightFormat f : o_.format_list) {
    Kernels kernels;
    for (const std::string& n : names) {
      absl::StatusOr<std::unique_ptr<ExpertKernel>> k = MakeExpertKernel(n, cpu_, f);
      if (k.ok() && (*k)->Supports(f)) {
        kernels.push_back(*std::move(k));
      } else if (!o_.kernels.empty()) {
        Die(absl::StrCat("--kernels: ", k.ok() ? absl::StrCat(n, " does not compute ", WeightFormatName(f))
                                               : k.status().ToString()));
      }
    }
    if (kernels.empty())
      Die(absl::StrCat("no kernel to benchmark ", WeightFormatName(f), " weights (this CPU has ", cpu_.Summary(),
                       "; add --with-reference)"));
    kernels_.emplace_back(f, std::move(kernels));
  }
}

// oneDNN (OpenMP build) gets as many threads as the pool: its workers 1..T-1
// pinned to the pool's PUs 1..T-1. Thread 0 is this (calling) thread, left
// unpinned like the caller of MoeExecutor::Forward: pinning it next to pool
// worker 0 would charge every Forward for the two sharing one core.
void Benchmark::PinOneDnnThreads() {
#ifdef _OPENMP
  const int T = pool_->size();
  omp_set_num_threads(T);
  int pinned = 0;
#pragma omp parallel num_threads(T) reduction(+ : pinned)
  pinned += omp_get_thread_num() == 0 || numa_->BindCurrentThread(omp_get_thread_num()).ok() ? 1 : 0;
  onednn_threads_ =
      absl::StrCat(T, " OpenMP threads, ", pinned == T ? "workers pinned to the pool's PUs" : "not pinned");
#else
  onednn_threads_ = "OpenMP default (set OMP_NUM_THREADS; this build has no OpenMP)";
#endif
}

std::unique_ptr<ExpertStore> Benchmark::LoadStore(const ModelSource& source, const ExpertGeometry& g, int layer,
                                                  int experts, double* seconds) {
  const Clock::time_point t0 = Clock::now();
  std::unique_ptr<ExpertStore> store = ValueOrDie(
      ExpertStore::Load(source, g, HostedSet{{layer}, Iota(experts)}, *numa_, *pool_), "ExpertStore::Load");
  *seconds = Seconds(t0);
  LogInfo("bench", "packed ", experts, " experts ", WeightFormatName(g.format), " (",
          Num(store->resident_bytes() / 1e9), " GB) in ", Num(*seconds), " s");
  return store;
}

std::string Benchmark::Check(MoeExecutor& ex, Reference& ref, const MoeBatch& batch, int H,
                             std::vector<int> rows, const std::string& what) {
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  std::vector<float> out(static_cast<size_t>(batch.n) * H);
  DieIf(ex.Forward(batch, DType::kF32, out.data(), nullptr), "Forward");
  std::vector<float> got;
  std::vector<double> want(rows.size() * H);
  const int k = batch.routing.k;
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t r = rows[i];
    got.insert(got.end(), out.begin() + r * H, out.begin() + (r + 1) * H);
    ref.Row(batch.layer, batch.tokens + r * H, k, batch.routing.ids + r * k, batch.routing.weights + r * k,
            want.data() + i * H);
  }
  const double err = RelativeL2Error(got.data(), want.data(), got.size());
  if (err <= ref.tolerance()) return absl::StrCat("err ", Num(err));
  ++failures_;
  std::fprintf(stderr, "FAIL %s: relative error %g > %g against the reference\n", what.c_str(), err,
               ref.tolerance());
  return absl::StrCat("FAIL err ", Num(err));
}

void Benchmark::Add(Result r, const ModelSpec& spec, double pairs, double distinct, double expert_bytes) {
  r.flops = 2.0 * pairs * 3.0 * spec.hidden * spec.intermediate;
  r.distinct = distinct;
  r.weight_bytes = distinct * expert_bytes;
  LogInfo("bench", r.shape, " ", r.case_name, " m=", r.tokens, " ", r.format, " ", r.impl, ": ",
          Num(r.seconds * 1e3), " ms, ", Num(r.weight_bytes / r.seconds / 1e9), " GB/s, ",
          Num(r.flops / r.seconds / 1e12), " TFLOP/s (", r.runs, " runs) ", r.note);
  results_.push_back(std::move(r));
}

void Benchmark::RunShape(const std::string& shape) {
  const ModelSpec spec = ValueOrDie(PresetSpec(shape), "--shapes");
  ShapeInfo info;
  info.shape = shape;
  info.H = spec.hidden;
  info.I = spec.intermediate;
  info.num_experts = spec.num_experts;
  const std::unique_ptr<ModelSource> source = MakeSyntheticSource(spec, kSeed);
  const std::vector<int> ms = ParseInts(o_.tokens, "tokens");
  const int max_rows = std::max(*std::max_element(ms.begin(), ms.end()),
                                *std::max_element(o_.prefill_list.begin(), o_.prefill_list.end()));
  const std::vector<bf16_t> tokens =
      RandomActivations(static_cast<size_t>(max_rows) * spec.hidden, kSeed + 1);
  for (const auto& [format, kernels] : kernels_) RunFormat(spec, *source, format, kernels, tokens, info);
}

// oneDNN's side for a format: bf16 matmuls for bf16 and fp8 (the bf16 weights
// an fp8 expert stands for: what computing it without an fp8 kernel costs),
// int8 ones for int8, none for int4 and mxfp4 (or when oneDNN refuses).
std::unique_ptr<DnnlExpert> Benchmark::MakeDnnl(WeightFormat format, const ExpertWeights& w,
                                                const ModelSpec& spec) {
  if (format == WeightFormat::kInt4 || format == WeightFormat::kMxfp4) return nullptr;
  const auto precision =
      format == WeightFormat::kInt8 ? DnnlExpert::Precision::kInt8 : DnnlExpert::Precision::kBf16;
  try {
    return std::make_unique<DnnlExpert>(precision, w, spec.hidden, spec.intermediate,
                                        std::max(kGiB, 3 * l3_bytes_), *numa_, *pool_, engine_, stream_);
  } catch (const dnnl::error& e) {
    LogWarning("bench", "oneDNN ", WeightFormatName(format), " skipped: ", e.what());
    return nullptr;
  }
}

void Benchmark::RunFormat(const ModelSpec& spec, const ModelSource& source, WeightFormat format,
                          const Kernels& kernels, const std::vector<bf16_t>& tokens, ShapeInfo info) {
  const int layer = spec.moe_layers.front();
  const ExpertGeometry g =
      ExpertGeometry::For(spec.hidden, spec.intermediate, format, format == WeightFormat::kInt4 ? static_cast<int>(o_.int4_group) : 0);
  info.format = WeightFormatName(format);
  info.expert_mb = g.packed_bytes() / 1e6;
  ExpertWeights w;
  DieIf(source.ReadExpert(layer, 0, &w), "expert 0");
  const std::unique_ptr<DnnlExpert> dnnl = MakeDnnl(format, w, spec);
  {
    // Enough copies that the rotation does not fit in cache.
    const Clock::time_point t0 = Clock::now();
    const PackedCopies copies(g, w, layer, std::max(kGiB, 3 * l3_bytes_), *numa_, *pool_);
    info.copies = copies.num_experts();
    info.copies_load_s = Seconds(t0);
    LogInfo("bench", info.shape, " ", info.format, ": H=", spec.hidden, " I=", spec.intermediate, ", ",
            info.copies, " copies of ", Num(info.expert_mb), " MB rotated (L3 ", l3_bytes_ >> 20, " MiB)");
    Result base;
    base.section = "expert";
    base.shape = info.shape;
    base.format = info.format;
    base.case_name = "1 expert";
    PerExpertCases(spec, source, kernels, copies, dnnl.get(), tokens, base);
  }
  WholeLayerCases(spec, source, kernels, g, dnnl.get(), tokens, &info);
  shapes_.push_back(info);
}

void Benchmark::PerExpertCases(const ModelSpec& spec, const ModelSource& source, const Kernels& kernels,
                               const PackedExperts& copies, DnnlExpert* dnnl, const std::vector<bf16_t>& tokens,
                               const Result& base) {
  const int layer = spec.moe_layers.front(), H = spec.hidden, n_copies = copies.num_experts();
  const double expert_bytes = static_cast<double>(copies.geometry().packed_bytes());
  Reference ref(source, copies);
  std::vector<std::unique_ptr<MoeExecutor>> executors;
  for (const auto& k : kernels) executors.push_back(std::make_unique<MoeExecutor>(copies, *k, *pool_));
  std::vector<bf16_t> out;
  for (int m : ParseInts(o_.tokens, "tokens")) {
    std::vector<int32_t> ids(m, 0);
    const std::vector<float> weights(m, 1.0f);
    const MoeBatch batch{layer, m, tokens.data(), RoutingView{m, 1, ids.data(), weights.data()}};
    out.resize(static_cast<size_t>(m) * H);
    for (size_t i = 0; i < kernels.size(); ++i) {
      if (std::string(kernels[i]->name()) == "reference" && m > kReferenceMaxTokens) continue;
      Result r = base;
      r.tokens = m;
      r.impl = kernels[i]->name();
      std::fill(ids.begin(), ids.end(), 0);
      r.note = Check(*executors[i], ref, batch, H, {0, m / 2, m - 1},
                     absl::StrCat(r.shape, " ", r.format, " m=", m, " ", r.impl));
      PhaseTimes phases;
      std::tie(r.seconds, r.runs) = TimeMedian(o_, [&](int call) {
        std::fill(ids.begin(), ids.end(), call % n_copies);
        ForwardStats stats;
        DieIf(executors[i]->Forward(batch, DType::kBF16, out.data(), &stats), "Forward");
        phases.Add(stats);
      });
      r.note += phases.Note();
      Add(std::move(r), spec, m, 1, expert_bytes);
    }
    if (dnnl == nullptr) continue;
    Result r = base;
    r.tokens = m;
    r.impl = dnnl->name();
    try {
      r.note = dnnl->Impl(m);
      std::tie(r.seconds, r.runs) = TimeMedian(o_, [&](int call) {
        dnnl->Run(m, call);
        dnnl->Wait();
      });
      Add(std::move(r), spec, m, 1, dnnl->weight_bytes());
    } catch (const dnnl::error& e) {
      LogWarning("bench", r.impl, " m=", m, ": ", e.what());
    }
  }
}

// decode: token t -> experts spread over the hosted ones, variant v shifted by v
// (disjoint sets while v < hosted / 64); weights random, summing to 1 per token.
std::vector<Routing> DecodeRoutings(int hosted) {
  std::vector<Routing> out;
  for (int v = 0; v < std::max(1, hosted / kDecodeExperts); ++v) {
    Routing r{kDecodeTokens, kTopK, {}, {}};
    RandomRouting(r.n, r.k, hosted, kSeed + v, 0.0, &r.ids, &r.weights);
    for (int i = 0; i < r.n * r.k; ++i) r.ids[i] = (i * hosted / kDecodeExperts + v) % hosted;
    out.push_back(std::move(r));
  }
  return out;
}

// prefill: uniform top-k over every expert of the model; pairs to experts this
// server does not host (ids >= hosted) are dropped, as the coordinator would.
std::vector<Routing> PrefillRoutings(int tokens, int num_experts, int hosted) {
  std::vector<Routing> out;
  for (int v = 0; v < 3; ++v) {
    Routing r{tokens, kTopK, {}, {}};
    RandomRouting(r.n, r.k, num_experts, kSeed + 100 + v, 0.0, &r.ids, &r.weights);
    for (int32_t& e : r.ids) e = e < hosted ? e : -1;
    out.push_back(std::move(r));
  }
  return out;
}

void Benchmark::WholeLayerCases(const ModelSpec& spec, const ModelSource& source, const Kernels& kernels,
                                const ExpertGeometry& g, DnnlExpert* dnnl, const std::vector<bf16_t>& tokens,
                                ShapeInfo* info) {
  const int layer = spec.moe_layers.front();
  const std::string& shape = info->shape;
  const uint64_t stride = ExpertStore::BytesNeeded(g, HostedSet{{layer}, {0}});
  const uint64_t fit = static_cast<uint64_t>(0.6 * static_cast<double>(AvailableMemoryBytes())) / stride;
  const int hosted = o_.layer_experts > 0 ? std::min<int>(o_.layer_experts, spec.num_experts)
                                          : static_cast<int>(std::min<uint64_t>(spec.num_experts, fit));
  info->hosted = hosted;
  if (hosted < 1) {
    LogWarning("bench", shape, " ", info->format,
               ": whole-layer cases skipped: not one expert fits in 60% of MemAvailable");
    return;
  }
  const std::unique_ptr<ExpertStore> store = LoadStore(source, g, layer, hosted, &info->layer_load_s);
  Reference ref(source, *store);
  Result base;
  base.section = "layer";
  base.shape = shape;
  base.format = info->format;
  base.hosted = hosted;
  base.case_name = "decode";
  if (hosted >= kDecodeExperts) {
    LayerCase(spec, *store, ref, kernels, dnnl, tokens, DecodeRoutings(hosted), base);
  } else {
    const std::string why =
        absl::StrCat("skipped: needs ", kDecodeExperts, " hosted experts, only ", hosted,
                     o_.layer_experts > 0 ? " (--layer-experts)" : " fit in 60% of MemAvailable");
    LogWarning("bench", shape, " ", info->format, ": decode ", why);
    Result r = base;
    r.impl = "-";
    r.tokens = kDecodeTokens;
    r.note = why;
    results_.push_back(r);
  }
  base.case_name = "prefill";
  for (int n : o_.prefill_list)
    LayerCase(spec, *store, ref, kernels, dnnl, tokens, PrefillRoutings(n, spec.num_experts, hosted), base);
}

// One whole-layer case (base.case_name) over its routing variants, call by
// call: every kernel, then the oneDNN loop when dnnl is given.
void Benchmark::LayerCase(const ModelSpec& spec, const ExpertStore& store, Reference& ref,
                          const Kernels& kernels, DnnlExpert* dnnl, const std::vector<bf16_t>& tokens,
                          const std::vector<Routing>& routings, Result base) {
  const int layer = spec.moe_layers.front(), n = routings.front().n;
  const int variants = static_cast<int>(routings.size());
  // Per variant, the rows of each distinct expert (for oneDNN) and the averages.
  std::vector<std::vector<int>> counts(variants);
  double pairs = 0, distinct = 0;
  ExpertGroups groups;
  std::vector<MoeBatch> batches;
  for (int v = 0; v < variants; ++v) {
    GroupByExpert(routings[v].view(), spec.num_experts, 1, &groups);
    counts[v] = groups.count;
    pairs += groups.total_pairs / double(variants);
    distinct += groups.num_groups() / double(variants);
    batches.push_back({layer, n, tokens.data(), routings[v].view()});
  }
  std::vector<bf16_t> out(static_cast<size_t>(n) * spec.hidden);
  base.tokens = n;
  const bool decode = base.case_name == "decode";
  for (const auto& kernel : kernels) {
    if (std::string(kernel->name()) == "reference" && !decode) continue;
    MoeExecutor ex(store, *kernel, *pool_);
    Result r = base;
    r.impl = kernel->name();
    r.note = Check(ex, ref, batches[0], spec.hidden, {0, n - 1},
                   absl::StrCat(r.shape, " ", r.format, " ", r.case_name, " ", r.impl));
    PhaseTimes phases;
    std::tie(r.seconds, r.runs) = TimeMedian(o_, [&](int call) {
      ForwardStats stats;
      DieIf(ex.Forward(batches[call % variants], DType::kBF16, out.data(), &stats), "Forward");
      phases.Add(stats);
    });
    r.note += phases.Note();
    Add(std::move(r), spec, pairs, distinct, static_cast<double>(store.geometry().packed_bytes()));
  }
  if (dnnl == nullptr) return;
  Result r = base;
  r.impl = absl::StrCat(dnnl->name(), " loop");
  try {
    for (const auto& v : counts) {
      for (int m : v) dnnl->Impl(m);  // make every primitive before timing
    }
    int copy = 0;
    std::tie(r.seconds, r.runs) = TimeMedian(o_, [&](int call) {
      for (int m : counts[call % variants]) dnnl->Run(m, copy++);
      dnnl->Wait();
    });
    r.note = dnnl->Impl(counts[0][0]);
    Add(std::move(r), spec, pairs, distinct, dnnl->weight_bytes());
  } catch (const dnnl::error& e) {
    LogWarning("bench", r.impl, " ", r.case_name, ": ", e.what());
  }
}

void PrintTable(const std::string& title, const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::printf("\n## %s\n\n| %s |\n|", title.c_str(), absl::StrJoin(header, " | ").c_str());
  for (size_t i = 0; i < header.size(); ++i) std::printf(" --- |");
  std::printf("\n");
  for (const auto& row : rows) std::printf("| %s |\n", absl::StrJoin(row, " | ").c_str());
}

std::vector<const Result*> Benchmark::Sorted(const std::string& section) const {
  const std::vector<std::string> shapes = SplitList(o_.shapes);
  auto key = [&](const Result* r) {
    return std::make_tuple(std::find(shapes.begin(), shapes.end(), r->shape) - shapes.begin(), r->case_name,
                           r->tokens);
  };
  std::vector<const Result*> v;
  for (const Result& r : results_) {
    if (r.section == section) v.push_back(&r);
  }
  std::stable_sort(v.begin(), v.end(), [&](const Result* a, const Result* b) { return key(a) < key(b); });
  return v;
}

// The machine, DRAM bandwidth and shapes tables.
void Benchmark::PrintSetup() const {
  std::string kernels;
  for (const auto& [format, ks] : kernels_) {
    absl::StrAppend(&kernels, kernels.empty() ? "" : "; ", WeightFormatName(format), ": ",
                    absl::StrJoin(ks, ", ", [](std::string* s, const auto& k) { s->append(k->name()); }));
  }
  PrintTable("Machine", {"item", "value"},
             {{"date", UtcNow()},
              {"CPU", cpu_.brand},
              {"ISA", cpu_.Summary()},
              {"topology", numa_->Describe()},
              {"command", o_.command},
              {"compute threads", absl::StrCat(pool_->size())},
              {"kernels", kernels},
              {"ComputePool::Run, empty task", absl::StrCat(Num(dispatch_s_ * 1e6), " us (median of 1001)")},
              {"L3", absl::StrCat(l3_bytes_ >> 20, " MiB")},
              {"memory available", absl::StrCat(Num(AvailableMemoryBytes() / 1e9), " GB")},
              {"oneDNN", absl::StrCat(dnnl_version()->major, ".", dnnl_version()->minor, ".",
                                      dnnl_version()->patch, ", ", onednn_threads_)}});
  std::vector<std::vector<std::string>> rows;
  for (const Result& r : results_) {
    if (r.section == "dram")
      rows.push_back({r.impl, Num(r.weight_bytes / r.seconds / 1e9), absl::StrCat(r.runs), r.note});
  }
  PrintTable("DRAM read bandwidth (median)", {"method", "GB/s", "runs", "detail"}, rows);
  rows.clear();
  for (const AmxPeak& p : amx_peaks_)
    rows.push_back({p.operands, absl::StrCat(p.threads), Num(p.tflops), absl::StrCat(Num(p.min_tflops), "-", Num(p.max_tflops)),
                    absl::StrCat(p.runs)});
  if (!rows.empty())
    PrintTable("AMX tile loops alone (2x2 tiles, K = 2048; the ceiling of the bf16 kernels; int8 rows: what one "
               "int8 activation row per token would reach, TOPS)",
               {"operands", "threads", "TFLOP/s or TOPS (median)", "min-max", "runs"}, rows);
  rows.clear();
  for (const ShapeInfo& s : shapes_) {
    rows.push_back({s.shape, s.format, absl::StrCat(s.H), absl::StrCat(s.I), Num(s.expert_mb),
                    absl::StrCat(s.copies), Num(s.copies * s.expert_mb / 1e3), Num(s.copies_load_s),
                    absl::StrCat(s.hosted, " / ", s.num_experts), Num(s.layer_load_s)});
  }
  PrintTable("Shapes",
             {"shape", "format", "H", "I", "packed expert MB", "copies rotated", "rotated GB", "pack + copy s",
              "layer experts hosted", "layer pack s"},
             rows);
}

int Benchmark::Report() const {
  PrintSetup();
  auto measured = [&](const Result& r, std::vector<std::string> row) {
    const double gbps = r.weight_bytes / r.seconds / 1e9;
    for (const std::string& s : {Num(r.weight_bytes / 1e6), Num(r.seconds * 1e3), Num(r.flops / r.seconds / 1e12),
                                 Num(gbps), Num(100 * gbps / dram_gbps_), absl::StrCat(r.runs), r.note}) {
      row.push_back(s);
    }
    return row;
  };
  std::vector<std::vector<std::string>> rows;
  for (const Result* r : Sorted("expert"))
    rows.push_back(measured(*r, {r->shape, absl::StrCat(r->tokens), r->format, r->impl}));
  PrintTable("Per expert: m tokens -> 1 expert (k = 1), weights rotated over copies",
             {"shape", "m", "format", "impl", "weight MB/call", "ms", "TFLOP/s", "weight GB/s", "% DRAM", "runs",
              "check / oneDNN impl"},
             rows);
  rows.clear();
  for (const Result* r : Sorted("layer")) {
    std::vector<std::string> row = {r->shape,         r->case_name, absl::StrCat(r->tokens, "x", kTopK),
                                    absl::StrCat(r->hosted), Num(r->distinct), r->format, r->impl};
    if (r->seconds > 0) {
      rows.push_back(measured(*r, row));
    } else {
      row.insert(row.end(), {"-", "-", "-", "-", "-", "-", r->note});
      rows.push_back(row);
    }
  }
  PrintTable("Whole layer through MoeExecutor::Forward (oneDNN: per-expert matmuls looped)",
             {"shape", "case", "tokens", "hosted", "experts/call", "format", "impl", "weight MB/call", "ms",
              "TFLOP/s", "weight GB/s", "% DRAM", "runs", "check / oneDNN impl"},
             rows);
  std::printf(
      "\nFLOPs = 2 x pairs x 3 x H x I; weight MB/call = distinct experts x packed expert bytes (int8/int4 "
      "scales and sums included; oneDNN: its blocked weights), weight GB/s = those bytes / time; %% DRAM of the "
      "%s GB/s measured above. oneDNN times gate+up [m,H]x[H,2I] and down [m,I]x[I,H] back to back (bf16 in/out; "
      "onednn-int8: u8 x s8 -> f32 with per-channel scales), without the SiLU*mul between them; our kernels "
      "include it (int8/int4: and the activations' hi/lo quantization). %% DRAM can pass 100: the probe is one "
      "plain streaming sum, not an absolute ceiling.\n\n",
      Num(dram_gbps_).c_str());
  if (failures_ > 0)
    std::printf("\n**FAIL: %d kernel check(s) above the relative error bound (%g; int4 %g)**\n", failures_,
                kMaxError, kMaxErrorInt4);
  if (!o_.csv.empty()) WriteCsv();
  return failures_ > 0 ? 1 : 0;
}

void Benchmark::WriteCsv() const {
  std::ofstream csv(o_.csv);
  csv << "section,shape,case,format,impl,tokens,hosted,experts_per_call,weight_bytes,ms,tflops,weight_gbps,"
         "pct_dram,runs,note\n";
  for (const Result& r : results_) {
    const double s = r.seconds > 0 ? r.seconds : NAN;
    const double gbps = r.weight_bytes / s / 1e9;
    csv << r.section << ',' << r.shape << ',' << r.case_name << ',' << r.format << ',' << r.impl << ','
        << r.tokens << ',' << r.hosted << ',' << r.distinct << ',' << r.weight_bytes << ',' << s * 1e3 << ','
        << r.flops / s / 1e12 << ',' << gbps << ',' << 100 * gbps / dram_gbps_ << ',' << r.runs << ",\""
        << r.note << "\"\n";
  }
  if (!csv) Die(absl::StrCat("--csv: cannot write ", o_.csv));
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::Options o;
  const moe::Options defaults;
  moe::FlagSet flags(
      "expert_kernels",
      "Benchmarks the CPU expert kernels (amx, avx512[, reference]) through MoeExecutor::Forward\n"
      "in each storage format of --formats, against oneDNN's bf16 (and int8) matmul and the measured\n"
      "DRAM read bandwidth; prints Markdown tables for bench/RESULTS.md.\n"
      "Smoke run: expert_kernels --quick --shapes qwen3-30b-a3b --formats bf16,int8,int4");
  flags.Int("threads", &o.threads,
            "compute threads (0 = one per core of the NUMA node); oneDNN gets as many");
  flags.String("numa-node", &o.numa_node, "NUMA node to run and allocate on: auto or an index");
  flags.String("shapes", &o.shapes, "model presets whose expert geometry to use (comma list)");
  flags.String("tokens", &o.tokens, "tokens per expert m for the per-expert cases (comma list)");
  flags.String("formats", &o.formats,
               "storage formats of the packed experts: bf16, int8, int4, fp8, mxfp4 (comma list; int4 --int4-group, fp8 group 128, mxfp4 32)");
  flags.Int("int4-group", &o.int4_group, "int4's scale group: 128, 32 (Kimi-K2's) or another multiple of 64");
  flags.String("kernels", &o.kernels,
               "kernels (amx, avx512, reference; comma list); empty = all this CPU has for each format");
  flags.Bool("with-reference", &o.with_reference, "also time the scalar reference kernel (m <= 16, decode)");
  flags.Bool("quick", &o.quick,
             "smoke run: m in 1,16,256, >= 5 runs, 0.05 s per case, 1 GiB bandwidth buffer");
  flags.Int("layer-experts", &o.layer_experts,
            "experts hosted for the whole-layer cases (0 = all that fit in 60% of MemAvailable)");
  flags.String("prefill-tokens", &o.prefill_tokens, "tokens of the whole-layer prefill cases, top-8 each (comma list)");
  flags.Double("bw-gib", &o.bw_gib,
               "GiB read by the DRAM bandwidth measurement (clamped to 1/4 of MemAvailable)");
  flags.Bool("peak", &o.peak, "measure the AMX tile loops alone first: bf16 TFLOP/s, and int8 TOPS with AMX-INT8 (CPUs with AMX)");
  flags.Double("min-seconds", &o.min_seconds, "minimum total timed seconds per case");
  flags.String("csv", &o.csv, "also write every row to this CSV file");
  if (!flags.Parse(argc, argv).empty()) flags.Fail("takes no positional arguments");
  o.command = absl::StrJoin(argv, argv + argc, " ");
  absl::StatusOr<std::vector<moe::WeightFormat>> formats = moe::ParseFormats(o.formats);
  if (!formats.ok()) flags.Fail(std::string(formats.status().message()));
  o.format_list = *std::move(formats);
  if (!moe::layout::Int4GroupServed(static_cast<int>(o.int4_group))) flags.Fail("--int4-group: 32 or a multiple of 64");
  if (o.quick) {
    o.min_runs = 5;
    if (o.tokens == defaults.tokens) o.tokens = "1,16,256";
    if (o.min_seconds == defaults.min_seconds) o.min_seconds = 0.05;
    if (o.bw_gib == defaults.bw_gib) o.bw_gib = 1;
  }
  if (o.bw_gib <= 0 || o.min_seconds < 0 || o.threads < 0 || o.layer_experts < 0)
    flags.Fail("negative or zero sizes");
  moe::ParseInts(o.tokens, "tokens");  // a bad list fails here, before the probes run
  o.prefill_list = moe::ParseInts(o.prefill_tokens, "prefill-tokens");
  moe::Benchmark bench(o);
  bench.Run();
  return bench.Report();
}
