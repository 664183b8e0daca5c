// Reading and checking the secrets Proxima is configured with: PEM certificates and keys for
// TLS/mTLS, and bearer tokens. Shared by proximad (server side) and libproxima (client side), so
// both report a bad file the same way: an error naming the setting, the path and what was
// expected ("server.tls.cert_file '/etc/proxima/tls.crt': no PEM certificate in the file").
// Secret values themselves never appear in an error or a log line.
//
// Thread-safe (pure functions).
#ifndef PROXIMA_COMMON_CREDENTIALS_H_
#define PROXIMA_COMMON_CREDENTIALS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace proxima {

enum class PemKind { kCertificates, kPrivateKey };

// Reads `path` and checks that it holds what `kind` says (one or more X.509 certificates, or
// one private key), parsed by OpenSSL. `setting` names the config key or flag in errors.
// NOT_FOUND (missing), PERMISSION_DENIED (unreadable), INVALID_ARGUMENT (empty or not valid PEM).
absl::StatusOr<std::string> ReadPemFile(absl::string_view setting, const std::string& path,
                                        PemKind kind);

// INVALID_ARGUMENT unless `key_pem` is the private key of the first certificate of `cert_pem`.
absl::Status CheckKeyMatchesCertificate(absl::string_view cert_setting,
                                        absl::string_view key_setting,
                                        const std::string& cert_pem, const std::string& key_pem);

// INVALID_ARGUMENT unless the first certificate of `cert_pem` may authenticate a TLS client
// (OpenSSL's SSL-client purpose: an extendedKeyUsage, if any, lists clientAuth; a keyUsage, if
// any, allows signing). A server certificate presented as a client certificate must pass this,
// or an mTLS peer refuses the handshake.
absl::Status CheckCertificateAllowsClientAuth(absl::string_view cert_setting,
                                              const std::string& cert_pem);

// Shortest bearer token accepted (bytes): shorter ones can be guessed.
inline constexpr size_t kMinTokenBytes = 16;

// Reads a bearer token from `path` (surrounding whitespace and the final newline removed).
// Errors name `setting` and the path, never the content; a token shorter than kMinTokenBytes or
// holding characters outside printable ASCII is INVALID_ARGUMENT.
absl::StatusOr<std::string> ReadTokenFile(absl::string_view setting, const std::string& path);

// The same for a token held in the environment variable `name`.
absl::StatusOr<std::string> ReadTokenEnv(absl::string_view setting, const std::string& name);

// The most tokens a token list (below) may hold.
inline constexpr size_t kMaxListedTokens = 8;

// Reads one token per line from `path` (blank lines skipped, each line checked as a token; an
// error names the line's number). INVALID_ARGUMENT for no token, or more than kMaxListedTokens.
// For a secret rotated while in use: its holder presents the first and accepts them all.
absl::StatusOr<std::vector<std::string>> ReadTokenListFile(absl::string_view setting,
                                                           const std::string& path);

// The same for tokens held in the environment variable `name`, one per line.
absl::StatusOr<std::vector<std::string>> ReadTokenListEnv(absl::string_view setting,
                                                          const std::string& name);

// Compares a presented secret with an expected one in time that depends only on the length of
// `expected`: no early exit at the first differing byte, so response time does not tell an
// attacker how much of a guess was right.
bool ConstantTimeEquals(absl::string_view presented, absl::string_view expected);

}  // namespace proxima

#endif  // PROXIMA_COMMON_CREDENTIALS_H_
