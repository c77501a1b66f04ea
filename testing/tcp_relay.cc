#include "testing/tcp_relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::testing {
namespace {

using RelayClock = std::chrono::steady_clock;

// Bytes read from one side and not yet written to the other, per direction;
// reading stops above this (the sender then sees TCP's back-pressure).
constexpr size_t kMaxQueuedBytes = size_t{8} << 20;
constexpr size_t kReadBytes = size_t{256} << 10;

struct Chunk {
  RelayClock::time_point due;  // read time + the delay
  std::string bytes;
  size_t written = 0;
};

// One direction of a connection: bytes read from `from`, written to `to`
// once due.
struct Direction {
  int from = -1, to = -1;
  std::deque<Chunk> queue;
  size_t queued = 0;
  bool eof = false;       // `from` closed its side
  bool shut = false;      // ... and everything was written: `to` was shut for writing
  std::atomic<uint64_t>* written = nullptr;

  bool WantsRead() const { return !eof && queued < kMaxQueuedBytes; }
  bool Due(RelayClock::time_point now) const { return !queue.empty() && queue.front().due <= now; }
};

struct Connection {
  int client = -1, upstream = -1;
  Direction up, down;  // client -> upstream, upstream -> client
  bool broken = false;
};

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

bool SetNonBlocking(int fd) { return fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) == 0; }

absl::StatusOr<sockaddr_in> Address(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1)
    return absl::InvalidArgumentError(absl::StrCat("TcpRelay: not an IPv4 address: ", host));
  return a;
}

// Reads what `d.from` has (once); false when the connection broke.
bool ReadSide(Direction& d, RelayClock::time_point now, std::chrono::microseconds delay) {
  std::string buf(kReadBytes, '\0');
  const ssize_t n = read(d.from, buf.data(), buf.size());
  if (n > 0) {
    buf.resize(static_cast<size_t>(n));
    d.queued += buf.size();
    d.queue.push_back(Chunk{now + delay, std::move(buf)});
  } else if (n == 0) {
    d.eof = true;
  } else if (errno != EAGAIN && errno != EINTR) {
    return false;
  }
  return true;
}

// Writes the due chunks to `d.to` while it takes them; false when broken.
bool WriteSide(Direction& d, RelayClock::time_point now) {
  while (d.Due(now)) {
    Chunk& c = d.queue.front();
    // Counted before the peer can have them (a reader of the count that has
    // the answer in hand sees it counted), the part not taken uncounted after.
    const size_t left = c.bytes.size() - c.written;
    d.written->fetch_add(left);
    const ssize_t n = send(d.to, c.bytes.data() + c.written, left, MSG_NOSIGNAL);
    d.written->fetch_sub(left - static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    c.written += static_cast<size_t>(n);
    if (c.written < c.bytes.size()) return true;
    d.queued -= c.bytes.size();
    d.queue.pop_front();
  }
  if (d.eof && d.queue.empty() && !d.shut) {
    shutdown(d.to, SHUT_WR);
    d.shut = true;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpRelay>> TcpRelay::Start(const Options& options) {
  std::unique_ptr<TcpRelay> r(new TcpRelay(options));
  absl::StatusOr<sockaddr_in> listen_at = Address(options.listen_host, options.listen_port);
  if (!listen_at.ok()) return listen_at.status();
  if (!Address(options.upstream_host, options.upstream_port).ok())
    return absl::InvalidArgumentError("TcpRelay: bad upstream host " + options.upstream_host);
  r->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (r->wake_fd_ < 0) return absl::InternalError(absl::StrCat("TcpRelay: eventfd: ", std::strerror(errno)));
  std::promise<absl::Status> listening;
  std::future<absl::Status> listening_done = listening.get_future();
  TcpRelay* self = r.get();
  const sockaddr_in at = *listen_at;
  r->thread_ = std::thread([self, at, &listening] {
    // The thread joins the relay's namespace for good: every socket it makes
    // (the listener, each upstream connection) belongs to that namespace.
    if (self->options_.netns_fd >= 0 && setns(self->options_.netns_fd, CLONE_NEWNET) != 0) {
      listening.set_value(absl::PermissionDeniedError(absl::StrCat("TcpRelay: setns: ", std::strerror(errno))));
      return;
    }
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in bound = at;
    socklen_t len = sizeof bound;
    if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 || listen(fd, 64) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      listening.set_value(absl::UnavailableError(absl::StrCat("TcpRelay: listen on ", self->options_.listen_host,
                                                              ":", self->options_.listen_port, ": ",
                                                              std::strerror(errno))));
      if (fd >= 0) close(fd);
      return;
    }
    self->listen_fd_ = fd;
    self->port_ = ntohs(bound.sin_port);
    listening.set_value(absl::OkStatus());
    self->Run();
  });
  const absl::Status st = listening_done.get();
  if (!st.ok()) {
    r->thread_.join();
    return st;
  }
  return r;
}

TcpRelay::~TcpRelay() {
  stop_ = true;
  Wake();
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

std::string TcpRelay::address() const { return absl::StrCat(options_.listen_host, ":", port_); }

void TcpRelay::SetStalled(bool stalled) {
  stalled_ = stalled;
  Wake();
}

void TcpRelay::Wake() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
}

void TcpRelay::Run() {
  const sockaddr_in upstream = *Address(options_.upstream_host, options_.upstream_port);
  std::list<Connection> connections;
  std::vector<pollfd> fds;
  std::vector<Connection*> owner;  // of fds[i], i >= 2 (two entries per connection)
  while (!stop_.load()) {
    const bool stalled = stalled_.load();
    RelayClock::time_point now = RelayClock::now();
    // Poll for what each socket can do now; while stalled only for a wake-up
    // (a socket with nothing asked of it is left out: its hang-up would spin).
    fds.assign({pollfd{wake_fd_, POLLIN, 0}, pollfd{stalled ? -1 : listen_fd_, POLLIN, 0}});
    owner.clear();
    RelayClock::time_point next_due = RelayClock::time_point::max();
    for (Connection& c : connections) {
      short client = 0, up = 0;
      if (!stalled) {
        client = static_cast<short>((c.up.WantsRead() ? POLLIN : 0) | (c.down.Due(now) ? POLLOUT : 0));
        up = static_cast<short>((c.down.WantsRead() ? POLLIN : 0) | (c.up.Due(now) ? POLLOUT : 0));
        for (const Direction* d : {&c.up, &c.down})
          if (!d->queue.empty() && !d->Due(now)) next_due = std::min(next_due, d->queue.front().due);
      }
      fds.push_back(pollfd{client != 0 ? c.client : -1, client, 0});
      fds.push_back(pollfd{up != 0 ? c.upstream : -1, up, 0});
      owner.push_back(&c);
    }
    timespec wait{};
    timespec* timeout = nullptr;
    if (next_due != RelayClock::time_point::max()) {
      const auto ns = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(next_due - now).count());
      wait.tv_sec = ns / 1000000000;
      wait.tv_nsec = ns % 1000000000;
      timeout = &wait;
    }
    if (ppoll(fds.data(), fds.size(), timeout, nullptr) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) {
      uint64_t drained;
      (void)!read(wake_fd_, &drained, sizeof drained);
    }
    if (stop_.load() || stalled_.load()) continue;
    now = RelayClock::now();
    if (fds[1].revents & POLLIN) {
      const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (client >= 0) {
        const int up = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (up >= 0 && connect(up, reinterpret_cast<const sockaddr*>(&upstream), sizeof upstream) == 0 &&
            SetNonBlocking(up)) {
          NoDelay(client);
          NoDelay(up);
          Connection& c = connections.emplace_back();
          c.client = client;
          c.upstream = up;
          c.up.from = c.down.to = client;
          c.up.to = c.down.from = up;
          c.up.written = &to_upstream_;
          c.down.written = &to_clients_;
          ++accepted_;
        } else {
          if (up >= 0) close(up);
          close(client);
        }
      }
    }
    for (size_t i = 0; i < owner.size(); ++i) {
      Connection& c = *owner[i];
      const short client = fds[2 + 2 * i].revents, up = fds[3 + 2 * i].revents;
      bool ok = true;
      if (client & (POLLIN | POLLHUP | POLLERR)) ok = ok && ReadSide(c.up, now, options_.delay);
      if (up & (POLLIN | POLLHUP | POLLERR)) ok = ok && ReadSide(c.down, now, options_.delay);
      ok = ok && WriteSide(c.up, now) && WriteSide(c.down, now);
      c.broken = !ok;
    }
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->broken || (it->up.shut && it->down.shut)) {
        close(it->client);
        close(it->upstream);
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Connection& c : connections) {
    close(c.client);
    close(c.upstream);
  }
}

}  // namespace moe::testing
