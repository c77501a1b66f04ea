#include "core/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace moe {

namespace {

// Misuse of the registry is a bug in the caller: say what it was and stop.
[[noreturn]] void Misuse(const std::string& what) {
  std::fprintf(stderr, "metrics: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

bool ValidName(std::string_view s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                    (allow_colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

std::string EscapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void AppendUint(std::string* out, uint64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, r.ptr);
}

// `name{a="x",b="y"` + extra label (for le) + `} `; no braces without labels.
void AppendSeriesName(std::string* out, const std::string& name, std::string_view suffix,
                      const std::vector<std::string>& label_names, const std::vector<std::string>& values,
                      std::string_view extra_label = {}, std::string_view extra_value = {}) {
  out->append(name).append(suffix);
  if (!label_names.empty() || !extra_label.empty()) {
    out->push_back('{');
    bool first = true;
    for (size_t i = 0; i < label_names.size(); ++i) {
      if (!first) out->push_back(',');
      first = false;
      out->append(label_names[i]).append("=\"").append(EscapeLabelValue(values[i])).push_back('"');
    }
    if (!extra_label.empty()) {
      if (!first) out->push_back(',');
      out->append(extra_label).append("=\"").append(extra_value).push_back('"');
    }
    out->push_back('}');
  }
  out->push_back(' ');
}

template <typename T>
std::unique_ptr<T> MakeSeries(const std::vector<double>*) {
  return std::make_unique<T>();
}
template <>
std::unique_ptr<Histogram> MakeSeries<Histogram>(const std::vector<double>* bounds) {
  return std::make_unique<Histogram>(bounds);
}

void RenderSeries(std::string* out, const std::string& name, const std::vector<std::string>& labels,
                  const std::vector<std::string>& values, const Counter& c, const std::vector<double>&) {
  AppendSeriesName(out, name, "", labels, values);
  AppendUint(out, c.value());
  out->push_back('\n');
}

void RenderSeries(std::string* out, const std::string& name, const std::vector<std::string>& labels,
                  const std::vector<std::string>& values, const Gauge& g, const std::vector<double>&) {
  AppendSeriesName(out, name, "", labels, values);
  out->append(FormatMetricValue(g.value())).push_back('\n');
}

void RenderSeries(std::string* out, const std::string& name, const std::vector<std::string>& labels,
                  const std::vector<std::string>& values, const Histogram& h, const std::vector<double>& bounds) {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    cumulative += h.bucket_count(i);
    const std::string le = i < bounds.size() ? FormatMetricValue(bounds[i]) : "+Inf";
    AppendSeriesName(out, name, "_bucket", labels, values, "le", le);
    AppendUint(out, cumulative);
    out->push_back('\n');
  }
  AppendSeriesName(out, name, "_sum", labels, values);
  out->append(FormatMetricValue(h.sum())).push_back('\n');
  AppendSeriesName(out, name, "_count", labels, values);
  AppendUint(out, cumulative);
  out->push_back('\n');
}

}  // namespace

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // As Go's strconv.FormatFloat(v, 'g', -1, 64), which the reference client
  // uses (so `le` labels read the same as everywhere else): the shortest digits
  // that read back exactly, in exponent form ("5e-06", "1.5e+10") when the
  // decimal exponent is < -4 or >= 6, else plain ("0.00025", "917504").
  char buf[40];
  const auto sci = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  const std::string_view s(buf, sci.ptr - buf);
  const char* e = s.data() + s.find('e') + 1;  // "-5" or "+21"
  int exp = 0;
  std::from_chars(*e == '+' ? e + 1 : e, s.data() + s.size(), exp);
  if (exp < -4 || exp >= 6) return std::string(s);
  const auto fixed = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  return std::string(buf, fixed.ptr);
}

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// ---- Histogram ------------------------------------------------------------

Histogram::Histogram(const std::vector<double>* bounds) : bounds_(bounds) {
  for (Shard& sh : shards_) {
    sh.counts.reset(new std::atomic<uint64_t>[bounds->size() + 1]);
    for (size_t i = 0; i <= bounds->size(); ++i) sh.counts[i].store(0, std::memory_order_relaxed);
  }
}

namespace {
// The calling thread's shard of every histogram: threads take them in turn.
int ThreadShard(int shards) {
  static std::atomic<unsigned> next{0};
  thread_local const unsigned mine = next.fetch_add(1, std::memory_order_relaxed);
  return static_cast<int>(mine % static_cast<unsigned>(shards));
}
}  // namespace

void Histogram::Observe(double v) {
  // First bucket whose upper bound is >= v ("le"); past the end is +Inf, where NaN goes too.
  const size_t i = std::isnan(v) ? bounds_->size()
                                 : std::lower_bound(bounds_->begin(), bounds_->end(), v) - bounds_->begin();
  Shard& sh = shards_[ThreadShard(kShards)];
  sh.counts[i].fetch_add(1, std::memory_order_relaxed);
  sh.sum.fetch_add(v, std::memory_order_relaxed);
}

uint64_t Histogram::bucket_count(size_t i) const {
  uint64_t n = 0;
  for (const Shard& sh : shards_) n += sh.counts[i].load(std::memory_order_relaxed);
  return n;
}

double Histogram::sum() const {
  double s = 0;
  for (const Shard& sh : shards_) s += sh.sum.load(std::memory_order_relaxed);
  return s;
}

uint64_t Histogram::count() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) n += bucket_count(i);
  return n;
}

std::vector<double> LatencyBuckets() {
  return {5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
          1e-2, 2.5e-2, 5e-2, 0.1,  0.25, 0.5,    1.0,  2.5,  5.0,  10.0};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0) || !(factor > 1) || count < 1) Misuse("ExponentialBuckets: need start > 0, factor > 1, count >= 1");
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

// ---- Family ---------------------------------------------------------------

template <typename T>
Family<T>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bounds)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)),
      bounds_(std::move(bounds)) {
  if (label_names_.empty()) Find({});
}

template <typename T>
T* Family<T>::Find(std::vector<std::string> values) {
  if (values.size() != label_names_.size())
    Misuse(name_ + ": " + std::to_string(values.size()) + " label values for " +
           std::to_string(label_names_.size()) + " label names");
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<T>& s = series_[std::move(values)];
  if (s == nullptr) s = MakeSeries<T>(&bounds_);
  return s.get();
}

template <typename T>
T* Family<T>::WithLabels(std::initializer_list<std::string_view> values) {
  return Find(std::vector<std::string>(values.begin(), values.end()));
}

template <typename T>
T* Family<T>::WithLabels(const std::vector<std::string>& values) {
  return Find(values);
}

template <typename T>
bool Family<T>::Remove(const std::vector<std::string>& values) {
  std::lock_guard<std::mutex> lock(mu_);
  return series_.erase(values) > 0;
}

template <typename T>
void Family<T>::Render(std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (series_.empty()) return;
  for (const auto& [values, series] : series_) RenderSeries(out, name_, label_names_, values, *series, bounds_);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- MetricsRegistry ------------------------------------------------------

struct MetricsRegistry::Entry {
  std::string type;  // "counter", "gauge", "histogram"
  std::string help;
  std::vector<std::string> label_names;
  std::vector<double> bounds;
  std::unique_ptr<Family<Counter>> counter;
  std::unique_ptr<Family<Gauge>> gauge;
  std::unique_ptr<Family<Histogram>> histogram;

  template <typename T>
  std::unique_ptr<Family<T>>& slot();
};
template <>
std::unique_ptr<Family<Counter>>& MetricsRegistry::Entry::slot<Counter>() { return counter; }
template <>
std::unique_ptr<Family<Gauge>>& MetricsRegistry::Entry::slot<Gauge>() { return gauge; }
template <>
std::unique_ptr<Family<Histogram>>& MetricsRegistry::Entry::slot<Histogram>() { return histogram; }

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

template <typename T>
Family<T>& MetricsRegistry::Add(const char* type, const std::string& name, const std::string& help,
                                std::vector<std::string> label_names, std::vector<double> bounds) {
  if (!ValidName(name, true)) Misuse("invalid metric name '" + name + "'");
  for (const std::string& l : label_names) {
    if (!ValidName(l, false) || l.rfind("__", 0) == 0 || (std::string_view(type) == "histogram" && l == "le"))
      Misuse(name + ": invalid label name '" + l + "'");
    if (std::count(label_names.begin(), label_names.end(), l) != 1) Misuse(name + ": label '" + l + "' given twice");
  }
  if (!std::is_sorted(bounds.begin(), bounds.end()) ||
      std::adjacent_find(bounds.begin(), bounds.end()) != bounds.end() ||
      std::any_of(bounds.begin(), bounds.end(), [](double b) { return !std::isfinite(b); }))
    Misuse(name + ": histogram bounds must be finite and strictly ascending");
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Entry>& e = families_[name];
  if (e != nullptr) {
    if (e->type != type || e->help != help || e->label_names != label_names || e->bounds != bounds)
      Misuse(name + ": registered again with a different type, help, labels or buckets");
    return *e->slot<T>();
  }
  e = std::make_unique<Entry>();
  e->type = type;
  e->help = help;
  e->label_names = label_names;
  e->bounds = bounds;
  e->slot<T>().reset(new Family<T>(name, help, std::move(label_names), std::move(bounds)));
  return *e->slot<T>();
}

Family<Counter>& MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                             std::vector<std::string> label_names) {
  return Add<Counter>("counter", name, help, std::move(label_names), {});
}

Family<Gauge>& MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                         std::vector<std::string> label_names) {
  return Add<Gauge>("gauge", name, help, std::move(label_names), {});
}

Family<Histogram>& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                                 std::vector<std::string> label_names,
                                                 std::vector<double> bounds) {
  return Add<Histogram>("histogram", name, help, std::move(label_names), std::move(bounds));
}

MetricsRegistry::Hook MetricsRegistry::AddScrapeHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  const uint64_t id = next_hook_++;
  hooks_.emplace(id, std::move(hook));
  return Hook(this, id);
}

void MetricsRegistry::RemoveHook(uint64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  hooks_.erase(id);
}

MetricsRegistry::Hook::Hook(Hook&& other) noexcept : registry_(other.registry_), id_(other.id_) {
  other.registry_ = nullptr;
}

MetricsRegistry::Hook& MetricsRegistry::Hook::operator=(Hook&& other) noexcept {
  if (this != &other) {
    if (registry_ != nullptr) registry_->RemoveHook(id_);
    registry_ = other.registry_;
    id_ = other.id_;
    other.registry_ = nullptr;
  }
  return *this;
}

MetricsRegistry::Hook::~Hook() {
  if (registry_ != nullptr) registry_->RemoveHook(id_);
}

std::string MetricsRegistry::Render() const {
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    for (const auto& [id, hook] : hooks_) hook();
  }
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, e] : families_) {
    std::string body;
    if (e->counter) e->counter->Render(&body);
    if (e->gauge) e->gauge->Render(&body);
    if (e->histogram) e->histogram->Render(&body);
    if (body.empty()) continue;
    out.append("# HELP ").append(name).append(" ").append(EscapeHelp(e->help)).push_back('\n');
    out.append("# TYPE ").append(name).append(" ").append(e->type).push_back('\n');
    out.append(body);
  }
  return out;
}

MetricsRegistry& Metrics() {
  static MetricsRegistry* registry = new MetricsRegistry();
  return *registry;
}

}  // namespace moe
