#include "tools/replay/trace.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/replay/replay.h"

namespace proxima::replay {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ParseTraceLine, ReadsEveryField) {
  auto r = ParseTraceLine(
      R"({"timestamp": 27, "input_length": 1100, "output_length": 5, "hash_ids": [0, 14, 15]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->timestamp_ms, 27u);
  EXPECT_EQ(r->input_length, 1100u);
  EXPECT_EQ(r->output_length, 5u);
  EXPECT_THAT(r->hash_ids, ElementsAre(0u, 14u, 15u));
}

TEST(ParseTraceLine, BadInputNamesTheFieldAndValue) {
  EXPECT_THAT(ParseTraceLine("{not json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a JSON object")));
  EXPECT_THAT(ParseTraceLine(R"({"timestamp": 0, "input_length": 1, "output_length": 1})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'hash_ids' is missing")));
  EXPECT_THAT(
      ParseTraceLine(R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []})"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a non-empty list")));
  EXPECT_THAT(
      ParseTraceLine(
          R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [3, -1]})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("'hash_ids[1]' has value -1; expected a non-negative integer")));
  EXPECT_THAT(ParseTraceLine(
                  R"({"timestamp": 0.5, "input_length": 1, "output_length": 1, "hash_ids": [3]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'timestamp' has value 0.5")));
  EXPECT_THAT(
      ParseTraceLine(
          R"({"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [3]})"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'input_length' is not a number")));
}

TEST(ReadTrace, ErrorsNameTheFileAndLine) {
  std::string path = ::testing::TempDir() + "/bad_trace.jsonl";
  {
    std::ofstream out(path);
    out << R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})"
        << "\n";
    out << R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0, "a"]})"
        << "\n";
  }
  EXPECT_THAT(ReadTrace(path, {}), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("bad_trace.jsonl:2: field 'hash_ids[1]'")));
  EXPECT_THAT(ReadTrace(path + ".absent", {}), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(ReadTrace(path, {.sample_one_in = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sample_one_in is 0")));
  std::remove(path.c_str());
}

// The shared data README states these facts about the whole trace; the reader must agree.
TEST(ReadTrace, WholeMooncakeTraceMatchesItsReadme) {
  auto trace = ReadTrace(PROXIMA_TRACE_PATH, {});
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->requests.size(), 12031u);
  ReuseFacts facts = MeasureReuse(trace->requests);
  EXPECT_EQ(facts.block_refs, 288500u);
  EXPECT_EQ(facts.distinct_blocks, 182790u);
  EXPECT_NEAR(facts.infinite_cache_hit_ratio, 0.366, 0.0005);
}

// Sampling keeps whole prefix families: every request whose second id is shared with a kept
// request is kept too, so reuse inside a family is never cut.
TEST(ReadTrace, SamplingKeepsWholePrefixFamilies) {
  auto all = ReadTrace(PROXIMA_TRACE_PATH, {});
  auto sampled = ReadTrace(PROXIMA_TRACE_PATH, {.sample_one_in = 16});
  ASSERT_TRUE(all.ok() && sampled.ok());
  absl::flat_hash_set<uint64_t> kept_families;
  for (const auto& r : sampled->requests) {
    if (r.hash_ids.size() > 1) kept_families.insert(r.hash_ids[1]);
  }
  size_t expected = 0;
  for (const auto& r : all->requests) {
    if (r.hash_ids.size() > 1 && kept_families.contains(r.hash_ids[1])) ++expected;
  }
  size_t multi_block = 0;
  for (const auto& r : sampled->requests) multi_block += r.hash_ids.size() > 1;
  EXPECT_EQ(multi_block, expected);
  // About 1 in 16 of the requests (families differ in size, so loosely).
  EXPECT_GT(sampled->requests.size(), all->requests.size() / 32);
  EXPECT_LT(sampled->requests.size(), all->requests.size() / 8);

  auto first = ReadTrace(PROXIMA_TRACE_PATH, {.sample_one_in = 16, .max_requests = 10});
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->requests.size(), 10u);
  for (size_t i = 0; i < 10; ++i)
    EXPECT_EQ(first->requests[i].hash_ids, sampled->requests[i].hash_ids);

  // In parts (a replay across a restart): the sample's requests from the 10th on, in order.
  auto rest = ReadTrace(PROXIMA_TRACE_PATH,
                        {.sample_one_in = 16, .first_request = 10, .max_requests = 5});
  ASSERT_TRUE(rest.ok());
  ASSERT_EQ(rest->requests.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(rest->requests[i].hash_ids, sampled->requests[10 + i].hash_ids);
  auto after_all = ReadTrace(PROXIMA_TRACE_PATH,
                             {.sample_one_in = 16, .first_request = sampled->requests.size()});
  ASSERT_TRUE(after_all.ok());
  EXPECT_TRUE(after_all->requests.empty());
}

TEST(BlockSource, PayloadsAreRealKvSlicesChosenByTheId) {
  auto source = BlockSource::Create(PROXIMA_KV_PATH, 16);
  ASSERT_TRUE(source.ok()) << source.status();
  const BlockSource& s = **source;
  EXPECT_EQ(s.block_bytes(), 2u * 30 * 16 * 3 * 64 * 2);  // SmolLM2-135M, 16 tokens, bf16
  EXPECT_EQ(s.FirstToken(12345, 0), 0u);                  // the sink block
  std::vector<uint32_t> starts;
  for (uint64_t id = 1; id < 200; ++id) {
    uint32_t t0 = s.FirstToken(id, 3);
    EXPECT_GE(t0, 16u);
    EXPECT_LE(t0, 256u - 16u);
    EXPECT_EQ(t0, s.FirstToken(id, 3));
    starts.push_back(t0);
  }
  EXPECT_GT(absl::flat_hash_set<uint32_t>(starts.begin(), starts.end()).size(), 100u);

  std::vector<std::byte> a(s.block_bytes()), b(s.block_bytes()), c(s.block_bytes());
  ASSERT_TRUE(s.Fill(7, 2, a).ok());
  ASSERT_TRUE(s.Fill(7, 2, b).ok());
  EXPECT_EQ(a, b);
  uint64_t other = 8;
  while (s.FirstToken(other, 2) == s.FirstToken(7, 2)) ++other;
  ASSERT_TRUE(s.Fill(other, 2, c).ok());
  EXPECT_NE(a, c);
  EXPECT_NE(BlockSource::Key(7), BlockSource::Key(8));

  EXPECT_THAT(BlockSource::Create(PROXIMA_KV_PATH, 200),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens_per_block is 200")));
  EXPECT_THAT(BlockSource::Create(PROXIMA_KV_PATH ".absent", 16),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

}  // namespace
}  // namespace proxima::replay
