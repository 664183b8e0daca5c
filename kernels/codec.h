// STAR-KV codec: encodes one KV block (all layers of `tokens_per_block` tokens, canonical layout
// [layer][k|v][token][head][dim]) into a versioned, self-describing container and back. The
// container carries one segment per (layer, K|V), each with its own codec, so one block can keep
// its first layers at higher fidelity than the rest. The byte format is docs/format.md.
//
// The decoder treats every input as hostile: any malformed, truncated or corrupted block yields
// an error status (kInvalidArgument, kUnimplemented for an unknown version, kDataLoss for a CRC
// mismatch), never a crash or an out-of-bounds access.
//
// The functions here run on the CPU (AVX-512 or AVX2 fast path chosen at run time, scalar
// reference otherwise; all give identical bytes). CUDA batch entry points are in
// kernels/codec_cuda.h. Thread-safety: every function is pure; concurrent calls on distinct outputs
// are safe.
#ifndef PROXIMA_KERNELS_CODEC_H_
#define PROXIMA_KERNELS_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace proxima::codec {

enum class DType : uint8_t { kFp16 = 1, kBf16 = 2 };

// Values are the on-disk codec ids; do not renumber.
enum class CodecId : uint8_t {
  kRaw = 0,
  kLossless = 1,
  kFp8 = 2,
  kInt8 = 3,
  kInt4 = 4,
  kInt2 = 5,
  kStar = 6,
  kK4v3 = 7,  // K at 4 bits in the block's RoPE frame, V at 3 bits after a Hadamard rotation
};
inline constexpr int kNumCodecs = 8;

std::string_view CodecName(CodecId codec);
absl::StatusOr<CodecId> ParseCodecName(std::string_view name);
// True for raw and lossless (decoding gives back the input bytes).
bool IsExact(CodecId codec);
// Higher is closer to the input: raw = lossless > int8 > fp8 > int4 > k4v3 > star > int2.
int Fidelity(CodecId codec);

struct BlockGeometry {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens_per_block = 0;
  DType dtype = DType::kBf16;

  // 2 * L * T * H * D * 2 bytes.
  size_t RawBytes() const;
  // Elements of one (layer, K|V) segment: T * H * D.
  size_t SegmentElements() const;
  // OK when every dimension is within the format's limits (docs/format.md section 1).
  absl::Status Validate() const;
  bool operator==(const BlockGeometry&) const = default;
};

// Which codec each layer of a block gets. See docs/format.md section 4.
struct CodecPlan {
  struct LayerRange {
    uint32_t begin = 0;  // first layer
    uint32_t end = 0;    // one past the last layer
    CodecId codec = CodecId::kRaw;
  };
  CodecId default_codec = CodecId::kRaw;
  std::vector<LayerRange> layer_ranges;  // first match wins
  std::optional<CodecId> sink_codec;     // floor of fidelity for the first block of a sequence
  uint32_t group_size = 64;              // int4/int2 (and k4v3's K) group: 32, 64 or 128
  // The model's RoPE base (theta), which k4v3 un-rotates K with; 0 = unknown (no rotation: k4v3's
  // K is then quantized as int4 quantizes it). Other codecs ignore it.
  double rope_theta = 0.0;

  CodecId CodecFor(uint32_t layer, bool is_first_block) const;
  // The canonical text form; ParseCodecPlan(ToString()) gives back an equal plan.
  std::string ToString() const;
  // This plan for a model whose RoPE base is `model_rope_theta` (0: unknown): the plan's own
  // rope_theta when it names one (the operator's word wins), else the model's.
  CodecPlan ForModel(double model_rope_theta) const;
};

// A RoPE base the codec takes: 0 (unknown), or a number from kMinRopeTheta to kMaxRopeTheta.
inline constexpr double kMinRopeTheta = 1.0;
inline constexpr double kMaxRopeTheta = 1e12;
bool RopeThetaValid(double rope_theta);

// Parses "int4" or "layers[0:4]=int8,default=int4,sink=int8,group=64" (and rope_theta=100000
// for k4v3). kInvalidArgument naming the offending item on error.
absl::StatusOr<CodecPlan> ParseCodecPlan(std::string_view text);

// Encodes one raw block. `raw`: RawBytes() bytes, [layer][k|v][token][head][dim]. `importance`:
// empty, or tokens_per_block values (higher = more important; only `star` uses it; the key norm
// is used when empty). `out` is replaced by the encoded block on success, untouched on error.
absl::Status EncodeBlock(const BlockGeometry& geometry, const CodecPlan& plan, bool is_first_block,
                         std::span<const std::byte> raw, std::span<const float> importance,
                         std::string* out);

// The exact size of EncodeBlock's output for `plan` on `geometry`, known without encoding when
// no layer of the plan (for this block position) is lossless, whose size depends on the data:
// nullopt then, and for a geometry or plan that EncodeBlock refuses.
std::optional<size_t> EncodedBytes(const BlockGeometry& geometry, const CodecPlan& plan,
                                   bool is_first_block);

struct SegmentInfo {
  CodecId codec = CodecId::kRaw;
  uint32_t group_size = 0;  // int4/int2/k4v3 only, else 0
  uint64_t offset = 0;      // of the payload inside the encoded block
  uint64_t bytes = 0;
};

struct BlockHeaderInfo {
  uint16_t version = 0;
  BlockGeometry geometry;
  bool is_first_block = false;
  std::vector<SegmentInfo> segments;  // 2 * num_layers, order [layer][k|v]
  size_t raw_bytes = 0;
  size_t encoded_bytes = 0;
  uint32_t payload_crc = 0;  // the payload CRC32C the header carries
};

// Validates the header, the segment table, both CRCs and every size; does not decode.
absl::StatusOr<BlockHeaderInfo> InspectBlock(std::span<const std::byte> encoded);
// The same except the payload CRC, for callers that check it elsewhere against payload_crc (the
// CUDA decoder checks it on the GPU, over the device copy it decodes).
absl::StatusOr<BlockHeaderInfo> InspectBlockHeader(std::span<const std::byte> encoded);

// Decodes into `raw_out`, whose size must equal the block's RawBytes().
absl::Status DecodeBlock(std::span<const std::byte> encoded, std::span<std::byte> raw_out);

// ---- Batched, multi-threaded CPU entry points. One status per block, in request order.
struct EncodeRequest {
  std::span<const std::byte> raw;
  std::span<const float> importance;  // may be empty
  bool is_first_block = false;
  std::string* out = nullptr;
};
struct DecodeRequest {
  std::span<const std::byte> encoded;
  std::span<std::byte> raw_out;
};
// `num_threads` <= 0: std::thread::hardware_concurrency().
std::vector<absl::Status> EncodeBlocks(const BlockGeometry& geometry, const CodecPlan& plan,
                                       std::span<const EncodeRequest> requests, int num_threads);
std::vector<absl::Status> DecodeBlocks(std::span<const DecodeRequest> requests, int num_threads);

// ---- CPU implementation selection (tests and benchmarks compare the paths).
enum class CpuPath : uint8_t { kAuto, kScalar, kAvx2, kAvx512 };
// Checked at run time: kAvx512 when the CPU has AVX-512 F, BW and VL and the OS saves the zmm
// state (unless the environment sets PROXIMA_CODEC_AVX512=0), else kAvx2 when it has AVX2 and
// F16C, else kScalar. Every path gives the same bytes.
CpuPath BestCpuPath();
// Whether this machine can run `path` (kAuto and kScalar: always).
bool CpuPathAvailable(CpuPath path);
// "auto", "scalar", "avx2", "avx512"; ParseCpuPath takes the same names.
std::string_view CpuPathName(CpuPath path);
absl::StatusOr<CpuPath> ParseCpuPath(std::string_view name);
// The same as EncodeBlock/DecodeBlock, on a chosen path. kInvalidArgument (kFailedPrecondition
// when the CPU lacks it) for a path this machine cannot run.
absl::Status EncodeBlockWithPath(CpuPath path, const BlockGeometry& geometry, const CodecPlan& plan,
                                 bool is_first_block, std::span<const std::byte> raw,
                                 std::span<const float> importance, std::string* out);
absl::Status DecodeBlockWithPath(CpuPath path, std::span<const std::byte> encoded,
                                 std::span<std::byte> raw_out);

}  // namespace proxima::codec

#endif  // PROXIMA_KERNELS_CODEC_H_
