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

class Line {
 public:
  Line(Level level, const char* file, int line);
  ~Line();
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;

  Line& operator<<(const Kv& kv);
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
};

}  // namespace proxima::log

#define PROXIMA_LOG(level) ::proxima::log::Line(::proxima::log::Level::level, __FILE__, __LINE__)

#endif  // PROXIMA_COMMON_LOG_H_
