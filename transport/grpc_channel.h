// gRPC channel and server set-up shared by every process: credentials from
// TLS options (plaintext only when asked for), and channel arguments chosen
// explicitly (message size from the model geometry, keepalive, reconnect
// back-off). Pure functions; thread-safe.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"
#include "grpcpp/grpcpp.h"

namespace moe {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls);
// cert+key required unless insecure (insecure with any TLS file: InvalidArgument); with ca_file the server requires and
// verifies client certificates (mTLS).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& tls);

// Makes glibc keep freed blocks of up to 32 MB for reuse instead of
// returning them to the kernel (see the .cc for the measured why): a process
// moving multi-MB gRPC messages does not fault their pages in per message.
// Process-wide, once; ConfigureServerBuilder and MakeChannelArguments call it.
void KeepFreedMessageMemory();

// Server-side counterpart: message limits, client keepalive pings permitted,
// flow-control windows sized for activation messages.
void ConfigureServerBuilder(grpc::ServerBuilder& builder, uint64_t max_message_bytes);

// own_connection: the channel opens a connection of its own rather than
// sharing one with every channel of the process to the same address (gRPC's
// global subchannel pool): streams on separate connections are read, parsed
// and written by separate threads, not one after another.
grpc::ChannelArguments MakeChannelArguments(uint64_t max_message_bytes, const TlsOptions& tls,
                                            bool own_connection = false);

// A channel to `address` with the above; never blocks.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           uint64_t max_message_bytes,
                                                           const TlsOptions& tls, bool own_connection = false);

}  // namespace moe
