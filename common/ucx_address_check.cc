#include "common/ucx_address_check.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/ucx.h"

extern char** environ;

namespace proxima::ucx {
namespace {

// What the child said on standard error that is kept: UCX's assertion line and a little more.
constexpr size_t kKeptErrorBytes = 4096;

// How a child ended.
struct ChildEnd {
  std::string start_error;  // non-empty: it never ran
  int start_errno = 0;      // the system's error when it never ran, where there was one
  bool timed_out = false;   // killed at `until`
  bool stopped = false;     // killed because `stop` was set
  int wait_status = 0;      // waitpid's
  std::string stderr_text;  // the first kKeptErrorBytes of its standard error and output
};

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

// How often a waiting child's parent looks at `stop`.
constexpr absl::Duration kStopPoll = absl::Milliseconds(100);

// Runs `command` with `input` on its standard input until it ends, or kills it at `until` or
// once `stop` is set.
ChildEnd RunChild(const std::vector<std::string>& command, const std::string& input,
                  absl::Time until, const std::atomic<bool>& stop) {
  ChildEnd end;
  // Standard input is a socket, so that writing to a child that already died is EPIPE
  // (MSG_NOSIGNAL), not SIGPIPE in a process that may not ignore it.
  int in[2] = {-1, -1};
  int out[2] = {-1, -1};
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    end.start_errno = errno;
    end.start_error = absl::StrCat("cannot make its pipes: ", std::strerror(errno));
    for (int* fd : {&in[0], &in[1], &out[0], &out[1]}) CloseFd(*fd);
    return end;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[1], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
  posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
  // proximad blocks the signals it waits for and ignores SIGPIPE; the child starts without that.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  CloseFd(in[1]);
  CloseFd(out[1]);
  if (spawned != 0) {
    end.start_errno = spawned;
    end.start_error = absl::StrCat("cannot run ", command[0], ": ", std::strerror(spawned));
    CloseFd(in[0]);
    CloseFd(out[0]);
    return end;
  }
  // Addresses are small (kMaxWorkerAddressBytes at most, below a socket's buffer): one send.
  for (size_t sent = 0; sent < input.size();) {
    const ssize_t n = send(in[0], input.data() + sent, input.size() - sent, MSG_NOSIGNAL);
    if (n <= 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the child is gone; how it ended is what counts
    sent += static_cast<size_t>(n);
  }
  CloseFd(in[0]);
  // Its standard error closes when it ends.
  for (;;) {
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) {
      end.timed_out = true;
      break;
    }
    if (stop.load()) {
      end.stopped = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    const int ready =
        poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(std::min(left, kStopPoll))) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;  // the loop's deadline check decides
    char buf[1024];
    const ssize_t n = read(out[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const size_t keep = std::min(static_cast<size_t>(n), kKeptErrorBytes - end.stderr_text.size());
    end.stderr_text.append(buf, keep);
  }
  CloseFd(out[0]);
  if (end.timed_out || end.stopped) kill(pid, SIGKILL);
  while (waitpid(pid, &end.wait_status, 0) < 0 && errno == EINTR) {
  }
  return end;
}

// UCX's line that says why the child died ("...select.c:294  Assertion `...' failed"), or the
// first line it wrote.
std::string UcxReason(const std::string& text) {
  std::string first;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
    line = absl::StripAsciiWhitespace(line);
    if (first.empty()) first = std::string(line);
    if (absl::StrContains(line, "Assertion") || absl::StrContains(line, "Caught signal")) {
      return std::string(line.substr(0, 300));
    }
  }
  return first.substr(0, 300);
}

}  // namespace

int RunAddressCheckChild() {
  std::string address;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(STDIN_FILENO, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    address.append(buf, static_cast<size_t>(n));
    if (address.size() > kMaxWorkerAddressBytes) return kAddressCheckBadInput;
  }
  const int code = ParseAddressInThisProcess(address);
  std::fflush(stderr);
  // No exit handlers, no UCX cleanup: closing the endpoint would start its wire-up.
  _exit(code);
}

AddressCheck::~AddressCheck() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
    threads.swap(threads_);
  }
  wake_.notify_all();
  done_.notify_all();
  for (std::thread& t : threads) t.join();
}

absl::Status AddressCheck::Check(const std::string& address, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (accepted_.contains(address)) {
    known_.fetch_add(1);
    return absl::OkStatus();
  }
  if (auto it = refused_by_.find(address); it != refused_by_.end()) {
    known_.fetch_add(1);
    return it->second;
  }
  if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
  std::shared_ptr<Job> job;
  if (auto it = pending_.find(address); it != pending_.end()) {
    job = it->second;
  } else {
    if (pending_.size() >= kMaxPending) {
      return absl::UnavailableError(absl::StrCat(
          kMaxPending, " UCX worker addresses are already waiting to be checked; try again"));
    }
    job = std::make_shared<Job>();
    job->address = address;
    pending_.emplace(address, job);
    queue_.push_back(job);
    if (idle_ == 0 && threads_.size() < static_cast<size_t>(kMaxChildren)) {
      threads_.emplace_back([this] { Work(); });
    } else {
      wake_.notify_one();
    }
  }
  const bool decided = done_.wait_until(lock, absl::ToChronoTime(deadline),
                                        [&] { return job->done || stopping_.load(); });
  if (decided && job->done) return job->verdict;
  if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
  return absl::UnavailableError(
      "the call's deadline passed before the check of the UCX worker address ended (it goes on; "
      "a later call with the same address gets its verdict)");
}

void AddressCheck::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    wake_.wait(lock, [this] { return !queue_.empty() || stopping_.load(); });
    --idle_;
    if (stopping_.load()) return;
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    bool same_every_time = false;
    absl::Status verdict = RunOne(job->address, &same_every_time);
    lock.lock();
    if (verdict.ok()) {
      if (accepted_.size() >= kMaxRemembered) accepted_.clear();
      accepted_.insert(job->address);
    } else if (same_every_time) {
      if (refused_by_.size() >= kMaxRemembered) refused_by_.clear();
      refused_by_.insert_or_assign(job->address, verdict);
    }
    job->verdict = std::move(verdict);
    job->done = true;
    pending_.erase(job->address);
    done_.notify_all();
  }
}

absl::Status AddressCheck::RunOne(const std::string& address, bool* same_every_time) {
  children_run_.fetch_add(1);
  ChildEnd end = RunChild(command_, address, absl::Now() + child_timeout_, stopping_);
  const int status = end.wait_status;
  // 127: the exec failed in the child (posix_spawn reports it so where it forks, e.g. qemu-user).
  if (end.start_error.empty() && !end.timed_out && !end.stopped && WIFEXITED(status) &&
      WEXITSTATUS(status) == 127) {
    end.start_error = absl::StrCat("cannot run ", command_[0], ": exit code 127");
  }
  if (!end.start_error.empty() && (end.start_errno == EMFILE || end.start_errno == ENFILE ||
                                   end.start_errno == EAGAIN || end.start_errno == ENOMEM)) {
    // Out of descriptors, processes or memory for now: nothing wrong with the address or the
    // command, and the next try may find them.
    return absl::UnavailableError(absl::StrCat(
        "cannot check the UCX worker address now (", end.start_error,
        "): proximad is short of file descriptors, processes or memory; if it is the open-file "
        "limit, raise its hard limit (docs/operations.md, Open files)"));
  }
  if (!end.start_error.empty()) {
    return absl::InternalError(
        absl::StrCat("cannot check the UCX worker address in a child process (", end.start_error,
                     "); set ucx.check_worker_addresses: false where proximad cannot run itself"));
  }
  if (end.stopped) return absl::UnavailableError("the daemon is stopping");
  if (!end.timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  if (!end.timed_out && WIFEXITED(status) && WEXITSTATUS(status) == kAddressCheckCannotStart) {
    return absl::InternalError(
        absl::StrCat("the process that checks UCX worker addresses could not open a UCX context: ",
                     UcxReason(end.stderr_text)));
  }
  std::string how;
  if (end.timed_out) {
    how = absl::StrCat("did not return within ", absl::FormatDuration(child_timeout_));
  } else if (WIFSIGNALED(status)) {
    how = absl::StrCat("ended the process that tried it with signal ", WTERMSIG(status), " (",
                       strsignal(WTERMSIG(status)), ")");
  } else {
    how = absl::StrCat("ended the process that tried it with exit code ", WEXITSTATUS(status));
  }
  const std::string reason = UcxReason(end.stderr_text);
  refused_.fetch_add(1);
  *same_every_time = !end.timed_out;
  PROXIMA_LOG(kWarning) << "refused a UCX worker address that UCX cannot parse"
                        << log::Kv("bytes", address.size()) << log::Kv("how", how)
                        << log::Kv("ucx", reason);
  return absl::InvalidArgumentError(absl::StrCat(
      "UCX worker address of ", address.size(),
      " bytes: creating an endpoint to it (ucp_ep_create) ", how,
      reason.empty() ? "" : absl::StrCat(": ", reason), "; expected an address packed by UCX ",
      UCP_API_MAJOR, ".", UCP_API_MINOR, " (ucp_worker_query) and not altered since"));
}

}  // namespace proxima::ucx
