#include "tools/replay/trace.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <fstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace proxima::replay {
namespace {

// Largest integer a JSON number (a double) carries exactly.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

absl::StatusOr<uint64_t> ToCount(const google::protobuf::Value& value, const std::string& field) {
  if (value.kind_case() != google::protobuf::Value::kNumberValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("field '", field, "' is not a number; expected a non-negative integer"));
  }
  double d = value.number_value();
  if (!(d >= 0) || d >= kMaxExactInteger || std::floor(d) != d) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' has value ", d,
                                                   "; expected a non-negative integer below 2^53"));
  }
  return static_cast<uint64_t>(d);
}

absl::StatusOr<uint64_t> RequiredCount(const google::protobuf::Struct& object,
                                       const std::string& field) {
  auto it = object.fields().find(std::string(field));
  if (it == object.fields().end()) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' is missing"));
  }
  return ToCount(it->second, field);
}

// A fixed 64-bit mix (the SplitMix64 finalizer): the sample must be the same in every process
// and on every machine, which absl::Hash does not promise.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<TraceRequest> ParseTraceLine(std::string_view line) {
  google::protobuf::Struct object;
  auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(line.data(), line.size()), &object);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a JSON object: ", std::string(parsed.message())));
  }
  TraceRequest request;
  PROXIMA_ASSIGN_OR_RETURN(request.timestamp_ms, RequiredCount(object, "timestamp"));
  PROXIMA_ASSIGN_OR_RETURN(request.input_length, RequiredCount(object, "input_length"));
  PROXIMA_ASSIGN_OR_RETURN(request.output_length, RequiredCount(object, "output_length"));
  auto it = object.fields().find("hash_ids");
  if (it == object.fields().end()) {
    return absl::InvalidArgumentError("field 'hash_ids' is missing");
  }
  if (it->second.kind_case() != google::protobuf::Value::kListValue ||
      it->second.list_value().values().empty()) {
    return absl::InvalidArgumentError(
        "field 'hash_ids' is not a non-empty list; expected a list of block ids");
  }
  const auto& ids = it->second.list_value().values();
  request.hash_ids.reserve(ids.size());
  for (int i = 0; i < ids.size(); ++i) {
    PROXIMA_ASSIGN_OR_RETURN(uint64_t id, ToCount(ids[i], absl::StrCat("hash_ids[", i, "]")));
    request.hash_ids.push_back(id);
  }
  return request;
}

bool InSample(const TraceRequest& request, uint32_t sample_one_in) {
  if (sample_one_in <= 1) return true;
  uint64_t family = request.hash_ids.size() > 1 ? request.hash_ids[1] : request.hash_ids[0];
  return Mix(family) % sample_one_in == 0;
}

absl::StatusOr<Trace> ReadTrace(const std::string& path, const TraceOptions& options) {
  if (options.sample_one_in == 0) {
    return absl::InvalidArgumentError("sample_one_in is 0; expected 1 (no sampling) or more");
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace file '", path, "'"));
  Trace trace;
  std::string line;
  size_t sampled = 0;  // requests in the sample so far, the ones left out first included
  while (std::getline(in, line)) {
    ++trace.lines_read;
    if (line.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", trace.lines_read, ": empty line; expected a JSON object"));
    }
    absl::StatusOr<TraceRequest> request = ParseTraceLine(line);
    if (!request.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", trace.lines_read, ": ", request.status().message()));
    }
    if (!InSample(*request, options.sample_one_in)) continue;
    if (sampled++ < options.first_request) continue;
    trace.requests.push_back(*std::move(request));
    if (options.max_requests != 0 && trace.requests.size() >= options.max_requests) break;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading trace file '", path, "'"));
  if (trace.lines_read == 0) {
    return absl::InvalidArgumentError(absl::StrCat("trace file '", path, "' is empty"));
  }
  return trace;
}

ReuseFacts MeasureReuse(const std::vector<TraceRequest>& requests) {
  ReuseFacts facts;
  absl::flat_hash_set<uint64_t> seen;
  uint64_t reused = 0;
  for (const TraceRequest& r : requests) {
    for (uint64_t id : r.hash_ids) {
      ++facts.block_refs;
      if (!seen.insert(id).second) ++reused;
    }
  }
  facts.distinct_blocks = seen.size();
  facts.infinite_cache_hit_ratio =
      facts.block_refs == 0 ? 0 : static_cast<double>(reused) / facts.block_refs;
  return facts;
}

}  // namespace proxima::replay
