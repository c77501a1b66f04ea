#include "process/socket_peer.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace moe {

namespace {

// The uid owning the TCP socket of this network namespace whose local end is
// `address`:`port` (network order, 4 or 16 bytes by `family`), asked of the
// kernel over NETLINK_SOCK_DIAG: one dump with the port as the kernel's
// filter, walked in one pass under each hash bucket's lock, so a live socket
// is always found however the table churns. (Reading /proc/net/tcp instead
// takes a page per read() and resumes by position: when entries before the
// position vanish between reads it skips live ones, and the soak's flood saw
// its peer counted under a second key.) Sockets without an owner (listening,
// TIME_WAIT, a server's half-open request) are not asked for. Two sockets at
// the same local end (SO_REUSEADDR, to different destinations) with different
// owners give nullopt: the caller cannot tell which is its peer.
std::optional<uint32_t> OwnerOf(int family, const void* address, uint16_t port_be) {
  const int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return std::nullopt;
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } ask{};
  ask.header.nlmsg_len = sizeof(ask);
  ask.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  ask.header.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  ask.header.nlmsg_seq = 1;
  ask.request.sdiag_family = static_cast<uint8_t>(family);
  ask.request.sdiag_protocol = IPPROTO_TCP;
  // TCP's states with an owning socket: SYN_SENT, ESTABLISHED, FIN_WAIT1/2,
  // CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING (include/net/tcp_states.h).
  ask.request.idiag_states = (1u << 1) | (1u << 2) | (1u << 4) | (1u << 5) | (1u << 7) | (1u << 8) | (1u << 9) |
                             (1u << 11);
  ask.request.id.idiag_sport = port_be;
  ask.request.id.idiag_cookie[0] = ask.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  const timeval patience{1, 0};  // the kernel answers at once; never hang on it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof(patience));
  std::optional<uint32_t> owner;
  bool ambiguous = false, done = false, failed = false;
  const size_t address_bytes = family == AF_INET ? 4 : 16;
  if (sendto(fd, &ask, sizeof(ask), 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof(kernel)) ==
      static_cast<ssize_t>(sizeof(ask))) {
    alignas(nlmsghdr) char buf[16384];
    while (!done && !failed) {
      const ssize_t got = recv(fd, buf, sizeof(buf), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      int left = static_cast<int>(got);
      for (const nlmsghdr* h = reinterpret_cast<const nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
        if (h->nlmsg_type == NLMSG_ERROR) {  // refused or cut short: no answer
          failed = true;
          break;
        }
        if (h->nlmsg_type == NLMSG_DONE) {
          done = true;
          break;
        }
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) continue;
        const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
        if (m->idiag_family != family || m->id.idiag_sport != port_be ||
            std::memcmp(m->id.idiag_src, address, address_bytes) != 0)
          continue;
        if (owner.has_value() && *owner != m->idiag_uid) ambiguous = true;
        owner = m->idiag_uid;
      }
    }
  }
  close(fd);
  if (!done || ambiguous) return std::nullopt;
  return owner;
}

std::string IpText(int family, const void* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(family, addr, buf, sizeof(buf)) == nullptr) return "";
  return buf;
}

// The owner of the loopback socket at `local`, whichever family it has: an
// IPv4 client may have an AF_INET socket or a dual-stack AF_INET6 one with the
// v4-mapped address (as gRPC's clients do).
std::optional<uint32_t> LoopbackOwner(const in6_addr& mapped_or_v6, uint16_t port) {
  const uint16_t port_be = htons(port);
  if (IN6_IS_ADDR_V4MAPPED(&mapped_or_v6))
    if (std::optional<uint32_t> uid = OwnerOf(AF_INET, &mapped_or_v6.s6_addr[12], port_be)) return uid;
  return OwnerOf(AF_INET6, &mapped_or_v6, port_be);
}

}  // namespace

std::string PeerKey(const sockaddr* addr, socklen_t len) {
  if (addr == nullptr) return "";
  in6_addr a{};  // IPv4 as v4-mapped
  uint16_t port = 0;
  if (addr->sa_family == AF_INET && len >= static_cast<socklen_t>(sizeof(sockaddr_in))) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    a.s6_addr[10] = a.s6_addr[11] = 0xff;
    std::memcpy(&a.s6_addr[12], &in->sin_addr, 4);
    port = ntohs(in->sin_port);
  } else if (addr->sa_family == AF_INET6 && len >= static_cast<socklen_t>(sizeof(sockaddr_in6))) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    a = in6->sin6_addr;
    port = ntohs(in6->sin6_port);
  } else {
    return "";
  }
  const bool v4 = IN6_IS_ADDR_V4MAPPED(&a);
  const bool loopback = v4 ? a.s6_addr[12] == 127 : IN6_IS_ADDR_LOOPBACK(&a);
  if (loopback)
    if (std::optional<uint32_t> uid = LoopbackOwner(a, port)) return absl::StrCat("uid:", *uid);
  return absl::StrCat("ip:", v4 ? IpText(AF_INET, &a.s6_addr[12]) : IpText(AF_INET6, &a));
}

std::string PeerKeyOfGrpcPeer(absl::string_view peer) {
  sockaddr_storage ss{};
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    const size_t colon = peer.rfind(':');
    uint32_t port = 0;
    if (colon == absl::string_view::npos || !absl::SimpleAtoi(peer.substr(colon + 1), &port) || port > 65535)
      return "";
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET, std::string(peer.substr(0, colon)).c_str(), &in->sin_addr) != 1) return "";
    return PeerKey(reinterpret_cast<const sockaddr*>(in), sizeof(sockaddr_in));
  }
  if (absl::ConsumePrefix(&peer, "ipv6:")) {
    // "[addr]:port", the address possibly with a URL-escaped zone ("%25eth0").
    const size_t close = peer.rfind("]:");
    uint32_t port = 0;
    if (!absl::StartsWith(peer, "[") || close == absl::string_view::npos ||
        !absl::SimpleAtoi(peer.substr(close + 2), &port) || port > 65535)
      return "";
    const absl::string_view host = peer.substr(1, close - 1);
    const std::string text(host.substr(0, host.find('%')));
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, text.c_str(), &in6->sin6_addr) != 1) return "";
    return PeerKey(reinterpret_cast<const sockaddr*>(in6), sizeof(sockaddr_in6));
  }
  return "";
}

}  // namespace moe
