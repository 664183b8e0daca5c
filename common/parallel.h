// ParallelFor: runs fn(0), ..., fn(n - 1) on up to `num_threads` threads (the calling thread and
// threads started for the call, joined before it returns), each taking the next index as it
// finishes one. For batches of independent work items that are large against a thread start
// (tens of microseconds): the codec's batch entry points, and the daemon's decode of a Get.
// Thread-safety: fn must be safe to call concurrently for different indices.
#ifndef PROXIMA_COMMON_PARALLEL_H_
#define PROXIMA_COMMON_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace proxima {

// `num_threads` <= 0: one per hardware thread. Never more threads than items.
template <typename Fn>
void ParallelFor(size_t n, int num_threads, Fn fn) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  num_threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(num_threads), n));
  if (num_threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) threads.emplace_back(work);
  work();  // the caller works too
  for (std::thread& t : threads) t.join();
}

}  // namespace proxima

#endif  // PROXIMA_COMMON_PARALLEL_H_
