// AddressCheck: a UCX worker address that came over the network is parsed in a child process
// before this one's UCX parses it.
//
// UCX (1.13, Debian's build, assertions on) parses a worker address without a length and trusts
// what it says: a well-framed address whose transport attributes lie (a negative bandwidth or
// latency, a device index past the end) ends ucp_ep_create in an assertion (SIGABRT) or a
// segmentation fault, whatever the transports. proximad takes these addresses from its clients
// (ConnectUcx) and from its cluster peers (FetchBlocks, StoreBlocks answers), so one such address
// would end the daemon and every block it holds.
// Proxima cannot tell such an address from a good one itself without re-implementing UCX's
// private format; instead a short-lived child process (proximad itself, run with
// kAddressCheckFlag) opens a context and worker as the daemon's and creates the endpoint, and
// only an address it survived reaches the daemon's own UCX. The child inherits the daemon's
// environment (UCX_TLS, ...), so its lane selection is the daemon's.
//
// The children run on this object's own threads (kMaxChildren at most, started as needed), not
// the caller's: a caller waits for the verdict until its deadline, and when that passes first
// the check goes on and its verdict is remembered for the next caller of the same address. A
// cluster peer's path waits at most half its call's time and moves blocks inline until the
// verdict is in; a spill sender starts the check without waiting (a past deadline) as soon as a
// receiver names a new address.
//
// Cost: one process start and UCX context per new address (about 47 ms on 2 vCPUs: scripts/bench.sh
// connect); verdicts are remembered (a client reconnecting, a peer's every call). docs/security.md
// and docs/decisions.md say what it covers and what it does not.
#ifndef PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_
#define PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace proxima::ucx {

// The command-line argument that makes proximad run as the check's child (RunAddressCheckChild).
inline constexpr char kAddressCheckFlag[] = "--check_ucx_worker_address";

// The child: reads one worker address from standard input, parses it
// (ParseAddressInThisProcess) and returns the process's exit code. Writes nothing to standard
// output; UCX's own messages (an assertion's) go to standard error, which the parent keeps.
int RunAddressCheckChild();

class AddressCheck {
 public:
  // At most this many children run at once; later checks queue for one to end.
  static constexpr int kMaxChildren = 4;
  // At most this many addresses are queued or being checked; a new one past it is turned away
  // (UNAVAILABLE), so that a flood of addresses costs a bounded amount of memory and children.
  static constexpr size_t kMaxPending = 64;
  // A child that has not ended this long after it started is killed, and its address refused.
  static constexpr absl::Duration kChildTimeout = absl::Seconds(10);

  // `command`: the program and arguments that run RunAddressCheckChild (proximad:
  // {"/proc/self/exe", kAddressCheckFlag}; a test: the proximad binary).
  explicit AddressCheck(std::vector<std::string> command,
                        absl::Duration child_timeout = kChildTimeout)
      : command_(std::move(command)), child_timeout_(child_timeout) {}
  // Kills the children still running and joins the threads. REQUIRES: no call in Check().
  ~AddressCheck();

  AddressCheck(const AddressCheck&) = delete;
  AddressCheck& operator=(const AddressCheck&) = delete;

  // OK when a child parsed `address` and ended normally (now or before). Otherwise
  // INVALID_ARGUMENT naming how the child ended (the signal, UCX's message) or that it did not
  // end within its timeout; UNAVAILABLE when `deadline` passed before the verdict (the check
  // goes on: ask again), too many addresses are pending, or the child cannot be started for want
  // of file descriptors, processes or memory; INTERNAL when the child cannot be started
  // otherwise (the command is wrong for this host). With a deadline already past, this never
  // waits: it answers a remembered verdict or starts the check and says UNAVAILABLE.
  absl::Status Check(const std::string& address, absl::Time deadline);

  // Children run, addresses they refused, and answers from a remembered verdict.
  uint64_t children_run() const { return children_run_.load(); }
  uint64_t refused() const { return refused_.load(); }
  uint64_t known() const { return known_.load(); }

 private:
  // Verdicts remembered, per kind, up to this many (then forgotten all at once).
  static constexpr size_t kMaxRemembered = 1024;

  struct Job {
    std::string address;
    bool done = false;     // under mu_
    absl::Status verdict;  // set before `done`
  };

  // A thread's loop: runs queued jobs until stopping_.
  void Work();
  // Runs the child on `address` and returns its verdict (Check's errors but UNAVAILABLE for a
  // deadline). `same_every_time`: set for a refusal by the child's death, which the same bytes
  // would bring again (not for one that ran out of time).
  absl::Status RunOne(const std::string& address, bool* same_every_time);

  const std::vector<std::string> command_;
  const absl::Duration child_timeout_;
  std::atomic<bool> stopping_{false};  // read by running children's loops too

  // std::mutex for the condition variables' sake (common/mutex.h's Mutex has none).
  std::mutex mu_;
  std::condition_variable wake_;            // a job was queued, or stopping_
  std::condition_variable done_;            // a job got its verdict, or stopping_
  std::deque<std::shared_ptr<Job>> queue_;  // under mu_
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> pending_;  // queued or running; mu_
  absl::flat_hash_set<std::string> accepted_;                       // under mu_
  // Addresses a child died on (a signal, an exit code): the same bytes die the same way.
  // Children that ran out of time are not remembered (a loaded host may pass them next time).
  absl::flat_hash_map<std::string, absl::Status> refused_by_;  // under mu_
  std::vector<std::thread> threads_;                           // under mu_
  int idle_ = 0;  // threads waiting for a job; under mu_
  std::atomic<uint64_t> children_run_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> known_{0};
};

}  // namespace proxima::ucx

#endif  // PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_
