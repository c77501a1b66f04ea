#include "testing/test_certificates.h"

#include <sys/stat.h>

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "openssl/bio.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "openssl/x509v3.h"

namespace moe {
namespace {

struct KeyFree { void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); } };
struct CertFree { void operator()(X509* c) const { X509_free(c); } };
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Cert = std::unique_ptr<X509, CertFree>;

bool AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key` named CN=`cn`, signed by issuer/issuer_key (self-signed when issuer is null).
Cert MakeCert(EVP_PKEY* key, const std::string& cn, long serial, X509* issuer, EVP_PKEY* issuer_key,
              const std::string& san) {
  Cert cert(X509_new());
  if (!cert || X509_set_version(cert.get(), 2) != 1) return nullptr;
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), serial);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 86400);
  if (X509_set_pubkey(cert.get(), key) != 1) return nullptr;
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509* signer = issuer != nullptr ? issuer : cert.get();
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(signer)) != 1) return nullptr;
  const bool ca = issuer == nullptr;
  if (!AddExtension(cert.get(), signer, NID_basic_constraints, ca ? "critical,CA:TRUE" : "critical,CA:FALSE") ||
      !AddExtension(cert.get(), signer, NID_key_usage,
                    ca ? "critical,keyCertSign,cRLSign" : "critical,digitalSignature,keyEncipherment") ||
      (!san.empty() && !AddExtension(cert.get(), signer, NID_subject_alt_name, san)))
    return nullptr;
  if (X509_sign(cert.get(), issuer_key != nullptr ? issuer_key : key, EVP_sha256()) <= 0) return nullptr;
  return cert;
}

bool WritePem(const std::string& path, X509* cert, EVP_PKEY* key) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  if (key != nullptr) fchmod(fileno(f), 0600);
  const bool ok = key != nullptr ? PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr) == 1
                                 : PEM_write_X509(f, cert) == 1;
  return std::fclose(f) == 0 && ok;
}

}  // namespace

absl::StatusOr<TestCertificates> WriteTestCertificates(const std::string& dir, const std::string& server_name,
                                                       const std::string& client_name) {
  Key ca_key(EVP_EC_gen("P-256")), server_key(EVP_EC_gen("P-256")), client_key(EVP_EC_gen("P-256"));
  if (!ca_key || !server_key || !client_key) return absl::InternalError("test certificates: EC key generation failed");
  Cert ca = MakeCert(ca_key.get(), "moe-test-ca", 1, nullptr, nullptr, "");
  if (!ca) return absl::InternalError("test certificates: the CA certificate could not be made");
  Cert server = MakeCert(server_key.get(), server_name, 2, ca.get(), ca_key.get(),
                         absl::StrCat("DNS:", server_name, ",IP:127.0.0.1,IP:::1"));
  Cert client = MakeCert(client_key.get(), client_name, 3, ca.get(), ca_key.get(), "");
  if (!server || !client) return absl::InternalError("test certificates: a leaf certificate could not be made");
  TestCertificates files{dir + "/ca.pem", dir + "/server.pem", dir + "/server.key", dir + "/client.pem",
                         dir + "/client.key"};
  if (!WritePem(files.ca_file, ca.get(), nullptr) || !WritePem(files.server_cert_file, server.get(), nullptr) ||
      !WritePem(files.server_key_file, nullptr, server_key.get()) ||
      !WritePem(files.client_cert_file, client.get(), nullptr) ||
      !WritePem(files.client_key_file, nullptr, client_key.get()))
    return absl::InternalError(absl::StrCat("test certificates: cannot write them into '", dir, "'"));
  return files;
}

}  // namespace moe
