#include "daemon/metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace proxima::metrics {
namespace log = ::proxima::log;
namespace {

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string RenderLabels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, labels[i].first, "=\"", EscapeLabelValue(labels[i].second), "\"");
  }
  return out + "}";
}

std::string FormatDouble(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  // Shortest form that reads back to the same double.
  char buf[32];
  for (int precision : {15, 17}) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// Adds `extra` (e.g. le="0.5") to a rendered label set.
std::string WithLabel(const std::string& labels, const std::string& extra) {
  if (labels.empty()) return "{" + extra + "}";
  return labels.substr(0, labels.size() - 1) + "," + extra + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  if (value > 0) {
    sum_micro_.fetch_add(static_cast<uint64_t>(value * 1e6), std::memory_order_relaxed);
  }
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.upper_bounds = bounds_;
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative_counts.push_back(running);
  }
  s.count = running;
  s.sum = static_cast<double>(sum_micro_.load(std::memory_order_relaxed)) / 1e6;
  return s;
}

std::vector<double> LatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
          25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,  2.5,    10.0};
}

Registry::Series* Registry::FindOrAdd(const std::string& name, const std::string& help, Type type,
                                      const Labels& labels, bool* created) {
  Family& family = families_[name];
  if (family.series.empty()) {
    family.type = type;
    family.help = help;
  } else if (family.type != type) {
    // Programming error: one name registered with two types. Fail loudly at start-up.
    PROXIMA_LOG(kError) << "metric registered with two types" << log::Kv("name", name);
    std::abort();
  }
  std::string rendered = RenderLabels(labels);
  for (auto& s : family.series) {
    if (s->labels == rendered) {
      *created = false;
      return s.get();
    }
  }
  family.series.push_back(std::make_unique<Series>());
  family.series.back()->labels = rendered;
  *created = true;
  return family.series.back().get();
}

Counter* TransferBytes(Registry* registry, const std::string& transport,
                       const std::string& direction) {
  return registry->AddCounter("proxima_transfer_bytes_total",
                              "Block bytes moved, by transport and direction",
                              {{"transport", transport}, {"direction", direction}});
}

Counter* Registry::AddCounter(const std::string& name, const std::string& help,
                              const Labels& labels) {
  proxima::MutexLock lock(&mu_);
  bool created = false;
  Series* s = FindOrAdd(name, help, Type::kCounter, labels, &created);
  if (created) s->counter = std::make_unique<Counter>();
  return s->counter.get();
}

Histogram* Registry::AddHistogram(const std::string& name, const std::string& help,
                                  const Labels& labels, std::vector<double> upper_bounds) {
  proxima::MutexLock lock(&mu_);
  bool created = false;
  Series* s = FindOrAdd(name, help, Type::kHistogram, labels, &created);
  if (created) s->histogram = std::make_unique<Histogram>(std::move(upper_bounds));
  return s->histogram.get();
}

void Registry::AddGauge(const std::string& name, const std::string& help, const Labels& labels,
                        std::function<double()> read) {
  proxima::MutexLock lock(&mu_);
  bool created = false;
  Series* s = FindOrAdd(name, help, Type::kGauge, labels, &created);
  s->read = std::move(read);
}

void Registry::AddCounterFunction(const std::string& name, const std::string& help,
                                  const Labels& labels, std::function<double()> read) {
  proxima::MutexLock lock(&mu_);
  bool created = false;
  Series* s = FindOrAdd(name, help, Type::kCounter, labels, &created);
  s->read = std::move(read);
}

std::string Registry::RenderText() const {
  proxima::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, family] : families_) {
    const char* type = family.type == Type::kCounter   ? "counter"
                       : family.type == Type::kGauge ? "gauge"
                                                     : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", family.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& s : family.series) {
      switch (family.type) {
        case Type::kCounter:
          if (s->counter) {
            absl::StrAppend(&out, name, s->labels, " ", s->counter->value(), "\n");
          } else {
            absl::StrAppend(&out, name, s->labels, " ", FormatDouble(s->read()), "\n");
          }
          break;
        case Type::kGauge:
          absl::StrAppend(&out, name, s->labels, " ", FormatDouble(s->read()), "\n");
          break;
        case Type::kHistogram: {
          Histogram::Snapshot h = s->histogram->Read();
          for (size_t i = 0; i <= h.upper_bounds.size(); ++i) {
            std::string le = i < h.upper_bounds.size() ? FormatDouble(h.upper_bounds[i]) : "+Inf";
            absl::StrAppend(&out, name, "_bucket", WithLabel(s->labels, "le=\"" + le + "\""), " ",
                            h.cumulative_counts[i], "\n");
          }
          absl::StrAppend(&out, name, "_sum", s->labels, " ", FormatDouble(h.sum), "\n");
          absl::StrAppend(&out, name, "_count", s->labels, " ", h.count, "\n");
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace proxima::metrics
