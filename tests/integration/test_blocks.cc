#include "tests/integration/test_blocks.h"

#include "client/test_pattern.h"
#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace proxima::testing {

using client::BlockKey;
using client::Client;
using client::ClientOptions;
using client::Profile;

v1::ModelProfile TestModel(uint32_t tokens, std::string fingerprint) {
  v1::ModelProfile p;
  p.set_num_layers(4);
  p.set_num_kv_heads(8);
  p.set_head_dim(128);
  p.set_tokens_per_block(tokens);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_fingerprint(fingerprint);
  return p;
}

std::unique_ptr<Client> MustConnect(const std::string& target, const std::string& ns,
                                    const std::string& token) {
  ClientOptions options;
  options.target = target;
  options.namespace_name = ns;
  options.token = token;
  options.call_timeout = absl::Seconds(20);
  auto c = Client::Connect(options);
  EXPECT_OK(c.status());
  return c.ok() ? *std::move(c) : nullptr;
}

Blocks MakeBlocks(uint64_t seed, size_t first, size_t count, uint64_t block_bytes) {
  Blocks b;
  b.keys = client::TestKeyChain(seed, first, count);
  for (size_t i = 0; i < count; ++i) {
    b.data.emplace_back(block_bytes);
    client::FillTestBlock(seed, first + i, b.data.back());
  }
  return b;
}

size_t GetAndCheck(Client& c, const Profile& p, uint64_t seed, size_t first, size_t count) {
  std::vector<BlockKey> keys = client::TestKeyChain(seed, first, count);
  std::vector<std::vector<std::byte>> out(count, std::vector<std::byte>(p.block_bytes));
  std::vector<std::span<std::byte>> spans(out.begin(), out.end());
  auto found = c.Get(p, keys, spans);
  EXPECT_OK(found.status());
  if (!found.ok()) return 0;
  size_t hits = 0;
  for (size_t i = 0; i < count; ++i) {
    if (!(*found)[i]) continue;
    ++hits;
    EXPECT_TRUE(client::IsTestBlock(seed, first + i, out[i])) << "block " << first + i;
  }
  return hits;
}

}  // namespace proxima::testing
