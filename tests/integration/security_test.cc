// Security against the real proximad: TLS and mTLS with certificates made at test time (openssl
// CLI), bearer tokens and read-only tokens, every call tried across namespaces, the Unix
// socket's file mode, and the per-client in-flight byte limit.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/testing/metric_value.h"
#include "common/testing/slow_link.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_pki.h"

namespace proxima {
namespace {

using ::proxima::client::BlockKey;
using ::proxima::client::Client;
using ::proxima::client::ClientOptions;
using ::proxima::client::Profile;
using ::proxima::testing::DaemonProcess;
using ::proxima::testing::RunCommand;
using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

v1::ModelProfile SmallModel() {  // 2 x 16 x 2 x 64 x fp16 x (K, V) = 16 KiB blocks
  v1::ModelProfile p;
  p.set_num_layers(2);
  p.set_num_kv_heads(2);
  p.set_head_dim(64);
  p.set_tokens_per_block(16);
  p.set_dtype(v1::DTYPE_FP16);
  p.set_fingerprint("security-test");
  return p;
}

// Two CAs and certificates, made by the openssl CLI.
class Pki : public testing::TestPki {
 public:
  Pki() {
    ok_ = MakeCa("ca") && MakeCa("other-ca") &&
          MakeCert("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost") &&
          MakeCert("client", "ca", "extendedKeyUsage=clientAuth") &&
          MakeCert("rogue-client", "other-ca", "extendedKeyUsage=clientAuth");
  }
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
};

absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options) {
  options.connect_timeout = absl::Seconds(3);
  options.call_timeout = absl::Seconds(10);
  return Client::Connect(options);
}

// Stores and reads back `n` test blocks; checks every byte.
void RoundTrip(Client& c, uint64_t seed, size_t n) {
  ASSERT_OK_AND_ASSIGN(Profile p, c.RegisterProfile(SmallModel()));
  std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, n);
  std::vector<std::vector<std::byte>> data(n, std::vector<std::byte>(p.block_bytes));
  for (size_t i = 0; i < n; ++i) client::FillTestBlock(seed, i, data[i]);
  std::vector<std::span<const std::byte>> in(data.begin(), data.end());
  ASSERT_OK(c.Put(p, keys, in).status());
  std::vector<std::vector<std::byte>> out(n, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> spans(out.begin(), out.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, c.Get(p, keys, spans));
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(found[i]);
    EXPECT_TRUE(client::IsTestBlock(seed, i, out[i])) << i;
  }
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(pki_.ok()); }
  std::vector<std::string> TlsSets(bool mtls) {
    std::vector<std::string> sets = {"server.tls.cert_file=" + pki_.Path("server.crt"),
                                     "server.tls.key_file=" + pki_.Path("server.key")};
    if (mtls) sets.push_back("server.tls.client_ca_file=" + pki_.Path("ca.crt"));
    return sets;
  }
  // Copies the PKI file `from` to `to` as a renewal does: written aside, then renamed over, so
  // that a reader never sees a file half written.
  void Install(const std::string& from, const std::string& to) {
    std::ifstream in(pki_.Path(from), std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    pki_.Write(to + ".tmp", text.str());
    ASSERT_EQ(std::rename(pki_.Path(to + ".tmp").c_str(), pki_.Path(to).c_str()), 0);
  }
  Pki pki_;
};

TEST_F(TlsTest, RoundTripOverTls) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start(TlsSets(false)));
  ASSERT_OK_AND_ASSIGN(auto c, Connect({.target = daemon->tcp_target(),
                                        .tls_ca_file = pki_.Path("ca.crt")}));
  RoundTrip(*c, 1, 6);
  // The Unix socket stays plaintext (protected by its file mode).
  ASSERT_OK_AND_ASSIGN(auto local, Connect({.target = daemon->unix_target()}));
  RoundTrip(*local, 2, 2);
}

// A daemon a round trip of 1.4 s away: the mTLS handshake takes longer than the client's
// reconnect backoff (1 s at most). libproxima once set GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, which
// gRPC takes as the least time a connection attempt may take, to 100 ms: every attempt was given
// up before its handshake ended and the client never connected (first seen under qemu in CI).
TEST_F(TlsTest, AClientReachesADaemonWhoseHandshakeTakesLongerThanTheReconnectBackoff) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start(TlsSets(true)));
  proxima::testing::SlowLink link(daemon->tcp_port(), std::chrono::milliseconds(700));
  ASSERT_TRUE(link.ok());
  absl::StatusOr<std::unique_ptr<Client>> c =
      Client::Connect({.target = link.address(),
                       .connect_timeout = absl::Seconds(20),
                       .call_timeout = absl::Seconds(20),
                       .tls_ca_file = pki_.Path("ca.crt"),
                       .tls_cert_file = pki_.Path("client.crt"),
                       .tls_key_file = pki_.Path("client.key"),
                       .transport = client::Transport::kInline});
  ASSERT_OK(c.status()) << link.connections() << " connection attempts over the slow link";
  RoundTrip(**c, 10, 2);
}

TEST_F(TlsTest, MutualTlsAcceptsOnlyCertificatesOfItsCa) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start(TlsSets(true)));
  ASSERT_OK_AND_ASSIGN(auto c, Connect({.target = daemon->tcp_target(),
                                        .tls_ca_file = pki_.Path("ca.crt"),
                                        .tls_cert_file = pki_.Path("client.crt"),
                                        .tls_key_file = pki_.Path("client.key")}));
  RoundTrip(*c, 3, 4);

  struct Case {
    const char* what;
    ClientOptions options;
  };
  const std::vector<Case> refused = {
      {"no client certificate",
       {.target = daemon->tcp_target(), .tls_ca_file = pki_.Path("ca.crt")}},
      {"a client certificate from another CA",
       {.target = daemon->tcp_target(),
        .tls_ca_file = pki_.Path("ca.crt"),
        .tls_cert_file = pki_.Path("rogue-client.crt"),
        .tls_key_file = pki_.Path("rogue-client.key")}},
      {"a plaintext client", {.target = daemon->tcp_target()}},
      {"a client that does not trust the server's CA",
       {.target = daemon->tcp_target(),
        .tls_ca_file = pki_.Path("other-ca.crt"),
        .tls_cert_file = pki_.Path("client.crt"),
        .tls_key_file = pki_.Path("client.key")}},
  };
  for (const Case& k : refused) {
    SCOPED_TRACE(k.what);
    absl::Time start = absl::Now();
    EXPECT_THAT(Connect(k.options),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot reach proximad")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(8));  // the connect timeout, not a hang
  }
  // The daemon is unharmed.
  RoundTrip(*c, 4, 2);
}

// A certificate renewed in place (a Secret update, cert-manager) is served without a restart:
// the daemon reads its files again every server.tls.reload_interval. Here the renewal also moves
// to another CA, so that a client can tell which certificate the daemon presents: one trusting
// only the new CA is refused before the files change and served after, within a few intervals;
// one trusting only the old CA the other way round. The Unix socket serves throughout.
TEST_F(TlsTest, ACertificateRenewedInPlaceIsServedWithoutARestart) {
  ASSERT_TRUE(pki_.MakeCert("renewed", "other-ca", "subjectAltName=IP:127.0.0.1,DNS:localhost"));
  Install("server.crt", "live.crt");
  Install("server.key", "live.key");
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       DaemonProcess::Start({"server.tls.cert_file=" + pki_.Path("live.crt"),
                                             "server.tls.key_file=" + pki_.Path("live.key"),
                                             "server.tls.reload_interval=1s"}));
  auto trusting = [&](const char* ca) {
    return Connect({.target = daemon->tcp_target(), .tls_ca_file = pki_.Path(ca)});
  };
  ASSERT_OK_AND_ASSIGN(auto before, trusting("ca.crt"));
  RoundTrip(*before, 5, 2);
  EXPECT_THAT(trusting("other-ca.crt"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot reach proximad")));

  Install("renewed.key", "live.key");
  Install("renewed.crt", "live.crt");
  absl::StatusOr<std::unique_ptr<Client>> after = trusting("other-ca.crt");
  for (const absl::Time until = absl::Now() + absl::Seconds(20);
       !after.ok() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(200));
    after = trusting("other-ca.crt");
  }
  ASSERT_OK(after.status()) << "the renewed certificate was not served within 20 s";
  RoundTrip(**after, 6, 2);
  EXPECT_THAT(trusting("ca.crt"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot reach proximad")));
  ASSERT_OK_AND_ASSIGN(auto local, Connect({.target = daemon->unix_target()}));
  RoundTrip(*local, 7, 2);
}

// The client reads its TLS files again too (ClientOptions::tls_reload_interval): a worker's
// client certificate and CA bundle renewed in place are used by its next connections without a
// new Client. Here the whole PKI moves to another CA while the daemon restarts on it: the
// client made before, on the old CA's files, must reach the restarted daemon, which accepts
// only the new CA's client certificates and presents a certificate of the new CA.
TEST_F(TlsTest, AClientUsesItsRenewedCertificateAndCaWithoutBeingMadeAgain) {
  ASSERT_TRUE(pki_.MakeCert("renewed", "other-ca", "subjectAltName=IP:127.0.0.1,DNS:localhost"));
  Install("ca.crt", "client-ca.crt");
  Install("client.crt", "client-live.crt");
  Install("client.key", "client-live.key");
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start(TlsSets(true)));
  ClientOptions options{.target = daemon->tcp_target(),
                        .tls_ca_file = pki_.Path("client-ca.crt"),
                        .tls_cert_file = pki_.Path("client-live.crt"),
                        .tls_key_file = pki_.Path("client-live.key"),
                        .tls_reload_interval = absl::Seconds(1),
                        .transport = client::Transport::kInline};
  ASSERT_OK_AND_ASSIGN(auto c, Connect(options));
  RoundTrip(*c, 8, 2);

  Install("other-ca.crt", "client-ca.crt");
  Install("rogue-client.key", "client-live.key");
  Install("rogue-client.crt", "client-live.crt");
  ASSERT_OK(daemon->Restart({"server.tls.cert_file=" + pki_.Path("renewed.crt"),
                             "server.tls.key_file=" + pki_.Path("renewed.key"),
                             "server.tls.client_ca_file=" + pki_.Path("other-ca.crt")}));
  // A client on the old files is refused by the restarted daemon (the premise).
  ClientOptions old_files = options;
  old_files.tls_ca_file = pki_.Path("ca.crt");
  old_files.tls_cert_file = pki_.Path("client.crt");
  old_files.tls_key_file = pki_.Path("client.key");
  EXPECT_THAT(Connect(old_files),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot reach proximad")));
  absl::StatusOr<Profile> registered = c->RegisterProfile(SmallModel());
  for (const absl::Time until = absl::Now() + absl::Seconds(20);
       !registered.ok() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(200));
    registered = c->RegisterProfile(SmallModel());
  }
  ASSERT_OK(registered.status()) << "the client did not use its renewed files within 20 s";
  RoundTrip(*c, 9, 2);
}

TEST_F(TlsTest, BadTlsFilesStopTheStartWithTheKeyAndPath) {
  std::string junk = pki_.Write("junk.pem", "-----BEGIN CERTIFICATE-----\nAAAA\n"
                                            "-----END CERTIFICATE-----\n");
  struct Case {
    std::vector<std::string> sets;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {{"server.tls.cert_file=" + pki_.Path("missing.crt"),
        "server.tls.key_file=" + pki_.Path("server.key")},
       {"server.tls.cert_file", "missing.crt", "No such file"}},
      {{"server.tls.cert_file=" + junk, "server.tls.key_file=" + pki_.Path("server.key")},
       {"server.tls.cert_file", "junk.pem", "no valid PEM certificate"}},
      {{"server.tls.cert_file=" + pki_.Path("server.crt"),
        "server.tls.key_file=" + pki_.Path("client.key")},
       {"server.tls.key_file", "not the private key"}},
      {{"server.tls.cert_file=" + pki_.Path("server.crt"),
        "server.tls.key_file=" + pki_.Path("server.key"),
        "server.tls.client_ca_file=" + pki_.Path("server.key")},
       {"server.tls.client_ca_file", "server.key", "certificate"}},
      {{"server.tls.cert_file=" + pki_.Path("server.crt")},
       {"server.tls.key_file", "since server.tls.cert_file is set"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.sets[0]);
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(k.sets);
    ASSERT_FALSE(d.ok());
    for (const std::string& e : k.expect) EXPECT_THAT(d.status().message(), HasSubstr(e));
  }
}

// Namespaces a (a read-write and a read-only token) and b (a read-write token), token files in
// the daemon's directory.
class TokenTest : public ::testing::Test {
 protected:
  static constexpr char kA[] = "tok-a-rw-7f3c9d1e2b4a6f80";
  static constexpr char kAReadOnly[] = "tok-a-ro-0e9d8c7b6a5f4e3d";
  static constexpr char kB[] = "tok-b-rw-1a2b3c4d5e6f7a8b";

  void SetUp() override {
    ASSERT_TRUE(pki_.ok());
    std::string a = pki_.Write("a.token", std::string(kA) + "\n");
    std::string a_ro = pki_.Write("a-ro.token", std::string(kAReadOnly) + "\n");
    std::string b = pki_.Write("b.token", std::string(kB) + "\n");
    ASSERT_OK_AND_ASSIGN(
        daemon_, DaemonProcess::Start({absl::StrCat(
                     "namespaces=[{name: a, tokens: [{name: worker, file: ", a,
                     "}, {name: dashboard, file: ", a_ro, ", access: read_only}]}, ",
                     "{name: b, tokens: [{name: worker, file: ", b, "}]}]")}));
  }
  absl::StatusOr<std::unique_ptr<Client>> As(const std::string& ns, const std::string& token) {
    return Connect({.target = daemon_->unix_target(), .namespace_name = ns, .token = token});
  }

  Pki pki_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(TokenTest, EveryCallAcrossNamespacesIsRefusedAndRevealsNothing) {
  ASSERT_OK_AND_ASSIGN(auto a, As("a", kA));
  ASSERT_OK_AND_ASSIGN(Profile p, a->RegisterProfile(SmallModel()));
  std::vector<BlockKey> keys = client::TestKeyChain(7, 0, 4);
  std::vector<std::vector<std::byte>> data(4, std::vector<std::byte>(p.block_bytes));
  for (size_t i = 0; i < 4; ++i) client::FillTestBlock(7, i, data[i]);
  std::vector<std::span<const std::byte>> in(data.begin(), data.end());
  ASSERT_OK(a->Put(p, keys, in).status());
  std::vector<std::vector<std::byte>> out(4, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> spans(out.begin(), out.end());

  // B's token naming namespace a, and naming a namespace that does not exist: every call gets
  // the same PERMISSION_DENIED, which names neither blocks nor a's existence.
  for (const char* ns : {"a", "no-such-ns"}) {
    SCOPED_TRACE(ns);
    ASSERT_OK_AND_ASSIGN(auto intruder, As(ns, kB));
    auto denied = StatusIs(absl::StatusCode::kPermissionDenied,
                           AllOf(HasSubstr("token 'worker' is not valid for namespace"),
                                 HasSubstr("grants namespace 'b' only")));
    EXPECT_THAT(intruder->RegisterProfile(SmallModel()), denied);
    EXPECT_THAT(intruder->Put(p, keys, in), denied);
    EXPECT_THAT(intruder->Get(p, keys, spans), denied);
    EXPECT_THAT(intruder->GetStored(p, keys), denied);
    EXPECT_THAT(intruder->Decompress(p, keys, spans), denied);
    EXPECT_THAT(intruder->Lookup(p, keys), denied);
    EXPECT_THAT(intruder->Delete(p, keys), denied);
  }
  // In its own namespace, B does not see a's blocks under the same profile and keys.
  ASSERT_OK_AND_ASSIGN(auto b, As("b", kB));
  ASSERT_OK_AND_ASSIGN(Profile pb, b->RegisterProfile(SmallModel()));
  EXPECT_EQ(pb.id, p.id);
  EXPECT_THAT(b->Lookup(pb, keys), ::proxima::testing::IsOkAndHolds(0u));
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, b->Get(pb, keys, spans));
  EXPECT_THAT(found, ::testing::Each(false));
  ASSERT_OK_AND_ASSIGN(found, b->Decompress(pb, keys, spans));
  EXPECT_THAT(found, ::testing::Each(false));
  EXPECT_THAT(b->Delete(pb, keys), ::proxima::testing::IsOkAndHolds(0u));
  // Stats: b sees b only, and no tier totals (they would count a's blocks).
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, b->Stats());
  ASSERT_EQ(stats.namespaces_size(), 1);
  EXPECT_EQ(stats.namespaces(0).name(), "b");
  EXPECT_EQ(stats.namespaces(0).blocks(), 0u);
  EXPECT_EQ(stats.tiers_size(), 0);
  EXPECT_THAT(stats.DebugString(), Not(HasSubstr("\"a\"")));
  // Nothing of a's was lost.
  EXPECT_THAT(a->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(4u));
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse a_stats, a->Stats());
  ASSERT_EQ(a_stats.namespaces_size(), 1);
  EXPECT_EQ(a_stats.namespaces(0).blocks(), 4u);
}

// Token rotation: SIGHUP makes proximad re-read its token files. From then on the new token
// works and the old one is refused, also on a connection opened with it; blocks stored under the
// old token stay. A reload that fails (an empty file) keeps every token in force and says why.
TEST_F(TokenTest, SighupRotatesTokensAndAFailedReloadKeepsThoseInForce) {
  static constexpr char kRotated[] = "tok-a-rw-rotated-5d6e7f8091a2";
  ASSERT_OK_AND_ASSIGN(auto a, As("a", kA));
  ASSERT_OK_AND_ASSIGN(Profile p, a->RegisterProfile(SmallModel()));
  std::vector<BlockKey> keys = client::TestKeyChain(9, 0, 2);
  std::vector<std::vector<std::byte>> data(2, std::vector<std::byte>(p.block_bytes));
  for (size_t i = 0; i < 2; ++i) client::FillTestBlock(9, i, data[i]);
  std::vector<std::span<const std::byte>> in(data.begin(), data.end());
  ASSERT_OK(a->Put(p, keys, in).status());

  pki_.Write("a.token", std::string(kRotated) + "\n");
  daemon_->Signal(SIGHUP);
  absl::StatusOr<std::unique_ptr<Client>> rotated;
  for (int i = 0; i < 100 && !rotated.ok(); ++i) {  // the reload runs in the daemon, soon
    absl::SleepFor(absl::Milliseconds(50));
    rotated = As("a", kRotated);
  }
  ASSERT_OK(rotated.status());
  EXPECT_THAT((*rotated)->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(2u));
  EXPECT_THAT(As("a", kA), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  EXPECT_THAT(a->Lookup(p, keys),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));

  pki_.Write("b.token", "");
  daemon_->Signal(SIGHUP);
  bool logged = false;
  for (int i = 0; i < 100 && !logged; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    logged = absl::StrContains(daemon_->Log(), "token reload failed");
  }
  ASSERT_TRUE(logged) << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), HasSubstr("namespaces[1].tokens[0].file"));
  ASSERT_OK_AND_ASSIGN(auto b, As("b", kB));
  EXPECT_OK(b->RegisterProfile(SmallModel()).status());
  EXPECT_THAT((*rotated)->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(2u));
  for (const char* t : {kA, kRotated, kB}) EXPECT_THAT(daemon_->Log(), Not(HasSubstr(t)));
}

// A worker's client given its token as a file (ClientOptions::token_file) follows the rotation
// security.md describes without a restart or a new Client: namespace r has two entries; the new
// secret goes into the idle one, the workers' file is rewritten, then the old entry gets a fresh
// secret, which revokes the old token. Clients over inline gRPC and over UCX (whose session
// belongs to the token that opened it) keep working throughout; a file that reads back empty
// meanwhile leaves the token in force.
TEST_F(TokenTest, AClientOnATokenFileFollowsARotationWithoutBeingMadeAgain) {
  static constexpr char kOld[] = "tok-r-old-5c1d2e3f4a5b6c7d";
  static constexpr char kNew[] = "tok-r-new-8e9f0a1b2c3d4e5f";
  const std::string worker = pki_.Write("r-worker.token", std::string(kOld) + "\n");
  const std::string next = pki_.Write("r-next.token", "tok-r-idle-0f1e2d3c4b5a6978\n");
  ASSERT_OK_AND_ASSIGN(
      auto daemon, DaemonProcess::Start(
                       {absl::StrCat("namespaces=[{name: r, tokens: [{name: worker, file: ", worker,
                                     "}, {name: worker-next, file: ", next, "}]}]")}));
  const std::string client_file = pki_.Write("client.token", std::string(kOld) + "\n");
  std::vector<std::unique_ptr<Client>> clients;
  for (client::Transport t : {client::Transport::kInline, client::Transport::kUcx}) {
    ASSERT_OK_AND_ASSIGN(auto c, Client::Connect({.target = daemon->unix_target(),
                                                  .namespace_name = "r",
                                                  .token_file = client_file,
                                                  .token_reload_interval = absl::Seconds(1),
                                                  .transport = t}));
    RoundTrip(*c, 20 + clients.size(), 2);
    clients.push_back(std::move(c));
  }
  auto as = [&](const char* token) {
    return Client::Connect({.target = daemon->unix_target(),
                            .namespace_name = "r",
                            .token = token,
                            .transport = client::Transport::kInline});
  };
  // 1. The new secret into the idle entry: both are valid.
  pki_.Write("r-next.token", std::string(kNew) + "\n");
  daemon->Signal(SIGHUP);
  absl::StatusOr<std::unique_ptr<Client>> fresh = as(kNew);
  for (int i = 0; i < 100 && !fresh.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    fresh = as(kNew);
  }
  ASSERT_OK(fresh.status());
  // A renewal caught half way (the file empty when read) keeps the token in force.
  pki_.Write("client.token", "");
  absl::SleepFor(absl::Milliseconds(1500));
  for (size_t i = 0; i < clients.size(); ++i) RoundTrip(*clients[i], 30 + i, 2);
  // 2. The workers' file gets the new secret; they present it once they read it again.
  pki_.Write("client.token", std::string(kNew) + "\n");
  absl::SleepFor(absl::Milliseconds(1500));
  for (size_t i = 0; i < clients.size(); ++i) RoundTrip(*clients[i], 40 + i, 2);
  // 3. A fresh secret into the old entry revokes the old token.
  pki_.Write("r-worker.token", "tok-r-fresh-7a6b5c4d3e2f1a0b\n");
  daemon->Signal(SIGHUP);
  absl::StatusOr<std::unique_ptr<Client>> old = as(kOld);
  for (int i = 0; i < 100 && old.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    old = as(kOld);
  }
  EXPECT_THAT(old, StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  for (size_t i = 0; i < clients.size(); ++i) RoundTrip(*clients[i], 50 + i, 2);
  EXPECT_EQ(clients[1]->transport(), client::Transport::kUcx);
  // The UCX client's first session was closed when it moved (with the token that opened it):
  // one session is open, its own.
  auto sessions = [&] {
    absl::StatusOr<std::string> metrics = daemon->ScrapeMetrics();
    return metrics.ok() ? ::proxima::testing::MetricValue(*metrics, "proxima_ucx_sessions") : -1;
  };
  EXPECT_EQ(sessions(), 1);
  // 4. One entry's secret replaced in one step (no second entry): the daemon refuses the old
  // secret at once, and the workers' calls fail until they read their file again; then they
  // work, and the session opened with the refused secret is closed all the same (with the new
  // one, of the same entry).
  static constexpr char kNewer[] = "tok-r-newer-1b2c3d4e5f60718293";
  pki_.Write("client.token", std::string(kNewer) + "\n");
  pki_.Write("r-next.token", std::string(kNewer) + "\n");
  daemon->Signal(SIGHUP);
  absl::SleepFor(absl::Milliseconds(1500));
  for (size_t i = 0; i < clients.size(); ++i) {
    absl::StatusOr<Profile> p = clients[i]->RegisterProfile(SmallModel());
    for (const absl::Time until = absl::Now() + absl::Seconds(10);
         !p.ok() && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(200));
      p = clients[i]->RegisterProfile(SmallModel());
    }
    ASSERT_OK(p.status());
    RoundTrip(*clients[i], 60 + i, 2);
  }
  EXPECT_EQ(sessions(), 1);
  for (const char* t : {kOld, kNew, kNewer}) EXPECT_THAT(daemon->Log(), Not(HasSubstr(t)));
}

TEST_F(TokenTest, MissingAndWrongTokensAreUnauthenticated) {
  // Connect() calls GetServerInfo, which needs no namespace; a wrong token fails it already.
  EXPECT_THAT(As("a", "tok-a-rw-00000000000000000"),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  ASSERT_OK_AND_ASSIGN(auto anonymous, As("a", ""));
  EXPECT_THAT(anonymous->RegisterProfile(SmallModel()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("needs a bearer token")));
  ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, anonymous->Stats());
  EXPECT_EQ(stats.namespaces_size(), 0);
  EXPECT_EQ(stats.tiers_size(), 0);
  // The daemon's log never holds a token.
  std::string log = daemon_->Log();
  for (const char* t : {kA, kAReadOnly, kB}) EXPECT_THAT(log, Not(HasSubstr(t)));
}

TEST_F(TokenTest, ReadOnlyTokenReadsButCannotWrite) {
  ASSERT_OK_AND_ASSIGN(auto writer, As("a", kA));
  ASSERT_OK_AND_ASSIGN(auto reader, As("a", kAReadOnly));
  ASSERT_OK_AND_ASSIGN(Profile p, reader->RegisterProfile(SmallModel()));
  std::vector<BlockKey> keys = client::TestKeyChain(9, 0, 2);
  std::vector<std::vector<std::byte>> data(2, std::vector<std::byte>(p.block_bytes));
  for (size_t i = 0; i < 2; ++i) client::FillTestBlock(9, i, data[i]);
  std::vector<std::span<const std::byte>> in(data.begin(), data.end());
  ASSERT_OK(writer->Put(p, keys, in).status());
  EXPECT_THAT(reader->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(2u));
  std::vector<std::vector<std::byte>> out(2, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> spans(out.begin(), out.end());
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, reader->Get(p, keys, spans));
  EXPECT_THAT(found, ::testing::Each(true));
  EXPECT_TRUE(client::IsTestBlock(9, 1, out[1]));
  // Decompress is a read: a read-only token may call it.
  std::fill(out[1].begin(), out[1].end(), std::byte{0});
  ASSERT_OK_AND_ASSIGN(found, reader->Decompress(p, keys, spans));
  EXPECT_THAT(found, ::testing::Each(true));
  EXPECT_TRUE(client::IsTestBlock(9, 1, out[1]));
  ASSERT_OK(reader->Stats().status());
  auto read_only = StatusIs(absl::StatusCode::kPermissionDenied,
                            AllOf(HasSubstr("'dashboard'"), HasSubstr("read_only")));
  EXPECT_THAT(reader->Put(p, keys, in), read_only);
  EXPECT_THAT(reader->Delete(p, keys), read_only);
  EXPECT_THAT(writer->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(2u));
}

TEST_F(TokenTest, CAbiAndProximactlPassTokens) {
  testing::CommandResult r = RunCommand({C_ABI_TEST_PATH, daemon_->unix_target(), "b", kB});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("c abi ok"));

  const std::string token_file = pki_.Write("ctl.token", std::string(kA) + "\n");
  r = RunCommand({testing::ProximactlPath(), "put", "--target=" + daemon_->unix_target(),
                  "--ns=a", "--token_file=" + token_file, "--count=3", "--layers=2",
                  "--kv_heads=2", "--head_dim=64", "--dtype=fp16"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  r = RunCommand({testing::ProximactlPath(), "put", "--target=" + daemon_->unix_target(),
                  "--ns=a", "--count=3"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, AllOf(HasSubstr("UNAUTHENTICATED"), HasSubstr("bearer token")));
}

TEST(UnixSocketTest, SocketHasTheConfiguredModeAndOthersCannotConnect) {
  // 0666 is the control: there, another user does get in, so a refusal under 0600 and 0660 is
  // the socket's mode at work and not something else.
  for (const char* mode : {"0600", "0660", "0666"}) {
    SCOPED_TRACE(mode);
    ASSERT_OK_AND_ASSIGN(auto daemon,
                         DaemonProcess::Start({std::string("server.unix_socket_mode=") + mode}));
    struct stat st;
    ASSERT_EQ(stat(daemon->socket_path().c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, std::stoul(mode, nullptr, 8));
    if (geteuid() != 0) continue;  // checking another user's view needs root to become one
    // The daemon's directory is 0700: open it, so that only the socket's own mode decides.
    ASSERT_EQ(chmod(daemon->dir().c_str(), 0755), 0);
    // A child that drops to user and group nobody (not the socket's owner or group).
    pid_t pid = fork();
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      int fd = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, daemon->socket_path().c_str(), sizeof(addr.sun_path) - 1);
      int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      _exit(rc == 0 ? 0 : (errno == EACCES ? 1 : 2));
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    // Exit 1: refused with EACCES; exit 0: connected.
    EXPECT_EQ(WEXITSTATUS(status), std::string(mode) == "0666" ? 0 : 1);
  }
}

TEST(LimitsTest, InflightBytesPerClientAreCappedWithAClearError) {
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       DaemonProcess::Start({"server.max_inflight_bytes_per_client=64KiB"}));
  // The limit counts gRPC message bytes: the inline path (UCX moves block bytes outside them).
  ASSERT_OK_AND_ASSIGN(auto c, Connect({.target = daemon->tcp_target(),
                                        .transport = client::Transport::kInline}));
  EXPECT_EQ(c->server_info().max_inflight_bytes, uint64_t{64} << 10);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(SmallModel()));  // 16 KiB blocks
  // One-block calls fit, even when the daemon has not yet released the previous call (it does
  // so once gRPC has finished sending, a moment after the client has the response).
  RoundTrip(*c, 11, 1);
  // The client cuts batches to the limit (half of it per inline call, leaving room for the
  // previous call's response until the daemon has released it): 5 blocks (80 KiB) go one by one.
  RoundTrip(*c, 12, 5);
  // The daemon enforces it on whatever arrives: raw calls of 5 blocks, over TCP and over a Unix
  // socket, each connection on an account of its own (the daemon accepts Unix-socket connections
  // itself, so gRPC names each one "fd:N" instead of all "unix:").
  std::vector<BlockKey> keys = client::TestKeyChain(14, 0, 5);
  auto key_string = [](const BlockKey& k) {
    return std::string(reinterpret_cast<const char*>(k.data()), k.size());
  };
  for (const std::string& target : {daemon->tcp_target(), daemon->unix_target()}) {
    SCOPED_TRACE(target);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    auto stub = v1::KVTier::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
    const bool local = target == daemon->unix_target();
    // A 5-block Put (80 KiB) is over the limit by itself.
    v1::PutRequest put;
    put.set_namespace_name("default");
    put.set_profile_id(p.id);
    for (const BlockKey& key : keys) {
      v1::PutBlock* block = put.add_blocks();
      block->set_key(key_string(key));
      block->set_data(std::string(p.block_bytes, 'x'));
    }
    grpc::ClientContext put_context;
    v1::PutResponse put_response;
    grpc::Status status = stub->Put(&put_context, put, &put_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(status.error_message(),
                AllOf(HasSubstr("server.max_inflight_bytes_per_client = 65536"),
                      HasSubstr("request"), HasSubstr(local ? "client fd:" : "client ipv4:")));
    EXPECT_THAT(c->Lookup(p, keys), ::proxima::testing::IsOkAndHolds(0u));  // nothing stored
    // A Get whose response would be 5 blocks (80 KiB): its request is small, its response not.
    v1::GetRequest get;
    get.set_namespace_name("default");
    get.set_profile_id(p.id);
    for (int i = 0; i < 5; ++i) get.add_keys(key_string(client::TestKeyChain(11, 0, 1)[0]));
    grpc::ClientContext get_context;
    v1::GetResponse get_response;
    status = stub->Get(&get_context, get, &get_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(status.error_message(),
                AllOf(HasSubstr("server.max_inflight_bytes_per_client"), HasSubstr("response")));
  }
  // Refused calls release what they held: small calls keep working, on both kinds of connection.
  RoundTrip(*c, 13, 1);
  ASSERT_OK_AND_ASSIGN(auto local, Connect({.target = daemon->unix_target()}));
  RoundTrip(*local, 15, 1);
}

// server.max_connections caps the connections with calls running at once. A call from one more
// is refused only until another connection's calls end, and says so (the retry metadata):
// libproxima sends it again within its deadline, so clients past the cap wait their turn instead
// of failing. Before stop 64 every such refusal reached the caller.
TEST(LimitsTest, CallsPastTheConnectionCapWaitForTheirTurn) {
  ASSERT_OK_AND_ASSIGN(auto daemon, DaemonProcess::Start({"server.max_connections=1"}));
  constexpr int kClients = 3;
  constexpr int kRounds = 40;
  constexpr size_t kBlocks = 8;
  std::vector<std::unique_ptr<Client>> clients;
  Profile p;
  for (int i = 0; i < kClients; ++i) {
    // Each client its own TCP connection (libproxima's channels keep their own subchannels).
    ASSERT_OK_AND_ASSIGN(
        auto c, Connect({.target = daemon->tcp_target(), .transport = client::Transport::kInline}));
    ASSERT_OK_AND_ASSIGN(p, c->RegisterProfile(SmallModel()));
    clients.push_back(std::move(c));
  }
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_failure;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      Client& c = *clients[i];
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t seed = 1000 + i * kRounds + r;
        std::vector<BlockKey> keys = client::TestKeyChain(seed, 0, kBlocks);
        std::vector<std::vector<std::byte>> data(kBlocks, std::vector<std::byte>(p.block_bytes));
        for (size_t b = 0; b < kBlocks; ++b) client::FillTestBlock(seed, b, data[b]);
        std::vector<std::span<const std::byte>> in(data.begin(), data.end());
        absl::Status status = c.Put(p, keys, in).status();
        if (status.ok()) {
          std::vector<std::span<std::byte>> out(data.begin(), data.end());
          absl::StatusOr<std::vector<bool>> found = c.Get(p, keys, out);
          status = found.status();
          for (size_t b = 0; status.ok() && b < kBlocks; ++b) {
            if (!(*found)[b] || !client::IsTestBlock(seed, b, data[b])) {
              status = absl::DataLossError(absl::StrCat("block ", b, " of chain ", seed));
            }
          }
        }
        if (!status.ok()) {
          failures.fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          if (first_failure.empty()) first_failure = status.ToString();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  // The premise: the daemon did refuse calls for the cap (each one sent again).
  ASSERT_OK_AND_ASSIGN(std::string metrics, daemon->ScrapeMetrics());
  double refused = 0;
  for (const char* method : {"Put", "Get"}) {
    refused += std::max(0.0, ::proxima::testing::MetricValue(
                                 metrics, absl::StrCat("proxima_requests_total{method=\"", method,
                                                       "\",code=\"RESOURCE_EXHAUSTED\"}")));
  }
  std::cout << "calls refused for server.max_connections and sent again: " << refused << "\n";
  EXPECT_GT(refused, 0) << "no call was refused: this test tested nothing";
}

}  // namespace
}  // namespace proxima
