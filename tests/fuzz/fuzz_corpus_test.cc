// Replays the checked-in corpora of the request, peer, config_parse and snapshot fuzz targets
// through their bodies in the normal build, so every input the fuzzers kept stays a clean
// success-or-error case (with isolation and round-trip checks) in builds that never run libFuzzer.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/fuzz/config_parse_fuzz_body.h"
#include "tests/fuzz/corpus_replay.h"
#include "tests/fuzz/peer_fuzz_body.h"
#include "tests/fuzz/request_fuzz_body.h"
#include "tests/fuzz/snapshot_fuzz_body.h"

namespace proxima::daemon {
namespace {

using ::proxima::fuzz_testing::ReplayCorpus;

TEST(FuzzCorpusTest, EveryRequestInputIsHandledOrRefusedCleanly) {
  auto [files, ok] = ReplayCorpus("request", fuzz::RunRequestInput);
  EXPECT_GE(files, 48);
  EXPECT_GE(ok, 16);  // at least the seeds that are valid for their caller
}

TEST(FuzzCorpusTest, EveryPeerInputIsHandledOrRefusedCleanly) {
  auto [files, ok] = ReplayCorpus("peer", fuzz::RunPeerInput);
  EXPECT_GE(files, 33);  // the seeds (make_request_seeds)
  EXPECT_GE(ok, 12);     // at least the seeds that are valid
}

TEST(FuzzCorpusTest, EveryConfigInputParsesOrFailsCleanly) {
  auto [files, ok] = ReplayCorpus("config_parse", fuzz::RunConfigParseInput);
  EXPECT_GE(files, 5);
  EXPECT_GE(ok, 5);  // at least the seeds: valid configurations
}

TEST(FuzzCorpusTest, EverySnapshotInputLoadsOnlyCheckedBlocksOrFailsCleanly) {
  auto [files, ok] = ReplayCorpus("snapshot", fuzz::RunSnapshotInput);
  EXPECT_GE(files, 2);
  EXPECT_GE(ok, 1);  // at least the seed with blocks
}

}  // namespace
}  // namespace proxima::daemon
