// Writes the seed corpora of the request, peer and snapshot fuzz targets: valid requests of every
// method, for every caller of the request harness (tests/fuzz/request_fuzz_body.h), in each
// namespace; the calls another daemon makes (tests/fuzz/peer_fuzz_body.h), valid ones and the
// refusals a buggy peer meets; and snapshot files (tests/fuzz/snapshot_fuzz_body.h) of raw,
// encoded and scoped blocks. Rerun when the API or the snapshot format changes:
//   ninja -C build make_request_seeds && build/tests/fuzz/make_request_seeds
//   tests/fuzz/corpus/request tests/fuzz/corpus/peer tests/fuzz/corpus/snapshot
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/crc32c.h"
#include "common/testing/tiny_profile.h"
#include "daemon/snapshot.h"
#include "daemon/tier_service.h"
#include "kernels/codec.h"
#include "proxima/v1/kvtier.pb.h"
#include "proxima/v1/peer.pb.h"
#include "tests/fuzz/snapshot_fuzz_body.h"

namespace {

proxima::v1::ModelProfile SmallProfile() { return proxima::testing::TinyProfile("fuzz-model"); }

int n = 0;
std::string dir;

void Write(int method, int caller, const google::protobuf::Message& m) {
  std::ofstream f(dir + "/seed_" + std::to_string(n++), std::ios::binary);
  f.put(static_cast<char>(method));
  f.put(static_cast<char>(caller));
  f << m.SerializeAsString();
}

// Peer seeds: one method byte (tests/fuzz/peer_fuzz_body.h's PeerMethod), then the message.
void WritePeer(const std::string& peer_dir, int method, const google::protobuf::Message& m) {
  std::ofstream f(peer_dir + "/seed_" + std::to_string(n++), std::ios::binary);
  f.put(static_cast<char>(method));
  f << m.SerializeAsString();
}

proxima::v1::SpilledBlock Spilled(const std::string& data, uint32_t level) {
  proxima::v1::SpilledBlock b;
  b.set_data(data);
  b.set_level(level);
  b.set_crc32c(proxima::Crc32c(std::as_bytes(std::span<const char>(data.data(), data.size()))));
  return b;
}

// A raw block of SmallProfile() and its encoding with `plan` (a CodecPlan text).
std::pair<std::string, std::string> RawAnd(const char* plan) {
  const proxima::v1::ModelProfile profile = SmallProfile();
  const proxima::codec::BlockGeometry geometry{profile.num_layers(), profile.num_kv_heads(),
                                               profile.head_dim(), profile.tokens_per_block(),
                                               proxima::codec::DType::kBf16};
  std::string raw(512, '\0');
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<char>((i * 7) % 61);
  std::string encoded;
  if (!proxima::codec::EncodeBlock(geometry, *proxima::codec::ParseCodecPlan(plan), false,
                                   std::as_bytes(std::span<const char>(raw.data(), raw.size())), {},
                                   &encoded)
           .ok()) {
    std::abort();
  }
  return {raw, encoded};
}

// An encoded spilled block as a sender of this version sends it: the plan of its level named,
// and the put's hints.
proxima::v1::SpilledBlock SpilledWithPlan(const std::string& data, uint32_t level,
                                          const std::string& plan, bool high_priority,
                                          int64_t position) {
  proxima::v1::SpilledBlock b = Spilled(data, level);
  b.set_plan(plan);
  b.set_high_priority(high_priority);
  b.set_position(position);
  b.set_second_chance(position == 0);
  return b;
}

void WritePeerSeeds(const std::string& peer_dir, uint64_t id) {
  enum { kRecord, kLookup, kFetch, kStore, kDelete };
  const std::pair<std::string, std::string> blocks = RawAnd("int8");
  const std::string& raw = blocks.first;
  const std::string& encoded = blocks.second;
  const std::string int4 = RawAnd("int4").second;
  for (const std::string ns : {"open", "other", "missing"}) {
    auto set = [&](proxima::v1::PeerBlockSet* s, std::initializer_list<char> keys) {
      s->set_namespace_name(ns);
      s->set_profile_id(id);
      for (char k : keys) s->add_keys(std::string(32, k));
    };
    proxima::v1::StoreBlocksRequest store;  // two raw blocks and an int8 one
    set(store.mutable_blocks(), {'a', 'b', 'e'});
    store.set_block_bytes(512);
    *store.add_data() = Spilled(raw, 0);
    *store.add_data() = Spilled(std::string(512, 'b'), 0);
    *store.add_data() = Spilled(encoded, 1);
    WritePeer(peer_dir, kStore, store);
    proxima::v1::StoreBlocksRequest wrong_size;  // block_bytes other than the registered one
    set(wrong_size.mutable_blocks(), {'c'});
    wrong_size.set_block_bytes(1024);
    *wrong_size.add_data() = Spilled(std::string(1024, 'c'), 0);
    WritePeer(peer_dir, kStore, wrong_size);
    proxima::v1::StoreBlocksRequest not_a_block;  // level 2 but not a container
    set(not_a_block.mutable_blocks(), {'d'});
    not_a_block.set_block_bytes(512);
    *not_a_block.add_data() = Spilled(std::string(300, 'd'), 2);
    WritePeer(peer_dir, kStore, not_a_block);
    proxima::v1::StoreBlocksRequest bad_crc = store;
    bad_crc.mutable_data(1)->set_crc32c(bad_crc.data(1).crc32c() ^ 1);
    WritePeer(peer_dir, kStore, bad_crc);
    proxima::v1::StoreBlocksRequest over_ucx;  // an older sender's: spills come inline only
    set(over_ucx.mutable_blocks(), {'f'});
    over_ucx.set_block_bytes(512);
    over_ucx.set_ucx_worker_address("worker");
    over_ucx.add_data();
    WritePeer(peer_dir, kStore, over_ucx);
    proxima::v1::StoreBlocksRequest pushed;  // blocks sent as UCX messages: none come here
    set(pushed.mutable_blocks(), {'f'});
    pushed.set_block_bytes(512);
    pushed.set_ucx_transfer(9);
    pushed.add_data()->set_ucx_size(512);
    WritePeer(peer_dir, kStore, pushed);
    proxima::v1::RecordLocationsRequest record;
    set(record.mutable_blocks(), {'a', 'x'});
    record.set_holder("peer-2:7070");
    WritePeer(peer_dir, kRecord, record);
    record.set_forget(true);
    WritePeer(peer_dir, kRecord, record);
    proxima::v1::LookupLocationsRequest lookup;
    set(lookup.mutable_blocks(), {'a', 'x', 'z'});
    WritePeer(peer_dir, kLookup, lookup);
    proxima::v1::FetchBlocksRequest fetch;
    set(fetch.mutable_blocks(), {'a', 'e', 'z'});
    WritePeer(peer_dir, kFetch, fetch);
    fetch.set_ucx_worker("worker");
    fetch.set_ucx_transfer(7);
    fetch.set_ucx_max_block_bytes(512);
    WritePeer(peer_dir, kFetch, fetch);
    proxima::v1::DeleteBlocksRequest del;
    set(del.mutable_blocks(), {'b'});
    WritePeer(peer_dir, kDelete, del);
    // Encoded blocks naming their level's plan ("open" compresses int8 then int4; "other" has
    // no levels): kept at the level here with that plan, or decoded.
    proxima::v1::StoreBlocksRequest planned;
    set(planned.mutable_blocks(), {'g', 'h', 'i', 'j'});
    planned.set_block_bytes(512);
    *planned.add_data() = SpilledWithPlan(encoded, 1, "int8", true, 0);
    *planned.add_data() = SpilledWithPlan(int4, 1, "int4", false, 3);    // the sender's level 1
    *planned.add_data() = SpilledWithPlan(encoded, 2, "fp8", false, 4);  // no level here
    *planned.add_data() = SpilledWithPlan(int4, 2, "int4", false, -1);
    WritePeer(peer_dir, kStore, planned);
    planned.set_handoff(true);
    WritePeer(peer_dir, kStore, planned);
  }
  // Token scopes of "p" (private prefixes; scopes alice and bob): by name, a scope the receiver
  // lacks, and the numbers of older senders, one past the namespace's partitions.
  auto scoped = [&](proxima::v1::PeerBlockSet* s, const char* scope, uint32_t partition, char key) {
    s->set_namespace_name("p");
    s->set_profile_id(id);
    if (scope != nullptr) s->set_scope(scope);
    s->set_partition(partition);
    s->add_keys(std::string(32, key));
  };
  for (const auto& [scope, partition] : std::vector<std::pair<const char*, uint32_t>>{
           {"alice", 2}, {"bob", 0}, {"carol", 1}, {"", 0}, {nullptr, 1}, {nullptr, 9}}) {
    proxima::v1::StoreBlocksRequest store;
    scoped(store.mutable_blocks(), scope, partition, 'k');
    store.set_block_bytes(512);
    *store.add_data() = Spilled(raw, 0);
    WritePeer(peer_dir, kStore, store);
    proxima::v1::FetchBlocksRequest fetch;
    scoped(fetch.mutable_blocks(), scope, partition, 'k');
    WritePeer(peer_dir, kFetch, fetch);
    proxima::v1::LookupLocationsRequest lookup;
    scoped(lookup.mutable_blocks(), scope, partition, 'k');
    WritePeer(peer_dir, kLookup, lookup);
  }
}

// One snapshot seed at `path`, written by a daemon whose "open" namespace compresses down
// `levels`: the int8 block at `int8_level`; with `all_kinds`, `path` is a directory and it holds
// every kind of block besides, and one file of the profiles alone.
void WriteSnapshotSeed(const std::string& path, const std::vector<std::string>& levels,
                       uint8_t int8_level, bool all_kinds) {
  using proxima::daemon::BlockId;
  proxima::metrics::Registry registry;
  auto core = proxima::daemon::TierService::Create(
      proxima::daemon::fuzz::SnapshotFuzzConfig(levels), &registry);
  if (!core.ok()) std::abort();
  (*core)->tierer().Stop();
  const proxima::v1::ModelProfile profile = SmallProfile();
  const uint64_t id = proxima::daemon::ProfileId(profile);
  for (uint32_t ns : {0u, 1u}) {
    if (!(*core)->AddProfile(ns, profile).ok()) std::abort();
  }
  const std::pair<std::string, std::string> blocks = RawAnd("int8");
  const std::string& raw = blocks.first;
  const std::string& encoded = blocks.second;
  auto store = [&](uint32_t ns, uint32_t partition, char key, const std::string& bytes,
                   uint8_t level) {
    BlockId block{ns, id, {}, partition};
    block.key.fill(static_cast<uint8_t>(key));
    auto p = (*core)->store().Reserve(bytes.size());
    if (!p) std::abort();
    std::memcpy(p->bytes().data(), bytes.data(), bytes.size());
    proxima::daemon::BlockAttributes attributes;
    attributes.max_level = 2;
    (*core)->store().Commit(
        block, *std::move(p),
        proxima::Crc32c(std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))),
        attributes, level);
  };
  store(0, 0, 'e', encoded, int8_level);
  if (!all_kinds) {
    if (!proxima::daemon::snapshot::Write(**core, path, absl::InfiniteFuture()).ok()) std::abort();
    ++n;
    return;
  }
  store(0, 0, 'a', raw, 0);
  store(0, 0, 'b', std::string(512, 'b'), 0);
  store(1, 1, 'a', raw, 0);
  store(1, 2, 'a', std::string(512, 'z'), 0);
  if (!proxima::daemon::snapshot::Write(**core, path + "/seed_blocks", absl::InfiniteFuture())
           .ok() ||
      !proxima::daemon::snapshot::Write(**core, path + "/seed_profiles_only", absl::InfinitePast())
           .ok()) {
    std::abort();
  }
  n += 2;
}

// Snapshot seeds: one of every kind of block (raw and int8 in "open", alice's and bob's in "p"),
// and one of the profiles alone (a deadline that had passed); then the int8 block written by
// daemons with other hierarchies: at level 2 of "int2;int8" (found at level 1 when loaded) and
// at level 1 of "fp8" (a plan the loader's hierarchy lacks: decoded).
void WriteSnapshotSeeds(const std::string& snapshot_dir) {
  WriteSnapshotSeed(snapshot_dir, {"int8", "int4"}, 1, /*all_kinds=*/true);
  WriteSnapshotSeed(snapshot_dir + "/seed_int8_at_level_2_of_int2_int8", {"int2", "int8"}, 2,
                    /*all_kinds=*/false);
  WriteSnapshotSeed(snapshot_dir + "/seed_int8_under_a_plan_no_longer_a_level", {"fp8"}, 1,
                    /*all_kinds=*/false);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: %s REQUEST_OUT_DIR [PEER_OUT_DIR [SNAPSHOT_OUT_DIR]]\n", argv[0]);
    return 2;
  }
  dir = argv[1];
  const uint64_t id = proxima::daemon::ProfileId(SmallProfile());
  // Callers as in request_fuzz_body.h: 0 anonymous, 1 t read-write, 2 t read-only, 3 p.
  for (int caller = 0; caller < 4; ++caller) {
    const std::string ns = caller == 0 ? "open" : caller == 3 ? "p" : "t";
    for (const std::string& name : {ns, std::string(caller == 0 ? "t" : "open")}) {
      proxima::v1::RegisterProfileRequest reg;
      reg.set_namespace_name(name);
      *reg.mutable_profile() = SmallProfile();
      Write(1, caller, reg);
      proxima::v1::PutRequest put;
      put.set_namespace_name(name);
      put.set_profile_id(id);
      for (int b = 0; b < 2; ++b) {
        proxima::v1::PutBlock* block = put.add_blocks();
        block->set_key(std::string(32, static_cast<char>('a' + b)));
        block->set_data(std::string(512, static_cast<char>(b)));
      }
      Write(2, caller, put);
      proxima::v1::GetRequest get;
      get.set_namespace_name(name);
      get.set_profile_id(id);
      get.add_keys(std::string(32, 'a'));
      get.add_keys(std::string(32, 'z'));
      Write(3, caller, get);
      proxima::v1::LookupRequest lookup;
      lookup.set_namespace_name(name);
      lookup.set_profile_id(id);
      for (char k : {'a', 'b', 'c'}) lookup.add_keys(std::string(32, k));
      Write(4, caller, lookup);
      proxima::v1::DeleteRequest del;
      del.set_namespace_name(name);
      del.set_profile_id(id);
      del.add_keys(std::string(32, 'b'));
      Write(5, caller, del);
      proxima::v1::DecompressRequest decompress;
      decompress.set_namespace_name(name);
      decompress.set_profile_id(id);
      decompress.add_keys(std::string(32, 'a'));
      Write(7, caller, decompress);
    }
    Write(0, caller, proxima::v1::GetServerInfoRequest());
    Write(6, caller, proxima::v1::StatsRequest());
  }
  if (argc >= 3) WritePeerSeeds(argv[2], id);
  if (argc == 4) WriteSnapshotSeeds(argv[3]);
  std::printf("wrote %d seeds\n", n);
  return 0;
}
