// Writes the seed corpus of the codec_decode fuzz target: small valid blocks of every codec and
// dtype (with the harness's mode byte in front). Rerun when the format changes:
//   g++ -std=c++20 -I. tests/fuzz/make_codec_seeds.cc build/kernels/libproxima_kernels.a \
//     build/common/libproxima_common.a $(pkg-config --libs absl_statusor absl_strings) \
//     -o /tmp/make_codec_seeds && /tmp/make_codec_seeds tests/fuzz/corpus/codec_decode
#include <cstdio>
#include <fstream>
#include <string>

#include "kernels/codec.h"
#include "kernels/internal/test_blocks.h"

int main(int argc, char** argv) {
  using namespace proxima::codec;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  // Two seeds per block: the harness's mode byte (0: decode, 1: inspect) in front.
  auto write = [&](const std::string& name, const std::string& enc) {
    for (char mode : {'\x00', '\x01'}) {
      std::ofstream f(dir + "/" + name + "_" + std::to_string(mode), std::ios::binary);
      f.put(mode);
      f << enc;
    }
  };
  int n = 0;
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const char* text : {"raw", "lossless", "fp8", "int8", "int4,group=32", "int2,group=64",
                             "star", "layers[0:1]=lossless,default=int4,sink=int8"}) {
      BlockGeometry g{2, 2, 16, 8, dtype};
      if (std::string(text) == "star") g.tokens_per_block = 64;  // several centroids
      auto plan = ParseCodecPlan(text);
      auto raw = internal::MakeBlock(g, internal::Pattern::kKvLike, 1000 + n);
      std::string enc;
      if (!plan.ok() || !EncodeBlock(g, *plan, n % 3 == 0, raw, {}, &enc).ok()) return 1;
      write("seed_" + std::to_string(n), enc);
      ++n;
    }
  }
  // k4v3 (added after the others, so their seeds keep their names): both dtypes, with and
  // without a RoPE base.
  int k = 0;
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const char* text : {"k4v3,rope_theta=10000", "k4v3,group=32"}) {
      BlockGeometry g{2, 2, 16, 8, dtype};
      auto plan = ParseCodecPlan(text);
      auto raw = internal::MakeBlock(g, internal::Pattern::kKvLike, 2000 + k);
      std::string enc;
      if (!plan.ok() || !EncodeBlock(g, *plan, false, raw, {}, &enc).ok()) return 1;
      write("seed_k4v3_" + std::to_string(k), enc);
      ++k;
    }
  }
  std::printf("wrote %d seeds\n", 2 * (n + k));
  return 0;
}
