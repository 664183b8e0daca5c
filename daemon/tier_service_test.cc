#include "daemon/tier_service.h"

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace proxima::daemon {
namespace {

using ::proxima::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::ModelProfile SmallProfile() {
  v1::ModelProfile p;
  p.set_num_layers(2);
  p.set_num_kv_heads(2);
  p.set_head_dim(8);
  p.set_tokens_per_block(4);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_fingerprint("test-model tp=1/0");
  return p;
}

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
    ASSERT_OK(service_->RegisterProfile(req, &resp));
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
  ASSERT_OK(service_->Put(PutOf(2, 'x'), &put_resp));

  v1::PutRequest wrong_ns = PutOf(1, 'y');
  wrong_ns.set_namespace_name("zzz");
  EXPECT_THAT(service_->Put(wrong_ns, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'zzz'")));
  v1::PutRequest other_ns = PutOf(1, 'y');
  other_ns.set_namespace_name("b");  // profile registered only in "a"
  EXPECT_THAT(service_->Put(other_ns, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("namespace 'b'")));
  v1::PutRequest wrong_profile = PutOf(1, 'y');
  wrong_profile.set_profile_id(12345);
  EXPECT_THAT(service_->Put(wrong_profile, &put_resp),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("0x0000000000003039")));
  EXPECT_THAT(service_->Put(PutOf(0, 'y'), &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no blocks")));
  EXPECT_THAT(service_->Put(PutOf(5, 'y'), &put_resp),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 4")));
  v1::PutRequest short_key = PutOf(3, 'y');
  short_key.mutable_blocks(2)->set_key("short");
  EXPECT_THAT(service_->Put(short_key, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[2].key is 5 bytes"), HasSubstr("32"))));
  v1::PutRequest wrong_size = PutOf(2, 'y');
  wrong_size.mutable_blocks(1)->set_data("tiny");
  EXPECT_THAT(service_->Put(wrong_size, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[1].data is 4 bytes"), HasSubstr("needs 512 bytes"))));
  v1::PutRequest bad_crc = PutOf(1, 'y');
  bad_crc.mutable_blocks(0)->set_crc32c(1);
  EXPECT_THAT(service_->Put(bad_crc, &put_resp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("crc32c")));

  // Nothing above changed the two blocks stored first.
  v1::GetRequest get;
  get.set_namespace_name("a");
  get.set_profile_id(profile_id_);
  get.add_keys(std::string(32, 'A'));
  get.add_keys(std::string(32, 'B'));
  get.add_keys(std::string(32, 'C'));
  v1::GetResponse got;
  ASSERT_OK(service_->Get(get, &got));
  ASSERT_EQ(got.results_size(), 3);
  EXPECT_EQ(got.results(0).data(), std::string(block_bytes_, 'x'));
  EXPECT_EQ(got.results(1).data(), std::string(block_bytes_, 'x'));
  EXPECT_FALSE(got.results(2).found());
}

TEST_F(TierServiceTest, GetThatCannotFitOneMessageIsRefusedUpFront) {
  DaemonConfig config;
  config.host_tier.capacity_bytes = 8 << 20;
  config.server.max_message_bytes = 1 << 20;
  metrics::Registry registry;
  ASSERT_OK_AND_ASSIGN(auto service, TierService::Create(config, &registry));
  v1::RegisterProfileRequest reg;
  reg.set_namespace_name("default");
  *reg.mutable_profile() = SmallProfile();
  reg.mutable_profile()->set_tokens_per_block(256);  // 64 KiB blocks
  v1::RegisterProfileResponse reg_resp;
  ASSERT_OK(service->RegisterProfile(reg, &reg_resp));
  v1::GetRequest get;
  get.set_namespace_name("default");
  get.set_profile_id(reg_resp.profile_id());
  for (int i = 0; i < 40; ++i) get.add_keys(std::string(32, static_cast<char>(i)));
  v1::GetResponse resp;
  EXPECT_THAT(service->Get(get, &resp),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("at most 31 blocks")));
}

TEST_F(TierServiceTest, LookupCountsTheLeadingPresentKeys) {
  v1::PutResponse put_resp;
  ASSERT_OK(service_->Put(PutOf(3, 'x'), &put_resp));  // keys A, B, C
  auto lookup = [&](std::string chain) {
    v1::LookupRequest req;
    req.set_namespace_name("a");
    req.set_profile_id(profile_id_);
    for (char c : chain) req.add_keys(std::string(32, c));
    v1::LookupResponse resp;
    EXPECT_OK(service_->Lookup(req, &resp));
    return resp.num_prefix_present();
  };
  EXPECT_EQ(lookup("ABC"), 3u);
  EXPECT_EQ(lookup("ABCD"), 3u);
  EXPECT_EQ(lookup("AXC"), 1u);  // a gap ends the prefix even though C is present
  EXPECT_EQ(lookup("X"), 0u);
}

}  // namespace
}  // namespace proxima::daemon
