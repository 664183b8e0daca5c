// The CUDA gather/scatter (GatherBlocksCuda / ScatterBlocksCuda) against the CPU path, byte for
// byte, on the layouts of kernels/kv_layout_test.cc copied to device memory. Label `gpu`; every
// test skips (and says why) when no CUDA device is visible.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kernels/internal/gpu_testing.h"
#include "kernels/internal/kv_layout_testing.h"
#include "kernels/kv_layout.h"

#if PROXIMA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace proxima::kv_layout {
namespace {

using ::proxima::testing::StatusIs;
using testing::PagedKv;
using testing::Spec;

#if PROXIMA_WITH_CUDA
// Device copy of host bytes, owned for the length of a test.
struct DeviceBuffer {
  explicit DeviceBuffer(const std::vector<std::byte>& host) : size(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, size), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), size, cudaMemcpyHostToDevice), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  std::vector<std::byte> ToHost() const {
    std::vector<std::byte> out(size);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::byte* get() const { return static_cast<std::byte*>(ptr); }
  void* ptr = nullptr;
  size_t size;
};

// The paged tensors of `kv` on the device, and the layout pointing there.
struct DeviceKv {
  explicit DeviceKv(const PagedKv& kv) : layout(kv.layout) {
    for (const auto& b : kv.buffers) buffers.push_back(std::make_unique<DeviceBuffer>(b));
    const size_t per_layer = kv.spec.separate_kv ? 2 : 1;
    for (size_t l = 0; l < layout.layers.size(); ++l) {
      layout.layers[l].data = buffers[l * per_layer]->get();
      if (per_layer == 2) layout.layers[l].v_data = buffers[l * per_layer + 1]->get();
    }
  }
  std::vector<std::vector<std::byte>> ToHost() const {
    std::vector<std::vector<std::byte>> out;
    for (const auto& b : buffers) out.push_back(b->ToHost());
    return out;
  }
  PagedLayout layout;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
};

std::vector<Spec> Specs() {
  std::vector<Spec> specs;
  std::mt19937_64 rng(11);
  for (int i = 0; i < 200; ++i) specs.push_back(testing::RandomSpec(rng));
  Spec big;  // a real-sized block: 128-dim heads, 16 tokens, bf16, HND with padding
  big.layers = 4;
  big.heads = 8;
  big.head_dim = 128;
  big.tokens = 16;
  big.num_blocks = 64;
  big.order = {testing::kBlock, testing::kKv, testing::kHead, testing::kToken, testing::kDim};
  specs.push_back(big);
  big.order = {testing::kKv, testing::kBlock, testing::kToken, testing::kHead, testing::kDim};
  big.padding[testing::kBlock] = 8;
  specs.push_back(big);
  return specs;
}
#endif

TEST(KvLayoutCudaTest, GatherMatchesCpu) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  std::mt19937_64 rng(12);
  for (const Spec& spec : Specs()) {
    // One paged block per canonical block, and three (one part of them kNoBlock: not read).
    for (uint32_t n : {1u, 3u}) {
      SCOPED_TRACE(absl::StrCat(spec.ToString(), " blocks_per_canonical=", n));
      PagedKv kv(spec);
      kv.layout.blocks_per_canonical = n;
      DeviceKv dev(kv);
      const size_t bb = kv.layout.BlockBytes();
      std::vector<uint64_t> ids;
      for (int i = 0; i < 9; ++i) ids.push_back(rng() % spec.num_blocks);
      if (n > 1) ids[4] = kNoBlock;
      const size_t blocks = ids.size() / n;
      std::vector<std::byte> want(blocks * bb, std::byte{0x77});
      std::vector<std::byte*> want_ptrs;
      for (size_t i = 0; i < blocks; ++i) want_ptrs.push_back(want.data() + i * bb);
      ASSERT_OK(GatherBlocks(kv.layout, ids, want_ptrs));
      DeviceBuffer out(std::vector<std::byte>(blocks * bb, std::byte{0x77}));
      std::vector<std::byte*> out_ptrs;
      for (size_t i = 0; i < blocks; ++i) out_ptrs.push_back(out.get() + i * bb);
      ASSERT_OK(GatherBlocksCuda(dev.layout, ids, out_ptrs, nullptr));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(out.ToHost(), want);
    }
  }
#endif
}

TEST(KvLayoutCudaTest, ScatterMatchesCpuEveryByte) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  std::mt19937_64 rng(13);
  for (const Spec& spec : Specs()) {
    // One paged block per canonical block, and three (the first part kNoBlock: not written).
    for (uint32_t n : {1u, 3u}) {
      SCOPED_TRACE(absl::StrCat(spec.ToString(), " blocks_per_canonical=", n));
      PagedKv kv(spec);
      kv.layout.blocks_per_canonical = n;
      DeviceKv dev(kv);
      const size_t bb = kv.layout.BlockBytes();
      std::vector<uint64_t> ids(spec.num_blocks);
      for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(std::min<size_t>(ids.size(), 7) / n * n);
      if (n > 1 && !ids.empty()) ids[0] = kNoBlock;
      const size_t blocks = ids.size() / n;
      std::vector<std::byte> src(blocks * bb);
      for (std::byte& b : src) b = static_cast<std::byte>(rng());
      std::vector<const std::byte*> src_ptrs;
      for (size_t i = 0; i < blocks; ++i) src_ptrs.push_back(src.data() + i * bb);
      ASSERT_OK(ScatterBlocks(kv.layout, ids, src_ptrs));
      DeviceBuffer dsrc(src);
      std::vector<const std::byte*> dsrc_ptrs;
      for (size_t i = 0; i < blocks; ++i) dsrc_ptrs.push_back(dsrc.get() + i * bb);
      ASSERT_OK(ScatterBlocksCuda(dev.layout, ids, dsrc_ptrs, nullptr));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(dev.ToHost(), kv.buffers);  // padding and other blocks untouched too
    }
  }
#endif
}

TEST(KvLayoutCudaTest, BadInputIsRejectedOnTheHost) {
  PROXIMA_SKIP_WITHOUT_GPU();
  PagedKv kv(Spec{});
  std::vector<std::byte> out(kv.layout.BlockBytes());
  std::vector<std::byte*> dst = {out.data()};
  std::vector<uint64_t> ids = {99};
  EXPECT_THAT(GatherBlocksCuda(kv.layout, ids, dst, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("block id 99")));
}

}  // namespace
}  // namespace proxima::kv_layout
