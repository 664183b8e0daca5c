// The request trace that proxima_replay plays against proximad: the Mooncake conversation trace
// (one JSON object per line, ../shared/data/README.md), reduced to what a prefix cache sees.
//
// Each request carries `hash_ids`: prefix-block ids of 512 tokens each, remapped so that two
// requests sharing their first n ids share their first n * 512 prompt tokens. The replay turns
// each id into one block key and one block of real KV (replay.h).
//
// Sampling keeps the reuse structure: it keeps or drops whole *prefix families* (all requests
// whose chains share the same second id, i.e. could share anything beyond the first block), so
// every reuse inside a kept family is replayed exactly as in the full trace. This is the
// spatial sampling used by cache simulators (SHARDS): a 1-in-S sample seen by a cache of C
// blocks behaves like the full trace seen by a cache of about S * C blocks.
//
// Thread-safety: pure functions; a Trace is a plain value.
#ifndef PROXIMA_TOOLS_REPLAY_TRACE_H_
#define PROXIMA_TOOLS_REPLAY_TRACE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace proxima::replay {

// Tokens per hash id in the Mooncake trace.
inline constexpr uint64_t kTraceTokensPerBlock = 512;

struct TraceRequest {
  uint64_t timestamp_ms = 0;
  uint64_t input_length = 0;   // prompt tokens
  uint64_t output_length = 0;  // generated tokens
  std::vector<uint64_t> hash_ids;
};

struct TraceOptions {
  // Keep 1 prefix family in `sample_one_in` (1 keeps everything).
  uint32_t sample_one_in = 1;
  // After sampling, leave out the first `first_request` requests (a replay in parts: the rest
  // of the trace after a daemon's restart), then keep only the first `max_requests` of the
  // others in trace order (0: all).
  size_t first_request = 0;
  size_t max_requests = 0;
};

struct Trace {
  std::vector<TraceRequest> requests;
  size_t lines_read = 0;  // lines read (reading stops once max_requests are kept)
};

// Parses one trace line. kInvalidArgument naming the field, its value and what was expected.
absl::StatusOr<TraceRequest> ParseTraceLine(std::string_view line);

// Reads and samples a trace file. Errors name the file and the 1-based line number.
absl::StatusOr<Trace> ReadTrace(const std::string& path, const TraceOptions& options);

// True when `request` belongs to the 1-in-`sample_one_in` sample (its prefix family is chosen
// by a fixed hash of its second id, or of its first when it has only one).
bool InSample(const TraceRequest& request, uint32_t sample_one_in);

// What an infinite cache would hit: references to ids already seen earlier in the trace.
struct ReuseFacts {
  uint64_t block_refs = 0;
  uint64_t distinct_blocks = 0;
  double infinite_cache_hit_ratio = 0;
};
ReuseFacts MeasureReuse(const std::vector<TraceRequest>& requests);

}  // namespace proxima::replay

#endif  // PROXIMA_TOOLS_REPLAY_TRACE_H_
