#include "tests/soak/codec_oracle.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace proxima::testing {
namespace {

uint64_t HashOf(std::span<const std::byte> bytes) {
  return absl::Hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CodecOracle>> CodecOracle::Create(
    const std::string& kv_file, const std::vector<std::string>& levels, uint32_t tokens,
    uint32_t contents) {
  std::unique_ptr<CodecOracle> o(new CodecOracle());
  PROXIMA_ASSIGN_OR_RETURN(o->tensor_, codec::ReadKvFile(kv_file));
  o->tokens_ = tokens;
  if (tokens == 0 || o->tensor_.num_tokens < tokens) {
    return absl::InvalidArgumentError(absl::StrCat("the KV dump ", kv_file, " holds ",
                                                   o->tensor_.num_tokens, " tokens; blocks need ",
                                                   tokens));
  }
  const uint32_t distinct = o->tensor_.num_tokens - tokens + 1;
  if (contents == 0 || contents > distinct) {
    return absl::InvalidArgumentError(absl::StrCat("contents is ", contents,
                                                   "; the dump gives 1 to ", distinct,
                                                   " distinct blocks of ", tokens, " tokens"));
  }
  // Offsets spread over the whole dump (positions early and late in the sequence).
  for (uint32_t i = 0; i < contents; ++i) {
    o->offsets_.push_back(
        static_cast<uint32_t>(uint64_t{i} * (distinct - 1) / std::max(1u, contents - 1)));
  }
  for (const std::string& text : levels) {
    PROXIMA_ASSIGN_OR_RETURN(codec::CodecPlan plan, codec::ParseCodecPlan(text));
    o->plans_.push_back(std::move(plan));
  }

  // The dump's own model, with SmolLM2's RoPE base (the dump's model), and the same bytes as
  // heads of 1.5x the dim where the head count allows it.
  Model own;
  own.geometry = o->tensor_.BlockShape(tokens);
  own.profile.set_num_layers(own.geometry.num_layers);
  own.profile.set_num_kv_heads(own.geometry.num_kv_heads);
  own.profile.set_head_dim(own.geometry.head_dim);
  own.profile.set_tokens_per_block(tokens);
  own.profile.set_dtype(v1::DTYPE_BF16);
  own.profile.set_rope_theta(100000);
  own.profile.set_fingerprint("soak-kv-own-heads");
  o->models_.push_back(own);
  if (own.geometry.num_kv_heads % 3 == 0 && own.geometry.head_dim % 2 == 0) {
    Model wide = own;
    wide.geometry.num_kv_heads = own.geometry.num_kv_heads / 3 * 2;
    wide.geometry.head_dim = own.geometry.head_dim / 2 * 3;
    wide.profile.set_num_kv_heads(wide.geometry.num_kv_heads);
    wide.profile.set_head_dim(wide.geometry.head_dim);
    wide.profile.set_fingerprint("soak-kv-wide-heads");
    o->models_.push_back(wide);
  }
  return o;
}

void CodecOracle::Fill(uint32_t content, std::span<std::byte> out) const {
  // Create() checked the offsets; ExtractBlock cannot fail for them.
  (void)tensor_.ExtractBlock(offsets_[content], tokens_, out);
}

uint64_t CodecOracle::encodings() const { return encodings_.load(std::memory_order_relaxed); }

CodecOracle::Entry& CodecOracle::EntryFor(size_t model, uint32_t content, bool first) {
  Entry* e;
  {
    MutexLock lock(&mu_);
    std::unique_ptr<Entry>& slot = entries_[{model, content, first}];
    if (slot == nullptr) slot = std::make_unique<Entry>();
    e = slot.get();
  }
  absl::call_once(e->once, [&] { Compute(model, content, first, e); });
  return *e;
}

void CodecOracle::Compute(size_t model, uint32_t content, bool first, Entry* e) {
  std::string raw(block_bytes(), '\0');
  Fill(content, std::as_writable_bytes(std::span<char>(raw.data(), raw.size())));
  e->raw_hash = HashOf(AsBytes(raw));
  Walk(model, first, 0, raw, e);
}

// Every path from `level` (whose decoded bytes are `from`) to each deeper level.
void CodecOracle::Walk(size_t model, bool first, uint8_t level, const std::string& from, Entry* e) {
  const Model& m = models_[model];
  for (uint8_t to = level + 1; to <= plans_.size(); ++to) {
    const codec::CodecPlan plan = plans_[to - 1].ForModel(m.profile.rope_theta());
    std::string encoded;
    absl::Status s = codec::EncodeBlock(m.geometry, plan, first, AsBytes(from), {}, &encoded);
    encodings_.fetch_add(1, std::memory_order_relaxed);
    std::string decoded(from.size(), '\0');
    if (s.ok()) {
      s = codec::DecodeBlock(AsBytes(encoded), std::as_writable_bytes(std::span<char>(
                                                   decoded.data(), decoded.size())));
    }
    if (!s.ok()) {
      e->status = absl::InternalError(
          absl::StrCat("the oracle's encode of level ", int(to), " failed: ", s.message()));
      return;
    }
    e->nodes.push_back({to, HashOf(AsBytes(encoded)), HashOf(AsBytes(decoded))});
    Walk(model, first, to, decoded, e);
  }
}

absl::StatusOr<bool> CodecOracle::IsDecoded(size_t model, uint32_t content, bool first,
                                            uint8_t max_level, std::span<const std::byte> bytes) {
  Entry& e = EntryFor(model, content, first);
  PROXIMA_RETURN_IF_ERROR(e.status);
  if (bytes.size() != block_bytes()) return false;
  const uint64_t h = HashOf(bytes);
  if (h == e.raw_hash) return true;
  for (const Node& n : e.nodes) {
    if (n.level <= max_level && n.decoded_hash == h) return true;
  }
  return false;
}

absl::StatusOr<bool> CodecOracle::IsStored(size_t model, uint32_t content, bool first,
                                           uint8_t max_level, uint32_t level,
                                           std::span<const std::byte> bytes) {
  Entry& e = EntryFor(model, content, first);
  PROXIMA_RETURN_IF_ERROR(e.status);
  if (level > max_level) return false;
  const uint64_t h = HashOf(bytes);
  if (level == 0) return bytes.size() == block_bytes() && h == e.raw_hash;
  for (const Node& n : e.nodes) {
    if (n.level == level && n.stored_hash == h) return true;
  }
  return false;
}

}  // namespace proxima::testing
