#include "daemon/tier_service.h"

#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "common/testing/metric_value.h"
#include "common/testing/status_matchers.h"
#include "common/testing/tiny_profile.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kernels/kv_file.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::ModelProfile SmallProfile() { return proxima::testing::TinyProfile("test-model tp=1/0"); }

class TierServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonConfig config;
    config.host_tier.capacity_bytes = 1 << 20;
    config.namespaces = {{"a"}, {"b"}};
    config.server.max_batch_blocks = 4;
    config.server.max_message_bytes = 64 << 10;
    auto s = TierService::Create(config, &registry_);
    ASSERT_OK(s.status());
    service_ = *std::move(s);
    v1::RegisterProfileRequest req;
    req.set_namespace_name("a");
    *req.mutable_profile() = SmallProfile();
    v1::RegisterProfileResponse resp;
    ASSERT_OK(service_->RegisterProfile(Caller::Anonymous(), req, &resp));
    profile_id_ = resp.profile_id();
    block_bytes_ = resp.block_bytes();
  }

  v1::PutRequest PutOf(int n, char fill) {
    v1::PutRequest req;
    req.set_namespace_name("a");
    req.set_profile_id(profile_id_);
    for (int i = 0; i < n; ++i) {
      v1::PutBlock* b = req.add_blocks();
      b->set_key(std::string(32, static_cast<char>('A' + i)));
      b->set_data(std::string(block_bytes_, fill));
    }
    return req;
  }

  metrics::Registry registry_;
  std::unique_ptr<TierService> service_;
  uint64_t profile_id_ = 0;
  uint64_t block_bytes_ = 0;
};

TEST_F(TierServiceTest, ProfileIdIsStableAndBlockBytesFollowGeometry) {
  EXPECT_EQ(block_bytes_, 2u * 2 * 4 * 2 * 8 * 2);
  EXPECT_EQ(ProfileId(SmallProfile()), profile_id_);
  v1::ModelProfile other = SmallProfile();
  other.set_fingerprint("other-model");
  EXPECT_NE(ProfileId(other), profile_id_);
  v1::ModelProfile bad = SmallProfile();
  bad.set_head_dim(0);
  EXPECT_THAT(ProfileBlockBytes(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("profile.head_dim is 0")));
  bad = SmallProfile();
  bad.set_dtype(static_cast<v1::DType>(42));
  EXPECT_THAT(ProfileBlockBytes(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("profile.dtype is 42")));
}

TEST_F(TierServiceTest, BadRequestsAreRejectedWithPreciseErrorsAndChangeNothing) {
  v1::PutResponse put_resp;
  ASSERT_OK(service_->Put(Caller::Anonymous(), PutOf(2, 'x'), &put_resp));

  v1::PutRequest wrong_ns = PutOf(1, 'y');
  wrong_ns.set_namespace_name("zzz");
  EXPECT_THAT(service_->Put(Caller::Anonymous(), wrong_ns, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'zzz'")));
  v1::PutRequest other_ns = PutOf(1, 'y');
  other_ns.set_namespace_name("b");  // profile registered only in "a"
  EXPECT_THAT(service_->Put(Caller::Anonymous(), other_ns, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'b'")));
  v1::PutRequest wrong_profile = PutOf(1, 'y');
  wrong_profile.set_profile_id(12345);
  EXPECT_THAT(service_->Put(Caller::Anonymous(), wrong_profile, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("0x0000000000003039")));
  EXPECT_THAT(service_->Put(Caller::Anonymous(), PutOf(0, 'y'), &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no blocks")));
  EXPECT_THAT(service_->Put(Caller::Anonymous(), PutOf(5, 'y'), &put_resp),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 4")));
  v1::PutRequest short_key = PutOf(3, 'y');
  short_key.mutable_blocks(2)->set_key("short");
  EXPECT_THAT(service_->Put(Caller::Anonymous(), short_key, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[2].key is 5 bytes"), HasSubstr("32"))));
  v1::PutRequest wrong_size = PutOf(2, 'y');
  wrong_size.mutable_blocks(1)->set_data("tiny");
  EXPECT_THAT(service_->Put(Caller::Anonymous(), wrong_size, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[1].data is 4 bytes"), HasSubstr("needs 512 bytes"))));
  v1::PutRequest bad_crc = PutOf(1, 'y');
  bad_crc.mutable_blocks(0)->set_crc32c(1);
  EXPECT_THAT(service_->Put(Caller::Anonymous(), bad_crc, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("crc32c")));

  // Nothing above changed the two blocks stored first.
  v1::GetRequest get;
  get.set_namespace_name("a");
  get.set_profile_id(profile_id_);
  get.add_keys(std::string(32, 'A'));
  get.add_keys(std::string(32, 'B'));
  get.add_keys(std::string(32, 'C'));
  v1::GetResponse got;
  ASSERT_OK(service_->Get(Caller::Anonymous(), get, &got));
  ASSERT_EQ(got.results_size(), 3);
  EXPECT_EQ(got.results(0).data(), std::string(block_bytes_, 'x'));
  EXPECT_EQ(got.results(1).data(), std::string(block_bytes_, 'x'));
  EXPECT_FALSE(got.results(2).found());
}

// A core with an 8 MiB host tier and messages of at most `max_message_bytes`, and the outcome
// of registering SmallProfile() with `tokens` per block in its namespace "default".
struct LimitedCore {
  metrics::Registry registry;
  std::unique_ptr<TierService> service;
  absl::Status registered;
  v1::RegisterProfileResponse profile;
};
std::unique_ptr<LimitedCore> CoreWithMessageLimit(uint64_t max_message_bytes, uint32_t tokens) {
  auto core = std::make_unique<LimitedCore>();
  DaemonConfig config;
  config.host_tier.capacity_bytes = 8 << 20;
  config.server.max_message_bytes = max_message_bytes;
  absl::StatusOr<std::unique_ptr<TierService>> service =
      TierService::Create(config, &core->registry);
  EXPECT_OK(service.status());
  if (!service.ok()) return nullptr;
  core->service = *std::move(service);
  v1::RegisterProfileRequest reg;
  reg.set_namespace_name("default");
  *reg.mutable_profile() = SmallProfile();
  reg.mutable_profile()->set_tokens_per_block(tokens);
  core->registered = core->service->RegisterProfile(Caller::Anonymous(), reg, &core->profile);
  return core;
}

TEST_F(TierServiceTest, GetThatCannotFitOneMessageIsRefusedUpFront) {
  auto core = CoreWithMessageLimit(1 << 20, /*tokens=*/256);  // 32 KiB blocks
  ASSERT_TRUE(core);
  ASSERT_OK(core->registered);
  v1::GetRequest get;
  get.set_namespace_name("default");
  get.set_profile_id(core->profile.profile_id());
  for (int i = 0; i < 40; ++i) get.add_keys(std::string(32, static_cast<char>(i)));
  v1::GetResponse resp;
  EXPECT_THAT(core->service->Get(Caller::Anonymous(), get, &resp),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("at most 31 blocks")));
}

TEST_F(TierServiceTest, AProfileIsTakenOnlyWhenAnInlineGetCanReturnOneOfItsBlocks) {
  for (const uint64_t room : {uint64_t{4096}, uint64_t{4096 + 64}}) {
    SCOPED_TRACE(absl::StrCat("max_message_bytes = 64 KiB + ", room));
    auto core = CoreWithMessageLimit((64 << 10) + room, /*tokens=*/512);  // 64 KiB blocks
    ASSERT_TRUE(core);
    if (room == 4096) {
      EXPECT_THAT(core->registered, StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("blocks of at most 65472 bytes")));
      continue;
    }
    ASSERT_OK(core->registered);
    v1::PutRequest put;
    put.set_namespace_name("default");
    put.set_profile_id(core->profile.profile_id());
    v1::PutBlock* b = put.add_blocks();
    b->set_key(std::string(32, 'k'));
    b->set_data(std::string(64 << 10, 'x'));
    v1::PutResponse put_resp;
    ASSERT_OK(core->service->Put(Caller::Anonymous(), put, &put_resp));
    v1::GetRequest get;
    get.set_namespace_name("default");
    get.set_profile_id(core->profile.profile_id());
    get.add_keys(std::string(32, 'k'));
    v1::GetResponse got;
    ASSERT_OK(core->service->Get(Caller::Anonymous(), get, &got));
    ASSERT_EQ(got.results_size(), 1);
    EXPECT_EQ(got.results(0).data(), std::string(64 << 10, 'x'));
  }
}

TEST_F(TierServiceTest, LookupCountsTheLeadingPresentKeys) {
  v1::PutResponse put_resp;
  ASSERT_OK(service_->Put(Caller::Anonymous(), PutOf(3, 'x'), &put_resp));  // keys A, B, C
  auto lookup = [&](std::string chain) {
    v1::LookupRequest req;
    req.set_namespace_name("a");
    req.set_profile_id(profile_id_);
    for (char c : chain) req.add_keys(std::string(32, c));
    v1::LookupResponse resp;
    EXPECT_OK(service_->Lookup(Caller::Anonymous(), req, &resp));
    return resp.num_prefix_present();
  };
  EXPECT_EQ(lookup("ABC"), 3u);
  EXPECT_EQ(lookup("ABCD"), 3u);
  EXPECT_EQ(lookup("AXC"), 1u);  // a gap ends the prefix even though C is present
  EXPECT_EQ(lookup("X"), 0u);
}

// Tokens, read-only access and private prefixes, on the core the gRPC layer calls.
class TierServiceAuthTest : public ::testing::Test {
 protected:
  static constexpr char kWriterA[] = "writer-a-token-0123456789";
  static constexpr char kReaderA[] = "reader-a-token-0123456789";
  static constexpr char kWriterB[] = "writer-b-token-0123456789";
  static constexpr char kAliceP[] = "alice-p-token-0123456789";
  static constexpr char kBobP[] = "bob-p-token-01234567890";
  static constexpr char kAliceReaderP[] = "alice-reader-p-token-0123";

  void SetUp() override {
    setenv("PXT_WA", kWriterA, 1);
    setenv("PXT_RA", kReaderA, 1);
    setenv("PXT_WB", kWriterB, 1);
    setenv("PXT_AP", kAliceP, 1);
    setenv("PXT_BP", kBobP, 1);
    setenv("PXT_ARP", kAliceReaderP, 1);
    DaemonConfig config;
    config.host_tier.capacity_bytes = 1 << 20;
    config.namespaces = {
        {"a",
         {{"writer", "", "PXT_WA", TokenAccess::kReadWrite, ""},
          {"reader", "", "PXT_RA", TokenAccess::kReadOnly, ""}}},
        {"b", {{"writer", "", "PXT_WB", TokenAccess::kReadWrite, ""}}},
        {"p",
         {{"alice", "", "PXT_AP", TokenAccess::kReadWrite, ""},
          {"bob", "", "PXT_BP", TokenAccess::kReadWrite, ""},
          {"alice-reader", "", "PXT_ARP", TokenAccess::kReadOnly, "alice"}},
         /*private_prefixes=*/true},
        {"open"}};
    ASSERT_OK_AND_ASSIGN(service_, TierService::Create(config, &registry_));
  }

  Caller As(const std::string& token) {
    absl::StatusOr<Caller> c = service_->Authenticate("Bearer " + token);
    EXPECT_OK(c.status());
    return c.ok() ? *c : Caller::Anonymous();
  }
  uint64_t Register(const Caller& caller, const std::string& ns) {
    v1::RegisterProfileRequest req;
    req.set_namespace_name(ns);
    *req.mutable_profile() = SmallProfile();
    v1::RegisterProfileResponse resp;
    EXPECT_OK(service_->RegisterProfile(caller, req, &resp));
    block_bytes_ = resp.block_bytes();
    return resp.profile_id();
  }
  absl::Status Put(const Caller& caller, const std::string& ns, uint64_t profile, char key) {
    v1::PutRequest req;
    req.set_namespace_name(ns);
    req.set_profile_id(profile);
    v1::PutBlock* b = req.add_blocks();
    b->set_key(std::string(32, key));
    b->set_data(std::string(block_bytes_, key));
    v1::PutResponse resp;
    return service_->Put(caller, req, &resp);
  }
  absl::StatusOr<uint32_t> Lookup(const Caller& caller, const std::string& ns, uint64_t profile,
                                  char key) {
    v1::LookupRequest req;
    req.set_namespace_name(ns);
    req.set_profile_id(profile);
    req.add_keys(std::string(32, key));
    v1::LookupResponse resp;
    PROXIMA_RETURN_IF_ERROR(service_->Lookup(caller, req, &resp));
    return resp.num_prefix_present();
  }

  metrics::Registry registry_;
  std::unique_ptr<TierService> service_;
  uint64_t block_bytes_ = 0;
};

TEST_F(TierServiceAuthTest, BadTokensAreUnauthenticated) {
  EXPECT_THAT(service_->Authenticate("Bearer not-a-configured-token-xyz"),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  EXPECT_THAT(service_->Authenticate(std::string("Basic ") + kWriterA),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("Bearer <token>")));
  // A prefix or an extension of a real token is no token.
  EXPECT_THAT(service_->Authenticate(std::string("Bearer ") + kWriterA + "x"),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  EXPECT_THAT(service_->Authenticate(std::string("Bearer writer-a-token")),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("not valid")));
  ASSERT_OK_AND_ASSIGN(Caller anonymous, service_->Authenticate(""));
  EXPECT_EQ(anonymous.namespace_index, -1);
  // Without a token: protected and unknown namespaces answer alike; open ones work.
  v1::RegisterProfileRequest req;
  *req.mutable_profile() = SmallProfile();
  v1::RegisterProfileResponse resp;
  for (const char* ns : {"a", "no-such-namespace"}) {
    req.set_namespace_name(ns);
    EXPECT_THAT(service_->RegisterProfile(anonymous, req, &resp),
                StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("needs a bearer token")));
  }
  req.set_namespace_name("open");
  EXPECT_OK(service_->RegisterProfile(anonymous, req, &resp));
}

TEST_F(TierServiceAuthTest, TokensActOnlyInTheirNamespace) {
  const Caller writer_a = As(kWriterA), writer_b = As(kWriterB);
  const uint64_t profile = Register(writer_a, "a");
  ASSERT_OK(Put(writer_a, "a", profile, 'K'));
  EXPECT_THAT(Lookup(writer_a, "a", profile, 'K'), ::proxima::testing::IsOkAndHolds(1u));
  // B's token on A's namespace, and on a namespace that does not exist: the same refusal.
  for (const char* ns : {"a", "zz"}) {
    EXPECT_THAT(Lookup(writer_b, ns, profile, 'K'),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         AllOf(HasSubstr("not valid for namespace"), HasSubstr("'b' only"))));
  }
  // In its own namespace B does not see A's block, even with A's profile registered there.
  EXPECT_EQ(Register(writer_b, "b"), profile);
  EXPECT_THAT(Lookup(writer_b, "b", profile, 'K'), ::proxima::testing::IsOkAndHolds(0u));
  v1::StatsResponse stats;
  ASSERT_OK(service_->Stats(writer_b, v1::StatsRequest(), &stats));
  ASSERT_EQ(stats.namespaces_size(), 1);
  EXPECT_EQ(stats.namespaces(0).name(), "b");
  EXPECT_EQ(stats.namespaces(0).blocks(), 0u);
  EXPECT_EQ(stats.tiers_size(), 0);  // tier totals would count A's block
}

TEST_F(TierServiceAuthTest, ReadOnlyTokensReadButNeverWrite) {
  const Caller writer = As(kWriterA), reader = As(kReaderA);
  const uint64_t profile = Register(reader, "a");  // registering is part of reading
  ASSERT_OK(Put(writer, "a", profile, 'K'));
  EXPECT_THAT(Lookup(reader, "a", profile, 'K'), ::proxima::testing::IsOkAndHolds(1u));
  v1::GetRequest get;
  get.set_namespace_name("a");
  get.set_profile_id(profile);
  get.add_keys(std::string(32, 'K'));
  v1::GetResponse got;
  ASSERT_OK(service_->Get(reader, get, &got));
  EXPECT_TRUE(got.results(0).found());
  EXPECT_THAT(Put(reader, "a", profile, 'L'),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr("'reader'"), HasSubstr("read_only"), HasSubstr("Put"))));
  v1::DeleteRequest del;
  del.set_namespace_name("a");
  del.set_profile_id(profile);
  del.add_keys(std::string(32, 'K'));
  v1::DeleteResponse deleted;
  EXPECT_THAT(service_->Delete(reader, del, &deleted),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("Delete")));
  EXPECT_THAT(Lookup(reader, "a", profile, 'K'), ::proxima::testing::IsOkAndHolds(1u));
}

TEST_F(TierServiceAuthTest, PrivatePrefixesSeparateTokenScopes) {
  const Caller alice = As(kAliceP), bob = As(kBobP), alice_reader = As(kAliceReaderP);
  const uint64_t profile = Register(alice, "p");
  ASSERT_OK(Put(alice, "p", profile, 'S'));
  // Bob cannot tell that Alice sent this prefix: a miss, and his own put of it is a new block.
  EXPECT_THAT(Lookup(bob, "p", profile, 'S'), ::proxima::testing::IsOkAndHolds(0u));
  ASSERT_OK(Put(bob, "p", profile, 'S'));
  EXPECT_THAT(Lookup(bob, "p", profile, 'S'), ::proxima::testing::IsOkAndHolds(1u));
  // A read-only token in Alice's scope reads Alice's blocks.
  EXPECT_THAT(Lookup(alice_reader, "p", profile, 'S'), ::proxima::testing::IsOkAndHolds(1u));
  v1::DeleteRequest del;
  del.set_namespace_name("p");
  del.set_profile_id(profile);
  del.add_keys(std::string(32, 'S'));
  v1::DeleteResponse deleted;
  ASSERT_OK(service_->Delete(bob, del, &deleted));
  EXPECT_EQ(deleted.num_deleted(), 1u);
  EXPECT_THAT(Lookup(alice, "p", profile, 'S'), ::proxima::testing::IsOkAndHolds(1u));
}

// tiers.host.pin_for_gpu: auto pins exactly when a GPU is visible and otherwise starts unpinned;
// on refuses to start when it cannot pin, saying why; off never pins. Whichever machine runs it,
// one of the two branches of each check is real (scripts/gpu-check.sh runs it on a GPU).
TEST(TierServicePinTest, HostTierIsPinnedForGpuTransfersWhenAGpuIsVisible) {
  std::string why_none;
  const bool gpu = !gpu::VisibleDevices(&why_none).empty();
  DaemonConfig config;
  config.host_tier.capacity_bytes = 64 << 20;
  for (PinForGpu mode : {PinForGpu::kAuto, PinForGpu::kOn, PinForGpu::kOff}) {
    config.host_tier.pin_for_gpu = mode;
    metrics::Registry registry;
    absl::StatusOr<std::unique_ptr<TierService>> s = TierService::Create(config, &registry);
    if (mode == PinForGpu::kOn && !gpu) {
      EXPECT_THAT(s,
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           AllOf(HasSubstr("tiers.host.pin_for_gpu is on"), HasSubstr(why_none))));
      continue;
    }
    ASSERT_OK(s.status()) << PinForGpuName(mode);
    const bool expect_pinned = gpu && mode != PinForGpu::kOff;
    EXPECT_THAT(registry.RenderText(),
                HasSubstr(absl::StrCat("proxima_tier_pinned_for_gpu{tier=\"host\"} ",
                                       expect_pinned ? 1 : 0)))
        << PinForGpuName(mode);
  }
}

TEST(TierServiceAuthConfigTest, TokenErrorsNameTheKeyNotTheToken) {
  metrics::Registry registry;
  DaemonConfig config;
  config.namespaces = {{"a", {{"w", "/nonexistent/token", "", TokenAccess::kReadWrite, ""}}}};
  EXPECT_THAT(TierService::Create(config, &registry),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("namespaces[0].tokens[0].file"),
                             HasSubstr("/nonexistent/token"))));
  setenv("PXT_DUP", "duplicated-token-0123456789", 1);
  config.namespaces = {{"a", {{"w", "", "PXT_DUP", TokenAccess::kReadWrite, ""}}},
                       {"b", {{"w", "", "PXT_DUP", TokenAccess::kReadOnly, ""}}}};
  metrics::Registry registry2;
  EXPECT_THAT(TierService::Create(config, &registry2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("namespaces[1].tokens[0]"),
                             HasSubstr("namespaces[0].tokens[0]"),
                             ::testing::Not(HasSubstr("duplicated-token")))));
}

// A service whose namespace "z" holds two real 16-token blocks (keys 'k'..., 'l'...) that the
// tierer encoded at int8.
struct CompressedService {
  std::unique_ptr<TierService> service;
  uint64_t profile_id = 0;
  uint64_t block_bytes = 0;
};
// A service whose namespace "z" holds `blocks` real 16-token blocks of SmolLM2 KV under keys of
// 32 'k's, 'l's, ..., all encoded at int8 by the tierer.
void MakeCompressedService(metrics::Registry* registry, CompressedService* out,
                           uint32_t blocks = 2) {
  absl::StatusOr<codec::KvTensor> kv = codec::ReadKvFile(PROXIMA_TEST_KV_FILE);
  ASSERT_OK(kv.status());
  constexpr uint32_t kTokens = 16;
  const codec::BlockGeometry shape = kv->BlockShape(kTokens);
  DaemonConfig config;
  config.host_tier.capacity_bytes = 16 << 20;  // far below the tierer's pressure threshold
  config.namespaces = {{"z"}};
  config.namespaces[0].compression.enabled = true;
  config.namespaces[0].compression.levels = {"int8"};
  ASSERT_OK(ResolveCompressionLevels("test", "namespaces[0].compression",
                                     &config.namespaces[0].compression));
  ASSERT_OK_AND_ASSIGN(out->service, TierService::Create(config, registry));
  TierService& service = *out->service;
  const Caller anonymous = Caller::Anonymous();
  v1::RegisterProfileRequest reg;
  reg.set_namespace_name("z");
  v1::ModelProfile* profile = reg.mutable_profile();
  profile->set_num_layers(kv->num_layers);
  profile->set_num_kv_heads(kv->num_kv_heads);
  profile->set_head_dim(kv->head_dim);
  profile->set_tokens_per_block(kTokens);
  profile->set_dtype(v1::DTYPE_BF16);
  v1::RegisterProfileResponse registered;
  ASSERT_OK(service.RegisterProfile(anonymous, reg, &registered));
  ASSERT_EQ(registered.block_bytes(), shape.RawBytes());
  out->profile_id = registered.profile_id();
  out->block_bytes = registered.block_bytes();

  v1::PutRequest put;
  put.set_namespace_name("z");
  put.set_profile_id(registered.profile_id());
  ASSERT_LE(blocks * kTokens, kv->num_tokens);
  for (uint32_t b = 0; b < blocks; ++b) {
    v1::PutBlock* block = put.add_blocks();
    block->set_key(std::string(32, static_cast<char>('k' + b)));
    std::string data(shape.RawBytes(), '\0');
    ASSERT_OK(kv->ExtractBlock(b * kTokens, kTokens,
                               std::as_writable_bytes(std::span(data.data(), data.size()))));
    block->set_data(std::move(data));
    block->set_position(b);
  }
  v1::PutResponse put_response;
  ASSERT_OK(service.Put(anonymous, put, &put_response));
  const uint8_t caps[] = {1};
  for (uint32_t b = 0; b < blocks; ++b) ASSERT_TRUE(service.tierer().CompressOne(caps));
  ASSERT_EQ(service.store().level_blocks(1), blocks);
}

// A raw Get of the blocks whose keys are 32 of each character of `keys`.
v1::GetRequest RawGetOf(uint64_t profile_id, std::string_view keys) {
  v1::GetRequest get;
  get.set_namespace_name("z");
  get.set_profile_id(profile_id);
  for (char k : keys) get.add_keys(std::string(32, k));
  get.set_format(v1::BLOCK_FORMAT_RAW);
  get.set_client_verifies_crc32c(true);
  return get;
}

// A block the tierer encoded, read back raw by a client that checks CRC32C itself
// (client_verifies_crc32c): the client sees only the decoded bytes and their fresh CRC32C, so
// the daemon must still check the stored container before decoding it. A corrupt container is
// dropped, counted and reported as a miss, not decoded into wrong bytes.
TEST(TierServiceCompressionTest, EncodedBlockIsCrcCheckedBeforeDecodingEvenWhenTheClientVerifies) {
  metrics::Registry registry;
  CompressedService c;
  ASSERT_NO_FATAL_FAILURE(MakeCompressedService(&registry, &c));
  TierService& service = *c.service;
  const Caller anonymous = Caller::Anonymous();
  const v1::GetRequest get = RawGetOf(c.profile_id, "kl");
  // Intact: both decoded, each with the CRC32C of the bytes sent.
  std::vector<std::optional<BlockStore::ReadBlock>> blocks;
  ASSERT_OK(service.GetBlocks(anonymous, get, &blocks));
  ASSERT_EQ(blocks.size(), 2u);
  for (const auto& b : blocks) {
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->level, 0);
    EXPECT_EQ(b->bytes.size(), c.block_bytes);
    EXPECT_EQ(b->crc32c, Crc32c(b->bytes));
  }
  blocks.clear();

  // Corrupt the stored container of the first block.
  BlockId id{0, c.profile_id, {}};
  std::memset(id.key.data(), 'k', id.key.size());
  ASSERT_TRUE(service.store().CorruptForTesting(id, 100));
  ASSERT_OK(service.GetBlocks(anonymous, get, &blocks));
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_FALSE(blocks[0].has_value());  // a miss, not wrong bytes
  ASSERT_TRUE(blocks[1].has_value());   // the other block is untouched
  EXPECT_EQ(blocks[1]->crc32c, Crc32c(blocks[1]->bytes));
  EXPECT_EQ(service.store().crc_failures(), 1u);
  EXPECT_FALSE(service.store().Contains(id));
}

// A Get's decoded blocks land in buffers that earlier Gets' responses let go of
// (server.decode_buffer_cache_bytes): a reused buffer holds exactly the new block's bytes, never
// a byte of the block it held before, and a buffer still referenced by a response in flight is
// never handed out.
TEST(TierServiceCompressionTest, DecodeBuffersAreReusedOnlyOnceReleasedAndHoldOnlyTheNewBlock) {
  metrics::Registry registry;
  CompressedService c;
  ASSERT_NO_FATAL_FAILURE(MakeCompressedService(&registry, &c));
  TierService& service = *c.service;
  const Caller anonymous = Caller::Anonymous();
  auto bytes_of = [](const std::optional<BlockStore::ReadBlock>& b) {
    return std::string(reinterpret_cast<const char*>(b->bytes.data()), b->bytes.size());
  };
  std::vector<std::optional<BlockStore::ReadBlock>> first;
  ASSERT_OK(service.GetBlocks(anonymous, RawGetOf(c.profile_id, "kl"), &first));
  ASSERT_TRUE(first[0].has_value() && first[1].has_value());
  const std::string k = bytes_of(first[0]), l = bytes_of(first[1]);
  ASSERT_NE(k, l);
  EXPECT_THAT(registry.RenderText(),
              HasSubstr("proxima_get_decode_buffers_total{source=\"allocated\"} 2"));

  // While `first` still holds both buffers, a Get gets new ones.
  std::vector<std::optional<BlockStore::ReadBlock>> second;
  ASSERT_OK(service.GetBlocks(anonymous, RawGetOf(c.profile_id, "l"), &second));
  EXPECT_NE(second[0]->bytes.data(), first[0]->bytes.data());
  EXPECT_NE(second[0]->bytes.data(), first[1]->bytes.data());
  EXPECT_EQ(bytes_of(second[0]), l);
  second.clear();
  first.clear();  // the "responses" are sent: three buffers kept

  // In the other order: each block comes back whole in a buffer that held another block.
  std::vector<std::optional<BlockStore::ReadBlock>> third;
  ASSERT_OK(service.GetBlocks(anonymous, RawGetOf(c.profile_id, "lk"), &third));
  ASSERT_TRUE(third[0].has_value() && third[1].has_value());
  EXPECT_EQ(bytes_of(third[0]), l);
  EXPECT_EQ(bytes_of(third[1]), k);
  EXPECT_EQ(third[0]->crc32c, Crc32c(third[0]->bytes));
  EXPECT_EQ(third[1]->crc32c, Crc32c(third[1]->bytes));
  const std::string metrics = registry.RenderText();
  EXPECT_THAT(metrics, HasSubstr("proxima_get_decode_buffers_total{source=\"reused\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("proxima_get_decode_buffers_total{source=\"allocated\"} 3"));
  EXPECT_THAT(metrics,
              HasSubstr(absl::StrCat("proxima_get_decode_buffers_kept_bytes ", c.block_bytes)));
}

// A Get of enough encoded blocks decodes them on several threads (server.decode_threads; two
// blocks and 2 MiB of raw bytes per thread): each block lands whole in its own buffer, with its
// own CRC32C, also when the buffers are reused from the Get before. Run under ThreadSanitizer
// by scripts/sanitize.sh thread.
TEST(TierServiceCompressionTest, ManyBlocksDecodeOnSeveralThreadsEachIntoItsOwnBuffer) {
  metrics::Registry registry;
  CompressedService c;
  constexpr uint32_t kBlocks = 16;  // 16 x 368,640 bytes: two threads' worth
  ASSERT_NO_FATAL_FAILURE(MakeCompressedService(&registry, &c, kBlocks));
  ASSERT_GE(kBlocks * c.block_bytes, 4u << 20);
  TierService& service = *c.service;
  std::string keys;
  for (uint32_t b = 0; b < kBlocks; ++b) keys.push_back(static_cast<char>('k' + b));
  // What each block decodes to, one block per Get (one thread).
  std::vector<std::string> expected;
  for (char k : keys) {
    std::vector<std::optional<BlockStore::ReadBlock>> one;
    ASSERT_OK(service.GetBlocks(Caller::Anonymous(), RawGetOf(c.profile_id, {&k, 1}), &one));
    ASSERT_TRUE(one[0].has_value());
    expected.emplace_back(reinterpret_cast<const char*>(one[0]->bytes.data()),
                          one[0]->bytes.size());
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::optional<BlockStore::ReadBlock>> all;
    ASSERT_OK(service.GetBlocks(Caller::Anonymous(), RawGetOf(c.profile_id, keys), &all));
    ASSERT_EQ(all.size(), kBlocks);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      ASSERT_TRUE(all[b].has_value()) << b;
      EXPECT_EQ(std::string_view(reinterpret_cast<const char*>(all[b]->bytes.data()),
                                 all[b]->bytes.size()),
                expected[b])
          << "block " << b << ", round " << round;
      EXPECT_EQ(all[b]->crc32c, Crc32c(all[b]->bytes)) << b;
    }
  }
  // The single Gets took one buffer again and again (15 reused), the first round that one and
  // 15 new, the second and third rounds all 16 from the round before.
  EXPECT_THAT(registry.RenderText(),
              HasSubstr(absl::StrCat("proxima_get_decode_buffers_total{source=\"reused\"} ",
                                     kBlocks + 2 * kBlocks)));
}

// namespaces[].max_bytes: a namespace at its limit makes room among its own blocks, least
// recently used first, and never takes another namespace's.
class NamespaceLimitTest : public ::testing::Test {
 protected:
  // Namespaces "a" (at most `a_max_bytes`) and "b" (no limit of its own), each with the 512-byte
  // test profile, in a 1 MiB host tier.
  void Start(uint64_t a_max_bytes) {
    DaemonConfig config;
    config.host_tier.capacity_bytes = 1 << 20;
    config.namespaces = {{"a"}, {"b"}};
    config.namespaces[0].max_bytes = a_max_bytes;
    ASSERT_OK_AND_ASSIGN(service_, TierService::Create(config, &registry_));
    for (const char* ns : {"a", "b"}) {
      v1::RegisterProfileRequest req;
      req.set_namespace_name(ns);
      *req.mutable_profile() = SmallProfile();
      v1::RegisterProfileResponse resp;
      ASSERT_OK(service_->RegisterProfile(Caller::Anonymous(), req, &resp));
      profile_id_ = resp.profile_id();
      block_bytes_ = resp.block_bytes();
    }
  }
  static std::string Key(int n) { return absl::StrFormat("%032d", n); }
  v1::PutOutcome Put(const std::string& ns, int key) {
    v1::PutRequest req;
    req.set_namespace_name(ns);
    req.set_profile_id(profile_id_);
    v1::PutBlock* b = req.add_blocks();
    b->set_key(Key(key));
    b->set_data(std::string(block_bytes_, static_cast<char>(key)));
    v1::PutResponse resp;
    EXPECT_OK(service_->Put(Caller::Anonymous(), req, &resp));
    return resp.outcomes_size() == 1 ? resp.outcomes(0) : v1::PUT_OUTCOME_UNSPECIFIED;
  }
  BlockId Id(uint32_t ns, int key) const {
    BlockId id{ns, profile_id_, {}};
    const std::string k = Key(key);
    std::memcpy(id.key.data(), k.data(), k.size());
    return id;
  }
  bool Has(uint32_t ns, int key) const { return service_->store().Contains(Id(ns, key)); }
  double Metric(const std::string& series) const {
    return proxima::testing::MetricValue(registry_.RenderText(), series);
  }

  metrics::Registry registry_;
  std::unique_ptr<TierService> service_;
  uint64_t profile_id_ = 0;
  uint64_t block_bytes_ = 0;
};

TEST_F(NamespaceLimitTest, ANamespaceAtItsLimitEvictsItsOwnLeastRecentlyUsedBlocksOnly) {
  ASSERT_NO_FATAL_FAILURE(Start(8 * 512));
  ASSERT_EQ(block_bytes_, 512u);
  for (int k = 0; k < 4; ++k) ASSERT_EQ(Put("b", 100 + k), v1::PUT_OUTCOME_STORED);
  for (int k = 0; k < 8; ++k) ASSERT_EQ(Put("a", k), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(0), 8 * 512u);
  // Block 0 used again: the next put takes block 1, the least recently used, instead.
  ASSERT_TRUE(service_->store().Touch(Id(0, 0)));
  ASSERT_EQ(Put("a", 8), v1::PUT_OUTCOME_STORED);
  EXPECT_TRUE(Has(0, 0)) << "used again, so not the least recently used";
  EXPECT_FALSE(Has(0, 1));
  // Eleven more: blocks 2 to 7, then 0, then 8 to 11 go, oldest use first.
  for (int k = 9; k < 20; ++k) ASSERT_EQ(Put("a", k), v1::PUT_OUTCOME_STORED) << k;
  EXPECT_EQ(service_->store().namespace_bytes(0), 8 * 512u);
  for (int k = 0; k < 12; ++k) EXPECT_FALSE(Has(0, k)) << k;
  for (int k = 12; k < 20; ++k) EXPECT_TRUE(Has(0, k)) << k;
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(Has(1, 100 + k)) << "b's blocks never go for a's";
  EXPECT_EQ(Metric("proxima_namespace_limit_evictions_total{namespace=\"a\"}"), 12);
  EXPECT_EQ(Metric("proxima_namespace_limit_refusals_total{namespace=\"a\"}"), 0);
  EXPECT_EQ(Metric("proxima_namespace_max_bytes{namespace=\"a\"}"), 8 * 512);
  EXPECT_EQ(Metric("proxima_namespace_max_bytes{namespace=\"b\"}"), 0) << "no limit";
  // A namespace without a limit is not held to one.
  for (int k = 0; k < 40; ++k) ASSERT_EQ(Put("b", 200 + k), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(1), 44 * 512u);
  // What a peer's spilled block is held to: room under the limit, without making any.
  EXPECT_FALSE(service_->FitsInNamespace(0, 512));
  EXPECT_TRUE(service_->FitsInNamespace(1, 1 << 20));
}

TEST_F(NamespaceLimitTest, ABlockThatCannotFitOrFindsEveryBlockInUseIsNotStored) {
  ASSERT_NO_FATAL_FAILURE(Start(2 * 512));
  ASSERT_EQ(Put("a", 1), v1::PUT_OUTCOME_STORED);
  ASSERT_EQ(Put("a", 2), v1::PUT_OUTCOME_STORED);
  {
    // Both being read: neither may go, so the third is refused and both stay.
    std::optional<BlockStore::ReadBlock> r1 = service_->store().Read(Id(0, 1));
    std::optional<BlockStore::ReadBlock> r2 = service_->store().Read(Id(0, 2));
    ASSERT_TRUE(r1 && r2);
    EXPECT_EQ(Put("a", 3), v1::PUT_OUTCOME_NO_SPACE);
    EXPECT_TRUE(Has(0, 1) && Has(0, 2));
    EXPECT_FALSE(Has(0, 3));
  }
  EXPECT_EQ(Metric("proxima_namespace_limit_refusals_total{namespace=\"a\"}"), 1);
  EXPECT_EQ(Put("a", 3), v1::PUT_OUTCOME_STORED);  // read no more: block 1 goes
  EXPECT_FALSE(Has(0, 1));
  EXPECT_TRUE(Has(0, 2) && Has(0, 3));
}

TEST_F(NamespaceLimitTest, ALimitBelowOneBlockStoresNoneAndTakesNothingFromOthers) {
  ASSERT_NO_FATAL_FAILURE(Start(256));
  ASSERT_EQ(Put("b", 7), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(Put("a", 1), v1::PUT_OUTCOME_NO_SPACE);
  EXPECT_TRUE(Has(1, 7));
  EXPECT_EQ(service_->store().namespace_bytes(0), 0u);
  EXPECT_EQ(Metric("proxima_namespace_limit_refusals_total{namespace=\"a\"}"), 1);
}

// A limit changed while the service runs (SIGHUP with a changed config file): lowered, the
// namespace is brought within it at once, least recently used first, and nothing of another
// namespace goes; raised or removed, later puts are held to the new one; Stats and the metric
// show the limit in force.
TEST_F(NamespaceLimitTest, ALimitChangedWhileRunningHoldsAtOnceAndForLaterPuts) {
  ASSERT_NO_FATAL_FAILURE(Start(8 * 512));
  for (int k = 0; k < 2; ++k) ASSERT_EQ(Put("b", 100 + k), v1::PUT_OUTCOME_STORED);
  for (int k = 0; k < 8; ++k) ASSERT_EQ(Put("a", k), v1::PUT_OUTCOME_STORED);
  ASSERT_TRUE(service_->store().Touch(Id(0, 0)));  // now the most recently used

  EXPECT_TRUE(service_->SetNamespaceLimit(0, 3 * 512));
  EXPECT_EQ(service_->store().namespace_bytes(0), 3 * 512u);
  for (int k : {0, 6, 7}) EXPECT_TRUE(Has(0, k)) << k;
  for (int k = 1; k < 6; ++k) EXPECT_FALSE(Has(0, k)) << k;
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(Has(1, 100 + k)) << "b's blocks never go for a's";
  EXPECT_EQ(Metric("proxima_namespace_limit_evictions_total{namespace=\"a\"}"), 5);
  EXPECT_EQ(Metric("proxima_namespace_max_bytes{namespace=\"a\"}"), 3 * 512);
  v1::StatsResponse stats;
  ASSERT_OK(service_->Stats(Caller::Anonymous(), v1::StatsRequest(), &stats));
  ASSERT_EQ(stats.namespaces(0).name(), "a");
  EXPECT_EQ(stats.namespaces(0).max_bytes(), 3 * 512u);
  ASSERT_EQ(Put("a", 8), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(0), 3 * 512u) << "later puts: the new limit";
  EXPECT_FALSE(service_->FitsInNamespace(0, 512));

  // Raised: room for more without evicting.
  EXPECT_TRUE(service_->SetNamespaceLimit(0, 5 * 512));
  EXPECT_TRUE(service_->FitsInNamespace(0, 2 * 512));
  for (int k = 9; k < 11; ++k) ASSERT_EQ(Put("a", k), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(0), 5 * 512u);
  EXPECT_EQ(Metric("proxima_namespace_limit_evictions_total{namespace=\"a\"}"), 6);

  // Blocks being read cannot give way: false, and the limit holds from the next puts on.
  {
    std::vector<std::optional<BlockStore::ReadBlock>> reads;
    for (int k : {0, 7, 8, 9, 10}) reads.push_back(service_->store().Read(Id(0, k)));
    for (const auto& r : reads) ASSERT_TRUE(r.has_value());
    EXPECT_FALSE(service_->SetNamespaceLimit(0, 2 * 512));
    EXPECT_EQ(service_->store().namespace_bytes(0), 5 * 512u);
  }
  ASSERT_EQ(Put("a", 11), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(0), 2 * 512u);

  // Removed (0): no limit of its own.
  EXPECT_TRUE(service_->SetNamespaceLimit(0, 0));
  for (int k = 12; k < 30; ++k) ASSERT_EQ(Put("a", k), v1::PUT_OUTCOME_STORED);
  EXPECT_EQ(service_->store().namespace_bytes(0), 20 * 512u);
  EXPECT_EQ(Metric("proxima_namespace_max_bytes{namespace=\"a\"}"), 0);
}

// A compressing namespace at its limit encodes its own coldest blocks before it evicts any: with
// int8 (1.85x smaller on these real KV blocks), a limit of 4 raw blocks holds 6.
// A service whose namespace "z" compresses (int8) under a limit of 4 raw blocks of real
// SmolLM2 KV (16 tokens), its tierer stopped unless `background`; `put(b)` puts block b under
// key 'k' + b.
struct LimitedCompressedService {
  metrics::Registry registry;
  DaemonConfig config;
  std::unique_ptr<TierService> service;
  uint64_t profile_id = 0;
  std::function<void(uint32_t)> put;
};
BlockId BlockKeyed(const LimitedCompressedService& c, char k) {
  BlockId id{0, c.profile_id, {}};
  std::memset(id.key.data(), k, id.key.size());
  return id;
}
void MakeLimitedCompressedService(LimitedCompressedService* out, bool background = false,
                                  double threshold = 0.8) {
  static const absl::StatusOr<codec::KvTensor>* kv =
      new absl::StatusOr<codec::KvTensor>(codec::ReadKvFile(PROXIMA_TEST_KV_FILE));
  ASSERT_OK(kv->status());
  constexpr uint32_t kTokens = 16;
  const codec::BlockGeometry shape = (*kv)->BlockShape(kTokens);
  DaemonConfig& config = out->config;
  config.host_tier.capacity_bytes = 16 << 20;  // far below the tier's pressure threshold
  config.namespaces = {{"z"}};
  config.namespaces[0].compression.enabled = true;
  config.namespaces[0].compression.levels = {"int8"};
  config.namespaces[0].compression.memory_pressure_threshold = threshold;
  config.namespaces[0].max_bytes = 4 * shape.RawBytes();
  ASSERT_OK(ResolveCompressionLevels("test", "namespaces[0].compression",
                                     &config.namespaces[0].compression));
  ASSERT_OK_AND_ASSIGN(out->service, TierService::Create(config, &out->registry));
  TierService* service = out->service.get();
  if (!background) service->tierer().Stop();  // only the puts encode
  v1::RegisterProfileRequest reg;
  reg.set_namespace_name("z");
  v1::ModelProfile* profile = reg.mutable_profile();
  profile->set_num_layers((*kv)->num_layers);
  profile->set_num_kv_heads((*kv)->num_kv_heads);
  profile->set_head_dim((*kv)->head_dim);
  profile->set_tokens_per_block(kTokens);
  profile->set_dtype(v1::DTYPE_BF16);
  v1::RegisterProfileResponse registered;
  ASSERT_OK(service->RegisterProfile(Caller::Anonymous(), reg, &registered));
  out->profile_id = registered.profile_id();
  out->put = [service, profile_id = registered.profile_id(), shape](uint32_t b) {
    v1::PutRequest put;
    put.set_namespace_name("z");
    put.set_profile_id(profile_id);
    v1::PutBlock* block = put.add_blocks();
    block->set_key(std::string(32, static_cast<char>('k' + b)));
    std::string data(shape.RawBytes(), '\0');
    ASSERT_OK((*kv)->ExtractBlock(b * kTokens, kTokens,
                                  std::as_writable_bytes(std::span(data.data(), data.size()))));
    block->set_data(std::move(data));
    v1::PutResponse response;
    ASSERT_OK(service->Put(Caller::Anonymous(), put, &response));
    ASSERT_EQ(response.outcomes(0), v1::PUT_OUTCOME_STORED) << b;
  };
}

TEST(NamespaceLimitCompressionTest, ACompressingNamespaceEncodesItsOwnBlocksBeforeEvicting) {
  LimitedCompressedService c;
  ASSERT_NO_FATAL_FAILURE(MakeLimitedCompressedService(&c));
  BlockStore& store = c.service->store();
  for (uint32_t b = 0; b < 7; ++b) {
    ASSERT_NO_FATAL_FAILURE(c.put(b));
    EXPECT_LE(store.namespace_bytes(0), c.config.namespaces[0].max_bytes) << b;
    if (b == 5) {
      // Six where four fit raw: five at int8 (199,728 bytes each), the newest raw; none evicted.
      EXPECT_EQ(store.blocks(), 6u);
      EXPECT_EQ(store.level_blocks(1), 5u);
    }
  }
  // The seventh: the sixth encoded too, still over, so the oldest (key 'k') goes.
  EXPECT_EQ(store.blocks(), 6u);
  EXPECT_FALSE(store.Contains(BlockKeyed(c, 'k')));
  EXPECT_TRUE(store.Contains(BlockKeyed(c, 'k' + 6)));
}

// The background tierer encodes a namespace with max_bytes ahead of its puts, as it does the
// tier: once the namespace's own bytes pass its pressure threshold's share of its limit.
// A compressing service with its background tierer on, a pressure threshold of half the limit,
// and two raw blocks: half the limit, not over it, so 200 ms (20 of the tierer's checks) encode
// none.
void MakeServiceWithTwoBlocksAtHalfItsLimit(LimitedCompressedService* c) {
  ASSERT_NO_FATAL_FAILURE(MakeLimitedCompressedService(c, /*background=*/true, 0.5));
  ASSERT_NO_FATAL_FAILURE(c->put(0));
  ASSERT_NO_FATAL_FAILURE(c->put(1));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(c->service->store().level_blocks(1), 0u);
}

// Waits up to 20 s for the background tierer to have encoded `n` blocks to level 1.
size_t AwaitLevelOneBlocks(const BlockStore& store, size_t n) {
  for (absl::Time end = absl::Now() + absl::Seconds(20);
       store.level_blocks(1) < n && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return store.level_blocks(1);
}

TEST(NamespaceLimitCompressionTest, TheTiererKeepsANamespaceUnderItsThresholdOfItsLimit) {
  LimitedCompressedService c;
  ASSERT_NO_FATAL_FAILURE(MakeServiceWithTwoBlocksAtHalfItsLimit(&c));
  BlockStore& store = c.service->store();
  ASSERT_NO_FATAL_FAILURE(c.put(2));  // 0.75 of the limit; the tier is at 7% of its capacity
  // Each int8 encoding saves 168,912 bytes: all three go under half the limit (737,280 bytes).
  EXPECT_EQ(AwaitLevelOneBlocks(store, 3), 3u);
  EXPECT_LE(store.namespace_bytes(0), c.config.namespaces[0].max_bytes / 2);
}

// A limit lowered while running (SIGHUP) also moves the tierer's own pressure for the namespace:
// blocks within the new limit but past its threshold's share of it are encoded ahead of puts.
TEST(NamespaceLimitCompressionTest, ALoweredLimitMovesTheTierersThresholdToo) {
  LimitedCompressedService c;
  ASSERT_NO_FATAL_FAILURE(MakeServiceWithTwoBlocksAtHalfItsLimit(&c));
  BlockStore& store = c.service->store();
  const uint64_t raw = c.config.namespaces[0].max_bytes / 4;
  // Three raw blocks: the two stored are within it (no room to make, nothing encoded for it) but
  // past half of it, so the tierer encodes them in the background.
  EXPECT_TRUE(c.service->SetNamespaceLimit(0, 3 * raw));
  EXPECT_EQ(AwaitLevelOneBlocks(store, 2), 2u);
  EXPECT_LE(store.namespace_bytes(0), 3 * raw / 2);
  EXPECT_EQ(store.blocks(), 2u);
}

}  // namespace
}  // namespace proxima::daemon
