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
#include <array>
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
  // `level` > 0 marks stored bytes encoded at that hierarchy level (GetResult.level).
  void AddHit(std::span<const std::byte> data, uint32_t crc32c,
              std::shared_ptr<const void> keep_alive, uint32_t level = 0);
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

// Serializes a proxima.v1.PutRequest. Each block's bytes are copied once, into slices the
// buffer owns, with their CRC32C computed on the way and sent as PutBlock.crc32c.
// REQUIRES: keys.size() == blocks.size().
// `positions`: empty, or one per block (PutBlock.position; negative = unset). `importance`:
// empty, or one per block (PutBlock.importance). `high_priority` sets PutRequest.priority.
grpc::ByteBuffer EncodePutRequest(const std::string& namespace_name, uint64_t profile_id,
                                  std::span<const std::array<uint8_t, 32>> keys,
                                  std::span<const std::span<const std::byte>> blocks,
                                  std::span<const int64_t> positions = {},
                                  bool high_priority = false,
                                  std::span<const float> importance = {});

// A parsed proxima.v1.PutRequest whose block bytes still sit in the received slices.
class PutRequestReader {
 public:
  struct Block {
    std::string key;
    uint64_t data_size = 0;
    bool has_crc32c = false;
    uint32_t crc32c = 0;
    bool has_position = false;
    uint32_t position = 0;
    float importance = 0;
    size_t slice = 0;  // where the data starts
    size_t offset = 0;
  };

  // Parses the message structure. INVALID_ARGUMENT when it is not a well-formed PutRequest;
  // RESOURCE_EXHAUSTED as soon as it holds more than `max_blocks` blocks (a hostile message of
  // millions of tiny blocks is refused before it costs memory).
  absl::Status Parse(const grpc::ByteBuffer& buffer, size_t max_blocks);

  const std::string& namespace_name() const { return namespace_name_; }
  uint64_t profile_id() const { return profile_id_; }
  uint32_t priority() const { return priority_; }  // PutRequest.priority (v1::Priority)
  const std::vector<Block>& blocks() const { return blocks_; }

  // CRC32C of block i's data, read in place.
  uint32_t DataCrc32c(size_t i) const;
  // Copies block i's data into `dst`. REQUIRES: dst.size() == blocks()[i].data_size.
  void CopyData(size_t i, std::span<std::byte> dst) const;

 private:
  std::vector<grpc::Slice> slices_;
  std::string namespace_name_;
  uint64_t profile_id_ = 0;
  uint32_t priority_ = 0;
  std::vector<Block> blocks_;
};

// A parsed GetRequest, LookupRequest, DeleteRequest or DecompressRequest (they share one
// layout: namespace_name = 1, profile_id = 2, repeated bytes keys = 3; GetRequest adds
// format = 4 and client_verifies_crc32c = 8).
struct KeyedRequest {
  std::string namespace_name;
  uint64_t profile_id = 0;
  std::vector<std::string> keys;
  uint32_t format = 0;  // GetRequest.format (v1::BlockFormat); 0 elsewhere
  bool client_verifies_crc32c = false;
};

// Parses a keyed request. INVALID_ARGUMENT when malformed (or a key is over 1 KiB);
// RESOURCE_EXHAUSTED as soon as it holds more than `max_keys` keys, so that a hostile message of
// millions of empty keys is refused before protobuf would have allocated them all.
absl::Status ParseKeyedRequest(const grpc::ByteBuffer& buffer, size_t max_keys,
                               const char* method, KeyedRequest* out);

// Trailing metadata of a RESOURCE_EXHAUSTED refusal that holds only because calls still running
// in the daemon hold what this one needs: by server.max_inflight_bytes_per_client, the client's
// earlier calls still hold bytes (released once gRPC has finished sending their responses,
// which can be a while after the client has them, the daemon's threads starved of CPU); by
// server.max_connections, other connections have calls running. The same call fits a moment
// later: a client may send it again after a short wait. Absent when the call alone is over the
// byte limit.
inline constexpr char kRetryWhenReleasedMetadata[] = "proxima-retry-when-released";

}  // namespace proxima::wire

#endif  // PROXIMA_PROTO_WIRE_H_
