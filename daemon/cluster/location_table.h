// LocationTable: the location records a home node keeps: block -> the node that holds it.
//
// A record is written when a holder tells the block's home that it stored the block (after a
// local put), and dropped when the holder leaves the live set, when a fetch from it missed (the
// block was evicted or deleted there), or when the table is full (at most `max_records`; a full
// table drops an arbitrary record per new one: a lost record is a cache miss, never wrong data).
// Holder ids are interned: a record costs its BlockId and 4 bytes.
//
// Thread-safe.
#ifndef PROXIMA_DAEMON_CLUSTER_LOCATION_TABLE_H_
#define PROXIMA_DAEMON_CLUSTER_LOCATION_TABLE_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
#include "daemon/block_store.h"

namespace proxima::daemon::cluster {

class LocationTable {
 public:
  explicit LocationTable(size_t max_records) : max_records_(max_records) {}

  // Records `holder` for every id (replacing older records of the same ids).
  void Record(std::span<const BlockId> ids, const std::string& holder);
  // Drops the records of `ids` that name `holder`; returns how many.
  size_t Forget(std::span<const BlockId> ids, const std::string& holder);
  // Drops every record naming `holder`; returns how many.
  size_t DropHolder(const std::string& holder);
  // The holder of each id, "" when there is no record.
  std::vector<std::string> Find(std::span<const BlockId> ids) const;

  size_t size() const;
  // Records dropped because the table was full (monotonic).
  uint64_t overflows() const;

 private:
  uint32_t Intern(const std::string& holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_records_;
  mutable proxima::Mutex mu_;
  absl::flat_hash_map<BlockId, uint32_t> records_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> holders_ ABSL_GUARDED_BY(mu_);  // interned ids, by index
  absl::flat_hash_map<std::string, uint32_t> holder_index_ ABSL_GUARDED_BY(mu_);
  uint64_t overflows_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace proxima::daemon::cluster

#endif  // PROXIMA_DAEMON_CLUSTER_LOCATION_TABLE_H_
