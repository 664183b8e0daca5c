// Encoded bytes are a function of the input alone, on every CPU. Blocks of the committed real KV
// dump and of random 16-bit patterns (NaN, Inf and subnormals included), encoded with every codec
// on every CPU path this machine has, must have the size and CRC32C recorded in
// kernels/testdata/golden_encodings.txt (written on x86-64), and decode to the recorded CRC32C.
// This is what holds an aarch64 build (scripts/aarch64.sh, under qemu) to the x86 bytes: a
// cluster may mix the two, and a worker decodes what any daemon encoded.
//
// Regenerate only when encoded bytes change on purpose: a format change (with a format version
// bump), or an encoder's choice that the format leaves open and every decoder reads alike (e.g.
// k4v3's V scale divisor, docs/decisions.md), from the repository root:
//   PROXIMA_WRITE_GOLDEN=kernels/testdata/golden_encodings.txt
//   build/kernels/kernels_codec_test --gtest_filter='GoldenTest.*'   (with that variable set)
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/kv_file.h"

namespace proxima::codec {
namespace {

struct Source {
  std::string name;
  BlockGeometry geometry;
  bool first;
  std::vector<std::byte> raw;
};

// Integer-only generation (no float arithmetic, whose contraction may differ between compilers'
// targets): any 16-bit pattern.
std::vector<std::byte> RandomBits(const BlockGeometry& g, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> raw(g.RawBytes());
  for (auto& b : raw) b = static_cast<std::byte>(rng() & 0xFF);
  return raw;
}

std::vector<Source> Sources() {
  std::vector<Source> out;
  absl::StatusOr<KvTensor> kv =
      ReadKvFile(std::string(PROXIMA_EVAL_TESTDATA_DIR) + "/smollm2-135m_gpl3_t0-256_bf16.pkv");
  EXPECT_OK(kv.status());
  if (kv.ok()) {
    for (auto [t0, tokens, first] : {std::tuple{0u, 64u, true}, std::tuple{100u, 16u, false}}) {
      Source s{absl::StrFormat("kv_t%u_n%u", t0, tokens), kv->BlockShape(tokens), first, {}};
      s.raw.resize(s.geometry.RawBytes());
      EXPECT_OK(kv->ExtractBlock(t0, tokens, s.raw));
      out.push_back(std::move(s));
    }
    // The first block's bytes read as 2 heads of 96 channels (a head_dim that is not a power of
    // two: k4v3's V transform in chunks). Added after the others, which keep their lines.
    Source wide = out.front();
    wide.name = "kv_t0_n64_h2_d96";
    wide.geometry.num_kv_heads = 2;
    wide.geometry.head_dim = 96;
    if (wide.geometry.RawBytes() == wide.raw.size()) out.push_back(std::move(wide));
  }
  for (DType dt : {DType::kBf16, DType::kFp16}) {
    const char* dn = dt == DType::kBf16 ? "bf16" : "fp16";
    BlockGeometry g{2, 3, 64, 33, dt};
    out.push_back({absl::StrCat("bits_", dn, "_h3_d64_t33"), g, false, RandomBits(g, 7)});
    BlockGeometry odd{1, 2, 12, 7, dt};
    out.push_back({absl::StrCat("bits_", dn, "_h2_d12_t7"), odd, true, RandomBits(odd, 8)});
  }
  return out;
}

constexpr const char* kPlans[] = {"raw",
                                  "lossless",
                                  "fp8",
                                  "int8",
                                  "int4,group=32",
                                  "int4,group=64",
                                  "int4,group=128",
                                  "int2,group=32",
                                  "int2,group=128",
                                  "star",
                                  "layers[0:1]=int8,default=int4,sink=int8,group=64",
                                  "k4v3,rope_theta=100000",
                                  "k4v3,group=32"};

uint32_t Crc(std::span<const std::byte> b) { return Crc32c(b); }

// "<source> <plan> <encoded bytes> <encoded crc> <decoded crc>" per case, on `path`.
std::vector<std::string> Lines(CpuPath path) {
  std::vector<std::string> lines;
  for (const Source& s : Sources()) {
    for (const char* text : kPlans) {
      absl::StatusOr<CodecPlan> plan = ParseCodecPlan(text);
      EXPECT_OK(plan.status()) << text;
      if (!plan.ok()) continue;
      std::string enc;
      absl::Status st = EncodeBlockWithPath(path, s.geometry, *plan, s.first, s.raw, {}, &enc);
      EXPECT_OK(st) << s.name << " " << text;
      if (!st.ok()) continue;
      auto bytes = std::as_bytes(std::span<const char>(enc));
      std::vector<std::byte> dec(s.geometry.RawBytes());
      EXPECT_OK(DecodeBlockWithPath(path, bytes, dec)) << s.name << " " << text;
      // Plans contain no spaces; the file is split on them.
      lines.push_back(
          absl::StrFormat("%s %s %u %08x %08x", s.name, text, enc.size(), Crc(bytes), Crc(dec)));
    }
  }
  return lines;
}

TEST(GoldenTest, EveryPathEncodesAndDecodesToTheRecordedBytes) {
  std::string file = std::string(PROXIMA_KERNELS_TESTDATA_DIR) + "/golden_encodings.txt";
  if (const char* w = std::getenv("PROXIMA_WRITE_GOLDEN"); w != nullptr) {
    // Regenerate mode: write the scalar path's lines, then compare every path with them.
    std::ofstream out(w);
    out << "# kernels/golden_test.cc: source plan encoded_bytes encoded_crc32c decoded_crc32c\n";
    for (const std::string& l : Lines(CpuPath::kScalar)) out << l << "\n";
    ASSERT_TRUE(out.good()) << w;
    std::printf("wrote %s\n", w);
    file = w;
  }
  std::ifstream f(file);
  ASSERT_TRUE(f.good()) << file << " missing";
  std::map<std::string, std::string> want;  // "source plan" -> the rest
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::string source, plan;
    in >> source >> plan;
    want[source + " " + plan] = line;
  }
  // Every source with every plan (seven sources).
  ASSERT_EQ(want.size(), 7 * std::size(kPlans));
  for (CpuPath path : {CpuPath::kScalar, CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (!CpuPathAvailable(path)) {
      std::printf("path %s: not on this CPU, not compared\n",
                  std::string(CpuPathName(path)).c_str());
      continue;
    }
    const std::vector<std::string> got = Lines(path);
    ASSERT_EQ(got.size(), want.size()) << CpuPathName(path);
    for (const std::string& l : got) {
      std::istringstream in(l);
      std::string source, plan;
      in >> source >> plan;
      EXPECT_EQ(l, want[source + " " + plan]) << "path " << CpuPathName(path);
    }
    std::printf("path %s: %zu encodings and decodings as recorded\n",
                std::string(CpuPathName(path)).c_str(), got.size());
  }
}

}  // namespace
}  // namespace proxima::codec
