// The memory this process may use, and the start-time check of the host tier's capacity
// against it. tiers.host.capacity_bytes is reserved with MAP_NORESERVE and filled as blocks
// arrive, so a capacity larger than the machine or the container can give starts fine and is
// killed by the OOM killer once the tier fills, losing every block. The daemon refuses such a
// capacity at start instead (docs/configuration.md).
#ifndef PROXIMA_DAEMON_MEMORY_LIMIT_H_
#define PROXIMA_DAEMON_MEMORY_LIMIT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace proxima::daemon {

struct MemoryLimit {
  uint64_t bytes = 0;
  // Where the limit comes from, for messages: "physical memory (MemTotal in /proc/meminfo)",
  // "cgroup v2 memory.max of /kubepods/...", "cgroup v1 memory.limit_in_bytes of /...".
  std::string source;
};

// The smallest of the machine's physical memory and the memory limits of every cgroup this
// process is in, and of their ancestors (cgroup v2 memory.max, v1 memory.limit_in_bytes; "max"
// and v1's "no limit" value mean none). Files that are missing or unreadable impose nothing.
// `root` is prefixed to /proc and /sys (tests read a tree of their own; "" for the real system).
MemoryLimit ProcessMemoryLimit(const std::string& root = "");

// OK when `capacity_bytes` fits in `limit`; FAILED_PRECONDITION naming the key, the value, the
// limit and its source otherwise.
absl::Status CheckHostCapacity(uint64_t capacity_bytes, const MemoryLimit& limit);

// Memory proximad needs beside its host tier (block index, gRPC buffers, calls in flight):
// a capacity within this of the limit is started, with a warning.
inline constexpr uint64_t kMemoryHeadroomBytes = uint64_t{1} << 30;

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_MEMORY_LIMIT_H_
