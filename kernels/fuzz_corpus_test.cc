// Replays the checked-in corpora of the codec's fuzz targets (tests/fuzz/corpus/codec_decode and
// codec_encode) through their bodies in the normal build, so every input the fuzzers kept stays
// a clean case also in builds that never run libFuzzer: a block that decodes or fails cleanly
// (scalar/SIMD agreement included), a block that encodes, on every path alike, to bytes that
// decode within the codec's bounds.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/fuzz/codec_decode_fuzz_body.h"
#include "tests/fuzz/codec_encode_fuzz_body.h"

namespace proxima::codec {
namespace {

// Runs `body` on every file of corpus `name`; returns {files, successes}.
template <typename Body>
std::pair<int, int> Replay(const std::string& name, Body body) {
  const std::filesystem::path dir = std::filesystem::path(PROXIMA_FUZZ_CORPUS_ROOT) / name;
  EXPECT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0, ok = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(entry.path(), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string data = ss.str();
    ++files;
    ok += body(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  return {files, ok};
}

TEST(FuzzCorpusTest, EveryCorpusInputDecodesOrFailsCleanly) {
  auto [files, decoded] = Replay("codec_decode", fuzz::RunCodecDecodeInput);
  EXPECT_GE(files, 32);
  EXPECT_GE(decoded, 32);  // at least the seeds: valid blocks of every codec
}

TEST(FuzzCorpusTest, EveryEncodeInputEncodesWithinItsBoundsOrIsRefused) {
  auto [files, encoded] = Replay("codec_encode", fuzz::RunCodecEncodeInput);
  EXPECT_GE(files, 40);
  EXPECT_GE(encoded, 32);  // at least the seeds that choose valid blocks (make_encode_seeds.py)
}

}  // namespace
}  // namespace proxima::codec
