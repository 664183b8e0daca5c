// A tmpfs file system of a given size, for tests of what a full disk does (ENOSPC for real).
// Mounting needs root, and the mount must not outlive a test that crashes: tests mount only in a
// mount namespace of their own (their ctest entries run them under `unshare --mount`, where the
// mounts go with the process) and skip elsewhere, saying so.
#ifndef PROXIMA_COMMON_TESTING_TMPFS_H_
#define PROXIMA_COMMON_TESTING_TMPFS_H_

#include <sys/mount.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace proxima::testing {

// Whether this process runs in a mount namespace of its own. The ctest entries that run a test
// under `unshare --mount` say so with PROXIMA_TEST_OWN_MOUNT_NAMESPACE=1, since init's namespace
// cannot always be examined (/proc/1 may belong to a process outside the container); a process
// that can see it shares init's namespace is told no regardless.
inline bool InMountNamespaceOfItsOwn() {
  const char* said = std::getenv("PROXIMA_TEST_OWN_MOUNT_NAMESPACE");
  if (said == nullptr || std::string(said) != "1") return false;
  struct stat self {};
  struct stat init {};
  return ::stat("/proc/self/ns/mnt", &self) != 0 || ::stat("/proc/1/ns/mnt", &init) != 0 ||
         self.st_ino != init.st_ino;
}

// A tmpfs of `bytes` (whole pages hold file data) on the directory `path` while it lives.
class ScopedTmpfs {
 public:
  ScopedTmpfs(const ScopedTmpfs&) = delete;
  ScopedTmpfs& operator=(const ScopedTmpfs&) = delete;
  ~ScopedTmpfs() { ::umount2(path_.c_str(), MNT_DETACH); }

  // FAILED_PRECONDITION unless InMountNamespaceOfItsOwn() (a mount in a shared namespace would
  // stay behind a crash); the mount's error otherwise.
  static absl::Status Mount(const std::string& path, uint64_t bytes,
                            std::unique_ptr<ScopedTmpfs>* out) {
    if (!InMountNamespaceOfItsOwn()) {
      return absl::FailedPreconditionError(
          "not in a mount namespace of its own (run under unshare --mount, as root)");
    }
    if (::mount("tmpfs", path.c_str(), "tmpfs", 0, absl::StrCat("size=", bytes).c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot mount a tmpfs on '", path, "': ", std::strerror(errno)));
    }
    out->reset(new ScopedTmpfs(path));
    return absl::OkStatus();
  }

 private:
  explicit ScopedTmpfs(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_TMPFS_H_
