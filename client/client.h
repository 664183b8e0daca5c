// libproxima: the C++ client of proximad (proxima.v1.KVTier over gRPC).
//
// A Client is connected to one daemon and acts for one namespace (tenant). It sizes its calls
// to the daemon's limits (splitting large batches into several calls), sets a deadline on every
// call, checks the CRC32C of every block it receives, and re-registers a model profile by itself
// when a restarted daemon no longer knows it.
//
//   PROXIMA_ASSIGN_OR_RETURN(auto client, Client::Connect({.target =
//   "unix:/run/proxima/proximad.sock"})); PROXIMA_ASSIGN_OR_RETURN(Profile profile,
//   client->RegisterProfile(model)); PROXIMA_ASSIGN_OR_RETURN(auto outcomes, client->Put(profile,
//   keys, blocks)); PROXIMA_ASSIGN_OR_RETURN(size_t cached, client->Lookup(profile, chain));
//
// Thread-safe: one Client may be used from many threads at once.
#ifndef PROXIMA_CLIENT_CLIENT_H_
#define PROXIMA_CLIENT_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_channel.h"
#include "common/mutex.h"
#include "proxima/v1/kvtier.grpc.pb.h"

namespace proxima::gpu {
class CopyQueue;
class PinnedBuffer;
}  // namespace proxima::gpu
namespace proxima::ucx {
class Endpoint;
class Parcel;
class Registration;
class Sending;
class Worker;
}  // namespace proxima::ucx
namespace proxima::wire {
struct GetResult;
}  // namespace proxima::wire

namespace proxima::client {

inline constexpr size_t kKeyBytes = 32;
using BlockKey = std::array<uint8_t, kKeyBytes>;

// How block bytes move. kAuto: UCX when the daemon serves it and, in ConnectUcx, reads a probe
// buffer of this process over UCX (so bytes really move end to end), inline otherwise. kUcx: UCX or
// Connect() fails. kInline: always in the gRPC messages.
enum class Transport { kAuto, kUcx, kInline };

// "auto", "ucx", "inline" and back.
const char* TransportName(Transport t);
absl::StatusOr<Transport> ParseTransport(const std::string& name);

// Whether blocks in ordinary host memory move over UCX through staging memory (see
// ClientOptions::host_staging). kAuto: when the daemon reaches this process over a
// shared-memory transport that maps only memory UCX allocated.
enum class HostStaging { kAuto, kAlways, kNever };
// "auto", "always", "never" and back.
const char* HostStagingName(HostStaging h);
absl::StatusOr<HostStaging> ParseHostStaging(const std::string& name);

// A caller buffer registered for the UCX data plane (see Client::RegisterMemory). Dropping the
// handle deregisters the buffer; a transfer in flight keeps its registration until it ends.
class MemoryRegion {
 public:
  MemoryRegion() = default;
  bool registered() const { return registration_ != nullptr; }
  // The memory of a region from Client::AllocateMemory (empty for RegisterMemory's regions,
  // whose memory is the caller's).
  std::span<std::byte> bytes() const { return bytes_; }

 private:
  friend class Client;
  explicit MemoryRegion(std::shared_ptr<ucx::Registration> r) : registration_(std::move(r)) {}
  std::shared_ptr<ucx::Registration> registration_;
  std::shared_ptr<std::byte[]> heap_;  // AllocateMemory over inline: plain memory
  std::span<std::byte> bytes_;
};

struct ClientOptions {
  // gRPC target: "unix:/run/proxima/proximad.sock", "127.0.0.1:50051", "dns:///host:50051".
  std::string target = "unix:/run/proxima/proximad.sock";
  std::string namespace_name = "default";
  absl::Duration connect_timeout = absl::Seconds(5);  // Connect() gives up after this
  // Deadline of every call. While the daemon cannot be reached (down, restarting) calls fail
  // UNAVAILABLE at once instead, and the client reconnects in the background
  // (ChannelReconnector): calls succeed again within about a second of the daemon serving.
  absl::Duration call_timeout = absl::Seconds(30);
  // Bearer token of the namespace, sent as `authorization: Bearer <token>` metadata on every
  // call; "" for an open namespace. Never logged. Send tokens over TLS or a Unix socket only.
  std::string token;
  // Or a file holding the token (one line, as proximad's token files are read): read at Connect
  // (a bad file fails it, naming the option and the path) and again every
  // token_reload_interval. A changed token is presented from the next call on (over UCX the
  // client opens a session for it first: a session belongs to the token that opened it), so a
  // long-running worker follows a token rotation (docs/security.md) without a restart or a new
  // Client. A read that fails or finds no valid token keeps the token in force and logs a
  // warning once. Not together with `token`.
  std::string token_file;
  absl::Duration token_reload_interval = absl::Seconds(10);
  // TLS to a daemon with server.tls set: tls_ca_file (PEM) verifies the daemon's certificate;
  // tls_cert_file + tls_key_file add a client certificate (mTLS). All "" = plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;  // name to check in the daemon's certificate, if not the target's
  // How often gRPC reads the three TLS files again (whole seconds, at least 1): a certificate
  // or CA bundle renewed in place is used for the channel's next connections (after a daemon
  // restart, say) without a new Client. The C ABI and the Python binding use this default.
  absl::Duration tls_reload_interval = absl::Seconds(60);
  Transport transport = Transport::kAuto;
  // Block buffers in GPU memory: when true and a GPU is visible, every segment of Put/Get is
  // checked (cudaPointerGetAttributes, which opens the process's CUDA context on that GPU as any
  // CUDA call does), and a call with any segment in device memory moves through pinned host
  // staging buffers (gpu_staging_bytes in all, two halves, double-buffered: the copies of one
  // half overlap the transfer of the other). False: host memory only, no CUDA call.
  bool device_memory = true;
  size_t gpu_staging_bytes = size_t{64} << 20;
  // Blocks in ordinary host memory (registered with RegisterMemory, or not registered) over UCX.
  // UCX 1.13's shared-memory transports (posix, sysv) map only memory UCX allocated; the daemon
  // reaches other memory of this process through emulated one-sided operations that this
  // process's UCX thread serves fragment by fragment (slow, with stalls: docs/benchmarks.md).
  // kAuto: when the daemon reports such a transport for this client's session
  // (ConnectUcxResponse.shared_memory_transport), a call whose blocks are not all in
  // AllocateMemory regions copies them through staging memory this client allocated with UCX
  // (host_staging_bytes per call in flight, made on first use and kept for later calls, up to 4),
  // which the daemon maps and copies directly.
  // kAlways: over every UCX transport. kNever: never.
  HostStaging host_staging = HostStaging::kAuto;
  size_t host_staging_bytes = size_t{16} << 20;
  // Over UCX, where proximad does not map this process's memory (tcp, UCX's default transports),
  // block bytes move as UCX messages: this process sends a put's blocks to the daemon's worker,
  // and the daemon sends a get's blocks back, which are copied into their segments here. False:
  // the daemon reads and writes the segments with one-sided operations instead, as before
  // 2026-12-04, faster for large blocks over tcp (docs/benchmarks.md, UCX run 20) but exposed to
  // a UCX abort of this whole process when the daemon dies in the middle of one
  // (docs/operations.md, "UCX 1.13 and peer death"). Keep true unless a daemon restart may take
  // this process down.
  bool ucx_messages = true;
  // With ucx_messages, a put's blocks of at least this many bytes move as rendezvous messages:
  // only a header travels with the call, and the daemon, once it has reserved tier memory for a
  // block, has UCX move the bytes straight into it (one copy fewer than an eager message, which
  // UCX assembles in memory of its own first; docs/benchmarks.md, UCX run 21). Smaller blocks go
  // eager, whose bytes travel before the call. 0: every block rendezvous.
  size_t ucx_rendezvous_bytes = size_t{1} << 20;
  // The same for a get's blocks: the daemon answers first, then UCX moves each block from the
  // daemon's memory straight into its segment here (not over shared memory, where the daemon
  // sends eager). Larger than for puts: below 8 MiB rendezvous gets won nothing over tcp
  // (docs/benchmarks.md, UCX run 23). 0: every block rendezvous.
  size_t ucx_rendezvous_get_bytes = size_t{8} << 20;
};

// A registered model profile: pass it to every block call.
struct Profile {
  uint64_t id = 0;
  uint64_t block_bytes = 0;  // raw size of one block
};

enum class PutOutcome { kStored, kAlreadyPresent, kNoSpace };

// Per-put hints for the daemon's tierer.
struct PutOptions {
  // Empty, or one per block: the block's index in its sequence (0 = the first block, which holds
  // the attention sinks); negative = unknown.
  std::span<const int64_t> positions;
  // Held at a safer level of the namespace's compression hierarchy.
  bool high_priority = false;
  // Empty, or one per block: the worker's importance hint (> 0: keep longer, see
  // PutBlock.importance).
  std::span<const float> importance;
};

// A block as the daemon stores it (Client::GetStored).
struct StoredBlock {
  uint32_t level = 0;  // 0: `bytes` is the raw block; k > 0: a STAR-KV container (level k)
  std::string bytes;   // decode with codec::DecodeBlock (kernels/codec.h) or the CUDA batch
};

struct ServerInfo {
  std::string version;
  uint64_t max_message_bytes = 0;
  uint32_t max_batch_blocks = 0;
  uint32_t max_lookup_keys = 0;
  bool ucx_enabled = false;  // the daemon serves the UCX data plane
  // server.max_inflight_bytes_per_client: no call this client makes (inline message, or UCX
  // block bytes and request) is larger; 0 when the daemon does not say (one that predates it).
  uint64_t max_inflight_bytes = 0;
};

// A block as a scatter/gather list: its bytes are the segments' bytes in order (e.g. one segment
// per layer). The segment sizes add up to the profile's block size.
using ConstSegments = std::vector<std::span<const std::byte>>;
using Segments = std::vector<std::span<std::byte>>;

class Client {
 public:
  // Connects and fetches the daemon's limits. UNAVAILABLE when the daemon cannot be reached
  // within connect_timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();  // closes the UCX session (if any)

  // The transport in use: kUcx or kInline (never kAuto), and why (e.g. "inline: proximad has
  // UCX disabled").
  Transport transport() const { return transport_; }
  const std::string& transport_detail() const { return transport_detail_; }

  // Registers [data, data + size) for UCX once (e.g. a worker's whole KV cache), so that later
  // Put/Get of blocks inside it move with no registration cost. Over inline, and for device
  // memory (which moves through the pinned staging buffers, see device_memory), a no-op handle.
  // Buffers that are not inside a registered region are registered for the duration of a call.
  // REQUIRES: every MemoryRegion is dropped before the Client.
  absl::StatusOr<MemoryRegion> RegisterMemory(void* data, size_t size);
  // Allocates `size` bytes registered for UCX (zeroed), from memory UCX chose: over shared
  // memory it is a segment the daemon maps and copies into or out of directly, instead of
  // UCX emulating one-sided access to ordinary process memory with messages that this
  // process's UCX thread must serve (docs/operations.md). Over inline, ordinary memory. The
  // memory lives as long as the region (region.bytes()). INVALID_ARGUMENT for 0 bytes or more
  // than the machine's memory.
  // REQUIRES: every MemoryRegion is dropped before the Client.
  absl::StatusOr<MemoryRegion> AllocateMemory(size_t size);

  // Registers `profile` in the client's namespace (idempotent; the id is stable).
  absl::StatusOr<Profile> RegisterProfile(const v1::ModelProfile& profile);

  // Stores blocks[i] under keys[i]; each block must be profile.block_bytes long. Returns one
  // outcome per block. Batches beyond the daemon's limits go out as several calls; if one of
  // them fails, the error is returned and earlier calls' blocks stay stored.
  absl::StatusOr<std::vector<PutOutcome>> Put(const Profile& profile,
                                              std::span<const BlockKey> keys,
                                              std::span<const std::span<const std::byte>> blocks,
                                              const PutOptions& options = {});

  // Reads keys[i] into out[i] (each profile.block_bytes long). found[i] tells whether block i
  // was present and intact; when it is false, out[i]'s contents are unspecified.
  // Blocks the daemon stores encoded come back decoded by the daemon (raw bytes; lossy levels
  // give bytes close to, not equal to, what was put).
  absl::StatusOr<std::vector<bool>> Get(const Profile& profile, std::span<const BlockKey> keys,
                                        std::span<const std::span<std::byte>> out);
  // Like Get, but through the Decompress call (with UCX, the daemon decodes straight into the
  // caller's buffer).
  absl::StatusOr<std::vector<bool>> Decompress(const Profile& profile,
                                               std::span<const BlockKey> keys,
                                               std::span<const std::span<std::byte>> out);
  // The stored bytes as they are (fewer bytes to move; the caller decodes): one entry per key,
  // nullopt for a miss or a block that failed its CRC32C.
  absl::StatusOr<std::vector<std::optional<StoredBlock>>> GetStored(const Profile& profile,
                                                                    std::span<const BlockKey> keys);

  // Put and Get of blocks given as scatter/gather lists (see Segments). Over inline, blocks of
  // several segments are gathered into (scattered from) a contiguous buffer; over UCX each block
  // moves as one message that UCX gathers from its segments as it sends (and, for a rendezvous
  // get, scatters into them as the bytes arrive; an eager get's message is copied into them
  // here), or, where the daemon maps this process's memory (shared memory) or ucx_messages is
  // false, the daemon reads (writes) the segments directly.
  absl::StatusOr<std::vector<PutOutcome>> PutScattered(const Profile& profile,
                                                       std::span<const BlockKey> keys,
                                                       std::span<const ConstSegments> blocks,
                                                       const PutOptions& options = {});
  absl::StatusOr<std::vector<bool>> GetScattered(const Profile& profile,
                                                 std::span<const BlockKey> keys,
                                                 std::span<const Segments> out);

  // Number of leading keys of `chain` that are stored.
  absl::StatusOr<size_t> Lookup(const Profile& profile, std::span<const BlockKey> chain);

  // Removes blocks; returns how many were present.
  absl::StatusOr<size_t> Delete(const Profile& profile, std::span<const BlockKey> keys);

  absl::StatusOr<v1::StatsResponse> Stats();

  const ServerInfo& server_info() const { return server_info_; }
  const ClientOptions& options() const { return options_; }
  // Blocks that failed their size or CRC32C check here twice, once as sent unchecked and once
  // as checked by the daemon (reported to the caller as not found): damage in transit. Blocks
  // corrupt in the daemon's memory are counted by the daemon (StatsResponse.crc_failures).
  uint64_t crc_failures() const { return crc_failures_.load(); }

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);

  // Runs `call` (one RPC with a fresh context); when it fails with NOT_FOUND and `profile` was
  // registered by this client, registers it again and retries once (the daemon restarted).
  template <typename Call>
  absl::Status CallWithProfile(const Profile& profile, Call&& call);
  // Sends `keys` in calls of at most `per_call` keys, each a `Request` (namespace, profile,
  // keys) through `rpc` (a stub method pointer) under CallWithProfile; after each call,
  // `on_response(response, keys_in_call)` returns false to stop (Lookup, once the prefix ended).
  template <typename Request, typename Response, typename Rpc, typename OnResponse>
  absl::Status CallInKeyChunks(const Profile& profile, std::span<const BlockKey> keys,
                               size_t per_call, Rpc rpc, OnResponse&& on_response);
  // Sets the call's deadline (`timeout` from now) and its bearer `token` (Token() or the UCX
  // session's), if any.
  static void PrepareContextWith(grpc::ClientContext* context, absl::Duration timeout,
                                 const std::string& token);
  // The bearer token to present: options_.token, or token_file's, read again when due.
  std::string Token() const ABSL_LOCKS_EXCLUDED(token_mu_);
  // Whether the UCX session was opened with the token presented now.
  bool SessionTokenIsCurrent() const ABSL_LOCKS_EXCLUDED(token_mu_);
  // One call: `attempt` makes it on a context whose deadline and bearer `token` are set. Made
  // again, on a fresh context, while the daemon refuses it only until calls running in it end
  // (wire::kRetryWhenReleasedMetadata: this client's earlier calls still hold bytes there, or
  // server.max_connections other connections have calls running), backing off from 1 to 50 ms,
  // as long as `deadline` allows. Every call to the daemon goes through here; one that fails
  // UNAVAILABLE sets reconnector_ going, so that the channel reconnects while calls fail fast.
  absl::Status CallDaemon(absl::Time deadline, const std::string& token,
                          absl::FunctionRef<grpc::Status(grpc::ClientContext*)> attempt);
  // One unary call with serialized messages (Put and Get encode their block bytes themselves).
  absl::Status CallRaw(const char* method, const grpc::ByteBuffer& request,
                       grpc::ByteBuffer* response);
  // One Get (or Decompress, `method`) call for keys.size() <= BlocksPerCall() blocks; fills
  // `results` (one per key).
  absl::Status GetOnce(const char* method, const Profile& profile, std::span<const BlockKey> keys,
                       std::span<const std::span<std::byte>> out, bool client_verifies,
                       std::vector<wire::GetResult>* results);
  // Get and Decompress: raw blocks into `out` through `method`.
  absl::StatusOr<std::vector<bool>> GetInto(const char* method, const Profile& profile,
                                            std::span<const BlockKey> keys,
                                            std::span<const std::span<std::byte>> out);
  void CountCrcFailure();
  // Largest number of blocks of `block_bytes` that one Put or Get message can carry, within the
  // daemon's message and per-client in-flight limits (at least 1).
  size_t BlocksPerCall(uint64_t block_bytes) const;
  // One past the last block of the PutUcx/GetUcx call that starts at `begin` of `blocks`
  // (scatter/gather lists): at most max_batch_blocks blocks, and no more block bytes than the
  // daemon admits for one client at once (it charges them like message bytes), but at least one
  // block.
  template <typename Blocks>
  size_t UcxBatchEnd(const Blocks& blocks, size_t begin) const;
  // Starts the UCX worker and opens a session with the daemon.
  absl::Status StartUcx();
  // Opens a new session on the existing worker (the daemon restarted and forgot the old one).
  // Opens a UCX session. `shared_memory` (optional) receives the daemon's
  // ConnectUcxResponse.shared_memory_transport.
  absl::Status OpenUcxSession(absl::Time deadline, std::string* shared_memory = nullptr);
  // After a call failed UNAVAILABLE: opens a new session once the channel is connected again,
  // before `deadline`. Fails UNAVAILABLE at once while the channel is in TRANSIENT_FAILURE (the
  // daemon down or restarting: reconnector_ reconnects meanwhile), as gRPC fails an inline
  // call; waits, within `deadline`, while a connection attempt is under way.
  absl::Status ReopenUcxSession(absl::Time deadline) ABSL_LOCKS_EXCLUDED(ucx_reopen_mu_);
  // After a call found the session `failed` unknown or its endpoint dead: closes it (best effort)
  // and opens a new one, unless another thread has replaced it meanwhile.
  absl::Status ReplaceUcxSession(uint64_t failed, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(ucx_reopen_mu_);
  // Asks the daemon to close `session_id` (0: none), best effort.
  void CloseUcxSession(uint64_t session_id, absl::Duration timeout);
  // Runs a UCX call, `call(deadline)`, within one call_timeout. A call that fails UNAVAILABLE
  // marks the session stale and the next call re-establishes it first; when the daemon no
  // longer knows the session (NOT_FOUND), a new one is opened and the call retried once.
  template <typename Call>
  absl::Status CallWithSession(Call&& call);
  // A PutUcx or GetUcx call (`method`, e.g. &v1::KVTier::Stub::GetUcx) through CallWithSession
  // and CallWithProfile, with the current session id set in `request`.
  // `prepare` (may be empty) runs before each attempt of the call (a retry included), with the
  // call's deadline: what must happen once per attempt, such as sending a PutUcx's messages.
  template <typename Req, typename Resp, typename Method>
  absl::Status CallUcx(const Profile& profile, Req& request, Resp* response, Method method,
                       const std::function<absl::Status(Req&, absl::Time)>& prepare = {});
  // The endpoint to the daemon's worker over which a PutUcx of blocks[begin, end) sends its
  // bytes as messages; null when the daemon pulls them instead: it maps every segment (a
  // shared-memory session and memory UCX allocated), or it takes no messages.
  template <typename Seg>
  std::shared_ptr<ucx::Endpoint> MessageEndpointFor(std::span<const Seg> blocks, size_t begin,
                                                    size_t end);
  // Fills request regions and blocks for keys[begin, end) over UCX; `held` keeps every
  // registration used alive for the call. With `with_crc` each block carries its CRC32C:
  // crcs[i] where given (one per key), else computed over the block's bytes.
  template <typename Seg, typename Req>
  absl::Status BuildUcxRequest(std::span<const BlockKey> keys, std::span<const Seg> blocks,
                               size_t begin, size_t end, bool with_crc,
                               std::span<const uint32_t> crcs, Req* request,
                               std::vector<std::shared_ptr<ucx::Registration>>* held);
  // Remembers `r` for FindRegistration and wraps it.
  MemoryRegion KeepRegion(std::shared_ptr<ucx::Registration> r);
  std::shared_ptr<ucx::Registration> FindRegistration(const void* p, size_t n);
  // Each contiguous block as a block of one segment (Seg: a span of bytes, const or not).
  template <typename Seg>
  static std::vector<std::vector<Seg>> OneSegmentEach(std::span<const Seg> blocks) {
    std::vector<std::vector<Seg>> segments;
    segments.reserve(blocks.size());
    for (const Seg& b : blocks) segments.push_back({b});
    return segments;
  }
  // `crcs`: empty, or each block's CRC32C, known to the caller (host staging computes them
  // while copying the blocks into its halves), so the blocks are not read again for it.
  absl::StatusOr<std::vector<PutOutcome>> PutUcx(const Profile& profile,
                                                 std::span<const BlockKey> keys,
                                                 std::span<const ConstSegments> blocks,
                                                 const PutOptions& options,
                                                 std::span<const uint32_t> crcs = {});
  absl::StatusOr<std::vector<bool>> GetUcx(const Profile& profile, std::span<const BlockKey> keys,
                                           std::span<const Segments> out);
  // Sends blocks[begin, end) as messages to the daemon's worker, block i at slot i - begin of a
  // new transfer, and names the transfer in `request`. Eager messages are sent before this
  // returns; rendezvous ones (ucx_rendezvous_bytes) complete only once the daemon, told by the
  // call, has taken them: their sends are appended to `in_flight`, to wait for after the call.
  absl::Status SendPutMessages(std::span<const ConstSegments> blocks, size_t begin, size_t end,
                               v1::PutUcxRequest* request, absl::Time deadline,
                               std::vector<std::unique_ptr<ucx::Sending>>* in_flight);
  // One GetUcx call for blocks [begin, end) of `keys`/`out`: sets (*found)[i] for each block
  // written whose bytes match the CRC32C the daemon sent, and appends to `mismatched` the
  // indices of those that do not.
  absl::Status GetUcxOnce(const Profile& profile, std::span<const BlockKey> keys,
                          std::span<const Segments> out, size_t begin, size_t end,
                          bool client_verifies, std::vector<bool>* found,
                          std::vector<size_t>* mismatched);
  // Has UCX move the bytes of the rendezvous messages among `parcels` (a GetUcx's, parcel k for
  // block begin + k of `out`) into their blocks' segments, waits for them (call_timeout), and
  // sets crcs[k] to the CRC32C of the bytes that landed. Eager parcels, missing ones and ones of
  // the wrong size are left for the caller. UNAVAILABLE when the daemon failed mid-way or the
  // time ran out (the endpoint to it is then closed).
  absl::Status ReceiveGetMessages(const Profile& profile, std::span<const Segments> out,
                                  size_t begin,
                                  std::span<std::shared_ptr<const ucx::Parcel>> parcels,
                                  std::span<uint32_t> crcs);
  // InvalidArgument unless `options` has no hints or one per key.
  static absl::Status CheckPutOptions(size_t keys, const PutOptions& options);
  // How a call's blocks move: as they are, through the pinned GPU staging halves (a segment in
  // device memory: options_.device_memory and a GPU), or through the host staging halves (UCX
  // reaches this process only through memory it allocated, and a segment lies elsewhere; see
  // ClientOptions::host_staging).
  enum class Staging { kNone, kDevice, kHost };
  template <typename Seg>
  Staging StagingFor(std::span<const Seg> blocks);
  // Whether any segment of `blocks` lies in device memory (options_.device_memory and a GPU).
  template <typename Seg>
  bool AnyDeviceMemory(std::span<const Seg> blocks) const;
  // Put and Get (or Decompress, `method`) of blocks through staging halves (client_staging.cc):
  // each chunk of blocks is copied into (out of) one half while the other half's chunk moves.
  // GPU staging: one staged call at a time per client. Host staging: each call its own halves.
  absl::StatusOr<std::vector<PutOutcome>> PutStaged(Staging staging, const Profile& profile,
                                                    std::span<const BlockKey> keys,
                                                    std::span<const ConstSegments> blocks,
                                                    const PutOptions& options)
      ABSL_LOCKS_EXCLUDED(staging_mu_, host_staging_mu_);
  absl::StatusOr<std::vector<bool>> GetStaged(Staging staging, const char* method,
                                              const Profile& profile,
                                              std::span<const BlockKey> keys,
                                              std::span<const Segments> out)
      ABSL_LOCKS_EXCLUDED(staging_mu_, host_staging_mu_);
  struct StagingMemory;
  class Stage;
  // Runs body(stage) with the halves `staging` names: the GPU halves under staging_mu_, or host
  // halves leased for the call. When host staging memory cannot be allocated, host staging is
  // given up for this client (logged once) and direct() moves the blocks as they are.
  template <typename Body, typename Direct>
  auto WithStage(Staging staging, uint64_t block_bytes, Body&& body, Direct&& direct)
      -> decltype(direct());
  absl::StatusOr<std::vector<PutOutcome>> PutThrough(Stage& stage, const Profile& profile,
                                                     std::span<const BlockKey> keys,
                                                     std::span<const ConstSegments> blocks,
                                                     const PutOptions& options);
  absl::StatusOr<std::vector<bool>> GetThrough(Stage& stage, const char* method,
                                               const Profile& profile,
                                               std::span<const BlockKey> keys,
                                               std::span<const Segments> out);
  // The GPU staging halves (each at least `block_bytes`) and the copy queue, made on first use
  // and registered for UCX.
  absl::StatusOr<Stage> PrepareDeviceStaging(uint64_t block_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(staging_mu_);
  // UCX-allocated host staging halves (each at least `block_bytes`) for one call: a free one,
  // or a new one; nullopt when none can be allocated (host staging is then given up).
  std::optional<MemoryRegion> LeaseHostStaging(uint64_t block_bytes)
      ABSL_LOCKS_EXCLUDED(host_staging_mu_);
  void ReturnHostStaging(MemoryRegion region) ABSL_LOCKS_EXCLUDED(host_staging_mu_);
  // `bytes` of GPU staging memory (see StagingMemory): UCX-allocated and pinned when the client
  // uses UCX and both succeed, else cudaMallocHost's.
  absl::StatusOr<std::unique_ptr<StagingMemory>> AllocateStaging(size_t bytes);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  ChannelReconnector reconnector_{channel_};
  std::unique_ptr<v1::KVTier::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_stub_;  // Get, parsed without copies (wire.h)
  ServerInfo server_info_;
  std::atomic<uint64_t> crc_failures_{0};
  proxima::Mutex mu_;
  absl::flat_hash_map<uint64_t, v1::ModelProfile> profiles_ ABSL_GUARDED_BY(mu_);

  Transport transport_ = Transport::kInline;
  std::string transport_detail_;
  // UCX data plane (transport_ == kUcx). The worker outlives every registration.
  std::unique_ptr<ucx::Worker> ucx_worker_;
  // Read by the daemon in every ConnectUcx (end-to-end check); declared after the worker so
  // that it is deregistered first.
  std::array<std::byte, 64> ucx_probe_bytes_{};
  std::shared_ptr<ucx::Registration> ucx_probe_;
  std::atomic<uint64_t> ucx_session_{0};
  proxima::Mutex ucx_reopen_mu_;  // held by the one thread re-establishing the session
  std::atomic<bool> ucx_session_stale_{false};  // a call failed UNAVAILABLE: reopen first
  // The bearer token presented (options_.token, or token_file's as last read), when the file is
  // read next, the last read error logged, and the token that opened the UCX session (presented
  // to close it; another token re-opens it first).
  mutable proxima::Mutex token_mu_;
  mutable std::string token_ ABSL_GUARDED_BY(token_mu_);
  mutable absl::Time next_token_read_ ABSL_GUARDED_BY(token_mu_) = absl::InfinitePast();
  mutable std::string token_read_error_ ABSL_GUARDED_BY(token_mu_);
  std::string session_token_ ABSL_GUARDED_BY(token_mu_);
  // The session runs over a shared-memory transport (ConnectUcxResponse.shared_memory_transport).
  std::atomic<bool> ucx_shared_memory_{false};
  // The daemon runs in another PID namespace (ConnectUcxResponse.pid_namespace), or another IPC
  // namespace: the keys sent leave out their posix part, or their System V part
  // (ucx::Worker::WithoutSegmentParts).
  std::atomic<bool> ucx_without_posix_{false};
  std::atomic<bool> ucx_without_sysv_{false};
  // This worker's endpoint to the daemon's (ConnectUcxResponse.worker_address), which PutUcx
  // messages go over; replaced with each session, null when the daemon takes no messages or its
  // worker cannot be reached from here. Dropped before the worker.
  proxima::Mutex daemon_ep_mu_;
  std::shared_ptr<ucx::Endpoint> daemon_ep_ ABSL_GUARDED_BY(daemon_ep_mu_);
  proxima::Mutex regions_mu_;
  std::vector<std::weak_ptr<ucx::Registration>> regions_ ABSL_GUARDED_BY(regions_mu_);
  // GPU staging (client_staging.cc). check_device_memory_: options_.device_memory and a GPU
  // visible at Connect.
  bool check_device_memory_ = false;
  // The memory of the staging halves. Over UCX: memory the worker allocated (AllocateMemory; over
  // shared memory the daemon copies into and out of it directly, as for any AllocateMemory),
  // page-locked with cudaHostRegister. Otherwise, or when either step fails: cudaMallocHost's,
  // registered with RegisterMemory over UCX. Unpinned before its memory is freed.
  struct StagingMemory {
    StagingMemory() = default;
    StagingMemory(const StagingMemory&) = delete;
    StagingMemory& operator=(const StagingMemory&) = delete;
    ~StagingMemory();
    std::byte* data = nullptr;
    size_t size = 0;
    std::unique_ptr<gpu::PinnedBuffer> pinned;  // the memory on the cudaMallocHost path
    MemoryRegion region;  // AllocateMemory's (the memory) or RegisterMemory's; before `pinned`
    bool host_registered = false;  // `data` is pinned with cudaHostRegister
  };
  proxima::Mutex staging_mu_;
  std::unique_ptr<StagingMemory> staging_ ABSL_GUARDED_BY(staging_mu_);
  std::unique_ptr<gpu::CopyQueue> copies_ ABSL_GUARDED_BY(staging_mu_);
  // Host staging (client_staging.cc): whether this session stages blocks in ordinary memory
  // (options_.host_staging and the daemon's ConnectUcxResponse), and its halves.
  std::atomic<bool> stage_host_memory_{false};
  static constexpr size_t kMaxFreeHostStaging = 4;
  proxima::Mutex host_staging_mu_;
  std::vector<MemoryRegion> host_staging_free_ ABSL_GUARDED_BY(host_staging_mu_);
};

// Channel credentials for `options`' TLS settings (plaintext when none is set). PEM files are
// read and checked here: a wrong path or a bad file is an error naming the option and the file;
// gRPC reads them again every `options.tls_reload_interval` (common/grpc_tls.h).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options);

// The daemon's stats as a JSON object (proto field names, zero fields included): what the C ABI's
// proxima_stats_json() and the Python binding return.
absl::StatusOr<std::string> StatsToJson(const v1::StatsResponse& stats);

// Converts between gRPC and Abseil statuses (the codes are the same).
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace proxima::client

#endif  // PROXIMA_CLIENT_CLIENT_H_
