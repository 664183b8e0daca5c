// Zero-copy encoding of the block-carrying proxima.v1 messages on gRPC byte buffers.
//
// Block bytes are megabytes; letting protobuf parse them into std::string and serialize them
// back costs a copy on each side. These functions produce and consume the exact proto3 wire
// format of GetResponse, so any gRPC client or server that uses the generated classes
// interoperates with them, but the block data travels as slices that point at tier memory
// (server side, kept alive by a pin) or are copied once, with the CRC32C computed on the way,
// straight into the caller's buffer (client side). Parsing treats its input as untrusted: any
// malformed or truncated field is an error, never an out-of-bounds access.
//
// Thread-compatible.
#ifndef PROXIMA_PROTO_WIRE_H_
#define PROXIMA_PROTO_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace proxima::wire {

// Builds a serialized proxima.v1.GetResponse from results added in request order.
class GetResponseWriter {
 public:
  void AddMiss();
  // A found block. `data` stays referenced (not copied) until gRPC has sent it; `keep_alive`
  // owns whatever keeps `data` valid (a pin on the stored block) and is released then.
  void AddHit(std::span<const std::byte> data, uint32_t crc32c,
              std::shared_ptr<const void> keep_alive);
  grpc::ByteBuffer Finish();

 private:
  std::string pending_;  // small header/trailer bytes not yet cut into a slice
  std::vector<grpc::Slice> slices_;
};

struct GetResult {
  bool found = false;
  bool intact = false;  // data had the expected size and matched its CRC32C
};

// Parses a serialized GetResponse with exactly `out.size()` results, copying each found block
// into out[i] (which must be exactly that block's size) and checking its CRC32C on the way.
// Results that are absent, of the wrong size, or fail their CRC come back not intact; the
// contents of their out[i] are then unspecified. INTERNAL when the message is malformed.
absl::Status ParseGetResponse(const grpc::ByteBuffer& buffer,
                              std::span<const std::span<std::byte>> out,
                              std::vector<GetResult>* results);

}  // namespace proxima::wire

#endif  // PROXIMA_PROTO_WIRE_H_
