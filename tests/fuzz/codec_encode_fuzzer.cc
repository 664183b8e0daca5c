// libFuzzer target `codec_encode`: hostile values, geometries and plans into EncodeBlock, the
// result checked across the CPU paths and against the input (codec_encode_fuzz_body.h). Built
// and run by scripts/fuzz.sh codec_encode SECONDS; corpus in tests/fuzz/corpus/codec_encode.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/codec_encode_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  proxima::codec::fuzz::RunCodecEncodeInput(data, size);
  return 0;
}
