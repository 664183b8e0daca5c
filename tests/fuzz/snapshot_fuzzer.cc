// libFuzzer target `snapshot`: hostile snapshot files into snapshot::Load (the warm restart's
// reader). Built and run by scripts/fuzz.sh snapshot SECONDS; corpus in tests/fuzz/corpus/snapshot.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/snapshot_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::daemon::fuzz::RunSnapshotInput(data, size);
  return 0;
}
