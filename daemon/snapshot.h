// Snapshot: the warm restart of a proximad that is not part of a cluster
// (tiers.host.snapshot_file). On SIGTERM, once no call runs, the daemon writes its registered
// profiles and its host tier's blocks (the GPU tier's moved down first), most recently used
// first, to a file, for at most tiers.host.snapshot_seconds; the next start reads them back
// before it serves. A restart (an upgrade, a config change, a node drain and return) then keeps
// the node's cache instead of sending every worker back to prefill.
//
// The file (docs/format.md, "Snapshot file") is a header, then records, each framed with its
// kind, sizes and a CRC32C of its framing and metadata: the profiles, the blocks (metadata, then
// the stored bytes, which carry their own CRC32C, encoded as the tier held them), and an end
// record. It is written as `path`.tmp and renamed over `path` once complete and synced, so a
// crash while writing leaves the previous state (no file), never a half-written one under the
// name.
//
// Loading treats the file as hostile: a record that fails a check (framing CRC, an unknown
// namespace, scope or profile, a size that cannot be the profile's, bytes failing their CRC32C or
// not a STAR-KV container at the stated level) is skipped and reported; damaged framing ends the
// read there; nothing loaded is ever other than what was written. The file is removed before it
// is read: it is read once, so a daemon that crashes later never loads blocks its clients have
// deleted since.
#ifndef PROXIMA_DAEMON_SNAPSHOT_H_
#define PROXIMA_DAEMON_SNAPSHOT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/tier_service.h"

namespace proxima::daemon::snapshot {

// This daemon's hold on the snapshot file `path`: an exclusive lock (flock) on `path`.lock, which
// names the holder's pid. Two daemons given the same file would write over each other's snapshot,
// and the next start of either would read the other's blocks; the second one's start is refused
// instead. The lock goes when the Claim is destroyed or the process ends, however it ends (a
// SIGKILL included); the .lock file stays, empty of meaning once unlocked.
class Claim {
 public:
  explicit Claim(int fd) : fd_(fd) {}
  Claim(const Claim&) = delete;
  Claim& operator=(const Claim&) = delete;
  ~Claim();

 private:
  int fd_;
};

// Claims `path` for this process, at start, so that a bad directory stops the start, not the
// shutdown later. FAILED_PRECONDITION naming tiers.host.snapshot_file when its directory is not
// one this process can write to (naming the directory and why), or when another process holds
// the file (naming its pid and the lock file).
absl::StatusOr<std::unique_ptr<Claim>> ClaimFile(const std::string& path);

struct Written {
  uint64_t profiles = 0;
  uint64_t blocks = 0;
  uint64_t bytes = 0;        // stored bytes of the blocks written
  uint64_t left_blocks = 0;  // host tier blocks the deadline or a full file system left out
  // Empty, or why the file system took no more blocks (its error: ENOSPC or EDQUOT). The file
  // then holds the hottest blocks that fit, ends with its end record and loads whole.
  std::string full;
};

// Writes every profile registered in `core` and its host tier's blocks, most recently used
// first, until `deadline`, to `path` (see above). The blocks stay stored (taken as a hand-off
// takes them, so not handed out to the tierer meanwhile). REQUIRES: no call runs on `core` (the
// daemon has stopped serving). A file system that fills keeps the hottest blocks that fit
// (`Written::full`). Errors name the path and the failing system call; `path` is then left as it
// was and `path`.tmp removed.
absl::StatusOr<Written> Write(TierService& core, const std::string& path, absl::Time deadline);

struct Loaded {
  bool found = false;     // there was a snapshot file
  bool complete = false;  // it ended with its end record
  uint64_t profiles = 0;
  uint64_t blocks = 0;  // blocks stored from it
  uint64_t bytes = 0;   // that they take in the tier
  // Of `blocks`, those whose level's codec plan the namespace's hierarchy no longer has (its
  // config changed), stored decoded, raw.
  uint64_t decoded = 0;
  uint64_t skipped = 0;  // block or profile records refused (`problems` says why)
  // Blocks left out because the hotter ones filled the host tier, or their namespace's
  // max_bytes.
  uint64_t no_room = 0;
  std::vector<std::string> problems;  // the first few reasons, each naming its record
};

// Reads the snapshot at `path` into `core` (no file: found = false) and removes the file. The
// blocks go in coldest first, so the most recently used before the restart are again the most
// recently used, and those that were in the protected segment (used again) are again; where the
// host tier is now smaller, the coldest are left out. An encoded block keeps its encoding at the
// level of the namespace's hierarchy with the same codec plan, and is decoded when the hierarchy
// has none (a block's level always names a plan of the current config). REQUIRES: `core`
// serves no call yet. An error (the file cannot be read or removed, its header is not a
// snapshot's of this version) loads nothing and names the path and what was expected.
absl::StatusOr<Loaded> Load(TierService& core, const std::string& path);

}  // namespace proxima::daemon::snapshot

#endif  // PROXIMA_DAEMON_SNAPSHOT_H_
