// proximad: the Proxima KV-cache tier daemon. See docs/configuration.md and docs/operations.md.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/ucx_address_check.h"
#include "daemon/config.h"
#include "daemon/daemon.h"

ABSL_FLAG(std::string, config, "",
          "YAML config file; without it the built-in defaults apply (see --print_default_config)");
ABSL_FLAG(std::string, port_file, "",
          "After start-up, write {\"tcp_port\":N,\"metrics_port\":M,\"pid\":P} to this file "
          "(for tools and tests that start proximad on port 0)");
ABSL_FLAG(bool, print_default_config, false, "Print the default config with comments and exit");
ABSL_FLAG(bool, check_config, false,
          "Validate the config (file and --set overrides), print it as it would run, and exit");
ABSL_FLAG(bool, version, false, "Print the version and exit");

namespace {

constexpr char kUsage[] =
    "proximad: the Proxima KV-cache memory-tier daemon.\n\n"
    "  proximad [--config=FILE] [--set=dotted.key=value ...] [--port_file=FILE]\n\n"
    "--set overrides one config key (value in YAML syntax) and may be repeated, e.g.\n"
    "  --set=tiers.host.capacity_bytes=8GiB --set=server.listen=0.0.0.0:50051\n"
    "SIGTERM or SIGINT drains in-flight calls and exits 0. SIGHUP reads the --config file again\n"
    "and puts namespaces[].max_bytes and log.level in force (other changed keys are logged and\n"
    "wait for a restart), and re-reads the token files and variables, cluster.peer_token's too\n"
    "(token rotation).";

// absl's vector flags keep only the last occurrence; --set is meant to repeat, so it is taken
// out of argv here before absl parses the rest.
std::vector<std::string> ExtractSetFlags(int* argc, char** argv) {
  std::vector<std::string> sets;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--set=", 0) == 0) {
      sets.push_back(arg.substr(6));
    } else if ((arg == "--set" || arg == "-set") && i + 1 < *argc) {
      sets.push_back(argv[++i]);
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return sets;
}

bool WritePortFile(const std::string& path, int tcp_port, int metrics_port) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << "{\"tcp_port\":" << tcp_port << ",\"metrics_port\":" << metrics_port
      << ",\"pid\":" << getpid() << "}\n";
    if (!f) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The child of ucx::AddressCheck: parses one UCX worker address and ends (see
  // common/ucx_address_check.h). First, before anything else of the daemon starts.
  if (argc == 2 && std::strcmp(argv[1], proxima::ucx::kAddressCheckFlag) == 0) {
    return proxima::ucx::RunAddressCheckChild();
  }
#ifdef NDEBUG
  // Debian's Abseil is built without NDEBUG, so by default every absl::Mutex acquisition (gRPC's
  // own included) also records lock order in a process-wide graph under a global lock, to report
  // lock-order cycles. That costs the data path several percent of the daemon's CPU. Release
  // builds of proximad turn it off; debug builds and the unit tests (which exercise the same
  // locks in-process) keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> overrides = ExtractSetFlags(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_version)) {
    std::printf("proximad %s\n", PROXIMA_VERSION);
    return 0;
  }
  if (absl::GetFlag(FLAGS_print_default_config)) {
    std::fputs(std::string(proxima::daemon::DefaultConfigYaml()).c_str(), stdout);
    return 0;
  }
  const std::string config_path = absl::GetFlag(FLAGS_config);
  absl::StatusOr<proxima::daemon::DaemonConfig> config =
      config_path.empty()
          ? proxima::daemon::ParseConfig(proxima::daemon::DefaultConfigYaml(), "<default config>",
                                         overrides)
          : proxima::daemon::LoadConfigFile(config_path, overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "proximad: invalid configuration: %s\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_check_config)) {
    std::fputs(proxima::daemon::ConfigToYaml(*config).c_str(), stdout);
    for (const std::string& w : proxima::daemon::ConfigWarnings(*config)) {
      std::fprintf(stderr, "proximad: warning: %s\n", w.c_str());
    }
    return 0;
  }
  proxima::log::Level level;
  proxima::log::ParseLevel(config->log_level, &level);  // validated with the config
  proxima::log::SetMinLevel(level);

  // Block the signals proximad handles in every thread (gRPC's included); main waits for them
  // below: SIGTERM and SIGINT shut down, SIGHUP reloads the config file and the token files.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<proxima::daemon::Daemon>> daemon =
      proxima::daemon::Daemon::Start(*config, {"/proc/self/exe", proxima::ucx::kAddressCheckFlag});
  if (!daemon.ok()) {
    PROXIMA_LOG(kError) << "proximad failed to start: " << daemon.status().message();
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() &&
      !WritePortFile(port_file, (*daemon)->tcp_port(), (*daemon)->metrics_port())) {
    PROXIMA_LOG(kError) << "cannot write --port_file" << proxima::log::Kv("path", port_file);
    return 1;
  }
  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    // The config file again (with the same overrides); what changed and can change while serving
    // is put in force, the rest logged. Errors are logged, and what is in force stays.
    if (!config_path.empty()) {
      (void)(*daemon)->Reconfigure(proxima::daemon::LoadConfigFile(config_path, overrides));
    }
    // Token rotation: the token files and variables are read again.
    (void)(*daemon)->ReloadTokens();
  }
  PROXIMA_LOG(kInfo) << "received signal, shutting down" << proxima::log::Kv("signal", sig);
  (*daemon)->Shutdown();
  return 0;
}
