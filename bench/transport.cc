// bench/transport: round-trip latency of the miss-token transports, measured
// against the floor of copying the same bytes in process.
//
// A child process serves an echo (output = the tokens: the compute is a
// memcpy, so transport dominates) over gRPC (the real ExpertServiceImpl with
// an echo handler) and over shared memory (the real ShmServer). The parent
// times, for n tokens of H = 7168 bf16 with top-8 routing:
//   memcpy       the request's and the response's bytes copied once in process (the floor)
//   unix-socket  the same bytes through a Unix stream socket to the child and back
//                (transport/unix_socket Send/Receive: a second floor, what any
//                socket-based transport pays at least)
//   tcp-socket   the same through a loopback TCP connection (TCP_NODELAY): what
//                any transport over TCP, gRPC's included, pays at least
//   shm          ExpertTransport::Submit (copies in and out of the segment)
//   shm-staged   Stage / SubmitStaged / Release (zero copy: the producer writes the slot)
//   *-polling    the same with SetPolling(2 ms) (both sides poll instead of
//                sleeping; the worker's mode for calls of few tokens); left out
//                below 4 hardware threads
//   grpc-stream  one long-lived ForwardStream
//   grpc-staged  the same with Stage / SubmitStaged / Release (the worker's
//                path: the tokens are lent to gRPC, not copied)
//   grpc-mtls    grpc-stream over mutual TLS (certificates made for the run)
//   grpc-4streams  four ForwardStreams (the worker's default), each on a
//                connection of its own: a batch of 96 KB or more striped over
//                them, smaller ones on the first idle stream
//   grpc-8streams  the same over eight
//   grpc-mtls-4streams  grpc-4streams over mutual TLS
//   grpc-unary   one unary Forward per batch
// Callers wait with AwaitResult (poll briefly, then block), as a GPU worker would.
// p50 / p99 over --iters round trips (fewer for n = 512, see --big-iters), each
// row's p50 against the two socket floors, then messages/s and GB/s with 4
// concurrent callers at n = 8 and n = 512, and last the gRPC rows against
// issue 45's targets (gRPC within 1.5x of the Unix socket, 4 GB/s each way on
// one stream and 8 on four at n = 512, mTLS within 1.3x of plaintext).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/flags.h"
#include "testing/random_data.h"
#include "testing/test_certificates.h"
#include "transport/grpc_channel.h"
#include "transport/shm_server.h"
#include "transport/transport.h"
#include "transport/unix_socket.h"
#include "expert_compute/cpu_features.h"
#include "expert_server/expert_service.h"
#include "grpcpp/grpcpp.h"

namespace {

constexpr int kHidden = 7168, kTopK = 8, kExperts = 256, kLayers = 61, kMaxTokens = 512;

// Child side of the raw socket floor: each message is {request bytes, response
// bytes} (two uint64) and the request; the answer is the response's bytes
// (the head of the request, repeated). Ends when the parent closes its end.
void RawSocketEcho(int fd) {
  std::vector<char> buf;
  uint64_t len[2];
  while (moe::unix_socket::Receive(fd, len, sizeof(len), nullptr, -1).ok()) {
    buf.resize(std::max(len[0], len[1]));
    if (!moe::unix_socket::Receive(fd, buf.data(), len[0], nullptr, -1).ok() ||
        !moe::unix_socket::Send(fd, buf.data(), len[1]).ok())
      break;
  }
  close(fd);
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Child: echo servers on gRPC (plaintext and mTLS ports written to `fd`),
// shm (socket_path), a raw Unix socket (raw_fd) and raw TCP (the first
// connection accepted on tcp_listener).
[[noreturn]] void RunEchoServer(int fd, const std::string& socket_path, int raw_fd, int tcp_listener,
                                const moe::TlsOptions& tls) {
  std::thread(RawSocketEcho, raw_fd).detach();
  std::thread([tcp_listener] {
    const int conn = accept(tcp_listener, nullptr, nullptr);
    close(tcp_listener);
    if (conn < 0) return;
    NoDelay(conn);
    RawSocketEcho(conn);
  }).detach();
  moe::ModelSpec spec;
  spec.num_layers = kLayers;
  spec.num_experts = kExperts;
  spec.hidden = kHidden;
  auto echo = [](const moe::MoeBatch& b, moe::DType, void* out, moe::ForwardStats*) {
    std::memcpy(out, b.tokens, size_t(b.n) * kHidden * 2);
    return absl::OkStatus();
  };
  moe::ServiceLimits limits;
  limits.max_tokens_per_request = kMaxTokens;
  moe::ExpertServiceImpl service(spec, echo, limits, moe::v1::ServerInfo());
  grpc::ServerBuilder builder;
  int ports[2] = {0, 0};
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &ports[0]);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> mtls = moe::MakeServerCredentials(tls);
  if (!mtls.ok()) _exit(1);
  builder.AddListeningPort("127.0.0.1:0", *mtls, &ports[1]);
  builder.RegisterService(&service);
  moe::ConfigureServerBuilder(builder, 64 << 20);
  auto server = builder.BuildAndStart();
  moe::ShmServer::Options so;
  so.socket_path = socket_path;
  so.hidden = kHidden;
  so.num_layers = kLayers;
  so.num_experts = kExperts;
  so.max_slot_tokens = kMaxTokens;
  auto shm = moe::ShmServer::Start(so, [](const moe::MoeBatch& b, moe::bf16_t* out) {
    std::memcpy(out, b.tokens, size_t(b.n) * kHidden * 2);
    return absl::OkStatus();
  });
  if (!server || !shm.ok()) _exit(1);
  (void)!write(fd, ports, sizeof(ports));
  char c;
  (void)!read(fd, &c, 1);  // the parent closes its end when done
  _exit(0);
}

struct Stats { double p50, p99, mean; };

Stats Summarize(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)], sum / us.size()};
}

double Us(std::chrono::steady_clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

struct Named { std::string name; std::unique_ptr<moe::ExpertTransport> t; bool staged; bool polling; };

// One round trip of `len` bytes each way through a connected stream socket
// to RawSocketEcho; false if the echo stopped answering.
bool SocketRoundTrip(int fd, const char* src, char* dst, size_t req_bytes, size_t resp_bytes) {
  const uint64_t lens[2] = {req_bytes, resp_bytes};
  return moe::unix_socket::Send(fd, lens, sizeof(lens)).ok() && moe::unix_socket::Send(fd, src, req_bytes).ok() &&
         moe::unix_socket::Receive(fd, dst, resp_bytes, nullptr, 10000).ok();
}

// Messages/s (and GB/s each way) with 4 concurrent callers of n tokens, each
// one batch at a time, into gbps[transport name]; false if a call failed.
bool Concurrent(std::vector<Named>& transports, int n, double seconds, std::map<std::string, double>* gbps) {
  std::printf("\n## 4 concurrent callers, n = %d (each caller one batch at a time)\n\n"
              "| transport | messages/s | GB/s each way | p50 us |\n| --- | --- | --- | --- |\n", n);
  std::vector<moe::bf16_t> x = moe::RandomActivations(size_t(n) * kHidden, 3);
  std::vector<int32_t> ids;
  std::vector<float> w;
  moe::RandomRouting(n, kTopK, kExperts, 4, 1.0, &ids, &w);
  const double bytes = double(x.size()) * 2 + double(ids.size()) * 8;
  std::atomic<bool> ok{true};
  for (Named& tr : transports) {
    if (tr.staged || tr.polling) continue;
    // Callers poll only when there are cores to spare for them (not on a 2-core box).
    const auto caller_spin = std::thread::hardware_concurrency() >= 8 ? std::chrono::microseconds(200)
                                                                       : std::chrono::microseconds(0);
    std::atomic<int64_t> count{0};
    std::vector<std::vector<double>> lats(4);
    std::vector<std::thread> callers;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (int c = 0; c < 4; ++c) {
      callers.emplace_back([&, c] {
        std::vector<moe::bf16_t> out(x.size());
        while (std::chrono::steady_clock::now() < end) {
          const auto t0 = std::chrono::steady_clock::now();
          auto f = tr.t->Submit(moe::MoeBatch{1, n, x.data(), moe::RoutingView{n, kTopK, ids.data(), w.data()}},
                                out.data(), t0 + std::chrono::seconds(10));
          if (!moe::AwaitResult(f, caller_spin).ok()) { ok = false; return; }
          lats[c].push_back(Us(std::chrono::steady_clock::now() - t0));
          ++count;
        }
      });
    }
    for (auto& t : callers) t.join();
    std::vector<double> all;
    for (auto& l : lats) all.insert(all.end(), l.begin(), l.end());
    if (all.empty()) continue;
    (*gbps)[tr.name] = count.load() * bytes / seconds / 1e9;
    std::printf("| %s | %.0f | %.2f | %.1f |\n", tr.name.c_str(), count.load() / seconds, (*gbps)[tr.name],
                Summarize(all).p50);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t iters = 10000, big_iters = 500, warmup = 200;
  double concurrent_seconds = 2.0;
  std::string sizes = "1,8,64,512";
  std::string only =
      "shm,shm-staged,shm-polling,shm-staged-polling,grpc-stream,grpc-staged,grpc-4streams,grpc-8streams,grpc-mtls,"
      "grpc-mtls-4streams,grpc-unary";
  moe::FlagSet flags("transport", "[flags]\nRound trips over shm, gRPC stream/unary vs an in-process memcpy floor.");
  flags.Int("iters", &iters, "timed round trips per (transport, n) for n <= 64");
  flags.Int("big-iters", &big_iters, "timed round trips for n > 64");
  flags.Int("warmup", &warmup, "untimed round trips first");
  flags.Double("concurrent-seconds", &concurrent_seconds, "duration of the 4-caller throughput run");
  flags.String("tokens", &sizes, "token counts n (comma list, <= 512)");
  flags.String("transports", &only, "transports to time (comma list; memcpy and the socket floors always run)");
  flags.Parse(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);  // rows appear as they are measured
  absl::StatusOr<std::vector<int>> ns = moe::ParseIndexList(sizes, kMaxTokens + 1, "tokens");
  if (!ns.ok() || ns->empty()) flags.Fail("--tokens: bad list");

  char dir_tmpl[] = "/tmp/moe-bench-XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl);
  const std::string sock = dir + "/echo.sock";
  absl::StatusOr<moe::TestCertificates> certs = moe::WriteTestCertificates(dir);
  if (!certs.ok()) flags.Fail(std::string(certs.status().message()), 1);
  int fds[2], raw[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, raw) != 0)
    flags.Fail("socketpair failed", 1);
  // The raw TCP floor's listener, on loopback like the gRPC ports.
  const int tcp_listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in tcp_addr{};
  tcp_addr.sin_family = AF_INET;
  tcp_addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t tcp_addr_len = sizeof(tcp_addr);
  if (tcp_listener < 0 || bind(tcp_listener, reinterpret_cast<sockaddr*>(&tcp_addr), sizeof(tcp_addr)) != 0 ||
      listen(tcp_listener, 1) != 0 ||
      getsockname(tcp_listener, reinterpret_cast<sockaddr*>(&tcp_addr), &tcp_addr_len) != 0)
    flags.Fail("cannot listen on loopback TCP", 1);
  const pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the benchmark
    close(fds[0]);
    close(raw[0]);
    RunEchoServer(fds[1], sock, raw[1], tcp_listener, certs->Server());
  }
  close(fds[1]);
  close(raw[1]);
  close(tcp_listener);
  int ports[2] = {0, 0};
  if (read(fds[0], ports, sizeof(ports)) != sizeof(ports)) flags.Fail("echo server did not start", 1);
  const std::string addr = absl::StrCat("127.0.0.1:", ports[0]), mtls_addr = absl::StrCat("localhost:", ports[1]);
  const int tcp = socket(AF_INET, SOCK_STREAM, 0);
  if (tcp < 0 || connect(tcp, reinterpret_cast<sockaddr*>(&tcp_addr), sizeof(tcp_addr)) != 0)
    flags.Fail("cannot connect to the TCP echo", 1);
  NoDelay(tcp);

  moe::TransportOptions o;
  o.hidden = kHidden;
  o.max_tokens_per_slot = kMaxTokens;
  o.max_pairs_per_token = kTopK;
  o.slots = 8;
  o.tls.insecure = true;
  o.max_message_bytes = 64 << 20;
  // "-polling": both sides poll (ExpertTransport::SetPolling, the mode the
  // worker turns on for calls of few tokens) and the caller spins on the
  // future, as LayerDispatcher does; the others sleep on futexes.
  std::vector<Named> transports;
  const bool can_poll = std::thread::hardware_concurrency() >= 4;  // a poller per side needs spare cores
  for (const char* kind : {"shm", "shm-staged", "shm-polling", "shm-staged-polling", "grpc-stream", "grpc-staged",
                           "grpc-4streams", "grpc-8streams", "grpc-mtls", "grpc-mtls-4streams", "grpc-unary"}) {
    const std::string k = kind;
    if (("," + only + ",").find("," + k + ",") == std::string::npos) continue;
    const bool polling = k.find("-polling") != std::string::npos;
    if (polling && !can_poll) continue;
    moe::TransportOptions to = o;
    to.grpc_unary = k == "grpc-unary";
    to.grpc_streams = k.find("-4streams") != std::string::npos ? 4 : k.find("-8streams") != std::string::npos ? 8 : 1;
    const bool shm = k.rfind("shm", 0) == 0, mtls = k.rfind("grpc-mtls", 0) == 0;
    if (mtls) to.tls = certs->Client();
    absl::StatusOr<std::unique_ptr<moe::ExpertTransport>> t =
        moe::ConnectTransport(shm ? "unix://" + sock : mtls ? mtls_addr : addr, to);
    if (!t.ok()) flags.Fail(absl::StrCat(kind, ": ", t.status().message()), 1);
    if (polling) (*t)->SetPolling(std::chrono::milliseconds(2));
    transports.push_back({k, *std::move(t), k.find("staged") != std::string::npos, polling});
  }
  if (!can_poll) std::fprintf(stderr, "fewer than 4 hardware threads: the -polling rows are left out\n");

  const auto& cpu = moe::CpuFeatures::Get();
  std::printf("## Transport round trips (echo server in a separate process)\n\n");
  std::printf("Machine: %s, %u hardware threads. H = %d bf16, top-%d routing per token; iterations: %lld for n <= 64, %lld for n > 64 (after %lld warm-up).\n\n",
              cpu.brand.c_str(), std::thread::hardware_concurrency(), kHidden, kTopK,
              static_cast<long long>(iters), static_cast<long long>(big_iters), static_cast<long long>(warmup));
  std::printf("| n | bytes each way | transport | p50 us | p99 us | mean us | p50 / unix-socket p50 | p50 / tcp-socket p50 |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  bool ok = true;
  std::map<std::pair<std::string, int>, double> p50s;  // (transport, n) -> p50 us
  for (int n : *ns) {
    if (n < 1) continue;
    const int runs = static_cast<int>(n > 64 ? big_iters : iters);
    std::vector<moe::bf16_t> x = moe::RandomActivations(size_t(n) * kHidden, n);
    std::vector<int32_t> ids;
    std::vector<float> w;
    moe::RandomRouting(n, kTopK, kExperts, n + 1, 1.0, &ids, &w);
    std::vector<moe::bf16_t> out(x.size());
    const size_t req_bytes = x.size() * 2 + ids.size() * 8, resp_bytes = out.size() * 2;
    // Floor: the same bytes copied once each way in process.
    std::vector<char> src(req_bytes + resp_bytes), dst(req_bytes + resp_bytes);
    std::memcpy(src.data(), x.data(), x.size() * 2);
    std::vector<double> lat;
    for (int i = 0; i < warmup + runs; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(dst.data(), src.data(), req_bytes);
      std::memcpy(dst.data() + req_bytes, src.data() + req_bytes, resp_bytes);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) lat.push_back(Us(t1 - t0));
    }
    const Stats floor = Summarize(lat);
    // Second and third floors: raw Unix socket and loopback TCP round trips
    // to the child with the same bytes.
    Stats socket_floors[2];
    for (int f = 0; f < 2; ++f) {
      const char* name = f == 0 ? "unix-socket" : "tcp-socket";
      lat.clear();
      for (int i = 0; i < warmup + runs; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        if (!SocketRoundTrip(f == 0 ? raw[0] : tcp, src.data(), dst.data(), req_bytes, resp_bytes)) {
          std::fprintf(stderr, "%s n=%d: the echo child stopped answering\n", name, n);
          ok = false;
          break;
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (i >= warmup) lat.push_back(Us(t1 - t0));
      }
      if (lat.empty()) flags.Fail(absl::StrCat(name, ": no round trip completed"), 1);
      socket_floors[f] = Summarize(lat);
    }
    const Stats& unix_floor = socket_floors[0];
    const Stats& tcp_floor = socket_floors[1];
    p50s[{"unix-socket", n}] = unix_floor.p50;
    p50s[{"tcp-socket", n}] = tcp_floor.p50;
    std::printf("| %d | %zu | memcpy | %.2f | %.2f | %.2f | - | - |\n", n, req_bytes, floor.p50, floor.p99, floor.mean);
    std::printf("| %d | %zu | unix-socket | %.2f | %.2f | %.2f | 1 | %.2f |\n", n, req_bytes, unix_floor.p50,
                unix_floor.p99, unix_floor.mean, unix_floor.p50 / tcp_floor.p50);
    std::printf("| %d | %zu | tcp-socket | %.2f | %.2f | %.2f | %.2f | 1 |\n", n, req_bytes, tcp_floor.p50,
                tcp_floor.p99, tcp_floor.mean, tcp_floor.p50 / unix_floor.p50);
    const moe::MoeBatch batch{1, n, x.data(), moe::RoutingView{n, kTopK, ids.data(), w.data()}};
    for (Named& tr : transports) {
      lat.clear();
      const auto spin = tr.polling ? std::chrono::microseconds(2000) : std::chrono::microseconds(200);  // 200: AwaitResult's default
      for (int i = 0; i < warmup + runs; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        absl::Status st;
        if (tr.staged) {
          absl::StatusOr<moe::StagingArea> s = tr.t->Stage(n, kTopK, t0 + std::chrono::seconds(10));
          if (!s.ok()) { st = s.status(); } else {
            // A producer writes straight into the slot (here from host memory; a GPU would DMA).
            std::memcpy(s->tokens, x.data(), x.size() * 2);
            std::memcpy(s->expert_ids, ids.data(), ids.size() * 4);
            std::memcpy(s->expert_weights, w.data(), w.size() * 4);
            auto f = tr.t->SubmitStaged(*s, 1, t0 + std::chrono::seconds(10));
            st = moe::AwaitResult(f, spin);
            if (st.ok() && std::memcmp(s->output, x.data(), 64) != 0) st = absl::DataLossError("echo mismatch");
            tr.t->Release(*s);
          }
        } else {
          auto f = tr.t->Submit(batch, out.data(), t0 + std::chrono::seconds(10));
          st = moe::AwaitResult(f, spin);
          if (st.ok() && std::memcmp(out.data(), x.data(), out.size() * 2) != 0) st = absl::DataLossError("echo mismatch");
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (!st.ok()) {
          std::fprintf(stderr, "%s n=%d: %s\n", tr.name.c_str(), n, std::string(st.message()).c_str());
          ok = false;
          break;
        }
        if (i >= warmup) lat.push_back(Us(t1 - t0));
      }
      if (lat.empty()) continue;
      const Stats s = Summarize(lat);
      p50s[{tr.name, n}] = s.p50;
      std::printf("| %d | %zu | %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", n, req_bytes, tr.name.c_str(), s.p50,
                  s.p99, s.mean, s.p50 / unix_floor.p50, s.p50 / tcp_floor.p50);
    }
  }

  std::map<std::string, double> gbps_512;
  for (int n : {8, kMaxTokens}) {
    if (std::find(ns->begin(), ns->end(), n) == ns->end()) continue;
    std::map<std::string, double> gbps;
    if (!Concurrent(transports, n, concurrent_seconds, &gbps)) ok = false;
    if (n == kMaxTokens) gbps_512 = gbps;
  }

  // Issue 45's targets for gRPC, from the figures above ("-": not measured in this run).
  auto ratio = [&](const std::string& a, const std::string& b, int n) {
    auto x = p50s.find({a, n}), y = p50s.find({b, n});
    return x == p50s.end() || y == p50s.end() ? std::string("-") : absl::StrFormat("%.2f", x->second / y->second);
  };
  auto rate = [&](const std::string& t) {
    auto it = gbps_512.find(t);
    return it == gbps_512.end() ? std::string("-") : absl::StrFormat("%.2f", it->second);
  };
  std::printf("\n## gRPC against issue 45's targets (p50 ratios of the table above)\n\n"
              "| n | grpc-stream / unix-socket | grpc-4streams / unix-socket | grpc-8streams / unix-socket | "
              "grpc-staged / unix-socket | grpc-stream / tcp-socket | grpc-mtls / grpc-stream | "
              "grpc-mtls-4streams / grpc-4streams |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int n : *ns)
    if (n >= 1)
      std::printf("| %d | %s | %s | %s | %s | %s | %s | %s |\n", n, ratio("grpc-stream", "unix-socket", n).c_str(),
                  ratio("grpc-4streams", "unix-socket", n).c_str(), ratio("grpc-8streams", "unix-socket", n).c_str(),
                  ratio("grpc-staged", "unix-socket", n).c_str(), ratio("grpc-stream", "tcp-socket", n).c_str(),
                  ratio("grpc-mtls", "grpc-stream", n).c_str(), ratio("grpc-mtls-4streams", "grpc-4streams", n).c_str());
  std::printf("\nTargets: gRPC / unix-socket <= 1.5 at every n; mTLS / plaintext <= 1.3 at n = 512; with 4 callers at "
              "n = 512, one stream >= 4 GB/s each way (grpc-stream: %s) and four streams >= 8 (grpc-4streams: %s; "
              "grpc-8streams: %s).\n",
              rate("grpc-stream").c_str(), rate("grpc-4streams").c_str(), rate("grpc-8streams").c_str());
  transports.clear();
  close(raw[0]);
  close(tcp);
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  unlink(sock.c_str());
  rmdir(dir.c_str());
  return ok ? 0 : 1;
}
