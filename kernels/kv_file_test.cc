#include "kernels/kv_file.h"

#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/bytes.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::codec {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

KvTensor SmallTensor() {
  KvTensor t;
  t.num_layers = 2;
  t.num_kv_heads = 3;
  t.head_dim = 4;
  t.num_tokens = 10;
  t.dtype = DType::kBf16;
  t.data.resize(2 * 2 * 10 * 3 * 4);
  for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = static_cast<uint16_t>(i);
  return t;
}

TEST(KvFileTest, ParsesWhatItSerializes) {
  KvTensor t = SmallTensor();
  std::string file = SerializeKvFile(t);
  EXPECT_EQ(file.size(), 40 + t.data.size() * 2);
  EXPECT_EQ(file.substr(0, 8), "PXKVDUMP");
  ASSERT_OK_AND_ASSIGN(KvTensor back, ParseKvFile(AsBytes(file)));
  EXPECT_EQ(back.num_layers, 2u);
  EXPECT_EQ(back.num_kv_heads, 3u);
  EXPECT_EQ(back.head_dim, 4u);
  EXPECT_EQ(back.num_tokens, 10u);
  EXPECT_EQ(back.dtype, DType::kBf16);
  EXPECT_EQ(back.data, t.data);
}

TEST(KvFileTest, ExtractsTheBlockSliceOfEveryLayerAndKv) {
  KvTensor t = SmallTensor();
  BlockGeometry g = t.BlockShape(4);
  std::vector<std::byte> block(g.RawBytes());
  ASSERT_OK(t.ExtractBlock(3, 4, block));
  const size_t row = 3 * 4;
  for (size_t s = 0; s < 4; ++s) {  // [layer][k|v]
    for (size_t tok = 0; tok < 4; ++tok) {
      for (size_t e = 0; e < row; ++e) {
        uint16_t v;
        std::memcpy(&v, block.data() + 2 * ((s * 4 + tok) * row + e), 2);
        ASSERT_EQ(v, t.data[(s * 10 + 3 + tok) * row + e]);
      }
    }
  }
  EXPECT_THAT(t.ExtractBlock(7, 4, block), StatusIs(absl::StatusCode::kOutOfRange, ::testing::_));
}

TEST(KvFileTest, RejectsMalformedFiles) {
  const std::string good = SerializeKvFile(SmallTensor());
  EXPECT_THAT(ParseKvFile(AsBytes(good.substr(0, 39))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  EXPECT_THAT(ParseKvFile(AsBytes(good.substr(0, good.size() - 1))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes")));
  std::string bad = good;
  bad[0] = 'Q';
  EXPECT_THAT(ParseKvFile(AsBytes(bad)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  bad = good;
  bad[8] = 2;
  EXPECT_THAT(ParseKvFile(AsBytes(bad)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version")));
  bad = good;
  bad[32] = static_cast<char>(bad[32] + 2);  // data_bytes lies
  EXPECT_THAT(ParseKvFile(AsBytes(bad)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_bytes")));
  bad = good;
  bad[28] = 3;  // dtype
  EXPECT_THAT(ParseKvFile(AsBytes(bad)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
}

TEST(KvFileTest, ReadsFromDisk) {
  const std::string path = ::testing::TempDir() + "/kv_file_test.pkv";
  {
    std::ofstream f(path, std::ios::binary);
    f << SerializeKvFile(SmallTensor());
  }
  ASSERT_OK_AND_ASSIGN(KvTensor t, ReadKvFile(path));
  EXPECT_EQ(t.data, SmallTensor().data);
  std::remove(path.c_str());
  EXPECT_THAT(ReadKvFile(path), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

}  // namespace
}  // namespace proxima::codec
