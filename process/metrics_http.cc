#include "process/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"
#include "process/socket_peer.h"

namespace moe {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kExpositionType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kTextType[] = "text/plain; charset=utf-8";
constexpr size_t kMaxHeadBytes = 8192;
// After the response: what the client still sends is read and dropped until
// it closes or this passes, so closing never resets the response away.
constexpr auto kLinger = std::chrono::milliseconds(1000);
constexpr int kMaxAcceptsPerWake = 64;
constexpr auto kAcceptPause = std::chrono::milliseconds(100);  // after accept ran out of descriptors
constexpr auto kRefusalLogInterval = std::chrono::seconds(10);

// The methods HTTP/1.1 defines; anything else is a malformed request (400).
bool KnownMethod(absl::string_view m) {
  for (absl::string_view k : {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE"})
    if (m == k) return true;
  return false;
}

std::string Response(int status, absl::string_view reason, absl::string_view type, const std::string& body,
                     bool with_body, absl::string_view extra_headers = "") {
  std::string r = absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", type,
                               "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                               "Connection: close\r\n\r\n");
  if (with_body) r += body;
  return r;
}

std::string Plain(int status, absl::string_view reason, absl::string_view extra_headers = "") {
  return Response(status, reason, kTextType, absl::StrCat(status, " ", reason, "\n"), true, extra_headers);
}

// Where the request's head ends (the byte after its blank line), or npos.
size_t HeadEnd(const std::string& in) {
  const size_t lf_lf = in.find("\n\n"), crlf = in.find("\n\r\n");
  const size_t a = lf_lf == std::string::npos ? std::string::npos : lf_lf + 2;
  const size_t b = crlf == std::string::npos ? std::string::npos : crlf + 3;
  return std::min(a, b);
}

// The whole response to a request head (the request line and headers).
std::string Answer(absl::string_view head, const MetricsRegistry& registry) {
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  for (absl::string_view& l : lines) absl::ConsumeSuffix(&l, "\r");
  size_t first = 0;
  while (first < lines.size() && lines[first].empty()) ++first;  // blank lines before the request line
  if (first == lines.size()) return Plain(400, "Bad Request");
  const std::vector<absl::string_view> parts = absl::StrSplit(lines[first], ' ');
  if (parts.size() != 3 || !KnownMethod(parts[0]) || !absl::StartsWith(parts[1], "/") ||
      (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0"))
    return Plain(400, "Bad Request");
  for (size_t i = first + 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    const size_t colon = lines[i].find(':');
    if (colon == 0 || colon == absl::string_view::npos ||
        lines[i].substr(0, colon).find_first_of(" \t") != absl::string_view::npos)
      return Plain(400, "Bad Request");
  }
  const absl::string_view method = parts[0];
  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  const bool read = method == "GET" || method == "HEAD";
  if (path == "/metrics" || path == "/healthz") {
    if (!read) return Plain(405, "Method Not Allowed", "Allow: GET, HEAD\r\n");
    if (path == "/healthz") return Response(200, "OK", kTextType, "ok\n", method == "GET");
    return Response(200, "OK", kExpositionType, registry.Render(), method == "GET");
  }
  return Plain(404, "Not Found");
}

// The library-free resolution: a name that resolves to nothing is the
// caller's mistake (InvalidArgument), not a busy port.
absl::StatusOr<addrinfo*> Resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0)
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", host, "': ", gai_strerror(rc)));
  return found;
}

// A non-blocking listening socket on the first address of `host` that binds
// (SO_REUSEADDR only: with SO_REUSEPORT a second process could bind the port
// and take half the scrapes); -1 when none does.
int Listen(addrinfo* addresses) {
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) return fd;
    close(fd);
  }
  return -1;
}

}  // namespace

// The event loop: every connection's state, its peer and deadline. Runs on
// the server's one thread; nothing here is shared.
class MetricsHttpServer::Loop {
 public:
  Loop(const Options& options, const MetricsRegistry& registry, std::atomic<uint64_t>* refused)
      : options_(options), registry_(registry), refused_(refused) {}

  ~Loop() {
    for (Connection& c : conns_) close(c.fd);
  }

  void Run(int listen_fd, int wake_fd) {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_fd, POLLIN, 0});
      // Out of descriptors: the listener stays readable, so it is left out of
      // the poll for a while (instead of spinning on accept's EMFILE).
      const bool accepting = Clock::now() >= accept_paused_until_;
      fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});
      Clock::time_point next = accepting ? Clock::time_point::max() : accept_paused_until_;
      for (const Connection& c : conns_) {
        fds.push_back({c.fd, static_cast<short>(c.state == State::kWriting ? POLLOUT : POLLIN), 0});
        next = std::min(next, c.deadline);
      }
      int timeout_ms = -1;
      if (next != Clock::time_point::max()) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
        timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
      }
      if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
        LogError("metrics", "poll failed: ", strerror(errno), "; the /metrics listener stops");
        return;
      }
      if (fds[0].revents != 0) return;  // stopping
      const Clock::time_point now = Clock::now();
      // Connections first (their indexes match fds[2...]), then the new ones.
      for (size_t i = 0; i < conns_.size(); ++i) {
        const short ev = fds[i + 2].revents;
        if (ev == 0) continue;
        Connection& c = conns_[i];
        if (c.state == State::kWriting) {
          Write(c, now);
        } else {
          Read(c, now);
        }
      }
      for (Connection& c : conns_)
        if (c.state != State::kClosed && now >= c.deadline) c.state = State::kClosed;
      Sweep();
      if (fds[1].revents != 0) Accept(listen_fd, now);
    }
  }

 private:
  enum class State { kReading, kWriting, kDraining, kClosed };
  struct Connection {
    int fd = -1;
    std::string peer;
    State state = State::kReading;
    Clock::time_point deadline;
    std::string in, out;
    size_t sent = 0;
    bool counted = true;  // one of its peer's places (until answered)
  };

  void Accept(int listen_fd, Clock::time_point now) {
    for (int i = 0; i < kMaxAcceptsPerWake; ++i) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_paused_until_ = now + kAcceptPause;
        return;  // EAGAIN: none left; anything else: try again on the next wake
      }
      std::string peer = PeerKey(reinterpret_cast<sockaddr*>(&addr), len);
      int& open = per_peer_[peer];
      // At the limit, a connection that has had its answer (lingering for
      // the client's close) makes room.
      bool full = static_cast<int>(conns_.size()) >= options_.max_connections;
      if (full && open < options_.max_connections_per_peer) full = !CloseOneDraining();
      if (full || open >= options_.max_connections_per_peer) {
        static const std::string busy = Plain(503, "Service Unavailable");
        (void)!send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        close(fd);
        if (open == 0) per_peer_.erase(peer);
        NoteRefusal(peer, full, now);
        continue;
      }
      ++open;
      Connection c;
      c.fd = fd;
      c.peer = std::move(peer);
      c.deadline = now + options_.request_timeout;
      conns_.push_back(std::move(c));
    }
  }

  // Closes a connection that already had its answer; false when there is none.
  bool CloseOneDraining() {
    for (size_t i = 0; i < conns_.size(); ++i) {
      if (conns_[i].state != State::kDraining) continue;
      close(conns_[i].fd);
      conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
    return false;
  }

  void NoteRefusal(const std::string& peer, bool full, Clock::time_point now) {
    refused_->fetch_add(1, std::memory_order_relaxed);
    ++unlogged_refusals_;
    if (last_refusal_log_ != Clock::time_point() && now - last_refusal_log_ < kRefusalLogInterval) return;
    LogWarning("metrics", "refused ", unlogged_refusals_, " connection(s) since the last such line; the last from ",
               peer.empty() ? "an unknown peer" : peer, ": ",
               full ? absl::StrCat(options_.max_connections, " connections open (the limit)")
                    : absl::StrCat("it has ", options_.max_connections_per_peer, " open (the cap per peer)"));
    unlogged_refusals_ = 0;
    last_refusal_log_ = now;
  }

  void Read(Connection& c, Clock::time_point now) {
    char buf[4096];
    for (;;) {
      const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        c.state = State::kClosed;  // the client went away (or finished, when draining)
        return;
      }
      if (n < 0) return;  // nothing more for now
      if (c.state == State::kDraining) continue;
      c.in.append(buf, static_cast<size_t>(n));
      const size_t end = HeadEnd(c.in);
      if (end != std::string::npos) {
        Respond(c, Answer(absl::string_view(c.in).substr(0, end), registry_), now);
        return;
      }
      if (c.in.size() > kMaxHeadBytes) {
        Respond(c, Plain(431, "Request Header Fields Too Large"), now);
        return;
      }
    }
  }

  void Respond(Connection& c, std::string response, Clock::time_point now) {
    c.in.clear();
    c.in.shrink_to_fit();
    c.out = std::move(response);
    c.sent = 0;
    c.state = State::kWriting;
    c.deadline = now + options_.response_timeout;
    Write(c, now);
  }

  void Write(Connection& c, Clock::time_point now) {
    while (c.sent < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        c.state = State::kClosed;
        return;
      }
      c.sent += static_cast<size_t>(n);
    }
    c.out.clear();
    c.out.shrink_to_fit();
    shutdown(c.fd, SHUT_WR);
    Uncount(c);  // answered: no longer one of its peer's places
    c.state = State::kDraining;
    c.deadline = std::min(c.deadline, now + kLinger);
  }

  void Uncount(Connection& c) {
    if (!c.counted) return;
    c.counted = false;
    auto it = per_peer_.find(c.peer);
    if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
  }

  // Closes the connections marked closed.
  void Sweep() {
    auto gone = std::remove_if(conns_.begin(), conns_.end(), [this](Connection& c) {
      if (c.state != State::kClosed) return false;
      close(c.fd);
      Uncount(c);
      return true;
    });
    conns_.erase(gone, conns_.end());
  }

  const Options options_;
  const MetricsRegistry& registry_;
  std::atomic<uint64_t>* const refused_;
  std::vector<Connection> conns_;
  std::map<std::string, int> per_peer_;  // connections not answered yet, by peer
  Clock::time_point accept_paused_until_{};
  uint64_t unlogged_refusals_ = 0;
  Clock::time_point last_refusal_log_{};  // {}: never
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const Options& options,
                                                                            const MetricsRegistry& registry) {
  if (options.port < 0 || options.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", options.port, " out of range [0, 65535]"));
  if (options.request_timeout.count() <= 0 || options.response_timeout.count() <= 0)
    return absl::InvalidArgumentError("metrics request_timeout and response_timeout must be > 0");
  if (options.max_connections < 1 || options.max_connections > 1024)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics max_connections ", options.max_connections, " out of range [1, 1024]"));
  if (options.max_connections_per_peer < 1 || options.max_connections_per_peer > options.max_connections)
    return absl::InvalidArgumentError(absl::StrCat("metrics max_connections_per_peer ",
                                                   options.max_connections_per_peer, " out of range [1, ",
                                                   options.max_connections, "]"));
  const std::string host = options.address.empty() ? "0.0.0.0" : options.address;
  absl::StatusOr<addrinfo*> addresses = Resolve(host, options.port);
  if (!addresses.ok()) return addresses.status();
  const int fd = Listen(*addresses);
  freeaddrinfo(*addresses);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", options.port,
                                               " (in use, or not an address of this host)"));
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->listen_fd_ = fd;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0)
    s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd_ < 0) return absl::InternalError(absl::StrCat("metrics: eventfd: ", strerror(errno)));
  s->loop_ = std::make_unique<Loop>(options, registry, &s->refused_);
  s->thread_ = std::thread([loop = s->loop_.get(), fd, wake = s->wake_fd_] {
    pthread_setname_np(pthread_self(), "moe-metrics");
    loop->Run(fd, wake);
  });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  loop_.reset();  // closes the connections left
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

}  // namespace moe
