// The gRPC channel arguments every Proxima channel uses: libproxima's channel to its daemon,
// the daemon's channels to its peers, proximactl's. One place, so that a setting found wrong
// (stops 60 and 61 each mended the same reconnect fault in one of two copies) is mended once.
//
// Thread-safe: ProximaChannelArguments is a pure function; ChannelReconnector's methods may be
// called from any thread.
#ifndef PROXIMA_COMMON_GRPC_CHANNEL_H_
#define PROXIMA_COMMON_GRPC_CHANNEL_H_

#include <grpcpp/channel.h>
#include <grpcpp/support/channel_arguments.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"

namespace proxima {

struct ChannelSettings {
  // Largest message sent or received; -1: no limit (the server enforces its own).
  int max_message_bytes = -1;
  // Reconnect backoff after a lost or refused connection: 100 ms at first, growing to this.
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // The name the server's certificate must carry, when not the name called (servers reached
  // by address whose certificates name a shared DNS name). Empty: the name called.
  std::string tls_server_name;
};

// Arguments for grpc::CreateCustomChannel: `settings`, one connection per channel, and HTTP/2
// framing sized for megabyte blocks.
grpc::ChannelArguments ProximaChannelArguments(const ChannelSettings& settings);

// Drives a channel's reconnection while no call waits on it.
//
// A gRPC channel whose connection failed retries at its backoff's pace, but only makes progress
// while some thread polls it: a call waiting on it, or gRPC's backup poller (every 5 s). Calls
// that fail fast (not wait_for_ready) poll for no time, so a client whose daemon came back kept
// failing for 3.4-8.9 s (measured; docs/reliability.md). Wake() after a call fails UNAVAILABLE:
// a thread of its own (started on the first Wake) then watches the channel's state, asking it to
// connect, until the channel is READY, and sleeps until the next Wake.
class ChannelReconnector {
 public:
  explicit ChannelReconnector(std::shared_ptr<grpc::Channel> channel);
  ~ChannelReconnector();  // stops the thread: at most one poll slice (kSlice) later
  ChannelReconnector(const ChannelReconnector&) = delete;
  ChannelReconnector& operator=(const ChannelReconnector&) = delete;

  // Reconnects the channel in the background unless it is READY.
  void Wake();
  // How many times the thread found the channel READY again after a Wake (tests).
  int reconnected() const;

  // Longest single wait on the channel's state: bounds how late a stop is seen.
  static constexpr absl::Duration kSlice = absl::Milliseconds(50);

 private:
  void Run();

  const std::shared_ptr<grpc::Channel> channel_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool woken_ = false;   // guarded by mu_
  bool stop_ = false;    // guarded by mu_
  int reconnected_ = 0;  // guarded by mu_
  std::thread thread_;   // started by the first Wake(); guarded by mu_
};

}  // namespace proxima

#endif  // PROXIMA_COMMON_GRPC_CHANNEL_H_
