#include "core/metrics_http.h"

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
#include <list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace moe {

namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr size_t kMaxRequestHead = 8192;
// After the response, how long we read (and discard) what the client still
// sends before closing: closing with unread data would reset the connection
// and could destroy the response before the client reads it.
constexpr std::chrono::milliseconds kLinger{1000};

std::string StatusLine(int code) {
  switch (code) {
    case 200: return "200 OK";
    case 400: return "400 Bad Request";
    case 404: return "404 Not Found";
    case 405: return "405 Method Not Allowed";
    case 431: return "431 Request Header Fields Too Large";
    default: return "500 Internal Server Error";
  }
}

std::string Response(int code, std::string_view content_type, const std::string& body, bool head_only = false,
                     std::string_view extra_headers = {}) {
  std::string r = absl::StrCat("HTTP/1.1 ", StatusLine(code), "\r\nContent-Type: ", absl::string_view(content_type.data(), content_type.size()),
                               "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n");
  r.append(extra_headers).append("\r\n");
  if (!head_only) r.append(body);
  return r;
}

std::string ErrorResponse(int code) {
  return Response(code, "text/plain; charset=utf-8", StatusLine(code) + "\n");
}

bool IsTokenChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

// Splits "METHOD SP TARGET SP HTTP/1.x"; false when it is not one.
bool ParseRequestLine(std::string_view line, std::string_view* method, std::string_view* target) {
  const size_t a = line.find(' ');
  if (a == std::string_view::npos || a == 0) return false;
  const size_t b = line.find(' ', a + 1);
  if (b == std::string_view::npos || b == a + 1) return false;
  *method = line.substr(0, a);
  *target = line.substr(a + 1, b - a - 1);
  const std::string_view version = line.substr(b + 1);
  if (!std::all_of(method->begin(), method->end(), IsTokenChar)) return false;
  if (target->front() != '/') return false;
  for (char c : *target) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return false;
  }
  return version == "HTTP/1.1" || version == "HTTP/1.0";
}

// The line in `text` starting at `from`, without its "\r\n" or "\n"; npos end when incomplete.
std::string_view LineAt(std::string_view text, size_t from, size_t* next) {
  const size_t nl = text.find('\n', from);
  if (nl == std::string_view::npos) {
    *next = std::string_view::npos;
    return {};
  }
  *next = nl + 1;
  size_t end = nl;
  if (end > from && text[end - 1] == '\r') --end;
  return text.substr(from, end - from);
}

}  // namespace

struct MetricsHttpServer::Connection {
  enum class State { kReading, kWriting, kLingering };
  int fd = -1;
  State state = State::kReading;
  std::string in, out;
  size_t sent = 0;
  SteadyClock::time_point deadline;
  ~Connection() {
    if (fd >= 0) close(fd);
  }
};

MetricsHttpServer::MetricsHttpServer(const Options& options, const MetricsRegistry& registry)
    : options_(options), registry_(registry) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const Options& options,
                                                                            const MetricsRegistry& registry) {
  if (options.port < 0 || options.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", options.port, " out of range [0, 65535]"));
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer(options, registry));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = getaddrinfo(options.address.empty() ? nullptr : options.address.c_str(), port.c_str(), &hints, &found);
      rc != 0)
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", options.address, "': ", gai_strerror(rc)));
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr && s->listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    s->listen_fd_ = fd;
  }
  freeaddrinfo(found);
  if (s->listen_fd_ < 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.address, ":", options.port, ": ", last_error));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd_ < 0) {
    close(s->listen_fd_);
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void MetricsHttpServer::Loop() {
  pthread_setname_np(pthread_self(), "moe-metrics");
  std::list<Connection> conns;
  std::vector<pollfd> fds;
  std::vector<Connection*> polled;
  SteadyClock::time_point accept_paused_until{};
  while (!stop_.load()) {
    const auto now = SteadyClock::now();
    // Close connections past their deadline (silent or slow clients).
    conns.remove_if([now](const Connection& c) { return now >= c.deadline; });
    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    const bool accepting = static_cast<int>(conns.size()) < options_.max_connections && now >= accept_paused_until;
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    auto wake_at = now + std::chrono::seconds(1);
    if (!accepting && now < accept_paused_until) wake_at = std::min(wake_at, accept_paused_until);
    for (Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.state == Connection::State::kWriting ? POLLOUT : POLLIN), 0});
      polled.push_back(&c);
      wake_at = std::min(wake_at, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now).count() + 1;
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0))) < 0) {
      if (errno == EINTR) continue;
      LogError("metrics", "poll: ", std::strerror(errno));
      break;
    }
    if (stop_.load()) break;
    for (size_t i = 0; i < polled.size(); ++i) {
      Connection& c = *polled[i];
      if (fds[i + 2].revents == 0) continue;
      if (c.state == Connection::State::kReading) ReadRequest(c);
      if (c.state == Connection::State::kWriting) {
        while (c.sent < c.out.size()) {
          const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (n > 0) {
            c.sent += static_cast<size_t>(n);
          } else {
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
            c.deadline = now;  // the client went away
            break;
          }
        }
        if (c.sent == c.out.size()) {
          shutdown(c.fd, SHUT_WR);
          c.state = Connection::State::kLingering;
          c.deadline = std::min(c.deadline, SteadyClock::now() + kLinger);
        }
      } else if (c.state == Connection::State::kLingering) {
        char buf[4096];
        for (;;) {
          const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
          if (n > 0) continue;
          if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.deadline = now;  // done
          break;
        }
      }
    }
    if (fds[1].revents & POLLIN) {
      while (static_cast<int>(conns.size()) < options_.max_connections) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            LogWarning("metrics", "accept: ", std::strerror(errno), "; pausing for 100 ms");
            accept_paused_until = SteadyClock::now() + std::chrono::milliseconds(100);
          }
          break;
        }
        Connection& c = conns.emplace_back();
        c.fd = fd;
        c.deadline = SteadyClock::now() + options_.client_timeout;
      }
    }
  }
}

void MetricsHttpServer::ReadRequest(Connection& c) {
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      if (c.in.size() > kMaxRequestHead) break;
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c.deadline = SteadyClock::now();  // closed before a whole request: nothing to answer
      return;
    }
    break;
  }
  // The request line alone tells a malformed request: answer it at once.
  size_t next;
  const std::string_view line = LineAt(c.in, 0, &next);
  std::string_view method, target;
  if (next != std::string_view::npos && !ParseRequestLine(line, &method, &target)) {
    c.out = ErrorResponse(400);
  } else {
    const size_t end = c.in.find("\n\r\n") != std::string::npos ? c.in.find("\n\r\n") + 3
                       : c.in.find("\n\n") != std::string::npos ? c.in.find("\n\n") + 2
                                                                 : std::string::npos;
    if (end != std::string::npos && end <= kMaxRequestHead) {
      c.out = Respond(c.in.substr(0, end));
    } else if (c.in.size() > kMaxRequestHead) {
      c.out = ErrorResponse(431);
    } else {
      return;  // wait for more
    }
  }
  c.state = Connection::State::kWriting;
  c.in.clear();
}

std::string MetricsHttpServer::Respond(const std::string& head) const {
  size_t next;
  std::string_view method, target;
  if (!ParseRequestLine(LineAt(head, 0, &next), &method, &target)) return ErrorResponse(400);
  // Header lines: "name: value", no obsolete line folding.
  for (;;) {
    const std::string_view line = LineAt(head, next, &next);
    if (next == std::string_view::npos || line.empty()) break;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0 ||
        !std::all_of(line.begin(), line.begin() + colon, IsTokenChar))
      return ErrorResponse(400);
  }
  const std::string_view path = target.substr(0, target.find('?'));
  if (path != "/metrics") return ErrorResponse(404);
  if (method != "GET" && method != "HEAD")
    return Response(405, "text/plain; charset=utf-8", StatusLine(405) + "\n", false, "Allow: GET, HEAD\r\n");
  return Response(200, "text/plain; version=0.0.4; charset=utf-8", registry_.Render(), method == "HEAD");
}

}  // namespace moe
