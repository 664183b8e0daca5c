// Timing for the CPU benchmarks (codec_bench, kv_layout_bench): thread CPU time or wall time,
// and a loop that repeats a call for a minimum time.
#ifndef PROXIMA_BENCH_TIMING_H_
#define PROXIMA_BENCH_TIMING_H_

#include <time.h>

#include <chrono>

namespace proxima::bench {

// Single-thread results use this thread's CPU time, so that time spent descheduled on a shared
// machine does not count; multi-thread results use wall time (CPU time would hide poor scaling).
inline double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
inline double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs fn() repeatedly for at least min_time_s; returns seconds per call.
template <typename Fn>
double TimePerCall(double min_time_s, bool cpu_time, Fn fn) {
  auto now = cpu_time ? ThreadCpuSeconds : WallSeconds;
  fn();  // warm up
  int iters = 0;
  const double start = now();
  double elapsed = 0;
  do {
    fn();
    ++iters;
    elapsed = now() - start;
  } while (elapsed < min_time_s);
  return elapsed / iters;
}

}  // namespace proxima::bench

#endif  // PROXIMA_BENCH_TIMING_H_
