// ucx_dead_peer_repro: produces, on demand, the UCX abort that keeps daemon-to-daemon transfers
// over UCX opt-in (docs/cluster.md, "It is not the default"): the *target* of a one-sided
// operation that UCX emulates with messages (tcp) answers an initiator that died after its
// request arrived, the answer fails with "Endpoint timeout", and UCX treats that as fatal and
// aborts the target's process (ucp_request.inl, "Fatal: unexpected error").
//
// The window is made wide instead of waited for: a target process registers a buffer and
// progresses its worker; an initiator process connects and wires up with one flushed put while
// the target runs; the target is then stopped (SIGSTOP), the initiator posts a put (or a get) of
// --bytes, waits until the request has left (a put: completed locally; a get: a few progress
// calls) and exits; then the target is continued. It reads the request and the closed
// connection in one progress call and answers a peer that is gone.
//
//   UCX_TLS=tcp ucx_dead_peer_repro [--op=put|get] [--bytes=8192] [--rounds=10] [--control]
//
// --control: the initiator waits for its operation to complete at the target (a flush) before
// it exits, the same steps otherwise: the target then survives every round.
//
// Exit status: 10 when the target died (the line before says how), 0 when it survived every
// round, 2-9 for a setup failure. Not part of the test suite: it exists to tell whether a UCX
// build still aborts (docs/cluster.md lists the versions tried).
#include <signal.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "bench/args.h"

namespace {

[[noreturn]] void Fail(int code, const char* what) {
  std::fprintf(stderr, "ucx_dead_peer_repro: %s\n", what);
  _exit(code);
}

ucp_context_h MakeContext() {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) Fail(2, "ucp_config_read");
  ucp_context_h context = nullptr;
  const ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) Fail(2, "ucp_init");
  return context;
}

ucp_worker_h MakeWorker(ucp_context_h context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  if (ucp_worker_create(context, &params, &worker) != UCS_OK) Fail(2, "ucp_worker_create");
  return worker;
}

void WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = write(fd, p, n);
    if (k <= 0) Fail(3, "pipe write");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = read(fd, p, n);
    if (k <= 0) Fail(3, "pipe read");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void SendBlob(int fd, const void* data, uint64_t n) {
  WriteAll(fd, &n, sizeof n);
  WriteAll(fd, data, n);
}

std::string ReceiveBlob(int fd) {
  uint64_t n = 0;
  ReadAll(fd, &n, sizeof n);
  std::string s(n, '\0');
  ReadAll(fd, s.data(), n);
  return s;
}

// Progresses `worker` until `request` (from a *_nbx call) is done; false on an error.
bool Wait(ucp_worker_h worker, ucs_status_ptr_t request) {
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) return false;
  while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker);
  const bool ok = ucp_request_check_status(request) == UCS_OK;
  ucp_request_free(request);
  return ok;
}

void IgnorePeerError(void*, ucp_ep_h, ucs_status_t) {}

// The target: a registered buffer, its address and key sent to `out`, then progress forever.
[[noreturn]] void RunTarget(int out, size_t bytes) {
  ucp_context_h context = MakeContext();
  ucp_worker_h worker = MakeWorker(context);
  std::vector<char> buffer(bytes + 4096);
  ucp_mem_map_params_t map{};
  map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  map.address = buffer.data();
  map.length = buffer.size();
  ucp_mem_h memh = nullptr;
  if (ucp_mem_map(context, &map, &memh) != UCS_OK) Fail(4, "ucp_mem_map");
  void* rkey = nullptr;
  size_t rkey_bytes = 0;
  if (ucp_rkey_pack(context, memh, &rkey, &rkey_bytes) != UCS_OK) Fail(4, "ucp_rkey_pack");
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  if (ucp_worker_get_address(worker, &address, &address_bytes) != UCS_OK) {
    Fail(4, "ucp_worker_get_address");
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(buffer.data());
  SendBlob(out, address, address_bytes);
  SendBlob(out, rkey, rkey_bytes);
  SendBlob(out, &base, sizeof base);
  while (true) ucp_worker_progress(worker);
}

// The initiator: connects, wires up, tells the parent (ready), waits for the target to be
// stopped (go), posts the operation, lets it leave and exits.
[[noreturn]] void RunInitiator(const std::string& address, const std::string& rkey,
                               uint64_t base, size_t bytes, bool get, bool control, int ready,
                               int go) {
  ucp_context_h context = MakeContext();
  ucp_worker_h worker = MakeWorker(context);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // as proximad's endpoints
  ep_params.err_handler.cb = IgnorePeerError;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) Fail(5, "ucp_ep_create");
  ucp_rkey_h remote_key = nullptr;
  if (ucp_ep_rkey_unpack(ep, rkey.data(), &remote_key) != UCS_OK) Fail(5, "ucp_ep_rkey_unpack");
  std::vector<char> local(bytes, 'x');
  ucp_request_param_t params{};
  if (!Wait(worker, ucp_put_nbx(ep, local.data(), 64, base, remote_key, &params)) ||
      !Wait(worker, ucp_ep_flush_nbx(ep, &params))) {
    Fail(6, "wire-up put");
  }
  char token = 1;
  WriteAll(ready, &token, 1);
  ReadAll(go, &token, 1);  // the target is stopped now
  if (control) {  // the answer arrives once the parent continues the target
    ucs_status_ptr_t op = get ? ucp_get_nbx(ep, local.data(), bytes, base, remote_key, &params)
                              : ucp_put_nbx(ep, local.data(), bytes, base, remote_key, &params);
    if (!Wait(worker, op) || !Wait(worker, ucp_ep_flush_nbx(ep, &params))) Fail(7, "operation");
  } else if (get) {
    ucs_status_ptr_t request = ucp_get_nbx(ep, local.data(), bytes, base, remote_key, &params);
    if (UCS_PTR_IS_ERR(request)) Fail(7, "ucp_get_nbx");
    for (int i = 0; i < 1000; ++i) ucp_worker_progress(worker);  // the request leaves
  } else if (!Wait(worker, ucp_put_nbx(ep, local.data(), bytes, base, remote_key, &params))) {
    Fail(7, "ucp_put_nbx");
  }
  _exit(0);  // no flush, no close: the process is gone before the target answers
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = proxima::bench::Arg(argc, argv, "op", "put");
  const size_t bytes =
      std::strtoull(proxima::bench::Arg(argc, argv, "bytes", "8192").c_str(), nullptr, 10);
  const int rounds = std::atoi(proxima::bench::Arg(argc, argv, "rounds", "10").c_str());
  bool control = false;
  for (int i = 1; i < argc; ++i) control = control || std::string_view(argv[i]) == "--control";
  if ((op != "put" && op != "get") || bytes == 0 || rounds <= 0) {
    std::fprintf(stderr,
                 "usage: UCX_TLS=tcp %s [--op=put|get] [--bytes=N>0] [--rounds=N>0] [--control]\n",
                 argv[0]);
    return 2;
  }
  int info[2];
  if (pipe(info) != 0) Fail(3, "pipe");
  const pid_t target = fork();
  if (target == 0) RunTarget(info[1], bytes);
  const std::string address = ReceiveBlob(info[0]);
  const std::string rkey = ReceiveBlob(info[0]);
  uint64_t base = 0;
  std::memcpy(&base, ReceiveBlob(info[0]).data(), sizeof base);

  for (int round = 0; round < rounds; ++round) {
    int ready[2], go[2];
    if (pipe(ready) != 0 || pipe(go) != 0) Fail(3, "pipe");
    const pid_t initiator = fork();
    if (initiator == 0) {
      RunInitiator(address, rkey, base, bytes, op == "get", control, ready[1], go[0]);
    }
    char token = 0;
    ReadAll(ready[0], &token, 1);
    kill(target, SIGSTOP);
    usleep(20000);  // the stop has taken effect
    WriteAll(go[1], &token, 1);
    int initiator_status = 0;
    if (control) {  // the initiator waits for the target's answer: continue the target first
      usleep(20000);
      kill(target, SIGCONT);
      waitpid(initiator, &initiator_status, 0);
    } else {
      waitpid(initiator, &initiator_status, 0);
      kill(target, SIGCONT);
    }
    for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
    usleep(200000);  // the target reads the request and the closed connection
    int target_status = 0;
    const bool target_died = waitpid(target, &target_status, WNOHANG) == target;
    std::printf("round %d: %s of %zu bytes, initiator exited %d; target %s\n", round, op.c_str(),
                bytes,
                WIFEXITED(initiator_status) ? WEXITSTATUS(initiator_status)
                                            : -WTERMSIG(initiator_status),
                !target_died                    ? "alive"
                : WIFSIGNALED(target_status) ? strsignal(WTERMSIG(target_status))
                                             : "exited");
    std::fflush(stdout);
    if (target_died) return 10;
  }
  kill(target, SIGKILL);
  waitpid(target, nullptr, 0);
  return 0;
}
