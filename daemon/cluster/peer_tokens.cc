#include "daemon/cluster/peer_tokens.h"

#include "common/credentials.h"

namespace proxima::daemon::cluster {

absl::StatusOr<std::vector<std::string>> PeerTokens::Read(const ClusterConfig& config) {
  return config.peer_token_file.empty()
             ? ReadTokenListEnv("cluster.peer_token.env", config.peer_token_env)
             : ReadTokenListFile("cluster.peer_token.file", config.peer_token_file);
}

bool PeerTokens::Accepts(absl::string_view authorization) const {
  bool accepted = false;
  for (const std::string& token : *Get()) {
    accepted = ConstantTimeEquals(authorization, "Bearer " + token) || accepted;
  }
  return accepted;
}

}  // namespace proxima::daemon::cluster
