// DaemonProcess: runs the real proximad binary for integration tests, on an ephemeral TCP port
// and a Unix socket in a fresh temporary directory, and stops it (SIGKILL if need be) when
// destroyed. RunCommand() runs any binary with a deadline and captures its output.
#ifndef PROXIMA_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define PROXIMA_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace proxima::testing {

struct CommandResult {
  int exit_code = -1;  // -1 when killed by a signal or the deadline
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs argv[0] with arguments, killing it (SIGKILL) after `deadline`, or as soon as `kill_when`
// (when given; polled every 2 ms while the command runs) returns true.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         absl::Duration deadline = absl::Seconds(60),
                         const std::function<bool()>& kill_when = nullptr);

// What a time bound of a test is multiplied by where the binaries run under an emulator
// (PROXIMA_TEST_RUNNER set: scripts/aarch64.sh's qemu-user): 5, else 1.
int EmulationFactor();

// Paths of the binaries under test (set by CMake).
std::string ProximadPath();
std::string ProximactlPath();

// The --set overrides that make daemons on 127.0.0.1:`ports` one cluster, for node `node`: it
// listens on and advertises its own port, lists every port as a static peer, takes the peer
// token from `token_file`, checks peers' health every 100 ms (down after 2 failures) and gives
// peer calls `peer_deadline`. The UCX data plane is off; an override after these turns it on.
std::vector<std::string> ClusterSets(const std::vector<int>& ports, size_t node,
                                     const std::string& token_file, absl::Duration peer_deadline);

// The value of `key` on the last line of `log` that holds `message` (a daemon's log line:
// `... message key=value key="value" ...`; a restarted daemon's log holds every run's): the
// value, without the quotes of a quoted one. nullopt when no line holds `message`, or that line
// has no `key`.
std::optional<std::string> LogValue(const std::string& log, const std::string& message,
                                    const std::string& key);

class DaemonProcess {
 public:
  // Starts proximad with `sets` as --set overrides on top of a test baseline (port 0, a Unix
  // socket in the temp dir, metrics on port 0, 64 MiB host tier). Waits until it serves. An
  // entry that starts with "--" is passed as it is (e.g. "--config=FILE").
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(std::vector<std::string> sets = {});
  // The same, with proximad run through `launcher` (e.g. {"ip", "netns", "exec", "ns1"}: the
  // launcher must exec proximad in its place, so that signals reach the daemon itself).
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(std::vector<std::string> sets,
                                                              std::vector<std::string> launcher);
  ~DaemonProcess();

  std::string tcp_target() const { return "127.0.0.1:" + std::to_string(tcp_port_); }
  std::string unix_target() const { return "unix:" + socket_path_; }
  const std::string& socket_path() const { return socket_path_; }
  int tcp_port() const { return tcp_port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_; }

  // Sends `sig` to the daemon.
  void Signal(int sig);
  // Waits for the daemon to exit; returns its exit code, or -1 if killed by a signal or if it
  // did not exit in time.
  int WaitExit(absl::Duration timeout);
  // Kills the daemon (if running) and starts it again on the same TCP address and socket, with
  // `more_sets` added after its overrides (a changed config: later ones win), for this start and
  // the later ones.
  absl::Status Restart(const std::vector<std::string>& more_sets = {});
  // Everything the daemon wrote to stderr so far.
  std::string Log() const;
  // GET /metrics from the daemon's metrics endpoint.
  absl::StatusOr<std::string> ScrapeMetrics() const;
  // The daemon's resident set size in bytes (VmRSS of /proc/PID/status).
  absl::StatusOr<uint64_t> ResidentBytes() const;

 private:
  DaemonProcess() = default;
  absl::Status Launch(const std::vector<std::string>& sets);

  std::string dir_;
  std::string socket_path_;
  std::vector<std::string> sets_;
  std::vector<std::string> launcher_;
  pid_t pid_ = -1;
  int tcp_port_ = 0;
  int metrics_port_ = 0;
  int launches_ = 0;
};

}  // namespace proxima::testing

#endif  // PROXIMA_TESTS_INTEGRATION_DAEMON_PROCESS_H_
