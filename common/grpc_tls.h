// TLS credentials for gRPC channels whose PEM files are read again while the process runs: a
// certificate or CA bundle renewed in place (a Kubernetes Secret update, cert-manager, an
// SPIFFE agent's short-lived certificates) is presented and trusted on the next connections
// without a restart. Shared by the daemon's channels to its peers (cluster.tls) and by
// libproxima's channel to the daemon (ClientOptions::tls_*), so both check their files, name a
// bad one and verify the server the same way.
//
// Thread-safe (pure functions; gRPC's file watcher runs on its own thread).
#ifndef PROXIMA_COMMON_GRPC_TLS_H_
#define PROXIMA_COMMON_GRPC_TLS_H_

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace proxima {

// One setting's name (for errors) and path.
struct PemSetting {
  std::string name;  // the config key or option, e.g. "cluster.tls.ca_file"
  std::string path;
};

struct TlsChannelFiles {
  PemSetting ca;    // the CA bundle the server's certificate must chain to (required)
  PemSetting cert;  // this side's certificate for mTLS; empty path: none presented
  PemSetting key;   // its private key; empty path exactly when `cert`'s is
  // Also require `cert` to be usable as a TLS client certificate (extendedKeyUsage clientAuth),
  // for servers that ask for one: an error now instead of refused handshakes later.
  bool cert_must_allow_client_auth = false;
};

// Reads and checks every file now (each parsed by OpenSSL, the key matched to its certificate),
// so that a bad one is an error naming its setting and path; then returns credentials that
// verify the server's certificate against the CA bundle and the name called (or the channel's
// SSL target name override), present `cert` when given, and read the files again every
// `reload_interval` (whole seconds, at least 1). A renewed pair whose key does not match its
// certificate is not taken: the previous one stays in use.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> WatchedTlsChannelCredentials(
    const TlsChannelFiles& files, absl::Duration reload_interval);

}  // namespace proxima

#endif  // PROXIMA_COMMON_GRPC_TLS_H_
