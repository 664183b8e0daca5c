#include "common/copy_pool.h"

#include <algorithm>
#include <cstring>

#include "common/crc32c.h"
#include "common/mutex.h"

namespace proxima {

struct CopyPool::Batch {
  explicit Batch(std::span<CopyPiece> p) : pieces(p), left(p.size()) {}
  const std::span<CopyPiece> pieces;
  std::atomic<size_t> next{0};  // the next piece to claim
  std::atomic<size_t> left;     // pieces not yet copied
  Notification done;            // left reached 0
};

CopyPool::CopyPool(int helpers) {
  threads_.reserve(static_cast<size_t>(std::max(helpers, 0)));
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { HelperLoop(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int CopyPool::HelpersFor(int requested) {
  if (requested >= 0) return requested;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores - 1, 0, 3);
}

uint64_t CopyPool::pieces_by_helpers() const { return pieces_by_helpers_.load(); }

uint64_t CopyPool::Work(Batch& batch) {
  uint64_t copied = 0;
  for (size_t i = batch.next.fetch_add(1); i < batch.pieces.size(); i = batch.next.fetch_add(1)) {
    CopyPiece& p = batch.pieces[i];
    if (p.checksum) {
      p.crc = Crc32cCopy(std::span(p.dst, p.size), std::span<const std::byte>(p.src, p.size));
    } else if (p.size > 0) {
      std::memcpy(p.dst, p.src, p.size);
    }
    ++copied;
    // The last piece copied wakes the caller; Notify's mutex orders every piece's writes (bytes
    // and crc) before the caller's return.
    if (batch.left.fetch_sub(1) == 1) batch.done.Notify();
  }
  return copied;
}

void CopyPool::Run(std::span<CopyPiece> pieces) {
  if (pieces.empty()) return;
  auto batch = std::make_shared<Batch>(pieces);
  // Shared only while at most as many calls copy as there are helpers: past that the callers
  // already keep the cores the helpers would run on busy, and handing pieces around only adds
  // thread switches (measured: 4 clients on 2 vCPUs, docs/benchmarks.md UCX run 15).
  const int copying = callers_.fetch_add(1) + 1;
  const bool share = pieces.size() > 1 && copying <= helpers();
  if (share) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      batches_.push_back(batch);
    }
    wake_.notify_all();
  }
  Work(*batch);
  if (share) {
    // Nothing is left to claim: take the batch off the queue if no helper did.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(batches_.begin(), batches_.end(), batch);
    if (it != batches_.end()) batches_.erase(it);
  }
  callers_.fetch_sub(1);
  // Helpers that claimed a piece finish it (a bounded copy); nothing else is waited for.
  batch->done.WaitForNotification();
}

void CopyPool::HelperLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !batches_.empty(); });
    if (stop_) return;
    std::shared_ptr<Batch> batch = batches_.front();
    lock.unlock();
    pieces_by_helpers_.fetch_add(Work(*batch));
    lock.lock();
    // Exhausted: off the queue, so that no helper wakes for it again.
    if (!batches_.empty() && batches_.front() == batch) batches_.pop_front();
  }
}

}  // namespace proxima
