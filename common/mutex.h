// Mutex, MutexLock and Notification for Proxima: std::mutex underneath, with Abseil's
// thread-safety annotations on top (ABSL_GUARDED_BY and friends work as with absl::Mutex).
//
// Why not absl::Mutex: Debian's Abseil is a prebuilt library that is not instrumented for
// ThreadSanitizer, so TSan cannot see absl::Mutex's happens-before edges and reports every
// guarded access as a race. The C++ library's mutex goes through pthreads, which TSan
// intercepts, so the sanitizer builds (scripts/sanitize.sh thread) check real races. See
// docs/decisions.md.
#ifndef PROXIMA_COMMON_MUTEX_H_
#define PROXIMA_COMMON_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace proxima {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Holds `mu` for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A one-shot event: Notify() once, WaitForNotification() from any number of threads.
class Notification {
 public:
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    notified_ = true;
    cv_.notify_all();
  }
  void WaitForNotification() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return notified_; });
  }
  // Waits until notified or `deadline`; returns whether notified.
  bool WaitForNotificationUntil(std::chrono::system_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline, [this] { return notified_; });
  }
  bool HasBeenNotified() {
    std::lock_guard<std::mutex> lock(mu_);
    return notified_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool notified_ = false;
};

}  // namespace proxima

#endif  // PROXIMA_COMMON_MUTEX_H_
