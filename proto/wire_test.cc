#include "proto/wire.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include <random>

#include "common/crc32c.h"
#include "common/testing/random_bytes.h"
#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::wire {
namespace {

using ::proxima::testing::RandomBytes;

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string s;
  for (const auto& sl : slices) s.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return s;
}

grpc::ByteBuffer FromString(const std::string& s) {
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

TEST(WireTest, WriterProducesAGetResponseThatProtobufParses) {
  auto a = RandomBytes(100000, 1), b = RandomBytes(7, 2);
  auto pin = std::make_shared<int>(0);
  GetResponseWriter w;
  w.AddHit(a, Crc32c(a), pin);
  w.AddMiss();
  w.AddHit(b, Crc32c(b), pin);
  grpc::ByteBuffer buffer = w.Finish();
  EXPECT_GT(pin.use_count(), 1);  // the slices hold the pin until the buffer goes
  v1::GetResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  ASSERT_EQ(parsed.results_size(), 3);
  EXPECT_TRUE(parsed.results(0).found());
  EXPECT_EQ(parsed.results(0).data(), std::string(reinterpret_cast<char*>(a.data()), a.size()));
  EXPECT_EQ(parsed.results(0).crc32c(), Crc32c(a));
  EXPECT_FALSE(parsed.results(1).found());
  EXPECT_EQ(parsed.results(2).data().size(), 7u);
  buffer.Clear();
  EXPECT_EQ(pin.use_count(), 1);
}

TEST(WireTest, ParserReadsWhatProtobufWritesAndChecksCrc) {
  auto a = RandomBytes(4096, 3), b = RandomBytes(4096, 4);
  v1::GetResponse msg;
  auto* r0 = msg.add_results();
  r0->set_found(true);
  r0->set_crc32c(Crc32c(a));  // field order on the wire differs from the writer's: fine
  r0->set_data(reinterpret_cast<char*>(a.data()), a.size());
  msg.add_results();
  auto* r2 = msg.add_results();
  r2->set_found(true);
  r2->set_data(reinterpret_cast<char*>(b.data()), b.size());
  r2->set_crc32c(Crc32c(b) ^ 1);  // corrupt
  std::vector<std::byte> o0(4096), o1(4096), o2(4096);
  std::vector<std::span<std::byte>> out = {o0, o1, o2};
  std::vector<GetResult> results;
  ASSERT_OK(ParseGetResponse(FromString(msg.SerializeAsString()), out, &results));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].intact);
  EXPECT_EQ(o0, a);
  EXPECT_FALSE(results[1].found);
  EXPECT_TRUE(results[2].found);
  EXPECT_FALSE(results[2].intact);
}

TEST(WireTest, WrongSizedDataIsNotIntact) {
  auto a = RandomBytes(100, 5);
  GetResponseWriter w;
  w.AddHit(a, Crc32c(a), nullptr);
  std::vector<std::byte> o(99);
  std::vector<std::span<std::byte>> out = {o};
  std::vector<GetResult> results;
  ASSERT_OK(ParseGetResponse(w.Finish(), out, &results));
  EXPECT_TRUE(results[0].found);
  EXPECT_FALSE(results[0].intact);
}

TEST(WireTest, EveryTruncationAndByteFlipIsHandledWithoutCrashing) {
  auto a = RandomBytes(300, 6);
  GetResponseWriter w;
  w.AddHit(a, Crc32c(a), nullptr);
  w.AddMiss();
  std::string full = Flatten(w.Finish());
  std::vector<std::byte> o0(300), o1(300);
  std::vector<std::span<std::byte>> out = {o0, o1};
  for (size_t cut = 0; cut < full.size(); ++cut) {
    std::vector<GetResult> results;
    absl::Status s = ParseGetResponse(FromString(full.substr(0, cut)), out, &results);
    EXPECT_FALSE(s.ok()) << "truncated at " << cut;
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string bad = full;
    bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
    std::vector<GetResult> results;
    absl::Status s = ParseGetResponse(FromString(bad), out, &results);
    if (s.ok() && results[0].intact) EXPECT_EQ(o0, a);  // never "intact" with wrong bytes
  }
}

TEST(WireTest, PutRequestEncodingInteroperatesWithProtobuf) {
  auto a = RandomBytes(70000, 8), b = RandomBytes(5, 9);
  std::vector<std::array<uint8_t, 32>> keys(2);
  keys[0].fill(1);
  keys[1].fill(2);
  std::vector<std::span<const std::byte>> blocks = {a, b};
  grpc::ByteBuffer buffer = EncodePutRequest("tenant", 0x1122334455667788ull, keys, blocks);
  v1::PutRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(parsed.namespace_name(), "tenant");
  EXPECT_EQ(parsed.profile_id(), 0x1122334455667788ull);
  ASSERT_EQ(parsed.blocks_size(), 2);
  EXPECT_EQ(parsed.blocks(0).key(), std::string(32, '\x01'));
  EXPECT_EQ(parsed.blocks(0).data().size(), a.size());
  EXPECT_EQ(parsed.blocks(0).crc32c(), Crc32c(a));
  EXPECT_TRUE(parsed.blocks(1).has_crc32c());

  // And the reader parses what protobuf writes, in protobuf's field order.
  parsed.mutable_blocks(1)->clear_crc32c();
  PutRequestReader reader;
  ASSERT_OK(reader.Parse(FromString(parsed.SerializeAsString()), 2));
  EXPECT_EQ(reader.namespace_name(), "tenant");
  EXPECT_EQ(reader.profile_id(), 0x1122334455667788ull);
  ASSERT_EQ(reader.blocks().size(), 2u);
  EXPECT_TRUE(reader.blocks()[0].has_crc32c);
  EXPECT_FALSE(reader.blocks()[1].has_crc32c);
  EXPECT_EQ(reader.DataCrc32c(0), Crc32c(a));
  std::vector<std::byte> copy(a.size());
  reader.CopyData(0, copy);
  EXPECT_EQ(copy, a);
}

TEST(WireTest, KeyedRequestParserReadsWhatProtobufWrites) {
  v1::GetRequest get;
  get.set_namespace_name("tenant");
  get.set_profile_id(42);
  get.add_keys(std::string(32, 'a'));
  get.add_keys(std::string(32, 'b'));
  for (bool verifies : {false, true}) {
    get.set_client_verifies_crc32c(verifies);
    KeyedRequest parsed;
    ASSERT_OK(ParseKeyedRequest(FromString(get.SerializeAsString()), 2, "Get", &parsed));
    EXPECT_EQ(parsed.namespace_name, "tenant");
    EXPECT_EQ(parsed.profile_id, 42u);
    EXPECT_EQ(parsed.keys, std::vector<std::string>({std::string(32, 'a'), std::string(32, 'b')}));
    EXPECT_EQ(parsed.client_verifies_crc32c, verifies);
  }
  KeyedRequest parsed;
  EXPECT_THAT(ParseKeyedRequest(FromString(get.SerializeAsString()), 1, "Get", &parsed),
              proxima::testing::StatusIs(absl::StatusCode::kResourceExhausted,
                                         ::testing::HasSubstr("limit is 1")));
  // A truncated flag (tag without its value) is malformed, not silently false.
  std::string truncated = get.SerializeAsString();
  truncated.push_back(static_cast<char>(8 << 3));
  EXPECT_THAT(ParseKeyedRequest(FromString(truncated), 2, "Get", &parsed),
              proxima::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         ::testing::HasSubstr("client_verifies_crc32c")));
}

TEST(WireTest, PutRequestReaderRejectsEveryTruncation) {
  auto a = RandomBytes(200, 10);
  std::vector<std::array<uint8_t, 32>> keys(1);
  std::vector<std::span<const std::byte>> blocks = {a};
  std::string full = Flatten(EncodePutRequest("ns", 7, keys, blocks));
  PutRequestReader reader;
  ASSERT_OK(reader.Parse(FromString(full), 8));
  EXPECT_THAT(reader.Parse(FromString(full), 0),
              proxima::testing::StatusIs(absl::StatusCode::kResourceExhausted,
                                         ::testing::HasSubstr("limit is 0")));
  for (size_t cut = 1; cut < full.size(); ++cut) {
    absl::Status s = reader.Parse(FromString(full.substr(0, cut)), 8);
    // A cut right after a complete field parses (as a request with fewer fields); any other
    // cut is an error. Either way nothing reads past the end.
    if (s.ok()) {
      EXPECT_TRUE(reader.blocks().empty()) << cut;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << cut;
    }
  }
  std::mt19937 rng(12);
  for (int i = 0; i < 2000; ++i) {
    std::string bad = full;
    bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
    if (reader.Parse(FromString(bad), 8).ok()) {
      for (size_t b = 0; b < reader.blocks().size(); ++b) {
        std::vector<std::byte> dst(reader.blocks()[b].data_size);
        reader.CopyData(b, dst);  // stays within the message
      }
    }
  }
}

TEST(WireTest, TierFieldsInteroperateWithProtobuf) {
  // GetResult.level: written by the writer for encoded blocks, omitted (0) for raw ones.
  auto a = RandomBytes(300, 10), b = RandomBytes(200, 11);
  GetResponseWriter w;
  w.AddHit(a, Crc32c(a), nullptr, /*level=*/2);
  w.AddHit(b, Crc32c(b), nullptr);
  v1::GetResponse got;
  ASSERT_TRUE(got.ParseFromString(Flatten(w.Finish())));
  ASSERT_EQ(got.results_size(), 2);
  EXPECT_EQ(got.results(0).level(), 2u);
  EXPECT_EQ(got.results(0).data().size(), a.size());
  EXPECT_EQ(got.results(0).crc32c(), Crc32c(a));
  EXPECT_EQ(got.results(1).level(), 0u);
  // The client's raw parser skips the level field and still checks the CRC.
  std::vector<std::byte> out0(a.size()), out1(b.size());
  std::vector<std::span<std::byte>> outs = {out0, out1};
  std::vector<GetResult> results;
  ASSERT_OK(ParseGetResponse(FromString(got.SerializeAsString()), outs, &results));
  EXPECT_TRUE(results[0].intact);
  EXPECT_EQ(out0, a);

  // PutBlock.position and PutRequest.priority, both ways.
  std::vector<std::array<uint8_t, 32>> keys(3);
  std::vector<std::span<const std::byte>> blocks = {a, b, a};
  std::vector<int64_t> positions = {0, -1, 300};
  std::vector<float> importance = {0.0f, 2.5f, 0.0f};
  v1::PutRequest put;
  ASSERT_TRUE(put.ParseFromString(Flatten(
      EncodePutRequest("t", 1, keys, blocks, positions, /*high_priority=*/true, importance))));
  EXPECT_EQ(put.blocks(1).importance(), 2.5f);
  EXPECT_EQ(put.blocks(0).importance(), 0.0f);
  EXPECT_EQ(put.priority(), v1::PRIORITY_HIGH);
  EXPECT_TRUE(put.blocks(0).has_position());
  EXPECT_EQ(put.blocks(0).position(), 0u);
  EXPECT_FALSE(put.blocks(1).has_position());
  EXPECT_EQ(put.blocks(2).position(), 300u);
  EXPECT_EQ(put.blocks(2).crc32c(), Crc32c(a));
  PutRequestReader reader;
  ASSERT_OK(reader.Parse(FromString(put.SerializeAsString()), 3));
  EXPECT_EQ(reader.priority(), static_cast<uint32_t>(v1::PRIORITY_HIGH));
  EXPECT_TRUE(reader.blocks()[0].has_position);
  EXPECT_FALSE(reader.blocks()[1].has_position);
  EXPECT_EQ(reader.blocks()[2].position, 300u);
  EXPECT_EQ(reader.blocks()[1].importance, 2.5f);
  EXPECT_EQ(reader.blocks()[2].importance, 0.0f);

  // GetRequest.format through the keyed parser.
  v1::GetRequest get;
  get.set_namespace_name("t");
  get.add_keys(std::string(32, 'k'));
  get.set_format(v1::BLOCK_FORMAT_STORED);
  KeyedRequest keyed;
  ASSERT_OK(ParseKeyedRequest(FromString(get.SerializeAsString()), 4, "Get", &keyed));
  EXPECT_EQ(keyed.format, static_cast<uint32_t>(v1::BLOCK_FORMAT_STORED));
  EXPECT_EQ(keyed.keys.size(), 1u);
}

}  // namespace
}  // namespace proxima::wire
