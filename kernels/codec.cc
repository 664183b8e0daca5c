// Container encode/decode, codec plans and the batched CPU entry points. Per-segment arithmetic
// lives in kernels/internal/ (scalar reference, AVX2 and AVX-512 paths, lossless).
#include "kernels/codec.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/crc32c.h"
#include "common/parallel.h"
#include "common/status_macros.h"
#include "kernels/internal/container.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"

namespace proxima::codec {
namespace {

using internal::SegmentShape;

// Debian's Abseil has its own string_view; the public API speaks std::string_view.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr std::string_view kCodecNames[kNumCodecs] = {"raw",  "lossless", "fp8",  "int8",
                                                      "int4", "int2",     "star", "k4v3"};

template <typename T>
T LoadLe(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
void StoreLe(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

absl::Status CheckPath(CpuPath path) {
  switch (path) {
    case CpuPath::kAuto:
    case CpuPath::kScalar:
      return absl::OkStatus();
    case CpuPath::kAvx2:
      if (!internal::CpuHasAvx2()) {
        return absl::FailedPreconditionError("this CPU lacks AVX2/F16C");
      }
      return absl::OkStatus();
    case CpuPath::kAvx512:
      if (!internal::CpuHasAvx512()) {
        return absl::FailedPreconditionError(
            "this CPU (or its OS) lacks AVX-512 F/BW/VL with zmm state saving");
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown CpuPath");
}

CpuPath Resolve(CpuPath path) { return path == CpuPath::kAuto ? BestCpuPath() : path; }

// The per-segment kernels of a CpuPath (kAuto: the best one here).
struct SegmentKernels {
  void (*encode_fp8)(const SegmentShape&, const std::byte*, std::byte*);
  void (*decode_fp8)(const SegmentShape&, const std::byte*, std::byte*);
  void (*encode_int8)(const SegmentShape&, const std::byte*, std::byte*);
  void (*decode_int8)(const SegmentShape&, const std::byte*, std::byte*);
  void (*encode_intn)(const SegmentShape&, uint32_t, const std::byte*, std::byte*);
  void (*decode_intn)(const SegmentShape&, uint32_t, const std::byte*, std::byte*);
  internal::K4v3TurnFn turn_k4v3;
  internal::K4v3ValueEncodeFn encode_k4v3_value;
  internal::K4v3ValueDecodeFn decode_k4v3_value;
  internal::K4v3KeyDecodeFn decode_k4v3_key;

  internal::K4v3Kernels K4v3() const {
    return {encode_intn, turn_k4v3, encode_k4v3_value, decode_k4v3_value, decode_k4v3_key};
  }
};

const SegmentKernels& KernelsFor(CpuPath path) {
  namespace in = internal;
  static constexpr SegmentKernels kScalar{in::EncodeFp8Scalar,       in::DecodeFp8Scalar,
                                          in::EncodeInt8Scalar,      in::DecodeInt8Scalar,
                                          in::EncodeIntNScalar,      in::DecodeIntNScalar,
                                          in::TurnK4v3Scalar,        in::EncodeK4v3ValueScalar,
                                          in::DecodeK4v3ValueScalar, in::DecodeK4v3KeyScalar};
  static constexpr SegmentKernels kAvx2{
      in::EncodeFp8Avx2,       in::DecodeFp8Avx2,    in::EncodeInt8Avx2, in::DecodeInt8Avx2,
      in::EncodeIntNAvx2,      in::DecodeIntNAvx2,   in::TurnK4v3Avx2,   in::EncodeK4v3ValueAvx2,
      in::DecodeK4v3ValueAvx2, in::DecodeK4v3KeyAvx2};
  static constexpr SegmentKernels kAvx512{in::EncodeFp8Avx512,       in::DecodeFp8Avx512,
                                          in::EncodeInt8Avx512,      in::DecodeInt8Avx512,
                                          in::EncodeIntNAvx512,      in::DecodeIntNAvx512,
                                          in::TurnK4v3Avx512,        in::EncodeK4v3ValueAvx512,
                                          in::DecodeK4v3ValueAvx512, in::DecodeK4v3KeyAvx512};
  switch (path == CpuPath::kAuto ? BestCpuPath() : path) {
    case CpuPath::kAvx512:
      return kAvx512;
    case CpuPath::kAvx2:
      return kAvx2;
    case CpuPath::kAuto:
    case CpuPath::kScalar:
      break;
  }
  return kScalar;
}

// Top-M tokens per head for `star`: by the worker's importance, else by the key norm of the
// layer's K segment `k` ([token][head][dim]).
std::vector<std::vector<uint32_t>> RankImportant(const SegmentShape& shape, const std::byte* k,
                                                 std::span<const float> importance, uint32_t m) {
  const uint32_t T = shape.tokens, H = shape.heads, D = shape.dim;
  std::vector<std::vector<uint32_t>> out(H);
  std::vector<float> score(T);
  std::vector<uint32_t> order(T);
  for (uint32_t h = 0; h < H; ++h) {
    for (uint32_t t = 0; t < T; ++t) {
      if (!importance.empty()) {
        score[t] = importance[t];
      } else {
        float sum = 0.0f;
        for (uint32_t d = 0; d < D; ++d) {
          float x =
              numeric::DtypeToFloat(shape.dtype, internal::Load16(k, (size_t{t} * H + h) * D + d));
          if (numeric::IsFiniteFloat(x)) sum += x * x;
        }
        score[t] = sum;
      }
      if (!(score[t] == score[t])) score[t] = -INFINITY;  // NaN importance ranks last
    }
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return score[a] > score[b]; });
    out[h].assign(order.begin(), order.begin() + m);
  }
  return out;
}

// The lossless codec's BMI2 build goes with the SIMD paths, so tests comparing the scalar path
// with a SIMD path compare the two builds of the lossless code too.
bool UseBmi2(CpuPath path) { return path != CpuPath::kScalar && internal::CpuHasBmi2(); }

// Appends the segment's payload to `block`.
absl::Status EncodeSegment(CpuPath path, CodecId codec, const SegmentShape& shape,
                           const std::byte* in, const std::byte* layer_k,
                           std::span<const float> importance, double rope_theta,
                           std::string* block) {
  const SegmentKernels& k = KernelsFor(path);
  if (codec == CodecId::kLossless) {
    internal::EncodeLossless(shape, in, block, UseBmi2(path));
    return absl::OkStatus();
  }
  const size_t start = block->size();
  block->resize(start + internal::FixedPayloadBytes(codec, shape));
  std::byte* p = reinterpret_cast<std::byte*>(block->data()) + start;
  switch (codec) {
    case CodecId::kRaw:
      std::memcpy(p, in, block->size() - start);
      return absl::OkStatus();
    case CodecId::kFp8:
      k.encode_fp8(shape, in, p);
      return absl::OkStatus();
    case CodecId::kInt8:
      k.encode_int8(shape, in, p);
      return absl::OkStatus();
    case CodecId::kInt4:
    case CodecId::kInt2: {
      uint32_t bits = codec == CodecId::kInt4 ? 4 : 2;
      k.encode_intn(shape, bits, in, p);
      return absl::OkStatus();
    }
    case CodecId::kStar: {
      auto important =
          RankImportant(shape, layer_k, importance, internal::StarLayoutFor(shape).important);
      internal::EncodeStar(shape, in, important, p);
      return absl::OkStatus();
    }
    case CodecId::kK4v3:
      internal::EncodeK4v3(shape, internal::K4v3RopeFor(rope_theta, shape.dim), k.K4v3(), in, p);
      return absl::OkStatus();
    case CodecId::kLossless:
      break;
  }
  return absl::InvalidArgumentError("unknown codec");
}

absl::Status DecodeSegment(CpuPath path, CodecId codec, const SegmentShape& shape,
                           std::span<const std::byte> payload, std::byte* out) {
  const SegmentKernels& k = KernelsFor(path);
  const std::byte* p = payload.data();
  switch (codec) {
    case CodecId::kRaw:
      std::memcpy(out, p, payload.size());
      return absl::OkStatus();
    case CodecId::kLossless:
      return internal::DecodeLossless(shape, payload, out, UseBmi2(path));
    case CodecId::kFp8:
      PROXIMA_RETURN_IF_ERROR(internal::ValidateFp8(shape, p));
      k.decode_fp8(shape, p, out);
      return absl::OkStatus();
    case CodecId::kInt8:
      PROXIMA_RETURN_IF_ERROR(internal::ValidateInt8(shape, p));
      k.decode_int8(shape, p, out);
      return absl::OkStatus();
    case CodecId::kInt4:
    case CodecId::kInt2: {
      uint32_t bits = codec == CodecId::kInt4 ? 4 : 2;
      PROXIMA_RETURN_IF_ERROR(internal::ValidateIntN(shape, bits, p));
      k.decode_intn(shape, bits, p, out);
      return absl::OkStatus();
    }
    case CodecId::kStar:
      PROXIMA_RETURN_IF_ERROR(internal::ValidateStar(shape, p));
      internal::DecodeStar(shape, p, out);
      return absl::OkStatus();
    case CodecId::kK4v3:
      PROXIMA_RETURN_IF_ERROR(internal::ValidateK4v3(shape, p));
      internal::DecodeK4v3(shape, k.K4v3(), p, out);
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown codec");
}

enum class CrcCheck { kHeader, kHeaderAndPayload };

// Parses and validates the header and segment table, the header CRC, and the payload CRC when
// `check` says so.
absl::StatusOr<BlockHeaderInfo> ParseHeader(std::span<const std::byte> enc, CrcCheck check) {
  using internal::kHeaderBytes;
  using internal::kSegmentEntryBytes;
  if (enc.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block is ", enc.size(), " bytes, shorter than its header"));
  }
  const std::byte* p = enc.data();
  if (std::memcmp(p, internal::kBlockMagic, 8) != 0) {
    return absl::InvalidArgumentError("not a STAR-KV block (bad magic)");
  }
  BlockHeaderInfo info;
  info.version = LoadLe<uint16_t>(p + 8);
  if (info.version != internal::kFormatVersion) {
    return absl::UnimplementedError(
        absl::StrCat("unsupported block format version ", info.version));
  }
  const uint8_t dtype = static_cast<uint8_t>(p[10]);
  const uint8_t flags = static_cast<uint8_t>(p[11]);
  if (dtype != 1 && dtype != 2) return absl::InvalidArgumentError("unknown dtype");
  if ((flags & ~1u) != 0) return absl::InvalidArgumentError("unknown header flags");
  info.is_first_block = (flags & 1u) != 0;
  BlockGeometry& g = info.geometry;
  g.num_layers = LoadLe<uint32_t>(p + 12);
  g.num_kv_heads = LoadLe<uint32_t>(p + 16);
  g.head_dim = LoadLe<uint32_t>(p + 20);
  g.tokens_per_block = LoadLe<uint32_t>(p + 24);
  g.dtype = static_cast<DType>(dtype);
  PROXIMA_RETURN_IF_ERROR(g.Validate());
  const uint32_t num_segments = LoadLe<uint32_t>(p + 28);
  if (num_segments != 2 * g.num_layers) {
    return absl::InvalidArgumentError("segment count is not 2 * num_layers");
  }
  const uint64_t payload_bytes = LoadLe<uint64_t>(p + 32);
  const size_t table_end = kHeaderBytes + kSegmentEntryBytes * size_t{num_segments};
  if (enc.size() < table_end || payload_bytes != enc.size() - table_end) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size ", enc.size(), " does not match its header"));
  }
  {
    uint32_t crc = Crc32c(enc.subspan(0, internal::kHeaderCrcOffset));
    crc = Crc32cExtend(crc, enc.subspan(kHeaderBytes, table_end - kHeaderBytes));
    if (crc != LoadLe<uint32_t>(p + internal::kHeaderCrcOffset)) {
      return absl::DataLossError("block header CRC32C mismatch");
    }
  }
  info.segments.resize(num_segments);
  uint64_t offset = table_end;
  for (uint32_t s = 0; s < num_segments; ++s) {
    const std::byte* e = p + kHeaderBytes + kSegmentEntryBytes * size_t{s};
    SegmentInfo& seg = info.segments[s];
    const uint8_t codec = static_cast<uint8_t>(e[0]);
    const uint8_t group_log2 = static_cast<uint8_t>(e[1]);
    if (codec >= kNumCodecs) {
      return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": unknown codec ", codec));
    }
    seg.codec = static_cast<CodecId>(codec);
    if (LoadLe<uint16_t>(e + 2) != 0 || LoadLe<uint32_t>(e + 4) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": reserved bytes set"));
    }
    if (internal::IsGroupedCodec(seg.codec)) {
      if (group_log2 < 5 || group_log2 > 7) {
        return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": bad group size"));
      }
      seg.group_size = 1u << group_log2;
    } else if (group_log2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": unexpected group size"));
    }
    seg.bytes = LoadLe<uint64_t>(e + 8);
    if (seg.bytes > enc.size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": size past end of block"));
    }
    seg.offset = offset;
    offset += seg.bytes;
    const SegmentShape shape = internal::SegmentShapeFor(g, s, seg.group_size);
    if (seg.codec == CodecId::kLossless) {
      if (seg.bytes < 1 + shape.Elements()) {  // at least the mode byte and verbatim plane B
        return absl::InvalidArgumentError(absl::StrCat("segment ", s, ": lossless too short"));
      }
    } else if (seg.bytes != internal::FixedPayloadBytes(seg.codec, shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment ", s, ": ", Absl(CodecName(seg.codec)), " payload is ", seg.bytes,
                       " bytes, expected ", internal::FixedPayloadBytes(seg.codec, shape)));
    }
  }
  if (offset != enc.size()) {
    return absl::InvalidArgumentError("segment sizes do not add up to the payload size");
  }
  info.payload_crc = LoadLe<uint32_t>(p + internal::kPayloadCrcOffset);
  if (check == CrcCheck::kHeaderAndPayload && Crc32c(enc.subspan(table_end)) != info.payload_crc) {
    return absl::DataLossError("block payload CRC32C mismatch");
  }
  info.raw_bytes = g.RawBytes();
  info.encoded_bytes = enc.size();
  return info;
}

void SealCrcs(std::span<std::byte> block, size_t table_end) {
  uint32_t crc = Crc32c(block.subspan(0, internal::kHeaderCrcOffset));
  crc =
      Crc32cExtend(crc, block.subspan(internal::kHeaderBytes, table_end - internal::kHeaderBytes));
  StoreLe<uint32_t>(block.data() + internal::kHeaderCrcOffset, crc);
  StoreLe<uint32_t>(block.data() + internal::kPayloadCrcOffset, Crc32c(block.subspan(table_end)));
}

}  // namespace

// ------------------------------------------------------------------ names, geometry, plans

std::string_view CodecName(CodecId codec) {
  auto i = static_cast<size_t>(codec);
  return i < kNumCodecs ? kCodecNames[i] : std::string_view("unknown");
}

absl::StatusOr<CodecId> ParseCodecName(std::string_view name) {
  for (int i = 0; i < kNumCodecs; ++i) {
    if (kCodecNames[i] == name) return static_cast<CodecId>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec '", Absl(name),
                   "' (expected raw, lossless, fp8, int8, int4, int2, star or k4v3)"));
}

bool IsExact(CodecId codec) { return codec == CodecId::kRaw || codec == CodecId::kLossless; }

int Fidelity(CodecId codec) {
  switch (codec) {
    case CodecId::kRaw:
    case CodecId::kLossless:
      return 7;
    case CodecId::kInt8:
      return 6;
    case CodecId::kFp8:
      return 5;
    case CodecId::kInt4:
      return 4;
    case CodecId::kK4v3:
      return 3;
    case CodecId::kStar:
      return 2;
    case CodecId::kInt2:
      return 1;
  }
  return 0;
}

size_t BlockGeometry::SegmentElements() const {
  return size_t{tokens_per_block} * num_kv_heads * head_dim;
}
size_t BlockGeometry::RawBytes() const { return 2 * size_t{num_layers} * SegmentElements() * 2; }

absl::Status BlockGeometry::Validate() const {
  using internal::kMaxDim;
  if (num_layers == 0 || num_layers > kMaxDim || num_kv_heads == 0 || num_kv_heads > kMaxDim ||
      head_dim == 0 || head_dim > kMaxDim || tokens_per_block == 0 ||
      tokens_per_block > internal::kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block geometry out of range: layers=", num_layers, " heads=", num_kv_heads, " dim=",
        head_dim, " tokens=", tokens_per_block, " (layers/heads/dim 1..1024, tokens 1..65536)"));
  }
  if (dtype != DType::kFp16 && dtype != DType::kBf16) {
    return absl::InvalidArgumentError("dtype must be fp16 or bf16");
  }
  if (RawBytes() > internal::kMaxRawBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw block of ", RawBytes(), " bytes exceeds the 1 GiB limit"));
  }
  return absl::OkStatus();
}

bool RopeThetaValid(double rope_theta) {
  return rope_theta == 0.0 || (rope_theta >= kMinRopeTheta && rope_theta <= kMaxRopeTheta);
}

CodecPlan CodecPlan::ForModel(double model_rope_theta) const {
  CodecPlan p = *this;
  if (p.rope_theta == 0.0) p.rope_theta = model_rope_theta;
  return p;
}

CodecId CodecPlan::CodecFor(uint32_t layer, bool is_first_block) const {
  CodecId c = default_codec;
  for (const LayerRange& r : layer_ranges) {
    if (layer >= r.begin && layer < r.end) {
      c = r.codec;
      break;
    }
  }
  if (is_first_block && sink_codec.has_value() && Fidelity(*sink_codec) > Fidelity(c)) {
    c = *sink_codec;
  }
  return c;
}

std::string CodecPlan::ToString() const {
  std::vector<std::string> items;
  for (const LayerRange& r : layer_ranges) {
    items.push_back(absl::StrCat("layers[", r.begin, ":", r.end, "]=", Absl(CodecName(r.codec))));
  }
  items.push_back(absl::StrCat("default=", Absl(CodecName(default_codec))));
  if (sink_codec.has_value()) items.push_back(absl::StrCat("sink=", Absl(CodecName(*sink_codec))));
  items.push_back(absl::StrCat("group=", group_size));
  if (rope_theta != 0.0) items.push_back(absl::StrFormat("rope_theta=%.17g", rope_theta));
  return absl::StrJoin(items, ",");
}

absl::StatusOr<CodecPlan> ParseCodecPlan(std::string_view text_in) {
  const absl::string_view text = Absl(text_in);
  CodecPlan plan;
  bool have_default = false, have_group = false, have_rope = false;
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("empty codec plan");
  }
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("codec plan item '", item, "': ", why));
    };
    absl::string_view key = item, value;
    if (size_t eq = item.find('='); eq != absl::string_view::npos) {
      key = absl::StripAsciiWhitespace(item.substr(0, eq));
      value = absl::StripAsciiWhitespace(item.substr(eq + 1));
    } else {
      value = item;
      key = "default";
    }
    auto codec = [&](absl::string_view v) {
      return ParseCodecName(std::string_view(v.data(), v.size()));
    };
    if (key == "default" || key == "sink") {
      absl::StatusOr<CodecId> c = codec(value);
      if (!c.ok()) return bad(c.status().message());
      if (key == "sink") {
        if (plan.sink_codec.has_value()) return bad("sink given twice");
        plan.sink_codec = *c;
      } else {
        if (have_default) return bad("default given twice");
        have_default = true;
        plan.default_codec = *c;
      }
    } else if (key == "group") {
      uint32_t g;
      if (have_group) return bad("group given twice");
      if (!absl::SimpleAtoi(value, &g) || (g != 32 && g != 64 && g != 128)) {
        return bad("group must be 32, 64 or 128");
      }
      have_group = true;
      plan.group_size = g;
    } else if (key == "rope_theta") {
      double theta;
      if (have_rope) return bad("rope_theta given twice");
      if (!absl::SimpleAtod(value, &theta) || theta == 0.0 || !RopeThetaValid(theta)) {
        return bad("rope_theta must be a number from 1 to 1e12 (the model's RoPE base)");
      }
      have_rope = true;
      plan.rope_theta = theta;
    } else if (absl::ConsumePrefix(&key, "layers[") && absl::ConsumeSuffix(&key, "]")) {
      std::vector<absl::string_view> ends = absl::StrSplit(key, ':');
      CodecPlan::LayerRange r;
      if (ends.size() != 2 || !absl::SimpleAtoi(ends[0], &r.begin) ||
          !absl::SimpleAtoi(ends[1], &r.end) || r.begin >= r.end) {
        return bad("expected layers[BEGIN:END] with BEGIN < END");
      }
      absl::StatusOr<CodecId> c = codec(value);
      if (!c.ok()) return bad(c.status().message());
      r.codec = *c;
      plan.layer_ranges.push_back(r);
    } else {
      return bad("expected CODEC, default=, sink=, group=, rope_theta= or layers[a:b]=");
    }
  }
  return plan;
}

// ------------------------------------------------------------------ block encode/decode

CpuPath BestCpuPath() {
  // PROXIMA_CODEC_AVX512=0 keeps a CPU with AVX-512 on the AVX2 path (for CPUs that lower their
  // clock under 512-bit code; the bytes are the same either way).
  static const bool avx512_declined = [] {
    const char* v = std::getenv("PROXIMA_CODEC_AVX512");
    return v != nullptr && std::string_view(v) == "0";
  }();
  if (!avx512_declined && internal::CpuHasAvx512()) return CpuPath::kAvx512;
  return internal::CpuHasAvx2() ? CpuPath::kAvx2 : CpuPath::kScalar;
}

bool CpuPathAvailable(CpuPath path) { return CheckPath(path).ok(); }

std::string_view CpuPathName(CpuPath path) {
  switch (path) {
    case CpuPath::kAuto:
      return "auto";
    case CpuPath::kScalar:
      return "scalar";
    case CpuPath::kAvx2:
      return "avx2";
    case CpuPath::kAvx512:
      return "avx512";
  }
  return "unknown";
}

absl::StatusOr<CpuPath> ParseCpuPath(std::string_view name) {
  for (CpuPath p : {CpuPath::kAuto, CpuPath::kScalar, CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (CpuPathName(p) == name) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown CPU path '", Absl(name), "' (known: auto, scalar, avx2, avx512)"));
}

namespace {

// The container's size for `plan` (header, segment table, payloads), counting
// `lossless_segment_bytes` for each lossless segment, whose size depends on the data; nullopt
// when the plan has one and no such figure is given. `geometry` and the group size are valid.
std::optional<size_t> ContainerBytes(const BlockGeometry& geometry, const CodecPlan& plan,
                                     bool is_first_block,
                                     std::optional<size_t> lossless_segment_bytes) {
  const uint32_t num_segments = 2 * geometry.num_layers;
  size_t bytes = internal::kHeaderBytes + internal::kSegmentEntryBytes * num_segments;
  for (uint32_t s = 0; s < num_segments; ++s) {
    const CodecId codec = plan.CodecFor(s / 2, is_first_block);
    if (codec == CodecId::kLossless) {
      if (!lossless_segment_bytes) return std::nullopt;
      bytes += *lossless_segment_bytes;
      continue;
    }
    bytes += internal::FixedPayloadBytes(
        codec, internal::SegmentShapeFor(geometry, s,
                                         internal::IsGroupedCodec(codec) ? plan.group_size : 0));
  }
  return bytes;
}

}  // namespace

std::optional<size_t> EncodedBytes(const BlockGeometry& geometry, const CodecPlan& plan,
                                   bool is_first_block) {
  if (!geometry.Validate().ok() || !internal::ValidPlan(plan).ok()) {
    return std::nullopt;
  }
  return ContainerBytes(geometry, plan, is_first_block, std::nullopt);
}

absl::Status EncodeBlockWithPath(CpuPath path, const BlockGeometry& geometry, const CodecPlan& plan,
                                 bool is_first_block, std::span<const std::byte> raw,
                                 std::span<const float> importance, std::string* out) {
  PROXIMA_RETURN_IF_ERROR(CheckPath(path));
  path = Resolve(path);
  PROXIMA_RETURN_IF_ERROR(geometry.Validate());
  if (raw.size() != geometry.RawBytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw block is ", raw.size(), " bytes, geometry needs ", geometry.RawBytes()));
  }
  if (!importance.empty() && importance.size() != geometry.tokens_per_block) {
    return absl::InvalidArgumentError(absl::StrCat(
        "importance has ", importance.size(), " values, expected ", geometry.tokens_per_block));
  }
  PROXIMA_RETURN_IF_ERROR(internal::ValidPlan(plan));
  const uint32_t num_segments = 2 * geometry.num_layers;
  const size_t seg_raw = geometry.SegmentElements() * 2;
  const size_t table_end = internal::kHeaderBytes + internal::kSegmentEntryBytes * num_segments;
  std::string block(table_end, '\0');
  // Reserve for the common case (fixed-size codecs) so appending segments does not reallocate.
  block.reserve(*ContainerBytes(geometry, plan, is_first_block, seg_raw + 1024));
  for (uint32_t s = 0; s < num_segments; ++s) {
    const CodecId codec = plan.CodecFor(s / 2, is_first_block);
    const uint32_t group = internal::IsGroupedCodec(codec) ? plan.group_size : 0;
    const SegmentShape shape = internal::SegmentShapeFor(geometry, s, group);
    const std::byte* in = raw.data() + s * seg_raw;
    const std::byte* layer_k = raw.data() + (s & ~1u) * seg_raw;
    const size_t before = block.size();
    PROXIMA_RETURN_IF_ERROR(
        EncodeSegment(path, codec, shape, in, layer_k, importance, plan.rope_theta, &block));
    std::byte* e = reinterpret_cast<std::byte*>(block.data()) + internal::kHeaderBytes +
                   internal::kSegmentEntryBytes * s;
    e[0] = std::byte{static_cast<uint8_t>(codec)};
    e[1] = std::byte{static_cast<uint8_t>(group == 0 ? 0 : std::countr_zero(group))};
    StoreLe<uint64_t>(e + 8, block.size() - before);
  }
  std::byte* h = reinterpret_cast<std::byte*>(block.data());
  std::memcpy(h, internal::kBlockMagic, 8);
  StoreLe<uint16_t>(h + 8, internal::kFormatVersion);
  h[10] = std::byte{static_cast<uint8_t>(geometry.dtype)};
  h[11] = std::byte{static_cast<uint8_t>(is_first_block ? 1 : 0)};
  StoreLe<uint32_t>(h + 12, geometry.num_layers);
  StoreLe<uint32_t>(h + 16, geometry.num_kv_heads);
  StoreLe<uint32_t>(h + 20, geometry.head_dim);
  StoreLe<uint32_t>(h + 24, geometry.tokens_per_block);
  StoreLe<uint32_t>(h + 28, num_segments);
  StoreLe<uint64_t>(h + 32, block.size() - table_end);
  SealCrcs(std::span<std::byte>(h, block.size()), table_end);
  *out = std::move(block);
  return absl::OkStatus();
}

absl::Status EncodeBlock(const BlockGeometry& geometry, const CodecPlan& plan, bool is_first_block,
                         std::span<const std::byte> raw, std::span<const float> importance,
                         std::string* out) {
  return EncodeBlockWithPath(CpuPath::kAuto, geometry, plan, is_first_block, raw, importance, out);
}

absl::StatusOr<BlockHeaderInfo> InspectBlock(std::span<const std::byte> encoded) {
  return ParseHeader(encoded, CrcCheck::kHeaderAndPayload);
}

absl::StatusOr<BlockHeaderInfo> InspectBlockHeader(std::span<const std::byte> encoded) {
  return ParseHeader(encoded, CrcCheck::kHeader);
}

absl::Status DecodeBlockWithPath(CpuPath path, std::span<const std::byte> encoded,
                                 std::span<std::byte> raw_out) {
  PROXIMA_RETURN_IF_ERROR(CheckPath(path));
  path = Resolve(path);
  PROXIMA_ASSIGN_OR_RETURN(BlockHeaderInfo info, ParseHeader(encoded, CrcCheck::kHeaderAndPayload));
  if (raw_out.size() != info.raw_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("output is ", raw_out.size(), " bytes, block decodes to ", info.raw_bytes));
  }
  const size_t seg_raw = info.geometry.SegmentElements() * 2;
  for (uint32_t s = 0; s < info.segments.size(); ++s) {
    const SegmentInfo& seg = info.segments[s];
    PROXIMA_RETURN_IF_ERROR(
        DecodeSegment(path, seg.codec, internal::SegmentShapeFor(info.geometry, s, seg.group_size),
                      encoded.subspan(seg.offset, seg.bytes), raw_out.data() + s * seg_raw));
  }
  return absl::OkStatus();
}

absl::Status DecodeBlock(std::span<const std::byte> encoded, std::span<std::byte> raw_out) {
  return DecodeBlockWithPath(CpuPath::kAuto, encoded, raw_out);
}

std::vector<absl::Status> EncodeBlocks(const BlockGeometry& geometry, const CodecPlan& plan,
                                       std::span<const EncodeRequest> requests, int num_threads) {
  std::vector<absl::Status> statuses(requests.size());
  ParallelFor(requests.size(), num_threads, [&](size_t i) {
    const EncodeRequest& r = requests[i];
    statuses[i] = r.out == nullptr
                      ? absl::InvalidArgumentError("EncodeRequest.out is null")
                      : EncodeBlock(geometry, plan, r.is_first_block, r.raw, r.importance, r.out);
  });
  return statuses;
}

std::vector<absl::Status> DecodeBlocks(std::span<const DecodeRequest> requests, int num_threads) {
  std::vector<absl::Status> statuses(requests.size());
  ParallelFor(requests.size(), num_threads, [&](size_t i) {
    statuses[i] = DecodeBlock(requests[i].encoded, requests[i].raw_out);
  });
  return statuses;
}

namespace internal {

bool IsGroupedCodec(CodecId c) {
  return c == CodecId::kInt4 || c == CodecId::kInt2 || c == CodecId::kK4v3;
}

absl::Status ValidPlan(const CodecPlan& plan) {
  if (plan.group_size != 32 && plan.group_size != 64 && plan.group_size != 128) {
    return absl::InvalidArgumentError("codec plan group size must be 32, 64 or 128");
  }
  return absl::OkStatus();
}

void ResealBlockForFuzzing(std::span<std::byte> block) {
  if (block.size() < kHeaderBytes) return;
  const uint64_t segments = LoadLe<uint32_t>(block.data() + 28);
  if (segments > 2 * kMaxDim) return;
  const size_t table_end = kHeaderBytes + kSegmentEntryBytes * segments;
  if (block.size() < table_end) return;
  SealCrcs(block, table_end);
}
}  // namespace internal

}  // namespace proxima::codec
