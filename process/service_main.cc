#include "process/service_main.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "transport/grpc_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"

namespace moe {

namespace {

// Why `listen` cannot be bound, found by binding it ourselves the way gRPC
// does (SO_REUSEADDR, no SO_REUSEPORT); "" when it can be.
std::string BindFailure(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return "expected host:port";
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return gai_strerror(rc);
  std::string failure;
  for (addrinfo* a = found; a != nullptr && failure.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) failure = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return failure;
}

// Bytes that do not parse as the method's request message: gRPC's protobuf
// deserializer answers INTERNAL with the message's InitializationErrorString
// (empty for proto3), before any handler runs. That is the client's fault,
// not ours: the status leaves as INVALID_ARGUMENT naming the message type.
// (No handler of ours returns INTERNAL with an empty message.)
class UnparseableRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit UnparseableRequestInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status st = methods->GetSendStatus();
      if (st.error_code() == grpc::StatusCode::INTERNAL && st.error_message().empty())
        methods->ModifySendStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, Describe()));
    }
    methods->Proceed();
  }

 private:
  // "ForwardRequest: the request bytes do not parse (moe.v1.ExpertService/Forward)".
  std::string Describe() const {
    std::string name = method_.size() > 1 ? method_.substr(1) : method_;  // "/pkg.Service/Method"
    std::replace(name.begin(), name.end(), '/', '.');
    const google::protobuf::MethodDescriptor* m =
        google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(name);
    const std::string type = m != nullptr ? std::string(m->input_type()->name()) : "request";
    return absl::StrCat(type, ": the request bytes do not parse as a ", type, " message (", method_, ")");
  }
  std::string method_;
};

class UnparseableRequestFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new UnparseableRequestInterceptor(info->method() != nullptr ? info->method() : "");
  }
};

sigset_t TerminationSignals() {
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigaddset(&term, SIGINT);
  return term;
}

}  // namespace

std::string LoopbackListen(int port) { return absl::StrCat("127.0.0.1:", port); }

absl::Status CheckListenAddress(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:") && listen.size() > 5) return absl::OkStatus();
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  const bool bracketed = absl::StartsWith(host, "[") && absl::EndsWith(host, "]");
  if (colon == std::string::npos || (!bracketed && host.find(':') != std::string::npos))
    return absl::InvalidArgumentError(absl::StrCat("--listen: '", listen,
                                                   "' has no port (HOST:PORT, [IPv6]:PORT or unix:PATH)"));
  const std::string port = listen.substr(colon + 1);
  uint32_t value = 0;
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port, &value) || value > 65535)
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: '", listen, "': port '", port, "' is not a number in [0, 65535]"));
  return absl::OkStatus();
}

absl::StatusOr<ListeningServer> StartGrpcServer(grpc::ServerBuilder& builder, const std::string& listen,
                                                const std::shared_ptr<grpc::ServerCredentials>& creds) {
  MOE_RETURN_IF_ERROR(CheckListenAddress(listen));
  ListeningServer s;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen, creds, &s.port);
  s.server = builder.BuildAndStart();
  if (s.server == nullptr || s.port == 0) {
    if (s.server != nullptr) s.server->Shutdown();
    const std::string why = BindFailure(listen);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, ": ",
                                               why.empty() ? "gRPC could not start a listener there" : why));
  }
  s.address = BoundAddress(listen, s.port);
  return s;
}

void ListeningServer::Stop(std::chrono::seconds drain) {
  server->Shutdown(std::chrono::system_clock::now() + drain);
  server->Wait();
}

absl::StatusOr<ListeningServer> ServeGrpc(const GrpcServeOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  ConfigureServerBuilder(builder, options.max_message_bytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<UnparseableRequestFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  return StartGrpcServer(builder, options.listen, options.credentials);
}

sigset_t BlockTerminationSignals() {
  sigset_t term = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &term, nullptr);
  return term;
}

int WaitForTerminationSignal() {
  const sigset_t term = TerminationSignals();
  int sig = 0;
  sigwait(&term, &sig);
  return sig;
}

std::string BoundAddress(const std::string& listen, int port) {
  return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
}

void ServiceFlags::Register(FlagSet& flags, const std::string& peers) {
  flags.String("tls-cert", &tls.cert_file,
               "PEM certificate chain of this process (served over gRPC/TLS" +
                   (peers.empty() ? std::string(")") : ", and presented to " + peers + ")"));
  flags.String("tls-key", &tls.key_file, "PEM private key of that certificate");
  flags.String("tls-ca", &tls.ca_file,
               peers.empty() ? "PEM CA bundle: when set, clients must present a certificate it signed (mTLS)"
                             : "PEM CA bundle: clients must present a certificate it signed (mTLS), and " + peers +
                                   " are verified with it");
  flags.Bool("insecure", &tls.insecure,
             (peers.empty() ? std::string("serve gRPC in plaintext") : "plaintext gRPC, served and to " + peers) +
                 " (only on trusted networks; TLS flags are needed otherwise)");
  flags.Int("metrics-port", &metrics_port,
            "serve Prometheus metrics on http://ADDRESS:PORT/metrics (-1 = off, 0 = a free port, printed at start)");
  flags.String("metrics-address", &metrics_address,
               "address the metrics endpoint binds to (loopback by default; e.g. 0.0.0.0 or the pod IP to be scraped)");
}

absl::Status ServiceFlags::Validate() const {
  if (metrics_port < -1 || metrics_port > 65535)
    return absl::InvalidArgumentError("--metrics-port must be -1 (off), 0 (a free port) or a port");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const ServiceFlags& flags) {
  if (flags.metrics_port < 0) return std::unique_ptr<MetricsHttpServer>();
  MetricsHttpServer::Options mo;
  mo.address = flags.metrics_address;
  mo.port = static_cast<int>(flags.metrics_port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> m = MetricsHttpServer::Start(mo);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat("--metrics-port: ", m.status().message()));
  LogInfo(component, "serving metrics on http://", flags.metrics_address, ":", (*m)->port(), "/metrics");
  return m;
}

void AnnounceReady(const std::string& binary, const std::string& address, const ServiceFlags& flags,
                   const MetricsHttpServer* metrics) {
  std::printf("%s ready on %s\n", binary.c_str(), address.c_str());
  if (metrics != nullptr)
    std::printf("%s metrics on %s:%d\n", binary.c_str(), flags.metrics_address.c_str(), metrics->port());
  std::fflush(stdout);
}

}  // namespace moe
