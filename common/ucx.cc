#include "common/ucx.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <list>
#include <random>
#include <string_view>
#include <type_traits>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace proxima::ucx {
namespace {

// A packed address or rkey from a peer is parsed by UCX without a length: it is copied into a
// buffer this much larger than itself, zero-filled, so that a truncated or hostile one is read
// as zeros rather than past the end of our memory.
constexpr size_t kPeerBlobPadding = 4096;
// After a deadline forces an endpoint closed, how long its operations get to complete.
constexpr absl::Duration kAbortGrace = absl::Seconds(5);
// Send()'s messages: their active-message id, and the header each carries.
constexpr unsigned kMessageAmId = 1;
constexpr uint32_t kMessageMagic = 0x50584d31;  // "PXM1"
struct MessageHeader {
  uint32_t magic = kMessageMagic;
  uint32_t slot = 0;
  uint64_t transfer = 0;
};
// How often arriving messages look for uncollected inboxes to drop.
constexpr absl::Duration kStaleCheckEvery = absl::Seconds(1);
// How long ~Worker progresses outstanding closes before giving up on them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);
// How long the progress thread keeps polling after its last event before it sleeps.
constexpr absl::Duration kSpinAfterActivity = absl::Microseconds(200);
// The longest an idle worker sleeps between progress calls when no event wakes it.
constexpr int kIdleWakeMs = 10;
// Remote keys kept unpacked per endpoint (Endpoint::State::rkeys).
constexpr size_t kRkeyCacheSize = 32;

std::vector<char> Padded(const std::string& blob) {
  std::vector<char> buf(blob.size() + kPeerBlobPadding, 0);
  std::memcpy(buf.data(), blob.data(), blob.size());
  return buf;
}

// Checks the framing of a packed rkey before UCX parses it (ucp_ep_rkey_unpack has no length
// and asserts on some malformed keys, which would abort the process). UCX 1.13 packs:
//   uint64 md_map | uint8 memory type | per set bit of md_map: uint8 size, `size` bytes
// optionally followed by a few bytes of system-device information. Only memory domains that this
// context packs too, with the same key size (`own_sizes`, -1 where absent), are accepted: a peer
// with the same UCX build and transports packs the same ones.
absl::Status CheckPackedRkey(const std::string& k, const std::array<int, 64>& own_sizes,
                             size_t index) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("rkeys[", index, "] does not unpack: ", why, " (", k.size(), " bytes)"));
  };
  if (k.size() < 9) return bad("shorter than its header");
  uint64_t md_map = 0;
  std::memcpy(&md_map, k.data(), sizeof(md_map));
  if (md_map == 0) return bad("names no memory domain");
  size_t p = 9;
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t{1} << bit)) == 0) continue;
    if (own_sizes[bit] < 0) {
      return bad(absl::StrCat("names memory domain ", bit,
                              ", which this side's UCX does not have (other UCX_TLS?)"));
    }
    if (p >= k.size()) return bad("truncated");
    const int size = static_cast<uint8_t>(k[p]);
    if (size != own_sizes[bit]) {
      return bad(absl::StrCat("memory domain ", bit, " key is ", size, " bytes; expected ",
                              own_sizes[bit]));
    }
    p += 1 + size;
    if (p > k.size()) return bad("truncated");
  }
  if (k.size() - p > 16) return bad("has trailing bytes");
  return absl::OkStatus();
}

// The shared-memory segment a packed key names, [begin, end) in the peer's addresses, for keys
// of a domain whose layout `segment_keys` knows (UCX 1.13: posix packs {u64 id, u64 address,
// u64 length}, sysv {u32 shmid, u64 owner address} and the segment's size is the kernel's).
// REQUIRES: CheckPackedRkey accepted `k`. An empty range (begin == end == 0) when the key names
// no such domain (tcp, cma, ordinary memory): nothing is mapped from it.
struct SegmentRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};
absl::StatusOr<SegmentRange> SegmentBounds(const std::string& k,
                                           const std::array<SegmentKey, 64>& segment_keys,
                                           size_t index) {
  uint64_t md_map = 0;
  std::memcpy(&md_map, k.data(), sizeof(md_map));
  SegmentRange range;
  size_t p = 9;
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t{1} << bit)) == 0) continue;
    const size_t size = static_cast<uint8_t>(k[p]);
    const char* key = k.data() + p + 1;
    p += 1 + size;
    if (segment_keys[bit] == SegmentKey::kPosix && size >= 24) {
      uint64_t address = 0, length = 0;
      std::memcpy(&address, key + 8, 8);
      std::memcpy(&length, key + 16, 8);
      if (address + length < address) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rkeys[", index, "] names a shared-memory segment of ", length, " bytes at 0x",
            absl::Hex(address), ", past the end of the address space"));
      }
      range = {address, address + length};
    } else if (segment_keys[bit] == SegmentKey::kSysv && size >= 12) {
      uint32_t shmid = 0;
      uint64_t owner = 0;
      std::memcpy(&shmid, key, 4);
      std::memcpy(&owner, key + 4, 8);
      struct shmid_ds ds {};
      if (shmctl(static_cast<int>(shmid), IPC_STAT, &ds) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("rkeys[", index, "] names System V segment ", shmid,
                         ", which cannot be examined: ", std::strerror(errno)));
      }
      if (owner + ds.shm_segsz < owner) {
        return absl::InvalidArgumentError(
            absl::StrCat("rkeys[", index, "] places System V segment ", shmid, " at 0x",
                         absl::Hex(owner), ", past the end of the address space"));
      }
      range = {owner, owner + ds.shm_segsz};
    }
  }
  return range;
}

// The default huge page size (Hugepagesize in /proc/meminfo), or 0 when the host has none.
uint64_t HugePageBytes() {
  static const uint64_t bytes = [] {
    std::ifstream meminfo("/proc/meminfo");
    for (std::string line; std::getline(meminfo, line);) {
      unsigned long long kib = 0;
      if (std::sscanf(line.c_str(), "Hugepagesize: %llu kB", &kib) == 1) return kib * 1024;
    }
    return 0ull;
  }();
  return bytes;
}

// UCX 1.13's ucp_ep_rkey_unpack ends the process when a transport cannot attach the segment a
// key names: its error path releases the transport key that failed (uct_posix_rkey_release
// dereferences a null handle, SIGSEGV). A posix key whose segment cannot be opened or mapped (a
// peer's lie, or a peer that closed the segment meanwhile) would end this process. So each posix
// segment a key names is opened and test-mapped here first, as UCX 1.13 would (procfs
// /proc/PID/fd/FD, shm_open of /ucx_shm_posix_ID, or a file in the key's directory; the length
// aligned to pages, to huge pages with MAP_HUGETLB), and the key is pointed at this process's
// own descriptor (procfs mode): UCX's open then cannot fail whatever the peer does meanwhile.
// `key` is the zero-padded copy that UCX will parse; `fds` gets the descriptors, to close once
// UCX has mapped the segments. REQUIRES: CheckPackedRkey accepted the key.
absl::Status PinPosixSegments(std::vector<char>& key,
                              const std::array<SegmentKey, 64>& segment_keys,
                              std::vector<int>* fds) {
  constexpr uint64_t kProcfs = uint64_t{1} << 63;
  constexpr uint64_t kShmOpen = uint64_t{1} << 62;
  constexpr uint64_t kHugetlb = uint64_t{1} << 61;
  constexpr uint64_t kFlags = kProcfs | kShmOpen | kHugetlb | (uint64_t{1} << 60);
  constexpr int kProcfsPidBits = 30;
  uint64_t md_map = 0;
  std::memcpy(&md_map, key.data(), sizeof(md_map));
  size_t p = 9;
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t{1} << bit)) == 0) continue;
    const size_t size = static_cast<uint8_t>(key[p]);
    char* body = key.data() + p + 1;
    p += 1 + size;
    if (segment_keys[bit] != SegmentKey::kPosix || size < 24) continue;
    uint64_t seg_id = 0, length = 0;
    std::memcpy(&seg_id, body, 8);
    std::memcpy(&length, body + 16, 8);
    const uint64_t mmid = seg_id & ~kFlags;
    std::string path;
    int fd = -1;
    if (seg_id & kProcfs) {
      path = absl::StrCat("/proc/", mmid & ((uint64_t{1} << kProcfsPidBits) - 1), "/fd/",
                          mmid >> kProcfsPidBits);
      fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    } else {
      const std::string name = absl::StrCat("/ucx_shm_posix_", absl::Hex(mmid));
      if (seg_id & kShmOpen) {
        path = name;
        fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      } else {
        path = std::string(body + 24, strnlen(body + 24, size - 24)) + name;
        fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      }
    }
    if (fd < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("names a shared-memory segment that cannot be opened (", path,
                       "): ", std::strerror(errno)));
    }
    fds->push_back(fd);
    const long page = sysconf(_SC_PAGESIZE);
    uint64_t mapped = (length + page - 1) / page * page;
    int flags = MAP_SHARED;
    if (seg_id & kHugetlb) {
      // UCX maps a huge-page segment at most twice its page-aligned length, or fails.
      const uint64_t huge = HugePageBytes();
      const uint64_t aligned = huge == 0 ? 0 : (mapped + huge - 1) / huge * huge;
      if (huge == 0 || aligned > 2 * mapped) {
        return absl::InvalidArgumentError(
            absl::StrCat("names a huge-page shared-memory segment of ", length,
                         " bytes, which this host cannot map (huge page size ", huge, ")"));
      }
      mapped = aligned;
      flags |= MAP_HUGETLB;
    }
    void* test = length == 0 || mapped < length
                     ? MAP_FAILED
                     : mmap(nullptr, mapped, PROT_READ | PROT_WRITE, flags, fd, 0);
    if (test == MAP_FAILED) {
      return absl::InvalidArgumentError(absl::StrCat("names a shared-memory segment (", path,
                                                     ") that cannot be mapped with ", length,
                                                     " bytes: ", std::strerror(errno)));
    }
    munmap(test, mapped);
    seg_id = (seg_id & kFlags) | kProcfs | static_cast<uint64_t>(getpid()) |
             (static_cast<uint64_t>(fd) << kProcfsPidBits);
    std::memcpy(body, &seg_id, 8);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FromUcs(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SHMEM_SEGMENT:  // the peer's shared memory is gone: the peer is
      return absl::UnavailableError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_UNSUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

// A peer's remote key, unpacked once for an endpoint and kept while transfers use it.
// Destroyed (ucp_rkey_destroy) when the last holder drops it, on the progress thread.
using UnpackedRkey = std::shared_ptr<std::remove_pointer_t<ucp_rkey_h>>;

// Shared by an Endpoint handle, the progress thread and UCX's error callback.
struct Endpoint::State {
  Worker* worker = nullptr;
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;  // progress thread only; null once closed
  std::function<void()> on_failure;
  // Whether UCX reports the peer's failure (peer error handling). Without it the endpoint cannot
  // be closed by force: a transfer stuck on a dead peer is abandoned, its buffers held.
  bool detects_peer_failure = true;
  // Remote keys this endpoint unpacked, by the peer's registration id and packed bytes, least
  // recently used first. Only the progress thread unpacks and adds keys; a caller's thread also
  // looks them up (Worker::TryDirect), hence `mu`. A peer names the same registered buffers call
  // after call; unpacking a key can be costly (over shared memory it maps the peer's segment,
  // and every page of it faults again), so up to kRkeyCacheSize stay unpacked until the endpoint
  // closes. The id tells a new registration from an old one whose key packs to the same bytes
  // (a freed segment's file descriptor and address can be reused).
  struct CachedRkey {
    uint64_t registration_id;
    std::string packed;
    UnpackedRkey rkey;
  };
  mutable proxima::Mutex mu;
  std::list<CachedRkey> rkeys ABSL_GUARDED_BY(mu);
  std::string failure ABSL_GUARDED_BY(mu);  // empty while usable
};

// One Transfer(): counted operations, completed on the progress thread.
struct Worker::TransferState {
  Worker* worker = nullptr;
  std::shared_ptr<Endpoint::State> endpoint;
  std::vector<Op> ops;
  std::vector<UnpackedRkey> rkeys;
  std::shared_ptr<const void> keep_alive;
  int pending = 0;      // progress thread only
  absl::Status result;  // written before `done` is notified
  // Set before `done` when every operation's remote bytes are mapped into this process: where
  // each one's bytes are here. The caller then copies them itself; `rkeys` (which keep the
  // mappings) and `keep_alive` stay held until it has.
  std::vector<std::byte*> mapped;
  bool wants_crc = false;  // a kGet asks for its CRC32C: the caller reads `local` after
  std::vector<MessageHeader> headers;  // Send()'s, one per message (UCX reads them until done)
  uint64_t rendezvous_bytes = 0;       // of Send()'s messages, those sent rendezvous
  // The IOV arrays of messages sent or received in pieces (UCX reads them until done).
  std::vector<std::vector<ucp_dt_iov_t>> iovs;
  // Sending::Detach: past `detach_deadline` the progress thread closes the endpoint by force.
  // Progress thread only.
  bool detached = false;
  absl::Time detach_deadline = absl::InfiniteFuture();
  // Receive()'s `sender`: closed by force when the deadline passes.
  std::shared_ptr<Endpoint::State> sender;
  proxima::Notification done;
};

struct Sending::State {
  Worker* worker = nullptr;
  std::shared_ptr<Worker::TransferState> transfer;
};

namespace {

// What a failed TransferState was, for its status: a transfer or send on endpoint
// `endpoint_id`, or a Receive (0: no endpoint; endpoint ids start at 1).
std::string Describe(uint64_t endpoint_id) {
  return endpoint_id != 0 ? absl::StrCat("UCX transfer on endpoint ", endpoint_id)
                          : std::string("UCX receive of rendezvous messages");
}

// The IOV array describing `pieces`, kept in `iovs` (a TransferState's, which UCX reads until
// the operation completes).
template <typename Byte>
ucp_dt_iov_t* KeepIov(std::vector<std::vector<ucp_dt_iov_t>>& iovs,
                      std::span<const std::span<Byte>> pieces) {
  std::vector<ucp_dt_iov_t>& iov = iovs.emplace_back();
  iov.reserve(pieces.size());
  for (std::span<Byte> piece : pieces) {
    iov.push_back({const_cast<std::byte*>(piece.data()), piece.size()});
  }
  return iov.data();
}

// What a parcel counts toward Worker::kMaxParkedBytes: its bytes, or for a pending one (the
// bytes are still at the sender) an estimate of the descriptor UCX keeps for it.
constexpr uint64_t kPendingParcelBytes = 256;
uint64_t ParkedBytes(const Parcel& parcel) {
  return parcel.pending() ? kPendingParcelBytes : parcel.size();
}

// Where the remote bytes of every operation lie in this process, when UCX has mapped all of them
// (ucp_rkey_ptr: a peer's shared memory segment); empty when any is not mapped (tcp, cma, a
// peer's ordinary memory) or an operation wraps around the address space. UCX translates
// addresses by the segment's offset, as its own shared-memory RMA does. Progress thread.
std::vector<std::byte*> MapDirect(std::span<const Op> ops, std::span<const UnpackedRkey> rkeys) {
  std::vector<std::byte*> mapped;
  mapped.reserve(ops.size());
  for (const Op& op : ops) {
    void* first = nullptr;
    void* last = nullptr;
    if (op.length == 0 || op.remote_address + op.length < op.remote_address ||
        ucp_rkey_ptr(rkeys[op.rkey].get(), op.remote_address, &first) != UCS_OK ||
        ucp_rkey_ptr(rkeys[op.rkey].get(), op.remote_address + op.length - 1, &last) != UCS_OK ||
        static_cast<std::byte*>(last) - static_cast<std::byte*>(first) !=
            static_cast<ptrdiff_t>(op.length - 1)) {
      return {};
    }
    mapped.push_back(static_cast<std::byte*>(first));
  }
  return mapped;
}

}  // namespace

bool MayUseTcp(const char* tls) {
  if (tls == nullptr || *tls == '\0') return true;  // UCX's default list has tcp
  std::string_view list(tls);
  const bool excluding = list.front() == '^';
  if (excluding) list.remove_prefix(1);
  bool named = false;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    std::string_view name = list.substr(0, comma);
    list.remove_prefix(comma == std::string_view::npos ? list.size() : comma + 1);
    if (!name.empty() && name.front() == '\\') name.remove_prefix(1);  // a name, not an alias
    named = named || name == "tcp" || (!excluding && name == "all");
  }
  return excluding ? !named : named;
}

namespace {

// A direct transfer is cut into pieces of this size for the copy pool: small enough that a
// 2 MiB block spreads over several threads, large enough that a piece (tens of microseconds)
// outweighs claiming it and combining its CRC (well under a microsecond).
constexpr size_t kCopyPieceBytes = 256 << 10;

// Copies every operation's bytes between `local` and its mapped remote bytes, folding CRCs where
// asked, on this thread and the pool's free helpers. Returns the bytes moved, or
// INVALID_ARGUMENT naming the first operation whose memory faulted (the peer truncated its
// shared-memory segment under the copy, or declared an address outside it; CopyPiece); the
// CRCs are then not written.
absl::StatusOr<uint64_t> CopyDirect(std::span<const Op> ops, std::span<std::byte* const> mapped,
                                    CopyPool& pool) {
  std::vector<CopyPiece> pieces;
  std::vector<size_t> first_piece;  // ops[i]'s pieces are [first_piece[i], first_piece[i + 1])
  first_piece.reserve(ops.size() + 1);
  uint64_t moved = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    std::byte* dst = op.kind == Op::kGet ? op.local : mapped[i];
    const std::byte* src = op.kind == Op::kGet ? mapped[i] : op.local;
    first_piece.push_back(pieces.size());
    for (size_t at = 0; at < op.length; at += kCopyPieceBytes) {
      const size_t len = std::min<size_t>(kCopyPieceBytes, op.length - at);
      pieces.push_back(CopyPiece{dst + at, src + at, len, op.crc32c != nullptr});
    }
    moved += op.length;
  }
  first_piece.push_back(pieces.size());
  if (!pool.Run(pieces)) {
    for (size_t i = 0; i < ops.size(); ++i) {
      for (size_t p = first_piece[i]; p < first_piece[i + 1]; ++p) {
        if (!pieces[p].faulted) continue;
        return absl::InvalidArgumentError(absl::StrCat(
            "operation ", i, ": the peer's shared memory at 0x", absl::Hex(ops[i].remote_address),
            " (", ops[i].length,
            " bytes) faulted while being copied (SIGBUS or SIGSEGV: the segment was truncated, "
            "or the address lies outside it); expected memory of the segment that stays mapped "
            "until the call ends"));
      }
    }
  }
  // In batch order: operations naming the same word continue one CRC.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].crc32c == nullptr) continue;
    for (size_t p = first_piece[i]; p < first_piece[i + 1]; ++p) {
      *ops[i].crc32c = Crc32cCombine(*ops[i].crc32c, pieces[p].crc, pieces[p].size);
    }
  }
  return moved;
}

}  // namespace

Registration::~Registration() {
  Worker* w = worker_;
  ucp_mem_h memh = memh_;
  auto unmap = [w, memh] {
    ucs_status_t s = ucp_mem_unmap(w->context_, memh);
    if (s != UCS_OK) {
      PROXIMA_LOG(kWarning) << "ucp_mem_unmap failed" << log::Kv("status", ucs_status_string(s));
    }
    w->live_registrations_.fetch_sub(1);
  };
  if (std::this_thread::get_id() == w->thread_.get_id()) {
    unmap();
  } else if (!w->RunAndWait(unmap, absl::Now() + kAbortGrace)) {
    PROXIMA_LOG(kWarning) << "memory deregistration is late; it will finish in the background";
  }
}

bool Registration::Contains(const void* p, size_t n) const {
  auto begin = reinterpret_cast<uintptr_t>(address_);
  auto q = reinterpret_cast<uintptr_t>(p);
  return q >= begin && n <= length_ && q - begin <= length_ - n;
}

Endpoint::~Endpoint() {
  Worker* w = worker_;
  std::shared_ptr<State> state = std::move(state_);
  if (std::this_thread::get_id() == w->thread_.get_id()) {
    w->CloseOnWorker(state, /*force=*/false);
  } else {
    w->Post([w, state] { w->CloseOnWorker(state, /*force=*/false); });
  }
}

bool Endpoint::detects_peer_failure() const { return state_->detects_peer_failure; }

absl::Status Endpoint::health() const {
  proxima::MutexLock lock(&state_->mu);
  if (state_->failure.empty()) return absl::OkStatus();
  return absl::UnavailableError(state_->failure);
}

namespace {

// The context and worker every Worker of this process has, and the address check's child too
// (whose lane selection must be this daemon's): same features, same transport settings.
absl::Status OpenContextAndWorker(const char* name, ucp_context_h* context, ucp_worker_h* worker) {
  ucp_config_t* config = nullptr;
  PROXIMA_RETURN_IF_ERROR(FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
  // Over tcp, UCX emulates one-sided operations with messages of TX_SEG_SIZE bytes (8 KiB by
  // default); blocks are megabytes, and 64 KiB segments moved 1.5-1.8x more (docs/benchmarks.md,
  // UCX run 4). 64 KiB is the receivers' default RX_SEG_SIZE, so a peer on UCX's defaults still
  // takes them. UCX_TCP_TX_SEG_SIZE in the environment wins. (The key has no TCP_ prefix here:
  // ucp_config_modify hands it to every transport, and only tcp has a TX_SEG_SIZE.)
  if (std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr && MayUseTcp(std::getenv("UCX_TLS"))) {
    ucs_status_t m = ucp_config_modify(config, "TX_SEG_SIZE", "64k");
    if (m != UCS_OK) {
      PROXIMA_LOG(kWarning) << "cannot set UCX's TCP_TX_SEG_SIZE; keeping UCX's default"
                            << log::Kv("status", ucs_status_string(m));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = name;
  ucs_status_t s = ucp_init(&params, config, context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    *context = nullptr;
    return FromUcs(s, "ucp_init (check UCX_TLS)");
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
  s = ucp_worker_create(*context, &wp, worker);
  if (s != UCS_OK) {
    *worker = nullptr;
    return FromUcs(s, "ucp_worker_create");
  }
  return absl::OkStatus();
}

// ucp_ep_create to a peer's (zero-padded) worker address, with peer error handling reported to
// `on_error` or without any.
ucs_status_t CreateEndpoint(ucp_worker_h worker, const char* padded_address, bool peer_handling,
                            ucp_err_handler_cb_t on_error, void* arg, ucp_ep_h* ep) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  p.address = reinterpret_cast<const ucp_address_t*>(padded_address);
  if (peer_handling) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_error;
    p.err_handler.arg = arg;
  }
  return ucp_ep_create(worker, &p, ep);
}

// What Proxima checks of a peer's worker address itself before UCX parses it. UCX parses the
// address without a length and asserts on an unknown version (aborting the process): the header
// byte (format version and flags) must be what this same UCX build writes (`own`), and the rest
// is read from a zero-padded copy (Padded).
absl::Status CheckAddressFraming(const std::string& remote, const std::string& own) {
  if (remote.empty() || remote.size() > kMaxWorkerAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat("UCX worker address is ", remote.size(),
                                                   " bytes; expected 1..", kMaxWorkerAddressBytes));
  }
  if (remote.size() < 9 || remote[0] != own[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX worker address of ", remote.size(),
                     " bytes has an unknown header; expected an address packed by UCX ",
                     UCP_API_MAJOR, ".", UCP_API_MINOR, " (ucp_worker_query)"));
  }
  return absl::OkStatus();
}

// Unlinks the files of the shared-memory segments UCX's posix transport created for this
// process's own worker, where they have names: with UCX_POSIX_USE_PROC_LINK=n, a segment is a
// file in /dev/shm (or in UCX_POSIX_DIR) that stays until UCX frees the segment, and a check
// child ends without freeing anything, which would leave its receive FIFO (about 4 MiB of
// tmpfs) behind for every address checked. The mappings stay valid. REQUIRES: no peer's segment
// is mapped yet (they are named alike and must not be removed).
void UnlinkOwnPosixSegmentFiles() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string_view path = std::string_view(line).substr(slash);
    const size_t name = path.rfind('/') + 1;
    // In procfs mode UCX unlinked the file already: maps calls it "... (deleted)".
    if (!path.substr(name).starts_with("ucx_shm_posix_") || path.ends_with(" (deleted)")) continue;
    unlink(std::string(path).c_str());  // a second mapping of the same file finds it gone: fine
  }
}

}  // namespace

int ParseAddressInThisProcess(const std::string& address) {
  if (address.empty() || address.size() > kMaxWorkerAddressBytes) return kAddressCheckBadInput;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  if (!OpenContextAndWorker("proximad-address-check", &context, &worker).ok()) {
    return kAddressCheckCannotStart;
  }
  UnlinkOwnPosixSegmentFiles();
  // As Worker::Connect does: with peer error handling, then without where UCX refuses it.
  const std::vector<char> padded = Padded(address);
  ucp_ep_h ep = nullptr;
  auto ignore = [](void*, ucp_ep_h, ucs_status_t) {};
  if (CreateEndpoint(worker, padded.data(), /*peer_handling=*/true, ignore, nullptr, &ep) ==
      UCS_ERR_UNREACHABLE) {
    CreateEndpoint(worker, padded.data(), /*peer_handling=*/false, nullptr, nullptr, &ep);
  }
  // UCX returned, with an endpoint or an error status the caller's own ucp_ep_create will return
  // too. Nothing is closed or progressed: the endpoint's wire-up would reach the peer.
  return 0;
}

namespace {
uint64_t NamespaceInode(const char* path) {
  struct stat st {};
  return stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}
}  // namespace

uint64_t PidNamespace() { return NamespaceInode("/proc/self/ns/pid"); }
uint64_t IpcNamespace() { return NamespaceInode("/proc/self/ns/ipc"); }

std::string Worker::WithoutSegmentParts(const std::string& packed, bool posix, bool sysv) const {
  if ((!posix && !sysv) || packed.size() < 9) return packed;
  uint64_t md_map = 0;
  std::memcpy(&md_map, packed.data(), sizeof(md_map));
  std::string parts;
  uint64_t kept = 0;
  size_t p = 9;
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t{1} << bit)) == 0) continue;
    if (p >= packed.size()) return packed;
    const size_t size = static_cast<uint8_t>(packed[p]);
    if (p + 1 + size > packed.size()) return packed;
    const SegmentKey kind = segment_keys_[bit];
    if (!(posix && kind == SegmentKey::kPosix) && !(sysv && kind == SegmentKey::kSysv)) {
      kept |= uint64_t{1} << bit;
      parts.append(packed, p, 1 + size);
    }
    p += 1 + size;
  }
  if (kept == md_map || kept == 0) return packed;
  std::string out(reinterpret_cast<const char*>(&kept), sizeof(kept));
  out.push_back(packed[8]);  // memory type
  out += parts;
  out.append(packed, p);  // trailing system-device information
  return out;
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(
    const std::string& name, int copy_helpers,
    std::function<absl::Status(const std::string&, absl::Time)> check_address) {
  std::unique_ptr<Worker> w(new Worker(name, std::max(copy_helpers, 0)));
  w->check_address_ = std::move(check_address);
  PROXIMA_RETURN_IF_ERROR(OpenContextAndWorker(w->name_.c_str(), &w->context_, &w->worker_));
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  ucs_status_t s = ucp_worker_query(w->worker_, &attr);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_query");
  w->address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  ucp_worker_release_address(w->worker_, attr.address);
  if (ucp_worker_get_efd(w->worker_, &w->event_fd_) != UCS_OK) w->event_fd_ = -1;
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = kMessageAmId;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = &Worker::OnMessage;
  handler.arg = w.get();
  s = ucp_worker_set_am_recv_handler(w->worker_, &handler);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_set_am_recv_handler");
  w->next_transfer_id_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  Worker* raw = w.get();
  w->thread_ = std::thread([raw] { raw->ProgressLoop(); });
  // Probes tell which memory domains this context packs rkeys for, and their key sizes: a
  // registration of ordinary memory, and an allocation (shared-memory domains, such as posix,
  // pack keys only for memory UCX allocated; Client::AllocateMemory hands out such memory).
  w->own_md_sizes_.fill(-1);
  auto learn = [&w](const std::string& k) {
    uint64_t md_map = 0;
    if (k.size() >= 9) std::memcpy(&md_map, k.data(), sizeof(md_map));
    size_t p = 9;
    for (int bit = 0; bit < 64 && p < k.size(); ++bit) {
      if ((md_map & (uint64_t{1} << bit)) == 0) continue;
      w->own_md_sizes_[bit] = static_cast<uint8_t>(k[p]);
      p += 1 + static_cast<uint8_t>(k[p]);
    }
  };
  {
    std::vector<std::byte> buf(4096);
    PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<Registration> probe,
                             w->Register(buf.data(), buf.size()));
    learn(probe->packed_rkey());
  }
  {
    // Optional: a context without an allocating domain allocates ordinary memory, or fails.
    absl::StatusOr<std::shared_ptr<Registration>> probe = w->Allocate(4096);
    if (probe.ok()) {
      const std::string& k = (*probe)->packed_rkey();
      learn(k);
      // A domain whose key holds the probe's own address where UCX 1.13's posix or sysv key
      // holds the segment's: its keys carry their segment's bounds (see SegmentBounds).
      const auto address = reinterpret_cast<uint64_t>((*probe)->address());
      uint64_t md_map = 0;
      if (k.size() >= 9) std::memcpy(&md_map, k.data(), sizeof(md_map));
      size_t p = 9;
      for (int bit = 0; bit < 64 && p < k.size(); ++bit) {
        if ((md_map & (uint64_t{1} << bit)) == 0) continue;
        const size_t size = static_cast<uint8_t>(k[p]);
        if (p + 1 + size > k.size()) break;
        uint64_t at8 = 0, at16 = 0, at4 = 0;
        if (size >= 24) {
          std::memcpy(&at8, k.data() + p + 1 + 8, 8);
          std::memcpy(&at16, k.data() + p + 1 + 16, 8);
        }
        if (size >= 12) std::memcpy(&at4, k.data() + p + 1 + 4, 8);
        if (size >= 24 && at8 == address && at16 >= 4096) {
          w->segment_keys_[bit] = SegmentKey::kPosix;
        } else if (size == 12 && at4 == address) {
          w->segment_keys_[bit] = SegmentKey::kSysv;
        }
        p += 1 + size;
      }
    }
  }
  return w;
}

Worker::~Worker() {
  {
    // Uncollected messages: released by the progress thread before it stops.
    absl::flat_hash_map<uint64_t, Inbox> parked;
    {
      proxima::MutexLock lock(&parked_mu_);
      parked.swap(parked_);
      parked_bytes_ = 0;
    }
  }
  if (thread_.joinable()) {
    Post([this] {
      // Copy: closing erases from endpoints_.
      std::vector<std::shared_ptr<Endpoint::State>> all = endpoints_;
      for (auto& e : all) CloseOnWorker(e, /*force=*/e->detects_peer_failure);
    });
    {
      proxima::MutexLock lock(&mu_);
      stop_ = true;
    }
    ucp_worker_signal(worker_);
    thread_.join();
  }
  // Transfers still outstanding here (on endpoints abandoned without peer failure detection)
  // hold the remote keys they use. UCX may refer to them until ucp_worker_destroy, and
  // destroying them after it would touch freed memory: they are kept, unreleased, to the end of
  // the process (reachable, so leak checkers do not report them).
  {
    static proxima::Mutex graveyard_mu;
    static auto* graveyard = new std::vector<UnpackedRkey>();
    proxima::MutexLock lock(&graveyard_mu);
    for (auto& st : in_flight_) {
      for (UnpackedRkey& k : st->rkeys) graveyard->push_back(std::move(k));
      st->rkeys.clear();
    }
  }
  if (closing_ != 0) {
    // A graceful close that never completed (its peer hung: stopped, or gone without peer
    // failure detection) is a request ucp_worker_destroy asserts on, aborting the process. The
    // worker and its context are left to the end of the process instead: one worker's memory,
    // against an abort of the process that dropped its client (seen once in CI, a Python test
    // whose daemon was SIGSTOPped).
    PROXIMA_LOG(kWarning) << "UCX worker left undestroyed: an endpoint's close never completed "
                             "(its peer hangs)"
                          << log::Kv("closing_endpoints", closing_);
    static proxima::Mutex left_mu;  // reachable, so that leak checkers do not report them
    static auto* left = new std::vector<std::pair<ucp_worker_h, ucp_context_h>>();
    proxima::MutexLock lock(&left_mu);
    left->emplace_back(worker_, context_);
    return;
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

void Worker::Post(std::function<void()> task) {
  {
    proxima::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  ucp_worker_signal(worker_);
}

bool Worker::RunAndWait(std::function<void()> task, absl::Time deadline) {
  auto done = std::make_shared<proxima::Notification>();
  Post([task = std::move(task), done] {
    task();
    done->Notify();
  });
  return done->WaitForNotificationUntil(absl::ToChronoTime(deadline));
}

void Worker::ProgressLoop() {
  absl::Time stop_deadline = absl::InfiniteFuture();
  absl::Time last_activity = absl::Now();
  // Swapped with tasks_ on every turn: reused, so polling allocates nothing.
  std::deque<std::function<void()>> batch;
  for (;;) {
    bool stop = false;
    {
      proxima::MutexLock lock(&mu_);
      batch.swap(tasks_);
      stop = stop_;
    }
    const bool had_tasks = !batch.empty();
    for (auto& task : batch) task();
    batch.clear();
    if (detached_ > 0) CloseExpiredDetached();
    if (stop) {
      if (stop_deadline == absl::InfiniteFuture()) stop_deadline = absl::Now() + kShutdownGrace;
      if ((closing_ == 0 && in_flight_.empty()) || absl::Now() > stop_deadline) break;
      ucp_worker_progress(worker_);
      continue;
    }
    if (ucp_worker_progress(worker_) != 0 || had_tasks) {
      last_activity = absl::Now();
      continue;
    }
    // Keep polling briefly after activity: a transfer is a burst of fragments, and sleeping in
    // the kernel between them (arm + wait) costs a wake-up each. Idle workers sleep.
    if (absl::Now() - last_activity < kSpinAfterActivity) continue;
    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
    {
      proxima::MutexLock lock(&mu_);
      if (!tasks_.empty() || stop_) continue;
    }
    if (s == UCS_OK && event_fd_ >= 0) {
      // Woken by network events or ucp_worker_signal(), but never asleep for long: a send
      // waiting for room (a shared-memory FIFO the peer has not drained yet) is resumed by
      // progress alone, since no event tells this worker that room appeared and an eager message
      // brings no answer that would (every millisecond while one is in flight); and whatever
      // else a lost wake-up would leave waiting is progressed within kIdleWakeMs (a send over
      // posix stalled until its deadline under load without this, docs/reliability.md).
      pollfd events{event_fd_, POLLIN, 0};
      poll(&events, 1, sends_in_flight_ > 0 ? 1 : kIdleWakeMs);
    } else if (s == UCS_OK && detached_ == 0) {  // (a detached send's deadline needs a clock)
      ucp_worker_wait(worker_);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  if (!in_flight_.empty() || closing_ != 0) {
    PROXIMA_LOG(kWarning) << "UCX worker stopping with work outstanding"
                          << log::Kv("transfers", in_flight_.size())
                          << log::Kv("closing_endpoints", closing_);
  }
}

absl::StatusOr<std::shared_ptr<Registration>> Worker::Register(void* address, size_t length) {
  if (address == nullptr || length == 0) {
    return absl::InvalidArgumentError("cannot register an empty buffer");
  }
  return Map(address, length);
}

absl::StatusOr<std::shared_ptr<Registration>> Worker::Allocate(size_t length) {
  if (length == 0) return absl::InvalidArgumentError("cannot allocate an empty buffer");
  return Map(nullptr, length);
}

absl::StatusOr<std::shared_ptr<Registration>> Worker::Map(void* address, size_t length) {
  struct Result {
    ucs_status_t status = UCS_OK;
    const char* what = "";
    ucp_mem_h memh = nullptr;
    void* address = nullptr;
    std::string rkey;
  };
  auto r = std::make_shared<Result>();
  ucp_context_h ctx = context_;
  std::atomic<int64_t>* live = &live_registrations_;
  bool finished = RunAndWait(
      [r, ctx, address, length, live] {
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = address;
        mp.length = length;
        if (address == nullptr) {  // UCX allocates it, from the memory its transports expose
          mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
          mp.flags = UCP_MEM_MAP_ALLOCATE;
        }
        r->status = ucp_mem_map(ctx, &mp, &r->memh);
        if (r->status != UCS_OK) {
          r->what = "ucp_mem_map";
          return;
        }
        r->address = address;
        if (address == nullptr) {
          ucp_mem_attr_t attr{};
          attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
          r->status = ucp_mem_query(r->memh, &attr);
          if (r->status != UCS_OK || attr.length < length) {
            if (r->status == UCS_OK) r->status = UCS_ERR_NO_MEMORY;
            r->what = "ucp_mem_query";
            ucp_mem_unmap(ctx, r->memh);
            return;
          }
          r->address = attr.address;
        }
        void* buf = nullptr;
        size_t size = 0;
        r->status = ucp_rkey_pack(ctx, r->memh, &buf, &size);
        if (r->status != UCS_OK) {
          r->what = "ucp_rkey_pack";
          ucp_mem_unmap(ctx, r->memh);
          return;
        }
        r->rkey.assign(static_cast<const char*>(buf), size);
        ucp_rkey_buffer_release(buf);

        live->fetch_add(1);
      },
      absl::Now() + kAbortGrace);
  if (!finished) return absl::DeadlineExceededError("UCX worker did not register memory in time");
  if (r->status != UCS_OK) {
    return FromUcs(r->status, absl::StrCat(r->what, " of ", length, " bytes"));
  }
  if (r->rkey.size() > kMaxPackedRkeyBytes) {
    // Our own peers would refuse it; better to say so here.
    std::shared_ptr<Registration> drop(
        new Registration(this, r->memh, r->address, length, std::move(r->rkey),
                         next_registration_id_.fetch_add(1), address == nullptr));
    return absl::FailedPreconditionError("packed rkey is larger than kMaxPackedRkeyBytes");
  }
  return std::shared_ptr<Registration>(
      new Registration(this, r->memh, r->address, length, std::move(r->rkey),
                       next_registration_id_.fetch_add(1), address == nullptr));
}

std::string LaneTransport(std::string_view ep_info, std::span<const std::string_view> names) {
  while (!ep_info.empty()) {
    const size_t eol = std::min(ep_info.find('\n'), ep_info.size());
    const std::string_view line = ep_info.substr(0, eol);
    ep_info.remove_prefix(std::min(eol + 1, ep_info.size()));
    // "#   lane[1]:  1:posix/memory.0 md[1]   -> md[1]/posix/sysdev[255]"
    const size_t lane = line.find("lane[");
    if (lane == std::string_view::npos) continue;
    const size_t colon = line.find("]:", lane);
    if (colon == std::string_view::npos) continue;
    std::string_view rest = line.substr(colon + 2);
    while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t')) rest.remove_prefix(1);
    const size_t index_end = rest.find(':');  // the resource index
    const size_t slash = rest.find('/');
    if (index_end == std::string_view::npos || slash == std::string_view::npos ||
        slash < index_end) {
      continue;
    }
    const std::string_view transport = rest.substr(index_end + 1, slash - index_end - 1);
    for (std::string_view name : names) {
      if (transport == name) return std::string(name);
    }
  }
  return "";
}

absl::StatusOr<std::string> Worker::SharedMemoryTransport(Endpoint& endpoint, absl::Time deadline) {
  auto info = std::make_shared<std::string>();
  auto open = std::make_shared<bool>(false);
  std::shared_ptr<Endpoint::State> state = endpoint.state_;
  const bool finished = RunAndWait(
      [state, info, open] {
        if (state->ep == nullptr) return;
        *open = true;
        char* text = nullptr;
        size_t size = 0;
        FILE* f = open_memstream(&text, &size);
        if (f == nullptr) return;
        ucp_ep_print_info(state->ep, f);
        std::fclose(f);
        info->assign(text, size);
        std::free(text);
      },
      deadline);
  if (!finished) return absl::UnavailableError("UCX worker did not describe the endpoint in time");
  if (!*open) return absl::UnavailableError("the UCX endpoint is closed");
  static constexpr std::string_view kAllocateOnly[] = {"posix", "sysv"};
  return LaneTransport(*info, kAllocateOnly);
}

void Worker::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* state = static_cast<Endpoint::State*>(arg);
  Worker* w = state->worker;
  {
    proxima::MutexLock lock(&state->mu);
    if (state->failure.empty()) {
      state->failure =
          absl::StrCat("UCX peer of endpoint ", state->id, " failed: ", ucs_status_string(status));
    }
  }
  w->peer_failures_.fetch_add(1);
  PROXIMA_LOG(kInfo) << "UCX peer failed; closing its endpoint" << log::Kv("endpoint", state->id)
                     << log::Kv("status", ucs_status_string(status));
  for (auto& e : w->endpoints_) {
    if (e.get() == state) {
      std::shared_ptr<Endpoint::State> keep = e;  // CloseOnWorker erases it from endpoints_
      w->CloseOnWorker(keep, /*force=*/true);
      if (keep->on_failure) keep->on_failure();
      break;
    }
  }
}

void Worker::CloseOnWorker(const std::shared_ptr<Endpoint::State>& state, bool force) {
  {
    proxima::MutexLock lock(&state->mu);
    if (state->failure.empty()) state->failure = absl::StrCat("endpoint ", state->id, " closed");
  }
  endpoints_.erase(std::remove(endpoints_.begin(), endpoints_.end(), state), endpoints_.end());
  std::list<Endpoint::State::CachedRkey> keys;  // transfers still running keep the keys they use
  {
    proxima::MutexLock lock(&state->mu);
    keys.swap(state->rkeys);
  }
  if (state->ep == nullptr) return;
  // A graceful close waits for what is in flight, and a detached send (Sending::Detach) waits
  // for a receiver that may never act: an endpoint dropped with one closes by force (else the
  // close never completes, and ucp_worker_destroy later asserts on the outstanding request).
  for (size_t i = 0; !force && i < in_flight_.size(); ++i) {
    force = in_flight_[i]->detached && in_flight_[i]->endpoint == state;
  }
  if (force && !state->detects_peer_failure) {
    // Forcing needs peer error handling. Leave the endpoint (and what is in flight on it) to
    // ucp_worker_destroy; it stays counted in live_endpoints().
    abandoned_.push_back(state);
    return;
  }
  ucp_ep_h ep = state->ep;
  state->ep = nullptr;
  // The close request keeps the state (the error callback's argument) alive until it completes.
  struct CloseContext {
    Worker* worker;
    std::shared_ptr<Endpoint::State> state;
  };
  auto* ctx = new CloseContext{this, state};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  param.cb.send = [](void* request, ucs_status_t, void* user_data) {
    auto* c = static_cast<CloseContext*>(user_data);
    --c->worker->closing_;
    c->worker->live_endpoints_.fetch_sub(1);
    ucp_request_free(request);
    delete c;
  };
  param.user_data = ctx;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &param);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    live_endpoints_.fetch_sub(1);
    delete ctx;
  } else {
    ++closing_;
  }
}

absl::Status Worker::CheckAddress(const std::string& remote_address, absl::Time deadline) const {
  PROXIMA_RETURN_IF_ERROR(CheckAddressFraming(remote_address, address_));
  if (!check_address_) return absl::OkStatus();
  return check_address_(remote_address, deadline);
}

absl::StatusOr<std::shared_ptr<Endpoint>> Worker::Connect(const std::string& remote_address,
                                                          absl::Time deadline,
                                                          std::function<void()> on_failure,
                                                          bool untrusted) {
  PROXIMA_RETURN_IF_ERROR(untrusted ? CheckAddress(remote_address, deadline)
                                    : CheckAddressFraming(remote_address, address_));
  auto state = std::make_shared<Endpoint::State>();
  state->worker = this;
  state->id = next_endpoint_id_.fetch_add(1);
  state->on_failure = std::move(on_failure);
  auto status = std::make_shared<ucs_status_t>(UCS_OK);
  auto address = std::make_shared<std::vector<char>>(Padded(remote_address));
  bool finished = RunAndWait(
      [this, state, status, address] {
        const std::string remote(address->begin(), address->end());
        const bool known_without = without_peer_handling_.contains(remote);
        *status = known_without ? UCS_ERR_UNREACHABLE
                                : CreateEndpoint(worker_, address->data(), /*peer_handling=*/true,
                                                 &Worker::OnEndpointError, state.get(), &state->ep);
        if (*status == UCS_ERR_UNREACHABLE) {
          // UCX 1.13's shared-memory transports cannot detect a failed peer; without peer error
          // handling they connect, and transfer deadlines bound what a dead peer costs. Decided
          // for this remote worker alone: an address that does not answer (a peer that restarted
          // since) fails the same way, and must not take peer error handling away from this
          // worker's endpoints to every other peer.
          *status = CreateEndpoint(worker_, address->data(), /*peer_handling=*/false, nullptr,
                                   nullptr, &state->ep);
          state->detects_peer_failure = false;
          if (*status == UCS_OK && !known_without) {
            if (without_peer_handling_.size() >= kMaxRemembered) without_peer_handling_.clear();
            without_peer_handling_.insert(remote);
          }
        }
        if (*status != UCS_OK) {
          state->ep = nullptr;
          return;
        }
        live_endpoints_.fetch_add(1);
        endpoints_.push_back(state);
      },
      deadline);
  if (!finished) return absl::UnavailableError("UCX worker did not create the endpoint in time");
  if (*status != UCS_OK) {
    absl::Status s = FromUcs(*status, "cannot create a UCX endpoint to the peer's worker address");
    if (*status == UCS_ERR_UNREACHABLE) return s;
    return absl::InvalidArgumentError(s.message());
  }
  std::shared_ptr<Endpoint> endpoint(new Endpoint(this, state->id, state));
  // An empty transfer is a flush: it completes once the wire-up with the peer is done.
  PROXIMA_RETURN_IF_ERROR(Transfer(*endpoint, {}, {}, nullptr, deadline));
  return endpoint;
}

void Worker::OnOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* st = static_cast<TransferState*>(user_data);
  ucp_request_free(request);
  st->worker->FinishOp(st, status);
}

void Worker::FinishOp(TransferState* st, ucs_status_t status) {
  if (status != UCS_OK && st->result.ok()) {
    st->result = FromUcs(status, Describe(st->endpoint != nullptr ? st->endpoint->id : 0));
  }
  if (--st->pending > 0) return;
  if (!st->headers.empty()) {
    --sends_in_flight_;
    if (st->detached) --detached_;
    if (st->result.ok()) rendezvous_sent_bytes_.fetch_add(st->rendezvous_bytes);
  }
  if (absl::IsUnavailable(st->result) && st->endpoint != nullptr) {
    // The peer is gone or unreachable: later transfers on this endpoint fail fast.
    proxima::MutexLock lock(&st->endpoint->mu);
    if (st->endpoint->failure.empty()) st->endpoint->failure = std::string(st->result.message());
  }
  // A caller that copies through the mappings, or checksums what landed, still needs the keys
  // and the buffers; it releases them.
  if (st->mapped.empty()) st->rkeys.clear();
  if (st->mapped.empty() && !(st->wants_crc && st->result.ok())) st->keep_alive.reset();
  // Erasing may drop the last reference to `st`; notify through a local reference.
  std::shared_ptr<TransferState> self;
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->get() == st) {
      self = std::move(*it);
      in_flight_.erase(it);
      break;
    }
  }
  st->done.Notify();
}

absl::StatusOr<UnpackedRkey> Worker::UnpackRkey(Endpoint::State& endpoint,
                                                const std::string& packed,
                                                uint64_t registration_id) {
  if (registration_id != 0) {
    proxima::MutexLock lock(&endpoint.mu);
    if (UnpackedRkey cached = CachedRkeyLocked(endpoint, packed, registration_id)) return cached;
  }
  std::vector<char> padded = Padded(packed);
  std::vector<int> pinned;  // closed once UCX has mapped what they name
  absl::Cleanup close_pinned = [&pinned] {
    for (int fd : pinned) close(fd);
  };
  PROXIMA_RETURN_IF_ERROR(PinPosixSegments(padded, segment_keys_, &pinned));
  ucp_rkey_h raw = nullptr;
  ucs_status_t s = ucp_ep_rkey_unpack(endpoint.ep, padded.data(), &raw);
  if (s != UCS_OK) return absl::InvalidArgumentError(ucs_status_string(s));
  rkeys_unpacked_.fetch_add(1);
  // Destroyed on the progress thread: a caller's thread that copied through the key (TryDirect)
  // may drop the last reference after the cache let go of it.
  UnpackedRkey rkey(raw, [this](ucp_rkey_h k) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      ucp_rkey_destroy(k);
    } else {
      Post([k] { ucp_rkey_destroy(k); });
    }
  });
  if (registration_id == 0) return rkey;  // for this transfer only
  UnpackedRkey evicted;                   // transfers using it keep it; dropped after the lock
  proxima::MutexLock lock(&endpoint.mu);
  auto& cache = endpoint.rkeys;
  if (cache.size() >= kRkeyCacheSize) {
    evicted = std::move(cache.front().rkey);
    cache.pop_front();
  }
  cache.push_back({registration_id, packed, rkey});
  return rkey;
}

UnpackedRkey Worker::CachedRkeyLocked(Endpoint::State& endpoint, const std::string& packed,
                                      uint64_t registration_id) {
  auto& cache = endpoint.rkeys;
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->registration_id == registration_id && it->packed == packed) {
      cache.splice(cache.end(), cache, it);  // now the most recently used
      return cache.back().rkey;
    }
  }
  return nullptr;
}

absl::Status Worker::CopyAndCount(std::span<const Op> ops, std::span<std::byte* const> mapped) {
  PROXIMA_ASSIGN_OR_RETURN(uint64_t moved, CopyDirect(ops, mapped, copy_pool_));
  direct_bytes_.fetch_add(moved);
  direct_transfers_.fetch_add(1);
  return absl::OkStatus();
}

bool Worker::TryDirect(Endpoint& endpoint, std::span<const std::string> packed_rkeys,
                       std::span<const Op> ops, std::span<const uint64_t> registration_ids,
                       absl::Status* copied) {
  if (ops.empty() || registration_ids.size() != packed_rkeys.size()) return false;
  std::vector<UnpackedRkey> keys;
  keys.reserve(packed_rkeys.size());
  {
    proxima::MutexLock lock(&endpoint.state_->mu);
    if (!endpoint.state_->failure.empty()) return false;  // the slow path reports it
    for (size_t i = 0; i < packed_rkeys.size(); ++i) {
      if (registration_ids[i] == 0) return false;
      UnpackedRkey k = CachedRkeyLocked(*endpoint.state_, packed_rkeys[i], registration_ids[i]);
      if (!k) return false;
      keys.push_back(std::move(k));
    }
  }
  // ucp_rkey_ptr only reads the unpacked key (for shared memory: an offset), which the
  // references above keep alive; it does not touch the worker.
  std::vector<std::byte*> mapped = MapDirect(ops, keys);
  if (mapped.empty()) return false;
  *copied = CopyAndCount(ops, mapped);
  return true;
}

absl::Status Worker::Transfer(Endpoint& endpoint, std::span<const std::string> packed_rkeys,
                              std::vector<Op> ops, std::shared_ptr<const void> keep_alive,
                              absl::Time deadline, std::span<const uint64_t> registration_ids,
                              bool* copied_here, bool mapped_only) {
  if (mapped_only && copied_here == nullptr) {
    return absl::InternalError("Transfer with mapped_only needs copied_here");
  }
  if (copied_here != nullptr) *copied_here = false;
  PROXIMA_RETURN_IF_ERROR(endpoint.health());
  if (!registration_ids.empty() && registration_ids.size() != packed_rkeys.size()) {
    return absl::InvalidArgumentError(absl::StrCat(registration_ids.size(),
                                                   " registration ids for ", packed_rkeys.size(),
                                                   " rkeys; expected none or one per rkey"));
  }
  for (size_t i = 0; i < packed_rkeys.size(); ++i) {
    if (packed_rkeys[i].empty() || packed_rkeys[i].size() > kMaxPackedRkeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("rkey ", i, " is ", packed_rkeys[i].size(),
                                                     " bytes; expected 1..", kMaxPackedRkeyBytes));
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].rkey >= packed_rkeys.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("operation ", i, " names rkey ", ops[i].rkey, " of ", packed_rkeys.size()));
    }
  }
  std::vector<SegmentRange> segments(packed_rkeys.size());
  for (size_t i = 0; i < packed_rkeys.size(); ++i) {
    PROXIMA_RETURN_IF_ERROR(CheckPackedRkey(packed_rkeys[i], own_md_sizes_, i));
    PROXIMA_ASSIGN_OR_RETURN(segments[i], SegmentBounds(packed_rkeys[i], segment_keys_, i));
  }
  // UCX maps such a segment and translates an address into it by adding an offset, checking
  // nothing: an operation outside the segment would touch whatever this process has there.
  for (size_t i = 0; i < ops.size(); ++i) {
    const SegmentRange& seg = segments[ops[i].rkey];
    if (seg.begin == seg.end) continue;
    const uint64_t a = ops[i].remote_address;
    if (a < seg.begin || a > seg.end || ops[i].length > seg.end - a) {
      return absl::InvalidArgumentError(
          absl::StrCat("operation ", i, ": [0x", absl::Hex(a), ", +", ops[i].length,
                       ") lies outside the shared-memory segment [0x", absl::Hex(seg.begin), ", +",
                       seg.end - seg.begin, ") that rkeys[", ops[i].rkey, "] names"));
    }
  }
  // Every key already unpacked and mapped here (a shared-memory peer's buffers seen before): the
  // calling thread copies, and the progress thread is neither woken nor waited for.
  absl::Status copied;
  if (TryDirect(endpoint, packed_rkeys, ops, registration_ids, &copied)) {
    PROXIMA_RETURN_IF_ERROR(copied);
    if (copied_here != nullptr) *copied_here = true;
    return absl::OkStatus();
  }
  auto st = std::make_shared<TransferState>();
  st->worker = this;
  st->endpoint = endpoint.state_;
  st->ops = std::move(ops);
  st->wants_crc = std::any_of(st->ops.begin(), st->ops.end(), [](const Op& op) {
    return op.crc32c != nullptr && op.kind == Op::kGet;
  });
  st->keep_alive = std::move(keep_alive);
  std::vector<std::string> rkeys(packed_rkeys.begin(), packed_rkeys.end());
  std::vector<uint64_t> ids(registration_ids.begin(), registration_ids.end());
  ids.resize(rkeys.size(), 0);
  Post([this, st, rkeys = std::move(rkeys), ids = std::move(ids), mapped_only] {
    ucp_ep_h ep = Begin(st);
    for (size_t i = 0; st->result.ok() && i < rkeys.size(); ++i) {
      absl::StatusOr<UnpackedRkey> rkey = UnpackRkey(*st->endpoint, rkeys[i], ids[i]);
      if (!rkey.ok()) {
        st->result = absl::InvalidArgumentError(
            absl::StrCat("rkeys[", i, "] does not unpack: ", rkey.status().message()));
        break;
      }
      st->rkeys.push_back(*std::move(rkey));
    }
    if (st->result.ok()) st->mapped = MapDirect(st->ops, st->rkeys);
    if (!st->mapped.empty() || mapped_only) {  // the caller copies, or nothing moves
      FinishOp(st.get(), UCS_OK);
      return;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &Worker::OnOpDone;
    param.user_data = st.get();
    for (size_t i = 0; st->result.ok() && i < st->ops.size(); ++i) {
      const Op& op = st->ops[i];
      ucp_request_param_t p = param;
      if (op.local_memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = op.local_memh->memh();
      }
      Track(st.get(), op.kind == Op::kGet ? ucp_get_nbx(ep, op.local, op.length, op.remote_address,
                                              st->rkeys[op.rkey].get(), &p)
                                : ucp_put_nbx(ep, op.local, op.length, op.remote_address,
                                              st->rkeys[op.rkey].get(), &p));
    }
    // The flush completes after every operation above has completed at the peer too.
    if (st->result.ok()) Track(st.get(), ucp_ep_flush_nbx(ep, &param));
    FinishOp(st.get(), UCS_OK);
  });
  if (st->done.WaitForNotificationUntil(absl::ToChronoTime(deadline))) {
    if (!st->result.ok()) return st->result;
    if (!st->mapped.empty()) {
      absl::Status copied = CopyAndCount(st->ops, st->mapped);
      st->keep_alive.reset();
      st->rkeys.clear();  // a last reference is destroyed on the progress thread (UnpackRkey)
      PROXIMA_RETURN_IF_ERROR(copied);
      if (copied_here != nullptr) *copied_here = true;
      return absl::OkStatus();
    }
    if (mapped_only) return absl::OkStatus();  // not mapped: nothing moved
    for (const Op& op : st->ops) {
      if (op.crc32c == nullptr || op.kind == Op::kPut) continue;
      *op.crc32c = Crc32cExtend(*op.crc32c, std::span(op.local, op.length));
    }
    st->keep_alive.reset();
    return absl::OkStatus();
  }
  return AbandonAfterDeadline(*st);
}

ucp_ep_h Worker::Begin(const std::shared_ptr<TransferState>& st) {
  st->pending = 1;  // released by the caller's FinishOp(st, UCS_OK) at the end of its task
  in_flight_.push_back(st);
  ucp_ep_h ep = st->endpoint->ep;
  if (ep == nullptr) {
    proxima::MutexLock lock(&st->endpoint->mu);
    st->result = absl::UnavailableError(st->endpoint->failure);
  }
  return ep;
}

void Worker::Track(TransferState* st, ucs_status_ptr_t r) {
  if (r == nullptr) return;
  if (UCS_PTR_IS_ERR(r)) {
    if (st->result.ok()) {
      st->result =
          FromUcs(UCS_PTR_STATUS(r), Describe(st->endpoint != nullptr ? st->endpoint->id : 0));
    }
    return;
  }
  ++st->pending;
}

void Worker::CloseAfterDeadline(const std::shared_ptr<Endpoint::State>& ep) {
  {
    proxima::MutexLock lock(&ep->mu);
    if (ep->failure.empty()) {
      ep->failure = absl::StrCat("endpoint ", ep->id,
                                 " closed: a transfer did not finish before its deadline");
    }
  }
  CloseOnWorker(ep, /*force=*/true);
}

void Worker::CloseExpiredDetached() {
  const absl::Time now = absl::Now();
  if (now < next_detached_check_) return;
  next_detached_check_ = now + absl::Milliseconds(5);
  // Collected first: closing completes requests, and their FinishOp edits in_flight_.
  std::vector<std::shared_ptr<Endpoint::State>> expired;
  for (const std::shared_ptr<TransferState>& st : in_flight_) {
    if (!st->detached || st->detach_deadline > now) continue;
    st->detached = false;
    --detached_;
    expired.push_back(st->endpoint);
  }
  for (const std::shared_ptr<Endpoint::State>& ep : expired) {
    PROXIMA_LOG(kWarning) << "UCX peer did not take its rendezvous messages before their "
                             "deadline; closing the endpoint"
                          << log::Kv("endpoint", ep->id);
    CloseAfterDeadline(ep);
  }
}

void Worker::CloseAndAwait(TransferState& st, const std::shared_ptr<Endpoint::State>& ep) {
  Post([this, ep] { CloseAfterDeadline(ep); });
  if (!st.done.WaitForNotificationUntil(absl::ToChronoTime(absl::Now() + kAbortGrace))) {
    PROXIMA_LOG(kWarning) << "UCX transfer still outstanding after its endpoint was closed; its "
                             "buffers stay allocated until it completes"
                          << log::Kv("endpoint", ep->id);
  }
}

absl::Status Worker::AbandonAfterDeadline(TransferState& st) {
  // Past the deadline: close the endpoint by force, which completes what is in flight.
  const std::shared_ptr<Endpoint::State>& ep = st.endpoint;
  CloseAndAwait(st, ep);
  return absl::UnavailableError(
      absl::StrCat("UCX transfer on endpoint ", ep->id,
                   " did not finish before the call's deadline; the endpoint is closed"));
}

absl::Status Worker::Send(Endpoint& endpoint, uint64_t transfer, std::vector<Message> messages,
                          std::shared_ptr<const void> keep_alive, absl::Time deadline) {
  PROXIMA_ASSIGN_OR_RETURN(
      std::unique_ptr<Sending> sending,
      StartSend(endpoint, transfer, std::move(messages), std::move(keep_alive)));
  return sending->Wait(deadline);
}

absl::StatusOr<std::unique_ptr<Sending>> Worker::StartSend(Endpoint& endpoint, uint64_t transfer,
                                                           std::vector<Message> messages,
                                                           std::shared_ptr<const void> keep_alive) {
  if (transfer == 0) return absl::InvalidArgumentError("UCX messages for transfer 0");
  PROXIMA_RETURN_IF_ERROR(endpoint.health());
  auto st = std::make_shared<TransferState>();
  st->worker = this;
  st->endpoint = endpoint.state_;
  auto sending = std::make_shared<Sending::State>();
  sending->worker = this;
  sending->transfer = st;
  if (messages.empty()) {
    st->done.Notify();
    return std::unique_ptr<Sending>(new Sending(std::move(sending)));
  }
  st->keep_alive = std::move(keep_alive);
  st->headers.resize(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    st->headers[i].slot = messages[i].slot;
    st->headers[i].transfer = transfer;
    if (messages[i].rendezvous) st->rendezvous_bytes += messages[i].size();
  }
  Post([this, st, messages = std::move(messages)] {
    ucp_ep_h ep = Begin(st);
    ++sends_in_flight_;  // until FinishOp's last count
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &Worker::OnOpDone;
    param.user_data = st.get();
    for (size_t i = 0; st->result.ok() && i < messages.size(); ++i) {
      ucp_request_param_t p = param;
      // Eager unless asked: a rendezvous message completes only once the receiver has taken it.
      p.flags = messages[i].rendezvous ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
      const void* buffer = messages[i].bytes.data();
      size_t count = messages[i].bytes.size();
      if (!messages[i].pieces.empty()) {  // gathered by UCX as it sends
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
        buffer = KeepIov(st->iovs, std::span(messages[i].pieces));
        count = messages[i].pieces.size();
      } else if (messages[i].memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = messages[i].memh->memh();
      }
      Track(st.get(), ucp_am_send_nbx(ep, kMessageAmId, &st->headers[i], sizeof(MessageHeader),
                                      buffer, count, &p));
    }
    FinishOp(st.get(), UCS_OK);
  });
  return std::unique_ptr<Sending>(new Sending(std::move(sending)));
}

size_t Message::size() const {
  size_t n = bytes.size();
  for (std::span<const std::byte> piece : pieces) n += piece.size();
  return n;
}

size_t Destination::size() const {
  size_t n = 0;
  for (std::span<std::byte> piece : pieces) n += piece.size();
  return n;
}

Sending::~Sending() = default;

void Sending::Detach(absl::Time deadline) {
  Worker* w = state_->worker;
  // Runs after StartSend's task (the progress thread runs tasks in order): still pending means
  // still in flight.
  w->Post([w, st = state_->transfer, deadline] {
    if (st->pending <= 0 || st->detached) return;
    st->detached = true;
    st->detach_deadline = deadline;
    ++w->detached_;
  });
}

absl::Status Sending::Wait(absl::Time deadline) {
  Worker::TransferState& st = *state_->transfer;
  if (!st.done.WaitForNotificationUntil(absl::ToChronoTime(deadline))) {
    return state_->worker->AbandonAfterDeadline(st);
  }
  return st.result;
}

absl::Status Worker::Receive(std::span<const std::shared_ptr<const Parcel>> parcels,
                             std::span<const Destination> dst,
                             std::shared_ptr<const void> keep_alive, absl::Time deadline,
                             Endpoint* sender) {
  if (dst.size() != parcels.size()) {
    return absl::InvalidArgumentError(absl::StrCat("UCX Receive: ", parcels.size(),
                                                   " messages and ", dst.size(), " destinations"));
  }
  for (size_t i = 0; i < parcels.size(); ++i) {
    const Parcel* parcel = parcels[i].get();
    if (parcel == nullptr || !parcel->pending() || parcel->ucx_data_ == nullptr ||
        parcel->worker_ != this) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX Receive: message ", i, " is not a rendezvous message of this worker left to take"));
    }
    if (dst[i].size() != parcel->size()) {
      return absl::InvalidArgumentError(absl::StrCat("UCX Receive: message ", i, " is ",
                                                     parcel->size(), " bytes; its destination is ",
                                                     dst[i].size(), " bytes"));
    }
  }
  if (parcels.empty()) return absl::OkStatus();
  auto st = std::make_shared<TransferState>();
  st->worker = this;
  st->keep_alive = std::move(keep_alive);
  if (sender != nullptr) st->sender = sender->state_;
  struct Target {
    void* descriptor;
    void* buffer;  // the bytes, or the IOV array (st->iovs) of a destination in pieces
    size_t count;  // bytes, or IOV entries
    bool iov;
    ucp_mem_h memh;
  };
  std::vector<Target> targets;
  targets.reserve(parcels.size());
  for (size_t i = 0; i < parcels.size(); ++i) {
    Target t{parcels[i]->ucx_data_, nullptr, 0, dst[i].pieces.size() > 1, nullptr};
    if (t.iov) {
      t.buffer = KeepIov(st->iovs, std::span(dst[i].pieces));
      t.count = dst[i].pieces.size();
    } else if (!dst[i].pieces.empty()) {
      t.buffer = dst[i].pieces[0].data();
      t.count = dst[i].pieces[0].size();
      if (dst[i].memh != nullptr) t.memh = dst[i].memh->memh();
    }
    targets.push_back(t);
    parcels[i]->ucx_data_ = nullptr;  // taken: UCX frees it once the bytes have moved
  }
  Post([this, st, targets = std::move(targets)] {
    st->pending = 1;  // released by the FinishOp(st, UCS_OK) below
    in_flight_.push_back(st);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = &Worker::OnReceived;
    param.user_data = st.get();
    for (const Target& t : targets) {
      if (!st->result.ok()) {  // nothing more is asked for: the rest tell their senders so
        ucp_am_data_release(worker_, t.descriptor);
        continue;
      }
      ucp_request_param_t p = param;
      if (t.iov) {  // scattered by UCX as the bytes arrive
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
      } else if (t.memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = t.memh;
      }
      Track(st.get(), ucp_am_recv_data_nbx(worker_, t.descriptor, t.buffer, t.count, &p));
    }
    FinishOp(st.get(), UCS_OK);
  });
  if (!st->done.WaitForNotificationUntil(absl::ToChronoTime(deadline))) {
    if (st->sender != nullptr) CloseAndAwait(*st, st->sender);
    return absl::UnavailableError(
        absl::StrCat("the bytes of ", parcels.size(),
                     " UCX rendezvous messages did not all arrive before the call's deadline",
                     st->sender != nullptr ? "; the endpoint to their sender is closed" : ""));
  }
  if (st->result.ok()) {
    uint64_t moved = 0;
    for (const Destination& d : dst) moved += d.size();
    rendezvous_bytes_.fetch_add(moved);
  }
  return st->result;
}

void Worker::OnReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  auto* st = static_cast<TransferState*>(user_data);
  ucp_request_free(request);
  st->worker->FinishOp(st, status);
}

uint64_t Worker::NewTransferId() {
  uint64_t id = 0;
  while (id == 0) id = next_transfer_id_.fetch_add(1);
  return id;
}

uint64_t Worker::parked_bytes() const {
  proxima::MutexLock lock(&parked_mu_);
  return parked_bytes_;
}

Parcel::~Parcel() {
  if (ucx_data_ == nullptr) return;
  Worker* w = worker_;
  void* data = ucx_data_;
  w->Post([w, data] { ucp_am_data_release(w->worker_, data); });
}

uint32_t Parcel::CopyTo(std::span<std::byte> dst, size_t offset, uint32_t crc) const {
  assert(!pending_ && offset + dst.size() <= size_);
  return Crc32cCopy(dst, bytes_.subspan(offset, dst.size()), crc);
}

void Worker::DropStaleLocked(absl::Time now, std::vector<std::shared_ptr<Parcel>>* dropped) {
  last_stale_check_ = now;
  for (auto it = parked_.begin(); it != parked_.end();) {
    auto current = it++;
    Inbox& inbox = current->second;
    if (inbox.waiter != nullptr || now - inbox.opened < kParkedFor) continue;
    for (auto& [slot, parcel] : inbox.slots) {
      parked_bytes_ -= ParkedBytes(*parcel);
      messages_dropped_.fetch_add(1);
      dropped->push_back(std::move(parcel));
    }
    parked_.erase(current);
  }
  absl::erase_if(collected_, [now](const auto& entry) { return now - entry.second >= kParkedFor; });
}

ucs_status_t Worker::OnMessage(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
  auto* w = static_cast<Worker*>(arg);
  MessageHeader h;
  // A message dropped here is released by UCX when this returns UCS_OK; for a rendezvous one,
  // UCX then tells its sender, whose send completes.
  if (header_length != sizeof h) {
    w->messages_dropped_.fetch_add(1);
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof h);
  if (h.magic != kMessageMagic || h.transfer == 0) {
    w->messages_dropped_.fetch_add(1);
    return UCS_OK;
  }
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  std::vector<std::shared_ptr<Parcel>> dropped;  // destroyed after the lock is released
  std::shared_ptr<proxima::Notification> waiter;
  ucs_status_t keep = UCS_OK;
  {
    proxima::MutexLock lock(&w->parked_mu_);
    const absl::Time now = absl::Now();
    if (now - w->last_stale_check_ >= kStaleCheckEvery) w->DropStaleLocked(now, &dropped);
    if (w->collected_.contains(h.transfer)) {  // a late message: its collector is gone
      w->messages_dropped_.fetch_add(1);
      return UCS_OK;
    }
    auto [it, opened] = w->parked_.try_emplace(h.transfer);
    if (opened) it->second.opened = now;
    Inbox& inbox = it->second;
    const uint64_t cost = rendezvous ? kPendingParcelBytes : length;
    if (w->parked_bytes_ + cost > kMaxParkedBytes || inbox.slots.contains(h.slot)) {
      w->messages_dropped_.fetch_add(1);
      if (opened) w->parked_.erase(it);
      return UCS_OK;
    }
    auto parcel = std::shared_ptr<Parcel>(new Parcel(w));
    parcel->size_ = length;
    if (rendezvous) {  // only the header is here: `data` is UCX's handle for the bytes
      parcel->ucx_data_ = data;
      parcel->pending_ = true;
      keep = UCS_INPROGRESS;
    } else if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0) {
      parcel->ucx_data_ = data;  // UCX keeps the descriptor until ucp_am_data_release
      keep = UCS_INPROGRESS;
      parcel->bytes_ = std::span(static_cast<const std::byte*>(data), length);
    } else {
      const auto* bytes = static_cast<const std::byte*>(data);
      parcel->copy_.assign(bytes, bytes + length);
      parcel->bytes_ = parcel->copy_;
    }
    inbox.slots.emplace(h.slot, std::move(parcel));
    w->parked_bytes_ += cost;
    waiter = inbox.waiter;
  }
  if (waiter != nullptr) waiter->Notify();
  return keep;
}

std::vector<std::shared_ptr<const Parcel>> Worker::Collect(uint64_t transfer,
                                                           std::span<const uint32_t> slots,
                                                           absl::Time deadline,
                                                           const Endpoint* sender) {
  std::vector<std::shared_ptr<const Parcel>> out(slots.size());
  std::vector<std::shared_ptr<Parcel>> dropped;  // destroyed after the lock is released
  for (;;) {
    std::shared_ptr<proxima::Notification> arrived;
    {
      proxima::MutexLock lock(&parked_mu_);
      auto it = parked_.find(transfer);
      size_t have = 0;
      if (it != parked_.end()) {
        for (uint32_t slot : slots) have += it->second.slots.contains(slot) ? 1 : 0;
      }
      const absl::Time now = absl::Now();
      const bool sender_gone = sender != nullptr && !sender->health().ok();
      if (have == slots.size() || now >= deadline || sender_gone) {
        collected_[transfer] = now;
        if (it == parked_.end()) break;
        Inbox& inbox = it->second;
        for (size_t i = 0; i < slots.size(); ++i) {
          auto found = inbox.slots.find(slots[i]);
          if (found == inbox.slots.end()) continue;
          parked_bytes_ -= ParkedBytes(*found->second);
          out[i] = std::move(found->second);
          inbox.slots.erase(found);
        }
        for (auto& [slot, parcel] : inbox.slots) {
          parked_bytes_ -= ParkedBytes(*parcel);
          messages_dropped_.fetch_add(1);
          dropped.push_back(std::move(parcel));
        }
        parked_.erase(it);
        break;
      }
      if (it == parked_.end()) {
        it = parked_.try_emplace(transfer).first;
        it->second.opened = absl::Now();
      }
      arrived = it->second.waiter = std::make_shared<proxima::Notification>();
    }
    const absl::Time wake =
        sender != nullptr ? std::min(deadline, absl::Now() + kSenderCheckEvery) : deadline;
    arrived->WaitForNotificationUntil(absl::ToChronoTime(wake));
  }
  return out;
}

}  // namespace proxima::ucx
