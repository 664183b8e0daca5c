// proximactl: the operator's and developer's command line for proximad.
//
//   proximactl stats | info | put | get | lookup | delete | load   [flags]
//   proximactl COMMAND --help
//
// Every command takes --target, --namespace, --timeout and --json (one JSON object on stdout).
// put/get/lookup/delete work on deterministic test blocks (client/test_pattern.h) so that what
// comes back is checked byte for byte.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/test_pattern.h"
#include "common/credentials.h"
#include "common/grpc_channel.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/codec.h"

ABSL_FLAG(std::string, target, "unix:/run/proxima/proximad.sock",
          "proximad address: unix:/path or host:port");
ABSL_FLAG(std::string, ns, "default", "namespace (tenant) to act in");
ABSL_FLAG(std::string, token_file, "",
          "file holding the namespace's bearer token (else $PROXIMA_TOKEN; none for an open "
          "namespace). Not a flag value: command lines are visible to every local user");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA that signed proximad's certificate: enables TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mTLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify in proximad's certificate, when not the host of --target");
ABSL_FLAG(double, timeout, 10, "seconds: connect timeout and per-call deadline");
ABSL_FLAG(bool, json, false, "print one JSON object instead of text");
ABSL_FLAG(std::string, transport, "auto",
          "how block bytes move: auto (UCX when both sides can reach each other), ucx, inline");
ABSL_FLAG(std::string, host_staging, "auto",
          "blocks in ordinary memory over UCX: auto (through UCX-allocated staging when proximad "
          "reaches this process over posix/sysv shared memory), always, never");
ABSL_FLAG(std::string, service, "proxima.v1.KVTier",
          "health: the service to ask about (\"\" for the whole server)");
ABSL_FLAG(uint32_t, layers, 4, "test profile: num_layers");
ABSL_FLAG(uint32_t, kv_heads, 8, "test profile: num_kv_heads");
ABSL_FLAG(uint32_t, head_dim, 128, "test profile: head_dim");
ABSL_FLAG(uint32_t, tokens_per_block, 16, "test profile: tokens_per_block");
ABSL_FLAG(std::string, dtype, "bf16", "test profile: fp16 | bf16 | fp8");
ABSL_FLAG(std::string, model, "proximactl-test", "test profile: fingerprint");
ABSL_FLAG(double, rope_theta, 0,
          "test profile: the model's RoPE base for k4v3 levels (0 = unknown; else 1 to 1e12)");
ABSL_FLAG(uint64_t, seed, 1, "test chain: which chain of test blocks");
ABSL_FLAG(uint64_t, first, 0, "test chain: index of the first block");
ABSL_FLAG(uint64_t, count, 8, "test chain: number of blocks");
ABSL_FLAG(uint32_t, clients, 4, "load: concurrent clients (one connection each)");
ABSL_FLAG(double, duration, 10, "load: seconds to run");
ABSL_FLAG(uint32_t, batch, 4, "load: blocks per call");
ABSL_FLAG(double, get_fraction, 0.8, "load: fraction of calls that are Gets (the rest are Puts)");
ABSL_FLAG(uint64_t, working_set, 64, "load: blocks each client cycles through");
ABSL_FLAG(std::string, buffers, "heap",
          "load: the clients' block buffers: heap (ordinary memory, registered for UCX) or ucx "
          "(allocated by UCX: shared memory the daemon maps directly, over shared memory)");
ABSL_FLAG(std::string, format, "raw",
          "get: raw (the daemon decodes encoded blocks) | stored (the stored encoding, decoded "
          "here) | decompress (the Decompress call)");

namespace {

using proxima::client::BlockKey;
using proxima::client::Client;
using proxima::client::Profile;
using proxima::client::TransportName;

struct Command {
  const char* name;
  const char* summary;
  const char* flags;  // the command's own flags, for its --help
};

constexpr Command kCommands[] = {
    {"info", "show the daemon's version, limits and the transport in use", ""},
    {"health", "ask the standard gRPC health service; exit 0 only when SERVING", "service"},
    {"stats", "show tier usage, per-namespace counters and, in a cluster, its peers", ""},
    {"put", "store test blocks --first..--first+--count of chain --seed",
     "seed first count layers kv_heads head_dim tokens_per_block dtype model"},
    {"get",
     "read test blocks and check them byte for byte (blocks stored encoded are counted "
     "apart: a lossy level does not give the exact bytes back)",
     "seed first count layers kv_heads head_dim tokens_per_block dtype model format"},
    {"lookup", "count how many leading blocks of a test chain are stored",
     "seed first count layers kv_heads head_dim tokens_per_block dtype model"},
    {"delete", "delete test blocks",
     "seed first count layers kv_heads head_dim tokens_per_block dtype model"},
    {"load", "generate put/get load from several clients, with progress each second",
     "clients duration batch get_fraction working_set layers kv_heads head_dim "
     "tokens_per_block dtype model"},
};

void PrintUsage(const Command* only) {
  if (only == nullptr) {
    std::printf("proximactl: command line for proximad\n\nusage: proximactl COMMAND [flags]\n\n");
    for (const Command& c : kCommands) std::printf("  %-8s %s\n", c.name, c.summary);
    std::printf(
        "\ncommon flags: --target=unix:/run/proxima/proximad.sock|host:port --ns=default "
        "--timeout=10 --json --transport=auto|ucx|inline\n"
        "'proximactl COMMAND --help' shows a command's flags.\n");
    return;
  }
  std::printf("proximactl %s: %s\n\nflags:\n", only->name, only->summary);
  std::vector<std::string> names = absl::StrSplit(only->flags, ' ', absl::SkipEmpty());
  for (const char* common : {"target", "ns", "timeout", "json", "transport"}) {
    names.push_back(common);
  }
  for (const std::string& n : names) {
    absl::CommandLineFlag* f = absl::FindCommandLineFlag(n);
    if (f == nullptr) continue;
    std::printf("  --%-18s %s (default: %s)\n", n.c_str(), f->Help().c_str(),
                f->DefaultValue().c_str());
  }
}

// A flat JSON object builder: enough for proximactl's outputs.
class Json {
 public:
  Json& Add(const std::string& key, const std::string& value) {
    return Raw(key, "\"" + Escape(value) + "\"");
  }
  Json& Add(const std::string& key, const char* value) { return Add(key, std::string(value)); }
  Json& Add(const std::string& key, double value) { return Raw(key, absl::StrFormat("%.6g", value)); }
  Json& Add(const std::string& key, uint64_t value) { return Raw(key, std::to_string(value)); }
  Json& Add(const std::string& key, bool value) { return Raw(key, value ? "true" : "false"); }
  Json& Raw(const std::string& key, const std::string& json) {
    fields_.push_back("\"" + Escape(key) + "\":" + json);
    return *this;
  }
  std::string str() const { return "{" + absl::StrJoin(fields_, ",") + "}"; }

 private:
  static std::string Escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        out += absl::StrFormat("\\u%04x", c);
        continue;
      }
      out += c;
    }
    return out;
  }
  std::vector<std::string> fields_;
};

int Fail(const std::string& what, const absl::Status& status) {
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", false)
                            .Add("error", what)
                            .Add("code", absl::StatusCodeToString(status.code()))
                            .Add("message", std::string(status.message()))
                            .str()
                            .c_str());
  } else {
    std::fprintf(stderr, "proximactl: %s: %s\n", what.c_str(), status.ToString().c_str());
  }
  return 1;
}

absl::StatusOr<proxima::client::ClientOptions> OptionsFromFlags() {
  proxima::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.namespace_name = absl::GetFlag(FLAGS_ns);
  options.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  options.call_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    PROXIMA_ASSIGN_OR_RETURN(options.token,
                             proxima::ReadTokenFile("--token_file", absl::GetFlag(FLAGS_token_file)));
  } else if (const char* env = std::getenv("PROXIMA_TOKEN"); env != nullptr && *env != '\0') {
    PROXIMA_ASSIGN_OR_RETURN(options.token, proxima::ReadTokenEnv("$PROXIMA_TOKEN", "PROXIMA_TOKEN"));
  }
  auto transport = proxima::client::ParseTransport(absl::GetFlag(FLAGS_transport));
  if (!transport.ok()) {
    return absl::InvalidArgumentError("--" + std::string(transport.status().message()));
  }
  options.transport = *transport;
  auto staging = proxima::client::ParseHostStaging(absl::GetFlag(FLAGS_host_staging));
  if (!staging.ok()) {
    return absl::InvalidArgumentError("--" + std::string(staging.status().message()));
  }
  options.host_staging = *staging;
  return options;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectFromFlags() {
  PROXIMA_ASSIGN_OR_RETURN(proxima::client::ClientOptions options, OptionsFromFlags());
  return Client::Connect(options);
}

absl::StatusOr<proxima::v1::ModelProfile> ProfileFromFlags() {
  proxima::v1::ModelProfile p;
  p.set_num_layers(absl::GetFlag(FLAGS_layers));
  p.set_num_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  p.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  p.set_tokens_per_block(absl::GetFlag(FLAGS_tokens_per_block));
  std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "fp16") p.set_dtype(proxima::v1::DTYPE_FP16);
  else if (dtype == "bf16") p.set_dtype(proxima::v1::DTYPE_BF16);
  else if (dtype == "fp8") p.set_dtype(proxima::v1::DTYPE_FP8_E4M3);
  else return absl::InvalidArgumentError("--dtype=" + dtype + ": expected fp16, bf16 or fp8");
  p.set_fingerprint(absl::GetFlag(FLAGS_model));
  p.set_rope_theta(absl::GetFlag(FLAGS_rope_theta));  // the daemon checks the range
  return p;
}

struct Session {
  std::unique_ptr<Client> client;
  Profile profile;
  std::vector<BlockKey> keys;
};

absl::StatusOr<Session> OpenTestChain() {
  Session s;
  auto client = ConnectFromFlags();
  if (!client.ok()) return client.status();
  s.client = *std::move(client);
  auto model = ProfileFromFlags();
  if (!model.ok()) return model.status();
  auto profile = s.client->RegisterProfile(*model);
  if (!profile.ok()) return profile.status();
  s.profile = *profile;
  s.keys = proxima::client::TestKeyChain(absl::GetFlag(FLAGS_seed), absl::GetFlag(FLAGS_first),
                                         absl::GetFlag(FLAGS_count));
  return s;
}

int CmdInfo() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("connect", client.status());
  const proxima::client::ServerInfo& info = (*client)->server_info();
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", true)
                            .Add("target", absl::GetFlag(FLAGS_target))
                            .Add("version", info.version)
                            .Add("transport", TransportName((*client)->transport()))
                            .Add("transport_detail", (*client)->transport_detail())
                            .Add("max_message_bytes", info.max_message_bytes)
                            .Add("max_batch_blocks", static_cast<uint64_t>(info.max_batch_blocks))
                            .Add("max_lookup_keys", static_cast<uint64_t>(info.max_lookup_keys))
                            .Add("max_inflight_bytes_per_client", info.max_inflight_bytes)
                            .str()
                            .c_str());
  } else {
    std::printf(
        "proximad %s at %s\n  transport: %s (%s)\n  limits: %llu bytes per message, "
        "%u blocks per call, %u keys per lookup, %llu bytes in flight per client\n",
        info.version.c_str(), absl::GetFlag(FLAGS_target).c_str(),
        TransportName((*client)->transport()), (*client)->transport_detail().c_str(),
        static_cast<unsigned long long>(info.max_message_bytes), info.max_batch_blocks,
        info.max_lookup_keys, static_cast<unsigned long long>(info.max_inflight_bytes));
  }
  return 0;
}

int CmdHealth() {
  absl::StatusOr<proxima::client::ClientOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail("health", options.status());
  auto credentials = proxima::client::ChannelCredentialsFor(*options);
  if (!credentials.ok()) return Fail("health", credentials.status());
  // A daemon still starting is retried every second at most, not on gRPC's growing backoff.
  auto channel = grpc::CreateCustomChannel(
      options->target, *credentials,
      proxima::ProximaChannelArguments({.tls_server_name = options->tls_server_name}));
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout))));
  context.set_wait_for_ready(true);  // a daemon still starting is waited for, up to the deadline
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return Fail("health", proxima::client::FromGrpc(status));
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", response.status() ==
                                           grpc::health::v1::HealthCheckResponse::SERVING)
                            .Add("service", absl::GetFlag(FLAGS_service))
                            .Add("status", name)
                            .str()
                            .c_str());
  } else {
    std::printf("%s: %s\n", absl::GetFlag(FLAGS_service).c_str(), name.c_str());
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int CmdStats() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail("connect", client.status());
  auto stats = (*client)->Stats();
  if (!stats.ok()) return Fail("stats", stats.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(*stats, &json, options);
    std::printf("%s\n", json.c_str());
    return 0;
  }
  std::printf("proximad %s, up %llus, %llu corrupt blocks caught\n", stats->version().c_str(),
              static_cast<unsigned long long>(stats->uptime_seconds()),
              static_cast<unsigned long long>(stats->crc_failures()));
  std::printf("%-10s %14s %14s %8s %10s %10s\n", "tier", "used_bytes", "capacity", "used%",
              "blocks", "evictions");
  for (const auto& t : stats->tiers()) {
    std::printf("%-10s %14llu %14llu %7.1f%% %10llu %10llu\n", t.name().c_str(),
                static_cast<unsigned long long>(t.used_bytes()),
                static_cast<unsigned long long>(t.capacity_bytes()),
                100.0 * t.used_bytes() / std::max<uint64_t>(1, t.capacity_bytes()),
                static_cast<unsigned long long>(t.blocks()),
                static_cast<unsigned long long>(t.evictions()));
    for (const auto& l : t.levels()) {
      std::printf("  level %-3u %14llu bytes %10llu blocks%s\n", l.level(),
                  static_cast<unsigned long long>(l.bytes()),
                  static_cast<unsigned long long>(l.blocks()), l.level() == 0 ? " (raw)" : "");
    }
  }
  std::printf("%-12s %8s %14s %14s %8s %9s %9s %11s %11s\n", "namespace", "blocks", "bytes",
              "max_bytes", "puts", "get_hits", "get_miss", "lookup_hits", "lookup_miss");
  for (const auto& n : stats->namespaces()) {
    const std::string limit = n.max_bytes() == 0 ? "-" : std::to_string(n.max_bytes());
    std::printf("%-12s %8llu %14llu %14s %8llu %9llu %9llu %11llu %11llu\n", n.name().c_str(),
                static_cast<unsigned long long>(n.blocks()),
                static_cast<unsigned long long>(n.bytes()), limit.c_str(),
                static_cast<unsigned long long>(n.puts()),
                static_cast<unsigned long long>(n.get_hits()),
                static_cast<unsigned long long>(n.get_misses()),
                static_cast<unsigned long long>(n.lookup_hits()),
                static_cast<unsigned long long>(n.lookup_misses()));
  }
  if (stats->has_cluster()) {
    const proxima::v1::ClusterStats& c = stats->cluster();
    const auto live = std::count_if(c.peers().begin(), c.peers().end(),
                                    [](const proxima::v1::PeerStats& p) { return p.live(); });
    std::printf("cluster: this node %s, %lld of %d peers live, %llu location records kept here\n",
                c.self().c_str(), static_cast<long long>(live), c.peers_size(),
                static_cast<unsigned long long>(c.location_records()));
    std::printf("%-24s %5s %13s  %s\n", "peer", "live", "failed_checks", "last_error");
    for (const proxima::v1::PeerStats& p : c.peers()) {
      std::printf("%-24s %5s %13u  %s\n", p.id().c_str(), p.live() ? "yes" : "no",
                  p.failed_checks(), p.last_error().c_str());
    }
  }
  return 0;
}

int CmdPut() {
  auto s = OpenTestChain();
  if (!s.ok()) return Fail("put", s.status());
  const uint64_t seed = absl::GetFlag(FLAGS_seed), first = absl::GetFlag(FLAGS_first);
  std::vector<std::vector<std::byte>> data(s->keys.size(),
                                           std::vector<std::byte>(s->profile.block_bytes));
  std::vector<std::span<const std::byte>> spans;
  for (size_t i = 0; i < data.size(); ++i) {
    proxima::client::FillTestBlock(seed, first + i, data[i]);
    spans.emplace_back(data[i]);
  }
  auto t0 = std::chrono::steady_clock::now();
  auto outcomes = s->client->Put(s->profile, s->keys, spans);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!outcomes.ok()) return Fail("put", outcomes.status());
  uint64_t stored = 0, present = 0, no_space = 0;
  for (auto o : *outcomes) {
    stored += o == proxima::client::PutOutcome::kStored;
    present += o == proxima::client::PutOutcome::kAlreadyPresent;
    no_space += o == proxima::client::PutOutcome::kNoSpace;
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", true)
                            .Add("blocks", static_cast<uint64_t>(s->keys.size()))
                            .Add("block_bytes", s->profile.block_bytes)
                            .Add("stored", stored)
                            .Add("already_present", present)
                            .Add("no_space", no_space)
                            .Add("seconds", secs)
                            .str()
                            .c_str());
  } else {
    std::printf("put %zu blocks of %llu bytes in %.3fs: %llu stored, %llu already present, %llu "
                "refused for lack of space\n",
                s->keys.size(), static_cast<unsigned long long>(s->profile.block_bytes), secs,
                static_cast<unsigned long long>(stored), static_cast<unsigned long long>(present),
                static_cast<unsigned long long>(no_space));
  }
  return no_space == 0 ? 0 : 3;
}

int CmdGet() {
  auto s = OpenTestChain();
  if (!s.ok()) return Fail("get", s.status());
  const uint64_t seed = absl::GetFlag(FLAGS_seed), first = absl::GetFlag(FLAGS_first);
  std::vector<std::vector<std::byte>> data(s->keys.size(),
                                           std::vector<std::byte>(s->profile.block_bytes));
  std::vector<std::span<std::byte>> spans(data.begin(), data.end());
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "raw" && format != "stored" && format != "decompress") {
    return Fail("get", absl::InvalidArgumentError(absl::StrCat(
                           "--format is '", format, "'; expected raw, stored or decompress")));
  }
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<bool>> found;
  uint64_t encoded = 0, stored_bytes = 0;  // --format=stored only
  std::vector<bool> lossy(data.size(), false);  // decoded here from an encoded level
  if (format == "stored") {
    auto blocks = s->client->GetStored(s->profile, s->keys);
    if (!blocks.ok()) return Fail("get", blocks.status());
    found = std::vector<bool>(data.size(), false);
    for (size_t i = 0; i < data.size(); ++i) {
      const auto& b = (*blocks)[i];
      if (!b) continue;
      stored_bytes += b->bytes.size();
      if (b->level == 0) {
        if (b->bytes.size() != data[i].size()) continue;
        std::memcpy(data[i].data(), b->bytes.data(), b->bytes.size());
      } else {
        ++encoded;
        lossy[i] = true;
        absl::Status st = proxima::codec::DecodeBlock(
            std::as_bytes(std::span(b->bytes.data(), b->bytes.size())), data[i]);
        if (!st.ok()) return Fail("get", st);
      }
      (*found)[i] = true;
    }
  } else if (format == "decompress") {
    found = s->client->Decompress(s->profile, s->keys, spans);
  } else {
    found = s->client->Get(s->profile, s->keys, spans);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!found.ok()) return Fail("get", found.status());
  uint64_t hits = 0, wrong = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    if (!(*found)[i]) continue;
    ++hits;
    // Blocks decoded from a lossy level come back close to the pattern, not equal to it.
    if (!lossy[i] && !proxima::client::IsTestBlock(seed, first + i, data[i])) ++wrong;
  }
  uint64_t misses = data.size() - hits;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", wrong == 0)
                            .Add("blocks", static_cast<uint64_t>(data.size()))
                            .Add("hits", hits)
                            .Add("misses", misses)
                            .Add("wrong_bytes", wrong)
                            .Add("format", format)
                            .Add("encoded", encoded)
                            .Add("stored_bytes", stored_bytes)
                            .Add("seconds", secs)
                            .str()
                            .c_str());
  } else {
    std::printf("get %zu blocks in %.3fs: %llu hits (all byte-exact: %s), %llu misses\n",
                data.size(), secs, static_cast<unsigned long long>(hits),
                wrong == 0 ? "yes" : "NO", static_cast<unsigned long long>(misses));
  }
  return wrong == 0 ? 0 : 4;
}

int CmdLookup() {
  auto s = OpenTestChain();
  if (!s.ok()) return Fail("lookup", s.status());
  auto present = s->client->Lookup(s->profile, s->keys);
  if (!present.ok()) return Fail("lookup", present.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", true)
                            .Add("chain", static_cast<uint64_t>(s->keys.size()))
                            .Add("prefix_present", static_cast<uint64_t>(*present))
                            .str()
                            .c_str());
  } else {
    std::printf("lookup of a %zu-block chain: the first %zu blocks are stored\n", s->keys.size(),
                *present);
  }
  return 0;
}

int CmdDelete() {
  auto s = OpenTestChain();
  if (!s.ok()) return Fail("delete", s.status());
  auto deleted = s->client->Delete(s->profile, s->keys);
  if (!deleted.ok()) return Fail("delete", deleted.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json().Add("ok", true).Add("deleted", static_cast<uint64_t>(*deleted)).str().c_str());
  } else {
    std::printf("deleted %zu of %zu blocks\n", *deleted, s->keys.size());
  }
  return 0;
}

// Per-call latencies and byte counts of one load client.
struct LoadStats {
  std::vector<double> latencies;
  uint64_t calls = 0, errors = 0, wrong = 0, bytes = 0, hits = 0, misses = 0;
};

int CmdLoad() {
  auto model = ProfileFromFlags();
  if (!model.ok()) return Fail("load", model.status());
  const uint32_t clients = std::max<uint32_t>(1, absl::GetFlag(FLAGS_clients));
  const uint32_t batch = std::max<uint32_t>(1, absl::GetFlag(FLAGS_batch));
  const uint64_t working_set = std::max<uint64_t>(batch, absl::GetFlag(FLAGS_working_set));
  const double get_fraction = absl::GetFlag(FLAGS_get_fraction);
  const auto duration = std::chrono::duration<double>(absl::GetFlag(FLAGS_duration));
  const std::string buffers = absl::GetFlag(FLAGS_buffers);
  if (buffers != "heap" && buffers != "ucx") {
    return Fail("load", absl::InvalidArgumentError(absl::StrCat(
                            "--buffers is '", buffers, "'; expected heap or ucx")));
  }
  const bool ucx_buffers = buffers == "ucx";
  std::vector<LoadStats> stats(clients);
  std::atomic<uint64_t> progress_bytes{0}, progress_calls{0}, progress_errors{0};
  std::atomic<bool> failed_connect{false};
  proxima::Mutex first_error_mu;
  std::string first_error;
  std::string transport_name;  // of the first client (all use the same flags)
  // Every client warms up, then all start together: `start` is set once all are ready.
  std::atomic<uint32_t> ready{0};
  std::atomic<bool> go{false};
  std::chrono::steady_clock::time_point start;
  std::vector<std::thread> threads;
  for (uint32_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      // A client that cannot start: counted as ready (so the others go), its error kept.
      auto fail_setup = [&](const absl::Status& status) {
        failed_connect = true;
        ready.fetch_add(1);
        proxima::MutexLock lock(&first_error_mu);
        if (first_error.empty()) first_error = status.ToString();
      };
      auto client = ConnectFromFlags();
      if (!client.ok()) return fail_setup(client.status());
      auto profile = (*client)->RegisterProfile(*model);
      if (!profile.ok()) return fail_setup(profile.status());
      const uint64_t seed = 1000 + c;
      std::vector<BlockKey> keys = proxima::client::TestKeyChain(seed, 0, working_set);
      // Block buffers, registered once for UCX (a no-op inline), as a worker registers its KV
      // cache; or allocated by UCX (--buffers=ucx).
      std::vector<proxima::client::TestBuffer> owned;
      std::vector<std::span<std::byte>> blocks;
      for (uint32_t i = 0; i < batch; ++i) {
        auto b = proxima::client::MakeTestBuffer(**client, profile->block_bytes, ucx_buffers);
        if (!b.ok()) return fail_setup(b.status());
        blocks.push_back(b->bytes);
        owned.push_back(*std::move(b));
      }
      {
        proxima::MutexLock lock(&first_error_mu);
        if (transport_name.empty()) transport_name = TransportName((*client)->transport());
      }
      std::mt19937_64 rng(seed);
      LoadStats& st = stats[c];
      // Warm-up: store the working set once, so that gets measure hits, not an empty cache.
      for (uint64_t b = 0; b < working_set; b += batch) {
        size_t n = std::min<uint64_t>(batch, working_set - b);
        std::vector<std::span<const std::byte>> in;
        for (size_t i = 0; i < n; ++i) {
          proxima::client::FillTestBlock(seed, b + i, blocks[i]);
          in.emplace_back(blocks[i]);
        }
        (void)(*client)->Put(*profile, std::span(keys).subspan(b, n), in);
      }
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      while (std::chrono::steady_clock::now() - start < duration) {
        size_t base = rng() % (working_set - batch + 1);
        std::span<const BlockKey> k(keys.data() + base, batch);
        bool is_get = std::uniform_real_distribution<double>(0, 1)(rng) < get_fraction;
        auto t0 = std::chrono::steady_clock::now();
        absl::Status status;
        if (is_get) {
          std::vector<std::span<std::byte>> out(blocks.begin(), blocks.end());
          auto found = (*client)->Get(*profile, k, out);
          status = found.status();
          if (found.ok()) {
            for (uint32_t i = 0; i < batch; ++i) {
              if (!(*found)[i]) {
                ++st.misses;
                continue;
              }
              ++st.hits;
              st.bytes += profile->block_bytes;
              if (!proxima::client::IsTestBlock(seed, base + i, blocks[i])) ++st.wrong;
            }
          }
        } else {
          std::vector<std::span<const std::byte>> in;
          for (uint32_t i = 0; i < batch; ++i) {
            proxima::client::FillTestBlock(seed, base + i, blocks[i]);
            in.emplace_back(blocks[i]);
          }
          status = (*client)->Put(*profile, k, in).status();
          if (status.ok()) st.bytes += uint64_t{batch} * profile->block_bytes;
        }
        st.latencies.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        ++st.calls;
        progress_calls.fetch_add(1);
        if (!status.ok()) {
          ++st.errors;
          progress_errors.fetch_add(1);
          proxima::MutexLock lock(&first_error_mu);
          if (first_error.empty()) first_error = status.ToString();
        }
        if (status.ok()) progress_bytes.fetch_add(uint64_t{batch} * profile->block_bytes);
      }
    });
  }
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  start = std::chrono::steady_clock::now();
  go.store(true);
  // Progress once a second on stderr (stdout stays clean for --json).
  std::thread reporter([&] {
    uint64_t last_bytes = 0;
    while (std::chrono::steady_clock::now() - start < duration && !failed_connect) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      uint64_t b = progress_bytes.load();
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "[%5.1fs] %llu calls, %.1f MB/s, %llu errors\n", t,
                   static_cast<unsigned long long>(progress_calls.load()), (b - last_bytes) / 1e6,
                   static_cast<unsigned long long>(progress_errors.load()));
      last_bytes = b;
    }
  });
  for (auto& t : threads) t.join();
  reporter.join();
  if (failed_connect) return Fail("load", absl::UnavailableError(first_error));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LoadStats all;
  for (const LoadStats& s : stats) {
    all.latencies.insert(all.latencies.end(), s.latencies.begin(), s.latencies.end());
    all.calls += s.calls;
    all.errors += s.errors;
    all.wrong += s.wrong;
    all.bytes += s.bytes;
    all.hits += s.hits;
    all.misses += s.misses;
  }
  std::sort(all.latencies.begin(), all.latencies.end());
  auto pct = [&](double p) {
    if (all.latencies.empty()) return 0.0;
    return all.latencies[std::min(all.latencies.size() - 1,
                                  static_cast<size_t>(p * all.latencies.size()))];
  };
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json()
                            .Add("ok", all.errors == 0 && all.wrong == 0)
                            .Add("seconds", secs)
                            .Add("clients", static_cast<uint64_t>(clients))
                            .Add("transport", transport_name)
                            .Add("calls", all.calls)
                            .Add("calls_per_second", all.calls / secs)
                            .Add("megabytes_per_second", all.bytes / secs / 1e6)
                            .Add("get_hits", all.hits)
                            .Add("get_misses", all.misses)
                            .Add("p50_ms", pct(0.5) * 1e3)
                            .Add("p99_ms", pct(0.99) * 1e3)
                            .Add("errors", all.errors)
                            .Add("wrong_bytes", all.wrong)
                            .Add("first_error", first_error)
                            .str()
                            .c_str());
  } else {
    std::printf("load: %u clients over %s for %.1fs: %llu calls (%.0f/s), %.1f MB/s, gets %llu hits / "
                "%llu misses, latency p50 %.2f ms p99 %.2f ms, %llu errors, %llu wrong blocks\n",
                clients, transport_name.c_str(), secs, static_cast<unsigned long long>(all.calls),
                all.calls / secs,
                all.bytes / secs / 1e6, static_cast<unsigned long long>(all.hits),
                static_cast<unsigned long long>(all.misses), pct(0.5) * 1e3, pct(0.99) * 1e3,
                static_cast<unsigned long long>(all.errors),
                static_cast<unsigned long long>(all.wrong));
    if (!first_error.empty()) std::printf("first error: %s\n", first_error.c_str());
  }
  return all.errors == 0 && all.wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "-h") {
    PrintUsage(nullptr);
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) {
    std::fprintf(stderr, "proximactl: unknown command '%s'\n\n", name.c_str());
    PrintUsage(nullptr);
    return 2;
  }
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "-help") {
      PrintUsage(command);
      return 0;
    }
  }
  // absl parses the flags after the command name.
  std::vector<char*> args = {argv[0]};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  proxima::log::SetMinLevel(proxima::log::Level::kWarning);
  if (name == "info") return CmdInfo();
  if (name == "health") return CmdHealth();
  if (name == "stats") return CmdStats();
  if (name == "put") return CmdPut();
  if (name == "get") return CmdGet();
  if (name == "lookup") return CmdLookup();
  if (name == "delete") return CmdDelete();
  return CmdLoad();
}
