// AddressCheck: a client's UCX worker address is parsed in a child process before this one's UCX
// parses it.
//
// UCX (1.13, Debian's build, assertions on) parses a worker address without a length and trusts
// what it says: a well-framed address whose transport attributes lie (a negative bandwidth or
// latency, a device index past the end) ends ucp_ep_create in an assertion (SIGABRT) or a
// segmentation fault, whatever the transports. proximad takes these addresses from its clients
// (ConnectUcx), so one such address would end the daemon and every block it holds. (Its cluster
// peers' addresses are not checked: docs/decisions.md says why.)
// Proxima cannot tell such an address from a good one itself without re-implementing UCX's
// private format; instead a short-lived child process (proximad itself, run with
// kAddressCheckFlag) opens a context and worker as the daemon's and creates the endpoint, and
// only an address it survived reaches the daemon's own UCX. The child inherits the daemon's
// environment (UCX_TLS, ...), so its lane selection is the daemon's.
//
// Cost: one process start and UCX context per new address (about 47 ms on 2 vCPUs: scripts/bench.sh
// connect); addresses that passed are remembered (a client reconnecting), and at most
// kMaxChildren run at once. docs/security.md and docs/decisions.md say what it covers and what it
// does not.
#ifndef PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_
#define PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_

#include <atomic>
#include <cstdint>
#include <semaphore>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace proxima::ucx {

// The command-line argument that makes proximad run as the check's child (RunAddressCheckChild).
inline constexpr char kAddressCheckFlag[] = "--check_ucx_worker_address";

// The child: reads one worker address from standard input, parses it
// (ParseAddressInThisProcess) and returns the process's exit code. Writes nothing to standard
// output; UCX's own messages (an assertion's) go to standard error, which the parent keeps.
int RunAddressCheckChild();

class AddressCheck {
 public:
  // At most this many children run at once; later checks wait for one to end.
  static constexpr int kMaxChildren = 4;
  // A child that has not ended this long after it started is killed, and its address refused.
  static constexpr absl::Duration kChildTimeout = absl::Seconds(10);

  // `command`: the program and arguments that run RunAddressCheckChild (proximad:
  // {"/proc/self/exe", kAddressCheckFlag}; a test: the proximad binary).
  explicit AddressCheck(std::vector<std::string> command,
                        absl::Duration child_timeout = kChildTimeout)
      : command_(std::move(command)), child_timeout_(child_timeout) {}

  // OK when the child parsed `address` and ended normally (or a child did before). Otherwise
  // INVALID_ARGUMENT naming how the child ended (the signal, UCX's message) or that it did not
  // end within its timeout; UNAVAILABLE when `deadline` passed first; INTERNAL when the child
  // cannot be started (the command is wrong for this host).
  absl::Status Check(const std::string& address, absl::Time deadline);

  // Addresses checked by a child, refused among them, and accepted without a child (known).
  uint64_t children_run() const { return children_run_.load(); }
  uint64_t refused() const { return refused_.load(); }
  uint64_t known() const { return known_.load(); }

 private:
  // Addresses a child accepted, remembered up to this many (then forgotten all at once).
  static constexpr size_t kMaxRemembered = 1024;

  const std::vector<std::string> command_;
  const absl::Duration child_timeout_;
  std::counting_semaphore<kMaxChildren> slots_{kMaxChildren};
  proxima::Mutex mu_;
  absl::flat_hash_set<std::string> accepted_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> children_run_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> known_{0};
};

}  // namespace proxima::ucx

#endif  // PROXIMA_COMMON_UCX_ADDRESS_CHECK_H_
