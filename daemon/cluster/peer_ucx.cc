#include "daemon/cluster/peer_ucx.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace proxima::daemon::cluster {

PeerUcx::PeerUcx(ucx::Worker* worker, metrics::Registry* registry) : worker_(worker) {
  bytes_in_ = metrics::TransferBytes(registry, "peer_ucx", "in");
  bytes_out_ = metrics::TransferBytes(registry, "peer_ucx", "out");
  registry->AddGauge("proxima_cluster_ucx_endpoints",
                     "UCX endpoints this daemon keeps to other daemons' workers", {}, [this] {
                       proxima::MutexLock lock(&mu_);
                       return static_cast<double>(endpoints_.size());
                     });
}

uint64_t PeerUcx::Describe(uint64_t max_block_bytes, v1::FetchBlocksRequest* request) {
  const uint64_t transfer = worker_->NewTransferId();
  request->set_ucx_worker(worker_->address());
  request->set_ucx_transfer(transfer);
  request->set_ucx_max_block_bytes(max_block_bytes);
  return transfer;
}

absl::StatusOr<std::shared_ptr<ucx::Endpoint>> PeerUcx::EndpointTo(const std::string& address,
                                                                   absl::Time deadline) {
  {
    proxima::MutexLock lock(&mu_);
    auto it = endpoints_.find(address);
    if (it != endpoints_.end()) {
      if (it->second->health().ok()) return it->second;
      endpoints_.erase(it);
      opened_.erase(std::find(opened_.begin(), opened_.end(), address));
    }
  }
  // Outside the lock: checking the address and connecting wait. A peer's address reaches this
  // process's UCX only once a child process survived parsing it (ucx::AddressCheck); its verdict
  // is waited for during half the call's time at most, so that the endpoint still has the rest.
  // Past that the caller goes inline, and the verdict is remembered for the next call.
  const absl::Time now = absl::Now();
  PROXIMA_RETURN_IF_ERROR(worker_->CheckAddress(address, now + (deadline - now) / 2));
  PROXIMA_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Endpoint> ep, worker_->Connect(address, deadline));
  proxima::MutexLock lock(&mu_);
  auto [it, inserted] = endpoints_.try_emplace(address, ep);
  if (!inserted) return it->second;  // another call connected meanwhile; ours closes
  opened_.push_back(address);
  if (opened_.size() > kMaxEndpoints) {
    endpoints_.erase(opened_.front());
    opened_.erase(opened_.begin());
  }
  return ep;
}

absl::Status PeerUcx::Verdict(const std::string& address) {
  return worker_->CheckAddress(address, absl::InfinitePast());
}

void PeerUcx::Drop(const std::string& address) {
  proxima::MutexLock lock(&mu_);
  if (endpoints_.erase(address) > 0) {
    opened_.erase(std::find(opened_.begin(), opened_.end(), address));
  }
}

absl::Status PeerUcx::Write(
    const v1::FetchBlocksRequest& request,
    std::shared_ptr<const std::vector<std::optional<BlockStore::ReadBlock>>> blocks,
    const std::vector<bool>& send, absl::Time deadline) {
  if (request.ucx_transfer() == 0) {
    return absl::InvalidArgumentError("FetchBlocks names a UCX worker but ucx_transfer is 0");
  }
  std::vector<ucx::Message> messages;
  for (size_t i = 0; i < blocks->size(); ++i) {
    const auto& b = (*blocks)[i];
    if (send[i] && b) messages.push_back({static_cast<uint32_t>(i), b->bytes});
  }
  if (messages.empty()) return absl::OkStatus();
  return SendTo(request.ucx_worker(), request.ucx_transfer(), std::move(messages),
                std::move(blocks), deadline);
}

absl::StatusOr<uint64_t> PeerUcx::Push(const std::string& address,
                                       std::span<const std::span<const std::byte>> blocks,
                                       absl::Time deadline) {
  std::vector<ucx::Message> messages;
  for (size_t j = 0; j < blocks.size(); ++j) {
    messages.push_back({static_cast<uint32_t>(j), blocks[j]});
  }
  const uint64_t transfer = worker_->NewTransferId();
  PROXIMA_RETURN_IF_ERROR(SendTo(address, transfer, std::move(messages), nullptr, deadline));
  return transfer;
}

absl::Status PeerUcx::SendTo(const std::string& address, uint64_t transfer,
                             std::vector<ucx::Message> messages,
                             std::shared_ptr<const void> keep_alive, absl::Time deadline) {
  uint64_t bytes = 0;
  for (const ucx::Message& m : messages) bytes += m.size();
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep = EndpointTo(address, deadline);
  if (!ep.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot reach the peer's UCX worker: ", ep.status().message()));
  }
  absl::Status sent =
      worker_->Send(**ep, transfer, std::move(messages), std::move(keep_alive), deadline);
  if (!sent.ok()) {
    Drop(address);
    return absl::UnavailableError(absl::StrCat("sending blocks over UCX: ", sent.message()));
  }
  bytes_out_->Increment(bytes);
  return absl::OkStatus();
}

}  // namespace proxima::daemon::cluster
