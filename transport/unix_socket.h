// Unix-domain socket helpers for the shared-memory transport and the
// coordinator's admin socket: listening with a file mode, connecting, peer
// credentials (SO_PEERCRED), messages that carry a file descriptor
// (SCM_RIGHTS), and a Listener with its own accept thread. The functions are
// plain calls on fds and thread-safe; a Listener is started and stopped from
// one thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace moe::unix_socket {

// Binds and listens on `path` and sets its mode. An existing socket file is replaced only when it is stale (nobody
// accepts on it) and owned by this uid; a live one is AlreadyExists ("a
// server already listens on PATH"), another uid's is PermissionDenied, any
// other kind of file FailedPrecondition.
absl::StatusOr<int> Listen(const std::string& path, mode_t mode);
// Identity of the socket file a listener bound, so that it removes the file
// only while it is still its own (another process may have replaced it).
struct SocketFileId {
  dev_t dev = 0;
  ino_t ino = 0;
};
absl::StatusOr<SocketFileId> FileId(const std::string& path);
// Unlinks `path` if it is still the file `id` names; a no-op otherwise.
void UnlinkIfOwn(const std::string& path, const SocketFileId& id);
absl::StatusOr<int> Connect(const std::string& path);
// The uid of the process at the other end of a connected socket.
absl::StatusOr<uid_t> PeerUid(int sock);
// Sends exactly `len` bytes, with `fd` attached when fd >= 0.
absl::Status Send(int sock, const void* data, size_t len, int fd = -1);
// Receives exactly `len` bytes (or fails) within `timeout_ms` in total, however
// the peer splits or withholds them (DeadlineExceeded then); an attached fd,
// if any, goes to *fd (else -1). timeout_ms < 0 waits without limit.
absl::Status Receive(int sock, void* data, size_t len, int* fd, int timeout_ms);
// True when the peer has closed its end (or the socket failed).
bool PeerClosed(int sock);
// A memfd a peer passed, before it is mapped for `bytes`: sealed against
// resizing (F_SEAL_SHRINK and F_SEAL_GROW: the peer cannot shrink it under
// the mapping, so no access can SIGBUS this process) and at least `bytes`
// long. FailedPrecondition / InvalidArgument naming `what` otherwise.
absl::Status CheckResizeSealed(int fd, uint64_t bytes, const std::string& what);

// PeerClosed for a polling loop: asks the kernel at most once per `every`
// (a syscall per message would sit on the round trip's critical path; under a
// sandboxing kernel it costs several microseconds) and stays true once seen.
class PeerClosedProbe {
 public:
  explicit PeerClosedProbe(int sock, std::chrono::microseconds every = std::chrono::milliseconds(1))
      : sock_(sock), every_(every) {}
  bool Closed();

 private:
  int sock_;
  std::chrono::microseconds every_;
  std::chrono::steady_clock::time_point next_{};
  bool closed_ = false;
};

// A listening socket at `path` (Listen: a live socket there is refused, a
// stale one of this uid replaced) whose accept thread hands every accepted
// connection (SOCK_CLOEXEC | extra_flags) to `on_accept`, which owns the fd
// from then on. Stop (or the destructor) ends the thread, closes the socket
// and removes the file while it is still the one this Listener created.
class Listener {
 public:
  static absl::StatusOr<std::unique_ptr<Listener>> Start(const std::string& path, mode_t mode,
                                                         std::function<void(int fd)> on_accept, int extra_flags = 0);
  ~Listener();
  void Stop();

 private:
  Listener() = default;
  void AcceptLoop();

  std::string path_;
  std::function<void(int)> on_accept_;
  int flags_ = 0;
  int listen_fd_ = -1;
  int wake_fd_[2] = {-1, -1};  // self-pipe to stop accept()
  SocketFileId file_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

}  // namespace moe::unix_socket
