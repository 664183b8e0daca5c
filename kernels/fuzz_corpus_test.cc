// Replays the checked-in fuzz corpus (tests/fuzz/corpus/codec_decode) through the decoder in
// the normal build, so every input the fuzzer ever kept stays an error-or-success case without
// a crash, also in builds that never run libFuzzer.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace proxima::codec {
namespace {

TEST(FuzzCorpusTest, EveryCorpusInputDecodesOrFailsCleanly) {
  const std::filesystem::path dir = PROXIMA_FUZZ_CORPUS_DIR;
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0, decoded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(entry.path(), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string data = ss.str();
    auto bytes = std::as_bytes(std::span<const char>(data.data(), data.size()));
    ++files;
    absl::StatusOr<BlockHeaderInfo> info = InspectBlock(bytes);
    if (!info.ok()) continue;
    std::vector<std::byte> out(info->raw_bytes);
    decoded += DecodeBlock(bytes, out).ok();
  }
  EXPECT_GT(files, 5);
  EXPECT_GT(decoded, 0);  // the seeds are valid blocks
}

}  // namespace
}  // namespace proxima::codec
