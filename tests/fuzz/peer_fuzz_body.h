// The body of the peer fuzz target, shared by the libFuzzer harness and by the unit test that
// replays the checked-in corpus (tests/fuzz/corpus/peer) in ordinary builds.
//
// Input: one byte choosing the proxima.v1.Peer method, then the request message in proto3 wire
// format, as another daemon of the cluster would send it (a buggy, hostile or other-version
// peer). It is handled in process by this daemon's PeerService bodies (ServeRecord, ServeLookup,
// ServeFetch, ServeStore, ServeDelete; the transport and the peer token aside), against one
// TierService that lives across inputs and so accumulates blocks and location records. Its
// namespaces: "open" (compressed: int8, then int4), "other" (raw only) and "p" (private prefixes,
// token scopes alice and bob). The cluster behind the service (the homes that Stored/Removed
// would tell) is a CountingRemote: it has no peers to call. Checked besides "no crash, no hang,
// no sanitizer report":
//  - every error carries a message;
//  - a StoreBlocks that fails stores nothing; after one that succeeds every block it reports
//    kept is readable and passes its CRC32C, in the partition of the scope the request names
//    (or of its number, without one), raw blocks of a profile registered here have that
//    profile's size, and encoded ones are whole STAR-KV containers;
//  - a block this node did not hold before is kept at the level of its own hierarchy whose plan
//    the sender named, or, when no level here has that plan, decoded: raw, the bytes the sent
//    container decodes to;
//  - the answers have one entry per key, and a fetched block is found only with its bytes.
// Thread-compatible (one fuzzing thread).
#ifndef PROXIMA_TESTS_FUZZ_PEER_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_PEER_FUZZ_BODY_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/testing/tiny_profile.h"
#include "daemon/cluster/counting_remote.h"
#include "daemon/cluster/location_table.h"
#include "daemon/cluster/peer_service.h"
#include "daemon/tier_service.h"
#include "kernels/codec.h"

namespace proxima::daemon::fuzz {

enum PeerMethod : uint8_t {
  kPeerRecord,
  kPeerLookup,
  kPeerFetch,
  kPeerStore,
  kPeerDelete,
  kPeerMethods
};

// The profile every seed names (registered in both namespaces at start): 512-byte blocks.
inline constexpr uint64_t kPeerFuzzBlockBytes = proxima::testing::kTinyBlockBytes;
inline v1::ModelProfile PeerFuzzProfile() { return proxima::testing::TinyProfile("fuzz-model"); }
// The hierarchy of namespace "open" (plan texts, CodecPlan::ToString).
inline std::vector<std::string> PeerFuzzLevels() { return {"int8", "int4"}; }

struct PeerFuzzState {
  std::unique_ptr<TierService> core;
  std::unique_ptr<cluster::LocationTable> records;
  cluster::CountingRemote remote;
  cluster::PeerTokens tokens{{"peer-fuzz-token-0123456789abcdef"}};
  std::unique_ptr<cluster::PeerService> service;
};

inline PeerFuzzState& PeerFuzz() {
  static PeerFuzzState* state = [] {
    auto* s = new PeerFuzzState;
    setenv("PROXIMA_PEER_FUZZ_ALICE", "alice-peer-fuzz-token-0123456789ab", 0);
    setenv("PROXIMA_PEER_FUZZ_BOB", "bob-peer-fuzz-token-0123456789abcd", 0);
    DaemonConfig config;
    config.host_tier.capacity_bytes = 1 << 20;
    config.server.max_message_bytes = 1 << 20;
    config.server.max_batch_blocks = 8;
    config.server.max_lookup_keys = 64;
    config.namespaces = {{"open"},
                         {"other"},
                         {"p",
                          {{"alice", "", "PROXIMA_PEER_FUZZ_ALICE", TokenAccess::kReadWrite, ""},
                           {"bob", "", "PROXIMA_PEER_FUZZ_BOB", TokenAccess::kReadWrite, ""}},
                          /*private_prefixes=*/true}};
    CompressionConfig& c = config.namespaces[0].compression;
    c.enabled = true;
    c.levels = PeerFuzzLevels();
    for (const std::string& text : c.levels) {
      absl::StatusOr<codec::CodecPlan> plan = codec::ParseCodecPlan(text);
      if (!plan.ok()) std::abort();
      c.plans.push_back(*plan);
    }
    static metrics::Registry registry;
    absl::StatusOr<std::unique_ptr<TierService>> core = TierService::Create(config, &registry);
    if (!core.ok()) std::abort();
    s->core = *std::move(core);
    // Nothing may change the blocks under the checks (the tierer would encode "open"'s).
    s->core->tierer().Stop();
    for (uint32_t ns = 0; ns < config.namespaces.size(); ++ns) {
      if (!s->core->AddProfile(ns, PeerFuzzProfile()).ok()) std::abort();
    }
    s->records = std::make_unique<cluster::LocationTable>(256);
    s->service = std::make_unique<cluster::PeerService>(
        s->core.get(), s->records.get(), &s->remote, /*ucx=*/nullptr, "self:1", &s->tokens,
        config.server.max_message_bytes,
        cluster::PeerService::Acceptance{.below = 0.75, .handoff_evicts = true}, &registry);
    return s;
  }();
  return *state;
}

// Handles one input; returns true when the call succeeded.
inline bool RunPeerInput(const uint8_t* data, size_t size) {
  if (size < 1) return false;
  const auto method = static_cast<PeerMethod>(data[0] % kPeerMethods);
  const std::string raw(reinterpret_cast<const char*>(data + 1), size - 1);
  PeerFuzzState& s = PeerFuzz();
  cluster::PeerService& service = *s.service;
  absl::Status status;
  size_t keys = 0;  // keys the request names, for the one-entry-per-key checks
  switch (method) {
    case kPeerRecord: {
      v1::RecordLocationsRequest req;
      v1::RecordLocationsResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = service.ServeRecord(req, &resp);
      break;
    }
    case kPeerLookup: {
      v1::LookupLocationsRequest req;
      v1::LookupLocationsResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = service.ServeLookup(req, &resp);
      keys = static_cast<size_t>(req.blocks().keys_size());
      if (status.ok() && static_cast<size_t>(resp.holders_size()) != keys) std::abort();
      break;
    }
    case kPeerFetch: {
      v1::FetchBlocksRequest req;
      v1::FetchBlocksResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = service.ServeFetch(req, &resp);
      keys = static_cast<size_t>(req.blocks().keys_size());
      if (status.ok()) {
        if (static_cast<size_t>(resp.blocks_size()) != keys || resp.ucx_sent()) std::abort();
        for (const v1::FetchedBlock& b : resp.blocks()) {
          // Found inline: the stored bytes and their CRC32C (no UCX without a UCX worker).
          if (b.found() && Crc32c(std::as_bytes(std::span<const char>(
                               b.data().data(), b.data().size()))) != b.crc32c()) {
            std::abort();
          }
        }
      }
      break;
    }
    case kPeerStore: {
      v1::StoreBlocksRequest req;
      v1::StoreBlocksResponse resp;
      if (!req.ParseFromString(raw)) return false;
      BlockStore& store = s.core->store();
      const uint64_t blocks_before = store.blocks();
      const uint64_t bytes_before = store.used_bytes();
      // The blocks as this node names them (scope resolved), and which it held before.
      absl::StatusOr<std::vector<BlockId>> ids =
          cluster::ResolveBlockSet(*s.core, req.blocks(), s.core->max_batch_blocks());
      std::vector<bool> held_before;
      if (ids.ok()) {
        for (const BlockId& id : *ids) held_before.push_back(store.Contains(id));
      }
      status = service.ServeStore(req, &resp);
      keys = static_cast<size_t>(req.blocks().keys_size());
      if (!status.ok()) {
        // A refused request stores nothing and evicts nothing (every block is checked before
        // any is reserved; nothing else runs).
        if (store.blocks() != blocks_before || store.used_bytes() != bytes_before) std::abort();
        break;
      }
      if (!ids.ok() || static_cast<size_t>(resp.stored_size()) != keys) std::abort();
      for (size_t i = 0; i < keys; ++i) {
        if (!resp.stored(static_cast<int>(i))) continue;
        const BlockId& id = (*ids)[i];
        const v1::SpilledBlock& sent = req.data(static_cast<int>(i));
        // Kept (or already held): readable, with bytes that pass their CRC32C.
        std::optional<BlockStore::ReadBlock> b = store.Read(id, BlockStore::CrcCheck::kHere);
        if (!b) std::abort();
        // A raw block of the registered profile is exactly its size, whatever block_bytes a
        // peer stated (other profiles are unknown here: their blocks are as stated).
        if (b->level == 0 && id.profile_id == ProfileId(PeerFuzzProfile()) &&
            b->bytes.size() != kPeerFuzzBlockBytes) {
          std::abort();
        }
        // An encoded one is a whole container of a block of the size the request stated.
        if (b->level > 0) {
          absl::StatusOr<codec::BlockHeaderInfo> info = codec::InspectBlock(b->bytes);
          if (!info.ok() || info->raw_bytes == 0) std::abort();
        }
        if (held_before[i] || sent.level() == 0 || sent.plan().empty()) continue;
        // New here, encoded with a named plan: at this node's level of that plan, else decoded.
        if (b->level > 0) {
          if (s.core->LevelPlanText(id.namespace_index, b->level) != sent.plan()) std::abort();
          if (sent.data() !=
              std::string(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size())) {
            std::abort();
          }
        } else {
          std::string decoded(req.block_bytes(), '\0');
          if (!codec::DecodeBlock(AsBytes(sent.data()), AsWritableBytes(decoded)).ok() ||
              decoded !=
                  std::string(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size())) {
            std::abort();
          }
        }
      }
      break;
    }
    case kPeerDelete: {
      v1::DeleteBlocksRequest req;
      v1::DeleteBlocksResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = service.ServeDelete(req, &resp);
      keys = static_cast<size_t>(req.blocks().keys_size());
      if (status.ok() && static_cast<size_t>(resp.deleted_size()) != keys) std::abort();
      break;
    }
    case kPeerMethods:
      std::abort();
  }
  if (!status.ok()) {
    if (status.message().empty()) std::abort();
    return false;
  }
  return true;
}

}  // namespace proxima::daemon::fuzz

#endif  // PROXIMA_TESTS_FUZZ_PEER_FUZZ_BODY_H_
