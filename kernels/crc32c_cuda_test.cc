// Crc32cBatchCuda against common/crc32c.h's Crc32c on random spans of device memory: odd lengths
// and addresses, empty and one-byte spans, 4 MiB spans, thousands of spans in one batch,
// overlapping spans, a non-default stream. Label `gpu`; every test skips (and says why) when no
// CUDA device is visible.
#include "kernels/crc32c_cuda.h"

#include <cstdio>
#include <random>
#include <vector>

#include "common/crc32c.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/internal/gpu_testing.h"

#if PROXIMA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace proxima::gpu {
namespace {

using ::proxima::testing::StatusIs;

#if PROXIMA_WITH_CUDA
// Random bytes on the host and the same bytes on the device.
struct Buffer {
  Buffer(size_t n, uint64_t seed) : host(n) {
    std::mt19937_64 rng(seed);
    for (auto& b : host) b = static_cast<std::byte>(rng());
    EXPECT_EQ(cudaMalloc(&dev, n), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dev, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() { cudaFree(dev); }
  const std::byte* d(size_t off) const { return static_cast<const std::byte*>(dev) + off; }
  std::vector<std::byte> host;
  void* dev = nullptr;
};

struct Piece {
  size_t offset;
  size_t size;
};

// Checks every piece's GPU CRC (one batch) against Crc32c of the host copy.
void ExpectBatchMatches(const Buffer& buf, const std::vector<Piece>& pieces, cudaStream_t stream) {
  std::vector<DeviceSpan> spans;
  for (const Piece& p : pieces) spans.push_back({buf.d(p.offset), p.size});
  std::vector<uint32_t> got(spans.size(), 0xDEADBEEFu);
  ASSERT_OK(Crc32cBatchCudaToHost(spans, got, stream));
  int bad = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint32_t want =
        Crc32c(std::span<const std::byte>(buf.host.data() + pieces[i].offset, pieces[i].size));
    if (got[i] != want && ++bad <= 10) {
      ADD_FAILURE() << "span " << i << " offset " << pieces[i].offset << " size "
                    << pieces[i].size << ": got " << got[i] << " want " << want;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << pieces.size() << " spans";
}
#endif

TEST(Crc32cCudaTest, SmallAndEdgeSpans) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  Buffer buf(1 << 20, 1);
  std::vector<Piece> pieces = {{0, 0}, {5, 0}, {0, 1}, {1, 1}, {7, 3}, {3, 16}, {16, 17}};
  // Every start offset 0..63 with lengths around 16-byte, lane (512) and chunk (16 KiB) sizes.
  for (size_t off = 0; off < 64; ++off) {
    for (size_t len : {2, 15, 16, 31, 33, 511, 512, 513, 16383, 16384, 16385, 40000}) {
      pieces.push_back({16384 - 32 + off, len});
    }
  }
  ExpectBatchMatches(buf, pieces, nullptr);
#endif
}

TEST(Crc32cCudaTest, LargeSpansAtOddAddresses) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  Buffer buf((4 << 20) + 4096, 2);
  ExpectBatchMatches(buf, {{0, 4 << 20}, {1, 4 << 20}, {4095, 4 << 20}, {3, (4 << 20) - 5}},
                     nullptr);
#endif
}

TEST(Crc32cCudaTest, ThousandsOfRandomSpansInOneBatch) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  const size_t kBytes = 64 << 20;
  Buffer buf(kBytes, 3);
  std::mt19937_64 rng(4);
  std::vector<Piece> pieces;
  for (int i = 0; i < 5000; ++i) {
    size_t len;
    switch (rng() % 4) {
      case 0: len = rng() % 64; break;                              // tiny, often empty
      case 1: len = 100 * 1024 + rng() % (2 << 20); break;          // 0.1-2 MiB blocks
      case 2: len = (700 << 10) + (rng() % 2) * (rng() % 4096); break;
      default: len = rng() % 70000; break;
    }
    pieces.push_back({rng() % (kBytes - len + 1), len});  // overlapping, any alignment
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ExpectBatchMatches(buf, pieces, stream);
  cudaStreamDestroy(stream);
#endif
}

TEST(Crc32cCudaTest, WritesTheDeviceArrayInStreamOrder) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  Buffer buf(3 << 20, 5);
  std::vector<DeviceSpan> spans = {{buf.d(0), 3 << 20}, {buf.d(11), 100000}, {nullptr, 0}};
  uint32_t* out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), 3 * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(out, 0xAB, 3 * sizeof(uint32_t)), cudaSuccess);
  ASSERT_OK(Crc32cBatchCuda(spans, out, nullptr));
  uint32_t got[3];
  ASSERT_EQ(cudaMemcpy(got, out, sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(out);
  EXPECT_EQ(got[0], Crc32c(std::span<const std::byte>(buf.host.data(), 3 << 20)));
  EXPECT_EQ(got[1], Crc32c(std::span<const std::byte>(buf.host.data() + 11, 100000)));
  EXPECT_EQ(got[2], 0u);
#endif
}

TEST(Crc32cCudaTest, RejectsBadArguments) {
  PROXIMA_SKIP_WITHOUT_GPU();
  std::vector<DeviceSpan> spans = {{nullptr, 4}};
  uint32_t host_out[1];
  EXPECT_THAT(Crc32cBatchCudaToHost(spans, host_out, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(Crc32cBatchCuda(spans, nullptr, nullptr), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(Crc32cBatchCudaToHost(spans, std::span<uint32_t>(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_OK(Crc32cBatchCuda({}, nullptr, nullptr));  // empty batch: nothing enqueued
}

}  // namespace
}  // namespace proxima::gpu
