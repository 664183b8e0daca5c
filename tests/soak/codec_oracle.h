// CodecOracle: what proximad may give back for a block of real KV it has compressed, exactly.
//
// The daemon's quantizing encoders are deterministic and bit-identical on every CPU path, so the
// bytes of a block the tierer took down its namespace's hierarchy are known in advance: a block
// put raw may sit at level 0 (its own bytes) or at any level it may reach, got there by one of
// the paths the tierer takes (straight from raw to a deeper level, or level after level, each
// step encoding the previous one's decoded bytes: daemon/tierer.cc CompressOne), each step with
// the plan the tierer takes for the block's model (CodecPlan::ForModel) and its
// first-block flag. The oracle enumerates those paths once per (model, content, first-block) and
// keeps a hash of every encoding and every decoding on them, so a soak can check each Get,
// Decompress and GetStored answer for exact equality with one of them instead of within an
// error bound.
//
// Thread-safe: entries are computed on first use, each once.
#ifndef PROXIMA_TESTS_SOAK_CODEC_ORACLE_H_
#define PROXIMA_TESTS_SOAK_CODEC_ORACLE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "kernels/codec.h"
#include "kernels/kv_file.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::testing {

class CodecOracle {
 public:
  // `kv_file`: a real KV dump (kernels/kv_file.h); `levels`: the namespace's hierarchy as the
  // daemon's config gives it, safest first; `tokens`: tokens per block; `contents`: how many
  // distinct blocks (token offsets into the dump) the workload draws from.
  static absl::StatusOr<std::unique_ptr<CodecOracle>> Create(const std::string& kv_file,
                                                             const std::vector<std::string>& levels,
                                                             uint32_t tokens, uint32_t contents);

  // The models blocks are put as: the dump's own geometry with its RoPE base, and the same bytes
  // read as heads of 1.5x the head dim (not a power of two: k4v3 rotates V in chunks there).
  size_t num_models() const { return models_.size(); }
  const v1::ModelProfile& model(size_t m) const { return models_[m].profile; }
  uint64_t block_bytes() const { return models_[0].geometry.RawBytes(); }
  uint32_t num_contents() const { return static_cast<uint32_t>(offsets_.size()); }
  uint8_t num_levels() const { return static_cast<uint8_t>(plans_.size()); }

  // The raw bytes of content `content` (the same for every model).
  void Fill(uint32_t content, std::span<std::byte> out) const;

  // Whether `bytes` is what a Get or Decompress may return for that block when it may sit at
  // levels 0..max_level: its raw bytes, or one of its encodings decoded. An error when the
  // oracle itself cannot encode the block.
  absl::StatusOr<bool> IsDecoded(size_t model, uint32_t content, bool first, uint8_t max_level,
                                 std::span<const std::byte> bytes);
  // Whether `bytes` is what GetStored may return at `level` (0: raw) for that block.
  absl::StatusOr<bool> IsStored(size_t model, uint32_t content, bool first, uint8_t max_level,
                                uint32_t level, std::span<const std::byte> bytes);

  // Encodings computed so far (one per path step), for the report.
  uint64_t encodings() const;

 private:
  struct Model {
    v1::ModelProfile profile;
    codec::BlockGeometry geometry;
  };
  // One step on a path: the level it ends at, and hashes of its encoding and that decoded.
  struct Node {
    uint8_t level = 0;
    uint64_t stored_hash = 0;
    uint64_t decoded_hash = 0;
  };
  struct Entry {
    absl::once_flag once;
    absl::Status status;
    uint64_t raw_hash = 0;
    std::vector<Node> nodes;
  };

  CodecOracle() = default;
  Entry& EntryFor(size_t model, uint32_t content, bool first);
  void Compute(size_t model, uint32_t content, bool first, Entry* e);
  void Walk(size_t model, bool first, uint8_t level, const std::string& raw, Entry* e);

  codec::KvTensor tensor_;
  uint32_t tokens_ = 0;
  std::vector<uint32_t> offsets_;  // token offset of each content
  std::vector<Model> models_;
  std::vector<codec::CodecPlan> plans_;  // level k is plans_[k - 1]

  mutable Mutex mu_;
  std::map<std::tuple<size_t, uint32_t, bool>, std::unique_ptr<Entry>> entries_
      ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> encodings_{0};
};

}  // namespace proxima::testing

#endif  // PROXIMA_TESTS_SOAK_CODEC_ORACLE_H_
