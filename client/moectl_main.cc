// moectl: the operator's command line for the coordinator (moe.v1.AdminService).
//
//   moectl --coordinator ADDR [--insecure | --tls-ca CA ...] [--json] COMMAND [flags]
//
// Human tables by default, --json (the response message in proto3 JSON, field
// names as in coordinator.proto) for scripts. Errors are one line on stderr:
// exit 2 for a usage error, 1 for a failed call.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "core/flags.h"
#include "transport/grpc_channel.h"
#include "google/protobuf/util/json_util.h"
#include "moe/v1/coordinator.grpc.pb.h"

namespace {

constexpr char kCommands[] =
    "Commands:\n"
    "  status                                   workers, expert servers, per-layer hit rate, assignment versions\n"
    "  popularity --layer L [--top N] [--worker W]\n"
    "                                           decayed pair counts of a layer's experts, hottest first\n"
    "  rebalance [--dry-run]                    run a placement round now (or show the copies it would make\n"
    "                                           and the hit rate it expects)\n"
    "  pin --layer L --experts 1,5,9 [--worker W]    keep these experts cached (every worker, or W)\n"
    "  unpin --layer L --experts 1,5,9 [--worker W]\n"
    "  drain SERVER [--no-wait] [--wait-seconds N]   stop routing to an expert server, wait until drained\n"
    "  undrain SERVER                           route to it again\n"
    "  policy get                               policy parameters\n"
    "  policy set KEY=VALUE [KEY=VALUE ...]     change them (persisted by the coordinator's --state-file)\n"
    "Run 'moectl COMMAND --help' for a command's flags.";

const std::vector<std::string> kCommandNames = {"status", "popularity", "rebalance", "pin",   "unpin",
                                                "drain",  "undrain",    "policy",    "help"};
// Flags that take a value (so the word after them is not the command).
const std::vector<std::string> kValueFlags = {"coordinator", "tls-ca",  "tls-cert", "tls-key", "tls-server-name",
                                              "timeout-seconds", "layer", "top", "worker", "experts",
                                              "wait-seconds", "config"};

std::string OneLine(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

[[noreturn]] void Die(const std::string& command, const std::string& message, int code = 1) {
  std::fprintf(stderr, "moectl: %s%s%s\n", command.c_str(), command.empty() ? "" : ": ", OneLine(message).c_str());
  std::exit(code);
}

std::string Percent(double x) { return absl::StrFormat("%.1f%%", 100.0 * x); }
std::string Fixed(double x, int digits = 1) { return absl::StrFormat("%.*f", digits, x); }
std::string Bytes(uint64_t b) {
  if (b >= (1ull << 30)) return absl::StrFormat("%.2f GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return absl::StrFormat("%.1f MiB", b / double(1ull << 20));
  if (b >= (1ull << 10)) return absl::StrFormat("%.1f KiB", b / double(1ull << 10));
  return absl::StrCat(b, " B");
}

// Columns padded to their widest cell, two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print() const {
    std::vector<size_t> width;
    for (const auto& r : rows_) {
      width.resize(std::max(width.size(), r.size()), 0);
      for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
    }
    for (const auto& r : rows_) {
      std::string line;
      for (size_t i = 0; i < r.size(); ++i) {
        line += r[i];
        if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
      }
      std::printf("%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

void PrintJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  std::printf("%s", out.c_str());
  if (out.empty() || out.back() != '\n') std::printf("\n");
}

std::string Join(const google::protobuf::RepeatedField<uint32_t>& v) {
  std::string s;
  for (uint32_t x : v) absl::StrAppend(&s, s.empty() ? "" : ",", x);
  return s;
}

// ---------------------------------------------------------------- commands

struct Context {
  std::string command;
  std::unique_ptr<moe::v1::AdminService::Stub> stub;
  double timeout_seconds = 5;
  bool json = false;

  void Deadline(grpc::ClientContext& ctx) const {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
  }
  // TLS without a client certificate: a coordinator that requires one (mTLS)
  // drops the connection after the handshake, which gRPC reports only as a
  // deadline or an unavailable server.
  bool tls_without_client_cert = false;

  void Check(const grpc::Status& st) const {
    if (st.ok()) return;
    std::string hint;
    if (tls_without_client_cert && (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                                    st.error_code() == grpc::StatusCode::UNAVAILABLE))
      hint = " (no client certificate was presented: a coordinator started with --tls-ca requires one, "
             "--tls-cert and --tls-key)";
    Die(command, absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())), ": ",
                              st.error_message(), hint));
  }
};

// What each worker's planner learned (its last heartbeat's rates), one row per
// worker that reported them.
void PrintPlannerRates(const moe::v1::StatusResponse& r) {
  Table p({"WORKER", "PLANNER", "COPY MS/EXPERT", "CPU MS/EXPERT", "CPU MS/CALL", "DEVICE MS/ROW",
           "COPY DELAY MS", "COPYING CALLS", "VETOED SHAPES"});
  bool any = false;
  for (const auto& x : r.workers()) {
    const auto& m = x.planner_rates();
    if (m.empty()) continue;
    any = true;
    auto ms = [&m](const char* key) {
      auto it = m.find(key);
      return it == m.end() ? std::string("-") : absl::StrFormat("%.3f", it->second * 1e3);
    };
    auto count = [&m](const char* key) {
      auto it = m.find(key);
      return it == m.end() ? std::string("-") : absl::StrCat(static_cast<uint64_t>(it->second));
    };
    const bool measured = m.count("measured") && m.at("measured") > 0;
    p.Add({x.worker_id(), measured ? "measured" : "priors", ms("copy_seconds"), ms("cpu_expert_seconds"),
           ms("cpu_call_seconds"), ms("device_row_seconds"), ms("copy_delay_seconds"), count("copy_calls_observed"),
           count("vetoed_call_shapes")});
  }
  if (any) {
    std::printf("\n");
    p.Print();
  }
}

void Status(Context& c) {
  grpc::ClientContext ctx;
  c.Deadline(ctx);
  moe::v1::StatusResponse r;
  c.Check(c.stub->GetStatus(&ctx, moe::v1::StatusRequest(), &r));
  if (c.json) return PrintJson(r);
  std::printf("coordinator %s, up %.0f s; ", r.version().c_str(), r.uptime_seconds());
  if (r.num_layers() == 0) {
    std::printf("no worker or expert server has registered yet\n");
  } else {
    std::string family = r.model_type();
    if (!r.expert_math().empty())
      absl::StrAppend(&family, family.empty() ? "" : " ", "(", r.expert_math(), ", ", r.routing(), " routing)");
    std::printf("model %s%u layers x %u experts%s; overall hit rate %s\n",
                family.empty() ? "" : (family + ", ").c_str(), r.num_layers(), r.num_experts(),
                r.model_identity().empty() ? "" : absl::StrCat(", identity ", r.model_identity()).c_str(),
                Percent(r.overall_hit_rate()).c_str());
  }
  std::printf("placement %s, half-life %g s, rebalance every %g s (%llu so far), copy budget %g GB/s\n",
              r.policy().placement().c_str(), r.policy().half_life_seconds(), r.policy().rebalance_interval_seconds(),
              static_cast<unsigned long long>(r.rebalances()), r.policy().copy_budget_gbps());
  std::printf("\n");
  Table w({"WORKER", "STATE", "TP RANK", "SLOTS", "LAYERS", "VERSION", "ACKED", "HIT RATE", "COPIES", "COPIED",
           "HEARTBEAT"});
  for (const auto& x : r.workers()) {
    w.Add({x.worker_id(), x.state(), x.tp_size() > 1 ? absl::StrCat(x.tp_rank(), "/", x.tp_size()) : "-",
           absl::StrCat(x.slots_per_layer()), absl::StrCat(x.cached_layers()),
           absl::StrCat(x.assigned_version()), absl::StrCat(x.acked_version()), Percent(x.hit_rate()),
           absl::StrCat(x.copies_issued()), Bytes(x.bytes_issued()), Fixed(x.seconds_since_heartbeat()) + " s ago"});
  }
  if (r.workers().empty()) {
    std::printf("no workers\n");
  } else {
    w.Print();
    PrintPlannerRates(r);
  }
  std::printf("\n");
  Table s({"SERVER", "STATE", "ADDRESS", "SHM", "NUMA", "LAYERS", "EXPERTS", "SLICE", "FORMAT", "IN FLIGHT",
           "HEARTBEAT"});
  for (const auto& x : r.servers()) {
    s.Add({x.server_id(), x.state(), x.address(), x.shm_socket().empty() ? "-" : x.shm_socket(),
           absl::StrCat(x.numa_node()), absl::StrCat(x.hosted_layers()), absl::StrCat(x.hosted_experts()),
           x.slice_count() > 1 ? absl::StrCat(x.slice_index(), "/", x.slice_count()) : "whole",
           x.weight_format().empty() ? "-" : x.weight_format(), absl::StrCat(x.inflight_requests()), Fixed(x.seconds_since_heartbeat()) + " s ago"});
  }
  if (r.servers().empty()) {
    std::printf("no expert servers\n");
  } else {
    s.Print();
  }
  if (r.layers().empty()) return;
  std::printf("\n");
  // Per layer, the planner's split of the pairs: cache hits, CPU servers,
  // copied to the GPU for the call (of which prefetched: copied while the
  // layer before ran, a prompt's prefetch); cache copies (admissions and prefetches)
  // per second, and the host->GPU link's busy share (summed over the workers'
  // links: above 100% with several workers).
  Table l({"LAYER", "HIT", "CPU", "COPIED", "PREFETCHED", "PAIRS (DECAYED)", "ROUTABLE EXPERTS", "PRED PRECISION", "CACHE COPIES/S",
           "PCIE MB/S", "PCIE BUSY"});
  for (const auto& x : r.layers()) {
    l.Add({absl::StrCat(x.layer()), Percent(x.hit_rate()), Percent(x.cpu_share()), Percent(x.copied_share()),
           Percent(x.prefetched_share()), Fixed(x.pairs()), absl::StrCat(x.routable_experts(), "/", r.num_experts()),
           x.prediction_precision() > 0 ? Percent(x.prediction_precision()) : "-", Fixed(x.copies_per_second()),
           Fixed(x.pcie_bytes_per_second() / 1e6), Percent(x.pcie_busy_share())});
  }
  l.Print();
}

void Popularity(Context& c, int64_t layer, int64_t top, const std::string& worker) {
  moe::v1::PopularityRequest req;
  req.set_layer(static_cast<uint32_t>(layer));
  req.set_top(static_cast<uint32_t>(top));
  req.set_worker_id(worker);
  grpc::ClientContext ctx;
  c.Deadline(ctx);
  moe::v1::PopularityResponse r;
  c.Check(c.stub->GetPopularity(&ctx, req, &r));
  if (c.json) return PrintJson(r);
  std::printf("layer %u, %s: %.1f decayed pairs (half-life %g s)\n", r.layer(),
              worker.empty() ? "all workers" : ("worker " + worker).c_str(), r.total(), r.half_life_seconds());
  Table t({"RANK", "EXPERT", "COUNT", "SHARE", "PINNED", "RESIDENT ON"});
  int rank = 0;
  for (const auto& e : r.experts()) {
    std::string on;
    for (const auto& w : e.resident_on()) absl::StrAppend(&on, on.empty() ? "" : ",", w);
    t.Add({absl::StrCat(++rank), absl::StrCat(e.expert()), Fixed(e.count()), Percent(e.share()),
           e.pinned() ? "yes" : "", on.empty() ? "-" : on});
  }
  t.Print();
}

void Rebalance(Context& c, bool dry_run) {
  moe::v1::RebalanceRequest req;
  req.set_dry_run(dry_run);
  grpc::ClientContext ctx;
  c.Deadline(ctx);
  moe::v1::RebalanceResponse r;
  c.Check(c.stub->Rebalance(&ctx, req, &r));
  if (c.json) return PrintJson(r);
  uint64_t bytes = 0;
  for (const auto& w : r.workers()) bytes += w.bytes();
  std::printf("rebalance%s: %d copies, %s; expected hit rate %s -> %s; union coverage %s -> %s\n",
              dry_run ? " (dry run, nothing changed)" : "", r.copies_size(), Bytes(bytes).c_str(),
              Percent(r.hit_rate_before()).c_str(), Percent(r.hit_rate_after()).c_str(),
              Percent(r.union_coverage_before()).c_str(), Percent(r.union_coverage_after()).c_str());
  if (!r.copies().empty()) {
    std::printf("\n");
    Table t({"WORKER", "LAYER", "COPY IN", "EVICT", "GAIN (HITS)", "PINNED"});
    for (const auto& x : r.copies()) {
      t.Add({x.worker_id(), absl::StrCat(x.layer()), absl::StrCat(x.expert()),
             x.evicted() < 0 ? "(free slot)" : absl::StrCat(x.evicted()), Fixed(x.gain()), x.pinned() ? "yes" : ""});
    }
    t.Print();
  }
  if (!r.workers().empty()) {
    std::printf("\n");
    Table t({"WORKER", "COPIED", "BUDGET", "HIT RATE BEFORE", "AFTER", "VERSION"});
    for (const auto& w : r.workers()) {
      t.Add({w.worker_id(), Bytes(w.bytes()), w.budget_bytes() == 0 ? "unlimited" : Bytes(w.budget_bytes()),
             Percent(w.hit_rate_before()), Percent(w.hit_rate_after()),
             w.skipped() ? "skipped (previous not acknowledged)" : (w.version() ? absl::StrCat(w.version()) : "-")});
    }
    t.Print();
  }
}

void Pin(Context& c, bool pin, int64_t layer, const std::vector<int>& experts, const std::string& worker) {
  moe::v1::PinRequest req;
  req.set_layer(static_cast<uint32_t>(layer));
  for (int e : experts) req.add_experts(e);
  req.set_worker_id(worker);
  grpc::ClientContext ctx;
  c.Deadline(ctx);
  moe::v1::PinResponse r;
  c.Check(pin ? c.stub->PinExperts(&ctx, req, &r) : c.stub->UnpinExperts(&ctx, req, &r));
  if (c.json) return PrintJson(r);
  std::printf("%s layer %lld experts %s on %s\n", pin ? "pinned" : "unpinned", static_cast<long long>(layer),
              Join(req.experts()).c_str(), worker.empty() ? "every worker" : ("worker " + worker).c_str());
  if (r.pins().empty()) {
    std::printf("no pins in force\n");
    return;
  }
  Table t({"WORKER", "LAYER", "PINNED EXPERTS"});
  for (const auto& p : r.pins())
    t.Add({p.worker_id().empty() ? "(every worker)" : p.worker_id(), absl::StrCat(p.layer()), Join(p.experts())});
  t.Print();
}

std::string DrainText(const moe::v1::DrainResponse& r) {
  std::string s = absl::StrCat("server ", r.server_id(), ": ", r.state());
  if (r.state() == "draining") {
    std::string pending;
    for (const auto& w : r.workers_pending()) absl::StrAppend(&pending, pending.empty() ? "" : ",", w);
    absl::StrAppend(&s, " (in flight ", r.inflight_requests(), "; workers still routing: ",
                    pending.empty() ? "none" : pending, ")");
  }
  return s;
}

void Drain(Context& c, const std::string& server, bool cancel, bool wait, double wait_seconds) {
  moe::v1::DrainRequest req;
  req.set_server_id(server);
  req.set_cancel(cancel);
  moe::v1::DrainResponse r;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_seconds * 1000));
  for (;;) {
    grpc::ClientContext ctx;
    c.Deadline(ctx);
    c.Check(c.stub->Drain(&ctx, req, &r));  // idempotent: asking again reports the progress
    if (cancel || !wait || r.state() == "drained" || r.state() == "down") break;
    if (std::chrono::steady_clock::now() >= end)
      Die(c.command, absl::StrCat(DrainText(r), " after ", wait_seconds, " s"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (c.json) return PrintJson(r);
  std::printf("%s\n", DrainText(r).c_str());
}

void Policy(Context& c, const std::vector<std::string>& args) {
  moe::v1::PolicyParameters r;
  grpc::ClientContext ctx;
  c.Deadline(ctx);
  if (args.empty() || (args[0] != "get" && args[0] != "set"))
    Die(c.command, "expected 'get' or 'set KEY=VALUE ...' (see moectl policy --help)", 2);
  if (args[0] == "get") {
    if (args.size() != 1) Die(c.command, "'policy get' takes no arguments", 2);
    c.Check(c.stub->GetPolicy(&ctx, moe::v1::GetPolicyRequest(), &r));
  } else {
    if (args.size() < 2) Die(c.command, "'policy set' needs KEY=VALUE", 2);
    moe::v1::SetPolicyRequest req;
    for (size_t i = 1; i < args.size(); ++i) {
      const size_t eq = args[i].find('=');
      if (eq == std::string::npos || eq == 0) Die(c.command, absl::StrCat("'", args[i], "' is not KEY=VALUE"), 2);
      (*req.mutable_values())[args[i].substr(0, eq)] = args[i].substr(eq + 1);
    }
    c.Check(c.stub->SetPolicy(&ctx, req, &r));
  }
  if (c.json) return PrintJson(r);
  Table t({"KEY", "VALUE"});
  t.Add({"half_life_seconds", absl::StrCat(r.half_life_seconds())});
  t.Add({"placement", r.placement()});
  t.Add({"copy_budget_gbps", absl::StrCat(r.copy_budget_gbps())});
  t.Add({"hysteresis_margin", absl::StrCat(r.hysteresis_margin())});
  t.Add({"copy_cost_hits", absl::StrCat(r.copy_cost_hits())});
  t.Add({"replicate_share", absl::StrCat(r.replicate_share())});
  t.Add({"rebalance_interval_seconds", absl::StrCat(r.rebalance_interval_seconds())});
  t.Print();
}

// The command word: the first argument that is neither a flag nor a flag's value.
int FindCommand(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") return i + 1 < argc ? i + 1 : -1;
    if (a == "-h") continue;  // --help's short form
    if (a.rfind("--", 0) == 0) {
      const std::string name = a.substr(2);
      if (name.find('=') == std::string::npos &&
          std::find(kValueFlags.begin(), kValueFlags.end(), name) != kValueFlags.end())
        ++i;
      continue;
    }
    return i;
  }
  return -1;
}

// The usage text of `command` ("" or "help": every command).
std::string UsageOf(const std::string& command) {
  const std::string globals = "--coordinator ADDR [--insecure | --tls-ca CA [--tls-cert C --tls-key K]] [--json]";
  if (command.empty() || command == "help")
    return absl::StrCat(globals, " COMMAND [flags]\nThe coordinator's admin command line.\n\n", kCommands);
  if (command == "status")
    return globals + "\nWorkers, expert servers and assignment versions; per layer the split of the pairs (HIT: GPU cache,\n"
                     "CPU: expert servers, COPIED: copied to the GPU for the call), prediction precision, cache copies/s,\n"
                     "PCIe bytes/s and the link's busy share (summed over the workers' links).";
  if (command == "popularity")
    return globals + " --layer L [--top N] [--worker W]\nA layer's experts by decayed pair count, hottest first.";
  if (command == "rebalance")
    return globals + " [--dry-run]\nRuns a placement round now; --dry-run shows the copies it would make and the "
           "hit rate it expects, changing nothing.";
  if (command == "pin" || command == "unpin")
    return globals + " --layer L --experts 1,5,9 [--worker W]\n" +
           (command == "pin" ? "Keeps these experts cached in layer L of every worker (or of W); pins win over "
                               "popularity and persist in the coordinator's state file."
                             : "Removes pins (the experts stay until placement replaces them).");
  if (command == "drain" || command == "undrain")
    return globals + (command == "drain" ? " [--no-wait] [--wait-seconds N] SERVER\n" : " SERVER\n") +
           (command == "drain" ? "Stops routing to an expert server, then waits until every worker stopped and its "
                                 "in-flight work finished (exit 1 if that takes longer than --wait-seconds)."
                               : "Routes to a drained expert server again.");
  if (command == "policy")
    return globals + " get | set KEY=VALUE [KEY=VALUE ...]\nPolicy keys: half_life_seconds, placement "
           "(per-worker|union), copy_budget_gbps, hysteresis_margin, copy_cost_hits, replicate_share, "
           "rebalance_interval_seconds.";
  return "";
}

// The flags of one moectl invocation.
struct Invocation {
  std::string command;
  std::string coordinator = "127.0.0.1:50100", tls_ca, tls_cert, tls_key, tls_server_name, worker, experts_text;
  bool insecure = false, json = false, dry_run = false, no_wait = false;
  double timeout_seconds = 5, wait_seconds = 30;
  int64_t layer = -1, top = 0;
  std::vector<int> experts;       // --experts, parsed
  std::vector<std::string> rest;  // positional arguments after the command
};

// The global flags and those of `inv->command`.
void RegisterFlags(moe::FlagSet& flags, Invocation* inv) {
  const std::string& command = inv->command;
  flags.String("coordinator", &inv->coordinator, "coordinator address, host:port, or unix:PATH (its --admin-socket)");
  flags.Bool("insecure", &inv->insecure,
             "plaintext gRPC (the coordinator runs with --insecure; mutations then need --insecure-admin there, "
             "or use --coordinator unix:PATH of its --admin-socket)");
  flags.String("tls-ca", &inv->tls_ca, "PEM CA bundle to verify the coordinator");
  flags.String("tls-cert", &inv->tls_cert, "PEM client certificate (mTLS)");
  flags.String("tls-key", &inv->tls_key, "PEM client key (mTLS)");
  flags.String("tls-server-name", &inv->tls_server_name, "TLS name to verify instead of the host");
  flags.Bool("json", &inv->json, "print the response as JSON (proto3 mapping, field names as in coordinator.proto)");
  flags.Double("timeout-seconds", &inv->timeout_seconds, "deadline of each call");
  if (command == "popularity" || command == "pin" || command == "unpin") {
    flags.Int("layer", &inv->layer, "layer index (required)");
    flags.String("worker", &inv->worker, command == "popularity" ? "one worker's counts (default: all workers)"
                                                                 : "only this worker (default: every worker)");
  }
  if (command == "popularity") flags.Int("top", &inv->top, "show the N hottest (0 = all)");
  if (command == "pin" || command == "unpin")
    flags.String("experts", &inv->experts_text, "experts, e.g. 1,5,9 or 4-7 (required)");
  if (command == "rebalance") flags.Bool("dry-run", &inv->dry_run, "plan only: show the copies and the expected hit rate");
  if (command == "drain") {
    flags.Bool("no-wait", &inv->no_wait, "return once the drain is requested");
    flags.Double("wait-seconds", &inv->wait_seconds, "how long to wait for the drain to complete");
  }
}

// After Parse: exits 2 with one line when the command's flags or arguments are wrong.
void CheckFlags(const moe::FlagSet& flags, Invocation* inv) {
  const std::string& command = inv->command;
  if (!(inv->timeout_seconds > 0 && inv->timeout_seconds <= 86400))
    flags.Fail(absl::StrCat("--timeout-seconds: ", inv->timeout_seconds, " is outside (0, 86400]"));
  if (!(inv->wait_seconds >= 0 && inv->wait_seconds <= 86400))  // -1 drained without waiting
    flags.Fail(absl::StrCat("--wait-seconds: ", inv->wait_seconds, " is outside [0, 86400]"));
  if (command == "popularity" || command == "pin" || command == "unpin") {
    if (inv->layer == -1) flags.Fail("--layer is required (see --help)");
    // The wire's layer is 32 bits: 4294967297 was layer 1.
    if (inv->layer < 0 || inv->layer > (1 << 20))
      flags.Fail(absl::StrCat("--layer: ", inv->layer, " is outside [0, 1048576]"));
    if (inv->top < 0 || inv->top > (1 << 20)) flags.Fail(absl::StrCat("--top: ", inv->top, " is outside [0, 1048576]"));
  }
  if (command == "pin" || command == "unpin") {
    if (inv->experts_text.empty()) flags.Fail("--experts is required (e.g. --experts 1,5,9)");
    absl::StatusOr<std::vector<int>> e = moe::ParseIndexList(inv->experts_text, 1 << 20, "experts");
    if (!e.ok()) flags.Fail(std::string(e.status().message()));
    inv->experts = *e;
  }
  const bool takes_args = command == "drain" || command == "undrain" || command == "policy";
  if (!takes_args && !inv->rest.empty()) flags.Fail(absl::StrCat("unexpected argument '", inv->rest[0], "'"));
  if ((command == "drain" || command == "undrain") && inv->rest.size() != 1) flags.Fail("needs exactly one SERVER id");
}

// The admin stub on --coordinator; exits 2 when the TLS flags do not fit it.
Context Connect(const moe::FlagSet& flags, const Invocation& inv) {
  // The coordinator's --admin-socket is plaintext by nature: the kernel, not
  // a certificate, tells the coordinator who is calling.
  const bool unix_target = absl::StartsWith(inv.coordinator, "unix:");
  if (unix_target && (!inv.tls_ca.empty() || !inv.tls_cert.empty() || !inv.tls_key.empty()))
    flags.Fail("--coordinator unix:PATH is the admin socket (no TLS); drop --tls-ca/--tls-cert/--tls-key");
  moe::TlsOptions tls{inv.tls_cert, inv.tls_key, inv.tls_ca, inv.insecure || unix_target, inv.tls_server_name};
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = moe::MakeChannel(inv.coordinator, 16u << 20, tls);
  if (!channel.ok()) flags.Fail(std::string(channel.status().message()));
  Context c;
  c.command = inv.command;
  c.stub = moe::v1::AdminService::NewStub(*channel);
  c.timeout_seconds = inv.timeout_seconds;
  c.json = inv.json;
  c.tls_without_client_cert = !tls.insecure && inv.tls_cert.empty();
  return c;
}

void Run(Context& c, const Invocation& inv) {
  const std::string& command = inv.command;
  if (command == "status") {
    Status(c);
  } else if (command == "popularity") {
    Popularity(c, inv.layer, inv.top, inv.worker);
  } else if (command == "rebalance") {
    Rebalance(c, inv.dry_run);
  } else if (command == "pin" || command == "unpin") {
    Pin(c, command == "pin", inv.layer, inv.experts, inv.worker);
  } else if (command == "drain" || command == "undrain") {
    Drain(c, inv.rest[0], command == "undrain", !inv.no_wait, inv.wait_seconds);
  } else if (command == "policy") {
    Policy(c, inv.rest);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int at = FindCommand(argc, argv);
  Invocation inv;
  inv.command = at < 0 ? "" : argv[at];
  const std::string& command = inv.command;
  if (!command.empty() && std::find(kCommandNames.begin(), kCommandNames.end(), command) == kCommandNames.end())
    Die("", absl::StrCat("unknown command '", command, "' (see moectl --help)"), 2);

  moe::FlagSet flags(command.empty() ? "moectl" : "moectl " + command, UsageOf(command));
  RegisterFlags(flags, &inv);
  std::vector<char*> args(argv, argv + argc);
  if (at > 0) args.erase(args.begin() + at);
  inv.rest = flags.Parse(static_cast<int>(args.size()), args.data());
  if (command.empty() || command == "help") {
    if (command.empty()) flags.Fail("no command (see moectl --help)");
    std::fputs(flags.HelpText().c_str(), stdout);
    return 0;
  }
  CheckFlags(flags, &inv);
  Context c = Connect(flags, inv);
  Run(c, inv);
  return 0;
}
