// GPU backend against the CPU reference: decoding is bit-identical for every codec the GPU
// decodes, and GPU encoding of the quantizers is bit-identical to the CPU encoder. Head dims that
// are multiples of 8 take the fast path (8 elements per thread, fused encode), dim 20 the
// per-element path. Label `gpu`;
// every test skips (and says why) when no CUDA device is visible.
#include "kernels/codec_cuda.h"

#include <cstdio>

#include "common/status_macros.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/device.h"
#include "kernels/error_metrics.h"
#include "kernels/internal/gpu_testing.h"
#include "kernels/internal/make_segment_job.h"
#include "kernels/internal/test_blocks.h"
#include "tests/fuzz/codec_encode_fuzz_body.h"
#include "tests/fuzz/corpus_replay.h"

#if PROXIMA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace proxima::codec {
namespace {

using internal::MakeBlock;
using internal::Pattern;
using ::proxima::testing::StatusIs;

#if PROXIMA_WITH_CUDA
// Device buffer owned for the length of a test.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::byte* get() const { return static_cast<std::byte*>(ptr); }
  void* ptr = nullptr;
  size_t size;
};

const char* kGpuPlans[] = {
    "raw",           "fp8",           "int8",
    "int4,group=32", "int4,group=64", "int4,group=128",
    "int2,group=64", "star",          "layers[0:1]=int8,default=int4,sink=fp8"};

// Encodes `raws` (blocks of `g`; block 0 is a sequence's first) in one EncodeBlocksCuda call.
absl::StatusOr<std::vector<std::string>> EncodeOnGpu(
    const BlockGeometry& g, const CodecPlan& plan,
    const std::vector<std::vector<std::byte>>& raws) {
  std::vector<DeviceBuffer> dev;
  std::vector<std::string> out(raws.size());
  std::vector<CudaEncodeJob> jobs;
  dev.reserve(raws.size());
  for (size_t b = 0; b < raws.size(); ++b) {
    dev.emplace_back(g.RawBytes());
    if (cudaMemcpy(dev[b].ptr, raws[b].data(), g.RawBytes(), cudaMemcpyHostToDevice) !=
        cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
    jobs.push_back({dev[b].get(), b == 0, &out[b]});
  }
  PROXIMA_RETURN_IF_ERROR(EncodeBlocksCuda(g, plan, jobs, nullptr));
  return out;
}

// Decodes `encs` (blocks of `g`) in one DecodeBlocksCuda call; their raw bytes.
absl::StatusOr<std::vector<std::vector<std::byte>>> DecodeOnGpu(
    const BlockGeometry& g, const std::vector<std::string>& encs) {
  std::vector<DeviceBuffer> dev_in, dev_out;
  std::vector<CudaDecodeJob> jobs;
  dev_in.reserve(encs.size());
  dev_out.reserve(encs.size());
  for (size_t b = 0; b < encs.size(); ++b) {
    dev_in.emplace_back(encs[b].size());
    dev_out.emplace_back(g.RawBytes());
    if (cudaMemcpy(dev_in[b].ptr, encs[b].data(), encs[b].size(), cudaMemcpyHostToDevice) !=
        cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
    jobs.push_back(
        {std::as_bytes(std::span<const char>(encs[b])), dev_in[b].get(), dev_out[b].get()});
  }
  PROXIMA_RETURN_IF_ERROR(DecodeBlocksCuda(jobs, nullptr));
  std::vector<std::vector<std::byte>> out(encs.size(), std::vector<std::byte>(g.RawBytes()));
  for (size_t b = 0; b < encs.size(); ++b) {
    if (cudaMemcpy(out[b].data(), dev_out[b].ptr, g.RawBytes(), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
  }
  return out;
}

TEST(CodecCudaTest, DecodeMatchesCpuBitForBit) {
  PROXIMA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (BlockGeometry g :
         {BlockGeometry{3, 3, 64, 16, dtype}, BlockGeometry{2, 2, 24, 100, dtype},
          BlockGeometry{2, 8, 128, 64, dtype}, BlockGeometry{2, 3, 20, 33, dtype}}) {
      for (const char* text : kGpuPlans) {
        ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
        std::vector<std::string> enc(3);
        for (int b = 0; b < 3; ++b) {
          std::vector<std::byte> raw =
              MakeBlock(g, b == 2 ? Pattern::kAdversarial : Pattern::kKvLike, 40 + b);
          ASSERT_OK(EncodeBlock(g, plan, b == 0, raw, {}, &enc[b]));
        }
        ASSERT_OK_AND_ASSIGN(std::vector<std::vector<std::byte>> gpu_out, DecodeOnGpu(g, enc));
        for (int b = 0; b < 3; ++b) {
          std::vector<std::byte> cpu(g.RawBytes());
          ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(enc[b])), cpu));
          ASSERT_EQ(cpu, gpu_out[b]) << text << " block " << b;
        }
      }
    }
  }
}

// Codes no encoder writes (fp8 0x7F/0xFF, int8 -128, every other byte value) decode on the GPU
// as on the CPU: the GPU's conversion shortcuts hold for every code.
TEST(CodecCudaTest, EveryCodeByteDecodesAsOnTheCpu) {
  PROXIMA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (const char* text : {"fp8", "int8"}) {
      ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
      const BlockGeometry g{2, 3, 64, 16, dtype};
      std::string enc;
      ASSERT_OK(EncodeBlock(g, plan, false, MakeBlock(g, Pattern::kKvLike, 3), {}, &enc));
      internal::FillEveryCodeByte(g, enc);
      DeviceBuffer in(enc.size()), out(g.RawBytes());
      ASSERT_EQ(cudaMemcpy(in.ptr, enc.data(), enc.size(), cudaMemcpyHostToDevice), cudaSuccess);
      const CudaDecodeJob job{std::as_bytes(std::span<const char>(enc)), in.get(), out.get()};
      ASSERT_OK(DecodeBlocksCuda(std::span(&job, 1), nullptr));
      std::vector<std::byte> cpu(g.RawBytes()), gpu_out(g.RawBytes());
      ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(enc)), cpu));
      ASSERT_EQ(cudaMemcpy(gpu_out.data(), out.ptr, g.RawBytes(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(cpu, gpu_out) << text << " dtype " << static_cast<int>(dtype);
    }
  }
}

TEST(CodecCudaTest, EncodeMatchesCpuBitForBit) {
  PROXIMA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (BlockGeometry g :
         {BlockGeometry{3, 3, 64, 16, dtype}, BlockGeometry{2, 2, 24, 100, dtype},
          BlockGeometry{2, 8, 128, 64, dtype}, BlockGeometry{2, 3, 20, 33, dtype}}) {
      for (const char* text : {"raw", "fp8", "int8", "int4,group=32", "int4,group=128",
                               "int2,group=64", "layers[0:1]=int8,default=int4,sink=fp8"}) {
        ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
        std::vector<std::vector<std::byte>> raws;
        for (int b = 0; b < 3; ++b) {
          raws.push_back(MakeBlock(g, b == 2 ? Pattern::kAdversarial : Pattern::kKvLike, 50 + b));
        }
        ASSERT_OK_AND_ASSIGN(std::vector<std::string> out, EncodeOnGpu(g, plan, raws));
        for (int b = 0; b < 3; ++b) {
          std::string cpu;
          ASSERT_OK(EncodeBlock(g, plan, b == 0, raws[b], {}, &cpu));
          ASSERT_EQ(cpu, out[b]) << text << " block " << b;
        }
      }
    }
  }
}

// A batch whose payloads outrun the pinned buffer they are copied out through (4 MiB chunks):
// blocks that straddle a chunk's end, and chunks that hold several blocks, come back as the CPU
// encodes them. 24 blocks of 32 layers x 8 heads x 128 x 16 tokens (2 MiB raw, about 1 MiB of
// int8 each, 270 KiB of int2, so both a block over several chunks and many blocks per chunk).
TEST(CodecCudaTest, APayloadLargerThanTheCopyBufferComesBackWhole) {
  PROXIMA_SKIP_WITHOUT_GPU();
  const BlockGeometry g{32, 8, 128, 16, DType::kBf16};
  std::vector<std::vector<std::byte>> raws;
  for (int b = 0; b < 24; ++b) raws.push_back(MakeBlock(g, Pattern::kKvLike, 90 + b));
  for (const char* text : {"int8", "int2,group=64", "k4v3,rope_theta=500000"}) {
    ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
    ASSERT_OK_AND_ASSIGN(std::vector<std::string> out, EncodeOnGpu(g, plan, raws));
    for (size_t b = 0; b < raws.size(); ++b) {
      std::string cpu;
      ASSERT_OK(EncodeBlock(g, plan, b == 0, raws[b], {}, &cpu));
      ASSERT_EQ(cpu, out[b]) << text << " block " << b;
    }
  }
}

// k4v3 on the GPU (head_dim a power of two from 8 to 256): encode and decode give the CPU's
// bytes, alone and mixed with int4 and int8 layers in one call, with and without a RoPE base,
// on K-like and adversarial values (NaN, Inf, subnormals, outliers).
TEST(CodecCudaTest, K4v3EncodeAndDecodeMatchCpuBitForBit) {
  PROXIMA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (BlockGeometry g :
         {BlockGeometry{3, 3, 64, 16, dtype}, BlockGeometry{2, 8, 128, 64, dtype},
          BlockGeometry{2, 2, 8, 33, dtype}, BlockGeometry{1, 2, 256, 20, dtype},
          BlockGeometry{1, 3, 16, 24, dtype}, BlockGeometry{1, 2, 32, 7, dtype}}) {
      for (const char* text : {"k4v3", "k4v3,rope_theta=100000", "k4v3,rope_theta=500000,group=32",
                               "layers[0:1]=int8,default=k4v3,sink=int4,rope_theta=10000"}) {
        ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
        std::vector<std::vector<std::byte>> raws;
        for (int b = 0; b < 3; ++b) {
          raws.push_back(MakeBlock(g, b == 2 ? Pattern::kAdversarial : Pattern::kKvLike, 60 + b));
        }
        ASSERT_OK_AND_ASSIGN(std::vector<std::string> gpu_enc, EncodeOnGpu(g, plan, raws));
        std::vector<std::string> cpu_enc(3);
        for (int b = 0; b < 3; ++b) {
          ASSERT_OK(EncodeBlock(g, plan, b == 0, raws[b], {}, &cpu_enc[b]));
          ASSERT_EQ(cpu_enc[b], gpu_enc[b]) << text << " dim " << g.head_dim << " block " << b;
        }
        ASSERT_OK_AND_ASSIGN(std::vector<std::vector<std::byte>> gpu_out, DecodeOnGpu(g, cpu_enc));
        for (int b = 0; b < 3; ++b) {
          std::vector<std::byte> cpu(g.RawBytes());
          ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(cpu_enc[b])), cpu));
          ASSERT_EQ(cpu, gpu_out[b]) << text << " dim " << g.head_dim << " block " << b;
        }
      }
    }
  }
}

// What the GPU leaves to the CPU says kUnimplemented (the daemon's tierer then encodes on the
// CPU, daemon/tierer.cc): lossless, and k4v3 with a head_dim past 256 (either way).
TEST(CodecCudaTest, LosslessAndWideK4v3SayUnimplemented) {
  PROXIMA_SKIP_WITHOUT_GPU();
  BlockGeometry g{1, 1, 512, 16, DType::kBf16};
  DeviceBuffer dev(g.RawBytes());
  for (const char* text : {"lossless", "k4v3,rope_theta=10000"}) {
    std::string out;
    CudaEncodeJob job{dev.get(), false, &out};
    ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan(text));
    EXPECT_THAT(EncodeBlocksCuda(g, plan, std::span(&job, 1), nullptr),
                StatusIs(absl::StatusCode::kUnimplemented, ::testing::_))
        << text;
  }
  ASSERT_OK_AND_ASSIGN(CodecPlan k4v3, ParseCodecPlan("k4v3"));
  std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 3);
  std::string enc;
  ASSERT_OK(EncodeBlock(g, k4v3, false, raw, {}, &enc));
  DeviceBuffer enc_dev(enc.size());
  ASSERT_EQ(cudaMemcpy(enc_dev.get(), enc.data(), enc.size(), cudaMemcpyHostToDevice), cudaSuccess);
  CudaDecodeJob djob{std::as_bytes(std::span<const char>(enc)), enc_dev.get(), dev.get()};
  EXPECT_THAT(DecodeBlocksCuda(std::span(&djob, 1), nullptr),
              StatusIs(absl::StatusCode::kUnimplemented, ::testing::HasSubstr("k4v3")));
}

// star may encode differently on the GPU; its size is fixed and its error must stay close to the
// CPU encoder's.
TEST(CodecCudaTest, StarEncodeStaysWithinTheCpuErrorBound) {
  PROXIMA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    BlockGeometry g{2, 3, 64, 64, dtype};
    ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("star"));
    std::vector<std::byte> raw = MakeBlock(g, Pattern::kKvLike, 77);
    DeviceBuffer dev(g.RawBytes());
    ASSERT_EQ(cudaMemcpy(dev.ptr, raw.data(), g.RawBytes(), cudaMemcpyHostToDevice), cudaSuccess);
    std::string gpu_enc, cpu_enc;
    CudaEncodeJob job{dev.get(), false, &gpu_enc};
    ASSERT_OK(EncodeBlocksCuda(g, plan, std::span(&job, 1), nullptr));
    ASSERT_OK(EncodeBlock(g, plan, false, raw, {}, &cpu_enc));
    ASSERT_EQ(gpu_enc.size(), cpu_enc.size());
    std::vector<std::byte> a(g.RawBytes()), b(g.RawBytes());
    ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(gpu_enc)), a));
    ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(cpu_enc)), b));
    ASSERT_OK_AND_ASSIGN(ErrorSums eg, MeasureBlockError(g, raw, a));
    ASSERT_OK_AND_ASSIGN(ErrorSums ec, MeasureBlockError(g, raw, b));
    EXPECT_LE(Finish(eg).k_rel_l2, Finish(ec).k_rel_l2 * 1.05 + 0.01);
    EXPECT_LE(Finish(eg).v_rel_l2, Finish(ec).v_rel_l2 * 1.05 + 0.01);
  }
}

// The codec_encode fuzz corpus (tests/fuzz/corpus/codec_encode: the geometries, plans and values
// with which the fuzzer reached new code on the CPU: odd and wide head dims, partial groups,
// NaN / Inf / subnormal mixes) through the GPU: each block the GPU encodes comes out as the
// CPU's bytes (star, which may differ, only encodes), and each block the CPU wrote decodes on the
// GPU to the CPU's bytes. What the GPU leaves to the CPU (lossless, k4v3 outside head dims 8 to
// 256) says kUnimplemented both ways.
TEST(CodecCudaTest, FuzzCorpusBlocksEncodeAndDecodeAsOnTheCpu) {
  PROXIMA_SKIP_WITHOUT_GPU();
  int compared = 0;
  for (const auto& [path, data] : fuzz_testing::ReadCorpus("codec_encode")) {
    const std::optional<fuzz::EncodeCase> c =
        fuzz::MakeEncodeCase(reinterpret_cast<const uint8_t*>(data.data()), data.size());
    if (!c.has_value() || !c->valid) continue;
    const BlockGeometry& g = c->geometry;
    const std::string name = path.filename().string() + " (" + c->plan.ToString() + ")";
    bool gpu_takes = true, has_star = false;
    for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
      const CodecId codec = c->plan.CodecFor(layer, c->is_first_block);
      if (codec == CodecId::kLossless ||
          (codec == CodecId::kK4v3 && !internal::K4v3GpuDimOk(g.head_dim))) {
        gpu_takes = false;
      }
      has_star |= codec == CodecId::kStar;
    }
    std::string cpu;
    ASSERT_OK(EncodeBlock(g, c->plan, c->is_first_block, c->raw_bytes(), c->importance, &cpu));

    DeviceBuffer raw_dev(g.RawBytes());
    ASSERT_EQ(cudaMemcpy(raw_dev.ptr, c->raw.data(), g.RawBytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    DeviceBuffer importance_dev(std::max<size_t>(1, c->importance.size() * sizeof(float)));
    if (!c->importance.empty()) {
      ASSERT_EQ(cudaMemcpy(importance_dev.ptr, c->importance.data(),
                           c->importance.size() * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    std::string gpu;
    const CudaEncodeJob job{
        raw_dev.get(), c->is_first_block, &gpu,
        c->importance.empty() ? nullptr : static_cast<const float*>(importance_dev.ptr)};
    const absl::Status encoded = EncodeBlocksCuda(g, c->plan, std::span(&job, 1), nullptr);
    absl::StatusOr<std::vector<std::vector<std::byte>>> decoded = DecodeOnGpu(g, {cpu});
    if (!gpu_takes) {
      EXPECT_EQ(encoded.code(), absl::StatusCode::kUnimplemented) << name << ": " << encoded;
      EXPECT_EQ(decoded.status().code(), absl::StatusCode::kUnimplemented)
          << name << ": " << decoded.status();
      continue;
    }
    ASSERT_OK(encoded) << name;
    if (!has_star) {
      EXPECT_EQ(gpu, cpu) << name;
    }
    ASSERT_OK(decoded) << name;
    std::vector<std::byte> cpu_out(g.RawBytes());
    ASSERT_OK(DecodeBlock(std::as_bytes(std::span<const char>(cpu)), cpu_out));
    EXPECT_EQ((*decoded)[0], cpu_out) << name;
    ++compared;
  }
  EXPECT_GE(compared, 32);  // the seeds alone give 32 blocks the GPU takes
}

#endif  // PROXIMA_WITH_CUDA

// A corrupt header or segment table is caught on the host, before anything reaches the GPU (the
// device pointers here are not even device memory).
TEST(CodecCudaTest, CorruptHeaderIsRejectedBeforeAnyKernel) {
  BlockGeometry g{1, 1, 64, 16, DType::kBf16};
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("int4"));
  std::string enc;
  ASSERT_OK(EncodeBlock(g, plan, false, MakeBlock(g, Pattern::kKvLike, 1), {}, &enc));
  enc[enc.size() - 1] ^= 1;  // the payload: left to the GPU's CRC check
  ASSERT_OK_AND_ASSIGN(BlockHeaderInfo info,
                       InspectBlockHeader(std::as_bytes(std::span<const char>(enc))));
  enc[info.segments[0].offset - 1] ^= 1;  // the segment table: the header CRC catches it
  std::byte dummy[1];
  CudaDecodeJob job{std::as_bytes(std::span<const char>(enc)), dummy, dummy};
  absl::Status s = DecodeBlocksCuda(std::span(&job, 1), nullptr);
  if (!gpu::BuiltWithCuda()) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  } else {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("header")));
  }
}

// The payload CRC is checked on the GPU over the device copy that is decoded: a device copy that
// differs from its (valid) host copy fails the call, naming the block.
TEST(CodecCudaTest, CorruptDeviceCopyFailsItsCrcOnTheGpu) {
  PROXIMA_SKIP_WITHOUT_GPU();
#if PROXIMA_WITH_CUDA
  BlockGeometry g{2, 2, 64, 16, DType::kBf16};
  ASSERT_OK_AND_ASSIGN(CodecPlan plan, ParseCodecPlan("int8"));
  std::vector<std::string> enc(2);
  std::vector<DeviceBuffer> dev_in, dev_out;
  dev_in.reserve(2);
  dev_out.reserve(2);
  std::vector<CudaDecodeJob> jobs;
  for (int b = 0; b < 2; ++b) {
    ASSERT_OK(EncodeBlock(g, plan, false, MakeBlock(g, Pattern::kKvLike, 60 + b), {}, &enc[b]));
    std::string device_copy = enc[b];
    if (b == 1) device_copy[device_copy.size() / 2] ^= 0x04;
    dev_in.emplace_back(enc[b].size());
    dev_out.emplace_back(g.RawBytes());
    ASSERT_EQ(
        cudaMemcpy(dev_in[b].ptr, device_copy.data(), device_copy.size(), cudaMemcpyHostToDevice),
        cudaSuccess);
    jobs.push_back(
        {std::as_bytes(std::span<const char>(enc[b])), dev_in[b].get(), dev_out[b].get()});
  }
  EXPECT_THAT(
      DecodeBlocksCuda(jobs, nullptr),
      StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("block 1: payload CRC32C")));
  jobs.pop_back();
  EXPECT_OK(DecodeBlocksCuda(jobs, nullptr));
#endif
}

}  // namespace
}  // namespace proxima::codec
