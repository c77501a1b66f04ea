#include "process/socket_peer.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/log.h"

namespace moe {

namespace {

// What the kernel says about the owner of the sockets at one local end.
struct Owner {
  enum Kind { kNone, kFound, kAmbiguous, kUnavailable } kind = kNone;
  uint32_t uid = 0;
  // Two answers as one (the same end asked of both families).
  Owner And(const Owner& o) const {
    if (kind == kUnavailable || o.kind == kUnavailable) return {kUnavailable, 0};
    if (kind == kAmbiguous || o.kind == kAmbiguous) return {kAmbiguous, 0};
    if (kind == kNone) return o;
    if (o.kind == kNone || o.uid == uid) return *this;
    return {kAmbiguous, 0};
  }
};

// The owner of the TCP sockets of this network namespace whose local end is
// `address`:`port` (network order, 4 or 16 bytes by `family`), asked of the
// kernel over NETLINK_SOCK_DIAG: one dump with the port as the kernel's
// filter, walked in one pass under each hash bucket's lock (only the few
// sockets of that port come back, in one message), so a live socket is
// always found however the table churns. (Reading /proc/net/tcp instead
// takes a page per read() and resumes by position: when entries before the
// position vanish between reads it skips live ones, and the soak's flood saw
// its peer counted under a second key.) Only sockets an open file holds
// count (inode != 0): a closed one (orphaned, or a TIME_WAIT entry, which
// reports uid 0) is not its owner's any more, so a caller that sends and
// closes at once is not taken for root. Two owners at the same local end
// (SO_REUSEADDR, to different destinations) are ambiguous.
Owner OwnerOf(int family, const void* address, uint16_t port_be) {
  const int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return {Owner::kUnavailable, 0};
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
  // TCP's states but LISTEN, TIME_WAIT and the request socks (SYN_RECV,
  // NEW_SYN_RECV): SYN_SENT, ESTABLISHED, FIN_WAIT1/2, CLOSE, CLOSE_WAIT,
  // LAST_ACK, CLOSING (include/net/tcp_states.h). A TIME_WAIT entry is
  // matched by its substate (FIN_WAIT2 among them): the inode check drops it.
  ask.request.idiag_states = (1u << 1) | (1u << 2) | (1u << 4) | (1u << 5) | (1u << 7) | (1u << 8) | (1u << 9) |
                             (1u << 11);
  ask.request.id.idiag_sport = port_be;
  ask.request.id.idiag_cookie[0] = ask.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  const timeval patience{1, 0};  // the kernel answers at once; never hang on it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof(patience));
  Owner owner;
  bool done = false, failed = false;
  const size_t address_bytes = family == AF_INET ? 4 : 16;
  if (sendto(fd, &ask, sizeof(ask), 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof(kernel)) ==
      static_cast<ssize_t>(sizeof(ask))) {
    alignas(nlmsghdr) char buf[16384];
    while (!done && !failed) {
      const ssize_t got = recv(fd, buf, sizeof(buf), MSG_TRUNC);  // MSG_TRUNC: the datagram's whole length
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0 || got > static_cast<ssize_t>(sizeof(buf))) {
        failed = true;
        break;
      }
      int left = static_cast<int>(got);
      for (const nlmsghdr* h = reinterpret_cast<const nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
        if (h->nlmsg_type == NLMSG_ERROR) {  // refused or cut short: no answer
          failed = true;
          break;
        }
        if (h->nlmsg_type == NLMSG_DONE) {  // a dump's error, if any, is its payload
          done = true;
          if (h->nlmsg_len >= NLMSG_LENGTH(sizeof(int)) && *static_cast<const int*>(NLMSG_DATA(h)) < 0)
            failed = true;
          break;
        }
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) continue;
        const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
        if (m->idiag_family != family || m->id.idiag_sport != port_be || m->idiag_inode == 0 ||
            std::memcmp(m->id.idiag_src, address, address_bytes) != 0)
          continue;
        owner = owner.And({Owner::kFound, m->idiag_uid});
      }
    }
  }
  close(fd);
  if (failed || !done) return {Owner::kUnavailable, 0};
  return owner;
}

std::string IpText(int family, const void* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(family, addr, buf, sizeof(buf)) == nullptr) return "";
  return buf;
}

// The owner of the loopback socket at `local`, whichever family it has: an
// IPv4 client may have an AF_INET socket or a dual-stack AF_INET6 one with the
// v4-mapped address (as gRPC's clients do); both are asked, and owners that
// differ between them are ambiguous too. Without sock_diag (a sandbox that
// refuses it) every local peer is "ip:127.0.0.1": logged once.
std::optional<uint32_t> LoopbackOwner(const in6_addr& mapped_or_v6, uint16_t port) {
  const uint16_t port_be = htons(port);
  Owner owner = OwnerOf(AF_INET6, &mapped_or_v6, port_be);
  if (IN6_IS_ADDR_V4MAPPED(&mapped_or_v6)) owner = owner.And(OwnerOf(AF_INET, &mapped_or_v6.s6_addr[12], port_be));
  if (owner.kind == Owner::kUnavailable) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true))
      LogWarning("peer", "the kernel's socket table (NETLINK_SOCK_DIAG) cannot be read here: local TCP callers are "
                         "told apart by address only (ip:127.0.0.1), not by user");
  }
  if (owner.kind != Owner::kFound) return std::nullopt;
  return owner.uid;
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
