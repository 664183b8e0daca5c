// The gRPC channel arguments every Proxima channel uses: libproxima's channel to its daemon,
// the daemon's channels to its peers, proximactl's. One place, so that a setting found wrong
// (stops 60 and 61 each mended the same reconnect fault in one of two copies) is mended once.
//
// Thread-safe (a pure function).
#ifndef PROXIMA_COMMON_GRPC_CHANNEL_H_
#define PROXIMA_COMMON_GRPC_CHANNEL_H_

#include <grpcpp/support/channel_arguments.h>

#include <string>

#include "absl/time/time.h"

namespace proxima {

struct ChannelSettings {
  // Largest message sent or received; -1: no limit (the server enforces its own).
  int max_message_bytes = -1;
  // Reconnect backoff after a lost or refused connection: 100 ms at first, growing to this.
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // The name the server's certificate must carry, when not the name called (servers reached
  // by address whose certificates name a shared DNS name). Empty: the name called.
  std::string tls_server_name;
};

// Arguments for grpc::CreateCustomChannel: `settings`, one connection per channel, and HTTP/2
// framing sized for megabyte blocks.
grpc::ChannelArguments ProximaChannelArguments(const ChannelSettings& settings);

}  // namespace proxima

#endif  // PROXIMA_COMMON_GRPC_CHANNEL_H_
