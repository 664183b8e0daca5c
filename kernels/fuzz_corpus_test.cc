// Replays the checked-in fuzz corpus (tests/fuzz/corpus/codec_decode) through the fuzz target's
// body in the normal build, so every input the fuzzer kept stays a clean error-or-success case
// (and scalar/SIMD agreement holds) also in builds that never run libFuzzer.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/fuzz/codec_decode_fuzz_body.h"

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
    ++files;
    decoded +=
        fuzz::RunCodecDecodeInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  EXPECT_GE(files, 32);
  EXPECT_GE(decoded, 32);  // at least the seeds: valid blocks of every codec
}

}  // namespace
}  // namespace proxima::codec
