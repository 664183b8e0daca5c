// CountingRemote: a RemoteBlocks with no peers behind it, for the tests and the fuzz target that
// drive PeerService in process. It counts the keys the service tells the keys' homes about
// (Stored, Removed) and answers every question about other nodes with "none".
#ifndef PROXIMA_DAEMON_CLUSTER_COUNTING_REMOTE_H_
#define PROXIMA_DAEMON_CLUSTER_COUNTING_REMOTE_H_

#include <cstddef>
#include <optional>
#include <vector>

#include "daemon/cluster/remote_blocks.h"

namespace proxima::daemon::cluster {

class CountingRemote final : public RemoteBlocks {
 public:
  void Stored(const RemoteBlockSet& blocks) override { stored += blocks.keys.size(); }
  void Removed(const RemoteBlockSet& blocks) override { removed += blocks.keys.size(); }
  size_t LookupChain(const RemoteBlockSet&) override { return 0; }
  std::vector<std::optional<RemoteBlock>> Fetch(const RemoteBlockSet& blocks) override {
    return std::vector<std::optional<RemoteBlock>>(blocks.keys.size());
  }
  std::vector<bool> DeleteRemote(const RemoteBlockSet& blocks) override {
    return std::vector<bool>(blocks.keys.size(), false);
  }
  void Describe(v1::ClusterStats*) const override {}

  size_t stored = 0;   // keys reported held here
  size_t removed = 0;  // keys reported gone from here
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_COUNTING_REMOTE_H_
