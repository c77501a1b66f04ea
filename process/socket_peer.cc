#include "process/socket_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe {

namespace {

// An address as the kernel's socket tables print it: IPv4 as one 32-bit word,
// IPv6 as four, each the word's in-memory value (%08X of the host-order load).
struct TableAddress {
  bool v6 = false;
  uint32_t words[4] = {0, 0, 0, 0};
  uint16_t port = 0;  // host order
};

bool ParseHexWord(absl::string_view hex, uint32_t* out) {
  if (hex.size() != 8) return false;
  uint32_t v = 0;
  for (char c : hex) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return false;
    }
    v = (v << 4) | static_cast<uint32_t>(d);
  }
  *out = v;
  return true;
}

// "0100007F:0CEA" (tcp) or 32 hex digits ":" port (tcp6).
bool ParseTableAddress(absl::string_view field, bool v6, TableAddress* out) {
  const size_t colon = field.find(':');
  if (colon == absl::string_view::npos) return false;
  const absl::string_view addr = field.substr(0, colon), port = field.substr(colon + 1);
  out->v6 = v6;
  const int words = v6 ? 4 : 1;
  if (addr.size() != static_cast<size_t>(8 * words)) return false;
  for (int i = 0; i < words; ++i)
    if (!ParseHexWord(addr.substr(8 * i, 8), &out->words[i])) return false;
  uint32_t p = 0;
  if (port.size() != 4 || !ParseHexWord(absl::StrCat("0000", port), &p)) return false;
  out->port = static_cast<uint16_t>(p);
  return true;
}

bool SameAddress(const TableAddress& a, const TableAddress& b) {
  if (a.v6 != b.v6 || a.port != b.port) return false;
  for (int i = 0; i < (a.v6 ? 4 : 1); ++i)
    if (a.words[i] != b.words[i]) return false;
  return true;
}

// The uid owning the socket whose local end is `local`, from one socket table
// (/proc/net/tcp or tcp6); listening sockets are skipped.
std::optional<uint32_t> OwnerIn(const char* table, const TableAddress& local) {
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // sl local rem st tx:rx tr:when retrnsmt uid ...
    if (f.size() < 8) continue;
    TableAddress a;
    if (!ParseTableAddress(f[1], local.v6, &a) || !SameAddress(a, local)) continue;
    if (f[3] == "0A") continue;  // LISTEN
    uint32_t uid = 0;
    if (absl::SimpleAtoi(f[7], &uid)) return uid;
  }
  return std::nullopt;
}

std::string IpText(int family, const void* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(family, addr, buf, sizeof(buf)) == nullptr) return "";
  return buf;
}

// The owner of the loopback socket at `local`, wherever the table lists it:
// an IPv4 client may have an AF_INET socket (tcp) or a dual-stack AF_INET6
// one with the v4-mapped address (tcp6, as gRPC's clients do).
std::optional<uint32_t> LoopbackOwner(const in6_addr& mapped_or_v6, uint16_t port) {
  TableAddress t6;
  t6.v6 = true;
  std::memcpy(t6.words, &mapped_or_v6, sizeof(t6.words));
  t6.port = port;
  if (IN6_IS_ADDR_V4MAPPED(&mapped_or_v6)) {
    TableAddress t4;
    std::memcpy(&t4.words[0], &mapped_or_v6.s6_addr[12], 4);
    t4.port = port;
    if (std::optional<uint32_t> uid = OwnerIn("/proc/net/tcp", t4)) return uid;
  }
  return OwnerIn("/proc/net/tcp6", t6);
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
