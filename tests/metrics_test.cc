// Metrics: the registry's exposition text (exact, with labels, escaping and
// histograms), exact totals under concurrent updates, the /metrics HTTP
// server over real sockets (200/404/405/400/431, /healthz, silent and slow
// clients, the whole-request deadline, slow-loris connections from one peer
// that deny nobody else, the per-peer cap, many connections, shutdown with a
// client connected), the peer keys of process/socket_peer.h, and the real
// moe-expert-server scraped over HTTP after gRPC and shared-memory requests.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include "core/metrics.h"
#include "process/metrics_http.h"
#include "process/socket_peer.h"
#include "testing/random_data.h"
#include "transport/transport.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// ---- Exposition format ----------------------------------------------------

TEST(MetricsFormat, ExactTextForCounterGaugeAndHistogram) {
  MetricsRegistry r;
  Family<Counter>& requests = r.AddCounter("test_requests_total", "Requests by code\\path.\nSecond line.",
                                           {"code", "path"});
  requests.WithLabels({"OK", "a\\b\"c\nd"})->Increment(3);
  requests.WithLabels({"INVALID_ARGUMENT", "/x"})->Increment();
  r.AddGauge("test_gauge", "A gauge.").Get()->Set(-2.5);
  r.AddCounter("test_unused_total", "Has labels but no series: not exported.", {"layer"});
  Histogram* h =
      r.AddHistogram("test_latency_seconds", "Latency.", {"transport"}, {0.001, 0.0078125, 0.5}).WithLabels({"shm"});
  h->Observe(0.000244140625);  // 2^-12
  h->Observe(0.0078125);       // on a bound: counts in that bucket (le is inclusive)
  h->Observe(2);               // past the last bound: +Inf only
  EXPECT_EQ(h->count(), 3u);

  const std::string expected =
      "# HELP test_gauge A gauge.\n"
      "# TYPE test_gauge gauge\n"
      "test_gauge -2.5\n"
      "# HELP test_latency_seconds Latency.\n"
      "# TYPE test_latency_seconds histogram\n"
      "test_latency_seconds_bucket{transport=\"shm\",le=\"0.001\"} 1\n"
      "test_latency_seconds_bucket{transport=\"shm\",le=\"0.0078125\"} 2\n"
      "test_latency_seconds_bucket{transport=\"shm\",le=\"0.5\"} 2\n"
      "test_latency_seconds_bucket{transport=\"shm\",le=\"+Inf\"} 3\n"
      "test_latency_seconds_sum{transport=\"shm\"} 2.008056640625\n"
      "test_latency_seconds_count{transport=\"shm\"} 3\n"
      "# HELP test_requests_total Requests by code\\\\path.\\nSecond line.\n"
      "# TYPE test_requests_total counter\n"
      "test_requests_total{code=\"INVALID_ARGUMENT\",path=\"/x\"} 1\n"
      "test_requests_total{code=\"OK\",path=\"a\\\\b\\\"c\\nd\"} 3\n";
  EXPECT_EQ(r.Render(), expected);
}

TEST(MetricsFormat, UnlabeledHistogramAndZeroSeries) {
  MetricsRegistry r;
  r.AddHistogram("h_seconds", "H.", {}, {1, 2});
  r.AddCounter("c_total", "C.");
  EXPECT_EQ(r.Render(),
            "# HELP c_total C.\n# TYPE c_total counter\nc_total 0\n"
            "# HELP h_seconds H.\n# TYPE h_seconds histogram\n"
            "h_seconds_bucket{le=\"1\"} 0\nh_seconds_bucket{le=\"2\"} 0\nh_seconds_bucket{le=\"+Inf\"} 0\n"
            "h_seconds_sum 0\nh_seconds_count 0\n");
}

TEST(MetricsFormat, ValuesAsThePrometheusGoClientWritesThem) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(1), "1");
  EXPECT_EQ(FormatMetricValue(-2.5), "-2.5");
  EXPECT_EQ(FormatMetricValue(0.25), "0.25");
  EXPECT_EQ(FormatMetricValue(0.0001), "0.0001");
  EXPECT_EQ(FormatMetricValue(0.00025), "0.00025");
  EXPECT_EQ(FormatMetricValue(5e-6), "5e-06");
  EXPECT_EQ(FormatMetricValue(2.5e-5), "2.5e-05");
  EXPECT_EQ(FormatMetricValue(917504), "917504");
  EXPECT_EQ(FormatMetricValue(1e6), "1e+06");
  EXPECT_EQ(FormatMetricValue(1.5e10), "1.5e+10");
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatMetricValue(std::nan("")), "NaN");
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST(MetricsFormat, LatencyBucketsSpan5usTo10s) {
  const std::vector<double> b = LatencyBuckets();
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(b.front(), 5e-6);
  EXPECT_EQ(b.back(), 10.0);
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
}

TEST(MetricsRegistry, SameRegistrationReturnsTheSameFamilyAndSeries) {
  MetricsRegistry r;
  Family<Counter>& a = r.AddCounter("x_total", "X.", {"k"});
  Family<Counter>& b = r.AddCounter("x_total", "X.", {"k"});
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(a.WithLabels({"v"}), b.WithLabels({"v"}));
  EXPECT_NE(a.WithLabels({"v"}), a.WithLabels({"w"}));
  EXPECT_EQ(r.AddGauge("g", "G.").Get(), r.AddGauge("g", "G.").Get());
}

TEST(MetricsRegistryDeathTest, MisuseAbortsWithTheReason) {
  MetricsRegistry r;
  r.AddCounter("x_total", "X.", {"k"});
  EXPECT_DEATH(r.AddGauge("x_total", "X.", {"k"}), "registered again");
  EXPECT_DEATH(r.AddCounter("bad-name", "B."), "invalid metric name");
  EXPECT_DEATH(r.AddHistogram("h", "H.", {"le"}), "invalid label name");
  EXPECT_DEATH(r.AddCounter("x_total", "X.", {"k"}).WithLabels({"a", "b"}), "2 label values for 1");
}

TEST(MetricsRegistry, ScrapeHooksRunBeforeRenderingUntilRemoved) {
  MetricsRegistry r;
  Gauge* g = r.AddGauge("version", "V.").Get();
  int runs = 0;
  {
    MetricsRegistry::Hook hook = r.AddScrapeHook([&] { g->Set(++runs); });
    EXPECT_NE(r.Render().find("version 1\n"), std::string::npos);
    EXPECT_NE(r.Render().find("version 2\n"), std::string::npos);
  }
  EXPECT_NE(r.Render().find("version 2\n"), std::string::npos);
  EXPECT_EQ(runs, 2);
}

// ---- Concurrency ----------------------------------------------------------

TEST(MetricsConcurrency, ThreadsIncrementingGiveExactTotals) {
  MetricsRegistry r;
  Family<Counter>& family = r.AddCounter("c_total", "C.", {"t"});
  Counter* shared = family.WithLabels({"shared"});
  Gauge* gauge = r.AddGauge("g", "G.").Get();
  Histogram* hist = r.AddHistogram("h_seconds", "H.", {}, {0.5, 1.5}).Get();
  constexpr int kThreads = 8, kIters = 100000;
  std::atomic<bool> go{false}, done{false};
  std::vector<Counter*> own(kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      // Creating series concurrently: each racer gets the same one.
      Counter* mine = family.WithLabels({"t" + std::to_string(t % 2)});
      own[t] = mine;
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kIters; ++i) {
        shared->Increment();
        mine->Increment(2);
        gauge->Add(1);
        hist->Observe(i % 2);  // 0 -> le 0.5, 1 -> le 1.5
      }
    });
  }
  std::thread scraper([&] {  // rendering while the counters move
    while (!done.load()) EXPECT_FALSE(r.Render().empty());
  });
  go.store(true);
  for (auto& t : ts) t.join();
  done.store(true);
  scraper.join();
  EXPECT_EQ(shared->value(), uint64_t(kThreads) * kIters);
  EXPECT_EQ(own[0], own[2]);
  EXPECT_EQ(own[0]->value() + own[1]->value(), uint64_t(kThreads) * kIters * 2);
  EXPECT_EQ(gauge->value(), double(kThreads) * kIters);
  EXPECT_EQ(hist->count(), uint64_t(kThreads) * kIters);
  EXPECT_EQ(hist->bucket_count(0), uint64_t(kThreads) * kIters / 2);
  EXPECT_EQ(hist->bucket_count(1), uint64_t(kThreads) * kIters / 2);
  EXPECT_EQ(hist->sum(), double(kThreads) * kIters / 2);
}

// ---- HTTP -----------------------------------------------------------------

int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Everything the peer sends until it closes, or until `timeout`.
std::string ReadUntilClosed(int fd, milliseconds timeout, bool* closed = nullptr) {
  std::string out;
  const auto end = SteadyClock::now() + timeout;
  if (closed) *closed = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(end - SteadyClock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) break;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      if (closed) *closed = true;
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Sends `request` on a fresh connection and returns the whole response.
std::string Exchange(int port, const std::string& request, milliseconds timeout = milliseconds(5000)) {
  const int fd = ConnectTo(port);
  if (fd < 0) return "";
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string r = ReadUntilClosed(fd, timeout);
  close(fd);
  return r;
}

std::string Body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::string StatusLineOf(const std::string& response) { return response.substr(0, response.find("\r\n")); }

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_.AddCounter("scrapes_total", "Test counter.", {"kind"}).WithLabels({"a"})->Increment(7);
    MetricsHttpServer::Options o;
    o.address = "127.0.0.1";
    o.request_timeout = milliseconds(500);
    auto s = MetricsHttpServer::Start(o, registry_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ASSERT_GT(server_->port(), 0);
  }
  MetricsRegistry registry_;
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpTest, GetMetricsServesTheRegistry) {
  const std::string r = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
  EXPECT_EQ(StatusLineOf(r), "HTTP/1.1 200 OK");
  EXPECT_NE(r.find("\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), std::string::npos) << r;
  const std::string body = registry_.Render();
  EXPECT_NE(r.find("\r\nContent-Length: " + std::to_string(body.size()) + "\r\n"), std::string::npos) << r;
  EXPECT_EQ(Body(r), body);
  EXPECT_NE(body.find("scrapes_total{kind=\"a\"} 7\n"), std::string::npos);
  // A query string and HTTP/1.0 are fine too.
  EXPECT_EQ(StatusLineOf(Exchange(server_->port(), "GET /metrics?name[]=x HTTP/1.0\r\n\r\n")), "HTTP/1.1 200 OK");
  // HEAD: the headers only.
  const std::string head = Exchange(server_->port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(StatusLineOf(head), "HTTP/1.1 200 OK");
  EXPECT_EQ(Body(head), "");
}

TEST_F(MetricsHttpTest, OtherPathsMethodsAndMalformedRequests) {
  const int port = server_->port();
  EXPECT_EQ(StatusLineOf(Exchange(port, "GET / HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  EXPECT_EQ(StatusLineOf(Exchange(port, "GET /metricsx HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  for (const char* method : {"POST", "PUT", "PATCH", "DELETE", "OPTIONS"}) {
    const std::string r = Exchange(port, std::string(method) + " /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    EXPECT_EQ(StatusLineOf(r), "HTTP/1.1 405 Method Not Allowed") << method;
    EXPECT_NE(r.find("\r\nAllow: GET, HEAD\r\n"), std::string::npos) << r;
  }
  for (const char* bad : {"garbage\r\n\r\n", "GET /metrics\r\n\r\n", "GET /metrics HTTP/2.0\r\n\r\n",
                          "FROB /metrics HTTP/1.1\r\n\r\n"}) {
    EXPECT_EQ(StatusLineOf(Exchange(port, bad)), "HTTP/1.1 400 Bad Request") << bad;
  }
  // A request far past the header limit gets no 200, and the server goes on.
  const std::string huge = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(100000, 'a') + "\r\n\r\n";
  EXPECT_NE(StatusLineOf(Exchange(port, huge)), "HTTP/1.1 200 OK");
  EXPECT_EQ(StatusLineOf(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
}

TEST_F(MetricsHttpTest, SilentClientDoesNotBlockOthersAndIsClosedAfterTheTimeout) {
  const int silent = ConnectTo(server_->port());
  ASSERT_GE(silent, 0);
  // While it sits there, others are served at once.
  const auto t0 = SteadyClock::now();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(StatusLineOf(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
  EXPECT_LT(SteadyClock::now() - t0, milliseconds(400));
  // The server drops it when request_timeout (500 ms) is up, without an answer.
  bool closed = false;
  EXPECT_EQ(ReadUntilClosed(silent, milliseconds(4000), &closed), "");
  EXPECT_TRUE(closed);
  EXPECT_GE(SteadyClock::now() - t0, milliseconds(450));
  EXPECT_LT(SteadyClock::now() - t0, milliseconds(1500));
  close(silent);
}

// Issue 47, defect 4: the deadline covers the whole request from accept; the
// bytes that do arrive do not restart it (an idle timer would keep this
// client, which sends a byte every 100 ms and never ends its headers, for ever).
TEST_F(MetricsHttpTest, TricklingClientIsClosedAtTheRequestDeadline) {
  const int fd = ConnectTo(server_->port());
  ASSERT_GE(fd, 0);
  const auto t0 = SteadyClock::now();
  const std::string request = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(1000, 'a');
  bool closed = false;
  std::string got;
  for (size_t i = 0; i < request.size() && !closed && SteadyClock::now() - t0 < milliseconds(5000); ++i) {
    if (send(fd, &request[i], 1, MSG_NOSIGNAL) != 1) break;
    got += ReadUntilClosed(fd, milliseconds(100), &closed);
  }
  if (!closed) got += ReadUntilClosed(fd, milliseconds(100), &closed);
  const auto lived = SteadyClock::now() - t0;
  EXPECT_TRUE(closed) << "still open after 5 s of trickling";
  EXPECT_GE(lived, milliseconds(450));
  EXPECT_LT(lived, milliseconds(1500)) << "request_timeout is 500 ms";
  EXPECT_EQ(got.find("200 OK"), std::string::npos) << got;
  close(fd);
}

TEST_F(MetricsHttpTest, HealthzAnswersOk) {
  const std::string r = Exchange(server_->port(), "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusLineOf(r), "HTTP/1.1 200 OK");
  EXPECT_EQ(Body(r), "ok\n");
  EXPECT_EQ(Body(Exchange(server_->port(), "HEAD /healthz HTTP/1.1\r\n\r\n")), "");
  const std::string post = Exchange(server_->port(), "POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(StatusLineOf(post), "HTTP/1.1 405 Method Not Allowed");
}

TEST_F(MetricsHttpTest, SlowClientSendingByteByByteIsServed) {
  const int fd = ConnectTo(server_->port());
  ASSERT_GE(fd, 0);
  for (char c : std::string("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")) {
    ASSERT_EQ(send(fd, &c, 1, MSG_NOSIGNAL), 1);
    std::this_thread::sleep_for(milliseconds(2));
  }
  EXPECT_EQ(StatusLineOf(ReadUntilClosed(fd, milliseconds(2000))), "HTTP/1.1 200 OK");
  close(fd);
}

TEST_F(MetricsHttpTest, ManySequentialAndConcurrentConnections) {
  for (int i = 0; i < 100; ++i)
    ASSERT_EQ(StatusLineOf(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK") << i;
  // As many at once as one peer may have open (the default cap, 4).
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 40; ++i)
        ok += StatusLineOf(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n")) == "HTTP/1.1 200 OK";
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), 160);
}

TEST_F(MetricsHttpTest, ShutsDownWithinTheIdleTimeoutWithAClientConnected) {
  const int idle = ConnectTo(server_->port());
  ASSERT_GE(idle, 0);
  std::this_thread::sleep_for(milliseconds(50));  // accepted by now
  const auto t0 = SteadyClock::now();
  server_.reset();
  EXPECT_LT(SteadyClock::now() - t0, milliseconds(1500));
  bool closed = false;
  ReadUntilClosed(idle, milliseconds(1000), &closed);
  EXPECT_TRUE(closed);
  close(idle);
}

TEST(MetricsHttp, PortInUseAndBadPortAreErrors) {
  MetricsRegistry r;
  MetricsHttpServer::Options o;
  o.address = "127.0.0.1";
  auto first = MetricsHttpServer::Start(o, r);
  ASSERT_TRUE(first.ok()) << first.status();
  o.port = (*first)->port();
  auto second = MetricsHttpServer::Start(o, r);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  o.port = 70000;
  EXPECT_EQ(MetricsHttpServer::Start(o, r).status().code(), absl::StatusCode::kInvalidArgument);
  o.port = 0;
  o.address = "no-such-host.invalid";
  EXPECT_EQ(MetricsHttpServer::Start(o, r).status().code(), absl::StatusCode::kInvalidArgument);
  o.address = "127.0.0.1";
  o.max_connections = 0;
  EXPECT_EQ(MetricsHttpServer::Start(o, r).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_connections = 8;
  o.max_connections_per_peer = 9;
  EXPECT_EQ(MetricsHttpServer::Start(o, r).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_connections_per_peer = 4;
  o.request_timeout = milliseconds(0);
  EXPECT_EQ(MetricsHttpServer::Start(o, r).status().code(), absl::StatusCode::kInvalidArgument);
}

// One scrape of `path`: true when it got a 200 within `bound`.
bool ScrapedWithin(int port, const std::string& path, milliseconds bound) {
  const auto t0 = SteadyClock::now();
  const std::string r = Exchange(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n", bound);
  return StatusLineOf(r) == "HTTP/1.1 200 OK" && SteadyClock::now() - t0 < bound;
}

// Issue 47, defect 4: eight connections that send a byte every 0.5 s (the
// default deadlines and limits, with the per-peer cap raised so that this
// uid's attack gets all its connections in) hold no one else: every scrape of
// /metrics and /healthz in the meantime is answered within 1 s.
TEST(MetricsHttp, SlowLorisConnectionsDelayNoOtherScrape) {
  MetricsRegistry r;
  r.AddCounter("x_total", "X.").Get()->Increment();
  MetricsHttpServer::Options o;
  o.address = "127.0.0.1";
  o.max_connections_per_peer = 16;
  auto s = MetricsHttpServer::Start(o, r);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  std::thread attack([port] { EXPECT_EQ(testing::SlowLoris(port, 8, milliseconds(500), milliseconds(4000)), 8); });
  std::this_thread::sleep_for(milliseconds(300));
  std::atomic<int> ok{0}, tried{0};
  std::vector<std::thread> scrapers;
  for (int t = 0; t < 4; ++t) {
    scrapers.emplace_back([&, t] {
      for (int i = 0; i < 6; ++i) {
        ++tried;
        ok += ScrapedWithin(port, t % 2 ? "/healthz" : "/metrics", milliseconds(1000)) ? 1 : 0;
        std::this_thread::sleep_for(milliseconds(400));
      }
    });
  }
  for (auto& t : scrapers) t.join();
  attack.join();
  EXPECT_EQ(ok.load(), tried.load());
}

// Issue 47, defect 4, with a second local user: the attacker (uid 65534, a
// child process) opens 8 slow connections; only 4 get in (the per-peer cap,
// the others answered 503 at once), and this uid's scrapes are answered
// within 1 s all along. The peer of a loopback connection is its socket's
// owner, not 127.0.0.1, so the attacker's cap is not ours.
TEST(MetricsHttp, APeerAtItsCapIsRefusedAndOtherUsersAreServed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (a child process becomes uid 65534)";
  MetricsRegistry r;
  r.AddCounter("x_total", "X.").Get()->Increment();
  MetricsHttpServer::Options o;
  o.address = "127.0.0.1";
  auto s = MetricsHttpServer::Start(o, r);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  const pid_t pid = testing::SlowLorisChild(port, 8, milliseconds(500), milliseconds(4000));
  ASSERT_GT(pid, 0);
  std::this_thread::sleep_for(milliseconds(300));
  int ok = 0, tried = 0;
  for (const auto end = SteadyClock::now() + milliseconds(3500); SteadyClock::now() < end; ++tried) {
    ok += ScrapedWithin(port, tried % 2 ? "/healthz" : "/metrics", milliseconds(1000)) ? 1 : 0;
    std::this_thread::sleep_for(milliseconds(200));
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 4) << "connections the attacker held (254: could not become uid 65534)";
  EXPECT_EQ(ok, tried);
  EXPECT_GE((*s)->refused_connections(), 4u);
}

// A TCP socket listening on 127.0.0.1 at a free port (-1 on failure), its
// port in *port.
int LoopbackListener(int backlog, int* port) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(listener, backlog) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (listener >= 0) close(listener);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return listener;
}

// A client connected to `listener` at `port` and its accepted end; *peer the
// client's address as accept() gave it. False on failure.
bool ConnectAndAccept(int listener, int port, int* client, int* accepted, sockaddr_in* peer) {
  *client = ConnectTo(port);
  socklen_t len = sizeof(*peer);
  *accepted = *client < 0 ? -1 : accept(listener, reinterpret_cast<sockaddr*>(peer), &len);
  return *client >= 0 && *accepted >= 0;
}

// The peer keys: a loopback connection is its socket's owner; other
// addresses are themselves, whatever the port; unknown forms are "".
TEST(SocketPeer, LoopbackPeersAreTheirUidOthersTheirAddress) {
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv4:10.1.2.3:5000"), "ip:10.1.2.3");
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv4:10.1.2.3:6000"), "ip:10.1.2.3");
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv6:[2001:db8::1]:5000"), "ip:2001:db8::1");
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv6:[::ffff:10.0.0.7]:5000"), "ip:10.0.0.7");
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv6:[fe80::1%25eth0]:5000"), "ip:fe80::1");
  for (const char* unknown : {"unix:/tmp/x.sock", "fd:7", "ipv4:1.2.3.4", "ipv4:nonsense:1", "ipv6:::1:5", ""})
    EXPECT_EQ(PeerKeyOfGrpcPeer(unknown), "") << unknown;
  // A real loopback connection: its client end belongs to this uid.
  int port = 0, client = -1, accepted = -1;
  const int listener = LoopbackListener(4, &port);
  ASSERT_GE(listener, 0);
  sockaddr_in peer{};
  ASSERT_TRUE(ConnectAndAccept(listener, port, &client, &accepted, &peer));
  socklen_t len = sizeof(peer);
  const std::string uid = "uid:" + std::to_string(geteuid());
  EXPECT_EQ(PeerKey(reinterpret_cast<sockaddr*>(&peer), len), uid);
  EXPECT_EQ(PeerKeyOfGrpcPeer("ipv4:127.0.0.1:" + std::to_string(ntohs(peer.sin_port))), uid);
  close(accepted);
  close(client);
  // A dual-stack client (an AF_INET6 socket with the v4-mapped address, as
  // gRPC's clients have) is found in the IPv6 table.
  const int client6 = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client6, 0);
  sockaddr_in6 to{};
  to.sin6_family = AF_INET6;
  to.sin6_port = htons(static_cast<uint16_t>(port));
  ASSERT_EQ(inet_pton(AF_INET6, "::ffff:127.0.0.1", &to.sin6_addr), 1);
  ASSERT_EQ(connect(client6, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  len = sizeof(peer);
  const int accepted6 = accept(listener, reinterpret_cast<sockaddr*>(&peer), &len);
  ASSERT_GE(accepted6, 0);
  EXPECT_EQ(PeerKey(reinterpret_cast<sockaddr*>(&peer), len), uid);
  close(accepted6);
  close(client6);
  close(listener);
}

// A caller that has closed its socket is nobody's: not its former owner, and
// not root (a TIME_WAIT entry reports uid 0), so sending and closing at once
// does not take another user's key.
TEST(SocketPeer, ALoopbackPeerThatClosedItsSocketIsItsAddress) {
  int port = 0;
  const int listener = LoopbackListener(4, &port);
  ASSERT_GE(listener, 0);
  for (bool server_closes : {false, true}) {
    int client = -1, accepted = -1;
    sockaddr_in peer{};
    ASSERT_TRUE(ConnectAndAccept(listener, port, &client, &accepted, &peer));
    const socklen_t len = sizeof(peer);
    EXPECT_EQ(PeerKey(reinterpret_cast<sockaddr*>(&peer), len), "uid:" + std::to_string(geteuid()));
    // The client closes first: its end goes to FIN_WAIT2 (orphaned), and to
    // TIME_WAIT once the server closes too.
    close(client);
    if (server_closes) close(accepted);
    std::this_thread::sleep_for(milliseconds(50));
    EXPECT_EQ(PeerKey(reinterpret_cast<sockaddr*>(&peer), len), "ip:127.0.0.1")
        << (server_closes ? "TIME_WAIT" : "FIN_WAIT2");
    if (!server_closes) close(accepted);
  }
  close(listener);
}

// A loopback peer is found while other connections of the namespace come and
// go (the kernel is asked over sock_diag). The /proc/net/tcp scan this
// replaced could skip a live socket when entries before it vanished between
// its page-sized reads (the soak's flood once registered 125 ids against a
// cap of 64, under two keys); this churn did not make it miss on the dev VM
// (204 lookups in 3 s, ~15 ms each beside 27,000 TIME_WAIT sockets), so it
// guards the sock_diag lookup under churn rather than reproducing that flake.
TEST(SocketPeer, LoopbackPeersAreFoundWhileOtherConnectionsComeAndGo) {
  int port = 0;
  const int listener = LoopbackListener(512, &port);
  ASSERT_GE(listener, 0);
  // The connections under test, opened before the churn starts.
  std::vector<int> fds;
  std::vector<sockaddr_in> peers;
  for (int i = 0; i < 8; ++i) {
    int client = -1, accepted = -1;
    sockaddr_in peer{};
    ASSERT_TRUE(ConnectAndAccept(listener, port, &client, &accepted, &peer));
    fds.insert(fds.end(), {client, accepted});
    peers.push_back(peer);
  }
  // Churn: keep ~300 connections open, closing the oldest and opening anew.
  std::atomic<bool> stop{false};
  std::thread acceptor([&] {
    while (!stop.load()) {
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int fd = accept(listener, nullptr, nullptr);
      if (fd >= 0) close(fd);  // the server closes at once: both ends churn
    }
  });
  std::thread churn([&] {
    std::vector<int> open;
    for (size_t i = 0; !stop.load(); ++i) {
      const int fd = ConnectTo(port);
      if (fd >= 0) open.push_back(fd);
      if (open.size() > 300) {
        close(open.front());
        open.erase(open.begin());
      }
    }
    for (int fd : open) close(fd);
  });
  const std::string uid = "uid:" + std::to_string(geteuid());
  int missed = 0, looked = 0;
  for (const auto end = SteadyClock::now() + milliseconds(3000); SteadyClock::now() < end; ++looked) {
    const sockaddr_in& peer = peers[looked % peers.size()];
    const std::string key = PeerKey(reinterpret_cast<const sockaddr*>(&peer), sizeof(peer));
    if (key != uid) ++missed;
  }
  stop = true;
  churn.join();
  acceptor.join();
  for (int fd : fds) close(fd);
  close(listener);
  EXPECT_EQ(missed, 0) << "of " << looked << " lookups";
  EXPECT_GE(looked, 100);
}

// ---- The expert server, scraped -------------------------------------------

// Sample lines of an exposition, keyed by everything before the value.
std::map<std::string, double> ParseSamples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) {
      ADD_FAILURE() << "bad sample line: " << line;
      continue;
    }
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

struct Batch {
  uint32_t layer;
  int n, k;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  MoeBatch view() const {
    return MoeBatch{static_cast<int>(layer), n, x.data(), RoutingView{n, k, ids.data(), w.data()}};
  }
};

// n tokens, 2 experts each, for `layer`.
Batch MakeBatch(uint32_t layer, int n, uint64_t seed) {
  Batch b{layer, n, 2, RandomActivations(size_t(n) * 96, seed), {}, {}};
  RandomRouting(n, 2, 8, seed + 1, 1.0, &b.ids, &b.w);
  return b;
}

TEST(ExpertServerMetrics, ScrapedCountersMatchWhatWasSent) {
  testing::TempDir dir;
  const std::string socket = dir.path() + "/expert.sock";
  testing::Subprocess* raw = nullptr;
  const std::string addr = testing::StartExpertServer(
      &raw, {"--model=synthetic:tiny:seed=5", "--threads=2", "--shm-socket=" + socket, "--metrics-port=0",
             "--metrics-address=127.0.0.1"});
  std::unique_ptr<testing::Subprocess> server(raw);
  ASSERT_FALSE(addr.empty()) << "moe-expert-server did not start";
  const std::string line = server->ReadLine(std::chrono::seconds(10));
  const std::string key = "metrics on 127.0.0.1:";
  ASSERT_NE(line.find(key), std::string::npos) << line;
  const int port = std::stoi(line.substr(line.find(key) + key.size()));

  // Before any request: the families are there, at zero.
  std::map<std::string, double> s = ParseSamples(Body(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n")));
  EXPECT_EQ(s["moe_expert_compute_threads"], 2);
  EXPECT_EQ(s["moe_expert_tokens_total{layer=\"1\"}"], 0);
  EXPECT_GT(s["moe_expert_weight_bytes"], 0);

  TransportOptions o;
  o.hidden = 96;
  o.max_tokens_per_slot = 16;
  o.max_pairs_per_token = 4;
  o.slots = 4;
  o.tls.insecure = true;
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(10); };
  std::map<std::string, uint64_t> tokens, pairs;  // by layer
  auto sent = [&](const Batch& b) {
    tokens[std::to_string(b.layer)] += b.n;
    for (int32_t id : b.ids) pairs[std::to_string(b.layer)] += id >= 0;
  };

  // gRPC: two unary calls and one on the stream, then a bad layer.
  o.grpc_unary = true;
  auto unary = ConnectTransport(addr, o);
  ASSERT_TRUE(unary.ok()) << unary.status();
  o.grpc_unary = false;
  auto stream = ConnectTransport(addr, o);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<bf16_t> out(16 * 96);
  for (const Batch& b : {MakeBatch(1, 3, 1), MakeBatch(2, 5, 2)}) {
    ASSERT_TRUE((*unary)->Submit(b.view(), out.data(), deadline()).get().ok());
    sent(b);
  }
  const Batch on_stream = MakeBatch(1, 4, 3);
  ASSERT_TRUE((*stream)->Submit(on_stream.view(), out.data(), deadline()).get().ok());
  sent(on_stream);
  Batch bad = MakeBatch(1, 2, 4);
  bad.layer = 99;
  EXPECT_EQ((*unary)->Submit(bad.view(), out.data(), deadline()).get().code(), absl::StatusCode::kInvalidArgument);

  // Shared memory: two batches of one slot each, then a layer without experts.
  o.grpc_unary = false;
  auto shm = ConnectTransport("unix://" + socket, o);
  ASSERT_TRUE(shm.ok()) << shm.status();
  uint64_t shm_in = 0, shm_out = 0;
  for (const Batch& b : {MakeBatch(1, 7, 5), MakeBatch(2, 2, 6)}) {
    ASSERT_TRUE((*shm)->Submit(b.view(), out.data(), deadline()).get().ok());
    sent(b);
    shm_in += uint64_t(b.n) * 96 * 2 + uint64_t(b.n) * b.k * 8;
    shm_out += uint64_t(b.n) * 96 * 2;
  }
  // Layer 0 of `tiny` is dense: the slot is well-formed (its bytes count as
  // received) but the executor refuses it.
  Batch dense = MakeBatch(0, 2, 7);
  EXPECT_EQ((*shm)->Submit(dense.view(), out.data(), deadline()).get().code(), absl::StatusCode::kInvalidArgument);
  shm_in += uint64_t(dense.n) * 96 * 2 + uint64_t(dense.n) * dense.k * 8;

  const std::string text = Body(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n"));
  s = ParseSamples(text);
  EXPECT_EQ(s["moe_expert_requests_total{transport=\"grpc\",code=\"OK\"}"], 3) << text;
  EXPECT_EQ(s["moe_expert_requests_total{transport=\"grpc\",code=\"INVALID_ARGUMENT\"}"], 1) << text;
  EXPECT_EQ(s["moe_expert_requests_total{transport=\"shm\",code=\"OK\"}"], 2) << text;
  EXPECT_EQ(s["moe_expert_requests_total{transport=\"shm\",code=\"INVALID_ARGUMENT\"}"], 1) << text;
  for (const auto& [layer, n] : tokens) {
    EXPECT_EQ(s["moe_expert_tokens_total{layer=\"" + layer + "\"}"], double(n)) << "layer " << layer;
    EXPECT_EQ(s["moe_expert_pairs_total{layer=\"" + layer + "\"}"], double(pairs[layer])) << "layer " << layer;
  }
  EXPECT_EQ(tokens["1"], 14u);
  EXPECT_EQ(tokens["2"], 7u);
  EXPECT_EQ(s["moe_expert_bytes_received_total{transport=\"shm\"}"], double(shm_in));
  EXPECT_EQ(s["moe_expert_bytes_sent_total{transport=\"shm\"}"], double(shm_out));
  // gRPC payloads are the serialized messages: at least the tensors' bytes.
  EXPECT_GE(s["moe_expert_bytes_received_total{transport=\"grpc\"}"], double((3 + 5 + 4 + 2) * 96 * 2));
  EXPECT_GE(s["moe_expert_bytes_sent_total{transport=\"grpc\"}"], double((3 + 5 + 4) * 96 * 2));
  EXPECT_EQ(s["moe_expert_request_seconds_count{transport=\"grpc\"}"], 4);
  EXPECT_EQ(s["moe_expert_request_seconds_count{transport=\"shm\"}"], 3);
  EXPECT_EQ(s["moe_expert_kernel_seconds_count"], 5);  // computed batches
  EXPECT_EQ(s["moe_expert_kernel_seconds_bucket{le=\"+Inf\"}"], 5);
  EXPECT_GT(s["moe_expert_kernel_seconds_sum"], 0);
  EXPECT_EQ(s["moe_expert_queue_seconds_count"], 5);
  EXPECT_EQ(s["moe_expert_merged_requests_total"], 0) << "one client's requests, one at a time";
  EXPECT_NE(text.find("# TYPE moe_expert_merged_requests_total counter\n"), std::string::npos);
  EXPECT_EQ(s["moe_expert_batches_in_flight"], 0);
  EXPECT_NE(text.find("# TYPE moe_expert_kernel_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE moe_expert_requests_total counter\n"), std::string::npos);
}

}  // namespace
}  // namespace moe
