// Blocks in GPU memory through the client library against a real proximad: Put from and Get /
// Decompress into device buffers (contiguous and scatter/gather, device and host segments mixed),
// over UCX (UCX_TLS=tcp, and shared memory alone: posix,self) and inline, with staging halves
// small enough that a batch moves in many double-buffered chunks. Over UCX the halves must be
// UCX-allocated memory pinned with cudaHostRegister (the client logs when it falls back).
// Byte-exact against the test pattern, read back both through device buffers and through host
// buffers. Labels `integration;gpu`; every test skips (and says why)
// without a CUDA device, so it runs for real in scripts/gpu-check.sh.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/internal/gpu_testing.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

#if PROXIMA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace proxima {
namespace {

using ::proxima::client::BlockKey;
using ::proxima::client::Client;
using ::proxima::client::ClientOptions;
using ::proxima::client::Profile;
using ::proxima::client::PutOutcome;
using ::proxima::client::Transport;
using ::proxima::testing::DaemonProcess;

#if PROXIMA_WITH_CUDA
// A device allocation owned for the length of a test.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) { EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::byte* get() const { return static_cast<std::byte*>(ptr); }
  void* ptr = nullptr;
};

std::vector<std::byte> ToHost(const std::byte* device, size_t n) {
  std::vector<std::byte> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

struct StagingCase {
  Transport transport;
  const char* ucx_tls;  // UCX_TLS of the daemon and the client
  const char* name;
};

class GpuStagingTest : public ::testing::TestWithParam<StagingCase> {
 protected:
  void SetUp() override {
    PROXIMA_SKIP_WITHOUT_GPU();
    setenv("UCX_TLS", GetParam().ucx_tls, 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    auto d = DaemonProcess::Start({"tiers.host.capacity_bytes=256MiB", "server.max_batch_blocks=8"});
    ASSERT_OK(d.status());
    daemon_ = *std::move(d);
    ClientOptions options;
    options.target = daemon_->tcp_target();
    options.transport = GetParam().transport;
    options.call_timeout = absl::Seconds(20);
    // Two halves of 2 MiB: two 1 MiB blocks per chunk, so a 20-block batch takes 10 chunks.
    options.gpu_staging_bytes = size_t{4} << 20;
    auto c = Client::Connect(options);
    ASSERT_OK(c.status());
    client_ = *std::move(c);
    ASSERT_EQ(client_->transport(), GetParam().transport) << client_->transport_detail();
    // 16 layers x 2 x 8 heads x 128 dims x 16 tokens x 2 bytes / 16 = 1 MiB blocks.
    v1::ModelProfile model = testing::TestModel(16, "gpu-staging-model");
    model.set_num_layers(16);
    model.set_num_kv_heads(8);
    model.set_head_dim(128);
    ASSERT_OK_AND_ASSIGN(profile_, client_->RegisterProfile(model));
    ASSERT_EQ(profile_.block_bytes, size_t{1} << 20);
  }
  void TearDown() override { unsetenv("UCX_TLS"); }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  Profile profile_;
};

TEST_P(GpuStagingTest, PutFromDeviceAndGetIntoDeviceAreByteExact) {
  constexpr size_t kBlocks = 20;
  const size_t n = profile_.block_bytes;
  const std::vector<BlockKey> keys = client::TestKeyChain(7, 0, kBlocks);
  std::vector<std::byte> pattern(kBlocks * n);
  for (size_t i = 0; i < kBlocks; ++i) client::FillTestBlock(7, i, {pattern.data() + i * n, n});
  DeviceBuffer src(kBlocks * n), dst(kBlocks * n);
  ASSERT_EQ(cudaMemcpy(src.ptr, pattern.data(), pattern.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<std::span<const std::byte>> in;
  for (size_t i = 0; i < kBlocks; ++i) in.emplace_back(src.get() + i * n, n);
  // The first staged call makes the halves: over UCX in UCX-allocated memory, pinned, with no
  // fallback (which the client logs).
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::vector<PutOutcome>> put = client_->Put(profile_, keys, in);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr("GPU staging in UCX-allocated memory")));
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, std::move(put));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));

  // The daemon holds the pattern: read back into host memory.
  std::vector<std::byte> host(kBlocks * n);
  std::vector<std::span<std::byte>> host_out;
  for (size_t i = 0; i < kBlocks; ++i) host_out.emplace_back(host.data() + i * n, n);
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, client_->Get(profile_, keys, host_out));
  EXPECT_THAT(found, ::testing::Each(true));
  EXPECT_TRUE(host == pattern);

  // Into device memory, poisoned first; one key in the middle is missing.
  std::vector<BlockKey> with_miss = keys;
  with_miss[9] = client::TestKeyChain(99, 0, 1)[0];
  ASSERT_EQ(cudaMemset(dst.ptr, 0xA5, kBlocks * n), cudaSuccess);
  std::vector<std::span<std::byte>> out;
  for (size_t i = 0; i < kBlocks; ++i) out.emplace_back(dst.get() + i * n, n);
  ASSERT_OK_AND_ASSIGN(found, client_->Get(profile_, with_miss, out));
  const std::vector<std::byte> back = ToHost(dst.get(), kBlocks * n);
  for (size_t i = 0; i < kBlocks; ++i) {
    const std::span<const std::byte> b(back.data() + i * n, n);
    if (i == 9) {
      EXPECT_FALSE(found[i]);
      EXPECT_EQ(b[0], std::byte{0xA5}) << "a missed block's buffer was written";
      continue;
    }
    EXPECT_TRUE(found[i]) << i;
    EXPECT_TRUE(client::IsTestBlock(7, i, b)) << "block " << i;
  }

  // Decompress into device memory takes the same path.
  ASSERT_EQ(cudaMemset(dst.ptr, 0, kBlocks * n), cudaSuccess);
  ASSERT_OK_AND_ASSIGN(found, client_->Decompress(profile_, keys, out));
  EXPECT_THAT(found, ::testing::Each(true));
  EXPECT_TRUE(ToHost(dst.get(), kBlocks * n) == pattern);
}

TEST_P(GpuStagingTest, ScatteredBlocksMixDeviceAndHostSegments) {
  // Each block as four segments (as one per layer group): 0 and 2 on the device, 1 and 3 on
  // the host, of uneven sizes.
  constexpr size_t kBlocks = 6;
  const size_t n = profile_.block_bytes;
  const size_t cut[5] = {0, n / 8, n / 2, n / 2 + 4096, n};
  const std::vector<BlockKey> keys = client::TestKeyChain(8, 0, kBlocks);
  DeviceBuffer dev_in(kBlocks * n), dev_out(kBlocks * n);
  std::vector<std::byte> host_in(kBlocks * n), host_out(kBlocks * n);
  std::vector<client::ConstSegments> in(kBlocks);
  std::vector<client::Segments> out(kBlocks);
  for (size_t b = 0; b < kBlocks; ++b) {
    std::vector<std::byte> block(n);
    client::FillTestBlock(8, b, block);
    for (int s = 0; s < 4; ++s) {
      const size_t off = b * n + cut[s], len = cut[s + 1] - cut[s];
      if (s % 2 == 0) {
        ASSERT_EQ(cudaMemcpy(dev_in.get() + off, block.data() + cut[s], len,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
        in[b].emplace_back(dev_in.get() + off, len);
        out[b].emplace_back(dev_out.get() + off, len);
      } else {
        std::memcpy(host_in.data() + off, block.data() + cut[s], len);
        in[b].emplace_back(host_in.data() + off, len);
        out[b].emplace_back(host_out.data() + off, len);
      }
    }
  }
  ASSERT_OK_AND_ASSIGN(std::vector<PutOutcome> outcomes, client_->PutScattered(profile_, keys, in));
  EXPECT_THAT(outcomes, ::testing::Each(PutOutcome::kStored));
  ASSERT_OK_AND_ASSIGN(std::vector<bool> found, client_->GetScattered(profile_, keys, out));
  EXPECT_THAT(found, ::testing::Each(true));
  const std::vector<std::byte> dev_back = ToHost(dev_out.get(), kBlocks * n);
  for (size_t b = 0; b < kBlocks; ++b) {
    std::vector<std::byte> block(n);
    for (int s = 0; s < 4; ++s) {
      const size_t off = b * n + cut[s], len = cut[s + 1] - cut[s];
      std::memcpy(block.data() + cut[s], (s % 2 == 0 ? dev_back.data() : host_out.data()) + off,
                  len);
    }
    EXPECT_TRUE(client::IsTestBlock(8, b, block)) << "block " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuStagingTest,
                         ::testing::Values(StagingCase{Transport::kUcx, "tcp", "ucx"},
                                           StagingCase{Transport::kUcx, "posix,self", "ucx_shm"},
                                           StagingCase{Transport::kInline, "tcp", "inline"}),
                         [](const ::testing::TestParamInfo<StagingCase>& info) {
                           return std::string(info.param.name);
                         });
#endif  // PROXIMA_WITH_CUDA

}  // namespace
}  // namespace proxima
