// PeerKey: who is at the other end of a connection, as the key of a per-peer
// limit (the coordinator's registrations per peer, the /metrics endpoint's
// connections per peer). What the kernel can vouch for, never what the peer
// says about itself:
//   - a TCP peer on loopback (127.0.0.0/8, ::1, ::ffff:127.x): "uid:N", the
//     owner of the peer's socket as the kernel reports it for this network
//     namespace (NETLINK_SOCK_DIAG, filtered by the peer's port), so two
//     local users are two peers even though both are 127.0.0.1;
//     "ip:127.0.0.1" when no open socket is found there (the peer has closed
//     it already: a closed socket is nobody's), when two owners share that
//     local end (SO_REUSEADDR), or where sock_diag is refused (logged once);
//   - any other TCP peer: "ip:ADDRESS" (an IPv4-mapped IPv6 address as IPv4),
//     whatever its port;
//   - anything else: "" (unknown; callers treat it as one peer).
// Thread-safe (no state). A loopback lookup is one netlink dump the kernel
// filters (~1 ms beside thousands of sockets): meant for accepts and
// registrations, not per request.
#pragma once

#include <sys/socket.h>

#include <string>

#include "absl/strings/string_view.h"

namespace moe {

// The key of the peer at `addr` (as accept() or getpeername() returned it).
std::string PeerKey(const sockaddr* addr, socklen_t len);
// The key of a gRPC peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678";
// anything else, e.g. "unix:" or "fd:7", gives "").
std::string PeerKeyOfGrpcPeer(absl::string_view peer);

}  // namespace moe
