// call_floor_bench: what one small call to proximad costs, against the floors under it measured
// in the same run: a thread-to-thread wake-up over a socketpair (the OS), and a unary gRPC call
// to a server in this process that does nothing (gRPC itself). Then against a real proximad
// (started here on a Unix socket, default config): GetServerInfo through a plain stub, and
// one-block Lookup and Get (64 KiB) through proxima::client over inline gRPC and over UCX.
//
//   call_floor_bench [--calls=5000] [--proximad=PATH] [--ucx_tls=posix,self]
//
// JSON lines: p50 and p90 of each in microseconds, with the gRPC floor as the baseline and the
// ratio against it (how much of a small call is the daemon's, how much gRPC's).
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "client/client.h"
#include "proxima/v1/kvtier.grpc.pb.h"

ABSL_FLAG(int, calls, 5000, "timed calls per measurement (after 500 untimed)");
ABSL_FLAG(std::string, proximad, PROXIMAD_PATH, "proximad binary");
ABSL_FLAG(std::string, ucx_tls, "posix,self", "UCX_TLS for proximad and this process");

namespace {

using Clock = std::chrono::steady_clock;

pid_t g_daemon = 0;  // proximad, once started: stopped before a failed run exits

struct Percentiles {
  double p50 = 0, p90 = 0;
};

// Runs `call` 500 times untimed, then --calls times timed; false from `call` stops the run.
Percentiles Time(const std::function<bool()>& call) {
  const int n = absl::GetFlag(FLAGS_calls);
  std::vector<double> us;
  us.reserve(n);
  for (int i = 0; i < 500 + n; ++i) {
    const auto start = Clock::now();
    if (!call()) {
      std::fprintf(stderr, "call failed; stopping\n");
      if (g_daemon > 0) {
        kill(g_daemon, SIGTERM);
        waitpid(g_daemon, nullptr, 0);
      }
      std::exit(1);
    }
    if (i >= 500) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 9 / 10]};
}

void Print(const char* metric, const Percentiles& p, double floor_p50) {
  std::printf(
      "{\"bench\":\"call_floor\",\"metric\":\"%s\",\"p50_us\":%.1f,\"p90_us\":%.1f,"
      "\"baseline\":\"grpc_floor\",\"baseline_p50_us\":%.1f,\"ratio\":%.3f}\n",
      metric, p.p50, p.p90, floor_p50, floor_p50 > 0 ? p.p50 / floor_p50 : 0.0);
  std::fflush(stdout);
}

// One byte there and back between two threads over a socketpair.
Percentiles WakeUpFloor() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) std::exit(1);
  std::thread echo([fd = sv[1]] {
    char b;
    while (read(fd, &b, 1) == 1) {
      if (write(fd, &b, 1) != 1) break;
    }
  });
  char b = 0;
  Percentiles p = Time([&] { return write(sv[0], &b, 1) == 1 && read(sv[0], &b, 1) == 1; });
  close(sv[0]);  // the echo thread's read returns 0
  echo.join();
  close(sv[1]);
  return p;
}

// GetServerInfo, answered at once, through gRPC's callback API (proximad's).
class NothingService final : public proxima::v1::KVTier::CallbackService {
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const proxima::v1::GetServerInfoRequest*,
                                          proxima::v1::GetServerInfoResponse* response) override {
    response->set_version("floor");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

Percentiles ServerInfoCalls(const std::string& target) {
  auto stub = proxima::v1::KVTier::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  return Time([&] {
    grpc::ClientContext context;
    proxima::v1::GetServerInfoRequest request;
    proxima::v1::GetServerInfoResponse response;
    return stub->GetServerInfo(&context, request, &response).ok();
  });
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  char dir_template[] = "/tmp/proxima-call-floor-XXXXXX";
  const std::string dir = mkdtemp(dir_template);

  const Percentiles wake = WakeUpFloor();
  Percentiles floor;
  {
    NothingService service;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + dir + "/floor.sock", grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    floor = ServerInfoCalls("unix:" + dir + "/floor.sock");
    server->Shutdown();
  }
  Print("wake_up_floor", wake, floor.p50);
  Print("grpc_floor", floor, floor.p50);

  setenv("UCX_TLS", absl::GetFlag(FLAGS_ucx_tls).c_str(), 1);
  const std::string socket = dir + "/proximad.sock";
  const pid_t daemon = g_daemon =
      proxima::bench::Spawn({absl::GetFlag(FLAGS_proximad), "--set=server.unix_socket=" + socket,
                             "--set=server.listen=", "--set=server.metrics_listen="},
                            dir + "/proximad.log");
  const std::string target = "unix:" + socket;
  int exit_code = 0;
  for (int i = 0; i < 100 && access(socket.c_str(), F_OK) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Print("daemon_get_server_info", ServerInfoCalls(target), floor.p50);
  for (auto transport : {proxima::client::Transport::kInline, proxima::client::Transport::kUcx}) {
    const char* name = transport == proxima::client::Transport::kUcx ? "ucx" : "inline";
    auto client = proxima::client::Client::Connect({.target = target, .transport = transport});
    if (!client.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, client.status().ToString().c_str());
      exit_code = 1;
      continue;
    }
    auto profile = (*client)->RegisterProfile(proxima::bench::BenchModel(64 << 10));
    if (!profile.ok()) {
      std::fprintf(stderr, "%s\n", profile.status().ToString().c_str());
      exit_code = 1;
      continue;
    }
    auto memory = (*client)->AllocateMemory(2 * profile->block_bytes);
    if (!memory.ok()) {
      std::fprintf(stderr, "%s\n", memory.status().ToString().c_str());
      exit_code = 1;
      continue;
    }
    std::span<std::byte> bytes = memory->bytes();
    for (size_t i = 0; i < profile->block_bytes; ++i) bytes[i] = std::byte(i * 131 + 7);
    proxima::client::BlockKey key{};
    key[0] = transport == proxima::client::Transport::kUcx ? 2 : 1;
    const std::span<const std::byte> in = bytes.first(profile->block_bytes);
    const std::span<std::byte> out = bytes.subspan(profile->block_bytes, profile->block_bytes);
    if (!(*client)->Put(*profile, {&key, 1}, {&in, 1}).ok()) exit_code = 1;
    Print(absl::StrCat("daemon_lookup_1_", name).c_str(), Time([&] {
            auto n = (*client)->Lookup(*profile, {&key, 1});
            return n.ok() && *n == 1;
          }),
          floor.p50);
    Print(absl::StrCat("daemon_get_64KiB_", name).c_str(), Time([&] {
            auto found = (*client)->Get(*profile, {&key, 1}, {&out, 1});
            return found.ok() && (*found)[0];
          }),
          floor.p50);
    if (!std::equal(in.begin(), in.end(), out.begin())) {
      std::fprintf(stderr, "%s: the block came back different\n", name);
      exit_code = 1;
    }
    std::fprintf(stderr, "# %s: %s\n", name, (*client)->transport_detail().c_str());
  }
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
  return exit_code;
}
