// Unix-domain socket helpers for the shared-memory transport: listening with
// a file mode, connecting, peer credentials (SO_PEERCRED), and messages that
// carry a file descriptor (SCM_RIGHTS). Plain functions on fds; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace moe::unix_socket {

// Binds and listens on `path` (a stale socket file is replaced) and sets its mode.
absl::StatusOr<int> Listen(const std::string& path, mode_t mode);
absl::StatusOr<int> Connect(const std::string& path);
// The uid of the process at the other end of a connected socket.
absl::StatusOr<uid_t> PeerUid(int sock);
// Sends exactly `len` bytes, with `fd` attached when fd >= 0.
absl::Status Send(int sock, const void* data, size_t len, int fd = -1);
// Receives exactly `len` bytes (or fails); an attached fd, if any, goes to *fd (else -1).
absl::Status Receive(int sock, void* data, size_t len, int* fd, int timeout_ms);
// True when the peer has closed its end (or the socket failed).
bool PeerClosed(int sock);

}  // namespace moe::unix_socket
