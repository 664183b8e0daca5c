#include "kernels/kv_file.h"

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace proxima::codec {
namespace {

constexpr char kMagic[8] = {'P', 'X', 'K', 'V', 'D', 'U', 'M', 'P'};
constexpr size_t kHeaderBytes = 40;
// A dump larger than this is refused rather than allocated (a lying header must not OOM us).
constexpr uint64_t kMaxDataBytes = uint64_t{16} << 30;

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

BlockGeometry KvTensor::BlockShape(uint32_t tokens_per_block) const {
  return BlockGeometry{num_layers, num_kv_heads, head_dim, tokens_per_block, dtype};
}

absl::Status KvTensor::ExtractBlock(uint32_t t0, uint32_t tokens_per_block,
                                    std::span<std::byte> raw_block) const {
  if (uint64_t{t0} + tokens_per_block > num_tokens) {
    return absl::OutOfRangeError(absl::StrCat("tokens [", t0, ", ", t0 + uint64_t{tokens_per_block},
                                              ") past the dump's ", num_tokens, " tokens"));
  }
  const size_t row = size_t{num_kv_heads} * head_dim;  // elements per token
  const size_t seg = size_t{tokens_per_block} * row;
  if (raw_block.size() != 2 * num_layers * seg * 2) {
    return absl::InvalidArgumentError("raw_block has the wrong size");
  }
  for (size_t s = 0; s < 2 * size_t{num_layers}; ++s) {
    const uint16_t* src = data.data() + (s * num_tokens + t0) * row;
    std::memcpy(raw_block.data() + s * seg * 2, src, seg * 2);
  }
  return absl::OkStatus();
}

absl::StatusOr<KvTensor> ParseKvFile(std::span<const std::byte> bytes) {
  if (bytes.size() < kHeaderBytes) return absl::InvalidArgumentError("kv dump: truncated header");
  const std::byte* p = bytes.data();
  if (std::memcmp(p, kMagic, 8) != 0) return absl::InvalidArgumentError("kv dump: bad magic");
  if (Load<uint32_t>(p + 8) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv dump: unsupported version ", Load<uint32_t>(p + 8)));
  }
  KvTensor t;
  t.num_layers = Load<uint32_t>(p + 12);
  t.num_kv_heads = Load<uint32_t>(p + 16);
  t.head_dim = Load<uint32_t>(p + 20);
  t.num_tokens = Load<uint32_t>(p + 24);
  const uint32_t dtype = Load<uint32_t>(p + 28);
  const uint64_t data_bytes = Load<uint64_t>(p + 32);
  if (dtype != 1 && dtype != 2) return absl::InvalidArgumentError("kv dump: unknown dtype");
  t.dtype = static_cast<DType>(dtype);
  if (t.num_layers == 0 || t.num_kv_heads == 0 || t.head_dim == 0 || t.num_tokens == 0 ||
      t.num_layers > 1024 || t.num_kv_heads > 1024 || t.head_dim > 1024) {
    return absl::InvalidArgumentError("kv dump: dimensions out of range");
  }
  const uint64_t expect =
      uint64_t{2} * t.num_layers * t.num_tokens * t.num_kv_heads * t.head_dim * 2;
  if (expect > kMaxDataBytes || data_bytes != expect) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv dump: data_bytes ", data_bytes, " does not match the dimensions (", expect, ")"));
  }
  if (bytes.size() != kHeaderBytes + data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv dump: file is ", bytes.size(), " bytes, header says ", kHeaderBytes + data_bytes));
  }
  t.data.resize(data_bytes / 2);
  std::memcpy(t.data.data(), p + kHeaderBytes, data_bytes);
  return t;
}

absl::StatusOr<KvTensor> ReadKvFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open kv dump ", path));
  const std::streamoff size = f.tellg();
  if (size < 0 || static_cast<uint64_t>(size) > kMaxDataBytes + kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv dump ", path, ": bad size"));
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  f.seekg(0);
  if (!f.read(bytes.data(), size)) {
    return absl::DataLossError(absl::StrCat("short read of kv dump ", path));
  }
  return ParseKvFile(std::as_bytes(std::span<const char>(bytes)));
}

std::string SerializeKvFile(const KvTensor& t) {
  std::string out(kHeaderBytes, '\0');
  std::memcpy(out.data(), kMagic, 8);
  const uint32_t fields[6] = {1,          t.num_layers, t.num_kv_heads,
                              t.head_dim, t.num_tokens, static_cast<uint32_t>(t.dtype)};
  std::memcpy(out.data() + 8, fields, sizeof(fields));
  const uint64_t data_bytes = t.data.size() * 2;
  std::memcpy(out.data() + 32, &data_bytes, 8);
  out.append(reinterpret_cast<const char*>(t.data.data()), data_bytes);
  return out;
}

}  // namespace proxima::codec
