// A real proximad in a cluster with a peer that answers every peer call with a lie: holders it
// does not have, fetched blocks of the wrong size, CRC32C or level, spill answers of the wrong
// length naming blocks that were never sent, Rejoin answers with malformed recent Deletes. Such
// a peer cannot be produced from a real daemon (it checks what it sends), so it is a double: a
// gRPC server in this test process, listed in the daemon's cluster.peers and passing its health
// checks. The daemon must live, serve the lies as misses (never wrong bytes), keep every block it
// stored, and say what it refused.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/crc32c.h"
#include "common/testing/free_port.h"
#include "common/testing/status_matchers.h"
#include "common/ucx.h"
#include "common/ucx_address_check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proxima/v1/peer.grpc.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

namespace proxima {
namespace {

using ::proxima::client::Client;
using ::proxima::client::Profile;
using ::proxima::client::PutOutcome;
using ::proxima::testing::Blocks;
using ::proxima::testing::ClusterSets;
using ::proxima::testing::DaemonProcess;
using ::proxima::testing::FreeLoopbackPorts;
using ::proxima::testing::GetAndCheck;
using ::proxima::testing::MakeBlocks;
using ::proxima::testing::MetricValue;
using ::proxima::testing::MustConnect;
using ::proxima::testing::TestModel;

// The lies, in turn: each call of a kind gets the next lie of that kind.
class LyingPeer final : public v1::Peer::Service {
 public:
  explicit LyingPeer(std::string self) : self_(std::move(self)) {}

  std::atomic<int> lookups{0}, fetches{0}, stores{0}, rejoins{0}, deletes{0};

  // It holds every block it is asked about, and one more than it was asked about, by turns.
  grpc::Status LookupLocations(grpc::ServerContext*, const v1::LookupLocationsRequest* request,
                               v1::LookupLocationsResponse* response) override {
    const int n = request->blocks().keys_size();
    const int turn = lookups.fetch_add(1) % 3;
    for (int i = 0; i < n + (turn == 2 ? 1 : 0); ++i) {
      // Turn 1: a holder that is no node of the cluster.
      response->add_holders(turn == 1 ? "10.255.255.1:1" : self_);
    }
    return grpc::Status::OK;
  }

  // Every block "found", each turn wrong in another way.
  static constexpr int kFetchLies = 6;
  grpc::Status FetchBlocks(grpc::ServerContext*, const v1::FetchBlocksRequest* request,
                           v1::FetchBlocksResponse* response) override {
    const int n = request->blocks().keys_size();
    const int turn = fetches.fetch_add(1) % kFetchLies;
    if (turn == 0) {  // one block more than asked for
      for (int i = 0; i <= n; ++i) Raw(response->add_blocks(), block_bytes_);
      return grpc::Status::OK;
    }
    for (int i = 0; i < n; ++i) {
      v1::FetchedBlock* b = response->add_blocks();
      switch (turn) {
        case 1:  // one byte short, with the CRC of what is sent
          Raw(b, block_bytes_ - 1);
          break;
        case 2:  // the right size, another CRC
          Raw(b, block_bytes_);
          b->set_crc32c(b->crc32c() ^ 1);
          break;
        case 3:  // a level no daemon has
          Raw(b, block_bytes_);
          b->set_level(99);
          break;
        case 4:  // an encoded level whose bytes are no container, with their right CRC
          Raw(b, 4096);
          b->set_level(1);
          break;
        default:  // "sent as a UCX message", and never sent
          b->set_found(true);
          b->set_size(block_bytes_);
          b->set_crc32c(7);
          response->set_ucx_sent(true);
          break;
      }
    }
    return grpc::Status::OK;
  }

  // Never keeps a block, and says so wrongly: an answer of the wrong length, or one that names
  // blocks declined for a Delete far outside the request, with room to spare.
  grpc::Status StoreBlocks(grpc::ServerContext*, const v1::StoreBlocksRequest* request,
                           v1::StoreBlocksResponse* response) override {
    const int n = request->blocks().keys_size();
    const int turn = stores.fetch_add(1) % 2;
    for (int i = 0; i < n + (turn == 0 ? 3 : 0); ++i) response->add_stored(turn == 0);
    if (turn == 1) {
      for (uint32_t j : {static_cast<uint32_t>(n), 1u << 20, ~0u}) {
        response->add_declined_deleted(j);
      }
    }
    response->set_room_bytes(uint64_t{1} << 40);
    return grpc::Status::OK;
  }

  // Recent Deletes that are all malformed: a namespace no daemon has, keys of 5 bytes, ids
  // that do not match the keys, and a memory said to reach back for ever.
  grpc::Status Rejoin(grpc::ServerContext*, const v1::RejoinRequest* request,
                      v1::RejoinResponse* response) override {
    rejoins.fetch_add(1);
    if (!request->want_recent_deletes()) return grpc::Status::OK;
    auto set = [&](const std::string& ns, const std::string& key, int ids) {
      v1::RecentDeleteSet* s = response->add_recent_deletes();
      s->mutable_blocks()->set_namespace_name(ns);
      s->mutable_blocks()->set_profile_id(profile_id_.load());
      s->mutable_blocks()->add_keys(key);
      for (int i = 0; i < ids; ++i) {
        s->add_delete_ids(1234);
        s->add_age_ms(10);
      }
    };
    set("no-such-namespace", std::string(32, 'k'), 1);
    set("default", "short", 1);
    set("default", std::string(32, 'k'), 3);
    response->set_deletes_known_ms(~uint64_t{0});
    return grpc::Status::OK;
  }

  grpc::Status RecordLocations(grpc::ServerContext*, const v1::RecordLocationsRequest*,
                               v1::RecordLocationsResponse*) override {
    return grpc::Status::OK;
  }
  // Deleted, it says, every key twice over.
  grpc::Status DeleteBlocks(grpc::ServerContext*, const v1::DeleteBlocksRequest* request,
                            v1::DeleteBlocksResponse* response) override {
    deletes.fetch_add(1);
    for (int i = 0; i < 2 * request->blocks().keys_size(); ++i) response->add_deleted(true);
    return grpc::Status::OK;
  }
  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest*, v1::LeaveResponse*) override {
    return grpc::Status::OK;
  }

  void set_block_bytes(uint64_t n) { block_bytes_ = n; }
  void set_profile_id(uint64_t id) { profile_id_ = id; }

 private:
  // A level-0 block of `size` bytes (a pattern no test chain has) with its CRC32C.
  static void Raw(v1::FetchedBlock* b, uint64_t size) {
    b->set_found(true);
    b->set_data(std::string(size, '\x5a'));
    b->set_crc32c(Crc32c(std::as_bytes(std::span<const char>(b->data().data(), size))));
    b->set_level(0);
  }

  const std::string self_;
  std::atomic<uint64_t> block_bytes_{256u << 10};
  std::atomic<uint64_t> profile_id_{0};
};

// Serves `peer` at `address` as a daemon would be seen by its peers: passing health checks.
std::unique_ptr<grpc::Server> ServePeer(v1::Peer::Service* peer, const std::string& address) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(peer);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server != nullptr) {
    server->GetHealthCheckService()->SetServingStatus("proxima.v1.KVTier", true);
  }
  return server;
}

// The value of `series` in `daemon`'s metrics, or -1 (absent, or not scraped).
double Metric(const DaemonProcess& daemon, const std::string& series) {
  absl::StatusOr<std::string> text = daemon.ScrapeMetrics();
  return text.ok() ? MetricValue(*text, series) : -1;
}

// Starts a proximad at ports[0] in a cluster with the fake peer at ports[1] and waits until the
// peer is live: 32 blocks of 256 KiB of host tier, spilling above 90% (28.8 blocks), with the
// UCX data plane (fetches ask for UCX messages, spills send them to a worker a receiver names).
// `dir`: its scratch directory (the peer token), for the caller to remove.
void StartBesidePeer(const std::vector<int>& ports, std::string* dir,
                     std::unique_ptr<DaemonProcess>* daemon) {
  char tmpl[] = "/tmp/proxima-liar-XXXXXX";
  *dir = mkdtemp(tmpl);
  const std::string token_file = *dir + "/peer-token";
  std::ofstream(token_file) << "lying-peer-test-token-0123456789\n";
  std::vector<std::string> sets = ClusterSets(ports, 0, token_file, absl::Milliseconds(1000));
  sets.insert(sets.end(), {"tiers.host.capacity_bytes=8MiB",
                           "cluster.spill={threshold: 0.9, accept_below: 0.75}", "ucx.enabled=true",
                           "cluster.transport=auto"});
  ASSERT_OK_AND_ASSIGN(*daemon, DaemonProcess::Start(sets));
  const absl::Time live_by = absl::Now() + absl::Seconds(15);
  while (Metric(**daemon, "proxima_cluster_live_nodes") != 2 && absl::Now() < live_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(Metric(**daemon, "proxima_cluster_live_nodes"), 2) << (*daemon)->Log();
}

TEST(LyingPeerTest, ADaemonServesAPeersLiesAsMissesAndKeepsEveryBlockItStored) {
  const std::vector<int> ports = FreeLoopbackPorts(2);  // 0: the daemon, 1: the liar
  const std::string liar_id = absl::StrCat("127.0.0.1:", ports[1]);
  LyingPeer liar(liar_id);
  std::unique_ptr<grpc::Server> server = ServePeer(&liar, liar_id);
  ASSERT_NE(server, nullptr);
  // The liar says it sent fetched blocks as UCX messages, and never sends them.
  std::string dir;
  std::unique_ptr<DaemonProcess> daemon;
  ASSERT_NO_FATAL_FAILURE(StartBesidePeer(ports, &dir, &daemon));
  auto metric = [&](const std::string& series) { return Metric(*daemon, series); };

  std::unique_ptr<Client> c = MustConnect(daemon->tcp_target());
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  liar.set_block_bytes(p.block_bytes);
  liar.set_profile_id(p.id);

  // 30 blocks stored here: over the spill threshold, under the capacity. Every spill of some
  // of them is answered with a lie; the daemon keeps them all.
  constexpr size_t kStored = 30;
  Blocks stored = MakeBlocks(1, 0, kStored, p.block_bytes);
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c->Put(p, stored.keys, stored.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  const absl::Time spilled_by = absl::Now() + absl::Seconds(15);
  while (liar.stores.load() < 4 && absl::Now() < spilled_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_GE(liar.stores.load(), 4) << "the daemon did not try to spill to the liar";

  // Blocks never put, whose homes are the liar: every lie of every kind, in turns, served as
  // misses (GetAndCheck fails the test on any wrong byte).
  constexpr size_t kAsked = 32;
  // (Only one lookup answer in three leads to a fetch; Lookups take turns as well.)
  absl::Duration slowest;
  for (int round = 0; round < 100 && liar.fetches.load() < 2 * LyingPeer::kFetchLies; ++round) {
    const absl::Time start = absl::Now();
    EXPECT_EQ(GetAndCheck(*c, p, 2, 0, kAsked), 0u) << "round " << round;
    slowest = std::max(slowest, absl::Now() - start);
    // A chain the liar says it holds counts as found: a Lookup takes its home's word.
    ASSERT_OK(c->Lookup(p, client::TestKeyChain(2, 0, kAsked)).status());
  }
  EXPECT_GE(liar.fetches.load(), 2 * LyingPeer::kFetchLies) << "the lies were not all told";
  // A Get waits for the UCX messages the liar never sent until the peer deadline (1 s), no more.
  EXPECT_LT(slowest, absl::Seconds(3));
  // Each failed block is counted; lines about them are few (at most one per 10 s per kind).
  const double crc_failures = metric("proxima_cluster_fetch_crc_failures_total");
  EXPECT_GT(crc_failures, 20);

  // A Delete of a chain the liar answers for twice over: the daemon's own copies go.
  ASSERT_OK(c->Delete(p, client::TestKeyChain(1, 28, 2)).status());
  EXPECT_GE(liar.deletes.load(), 1);

  // Nothing the daemon stored was lost to the lies, and it still answers.
  EXPECT_EQ(GetAndCheck(*c, p, 1, 0, 28), 28u);
  EXPECT_EQ(GetAndCheck(*c, p, 1, 28, 2), 0u) << "deleted blocks came back";
  EXPECT_EQ(metric("proxima_cluster_live_nodes"), 2);
  EXPECT_GE(liar.rejoins.load(), 1);
  const std::string log = daemon->Log();
  // Each refusal said what was wrong, naming the peer.
  std::vector<std::string> said = {
      "a peer's recent Deletes not taken in peer=" + liar_id, "failed its CRC32C or size check",
      "encoded block failed to decode; served as a miss", "from=\"a peer\"",
      "a peer declined blocks it was not sent; ignored peer=" + liar_id +
          " indices=3 largest=4294967295"};
  for (const char* call : {"LookupLocations", "FetchBlocks", "StoreBlocks", "DeleteBlocks"}) {
    said.push_back(
        absl::StrCat("one entry per key; answer ignored peer=", liar_id, " call=", call));
  }
  for (const std::string& line : said) EXPECT_TRUE(absl::StrContains(log, line)) << line;
  size_t crc_lines = 0;
  for (size_t at = log.find("failed its CRC32C or size check"); at != std::string::npos;
       at = log.find("failed its CRC32C or size check", at + 1)) {
    ++crc_lines;
  }
  EXPECT_LE(crc_lines, 3u) << crc_failures << " failures";
  EXPECT_FALSE(absl::StrContains(log, "Fatal"));

  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->WaitExit(absl::Seconds(30)), 0) << daemon->Log();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  std::filesystem::remove_all(dir);
}

// A spill receiver that takes nothing and names, in every StoreBlocks answer, a UCX worker
// address that lies: one that ends UCX's ucp_ep_create (an assertion) in the process that
// parses it.
class LyingUcxReceiver final : public v1::Peer::Service {
 public:
  explicit LyingUcxReceiver(std::string worker) : worker_(std::move(worker)) {}

  std::atomic<int> stores{0};
  std::atomic<int> stores_over_ucx{0};  // calls naming a UCX transfer: sent to the lie

  grpc::Status StoreBlocks(grpc::ServerContext*, const v1::StoreBlocksRequest* request,
                           v1::StoreBlocksResponse* response) override {
    stores.fetch_add(1);
    if (request->ucx_transfer() != 0) stores_over_ucx.fetch_add(1);
    for (int i = 0; i < request->blocks().keys_size(); ++i) response->add_stored(false);
    response->set_room_bytes(uint64_t{1} << 40);
    response->set_ucx_worker(worker_);
    return grpc::Status::OK;
  }
  grpc::Status RecordLocations(grpc::ServerContext*, const v1::RecordLocationsRequest*,
                               v1::RecordLocationsResponse*) override {
    return grpc::Status::OK;
  }

 private:
  const std::string worker_;
};

// The spill path's side of ucx.check_worker_addresses: a receiver's lying worker address is
// parsed by a child first and refused, the blocks go inline, and the daemon lives and keeps
// them. Without the check (mutation: ucx.check_worker_addresses=false) the spiller's first
// endpoint to the address ended the daemon (the same assertion, select.c:294).
TEST(LyingPeerTest, ASpillReceiverNamingALyingUcxWorkerGetsNothingOverUcxAndTheDaemonLives) {
  // A lie that kills: -1.0f over a real worker address, offset after offset, each parsed by
  // proximad's own check child until one dies.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ucx::Worker> worker, ucx::Worker::Create("lie-source"));
  std::string lie;
  {
    ucx::AddressCheck check({::proxima::testing::ProximadPath(), ucx::kAddressCheckFlag});
    const std::string good = worker->address();
    for (size_t at = 1; at + sizeof(float) <= good.size() && lie.empty(); ++at) {
      std::string candidate = good;
      const float minus_one = -1.0f;
      std::memcpy(candidate.data() + at, &minus_one, sizeof(minus_one));
      if (absl::IsInvalidArgument(check.Check(candidate, absl::Now() + absl::Seconds(20)))) {
        lie = candidate;
      }
    }
  }
  ASSERT_FALSE(lie.empty()) << "no lie ended the checking process: this test tests nothing";

  const std::vector<int> ports = FreeLoopbackPorts(2);  // 0: the daemon, 1: the receiver
  LyingUcxReceiver receiver(lie);
  std::unique_ptr<grpc::Server> server = ServePeer(&receiver, absl::StrCat("127.0.0.1:", ports[1]));
  ASSERT_NE(server, nullptr);
  std::string dir;
  std::unique_ptr<DaemonProcess> daemon;
  ASSERT_NO_FATAL_FAILURE(StartBesidePeer(ports, &dir, &daemon));
  auto metric = [&](const std::string& series) { return Metric(*daemon, series); };
  auto alive = [&] {
    int wait_status = 0;
    return waitpid(daemon->pid(), &wait_status, WNOHANG) == 0;
  };
  std::unique_ptr<Client> c = MustConnect(daemon->tcp_target());
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(Profile p, c->RegisterProfile(TestModel()));
  // 30 blocks of 256 KiB: over the spill threshold (90% of 32), so the daemon spills to the
  // receiver round after round; it names the lie from its first answer on.
  Blocks stored = MakeBlocks(5, 0, 30, p.block_bytes);
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, c->Put(p, stored.keys, stored.spans()));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  const absl::Time spilled_by = absl::Now() + absl::Seconds(15);
  while ((receiver.stores.load() < 4 || metric("proxima_ucx_addresses_refused_total") < 1) &&
         absl::Now() < spilled_by && alive()) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(alive()) << "proximad ended on the receiver's address: " << daemon->Log();
  EXPECT_GE(receiver.stores.load(), 4) << "the daemon did not spill again after the answer";
  EXPECT_EQ(metric("proxima_ucx_addresses_refused_total"), 1) << daemon->Log();
  EXPECT_EQ(receiver.stores_over_ucx.load(), 0) << "a spill named a transfer to the lie";
  EXPECT_EQ(metric("proxima_cluster_ucx_endpoints"), 0);
  // Everything the daemon stored is still here, byte-exact.
  EXPECT_EQ(GetAndCheck(*c, p, 5, 0, 30), 30u);
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->WaitExit(absl::Seconds(30)), 0) << daemon->Log();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace proxima
