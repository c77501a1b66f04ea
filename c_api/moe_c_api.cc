// The C ABI of include/moe/moe.h over MoeSession: option parsing from JSON,
// status codes and the thread-local last-error text, and the boundary that
// turns every C++ exception into a status. Built into libmoe.so.
//
// Thread-safety: each moe_session carries a mutex; every call on it holds it.
#include "moe/moe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "moe/engine.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

struct moe_session {
  std::mutex mu;
  std::unique_ptr<moe::MoeSession> session;
  std::vector<int32_t> moe_layers;  // moe_model_info.moe_layers points here
  std::string text;                 // what moe_session_describe / moe_session_options returned last
};

namespace {

thread_local std::string last_error;

moe_status Fail(moe_status code, std::string message) {
  last_error = std::move(message);
  return code;
}

moe_status FromStatus(const absl::Status& st) {
  if (st.ok()) return MOE_OK;
  return Fail(static_cast<moe_status>(static_cast<int>(st.code())),
              absl::StrCat(absl::StatusCodeToString(st.code()), ": ", st.message()));
}

// Runs `body` with every exception mapped to a status.
template <typename Body>
moe_status Guard(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(MOE_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: out of memory");
  } catch (const std::exception& e) {
    return Fail(MOE_INTERNAL, absl::StrCat("INTERNAL: ", e.what()));
  } catch (...) {
    return Fail(MOE_INTERNAL, "INTERNAL: unknown exception");
  }
}

moe_status Invalid(const std::string& message) { return Fail(MOE_INVALID_ARGUMENT, "INVALID_ARGUMENT: " + message); }

// Typed reads of one JSON option; the key names the field in errors.
absl::Status ReadOption(const nlohmann::json& v, const std::string& key, std::string* out) {
  if (!v.is_string()) return absl::InvalidArgumentError(absl::StrCat("options.", key, ": expected a string"));
  *out = v.get<std::string>();
  return absl::OkStatus();
}
absl::Status ReadOption(const nlohmann::json& v, const std::string& key, int* out) {
  if (!v.is_number_integer()) return absl::InvalidArgumentError(absl::StrCat("options.", key, ": expected an integer"));
  // 2^63 and above parse as unsigned: as int64 they read negative.
  if (v.is_number_unsigned() && v.get<uint64_t>() > INT32_MAX)
    return absl::InvalidArgumentError(absl::StrCat("options.", key, ": ", v.get<uint64_t>(), " is out of range"));
  const int64_t x = v.get<int64_t>();
  if (x < 0 || x > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat("options.", key, ": ", x, " is out of range"));
  *out = static_cast<int>(x);
  return absl::OkStatus();
}
absl::Status ReadOption(const nlohmann::json& v, const std::string& key, double* out) {
  if (!v.is_number() || v.get<double>() < 0)
    return absl::InvalidArgumentError(absl::StrCat("options.", key, ": expected a number >= 0"));
  *out = v.get<double>();
  return absl::OkStatus();
}
// A string option naming one of a SessionOptions choice's values.
template <typename E>
absl::Status ReadChoice(const nlohmann::json& v, const std::string& key, E* out,
                        absl::StatusOr<E> (*parse)(const std::string&, const std::string&)) {
  std::string name;
  MOE_RETURN_IF_ERROR(ReadOption(v, key, &name));
  MOE_ASSIGN_OR_RETURN(*out, parse(name, "options." + key));
  return absl::OkStatus();
}

absl::Status ReadOption(const nlohmann::json& v, const std::string& key, bool* out) {
  if (!v.is_boolean()) return absl::InvalidArgumentError(absl::StrCat("options.", key, ": expected true or false"));
  *out = v.get<bool>();
  return absl::OkStatus();
}
template <typename T>
absl::Status ReadList(const nlohmann::json& v, const std::string& key, std::vector<T>* out) {
  if (!v.is_array()) return absl::InvalidArgumentError(absl::StrCat("options.", key, ": expected an array"));
  out->clear();
  for (size_t i = 0; i < v.size(); ++i) {
    T x{};
    MOE_RETURN_IF_ERROR(ReadOption(v[i], absl::StrCat(key, "[", i, "]"), &x));
    out->push_back(std::move(x));
  }
  return absl::OkStatus();
}

absl::Status ParseTls(const nlohmann::json& v, moe::TlsOptions* tls) {
  if (!v.is_object()) return absl::InvalidArgumentError("options.tls: expected an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string key = "tls." + it.key();
    absl::Status st;
    if (it.key() == "cert_file") st = ReadOption(*it, key, &tls->cert_file);
    else if (it.key() == "key_file") st = ReadOption(*it, key, &tls->key_file);
    else if (it.key() == "ca_file") st = ReadOption(*it, key, &tls->ca_file);
    else if (it.key() == "server_name_override") st = ReadOption(*it, key, &tls->server_name_override);
    else if (it.key() == "insecure") st = ReadOption(*it, key, &tls->insecure);
    else st = absl::InvalidArgumentError(absl::StrCat("options.", key, ": unknown option"));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ParseGroup(const nlohmann::json& v, moe::ParallelGroup* group) {
  if (!v.is_object()) return absl::InvalidArgumentError("options.group: expected an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string key = "group." + it.key();
    absl::Status st;
    if (it.key() == "rank") st = ReadOption(*it, key, &group->rank);
    else if (it.key() == "size") st = ReadOption(*it, key, &group->size);
    else if (it.key() == "mode") st = ReadChoice(*it, key, &group->mode, moe::ParseGroupMode);
    else if (it.key() == "id") st = ReadOption(*it, key, &group->id);
    else st = absl::InvalidArgumentError(absl::StrCat("options.", key, ": unknown option"));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<moe::SessionOptions> ParseOptions(const char* text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("options_json: not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("options_json: expected a JSON object");
  moe::SessionOptions o;
  bool have_model = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    absl::Status st;
    if (key == "model") { st = ReadOption(*it, key, &o.model); have_model = true; }
    else if (key == "servers") st = ReadList(*it, key, &o.servers);
    else if (key == "device") st = ReadChoice(*it, key, &o.device, moe::ParseDeviceChoice);
    else if (key == "cuda_device") st = ReadOption(*it, key, &o.cuda_device);
    else if (key == "cache_experts_per_layer") st = ReadOption(*it, key, &o.cache_experts_per_layer);
    else if (key == "cache_gib") st = ReadOption(*it, key, &o.cache_gib);
    else if (key == "policy") st = ReadChoice(*it, key, &o.policy, moe::ParseCachePolicy);
    else if (key == "copy_mode") st = ReadChoice(*it, key, &o.copy_mode, moe::ParseCopyMode);
    else if (key == "max_tokens") st = ReadOption(*it, key, &o.max_tokens);
    else if (key == "max_top_k") st = ReadOption(*it, key, &o.max_top_k);
    else if (key == "contexts") st = ReadOption(*it, key, &o.contexts);
    else if (key == "cpu_threads") st = ReadOption(*it, key, &o.cpu_threads);
    else if (key == "grpc_streams") st = ReadOption(*it, key, &o.grpc_streams);
    else if (key == "layers") st = ReadList(*it, key, &o.layers);
    else if (key == "host_copy") st = ReadOption(*it, key, &o.host_copy);
    else if (key == "weight_dtype") st = ReadChoice(*it, key, &o.weight_dtype, moe::ParseWeightDtype);
    else if (key == "share_host_copy") st = ReadOption(*it, key, &o.share_host_copy);
    else if (key == "fill_cache") st = ReadOption(*it, key, &o.fill_cache);
    else if (key == "group") st = ParseGroup(*it, &o.group);
    else if (key == "tls") st = ParseTls(*it, &o.tls);
    else if (key == "deadline_ms") {
      int ms = 0;
      st = ReadOption(*it, key, &ms);
      if (st.ok() && ms == 0) st = absl::InvalidArgumentError("options.deadline_ms: must be > 0");
      o.deadline = std::chrono::milliseconds(ms);
    } else if (key == "server_deadline_ms") {
      int ms = 0;
      st = ReadOption(*it, key, &ms);
      if (st.ok() && ms <= 0) st = absl::InvalidArgumentError("options.server_deadline_ms: must be > 0");
      o.server_deadline = std::chrono::milliseconds(ms);
    } else {
      st = absl::InvalidArgumentError(absl::StrCat("options.", key, ": unknown option"));
    }
    if (!st.ok()) return st;
  }
  if (!have_model || o.model.empty()) return absl::InvalidArgumentError("options.model: required");
  return o;
}

// The options under the keys ParseOptions reads (moe_session_options).
nlohmann::json OptionsJson(const moe::SessionOptions& o) {
  nlohmann::json j = {
      {"model", o.model},
      {"servers", o.servers},
      {"device", moe::Name(o.device)},
      {"cuda_device", o.cuda_device},
      {"cache_experts_per_layer", o.cache_experts_per_layer},
      {"cache_gib", o.cache_gib},
      {"policy", moe::Name(o.policy)},
      {"copy_mode", moe::Name(o.copy_mode)},
      {"max_tokens", o.max_tokens},
      {"max_top_k", o.max_top_k},
      {"contexts", o.contexts},
      {"cpu_threads", o.cpu_threads},
      {"grpc_streams", o.grpc_streams},
      {"layers", o.layers},
      {"host_copy", o.host_copy},
      {"weight_dtype", moe::Name(o.weight_dtype)},
      {"share_host_copy", o.share_host_copy},
      {"fill_cache", o.fill_cache},
      {"group", {{"rank", o.group.rank}, {"size", o.group.size}, {"mode", moe::Name(o.group.mode)}, {"id", o.group.id}}},
      {"tls",
       {{"cert_file", o.tls.cert_file},
        {"key_file", o.tls.key_file},
        {"ca_file", o.tls.ca_file},
        {"server_name_override", o.tls.server_name_override},
        {"insecure", o.tls.insecure}}},
      {"deadline_ms", o.deadline.count()},
      {"server_deadline_ms", o.server_deadline.count()},
  };
  return j;
}

// Copies `text` into a fixed C string field, NUL-terminated (cut if longer).
template <size_t N>
void CopyText(const std::string& text, char (&field)[N]) {
  std::strncpy(field, text.c_str(), N - 1);
  field[N - 1] = '\0';
}

// Writes up to `capacity` of `values` into `out`; *count = all of them.
moe_status CopyList(const std::vector<int>& values, int32_t* out, int32_t capacity, int32_t* count, const char* name) {
  if (count == nullptr) return Invalid("count: NULL");
  if (capacity < 0 || (capacity > 0 && out == nullptr)) return Invalid(absl::StrCat(name, ": NULL with capacity > 0"));
  *count = static_cast<int32_t>(values.size());
  for (int32_t i = 0; i < capacity && i < *count; ++i) out[i] = values[i];
  return MOE_OK;
}

moe_status CheckSession(moe_session* s) { return s == nullptr || !s->session ? Invalid("session: NULL") : MOE_OK; }
// InvalidArgument naming the layer unless the session serves it (the caller holds s->mu).
moe_status CheckServedLayer(moe_session* s, int32_t layer) {
  const std::vector<int>& served = s->session->served_layers();
  if (std::find(served.begin(), served.end(), layer) == served.end())
    return Invalid(absl::StrCat("layer: ", layer, " is not an MoE layer this session serves"));
  return MOE_OK;
}

moe::MemoryKind KindOf(int32_t memory) {
  return memory == MOE_MEMORY_DEVICE ? moe::MemoryKind::kDevice : moe::MemoryKind::kHost;
}

moe_status CheckCall(int32_t memory) {
  if (memory != MOE_MEMORY_HOST && memory != MOE_MEMORY_DEVICE)
    return Invalid(absl::StrCat("memory: ", memory, " is neither MOE_MEMORY_HOST (0) nor MOE_MEMORY_DEVICE (1)"));
  return MOE_OK;
}

// A call's stats in the C struct (the same fields, moe/types.h CallStats).
void Fill(const moe::CallStats& c, moe_call_stats* out) {
  if (out == nullptr) return;
  *out = moe_call_stats{};
  out->hit_pairs = c.hit_pairs;
  out->cpu_pairs = c.cpu_pairs;
  out->cpu_experts = c.cpu_experts;
  out->copied_pairs = c.copied_pairs;
  out->copied_experts = c.copied_experts;
  out->prefetched_pairs = c.prefetched_pairs;
  out->prefetched_experts = c.prefetched_experts;
  out->miss_tokens = c.miss_tokens;
  out->failovers = c.failovers;
  out->bytes_shipped = static_cast<int64_t>(c.bytes_shipped);
  out->seconds = c.seconds;
  out->submit_seconds = c.submit_seconds;
  out->wait_seconds = c.wait_seconds;
}

}  // namespace

extern "C" {

int moe_abi_version(void) { return MOE_ABI_VERSION; }

const char* moe_last_error(void) { return last_error.c_str(); }

const char* moe_status_name(int status) {
  static const char* const kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                       "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                       "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  if (status < 0 || status >= static_cast<int>(sizeof(kNames) / sizeof(kNames[0]))) return "UNKNOWN_STATUS";
  return kNames[status];
}

moe_status moe_session_open(const char* options_json, moe_session** out) {
  return Guard([&]() -> moe_status {
    last_error.clear();
    if (out == nullptr) return Invalid("out: NULL");
    *out = nullptr;
    if (options_json == nullptr) return Invalid("options_json: NULL");
    absl::StatusOr<moe::SessionOptions> o = ParseOptions(options_json);
    if (!o.ok()) return FromStatus(o.status());
    absl::StatusOr<std::unique_ptr<moe::MoeSession>> session = moe::MoeSession::Open(*o);
    if (!session.ok()) return FromStatus(session.status());
    auto s = std::make_unique<moe_session>();
    s->session = *std::move(session);
    const std::vector<int>& moe_layers = s->session->model_info().moe_layers;
    s->moe_layers.assign(moe_layers.begin(), moe_layers.end());
    *out = s.release();
    return MOE_OK;
  });
}

void moe_session_close(moe_session* session) {
  (void)Guard([&]() -> moe_status {
    delete session;
    return MOE_OK;
  });
}

moe_status moe_session_model_info(moe_session* session, moe_model_info* out) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (out == nullptr) return Invalid("out: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    const moe::ModelInfo& m = session->session->model_info();
    *out = moe_model_info{};
    CopyText(m.model_type, out->model_type);
    out->num_layers = m.num_layers;
    out->num_moe_layers = static_cast<int32_t>(session->moe_layers.size());
    out->moe_layers = session->moe_layers.data();
    out->num_experts = m.num_experts;
    out->top_k = m.top_k;
    out->hidden = m.hidden;
    out->intermediate = m.intermediate;
    CopyText(m.weight_dtype, out->weight_dtype);
    out->expert_bytes = m.expert_bytes;
    out->identity = m.identity;
    CopyText(m.expert_math, out->expert_math);
    CopyText(m.routing, out->routing);
    return MOE_OK;
  });
}

moe_status moe_session_served_layers(moe_session* session, int32_t* layers, int32_t capacity, int32_t* count) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    return CopyList(session->session->served_layers(), layers, capacity, count, "layers");
  });
}

const char* moe_session_device(moe_session* session) {
  const char* device = "";
  (void)Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    device = session->session->device();
    return MOE_OK;
  });
  return device;
}

const char* moe_session_options(moe_session* session) {
  const char* text = "";
  (void)Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    session->text = OptionsJson(session->session->options()).dump();
    text = session->text.c_str();
    return MOE_OK;
  });
  return text;
}

moe_status moe_forward_layer(moe_session* session, int32_t layer, int32_t tokens, int32_t top_k, const void* hidden,
                       const int32_t* topk_ids, const float* topk_weights, void* out, int32_t memory,
                       void* cuda_stream, moe_call_stats* stats) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (moe_status st = CheckCall(memory); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    moe::CallStats c;
    absl::Status st = session->session->ForwardLayer(
        layer, tokens, top_k, static_cast<const moe::bf16_t*>(hidden), topk_ids, topk_weights,
        static_cast<moe::bf16_t*>(out), KindOf(memory), &c, cuda_stream);
    Fill(c, stats);
    return FromStatus(st);
  });
}

moe_status moe_forward_layer_async(moe_session* session, int32_t layer, int32_t tokens, int32_t top_k,
                             const void* hidden, const int32_t* topk_ids, const float* topk_weights, void* out,
                             int32_t memory, void* cuda_stream, int32_t* ticket) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (moe_status st = CheckCall(memory); st != MOE_OK) return st;
    if (ticket == nullptr) return Invalid("ticket: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    absl::StatusOr<moe::MoeSession::Pending> p = session->session->ForwardLayerAsync(
        layer, tokens, top_k, static_cast<const moe::bf16_t*>(hidden), topk_ids, topk_weights,
        static_cast<moe::bf16_t*>(out), KindOf(memory), cuda_stream);
    if (!p.ok()) return FromStatus(p.status());
    *ticket = p->ticket;
    return MOE_OK;
  });
}

moe_status moe_wait(moe_session* session, int32_t ticket, moe_call_stats* stats) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    moe::CallStats c;
    absl::Status st = session->session->Wait(moe::MoeSession::Pending{ticket}, &c);
    Fill(c, stats);
    return FromStatus(st);
  });
}

moe_status moe_forward_layer_capturable(moe_session* session, int32_t layer, int32_t tokens, int32_t top_k,
                                  const void* hidden, const int32_t* topk_ids, const float* topk_weights, void* out,
                                  void* cuda_stream) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    return FromStatus(session->session->ForwardLayerCapturable(
        layer, tokens, top_k, static_cast<const moe::bf16_t*>(hidden), topk_ids, topk_weights,
        static_cast<moe::bf16_t*>(out), cuda_stream));
  });
}

moe_status moe_take_stream_error(moe_session* session) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    return FromStatus(session->session->TakeStreamError());
  });
}

moe_status moe_apply_assignment(moe_session* session, int32_t layer, const int32_t* experts, int32_t n,
                                const int32_t* pinned, int32_t n_pinned) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (n < 0 || (n > 0 && experts == nullptr)) return Invalid(absl::StrCat("experts: NULL or n = ", n, " < 0"));
    if (n_pinned < 0 || (n_pinned > 0 && pinned == nullptr))
      return Invalid(absl::StrCat("pinned: NULL or n_pinned = ", n_pinned, " < 0"));
    std::lock_guard<std::mutex> lock(session->mu);
    return FromStatus(session->session->admin().ApplyAssignment(layer, std::vector<int>(experts, experts + n),
                                                                std::vector<int>(pinned, pinned + n_pinned)));
  });
}

moe_status moe_flush_copies(moe_session* session) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    return FromStatus(session->session->admin().FlushCopies());
  });
}

moe_status moe_set_server_enabled(moe_session* session, const char* address, int32_t enabled) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (address == nullptr) return Invalid("address: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    return FromStatus(session->session->admin().SetServerEnabled(address, enabled != 0));
  });
}

moe_status moe_cached_experts(moe_session* session, int32_t layer, int32_t* experts, int32_t capacity,
                              int32_t* count) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    if (moe_status st = CheckServedLayer(session, layer); st != MOE_OK) return st;
    return CopyList(session->session->admin().CachedExperts(layer), experts, capacity, count, "experts");
  });
}

moe_status moe_hit_rate(moe_session* session, int32_t layer, double* out) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (out == nullptr) return Invalid("out: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    if (moe_status st = CheckServedLayer(session, layer); st != MOE_OK) return st;
    *out = session->session->admin().HitRate(layer);
    return MOE_OK;
  });
}

moe_status moe_slots_per_layer(moe_session* session, int32_t* out) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (out == nullptr) return Invalid("out: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    *out = session->session->admin().slots_per_layer();
    return MOE_OK;
  });
}

moe_status moe_totals(moe_session* session, moe_session_totals* out) {
  return Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    if (out == nullptr) return Invalid("out: NULL");
    std::lock_guard<std::mutex> lock(session->mu);
    const moe::SessionTotals t = session->session->totals();
    *out = moe_session_totals{};
    out->calls = static_cast<int64_t>(t.calls);
    out->failed_calls = static_cast<int64_t>(t.failed_calls);
    out->hit_pairs = static_cast<int64_t>(t.hit_pairs);
    out->cpu_pairs = static_cast<int64_t>(t.cpu_pairs);
    out->copied_pairs = static_cast<int64_t>(t.copied_pairs);
    out->miss_tokens = static_cast<int64_t>(t.miss_tokens);
    out->failovers = static_cast<int64_t>(t.failovers);
    out->bytes_shipped = static_cast<int64_t>(t.bytes_shipped);
    out->cache_copies_started = static_cast<int64_t>(session->session->admin().copies_started());
    out->cache_copies_pending = session->session->admin().PendingCopies();
    out->seconds = t.seconds;
    return MOE_OK;
  });
}

moe_status moe_new_group_id(char* out, int32_t capacity) {
  return Guard([&]() -> moe_status {
    if (out == nullptr) return Invalid("out: NULL");
    absl::StatusOr<std::string> id = moe::MoeSession::NewGroupId();
    if (!id.ok()) return FromStatus(id.status());
    if (capacity < static_cast<int32_t>(id->size()) + 1)
      return Invalid(absl::StrCat("capacity: ", capacity, " bytes; the id takes ", id->size() + 1));
    std::memcpy(out, id->c_str(), id->size() + 1);
    return MOE_OK;
  });
}

const char* moe_session_describe(moe_session* session) {
  const char* text = "";
  (void)Guard([&]() -> moe_status {
    if (moe_status st = CheckSession(session); st != MOE_OK) return st;
    std::lock_guard<std::mutex> lock(session->mu);
    session->text = session->session->admin().Describe();
    text = session->text.c_str();
    return MOE_OK;
  });
  return text;
}

moe_status moe_reference_forward(const char* model, int32_t layer, int32_t tokens, int32_t top_k, const void* hidden,
                                 const int32_t* topk_ids, const float* topk_weights, float* out) {
  return Guard([&]() -> moe_status {
    if (model == nullptr) return Invalid("model: NULL");
    return FromStatus(moe::MoeSession::ReferenceForward(model, layer, tokens, top_k,
                                                        static_cast<const moe::bf16_t*>(hidden), topk_ids,
                                                        topk_weights, out));
  });
}

}  // extern "C"
