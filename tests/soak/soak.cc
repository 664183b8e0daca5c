// proxima_soak: a bounded soak of a real proximad on loopback. Starts the daemon (the built
// binary, default config plus --set overrides), then runs --clients clients, each with its own
// connection, doing a mix of put / get / lookup / delete on its own chains of test blocks for
// --duration_s seconds (or until --max_requests), checking every byte that comes back.
//
// With --levels (a compression hierarchy, e.g. "int8;layers[0:2]=int8,default=int4,sink=int8;k4v3")
// the blocks are real KV (--kv_file) and the daemon compresses them under pressure in two
// namespaces: "default" compresses every block, "long" only blocks of sequences of 48 tokens or
// more and with a tight quality budget, so its guard steps back. Each client owns its chains in
// both, of two models (the dump's own heads, and the same bytes as heads of 1.5x the dim, which
// k4v3 cannot take), puts them with positions and, now and then, high priority, and reads them
// back through Get, Decompress and GetStored. Every answer must be exactly what the codec makes
// of the block on some path down the hierarchy the block may reach (tests/soak/codec_oracle.h),
// a block deleted must not come back, and every level must be seen among the stored answers.
// After a delete the key is put again with other content, so an encoding of the old content
// that lands after the delete shows as wrong bytes.
//
// --nodes=N makes the daemons a cluster, each request going to a random node. --kill_every_s adds
// node loss: every so often a node other than node 0 is killed (SIGKILL) mid-traffic and started
// again, empty, --down_s later (--kill_signal=TERM: stopped gracefully; STOP: hung for --down_s,
// then resumed with its blocks, as a node stalled or cut off for a while). Requests to it from
// its kill until every node sees it live again
// may fail with UNAVAILABLE (counted, with how long after that they still failed); no other
// request may fail, no answer may be wrong, and every node must see every node live at the end.
//
// With one node, --kill_every_s restarts that node (requests to it fail with UNAVAILABLE while it
// is down, as above), and --snapshot gives it a snapshot file (tiers.host.snapshot_file): then a
// TERM writes its blocks and the restart reads them back, each restart must load every block the
// stop wrote and skip none, and every answer after it is checked as before: exact bytes, and no
// block deleted before the stop may come back. Its RSS is not checked (the daemon restarts).
//
// Every --report_s seconds it prints one JSON line: throughput per operation, p50/p99 latency,
// the daemon's RSS, errors and wrong bytes in that interval. At the end, one summary line and
// the verdict: errors and wrong bytes must be zero, so must the blocks whose CRC32C failed at a
// client (twice: the client reports them as misses), and RSS must be flat after warm-up (the
// largest RSS of the last interval at most --rss_growth_mib above the largest RSS of the first
// interval after warm-up). Exit status 0 only when the verdict is "pass".
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/mutex.h"
#include "common/testing/free_port.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"
#include "tests/soak/codec_oracle.h"

ABSL_FLAG(int, duration_s, 600, "seconds to run");
ABSL_FLAG(int64_t, max_requests, 0, "stop after this many requests in all (0: no limit)");
ABSL_FLAG(int, clients, 8, "concurrent clients, one connection each");
ABSL_FLAG(int, report_s, 10, "seconds per reported interval");
ABSL_FLAG(int, warmup_s, 60, "seconds of warm-up before RSS must stay flat");
ABSL_FLAG(int, rss_growth_mib, 32, "largest RSS growth after warm-up that still passes");
ABSL_FLAG(uint64_t, capacity_bytes, 256ull << 20, "host tier capacity of the daemon");
ABSL_FLAG(int, chain_blocks, 64, "blocks per client chain (a client cycles over 8 chains)");
ABSL_FLAG(std::string, levels, "",
          "a compression hierarchy, levels separated by ';' (e.g. \"int8;k4v3\"): soak with real "
          "KV blocks compressed by the daemon, every answer checked exactly against the codec");
ABSL_FLAG(std::string, kv_file, PROXIMA_SOAK_KV_FILE,
          "the real KV dump blocks come from (--levels)");
ABSL_FLAG(int, contents, 48, "distinct real blocks the chains draw from (--levels)");
ABSL_FLAG(int, nodes, 1,
          "daemons (--levels): more than one makes them a cluster on loopback, with the UCX data "
          "plane on; node i's host tier is (i + 1) x --capacity_bytes, so the smaller ones spill; "
          "each request goes to a random node");

ABSL_FLAG(int, kill_every_s, 0,
          "every this many seconds, SIGKILL a random node other than node 0 (with one node: "
          "node 0) mid-traffic and start it again --down_s later (0: never)");
ABSL_FLAG(bool, snapshot, false,
          "with --nodes=1: the daemon keeps its blocks across its restarts in a snapshot file "
          "(tiers.host.snapshot_file; use with --kill_signal=TERM)");
ABSL_FLAG(std::vector<std::string>, set, {},
          "config overrides given to every daemon, as proximad's --set (comma-separated)");
ABSL_FLAG(std::string, client_transport, "auto",
          "how the soak's clients move block bytes (--levels): auto, ucx or inline");
ABSL_FLAG(int, down_s, 2, "seconds a node killed by --kill_every_s stays down");
ABSL_FLAG(std::string, kill_signal, "KILL",
          "--kill_every_s: KILL (the node dies at once), TERM (it drains, hands its blocks to "
          "its peers, cluster.spill.handoff, and exits) or STOP (it hangs for --down_s, SIGSTOP, "
          "and then runs on with its blocks, SIGCONT: no restart)");
ABSL_FLAG(int, reconnect_grace_s, 2,
          "--kill_every_s: how long after a restarted node is live again on every node a request "
          "to it may still fail with UNAVAILABLE (its client reconnecting)");

namespace proxima {
namespace {

using client::BlockKey;
using client::Client;
using client::Profile;
using Clock = std::chrono::steady_clock;

enum Op { kPut, kGet, kLookup, kDelete, kDecompress, kGetStored, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"put",    "get",        "lookup",
                                           "delete", "decompress", "get_stored"};
// The operations of a plain soak; a compressed one (--levels) adds Decompress and GetStored.
constexpr int kPlainOps = kDelete + 1;

// Latencies and counts of one interval, merged from all clients.
struct Interval {
  std::vector<double> latency_ms[kNumOps];
  uint64_t errors = 0;
  uint64_t wrong_bytes = 0;
  std::string first_error;
  std::string first_wrong;
};

class Recorder {
 public:
  void Record(Op op, double ms) {
    proxima::MutexLock lock(&mu_);
    current_.latency_ms[op].push_back(ms);
  }
  void Error(const absl::Status& s) {
    proxima::MutexLock lock(&mu_);
    if (current_.errors++ == 0) current_.first_error = s.ToString();
  }
  void WrongBytes(const std::string& what = "") {
    proxima::MutexLock lock(&mu_);
    if (current_.wrong_bytes++ == 0) current_.first_wrong = what;
  }
  // A GetStored answer at `level` that the oracle confirmed (--levels).
  void StoredAt(uint32_t level) {
    proxima::MutexLock lock(&mu_);
    if (stored_levels_.size() <= level) stored_levels_.resize(level + 1);
    ++stored_levels_[level];
  }
  // A block found again after this client deleted it (a cluster forgets asynchronously): read
  // back (`read`), or counted by a lookup.
  void FoundAfterDelete(bool read) {
    found_after_delete_[read].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t found_after_delete(bool read) const { return found_after_delete_[read].load(); }
  // Blocks a get (Get, Decompress, GetStored) that succeeded asked for, and how many it found.
  void Gets(uint64_t asked, uint64_t found) {
    gets_asked_.fetch_add(asked, std::memory_order_relaxed);
    gets_found_.fetch_add(found, std::memory_order_relaxed);
  }
  double get_hit_ratio() const {
    const uint64_t asked = gets_asked_.load();
    return asked == 0 ? 0.0 : static_cast<double>(gets_found_.load()) / static_cast<double>(asked);
  }
  // A request to a node that failed with UNAVAILABLE while the node was down (--kill_every_s),
  // or `after_up` after it was live again.
  void Unavailable(Clock::duration after_up) {
    unavailable_.fetch_add(1, std::memory_order_relaxed);
    const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(after_up).count();
    int64_t prev = unavailable_after_up_ms_.load();
    while (ms > prev && !unavailable_after_up_ms_.compare_exchange_weak(prev, ms)) {
    }
  }
  uint64_t unavailable() const { return unavailable_.load(); }
  // Blocks a client received whose bytes failed their CRC32C and failed it again when asked for
  // again (Client::crc_failures): the client reports them as misses, so no wrong byte reaches the
  // soak's checks, but on loopback nothing damages bytes on their way: the daemon sent them.
  void ClientCrcFailures(uint64_t n) { client_crc_failures_.fetch_add(n); }
  uint64_t client_crc_failures() const { return client_crc_failures_.load(); }
  int64_t unavailable_after_up_ms() const { return unavailable_after_up_ms_.load(); }
  std::vector<uint64_t> stored_levels() {
    proxima::MutexLock lock(&mu_);
    return stored_levels_;
  }
  Interval Take() {
    proxima::MutexLock lock(&mu_);
    Interval out = std::move(current_);
    current_ = Interval();
    return out;
  }

 private:
  proxima::Mutex mu_;
  Interval current_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> stored_levels_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> found_after_delete_[2] = {0, 0};
  std::atomic<uint64_t> gets_asked_{0};
  std::atomic<uint64_t> gets_found_{0};
  std::atomic<uint64_t> unavailable_{0};
  std::atomic<int64_t> unavailable_after_up_ms_{0};
  std::atomic<uint64_t> client_crc_failures_{0};
};

// When each node was down (--kill_every_s): from its kill until every node saw it live again.
class Outages {
 public:
  explicit Outages(size_t nodes, Clock::duration grace) : windows_(nodes), grace_(grace) {}
  void Down(size_t node) {
    proxima::MutexLock lock(&mu_);
    windows_[node].push_back({Clock::now(), Clock::time_point::max()});
  }
  void Up(size_t node) {
    proxima::MutexLock lock(&mu_);
    windows_[node].back().second = Clock::now();
  }
  // Whether a request to `node` over [start, end] met one of its outages (or the grace after
  // it); `after_up` is how long after the nearest such outage ended the request ended (0 when
  // it ended within one).
  bool Met(size_t node, Clock::time_point start, Clock::time_point end,
           Clock::duration* after_up) const {
    proxima::MutexLock lock(&mu_);
    bool met = false;
    for (const auto& [down, up] : windows_[node]) {
      if (end < down || (up != Clock::time_point::max() && start > up + grace_)) continue;
      const Clock::duration late =
          up != Clock::time_point::max() && end > up ? end - up : Clock::duration(0);
      *after_up = met ? std::min(*after_up, late) : late;
      met = true;
    }
    return met;
  }

 private:
  mutable proxima::Mutex mu_;
  std::vector<std::vector<std::pair<Clock::time_point, Clock::time_point>>> windows_
      ABSL_GUARDED_BY(mu_);
  const Clock::duration grace_;
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, static_cast<size_t>(q * v.size()));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// Records a request that started at `start`: its latency, or its error. False on an error.
bool Recorded(Recorder* rec, Op op, Clock::time_point start, const absl::Status& status) {
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  if (!status.ok()) {
    rec->Error(status);
    return false;
  }
  rec->Record(op, ms);
  return true;
}

// One client: 8 chains; each step picks an operation (put 20%, get 45%, lookup 30%, delete 5%)
// on a random chain and a random batch of 4 blocks in it.
void RunClient(int id, const std::string& target, const v1::ModelProfile& model,
               std::atomic<bool>* stop, std::atomic<int64_t>* budget, Recorder* rec) {
  client::ClientOptions options;
  options.target = target;
  options.call_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  if (!connected.ok()) {
    rec->Error(connected.status());
    return;
  }
  std::unique_ptr<Client> c = *std::move(connected);
  absl::StatusOr<Profile> p = c->RegisterProfile(model);
  if (!p.ok()) {
    rec->Error(p.status());
    return;
  }
  const size_t chain_blocks = absl::GetFlag(FLAGS_chain_blocks);
  constexpr size_t kBatch = 4;
  std::mt19937_64 rng(id);
  std::vector<std::vector<std::byte>> data(kBatch, std::vector<std::byte>(p->block_bytes));
  std::vector<std::span<std::byte>> out(data.begin(), data.end());
  while (!stop->load() && budget->fetch_sub(1) > 0) {
    const uint64_t seed = 10000 + id * 8 + rng() % 8;
    const size_t first = rng() % (chain_blocks / kBatch) * kBatch;
    const std::vector<BlockKey> keys = client::TestKeyChain(seed, first, kBatch);
    const int pick = static_cast<int>(rng() % 100);
    const Op op = pick < 20 ? kPut : pick < 65 ? kGet : pick < 95 ? kLookup : kDelete;
    std::vector<std::span<const std::byte>> in;
    if (op == kPut) {
      for (size_t i = 0; i < kBatch; ++i) {
        client::FillTestBlock(seed, first + i, data[i]);
        in.push_back(data[i]);
      }
    }
    const Clock::time_point start = Clock::now();
    absl::Status status;
    std::vector<bool> found;
    switch (op) {
      case kPut:
        status = c->Put(*p, keys, in).status();
        break;
      case kGet: {
        absl::StatusOr<std::vector<bool>> r = c->Get(*p, keys, out);
        status = r.status();
        if (r.ok()) found = *std::move(r);
        break;
      }
      case kLookup:
        status = c->Lookup(*p, client::TestKeyChain(seed, 0, chain_blocks)).status();
        break;
      case kDelete:
        status = c->Delete(*p, keys).status();
        break;
      case kDecompress:  // a compressed soak's (RunCompressedClient)
      case kGetStored:
      case kNumOps:
        break;
    }
    if (!Recorded(rec, op, start, status)) continue;
    for (size_t i = 0; i < found.size(); ++i) {
      if (found[i] && !client::IsTestBlock(seed, first + i, data[i])) rec->WrongBytes();
    }
  }
  rec->ClientCrcFailures(c->crc_failures());
}

// --levels: the two namespaces a compressed soak runs in. Blocks in "long" compress only from
// the position whose sequence reaches kMinSeqLen tokens, high-priority ones go one level deeper
// than in "default", and its quality budget is the default one (0.12), which k4v3 on SmolLM2's
// 16-token blocks exceeds (about 0.14), so its guard steps back from that level while "default"
// (budget 0.5) keeps it. The oracle allows every level a block may reach.
constexpr const char* kNamespaces[2] = {"default", "long"};
constexpr uint32_t kMinSeqLen = 48;
// The deepest level a block put with high priority may reach, per namespace.
constexpr uint8_t kHighMaxLevel[2] = {1, 2};

std::string NamespacesConfig(const std::vector<std::string>& levels) {
  const std::string list = absl::StrCat("['", absl::StrJoin(levels, "', '"), "']");
  return absl::StrCat(
      "namespaces=[{name: ", kNamespaces[0], ", compression: {enabled: true, levels: ", list,
      ", trigger: {memory_pressure_threshold: 0.7}, priority: {high_max_level: ", kHighMaxLevel[0],
      "}, quality: {max_attention_error: 0.5}}}, {name: ", kNamespaces[1],
      ", compression: {enabled: true, levels: ", list,
      ", trigger: {memory_pressure_threshold: 0.7, min_seq_len_to_compress: ", kMinSeqLen,
      "}, priority: {high_max_level: ", kHighMaxLevel[1],
      "}, quality: {max_attention_error: 0.12, sample_one_in: 4}}}]");
}

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One client of a compressed soak: 8 chains (namespace c % 2, model (c / 2) % models); each step
// picks an operation (put 25%, get 20%, decompress 15%, get_stored 15%, lookup 20%, delete 5%) on
// a random chain and a random batch of 4 blocks in it, through a random node of `targets`, and
// checks the answer against the oracle and what this client did to its own keys.
//
// With one node, a delete gives the keys other content for their next put, and a deleted block
// must never come back. A cluster forgets deleted blocks asynchronously (docs/cluster.md: a copy
// no home knows of stays until evicted), and a content-addressed key always names the same bytes:
// there, keys keep their content and a deleted block found again is counted, not a failure.
//
// `outages` (null without --kill_every_s): a request that fails with UNAVAILABLE through a node
// while it was down is counted there, not as an error.
void RunCompressedClient(int id, const std::vector<std::string>& targets,
                         testing::CodecOracle* oracle, const Outages* outages,
                         std::atomic<bool>* stop, std::atomic<int64_t>* budget, Recorder* rec) {
  const bool cluster = targets.size() > 1;
  // conns[node][ns], profiles[node][ns][model]
  std::vector<std::array<std::unique_ptr<Client>, 2>> conns(targets.size());
  std::vector<std::array<std::vector<Profile>, 2>> profiles(targets.size());
  for (size_t node = 0; node < targets.size(); ++node) {
    for (int ns = 0; ns < 2; ++ns) {
      client::ClientOptions options;
      options.target = targets[node];
      options.namespace_name = kNamespaces[ns];
      options.call_timeout = absl::Seconds(10);
      const std::string transport = absl::GetFlag(FLAGS_client_transport);
      options.transport = transport == "ucx"      ? client::Transport::kUcx
                          : transport == "inline" ? client::Transport::kInline
                                                  : client::Transport::kAuto;
      absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
      if (!connected.ok()) {
        rec->Error(connected.status());
        return;
      }
      conns[node][ns] = *std::move(connected);
      for (size_t m = 0; m < oracle->num_models(); ++m) {
        absl::StatusOr<Profile> p = conns[node][ns]->RegisterProfile(oracle->model(m));
        if (!p.ok()) {
          rec->Error(p.status());
          return;
        }
        profiles[node][ns].push_back(*p);
      }
    }
  }
  struct BlockState {
    uint32_t generation = 0;    // bumped by each delete (one node): other content next time
    bool maybe_stored = false;  // false after a delete, until a put stores it again
  };
  struct Chain {
    uint64_t seed = 0;
    int ns = 0;
    size_t model = 0;
    std::vector<BlockState> blocks;
  };
  constexpr size_t kBatch = 4;
  const size_t chain_blocks = absl::GetFlag(FLAGS_chain_blocks);
  const uint32_t tokens = oracle->model(0).tokens_per_block();
  std::vector<Chain> chains(8);
  for (size_t c = 0; c < chains.size(); ++c) {
    chains[c] = {20000 + static_cast<uint64_t>(id) * 8 + c, static_cast<int>(c % 2),
                 (c / 2) % oracle->num_models(), std::vector<BlockState>(chain_blocks)};
  }
  auto content = [&](const Chain& chain, size_t j) {
    return static_cast<uint32_t>(
        Mix(chain.seed * 1000003 + j * 7919 + (uint64_t{chain.blocks[j].generation} << 20)) %
        oracle->num_contents());
  };
  // One batch in 8 is put with high priority, always the same ones: every copy of a block, on
  // any node, may then reach the same levels.
  auto high_priority = [&](const Chain& chain, size_t first) {
    return Mix(chain.seed * 31 + first) % 8 == 0;
  };
  auto max_level = [&](const Chain& chain, size_t j) -> uint8_t {
    if (chain.ns == 1 && (j + 1) * tokens < kMinSeqLen) return 0;
    return high_priority(chain, j / kBatch * kBatch)
               ? std::min(kHighMaxLevel[chain.ns], oracle->num_levels())
               : oracle->num_levels();
  };
  std::mt19937_64 rng(id);
  std::vector<std::vector<std::byte>> data(kBatch, std::vector<std::byte>(oracle->block_bytes()));
  std::vector<std::span<std::byte>> out(data.begin(), data.end());
  while (!stop->load() && budget->fetch_sub(1) > 0) {
    Chain& chain = chains[rng() % chains.size()];
    const size_t first = rng() % (chain_blocks / kBatch) * kBatch;
    const std::vector<BlockKey> keys = client::TestKeyChain(chain.seed, first, kBatch);
    const int pick = static_cast<int>(rng() % 100);
    const Op op = pick < 25   ? kPut
                  : pick < 45 ? kGet
                  : pick < 60 ? kDecompress
                  : pick < 75 ? kGetStored
                  : pick < 95 ? kLookup
                              : kDelete;
    // A chain's puts go through its own node, as a worker puts through its node's daemon; the
    // other requests through any node, as workers elsewhere sharing the prefix would.
    const size_t node = rng() % targets.size();
    Client& c = *conns[node][chain.ns];
    const Profile& profile = profiles[node][chain.ns][chain.model];
    auto where = [&](size_t j, uint32_t level) {
      return absl::StrCat(kOpNames[op], " through node ", node, ": namespace ",
                          kNamespaces[chain.ns], ", model ", chain.model, ", chain ", chain.seed,
                          ", block ", j, " (generation ", chain.blocks[j].generation, ", content ",
                          content(chain, j), ", max level ", int(max_level(chain, j)), "), level ",
                          level);
    };
    // A block found after its delete: wrong on one node, counted in a cluster.
    auto found_deleted = [&](const std::string& what) {
      if (cluster) {
        rec->FoundAfterDelete(op != kLookup);
      } else {
        rec->WrongBytes(what);
      }
    };
    // A hit must be a block this client stored (and, on one node, did not delete since), with
    // bytes the oracle says it may have.
    auto check = [&](size_t j, absl::StatusOr<bool> matches, uint32_t level) {
      if (!matches.ok()) {
        rec->Error(matches.status());
        return;
      }
      if (!*matches) {
        rec->WrongBytes(absl::StrCat("bytes the codec does not give: ", where(j, level)));
      }
      if (!chain.blocks[j].maybe_stored) {
        found_deleted(absl::StrCat("a deleted block came back: ", where(j, level)));
      }
    };
    const Clock::time_point start = Clock::now();
    absl::Status status;
    switch (op) {
      case kPut: {
        std::vector<std::span<const std::byte>> in;
        std::vector<int64_t> positions;
        for (size_t i = 0; i < kBatch; ++i) {
          oracle->Fill(content(chain, first + i), data[i]);
          in.push_back(data[i]);
          positions.push_back(static_cast<int64_t>(first + i));
        }
        client::PutOptions options;
        options.positions = positions;
        options.high_priority = high_priority(chain, first);
        absl::StatusOr<std::vector<client::PutOutcome>> r = c.Put(profile, keys, in, options);
        status = r.status();
        for (size_t i = 0; i < kBatch; ++i) {
          // A put that failed (its node went down under it) may have stored the block all the
          // same.
          if (!r.ok() || (*r)[i] != client::PutOutcome::kNoSpace) {
            chain.blocks[first + i].maybe_stored = true;
          }
        }
        break;
      }
      case kGet:
      case kDecompress: {
        absl::StatusOr<std::vector<bool>> r =
            op == kGet ? c.Get(profile, keys, out) : c.Decompress(profile, keys, out);
        status = r.status();
        if (r.ok()) rec->Gets(kBatch, std::count(r->begin(), r->end(), true));
        for (size_t i = 0; r.ok() && i < kBatch; ++i) {
          if (!(*r)[i]) continue;
          const size_t j = first + i;
          check(j,
                oracle->IsDecoded(chain.model, content(chain, j), j == 0, max_level(chain, j),
                                  data[i]),
                0);
        }
        break;
      }
      case kGetStored: {
        absl::StatusOr<std::vector<std::optional<client::StoredBlock>>> r =
            c.GetStored(profile, keys);
        status = r.status();
        if (r.ok()) {
          rec->Gets(kBatch, std::count_if(r->begin(), r->end(),
                                          [](const auto& b) { return b.has_value(); }));
        }
        for (size_t i = 0; r.ok() && i < kBatch; ++i) {
          if (!(*r)[i].has_value()) continue;
          const size_t j = first + i;
          const client::StoredBlock& got = *(*r)[i];
          absl::StatusOr<bool> matches = oracle->IsStored(
              chain.model, content(chain, j), j == 0, max_level(chain, j), got.level,
              std::as_bytes(std::span(got.bytes.data(), got.bytes.size())));
          if (matches.ok() && *matches) rec->StoredAt(got.level);
          check(j, matches, got.level);
        }
        break;
      }
      case kLookup: {
        absl::StatusOr<size_t> r =
            c.Lookup(profile, client::TestKeyChain(chain.seed, 0, chain_blocks));
        status = r.status();
        for (size_t j = 0; r.ok() && j < *r; ++j) {
          if (!chain.blocks[j].maybe_stored) {
            found_deleted(absl::StrCat("a lookup counted a deleted block: ", where(j, 0)));
            break;
          }
        }
        break;
      }
      case kDelete: {
        status = c.Delete(profile, keys).status();
        for (size_t i = 0; status.ok() && i < kBatch; ++i) {
          if (!cluster) ++chain.blocks[first + i].generation;
          chain.blocks[first + i].maybe_stored = false;
        }
        break;
      }
      case kNumOps:
        break;
    }
    Clock::duration after_up;
    if (outages != nullptr && absl::IsUnavailable(status) &&
        outages->Met(node, start, Clock::now(), &after_up)) {
      rec->Unavailable(after_up);
      continue;
    }
    Recorded(rec, op, start, status);
  }
  for (const auto& node : conns) {
    for (const std::unique_ptr<Client>& c : node) rec->ClientCrcFailures(c->crc_failures());
  }
}

int Main() {
  const int duration_s = absl::GetFlag(FLAGS_duration_s);
  const int report_s = std::max(1, absl::GetFlag(FLAGS_report_s));
  const int warmup_s = std::min(absl::GetFlag(FLAGS_warmup_s), duration_s / 2);
  const uint64_t capacity = absl::GetFlag(FLAGS_capacity_bytes);
  std::vector<std::string> sets = absl::GetFlag(FLAGS_set);  // every node's; each has its own
                                                             // capacity besides
  // --levels: real KV blocks, checked against what the codec makes of them.
  const std::vector<std::string> levels =
      absl::StrSplit(absl::GetFlag(FLAGS_levels), ';', absl::SkipWhitespace());
  std::unique_ptr<testing::CodecOracle> oracle;
  if (!levels.empty()) {
    absl::StatusOr<std::unique_ptr<testing::CodecOracle>> o = testing::CodecOracle::Create(
        absl::GetFlag(FLAGS_kv_file), levels, 16, absl::GetFlag(FLAGS_contents));
    if (!o.ok()) {
      std::fprintf(stderr, "cannot build the codec oracle: %s\n", o.status().ToString().c_str());
      return 2;
    }
    oracle = *std::move(o);
    sets.push_back(NamespacesConfig(levels));
  }
  const int num_ops = oracle ? kNumOps : kPlainOps;
  const int nodes = std::max(1, absl::GetFlag(FLAGS_nodes));
  if (nodes > 1 && !oracle) {
    std::fprintf(stderr, "--nodes=%d needs --levels (a cluster soak checks real KV blocks)\n",
                 nodes);
    return 2;
  }
  const bool snapshot = absl::GetFlag(FLAGS_snapshot);
  if (snapshot && (nodes > 1 || !oracle)) {
    std::fprintf(stderr,
                 "--snapshot needs --nodes=1 and --levels (a cluster hands its blocks "
                 "off instead)\n");
    return 2;
  }
  std::string snapshot_dir;
  if (snapshot) {
    char tmpl[] = "/tmp/proxima-soak-snapshot-XXXXXX";
    snapshot_dir = mkdtemp(tmpl);
    sets.push_back("tiers.host.snapshot_file=" + snapshot_dir + "/snapshot");
  }
  std::vector<std::unique_ptr<testing::DaemonProcess>> daemons;
  std::vector<std::string> targets;
  std::string cluster_dir;
  const std::vector<int> ports = nodes > 1 ? testing::FreeLoopbackPorts(nodes) : std::vector<int>();
  if (nodes > 1) {
    char tmpl[] = "/tmp/proxima-soak-XXXXXX";
    cluster_dir = mkdtemp(tmpl);
    std::ofstream(cluster_dir + "/peer-token") << "soak-peer-token-0123456789abcdef\n";
  }
  for (int i = 0; i < nodes; ++i) {
    std::vector<std::string> node_sets = sets;
    node_sets.push_back(absl::StrCat("tiers.host.capacity_bytes=", capacity * (i + 1)));
    if (nodes > 1) {
      for (std::string& set :
           testing::ClusterSets(ports, i, cluster_dir + "/peer-token", absl::Seconds(2))) {
        node_sets.push_back(std::move(set));
      }
      node_sets.push_back("ucx.enabled=true");
    }
    absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> daemon =
        testing::DaemonProcess::Start(node_sets);
    if (!daemon.ok()) {
      std::fprintf(stderr, "cannot start proximad: %s\n", daemon.status().ToString().c_str());
      return 2;
    }
    targets.push_back((*daemon)->tcp_target());
    daemons.push_back(*std::move(daemon));
  }
  // Whether every node sees every node live within `timeout`.
  auto all_live = [&](absl::Duration timeout) {
    if (nodes == 1) return true;  // no cluster; a (re)started daemon serves (DaemonProcess)
    const absl::Time give_up = absl::Now() + timeout;
    for (const auto& d : daemons) {
      while (true) {
        absl::StatusOr<std::string> m = d->ScrapeMetrics();
        if (m.ok() && testing::MetricValue(*m, "proxima_cluster_live_nodes") == nodes) break;
        if (absl::Now() > give_up) return false;
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    return true;
  };
  // A cluster's traffic starts once every node sees every node live: before, its lookups and
  // gets would miss what other nodes hold.
  if (nodes > 1 && !all_live(absl::Seconds(30))) {
    std::fprintf(stderr, "the %d daemons did not all see each other live within 30 s\n", nodes);
    return 2;
  }
  const int kill_every_s = absl::GetFlag(FLAGS_kill_every_s);
  const std::string kill_signal_name = absl::GetFlag(FLAGS_kill_signal);
  if (kill_signal_name != "KILL" && kill_signal_name != "TERM" && kill_signal_name != "STOP") {
    std::fprintf(stderr, "--kill_signal is '%s'; expected KILL, TERM or STOP\n",
                 kill_signal_name.c_str());
    return 2;
  }
  const int kill_signal = kill_signal_name == "TERM"   ? SIGTERM
                          : kill_signal_name == "STOP" ? SIGSTOP
                                                       : SIGKILL;
  if (kill_every_s > 0 && !oracle) {
    std::fprintf(stderr, "--kill_every_s needs --levels\n");
    return 2;
  }
  Outages outages(nodes, std::chrono::seconds(absl::GetFlag(FLAGS_reconnect_grace_s)));
  const v1::ModelProfile model = testing::TestModel();  // 256 KiB blocks
  std::atomic<bool> stop{false};
  const int64_t max_requests = absl::GetFlag(FLAGS_max_requests);
  std::atomic<int64_t> budget{max_requests > 0 ? max_requests : INT64_MAX};
  Recorder rec;
  std::vector<std::thread> clients;
  for (int i = 0; i < absl::GetFlag(FLAGS_clients); ++i) {
    if (oracle) {
      clients.emplace_back(RunCompressedClient, i, targets, oracle.get(),
                           kill_every_s > 0 ? &outages : nullptr, &stop, &budget, &rec);
    } else {
      clients.emplace_back(RunClient, i, targets[0], model, &stop, &budget, &rec);
    }
  }
  // Node loss (--kill_every_s): a node other than node 0, killed mid-traffic, started again
  // (empty) --down_s later; its outage lasts until every node sees it live again.
  std::atomic<bool> stop_killing{false};
  int kills = 0;
  uint64_t handed_off = 0;   // blocks the TERMed nodes handed to their peers
  uint64_t left_behind = 0;  // and those they could not
  uint64_t deleted_on_peers = 0;            // and those a peer had seen deleted (dropped)
  std::map<std::string, int> handoff_ends;  // why each hand-off stopped -> how many times
  int64_t slowest_rejoin_ms = 0;
  uint64_t snapshot_written = 0;  // --snapshot: blocks the stops wrote
  uint64_t snapshot_loaded = 0;   // and the restarts loaded
  std::string kill_failure;  // set by the killer; read after it is joined
  std::thread killer;
  if (kill_every_s > 0) {
    killer = std::thread([&] {
      std::mt19937_64 rng(7);
      auto sleep_unless_stopped = [&](int seconds) {
        const Clock::time_point until = Clock::now() + std::chrono::seconds(seconds);
        while (Clock::now() < until && !stop_killing.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return !stop_killing.load();
      };
      while (sleep_unless_stopped(kill_every_s)) {
        const size_t victim = nodes > 1 ? 1 + rng() % (nodes - 1) : 0;
        outages.Down(victim);
        daemons[victim]->Signal(kill_signal);
        // A TERM drains (server.shutdown_grace_seconds) and hands off (cluster.spill.handoff).
        if (kill_signal != SIGSTOP) {
          daemons[victim]->WaitExit(absl::Seconds(kill_signal == SIGTERM ? 60 : 10));
        }
        if (kill_signal == SIGTERM) {  // what its hand-off moved, from its last log line of it
          const std::string log = daemons[victim]->Log();
          constexpr char kLine[] = "handed blocks off to peers before exit";
          auto count = [&](const char* key) {
            const std::optional<std::string> v = testing::LogValue(log, kLine, key);
            return v ? std::strtoull(v->c_str(), nullptr, 10) : 0;
          };
          if (log.find(kLine) != std::string::npos) {
            handed_off += count("blocks");
            left_behind += count("left_blocks");
            deleted_on_peers += count("deleted_blocks");
            if (std::optional<std::string> ended = testing::LogValue(log, kLine, "ended")) {
              ++handoff_ends[*ended];
            }
          }
        }
        sleep_unless_stopped(absl::GetFlag(FLAGS_down_s));
        const Clock::time_point restart = Clock::now();
        // A stopped node runs on where it was, with its blocks and its (now late) view of the
        // cluster; a killed one starts again, empty.
        absl::Status started = absl::OkStatus();
        if (kill_signal == SIGSTOP) {
          daemons[victim]->Signal(SIGCONT);
        } else {
          started = daemons[victim]->Restart();
        }
        const bool live = started.ok() && all_live(absl::Seconds(30));
        outages.Up(victim);
        if (live && snapshot && kill_signal == SIGTERM) {
          // Every block the stop wrote came back, and no record was refused.
          const std::string log = daemons[victim]->Log();
          auto value = [&](const char* line, const char* key) {
            return testing::LogValue(log, line, key).value_or("(none)");
          };
          constexpr char kWrote[] = "wrote the blocks to the snapshot for the next start";
          constexpr char kLoaded[] = "loaded the blocks of the snapshot the last run wrote";
          const std::string wrote = value(kWrote, "blocks");
          const std::string loaded = value(kLoaded, "blocks");
          if (wrote != loaded || value(kLoaded, "skipped") != "0" ||
              value(kLoaded, "complete") != "1") {
            kill_failure =
                absl::StrCat("restart ", kills + 1, ": the stop wrote ", wrote,
                             " blocks; the start loaded ", loaded, ", skipped ",
                             value(kLoaded, "skipped"), ", complete ", value(kLoaded, "complete"));
            return;
          }
          snapshot_written += std::strtoull(wrote.c_str(), nullptr, 10);
          snapshot_loaded += std::strtoull(loaded.c_str(), nullptr, 10);
        }
        if (!live) {
          kill_failure = started.ok() ? absl::StrCat("node ", victim,
                                                     " was not live on every node within 30 s "
                                                     "of its restart")
                                      : started.ToString();
          for (size_t i = 0; i < daemons.size(); ++i) {
            const std::string log = daemons[i]->Log();
            std::fprintf(stderr, "node %zu's log, last 6 KiB:\n%s\n", i,
                         log.substr(log.size() > 6144 ? log.size() - 6144 : 0).c_str());
          }
          return;
        }
        ++kills;
        slowest_rejoin_ms = std::max<int64_t>(
            slowest_rejoin_ms,
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - restart).count());
      }
    });
  }
  // The daemons' RSS together (with --kill_every_s, node 0's alone: the others restart; none
  // when node 0 restarts too); an error when one is gone.
  const size_t watched = kill_every_s == 0 ? daemons.size() : nodes > 1 ? 1 : 0;
  auto resident = [&]() -> absl::StatusOr<uint64_t> {
    uint64_t sum = 0;
    for (size_t i = 0; i < watched; ++i) {
      const auto& d = daemons[i];
      absl::StatusOr<uint64_t> rss = d->ResidentBytes();
      if (!rss.ok()) return rss.status();
      sum += *rss;
    }
    return sum;
  };

  const Clock::time_point start = Clock::now();
  uint64_t total_ops = 0, total_errors = 0, total_wrong = 0;
  uint64_t rss_after_warmup = 0, rss_last = 0, rss_max = 0;
  std::vector<double> all_ms[kNumOps];
  std::string first_error, first_wrong;
  for (int t = report_s; t <= duration_s && budget.load() > 0; t += report_s) {
    uint64_t interval_rss = 0;
    while (Clock::now() < start + std::chrono::seconds(t) && budget.load() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      absl::StatusOr<uint64_t> rss = resident();
      if (!rss.ok()) {
        std::fprintf(stderr, "proximad is gone: %s\n", rss.status().ToString().c_str());
        stop.store(true);
        stop_killing.store(true);
        for (auto& c : clients) c.join();
        if (killer.joinable()) killer.join();
        return 1;
      }
      interval_rss = std::max(interval_rss, *rss);
    }
    Interval iv = rec.Take();
    std::string line = absl::StrCat("{\"bench\":\"soak\",\"t_s\":", t);
    uint64_t ops = 0;
    for (int op = 0; op < num_ops; ++op) {
      std::vector<double>& ms = iv.latency_ms[op];
      ops += ms.size();
      absl::StrAppend(&line, ",\"", kOpNames[op], "_per_s\":",
                      static_cast<double>(ms.size()) / report_s, ",\"", kOpNames[op],
                      "_p50_ms\":", Percentile(ms, 0.5), ",\"", kOpNames[op],
                      "_p99_ms\":", Percentile(ms, 0.99));
      all_ms[op].insert(all_ms[op].end(), ms.begin(), ms.end());
    }
    absl::StrAppend(&line, ",\"rss_mib\":", interval_rss >> 20, ",\"errors\":", iv.errors,
                    ",\"wrong_bytes\":", iv.wrong_bytes, "}");
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    if (first_error.empty()) first_error = iv.first_error;
    if (first_wrong.empty()) first_wrong = iv.first_wrong;
    total_ops += ops;
    total_errors += iv.errors;
    total_wrong += iv.wrong_bytes;
    if (t > warmup_s && rss_after_warmup == 0) rss_after_warmup = interval_rss;
    rss_last = interval_rss;
    rss_max = std::max(rss_max, interval_rss);
  }
  stop.store(true);
  stop_killing.store(true);
  for (auto& c : clients) c.join();
  if (killer.joinable()) killer.join();
  // After node loss, every node must see every node live again (the last one restarted too).
  const bool rejoined = kill_every_s == 0 || (kill_failure.empty() && all_live(absl::Seconds(30)));

  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t growth_mib =
      (static_cast<int64_t>(rss_last) - static_cast<int64_t>(rss_after_warmup)) >> 20;
  // A compressed soak checks something only when its reads met every level: each must be among
  // the GetStored answers the oracle confirmed.
  std::vector<uint64_t> stored_levels = rec.stored_levels();
  bool every_level = true;
  if (oracle) {
    stored_levels.resize(oracle->num_levels() + 1);
    for (uint64_t n : stored_levels) every_level = every_level && n > 0;
  }
  const bool rss_flat =
      watched == 0 || (rss_after_warmup > 0 && growth_mib <= absl::GetFlag(FLAGS_rss_growth_mib));
  const uint64_t client_crc_failures = rec.client_crc_failures();
  const bool pass = total_errors == 0 && total_wrong == 0 && client_crc_failures == 0 && rss_flat &&
                    total_ops > 0 && every_level && rejoined && (kill_every_s == 0 || kills > 0);
  std::string summary =
      absl::StrCat("{\"bench\":\"soak\",\"summary\":true,\"seconds\":", elapsed,
                   ",\"clients\":", absl::GetFlag(FLAGS_clients), ",\"requests\":", total_ops,
                   ",\"requests_per_s\":", total_ops / elapsed);
  if (oracle) {
    absl::StrAppend(&summary, ",\"levels\":\"", absl::GetFlag(FLAGS_levels),
                    "\",\"stored_answers_per_level\":[", absl::StrJoin(stored_levels, ","),
                    "],\"oracle_encodings\":", oracle->encodings());
    // What the quality guard did in each namespace: its deepest level at the end on node 0
    // (reported, not checked: the oracle holds whatever the guard did); in a cluster, what moved
    // between the nodes, summed over them.
    std::vector<absl::StatusOr<std::string>> metrics;
    for (const auto& d : daemons) metrics.push_back(d->ScrapeMetrics());
    auto metric = [&](const std::string& series, size_t from, size_t to) {
      double sum = 0;
      for (size_t i = from; i < to; ++i) {
        sum += metrics[i].ok() ? testing::MetricValue(*metrics[i], series) : -1;
      }
      return sum;
    };
    for (const char* ns : kNamespaces) {
      absl::StrAppend(
          &summary, ",\"level_cap_", ns, "\":",
          metric(absl::StrCat("proxima_compression_level_cap{namespace=\"", ns, "\"}"), 0, 1));
    }
    if (nodes > 1) {
      absl::StrAppend(
          &summary, ",\"nodes\":", nodes, ",\"spilled_blocks_kept\":",
          metric("proxima_cluster_spill_received_blocks_total{outcome=\"kept\"}", 0, nodes),
          ",\"spilled_blocks_withdrawn\":",
          metric("proxima_cluster_spill_withdrawn_blocks_total", 0, nodes),
          ",\"remote_get_hits\":", metric("proxima_cluster_remote_get_hits_total", 0, nodes),
          ",\"peer_call_failures\":", metric("proxima_cluster_peer_call_failures_total", 0, nodes),
          ",\"peer_calls_skipped\":", metric("proxima_cluster_peer_calls_skipped_total", 0, nodes),
          ",\"read_after_delete\":", rec.found_after_delete(true),
          ",\"counted_by_lookup_after_delete\":", rec.found_after_delete(false));
    }
    if (kill_every_s > 0) {
      absl::StrAppend(&summary, ",\"kills\":", kills, ",\"kill_signal\":\"", kill_signal_name,
                      "\",\"handed_off_blocks\":", handed_off,
                      ",\"left_behind_blocks\":", left_behind,
                      ",\"deleted_on_peer_blocks\":", deleted_on_peers, ",\"handoff_ends\":{",
                      absl::StrJoin(handoff_ends, ",",
                                    [](std::string* out, const auto& end) {
                                      absl::StrAppend(out, "\"", end.first, "\":", end.second);
                                    }),
                      "}", ",\"slowest_rejoin_ms\":", slowest_rejoin_ms,
                      ",\"unavailable_while_down\":", rec.unavailable(),
                      ",\"unavailable_after_up_ms\":", rec.unavailable_after_up_ms(),
                      ",\"rejoined\":", rejoined ? "true" : "false");
      if (snapshot) {
        absl::StrAppend(&summary, ",\"snapshot_written_blocks\":", snapshot_written,
                        ",\"snapshot_loaded_blocks\":", snapshot_loaded);
      }
    }
  }
  for (int op = 0; op < num_ops; ++op) {
    absl::StrAppend(&summary, ",\"", kOpNames[op], "_p99_ms\":", Percentile(all_ms[op], 0.99));
  }
  absl::StrAppend(
      &summary, ",\"get_hit_ratio\":", rec.get_hit_ratio(), ",\"capacity_mib\":", capacity >> 20,
      ",\"rss_after_warmup_mib\":", rss_after_warmup >> 20, ",\"rss_end_mib\":", rss_last >> 20,
      ",\"rss_max_mib\":", rss_max >> 20, ",\"rss_growth_mib\":", growth_mib,
      ",\"rss_checked\":", watched > 0 ? "true" : "false", ",\"errors\":", total_errors,
      ",\"wrong_bytes\":", total_wrong, ",\"client_crc_failures\":", client_crc_failures,
      ",\"verdict\":\"", pass ? "pass" : "fail", "\"}");
  std::printf("%s\n", summary.c_str());
  if (!first_error.empty()) std::fprintf(stderr, "first error: %s\n", first_error.c_str());
  if (!first_wrong.empty()) std::fprintf(stderr, "first wrong answer: %s\n", first_wrong.c_str());
  if (!kill_failure.empty()) std::fprintf(stderr, "node loss: %s\n", kill_failure.c_str());
  if (client_crc_failures > 0) {
    std::fprintf(stderr,
                 "clients received %llu blocks whose bytes failed their CRC32C twice (reported "
                 "to them as misses); on loopback the daemon sent those bytes\n",
                 static_cast<unsigned long long>(client_crc_failures));
  }
  if (kill_every_s > 0 && kills == 0) {
    std::fprintf(stderr, "no node was killed: give --duration_s more than --kill_every_s\n");
  }
  if (!cluster_dir.empty()) std::filesystem::remove_all(cluster_dir);
  if (!snapshot_dir.empty()) std::filesystem::remove_all(snapshot_dir);
  if (!every_level) {
    std::fprintf(stderr,
                 "no stored answer at some level (per level: %s): the soak did not "
                 "exercise the hierarchy; give it less capacity or more time\n",
                 absl::StrJoin(stored_levels, ",").c_str());
  }
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace proxima

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return proxima::Main();
}
