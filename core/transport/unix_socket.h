// Unix-domain socket helpers for the shared-memory transport: listening with
// a file mode, connecting, peer credentials (SO_PEERCRED), and messages that
// carry a file descriptor (SCM_RIGHTS). Plain functions on fds; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

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
// if any, goes to *fd (else -1).
absl::Status Receive(int sock, void* data, size_t len, int* fd, int timeout_ms);
// True when the peer has closed its end (or the socket failed).
bool PeerClosed(int sock);

}  // namespace moe::unix_socket
