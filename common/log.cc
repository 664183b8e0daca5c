#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <limits>

namespace proxima::log {
namespace {

std::atomic<int> g_min_level{static_cast<int>(Level::kInfo)};

const char* LevelName(Level level) {
  switch (level) {
    case Level::kDebug:
      return "DEBUG";
    case Level::kInfo:
      return "INFO";
    case Level::kWarning:
      return "WARN";
    case Level::kError:
      return "ERROR";
  }
  return "?";
}

std::string Timestamp() {
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm;
  gmtime_r(&secs, &tm);
  char buf[40];
  size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof(buf) - n, ".%03dZ", static_cast<int>(millis));
  return buf;
}

// Keeps only the path below the repository root: "/x/y/daemon/server.cc" -> "daemon/server.cc".
std::string_view ShortFile(const char* file) {
  std::string_view f(file);
  for (std::string_view root : {"common/", "daemon/", "client/", "kernels/", "tools/", "tests/",
                                "bench/"}) {
    size_t pos = f.rfind(root);
    if (pos != std::string_view::npos) return f.substr(pos);
  }
  size_t slash = f.rfind('/');
  return slash == std::string_view::npos ? f : f.substr(slash + 1);
}

std::string Quote(const std::string& value) {
  bool needs = value.empty() || value.find_first_of(" \"=\t\n") != std::string::npos;
  if (!needs) return value;
  std::string out = "\"";
  for (char c : value) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  out += '"';
  return out;
}

}  // namespace

void SetMinLevel(Level level) { g_min_level.store(static_cast<int>(level)); }
Level MinLevel() { return static_cast<Level>(g_min_level.load()); }

bool ParseLevel(std::string_view text, Level* level) {
  if (text == "debug") *level = Level::kDebug;
  else if (text == "info") *level = Level::kInfo;
  else if (text == "warning") *level = Level::kWarning;
  else if (text == "error") *level = Level::kError;
  else return false;
  return true;
}

Line::Line(Level level, const char* file, int line)
    : enabled_(static_cast<int>(level) >= g_min_level.load(std::memory_order_relaxed)) {
  if (!enabled_) return;
  fields_ = Timestamp();
  fields_ += ' ';
  fields_ += LevelName(level);
  fields_ += ' ';
  fields_ += ShortFile(file);
  fields_ += ':';
  fields_ += std::to_string(line);
  fields_ += ' ';
}

Line& Line::operator<<(const Kv& kv) {
  if (!enabled_) return *this;
  pending_kvs_ += ' ';
  pending_kvs_ += kv.key;
  pending_kvs_ += '=';
  pending_kvs_ += Quote(kv.value);
  return *this;
}

Line::~Line() {
  if (!enabled_) return;
  std::string out = fields_ + message_.str() + pending_kvs_;
  if (held_back_ > 0) out += " held_back=" + std::to_string(held_back_);
  out += '\n';
  size_t off = 0;
  while (off < out.size()) {
    ssize_t n = ::write(STDERR_FILENO, out.data() + off, out.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

Limiter::Limiter(std::chrono::steady_clock::duration period)
    : period_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(period).count()),
      next_ns_(std::numeric_limits<int64_t>::min()) {}

bool Limiter::Allow(HeldBack* held_back) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  if (now < next || !next_ns_.compare_exchange_strong(next, now + period_ns_)) {
    held_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  held_back->lines = held_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace proxima::log
