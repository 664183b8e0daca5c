#include "common/copy_pool.h"

#include <setjmp.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "common/crc32c.h"
#include "common/mutex.h"

namespace proxima {
namespace {

// A fault (SIGBUS, SIGSEGV) inside a piece being copied jumps back to CopyOnePiece. The guard is
// the copying thread's own (the signals are synchronous: they arrive on the thread that touched
// the page).
struct FaultGuard {
  sigjmp_buf env;
  uintptr_t ranges[2][2] = {};  // [begin, end) of the piece's destination and source
  volatile sig_atomic_t armed = 0;
};
thread_local FaultGuard t_guard;
constexpr int kFaultSignals[] = {SIGBUS, SIGSEGV};
struct sigaction g_previous[2];  // per kFaultSignals entry: the disposition before ours

void OnFault(int sig, siginfo_t* info, void* context) {
  FaultGuard& g = t_guard;
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  if (g.armed) {
    for (const auto& r : g.ranges) {
      if (at >= r[0] && at < r[1]) {
        g.armed = 0;
        siglongjmp(g.env, 1);  // SA_NODEFER: the signal is not left blocked
      }
    }
  }
  // Not a piece's memory: what the process did before (UCX's error handler, a sanitizer's, or
  // the default, which the faulting instruction meets again on return and which ends the
  // process).
  const struct sigaction& previous = g_previous[sig == SIGBUS ? 0 : 1];
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);
  }
}

void InstallFaultHandlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &OnFault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 2; ++i) sigaction(kFaultSignals[i], &sa, &g_previous[i]);
  });
}

// Copies one piece; false when its memory faulted.
bool CopyOnePiece(CopyPiece& p) {
  FaultGuard& g = t_guard;  // touched here first: the handler never allocates it
  g.ranges[0][0] = reinterpret_cast<uintptr_t>(p.dst);
  g.ranges[0][1] = g.ranges[0][0] + p.size;
  g.ranges[1][0] = reinterpret_cast<uintptr_t>(p.src);
  g.ranges[1][1] = g.ranges[1][0] + p.size;
  if (sigsetjmp(g.env, 0) != 0) return false;  // back from OnFault
  g.armed = 1;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (p.checksum) {
    p.crc = Crc32cCopy(std::span(p.dst, p.size), std::span<const std::byte>(p.src, p.size));
  } else if (p.size > 0) {
    std::memcpy(p.dst, p.src, p.size);
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  g.armed = 0;
  return true;
}

}  // namespace

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
    p.faulted = !CopyOnePiece(p);
    ++copied;
    // The last piece copied wakes the caller; Notify's mutex orders every piece's writes (bytes
    // and crc) before the caller's return.
    if (batch.left.fetch_sub(1) == 1) batch.done.Notify();
  }
  return copied;
}

bool CopyPool::Run(std::span<CopyPiece> pieces) {
  if (pieces.empty()) return true;
  // Only processes that copy install them (proximad; libproxima's workers never copy through a
  // peer's memory, so a worker process keeps its own dispositions untouched).
  InstallFaultHandlers();
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
  return std::none_of(pieces.begin(), pieces.end(), [](const CopyPiece& p) { return p.faulted; });
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
