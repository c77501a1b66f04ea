#include "bench/server_links.h"

#include <signal.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "model/routing.h"
#include "transport/transport.h"

namespace moe {

absl::StatusOr<std::vector<ServerLink>> ParseServerLinks(absl::string_view text) {
  std::vector<ServerLink> links;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    ServerLink l{std::string(item)};
    if (item == "netns") {
      l.netns = true;
    } else if (absl::ConsumePrefix(&item, "netns:")) {
      int us = -1;
      if (!absl::SimpleAtoi(item, &us) || us < 0 || us > 1000000)
        return absl::InvalidArgumentError(absl::StrCat("--links: '", l.name, "': the delay must be 0-1000000 µs"));
      l.netns = true;
      l.delay_us = us;
    } else if (item != "shm") {
      return absl::InvalidArgumentError(absl::StrCat("--links: unknown link '", l.name,
                                                     "' (shm, netns or netns:US)"));
    }
    for (const ServerLink& seen : links)
      if (seen.name == l.name) return absl::InvalidArgumentError(absl::StrCat("--links: '", l.name, "' twice"));
    links.push_back(std::move(l));
  }
  if (links.empty()) return absl::InvalidArgumentError("--links: empty");
  return links;
}

absl::StatusOr<std::unique_ptr<BenchServers>> BenchServers::Start(const Options& o) {
  std::unique_ptr<BenchServers> s(new BenchServers());
  const bool netns = std::any_of(o.links.begin(), o.links.end(), [](const ServerLink& l) { return l.netns; });
  if (netns)
    if (absl::Status why = testing::NetworkStackUnavailable(); !why.ok())
      return absl::FailedPreconditionError(absl::StrCat("--links netns: ", why.message()));
  s->servers_.resize(o.count);
  for (int i = 0; i < o.count; ++i) {
    Server& sv = s->servers_[i];
    s->sockets_.push_back(absl::StrCat(o.dir, "/expert", i, ".sock"));
    std::string listen = "127.0.0.1:0";
    if (netns) {
      absl::StatusOr<std::unique_ptr<testing::NetworkNamespace>> ns = testing::NetworkNamespace::Create();
      if (!ns.ok()) return ns.status();
      sv.ns = *std::move(ns);
      absl::StatusOr<std::unique_ptr<testing::VethLink>> link = testing::VethLink::Create(*sv.ns, i);
      if (!link.ok()) return link.status();
      sv.link = *std::move(link);
      listen = sv.link->peer_address() + ":0";
    }
    std::vector<std::string> args{"--shm-socket=" + s->sockets_.back(), "--insecure", "--listen=" + listen};
    if (static_cast<size_t>(i) < o.args.size()) args.insert(args.end(), o.args[i].begin(), o.args[i].end());
    sv.process = std::make_unique<Subprocess>(o.binary, args, "", sv.ns ? sv.ns->fd() : -1);
    const std::string line = sv.process->ReadLine(o.start_timeout);
    const std::string key = "ready on ";
    const size_t at = line.find(key);
    if (at == std::string::npos)
      return absl::UnavailableError(absl::StrCat("expert server ", i, " did not start (", o.binary, ")"));
    sv.grpc = line.substr(at + key.size());
    while (!sv.grpc.empty() && (sv.grpc.back() == '\n' || sv.grpc.back() == ' ')) sv.grpc.pop_back();
    for (const ServerLink& l : o.links) {
      if (!l.netns || l.delay_us < 0) continue;
      int port = 0;
      if (!absl::SimpleAtoi(sv.grpc.substr(sv.grpc.rfind(':') + 1), &port))
        return absl::InternalError(absl::StrCat("expert server ", i, ": no port in '", sv.grpc, "'"));
      testing::TcpRelay::Options r;
      r.netns_fd = sv.ns->fd();
      r.listen_host = sv.link->peer_address();
      r.upstream_host = sv.link->peer_address();
      r.upstream_port = port;
      r.delay = std::chrono::microseconds(l.delay_us);
      absl::StatusOr<std::unique_ptr<testing::TcpRelay>> relay = testing::TcpRelay::Start(r);
      if (!relay.ok()) return relay.status();
      sv.relays.emplace_back(l.delay_us, *std::move(relay));
    }
  }
  return s;
}

BenchServers::~BenchServers() {
  for (Server& sv : servers_)
    if (sv.process) sv.process->Signal(SIGTERM);
  for (Server& sv : servers_)
    if (sv.process) sv.process->Wait(std::chrono::seconds(30));
  // Relays, links and namespaces go after their servers (members' order).
}

std::vector<std::string> BenchServers::Addresses(const ServerLink& link) const {
  std::vector<std::string> out;
  for (size_t i = 0; i < servers_.size(); ++i) {
    const Server& sv = servers_[i];
    if (!link.netns) {
      out.push_back("unix://" + sockets_[i]);
    } else if (link.delay_us < 0) {
      out.push_back(sv.grpc);
    } else {
      for (const auto& [delay, relay] : sv.relays)
        if (delay == link.delay_us) out.push_back(relay->address());
    }
  }
  return out;
}

absl::StatusOr<double> EmptyRoundTrip(const std::string& address, int hidden, int layer, int tokens, int reps) {
  TransportOptions to;
  to.hidden = hidden;
  to.max_tokens_per_slot = tokens;
  to.max_pairs_per_token = 1;
  to.slots = 2;
  to.tls.insecure = true;
  absl::StatusOr<std::unique_ptr<ExpertTransport>> tr = ConnectTransport(address, to);
  if (!tr.ok()) return tr.status();
  // As the dispatcher polls for decode-sized calls on machines with the threads for it (shm; gRPC ignores it).
  if (std::thread::hardware_concurrency() >= 8) (*tr)->SetPolling(std::chrono::microseconds(2000));
  std::vector<bf16_t> x(static_cast<size_t>(tokens) * hidden, F32ToBf16(0.5f)), y(x.size());
  std::vector<int32_t> ids(tokens, -1);
  std::vector<float> w(tokens, 1.0f);
  std::vector<double> times;
  for (int i = 0; i < reps + 5; ++i) {
    const MoeBatch batch{layer, tokens, x.data(), RoutingView{tokens, 1, ids.data(), w.data()}};
    const auto t0 = std::chrono::steady_clock::now();
    std::future<absl::Status> f = (*tr)->Submit(batch, y.data(), t0 + std::chrono::seconds(30));
    if (absl::Status st = AwaitResult(f); !st.ok()) return st;
    if (i >= 5) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

}  // namespace moe
