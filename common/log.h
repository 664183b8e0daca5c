// Structured logging for Proxima binaries: one line per event, logfmt-style key=value pairs.
//
//   PROXIMA_LOG(kInfo) << "listening" << proxima::log::Kv("address", addr);
// prints
//   2026-11-29T10:20:15.123Z INFO daemon/server.cc:42 listening address=127.0.0.1:50051
//
// A line is written with one write(2) when the statement ends, so lines from concurrent threads
// never interleave. Thread-safe.
#ifndef PROXIMA_COMMON_LOG_H_
#define PROXIMA_COMMON_LOG_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace proxima::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below `level` are dropped. Default: kInfo.
void SetMinLevel(Level level);
Level MinLevel();

// Parses "debug" | "info" | "warning" | "error".
bool ParseLevel(std::string_view text, Level* level);

// A key=value pair; the value is quoted when it holds spaces, quotes or '='.
struct Kv {
  template <typename T>
  Kv(std::string_view key, const T& value) : key(key) {
    std::ostringstream os;
    os << value;
    this->value = os.str();
  }
  std::string_view key;
  std::string value;
};

// How many lines a Limiter held back before this one: written last, as held_back=N, when N > 0.
struct HeldBack {
  uint64_t lines = 0;
};

class Line {
 public:
  Line(Level level, const char* file, int line);
  ~Line();
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;

  Line& operator<<(const Kv& kv);
  Line& operator<<(HeldBack held) {
    held_back_ = held.lines;
    return *this;
  }
  template <typename T>
  Line& operator<<(const T& value) {
    if (enabled_) message_ << value;
    return *this;
  }

 private:
  bool enabled_;
  std::ostringstream message_;
  std::string fields_;
  std::string pending_kvs_;
  uint64_t held_back_ = 0;
};

// Lets one line through per `period` and counts those it holds back, for an event that a
// broken peer, client or disk can repeat on every call (a line per block would flood the log
// and cost the daemon its time). Thread-safe.
class Limiter {
 public:
  explicit Limiter(std::chrono::steady_clock::duration period);
  // True when a line may be written now; it then sets `held_back` to the number of lines held
  // back since the last one let through.
  bool Allow(HeldBack* held_back);

 private:
  const int64_t period_ns_;
  std::atomic<int64_t> next_ns_;
  std::atomic<uint64_t> held_{0};
};

}  // namespace proxima::log

#define PROXIMA_LOG(level) ::proxima::log::Line(::proxima::log::Level::level, __FILE__, __LINE__)

// PROXIMA_LOG through `limiter` (a log::Limiter): the line is written only when the limiter lets
// it through, and says how many it held back before it.
#define PROXIMA_LOG_LIMITED(level, limiter)                                               \
  if (::proxima::log::HeldBack proxima_log_held_; !(limiter).Allow(&proxima_log_held_)) { \
  } else                                                                                  \
    PROXIMA_LOG(level) << proxima_log_held_

// PROXIMA_LOG at most once per `period_s` seconds from this statement.
#define PROXIMA_LOG_EVERY(level, period_s)                                                 \
  PROXIMA_LOG_LIMITED(                                                                     \
      level, ([]() -> ::proxima::log::Limiter& {                                           \
        static ::proxima::log::Limiter proxima_log_every_{std::chrono::seconds(period_s)}; \
        return proxima_log_every_;                                                         \
      }()))

#endif  // PROXIMA_COMMON_LOG_H_
