// The kept fuzz corpora (tests/fuzz/corpus/NAME) read outside libFuzzer: by the tests that replay
// them through the fuzz bodies in ordinary builds, and by the GPU test that replays codec_encode's
// through CUDA. The including target defines PROXIMA_FUZZ_CORPUS_ROOT (the corpus directory of
// its checkout). Thread-safety: pure.
#ifndef PROXIMA_TESTS_FUZZ_CORPUS_REPLAY_H_
#define PROXIMA_TESTS_FUZZ_CORPUS_REPLAY_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace proxima::fuzz_testing {

// Every file of corpus `name` with its bytes, in name order (the request corpus replays through
// a service that keeps state, so the order is fixed). The root is PROXIMA_FUZZ_CORPUS_ROOT from
// the environment when set (scripts/gpu-check.sh runs binaries on the GPU machine from another
// checkout than the one whose path was compiled in), else the compiled-in one.
inline std::vector<std::pair<std::filesystem::path, std::string>> ReadCorpus(
    const std::string& name) {
  const char* env = std::getenv("PROXIMA_FUZZ_CORPUS_ROOT");
  const std::filesystem::path dir =
      std::filesystem::path(env != nullptr && env[0] != '\0' ? env : PROXIMA_FUZZ_CORPUS_ROOT) /
      name;
  EXPECT_TRUE(std::filesystem::is_directory(dir)) << dir;
  std::vector<std::filesystem::path> paths;
  if (std::filesystem::is_directory(dir)) {
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<std::pair<std::filesystem::path, std::string>> files;
  for (const auto& path : paths) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    files.emplace_back(path, ss.str());
  }
  return files;
}

// Runs `body(data, size)` (true: a success) on every file of corpus `name`; returns
// {files, successes}.
template <typename Body>
std::pair<int, int> ReplayCorpus(const std::string& name, Body body) {
  int files = 0, ok = 0;
  for (const auto& [path, data] : ReadCorpus(name)) {
    ++files;
    ok += body(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  return {files, ok};
}

}  // namespace proxima::fuzz_testing

#endif  // PROXIMA_TESTS_FUZZ_CORPUS_REPLAY_H_
