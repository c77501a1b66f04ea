// gpu_experts: the cuda backend's hit experts (RunExperts: the grouped
// kernels up to 64 rows per expert for bf16 and 256 for the packed formats, cuBLAS above) per storage format — bf16
// slots, int8, int4, fp8 and mxfp4 packed slots — at 1 to 64 and more rows per expert,
// against the bounds measured in the same run: HBM bandwidth (a device-to-
// device copy) for the weight stream, cuBLAS's bf16 GEMM rate for the
// tensor cores. Prints, per geometry and rows per expert, the median time of
// one RunExperts over `--experts` experts (each in its own buffer, rotated
// over twice as many buffers so that no run finds them in L2), min-max over
// `--runs` runs, each packed format's time as a share of bf16's, and each format's
// weight rate and FLOP rate against the bounds; then the kernels' own time: the
// same calls enqueued back to back and timed on the GPU (CUDA events around
// the run of calls, divided by their number), which leaves out what one call
// costs the host (the plan's upload enqueued, two launches, the wait) while the
// GPU would be idle. Then the latency of moving
// rows between the GPU and host memory (GatherRows / AddRows, registered vs
// pageable; MOE_CUDA_MAPPED_WRITE_MAX_BYTES=0 forces the DMA path for
// registered memory).
//
// Needs an NVIDIA GPU: exits 0 with a line saying so elsewhere.
#include <cuda_runtime_api.h>
#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/bf16.h"
#include "core/flags.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/packed_index.h"
#include "gpu_worker/device_backend.h"
#include "testing/packed_expert.h"
#include "testing/random_data.h"

namespace moe {
namespace {

struct Shape {
  std::string name;
  int H, I;
};

struct Stat {
  double median = 0, lo = 0, hi = 0;
};

Stat Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

#define BENCH_CUDA(x)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "gpu_experts: %s: %s\n", #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// Device-to-device copy rate: reads + writes per second, the HBM bound.
double HbmBytesPerSecond(int runs) {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  BENCH_CUDA(cudaMalloc(&a, bytes));
  BENCH_CUDA(cudaMalloc(&b, bytes));
  BENCH_CUDA(cudaMemset(a, 1, bytes));
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {
    BENCH_CUDA(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    BENCH_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) rates.push_back(2.0 * bytes / s);
  }
  cudaFree(a);
  cudaFree(b);
  return Summarize(rates).median;
}

// cuBLAS bf16 GEMM (f32 accumulate) at 8192^3: the tensor-core bound.
double GemmFlopsPerSecond(int runs) {
  const int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  BENCH_CUDA(cudaMalloc(&a, elems * 2));
  BENCH_CUDA(cudaMalloc(&b, elems * 2));
  BENCH_CUDA(cudaMalloc(&c, elems * 4));
  BENCH_CUDA(cudaMemset(a, 0x3f, elems * 2));  // 0x3f3f: a finite bf16
  BENCH_CUDA(cudaMemset(b, 0x3f, elems * 2));
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "gpu_experts: cublasCreate failed\n");
    std::exit(1);
  }
  const float one = 1.f, zero = 0.f;
  std::vector<double> rates;
  for (int r = 0; r < runs + 1; ++r) {
    BENCH_CUDA(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c,
                     CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "gpu_experts: cublasGemmEx failed\n");
      std::exit(1);
    }
    BENCH_CUDA(cudaDeviceSynchronize());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) rates.push_back(2.0 * n * double(n) * n / s);
  }
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return Summarize(rates).median;
}

struct Options {
  int experts = 32, runs = 3, reps = 20, int4_group = 128;
  std::vector<int> rows;
};

struct Timing {
  std::map<int, Stat> call;  // one RunExperts + its wait, host clock (median of o.reps per run)
  std::map<int, Stat> gpu;   // o.reps calls back to back, GPU time per call (per run)
};

// Seconds of one RunExperts over o.experts experts with `rows` rows each,
// per run, in `format`: each call alone, and calls back to back on the GPU.
Timing TimeFormat(const Shape& s, WeightFormat format, const Options& o) {
  std::unique_ptr<DeviceBackend> backend = *MakeDeviceBackend("cuda");
  const int buffers = 2 * o.experts, max_rows = *std::max_element(o.rows.begin(), o.rows.end());
  const int T = std::max(512, max_rows);
  BackendConfig c;
  c.hidden = s.H;
  c.intermediate = s.I;
  c.num_buffers = buffers;
  c.max_tokens = T;
  c.max_top_k = 8;
  c.format = format;
  c.int4_group = format == WeightFormat::kInt4 ? o.int4_group : 0;
  if (absl::Status st = backend->Init(c); !st.ok()) {
    std::fprintf(stderr, "gpu_experts: Init: %s\n", std::string(st.message()).c_str());
    std::exit(1);
  }
  std::vector<PackedExpert> made;
  for (int i = 0; i < 4; ++i) made.push_back(MakePackedExpert(s.H, s.I, format, 20261126, i, false, c.int4_group));
  for (int b = 0; b < buffers; ++b) {
    absl::StatusOr<uint64_t> f = backend->LoadExpert(b, made[b % 4].bytes.get(), 0);
    if (!f.ok() || !backend->WaitCopy(*f).ok()) {
      std::fprintf(stderr, "gpu_experts: LoadExpert failed\n");
      std::exit(1);
    }
  }
  const std::vector<bf16_t> x = RandomActivations(static_cast<size_t>(T) * s.H, 7);
  std::vector<bf16_t> out(static_cast<size_t>(T) * s.H);
  Timing result;
  for (int rows : o.rows) {
    ExpertGroups g;
    std::vector<int32_t> buffer(o.experts);
    const int align = backend->hit_row_align();
    for (int e = 0; e < o.experts; ++e) {
      g.expert.push_back(e);
      g.row_begin.push_back(static_cast<int32_t>(g.token.size()));
      g.count.push_back(rows);
      for (int r = 0; r < rows; ++r) {
        g.token.push_back((e * 7 + r * 13) % T);
        g.weight.push_back(0.5f);
      }
      while (g.token.size() % align != 0) g.token.push_back(-1), g.weight.push_back(0.f);
    }
    g.total_rows = static_cast<int32_t>(g.token.size());
    g.total_pairs = o.experts * rows;
    const auto run_experts = [&](int i) {
      for (int e = 0; e < o.experts; ++e) buffer[e] = (e + (i % 2) * o.experts) % buffers;
      if (!backend->RunExperts(0, HitPlan{&g, buffer.data()}).ok()) std::exit(1);
    };
    std::vector<double> per_run, gpu_per_run;
    for (int run = 0; run < o.runs; ++run) {
      if (!backend->BeginCall(0, T, x.data(), MemoryKind::kHost).ok()) std::exit(1);
      std::vector<double> t;
      for (int i = 0; i < o.reps + 2; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        run_experts(i);
        if (!backend->WaitCompute(backend->RecordCompute()).ok()) std::exit(1);
        if (i >= 2) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      const uint64_t from = backend->MarkCompute();
      for (int i = 0; i < o.reps; ++i) run_experts(i);
      const uint64_t to = backend->MarkCompute();
      if (!backend->WaitCompute(backend->RecordCompute()).ok()) std::exit(1);
      const std::optional<double> gpu_s = backend->ComputeSeconds(from, to);
      if (!gpu_s) {
        std::fprintf(stderr, "gpu_experts: no GPU time for the calls back to back\n");
        std::exit(1);
      }
      if (!backend->FinishCall(0, out.data(), MemoryKind::kHost).ok()) std::exit(1);
      per_run.push_back(Summarize(t).median);
      gpu_per_run.push_back(*gpu_s / o.reps);
    }
    result.call[rows] = Summarize(per_run);
    result.gpu[rows] = Summarize(gpu_per_run);
  }
  return result;
}

// Median microseconds of GatherRows / AddRows of n rows to registered and
// pageable host memory (DeepSeek-V3's H), printed as a table.
void TransferLatency() {
  const int H = 7168, T = 256;
  std::unique_ptr<DeviceBackend> backend = *MakeDeviceBackend("cuda");
  BackendConfig c;
  c.hidden = H;
  c.intermediate = 2048;
  c.num_buffers = 0;
  c.max_tokens = T;
  if (!backend->Init(c).ok()) std::exit(1);
  const size_t n = static_cast<size_t>(T) * H;
  std::vector<bf16_t> registered(2 * n), pageable(2 * n);
  if (!backend->RegisterHost(registered.data(), registered.size() * sizeof(bf16_t)).ok()) std::exit(1);
  const std::vector<bf16_t> x = RandomActivations(n, 5);
  if (!backend->BeginCall(0, T, x.data(), MemoryKind::kHost).ok()) std::exit(1);
  std::vector<int32_t> rows(T);
  for (int i = 0; i < T; ++i) rows[i] = i;
  auto median_us = [&](auto&& op) {
    std::vector<double> t;
    for (int i = 0; i < 30; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<uint64_t> f = op();
      if (!f.ok() || !backend->WaitCompute(*f).ok()) std::exit(1);
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    return Summarize(t).median;
  };
  std::printf("\n## Rows between GPU and host (H %d), median of 30\n\n"
              "| rows | bytes | GatherRows registered us | pageable us | AddRows registered us | pageable us |\n"
              "|---|---|---|---|---|---|\n", H);
  for (int rn : {1, 8, 32, 256}) {
    const double gr = median_us([&] { return backend->GatherRows(0, rows.data(), rn, registered.data()); });
    const double gp = median_us([&] { return backend->GatherRows(0, rows.data(), rn, pageable.data()); });
    const double ar = median_us([&] { return backend->AddRows(0, rows.data(), rn, registered.data() + n); });
    const double ap = median_us([&] { return backend->AddRows(0, rows.data(), rn, pageable.data() + n); });
    std::printf("| %d | %zu | %.1f | %.1f | %.1f | %.1f |\n", rn, static_cast<size_t>(rn) * H * 2, gr, gp, ar, ap);
  }
  std::vector<bf16_t> out(n);
  if (!backend->FinishCall(0, out.data(), MemoryKind::kHost).ok()) std::exit(1);
  backend->UnregisterHost(registered.data());
}

constexpr int kF = 5;
constexpr WeightFormat kFormats[kF] = {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kInt4, WeightFormat::kFp8,
                                       WeightFormat::kMxfp4};

// One table: per rows per expert, each format's time, its share of bf16's and
// its rates against the bounds.
void PrintTable(const Shape& s, const char* what, const std::map<int, Stat> (&t)[kF], const double (&bytes)[kF],
                double hbm, double peak, const Options& o) {
  std::printf("\n## %s (H %d, I %d)%s\n\n", s.name.c_str(), s.H, s.I, what);
  std::string head = "| rows/expert |", names, rule = "|---|";
  for (int f = 0; f < kF; ++f) {
    const std::string n = kFormats[f] == WeightFormat::kInt4 ? absl::StrCat("int4 (group ", o.int4_group, ")")
                                                             : WeightFormatName(kFormats[f]);
    absl::StrAppend(&head, " ", n, " us |");
    absl::StrAppend(&names, f ? " / " : "", WeightFormatName(kFormats[f]));
    rule += "---|";
  }
  for (int f = 1; f < kF; ++f) absl::StrAppend(&head, " ", WeightFormatName(kFormats[f]), "/bf16 |"), rule += "---|";
  absl::StrAppend(&head, " ", names, " % of HBM | ", names, " % of GEMM peak |");
  rule += "---|---|";
  std::printf("%s\n%s\n", head.c_str(), rule.c_str());
  for (int rows : o.rows) {
    const double flops = 2.0 * 3.0 * s.H * double(s.I) * rows * o.experts;
    std::string line = absl::StrCat("| ", rows, " |");
    for (int f = 0; f < kF; ++f)
      absl::StrAppend(&line, absl::StrFormat(" %.0f [%.0f-%.0f] |", t[f].at(rows).median * 1e6, t[f].at(rows).lo * 1e6,
                                             t[f].at(rows).hi * 1e6));
    for (int f = 1; f < kF; ++f)
      absl::StrAppend(&line, absl::StrFormat(" %.2f |", t[f].at(rows).median / t[0].at(rows).median));
    for (const bool bw : {true, false}) {
      for (int f = 0; f < kF; ++f) {
        const double pct = 100.0 * (bw ? bytes[f] / hbm : flops / peak) / t[f].at(rows).median;
        absl::StrAppend(&line, f ? " / " : " ", bw ? absl::StrFormat("%.0f", pct) : absl::StrFormat("%.1f", pct));
      }
      absl::StrAppend(&line, " |");
    }
    std::printf("%s\n", line.c_str());
  }
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  using namespace moe;
  std::string shapes_text = "deepseek-v3,qwen3-30b-a3b", rows_text = "1,2,4,8,16,24,32,48,64,128";
  int64_t experts = 32, runs = 3, reps = 20, int4_group = 128;
  FlagSet flags("gpu_experts", "[--shapes LIST] [--rows LIST] [--experts N] [--runs N]\n"
                               "The cuda backend's hit experts per storage format vs HBM and tensor-core bounds.");
  flags.String("shapes", &shapes_text,
               "comma list of deepseek-v3 (H 7168, I 2048), qwen3-30b-a3b (H 2048, I 768) and gpt-oss (H = I = 2880)");
  flags.String("rows", &rows_text, "rows per expert: a list such as 1,2,8-16 (each in [1, 512])");
  flags.Int("experts", &experts, "experts per RunExperts");
  flags.Int("runs", &runs, "runs per row (median and min-max are printed)");
  flags.Int("reps", &reps, "calls per run (their median is the run's time)");
  flags.Int("int4-group", &int4_group, "int4's scale group: 128, 32 (Kimi-K2's) or another multiple of 64");
  flags.Parse(argc, argv);
  Options o;
  o.experts = static_cast<int>(experts);
  o.runs = static_cast<int>(runs);
  o.reps = static_cast<int>(reps);
  o.int4_group = static_cast<int>(int4_group);
  if (!layout::Int4GroupServed(o.int4_group)) flags.Fail("--int4-group: 32 or a multiple of 64");
  if (o.experts < 1 || o.experts > 256 || o.runs < 1 || o.reps < 1) flags.Fail("--experts in [1, 256], --runs and --reps >= 1");
  absl::StatusOr<std::vector<int>> rows = ParseIndexList(rows_text, 513, "rows");
  if (!rows.ok() || rows->empty() || rows->front() < 1) flags.Fail("--rows: a list of counts in [1, 512], e.g. 1,8,16-64");
  o.rows = *rows;
  std::vector<Shape> shapes;
  for (absl::string_view n : absl::StrSplit(shapes_text, ',')) {
    if (n == "deepseek-v3") shapes.push_back({"deepseek-v3", 7168, 2048});
    else if (n == "qwen3-30b-a3b") shapes.push_back({"qwen3-30b-a3b", 2048, 768});
    else if (n == "gpt-oss") shapes.push_back({"gpt-oss", 2880, 2880});
    else flags.Fail("--shapes: unknown shape '" + std::string(n) + "'");
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu_experts: skipped (no CUDA device)\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double hbm = HbmBytesPerSecond(o.runs), peak = GemmFlopsPerSecond(o.runs);
  std::printf("# gpu_experts on %s: HBM (d2d copy) %.0f GB/s, cuBLAS bf16 GEMM 8192^3 %.0f TFLOP/s; "
              "%d experts per call, median [min-max] of %d runs x %d calls\n",
              prop.name, hbm / 1e9, peak / 1e12, o.experts, o.runs, o.reps);
  for (const Shape& s : shapes) {
    Timing timing[kF];
    double bytes[kF];
    for (int f = 0; f < kF; ++f) {
      timing[f] = TimeFormat(s, kFormats[f], o);
      const int group = kFormats[f] == WeightFormat::kInt4 ? o.int4_group : 0;
      bytes[f] = static_cast<double>(ExpertGeometry::For(s.H, s.I, kFormats[f], group).packed_bytes()) * o.experts;
    }
    for (const bool gpu : {false, true}) {
      std::map<int, Stat> t[kF];
      for (int f = 0; f < kF; ++f) t[f] = gpu ? timing[f].gpu : timing[f].call;
      PrintTable(s, gpu ? ": the kernels' own time (calls back to back, GPU time per call)" : ": one call and its wait",
                 t, bytes, hbm, peak, o);
    }
  }
  TransferLatency();
  return 0;
}
