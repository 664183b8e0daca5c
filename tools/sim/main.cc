// proxima_placement_sim: simulates cluster placement (DESIGN.md section 6) on the Mooncake trace
// for several cluster sizes and prints one JSON line per result (placement_sim.h, hops_sim.h):
//
//   metric "balance": bytes per node by home placement, equal and unequal weights;
//   metric "moved":   fraction of distinct keys whose home moves when one node joins or leaves,
//                     against the ideal 1/(N+1) or 1/N and against modulo hashing (the
//                     baseline, same keys, same run);
//   metric "hops":    read hops of the put-local + home-record design, without and with
//                     per-node capacity pressure, against put-at-home (same hits).
//
//   proxima_placement_sim --trace=../shared/data/mooncake_conversation_trace.jsonl
//       --nodes=10,30,100,300,1000
//
// --check_moved_z=Z makes the run a test: exit status 3 when a rendezvous moved fraction is
// more than Z binomial standard deviations from its ideal (1 on any other error).
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/codec.h"
#include "tools/replay/trace.h"
#include "tools/sim/hops_sim.h"
#include "tools/sim/placement_sim.h"

ABSL_FLAG(std::string, trace, "../shared/data/mooncake_conversation_trace.jsonl",
          "Mooncake trace (JSON lines with hash_ids)");
ABSL_FLAG(uint32_t, sample_one_in, 1, "keep 1 prefix family in N (tools/replay/trace.h)");
ABSL_FLAG(uint64_t, max_requests, 0, "use only the first N (sampled) requests; 0: all");
ABSL_FLAG(std::string, nodes, "10,30,100,300,1000", "cluster sizes, comma-separated");
ABSL_FLAG(std::string, metrics, "balance,moved,hops", "which results to print, comma-separated");
ABSL_FLAG(std::string, ns, "default", "namespace the blocks are placed in");
ABSL_FLAG(uint32_t, num_layers, 32, "model profile: layers (default Llama-3.1-8B)");
ABSL_FLAG(uint32_t, num_kv_heads, 8, "model profile: KV heads");
ABSL_FLAG(uint32_t, head_dim, 128, "model profile: head dimension (bf16/fp16: 2 bytes a value)");
ABSL_FLAG(
    double, heavy_weight, 2.0,
    "unequal weights: odd-numbered nodes get this weight, even ones 1 (half big, half small)");
ABSL_FLAG(double, capacity_factor, 0.5,
          "with pressure: each node holds this fraction of its mean share of the trace's distinct "
          "blocks (0.5: the cluster holds half of them); ignored when --node_capacity_gib > 0");
ABSL_FLAG(double, node_capacity_gib, 0,
          "with pressure: each node's capacity in GiB (0: use "
          "--capacity_factor)");
ABSL_FLAG(uint32_t, spill_candidates, 3,
          "a cold block spills to the first of its key's top K rendezvous nodes with room");
ABSL_FLAG(std::string, routing, "round_robin,prefix_family",
          "request-to-node routing for hops: round_robin, prefix_family (comma-separated)");
ABSL_FLAG(double, check_moved_z, 0,
          "if > 0: exit 3 when a rendezvous moved fraction is more than this many binomial "
          "standard deviations from its ideal");

namespace {

namespace sim = proxima::sim;

// One JSON object on one line, keys in the order added.
class JsonLine {
 public:
  JsonLine& Num(const std::string& key, double v) {
    return Raw(key, std::isfinite(v) ? absl::StrCat(v) : "null");
  }
  JsonLine& Int(const std::string& key, uint64_t v) { return Raw(key, absl::StrCat(v)); }
  JsonLine& Str(const std::string& key, const std::string& v) {
    return Raw(key, absl::StrCat("\"", v, "\""));  // values are our own identifiers
  }
  void Print() const {
    std::printf("{%s}\n", body_.c_str());
    std::fflush(stdout);
  }

 private:
  JsonLine& Raw(const std::string& key, const std::string& value) {
    absl::StrAppend(&body_, body_.empty() ? "" : ", ", "\"", key, "\": ", value);
    return *this;
  }
  std::string body_;
};

absl::StatusOr<std::vector<size_t>> ParseSizes(const std::string& text) {
  std::vector<size_t> out;
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  for (const std::string& part : parts) {
    size_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 2 || n > 1000000) {
      return absl::InvalidArgumentError(
          absl::StrCat("--nodes: \"", part, "\" is not a cluster size in [2, 1000000]"));
    }
    out.push_back(n);
  }
  return out;
}

bool Wants(const std::vector<std::string>& list, const std::string& name) {
  for (const std::string& s : list) {
    if (s == name) return true;
  }
  return false;
}

void PrintBalance(size_t n, const std::string& weights, const sim::Balance& b, uint64_t keys,
                  double block_bytes, double ideal_cv, double home_ns_per_key) {
  JsonLine()
      .Str("bench", "placement_sim")
      .Str("metric", "balance")
      .Int("nodes", n)
      .Str("weights", weights)
      .Int("keys", keys)
      .Num("mean_gib_per_node", keys * block_bytes / n / (1u << 30))
      .Num("max_over_mean", b.max_over_mean)
      .Num("p99_over_mean", b.p99_over_mean)
      .Num("min_over_mean", b.min_over_mean)
      .Num("cv", b.cv)
      .Num("ideal_random_cv", ideal_cv)
      .Num("home_node_ns_per_key", home_ns_per_key)
      .Print();
}

void PrintMoved(size_t n, const char* event, const sim::Moved& m, double ideal,
                const sim::Moved& baseline) {
  JsonLine()
      .Str("bench", "placement_sim")
      .Str("metric", "moved")
      .Int("nodes", n)
      .Str("event", event)
      .Int("keys", m.keys)
      .Int("moved", m.moved)
      .Num("moved_fraction", m.fraction())
      .Num("ideal_fraction", ideal)
      .Num("ratio_to_ideal", m.fraction() / ideal)
      .Int("moved_between_other_nodes", m.moved_between_others)
      .Str("baseline", "modulo")
      .Num("baseline_moved_fraction", baseline.fraction())
      .Num("baseline_over_rendezvous", m.moved == 0 ? 0 : baseline.fraction() / m.fraction())
      .Print();
}

absl::Status RunBalance(size_t n, const std::vector<uint64_t>& hashes, double block_bytes,
                        double heavy_weight) {
  for (bool equal : {true, false}) {
    const auto nodes = sim::MakeNodes(n, equal ? 1.0 : heavy_weight);
    std::vector<double> bytes(n, 0), weight(n);
    for (size_t i = 0; i < n; ++i) weight[i] = nodes[i].weight;
    const absl::Time start = absl::Now();
    const std::vector<uint32_t> homes = sim::Homes(nodes, hashes);
    // Wall time of one HomeNode (O(N): a score per node) on this machine, for docs/cluster.md.
    const double ns_per_key = absl::ToDoubleNanoseconds(absl::Now() - start) / hashes.size();
    for (uint32_t home : homes) bytes[home] += block_bytes;
    PROXIMA_ASSIGN_OR_RETURN(sim::Balance b, sim::MeasureBalance(bytes, weight));
    // Keys thrown independently at nodes (multinomial): the spread a perfect hash would give.
    const double keys = static_cast<double>(hashes.size());
    const double ideal_cv = equal ? std::sqrt((n - 1.0) / keys) : NAN;
    PrintBalance(n, equal ? "equal" : absl::StrCat("1:", heavy_weight), b, hashes.size(),
                 block_bytes, ideal_cv, ns_per_key);
  }
  return absl::OkStatus();
}

// Returns whether every moved fraction was within --check_moved_z (true when not checking).
bool RunMoved(size_t n, const std::vector<uint64_t>& hashes) {
  const auto nodes = sim::MakeNodes(n);
  const size_t leaving = n - 1;  // the newest node leaves
  const double z = absl::GetFlag(FLAGS_check_moved_z);
  bool ok = true;
  auto check = [&](const sim::Moved& m, double p) {
    if (z <= 0) return;
    absl::Status s = sim::CheckMovedFraction(m, p, z);
    if (m.moved_between_others != 0) {
      s = absl::InternalError(
          absl::StrCat(m.moved_between_others, " keys moved between nodes that did not change"));
    }
    if (!s.ok()) {
      std::fprintf(stderr, "nodes %zu: %s\n", n, std::string(s.message()).c_str());
      ok = false;
    }
  };
  const sim::Moved join = sim::RendezvousMovedOnJoin(nodes, hashes);
  PrintMoved(n, "join", join, 1.0 / (n + 1), sim::ModuloMovedOnJoin(nodes, hashes));
  check(join, 1.0 / (n + 1));
  const sim::Moved leave = sim::RendezvousMovedOnLeave(nodes, hashes, leaving);
  PrintMoved(n, "leave", leave, 1.0 / n, sim::ModuloMovedOnLeave(nodes, hashes, leaving));
  check(leave, 1.0 / n);
  return ok;
}

absl::Status RunHops(size_t n, const proxima::replay::Trace& trace, uint64_t distinct,
                     double block_bytes) {
  const auto nodes = sim::MakeNodes(n);
  size_t capacity = 0;
  if (absl::GetFlag(FLAGS_node_capacity_gib) > 0) {
    capacity =
        static_cast<size_t>(absl::GetFlag(FLAGS_node_capacity_gib) * (1u << 30) / block_bytes);
  } else if (absl::GetFlag(FLAGS_capacity_factor) > 0) {
    capacity = static_cast<size_t>(
        std::ceil(absl::GetFlag(FLAGS_capacity_factor) * static_cast<double>(distinct) / n));
  }
  std::vector<size_t> capacities = {0};
  if (capacity > 0) capacities.push_back(capacity);
  const std::vector<std::string> routings = absl::StrSplit(absl::GetFlag(FLAGS_routing), ',');
  for (const std::string& name : routings) {
    PROXIMA_ASSIGN_OR_RETURN(sim::Routing routing, sim::ParseRouting(name));
    for (size_t cap : capacities) {
      sim::HopsOptions options;
      options.routing = routing;
      options.capacity_blocks = cap;
      options.spill_candidates = absl::GetFlag(FLAGS_spill_candidates);
      options.name_space = absl::GetFlag(FLAGS_ns);
      PROXIMA_ASSIGN_OR_RETURN(sim::HopsResult r,
                               sim::SimulateHops(nodes, trace.requests, options));
      const double hits = r.hits == 0 ? 1 : static_cast<double>(r.hits);
      const double misses = r.misses == 0 ? 1 : static_cast<double>(r.misses);
      JsonLine()
          .Str("bench", "placement_sim")
          .Str("metric", "hops")
          .Int("nodes", n)
          .Str("routing", std::string(sim::RoutingName(routing)))
          .Int("capacity_blocks_per_node", cap)
          .Num("capacity_gib_per_node", cap * block_bytes / (1u << 30))
          .Int("block_refs", r.block_refs)
          .Int("hits", r.hits)
          .Num("hit_ratio", r.hit_ratio())
          .Num("read_hops_0", r.read_hops[0] / hits)
          .Num("read_hops_1", r.read_hops[1] / hits)
          .Num("read_hops_2", r.read_hops[2] / hits)
          .Num("mean_read_hops", r.mean_read_hops())
          .Num("locate_hops_0", r.locate_hops[0] / hits)
          .Num("locate_hops_1", r.locate_hops[1] / hits)
          .Num("miss_lookup_hops_1", r.miss_locate_hops[1] / misses)
          .Num("hits_on_spilled", r.hits_on_spilled / hits)
          .Int("puts", r.puts)
          .Int("spills", r.spills)
          .Int("evictions", r.evictions)
          .Str("baseline", "put_at_home")
          .Num("baseline_mean_read_hops", r.baseline_mean_read_hops())
          .Print();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Run() {
  PROXIMA_ASSIGN_OR_RETURN(std::vector<size_t> sizes, ParseSizes(absl::GetFlag(FLAGS_nodes)));
  const std::vector<std::string> metrics = absl::StrSplit(absl::GetFlag(FLAGS_metrics), ',');
  for (const std::string& m : metrics) {
    if (m != "balance" && m != "moved" && m != "hops") {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics: '", m, "' is unknown; expected balance, moved or hops"));
    }
  }
  proxima::codec::BlockGeometry geometry{
      absl::GetFlag(FLAGS_num_layers), absl::GetFlag(FLAGS_num_kv_heads),
      absl::GetFlag(FLAGS_head_dim), static_cast<uint32_t>(proxima::replay::kTraceTokensPerBlock),
      proxima::codec::DType::kBf16};
  PROXIMA_RETURN_IF_ERROR(geometry.Validate());
  const double block_bytes = static_cast<double>(geometry.RawBytes());
  if (!(absl::GetFlag(FLAGS_heavy_weight) > 0)) {
    return absl::InvalidArgumentError("--heavy_weight must be > 0");
  }

  proxima::replay::TraceOptions trace_options;
  trace_options.sample_one_in = absl::GetFlag(FLAGS_sample_one_in);
  trace_options.max_requests = absl::GetFlag(FLAGS_max_requests);
  PROXIMA_ASSIGN_OR_RETURN(proxima::replay::Trace trace,
                           proxima::replay::ReadTrace(absl::GetFlag(FLAGS_trace), trace_options));
  const std::vector<uint64_t> ids = sim::DistinctBlocks(trace.requests);
  std::vector<uint64_t> hashes;
  hashes.reserve(ids.size());
  for (uint64_t id : ids) hashes.push_back(sim::TraceBlockHash(absl::GetFlag(FLAGS_ns), id));

  JsonLine()
      .Str("bench", "placement_sim")
      .Str("metric", "input")
      .Int("requests", trace.requests.size())
      .Int("distinct_blocks", ids.size())
      .Int("block_bytes", geometry.RawBytes())
      .Num("distinct_gib", ids.size() * block_bytes / (1u << 30))
      .Print();

  bool moved_ok = true;
  for (size_t n : sizes) {
    if (Wants(metrics, "balance")) {
      PROXIMA_RETURN_IF_ERROR(
          RunBalance(n, hashes, block_bytes, absl::GetFlag(FLAGS_heavy_weight)));
    }
    if (Wants(metrics, "moved") && !RunMoved(n, hashes)) moved_ok = false;
    if (Wants(metrics, "hops")) PROXIMA_RETURN_IF_ERROR(RunHops(n, trace, ids.size(), block_bytes));
  }
  return moved_ok ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<int> rc = Run();
  if (!rc.ok()) {
    std::fprintf(stderr, "proxima_placement_sim: %s\n", rc.status().ToString().c_str());
    return 1;
  }
  return *rc;
}
