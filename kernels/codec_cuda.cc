// Host side of the CUDA batch entry points: validates block headers and metadata on the host,
// builds one SegmentJob per segment, launches one kernel per dtype for the whole batch, and
// computes the payload CRCs on the GPU (kernels/crc32c_cuda.h).
#include "kernels/codec_cuda.h"

#include <cuda_runtime_api.h>

#include <bit>
#include <chrono>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "kernels/crc32c_cuda.h"
#include "kernels/internal/codec_launch.h"
#include "kernels/internal/container.h"
#include "kernels/internal/make_segment_job.h"
#include "kernels/internal/segment_codecs.h"
#include "kernels/internal/segment_job.h"
#include "kernels/internal/vec_codec.h"

namespace proxima::codec {
namespace {

using internal::SegmentJob;
using internal::SegmentShape;

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// Copies `jobs` to the device (stream-ordered) and returns the device pointer.
absl::StatusOr<SegmentJob*> UploadJobs(const std::vector<SegmentJob>& jobs, cudaStream_t stream) {
  void* dev = nullptr;
  const size_t bytes = jobs.size() * sizeof(SegmentJob);
  PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&dev, bytes, stream), "cudaMallocAsync"));
  // From pageable memory the copy is staged before the call returns, so `jobs` may go away.
  cudaError_t err = cudaMemcpyAsync(dev, jobs.data(), bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) {
    cudaFreeAsync(dev, stream);
    return CudaStatus(err, "cudaMemcpyAsync(jobs)");
  }
  return static_cast<SegmentJob*>(dev);
}

// Enqueues the CRC32C of every span on the GPU and the copy of the results into `crcs` (host),
// which holds them once `stream` is synchronised.
absl::Status EnqueueCrcs(const std::vector<gpu::DeviceSpan>& spans, std::vector<uint32_t>* crcs,
                         cudaStream_t stream) {
  crcs->assign(spans.size(), 0);
  if (spans.empty()) return absl::OkStatus();
  void* dev = nullptr;
  const size_t bytes = spans.size() * sizeof(uint32_t);
  PROXIMA_RETURN_IF_ERROR(
      CudaStatus(cudaMallocAsync(&dev, bytes, stream), "cudaMallocAsync(crcs)"));
  absl::Status status = gpu::Crc32cBatchCuda(spans, static_cast<uint32_t*>(dev), stream);
  if (status.ok()) {
    status = CudaStatus(cudaMemcpyAsync(crcs->data(), dev, bytes, cudaMemcpyDeviceToHost, stream),
                        "cudaMemcpyAsync(crcs)");
  }
  cudaFreeAsync(dev, stream);
  return status;
}

// One dtype's decode jobs by kind (cuda::DecodeRun): the fast path per codec, and the
// per-element path.
struct DecodeBatch {
  std::map<std::pair<uint8_t, uint8_t>, std::vector<SegmentJob>> by_kind;  // (vec, codec)
  void Add(const SegmentJob& j) { by_kind[{j.vec, j.vec ? j.codec : uint8_t{0}}].push_back(j); }
  // The jobs in run order, and their runs.
  void Flatten(std::vector<SegmentJob>* jobs, std::vector<cuda::DecodeRun>* runs) const {
    for (const auto& [kind, list] : by_kind) {
      cuda::DecodeRun run;
      run.first = static_cast<uint32_t>(jobs->size());
      run.count = static_cast<uint32_t>(list.size());
      run.vec = kind.first;
      run.codec = kind.second;
      for (const SegmentJob& j : list) {
        run.max_work = std::max(run.max_work, j.vec ? j.elements / 8 : j.elements);
        jobs->push_back(j);
      }
      runs->push_back(run);
    }
  }
};

struct EncodeBatch {
  std::vector<SegmentJob> jobs;
  cuda::EncodeLaunch launch;
  void Add(SegmentJob j) {
    // The fused path takes the codecs with per-head statistics (and raw) when their statistics
    // fit in shared memory; star and the rest go per element.
    const uint64_t smem = 4ull * vec::StatsWords(j);
    if (j.codec == vec::kStar || smem > cuda::kMaxFusedSmemBytes) j.vec = 0;
    if (j.vec) {
      launch.fused_heads = std::max(launch.fused_heads, j.heads);
      launch.fused_smem_bytes = std::max(launch.fused_smem_bytes, static_cast<uint32_t>(smem));
    } else {
      launch.max_groups = std::max(launch.max_groups, j.groups);
      launch.max_units = std::max(launch.max_units, j.units);
    }
    jobs.push_back(j);
  }
};

// Times a call for CudaCallTiming: events around the kernels, and the rest of the call's wall
// time (from construction to Finish, which waits for the kernels) as host time.
class CallTimer {
 public:
  CallTimer(CudaCallTiming* timing, cudaStream_t stream)
      : timing_(timing), stream_(stream), start_(std::chrono::steady_clock::now()) {
    if (timing_ == nullptr) return;
    if (cudaEventCreate(&begin_) != cudaSuccess || cudaEventCreate(&crc_) != cudaSuccess ||
        cudaEventCreate(&end_) != cudaSuccess) {
      timing_ = nullptr;  // no events: the call goes on untimed
    }
  }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;
  ~CallTimer() {
    for (cudaEvent_t e : {begin_, crc_, end_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  void KernelsBegin() {
    if (timing_ != nullptr) cudaEventRecord(begin_, stream_);
  }
  // Between the codec kernels and the CRC pass.
  void CrcBegin() {
    if (timing_ != nullptr) cudaEventRecord(crc_, stream_);
  }
  void KernelsEnd() {
    if (timing_ != nullptr) cudaEventRecord(end_, stream_);
  }
  void Finish() {
    if (timing_ == nullptr) return;
    float ms = 0;
    if (cudaEventSynchronize(end_) == cudaSuccess) {
      if (cudaEventElapsedTime(&ms, begin_, crc_) == cudaSuccess) timing_->kernel_ms = ms;
      if (cudaEventElapsedTime(&ms, crc_, end_) == cudaSuccess) timing_->crc_ms = ms;
    }
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count();
    timing_->host_ms = std::max(0.0, wall_ms - timing_->kernel_ms - timing_->crc_ms);
  }

 private:
  CudaCallTiming* timing_;
  cudaStream_t stream_;
  cudaEvent_t begin_ = nullptr, crc_ = nullptr, end_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

absl::Status DecodeBlocksCuda(std::span<const CudaDecodeJob> jobs, CUstream_st* stream,
                              CudaCallTiming* timing) {
  CallTimer timer(timing, stream);
  std::map<uint8_t, DecodeBatch> by_dtype;
  std::vector<gpu::DeviceSpan> payloads(jobs.size());  // checked against `expected` on the GPU
  std::vector<uint32_t> expected(jobs.size());
  for (size_t b = 0; b < jobs.size(); ++b) {
    const CudaDecodeJob& job = jobs[b];
    PROXIMA_ASSIGN_OR_RETURN(BlockHeaderInfo info, InspectBlockHeader(job.encoded_host));
    if (job.encoded_device == nullptr || job.raw_device == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("block ", b, ": null device pointer"));
    }
    const size_t seg_raw = info.geometry.SegmentElements() * 2;
    const size_t payload_offset = info.segments[0].offset;  // 2 * num_layers >= 2 segments
    payloads[b] = {job.encoded_device + payload_offset, info.encoded_bytes - payload_offset};
    expected[b] = info.payload_crc;
    for (uint32_t s = 0; s < info.segments.size(); ++s) {
      const SegmentInfo& seg = info.segments[s];
      const SegmentShape sh = internal::SegmentShapeFor(info.geometry, s, seg.group_size);
      const std::byte* host = job.encoded_host.data() + seg.offset;
      switch (seg.codec) {
        case CodecId::kLossless:
          return absl::UnimplementedError("lossless decode is CPU-only");
        case CodecId::kK4v3:
          return absl::UnimplementedError("k4v3 decode is CPU-only (no CUDA kernel yet)");
        case CodecId::kFp8:
          PROXIMA_RETURN_IF_ERROR(internal::ValidateFp8(sh, host));
          break;
        case CodecId::kInt8:
          PROXIMA_RETURN_IF_ERROR(internal::ValidateInt8(sh, host));
          break;
        case CodecId::kInt4:
        case CodecId::kInt2:
          PROXIMA_RETURN_IF_ERROR(
              internal::ValidateIntN(sh, seg.codec == CodecId::kInt4 ? 4 : 2, host));
          break;
        case CodecId::kStar:
          PROXIMA_RETURN_IF_ERROR(internal::ValidateStar(sh, host));
          break;
        case CodecId::kRaw:
          break;
      }
      by_dtype[sh.dtype].Add(internal::MakeSegmentJob(
          seg.codec, sh,
          const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(job.encoded_device + seg.offset)),
          reinterpret_cast<uint16_t*>(job.raw_device + s * seg_raw)));
    }
  }
  struct Uploaded {
    uint8_t dtype;
    SegmentJob* jobs;
    std::vector<cuda::DecodeRun> runs;
  };
  std::vector<Uploaded> uploaded;
  absl::Status status;
  for (auto& [dtype, batch] : by_dtype) {
    std::vector<SegmentJob> flat;
    std::vector<cuda::DecodeRun> runs;
    batch.Flatten(&flat, &runs);
    absl::StatusOr<SegmentJob*> dev = UploadJobs(flat, stream);
    if (!dev.ok()) {
      status = dev.status();
      break;
    }
    uploaded.push_back({dtype, *dev, std::move(runs)});
  }
  timer.KernelsBegin();
  for (const Uploaded& u : uploaded) {
    if (status.ok()) {
      status = CudaStatus(cuda::LaunchDecodeSegments(u.jobs, u.runs.data(),
                                                     static_cast<uint32_t>(u.runs.size()),
                                                     u.dtype, stream),
                          "decode kernel launch");
    }
  }
  timer.CrcBegin();
  std::vector<uint32_t> crcs;
  if (status.ok()) status = EnqueueCrcs(payloads, &crcs, stream);
  timer.KernelsEnd();
  for (const Uploaded& u : uploaded) cudaFreeAsync(u.jobs, stream);
  const absl::Status sync =
      CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize(decode)");
  timer.Finish();
  PROXIMA_RETURN_IF_ERROR(status);
  PROXIMA_RETURN_IF_ERROR(sync);
  for (size_t b = 0; b < jobs.size(); ++b) {
    if (crcs[b] != expected[b]) {
      return absl::DataLossError(
          absl::StrCat("block ", b, ": payload CRC32C mismatch in its device copy (computed ",
                       crcs[b], ", header says ", expected[b], "); its output is not valid"));
    }
  }
  return absl::OkStatus();
}

absl::Status EncodeBlocksCuda(const BlockGeometry& geometry, const CodecPlan& plan,
                              std::span<const CudaEncodeJob> jobs, CUstream_st* stream,
                              CudaCallTiming* timing) {
  CallTimer timer(timing, stream);
  PROXIMA_RETURN_IF_ERROR(geometry.Validate());
  if (plan.group_size != 32 && plan.group_size != 64 && plan.group_size != 128) {
    return absl::InvalidArgumentError("codec plan group size must be 32, 64 or 128");
  }
  if (jobs.empty()) return absl::OkStatus();
  const uint32_t num_segments = 2 * geometry.num_layers;
  const size_t seg_raw = geometry.SegmentElements() * 2;
  const size_t table_end = internal::kHeaderBytes + internal::kSegmentEntryBytes * num_segments;
  // The header and table depend only on the plan and is_first_block; build both variants.
  std::string header[2];
  for (int first = 0; first < 2; ++first) {
    std::string& h = header[first];
    h.assign(table_end, '\0');
    std::memcpy(h.data(), internal::kBlockMagic, 8);
    const uint16_t version = internal::kFormatVersion;
    std::memcpy(h.data() + 8, &version, 2);
    h[10] = static_cast<char>(geometry.dtype);
    h[11] = static_cast<char>(first);
    const uint32_t dims[5] = {geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                              geometry.tokens_per_block, num_segments};
    std::memcpy(h.data() + 12, dims, sizeof(dims));
    uint64_t payload = 0;
    for (uint32_t s = 0; s < num_segments; ++s) {
      const CodecId codec = plan.CodecFor(s / 2, first == 1);
      if (codec == CodecId::kLossless || codec == CodecId::kK4v3) {
        return absl::UnimplementedError(absl::StrCat("GPU encode of ",
                                                     std::string(CodecName(codec)),
                                                     " is not implemented; use EncodeBlocks"));
      }
      const bool grouped = codec == CodecId::kInt4 || codec == CodecId::kInt2;
      const uint64_t bytes = internal::FixedPayloadBytes(
          codec, internal::SegmentShapeFor(geometry, s, grouped ? plan.group_size : 0));
      char* e = h.data() + internal::kHeaderBytes + internal::kSegmentEntryBytes * s;
      e[0] = static_cast<char>(codec);
      e[1] = static_cast<char>(grouped ? std::countr_zero(plan.group_size) : 0);
      std::memcpy(e + 8, &bytes, 8);
      payload += bytes;
    }
    std::memcpy(h.data() + 32, &payload, 8);
    uint32_t crc =
        Crc32c(std::as_bytes(std::span<const char>(h.data(), internal::kHeaderCrcOffset)));
    crc =
        Crc32cExtend(crc, std::as_bytes(std::span<const char>(h.data() + internal::kHeaderBytes,
                                                              table_end - internal::kHeaderBytes)));
    std::memcpy(h.data() + internal::kHeaderCrcOffset, &crc, 4);
  }
  auto payload_bytes = [&](int first) {
    uint64_t v;
    std::memcpy(&v, header[first].data() + 32, 8);
    return v;
  };
  // One device buffer holds every block's payloads back to back.
  std::vector<uint64_t> block_offset(jobs.size() + 1, 0);
  for (size_t b = 0; b < jobs.size(); ++b) {
    if (jobs[b].raw_device == nullptr || jobs[b].out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("job ", b, ": null pointer"));
    }
    block_offset[b + 1] = block_offset[b] + payload_bytes(jobs[b].is_first_block ? 1 : 0);
  }
  void* dev_out = nullptr;
  PROXIMA_RETURN_IF_ERROR(
      CudaStatus(cudaMallocAsync(&dev_out, block_offset.back(), stream), "cudaMallocAsync"));
  EncodeBatch batch;
  for (size_t b = 0; b < jobs.size(); ++b) {
    const int first = jobs[b].is_first_block ? 1 : 0;
    uint64_t off = block_offset[b];
    for (uint32_t s = 0; s < num_segments; ++s) {
      const char* e =
          header[first].data() + internal::kHeaderBytes + internal::kSegmentEntryBytes * s;
      const CodecId codec = static_cast<CodecId>(e[0]);
      uint64_t bytes;
      std::memcpy(&bytes, e + 8, 8);
      const bool grouped = codec == CodecId::kInt4 || codec == CodecId::kInt2;
      SegmentJob job = internal::MakeSegmentJob(
          codec, internal::SegmentShapeFor(geometry, s, grouped ? plan.group_size : 0),
          static_cast<uint8_t*>(dev_out) + off,
          reinterpret_cast<uint16_t*>(const_cast<std::byte*>(jobs[b].raw_device) + s * seg_raw));
      job.layer_k = reinterpret_cast<const uint16_t*>(jobs[b].raw_device + (s & ~1u) * seg_raw);
      job.importance = jobs[b].importance_device;
      batch.Add(job);
      off += bytes;
    }
  }
  // star scratch, one slice per (job, head).
  uint64_t scratch_floats = 0;
  for (const SegmentJob& j : batch.jobs) scratch_floats += j.star_scratch_floats * j.heads;
  void* scratch = nullptr;
  absl::Status status;
  if (scratch_floats > 0) {
    status = CudaStatus(cudaMallocAsync(&scratch, scratch_floats * sizeof(float), stream),
                        "cudaMallocAsync(star scratch)");
    uint64_t off = 0;
    for (SegmentJob& j : batch.jobs) {
      if (j.star_scratch_floats == 0) continue;
      j.star_scratch = static_cast<float*>(scratch) + off;
      off += j.star_scratch_floats * j.heads;
    }
  }
  absl::StatusOr<SegmentJob*> dev_jobs =
      status.ok() ? UploadJobs(batch.jobs, stream) : absl::StatusOr<SegmentJob*>(status);
  if (!dev_jobs.ok()) {
    status = dev_jobs.status();
  } else {
    timer.KernelsBegin();
    status = CudaStatus(
        cuda::LaunchEncodeSegments(*dev_jobs, static_cast<uint32_t>(batch.jobs.size()),
                                   batch.launch, static_cast<uint8_t>(geometry.dtype), stream),
        "encode kernel launch");
    cudaFreeAsync(*dev_jobs, stream);
  }
  timer.CrcBegin();
  std::vector<uint32_t> crcs;
  if (status.ok()) {
    std::vector<gpu::DeviceSpan> payloads(jobs.size());
    for (size_t b = 0; b < jobs.size(); ++b) {
      payloads[b] = {static_cast<const std::byte*>(dev_out) + block_offset[b],
                     block_offset[b + 1] - block_offset[b]};
    }
    status = EnqueueCrcs(payloads, &crcs, stream);
  }
  timer.KernelsEnd();
  std::vector<std::string> results(jobs.size());
  if (status.ok()) {
    for (size_t b = 0; b < jobs.size() && status.ok(); ++b) {
      const int first = jobs[b].is_first_block ? 1 : 0;
      results[b] = header[first];
      results[b].resize(table_end + payload_bytes(first));
      status = CudaStatus(cudaMemcpyAsync(results[b].data() + table_end,
                                          static_cast<uint8_t*>(dev_out) + block_offset[b],
                                          payload_bytes(first), cudaMemcpyDeviceToHost, stream),
                          "cudaMemcpyAsync(payload)");
    }
  }
  cudaFreeAsync(dev_out, stream);
  if (scratch != nullptr) cudaFreeAsync(scratch, stream);
  absl::Status sync = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!status.ok()) return status;
  PROXIMA_RETURN_IF_ERROR(sync);
  for (size_t b = 0; b < jobs.size(); ++b) {
    std::string& r = results[b];
    std::memcpy(r.data() + internal::kPayloadCrcOffset, &crcs[b], 4);  // computed on the GPU
    *jobs[b].out = std::move(r);
  }
  timer.Finish();
  return absl::OkStatus();
}

}  // namespace proxima::codec
