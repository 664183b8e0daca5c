#include "common/grpc_channel.h"

#include <grpc/grpc.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace proxima {

grpc::ChannelArguments ProximaChannelArguments(const ChannelSettings& settings) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(settings.max_message_bytes);
  args.SetMaxSendMessageSize(settings.max_message_bytes);
  // One connection per channel, even when two channels point at the same address: several
  // Clients in a process (load generators, benchmarks, a worker per GPU) or two peer entries for
  // one daemon then move bytes in parallel instead of sharing one TCP stream.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Blocks are megabytes: large HTTP/2 frames and a deep flow-control window move them in
  // fewer, bigger writes than gRPC's defaults (16 KiB frames). Also measured over loopback TCP,
  // and not set because none moved 256 KiB gets beyond run-to-run noise (docs/benchmarks.md,
  // run 8): BDP probing off, bigger TCP read chunks, gRPC's SO_RCVLOWAT experiment.
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  // gRPC's default reconnect backoff starts at 1 s and grows to 2 minutes while the server is
  // down, and calls fail fast meanwhile: after a 25 s daemon restart, calls still failed 5.3 s
  // after it served again (proxima_soak --kill_every_s=5 --down_s=25; 0 s with these), and a
  // restarted peer stayed out of the live set long after it answered. Proxima's servers are
  // near and cheap to reconnect to: retry after 100 ms, then no less often than the maximum.
  //
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC takes it as the least time a connection attempt
  // (TCP, TLS and HTTP/2 set-up) is given before it is abandoned, not as the backoff's floor.
  // Set to 100 ms, a connection slower than that (mTLS under emulation, a loaded host, a distant
  // peer) never completed: the client never reconnected under qemu (stop 60), and a peer behind a
  // link with 0.6 s of delay was never live (stop 61). gRPC's default (20 s) stays. Tests:
  // TlsTest.AClientReachesADaemonWhoseHandshakeTakesLongerThanTheReconnectBackoff,
  // MembershipTest.APeerWhoseConnectionTakesLongerThanTheBackoffJoins.
  const int max_backoff_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(settings.max_reconnect_backoff), 100, INT32_MAX));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms);
  if (!settings.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(settings.tls_server_name);
  }
  return args;
}

ChannelReconnector::ChannelReconnector(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)) {}

ChannelReconnector::~ChannelReconnector() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    thread = std::move(thread_);
  }
  cv_.notify_all();
  if (thread.joinable()) thread.join();
}

void ChannelReconnector::Wake() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) return;
  woken_ = true;
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { Run(); });
  } else {
    cv_.notify_all();
  }
}

int ChannelReconnector::reconnected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reconnected_;
}

void ChannelReconnector::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return woken_ || stop_; });
    if (stop_) return;
    woken_ = false;
    lock.unlock();
    // GetState(true) asks an IDLE channel to connect; waiting on its state polls it, which is
    // what moves the connection attempts (and the backoff between them) along.
    bool reconnected = false;
    for (grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
         state != GRPC_CHANNEL_READY; state = channel_->GetState(/*try_to_connect=*/true)) {
      channel_->WaitForStateChange(state, absl::ToChronoTime(absl::Now() + kSlice));
      std::lock_guard<std::mutex> check(mu_);
      if (stop_) break;
      reconnected = true;
    }
    lock.lock();
    if (stop_) return;
    if (reconnected) ++reconnected_;
  }
}

}  // namespace proxima
