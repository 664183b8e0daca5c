// libFuzzer target `codec_decode`: hostile bytes into InspectBlock/DecodeBlock. Built and run by
// scripts/fuzz.sh codec_decode SECONDS; corpus in tests/fuzz/corpus/codec_decode.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/codec_decode_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::codec::fuzz::RunCodecDecodeInput(data, size);
  return 0;
}
