#include "daemon/unix_listener.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempPath(const char* name) {
  return ::testing::TempDir() + "/ul-" + std::to_string(getpid()) + "-" + name;
}

// Connects to `path`; the fd (>= 0) or -1 with errno set.
int Connect(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

// A started gRPC server with nothing but a generic callback service (a server needs one).
struct TestServer {
  TestServer() {
    grpc::ServerBuilder builder;
    builder.RegisterCallbackGenericService(&service);
    server = builder.BuildAndStart();
  }
  ~TestServer() {
    if (server) server->Shutdown();
  }
  grpc::CallbackGenericService service;
  std::unique_ptr<grpc::Server> server;
};

bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 500 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(UnixListenerTest, ConnectionsGetTheConfiguredSendBufferAndGoToTheServer) {
  const std::string path = TempPath("sndbuf");
  TestServer t;
  ASSERT_NE(t.server, nullptr);
  constexpr uint64_t kWanted = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto listener, UnixListener::Create({path, 0600, kWanted}));
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  listener->Start(t.server.get());
  // A gRPC client gets through to the server: the HTTP/2 handshake ran over the handed fd.
  auto channel = grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  EXPECT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  ASSERT_TRUE(WaitFor([&] { return listener->connections_accepted() == 1; }));
  // What the kernel grants: all of it with CAP_NET_ADMIN (SO_SNDBUFFORCE) or when
  // net.core.wmem_max allows; at least more than its 208 KiB default otherwise, unless
  // wmem_max is that low too.
  uint64_t wmem_max = 0;
  std::ifstream("/proc/sys/net/core/wmem_max") >> wmem_max;
  const uint64_t granted = listener->effective_send_buffer_bytes();
  if (geteuid() == 0 || wmem_max >= kWanted) {
    EXPECT_EQ(granted, kWanted);
  } else {
    EXPECT_EQ(granted, wmem_max);
  }
  listener->Stop();
}

TEST(UnixListenerTest, StopRefusesNewConnectionsAndDestructionRemovesTheFile) {
  const std::string path = TempPath("stop");
  TestServer t;
  ASSERT_NE(t.server, nullptr);
  ASSERT_OK_AND_ASSIGN(auto listener, UnixListener::Create({path, 0660, 0}));
  listener->Start(t.server.get());
  int fd = Connect(path);
  ASSERT_GE(fd, 0);
  close(fd);
  listener->Stop();
  EXPECT_EQ(Connect(path), -1);
  EXPECT_EQ(errno, ECONNREFUSED);
  listener.reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "socket file left behind";
}

TEST(UnixListenerTest, ALiveSocketIsNeverTakenOverAndAStaleOneIsReplaced) {
  const std::string path = TempPath("live");
  ASSERT_OK_AND_ASSIGN(auto first, UnixListener::Create({path, 0660, 0}));
  EXPECT_THAT(UnixListener::Create({path, 0660, 0}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is in use by a running server")));
  // A socket file whose server is gone (listen fd closed, file left, as after SIGKILL).
  first->Stop();
  ASSERT_EQ(access(path.c_str(), F_OK), 0);
  ASSERT_OK_AND_ASSIGN(auto second, UnixListener::Create({path, 0660, 0}));
  first.reset();  // removes the path, which is now second's: a later start replaces it anyway
}

TEST(UnixListenerTest, APathThatIsNotASocketIsAClearError) {
  const std::string path = TempPath("file");
  std::ofstream(path) << "not a socket";
  EXPECT_THAT(UnixListener::Create({path, 0660, 0}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("exists and is not a socket"))));
  unlink(path.c_str());
}

}  // namespace
}  // namespace proxima::daemon
