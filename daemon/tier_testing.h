// Test support for the tiers' tests: real KV blocks, and device memory of either kind for the
// GPU tier's.
//
// RealBlocks: blocks cut from real KV of SmolLM2-135M (tools/eval/testdata), so that codec sizes
// and errors in tier tests are those of a real model. The file is the one PROXIMA_TEST_KV_FILE
// names in the environment (the GPU machine runs the tests from another checkout path), else the
// one the build defines.
//
// HostBackedDeviceMemory stands in for a GPU's memory on machines without one (every build
// machine and CI): host memory behind the DeviceMemory interface, encoding with the CPU codec,
// which gives the bytes the CUDA encoder gives for every codec but `star`. It can be told to fail
// its copies, a device fault that cannot be produced for real. The same tests run over the real
// CUDA memory (AllocateCudaMemory) where a GPU is visible (label `gpu`, scripts/gpu-check.sh).
#ifndef PROXIMA_DAEMON_TIER_TESTING_H_
#define PROXIMA_DAEMON_TIER_TESTING_H_

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "common/testing/status_matchers.h"
#include "daemon/device_pool.h"
#include "daemon/tierer.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/device.h"
#include "kernels/kv_file.h"

namespace proxima::daemon::testing {

inline constexpr uint32_t kTestTokens = 16;

inline std::string TestKvFile() {
  const char* path = std::getenv("PROXIMA_TEST_KV_FILE");
  return path != nullptr && path[0] != '\0' ? path : PROXIMA_TEST_KV_FILE;
}

// Real KV of SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16). Blocks keep the first
// `layers` layers (a prefix of the canonical layout) so that tests stay small.
class RealBlocks {
 public:
  explicit RealBlocks(uint32_t layers, uint32_t tokens = kTestTokens) : tokens_(tokens) {
    absl::StatusOr<codec::KvTensor> t = codec::ReadKvFile(TestKvFile());
    EXPECT_OK(t.status());
    tensor_ = *std::move(t);
    full_ = tensor_.BlockShape(tokens);
    geometry_ = full_;
    geometry_.num_layers = layers;
  }
  const codec::BlockGeometry& geometry() const { return geometry_; }
  uint32_t distinct() const { return tensor_.num_tokens - tokens_ + 1; }
  // Block n: tokens [n % distinct, +tokens), first `layers` layers.
  std::string Block(uint32_t n) const {
    std::string full(full_.RawBytes(), '\0');
    EXPECT_OK(tensor_.ExtractBlock(n % distinct(), tokens_,
                                   std::as_writable_bytes(std::span(full.data(), full.size()))));
    full.resize(geometry_.RawBytes());
    return full;
  }

 private:
  uint32_t tokens_;
  codec::KvTensor tensor_;
  codec::BlockGeometry full_, geometry_;
};

// The Tierer's profile lookup for tests with one registered profile: `geometry` (and the model's
// RoPE base `rope_theta`) for `profile_id`, unknown for any other.
inline auto OneProfile(uint64_t profile_id, const codec::BlockGeometry& geometry,
                       double rope_theta = 0.0) {
  return [profile_id, geometry, rope_theta](
             uint32_t, uint64_t profile) -> std::optional<Tierer::ProfileCodec> {
    if (profile != profile_id) return std::nullopt;
    return Tierer::ProfileCodec{geometry, rope_theta};
  };
}

class HostBackedDeviceMemory final : public DeviceMemory {
 public:
  HostBackedDeviceMemory(int device, uint64_t bytes) : device_(device), bytes_(bytes) {}

  int device() const override { return device_; }
  uint64_t size_bytes() const override { return bytes_.size(); }

  absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) override {
    if (fail_copies.load()) return absl::InternalError("copy failed (test fault)");
    PROXIMA_RETURN_IF_ERROR(Check(offset, src.size()));
    std::memcpy(bytes_.data() + offset, src.data(), src.size());
    copies_in.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) override {
    if (fail_copies.load()) return absl::InternalError("copy failed (test fault)");
    PROXIMA_RETURN_IF_ERROR(Check(offset, dst.size()));
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    copies_out.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status Checksum(std::span<const uint64_t> offsets, uint64_t bytes,
                        std::span<uint32_t> crcs) override {
    if (fail_encodes.load()) return absl::InternalError("checksum failed (test fault)");
    for (size_t i = 0; i < offsets.size(); ++i) {
      PROXIMA_RETURN_IF_ERROR(Check(offsets[i], bytes));
      crcs[i] = Crc32c(std::span<const std::byte>(bytes_.data() + offsets[i], bytes));
    }
    checksums.fetch_add(offsets.size());
    return absl::OkStatus();
  }
  absl::Status Encode(const codec::BlockGeometry& geometry, const codec::CodecPlan& plan,
                      std::span<const EncodeJob> jobs) override {
    if (fail_encodes.load()) return absl::InternalError("encode failed (test fault)");
    for (const EncodeJob& job : jobs) {
      PROXIMA_RETURN_IF_ERROR(Check(job.offset, geometry.RawBytes()));
      PROXIMA_RETURN_IF_ERROR(codec::EncodeBlock(
          geometry, plan, job.is_first_block,
          std::span<const std::byte>(bytes_.data() + job.offset, geometry.RawBytes()), {},
          job.out));
    }
    encode_batches.fetch_add(1);
    encoded_blocks.fetch_add(jobs.size());
    return absl::OkStatus();
  }

  std::atomic<bool> fail_copies{false};
  std::atomic<bool> fail_encodes{false};  // Checksum and Encode fail: the device computes nothing
  std::atomic<uint64_t> copies_in{0};
  std::atomic<uint64_t> copies_out{0};
  std::atomic<uint64_t> encode_batches{0};
  std::atomic<uint64_t> checksums{0};  // blocks checksummed
  std::atomic<uint64_t> encoded_blocks{0};

 private:
  absl::Status Check(uint64_t offset, uint64_t n) const {
    if (offset > bytes_.size() || n > bytes_.size() - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("range [", offset, ", +", n, ") outside ", bytes_.size(), " bytes"));
    }
    return absl::OkStatus();
  }
  const int device_;
  std::vector<std::byte> bytes_;
};

// Which memory a GPU tier test runs over.
enum class MemoryKind { kHostBacked, kCuda };

inline std::string MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kCuda ? "cuda" : "host_backed";
}

// `bytes` of device memory of `kind` for pool number `device`; for kCuda, null (and `why` set)
// when no CUDA device is visible.
inline std::unique_ptr<DeviceMemory> MakeDeviceMemory(MemoryKind kind, int device, uint64_t bytes,
                                                      std::string* why) {
  if (kind == MemoryKind::kHostBacked) {
    return std::make_unique<HostBackedDeviceMemory>(device, bytes);
  }
  std::vector<gpu::DeviceInfo> gpus = gpu::VisibleDevices(why);
  if (gpus.empty()) return nullptr;
  // Every pool on the first GPU when the machine has fewer than asked for.
  absl::StatusOr<std::unique_ptr<DeviceMemory>> m =
      AllocateCudaMemory(device % static_cast<int>(gpus.size()), bytes);
  if (!m.ok()) {
    *why = m.status().ToString();
    return nullptr;
  }
  return *std::move(m);
}

}  // namespace proxima::daemon::testing

#endif  // PROXIMA_DAEMON_TIER_TESTING_H_
