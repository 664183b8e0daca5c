// libFuzzer target `request`: hostile KVTier requests (method, caller, wire bytes) handled in
// process by the daemon's handler code. Built and run by scripts/fuzz.sh request SECONDS;
// corpus in tests/fuzz/corpus/request.
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "common/log.h"
#include "tests/fuzz/request_fuzz_body.h"

// Quiet: protobuf's complaint about each invalid UTF-8 string and the daemon's info lines would
// cost more time than the inputs themselves. Errors still surface as crashes or aborts.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  proxima::log::SetMinLevel(proxima::log::Level::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::daemon::fuzz::RunRequestInput(data, size);
  return 0;
}
