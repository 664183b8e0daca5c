// The open-file limit (RLIMIT_NOFILE) of the daemon. Every client connection, UCX endpoint and
// cluster peer holds file descriptors, and gRPC 1.51's TCP listener stops accepting for good once
// an accept finds the limit reached (grpc/grpc#20418: it logs "Failed accept4: Too many open
// files" and never polls its socket again, so clients and peers on server.listen are refused until
// a restart; the Unix socket's own listener waits and retries). The soft limit is often 1024
// (systemd's default for services, containerd 2.0's for containers) under a hard limit of 512Ki
// or more, so proximad raises its soft limit to the hard limit at start, as Go's runtime does for
// every Go program, and warns when even that leaves little room (docs/operations.md).
#ifndef PROXIMA_DAEMON_FILE_LIMIT_H_
#define PROXIMA_DAEMON_FILE_LIMIT_H_

#include <cstdint>
#include <string>

namespace proxima::daemon {

struct FileLimit {
  uint64_t soft_at_start = 0;  // the soft limit this process started with
  uint64_t soft = 0;           // the soft limit in force now
  uint64_t hard = 0;           // the hard limit (RLIM_INFINITY as UINT64_MAX)
  std::string error;  // why the soft limit could not be raised; empty when it was or was not needed
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit (to fs.nr_open where the hard limit
// is unlimited, the most the kernel takes) and returns what it found and did.
FileLimit RaiseOpenFileLimit();

// The soft RLIMIT_NOFILE in force now; 0 when it cannot be read.
uint64_t OpenFileLimit();

// How many file descriptors this process has open (the entries of /proc/self/fd); -1 when that
// cannot be read.
int64_t OpenFileDescriptors();

// Descriptors proximad wants beside one per client connection (server.max_connections): UCX
// endpoints and workers, cluster peers, its listeners, files. A soft limit below
// max_connections + this starts with a warning.
inline constexpr uint64_t kFileHeadroom = 1024;

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_FILE_LIMIT_H_
