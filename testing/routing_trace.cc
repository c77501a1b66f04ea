#include "testing/routing_trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string_view>
#include <vector>

#include <lzma.h>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe {

namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A trace file, through liblzma when it ends in .xz: read as a byte stream,
// or written and finished (the xz stream's end) by Finish.
class TraceFile {
 public:
  TraceFile(const std::string& path, bool write) : path_(path), write_(write), xz_(EndsWith(path, ".xz")) {
    f_ = std::fopen(path.c_str(), write ? "wb" : "rb");
    if (f_ != nullptr && xz_)
      ok_ = (write ? lzma_easy_encoder(&z_, 6, LZMA_CHECK_CRC64) : lzma_stream_decoder(&z_, UINT64_MAX, 0)) == LZMA_OK;
    else
      ok_ = f_ != nullptr;
  }
  ~TraceFile() {
    if (xz_) lzma_end(&z_);
    if (f_ != nullptr) std::fclose(f_);
  }
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;
  bool ok() const { return ok_; }

  // Up to `n` bytes into `out`; 0 at the end of the stream.
  absl::StatusOr<size_t> Read(char* out, size_t n) {
    if (!xz_) {
      const size_t got = std::fread(out, 1, n, f_);
      if (got == 0 && std::ferror(f_)) return absl::DataLossError(absl::StrCat("reading '", path_, "' failed"));
      return got;
    }
    z_.next_out = reinterpret_cast<uint8_t*>(out);
    z_.avail_out = n;
    while (z_.avail_out == n && !done_) {
      if (z_.avail_in == 0 && !std::feof(f_)) {
        z_.next_in = in_;
        z_.avail_in = std::fread(in_, 1, sizeof(in_), f_);
      }
      const lzma_ret r = lzma_code(&z_, z_.avail_in == 0 && std::feof(f_) ? LZMA_FINISH : LZMA_RUN);
      if (r == LZMA_STREAM_END) done_ = true;
      else if (r != LZMA_OK) return absl::DataLossError(absl::StrCat("'", path_, "': not a valid xz stream (liblzma ", r, ")"));
    }
    return n - z_.avail_out;
  }

  absl::Status Write(std::string_view data) { return Code(data, LZMA_RUN); }
  // Ends the xz stream and flushes; the file is complete when this is OK.
  absl::Status Finish() {
    MOE_RETURN_IF_ERROR(Code({}, LZMA_FINISH));
    if (std::fflush(f_) != 0) return absl::UnavailableError(absl::StrCat("writing '", path_, "' failed"));
    return absl::OkStatus();
  }

 private:
  absl::Status Code(std::string_view data, lzma_action action) {
    if (!xz_) {
      if (std::fwrite(data.data(), 1, data.size(), f_) != data.size())
        return absl::UnavailableError(absl::StrCat("writing '", path_, "' failed"));
      return absl::OkStatus();
    }
    z_.next_in = reinterpret_cast<const uint8_t*>(data.data());
    z_.avail_in = data.size();
    for (;;) {
      uint8_t out[1 << 16];
      z_.next_out = out;
      z_.avail_out = sizeof(out);
      const lzma_ret r = lzma_code(&z_, action);
      if (r != LZMA_OK && r != LZMA_STREAM_END)
        return absl::InternalError(absl::StrCat("'", path_, "': xz compression failed (liblzma ", r, ")"));
      const size_t n = sizeof(out) - z_.avail_out;
      if (std::fwrite(out, 1, n, f_) != n) return absl::UnavailableError(absl::StrCat("writing '", path_, "' failed"));
      if (action == LZMA_FINISH ? r == LZMA_STREAM_END : z_.avail_in == 0) return absl::OkStatus();
    }
  }

  std::string path_;
  bool write_, xz_, ok_ = false, done_ = false;
  std::FILE* f_ = nullptr;
  lzma_stream z_ = LZMA_STREAM_INIT;
  uint8_t in_[1 << 16];
};

// Reads `path` line by line (decompressed when it ends in .xz).
absl::Status ForEachLine(const std::string& path, const std::function<absl::Status(const std::string&)>& fn) {
  TraceFile f(path, /*write=*/false);
  if (!f.ok()) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::string line;
  std::vector<char> buf(1 << 16);
  for (;;) {
    MOE_ASSIGN_OR_RETURN(const size_t n, f.Read(buf.data(), buf.size()));
    if (n == 0) break;
    for (size_t i = 0; i < n; ++i) {
      if (buf[i] != '\n') {
        line += buf[i];
        continue;
      }
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (!line.empty()) MOE_RETURN_IF_ERROR(fn(line));
      line.clear();
    }
  }
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (!line.empty()) MOE_RETURN_IF_ERROR(fn(line));
  return absl::OkStatus();
}

// One layer's token lists as [T, top_k] ids, -1 padded (ids out of range too).
void Tokens(const std::vector<std::vector<int>>& lists, int top_k, int num_experts, std::vector<int16_t>* out) {
  out->assign(lists.size() * static_cast<size_t>(top_k), -1);
  for (size_t t = 0; t < lists.size(); ++t)
    for (size_t j = 0; j < lists[t].size() && j < static_cast<size_t>(top_k); ++j)
      if (lists[t][j] >= 0 && lists[t][j] < num_experts) (*out)[t * top_k + j] = static_cast<int16_t>(lists[t][j]);
}

void Aggregate(const std::vector<int>& ids, int num_experts, std::vector<ExpertAccess>* out) {
  std::map<int, int> count;
  for (int e : ids) {
    if (e >= 0 && e < num_experts) ++count[e];
  }
  out->clear();
  for (auto [e, n] : count) out->push_back({e, n});
}

// The steps of our format, (step, layer) -> token lists, in step order; per
// token ids kept as int16 (the aggregated counts always).
void AddOurs(const std::map<int, std::map<int, std::vector<std::vector<int>>>>& ours, RoutingTrace* t) {
  const bool keep_tokens = t->num_experts <= 32767;
  for (const auto& [step, layers] : ours) {
    std::vector<std::vector<ExpertAccess>> s(t->num_layers);
    std::vector<std::vector<int16_t>> tok(t->num_layers);
    std::vector<int> ids;
    for (const auto& [layer, lists] : layers) {
      ids.clear();
      for (const auto& l : lists) ids.insert(ids.end(), l.begin(), l.end());
      Aggregate(ids, t->num_experts, &s[layer]);
      if (keep_tokens) Tokens(lists, t->top_k, t->num_experts, &tok[layer]);
    }
    t->steps.push_back(std::move(s));
    if (keep_tokens) t->tokens.push_back(std::move(tok));
  }
}

// The steps of recorded routing, (problem, token) -> layer -> experts: one token each.
void AddRecords(const std::map<std::pair<int64_t, int64_t>, std::map<int, std::vector<int>>>& records,
                RoutingTrace* t) {
  const bool keep_tokens = t->num_experts <= 32767;
  for (const auto& [key, layers] : records) {
    std::vector<std::vector<ExpertAccess>> s(t->num_layers);
    std::vector<std::vector<int16_t>> tok(t->num_layers);
    for (const auto& [layer, ids] : layers) {
      Aggregate(ids, t->num_experts, &s[layer]);
      if (keep_tokens) Tokens({ids}, t->top_k, t->num_experts, &tok[layer]);
    }
    t->steps.push_back(std::move(s));
    if (keep_tokens) t->tokens.push_back(std::move(tok));
  }
}

}  // namespace

uint64_t RoutingTrace::Pairs(int layer) const {
  uint64_t n = 0;
  for (const auto& s : steps) {
    for (const ExpertAccess& a : s[layer]) n += a.pairs;
  }
  return n;
}

std::vector<int> MostUsed(const std::vector<uint64_t>& pairs, int slots) {
  std::vector<int> v(pairs.size());
  for (size_t e = 0; e < v.size(); ++e) v[e] = static_cast<int>(e);
  std::stable_sort(v.begin(), v.end(), [&](int a, int b) { return pairs[a] > pairs[b]; });
  v.resize(std::min<size_t>(v.size(), static_cast<size_t>(std::max(slots, 0))));
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int> BestFixedSet(const RoutingTrace& t, int layer, int slots) {
  std::vector<uint64_t> pairs(t.num_experts, 0);
  for (const auto& step : t.steps)
    for (const ExpertAccess& a : step[layer]) pairs[a.expert] += a.pairs;
  return MostUsed(pairs, slots);
}

absl::StatusOr<RoutingTrace> InterleaveSequences(const RoutingTrace& t, int batch) {
  const size_t S = t.steps.size();
  if (batch < 1 || static_cast<size_t>(batch) > S)
    return absl::InvalidArgumentError(absl::StrCat("batch: ", batch, " is outside [1, ", S, "] (the trace's steps)"));
  RoutingTrace out;
  out.num_layers = t.num_layers;
  out.num_experts = t.num_experts;
  out.top_k = t.top_k;
  out.source = absl::StrCat(t.source, " as ", batch, " sequences");
  out.steps.resize(S);
  out.tokens.resize(S);
  const size_t stride = S / static_cast<size_t>(batch);
  std::vector<int> pairs(static_cast<size_t>(t.num_experts), 0);
  for (size_t s = 0; s < S; ++s) {
    out.steps[s].resize(static_cast<size_t>(t.num_layers));
    out.tokens[s].resize(static_cast<size_t>(t.num_layers));
    for (int l = 0; l < t.num_layers; ++l) {
      std::vector<int16_t>& ids = out.tokens[s][l];
      bool per_token = true;  // else the step keeps no token rows (a step-wide row is used)
      for (int j = 0; j < batch; ++j) {
        const size_t from = (s + static_cast<size_t>(j) * stride) % S;
        for (const ExpertAccess& a : t.steps[from][l]) pairs[a.expert] += a.pairs;
        const bool rows = from < t.tokens.size() && static_cast<size_t>(l) < t.tokens[from].size() &&
                          !t.tokens[from][l].empty();
        per_token = per_token && (rows || t.steps[from][l].empty());
        if (rows) ids.insert(ids.end(), t.tokens[from][l].begin(), t.tokens[from][l].end());
      }
      if (!per_token) ids.clear();
      for (int e = 0; e < t.num_experts; ++e)
        if (pairs[e] > 0) {
          out.steps[s][l].push_back({e, pairs[e]});
          pairs[e] = 0;
        }
    }
  }
  return out;
}

absl::StatusOr<RoutingTrace> ReadRoutingTrace(const std::string& path) {
  RoutingTrace t;
  t.source = path;
  enum class Kind { kUnknown, kOurs, kRecords } kind = Kind::kUnknown;
  // Ours: (step, layer) -> token lists. Records: (problem, token) -> layer -> experts.
  std::map<int, std::map<int, std::vector<std::vector<int>>>> ours;
  std::map<std::pair<int64_t, int64_t>, std::map<int, std::vector<int>>> records;
  int max_expert = -1, max_layer = -1;
  int64_t line_no = 0;
  absl::Status st = ForEachLine(path, [&](const std::string& line) -> absl::Status {
    ++line_no;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": ", what));
    };
    if (!j.is_object()) return bad("not a JSON object");
    try {
      if (j.contains("format")) {
        if (j["format"] != "moe-routing-trace") return bad("unknown \"format\"");
        kind = Kind::kOurs;
        t.num_layers = j.at("num_layers").get<int>();
        t.num_experts = j.at("num_experts").get<int>();
        t.top_k = j.at("top_k").get<int>();
        if (t.num_layers < 1 || t.num_experts < 1 || t.num_layers > 100000 || t.num_experts > 1000000)
          return bad("num_layers / num_experts out of range");
        if (t.top_k < 1 || t.top_k > t.num_experts) return bad("top_k outside [1, num_experts]");
        if (j.contains("generator")) t.source += " " + j["generator"].dump();
        return absl::OkStatus();
      }
      if (j.contains("topk")) {
        if (kind != Kind::kOurs) return bad("\"topk\" line before the header line");
        const int step = j.at("step").get<int>(), layer = j.at("layer").get<int>();
        if (layer < 0 || layer >= t.num_layers) return bad(absl::StrCat("layer ", layer, " out of range"));
        std::vector<std::vector<int>>& lists = ours[step][layer];
        for (const auto& token : j["topk"]) {
          lists.emplace_back();
          for (const auto& e : token) lists.back().push_back(e.get<int>());
        }
        return absl::OkStatus();
      }
      if (j.contains("experts") && j.contains("token_idx")) {
        if (kind == Kind::kOurs) return bad("recorded routing mixed into a moe-routing-trace file");
        kind = Kind::kRecords;
        const int64_t problem = j.value("problem_id", int64_t{0});
        const int layer = j.at("layer").get<int>();
        if (layer < 0) return bad("negative layer");
        std::vector<int>& ids = records[{problem, j.at("token_idx").get<int64_t>()}][layer];
        for (const auto& e : j["experts"]) {
          ids.push_back(e.get<int>());
          max_expert = std::max(max_expert, ids.back());
        }
        max_layer = std::max(max_layer, layer);
        t.top_k = std::max<int>(t.top_k, j["experts"].size());
        return absl::OkStatus();
      }
    } catch (const nlohmann::json::exception& e) {
      return bad(e.what());
    }
    return bad("neither a moe-routing-trace line nor a routing record");
  });
  if (!st.ok()) return st;
  if (kind == Kind::kOurs) {
    AddOurs(ours, &t);
  } else if (kind == Kind::kRecords) {
    t.num_layers = max_layer + 1;
    t.num_experts = max_expert + 1;
    AddRecords(records, &t);
  }
  if (t.steps.empty() || t.num_layers <= 0 || t.num_experts <= 0)
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': no routing in it"));
  return t;
}

void GenerateRoutingTrace(const SyntheticTraceOptions& o,
                          const std::function<void(int, int, const std::vector<std::vector<int>>&)>& emit) {
  std::mt19937_64 rng(o.seed);
  const int ne = o.num_experts;
  std::vector<double> rank_weight(ne);
  for (int r = 0; r < ne; ++r) rank_weight[r] = 1.0 / std::pow(r + 1.0, o.zipf);
  struct LayerState {
    std::vector<int> expert_of_rank;  // the layer's own hot set, drifting
    std::vector<int> burst_left;      // [expert] steps of burst left
  };
  std::vector<LayerState> layers(o.num_layers);
  for (LayerState& l : layers) {
    l.expert_of_rank.resize(ne);
    for (int r = 0; r < ne; ++r) l.expert_of_rank[r] = r;
    std::shuffle(l.expert_of_rank.begin(), l.expert_of_rank.end(), rng);
    l.burst_left.assign(ne, 0);
  }
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  const int hot = std::max(1, ne / 4);
  std::vector<double> weight(ne), cumulative(ne);
  std::vector<std::vector<int>> topk(o.tokens_per_step, std::vector<int>(o.top_k));
  std::vector<bool> taken(ne);
  for (int step = 0; step < o.steps; ++step) {
    for (int li = 0; li < o.num_layers; ++li) {
      LayerState& l = layers[li];
      if (o.drift_every > 0 && step > 0 && step % o.drift_every == 0) {
        for (int k = 0; k < o.drift_swaps; ++k) {
          const int a = static_cast<int>(uni(rng) * hot), b = hot + static_cast<int>(uni(rng) * (ne - hot));
          std::swap(l.expert_of_rank[a], l.expert_of_rank[std::min(b, ne - 1)]);
        }
      }
      if (uni(rng) < o.burst_rate) l.burst_left[static_cast<int>(uni(rng) * ne) % ne] = o.burst_steps;
      for (int r = 0; r < ne; ++r) {
        const int e = l.expert_of_rank[r];
        weight[e] = l.burst_left[e] > 0 ? rank_weight[0] : rank_weight[r];
      }
      for (int e = 0; e < ne; ++e) {
        if (l.burst_left[e] > 0) --l.burst_left[e];
      }
      for (auto& token : topk) {
        std::fill(taken.begin(), taken.end(), false);
        for (int j = 0; j < o.top_k; ++j) {
          // Draw without replacement: renormalise over the experts not taken yet.
          double total = 0;
          for (int e = 0; e < ne; ++e) {
            total += taken[e] ? 0.0 : weight[e];
            cumulative[e] = total;
          }
          const double x = uni(rng) * total;
          int e = static_cast<int>(std::upper_bound(cumulative.begin(), cumulative.end(), x) - cumulative.begin());
          e = std::min(e, ne - 1);
          while (taken[e]) e = (e + 1) % ne;  // only on rounding at the edge
          taken[e] = true;
          token[j] = e;
        }
      }
      emit(step, li, topk);
    }
  }
}

RoutingTrace GenerateRoutingTrace(const SyntheticTraceOptions& o) {
  RoutingTrace t;
  t.num_layers = o.num_layers;
  t.num_experts = o.num_experts;
  t.top_k = o.top_k;
  t.source = "synthetic";
  t.steps.assign(o.steps, std::vector<std::vector<ExpertAccess>>(o.num_layers));
  if (o.num_experts <= 32767) t.tokens.assign(o.steps, std::vector<std::vector<int16_t>>(o.num_layers));
  std::vector<int> ids;
  GenerateRoutingTrace(o, [&](int step, int layer, const std::vector<std::vector<int>>& topk) {
    ids.clear();
    for (const auto& token : topk) ids.insert(ids.end(), token.begin(), token.end());
    Aggregate(ids, o.num_experts, &t.steps[step][layer]);
    if (o.num_experts <= 32767) Tokens(topk, o.top_k, o.num_experts, &t.tokens[step][layer]);
  });
  return t;
}

absl::Status WriteSyntheticTrace(const SyntheticTraceOptions& o, const std::string& path) {
  TraceFile f(path, /*write=*/true);
  if (!f.ok()) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  nlohmann::json header = {{"format", "moe-routing-trace"},
                           {"version", 1},
                           {"num_layers", o.num_layers},
                           {"num_experts", o.num_experts},
                           {"top_k", o.top_k},
                           {"generator",
                            {{"tokens_per_step", o.tokens_per_step},
                             {"steps", o.steps},
                             {"zipf", o.zipf},
                             {"drift_every", o.drift_every},
                             {"drift_swaps", o.drift_swaps},
                             {"burst_rate", o.burst_rate},
                             {"burst_steps", o.burst_steps},
                             {"seed", o.seed}}}};
  MOE_RETURN_IF_ERROR(f.Write(header.dump() + "\n"));
  std::string line;
  absl::Status written;
  GenerateRoutingTrace(o, [&](int step, int layer, const std::vector<std::vector<int>>& topk) {
    line = absl::StrCat("{\"step\":", step, ",\"layer\":", layer, ",\"topk\":[");
    for (size_t t = 0; t < topk.size(); ++t) {
      line += t ? ",[" : "[";
      for (size_t j = 0; j < topk[t].size(); ++j) absl::StrAppend(&line, j ? "," : "", topk[t][j]);
      line += "]";
    }
    line += "]}\n";
    if (written.ok()) written = f.Write(line);
  });
  MOE_RETURN_IF_ERROR(written);
  return f.Finish();
}

}  // namespace moe
