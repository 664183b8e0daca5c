// Reader for `.pkv` KV dump files (written by tools/eval from a real model; format in
// docs/format.md section 5): the full K and V of one sequence, layout
// [layer][k|v][token][head][dim], fp16 or bf16. Benchmarks and error figures slice blocks out
// of it. Thread-safety: pure functions; a KvTensor is a plain value.
#ifndef PROXIMA_KERNELS_KV_FILE_H_
#define PROXIMA_KERNELS_KV_FILE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace proxima::codec {

struct KvTensor {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t num_tokens = 0;
  DType dtype = DType::kBf16;
  std::vector<uint16_t> data;  // [layer][k|v][token][head][dim]

  // Geometry of a block of `tokens_per_block` tokens of this tensor.
  BlockGeometry BlockShape(uint32_t tokens_per_block) const;
  // Copies tokens [t0, t0 + tokens_per_block) into `raw_block` (BlockShape().RawBytes() bytes,
  // canonical block layout). kOutOfRange when the tokens run past the end.
  absl::Status ExtractBlock(uint32_t t0, uint32_t tokens_per_block,
                            std::span<std::byte> raw_block) const;
};

// kNotFound when the file does not exist, kInvalidArgument when it is not a valid dump.
absl::StatusOr<KvTensor> ReadKvFile(const std::string& path);
// Parses an in-memory dump (what ReadKvFile does after reading the file).
absl::StatusOr<KvTensor> ParseKvFile(std::span<const std::byte> bytes);
// Serialises `tensor` in the dump format (tests and tools).
std::string SerializeKvFile(const KvTensor& tensor);

}  // namespace proxima::codec

#endif  // PROXIMA_KERNELS_KV_FILE_H_
