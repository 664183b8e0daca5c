#include "common/grpc_channel.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace proxima {
namespace {

std::string SocketPath(const char* name) {
  return ::testing::TempDir() + "/gc-" + std::to_string(getpid()) + "-" + name;
}

// A gRPC server on a Unix socket. It needs a service: a generic one, which no call reaches.
struct Server {
  grpc::CallbackGenericService service;
  std::unique_ptr<grpc::Server> server;
  ~Server() {
    if (server != nullptr) {
      server->Shutdown();
      server->Wait();
    }
  }
};

std::unique_ptr<Server> Serve(const std::string& path) {
  auto s = std::make_unique<Server>();
  unlink(path.c_str());
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&s->service);
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  s->server = builder.BuildAndStart();
  return s->server != nullptr ? std::move(s) : nullptr;
}

std::shared_ptr<grpc::Channel> ChannelTo(const std::string& path) {
  return grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(),
                                   ProximaChannelArguments({}));
}

// Waits until `channel` is in `want`, looking without asking it to connect or polling it.
bool StateBecomes(grpc::Channel& channel, grpc_connectivity_state want, absl::Duration within) {
  const absl::Time until = absl::Now() + within;
  while (channel.GetState(/*try_to_connect=*/false) != want) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

TEST(ChannelReconnectorTest, AWokenReconnectorBringsTheChannelBackWithNoCallMade) {
  const std::string path = SocketPath("back");
  std::unique_ptr<Server> server = Serve(path);
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = ChannelTo(path);
  ASSERT_TRUE(channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  ChannelReconnector reconnector(channel);
  reconnector.Wake();  // READY: nothing to do
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(reconnector.reconnected(), 0);

  // The server goes: the channel's connection is lost, and an attempt to make another fails.
  server.reset();
  unlink(path.c_str());
  channel->GetState(/*try_to_connect=*/true);
  ASSERT_TRUE(channel->WaitForStateChange(GRPC_CHANNEL_READY,
                                          absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  // What a failed call does: wake the reconnector. Then the server stays away for longer than
  // the backoff's 1 s maximum, and comes back on the same socket.
  reconnector.Wake();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_NE(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
  server = Serve(path);
  ASSERT_NE(server, nullptr);
  const absl::Time back = absl::Now();
  // Nothing here calls the channel: it is READY again within the backoff's maximum, its 20%
  // jitter and room for a loaded or emulated machine. (In this process the server's threads poll
  // too, which moves the channel's connection on as well; what the reconnector is for, a client
  // whose daemon is another process, is checked by tests/integration:
  // DaemonIntegrationTest.WhileItsDaemonIsDownAClientFailsAtOnceAndServesSoonAfterItReturns.)
  EXPECT_TRUE(StateBecomes(*channel, GRPC_CHANNEL_READY, absl::Seconds(5)))
      << "state " << channel->GetState(false) << " after " << absl::Now() - back;
  EXPECT_TRUE(StateBecomes(*channel, GRPC_CHANNEL_READY, absl::ZeroDuration()));
  // Counted once the thread saw it; then it sleeps until the next Wake.
  const absl::Time until = absl::Now() + absl::Seconds(2);
  while (reconnector.reconnected() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(reconnector.reconnected(), 1);
  server.reset();
  unlink(path.c_str());
}

TEST(ChannelReconnectorTest, GoesAtOnceWhileItsServerIsAway) {
  // Destroyed while it is still trying (its server never came): it stops within its poll slice
  // (and room for an emulated machine), where a thread that did not look would go on for good.
  const std::string path = SocketPath("never");
  unlink(path.c_str());
  std::shared_ptr<grpc::Channel> channel = ChannelTo(path);
  auto reconnector = std::make_unique<ChannelReconnector>(channel);
  reconnector->Wake();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_NE(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
  const absl::Time start = absl::Now();
  reconnector.reset();
  EXPECT_LE(absl::Now() - start, ChannelReconnector::kSlice + absl::Seconds(1));
}

TEST(ChannelReconnectorTest, NeverWokenStartsNoThreadAndGoesAtOnce) {
  std::shared_ptr<grpc::Channel> channel = ChannelTo(SocketPath("idle"));
  const absl::Time start = absl::Now();
  { ChannelReconnector reconnector(channel); }
  EXPECT_LE(absl::Now() - start, absl::Milliseconds(500));
}

}  // namespace
}  // namespace proxima
