#include "common/credentials.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class CredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/proxima-cred-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(CredentialsTest, TokenFileIsTrimmedAndItsValueNeverInErrors) {
  std::string path = Write("tok", "  s3cr3t-token-0123456789\n");
  EXPECT_THAT(ReadTokenFile("k.file", path), ::proxima::testing::IsOkAndHolds(
                                                 std::string("s3cr3t-token-0123456789")));
  std::string short_path = Write("short", "abc-secret\n");
  absl::StatusOr<std::string> bad = ReadTokenFile("k.file", short_path);
  EXPECT_THAT(bad, StatusIs(absl::StatusCode::kInvalidArgument,
                            AllOf(HasSubstr("k.file"), HasSubstr(short_path), HasSubstr("16"),
                                  Not(HasSubstr("abc-secret")))));
  std::string spaced = Write("spaced", "a token with spaces inside it\n");
  EXPECT_THAT(ReadTokenFile("k.file", spaced),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("printable ASCII"), Not(HasSubstr("spaces inside")))));
  EXPECT_THAT(ReadTokenFile("k.file", dir_ + "/missing"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
}

TEST_F(CredentialsTest, TokenFromEnvironment) {
  setenv("PROXIMA_TEST_TOKEN_X", "env-token-abcdefghijkl", 1);
  EXPECT_THAT(ReadTokenEnv("k.env", "PROXIMA_TEST_TOKEN_X"),
              ::proxima::testing::IsOkAndHolds(std::string("env-token-abcdefghijkl")));
  unsetenv("PROXIMA_TEST_TOKEN_X");
  EXPECT_THAT(ReadTokenEnv("k.env", "PROXIMA_TEST_TOKEN_X"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("k.env"), HasSubstr("PROXIMA_TEST_TOKEN_X"))));
}

TEST_F(CredentialsTest, ATokenListHoldsOneTokenPerLineInOrder) {
  using ::proxima::testing::IsOkAndHolds;
  using ::testing::ElementsAre;
  EXPECT_THAT(ReadTokenListFile("k.file", Write("one", "only-token-0123456789\n")),
              IsOkAndHolds(ElementsAre("only-token-0123456789")));
  EXPECT_THAT(ReadTokenListFile(
                  "k.file", Write("two", "\n  first-token-0123456789 \n\nsecond-token-0123456789")),
              IsOkAndHolds(ElementsAre("first-token-0123456789", "second-token-0123456789")));
  // A bad line is named by its number, never by its value.
  const std::string bad = Write("bad", "first-token-0123456789\nshort-secret\n");
  EXPECT_THAT(ReadTokenListFile("k.file", bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("k.file"), HasSubstr("line 2"), HasSubstr("16"),
                             Not(HasSubstr("short-secret")))));
  EXPECT_THAT(ReadTokenListFile("k.file", Write("empty", "\n \n")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds 0 tokens")));
  std::string nine;
  for (int i = 0; i < 9; ++i) nine += "token-number-" + std::to_string(i) + "-0123456789\n";
  EXPECT_THAT(ReadTokenListFile("k.file", Write("nine", nine)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 1 to 8")));
  setenv("PROXIMA_TEST_TOKENS_X", "env-token-one-0123456\nenv-token-two-0123456", 1);
  EXPECT_THAT(ReadTokenListEnv("k.env", "PROXIMA_TEST_TOKENS_X"),
              IsOkAndHolds(ElementsAre("env-token-one-0123456", "env-token-two-0123456")));
  unsetenv("PROXIMA_TEST_TOKENS_X");
  EXPECT_THAT(ReadTokenListEnv("k.env", "PROXIMA_TEST_TOKENS_X"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("PROXIMA_TEST_TOKENS_X")));
}

TEST_F(CredentialsTest, PemFilesAreParsedNotJustNamed) {
  std::string junk = Write("junk.pem", "-----BEGIN CERTIFICATE-----\nnot base64!\n"
                                       "-----END CERTIFICATE-----\n");
  EXPECT_THAT(ReadPemFile("server.tls.cert_file", junk, PemKind::kCertificates),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("server.tls.cert_file"), HasSubstr(junk),
                             HasSubstr("BEGIN CERTIFICATE"))));
  EXPECT_THAT(ReadPemFile("server.tls.key_file", Write("empty", ""), PemKind::kPrivateKey),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ReadPemFile("server.tls.key_file", dir_ + "/nope.key", PemKind::kPrivateKey),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.key")));
  if (geteuid() != 0) {  // root reads any file
    std::string locked = Write("locked.pem", "x");
    chmod(locked.c_str(), 0);
    EXPECT_THAT(ReadPemFile("server.tls.key_file", locked, PemKind::kPrivateKey),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("locked.pem")));
  }
}

// Self-signed certificates with the given extensions, made by the openssl CLI.
TEST_F(CredentialsTest, ClientAuthIsAllowedByNoOrAClientExtendedKeyUsage) {
  auto make = [this](const std::string& name, const std::string& ext) {
    const std::string cmd = "/usr/bin/openssl req -x509 -newkey ec -pkeyopt "
                            "ec_paramgen_curve:prime256v1 -nodes -days 1 -subj /CN=" + name +
                            " -keyout " + dir_ + "/" + name + ".key -out " + dir_ + "/" + name +
                            ".crt" + (ext.empty() ? "" : " -addext " + ext) + " 2>/dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    absl::StatusOr<std::string> pem =
        ReadPemFile("k.cert_file", dir_ + "/" + name + ".crt", PemKind::kCertificates);
    EXPECT_OK(pem.status());
    return pem.value_or("");
  };
  EXPECT_OK(CheckCertificateAllowsClientAuth("k.cert_file", make("plain", "")));
  EXPECT_OK(CheckCertificateAllowsClientAuth(
      "k.cert_file", make("both", "extendedKeyUsage=serverAuth,clientAuth")));
  EXPECT_THAT(CheckCertificateAllowsClientAuth("k.cert_file",
                                               make("server", "extendedKeyUsage=serverAuth")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("k.cert_file"), HasSubstr("clientAuth"))));
  EXPECT_THAT(CheckCertificateAllowsClientAuth("k.cert_file", "not a certificate"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k.cert_file")));
}

TEST(ConstantTimeEqualsTest, ComparesWholeValues) {
  EXPECT_TRUE(ConstantTimeEquals("abcdefgh", "abcdefgh"));
  EXPECT_FALSE(ConstantTimeEquals("abcdefgX", "abcdefgh"));
  EXPECT_FALSE(ConstantTimeEquals("abcdefg", "abcdefgh"));
  EXPECT_FALSE(ConstantTimeEquals("abcdefghi", "abcdefgh"));
  EXPECT_FALSE(ConstantTimeEquals("", "abcdefgh"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("abcdefgh\0", 9), "abcdefgh"));
}

}  // namespace
}  // namespace proxima
