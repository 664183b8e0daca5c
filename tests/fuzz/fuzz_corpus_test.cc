// Replays the checked-in corpora of the request, peer and config_parse fuzz targets through their
// bodies in the normal build, so every input the fuzzers kept stays a clean success-or-error
// case (with isolation and round-trip checks) in builds that never run libFuzzer.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/fuzz/config_parse_fuzz_body.h"
#include "tests/fuzz/peer_fuzz_body.h"
#include "tests/fuzz/request_fuzz_body.h"

namespace proxima::daemon {
namespace {

// Runs `body` on every file of corpus `name`; returns {files, successes}.
template <typename Body>
std::pair<int, int> Replay(const std::string& name, Body body) {
  const std::filesystem::path dir = std::filesystem::path(PROXIMA_FUZZ_CORPUS_ROOT) / name;
  EXPECT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int files = 0, ok = 0;
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) paths.push_back(entry.path());
  std::sort(paths.begin(), paths.end());  // the request service keeps state: a fixed order
  for (const auto& path : paths) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string data = ss.str();
    ++files;
    ok += body(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  return {files, ok};
}

TEST(FuzzCorpusTest, EveryRequestInputIsHandledOrRefusedCleanly) {
  auto [files, ok] = Replay("request", fuzz::RunRequestInput);
  EXPECT_GE(files, 48);
  EXPECT_GE(ok, 16);  // at least the seeds that are valid for their caller
}

TEST(FuzzCorpusTest, EveryPeerInputIsHandledOrRefusedCleanly) {
  auto [files, ok] = Replay("peer", fuzz::RunPeerInput);
  EXPECT_GE(files, 33);  // the seeds (make_request_seeds)
  EXPECT_GE(ok, 12);     // at least the seeds that are valid
}

TEST(FuzzCorpusTest, EveryConfigInputParsesOrFailsCleanly) {
  auto [files, ok] = Replay("config_parse", fuzz::RunConfigParseInput);
  EXPECT_GE(files, 5);
  EXPECT_GE(ok, 5);  // at least the seeds: valid configurations
}

}  // namespace
}  // namespace proxima::daemon
