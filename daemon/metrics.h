// Prometheus metrics for proximad: counters, histograms and scrape-time gauges in one registry,
// rendered in the Prometheus text exposition format (version 0.0.4).
//
// Debian 12 has no prometheus-cpp package, so this small registry stands in for it (see
// docs/decisions.md). Hot-path updates are lock-free atomics; the registry's mutex is taken only
// to create series and to render.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_METRICS_H_
#define PROXIMA_DAEMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace proxima::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Increment(uint64_t by = 1) { value_.fetch_add(by, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// Cumulative histogram with fixed upper bounds (plus +Inf).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> upper_bounds;
    std::vector<uint64_t> cumulative_counts;  // one per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_micro_{0};  // sum in millionths, to stay atomic without a lock
};

// Latency buckets in seconds, 50 us to 10 s.
std::vector<double> LatencyBuckets();

class Registry;
// The series of proxima_transfer_bytes_total: block bytes moved over `transport` ("grpc_inline",
// "ucx", "peer_grpc", "peer_ucx") in `direction` ("in": into this daemon, or "out").
Counter* TransferBytes(Registry* registry, const std::string& transport,
                       const std::string& direction);

class Registry {
 public:
  // Each Add* creates one series. Calling it again with the same name and labels returns the
  // existing series. Names follow Prometheus rules; counters end in "_total".
  Counter* AddCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* AddHistogram(const std::string& name, const std::string& help, const Labels& labels,
                          std::vector<double> upper_bounds);
  // A gauge whose value is read by `read` at each scrape.
  void AddGauge(const std::string& name, const std::string& help, const Labels& labels,
                std::function<double()> read);
  // A counter kept elsewhere (monotonic), read by `read` at each scrape.
  void AddCounterFunction(const std::string& name, const std::string& help, const Labels& labels,
                          std::function<double()> read);

  std::string RenderText() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Series {
    std::string labels;  // rendered: {a="x",b="y"} or empty
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Histogram> histogram;
    std::function<double()> read;  // gauges, and counters kept elsewhere
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<std::unique_ptr<Series>> series;
  };
  Series* FindOrAdd(const std::string& name, const std::string& help, Type type,
                    const Labels& labels, bool* created) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable proxima::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace proxima::metrics

#endif  // PROXIMA_DAEMON_METRICS_H_
