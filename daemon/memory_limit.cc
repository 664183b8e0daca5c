#include "daemon/memory_limit.h"

#include <unistd.h>

#include <fstream>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace proxima::daemon {
namespace {

// A cgroup v1 limit at or above this is the kernel's "no limit" (a page-rounded INT64_MAX).
constexpr uint64_t kV1Unlimited = uint64_t{1} << 62;

std::optional<std::string> ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// "max" (none) or a byte count; nullopt for anything else.
std::optional<uint64_t> ParseLimit(const std::string& text) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(text, &v)) return std::nullopt;
  return v;
}

// The cgroup and each of its ancestors: "/a/b" -> "/a/b", "/a", "/".
std::vector<std::string> SelfAndAncestors(std::string path) {
  std::vector<std::string> out;
  if (path.empty() || path[0] != '/') return out;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  for (;;) {
    out.push_back(path);
    if (path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return out;
}

void Lower(MemoryLimit* limit, uint64_t bytes, std::string source) {
  if (bytes < limit->bytes) *limit = MemoryLimit{bytes, std::move(source)};
}

uint64_t PhysicalMemory(const std::string& root, std::string* source) {
  std::ifstream in(root + "/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemTotal:") {
      *source = "physical memory (MemTotal in /proc/meminfo)";
      return kb * 1024;
    }
  }
  if (!root.empty()) return UINT64_MAX;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  *source = "physical memory (sysconf)";
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

// Lowers `limit` to the limit in `file` of the cgroup at `path` under `mount` and of each of its
// ancestors ("max", unreadable files and values at or above the v1 "no limit" impose nothing).
void LowerAlongPath(const std::string& mount, const std::string& path, const char* file,
                    const char* version, MemoryLimit* limit) {
  for (const std::string& dir : SelfAndAncestors(path)) {
    std::optional<std::string> text =
        ReadFirstLine(absl::StrCat(mount, dir == "/" ? "" : dir, "/", file));
    if (!text) continue;
    std::optional<uint64_t> v = ParseLimit(*text);
    if (v && *v < kV1Unlimited) {
      Lower(limit, *v, absl::StrCat(version, " ", file, " of ", dir));
    }
  }
}

}  // namespace

MemoryLimit ProcessMemoryLimit(const std::string& root) {
  MemoryLimit limit{UINT64_MAX, "no limit found"};
  std::string source;
  const uint64_t physical = PhysicalMemory(root, &source);
  if (physical != UINT64_MAX) limit = MemoryLimit{physical, source};

  std::ifstream cgroups(root + "/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    // "hierarchy-id:controllers:path"; v2 is "0::path".
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a);
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {
      for (const char* mount : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
        LowerAlongPath(root + mount, path, "memory.max", "cgroup v2", &limit);
      }
      continue;
    }
    bool memory = false;
    for (size_t start = 0; start <= controllers.size();) {
      size_t comma = controllers.find(',', start);
      if (comma == std::string::npos) comma = controllers.size();
      if (std::string_view(controllers).substr(start, comma - start) == "memory") memory = true;
      start = comma + 1;
    }
    if (memory) {
      LowerAlongPath(root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "cgroup v1",
                     &limit);
    }
  }
  return limit;
}

absl::Status CheckHostCapacity(uint64_t capacity_bytes, const MemoryLimit& limit) {
  if (capacity_bytes <= limit.bytes) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "tiers.host.capacity_bytes is %d bytes (%.1f GiB), but this process may use at most %d "
      "bytes (%.1f GiB: %s): the daemon would be killed for lack of memory once the tier fills; "
      "expected a capacity below that, leaving about 1 GiB for the rest of proximad",
      capacity_bytes, capacity_bytes / 1073741824.0, limit.bytes, limit.bytes / 1073741824.0,
      limit.source));
}

}  // namespace proxima::daemon
