// CopyPool: copies a batch of memory pieces (optionally checksumming each with CRC32C as it goes)
// on the calling thread and, at once, on whichever of the pool's helper threads are free.
//
// Why: one core copies and checksums at 10-16 GB/s (the CRC32C instruction, not memory, is the
// limit: common/crc32c.cc), so a single client's large get or put over shared memory is held to
// one core's speed while the node's other cores idle. The caller always works too, so a batch
// never waits for a busy helper to start: when every helper is busy with other batches the
// caller copies its whole batch itself, as it would without the pool. A helper that joined
// finishes the piece it took before the caller returns. While more calls copy at once than the
// pool has helpers, each copies alone: the callers already keep the cores busy.
//
// Thread-safe: Run() may be called from any number of threads at once.
#ifndef PROXIMA_COMMON_COPY_POOL_H_
#define PROXIMA_COMMON_COPY_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <memory>
#include <span>
#include <thread>
#include <vector>


namespace proxima {

// One piece of a batch: copies [src, src + size) to [dst, dst + size) (the two must not
// overlap) and, when `checksum`, sets `crc` to Crc32c of the bytes written.
//
// Either side may be another process's shared memory mapped here, which that process can take
// away under the copy (ftruncate of the segment: the next access raises SIGBUS), or an address a
// peer got wrong that lies outside any mapping (SIGSEGV). Such a fault inside a piece ends that
// piece with `faulted` set instead of killing the process; the piece's bytes are then partly
// copied and its crc meaningless. Faults anywhere else go to the process's previous disposition,
// as before. (The first Run() installs the process's SIGBUS and SIGSEGV handlers for this; one
// installed later by someone else takes its place.)
struct CopyPiece {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  size_t size = 0;
  bool checksum = false;
  uint32_t crc = 0;      // output
  bool faulted = false;  // output: SIGBUS inside [src, +size) or [dst, +size)
};

class CopyPool {
 public:
  // Starts `helpers` threads (0: every batch is copied by its caller alone).
  explicit CopyPool(int helpers);
  // Stops and joins the helpers. REQUIRES: no Run() in progress.
  ~CopyPool();

  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Copies every piece (in any order, on this thread and free helpers); returns when all are
  // done, each piece's `crc` set where it asked for one and `faulted` where its memory failed.
  // Returns whether no piece faulted.
  bool Run(std::span<CopyPiece> pieces);

  int helpers() const { return static_cast<int>(threads_.size()); }
  // Pieces the helpers copied, over the pool's life (the rest were copied by their callers).
  uint64_t pieces_by_helpers() const;

  // The number of helpers `requested` means: itself when >= 0; for -1 ("auto"), one fewer than
  // the cores of this machine, at most 3 (a batch is cut into a handful of pieces, and memory
  // bandwidth, not cores, limits a copy past a few threads).
  static int HelpersFor(int requested);

 private:
  struct Batch;
  void HelperLoop();
  // Copies pieces of `batch` until none is left to claim.
  // Returns how many it copied.
  static uint64_t Work(Batch& batch);

  // std::mutex for the condition variable's sake (common/mutex.h's Mutex has none).
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Batch>> batches_;  // guarded by mu_; may still have pieces to claim
  bool stop_ = false;                           // guarded by mu_
  std::vector<std::thread> threads_;            // set by the constructor only
  std::atomic<uint64_t> pieces_by_helpers_{0};
  std::atomic<int> callers_{0};  // Run() calls copying now
};

}  // namespace proxima

#endif  // PROXIMA_COMMON_COPY_POOL_H_
