#include "daemon/config.h"

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

TEST(ConfigTest, DefaultYamlEqualsBuiltInDefaults) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig c, ParseConfig(DefaultConfigYaml(), "<default>", {}));
  DaemonConfig d;
  EXPECT_EQ(c.server.listen, d.server.listen);
  EXPECT_EQ(c.server.unix_socket, d.server.unix_socket);
  EXPECT_EQ(c.server.unix_socket_mode, d.server.unix_socket_mode);
  EXPECT_EQ(c.server.max_message_bytes, d.server.max_message_bytes);
  EXPECT_EQ(c.host_tier.capacity_bytes, d.host_tier.capacity_bytes);
  EXPECT_EQ(c.host_tier.pin_for_gpu, PinForGpu::kAuto);
  EXPECT_EQ(c.index_shards, d.index_shards);
  ASSERT_EQ(c.namespaces.size(), 1u);
  EXPECT_EQ(c.namespaces[0].name, "default");
  ASSERT_OK_AND_ASSIGN(DaemonConfig empty, ParseConfig("", "<empty>", {}));
  EXPECT_EQ(empty.host_tier.capacity_bytes, d.host_tier.capacity_bytes);
}

// What a reload (SIGHUP) compares: each changed key named as --set spells it, once.
TEST(ConfigTest, DifferencesNameEachChangedKey) {
  const char* kBase =
      "server: {listen: '127.0.0.1:7000'}\n"
      "namespaces: [{name: a}, {name: b, max_bytes: 1GiB}]\n";
  ASSERT_OK_AND_ASSIGN(DaemonConfig a, ParseConfig(kBase, "a", {}));
  ASSERT_OK_AND_ASSIGN(DaemonConfig same, ParseConfig(kBase, "same", {}));
  EXPECT_THAT(ConfigDifferences(a, same), IsEmpty());
  ASSERT_OK_AND_ASSIGN(DaemonConfig b,
                       ParseConfig(kBase, "b",
                                   {"namespaces=[{name: a, max_bytes: 2GiB}, {name: b}]",
                                    "log.level=debug", "server.listen=127.0.0.1:7001"}));
  EXPECT_THAT(ConfigDifferences(a, b),
              UnorderedElementsAre("server.listen", "log.level", "namespaces[0].max_bytes",
                                   "namespaces[1].max_bytes"));
  ASSERT_OK_AND_ASSIGN(DaemonConfig c, ParseConfig(kBase, "c", {"namespaces=[{name: a}]"}));
  EXPECT_THAT(ConfigDifferences(a, c), ElementsAre("namespaces"));
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig d,
      ParseConfig(kBase, "d", {"namespaces=[{name: a}, {name: c, max_bytes: 1GiB}]"}));
  EXPECT_THAT(ConfigDifferences(a, d), ElementsAre("namespaces[1].name"));
}

TEST(ConfigTest, RenderedConfigParsesBackToTheSame) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig c,
                       ParseConfig("tiers: {host: {capacity_bytes: 3GiB, pin_for_gpu: off}}\n"
                                   "namespaces: [{name: a}, {name: b.c-d_e, max_bytes: 1GiB}]\n",
                                   "x", {}));
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(c), "rendered", {}));
  EXPECT_EQ(again.host_tier.capacity_bytes, 3ull << 30);
  EXPECT_EQ(again.host_tier.pin_for_gpu, PinForGpu::kOff);
  EXPECT_THAT(ParseConfig("tiers: {host: {pin_for_gpu: always}}", "t", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tiers.host.pin_for_gpu"), HasSubstr("always"),
                             HasSubstr("auto, on or off"))));
  ASSERT_EQ(again.namespaces.size(), 2u);
  EXPECT_EQ(again.namespaces[1].name, "b.c-d_e");
  EXPECT_EQ(again.namespaces[0].max_bytes, 0u) << "no limit unless given";
  EXPECT_EQ(again.namespaces[1].max_bytes, 1ull << 30);
  EXPECT_EQ(again.server.unix_socket_mode, 0660u);
}

TEST(ConfigTest, OverridesApplyBeforeValidation) {
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("server: {listen: '127.0.0.1:1'}", "f",
                  {"server.listen=0.0.0.0:50051", "tiers.host.capacity_bytes=512MiB",
                   "namespaces=[{name: x}, {name: y}]", "server.unix_socket=''"}));
  EXPECT_EQ(c.server.listen, "0.0.0.0:50051");
  EXPECT_EQ(c.host_tier.capacity_bytes, 512ull << 20);
  EXPECT_EQ(c.namespaces.size(), 2u);
  EXPECT_EQ(c.server.unix_socket, "");
  EXPECT_THAT(ParseConfig("", "f", {"tiers.host.capacity_bytes=lots"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tiers.host.capacity_bytes"), HasSubstr("lots"))));
  EXPECT_THAT(ParseConfig("", "f", {"no_equals_sign"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dotted.key=value")));
}

TEST(ConfigTest, ErrorsNameTheKeyTheValueAndWhatIsAllowed) {
  struct Case {
    const char* yaml;
    std::vector<std::string> must_mention;
  };
  const Case cases[] = {
      {"server: {lisen: x}", {"server.lisen", "unknown", "listen"}},
      {"bogus: 1", {"bogus", "unknown", "server, tiers"}},
      {"server: {listen: nocolon}", {"server.listen", "nocolon", "host:port"}},
      {"server: {max_batch_blocks: 0}", {"server.max_batch_blocks", "'0'", "[1, 65536]"}},
      {"server: {unix_socket: relative.sock}", {"server.unix_socket", "absolute"}},
      {"server: {unix_socket_mode: '999'}", {"server.unix_socket_mode", "999", "octal"}},
      {"tiers: {host: {capacity_bytes: 12X}}", {"tiers.host.capacity_bytes", "12X", "512MiB"}},
      {"tiers: {host: {capacity_bytes: 10}}", {"tiers.host.capacity_bytes", "'10'"}},
      {"index: {shards: 3}", {"index.shards", "'3'", "power of two"}},
      {"namespaces: []", {"namespaces", "non-empty"}},
      {"namespaces: [{name: 'a b'}]", {"namespaces[0].name", "a b", "[A-Za-z0-9_.-]"}},
      {"namespaces: [{name: a}, {name: a}]", {"namespaces[1].name", "earlier"}},
      {"log: {level: loud}", {"log.level", "loud", "debug, info, warning, error"}},
      {"server: [1, 2]", {"server", "mapping"}},
      {"server: {listen: ''}\n", {}},  // valid: the Unix socket remains
      {"server: {listen: '', unix_socket: ''}", {"both empty"}},
      {"server: {listen: [\n", {"not valid YAML", "line"}},
      {"server: {tls: {cert_file: /c.pem}}", {"server.tls.key_file", "cert_file is set"}},
      {"server: {tls: {key_file: /k.pem}}", {"server.tls.cert_file", "key_file is set"}},
      {"server: {tls: {client_ca_file: /ca.pem}}", {"server.tls.cert_file", "mTLS"}},
      {"server: {tls: {crt: /c.pem}}", {"server.tls.crt", "unknown", "cert_file"}},
      {"server: {tls: {reload_interval: 0s}}", {"server.tls.reload_interval", "0s"}},
      {"server: {max_inflight_bytes_per_client: 1KiB}",
       {"server.max_inflight_bytes_per_client", "1KiB"}},
      {"server: {max_connections: 0}", {"server.max_connections", "'0'"}},
      {"server: {decode_threads: 0}", {"server.decode_threads", "'0'", "1"}},
      {"server: {decode_threads: 1000}", {"server.decode_threads", "'1000'", "256"}},
      {"server: {decode_buffer_cache_bytes: 2TiB}", {"server.decode_buffer_cache_bytes", "2TiB"}},
      {"server: {decode_buffer_cache_bytes: -1}", {"server.decode_buffer_cache_bytes", "'-1'"}},
      {"namespaces: [{name: a, tokens: [{name: w}]}]",
       {"namespaces[0].tokens[0]", "exactly one of 'file'", "never written in the config"}},
      {"namespaces: [{name: a, tokens: [{name: w, file: /t, env: T}]}]",
       {"namespaces[0].tokens[0]", "exactly one"}},
      {"namespaces: [{name: a, tokens: [{name: w, file: /t, access: admin}]}]",
       {"namespaces[0].tokens[0].access", "admin", "read_write or read_only"}},
      {"namespaces: [{name: a, tokens: [{name: w, file: /t}, {name: w, env: T}]}]",
       {"namespaces[0].tokens[1].name", "'w'", "earlier token"}},
      {"namespaces: [{name: a, tokens: [{name: w, file: /t, secret: x}]}]",
       {"namespaces[0].tokens[0].secret", "unknown"}},
      {"namespaces: [{name: a, max_bytes: lots}]",
       {"namespaces[0].max_bytes", "lots", "a size such as"}},
      {"namespaces: [{name: a, max_bytes: 2048TiB}]", {"namespaces[0].max_bytes", "2048TiB"}},
      {"namespaces: [{name: a, private_prefixes: true}]",
       {"namespaces[0].private_prefixes", "tokens"}},
      {"namespaces: [{name: a, private_prefixes: yes-please, tokens: [{name: w, file: /t}]}]",
       {"namespaces[0].private_prefixes", "yes-please", "true or false"}},
      {"namespaces: [{name: a, private_prefixes: true, tokens: [{name: w, file: /t, "
       "access: read_only, scope: s}]}]\n",
       {}},  // valid
  };
  for (const Case& c : cases) {
    absl::StatusOr<DaemonConfig> r = ParseConfig(c.yaml, "test.yaml", {});
    if (c.must_mention.empty()) {
      EXPECT_OK(r.status()) << c.yaml;
      continue;
    }
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_THAT(r.status().message(), HasSubstr("test.yaml")) << c.yaml;
    for (const std::string& m : c.must_mention) {
      EXPECT_THAT(r.status().message(), HasSubstr(m)) << c.yaml;
    }
  }
}

TEST(ConfigTest, TextThatIsNotUtf8IsRefusedWithItsPosition) {
  // Found by the config_parse fuzzer: a Latin-1 byte inside a path was accepted, then written
  // back out by ConfigToYaml as something that did not parse back to the same config.
  EXPECT_THAT(ParseConfig("server:\n  unix_socket: \"/run/a\xb7" "b.sock\"\n", "f.yaml", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("f.yaml"), HasSubstr("not valid UTF-8 at byte 30"))));
  EXPECT_THAT(ParseConfig("", "f.yaml", {"server.unix_socket=/run/\xc0\xafx"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid UTF-8 at byte 24")));
  // Real UTF-8 (here in a namespace-free spot: a path) is fine.
  EXPECT_OK(ParseConfig("server:\n  unix_socket: \"/run/pr\xc3\xb6xima.sock\"\n", "f.yaml", {})
                .status());
}

TEST(ConfigTest, ComplexKeysAreAnErrorNotACrash) {
  // Found by the config_parse fuzzer: a YAML complex key ("? ...") made yaml-cpp throw from
  // the key walk, and proximad died of an uncaught exception.
  EXPECT_THAT(ParseConfig("namespaces:\n?  - name: default\n", "f.yaml", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("f.yaml")));
  EXPECT_THAT(ParseConfig("tiers:\n  host:\n?   capacity_bytes: 1GiB\n", "f.yaml", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("f.yaml"), HasSubstr("expected a plain name"))));
}

// A k4v3 level under a quality budget its own error exceeds: a warning naming the keys; none
// with a budget that fits it, or for other codecs.
TEST(ConfigTest, WarnsWhenAK4v3LevelsErrorExceedsTheQualityBudget) {
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("namespaces: [{name: a, compression: {enabled: true, levels: [int4, k4v3]}},\n"
                  "  {name: b, compression: {enabled: true, levels: [k4v3], quality: "
                  "{max_attention_error: 0.3}}},\n"
                  "  {name: c, compression: {enabled: true, levels: [int8, int4]}}]\n",
                  "test.yaml", {}));
  std::vector<std::string> warnings = ConfigWarnings(c);
  ASSERT_EQ(warnings.size(), 1u) << ::testing::PrintToString(warnings);
  EXPECT_THAT(warnings[0],
              AllOf(HasSubstr("namespaces[0].compression.levels[1] is k4v3"),
                    HasSubstr("quality.max_attention_error is 0.12"), HasSubstr("about 0.3")));
}

TEST(ConfigTest, SecuritySettingsRoundTripWithoutSecrets) {
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("server: {tls: {cert_file: /etc/p/tls.crt, key_file: /etc/p/tls.key, "
                  "client_ca_file: /etc/p/ca.crt, reload_interval: 5m}, max_connections: 7, "
                  "decode_threads: 9, "
                  "decode_buffer_cache_bytes: 0}\n"
                  "namespaces: [{name: a, private_prefixes: true, tokens: ["
                  "{name: w, file: /etc/p/a.token}, {name: r, env: A_RO, access: read_only, "
                  "scope: w}]}]\n",
                  "test.yaml", {}));
  EXPECT_EQ(c.server.tls.client_ca_file, "/etc/p/ca.crt");
  EXPECT_EQ(c.server.tls.reload_interval_seconds, 300);
  EXPECT_EQ(c.server.max_connections, 7u);
  EXPECT_EQ(c.server.decode_threads, 9u);
  EXPECT_EQ(c.server.decode_buffer_cache_bytes, 0u);
  ASSERT_EQ(c.namespaces[0].tokens.size(), 2u);
  EXPECT_EQ(c.namespaces[0].tokens[1].access, TokenAccess::kReadOnly);
  EXPECT_EQ(c.namespaces[0].tokens[1].scope, "w");
  EXPECT_TRUE(c.namespaces[0].private_prefixes);
  const std::string yaml = ConfigToYaml(c);
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(yaml, "printed", {}));
  EXPECT_EQ(ConfigToYaml(again), yaml);
  EXPECT_EQ(again.namespaces[0].tokens[0].file, "/etc/p/a.token");
}

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("1073741824"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512ull << 20);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("2GB"), 2000000000ull);
  EXPECT_EQ(*ParseByteSize("64 KiB"), 65536ull);
  for (const char* bad : {"", "GiB", "-1", "1.5", "5 parsecs", "1e9"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
}

TEST(ConfigTest, MissingFileIsNotFound) {
  EXPECT_THAT(LoadConfigFile("/nonexistent/proxima.yaml", {}),
              StatusIs(absl::StatusCode::kNotFound, AllOf(HasSubstr("/nonexistent/proxima.yaml"),
                                                          HasSubstr("No such file or directory"))));
}

TEST(CompressionConfigTest, DefaultsAreOffWithTheDocumentedThreshold) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig c, ParseConfig(DefaultConfigYaml(), "<default>", {}));
  const CompressionConfig& z = c.namespaces[0].compression;
  EXPECT_FALSE(z.enabled);
  EXPECT_TRUE(z.plans.empty());
  EXPECT_DOUBLE_EQ(z.memory_pressure_threshold, 0.8);
  EXPECT_EQ(c.tierer.temperature_policy, "slru");
  EXPECT_DOUBLE_EQ(c.tierer.protected_share, 0.2);
  EXPECT_EQ(c.gpu_tier.capacity_bytes_per_device, 0u);
  EXPECT_DOUBLE_EQ(c.gpu_tier.pressure_threshold, 0.8);
}

TEST(CompressionConfigTest, ExplicitLevelsAreParsedSafestFirst) {
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("namespaces:\n"
                  "  - name: a\n"
                  "    compression:\n"
                  "      enabled: true\n"
                  "      levels: [int8, 'layers[0:4]=int8,default=int4,sink=int8',\n"
                  "               'k4v3,rope_theta=500000,sink=int8']\n"
                  "      trigger: {memory_pressure_threshold: 0.7, min_seq_len_to_compress: 64}\n"
                  "  - name: b\n",
                  "t.yaml", {}));
  const CompressionConfig& a = c.namespaces[0].compression;
  ASSERT_EQ(a.plans.size(), 3u);
  EXPECT_EQ(a.plans[0].default_codec, codec::CodecId::kInt8);
  EXPECT_EQ(a.plans[1].default_codec, codec::CodecId::kInt4);
  EXPECT_EQ(a.plans[1].CodecFor(2, false), codec::CodecId::kInt8);
  EXPECT_EQ(a.plans[1].CodecFor(9, true), codec::CodecId::kInt8);  // sink floor
  EXPECT_EQ(a.plans[2].default_codec, codec::CodecId::kK4v3);      // k4v3 keeps its RoPE base
  EXPECT_DOUBLE_EQ(a.plans[2].rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(a.memory_pressure_threshold, 0.7);
  EXPECT_EQ(a.min_seq_len_to_compress, 64u);
  EXPECT_TRUE(c.namespaces[1].compression.plans.empty());  // not enabled

  // What the daemon prints parses back to the same hierarchy.
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(c), "rendered", {}));
  ASSERT_EQ(again.namespaces[0].compression.plans.size(), 3u);
  EXPECT_EQ(again.namespaces[0].compression.plans[1].ToString(), a.plans[1].ToString());
  EXPECT_DOUBLE_EQ(again.namespaces[0].compression.plans[2].rope_theta, 500000.0);
}

// Levels go from safer to deeper: k4v3 sits between int4 and star.
TEST(CompressionConfigTest, K4v3IsDeeperThanInt4AndSaferThanStar) {
  EXPECT_OK(ParseConfig(
      "namespaces: [{name: a, compression: {enabled: true, levels: [int4, k4v3, star]}}]", "t",
      {}));
  absl::StatusOr<DaemonConfig> bad = ParseConfig(
      "namespaces: [{name: a, compression: {enabled: true, levels: [star, k4v3]}}]", "t", {});
  EXPECT_THAT(bad.status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("levels[1]")));
}

TEST(CompressionConfigTest, StrategiesDeriveLadders) {
  auto plans = [](const std::string& compression) {
    absl::StatusOr<DaemonConfig> c = ParseConfig(
        "namespaces: [{name: a, compression: {enabled: true, " + compression + "}}]", "t", {});
    EXPECT_OK(c.status()) << compression;
    std::vector<std::string> out;
    if (c.ok()) {
      for (const auto& p : c->namespaces[0].compression.plans) out.push_back(p.ToString());
    }
    return out;
  };
  EXPECT_THAT(plans("strategy: hybrid, first_block: ''"),
              ::testing::ElementsAre("default=int8,group=64", "default=int4,group=64"));
  EXPECT_THAT(plans("strategy: quantize, first_block: '', star_kv: {hierarchy_levels: 3}"),
              ::testing::ElementsAre("default=int8,group=64", "default=int4,group=64", "default=int2,group=64"));
  EXPECT_THAT(plans("strategy: star, first_block: '', quantization: {group_size: 32}"),
              ::testing::ElementsAre("default=int4,group=32", "default=star,group=32"));
  std::vector<std::string> layered =
      plans("strategy: hybrid, per_layer: 'layers[0:2]=int8', first_block: fp8");
  ASSERT_EQ(layered.size(), 2u);
  ASSERT_OK_AND_ASSIGN(codec::CodecPlan second, codec::ParseCodecPlan(layered[1]));
  EXPECT_EQ(second.CodecFor(1, false), codec::CodecId::kInt8);
  EXPECT_EQ(second.CodecFor(5, false), codec::CodecId::kInt4);
  EXPECT_EQ(second.sink_codec, codec::CodecId::kFp8);
  EXPECT_TRUE(plans("strategy: none").empty());
}

TEST(CompressionConfigTest, BadPoliciesNameKeyValueAndAllowed) {
  struct Case {
    const char* compression;
    std::vector<std::string> must_mention;
  };
  const Case cases[] = {
      {"levels: [int8, zstd]", {"namespaces[0].compression.levels[1]", "zstd", "int4"}},
      {"levels: [int4, int8]", {"levels[1]", "int8", "safest"}},
      {"levels: [raw]", {"levels[0]", "raw"}},
      {"levels: [int8, int8]", {"levels[1]", "different"}},
      {"levels: int8", {"compression.levels", "list of codec plans"}},
      {"strategy: zip", {"compression.strategy", "zip", "none, quantize, star, hybrid"}},
      {"strategy: sparse", {"compression.strategy", "sparse", "not implemented"}},
      {"sparsification: {keep_ratio: 0.6}", {"compression.sparsification", "keep_ratio"}},
      {"trigger: {memory_pressure_threshold: 1.5}",
       {"trigger.memory_pressure_threshold", "1.5", "[0.05, 1]"}},
      {"trigger: {pressure: 0.5}", {"compression.trigger.pressure", "unknown"}},
      {"quantization: {k_bits: 8, v_bits: 4}", {"quantization.v_bits", "'4'", "k_bits"}},
      {"quantization: {k_bits: 3}", {"quantization.k_bits", "8, 4 or 2"}},
      {"star_kv: {cluster_size: 8}", {"star_kv.cluster_size", "'8'", "16"}},
      {"first_block: int3", {"compression.first_block", "int3", "codec name"}},
      {"per_layer: 'default=int8'", {"compression.per_layer", "layer ranges only"}},
      {"enabled: maybe", {"compression.enabled", "maybe", "true or false"}},
  };
  for (const Case& c : cases) {
    // Validated even when disabled: a typo is found at start, not when someone turns it on.
    std::string yaml = std::string("namespaces: [{name: a, compression: {") + c.compression + "}}]";
    absl::StatusOr<DaemonConfig> r = ParseConfig(yaml, "test.yaml", {});
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << yaml;
    for (const std::string& m : c.must_mention) {
      EXPECT_THAT(r.status().message(), HasSubstr(m)) << yaml;
    }
  }
  EXPECT_THAT(ParseConfig("tierer: {temperature_policy: arc}", "t", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tierer.temperature_policy"), HasSubstr("arc"),
                             HasSubstr("slru or lru"))));
  EXPECT_THAT(ParseConfig("tierer: {protected_share: 0.95}", "t", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tierer.protected_share"), HasSubstr("0.95"))));
  EXPECT_THAT(ParseConfig("tiers: {gpu: {capacity_bytes_per_device: 1KiB}}", "t", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tiers.gpu.capacity_bytes_per_device")));
  EXPECT_THAT(ParseConfig("tiers: {gpu: {pressure_threshold: 1.5}}", "t", {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tiers.gpu.pressure_threshold"), HasSubstr("1.5"))));
  ASSERT_OK_AND_ASSIGN(DaemonConfig c, ParseConfig("tiers: {gpu: {capacity_bytes_per_device: 2GiB, "
                                                   "pressure_threshold: 0.6}}",
                                                   "t", {}));
  EXPECT_EQ(c.gpu_tier.capacity_bytes_per_device, 2ull << 30);
  EXPECT_DOUBLE_EQ(c.gpu_tier.pressure_threshold, 0.6);
}

}  // namespace
}  // namespace proxima::daemon

namespace proxima::daemon {
namespace {

TEST(ConfigTest, UcxSection) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig d, ParseConfig("", "<empty>", {}));
  EXPECT_TRUE(d.ucx.enabled);
  EXPECT_EQ(d.ucx.max_sessions, 1024u);
  EXPECT_EQ(d.ucx.copy_threads, -1);  // auto
  EXPECT_EQ(d.ucx.rendezvous_get_max_bytes, uint64_t{1} << 30);
  ASSERT_OK_AND_ASSIGN(DaemonConfig c,
                       ParseConfig("ucx: {enabled: false, max_sessions: 8, copy_threads: 2, "
                                   "rendezvous_get_max_bytes: 256MiB}\n",
                                   "x", {}));
  EXPECT_FALSE(c.ucx.enabled);
  EXPECT_EQ(c.ucx.max_sessions, 8u);
  EXPECT_EQ(c.ucx.copy_threads, 2);
  EXPECT_EQ(c.ucx.rendezvous_get_max_bytes, uint64_t{256} << 20);
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(c), "rendered", {}));
  EXPECT_FALSE(again.ucx.enabled);
  EXPECT_EQ(again.ucx.max_sessions, 8u);
  EXPECT_EQ(again.ucx.copy_threads, 2);
  EXPECT_EQ(again.ucx.rendezvous_get_max_bytes, uint64_t{256} << 20);
  ASSERT_OK_AND_ASSIGN(DaemonConfig off, ParseConfig("", "x", {"ucx.rendezvous_get_max_bytes=0"}));
  EXPECT_EQ(off.ucx.rendezvous_get_max_bytes, 0u);
  for (const char* bad : {"ucx.rendezvous_get_max_bytes=lots", "ucx.rendezvous_get_max_bytes=-1"}) {
    EXPECT_THAT(ParseConfig("", "x", {bad}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("'ucx.rendezvous_get_max_bytes'"), HasSubstr("a size"))))
        << bad;
  }
  ASSERT_OK_AND_ASSIGN(DaemonConfig rendered_auto, ParseConfig(ConfigToYaml(d), "rendered", {}));
  EXPECT_EQ(rendered_auto.ucx.copy_threads, -1);
  ASSERT_OK_AND_ASSIGN(DaemonConfig none, ParseConfig("", "x", {"ucx.copy_threads=0"}));
  EXPECT_EQ(none.ucx.copy_threads, 0);
  for (const char* bad : {"ucx.copy_threads=65", "ucx.copy_threads=-1", "ucx.copy_threads=many"}) {
    EXPECT_THAT(ParseConfig("", "x", {bad}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("'ucx.copy_threads'"), HasSubstr("auto or a number"))))
        << bad;
  }
  EXPECT_THAT(ParseConfig("", "x", {"ucx.enabled=yes please"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'ucx.enabled'"), HasSubstr("true or false"))));
  EXPECT_THAT(ParseConfig("", "x", {"ucx.max_sessions=0"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'ucx.max_sessions'")));
  EXPECT_THAT(ParseConfig("", "x", {"ucx.transport=rdma"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ucx.transport")));
}

}  // namespace
}  // namespace proxima::daemon

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ConfigTest, ClusterIsOffByDefaultAndParsesEveryKey) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig d, ParseConfig(DefaultConfigYaml(), "<default>", {}));
  EXPECT_FALSE(d.cluster.enabled);
  EXPECT_EQ(d.cluster.health_interval_seconds, 1);
  EXPECT_EQ(d.cluster.health_timeout_seconds, 0.5);
  EXPECT_EQ(d.cluster.failures_before_down, 3u);
  EXPECT_EQ(d.cluster.peer_deadline_seconds, 2);
  EXPECT_EQ(d.cluster.dns_refresh_seconds, 10);
  EXPECT_TRUE(d.cluster.spill_enabled);
  EXPECT_EQ(d.cluster.spill_threshold, 0.9);
  EXPECT_EQ(d.cluster.spill_accept_below, 0.75);
  EXPECT_EQ(d.cluster.spill_candidates, 3u);
  EXPECT_EQ(d.cluster.spill_put_wait_seconds, 0.5);
  EXPECT_EQ(d.cluster.spill_handoff_seconds, 10);
  EXPECT_TRUE(d.cluster.spill_handoff_evicts);
  EXPECT_EQ(d.cluster.transport, "auto");
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("cluster:\n"
                  "  enabled: true\n"
                  "  advertise: 10.0.0.7:50051\n"
                  "  peers: [10.0.0.7:50051, 10.0.0.8:50051]\n"
                  "  dns_name: proxima.proxima-system.svc.cluster.local\n"
                  "  dns_port: 50052\n"
                  "  dns_refresh: 30s\n"
                  "  health_interval: 250ms\n"
                  "  health_timeout: 0.1\n"
                  "  failures_before_down: 5\n"
                  "  peer_deadline: 1.5s\n"
                  "  peer_token: {file: /etc/proxima/peer-token}\n"
                  "  receive_pool_bytes: 64MiB\n"
                  "  spill: {enabled: false, threshold: 0.95, accept_below: 0.5, candidates: 2,\n"
                  "          put_wait: 0, handoff: 2m, handoff_evicts: false}\n",
                  "c", {}));
  EXPECT_TRUE(c.cluster.enabled);
  EXPECT_EQ(c.cluster.advertise, "10.0.0.7:50051");
  EXPECT_EQ(c.cluster.peers.size(), 2u);
  EXPECT_EQ(c.cluster.dns_port, 50052u);
  EXPECT_EQ(c.cluster.dns_refresh_seconds, 30);
  EXPECT_EQ(c.cluster.health_interval_seconds, 0.25);
  EXPECT_EQ(c.cluster.health_timeout_seconds, 0.1);
  EXPECT_EQ(c.cluster.failures_before_down, 5u);
  EXPECT_EQ(c.cluster.peer_deadline_seconds, 1.5);
  EXPECT_EQ(c.cluster.peer_token_file, "/etc/proxima/peer-token");
  // Rendered back (the token's path only), it parses to the same.
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(c), "rendered", {}));
  EXPECT_EQ(again.cluster.peers, c.cluster.peers);
  EXPECT_EQ(again.cluster.health_interval_seconds, 0.25);
  EXPECT_EQ(again.cluster.peer_deadline_seconds, 1.5);
  EXPECT_EQ(again.cluster.peer_token_file, c.cluster.peer_token_file);
  EXPECT_FALSE(again.cluster.spill_enabled);
  EXPECT_EQ(again.cluster.spill_threshold, 0.95);
  EXPECT_EQ(again.cluster.spill_accept_below, 0.5);
  EXPECT_EQ(again.cluster.spill_candidates, 2u);
  EXPECT_EQ(again.cluster.spill_put_wait_seconds, 0);
  EXPECT_EQ(again.cluster.spill_handoff_seconds, 120);
  EXPECT_FALSE(again.cluster.spill_handoff_evicts);
  // --set works on the section like on any other.
  ASSERT_OK_AND_ASSIGN(DaemonConfig s,
                       ParseConfig("", "s",
                                   {"cluster.enabled=true", "cluster.advertise=127.0.0.1:7001",
                                    "cluster.peers=[127.0.0.1:7002]",
                                    "cluster.peer_token={env: PEER_TOKEN}"}));
  EXPECT_EQ(s.cluster.peer_token_env, "PEER_TOKEN");
  // receive_pool_bytes (of one-sided UCX fetches, gone) still loads, whatever its value.
  ASSERT_OK(ParseConfig("cluster: {receive_pool_bytes: lots}", "p", {}).status());
}

TEST(ConfigTest, SnapshotIsOffByDefaultAndRefusedInACluster) {
  ASSERT_OK_AND_ASSIGN(DaemonConfig d, ParseConfig("", "d", {}));
  EXPECT_EQ(d.host_tier.snapshot_file, "");
  EXPECT_EQ(d.host_tier.snapshot_seconds, 20);
  ASSERT_OK_AND_ASSIGN(
      DaemonConfig c,
      ParseConfig("tiers: {host: {snapshot_file: /var/lib/proxima/snapshot, snapshot_seconds: 1m}}",
                  "c", {}));
  EXPECT_EQ(c.host_tier.snapshot_file, "/var/lib/proxima/snapshot");
  EXPECT_EQ(c.host_tier.snapshot_seconds, 60);
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(c), "rendered", {}));
  EXPECT_EQ(again.host_tier.snapshot_file, c.host_tier.snapshot_file);
  EXPECT_EQ(again.host_tier.snapshot_seconds, 60);
  EXPECT_THAT(ParseConfig("", "r", {"tiers.host.snapshot_file=snap"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tiers.host.snapshot_file"), HasSubstr("snap"),
                             HasSubstr("an absolute path"))));
  EXPECT_THAT(ParseConfig("", "r", {"tiers.host.snapshot_seconds=2h"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tiers.host.snapshot_seconds"), HasSubstr("2h"))));
  EXPECT_THAT(
      ParseConfig("", "k",
                  {"cluster.enabled=true", "cluster.advertise=127.0.0.1:7001",
                   "cluster.peers=[127.0.0.1:7002]", "cluster.peer_token={env: T}",
                   "tiers.host.snapshot_file=/var/lib/proxima/snapshot"}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("tiers.host.snapshot_file"), HasSubstr("cluster.enabled is true"),
                     HasSubstr("cluster.spill.handoff"))));
}

TEST(ConfigTest, ClusterErrorsNameTheKeyTheValueAndWhatIsAllowed) {
  const std::string on = "cluster: {enabled: true, advertise: 127.0.0.1:7001, "
                         "peers: [127.0.0.1:7002], peer_token: {file: /t}, ";
  struct Case {
    std::string yaml;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"cluster: {enabled: yes}", {"cluster.enabled", "yes", "true or false"}},
      {"cluster: {advertise: nohost}", {"cluster.advertise", "nohost", "host:port"}},
      {"cluster: {advertise: 127.0.0.1:0}", {"cluster.advertise", "fixed port"}},
      {"cluster: {peers: [a:1, a:1]}", {"cluster.peers[1]", "a:1", "not listed earlier"}},
      {"cluster: {peers: [x]}", {"cluster.peers[0]", "'x'", "host:port"}},
      {"cluster: {health_interval: soon}", {"cluster.health_interval", "soon", "500ms"}},
      {"cluster: {health_interval: 1s, health_timeout: 2s}",
       {"cluster.health_timeout", "no longer than cluster.health_interval"}},
      {"cluster: {failures_before_down: 0}", {"cluster.failures_before_down", "[1, 100]"}},
      {"cluster: {peer_deadline: 2h}", {"cluster.peer_deadline", "2h"}},
      {"cluster: {dns_name: 'svc:50051'}", {"cluster.dns_name", "cluster.dns_port"}},
      {"cluster: {peer_token: {file: /a, env: B}}", {"cluster.peer_token", "exactly one"}},
      {"cluster: {peer_token: {secret: x}}", {"cluster.peer_token.secret", "file, env"}},
      {"cluster: {enabled: true, peers: [a:1], peer_token: {file: /t}}",
       {"cluster.advertise", "since cluster.enabled is true"}},
      {"cluster: {enabled: true, advertise: a:1, peer_token: {file: /t}}",
       {"cluster.peers", "at least one peer"}},
      {"cluster: {enabled: true, advertise: a:1, peers: [b:1]}",
       {"cluster.peer_token", "must authenticate"}},
      // TLS to peers: with server.tls, a CA for the peers' certificates is needed (its default
      // is server.tls.client_ca_file); without server.tls, cluster.tls must stay empty.
      {on + "}\nserver: {tls: {cert_file: /c, key_file: /k}}",
       {"cluster.tls.ca_file", "''", "server.tls.client_ca_file", "is empty"}},
      {on + "tls: {ca_file: /ca}}", {"cluster.tls.ca_file", "/ca", "while server.tls is not set"}},
      {on + "tls: {server_name: peers.example}}",
       {"cluster.tls.server_name", "peers.example", "while server.tls is not set"}},
      {on + "tls: {cert_file: /pc}}\nserver: {tls: {cert_file: /c, key_file: /k}}",
       {"cluster.tls.key_file", "since cluster.tls.cert_file is set"}},
      {on + "tls: {key_file: /pk}}\nserver: {tls: {cert_file: /c, key_file: /k}}",
       {"cluster.tls.cert_file", "since cluster.tls.key_file is set"}},
      {"cluster: {tls: {server_name: 'peers.example:443'}}",
       {"cluster.tls.server_name", "no port"}},
      {"cluster: {tls: {ca: /ca}}", {"cluster.tls.ca", "unknown", "ca_file"}},
      {"cluster: {gossip: true}", {"cluster.gossip", "unknown", "advertise"}},
      {"cluster: {spill: {threshold: 1.5}}", {"cluster.spill.threshold", "1.5", "[0.05, 1]"}},
      {"cluster: {spill: {accept_below: 0.95}}",
       {"cluster.spill.accept_below", "0.95", "below cluster.spill.threshold (0.9)"}},
      {"cluster: {spill: {candidates: 0}}", {"cluster.spill.candidates", "[1, 64]"}},
      {"cluster: {spill: {put_wait: -1s}}", {"cluster.spill.put_wait", "-1s"}},
      {"cluster: {spill: {put_wait: soon}}", {"cluster.spill.put_wait", "soon"}},
      {"cluster: {spill: {handoff: 11m}}", {"cluster.spill.handoff", "11m"}},
      {"cluster: {spill: {handoff: -1}}", {"cluster.spill.handoff", "-1"}},
      {"cluster: {spill: {ratio: 2}}", {"cluster.spill.ratio", "unknown"}},
      {"cluster: {spill: 3}", {"cluster.spill"}},
      {"cluster: {transport: rdma}", {"cluster.transport", "rdma", "auto", "grpc or ucx"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    absl::StatusOr<DaemonConfig> got = ParseConfig(c.yaml, "t", {});
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& w : c.want) EXPECT_THAT(got.status().message(), HasSubstr(w));
  }
  EXPECT_OK(ParseConfig(on + "}", "ok", {}).status());
}

TEST(ConfigTest, ClusterTlsDefaultsToTheServersFilesAndKeepsExplicitOnes) {
  const std::string on =
      "cluster: {enabled: true, advertise: 127.0.0.1:7001, "
      "peers: [127.0.0.1:7002], peer_token: {file: /t}";
  const std::string mtls = "server: {tls: {cert_file: /c, key_file: /k, client_ca_file: /ca}}\n";
  // Plaintext server: plaintext peers.
  ASSERT_OK_AND_ASSIGN(DaemonConfig plain, ParseConfig(on + "}", "t", {}));
  EXPECT_FALSE(plain.cluster.tls.enabled());
  // mTLS server: peers verified against the client CA, this daemon's own certificate presented.
  ASSERT_OK_AND_ASSIGN(DaemonConfig d, ParseConfig(mtls + on + "}", "t", {}));
  EXPECT_TRUE(d.cluster.tls.enabled());
  EXPECT_EQ(d.cluster.tls.ca_file, "/ca");
  EXPECT_EQ(d.cluster.tls.cert_file, "/c");
  EXPECT_EQ(d.cluster.tls.key_file, "/k");
  EXPECT_EQ(d.cluster.tls.server_name, "");
  // Explicit keys win; a TLS (not mTLS) server works with an explicit ca_file.
  ASSERT_OK_AND_ASSIGN(DaemonConfig e,
                       ParseConfig("server: {tls: {cert_file: /c, key_file: /k}}\n" + on +
                                       ", tls: {ca_file: /peer-ca, cert_file: /pc, key_file: /pk, "
                                       "server_name: proxima.proxima-system.svc}}",
                                   "t", {}));
  EXPECT_EQ(e.cluster.tls.ca_file, "/peer-ca");
  EXPECT_EQ(e.cluster.tls.cert_file, "/pc");
  EXPECT_EQ(e.cluster.tls.key_file, "/pk");
  EXPECT_EQ(e.cluster.tls.server_name, "proxima.proxima-system.svc");
  ASSERT_OK_AND_ASSIGN(DaemonConfig again, ParseConfig(ConfigToYaml(e), "again", {}));
  EXPECT_EQ(again.cluster.tls.ca_file, "/peer-ca");
  EXPECT_EQ(again.cluster.tls.server_name, "proxima.proxima-system.svc");
  // The cluster off: nothing is resolved, whatever server.tls says.
  ASSERT_OK_AND_ASSIGN(DaemonConfig off, ParseConfig(mtls, "t", {}));
  EXPECT_FALSE(off.cluster.tls.enabled());
}

}  // namespace
}  // namespace proxima::daemon
