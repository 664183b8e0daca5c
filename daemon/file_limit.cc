#include "daemon/file_limit.h"

#include <dirent.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"

namespace proxima::daemon {
namespace {

uint64_t AsLimit(rlim_t v) {
  return v == RLIM_INFINITY ? std::numeric_limits<uint64_t>::max() : static_cast<uint64_t>(v);
}

}  // namespace

FileLimit RaiseOpenFileLimit() {
  FileLimit out;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    out.error = absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno));
    return out;
  }
  out.soft_at_start = out.soft = AsLimit(limit.rlim_cur);
  out.hard = AsLimit(limit.rlim_max);
  if (limit.rlim_cur == limit.rlim_max) return out;
  rlim_t target = limit.rlim_max;
  if (target == RLIM_INFINITY) {
    // The kernel refuses a soft limit above fs.nr_open, "unlimited" included.
    uint64_t nr_open = 0;
    std::ifstream("/proc/sys/fs/nr_open") >> nr_open;
    if (nr_open == 0) nr_open = 1 << 20;  // the kernel's default
    target = static_cast<rlim_t>(nr_open);
  }
  if (target <= limit.rlim_cur) return out;
  rlimit raised = limit;
  raised.rlim_cur = target;
  if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    out.error = absl::StrCat("setrlimit(RLIMIT_NOFILE, ", target, "): ", std::strerror(errno));
    return out;
  }
  out.soft = AsLimit(target);
  return out;
}

uint64_t OpenFileLimit() {
  rlimit limit{};
  return getrlimit(RLIMIT_NOFILE, &limit) == 0 ? AsLimit(limit.rlim_cur) : 0;
}

int64_t OpenFileDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n - 1;  // the descriptor of `dir` itself
}

}  // namespace proxima::daemon
