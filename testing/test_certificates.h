// Test certificates made in process (OpenSSL, no `openssl` command needed):
// a fresh CA and a server and a client certificate it signed, for TLS and
// mTLS between processes of one test or benchmark. EC P-256 keys, valid for
// a day. Pure functions; thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "moe/types.h"

namespace moe {

// Files written by WriteTestCertificates, and the TLS options of each end.
struct TestCertificates {
  std::string ca_file, server_cert_file, server_key_file, client_cert_file, client_key_file;
  // The server's: its certificate, and the CA to require clients' (mTLS).
  TlsOptions Server() const { return TlsOptions{server_cert_file, server_key_file, ca_file, false, ""}; }
  // The client's: its certificate, and the CA to verify the server's.
  TlsOptions Client() const { return TlsOptions{client_cert_file, client_key_file, ca_file, false, ""}; }
};

// Makes a CA, a server certificate for `server_name` (and 127.0.0.1, ::1)
// and a client certificate (CN=`client_name`), and writes them as PEM files
// into `dir` (ca.pem, server.pem, server.key, client.pem, client.key; keys
// mode 0600). INTERNAL naming the step that failed.
absl::StatusOr<TestCertificates> WriteTestCertificates(const std::string& dir,
                                                       const std::string& server_name = "localhost",
                                                       const std::string& client_name = "test-client");

}  // namespace moe
