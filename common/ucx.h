// ucx::Worker: Proxima's one way of using UCX (the data plane of DESIGN.md section 3), shared by
// proximad and libproxima.
//
// A Worker owns one ucp_context and one ucp_worker, driven by one progress thread: every UCX call
// that touches the worker (endpoint creation, rkey unpacking, one-sided puts and gets, closing)
// runs on that thread. Other threads hand it work and wait for the answer with a deadline, as
// UCX's own examples do with one worker per progress thread.
//
//  - Register() maps a buffer with ucp_mem_map and packs its remote key (rkey), so a peer can
//    read or write it with one-sided operations. The registration lives as long as its handle:
//    a transfer using it holds a reference, so dropping the handle mid-transfer defers the unmap
//    until the transfer is over.
//  - Connect() opens an endpoint to a peer's worker address, with peer error handling: when the
//    peer dies the endpoint fails, its in-flight operations complete with an error, and the
//    endpoint's failure callback runs (on the progress thread).
//  - Transfer() runs a batch of one-sided gets (remote -> local) and puts (local -> remote)
//    against packed rkeys, then flushes, so that on success every byte has landed on both sides.
//    Past its deadline the endpoint is closed by force, which completes what is still in flight;
//    the local buffers (held by `keep_alive`) are released only once UCX no longer touches them.
//    When every remote buffer of a batch is shared memory this process has mapped (UCX-allocated
//    memory of a peer on the same host, over posix or sysv: ucp_rkey_ptr), the calling thread
//    copies the bytes itself instead, checksumming them as it copies where asked: no fragments,
//    and transfers of several callers run in parallel. A batch of more than one piece (256 KiB)
//    is copied by the caller together with whichever of the worker's copy helpers are free
//    (CopyPool; Create's `copy_helpers`), so one caller's large transfer is not held to one core.
//    Once the endpoint holds those keys unpacked (after the first transfer naming them with a
//    registration id), the calling thread looks them up and maps the addresses itself, and the
//    progress thread is not involved at all; the key's last reference is still released on the
//    progress thread.
//  - Send() and Collect() move bytes as messages instead (UCX active messages): the sender
//    names a transfer id and a slot per message; the receiver's worker keeps what arrives
//    (parked, without copying where UCX allows it) until Collect() takes the slots of a
//    transfer. Unlike the one-sided operations, nothing on either side answers the other from
//    inside UCX: over transports that emulate one-sided operations with messages (tcp), the
//    target of a put or get answers its initiator from a UCX handler, and UCX aborts the whole
//    process when that initiator has died (docs/cluster.md; tools/ucx_repro). A message to or
//    from a dead peer only fails, or is never collected. Daemons move blocks between each other
//    this way. Messages are eager (the bytes arrive with them) unless the sender asks for
//    rendezvous (StartSend): then only a header arrives, and the receiver, once it has collected
//    it and knows where the bytes belong, has UCX move them straight there (Receive); UCX's
//    protocol for that ends with an error, not an abort, when either side dies mid-way
//    (tools/ucx_repro --op=am-rndv*).
//
// Thread-safe: every public method may be called from any thread except the progress thread.
#ifndef PROXIMA_COMMON_UCX_H_
#define PROXIMA_COMMON_UCX_H_

#include <ucp/api/ucp.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/copy_pool.h"
#include "common/mutex.h"

namespace proxima::ucx {

class Worker;

// Converts a UCX status to an absl::Status with `what` in front of UCX's description. Failures
// of the peer or the path to it are UNAVAILABLE (retryable elsewhere).
absl::Status FromUcs(ucs_status_t status, const std::string& what);

// The transport of the endpoint's first lane that runs over one of `names`, read from UCX's text
// description of the endpoint (ucp_ep_print_info: lines "lane[i]: <rsc>:<transport>/<device> ...");
// "" when no lane uses one of them.
std::string LaneTransport(std::string_view ep_info, std::span<const std::string_view> names);

// The largest packed rkey Proxima accepts from a peer. UCX's rkey_unpack takes no length, so
// packed keys are copied into a zero-padded buffer of this size plus headroom before unpacking.
inline constexpr size_t kMaxPackedRkeyBytes = 1024;
// The longest worker address Proxima accepts from a peer (UCX 1.13's are a few hundred bytes).
inline constexpr size_t kMaxWorkerAddressBytes = 64 * 1024;

// A buffer registered with a Worker's context. Move-only through its shared_ptr handle.
class Registration {
 public:
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  void* address() const { return address_; }
  size_t length() const { return length_; }
  // The packed remote key a peer needs to access this buffer.
  const std::string& packed_rkey() const { return rkey_; }
  // Whether [p, p + n) lies inside the buffer.
  bool Contains(const void* p, size_t n) const;
  ucp_mem_h memh() const { return memh_; }
  // Unique among this worker's registrations (never 0); a peer keys its unpacked rkeys by it.
  uint64_t id() const { return id_; }
  // Whether UCX allocated the memory (Worker::Allocate) rather than registering the caller's.
  bool allocated() const { return allocated_; }

 private:
  friend class Worker;
  Registration(Worker* worker, ucp_mem_h memh, void* address, size_t length, std::string rkey,
               uint64_t id, bool allocated)
      : worker_(worker),
        memh_(memh),
        address_(address),
        length_(length),
        rkey_(std::move(rkey)),
        id_(id),
        allocated_(allocated) {}
  Worker* const worker_;
  ucp_mem_h const memh_;
  void* const address_;
  const size_t length_;
  const std::string rkey_;
  const uint64_t id_;
  const bool allocated_;
};

// A connection to a peer's worker. Closed when the last handle is dropped.
class Endpoint {
 public:
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // OK while usable; UNAVAILABLE naming the cause once the peer failed or the endpoint was closed.
  absl::Status health() const;
  uint64_t id() const { return id_; }
  // Whether UCX reports the peer's failure on this endpoint (peer error handling). False where
  // the transports that reach the peer cannot detect one (UCX 1.13's shared memory alone): a
  // dead peer then shows only as transfers that miss their deadlines.
  bool detects_peer_failure() const;

 private:
  friend class Worker;
  struct State;
  Endpoint(Worker* worker, uint64_t id, std::shared_ptr<State> state)
      : worker_(worker), id_(id), state_(std::move(state)) {}
  Worker* const worker_;
  const uint64_t id_;
  std::shared_ptr<State> state_;
};

// One message as it arrived (Worker::Collect). An eager message's bytes are here: held in UCX's
// receive descriptor, or in a copy where UCX does not let them be held. A rendezvous message's
// bytes are still at the sender (pending()): Worker::Receive moves them straight into the
// receiver's memory. Released (on the worker's progress thread) when the last handle is dropped;
// a pending message dropped unreceived tells its sender, whose send then completes. Every handle
// must be dropped before the Worker.
class Parcel {
 public:
  ~Parcel();
  Parcel(const Parcel&) = delete;
  Parcel& operator=(const Parcel&) = delete;

  // The message's length, whether its bytes are here or not.
  size_t size() const { return size_; }
  // Whether the bytes are still at the sender (a rendezvous message): bytes() is then empty.
  bool pending() const { return pending_; }
  std::span<const std::byte> bytes() const { return bytes_; }
  // Copies bytes [offset, offset + dst.size()) of the message into `dst`, folding their CRC32C
  // into `crc` (Crc32cCopy), and returns it. REQUIRES: !pending(), the range within size().
  uint32_t CopyTo(std::span<std::byte> dst, size_t offset = 0, uint32_t crc = 0) const;

 private:
  friend class Worker;
  explicit Parcel(Worker* worker) : worker_(worker) {}
  Worker* const worker_;
  // UCX's descriptor, when held (an eager message's bytes, or a pending message's handle). A
  // Receive takes it: UCX frees it once the bytes have moved.
  mutable void* ucx_data_ = nullptr;
  std::vector<std::byte> copy_;
  std::span<const std::byte> bytes_;
  size_t size_ = 0;
  bool pending_ = false;
};

// One message of a Send: `bytes` for slot `slot` of the transfer.
struct Message {
  uint32_t slot = 0;
  std::span<const std::byte> bytes;
  // A registration of this worker covering `bytes`, if the caller has one: UCX then need not
  // look the memory up in its registration cache.
  const Registration* memh = nullptr;
  // Rendezvous: only the message's header travels now; the receiver moves the bytes when it has
  // decided where they go (Worker::Receive), and the send completes only then, or when the
  // receiver drops the message. Eager (false): the bytes travel at once and the receiver holds
  // them until it collects them (a copy more, into memory UCX allocates per message).
  bool rendezvous = false;
  // Instead of `bytes` (then empty): the message is these pieces in order, e.g. a block spread
  // over one buffer per layer. UCX gathers them as it sends (an IOV datatype), with no copy
  // here; `memh` is not used.
  std::vector<std::span<const std::byte>> pieces;
  // The message's length: `bytes`, or its pieces together.
  size_t size() const;
};

// Where Worker::Receive puts one message: one span, or several in order that UCX scatters the
// bytes into as they arrive (an IOV datatype). `memh` (may be null): a registration of the
// receiving worker covering a single span; not used for several.
struct Destination {
  std::vector<std::span<std::byte>> pieces;
  const Registration* memh = nullptr;
  size_t size() const;
};

// The messages of a Worker::StartSend on their way.
class Sending {
 public:
  ~Sending();
  Sending(const Sending&) = delete;
  Sending& operator=(const Sending&) = delete;

  // Waits until UCX no longer needs the bytes: each message sent, or, for a rendezvous one,
  // received or dropped by the receiver. Past `deadline` the endpoint is closed by force
  // (UNAVAILABLE), which ends what is in flight. The status of Worker::Send.
  absl::Status Wait(absl::Time deadline);
  // Leaves the sends to the worker instead of waiting: the handle may be dropped, and if UCX
  // still holds any of the messages at `deadline` (a receiver that neither took nor dropped a
  // rendezvous message), the progress thread closes the endpoint by force, which ends them and
  // releases the bytes' keep-alive. An endpoint without peer error handling (UCX 1.13's shared
  // memory) cannot be closed so: its sends then end only when the receiver acts. For a sender
  // that answers first and lets the receiver take the bytes after (a daemon's rendezvous gets).
  // Call at most once, instead of Wait.
  void Detach(absl::Time deadline);

 private:
  friend class Worker;
  struct State;
  explicit Sending(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// One one-sided operation of a Transfer.
struct Op {
  enum Kind { kGet, kPut } kind = kGet;  // kGet: remote -> local; kPut: local -> remote
  std::byte* local = nullptr;
  size_t length = 0;
  uint64_t remote_address = 0;
  uint32_t rkey = 0;                         // index into Transfer()'s packed_rkeys
  const Registration* local_memh = nullptr;  // registration covering `local`, if any (faster)
  // When set, the CRC32C of the bytes moved is folded into *crc32c (Crc32cExtend; operations
  // naming the same word fold in their order in the batch), computed while copying when the
  // bytes are copied directly; else, for a kGet, over `local` once the batch has landed, and for
  // a kPut not at all (the caller's own bytes; Transfer's `copied_here` says whether it was
  // computed). Written only when Transfer() succeeds.
  uint32_t* crc32c = nullptr;
};

// Whether UCX may pick tcp under this UCX_TLS value (null or empty: UCX's default list, which has
// it; "^a,b": everything but a and b). Worker::Create asks for 64 KiB tcp segments only then:
// UCX warns about a setting for a transport it did not load.
bool MayUseTcp(const char* tls);

// How a memory domain's packed keys describe the shared-memory segment they name (UCX 1.13's
// posix and sysv layouts), or kNone: keys that name no segment (tcp, cma, ordinary memory).
enum class SegmentKey : int8_t { kNone, kPosix, kSysv };

// The child's half of AddressCheck (common/ucx_address_check.h): opens a context and worker as
// Worker::Create does and creates an endpoint to `address` as Worker::Connect does, closing
// nothing. Returns 0 once UCX returned from parsing the address (with an endpoint or an error
// status), or one of the codes below; a UCX assertion or fault ends the process instead.
int ParseAddressInThisProcess(const std::string& address);
inline constexpr int kAddressCheckBadInput = 3;     // empty, or longer than any address
inline constexpr int kAddressCheckCannotStart = 4;  // UCX's context or worker did not open

// This process's PID and IPC namespaces: the inodes of /proc/self/ns/{pid,ipc}, as UCX compares
// them (0 where they cannot be read). UCX's posix transport reaches a peer only in the same PID
// namespace; a System V segment id names a segment only in its IPC namespace.
uint64_t PidNamespace();
uint64_t IpcNamespace();

class Worker {
 public:
  // Creates the context (RMA + wakeup features), the worker and its progress thread. `name`
  // shows in UCX's logs. Transports follow UCX's environment (UCX_TLS, ...). `copy_helpers`:
  // threads that help callers copy through mapped shared memory (0: callers copy alone).
  // `check_address` (may be empty): runs in CheckAddress() on every address that passed
  // Proxima's own framing checks, before this process's UCX parses it (proximad: AddressCheck,
  // a child process parses a client's or peer's address first).
  static absl::StatusOr<std::unique_ptr<Worker>> Create(
      const std::string& name, int copy_helpers = 0,
      std::function<absl::Status(const std::string&, absl::Time)> check_address = {});
  // Closes every endpoint, waits (bounded) for in-flight work, and releases the worker and the
  // context. REQUIRES: every Registration and Endpoint handle has been dropped.
  ~Worker();

  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // This worker's address, to hand to a peer (over gRPC) so it can Connect() here.
  const std::string& address() const { return address_; }
  // `packed` (a key this worker packed) without its posix part (`posix`) and its System V part
  // (`sysv`), for a peer that cannot reach this process's segments of that kind: in another PID
  // namespace UCX skips the posix part; in another IPC namespace the sysv part names a segment
  // id of this one. proximad checks every part against its own and refuses or opens what they
  // name. Unchanged when it has no such part, or nothing else.
  std::string WithoutSegmentParts(const std::string& packed, bool posix, bool sysv) const;

  // Registers [address, address + length) for remote access.
  absl::StatusOr<std::shared_ptr<Registration>> Register(void* address, size_t length);
  // Allocates `length` bytes that UCX chose (shared memory its transports can map, where the
  // context has such a transport) and registers them; freed when the registration is dropped.
  absl::StatusOr<std::shared_ptr<Registration>> Allocate(size_t length);

  // Opens an endpoint to the worker at `remote_address` and checks that the peer answers (a
  // flush) before `deadline`. `on_failure` (may be empty) runs on the progress thread when the
  // peer fails later; it must not block. INVALID_ARGUMENT when the address is malformed,
  // UNAVAILABLE when the peer cannot be reached. `untrusted`: the address came over the network
  // and was not checked yet, so CheckAddress() runs on it first.
  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(const std::string& remote_address,
                                                    absl::Time deadline,
                                                    std::function<void()> on_failure = {},
                                                    bool untrusted = false);

  // Whether Connect() may hand `remote_address` to this process's UCX: Proxima's framing checks,
  // then Create's `check_address` (waiting for it until `deadline`; a deadline already past
  // asks without waiting). OK without a `check_address`; its errors otherwise.
  absl::Status CheckAddress(const std::string& remote_address, absl::Time deadline) const;

  // Runs `ops` on `endpoint` and flushes, or copies them on the calling thread when every remote
  // buffer is mapped here (see the top of this file). `keep_alive` owns the local buffers; it is
  // released when UCX no longer accesses them (which can be after this returns when the deadline
  // passed).
  // INVALID_ARGUMENT when a packed rkey does not unpack or, on a copy through mapped memory, the
  // peer's memory faulted under it (a segment the peer truncated, or an address outside it:
  // SIGBUS or SIGSEGV, caught; the local bytes are then partly written), UNAVAILABLE when the peer
  // failed or the deadline passed (the endpoint is then closed). `registration_ids` (empty, or one
  // per packed rkey): the peer's Registration::id() of each key; the endpoint keeps keys with an id
  // unpacked for later transfers naming the same id and bytes (unpacking can be costly: over shared
  // memory it maps the peer's segment, whose every page then faults again). Keys without one (0)
  // are unpacked for this transfer only. `copied_here` (may be null) is set on success: whether the
  // calling thread copied the bytes itself (every remote buffer mapped here). `mapped_only`:
  // copy through mapped memory or not at all: when some remote buffer is not mapped here,
  // nothing moves, no UCX operation is posted, and Transfer returns OK with *copied_here false
  // (REQUIRES copied_here then). Callers that must never be the initiator of a one-sided
  // operation over an emulating transport use it and move the bytes as messages otherwise.
  absl::Status Transfer(Endpoint& endpoint, std::span<const std::string> packed_rkeys,
                        std::vector<Op> ops, std::shared_ptr<const void> keep_alive,
                        absl::Time deadline, std::span<const uint64_t> registration_ids = {},
                        bool* copied_here = nullptr, bool mapped_only = false);

  // Sends each message to the peer's worker, for `transfer` (nonzero, chosen by the receiver:
  // NewTransferId) at its slot, and waits until UCX no longer needs the bytes (sent; not
  // necessarily received: the receiver collects them). `keep_alive` owns the bytes, as for
  // Transfer. UNAVAILABLE when the peer failed or the deadline passed (the endpoint is then
  // closed); INVALID_ARGUMENT for transfer 0. REQUIRES: no message is a rendezvous one (its send
  // would wait for a receiver that has not been told yet: use StartSend).
  absl::Status Send(Endpoint& endpoint, uint64_t transfer, std::vector<Message> messages,
                    std::shared_ptr<const void> keep_alive, absl::Time deadline);
  // Send's first half: posts the messages and returns; Sending::Wait is the second. The caller
  // tells the receiver about the transfer in between (a rendezvous message completes only once
  // the receiver has taken its bytes). Errors found before anything was posted (transfer 0, the
  // endpoint already failed) are returned here.
  absl::StatusOr<std::unique_ptr<Sending>> StartSend(Endpoint& endpoint, uint64_t transfer,
                                                     std::vector<Message> messages,
                                                     std::shared_ptr<const void> keep_alive);

  // Moves the bytes of pending (rendezvous) messages from their senders into `dst`, one
  // destination per parcel, each exactly the parcel's size(), and waits for them until
  // `deadline`. `keep_alive` owns the destinations: UCX may still write into them after a deadline
  // passed, so it is released only when UCX is done with them. Each parcel is consumed (its handle
  // no longer tells the sender anything when dropped). UNAVAILABLE when a sender failed mid-way or
  // the deadline passed (the destinations' bytes are then undefined); INVALID_ARGUMENT when a
  // parcel is not pending or its destination's size differs. `sender` (may be null): an endpoint to
  // the peer that sent the parcels; past the deadline it is closed by force, which stops the bytes
  // still on their way (use it where `keep_alive` cannot own the destinations: after that, UCX
  // writes no more into them once Receive has returned).
  absl::Status Receive(std::span<const std::shared_ptr<const Parcel>> parcels,
                       std::span<const Destination> dst, std::shared_ptr<const void> keep_alive,
                       absl::Time deadline, Endpoint* sender = nullptr);

  // A transfer id for peers to Send() to this worker: random, nonzero.
  uint64_t NewTransferId();

  // Waits (until `deadline`) for the messages of `transfer` at `slots` and takes them: one entry
  // per slot, null for one that did not arrive in time. Messages of the transfer at other slots,
  // and any that arrive later, are dropped. Messages nobody collects are dropped once older than
  // kParkedFor (looked for as later messages arrive); past kMaxParkedBytes of uncollected bytes,
  // new messages are dropped.
  // `sender` (may be null): an endpoint to the peer that sends the messages; once it has failed,
  // waiting ends early (checked every kSenderCheckEvery): what is missing will not come.
  std::vector<std::shared_ptr<const Parcel>> Collect(uint64_t transfer,
                                                     std::span<const uint32_t> slots,
                                                     absl::Time deadline,
                                                     const Endpoint* sender = nullptr);
  static constexpr absl::Duration kSenderCheckEvery = absl::Milliseconds(50);
  static constexpr absl::Duration kParkedFor = absl::Seconds(30);
  static constexpr uint64_t kMaxParkedBytes = uint64_t{1} << 30;

  // Bytes of messages that arrived and are not collected yet (a pending one counts 256, an
  // estimate of the descriptor UCX keeps for it), and messages dropped on arrival
  // (malformed, a slot that already arrived, over kMaxParkedBytes) or uncollected (since start).
  uint64_t parked_bytes() const;
  uint64_t messages_dropped() const { return messages_dropped_.load(); }
  // Bytes that Receive() moved from rendezvous messages' senders (since start).
  uint64_t rendezvous_bytes() const { return rendezvous_bytes_.load(); }
  // Bytes of rendezvous messages this worker sent that their receivers took (since start).
  uint64_t rendezvous_sent_bytes() const { return rendezvous_sent_bytes_.load(); }

  // The shared-memory transport ("posix", "sysv") that one of the endpoint's lanes runs over,
  // "" when none does (tcp, or a peer on another host). UCX 1.13's posix and sysv domains reach
  // only memory UCX allocated: a one-sided operation on a peer's ordinary memory over such an
  // endpoint is emulated with messages that the peer's progress thread must serve. Read from
  // UCX's description of the endpoint's lanes (ucp_ep_print_info). UNAVAILABLE when the
  // endpoint is closed or the worker does not answer before `deadline`.
  absl::StatusOr<std::string> SharedMemoryTransport(Endpoint& endpoint, absl::Time deadline);

  // Live endpoints (opened and not yet fully closed) and registrations: leak checks and metrics.
  int64_t live_endpoints() const { return live_endpoints_.load(); }
  int64_t live_registrations() const { return live_registrations_.load(); }
  // Endpoints that failed because their peer did (since start).
  uint64_t peer_failures() const { return peer_failures_.load(); }
  // Remote keys unpacked so far (each endpoint keeps the ones its transfers use; see Transfer).
  uint64_t rkeys_unpacked() const { return rkeys_unpacked_.load(); }
  // Transfers whose bytes the calling thread copied through mapped shared memory (see Transfer),
  // and the bytes they moved.
  uint64_t direct_transfers() const { return direct_transfers_.load(); }
  uint64_t direct_bytes() const { return direct_bytes_.load(); }
  // Copy helpers, and the 256 KiB pieces of direct transfers they copied (the callers copied the
  // rest).
  int copy_helpers() const { return copy_pool_.helpers(); }
  uint64_t pieces_copied_by_helpers() const { return copy_pool_.pieces_by_helpers(); }
  // The name given to Create() (shows in UCX's logs).
  const std::string& name() const { return name_; }

 private:
  friend class Registration;
  friend class Endpoint;
  friend class Parcel;
  friend class Sending;
  struct TransferState;
  // Messages of one transfer that arrived and are not collected yet.
  struct Inbox {
    absl::Time opened;
    absl::flat_hash_map<uint32_t, std::shared_ptr<Parcel>> slots;
    std::shared_ptr<proxima::Notification> waiter;  // a Collect() waiting, notified on arrival
  };

  Worker(std::string name, int copy_helpers) : name_(std::move(name)), copy_pool_(copy_helpers) {}
  void ProgressLoop();
  // The unpacked form of `packed` for `endpoint`, from its cache or unpacked now. Progress thread.
  absl::StatusOr<std::shared_ptr<std::remove_pointer_t<ucp_rkey_h>>> UnpackRkey(
      Endpoint::State& endpoint, const std::string& packed, uint64_t registration_id);
  // The cached key with this id and these bytes (now the most recently used), or null.
  // REQUIRES: endpoint.mu held.
  static std::shared_ptr<std::remove_pointer_t<ucp_rkey_h>> CachedRkeyLocked(
      Endpoint::State& endpoint, const std::string& packed, uint64_t registration_id);
  // Transfer's fast path, on the calling thread: when every key is in the endpoint's cache and
  // every operation's remote bytes are mapped here, copies them and returns true. False (nothing
  // done) otherwise; Transfer then goes through the progress thread.
  // `copied`: the copy's outcome when it returns true.
  bool TryDirect(Endpoint& endpoint, std::span<const std::string> packed_rkeys,
                 std::span<const Op> ops, std::span<const uint64_t> registration_ids,
                 absl::Status* copied);
  // Copies `ops` through their mapped remote bytes (MapDirect's result) and counts the transfer;
  // INVALID_ARGUMENT when the peer's memory faulted under the copy (CopyDirect).
  absl::Status CopyAndCount(std::span<const Op> ops, std::span<std::byte* const> mapped);
  // Register (address set) or Allocate (address null).
  absl::StatusOr<std::shared_ptr<Registration>> Map(void* address, size_t length);
  // Queues `task` for the progress thread and wakes it.
  void Post(std::function<void()> task);
  // Runs `task` on the progress thread and waits for it, at most until `deadline`. False when
  // the deadline passed first (the task still runs later).
  bool RunAndWait(std::function<void()> task, absl::Time deadline);
  // Progress-thread side of closing an endpoint.
  void CloseOnWorker(const std::shared_ptr<Endpoint::State>& state, bool force);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnOpDone(void* request, ucs_status_t status, void* user_data);
  // Completion of one of Receive()'s ucp_am_recv_data_nbx. Progress thread.
  static void OnReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  void FinishOp(TransferState* state, ucs_status_t status);
  // Starts running `state` on the progress thread: in flight, one pending count held until the
  // task's closing FinishOp(state, UCS_OK); its endpoint's handle, null (and the result
  // UNAVAILABLE) when the endpoint has closed.
  ucp_ep_h Begin(const std::shared_ptr<TransferState>& state);
  // Counts `request` (from a *_nbx call) as pending in `state`, or records its error.
  // Progress thread.
  void Track(TransferState* state, ucs_status_ptr_t request);
  // After a transfer's deadline passed: closes its endpoint by force, which completes what is
  // in flight, and waits (bounded) for that. Returns the UNAVAILABLE status to hand back.
  absl::Status AbandonAfterDeadline(TransferState& state);
  // Has the progress thread close `endpoint` by force (CloseAfterDeadline), which completes
  // what `state` has in flight on it, and waits (bounded) for that.
  void CloseAndAwait(TransferState& state, const std::shared_ptr<Endpoint::State>& endpoint);
  // The progress-thread half of that: marks the endpoint failed and closes it by force.
  void CloseAfterDeadline(const std::shared_ptr<Endpoint::State>& endpoint);
  // Closes by force the endpoints of detached sends past their deadline. Progress thread.
  void CloseExpiredDetached();
  // The active-message handler of Send()'s messages. Progress thread.
  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  // Drops inboxes opened more than kParkedFor ago with nobody waiting (their parcels go to
  // `dropped`, destroyed by the caller outside parked_mu_), and forgets transfers collected
  // that long ago.
  void DropStaleLocked(absl::Time now, std::vector<std::shared_ptr<Parcel>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(parked_mu_);

  const std::string name_;
  std::function<absl::Status(const std::string&, absl::Time)> check_address_;  // Create's
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::thread thread_;

  proxima::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Progress-thread only.
  std::vector<std::shared_ptr<TransferState>> in_flight_;
  std::vector<std::shared_ptr<Endpoint::State>> endpoints_;
  int closing_ = 0;                         // ep close requests not yet completed
  int sends_in_flight_ = 0;                 // Send()s whose messages UCX still holds
  int detached_ = 0;                        // of those, detached ones (Sending::Detach)
  absl::Time next_detached_check_;          // when ProgressLoop next looks at their deadlines
  int event_fd_ = -1;                       // the worker's event fd (ucp_worker_get_efd)
  // Worker addresses that took an endpoint only without peer error handling (their transports
  // cannot detect a failed peer, e.g. shared memory alone): later endpoints to them skip the
  // attempt with it (UCX logs an error each time). Per address, never for the whole worker: one
  // worker's endpoints to the same peer must not mix error modes (docs/decisions.md, "Peer error
  // handling is decided per remote worker"). Progress thread only; cleared past kMaxRemembered.
  absl::flat_hash_set<std::string> without_peer_handling_;
  static constexpr size_t kMaxRemembered = 4096;
  // Endpoints without peer error handling whose peer stopped answering (see Endpoint::State).
  std::vector<std::shared_ptr<Endpoint::State>> abandoned_;

  std::atomic<uint64_t> next_endpoint_id_{1};
  std::atomic<int64_t> live_endpoints_{0};
  std::atomic<int64_t> live_registrations_{0};
  std::atomic<uint64_t> peer_failures_{0};
  std::atomic<uint64_t> rkeys_unpacked_{0};
  std::atomic<uint64_t> direct_transfers_{0};
  std::atomic<uint64_t> direct_bytes_{0};
  CopyPool copy_pool_;  // direct transfers' copies (thread-safe)
  mutable proxima::Mutex parked_mu_;
  absl::flat_hash_map<uint64_t, Inbox> parked_ ABSL_GUARDED_BY(parked_mu_);
  // Transfers collected in the last kParkedFor, and when: their late messages are dropped.
  absl::flat_hash_map<uint64_t, absl::Time> collected_ ABSL_GUARDED_BY(parked_mu_);
  uint64_t parked_bytes_ ABSL_GUARDED_BY(parked_mu_) = 0;
  absl::Time last_stale_check_ ABSL_GUARDED_BY(parked_mu_);
  std::atomic<uint64_t> messages_dropped_{0};
  std::atomic<uint64_t> rendezvous_bytes_{0};
  std::atomic<uint64_t> rendezvous_sent_bytes_{0};
  std::atomic<uint64_t> next_transfer_id_{1};  // seeded at random in Create()
  std::atomic<uint64_t> next_registration_id_{1};
  // Packed key size per memory domain this context packs rkeys for, -1 for the others (learned
  // from a probe registration in Create(), read-only afterwards).
  std::array<int, 64> own_md_sizes_{};
  // Per memory domain: whether its packed keys say where their shared-memory segment lies, and
  // how (learned from the probe allocation in Create(), read-only afterwards). UCX translates an
  // address into a peer's mapped segment without bounds, so Transfer checks every operation
  // against them first (SegmentBounds in ucx.cc).
  std::array<SegmentKey, 64> segment_keys_{};
};

}  // namespace proxima::ucx

#endif  // PROXIMA_COMMON_UCX_H_
