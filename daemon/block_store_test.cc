#include "daemon/block_store.h"

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

BlockId Id(uint32_t n, uint32_t ns = 0, uint64_t profile = 7) {
  BlockId id{ns, profile, {}};
  std::memcpy(id.key.data(), &n, sizeof(n));
  return id;
}

std::string Payload(uint32_t n, size_t size) {
  std::string s(size, '\0');
  std::mt19937 rng(n);
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::span<const std::byte> B(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// Reads a block into `out`; nullopt-like false when absent or corrupt.
bool ReadInto(BlockStore& store, const BlockId& id, std::string* out) {
  std::optional<BlockStore::ReadBlock> r = store.Read(id);
  if (!r) return false;
  out->assign(reinterpret_cast<const char*>(r->bytes.data()), r->bytes.size());
  return true;
}

class BlockStoreTest : public ::testing::Test {
 protected:
  std::unique_ptr<BlockStore> MakeStore(uint64_t capacity, uint32_t shards = 8,
                                        double protected_share = 0) {
    auto tier = HostTier::Create(capacity);
    EXPECT_OK(tier.status());
    return std::make_unique<BlockStore>(*std::move(tier), shards, std::span(counters_),
                                        protected_share);
  }
  PutOutcome Put(BlockStore& s, const BlockId& id, const std::string& data) {
    return s.Put(id, B(data), Crc32c(B(data)));
  }
  // Stores `data` as a block a peer spilled here (from_peer), at `level`, as the peer service
  // does; kNoSpace when there is no room for it.
  PutOutcome CommitFromPeer(BlockStore& s, const BlockId& id, const std::string& data,
                            uint8_t level) {
    std::optional<BlockStore::PendingBlock> p = s.TryReserve(data.size());
    if (!p) return PutOutcome::kNoSpace;
    std::memcpy(p->bytes().data(), data.data(), data.size());
    BlockAttributes from_peer;
    from_peer.from_peer = true;
    return s.Commit(id, *std::move(p), Crc32c(B(data)), from_peer, level);
  }
  NamespaceCounters counters_[2];
};

TEST_F(BlockStoreTest, RoundTripIsByteExactAndNamespacesAreSeparate) {
  auto store = MakeStore(1 << 20);
  std::string a = Payload(1, 5000), b = Payload(2, 5000);
  EXPECT_EQ(Put(*store, Id(1, 0), a), PutOutcome::kStored);
  EXPECT_EQ(Put(*store, Id(1, 1), b), PutOutcome::kStored);  // same key, other namespace
  EXPECT_EQ(Put(*store, Id(1, 0), b), PutOutcome::kAlreadyPresent);
  std::string out;
  ASSERT_TRUE(ReadInto(*store, Id(1, 0), &out));
  EXPECT_EQ(out, a);
  ASSERT_TRUE(ReadInto(*store, Id(1, 1), &out));
  EXPECT_EQ(out, b);
  EXPECT_FALSE(ReadInto(*store, Id(1, 0, /*profile=*/8), &out));
  EXPECT_EQ(counters_[0].blocks.load(), 1u);
  EXPECT_EQ(counters_[0].bytes.load(), 5000u);
  EXPECT_TRUE(store->Delete(Id(1, 0)));
  EXPECT_FALSE(store->Delete(Id(1, 0)));
  EXPECT_FALSE(store->Contains(Id(1, 0)));
  EXPECT_EQ(counters_[0].blocks.load(), 0u);
  EXPECT_EQ(counters_[1].blocks.load(), 1u);
}

TEST_F(BlockStoreTest, EvictsLeastRecentlyUsedAndNeverExceedsCapacity) {
  const size_t kBlock = 64 << 10;
  auto store = MakeStore(16 * kBlock);  // room for exactly 16 blocks
  for (uint32_t i = 0; i < 16; ++i) ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  std::string out;
  ASSERT_TRUE(ReadInto(*store, Id(0), &out));  // 0 becomes most recent; 1 is now the oldest
  ASSERT_EQ(Put(*store, Id(100), Payload(100, kBlock)), PutOutcome::kStored);
  EXPECT_TRUE(store->Contains(Id(0)));
  EXPECT_FALSE(store->Contains(Id(1)));
  EXPECT_TRUE(store->Contains(Id(2)));
  EXPECT_EQ(store->evictions(), 1u);
  for (uint32_t i = 200; i < 260; ++i) {
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
    ASSERT_LE(store->used_bytes(), store->capacity_bytes());
  }
  EXPECT_EQ(store->blocks(), 16u);
  for (uint32_t i = 244; i < 260; ++i) {  // the newest 16 survive, intact
    ASSERT_TRUE(ReadInto(*store, Id(i), &out));
    EXPECT_EQ(out, Payload(i, kBlock));
  }
}

// Segmented LRU: a block read once more is protected from a stream of new puts that would push
// it out of a plain LRU.
TEST_F(BlockStoreTest, SegmentedLruKeepsABlockUsedTwiceThroughAStreamOfNewBlocks) {
  const size_t kBlock = 64 << 10;
  for (double share : {0.0, 0.2}) {
    auto store = MakeStore(10 * kBlock, 8, share);
    for (uint32_t i = 0; i < 10; ++i)
      ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
    std::string out;
    ASSERT_TRUE(ReadInto(*store, Id(0), &out));
    for (uint32_t i = 100; i < 130; ++i) {
      ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
      ASSERT_LE(store->used_bytes(), store->capacity_bytes());
    }
    EXPECT_EQ(store->Contains(Id(0)), share > 0) << "protected_share " << share;
    EXPECT_EQ(store->blocks(), 10u);
    EXPECT_EQ(store->evictions(), 30u);
    if (share > 0) {
      ASSERT_TRUE(ReadInto(*store, Id(0), &out));
      EXPECT_EQ(out, Payload(0, kBlock));
    }
  }
}

// The protected segment holds at most its share of the tier; its least recent block goes back to
// the front of probation, and is evicted only after the probation blocks older than it.
TEST_F(BlockStoreTest, ProtectedSegmentStaysWithinItsShareAndDemotesItsOldest) {
  const size_t kBlock = 64 << 10;
  auto store = MakeStore(10 * kBlock, 8, 0.2);  // protected: at most 2 blocks
  EXPECT_EQ(store->protected_max_bytes(), 2 * kBlock);
  for (uint32_t i = 0; i < 10; ++i)
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  std::string out;
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(ReadInto(*store, Id(i), &out));
  EXPECT_EQ(store->protected_bytes(), 2 * kBlock);  // 0 was demoted when 2 came in
  // Probation, oldest first: 3..9, then 0. Seven puts evict 3..9; the eighth evicts 0.
  for (uint32_t i = 100; i < 107; ++i)
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  EXPECT_TRUE(store->Contains(Id(0)));
  for (uint32_t i = 3; i < 10; ++i) EXPECT_FALSE(store->Contains(Id(i))) << i;
  ASSERT_EQ(Put(*store, Id(107), Payload(107, kBlock)), PutOutcome::kStored);
  EXPECT_FALSE(store->Contains(Id(0)));
  EXPECT_TRUE(store->Contains(Id(1)));
  EXPECT_TRUE(store->Contains(Id(2)));
  // A put of a stored key counts as a use, as a read does; deleting a protected block gives its
  // bytes back to the segment.
  EXPECT_EQ(Put(*store, Id(100), Payload(100, kBlock)), PutOutcome::kAlreadyPresent);
  EXPECT_EQ(store->protected_bytes(), 2 * kBlock);
  EXPECT_TRUE(store->Delete(Id(100)));
  EXPECT_TRUE(store->Delete(Id(2)));
  EXPECT_EQ(store->protected_bytes(), 0u);
}

TEST_F(BlockStoreTest, CorruptBlockIsDroppedAndCountedNeverReturned) {
  auto store = MakeStore(1 << 20);
  std::string a = Payload(9, 4096);
  ASSERT_EQ(Put(*store, Id(9), a), PutOutcome::kStored);
  ASSERT_TRUE(store->CorruptForTesting(Id(9), 1234));
  std::string out;
  EXPECT_FALSE(ReadInto(*store, Id(9), &out));
  EXPECT_EQ(store->crc_failures(), 1u);
  EXPECT_FALSE(store->Contains(Id(9)));
  EXPECT_EQ(store->used_bytes(), 0u);  // its extent was freed
}

TEST_F(BlockStoreTest, ACallerThatChecksGetsTheStoredBytesAndCrcUntouched) {
  auto store = MakeStore(1 << 20);
  std::string a = Payload(9, 4096);
  ASSERT_EQ(Put(*store, Id(9), a), PutOutcome::kStored);
  ASSERT_TRUE(store->CorruptForTesting(Id(9), 7));
  // kByCaller hands over the bytes as stored with the CRC32C they were stored with, so the
  // caller's own check fails...
  std::optional<BlockStore::ReadBlock> r = store->Read(Id(9), BlockStore::CrcCheck::kByCaller);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->crc32c, Crc32c(B(a)));
  EXPECT_NE(Crc32c(r->bytes), r->crc32c);
  EXPECT_EQ(store->crc_failures(), 0u);
  EXPECT_TRUE(store->Contains(Id(9)));
  r.reset();
  // ...and its second read, checked here, drops the block.
  EXPECT_FALSE(store->Read(Id(9), BlockStore::CrcCheck::kHere).has_value());
  EXPECT_EQ(store->crc_failures(), 1u);
  EXPECT_FALSE(store->Contains(Id(9)));
}

TEST_F(BlockStoreTest, SpillCandidatesAreTheColdestOwnBlocksAndLeaveUncounted) {
  const size_t kBlock = 4096;
  auto store = MakeStore(64 * kBlock);
  // A block a peer spilled here, committed at the level it arrived at: never a spill candidate.
  const std::string spilled = Payload(100, kBlock / 2);
  EXPECT_EQ(CommitFromPeer(*store, Id(100), spilled, /*level=*/2), PutOutcome::kStored);
  EXPECT_EQ(store->level_blocks(2), 1u);
  EXPECT_EQ(store->level_bytes(2), spilled.size());
  std::optional<BlockStore::ReadBlock> r = store->Read(Id(100));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->level, 2);
  r.reset();
  for (uint32_t i = 0; i < 3; ++i) ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  std::string out;
  ASSERT_TRUE(ReadInto(*store, Id(0), &out));  // 0 is now the most recent: 1 is the coldest

  std::optional<BlockStore::Candidate> first = store->ColdestSpillable();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->id, Id(1));
  std::optional<BlockStore::Candidate> second = store->ColdestSpillable();  // 1 is busy now
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->id, Id(2));
  store->Release(*second);
  second.reset();  // a candidate pins its block: held, it is no candidate again
  EXPECT_TRUE(store->EvictCandidate(*first, /*count=*/false));
  EXPECT_FALSE(store->Contains(Id(1)));
  EXPECT_EQ(store->evictions(), 0u);  // it left for a peer: not an eviction
  second = store->ColdestSpillable();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->id, Id(2));
  // A reader pinning it keeps it here.
  std::optional<BlockStore::ReadBlock> pin = store->Read(Id(2));
  EXPECT_FALSE(store->EvictCandidate(*second, /*count=*/false));
  EXPECT_TRUE(store->Contains(Id(2)));
  pin.reset();
  second.reset();
  // Blocks 0 and 2 remain (the read made 2 the most recent), then nothing: the spilled-in
  // block 100 is never handed out.
  std::optional<BlockStore::Candidate> c0 = store->ColdestSpillable();
  std::optional<BlockStore::Candidate> c2 = store->ColdestSpillable();
  ASSERT_TRUE(c0.has_value() && c2.has_value());
  EXPECT_EQ(c0->id, Id(0));
  EXPECT_EQ(c2->id, Id(2));
  EXPECT_FALSE(store->ColdestSpillable().has_value());
}

// A node that is leaving hands its blocks to peers most recently used first: blocks read again
// (protected) before the rest, blocks peers spilled here included (kept at the cold end until
// read here); busy and pinned ones are passed over.
TEST_F(BlockStoreTest, AHandOffTakesTheMostRecentlyUsedBlocksFirstSpilledOnesToo) {
  const size_t kBlock = 4096;
  auto store = MakeStore(16 * kBlock, /*shards=*/8, /*protected_share=*/0.5);
  for (uint32_t i = 0; i < 5; ++i) {
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  }
  ASSERT_EQ(CommitFromPeer(*store, Id(100), Payload(100, kBlock), /*level=*/0),
            PutOutcome::kStored);
  std::string out;
  ASSERT_TRUE(ReadInto(*store, Id(1), &out));  // read again: protected
  ASSERT_TRUE(ReadInto(*store, Id(3), &out));  // the same, more recently

  std::vector<BlockStore::Candidate> taken;
  auto next = [&]() -> std::optional<BlockId> {
    std::optional<BlockStore::Candidate> c = store->HottestForHandoff();
    if (!c) return std::nullopt;
    taken.push_back(*c);
    return c->id;
  };
  EXPECT_EQ(next(), Id(3));
  EXPECT_EQ(next(), Id(1));
  std::optional<BlockStore::ReadBlock> pin = store->Read(Id(4));  // a reader holds 4
  ASSERT_TRUE(pin.has_value());
  EXPECT_EQ(next(), Id(2));
  pin.reset();
  EXPECT_EQ(next(), Id(4));
  EXPECT_EQ(next(), Id(0));
  EXPECT_EQ(next(), Id(100));       // a peer's block waits at the cold end, but goes too
  EXPECT_EQ(next(), std::nullopt);  // every block is taken (busy)
  for (const BlockStore::Candidate& c : taken) store->Release(c);
  taken.clear();
  EXPECT_TRUE(store->HottestForHandoff().has_value());  // released: candidates again
}

// The cluster tells a block's home when the block leaves this node, so the store logs every way
// a block leaves other than Delete (whose caller tells the homes itself), in order, once.
TEST_F(BlockStoreTest, BlocksThatLeaveOtherThanByDeleteAreLoggedOnceEach) {
  const size_t kBlock = 4096;
  auto store = MakeStore(4 * kBlock);
  for (uint32_t i = 0; i < 4; ++i)
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  ASSERT_EQ(Put(*store, Id(4), Payload(4, kBlock)), PutOutcome::kStored);  // evicts 0, untracked
  EXPECT_TRUE(store->TakeDepartures().ids.empty()) << "logged before anyone asked";

  store->TrackDepartures(/*max_logged=*/3);
  ASSERT_EQ(Put(*store, Id(5), Payload(5, kBlock)), PutOutcome::kStored);  // evicts 1
  EXPECT_TRUE(store->Delete(Id(2)));                                       // not a departure
  std::optional<BlockStore::Candidate> spill = store->ColdestSpillable();  // 3
  ASSERT_TRUE(spill.has_value());
  ASSERT_TRUE(store->EvictCandidate(*spill, /*count=*/false));
  spill.reset();
  ASSERT_TRUE(store->CorruptForTesting(Id(4), 7));
  std::string out;
  EXPECT_FALSE(ReadInto(*store, Id(4), &out));  // dropped for its CRC32C
  BlockStore::Departures gone = store->TakeDepartures();
  EXPECT_THAT(gone.ids, ::testing::ElementsAre(Id(1), Id(3), Id(4)));
  EXPECT_EQ(gone.not_logged, 0u);
  EXPECT_TRUE(store->TakeDepartures().ids.empty()) << "handed out twice";

  // Past max_logged departures are counted, not logged.
  for (uint32_t i = 10; i < 18; ++i)
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  gone = store->TakeDepartures();
  EXPECT_EQ(gone.ids.size(), 3u);
  EXPECT_EQ(gone.ids.size() + gone.not_logged, store->evictions() - 2);  // all but 0 and 1 above
  EXPECT_THAT(gone.ids, ::testing::ElementsAre(Id(5), Id(10), Id(11)));
}

TEST_F(BlockStoreTest, TheShardsTogetherListEveryStoredBlockOnce) {
  auto store = MakeStore(1 << 20, /*shards=*/4);
  for (uint32_t i = 0; i < 40; ++i)
    ASSERT_EQ(Put(*store, Id(i, i % 2), Payload(i, 100)), PutOutcome::kStored);
  ASSERT_TRUE(store->Delete(Id(7, 1)));
  std::vector<BlockId> all;
  ASSERT_EQ(store->num_shards(), 4u);
  for (size_t s = 0; s < store->num_shards(); ++s) {
    std::vector<BlockId> ids = store->ShardIds(s);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  std::vector<BlockId> want;
  for (uint32_t i = 0; i < 40; ++i) {
    if (i != 7) want.push_back(Id(i, i % 2));
  }
  EXPECT_THAT(all, ::testing::UnorderedElementsAreArray(want));
}

// Puts evicting on several threads while another drains the log: every eviction is handed out
// exactly once (logged or counted), none twice (run under TSan by scripts/sanitize.sh thread).
TEST_F(BlockStoreTest, DeparturesLoggedByRacingPutsAreEachTakenOnce) {
  const size_t kBlock = 4096;
  auto store = MakeStore(32 * kBlock);
  store->TrackDepartures(/*max_logged=*/1000);
  constexpr uint32_t kThreads = 3, kPuts = 400;
  std::atomic<bool> done{false};
  std::vector<BlockId> taken;
  uint64_t not_logged = 0;
  std::thread drainer([&] {
    while (!done.load()) {
      BlockStore::Departures d = store->TakeDepartures();
      taken.insert(taken.end(), d.ids.begin(), d.ids.end());
      not_logged += d.not_logged;
    }
  });
  std::vector<std::thread> putters;
  for (uint32_t t = 0; t < kThreads; ++t) {
    putters.emplace_back([&, t] {
      const std::string data = Payload(t, kBlock);
      for (uint32_t i = 0; i < kPuts; ++i) Put(*store, Id(t * kPuts + i), data);
    });
  }
  for (std::thread& t : putters) t.join();
  done.store(true);
  drainer.join();
  BlockStore::Departures rest = store->TakeDepartures();
  taken.insert(taken.end(), rest.ids.begin(), rest.ids.end());
  not_logged += rest.not_logged;
  EXPECT_EQ(taken.size() + not_logged, store->evictions());
  EXPECT_EQ(store->evictions(), kThreads * kPuts - 32);
  absl::flat_hash_set<BlockId> distinct(taken.begin(), taken.end());
  EXPECT_EQ(distinct.size(), taken.size()) << "a departure was handed out twice";
  for (const BlockId& id : taken) EXPECT_FALSE(store->Contains(id));
}

// Several threads (tierer workers, puts) asking for the coldest compressible block at once
// often find the same one; the loser must get the next one, not "none" while blocks remain
// (a worker would go idle, and a put would evict instead of compressing).
TEST_F(BlockStoreTest, ThreadsRacingForTheColdestCompressibleBlockEachGetOne) {
  constexpr uint32_t kBlocks = 2000, kThreads = 4;
  const size_t kBlock = 256;
  auto store = MakeStore(uint64_t{kBlocks} * kBlock * 2);
  BlockAttributes compressible;
  compressible.max_level = 1;
  for (uint32_t i = 0; i < kBlocks; ++i) {
    const std::string data = Payload(i, kBlock);
    std::optional<BlockStore::PendingBlock> p = store->TryReserve(data.size());
    ASSERT_TRUE(p.has_value());
    std::memcpy(p->bytes().data(), data.data(), data.size());
    ASSERT_EQ(store->Commit(Id(i), *std::move(p), Crc32c(B(data)), compressible),
              PutOutcome::kStored);
  }
  const std::vector<uint8_t> caps = {1, 0};
  std::atomic<uint32_t> taken{0};
  std::atomic<uint32_t> early_none{0};
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (true) {
        std::optional<BlockStore::Candidate> c = store->ColdestCompressible(caps);
        if (!c) {
          // Legitimate only when every block left is held by another thread (at most
          // kThreads - 1 of them, taken but not yet counted).
          if (kBlocks - taken.load() > kThreads - 1) ++early_none;
          return;
        }
        ++taken;
        store->KeepAtLevel(*c);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(early_none.load(), 0u);
  EXPECT_EQ(taken.load(), kBlocks);  // each block handed out exactly once
  EXPECT_FALSE(store->ColdestCompressible(caps).has_value());
}

// The tierer encodes a candidate outside the shard lock. When the worker deletes the key and puts
// it again (other bytes) meanwhile, no way of handing the candidate back may touch the new block:
// an encoding of the old bytes committed over it would be returned under the new block's key.
// (A soak that deletes and re-puts keys under compression, tests/soak, reaches this window only
// by chance.)
TEST_F(BlockStoreTest, ACandidateWhoseKeyWasDeletedAndPutAgainLeavesTheNewBlockAlone) {
  auto store = MakeStore(1 << 20);
  BlockAttributes compressible;
  compressible.max_level = 2;
  const std::vector<uint8_t> caps = {2, 0};
  auto commit = [&](const std::string& data) {
    std::optional<BlockStore::PendingBlock> p = store->TryReserve(data.size());
    ASSERT_TRUE(p.has_value());
    std::memcpy(p->bytes().data(), data.data(), data.size());
    ASSERT_EQ(store->Commit(Id(1), *std::move(p), Crc32c(B(data)), compressible),
              PutOutcome::kStored);
  };
  const std::string old_bytes = Payload(1, 8192), new_bytes = Payload(2, 8192);
  commit(old_bytes);
  std::optional<BlockStore::Candidate> c = store->ColdestCompressible(caps);
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(store->Delete(Id(1)));
  commit(new_bytes);

  const std::string encoded = Payload(3, 1024);  // "the old bytes at level 1"
  std::optional<BlockStore::PendingBlock> e = store->TryReserve(encoded.size());
  ASSERT_TRUE(e.has_value());
  std::memcpy(e->bytes().data(), encoded.data(), encoded.size());
  EXPECT_FALSE(store->Replace(*c, *std::move(e), Crc32c(B(encoded)), 1));
  EXPECT_EQ(store->ReplaceInPlace(*c, B(encoded), 1), BlockStore::InPlace::kGone);
  EXPECT_FALSE(store->EvictCandidate(*c));
  store->KeepAtLevel(*c);
  store->Release(*c);
  c.reset();

  std::optional<BlockStore::ReadBlock> now = store->Read(Id(1));
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->level, 0);
  EXPECT_TRUE(std::string(reinterpret_cast<const char*>(now->bytes.data()), now->bytes.size()) ==
              new_bytes)
      << "the key holds other bytes than its last put's";
  now.reset();
  EXPECT_EQ(store->level_blocks(0), 1u);
  EXPECT_EQ(store->level_blocks(1), 0u);
  EXPECT_EQ(store->used_bytes(), new_bytes.size());  // the encoding's room was given back
  // KeepAtLevel of the old candidate left the new block compressible.
  std::optional<BlockStore::Candidate> again = store->ColdestCompressible(caps);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->block.level, 0);
  store->Release(*again);
}

TEST_F(BlockStoreTest, APinnedBlockOutlivesEvictionAndDeletion) {
  auto store = MakeStore(64 << 10);
  std::string a = Payload(1, 32 << 10);
  ASSERT_EQ(Put(*store, Id(1), a), PutOutcome::kStored);
  std::optional<BlockStore::ReadBlock> pinned = store->Read(Id(1));
  ASSERT_TRUE(pinned.has_value());
  EXPECT_TRUE(store->Delete(Id(1)));
  EXPECT_EQ(store->used_bytes(), 32u << 10);  // still held by the reader
  // With the pinned block's bytes still allocated, only one more 32 KiB block fits.
  EXPECT_EQ(Put(*store, Id(2), Payload(2, 32 << 10)), PutOutcome::kStored);
  EXPECT_EQ(Put(*store, Id(3), Payload(3, 32 << 10)), PutOutcome::kStored);  // evicts 2
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(pinned->bytes.data()), pinned->bytes.size()),
            a);
  pinned.reset();
  EXPECT_EQ(store->used_bytes(), 32u << 10);
}

TEST_F(BlockStoreTest, WhenEveryBlockIsPinnedAPutIsRefusedAndNothingIsLost) {
  auto store = MakeStore(64 << 10);
  std::string a = Payload(1, 32 << 10), b = Payload(2, 32 << 10);
  ASSERT_EQ(Put(*store, Id(1), a), PutOutcome::kStored);
  ASSERT_EQ(Put(*store, Id(2), b), PutOutcome::kStored);
  std::optional<BlockStore::ReadBlock> pin_a = store->Read(Id(1));
  std::optional<BlockStore::ReadBlock> pin_b = store->Read(Id(2));
  ASSERT_TRUE(pin_a && pin_b);
  // Nothing can give way: refused, not over capacity, and both stored blocks are untouched.
  EXPECT_EQ(Put(*store, Id(3), Payload(3, 32 << 10)), PutOutcome::kNoSpace);
  EXPECT_LE(store->used_bytes(), 64u << 10);
  std::string out;
  ASSERT_TRUE(ReadInto(*store, Id(1), &out));
  EXPECT_EQ(out, a);
  ASSERT_TRUE(ReadInto(*store, Id(2), &out));
  EXPECT_EQ(out, b);
  // Once a reader lets go, the put gets its room.
  pin_a.reset();
  EXPECT_EQ(Put(*store, Id(3), Payload(3, 32 << 10)), PutOutcome::kStored);
}

// Encoded blocks of many sizes leave holes: enough bytes free, no region large enough. A put
// then moves blocks out of the cheapest window instead of evicting any.
TEST_F(BlockStoreTest, AFragmentedTierMakesRoomByMovingBlocksNotByEvictingThem) {
  const size_t kBlock = 64 << 10;
  auto store = MakeStore(16 * kBlock);
  for (uint32_t i = 0; i < 16; ++i) {
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  }
  for (uint32_t i = 1; i < 16; i += 2) ASSERT_TRUE(store->Delete(Id(i)));  // 8 holes of 64 KiB
  ASSERT_EQ(store->used_bytes(), 8 * kBlock);
  const std::string big = Payload(100, 4 * kBlock);
  ASSERT_EQ(Put(*store, Id(100), big), PutOutcome::kStored);
  EXPECT_EQ(store->evictions(), 0u);
  EXPECT_EQ(store->compactions(), 1u);
  EXPECT_EQ(store->compaction_moved_bytes(), 2 * kBlock);  // a 4-block window holds 2 blocks
  EXPECT_EQ(store->used_bytes(), 12 * kBlock);
  std::string out;
  for (uint32_t i = 0; i < 16; i += 2) {  // every block that was there is still there, intact
    ASSERT_TRUE(ReadInto(*store, Id(i), &out)) << i;
    EXPECT_EQ(out, Payload(i, kBlock)) << i;
  }
  ASSERT_TRUE(ReadInto(*store, Id(100), &out));
  EXPECT_EQ(out, big);
  // The rest fills up to the last byte: 4 more 64 KiB blocks, still without an eviction.
  for (uint32_t i = 200; i < 204; ++i) {
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  }
  EXPECT_EQ(store->used_bytes(), store->capacity_bytes());
  EXPECT_EQ(store->evictions(), 0u);
}

// A block being read is never moved: the compaction gives up (nothing lost, nothing evicted
// under a reader), and succeeds once the reader lets go.
TEST_F(BlockStoreTest, ACompactionNeverMovesABlockUnderAReader) {
  const size_t kBlock = 64 << 10;
  auto store = MakeStore(8 * kBlock);
  for (uint32_t i = 0; i < 8; ++i) {
    ASSERT_EQ(Put(*store, Id(i), Payload(i, kBlock)), PutOutcome::kStored);
  }
  for (uint32_t i = 1; i < 8; i += 2) ASSERT_TRUE(store->Delete(Id(i)));
  std::vector<BlockStore::ReadBlock> pins;
  for (uint32_t i = 0; i < 8; i += 2) {
    std::optional<BlockStore::ReadBlock> r = store->Read(Id(i));
    ASSERT_TRUE(r.has_value());
    pins.push_back(*std::move(r));
  }
  EXPECT_FALSE(store->ReserveCompacting(2 * kBlock).has_value());
  EXPECT_GE(store->compactions_given_up(), 1u);
  EXPECT_EQ(Put(*store, Id(100), Payload(100, 2 * kBlock)), PutOutcome::kNoSpace);
  EXPECT_EQ(store->used_bytes(), 4 * kBlock);  // the claimed holes were given back
  EXPECT_EQ(store->blocks(), 4u);
  for (size_t p = 0; p < pins.size(); ++p) {  // readers' bytes never moved or changed
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(pins[p].bytes.data()),
                          pins[p].bytes.size()),
              Payload(static_cast<uint32_t>(2 * p), kBlock));
  }
  pins.clear();
  EXPECT_EQ(Put(*store, Id(100), Payload(100, 2 * kBlock)), PutOutcome::kStored);
  EXPECT_EQ(store->evictions(), 0u);
  std::string out;
  for (uint32_t i = 0; i < 8; i += 2) {
    ASSERT_TRUE(ReadInto(*store, Id(i), &out));
    EXPECT_EQ(out, Payload(i, kBlock));
  }
}

class ConcurrentBlockStoreTest : public BlockStoreTest,
                                 public ::testing::WithParamInterface<double> {};

// Plain LRU and segmented LRU (promotions and demotions racing puts, reads and deletes).
// Blocks of four sizes, so puts also compact the tier while others read and delete.
TEST_P(ConcurrentBlockStoreTest, ConcurrentPutsGetsAndDeletesStayConsistent) {
  const size_t kUnit = 8 << 10;
  auto size_of = [&](uint32_t k) { return kUnit * (1 + k % 4); };
  auto store = MakeStore(128 * kUnit, 4, /*protected_share=*/GetParam());
  std::atomic<bool> wrong{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::string out;
      for (int i = 0; i < 3000; ++i) {
        uint32_t k = rng() % 200;
        switch (rng() % 4) {
          case 0:
          case 1:
            Put(*store, Id(k), Payload(k, size_of(k)));
            break;
          case 2:
            if (ReadInto(*store, Id(k), &out) && out != Payload(k, size_of(k))) wrong = true;
            break;
          case 3:
            store->Delete(Id(k));
            break;
        }
        if (store->used_bytes() > store->capacity_bytes()) wrong = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(wrong.load());
  uint64_t resident = 0;
  std::string out;
  for (uint32_t k = 0; k < 200; ++k) {
    if (!store->Contains(Id(k))) continue;
    resident += size_of(k);
    ASSERT_TRUE(ReadInto(*store, Id(k), &out));
    EXPECT_EQ(out, Payload(k, size_of(k))) << k;
  }
  EXPECT_EQ(store->used_bytes(), resident);  // nothing leaked, no claim left behind
  EXPECT_EQ(counters_[0].blocks.load(), store->blocks());
  EXPECT_GT(store->compactions(), 0u);
  EXPECT_LE(store->protected_bytes(), store->protected_max_bytes());
  // Every protected byte belongs to a resident block: deleting them all leaves none.
  for (uint32_t k = 0; k < 200; ++k) store->Delete(Id(k));
  EXPECT_EQ(store->protected_bytes(), 0u);
  EXPECT_EQ(store->used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(ProtectedShares, ConcurrentBlockStoreTest, ::testing::Values(0.0, 0.25));

}  // namespace
}  // namespace proxima::daemon
