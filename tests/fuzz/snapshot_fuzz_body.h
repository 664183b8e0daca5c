// The body of the snapshot fuzz target, shared by the libFuzzer harness and by the unit test that
// replays the checked-in corpus (tests/fuzz/corpus/snapshot) in ordinary builds.
//
// Input: the bytes of a snapshot file (tiers.host.snapshot_file, docs/format.md section 6) as a
// damaged disk, another version or a hostile local process could leave it. It is loaded by
// snapshot::Load into a fresh TierService (namespaces "open", compressed int8 then int4, and "p",
// with private prefixes and scopes alice and bob; a 1 MiB host tier). Checked
// besides "no crash, no hang, no sanitizer report":
//  - every error carries a message, and so does every refused record;
//  - the file is gone afterwards (read once), whether or not it loaded;
//  - the store holds exactly the blocks Load says it stored, and every one of them passes its
//    CRC32C, is of a size its profile allows at its level, and (encoded) is a whole container.
// Thread-compatible (one fuzzing thread).
#ifndef PROXIMA_TESTS_FUZZ_SNAPSHOT_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_SNAPSHOT_FUZZ_BODY_H_

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "daemon/metrics.h"
#include "daemon/snapshot.h"
#include "daemon/tier_service.h"
#include "kernels/codec.h"

namespace proxima::daemon::fuzz {

// The configuration the seeds are loaded with, and most were written with
// (tests/fuzz/make_request_seeds.cc); `open_levels`: the hierarchy of "open" (plan texts).
inline DaemonConfig SnapshotFuzzConfig(const std::vector<std::string>& open_levels = {"int8",
                                                                                      "int4"}) {
  setenv("PROXIMA_SNAPSHOT_FUZZ_ALICE", "alice-snapshot-fuzz-token-0123456789", 0);
  setenv("PROXIMA_SNAPSHOT_FUZZ_BOB", "bob-snapshot-fuzz-token-0123456789", 0);
  DaemonConfig config;
  config.host_tier.capacity_bytes = 1 << 20;
  config.namespaces = {{"open"},
                       {"p",
                        {{"alice", "", "PROXIMA_SNAPSHOT_FUZZ_ALICE", TokenAccess::kReadWrite, ""},
                         {"bob", "", "PROXIMA_SNAPSHOT_FUZZ_BOB", TokenAccess::kReadWrite, ""}},
                        /*private_prefixes=*/true}};
  CompressionConfig& c = config.namespaces[0].compression;
  c.enabled = true;
  c.levels = open_levels;
  for (const std::string& text : open_levels) {
    absl::StatusOr<codec::CodecPlan> plan = codec::ParseCodecPlan(text);
    if (!plan.ok()) std::abort();
    c.plans.push_back(*plan);
  }
  return config;
}

// Returns true when the input loaded at least one block.
inline bool RunSnapshotInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    char dir[] = "/tmp/proxima-snapshot-fuzz-XXXXXX";
    if (::mkdtemp(dir) == nullptr) std::abort();
    return std::string(dir) + "/snapshot";
  }();
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!f) std::abort();
  }
  metrics::Registry registry;
  absl::StatusOr<std::unique_ptr<TierService>> core =
      TierService::Create(SnapshotFuzzConfig(), &registry);
  if (!core.ok()) std::abort();
  (*core)->tierer().Stop();  // "open" compresses: nothing may change the blocks under the checks
  absl::StatusOr<snapshot::Loaded> loaded = snapshot::Load(**core, path);
  if (::access(path.c_str(), F_OK) == 0) std::abort();  // read once, loaded or not
  if (!loaded.ok()) {
    if (loaded.status().message().empty()) std::abort();
    return false;
  }
  for (const std::string& p : loaded->problems) {
    if (p.empty()) std::abort();
  }
  BlockStore& store = (*core)->store();
  if (store.blocks() != loaded->blocks) std::abort();
  uint64_t seen = 0;
  for (size_t shard = 0; shard < store.num_shards(); ++shard) {
    for (const BlockId& id : store.ShardIds(shard)) {
      std::optional<BlockStore::ReadBlock> r = store.Read(id);  // checks the CRC32C
      if (!r) std::abort();
      absl::StatusOr<uint64_t> block_bytes =
          (*core)->RegisteredBlockBytes(id.namespace_index, id.profile_id);
      if (!block_bytes.ok() || !CheckStoredSize(r->level, r->bytes.size(), *block_bytes).ok() ||
          !CheckStoredContainer(r->level, r->bytes, *block_bytes).ok()) {
        std::abort();
      }
      ++seen;
    }
  }
  if (seen != loaded->blocks || store.crc_failures() != 0) std::abort();
  return loaded->blocks > 0;
}

}  // namespace proxima::daemon::fuzz

#endif  // PROXIMA_TESTS_FUZZ_SNAPSHOT_FUZZ_BODY_H_
