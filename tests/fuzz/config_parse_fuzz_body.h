// The body of the config_parse fuzz target, shared by the libFuzzer harness and by the unit test
// that replays the checked-in corpus (tests/fuzz/corpus/config_parse) in ordinary builds.
//
// Input: YAML text, then optionally '\0'-separated --set overrides ("dotted.key=value"). The
// parser must return a configuration or an error with a message, never crash or hang; and a
// configuration it accepts must survive the round trip through ConfigToYaml (what
// `proximad --check_config` prints loads back as the same configuration). Thread-safety: pure.
#ifndef PROXIMA_TESTS_FUZZ_CONFIG_PARSE_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_CONFIG_PARSE_FUZZ_BODY_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/config.h"

namespace proxima::daemon::fuzz {

// Returns true when the input parsed into a valid configuration.
inline bool RunConfigParseInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t begin = 0;
  while (parts.size() < 9) {
    size_t nul = input.find('\0', begin);
    parts.push_back(input.substr(begin, nul == std::string::npos ? std::string::npos
                                                                 : nul - begin));
    if (nul == std::string::npos) break;
    begin = nul + 1;
  }
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  absl::StatusOr<DaemonConfig> config = ParseConfig(parts[0], "<fuzz>", overrides);
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();  // every error explains itself
    return false;
  }
  const std::string yaml = ConfigToYaml(*config);
  absl::StatusOr<DaemonConfig> again = ParseConfig(yaml, "<round trip>", {});
  if (!again.ok() || ConfigToYaml(*again) != yaml) std::abort();
  return true;
}

}  // namespace proxima::daemon::fuzz

#endif  // PROXIMA_TESTS_FUZZ_CONFIG_PARSE_FUZZ_BODY_H_
