#include "core/metrics_http.h"

#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>

#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace moe {

namespace {

constexpr char kExpositionType[] = "text/plain; version=0.0.4; charset=utf-8";

void MethodNotAllowed(const httplib::Request&, httplib::Response& res) {
  res.status = 405;
  res.set_header("Allow", "GET, HEAD");
  res.set_content("405 Method Not Allowed\n", "text/plain; charset=utf-8");
}

// The library binds whatever it can resolve; a name that resolves to nothing
// is the caller's mistake (InvalidArgument), not a busy port.
absl::Status CheckAddress(const std::string& address) {
  if (address.empty()) return absl::OkStatus();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(address.c_str(), nullptr, &hints, &found); rc != 0)
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "': ", gai_strerror(rc)));
  freeaddrinfo(found);
  return absl::OkStatus();
}

}  // namespace

MetricsHttpServer::MetricsHttpServer() : http_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const Options& options,
                                                                            const MetricsRegistry& registry) {
  if (options.port < 0 || options.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", options.port, " out of range [0, 65535]"));
  if (options.threads < 1 || options.threads > 64)
    return absl::InvalidArgumentError(absl::StrCat("metrics threads ", options.threads, " out of range [1, 64]"));
  if (options.client_timeout.count() <= 0)
    return absl::InvalidArgumentError("metrics client_timeout must be > 0");
  if (absl::Status st = CheckAddress(options.address); !st.ok()) return st;
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  httplib::Server& http = *s->http_;
  const size_t threads = static_cast<size_t>(options.threads);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  const auto idle_s = (options.client_timeout.count() + 999) / 1000;
  http.set_keep_alive_max_count(1)  // one request per connection
      .set_keep_alive_timeout(static_cast<time_t>(idle_s))
      .set_read_timeout(options.client_timeout)
      .set_write_timeout(options.client_timeout)
      .set_payload_max_length(1 << 16);
  // SO_REUSEADDR only: the library's default adds SO_REUSEPORT, under which a
  // second process binds a port already in use and takes half its scrapes.
  http.set_socket_options([](int sock) {
    const int one = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  });
  http.Get("/metrics", [&registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry.Render(), kExpositionType);
  });
  http.Post("/metrics", MethodNotAllowed).Put("/metrics", MethodNotAllowed).Patch("/metrics", MethodNotAllowed);
  http.Delete("/metrics", MethodNotAllowed).Options("/metrics", MethodNotAllowed);
  const std::string host = options.address.empty() ? "0.0.0.0" : options.address;
  if (options.port == 0) {
    s->port_ = http.bind_to_any_port(host);
    if (s->port_ <= 0) s->port_ = 0;
  } else if (http.bind_to_port(host, options.port)) {
    s->port_ = options.port;
  }
  if (s->port_ == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", options.port,
                                               " (in use, or not an address of this host)"));
  s->thread_ = std::thread([&http] {
    pthread_setname_np(pthread_self(), "moe-metrics");
    if (!http.listen_after_bind()) LogError("metrics", "the /metrics listener stopped unexpectedly");
  });
  // stop() is a no-op until the listener runs: the destructor must not come first.
  while (!http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace moe
