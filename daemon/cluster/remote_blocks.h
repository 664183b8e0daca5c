// RemoteBlocks: what the core (TierService) asks of the cluster, so that tier_service.cc knows no
// gRPC peer code (and the in-process fuzzers link without it). daemon/cluster/cluster.h is the
// implementation; with the cluster off the core has none and serves from its own tiers alone.
//
// Every method runs on behalf of a caller the core has already authenticated and authorized for
// the namespace and partition it passes: the cluster never decides who may see a block. Every
// method is best effort and bounded by cluster.peer_deadline: a peer that is down, slow or
// answers wrongly costs a miss, never an error or a hang.
//
// Thread-safe: called concurrently from every request thread.
#ifndef PROXIMA_DAEMON_CLUSTER_REMOTE_BLOCKS_H_
#define PROXIMA_DAEMON_CLUSTER_REMOTE_BLOCKS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "daemon/block_store.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima::daemon {

// Which blocks, named as every daemon of the cluster names them (namespace by name: its index is
// local to one daemon's config).
struct RemoteBlockSet {
  uint32_t namespace_index = 0;  // the namespace's index on this daemon
  std::string namespace_name;
  uint32_t partition = 0;
  uint64_t profile_id = 0;
  std::span<const BlockKey> keys;
  uint64_t block_bytes = 0;  // raw block size of the profile (a raw block fetched must have it)
};

// A block read from another node: its stored bytes (kept valid by `pin`: the gRPC answer they
// came inline in, or the UCX message), checked against `crc32c` on arrival.
struct RemoteBlock {
  std::shared_ptr<const void> pin;
  std::span<const std::byte> bytes;
  uint32_t crc32c = 0;
  uint8_t level = 0;  // 0 raw, k > 0 a STAR-KV container at hierarchy level k
};

class RemoteBlocks {
 public:
  virtual ~RemoteBlocks() = default;

  // The local tiers now hold `blocks` (a put committed them): tells each key's home node, in the
  // background. Returns at once; never fails the put.
  virtual void Stored(const RemoteBlockSet& blocks) = 0;

  // The local tiers no longer hold `blocks` (a Delete): tells their homes to drop the records,
  // in the background.
  virtual void Removed(const RemoteBlockSet& blocks) = 0;

  // How many leading keys of `blocks` (the rest of a chain after its local prefix) some live
  // node holds, as their home nodes know it: one hop, batched per home.
  virtual size_t LookupChain(const RemoteBlockSet& blocks) = 0;

  // Reads `blocks` from the nodes that hold them: one entry per key, nullopt for a miss.
  virtual std::vector<std::optional<RemoteBlock>> Fetch(const RemoteBlockSet& blocks) = 0;

  // Deletes `blocks` at the other nodes that hold them (as their homes know it): one entry
  // per key, true when some node deleted it. Best effort, bounded like the rest.
  virtual std::vector<bool> DeleteRemote(const RemoteBlockSet& blocks) = 0;

  // A put found the local tiers full, with nothing left to compress: waits (at most
  // cluster.spill.put_wait) for a spill round to move cold blocks to peers with room. True when
  // the caller should try to allocate again (a round moved some, or the tier is under the spill
  // threshold now); false when no peer could take any (spilling off, no live peer, the last
  // round found no room) or the wait ran out: the caller evicts.
  virtual bool MakeRoom() { return false; }

  // This node's view of the cluster: its id, its peers and their state, its records.
  virtual void Describe(v1::ClusterStats* out) const = 0;
};

}  // namespace proxima::daemon

#endif  // PROXIMA_DAEMON_CLUSTER_REMOTE_BLOCKS_H_
