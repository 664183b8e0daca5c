// Byte views of strings: the codec, CRC32C and the tiers take std::span<const std::byte>, and
// protobuf and gRPC hand block bytes over as std::string.
#ifndef PROXIMA_COMMON_BYTES_H_
#define PROXIMA_COMMON_BYTES_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace proxima {

inline std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

inline std::span<std::byte> AsWritableBytes(std::string& s) {
  return std::as_writable_bytes(std::span<char>(s.data(), s.size()));
}

}  // namespace proxima

#endif  // PROXIMA_COMMON_BYTES_H_
