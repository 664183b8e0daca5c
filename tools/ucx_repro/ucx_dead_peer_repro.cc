// ucx_dead_peer_repro: produces, on demand, the UCX abort that made one-sided transfers between
// daemons unsafe (docs/cluster.md, "UCX between daemons"): the *target* of a one-sided operation
// that UCX emulates with messages (tcp) answers an initiator that died after its request
// arrived, the answer fails with "Endpoint timeout", and UCX treats that as fatal and aborts the
// target's process (ucp_request.inl, "Fatal: unexpected error"). And shows that active messages,
// which daemons send instead, do not.
//
// The window is made wide instead of waited for: a target process registers a buffer and
// progresses its worker; an initiator process connects and wires up with one flushed put while
// the target runs; the target is then stopped (SIGSTOP), the initiator posts its operation of
// --bytes, waits until the request has left (a put or an eager message: completed locally; a
// get or a rendezvous message: a few progress calls) and exits; then the target is continued. It
// reads the request and the closed connection in one progress call and answers a peer that is
// gone, if the protocol makes it answer.
//
//   UCX_TLS=tcp ucx_dead_peer_repro [--op=put|get|am|am-rndv|am-rndv-mid|am-rndv-decline|
//                                        am-rndv-release|am-to-dead|am-rndv-to-dead] [--bytes=8192] [--rounds=10]
//                                   [--mid_us=3000] [--control]
//
// put, get: one-sided operations (the target aborts). am, am-rndv: an eager or a rendezvous
// active message (the target, whose handler copies it or asks for its bytes, lives).
// am-rndv-decline, am-rndv-release: as am-rndv, but the target does not want the bytes: its
// handler declines the message, or holds it and releases it after that progress call.
// am-rndv-mid: the target is not stopped; it asks for the bytes of a rendezvous message at once,
// they start to flow into its buffer, and the initiator is killed (SIGKILL) --mid_us after it
// was told to send (choose --bytes large enough that the transfer is still under way then).
// am-to-dead, am-rndv-to-dead: the other way round, the long-lived process sends eight messages
// to a receiver that exits on the first one (after asking for its bytes, for rendezvous).
// --control: the initiator waits for its operation to complete at the target (a flush) before
// it exits, the same steps otherwise: the target then survives every round.
//
// Exit status: 10 when the target died (the line before says how), 0 when it survived every
// round, 2-9 for a setup failure. Not part of the test suite: it exists to tell whether a UCX
// build still aborts, and whether a protocol is exposed (docs/cluster.md lists the results).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
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
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
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

void SendBlob(int fd, const std::string& blob) { SendBlob(fd, blob.data(), blob.size()); }

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

// The target's active-message handler: copies an eager message into the buffer, or starts
// receiving a rendezvous one into it (the request is left to complete or fail on its own).
struct AmTarget {
  ucp_worker_h worker;
  char* buffer;
  size_t capacity;
};

std::string WorkerAddress(ucp_worker_h worker) {
  ucp_address_t* address = nullptr;
  size_t bytes = 0;
  if (ucp_worker_get_address(worker, &address, &bytes) != UCS_OK) {
    Fail(4, "ucp_worker_get_address");
  }
  std::string out(reinterpret_cast<const char*>(address), bytes);
  ucp_worker_release_address(worker, address);
  return out;
}

// Makes `cb` (with `target`) the worker's handler of active message 1.
void SetAmHandler(ucp_worker_h worker, ucp_am_recv_callback_t cb, AmTarget* target) {
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = 1;
  handler.cb = cb;
  handler.arg = target;
  if (ucp_worker_set_am_recv_handler(worker, &handler) != UCS_OK) Fail(4, "am handler");
}

void OnReceived(void* request, ucs_status_t status, size_t length, void*) {
  std::fprintf(stderr, "rendezvous receive of %zu bytes ended: %s\n", length,
               ucs_status_string(status));
  ucp_request_free(request);
}

// What the target does with a rendezvous message: receive it (am-rndv), decline it from its
// handler (am-rndv-decline: UCX then tells the sender itself), or hold it and release it after
// the progress call that brought it (am-rndv-release: ucp_am_data_release).
enum class RndvMode { kReceive, kDecline, kRelease };
RndvMode rndv_mode = RndvMode::kReceive;
void* held = nullptr;  // kRelease: the descriptor to release

ucs_status_t OnAm(void* arg, const void*, size_t, void* data, size_t length,
                  const ucp_am_recv_param_t* param) {
  auto* target = static_cast<AmTarget*>(arg);
  const size_t n = length < target->capacity ? length : target->capacity;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 && rndv_mode != RndvMode::kReceive) {
    std::fprintf(stderr, "target: rendezvous message of %zu bytes, %s\n", length,
                 rndv_mode == RndvMode::kDecline ? "declined" : "held");
    if (rndv_mode == RndvMode::kDecline) return UCS_OK;
    held = data;
    return UCS_INPROGRESS;
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    ucp_request_param_t receive{};
    receive.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    receive.cb.recv_am = OnReceived;
    std::fprintf(stderr, "target: rendezvous message of %zu bytes\n", length);
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(target->worker, data, target->buffer, n, &receive);
    if (!UCS_PTR_IS_PTR(request)) {
      std::fprintf(stderr, "target: rendezvous receive ended at once: %s\n",
                   ucs_status_string(UCS_PTR_STATUS(request)));
    }
    return UCS_OK;
  }
  std::fprintf(stderr, "target: eager message of %zu bytes\n", length);
  std::memcpy(target->buffer, data, n);
  return UCS_OK;
}

// The target: a registered buffer, its address and key sent to `out`, then progress forever.
// Reverse rounds (--op=am-to-dead, am-rndv-to-dead): the target connects to the worker address
// that arrived on `in` and sends it kSends messages of `bytes`, while that receiver exits on the
// first one it sees; every send must end (done or failed) and the target must live on.
constexpr int kSends = 8;

void SendToDying(ucp_worker_h worker, const std::string& address, size_t bytes, bool rndv) {
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = IgnorePeerError;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) Fail(5, "ucp_ep_create");
  std::vector<char> local(bytes, 'y');
  ucp_request_param_t am{};
  am.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  am.flags = rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  std::vector<ucs_status_ptr_t> sends;
  for (int i = 0; i < kSends; ++i) {
    sends.push_back(ucp_am_send_nbx(ep, 1, nullptr, 0, local.data(), bytes, &am));
  }
  int ok = 0, failed = 0;
  for (ucs_status_ptr_t request : sends) {
    if (Wait(worker, request)) {
      ++ok;
    } else {
      ++failed;
    }
  }
  std::fprintf(stderr, "target: %d sends to the dying receiver completed, %d failed\n", ok, failed);
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = UCP_EP_CLOSE_FLAG_FORCE;
  Wait(worker, ucp_ep_close_nbx(ep, &close));
}

[[noreturn]] void RunTarget(int out, int in, size_t bytes, bool rndv) {
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
  static AmTarget am{worker, buffer.data(), buffer.size()};
  SetAmHandler(worker, OnAm, &am);
  const uint64_t base = reinterpret_cast<uintptr_t>(buffer.data());
  SendBlob(out, WorkerAddress(worker));
  SendBlob(out, rkey, rkey_bytes);
  SendBlob(out, &base, sizeof base);
  fcntl(in, F_SETFL, O_NONBLOCK);
  while (true) {
    ucp_worker_progress(worker);
    if (held != nullptr) {
      ucp_am_data_release(worker, held);
      held = nullptr;
    }
    uint64_t n = 0;
    if (read(in, &n, sizeof n) != sizeof n) continue;  // nothing yet (a length comes whole)
    fcntl(in, F_SETFL, 0);
    std::string peer(n, '\0');
    ReadAll(in, peer.data(), n);
    fcntl(in, F_SETFL, O_NONBLOCK);
    SendToDying(worker, peer, bytes, rndv);
  }
}

// A receiver that exits inside its handler for the first message (a rendezvous one after
// asking for its data), from a reverse round.
bool dying = false;

ucs_status_t ExitOnAm(void* arg, const void*, size_t, void* data, size_t length,
                      const ucp_am_recv_param_t* param) {
  auto* receiver = static_cast<AmTarget*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    ucp_request_param_t receive{};
    receive.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    receive.cb.recv_am = OnReceived;
    ucp_am_recv_data_nbx(receiver->worker, data, receiver->buffer,
                         std::min(length, receiver->capacity), &receive);
    dying = true;  // the loop lets the request leave, then exits
    return UCS_OK;
  }
  _exit(0);
}

[[noreturn]] void RunDyingReceiver(size_t bytes, int ready) {
  ucp_context_h context = MakeContext();
  ucp_worker_h worker = MakeWorker(context);
  std::vector<char> buffer(bytes);
  static AmTarget am;
  am = AmTarget{worker, buffer.data(), buffer.size()};
  SetAmHandler(worker, ExitOnAm, &am);
  SendBlob(ready, WorkerAddress(worker));
  while (!dying) ucp_worker_progress(worker);
  for (int i = 0; i < 100; ++i) ucp_worker_progress(worker);
  _exit(0);
}

// The initiator: connects, wires up, tells the parent (ready), waits for the target to be
// stopped (go), posts the operation, lets it leave and exits.
[[noreturn]] void RunInitiator(const std::string& address, const std::string& rkey, uint64_t base,
                               size_t bytes, const std::string& kind, bool control, int ready,
                               int go, int mid_us) {
  const bool get = kind == "get";
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
  ucp_request_param_t am{};
  am.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  const bool rndv = kind.starts_with("am-rndv");
  am.flags = rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  if (kind == "am-rndv-mid") {  // the target runs: it asks for the bytes, and they start to flow
    ucs_status_ptr_t request = ucp_am_send_nbx(ep, 1, nullptr, 0, local.data(), bytes, &am);
    if (UCS_PTR_IS_ERR(request)) Fail(7, "ucp_am_send_nbx");
    while (true) ucp_worker_progress(worker);  // until the parent kills this process
  }
  if (kind == "am" || rndv) {
    ucs_status_ptr_t request = ucp_am_send_nbx(ep, 1, nullptr, 0, local.data(), bytes, &am);
    if (control) {
      if (!Wait(worker, request) || !Wait(worker, ucp_ep_flush_nbx(ep, &params))) {
        Fail(7, "am");
      }
    } else if (!rndv) {
      if (!Wait(worker, request)) Fail(7, "ucp_am_send_nbx");
    } else {
      if (UCS_PTR_IS_ERR(request)) Fail(7, "ucp_am_send_nbx");
      for (int i = 0; i < 1000; ++i) ucp_worker_progress(worker);  // the RTS leaves
    }
    _exit(0);
  }
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
  const int mid_us = std::atoi(proxima::bench::Arg(argc, argv, "mid_us", "3000").c_str());
  bool control = false;
  for (int i = 1; i < argc; ++i) control = control || std::string_view(argv[i]) == "--control";
  const bool reverse = op == "am-to-dead" || op == "am-rndv-to-dead";
  const bool mid = op == "am-rndv-mid";
  if (op == "am-rndv-decline") rndv_mode = RndvMode::kDecline;
  if (op == "am-rndv-release") rndv_mode = RndvMode::kRelease;
  if ((op != "put" && op != "get" && op != "am" && op != "am-rndv" && !mid &&
       op != "am-rndv-decline" && op != "am-rndv-release" && !reverse) ||
      bytes == 0 ||
      rounds <= 0) {
    std::fprintf(stderr,
                 "usage: UCX_TLS=tcp %s [--op=put|get|am|am-rndv|am-rndv-mid|am-rndv-decline|"
                 "am-rndv-release|am-to-dead|am-rndv-to-dead] [--bytes=N>0] [--rounds=N>0] [--mid_us=N] [--control]\n",
                 argv[0]);
    return 2;
  }
  int info[2], peers[2];
  if (pipe(info) != 0 || pipe(peers) != 0) Fail(3, "pipe");
  const pid_t target = fork();
  if (target == 0) RunTarget(info[1], peers[0], bytes, op == "am-rndv-to-dead");
  const std::string address = ReceiveBlob(info[0]);
  const std::string rkey = ReceiveBlob(info[0]);
  uint64_t base = 0;
  std::memcpy(&base, ReceiveBlob(info[0]).data(), sizeof base);

  for (int round = 0; reverse && round < rounds; ++round) {
    int ready[2];
    if (pipe(ready) != 0) Fail(3, "pipe");
    const pid_t receiver = fork();
    if (receiver == 0) RunDyingReceiver(bytes, ready[1]);
    const std::string peer = ReceiveBlob(ready[0]);
    SendBlob(peers[1], peer.data(), peer.size());
    int receiver_status = 0;
    waitpid(receiver, &receiver_status, 0);
    close(ready[0]);
    close(ready[1]);
    usleep(500000);  // the target sees the connection close and ends its sends
    int target_status = 0;
    const bool target_died = waitpid(target, &target_status, WNOHANG) == target;
    std::printf(
        "round %d: %s, %d sends of %zu bytes, receiver exited %d; target %s\n", round, op.c_str(),
        kSends, bytes,
        WIFEXITED(receiver_status) ? WEXITSTATUS(receiver_status) : -WTERMSIG(receiver_status),
        !target_died                 ? "alive"
        : WIFSIGNALED(target_status) ? strsignal(WTERMSIG(target_status))
                                     : "exited");
    std::fflush(stdout);
    if (target_died) return 10;
  }
  for (int round = 0; !reverse && round < rounds; ++round) {
    int ready[2], go[2];
    if (pipe(ready) != 0 || pipe(go) != 0) Fail(3, "pipe");
    const pid_t initiator = fork();
    if (initiator == 0) {
      RunInitiator(address, rkey, base, bytes, op, control, ready[1], go[0], mid_us);
    }
    char token = 0;
    ReadAll(ready[0], &token, 1);
    if (!mid) kill(target, SIGSTOP);
    usleep(20000);  // the stop has taken effect
    WriteAll(go[1], &token, 1);
    int initiator_status = 0;
    if (mid) {
      usleep(mid_us);
      kill(initiator, SIGKILL);
      waitpid(initiator, &initiator_status, 0);
    } else if (control) {  // the initiator waits for the target's answer: continue the target first
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
