// proxima_replay: replays the Mooncake conversation trace through a running proximad and prints
// one JSON line with what a prefix cache of that daemon's size achieves: block hit ratio,
// prefill tokens saved, blocks held per GiB of budget, wall time. scripts/bench.sh replay runs
// it against daemons of several budgets and compression hierarchies (scripts/bench-replay.sh).
//
//   proxima_replay --target=127.0.0.1:50051
//       --trace=../shared/data/mooncake_conversation_trace.jsonl
//       --kv_file=tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv --tokens_per_block=16
//       --sample_one_in=16 --label=raw@250
//
// Requests run one after the other, as fast as the daemon answers (the trace's timestamps are
// not waited for: a cache's hit ratio depends on the order of requests, not their spacing).
// Exit status: 0 when every block that came back was right, 3 when some were wrong (counted in
// "bad"), 1 on any other error.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpc/grpc.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "tools/replay/policy_sim.h"
#include "tools/replay/replay.h"
#include "tools/replay/trace.h"

ABSL_FLAG(std::string, target, "unix:/run/proxima/proximad.sock", "proximad's gRPC target");
ABSL_FLAG(std::string, ns, "default", "namespace (tenant) to replay in");
ABSL_FLAG(std::string, trace, "../shared/data/mooncake_conversation_trace.jsonl",
          "Mooncake trace (JSON lines with hash_ids)");
ABSL_FLAG(std::string, kv_file, "tools/eval/testdata/smollm2-135m_gpl3_t0-256_bf16.pkv",
          "real KV dump (.pkv) the block payloads are cut from");
ABSL_FLAG(uint32_t, tokens_per_block, 16,
          "tokens of real KV per replayed block (each stands for one 512-token trace block)");
ABSL_FLAG(uint32_t, sample_one_in, 1, "keep 1 prefix family in N (trace.h); 1 keeps all");
ABSL_FLAG(uint64_t, first_request, 0,
          "leave out the first N sampled requests (the part of a replay before a restart)");
ABSL_FLAG(uint64_t, max_requests, 0,
          "replay only the first N sampled requests after --first_request (0: all)");
ABSL_FLAG(double, max_rel_l2, 0,
          "0: every block read back must be byte-exact; else the K/V relative L2 error a "
          "lossy block may have");
ABSL_FLAG(std::string, label, "", "free text copied into the JSON line (\"run\")");
ABSL_FLAG(double, timeout, 60, "seconds: connect timeout and per-call deadline");
ABSL_FLAG(std::string, simulate, "",
          "instead of replaying through proximad: simulate these temperature policies "
          "(comma-separated: lru, fifo, s3fifo, arc; policy_sim.h) offline at --capacities and "
          "print one JSON line per policy, touch order and capacity");
ABSL_FLAG(std::string, capacities, "125,250,500,1000,2000",
          "with --simulate: cache sizes in blocks, comma-separated");

namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

void Set(Struct& s, const std::string& key, double v) {
  (*s.mutable_fields())[key].set_number_value(v);
}
void SetString(Struct& s, const std::string& key, const std::string& v) {
  (*s.mutable_fields())[key].set_string_value(v);
}

absl::Status PrintJson(const Struct& out) {
  std::string json;
  auto printed = google::protobuf::util::MessageToJsonString(out, &json);
  if (!printed.ok()) return absl::InternalError(std::string(printed.message()));
  std::printf("%s\n", json.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

// --simulate: the trace's requests through offline caches of each policy and size.
absl::Status Simulate(const proxima::replay::Trace& trace, uint32_t sample_one_in) {
  std::vector<size_t> capacities;
  const std::vector<std::string> sizes = absl::StrSplit(absl::GetFlag(FLAGS_capacities), ',');
  for (const std::string& c : sizes) {
    size_t n = 0;
    if (!absl::SimpleAtoi(c, &n) || n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--capacities: \"", c, "\" is not a positive number of blocks"));
    }
    capacities.push_back(n);
  }
  const proxima::replay::ReuseFacts reuse = proxima::replay::MeasureReuse(trace.requests);
  // The baseline of every line: LRU in chain order at the same size, what proximad does today.
  std::vector<double> lru_hit_ratio;
  for (size_t capacity : capacities) {
    PROXIMA_ASSIGN_OR_RETURN(auto lru, proxima::replay::MakeCachePolicy("lru", capacity));
    lru_hit_ratio.push_back(proxima::replay::Simulate(trace.requests, *lru).hit_ratio());
  }
  const std::vector<std::string> policies = absl::StrSplit(absl::GetFlag(FLAGS_simulate), ',');
  for (const std::string& policy : policies) {
    for (auto order :
         {proxima::replay::TouchOrder::kChainOrder, proxima::replay::TouchOrder::kChainHeadLast}) {
      for (size_t k = 0; k < capacities.size(); ++k) {
        const size_t capacity = capacities[k];
        PROXIMA_ASSIGN_OR_RETURN(auto cache, proxima::replay::MakeCachePolicy(policy, capacity));
        const proxima::replay::SimulatedCounts c =
            proxima::replay::Simulate(trace.requests, *cache, order);
        Struct out;
        SetString(out, "bench", "replay_policy");
        SetString(out, "policy", policy);
        SetString(
            out, "touch_order",
            order == proxima::replay::TouchOrder::kChainOrder ? "chain_order" : "chain_head_last");
        Set(out, "sample_one_in", sample_one_in);
        Set(out, "capacity_blocks", static_cast<double>(capacity));
        Set(out, "requests", static_cast<double>(c.requests));
        Set(out, "block_refs", static_cast<double>(c.block_refs));
        Set(out, "infinite_cache_hit_ratio", reuse.infinite_cache_hit_ratio);
        Set(out, "hits", static_cast<double>(c.hits));
        Set(out, "hit_ratio", c.hit_ratio());
        SetString(out, "baseline", "lru chain_order");
        Set(out, "baseline_hit_ratio", lru_hit_ratio[k]);
        Set(out, "ratio", lru_hit_ratio[k] == 0 ? 0 : c.hit_ratio() / lru_hit_ratio[k]);
        Set(out, "puts_stored", static_cast<double>(c.puts_stored));
        Set(out, "evictions", static_cast<double>(c.evictions));
        PROXIMA_RETURN_IF_ERROR(PrintJson(out));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Run() {
  proxima::replay::TraceOptions trace_options;
  trace_options.sample_one_in = absl::GetFlag(FLAGS_sample_one_in);
  trace_options.first_request = absl::GetFlag(FLAGS_first_request);
  trace_options.max_requests = absl::GetFlag(FLAGS_max_requests);
  PROXIMA_ASSIGN_OR_RETURN(proxima::replay::Trace trace,
                           proxima::replay::ReadTrace(absl::GetFlag(FLAGS_trace), trace_options));
  if (!absl::GetFlag(FLAGS_simulate).empty()) {
    PROXIMA_RETURN_IF_ERROR(Simulate(trace, trace_options.sample_one_in));
    return 0;
  }
  PROXIMA_ASSIGN_OR_RETURN(
      auto source, proxima::replay::BlockSource::Create(absl::GetFlag(FLAGS_kv_file),
                                                        absl::GetFlag(FLAGS_tokens_per_block)));

  proxima::client::ClientOptions client_options;
  client_options.target = absl::GetFlag(FLAGS_target);
  client_options.namespace_name = absl::GetFlag(FLAGS_ns);
  client_options.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  client_options.call_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  // Inline puts store a request's blocks one after another, each free to evict the ones before
  // it, which is what the policy model (--simulate, and replay_integration_test's exact model)
  // assumes. UCX puts reserve a whole batch before committing any of it, so in a tier smaller
  // than one request's misses they refuse the overflow instead (docs/decisions.md).
  client_options.transport = proxima::client::Transport::kInline;
  PROXIMA_ASSIGN_OR_RETURN(auto client, proxima::client::Client::Connect(client_options));
  PROXIMA_ASSIGN_OR_RETURN(proxima::client::Profile profile,
                           client->RegisterProfile(source->Profile()));

  proxima::replay::ReplayOptions options;
  options.max_rel_l2 = absl::GetFlag(FLAGS_max_rel_l2);
  PROXIMA_ASSIGN_OR_RETURN(
      proxima::replay::ReplayCounts c,
      proxima::replay::RunReplay(*client, profile, *source, trace.requests, options));
  PROXIMA_ASSIGN_OR_RETURN(proxima::v1::StatsResponse stats, client->Stats());

  proxima::replay::ReuseFacts reuse = proxima::replay::MeasureReuse(trace.requests);
  Struct out;
  SetString(out, "bench", "replay");
  SetString(out, "run", absl::GetFlag(FLAGS_label));
  SetString(out, "namespace", absl::GetFlag(FLAGS_ns));
  Set(out, "sample_one_in", trace_options.sample_one_in);
  Set(out, "first_request", static_cast<double>(trace_options.first_request));
  Set(out, "requests", static_cast<double>(c.requests));
  Set(out, "block_refs", static_cast<double>(c.block_refs));
  Set(out, "distinct_blocks", static_cast<double>(reuse.distinct_blocks));
  Set(out, "infinite_cache_hit_ratio", reuse.infinite_cache_hit_ratio);
  Set(out, "tokens_per_block", absl::GetFlag(FLAGS_tokens_per_block));
  Set(out, "block_bytes", static_cast<double>(source->block_bytes()));
  Set(out, "hits", static_cast<double>(c.hits));
  Set(out, "hit_ratio", c.hit_ratio());
  Set(out, "prefill_tokens_saved", static_cast<double>(c.prefill_tokens_saved()));
  Set(out, "lookup_hits", static_cast<double>(c.lookup_hits));
  Set(out, "get_missing", static_cast<double>(c.get_missing));
  Set(out, "exact", static_cast<double>(c.exact));
  Set(out, "lossy_within_bound", static_cast<double>(c.lossy_within_bound));
  Set(out, "bad", static_cast<double>(c.bad));
  Set(out, "worst_k_rel_l2", c.worst_k_rel_l2);
  Set(out, "worst_v_rel_l2", c.worst_v_rel_l2);
  Set(out, "puts_stored", static_cast<double>(c.puts_stored));
  Set(out, "puts_already_present", static_cast<double>(c.puts_already_present));
  Set(out, "puts_no_space", static_cast<double>(c.puts_no_space));
  Set(out, "bytes_put", static_cast<double>(c.bytes_put));
  Set(out, "bytes_got", static_cast<double>(c.bytes_got));
  Set(out, "wall_s", c.wall_seconds);
  uint64_t capacity = 0, used = 0, evictions = 0;
  for (const auto& tier : stats.tiers()) {
    capacity += tier.capacity_bytes();
    used += tier.used_bytes();
    evictions += tier.evictions();
  }
  uint64_t held = 0;
  for (const auto& ns : stats.namespaces()) {
    if (ns.name() == absl::GetFlag(FLAGS_ns)) held = ns.blocks();
  }
  Set(out, "capacity_bytes", static_cast<double>(capacity));
  Set(out, "used_bytes", static_cast<double>(used));
  Set(out, "evictions", static_cast<double>(evictions));
  Set(out, "blocks_held", static_cast<double>(held));
  Set(out, "blocks_held_per_gib",
      capacity == 0 ? 0
                    : static_cast<double>(held) / (static_cast<double>(capacity) / (1ull << 30)));
  Set(out, "crc_failures_client", static_cast<double>(client->crc_failures()));
  Set(out, "crc_failures_daemon", static_cast<double>(stats.crc_failures()));

  PROXIMA_RETURN_IF_ERROR(PrintJson(out));
  return c.bad == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Holds one gRPC library reference for the life of the process, never released. Without it
  // the client's channel drops the last reference when it is destroyed, and grpc_shutdown()
  // (gRPC 1.51) joins an executor thread that sits in a 10 s epoll_wait after callback-API
  // calls: every run would end with 10 s of idle. The OS reclaims everything at exit.
  grpc_init();
  absl::StatusOr<int> code = Run();
  if (!code.ok()) {
    std::fprintf(stderr, "proxima_replay: %s\n", code.status().ToString().c_str());
    return 1;
  }
  return *code;
}
