#include "common/grpc_tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/status_macros.h"

namespace proxima {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> WatchedTlsChannelCredentials(
    const TlsChannelFiles& files, absl::Duration reload_interval) {
  if (files.cert.path.empty() != files.key.path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a client certificate needs both ",
                                                   files.cert.name, " and ", files.key.name,
                                                   "; one is empty"));
  }
  PROXIMA_RETURN_IF_ERROR(
      ReadPemFile(files.ca.name, files.ca.path, PemKind::kCertificates).status());
  const bool identity = !files.cert.path.empty();
  if (identity) {
    PROXIMA_ASSIGN_OR_RETURN(std::string cert,
                             ReadPemFile(files.cert.name, files.cert.path, PemKind::kCertificates));
    PROXIMA_ASSIGN_OR_RETURN(std::string key,
                             ReadPemFile(files.key.name, files.key.path, PemKind::kPrivateKey));
    PROXIMA_RETURN_IF_ERROR(CheckKeyMatchesCertificate(files.cert.name, files.key.name, cert, key));
    if (files.cert_must_allow_client_auth) {
      PROXIMA_RETURN_IF_ERROR(CheckCertificateAllowsClientAuth(files.cert.name, cert));
    }
  }
  const auto seconds =
      static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(reload_interval)));
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  if (identity) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files.key.path, files.cert.path, files.ca.path, seconds);
  } else {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.ca.path,
                                                                                    seconds);
  }
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(std::move(provider));
  options.watch_root_certs();
  if (identity) options.watch_identity_key_cert_pairs();
  // The server's certificate must name the host called (or the SSL target name override), as
  // well as chain to the CA: the check SSL credentials make implicitly, named here.
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace proxima
