// metrics_hot_path: what one counter increment and one histogram observation
// cost on the request path, ours (core/metrics.h: relaxed atomics, a bucket
// search) against prometheus-cpp's (Debian's prometheus-cpp-dev 1.0.1), from
// 1 and from N threads hitting the same series (the expert server's compute
// threads share one series per status code). Prints ns per operation,
// medians of --runs runs with the spread. Built only when prometheus-cpp is
// installed (the service does not link it; see bench/README.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "core/flags.h"
#include "core/metrics.h"

namespace {

// ns per operation when `threads` threads each run `op` `iters` times at once.
double TimeNsPerOp(int threads, int64_t iters, const std::function<void(int64_t)>& op) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      for (int64_t i = 0; i < iters; ++i) op(i);
    });
  }
  while (ready.load() < threads) {
  }
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true);
  for (auto& t : ts) t.join();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  return ns / static_cast<double>(iters);  // wall time per operation of one thread
}

struct Summary {
  double median, lo, hi;
};

Summary Measure(int runs, int threads, int64_t iters, const std::function<void(int64_t)>& op) {
  std::vector<double> v;
  for (int r = 0; r < runs; ++r) v.push_back(TimeNsPerOp(threads, iters, op));
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t runs = 5, iters = 2'000'000, threads = std::max(2u, std::thread::hardware_concurrency());
  moe::FlagSet flags("metrics_hot_path", "[--runs N] [--iters N] [--threads N]\n"
                                         "ns per counter increment / histogram observation: ours vs prometheus-cpp.");
  flags.Int("runs", &runs, "runs per row (median and spread are printed)");
  flags.Int("iters", &iters, "operations per thread per run");
  flags.Int("threads", &threads, "threads of the contended rows (default: one per CPU)");
  flags.Parse(argc, argv);
  if (runs < 1 || iters < 1 || threads < 1) flags.Fail("--runs, --iters and --threads must be >= 1");

  moe::MetricsRegistry ours;
  moe::Counter* our_counter = ours.AddCounter("requests_total", "x", {"code"}).WithLabels({"OK"});
  moe::Histogram* our_hist = ours.AddHistogram("latency_seconds", "x", {"method"}).WithLabels({"Forward"});

  prometheus::Registry theirs;
  prometheus::Counter& their_counter =
      prometheus::BuildCounter().Name("requests_total").Help("x").Register(theirs).Add({{"code", "OK"}});
  const std::vector<double> bounds = moe::LatencyBuckets();
  prometheus::Histogram& their_hist = prometheus::BuildHistogram()
                                          .Name("latency_seconds")
                                          .Help("x")
                                          .Register(theirs)
                                          .Add({{"method", "Forward"}}, prometheus::Histogram::BucketBoundaries(bounds));
  // Latencies spread over the buckets as a server's are: 10 µs .. 10 ms.
  auto latency = [](int64_t i) { return 1e-5 * static_cast<double>(1 + (i * 7919) % 1000); };

  std::printf("# metrics_hot_path: ns per operation per thread, median [min, max] of %lld runs x %lld ops\n",
              static_cast<long long>(runs), static_cast<long long>(iters));
  std::printf("| operation | threads | ours (core/metrics.h) | prometheus-cpp 1.0 | prometheus-cpp / ours |\n");
  std::printf("|---|---|---|---|---|\n");
  for (int th : {1, static_cast<int>(threads)}) {
    const Summary oc = Measure(static_cast<int>(runs), th, iters, [&](int64_t) { our_counter->Increment(); });
    const Summary tc = Measure(static_cast<int>(runs), th, iters, [&](int64_t) { their_counter.Increment(); });
    const Summary oh = Measure(static_cast<int>(runs), th, iters, [&](int64_t i) { our_hist->Observe(latency(i)); });
    const Summary tcH = Measure(static_cast<int>(runs), th, iters, [&](int64_t i) { their_hist.Observe(latency(i)); });
    std::printf("| counter increment | %d | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | %.2f |\n", th, oc.median, oc.lo,
                oc.hi, tc.median, tc.lo, tc.hi, tc.median / oc.median);
    std::printf("| histogram observe | %d | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | %.2f |\n", th, oh.median, oh.lo,
                oh.hi, tcH.median, tcH.lo, tcH.hi, tcH.median / oh.median);
  }
  // Keep the values observable so nothing is optimised away.
  std::fprintf(stderr, "ours %llu / %llu, theirs %.0f\n", static_cast<unsigned long long>(our_counter->value()),
               static_cast<unsigned long long>(our_hist->count()), their_counter.Value());
  return 0;
}
