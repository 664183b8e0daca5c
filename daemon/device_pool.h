// DevicePool: one GPU's share of the GPU tier. Device memory of `tiers.gpu.capacity_bytes_per_
// device` is allocated once at start and sub-allocated into extents (the ExtentMap it is) that
// hold raw blocks, the hottest of the node. Host code never dereferences that memory: bytes move
// in and out through copies, and the tierer encodes blocks there, with the codec's CUDA kernels,
// before they move down to the host tier (BlockStore, Tierer).
//
// DeviceMemory is the memory behind a pool: the CUDA implementation (AllocateCudaMemory) in the
// daemon, and a stand-in over host memory in the tests of the tier logic, which run on machines
// without a GPU (the CUDA one is tested by the `gpu`-labelled tests, scripts/gpu-check.sh).
//
// Thread-safe: every method may be called concurrently (on distinct extents for the copies).
#ifndef PROXIMA_DAEMON_DEVICE_POOL_H_
#define PROXIMA_DAEMON_DEVICE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/extent_map.h"
#include "kernels/codec.h"

namespace proxima::daemon {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // The CUDA device ordinal.
  virtual int device() const = 0;
  virtual uint64_t size_bytes() const = 0;

  // Host bytes `src` to [offset, offset + src.size()); returns once they are there.
  virtual absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) = 0;
  // [offset, offset + dst.size()) to host bytes `dst`; returns once they are there.
  virtual absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) = 0;

  // The CRC32C (common/crc32c.h) of `bytes` bytes at each of `offsets`, into crcs (REQUIRES:
  // crcs.size() == offsets.size()), computed where the bytes are (on a GPU, by its kernels:
  // nothing is copied out). What the tierer checks a block against before encoding it there.
  virtual absl::Status Checksum(std::span<const uint64_t> offsets, uint64_t bytes,
                                std::span<uint32_t> crcs) = 0;

  // Encodes raw blocks of `geometry` (RawBytes() bytes at each job's offset) with `plan`, on the
  // device, in one batch; each job's `out` receives its STAR-KV container (host memory), the
  // same bytes codec::EncodeBlock gives for the codecs the GPU encodes bit-identically (every
  // codec but `star`, whose bytes may differ within its bound, and `lossless`, refused with
  // kUnimplemented: the caller encodes it on the CPU).
  struct EncodeJob {
    uint64_t offset = 0;
    bool is_first_block = false;
    std::string* out = nullptr;
  };
  virtual absl::Status Encode(const codec::BlockGeometry& geometry, const codec::CodecPlan& plan,
                              std::span<const EncodeJob> jobs) = 0;
};

// `bytes` of device memory on CUDA device `device` (one cudaMalloc), encoding with the codec's
// CUDA kernels. FailedPrecondition without CUDA or when the device is not visible,
// ResourceExhausted naming the device and size when the driver refuses.
absl::StatusOr<std::unique_ptr<DeviceMemory>> AllocateCudaMemory(int device, uint64_t bytes);

class DevicePool : public ExtentMap {
 public:
  // The pool's capacity is the memory's size rounded down to ExtentMap::kAlignment.
  // REQUIRES: memory->size_bytes() >= kAlignment.
  explicit DevicePool(std::unique_ptr<DeviceMemory> memory);

  int device() const { return memory_->device(); }
  DeviceMemory& memory() const { return *memory_; }

 private:
  const std::unique_ptr<DeviceMemory> memory_;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_DEVICE_POOL_H_
