#include "transport/grpc_channel.h"

#include <malloc.h>
#include <stdlib.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "openssl/bio.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace moe {

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().find("-----BEGIN") == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is not a PEM file"));
  return ss.str();
}

// A key that does not belong to its certificate would only surface as a
// listener gRPC cannot start (or a handshake that fails): say so up front.
absl::Status CheckKeyMatchesCertificate(const TlsOptions& tls, const std::string& cert_pem,
                                        const std::string& key_pem) {
  BIO* cb = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = cb != nullptr ? PEM_read_bio_X509(cb, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(cb);
  BIO* kb = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = kb != nullptr ? PEM_read_bio_PrivateKey(kb, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(kb);
  absl::Status st;
  if (cert == nullptr) {
    st = absl::InvalidArgumentError(absl::StrCat("--tls-cert: '", tls.cert_file, "' holds no readable certificate"));
  } else if (key == nullptr) {
    st = absl::InvalidArgumentError(absl::StrCat("--tls-key: '", tls.key_file, "' holds no readable private key"));
  } else if (X509_check_private_key(cert, key) != 1) {
    st = absl::InvalidArgumentError(absl::StrCat("--tls-key: '", tls.key_file, "' does not match the certificate in '",
                                                 tls.cert_file, "'"));
  }
  X509_free(cert);
  EVP_PKEY_free(key);
  return st;
}

// Plaintext asked for together with TLS material is a mistake the operator
// must hear about, not a silent downgrade.
absl::Status CheckNoConflict(const TlsOptions& tls) {
  if (tls.insecure && (!tls.cert_file.empty() || !tls.key_file.empty() || !tls.ca_file.empty()))
    return absl::InvalidArgumentError(
        "--insecure conflicts with --tls-cert/--tls-key/--tls-ca: ask for plaintext or for TLS, not both");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls) {
  MOE_RETURN_IF_ERROR(CheckNoConflict(tls));
  if (tls.insecure) return grpc::InsecureChannelCredentials();
  if (tls.ca_file.empty())
    return absl::InvalidArgumentError("--tls-ca is required to verify the server (or ask for --insecure)");
  grpc::SslCredentialsOptions o;
  MOE_ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca_file, "--tls-ca"));
  if (!tls.cert_file.empty() || !tls.key_file.empty()) {
    MOE_ASSIGN_OR_RETURN(std::string cert, ReadPem(tls.cert_file, "--tls-cert"));
    MOE_ASSIGN_OR_RETURN(std::string key, ReadPem(tls.key_file, "--tls-key"));
    MOE_RETURN_IF_ERROR(CheckKeyMatchesCertificate(tls, cert, key));
    o.pem_cert_chain = cert;
    o.pem_private_key = key;
  }
  return grpc::SslCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& tls) {
  MOE_RETURN_IF_ERROR(CheckNoConflict(tls));
  if (tls.insecure) return grpc::InsecureServerCredentials();
  if (tls.cert_file.empty() || tls.key_file.empty())
    return absl::InvalidArgumentError("--tls-cert and --tls-key are required (or ask for --insecure)");
  MOE_ASSIGN_OR_RETURN(std::string cert, ReadPem(tls.cert_file, "--tls-cert"));
  MOE_ASSIGN_OR_RETURN(std::string key, ReadPem(tls.key_file, "--tls-key"));
  MOE_RETURN_IF_ERROR(CheckKeyMatchesCertificate(tls, cert, key));
  grpc::SslServerCredentialsOptions o(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  o.pem_key_cert_pairs.push_back({key, cert});
  if (!tls.ca_file.empty()) {
    MOE_ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca_file, "--tls-ca"));
    o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(o);
}

namespace {
// gRPC 1.51 notices the end of a subchannel's connection attempt (the TCP
// connect, the handshakes) only while something polls the subchannel's fds,
// and neither a call nor WaitForConnected on the channel does: the client
// channel's backup poller (every 5 s by default) does. Every attempt then ran
// to its 1 s connect deadline, so a restarted server took 3-5 s to be used
// again (issue 47; measured 3.0 s after a 6 s outage with one caller, 0.2-0.3 s
// with the poller at 50 ms). The interval is read when gRPC initialises, so it
// is set when this library is loaded, before any gRPC object exists; an
// operator's own setting wins.
[[maybe_unused]] const bool kBackupPollSet = [] {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", /*overwrite=*/0);
  return true;
}();

// absl::Mutex checks every acquisition against a process-wide lock-order
// graph (under one global lock) unless abseil itself was built with NDEBUG,
// and Debian 12's libabsl is not: gRPC 1.51 takes all its mutexes through
// absl, so every message paid for the graph on every thread that touched it
// (GraphCycles in the profiles of gRPC round trips; with it off, 10-17% less
// CPU for round trips of 1 and 8 tokens on the dev VM, a noisy 2-core VM).
// The check is a debugging aid, off in optimized
// builds of abseil; this turns it off when the library loads. A program that
// wants it calls absl::SetMutexDeadlockDetectionMode itself, later.
[[maybe_unused]] const bool kMutexGraphOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

// A decode batch (8 tokens x 7168 bf16 = 115 KB) exceeds HTTP/2's default 64 KiB
// stream window; without a larger look-ahead each message waits for a
// WINDOW_UPDATE round trip.
constexpr int kLookaheadBytes = 16 << 20;

// Arguments of the data path shared by both ends. set(name, value).
template <typename Set>
void SetDataPathArgs(Set set) {
  set(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookaheadBytes);
  set(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kLookaheadBytes - 1);
}
}  // namespace

void KeepFreedMessageMemory() {
  static std::once_flag once;
  std::call_once(once, [] {
    // glibc's defaults hand large freed blocks straight back to the kernel:
    // a block over the (dynamic) mmap threshold is munmapped, and a thread
    // arena whose free top passes the trim threshold is madvise(DONTNEED)d,
    // with a TLB shoot-down across cores. gRPC frees its receive buffers
    // after every message, so every multi-MB message faulted its pages in
    // again: at n = 512 (7.4 MB each way) the kernel's page faults and
    // madvise were half of the loopback round trip and it took ~100 ms on
    // the 2-core dev VM; 28 ms with these settings. Freed blocks up to
    // 32 MB (glibc's largest heap block) now stay in the process for reuse;
    // its resident size stays at its high-water mark instead of shrinking.
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
  });
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder, uint64_t max_message_bytes) {
  KeepFreedMessageMemory();
  const int max = static_cast<int>(std::min<uint64_t>(max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max);
  builder.SetMaxSendMessageSize(max);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  SetDataPathArgs([&](const char* name, int v) { builder.AddChannelArgument(name, v); });
}

grpc::ChannelArguments MakeChannelArguments(uint64_t max_message_bytes, const TlsOptions& tls, bool own_connection) {
  KeepFreedMessageMemory();
  grpc::ChannelArguments args;
  const int max = static_cast<int>(std::min<uint64_t>(max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(max);
  args.SetMaxSendMessageSize(max);
  // Detect a dead or silent server within seconds even on an idle stream.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Reconnect quickly when a restarted server comes back: attempts 100 ms
  // apart growing to 500 ms. gRPC takes GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as
  // the least time one attempt may take (a TLS handshake on a loaded host
  // must fit). Progress needs a poller: GrpcTransport::Reconnect asks for
  // attempts and the backup poller (kBackupPollSet) notices their end.
  // Measured: a worker is back on a restarted server 0.2-0.3 s after its start
  // (DispatcherTest.RestartedServerTakesMissesAgainSoonAfterItsStart).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  SetDataPathArgs([&](const char* name, int v) { args.SetInt(name, v); });
  if (!tls.server_name_override.empty()) args.SetSslTargetNameOverride(tls.server_name_override);
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           uint64_t max_message_bytes,
                                                           const TlsOptions& tls, bool own_connection) {
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds, MakeChannelCredentials(tls));
  return grpc::CreateCustomChannel(address, creds, MakeChannelArguments(max_message_bytes, tls, own_connection));
}

}  // namespace moe
