// Host side of the CUDA batch entry points: validates block headers and metadata on the host,
// builds one SegmentJob per segment, launches one kernel per dtype for the whole batch, and
// computes the payload CRCs on the GPU (kernels/crc32c_cuda.h).
#include "kernels/codec_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "kernels/crc32c_cuda.h"
#include "kernels/device.h"
#include "kernels/internal/codec_launch.h"
#include "kernels/internal/container.h"
#include "kernels/internal/k4v3_math.h"
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

// Copies an encode call's payloads, back to back in device memory at `dev` (block b's at
// [offset[b], offset[b + 1])), into `results` (block b's after its first `table_end` bytes, which
// the caller sized). A copy from device memory into pageable memory is staged by the driver and
// ran at about 0.6 GB/s into fresh strings on an H200 host (the GPU tier's encoded moves,
// docs/benchmarks.md), so the bytes go through a pinned buffer of this thread's in chunks of
// kPayloadChunkBytes (portable: any device may copy into it), straight to the strings only where
// pinned memory cannot be had. Waits for `stream`.
constexpr size_t kPayloadChunkBytes = size_t{4} << 20;

absl::Status CopyPayloadsToHost(const uint8_t* dev, const std::vector<uint64_t>& offset,
                                size_t table_end, std::vector<std::string>* results,
                                cudaStream_t stream) {
  thread_local std::unique_ptr<gpu::PinnedBuffer> staging;
  if (staging == nullptr) {
    absl::StatusOr<std::unique_ptr<gpu::PinnedBuffer>> b =
        gpu::PinnedBuffer::Allocate(kPayloadChunkBytes);
    if (b.ok()) staging = *std::move(b);
  }
  const size_t blocks = offset.size() - 1;
  if (staging == nullptr) {
    for (size_t b = 0; b < blocks; ++b) {
      PROXIMA_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync((*results)[b].data() + table_end, dev + offset[b],
                          offset[b + 1] - offset[b], cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync(payload)"));
    }
    return CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  size_t first = 0;  // the first block not yet wholly copied
  for (uint64_t c0 = 0; c0 < offset.back(); c0 += kPayloadChunkBytes) {
    const uint64_t c1 = std::min<uint64_t>(offset.back(), c0 + kPayloadChunkBytes);
    PROXIMA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(staging->data(), dev + c0, c1 - c0, cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync(payloads)"));
    PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
    for (size_t b = first; b < blocks && offset[b] < c1; ++b) {
      const uint64_t lo = std::max(offset[b], c0), hi = std::min(offset[b + 1], c1);
      std::memcpy((*results)[b].data() + table_end + (lo - offset[b]), staging->data() + (lo - c0),
                  hi - lo);
      if (offset[b + 1] <= c1) first = b + 1;
    }
  }
  return absl::OkStatus();
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

// k4v3's jobs of one dtype (internal::MakeK4v3Jobs): K jobs' turns and V jobs' rows, and the
// most threads a job of each needs (K: one per (token, pair); V: a team of TeamSize(dim) per row).
struct K4v3Batch {
  std::vector<SegmentJob> turns, values;
  uint64_t max_turn_threads = 0, max_row_threads = 0;
  void Add(const SegmentJob& j) {
    if (j.is_value) {
      values.push_back(j);
      max_row_threads = std::max(max_row_threads, j.units * k4v3::TeamSize(j.dim));
    } else {
      turns.push_back(j);
      max_turn_threads = std::max(max_turn_threads, j.units / j.heads);
    }
  }
};

// Uploads `jobs` (all of `dtype`) and launches `step` over them; the device copy is freed in
// stream order.
absl::Status LaunchK4v3Jobs(const std::vector<SegmentJob>& jobs, uint64_t max_threads,
                            cuda::K4v3Step step, uint8_t dtype, cudaStream_t stream) {
  if (jobs.empty()) return absl::OkStatus();
  PROXIMA_ASSIGN_OR_RETURN(SegmentJob * dev, UploadJobs(jobs, stream));
  const absl::Status status = CudaStatus(
      cuda::LaunchK4v3(dev, static_cast<uint32_t>(jobs.size()), max_threads, step, dtype, stream),
      "k4v3 kernel launch");
  cudaFreeAsync(dev, stream);
  return status;
}

// Bytes of one K segment's turned values in the shared scratch buffer: 16-byte aligned slices,
// so int4's fast path takes them.
uint64_t TurnedSliceBytes(uint64_t segment_raw_bytes) { return (segment_raw_bytes + 15) / 16 * 16; }

absl::Status K4v3DimForGpu(uint32_t head_dim) {
  if (internal::K4v3GpuDimOk(head_dim)) return absl::OkStatus();
  return absl::UnimplementedError(
      absl::StrCat("k4v3 on the GPU takes head_dim a power of two from 8 to ", k4v3::kMaxRowDim,
                   "; this block's is ", head_dim, " (the CPU codec takes it)"));
}

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

// The most bytes of one segment's metadata (or of a block's header) requested ahead at a time.
constexpr size_t kMaxPrefetchBytes = 4096;

}  // namespace

absl::Status DecodeBlocksCuda(std::span<const CudaDecodeJob> jobs, CUstream_st* stream,
                              CudaCallTiming* timing) {
  CallTimer timer(timing, stream);
  std::map<uint8_t, DecodeBatch> by_dtype;
  std::map<uint8_t, K4v3Batch> k4v3_by_dtype;
  // k4v3 K segments, whose int4 jobs need the scratch allocated once all are known.
  struct PendingK4v3Key {
    SegmentShape shape;
    internal::K4v3Rope rope;
    uint8_t* payload;
    uint16_t* raw;
    uint64_t turned_offset;
  };
  std::vector<PendingK4v3Key> k4v3_keys;
  uint64_t turned_bytes = 0;
  std::vector<gpu::DeviceSpan> payloads(jobs.size());  // checked against `expected` on the GPU
  std::vector<uint32_t> expected(jobs.size());
  // The checks below read a few hundred bytes at the start of every segment, tens of kilobytes
  // apart in host memory that is usually not in cache (blocks just received): one cache miss
  // after another. So the next block's header and the metadata of the segment kPrefetchAhead
  // further on are requested before each check.
  constexpr uint32_t kPrefetchAhead = 4;
  auto prefetch = [](const std::byte* p, size_t bytes) {
    for (size_t at = 0; at < std::min<size_t>(bytes, kMaxPrefetchBytes); at += 64) {
      __builtin_prefetch(p + at);
    }
  };
  for (size_t b = 0; b < jobs.size(); ++b) {
    const CudaDecodeJob& job = jobs[b];
    if (b + 1 < jobs.size()) {
      prefetch(jobs[b + 1].encoded_host.data(), jobs[b + 1].encoded_host.size());
    }
    PROXIMA_ASSIGN_OR_RETURN(BlockHeaderInfo info, InspectBlockHeader(job.encoded_host));
    if (job.encoded_device == nullptr || job.raw_device == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("block ", b, ": null device pointer"));
    }
    const size_t seg_raw = info.geometry.SegmentElements() * 2;
    const size_t payload_offset = info.segments[0].offset;  // 2 * num_layers >= 2 segments
    payloads[b] = {job.encoded_device + payload_offset, info.encoded_bytes - payload_offset};
    expected[b] = info.payload_crc;
    auto prefetch_segment = [&](uint32_t s) {
      const SegmentInfo& seg = info.segments[s];
      prefetch(job.encoded_host.data() + seg.offset,
               internal::LeadingMetadataBytes(
                   seg.codec, internal::SegmentShapeFor(info.geometry, s, seg.group_size)));
    };
    for (uint32_t s = 0; s < kPrefetchAhead && s < info.segments.size(); ++s) prefetch_segment(s);
    for (uint32_t s = 0; s < info.segments.size(); ++s) {
      if (s + kPrefetchAhead < info.segments.size()) prefetch_segment(s + kPrefetchAhead);
      const SegmentInfo& seg = info.segments[s];
      const SegmentShape sh = internal::SegmentShapeFor(info.geometry, s, seg.group_size);
      const std::byte* host = job.encoded_host.data() + seg.offset;
      switch (seg.codec) {
        case CodecId::kLossless:
          return absl::UnimplementedError("lossless decode is CPU-only");
        case CodecId::kK4v3:
          PROXIMA_RETURN_IF_ERROR(K4v3DimForGpu(sh.dim));
          PROXIMA_RETURN_IF_ERROR(internal::ValidateK4v3(sh, host));
          break;
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
      auto* payload =
          const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(job.encoded_device + seg.offset));
      auto* raw = reinterpret_cast<uint16_t*>(job.raw_device + s * seg_raw);
      if (seg.codec != CodecId::kK4v3) {
        by_dtype[sh.dtype].Add(internal::MakeSegmentJob(seg.codec, sh, payload, raw));
      } else if (sh.is_value) {
        k4v3_by_dtype[sh.dtype].Add(internal::MakeK4v3Jobs(sh, {}, payload, raw, nullptr).main);
      } else {  // int4 decodes into scratch, then the turn back writes `raw`
        const internal::K4v3Rope rope{internal::LoadF32(host, 0), internal::LoadF32(host, 1)};
        k4v3_keys.push_back({sh, rope, payload, raw, turned_bytes});
        turned_bytes += TurnedSliceBytes(seg_raw);
      }
    }
  }
  void* turned = nullptr;
  if (turned_bytes > 0) {
    PROXIMA_RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&turned, turned_bytes, stream),
                                       "cudaMallocAsync(k4v3 scratch)"));
  }
  for (const PendingK4v3Key& k : k4v3_keys) {
    const internal::K4v3Jobs j = internal::MakeK4v3Jobs(
        k.shape, k.rope, k.payload, k.raw,
        reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(turned) + k.turned_offset));
    by_dtype[k.shape.dtype].Add(j.int4);
    k4v3_by_dtype[k.shape.dtype].Add(j.main);
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
  // After int4's kernels on the same stream: k4v3's turns back, and its V rows.
  for (const auto& [dtype, k] : k4v3_by_dtype) {
    if (status.ok()) {
      status =
          LaunchK4v3Jobs(k.turns, k.max_turn_threads, cuda::K4v3Step::kTurnBack, dtype, stream);
    }
    if (status.ok()) {
      status =
          LaunchK4v3Jobs(k.values, k.max_row_threads, cuda::K4v3Step::kDecodeValues, dtype, stream);
    }
  }
  timer.CrcBegin();
  std::vector<uint32_t> crcs;
  if (status.ok()) status = EnqueueCrcs(payloads, &crcs, stream);
  timer.KernelsEnd();
  for (const Uploaded& u : uploaded) cudaFreeAsync(u.jobs, stream);
  if (turned != nullptr) cudaFreeAsync(turned, stream);
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
  PROXIMA_RETURN_IF_ERROR(internal::ValidPlan(plan));
  if (jobs.empty()) return absl::OkStatus();
  const internal::K4v3Rope rope = internal::K4v3RopeFor(plan.rope_theta, geometry.head_dim);
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
      if (codec == CodecId::kLossless) {
        return absl::UnimplementedError(
            "GPU encode of lossless is not implemented; use EncodeBlocks");
      }
      if (codec == CodecId::kK4v3) PROXIMA_RETURN_IF_ERROR(K4v3DimForGpu(geometry.head_dim));
      const bool grouped = internal::IsGroupedCodec(codec);
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
  // k4v3's turned K values: one scratch slice per k4v3 K segment.
  uint64_t turned_bytes = 0;
  for (size_t b = 0; b < jobs.size(); ++b) {
    for (uint32_t layer = 0; layer < geometry.num_layers; ++layer) {
      if (plan.CodecFor(layer, jobs[b].is_first_block) == CodecId::kK4v3) {
        turned_bytes += TurnedSliceBytes(seg_raw);
      }
    }
  }
  void* dev_out = nullptr;
  PROXIMA_RETURN_IF_ERROR(
      CudaStatus(cudaMallocAsync(&dev_out, block_offset.back(), stream), "cudaMallocAsync"));
  void* turned = nullptr;
  if (turned_bytes > 0) {
    const absl::Status s =
        CudaStatus(cudaMallocAsync(&turned, turned_bytes, stream), "cudaMallocAsync(k4v3 scratch)");
    if (!s.ok()) {
      cudaFreeAsync(dev_out, stream);
      cudaStreamSynchronize(stream);
      return s;
    }
  }
  uint64_t turned_offset = 0;
  EncodeBatch batch;
  K4v3Batch k4v3_batch;
  for (size_t b = 0; b < jobs.size(); ++b) {
    const int first = jobs[b].is_first_block ? 1 : 0;
    uint64_t off = block_offset[b];
    for (uint32_t s = 0; s < num_segments; ++s) {
      const char* e =
          header[first].data() + internal::kHeaderBytes + internal::kSegmentEntryBytes * s;
      const CodecId codec = static_cast<CodecId>(e[0]);
      uint64_t bytes;
      std::memcpy(&bytes, e + 8, 8);
      const SegmentShape shape = internal::SegmentShapeFor(
          geometry, s, internal::IsGroupedCodec(codec) ? plan.group_size : 0);
      uint8_t* payload = static_cast<uint8_t*>(dev_out) + off;
      auto* raw =
          reinterpret_cast<uint16_t*>(const_cast<std::byte*>(jobs[b].raw_device) + s * seg_raw);
      off += bytes;
      if (codec == CodecId::kK4v3) {
        uint16_t* slice = nullptr;
        if (!shape.is_value) {
          slice = reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(turned) + turned_offset);
          turned_offset += TurnedSliceBytes(seg_raw);
        }
        const internal::K4v3Jobs k = internal::MakeK4v3Jobs(shape, rope, payload, raw, slice);
        k4v3_batch.Add(k.main);
        if (!shape.is_value) batch.Add(k.int4);
        continue;
      }
      SegmentJob job = internal::MakeSegmentJob(codec, shape, payload, raw);
      job.layer_k = reinterpret_cast<const uint16_t*>(jobs[b].raw_device + (s & ~1u) * seg_raw);
      job.importance = jobs[b].importance_device;
      batch.Add(job);
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
  const auto dtype = static_cast<uint8_t>(geometry.dtype);
  if (!dev_jobs.ok()) {
    status = dev_jobs.status();
  } else {
    timer.KernelsBegin();
    // k4v3's K turns first: their output is the input of its int4 jobs in the batch.
    status = LaunchK4v3Jobs(k4v3_batch.turns, k4v3_batch.max_turn_threads,
                            cuda::K4v3Step::kTurnIn, dtype, stream);
    if (status.ok()) {
      status = LaunchK4v3Jobs(k4v3_batch.values, k4v3_batch.max_row_threads,
                              cuda::K4v3Step::kEncodeValues, dtype, stream);
    }
    if (status.ok()) {
      status =
          CudaStatus(cuda::LaunchEncodeSegments(*dev_jobs, static_cast<uint32_t>(batch.jobs.size()),
                                                batch.launch, dtype, stream),
                     "encode kernel launch");
    }
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
    for (size_t b = 0; b < jobs.size(); ++b) {
      const int first = jobs[b].is_first_block ? 1 : 0;
      results[b] = header[first];
      results[b].resize(table_end + payload_bytes(first));
    }
    status = CopyPayloadsToHost(static_cast<const uint8_t*>(dev_out), block_offset, table_end,
                                &results, stream);
  }
  cudaFreeAsync(dev_out, stream);
  if (scratch != nullptr) cudaFreeAsync(scratch, stream);
  if (turned != nullptr) cudaFreeAsync(turned, stream);
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
