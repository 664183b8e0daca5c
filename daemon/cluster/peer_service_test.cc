// PeerService::ServeStore against blocks a buggy or other-version peer spills here: what it
// keeps, what it refuses, and that a refused request stores nothing. (The whole peer protocol
// between real daemons: tests/integration/cluster_test.cc; hostile peer calls of every method:
// the `peer` fuzz target, tests/fuzz/peer_fuzz_body.h.)
#include "daemon/cluster/peer_service.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "common/testing/tiny_profile.h"
#include "daemon/cluster/counting_remote.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace proxima::daemon::cluster {
namespace {

using ::testing::HasSubstr;

v1::ModelProfile Profile() { return proxima::testing::TinyProfile("peer-test"); }

v1::SpilledBlock Spilled(const std::string& data, uint32_t level) {
  v1::SpilledBlock b;
  b.set_data(data);
  b.set_level(level);
  b.set_crc32c(Crc32c(std::as_bytes(std::span<const char>(data.data(), data.size()))));
  return b;
}

class PeerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }

  // The service of a node whose namespace "open" has the compression hierarchy `levels`.
  void Start(const std::vector<std::string>& levels) {
    DaemonConfig config;
    config.host_tier.capacity_bytes = 1 << 20;
    config.namespaces = {{"open"}};
    CompressionConfig& c = config.namespaces[0].compression;
    c.enabled = !levels.empty();
    c.levels = levels;
    for (const std::string& text : levels) {
      ASSERT_OK_AND_ASSIGN(codec::CodecPlan plan, codec::ParseCodecPlan(text));
      c.plans.push_back(plan);
    }
    ASSERT_OK_AND_ASSIGN(core_, TierService::Create(config, &registry_));
    v1::RegisterProfileRequest reg;
    reg.set_namespace_name("open");
    *reg.mutable_profile() = Profile();
    v1::RegisterProfileResponse resp;
    ASSERT_OK(core_->RegisterProfile(Caller::Anonymous(), reg, &resp));
    profile_id_ = resp.profile_id();
    service_ = std::make_unique<PeerService>(core_.get(), &records_, &remote_, nullptr, "self:1",
                                             &tokens_, config.server.max_message_bytes,
                                             PeerService::Acceptance{0.75, true}, &registry_);
    raw_.resize(512);
    for (size_t i = 0; i < raw_.size(); ++i) raw_[i] = static_cast<char>((i * 13) % 97);
  }

  v1::StoreBlocksRequest Request(std::initializer_list<char> keys, uint64_t block_bytes,
                                 uint64_t profile_id = 0) {
    v1::StoreBlocksRequest r;
    r.mutable_blocks()->set_namespace_name("open");
    r.mutable_blocks()->set_profile_id(profile_id != 0 ? profile_id : profile_id_);
    for (char k : keys) r.mutable_blocks()->add_keys(std::string(kKeyBytes, k));
    r.set_block_bytes(block_bytes);
    return r;
  }

  std::string Int8Block() { return Encoded("int8"); }
  // raw_ encoded with the codec plan `plan`.
  std::string Encoded(const std::string& plan) {
    std::string encoded;
    const codec::BlockGeometry g{2, 2, 8, 4, codec::DType::kBf16};
    EXPECT_OK(codec::EncodeBlock(g, *codec::ParseCodecPlan(plan), false,
                                 std::as_bytes(std::span<const char>(raw_.data(), raw_.size())), {},
                                 &encoded));
    return encoded;
  }

  // Another service over the same store and records, with its own metrics, recent-delete
  // window and slack (the fixture's has 5 s of each).
  std::unique_ptr<PeerService> OtherService(metrics::Registry* registry, absl::Duration window,
                                            absl::Duration slack = absl::Seconds(5)) {
    return std::make_unique<PeerService>(core_.get(), &records_, &remote_, nullptr, "self:2",
                                         &tokens_, 1 << 20, PeerService::Acceptance{0.75, true},
                                         registry, window, slack);
  }

  std::optional<BlockStore::ReadBlock> Read(char key, uint64_t profile_id = 0) {
    BlockId id{0, profile_id != 0 ? profile_id : profile_id_, {}, 0};
    std::memset(id.key.data(), key, kKeyBytes);
    return core_->store().Read(id);
  }

  metrics::Registry registry_;
  PeerTokens tokens_{{"peer-service-test-token-0123456789"}};
  std::unique_ptr<TierService> core_;
  uint64_t profile_id_ = 0;
  LocationTable records_{64};
  CountingRemote remote_;
  std::unique_ptr<PeerService> service_;
  std::string raw_;
};

TEST_F(PeerServiceTest, KeepsRawAndEncodedBlocksAndTellsTheirHomes) {
  v1::StoreBlocksRequest r = Request({'a', 'e'}, 512);
  *r.add_data() = Spilled(raw_, 0);
  *r.add_data() = Spilled(Int8Block(), 1);
  v1::StoreBlocksResponse resp;
  ASSERT_OK(service_->ServeStore(r, &resp));
  EXPECT_THAT(resp.stored(), ::testing::ElementsAre(true, true));
  std::optional<BlockStore::ReadBlock> a = Read('a'), e = Read('e');
  ASSERT_TRUE(a && e);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(a->bytes.data()), a->bytes.size()), raw_);
  EXPECT_EQ(a->level, 0);
  EXPECT_EQ(e->level, 1);
  EXPECT_EQ(remote_.stored, 2u);
}

TEST_F(PeerServiceTest, ABlockHeldHereAlreadyIsAnsweredHeldAndItsHomeToldOfThisHolder) {
  // The sender drops its copy when told "stored", and its home may record the sender, not this
  // node: the home must learn of this holder, or the block is found from nowhere but here.
  v1::StoreBlocksRequest r = Request({'a'}, 512);
  *r.add_data() = Spilled(raw_, 0);
  v1::StoreBlocksResponse first;
  ASSERT_OK(service_->ServeStore(r, &first));
  EXPECT_THAT(first.stored(), ::testing::ElementsAre(true));
  EXPECT_EQ(remote_.stored, 1u);
  for (const bool handoff : {false, true}) {
    SCOPED_TRACE(handoff ? "hand-off" : "spill");
    r.set_handoff(handoff);
    v1::StoreBlocksResponse again;
    ASSERT_OK(service_->ServeStore(r, &again));
    EXPECT_THAT(again.stored(), ::testing::ElementsAre(true));
    EXPECT_EQ(remote_.stored, handoff ? 3u : 2u);
  }
  EXPECT_EQ(core_->store().blocks(), 1u);
  EXPECT_THAT(registry_.RenderText(),
              HasSubstr("proxima_cluster_spill_received_blocks_total{outcome=\"kept\"} 1\n"));
}

TEST_F(PeerServiceTest, ABlockSizeOtherThanTheRegisteredProfilesIsRefusedAndNothingStored) {
  v1::StoreBlocksRequest r = Request({'a', 'b'}, 1024);
  *r.add_data() = Spilled(raw_ + raw_, 0);
  *r.add_data() = Spilled(std::string(1024, 'b'), 0);
  v1::StoreBlocksResponse resp;
  const absl::Status s = service_->ServeStore(r, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("block_bytes is 1024"));
  EXPECT_THAT(s.message(), HasSubstr("registered here with 512-byte blocks"));
  EXPECT_EQ(core_->store().blocks(), 0u);
  EXPECT_EQ(remote_.stored, 0u);
}

TEST_F(PeerServiceTest, AnEncodedBlockThatIsNotAContainerIsRefusedWithTheWholeRequest) {
  v1::StoreBlocksRequest r = Request({'a', 'd'}, 512);
  *r.add_data() = Spilled(raw_, 0);                   // fine
  *r.add_data() = Spilled(std::string(300, 'd'), 2);  // CRC right, not a STAR-KV block
  v1::StoreBlocksResponse resp;
  const absl::Status s = service_->ServeStore(r, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("data[1] is at level 2 but is not a valid STAR-KV block"));
  EXPECT_FALSE(Read('a'));
  EXPECT_EQ(core_->store().blocks(), 0u);
}

TEST_F(PeerServiceTest, AContainerOfAnotherBlockSizeIsRefused) {
  // A profile not registered here: its stated size is all there is to check against.
  const uint64_t unknown = profile_id_ ^ 1;
  v1::StoreBlocksRequest r = Request({'e'}, 1024, unknown);
  *r.add_data() = Spilled(Int8Block(), 1);  // a 512-byte block's container
  v1::StoreBlocksResponse resp;
  const absl::Status s = service_->ServeStore(r, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("decodes to 512 bytes; expected block_bytes = 1024"));
  EXPECT_FALSE(Read('e', unknown));

  // The same container under its own size is kept, also for a profile not registered here.
  r.set_block_bytes(512);
  ASSERT_OK(service_->ServeStore(r, &resp));
  EXPECT_TRUE(Read('e', unknown));
}

// A spill of a key deleted here a moment ago (the Delete reached this node before the spilled
// copy did) is declined, not kept, and not counted as a lack of room: the sender keeps the
// block, where the same Delete removes it. A Delete sent by a peer counts as much as one of this
// node's workers. A copy whose sender names that very Delete as the last it saw was put again
// after it, and is kept. Once the window is over, the key is taken again.
TEST_F(PeerServiceTest, ASpillOfAKeyDeletedHereJustBeforeIsDeclinedUnlessPutAgainAfterIt) {
  auto delete_here = [&](char key, uint64_t delete_id) {
    v1::DeleteBlocksRequest del;
    del.mutable_blocks()->set_namespace_name("open");
    del.mutable_blocks()->set_profile_id(profile_id_);
    del.mutable_blocks()->add_keys(std::string(kKeyBytes, key));  // not here (yet)
    del.set_delete_id(delete_id);
    v1::DeleteBlocksResponse deleted;
    ASSERT_OK(service_->ServeDelete(del, &deleted));
    EXPECT_THAT(deleted.deleted(), ::testing::ElementsAre(false));
  };
  delete_here('a', 41);
  delete_here('d', 0);  // a withdrawal names no Delete
  BlockId b{0, profile_id_, {}, 0};
  std::memset(b.key.data(), 'b', kKeyBytes);
  const std::vector<BlockId> by_worker = {b};
  service_->NoteDeleted(by_worker, 42);

  v1::StoreBlocksRequest r = Request({'a', 'b', 'c', 'd'}, 512);
  for (int i = 0; i < 4; ++i) *r.add_data() = Spilled(raw_, 0);
  v1::StoreBlocksResponse resp;
  ASSERT_OK(service_->ServeStore(r, &resp));
  EXPECT_THAT(resp.stored(), ::testing::ElementsAre(false, false, true, false));
  // The sender learns which ones were deleted here (it drops them), not refused for room.
  EXPECT_THAT(resp.declined_deleted(), ::testing::ElementsAre(0u, 1u, 3u));
  EXPECT_FALSE(resp.full());
  EXPECT_FALSE(Read('a'));
  EXPECT_FALSE(Read('b'));
  EXPECT_TRUE(Read('c'));
  EXPECT_FALSE(Read('d'));
  const std::string text = registry_.RenderText();
  EXPECT_THAT(
      text,
      HasSubstr("proxima_cluster_spill_received_blocks_total{outcome=\"deleted_recently\"} 3"));
  EXPECT_THAT(text,
              HasSubstr("proxima_cluster_spill_received_blocks_total{outcome=\"no_room\"} 0"));

  // Senders that saw a Delete: 'a' after the one this node saw (kept), 'b' after another one
  // (declined: this node's Delete of it may be newer than the copy).
  v1::StoreBlocksRequest after = Request({'a', 'b'}, 512);
  *after.add_data() = Spilled(raw_, 0);
  after.mutable_data(0)->set_after_delete(41);
  *after.add_data() = Spilled(raw_, 0);
  after.mutable_data(1)->set_after_delete(41);
  v1::StoreBlocksResponse put_again;
  ASSERT_OK(service_->ServeStore(after, &put_again));
  EXPECT_THAT(put_again.stored(), ::testing::ElementsAre(true, false));
  EXPECT_THAT(put_again.declined_deleted(), ::testing::ElementsAre(1u));
  EXPECT_TRUE(Read('a'));
  EXPECT_FALSE(Read('b'));

  // The window (a short one here) over, the same spill is kept.
  metrics::Registry other;
  std::unique_ptr<PeerService> later_service = OtherService(&other, absl::Milliseconds(1));
  PeerService& later = *later_service;
  later.NoteDeleted(by_worker, 43);
  absl::SleepFor(absl::Milliseconds(5));
  v1::StoreBlocksRequest again = Request({'b'}, 512);
  *again.add_data() = Spilled(raw_, 0);
  v1::StoreBlocksResponse kept;
  ASSERT_OK(later.ServeStore(again, &kept));
  EXPECT_THAT(kept.stored(), ::testing::ElementsAre(true));
  EXPECT_THAT(kept.declined_deleted(), ::testing::IsEmpty());
  EXPECT_TRUE(Read('b'));

  // Within the window, a sender that started after the Delete (its memory of Deletes reaches
  // back 1 ms, the Delete was 20 ms ago, the slack is 1 ms) had nothing to miss: kept. A sender
  // that does not say how far back it knows is declined.
  metrics::Registry third;
  std::unique_ptr<PeerService> recent_service =
      OtherService(&third, absl::Seconds(60), absl::Milliseconds(1));
  PeerService& recent = *recent_service;
  BlockId e{0, profile_id_, {}, 0};
  std::memset(e.key.data(), 'e', kKeyBytes);
  const std::vector<BlockId> deleted_e = {e};
  recent.NoteDeleted(deleted_e, 44);
  absl::SleepFor(absl::Milliseconds(20));
  v1::StoreBlocksRequest unsaid = Request({'e'}, 512);
  *unsaid.add_data() = Spilled(raw_, 0);
  v1::StoreBlocksResponse declined_e;
  ASSERT_OK(recent.ServeStore(unsaid, &declined_e));
  EXPECT_THAT(declined_e.stored(), ::testing::ElementsAre(false));
  v1::StoreBlocksRequest young = unsaid;
  young.set_deletes_known_ms(1);
  v1::StoreBlocksResponse kept_e;
  ASSERT_OK(recent.ServeStore(young, &kept_e));
  EXPECT_THAT(kept_e.stored(), ::testing::ElementsAre(true));
  EXPECT_TRUE(Read('e'));
}

// A node that has just started asks its peers for the Deletes they remember (Rejoin): the
// answer carries each key's last Delete by namespace, and the asking node takes them in, so its
// blocks put again after them name them. Malformed sets, or sets of a namespace it does not
// serve, are skipped.
TEST_F(PeerServiceTest, ARejoiningNodeLearnsTheDeletesItsPeerRemembers) {
  BlockId a{0, profile_id_, {}, 0};
  std::memset(a.key.data(), 'a', kKeyBytes);
  BlockId b = a;
  std::memset(b.key.data(), 'b', kKeyBytes);
  const std::vector<BlockId> ab = {a, b};
  service_->NoteDeleted(ab, 51);

  v1::RejoinRequest plain;
  plain.set_node("peer:2");
  v1::RejoinResponse none;
  ASSERT_OK(service_->ServeRejoin(plain, &none));
  EXPECT_EQ(none.recent_deletes_size(), 0);
  v1::RejoinRequest want = plain;
  want.set_want_recent_deletes(true);
  v1::RejoinResponse answer;
  ASSERT_OK(service_->ServeRejoin(want, &answer));
  ASSERT_EQ(answer.recent_deletes_size(), 1);
  EXPECT_EQ(answer.recent_deletes(0).blocks().namespace_name(), "open");
  EXPECT_EQ(answer.recent_deletes(0).blocks().profile_id(), profile_id_);
  EXPECT_EQ(answer.recent_deletes(0).blocks().keys_size(), 2);
  EXPECT_THAT(answer.recent_deletes(0).delete_ids(), ::testing::ElementsAre(51u, 51u));

  // A node started just now (its own memory reaches back a few ms; the window is 60 s).
  metrics::Registry other;
  std::unique_ptr<PeerService> young_service = OtherService(&other, absl::Seconds(60));
  PeerService& young = *young_service;
  EXPECT_TRUE(young.WantsRecentDeletes());
  EXPECT_EQ(young.LastDelete(a), 0u);
  v1::RejoinResponse bad = answer;
  bad.mutable_recent_deletes(0)->add_delete_ids(52);  // one more id than keys
  v1::RecentDeleteSet* elsewhere = bad.add_recent_deletes();
  *elsewhere = answer.recent_deletes(0);
  elsewhere->mutable_blocks()->set_namespace_name("not-served-here");
  EXPECT_EQ(young.LearnDeletes("peer:1", bad), 0u);
  EXPECT_EQ(young.LastDelete(a), 0u);
  answer.set_deletes_known_ms(60'000);  // as from a peer up for a minute or more
  EXPECT_EQ(young.LearnDeletes("peer:1", answer), 2u);
  EXPECT_EQ(young.LastDelete(a), 51u);
  EXPECT_EQ(young.LastDelete(b), 51u);
  EXPECT_FALSE(young.WantsRecentDeletes());  // the peer's memory reached back far enough
  EXPECT_THAT(other.RenderText(), HasSubstr("proxima_cluster_recent_deletes_learned_total 2"));
}

// A Delete sent again says how long ago it was made (DeleteBlocksRequest.age_ms): arriving after
// a later Delete of the same key, it does not become the key's last, which spills name.
TEST_F(PeerServiceTest, ADeleteSentAgainIsNotedAsOfWhenItWasMade) {
  BlockId f{0, profile_id_, {}, 0};
  std::memset(f.key.data(), 'f', kKeyBytes);
  v1::DeleteBlocksRequest later;
  later.mutable_blocks()->set_namespace_name("open");
  later.mutable_blocks()->set_profile_id(profile_id_);
  later.mutable_blocks()->add_keys(std::string(kKeyBytes, 'f'));
  later.set_delete_id(72);
  later.set_age_ms(500);
  v1::DeleteBlocksRequest earlier = later;
  earlier.set_delete_id(71);
  earlier.set_age_ms(2'000);
  v1::DeleteBlocksResponse out;
  ASSERT_OK(service_->ServeDelete(later, &out));
  ASSERT_OK(service_->ServeDelete(earlier, &out));
  EXPECT_EQ(service_->LastDelete(f), 72u);
}

// A full node (its own blocks up to its capacity) keeps no spilled block, but keeps the blocks a
// peer hands off as it shuts down, evicting its own least recently used blocks for them, and
// keeps them as recently used: the next local puts evict its older blocks, not these. With
// handoff_evicts off, a hand-off is kept only below accept_below, as a spill.
// A namespace's max_bytes holds for its peers' blocks too: a spill or a hand-off past it keeps
// what fits under it and evicts none of the namespace's own blocks to make more room.
TEST(PeerServiceLimitTest, PeerBlocksStayWithinTheNamespacesMaxBytesAndEvictNone) {
  DaemonConfig config;
  config.host_tier.capacity_bytes = 1 << 20;
  config.namespaces = {{"open"}};
  config.namespaces[0].max_bytes = 3 * 512;
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TierService> core, TierService::Create(config, &registry));
  v1::RegisterProfileRequest reg;
  reg.set_namespace_name("open");
  *reg.mutable_profile() = Profile();
  v1::RegisterProfileResponse registered;
  ASSERT_OK(core->RegisterProfile(Caller::Anonymous(), reg, &registered));
  LocationTable records{64};
  CountingRemote remote;
  const PeerTokens tokens({"peer-service-test-token-0123456789"});
  PeerService service(core.get(), &records, &remote, nullptr, "self:1", &tokens, 1 << 20,
                      PeerService::Acceptance{0.75, true}, &registry);
  const std::string raw(512, 'r');
  BlockId local{0, registered.profile_id(), {}, 0};
  std::memset(local.key.data(), 'L', kKeyBytes);
  const auto bytes = std::as_bytes(std::span<const char>(raw.data(), raw.size()));
  ASSERT_EQ(core->store().Put(local, bytes, Crc32c(bytes)), PutOutcome::kStored);

  for (bool handoff : {false, true}) {
    SCOPED_TRACE(handoff ? "hand-off" : "spill");
    v1::StoreBlocksRequest r;
    r.mutable_blocks()->set_namespace_name("open");
    r.mutable_blocks()->set_profile_id(registered.profile_id());
    r.set_block_bytes(512);
    r.set_handoff(handoff);
    for (char k : handoff ? std::string("efgh") : std::string("abcd")) {
      r.mutable_blocks()->add_keys(std::string(kKeyBytes, k));
      *r.add_data() = Spilled(raw, 0);
    }
    v1::StoreBlocksResponse resp;
    ASSERT_OK(service.ServeStore(r, &resp));
    if (handoff) {
      EXPECT_THAT(resp.stored(), ::testing::Each(false)) << "the namespace is at its limit";
    } else {
      EXPECT_THAT(resp.stored(), ::testing::ElementsAre(true, true, false, false));
    }
    EXPECT_TRUE(resp.full());
    EXPECT_TRUE(core->store().Contains(local));
    EXPECT_EQ(core->store().evictions(), 0u);
    EXPECT_EQ(core->store().namespace_bytes(0), 3 * 512u);
  }
}

TEST_F(PeerServiceTest, AFullNodeMakesRoomForAHandOffButNotForASpill) {
  BlockStore& store = core_->store();
  auto local = [&](uint32_t i) {
    BlockId id{0, profile_id_, {}, 0};
    std::memset(id.key.data(), 0xee, kKeyBytes);
    std::memcpy(id.key.data(), &i, sizeof(i));
    return id;
  };
  const auto bytes = std::as_bytes(std::span<const char>(raw_.data(), raw_.size()));
  uint32_t puts = 0;
  auto put_local = [&](uint32_t n) {
    for (uint32_t end = puts + n; puts < end; ++puts) store.Put(local(puts), bytes, Crc32c(bytes));
  };
  put_local(static_cast<uint32_t>(store.capacity_bytes() / raw_.size()) + 64);
  ASSERT_GT(store.evictions(), 0u);  // the premise: full
  const uint64_t evicted_before = store.evictions();

  v1::StoreBlocksRequest spill = Request({'a', 'b', 'c', 'd'}, 512);
  for (int i = 0; i < 4; ++i) *spill.add_data() = Spilled(raw_, 0);
  v1::StoreBlocksResponse refused;
  ASSERT_OK(service_->ServeStore(spill, &refused));
  EXPECT_THAT(refused.stored(), ::testing::Each(false));
  EXPECT_TRUE(refused.full());
  EXPECT_EQ(store.evictions(), evicted_before);

  metrics::Registry other;
  PeerService no_evict(core_.get(), &records_, &remote_, nullptr, "self:1", &tokens_, 1 << 20,
                       PeerService::Acceptance{0.75, false}, &other);
  v1::StoreBlocksRequest handoff = spill;
  handoff.set_handoff(true);
  ASSERT_OK(no_evict.ServeStore(handoff, &refused));
  EXPECT_THAT(refused.stored(), ::testing::Each(false));
  EXPECT_EQ(store.evictions(), evicted_before);

  // The hand-off also names, first, the block this node would evict first: it counts as held,
  // and the evictions for the other four do not take it.
  uint32_t oldest = 0;
  while (!store.Contains(local(oldest))) ++oldest;
  const BlockId held = local(oldest);
  v1::StoreBlocksRequest with_held = Request({}, 512);
  with_held.set_handoff(true);
  with_held.mutable_blocks()->add_keys(reinterpret_cast<const char*>(held.key.data()), kKeyBytes);
  *with_held.add_data() = Spilled(raw_, 0);
  for (int i = 0; i < 4; ++i) {
    with_held.mutable_blocks()->add_keys(handoff.blocks().keys(i));
    *with_held.add_data() = handoff.data(i);
  }
  handoff = with_held;
  v1::StoreBlocksResponse kept;
  ASSERT_OK(service_->ServeStore(handoff, &kept));
  EXPECT_THAT(kept.stored(), ::testing::Each(true));
  EXPECT_TRUE(store.Contains(held));
  EXPECT_FALSE(kept.full());
  EXPECT_GT(kept.room_bytes(), 0u);
  EXPECT_GE(store.evictions(), evicted_before + 4);
  EXPECT_TRUE(store.Contains(local(puts - 1)));  // this node's newest blocks stay
  // Eight more local puts evict this node's oldest blocks, not the four handed off.
  put_local(8);
  for (char k : {'a', 'b', 'c', 'd'}) {
    std::optional<BlockStore::ReadBlock> b = Read(k);
    ASSERT_TRUE(b) << k;
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size()), raw_);
  }
}

// Levels are numbered per config, and a peer may run another hierarchy than this node (a rolling
// config change): a spilled or handed-off block keeps its encoding at the level of this node's
// hierarchy with the same codec plan, and is stored decoded (raw, for this node's tierer to
// encode) where this hierarchy has none. How deep this node's tierer may take it follows from the
// put's hints under this node's config. A sender that names neither (an older version) has its
// block kept at its level number, never encoded further, as before.
class PeerServiceHierarchyTest : public PeerServiceTest {
 protected:
  void SetUp() override { Start({"int4", "int2"}); }

  static std::string PlanText(const std::string& plan) {
    return codec::ParseCodecPlan(plan)->ToString();
  }
  // key byte -> max_level of every block stored here.
  std::map<char, int> MaxLevels() {
    std::map<char, int> out;
    std::vector<BlockStore::Candidate> taken;
    while (std::optional<BlockStore::Candidate> c = core_->store().HottestForHandoff()) {
      out[static_cast<char>(c->id.key[0])] = c->attributes.max_level;
      taken.push_back(*c);
    }
    for (const BlockStore::Candidate& c : taken) core_->store().Release(c);
    return out;
  }
};

TEST_F(PeerServiceHierarchyTest, ABlockTakesTheLevelOfItsPlanHereOrComesRawWhereThereIsNone) {
  const std::string int4 = Encoded("int4"), int8 = Encoded("int8");
  std::string decoded(512, '\0');
  ASSERT_OK(codec::DecodeBlock(AsBytes(int8), AsWritableBytes(decoded)));
  ASSERT_NE(decoded, raw_);  // lossy: the test tells a decoded block from the raw one
  for (const bool handoff : {false, true}) {
    SCOPED_TRACE(handoff ? "hand-off" : "spill");
    const char k = handoff ? 'e' : 'a';  // keys k .. k + 3
    v1::StoreBlocksRequest r = Request({k, char(k + 1), char(k + 2), char(k + 3)}, 512);
    r.set_handoff(handoff);
    // The sender's level 2 is int4: level 1 here, the same bytes. High priority, so at most
    // level 1 here (priority.high_max_level).
    *r.add_data() = Spilled(int4, 2);
    r.mutable_data(0)->set_plan(PlanText("int4"));
    r.mutable_data(0)->set_high_priority(true);
    r.mutable_data(0)->set_position(5);
    // int8 is no level here: stored decoded, and may go as deep as this hierarchy does.
    *r.add_data() = Spilled(int8, 1);
    r.mutable_data(1)->set_plan(PlanText("int8"));
    r.mutable_data(1)->set_high_priority(false);
    r.mutable_data(1)->set_position(0);
    // An older sender: level 1 as it says, never encoded further here.
    *r.add_data() = Spilled(int4, 1);
    // A raw block with its hints.
    *r.add_data() = Spilled(raw_, 0);
    r.mutable_data(3)->set_high_priority(false);
    r.mutable_data(3)->set_position(7);
    r.mutable_data(3)->set_second_chance(true);
    v1::StoreBlocksResponse resp;
    ASSERT_OK(service_->ServeStore(r, &resp));
    EXPECT_THAT(resp.stored(), ::testing::ElementsAre(true, true, true, true));

    // Checked reads: each one's CRC32C is that of the bytes stored.
    std::optional<BlockStore::ReadBlock> a = Read(k), b = Read(char(k + 1)), c = Read(char(k + 2)),
                                         d = Read(char(k + 3));
    ASSERT_TRUE(a && b && c && d);
    auto text = [](const BlockStore::ReadBlock& x) {
      return std::string(reinterpret_cast<const char*>(x.bytes.data()), x.bytes.size());
    };
    EXPECT_EQ(a->level, 1);
    EXPECT_EQ(text(*a), int4);
    EXPECT_EQ(b->level, 0);
    EXPECT_EQ(text(*b), decoded);
    EXPECT_EQ(c->level, 1);
    EXPECT_EQ(text(*c), int4);
    EXPECT_EQ(d->level, 0);
    EXPECT_EQ(text(*d), raw_);
  }
  const std::map<char, int> max_levels = MaxLevels();
  for (const char k : {'a', 'e'}) {
    EXPECT_EQ(max_levels.at(k), 1) << k;      // high priority
    EXPECT_EQ(max_levels.at(k + 1), 2) << k;  // the whole hierarchy
    EXPECT_EQ(max_levels.at(k + 2), 0) << k;  // no hints: stays as it came
    EXPECT_EQ(max_levels.at(k + 3), 2) << k;
  }
}

// Partition numbers follow the order of each node's token list; a rolling change that adds,
// removes or reorders tokens gives one scope two numbers on two nodes, and blocks named by number
// would land in (and be read from) another tenant's partition. A set names its scope: resolved
// here by name, and a scope this node lacks is NOT_FOUND. A set without one (an older sender)
// goes by its number, which must be one of the namespace's.
TEST(PeerServiceScopeTest, ABlockSetIsResolvedByItsScopeNotItsNumber) {
  setenv("PXT_PEER_ALICE", "peer-scope-test-alice-token-0123456789", 1);
  setenv("PXT_PEER_BOB", "peer-scope-test-bob-token-0123456789ab", 1);
  DaemonConfig config;
  config.host_tier.capacity_bytes = 1 << 20;
  TokenConfig alice{"alice", "", "PXT_PEER_ALICE", TokenAccess::kReadWrite, ""};
  TokenConfig bob{"bob", "", "PXT_PEER_BOB", TokenAccess::kReadWrite, ""};
  config.namespaces = {{"p", {alice, bob}, /*private_prefixes=*/true}};
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TierService> core, TierService::Create(config, &registry));
  ASSERT_EQ(core->ScopePartition(0, "alice"), 1u);
  ASSERT_EQ(core->ScopePartition(0, "bob"), 2u);

  v1::PeerBlockSet set;
  set.set_namespace_name("p");
  set.add_keys(std::string(kKeyBytes, 'k'));
  set.set_partition(1);  // bob on a node whose tokens are [bob, alice]
  set.set_scope("bob");
  ASSERT_OK_AND_ASSIGN(std::vector<BlockId> ids, ResolveBlockSet(*core, set, 16));
  EXPECT_EQ(ids[0].partition, 2u);
  set.set_scope("");  // the namespace's shared blocks
  ASSERT_OK_AND_ASSIGN(ids, ResolveBlockSet(*core, set, 16));
  EXPECT_EQ(ids[0].partition, 0u);
  set.set_scope("carol");
  EXPECT_THAT(ResolveBlockSet(*core, set, 16).status(),
              proxima::testing::StatusIs(absl::StatusCode::kNotFound,
                                         HasSubstr("token scope 'carol' of namespace 'p'")));
  set.clear_scope();  // an older sender: its number
  ASSERT_OK_AND_ASSIGN(ids, ResolveBlockSet(*core, set, 16));
  EXPECT_EQ(ids[0].partition, 1u);
  set.set_partition(3);
  EXPECT_THAT(ResolveBlockSet(*core, set, 16).status(),
              proxima::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("partition 3 of namespace 'p'")));

  // And a set this node names carries both.
  v1::PeerBlockSet named;
  NamePartition(*core, 0, 2, &named);
  EXPECT_EQ(named.partition(), 2u);
  EXPECT_TRUE(named.has_scope());
  EXPECT_EQ(named.scope(), "bob");
}

}  // namespace
}  // namespace proxima::daemon::cluster
