// PeerTokens: the cluster's peer tokens (cluster.peer_token), one per line of its file or
// variable. This node presents the first on its calls to peers and accepts any of them on the
// calls it serves, so a rolling rotation never splits the cluster: every node first accepts the
// new token, then presents it, then drops the old one (docs/security.md, "Rotating the peer
// token"). Read at start and again on SIGHUP (Daemon::ReloadTokens).
//
// Thread-safe: a reload replaces the list whole while calls read it.
#ifndef PROXIMA_DAEMON_CLUSTER_PEER_TOKENS_H_
#define PROXIMA_DAEMON_CLUSTER_PEER_TOKENS_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/config.h"

namespace proxima::daemon::cluster {

class PeerTokens {
 public:
  // Reads cluster.peer_token ({file} or {env}) as `config` names it.
  static absl::StatusOr<std::vector<std::string>> Read(const ClusterConfig& config);

  // `tokens`: at least one.
  explicit PeerTokens(std::vector<std::string> tokens) { Set(std::move(tokens)); }

  // The tokens now in force, the presented one first.
  std::shared_ptr<const std::vector<std::string>> Get() const { return tokens_.load(); }
  void Set(std::vector<std::string> tokens) {
    tokens_.store(std::make_shared<const std::vector<std::string>>(std::move(tokens)));
  }

  // "Bearer <the first token>": the authorization this node's peer calls carry.
  std::string Authorization() const { return "Bearer " + Get()->front(); }
  // Whether `authorization` is "Bearer <t>" for one of the tokens. Every token is compared, each
  // in constant time, whichever matches.
  bool Accepts(absl::string_view authorization) const;

 private:
  std::atomic<std::shared_ptr<const std::vector<std::string>>> tokens_;
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_PEER_TOKENS_H_
