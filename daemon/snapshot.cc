#include "daemon/snapshot.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bytes.h"
#include "common/crc32c.h"
#include "common/parallel.h"
#include "common/status_macros.h"
#include "kernels/codec.h"
#include "proxima/v1/snapshot.pb.h"

namespace proxima::daemon::snapshot {
namespace {

// The layout (docs/format.md, "Snapshot file"); integers little-endian.
//   file header, 32 bytes: magic "PROXSNAP" | u32 version | u32 header bytes (32) |
//                          u64 written at (Unix ms) | u32 reserved (0) | u32 CRC32C of bytes 0-27
//   record header, 24 bytes: u32 kind | u32 meta bytes | u64 data bytes | u32 reserved (0) |
//                            u32 CRC32C of header bytes 0-19 and the meta bytes
//   then the meta bytes (a SnapshotProfile, SnapshotBlock or SnapshotEnd message), then the data
//   bytes (a block's stored bytes; none for the other kinds).
constexpr char kMagic[8] = {'P', 'R', 'O', 'X', 'S', 'N', 'A', 'P'};
constexpr uint32_t kVersion = 1;
constexpr size_t kFileHeaderBytes = 32;
constexpr size_t kRecordHeaderBytes = 24;
constexpr uint32_t kMaxMetaBytes = 64 << 10;
constexpr size_t kMaxProblems = 16;
enum Kind : uint32_t { kProfile = 1, kBlock = 2, kEnd = 3 };

void Put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void Put64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
uint32_t Get32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint64_t Get64(const char* p) {
  return static_cast<uint64_t>(Get32(p)) | static_cast<uint64_t>(Get32(p + 4)) << 32;
}

absl::Status Errno(int err, absl::string_view what, const std::string& path) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(message)
                                        : absl::InternalError(message);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  // Closes now, reporting what close(2) says (a write-back error of NFS and the like).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, std::span<const std::byte> data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno(n < 0 ? errno : EIO, "cannot write the snapshot file", path);
    data = data.subspan(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Reads exactly `out.size()` bytes at `offset`; false at end of file or on an error (`err`).
bool ReadAt(int fd, uint64_t offset, std::span<std::byte> out, int* err) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n =
        ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *err = n < 0 ? errno : 0;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

// The directory that holds `path` (an absolute path).
std::string DirectoryOf(const std::string& path) {
  return path.substr(0, std::max<size_t>(path.rfind('/'), 1));
}

std::string RecordHeader(Kind kind, const std::string& meta, uint64_t data_bytes) {
  std::string h;
  Put32(h, kind);
  Put32(h, static_cast<uint32_t>(meta.size()));
  Put64(h, data_bytes);
  Put32(h, 0);
  Put32(h, Crc32cExtend(Crc32c(AsBytes(h)), AsBytes(meta)));
  return h + meta;
}

}  // namespace

Claim::~Claim() { ::close(fd_); }  // closing the last descriptor of the lock drops it

absl::StatusOr<std::unique_ptr<Claim>> ClaimFile(const std::string& path) {
  const std::string dir = DirectoryOf(path);
  const std::string lock = path + ".lock";
  auto unwritable = [&](int err) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tiers.host.snapshot_file '", path, "': its directory '", dir,
        "' is not one this process can write to (", std::strerror(err),
        "); create it, owned by proximad's user, or set tiers.host.snapshot_file to \"\""));
  };
  // The lock file alone could be writable in a directory that is not (the rename at shutdown
  // needs the directory).
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return unwritable(errno);
  Fd fd(::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() < 0) return unwritable(errno);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tiers.host.snapshot_file '", path, "': cannot lock '", lock, "': ", std::strerror(err)));
    }
    // The holder wrote its pid when it took the lock (it may be taking it still: then unknown).
    char pid[32] = {};
    int read_err = 0;
    ReadAt(fd.get(), 0, std::as_writable_bytes(std::span(pid, sizeof(pid) - 1)), &read_err);
    std::string holder;
    for (const char* c = pid; *c >= '0' && *c <= '9'; ++c) holder.push_back(*c);
    if (holder.empty()) holder = "unknown";
    return absl::FailedPreconditionError(absl::StrCat(
        "tiers.host.snapshot_file '", path, "' is in use by another proximad (pid ", holder,
        ", which holds the lock '", lock, "'); give each proximad its own snapshot file"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  // The pid only names the holder in another start's error: a lock whose pid cannot be written
  // still holds.
  if (::ftruncate(fd.get(), 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(fd.get(), pid.data(), pid.size(), 0);
  }
  return std::make_unique<Claim>(fd.Release());
}

absl::StatusOr<Written> Write(TierService& core, const std::string& path, absl::Time deadline) {
  const std::string tmp = path + ".tmp";
  Written w;
  // Every block taken stays busy until the end (the tierer leaves it alone).
  std::vector<BlockStore::Candidate> taken;
  BlockStore& store = core.store();
  absl::Status status = [&]() -> absl::Status {
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (fd.get() < 0) return Errno(errno, "cannot create the snapshot file", tmp);
    std::string header(kMagic, sizeof(kMagic));
    Put32(header, kVersion);
    Put32(header, kFileHeaderBytes);
    Put64(header, static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())));
    Put32(header, 0);
    Put32(header, Crc32c(AsBytes(header)));
    PROXIMA_RETURN_IF_ERROR(WriteAll(fd.get(), AsBytes(header), tmp));
    uint64_t offset = header.size();  // where the next record starts
    for (const auto& [ns, profile] : core.Profiles()) {
      v1::SnapshotProfile p;
      p.set_namespace_name(core.NamespaceName(ns));
      *p.mutable_profile() = profile;
      const std::string record = RecordHeader(kProfile, p.SerializeAsString(), 0);
      PROXIMA_RETURN_IF_ERROR(WriteAll(fd.get(), AsBytes(record), tmp));
      offset += record.size();
      ++w.profiles;
    }
    // Each block record written: where it starts and its stored bytes. A file system that fills
    // (ENOSPC, EDQUOT) ends the blocks as the deadline does, at the last whole record, and the
    // coldest of them make room for the end record if it does not fit after them.
    struct Record {
      uint64_t offset;
      uint64_t bytes;
    };
    std::vector<Record> records;
    // Hottest first, each block once: the order is taken in one pass (the daemon has stopped
    // serving; a block gone or pinned meanwhile is passed over).
    for (const BlockId& hot : store.HostBlocksHottestFirst()) {
      if (absl::Now() >= deadline) break;
      std::optional<BlockStore::Candidate> c = store.TakeHostBlock(hot);
      if (!c) continue;
      const BlockId& id = c->id;
      std::optional<std::string> scope = core.PartitionScope(id.namespace_index, id.partition);
      taken.push_back(*c);
      // Every stored block's partition is one of the config's; a snapshot never names another
      // scope (which the next start would read as another tenant's).
      if (!scope) continue;
      v1::SnapshotBlock b;
      b.set_namespace_name(core.NamespaceName(id.namespace_index));
      b.set_scope(*scope);
      b.set_profile_id(id.profile_id);
      b.set_key(reinterpret_cast<const char*>(id.key.data()), kKeyBytes);
      b.set_level(c->block.level);
      b.set_plan(core.LevelPlanText(id.namespace_index, c->block.level));
      b.set_crc32c(c->block.crc32c);
      b.set_max_level(c->attributes.max_level);
      b.set_first_block(c->attributes.is_first_block);
      b.set_second_chance(c->attributes.second_chance);
      b.set_reused(c->reused);
      b.set_high_priority(c->attributes.high_priority);
      b.set_position(c->attributes.position);
      const std::span<const std::byte> bytes = c->block.bytes;
      const std::string head = RecordHeader(kBlock, b.SerializeAsString(), bytes.size());
      absl::Status written = WriteAll(fd.get(), AsBytes(head), tmp);
      if (written.ok()) written = WriteAll(fd.get(), bytes, tmp);
      if (!written.ok()) {
        if (!absl::IsResourceExhausted(written)) return written;
        w.full = std::string(written.message());
        break;
      }
      records.push_back({offset, bytes.size()});
      offset += head.size() + bytes.size();
      ++w.blocks;
      w.bytes += bytes.size();
    }
    while (true) {
      if (!w.full.empty()) {
        // Back to the end of the last whole record: what a failed write left after it goes.
        if (::ftruncate(fd.get(), static_cast<off_t>(offset)) != 0 ||
            ::lseek(fd.get(), static_cast<off_t>(offset), SEEK_SET) < 0) {
          return Errno(errno, "cannot cut the snapshot file back to its last whole record", tmp);
        }
      }
      w.left_blocks = store.blocks() - std::min<uint64_t>(store.blocks(), w.blocks);
      v1::SnapshotEnd end;
      end.set_blocks(w.blocks);
      end.set_block_bytes(w.bytes);
      end.set_left_blocks(w.left_blocks);
      const absl::Status written =
          WriteAll(fd.get(), AsBytes(RecordHeader(kEnd, end.SerializeAsString(), 0)), tmp);
      if (written.ok()) break;
      if (!absl::IsResourceExhausted(written) || records.empty()) return written;
      if (w.full.empty()) w.full = std::string(written.message());
      offset = records.back().offset;
      w.bytes -= records.back().bytes;
      --w.blocks;
      records.pop_back();
    }
    if (::fsync(fd.get()) != 0) return Errno(errno, "cannot sync the snapshot file", tmp);
    if (fd.Close() != 0) return Errno(errno, "cannot close the snapshot file", tmp);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      return Errno(errno, "cannot rename the snapshot file to", path);
    }
    // The rename survives a power loss once the directory is synced. The file is complete and
    // in place either way (the next start reads it), so a directory that cannot be synced is
    // not an error.
    Fd dfd(::open(DirectoryOf(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dfd.get() >= 0) ::fsync(dfd.get());
    return absl::OkStatus();
  }();
  for (const BlockStore::Candidate& c : taken) store.Release(c);
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  return w;
}

absl::StatusOr<Loaded> Load(TierService& core, const std::string& path) {
  Loaded out;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return out;
    return Errno(errno, "cannot open the snapshot file", path);
  }
  out.found = true;
  // Read once: gone before any block of it is served, so a crash later cannot bring back blocks
  // deleted meanwhile. A file that cannot be removed is not read.
  if (::unlink(path.c_str()) != 0) {
    return Errno(errno,
                 "cannot remove the snapshot file (a file read at every start would bring back "
                 "deleted blocks), so it was not loaded",
                 path);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Errno(errno, "cannot examine the snapshot file", path);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  int err = 0;
  char header[kFileHeaderBytes];
  if (!ReadAt(fd.get(), 0, std::as_writable_bytes(std::span(header)), &err)) {
    return err != 0 ? Errno(err, "cannot read the snapshot file", path)
                    : absl::InvalidArgumentError(absl::StrCat(
                          "snapshot file '", path, "' is ", file_bytes,
                          " bytes; expected at least its ", kFileHeaderBytes, "-byte header"));
  }
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot file '", path, "' does not start with the magic \"PROXSNAP\"; not a snapshot"));
  }
  if (const uint32_t crc = Crc32c(AsBytes(std::string_view(header, 28)));
      crc != Get32(header + 28)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("snapshot file '%s' header has CRC32C 0x%08x; its bytes have 0x%08x", path,
                        Get32(header + 28), crc));
  }
  if (Get32(header + 8) != kVersion || Get32(header + 12) != kFileHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot file '", path, "' is version ", Get32(header + 8), " with a ", Get32(header + 12),
        "-byte header; this proximad reads version ", kVersion, " (", kFileHeaderBytes, " bytes)"));
  }

  auto problem = [&out](std::string what) {
    if (out.problems.size() < kMaxProblems) out.problems.push_back(std::move(what));
  };
  // The blocks whose records check out, in file order (hottest first).
  struct Entry {
    BlockId id;
    uint64_t offset = 0;  // of the data bytes
    uint64_t size = 0;
    uint64_t block_bytes = 0;
    uint32_t crc32c = 0;
    uint8_t level = 0;      // of the bytes in the file
    uint8_t level_now = 0;  // in this daemon's hierarchy
    bool decode = false;    // stored raw: its level's plan is not in this daemon's hierarchy
    BlockAttributes attributes;
    bool reused = false;
    size_t record = 0;
    uint64_t tier_bytes() const { return decode ? block_bytes : size; }
  };
  std::vector<Entry> entries;
  uint64_t offset = kFileHeaderBytes;
  for (size_t record = 0;; ++record) {
    if (offset == file_bytes) break;
    const std::string where = absl::StrCat("record ", record, " at offset ", offset);
    char h[kRecordHeaderBytes];
    if (!ReadAt(fd.get(), offset, std::as_writable_bytes(std::span(h)), &err)) {
      problem(absl::StrCat(where, ": ", err != 0 ? std::strerror(err) : "cut short in its header",
                           "; the rest of the file is not read"));
      break;
    }
    const uint32_t kind = Get32(h);
    const uint32_t meta_bytes = Get32(h + 4);
    const uint64_t data_bytes = Get64(h + 8);
    const uint64_t left = file_bytes - offset - kRecordHeaderBytes;
    if (meta_bytes > kMaxMetaBytes || meta_bytes > left || data_bytes > left - meta_bytes) {
      problem(absl::StrCat(where, ": states ", meta_bytes, " meta bytes and ", data_bytes,
                           " data bytes, but ", left, " bytes are left (meta at most ",
                           kMaxMetaBytes, "); the rest of the file is not read"));
      break;
    }
    std::string meta(meta_bytes, '\0');
    if (!ReadAt(fd.get(), offset + kRecordHeaderBytes,
                std::as_writable_bytes(std::span(meta.data(), meta.size())), &err)) {
      problem(absl::StrCat(where, ": cannot read its metadata: ", std::strerror(err),
                           "; the rest of the file is not read"));
      break;
    }
    const uint32_t crc = Crc32cExtend(Crc32c(AsBytes(std::string_view(h, 20))), AsBytes(meta));
    if (crc != Get32(h + 20)) {
      problem(
          absl::StrFormat("%s: framing has CRC32C 0x%08x; its bytes have 0x%08x; the rest of "
                          "the file is not read",
                          where, Get32(h + 20), crc));
      break;
    }
    const uint64_t data_offset = offset + kRecordHeaderBytes + meta_bytes;
    offset = data_offset + data_bytes;
    if (kind == kEnd) {
      out.complete = true;
      break;
    }
    if (kind == kProfile) {
      v1::SnapshotProfile p;
      absl::StatusOr<uint32_t> ns = absl::InvalidArgumentError("its metadata does not parse");
      if (p.ParseFromString(meta)) ns = core.NamespaceIndex(p.namespace_name());
      absl::StatusOr<uint64_t> id = ns.ok() ? core.AddProfile(*ns, p.profile()) : ns.status();
      if (id.ok()) {
        ++out.profiles;
      } else {
        ++out.skipped;
        problem(absl::StrCat(where, " (a profile of namespace '", p.namespace_name(),
                             "') skipped: ", id.status().message()));
      }
      continue;
    }
    if (kind != kBlock) {
      ++out.skipped;
      problem(absl::StrCat(where, " skipped: kind is ", kind, "; expected ", kProfile,
                           " (profile), ", kBlock, " (block) or ", kEnd, " (end)"));
      continue;
    }
    v1::SnapshotBlock b;
    Entry e;
    e.record = record;
    e.offset = data_offset;
    e.size = data_bytes;
    absl::Status ok = [&]() -> absl::Status {
      if (!b.ParseFromString(meta))
        return absl::InvalidArgumentError("its metadata does not parse");
      PROXIMA_ASSIGN_OR_RETURN(e.id.namespace_index, core.NamespaceIndex(b.namespace_name()));
      std::optional<uint32_t> partition = core.ScopePartition(e.id.namespace_index, b.scope());
      if (!partition) {
        return absl::NotFoundError(
            absl::StrCat("scope '", b.scope(), "' is not a token scope of namespace '",
                         b.namespace_name(), "' with private_prefixes in this config"));
      }
      e.id.partition = *partition;
      e.id.profile_id = b.profile_id();
      PROXIMA_ASSIGN_OR_RETURN(e.block_bytes,
                               core.RegisteredBlockBytes(e.id.namespace_index, b.profile_id()));
      if (b.key().size() != kKeyBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("key is ", b.key().size(), " bytes; expected ", kKeyBytes));
      }
      std::memcpy(e.id.key.data(), b.key().data(), kKeyBytes);
      if (b.level() >= static_cast<uint32_t>(kMaxLevels) ||
          b.max_level() >= static_cast<uint32_t>(kMaxLevels)) {
        return absl::InvalidArgumentError(absl::StrCat("level is ", b.level(), " and max_level ",
                                                       b.max_level(), "; levels are 0 to ",
                                                       kMaxLevels - 1));
      }
      if (absl::Status s = CheckStoredSize(b.level(), data_bytes, e.block_bytes); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("its data ", s.message()));
      }
      e.level = static_cast<uint8_t>(b.level());
      // The block keeps its encoding under the level of this daemon's hierarchy with the same
      // plan; with none (the hierarchy changed), it is stored raw, and the tierer encodes it
      // down this hierarchy as pressure asks.
      const std::optional<uint8_t> here = core.LevelOfPlan(e.id.namespace_index, e.level, b.plan());
      e.decode = !here.has_value();
      e.level_now = here.value_or(0);
      e.crc32c = b.crc32c();
      e.attributes.max_level = static_cast<uint8_t>(b.max_level());
      e.attributes.is_first_block = b.first_block();
      e.attributes.second_chance = b.second_chance();
      if (b.has_high_priority()) {
        // As a Put under this config would have them (its hierarchy may be deeper or shallower,
        // or compress where the writer's did not).
        BlockAttributes put;
        put.position = b.position();
        put.high_priority = b.high_priority();
        put.second_chance = b.second_chance();
        e.attributes = core.AttributesAgain(e.id.namespace_index, e.id.profile_id, put);
      }
      e.reused = b.reused();
      return absl::OkStatus();
    }();
    if (!ok.ok()) {
      ++out.skipped;
      problem(absl::StrCat(where, " (a block of namespace '", b.namespace_name(),
                           "') skipped: ", ok.message()));
      continue;
    }
    entries.push_back(e);
  }

  // The hottest that fit, put in coldest first: each Commit makes its block the most recently
  // used, so the order before the restart comes back.
  BlockStore& store = core.store();
  // Each namespace's hottest within its max_bytes (a limit lowered since the snapshot).
  absl::flat_hash_map<uint32_t, uint64_t> namespace_fit;
  const size_t listed = entries.size();
  std::erase_if(entries, [&](const Entry& e) {
    uint64_t& taken = namespace_fit[e.id.namespace_index];
    if (!core.FitsInNamespace(e.id.namespace_index, taken + e.tier_bytes())) return true;
    taken += e.tier_bytes();
    return false;
  });
  out.no_room = listed - entries.size();
  uint64_t fit = 0;
  size_t keep = 0;
  while (keep < entries.size() && fit + entries[keep].tier_bytes() <= store.capacity_bytes()) {
    fit += entries[keep++].tier_bytes();
  }
  out.no_room += entries.size() - keep;
  // Read in file order (the disk's readahead follows), a batch at a time: tier memory for each
  // block of the batch, then the batch read into it and checked on several threads (a fresh
  // tier's pages are faulted in on their first write, which costs more than the copy:
  // docs/benchmarks.md). Then committed coldest first, so that each commit making its block the
  // most recently used brings the order of use back.
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr size_t kBatch = 32;
  const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  struct Item {
    const Entry* e = nullptr;
    std::optional<BlockStore::PendingBlock> p;
    uint32_t crc32c = 0;  // of the bytes in `p`
    std::string problem;  // empty: read and checked
  };
  std::vector<Item> items;
  items.reserve(keep);
  for (size_t begin = 0; begin < keep; begin += kBatch) {
    const size_t first = items.size();
    for (size_t i = begin; i < std::min(keep, begin + kBatch); ++i) {
      Item item;
      item.e = &entries[i];
      item.p = store.Reserve(item.e->tier_bytes());
      if (!item.p) {
        ++out.no_room;
        continue;
      }
      items.push_back(std::move(item));
    }
    ParallelFor(items.size() - first, threads, [&](size_t j) {
      Item& item = items[first + j];
      const Entry& e = *item.e;
      // A block to decode is read into a buffer of its own, then decoded into tier memory.
      std::string encoded(e.decode ? e.size : 0, '\0');
      const std::span<std::byte> read_into =
          e.decode ? std::as_writable_bytes(std::span(encoded.data(), encoded.size()))
                   : item.p->bytes();
      int read_err = 0;
      if (!ReadAt(fd.get(), e.offset, read_into, &read_err)) {
        item.problem = absl::StrCat("cannot read its bytes: ",
                                    read_err != 0 ? std::strerror(read_err) : "cut short");
      } else if (const uint32_t crc = Crc32c(read_into); crc != e.crc32c) {
        item.problem =
            absl::StrFormat("its bytes have CRC32C 0x%08x; expected 0x%08x", crc, e.crc32c);
      } else if (absl::Status c = CheckStoredContainer(e.level, read_into, e.block_bytes);
                 !c.ok()) {
        item.problem = absl::StrCat("its data ", c.message());
      } else if (!e.decode) {
        item.crc32c = e.crc32c;
      } else if (absl::Status d = codec::DecodeBlock(read_into, item.p->bytes()); !d.ok()) {
        item.problem = absl::StrCat("its level's plan is no level here, and it does not decode: ",
                                    d.message());
      } else {
        item.crc32c = Crc32c(item.p->bytes());
      }
    });
  }
  for (size_t i = items.size(); i-- > 0;) {
    Item& item = items[i];
    const Entry& e = *item.e;
    if (!item.problem.empty()) {
      ++out.skipped;
      problem(absl::StrCat("record ", e.record, " (a block of namespace '",
                           core.NamespaceName(e.id.namespace_index), "') skipped: ", item.problem));
      continue;
    }
    if (store.Commit(e.id, *std::move(item.p), item.crc32c, e.attributes, e.level_now) ==
        PutOutcome::kStored) {
      ++out.blocks;
      out.bytes += e.tier_bytes();
      out.decoded += e.decode ? 1 : 0;
      // A block used again before the restart goes back to the protected segment, in the same
      // order (the protected blocks come last here, coldest first).
      if (e.reused) store.Touch(e.id);
    }
  }
  // The file was unlinked at the start: its last close gives its blocks back to the file system,
  // which takes about 0.25 s per GB on ext4 here; the daemon need not wait for that to serve.
  std::thread([fd = fd.Release()] { ::close(fd); }).detach();
  return out;
}

}  // namespace proxima::daemon::snapshot
