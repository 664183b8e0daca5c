// libFuzzer target `config_parse`: hostile YAML and --set overrides into ParseConfig. Built and
// run by scripts/fuzz.sh config_parse SECONDS; corpus in tests/fuzz/corpus/config_parse.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/config_parse_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::daemon::fuzz::RunConfigParseInput(data, size);
  return 0;
}
