// Replays the checked-in corpora of the codec's fuzz targets (tests/fuzz/corpus/codec_decode and
// codec_encode) through their bodies in the normal build, so every input the fuzzers kept stays
// a clean case also in builds that never run libFuzzer: a block that decodes or fails cleanly
// (scalar/SIMD agreement included), a block that encodes, on every path alike, to bytes that
// decode within the codec's bounds.
#include <string>

#include "gtest/gtest.h"
#include "tests/fuzz/codec_decode_fuzz_body.h"
#include "tests/fuzz/codec_encode_fuzz_body.h"
#include "tests/fuzz/corpus_replay.h"

namespace proxima::codec {
namespace {

using ::proxima::fuzz_testing::ReplayCorpus;

TEST(FuzzCorpusTest, EveryCorpusInputDecodesOrFailsCleanly) {
  auto [files, decoded] = ReplayCorpus("codec_decode", fuzz::RunCodecDecodeInput);
  EXPECT_GE(files, 32);
  EXPECT_GE(decoded, 32);  // at least the seeds: valid blocks of every codec
}

TEST(FuzzCorpusTest, EveryEncodeInputEncodesWithinItsBoundsOrIsRefused) {
  auto [files, encoded] = ReplayCorpus("codec_encode", fuzz::RunCodecEncodeInput);
  EXPECT_GE(files, 40);
  EXPECT_GE(encoded, 32);  // at least the seeds that choose valid blocks (make_encode_seeds.py)
}

}  // namespace
}  // namespace proxima::codec
