// Trace replay against a running proximad: each trace request looks up its chain of block keys,
// gets the leading blocks the daemon holds (checking every byte that comes back) and puts the
// rest, exactly as a prefix-caching inference engine would, one request after the other.
//
// Block payloads are real KV (BlockSource): every hash id of the trace maps to a fixed slice of
// `tokens_per_block` consecutive tokens of a `.pkv` dump of a real model (kernels/kv_file.h).
// Blocks are scaled down from the trace's 512 tokens to `tokens_per_block` tokens; the reuse
// structure (which request reuses which block, in which order) is the trace's, unchanged.
//
// Thread-safety: a BlockSource is immutable after Create() and may be shared; RunReplay runs the
// requests sequentially on the calling thread (order matters for a cache).
#ifndef PROXIMA_TOOLS_REPLAY_REPLAY_H_
#define PROXIMA_TOOLS_REPLAY_REPLAY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "kernels/kv_file.h"
#include "tools/replay/trace.h"

namespace proxima::replay {

class BlockSource {
 public:
  // Reads the dump. kInvalidArgument when it holds fewer than 2 * tokens_per_block tokens.
  static absl::StatusOr<std::unique_ptr<BlockSource>> Create(const std::string& kv_file,
                                                             uint32_t tokens_per_block);

  // The profile to register: the dump's geometry at `tokens_per_block` tokens per block.
  v1::ModelProfile Profile() const;
  const codec::BlockGeometry& geometry() const { return geometry_; }
  size_t block_bytes() const { return geometry_.RawBytes(); }

  // The block key of trace id `hash_id` (ids name prefixes already, so one id is one key).
  static client::BlockKey Key(uint64_t hash_id);

  // First token of the slice that holds the payload of `hash_id` at chain position `position`.
  // Position 0 (a sequence's first block, where the attention sinks are) always gets the dump's
  // first tokens [0, T); later positions get a slice in [T, num_tokens - T], chosen by a fixed
  // hash of the id, so that the payload is a function of the id alone.
  uint32_t FirstToken(uint64_t hash_id, size_t position) const;

  // Writes the payload of `hash_id` at chain `position` into `out` (block_bytes() bytes).
  absl::Status Fill(uint64_t hash_id, size_t position, std::span<std::byte> out) const;

 private:
  BlockSource(codec::KvTensor kv, uint32_t tokens_per_block);

  const codec::KvTensor kv_;
  const uint32_t tokens_per_block_;
  const codec::BlockGeometry geometry_;
};

struct ReplayOptions {
  // 0: every block that comes back must be byte-exact (raw or lossless storage). Above 0: a
  // block that differs counts as lossy-good when its K and V relative L2 errors
  // (kernels/error_metrics.h) are both within this bound, and as bad otherwise.
  double max_rel_l2 = 0;
};

struct ReplayCounts {
  uint64_t requests = 0;
  uint64_t block_refs = 0;          // hash ids replayed
  uint64_t lookup_hits = 0;         // leading keys the daemon reported present
  uint64_t hits = 0;                // of those, blocks Get returned intact (the hit count)
  uint64_t get_missing = 0;         // reported present by Lookup, then not returned by Get
  uint64_t exact = 0;               // hits that came back byte-exact
  uint64_t lossy_within_bound = 0;  // hits that differ, within max_rel_l2
  uint64_t bad = 0;                 // hits that differ beyond the bound (wrong bytes)
  double worst_k_rel_l2 = 0;        // over the lossy hits
  double worst_v_rel_l2 = 0;
  uint64_t puts_stored = 0;
  uint64_t puts_already_present = 0;
  uint64_t puts_no_space = 0;
  uint64_t bytes_put = 0;  // block bytes sent by Put
  uint64_t bytes_got = 0;  // block bytes returned by Get
  double wall_seconds = 0;

  double hit_ratio() const { return block_refs == 0 ? 0 : static_cast<double>(hits) / block_refs; }
  // Prefill tokens an engine would not recompute, in the trace's 512-token blocks.
  uint64_t prefill_tokens_saved() const { return hits * kTraceTokensPerBlock; }
};

// Replays `requests` in order through `client` (profile registered from `source`). Returns an
// error when a call fails; wrong bytes are counted (ReplayCounts::bad), not returned as errors.
absl::StatusOr<ReplayCounts> RunReplay(client::Client& client, const client::Profile& profile,
                                       const BlockSource& source,
                                       const std::vector<TraceRequest>& requests,
                                       const ReplayOptions& options);

}  // namespace proxima::replay

#endif  // PROXIMA_TOOLS_REPLAY_REPLAY_H_
