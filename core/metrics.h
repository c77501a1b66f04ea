// Metrics: a small, thread-safe registry of counters, gauges and histograms,
// rendered in the Prometheus text exposition format 0.0.4 (served over HTTP
// by MetricsHttpServer, process/metrics_http.h).
//
// A metric *family* has a name, a help text, a type and label names; each set
// of label values is one *series*. Families and series are created rarely (at
// start-up, or the first time a label value is seen) and take a lock; a series
// lives as long as its registry and never moves, so callers keep a pointer to
// it and update it lock-free and allocation-free (relaxed atomics):
//
//   static Family<Counter>& requests = Metrics().AddCounter(
//       "moe_x_requests_total", "Requests answered.", {"transport", "code"});
//   Counter* ok = requests.WithLabels({"grpc", "OK"});   // once
//   ok->Increment();                                      // per request
//
// Thread safety: every method of every class here may be called from any
// thread. Render() sees each atomic at some recent value; a histogram's
// buckets, _count and _sum are read one by one (never torn, but _sum may lag
// the buckets by in-flight observations). _count is always the +Inf bucket.
//
// Misuse — an invalid metric or label name, one name registered with two
// different types/label names/buckets, the wrong number of label values — is a
// programming error: the process prints what was wrong and aborts.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// A monotonically increasing count (requests, tokens, bytes).
class alignas(64) Counter {
 public:
  void Increment(uint64_t by = 1) { value_.fetch_add(by, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down (threads, in-flight batches, a version).
class alignas(64) Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by) { value_.fetch_add(by, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A distribution over fixed buckets (upper bounds, ascending; +Inf is
// implicit). Observe() costs one bucket search and two relaxed atomics on
// the calling thread's shard: threads observing the same series at once
// (an expert server's compute threads) rarely share a cache line; the
// readers sum the shards.
class Histogram {
 public:
  explicit Histogram(const std::vector<double>* bounds);
  void Observe(double v);
  // Observes a duration given in nanoseconds, as seconds.
  void ObserveNanos(uint64_t ns) { Observe(static_cast<double>(ns) * 1e-9); }

  // Non-cumulative count of bucket i (i == bounds().size() is the +Inf bucket).
  uint64_t bucket_count(size_t i) const;
  uint64_t count() const;  // sum of every bucket
  double sum() const;
  const std::vector<double>& bounds() const { return *bounds_; }

 private:
  static constexpr int kShards = 4;
  struct alignas(64) Shard {
    std::unique_ptr<std::atomic<uint64_t>[]> counts;
    std::atomic<double> sum{0.0};
  };
  const std::vector<double>* bounds_;  // owned by the family
  Shard shards_[kShards];
};

// Latency buckets in seconds, 5 µs to 10 s (1-2.5-5 steps): 5e-6, 1e-5,
// 2.5e-5, ..., 5, 10.
std::vector<double> LatencyBuckets();
// count bounds: start, start*factor, start*factor^2, ... (start > 0, factor > 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// One metric family: its series by label values. T is Counter, Gauge or Histogram.
template <typename T>
class Family {
 public:
  // The series with these label values (one per label name, in order),
  // created (at zero) on first use. Takes a lock: look it up once and keep the
  // pointer, which stays valid as long as the registry.
  T* WithLabels(std::initializer_list<std::string_view> values);
  T* WithLabels(const std::vector<std::string>& values);
  // The only series of a family without labels.
  T* Get() { return WithLabels({}); }
  // Drops the series with these label values (e.g. of a worker that is gone):
  // it is no longer exported, and every pointer to it WithLabels returned is
  // invalid — only an owner that looks its series up again after removing
  // may call this. Returns whether there was one.
  bool Remove(const std::vector<std::string>& values);

  const std::string& name() const { return name_; }

 private:
  friend class MetricsRegistry;
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds);
  T* Find(std::vector<std::string> values);
  void Render(std::string* out) const;

  const std::string name_, help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> series_;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registers a family, or returns the one already registered under `name`
  // when type, help and label names (and buckets) match; aborts when they do
  // not. Names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: [a-zA-Z_][a-zA-Z0-9_]*,
  // not starting with "__" (and not "le" for histograms). A family without
  // labels has its one series from the start (exported as 0).
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names = {},
                                  std::vector<double> bounds = LatencyBuckets());

  // A function run at the start of every Render(), for values kept elsewhere
  // (e.g. set a gauge from a cache's state). It runs on the rendering thread
  // (the HTTP server's); it must not add or remove hooks. The hook is removed
  // when the returned handle is destroyed (waiting for a Render in progress),
  // so it may capture `this` of an object that owns the handle.
  class Hook {
   public:
    Hook() = default;
    Hook(Hook&& other) noexcept;
    Hook& operator=(Hook&& other) noexcept;
    ~Hook();

   private:
    friend class MetricsRegistry;
    Hook(MetricsRegistry* registry, uint64_t id) : registry_(registry), id_(id) {}
    MetricsRegistry* registry_ = nullptr;
    uint64_t id_ = 0;
  };
  [[nodiscard]] Hook AddScrapeHook(std::function<void()> hook);

  // Every family with at least one series, sorted by name, series sorted by
  // label values, in the text exposition format 0.0.4.
  std::string Render() const;

 private:
  struct Entry;
  template <typename T>
  Family<T>& Add(const char* type, const std::string& name, const std::string& help,
                 std::vector<std::string> label_names, std::vector<double> bounds);
  void RemoveHook(uint64_t id);

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Entry>> families_;
  mutable std::mutex hooks_mu_;  // held while hooks run
  uint64_t next_hook_ = 1;
  std::map<uint64_t, std::function<void()>> hooks_;
};

// The process-wide registry that /metrics serves. Never destroyed.
MetricsRegistry& Metrics();

// Exposition helpers (exposed for tests): a sample value as the Prometheus Go
// client writes it ("+Inf", "-Inf", "NaN", else the shortest text that reads
// back exactly: "0.0001", "5e-06", "1e+06"), and a label value with \\, \"
// and \n escaped.
std::string FormatMetricValue(double v);
std::string EscapeLabelValue(std::string_view v);

}  // namespace moe
