// proxima_soak: a bounded soak of a real proximad on loopback. Starts the daemon (the built
// binary, default config plus --set overrides), then runs --clients clients, each with its own
// connection, doing a mix of put / get / lookup / delete on its own chains of test blocks for
// --duration_s seconds (or until --max_requests), checking every byte that comes back.
//
// Every --report_s seconds it prints one JSON line: throughput per operation, p50/p99 latency,
// the daemon's RSS, errors and wrong bytes in that interval. At the end, one summary line and
// the verdict: errors and wrong bytes must be zero, and RSS must be flat after warm-up (the
// largest RSS of the last interval at most --rss_growth_mib above the largest RSS of the first
// interval after warm-up). Exit status 0 only when the verdict is "pass".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/mutex.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_blocks.h"

ABSL_FLAG(int, duration_s, 600, "seconds to run");
ABSL_FLAG(int64_t, max_requests, 0, "stop after this many requests in all (0: no limit)");
ABSL_FLAG(int, clients, 8, "concurrent clients, one connection each");
ABSL_FLAG(int, report_s, 10, "seconds per reported interval");
ABSL_FLAG(int, warmup_s, 60, "seconds of warm-up before RSS must stay flat");
ABSL_FLAG(int, rss_growth_mib, 32, "largest RSS growth after warm-up that still passes");
ABSL_FLAG(uint64_t, capacity_bytes, 256ull << 20, "host tier capacity of the daemon");
ABSL_FLAG(int, chain_blocks, 64, "blocks per client chain (a client cycles over 8 chains)");

namespace proxima {
namespace {

using client::BlockKey;
using client::Client;
using client::Profile;
using Clock = std::chrono::steady_clock;

enum Op { kPut, kGet, kLookup, kDelete, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"put", "get", "lookup", "delete"};

// Latencies and counts of one interval, merged from all clients.
struct Interval {
  std::vector<double> latency_ms[kNumOps];
  uint64_t errors = 0;
  uint64_t wrong_bytes = 0;
  std::string first_error;
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
  void WrongBytes() {
    proxima::MutexLock lock(&mu_);
    ++current_.wrong_bytes;
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
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, static_cast<size_t>(q * v.size()));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
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
      case kNumOps:
        break;
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!status.ok()) {
      rec->Error(status);
      continue;
    }
    rec->Record(op, ms);
    for (size_t i = 0; i < found.size(); ++i) {
      if (found[i] && !client::IsTestBlock(seed, first + i, data[i])) rec->WrongBytes();
    }
  }
}

int Main() {
  const int duration_s = absl::GetFlag(FLAGS_duration_s);
  const int report_s = std::max(1, absl::GetFlag(FLAGS_report_s));
  const int warmup_s = std::min(absl::GetFlag(FLAGS_warmup_s), duration_s / 2);
  const uint64_t capacity = absl::GetFlag(FLAGS_capacity_bytes);
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> daemon = testing::DaemonProcess::Start(
      {absl::StrCat("tiers.host.capacity_bytes=", capacity)});
  if (!daemon.ok()) {
    std::fprintf(stderr, "cannot start proximad: %s\n", daemon.status().ToString().c_str());
    return 2;
  }
  const v1::ModelProfile model = testing::TestModel();  // 256 KiB blocks
  std::atomic<bool> stop{false};
  const int64_t max_requests = absl::GetFlag(FLAGS_max_requests);
  std::atomic<int64_t> budget{max_requests > 0 ? max_requests : INT64_MAX};
  Recorder rec;
  std::vector<std::thread> clients;
  for (int i = 0; i < absl::GetFlag(FLAGS_clients); ++i) {
    clients.emplace_back(RunClient, i, (*daemon)->tcp_target(), model, &stop, &budget, &rec);
  }

  const Clock::time_point start = Clock::now();
  uint64_t total_ops = 0, total_errors = 0, total_wrong = 0;
  uint64_t rss_after_warmup = 0, rss_last = 0, rss_max = 0;
  std::vector<double> all_ms[kNumOps];
  std::string first_error;
  for (int t = report_s; t <= duration_s && budget.load() > 0; t += report_s) {
    uint64_t interval_rss = 0;
    while (Clock::now() < start + std::chrono::seconds(t) && budget.load() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      absl::StatusOr<uint64_t> rss = (*daemon)->ResidentBytes();
      if (!rss.ok()) {
        std::fprintf(stderr, "proximad is gone: %s\n", rss.status().ToString().c_str());
        stop.store(true);
        for (auto& c : clients) c.join();
        return 1;
      }
      interval_rss = std::max(interval_rss, *rss);
    }
    Interval iv = rec.Take();
    std::string line = absl::StrCat("{\"bench\":\"soak\",\"t_s\":", t);
    uint64_t ops = 0;
    for (int op = 0; op < kNumOps; ++op) {
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
    total_ops += ops;
    total_errors += iv.errors;
    total_wrong += iv.wrong_bytes;
    if (t > warmup_s && rss_after_warmup == 0) rss_after_warmup = interval_rss;
    rss_last = interval_rss;
    rss_max = std::max(rss_max, interval_rss);
  }
  stop.store(true);
  for (auto& c : clients) c.join();

  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t growth_mib =
      (static_cast<int64_t>(rss_last) - static_cast<int64_t>(rss_after_warmup)) >> 20;
  const bool pass = total_errors == 0 && total_wrong == 0 && rss_after_warmup > 0 &&
                    growth_mib <= absl::GetFlag(FLAGS_rss_growth_mib) && total_ops > 0;
  std::string summary =
      absl::StrCat("{\"bench\":\"soak\",\"summary\":true,\"seconds\":", elapsed,
                   ",\"clients\":", absl::GetFlag(FLAGS_clients), ",\"requests\":", total_ops,
                   ",\"requests_per_s\":", total_ops / elapsed);
  for (int op = 0; op < kNumOps; ++op) {
    absl::StrAppend(&summary, ",\"", kOpNames[op], "_p99_ms\":", Percentile(all_ms[op], 0.99));
  }
  absl::StrAppend(&summary, ",\"capacity_mib\":", capacity >> 20,
                  ",\"rss_after_warmup_mib\":", rss_after_warmup >> 20,
                  ",\"rss_end_mib\":", rss_last >> 20, ",\"rss_max_mib\":", rss_max >> 20,
                  ",\"rss_growth_mib\":", growth_mib, ",\"errors\":", total_errors,
                  ",\"wrong_bytes\":", total_wrong, ",\"verdict\":\"", pass ? "pass" : "fail",
                  "\"}");
  std::printf("%s\n", summary.c_str());
  if (!first_error.empty()) std::fprintf(stderr, "first error: %s\n", first_error.c_str());
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace proxima

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return proxima::Main();
}
