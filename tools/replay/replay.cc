#include "tools/replay/replay.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/test_pattern.h"
#include "common/status_macros.h"
#include "kernels/error_metrics.h"
#include "proto/model_profile.h"

namespace proxima::replay {
namespace {

// Chain seed of replay keys: TestKeyChain(kKeySeedBase + id) never collides with the small
// seeds proximactl and the tests use, and distinct ids give distinct keys.
constexpr uint64_t kKeySeedBase = 0x7265706c61790000ull;  // "replay\0\0"

// Fixed mix of an id into a slice choice (the same in every process).
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

BlockSource::BlockSource(codec::KvTensor kv, uint32_t tokens_per_block)
    : kv_(std::move(kv)),
      tokens_per_block_(tokens_per_block),
      geometry_(kv_.BlockShape(tokens_per_block)) {}

absl::StatusOr<std::unique_ptr<BlockSource>> BlockSource::Create(const std::string& kv_file,
                                                                 uint32_t tokens_per_block) {
  PROXIMA_ASSIGN_OR_RETURN(codec::KvTensor kv, codec::ReadKvFile(kv_file));
  if (tokens_per_block == 0 || kv.num_tokens < 2ull * tokens_per_block) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens_per_block is ", tokens_per_block, "; the KV file '", kv_file, "' holds ",
        kv.num_tokens, " tokens, expected 1 <= tokens_per_block <= ", kv.num_tokens / 2));
  }
  PROXIMA_RETURN_IF_ERROR(kv.BlockShape(tokens_per_block).Validate());
  return std::unique_ptr<BlockSource>(new BlockSource(std::move(kv), tokens_per_block));
}

v1::ModelProfile BlockSource::Profile() const {
  v1::ModelProfile p = ProfileOf(geometry_);
  p.set_fingerprint(absl::StrCat("proxima_replay L", geometry_.num_layers, " H",
                                 geometry_.num_kv_heads, " D", geometry_.head_dim));
  return p;
}

client::BlockKey BlockSource::Key(uint64_t hash_id) {
  return client::TestKeyChain(kKeySeedBase + hash_id, 0, 1)[0];
}

uint32_t BlockSource::FirstToken(uint64_t hash_id, size_t position) const {
  if (position == 0) return 0;
  // Slices start in [T, num_tokens - T]: never the sink slice, always whole.
  uint64_t choices = kv_.num_tokens - 2ull * tokens_per_block_ + 1;
  return tokens_per_block_ + static_cast<uint32_t>(Mix(hash_id) % choices);
}

absl::Status BlockSource::Fill(uint64_t hash_id, size_t position, std::span<std::byte> out) const {
  return kv_.ExtractBlock(FirstToken(hash_id, position), tokens_per_block_, out);
}

absl::StatusOr<ReplayCounts> RunReplay(client::Client& client, const client::Profile& profile,
                                       const BlockSource& source,
                                       const std::vector<TraceRequest>& requests,
                                       const ReplayOptions& options) {
  const size_t block_bytes = source.block_bytes();
  if (profile.block_bytes != block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("profile block_bytes is ", profile.block_bytes,
                                                   "; the block source makes blocks of ",
                                                   block_bytes, " bytes"));
  }
  ReplayCounts counts;
  std::vector<client::BlockKey> chain;
  std::vector<std::byte> got;  // blocks returned by Get, back to back
  std::vector<std::byte> expected(block_bytes);
  std::vector<std::byte> to_put;  // blocks to Put, back to back
  const auto start = std::chrono::steady_clock::now();

  for (const TraceRequest& request : requests) {
    const size_t n = request.hash_ids.size();
    ++counts.requests;
    counts.block_refs += n;
    chain.clear();
    for (uint64_t id : request.hash_ids) chain.push_back(BlockSource::Key(id));

    PROXIMA_ASSIGN_OR_RETURN(size_t present, client.Lookup(profile, chain));
    counts.lookup_hits += present;

    // Get the leading blocks the daemon holds; the hit run ends at the first that does not
    // come back intact (an engine can only use a contiguous prefix).
    size_t hits = 0;
    if (present > 0) {
      got.resize(present * block_bytes);
      std::vector<std::span<std::byte>> out;
      out.reserve(present);
      for (size_t i = 0; i < present; ++i)
        out.emplace_back(got.data() + i * block_bytes, block_bytes);
      PROXIMA_ASSIGN_OR_RETURN(std::vector<bool> found,
                               client.Get(profile, std::span(chain).first(present), out));
      for (; hits < present && found[hits]; ++hits) {
        PROXIMA_RETURN_IF_ERROR(source.Fill(request.hash_ids[hits], hits, expected));
        std::span<const std::byte> block = out[hits];
        if (std::memcmp(block.data(), expected.data(), block_bytes) == 0) {
          ++counts.exact;
          continue;
        }
        if (options.max_rel_l2 > 0) {
          PROXIMA_ASSIGN_OR_RETURN(
              codec::ErrorSums sums,
              codec::MeasureBlockError(source.geometry(), expected, block, /*num_probes=*/1));
          codec::ErrorFigures e = codec::Finish(sums);
          counts.worst_k_rel_l2 = std::max(counts.worst_k_rel_l2, e.k_rel_l2);
          counts.worst_v_rel_l2 = std::max(counts.worst_v_rel_l2, e.v_rel_l2);
          if (e.k_rel_l2 <= options.max_rel_l2 && e.v_rel_l2 <= options.max_rel_l2) {
            ++counts.lossy_within_bound;
            continue;
          }
        }
        ++counts.bad;
      }
      counts.get_missing += present - hits;
      counts.bytes_got += hits * block_bytes;
    }
    counts.hits += hits;

    // Put the rest of the chain: what the engine computed in prefill.
    if (hits < n) {
      const size_t misses = n - hits;
      to_put.resize(misses * block_bytes);
      std::vector<std::span<const std::byte>> blocks;
      std::vector<int64_t> positions;  // so the daemon knows the sink block (position 0)
      blocks.reserve(misses);
      positions.reserve(misses);
      for (size_t i = 0; i < misses; ++i) {
        std::span<std::byte> slot(to_put.data() + i * block_bytes, block_bytes);
        PROXIMA_RETURN_IF_ERROR(source.Fill(request.hash_ids[hits + i], hits + i, slot));
        blocks.push_back(slot);
        positions.push_back(static_cast<int64_t>(hits + i));
      }
      PROXIMA_ASSIGN_OR_RETURN(
          std::vector<client::PutOutcome> outcomes,
          client.Put(profile, std::span(chain).subspan(hits), blocks, {.positions = positions}));
      for (client::PutOutcome o : outcomes) {
        switch (o) {
          case client::PutOutcome::kStored:
            ++counts.puts_stored;
            break;
          case client::PutOutcome::kAlreadyPresent:
            ++counts.puts_already_present;
            break;
          case client::PutOutcome::kNoSpace:
            ++counts.puts_no_space;
            break;
        }
      }
      counts.bytes_put += misses * block_bytes;
    }
  }
  counts.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return counts;
}

}  // namespace proxima::replay
