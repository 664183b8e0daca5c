#include "common/credentials.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace proxima {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

absl::StatusOr<std::string> ReadWholeFile(absl::string_view setting, const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(setting, " is empty; expected a file path"));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string why = absl::StrCat(setting, " '", path, "': cannot read the file: ",
                                         err != 0 ? std::strerror(err) : "open failed");
    if (err == ENOENT) return absl::NotFoundError(why);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(why);
    return absl::FailedPreconditionError(why);
  }
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::FailedPreconditionError(
        absl::StrCat(setting, " '", path, "': read error (is it a directory?)"));
  }
  return text.str();
}

absl::StatusOr<std::string> CheckToken(absl::string_view setting, absl::string_view where,
                                       std::string token) {
  absl::string_view t = absl::StripAsciiWhitespace(token);
  if (t.size() < kMinTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(setting, " ", where, ": the token is ",
                                                   t.size(), " bytes; expected at least ",
                                                   kMinTokenBytes));
  }
  for (char c : t) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(setting, " ", where,
                       ": the token holds a character outside printable ASCII (one token, one "
                       "line, no spaces)"));
    }
  }
  return std::string(t);
}

// The value of the environment variable `name`, which is to hold a token.
absl::StatusOr<std::string> TokenEnvValue(absl::string_view setting, const std::string& name) {
  const char* value = name.empty() ? nullptr : std::getenv(name.c_str());
  if (value == nullptr) {
    return absl::NotFoundError(absl::StrCat(setting, " names the environment variable '", name,
                                            "', which is not set; expected it to hold a token"));
  }
  return std::string(value);
}

// One token per line of `text` (from `where`, for errors).
absl::StatusOr<std::vector<std::string>> TokenLines(absl::string_view setting,
                                                    absl::string_view where,
                                                    const std::string& text) {
  std::vector<std::string> tokens;
  const std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    if (absl::StripAsciiWhitespace(lines[i]).empty()) continue;
    PROXIMA_ASSIGN_OR_RETURN(
        std::string token,
        CheckToken(setting, absl::StrCat(where, " line ", i + 1), std::string(lines[i])));
    tokens.push_back(std::move(token));
  }
  if (tokens.empty() || tokens.size() > kMaxListedTokens) {
    return absl::InvalidArgumentError(absl::StrCat(setting, " ", where, ": holds ", tokens.size(),
                                                   " tokens; expected 1 to ", kMaxListedTokens,
                                                   ", one per line"));
  }
  return tokens;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadTokenListFile(absl::string_view setting,
                                                           const std::string& path) {
  PROXIMA_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(setting, path));
  return TokenLines(setting, absl::StrCat("'", path, "'"), text);
}

absl::StatusOr<std::vector<std::string>> ReadTokenListEnv(absl::string_view setting,
                                                          const std::string& name) {
  PROXIMA_ASSIGN_OR_RETURN(std::string value, TokenEnvValue(setting, name));
  return TokenLines(setting, absl::StrCat("(environment variable '", name, "')"), value);
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view setting, const std::string& path,
                                        PemKind kind) {
  absl::StatusOr<std::string> text = ReadWholeFile(setting, path);
  if (!text.ok()) return text.status();
  const char* expected = kind == PemKind::kCertificates ? "PEM certificates (-----BEGIN CERTIFICATE-----)"
                                                        : "a PEM private key (-----BEGIN PRIVATE KEY-----)";
  auto bad = [&](absl::string_view what) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(setting, " '", path, "': ", what, "; expected ", expected));
  };
  if (text->empty()) return bad("the file is empty");
  BioPtr bio = MemoryBio(*text);
  if (kind == PemKind::kCertificates) {
    int certs = 0;
    while (true) {
      X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
      if (!cert) break;
      ++certs;
    }
    if (certs == 0) return bad("no valid PEM certificate in the file");
  } else {
    KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (!key) return bad("no valid (unencrypted) PEM private key in the file");
  }
  ERR_clear_error();
  return text;
}

absl::Status CheckKeyMatchesCertificate(absl::string_view cert_setting,
                                        absl::string_view key_setting,
                                        const std::string& cert_pem, const std::string& key_pem) {
  BioPtr cert_bio = MemoryBio(cert_pem);
  BioPtr key_bio = MemoryBio(key_pem);
  X509Ptr cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  KeyPtr key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  const bool match = cert && key && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();
  if (!match) {
    return absl::InvalidArgumentError(absl::StrCat(
        key_setting, " is not the private key of the certificate in ", cert_setting,
        "; expected the key the certificate was issued for"));
  }
  return absl::OkStatus();
}

absl::Status CheckCertificateAllowsClientAuth(absl::string_view cert_setting,
                                              const std::string& cert_pem) {
  BioPtr bio = MemoryBio(cert_pem);
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  const bool ok = cert && X509_check_purpose(cert.get(), X509_PURPOSE_SSL_CLIENT, 0) == 1;
  ERR_clear_error();
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the certificate in ", cert_setting,
        " may not authenticate a TLS client (its extendedKeyUsage lacks clientAuth, or its "
        "keyUsage forbids signing); expected a certificate that allows client authentication, "
        "such as one with extendedKeyUsage serverAuth,clientAuth or none"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenFile(absl::string_view setting, const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(setting, path);
  if (!text.ok()) return text.status();
  return CheckToken(setting, absl::StrCat("'", path, "'"), *std::move(text));
}

absl::StatusOr<std::string> ReadTokenEnv(absl::string_view setting, const std::string& name) {
  PROXIMA_ASSIGN_OR_RETURN(std::string value, TokenEnvValue(setting, name));
  return CheckToken(setting, absl::StrCat("(environment variable '", name, "')"), value);
}

bool ConstantTimeEquals(absl::string_view presented, absl::string_view expected) {
  // Every byte of `expected` is visited whatever `presented` holds; differences are OR-ed
  // together, never branched on.
  volatile unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char p =
        i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff = diff | (p ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

}  // namespace proxima
