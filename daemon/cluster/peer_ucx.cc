#include "daemon/cluster/peer_ucx.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace proxima::daemon::cluster {

PeerUcx::PeerUcx(ucx::Worker* worker, const ucx::Registration* arena, uint64_t receive_pool_bytes,
                 metrics::Registry* registry)
    : worker_(worker), arena_(arena), pool_(worker, receive_pool_bytes, registry) {
  bytes_in_ = metrics::TransferBytes(registry, "peer_ucx", "in");
  bytes_out_ = metrics::TransferBytes(registry, "peer_ucx", "out");
  registry->AddGauge("proxima_cluster_ucx_endpoints",
                     "UCX endpoints this daemon keeps to other daemons' workers", {}, [this] {
                       proxima::MutexLock lock(&mu_);
                       return static_cast<double>(endpoints_.size());
                     });
}

void PeerUcx::Describe(const ReceiveBuffer& buffer, v1::FetchBlocksRequest* request) const {
  request->set_ucx_worker_address(worker_->address());
  request->set_ucx_rkey(buffer.packed_rkey());
  request->set_ucx_registration_id(buffer.registration_id());
  request->set_ucx_address(reinterpret_cast<uint64_t>(buffer.data()));
  request->set_ucx_slot_bytes(buffer.slot_bytes());
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
  // Outside the lock: connecting waits for the peer.
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
  const uint64_t slot = request.ucx_slot_bytes();
  const uint64_t base = request.ucx_address();
  const uint64_t slots = blocks->size();
  if (slot == 0 || slots > std::numeric_limits<uint64_t>::max() / slot ||
      base > std::numeric_limits<uint64_t>::max() - slots * slot) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FetchBlocks receive buffer at ", base, " with ", slots, " slots of ", slot,
        " bytes does not fit a 64-bit address space"));
  }
  std::vector<ucx::Op> ops;
  uint64_t bytes = 0;
  for (size_t i = 0; i < blocks->size(); ++i) {
    const auto& b = (*blocks)[i];
    if (!send[i] || !b) continue;
    // The tier's bytes are only read; UCX's API takes a non-const pointer for both directions.
    ops.push_back(ucx::Op{ucx::Op::kPut, const_cast<std::byte*>(b->bytes.data()),
                          b->bytes.size(), base + i * slot, 0, arena_});
    bytes += b->bytes.size();
  }
  if (ops.empty()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(Run(request.ucx_worker_address(), request.ucx_rkey(),
                              request.ucx_registration_id(), std::move(ops), std::move(blocks),
                              deadline));
  bytes_out_->Increment(bytes);
  return absl::OkStatus();
}

void PeerUcx::DescribeArena(v1::StoreBlocksRequest* request) const {
  request->set_ucx_worker_address(worker_->address());
  request->set_ucx_rkey(arena_->packed_rkey());
  request->set_ucx_registration_id(arena_->id());
}

absl::Status PeerUcx::Read(const std::string& worker_address, const std::string& rkey,
                           uint64_t registration_id, const std::vector<Pull>& pulls,
                           std::shared_ptr<const void> keep_alive, absl::Time deadline) {
  std::vector<ucx::Op> ops;
  uint64_t bytes = 0;
  for (const Pull& p : pulls) {
    ops.push_back(ucx::Op{ucx::Op::kGet, p.local.data(), p.local.size(), p.remote_address, 0,
                          arena_});
    bytes += p.local.size();
  }
  if (ops.empty()) return absl::OkStatus();
  PROXIMA_RETURN_IF_ERROR(
      Run(worker_address, rkey, registration_id, std::move(ops), std::move(keep_alive), deadline));
  bytes_in_->Increment(bytes);
  return absl::OkStatus();
}

absl::Status PeerUcx::Run(const std::string& address, const std::string& rkey,
                          uint64_t registration_id, std::vector<ucx::Op> ops,
                          std::shared_ptr<const void> keep_alive, absl::Time deadline) {
  if (rkey.empty() || rkey.size() > ucx::kMaxPackedRkeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("ucx_rkey is ", rkey.size(),
                                                   " bytes; expected 1 to ",
                                                   ucx::kMaxPackedRkeyBytes));
  }
  absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep = EndpointTo(address, deadline);
  if (!ep.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot reach the peer's UCX worker: ", ep.status().message()));
  }
  const std::string rkeys[] = {rkey};
  const uint64_t ids[] = {registration_id};
  absl::Status status =
      worker_->Transfer(**ep, rkeys, std::move(ops), std::move(keep_alive), deadline, ids);
  if (absl::IsInvalidArgument(status)) return status;  // an rkey that does not unpack
  if (!status.ok()) {
    Drop(address);
    return absl::UnavailableError(
        absl::StrCat("moving blocks over UCX: ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace proxima::daemon::cluster
