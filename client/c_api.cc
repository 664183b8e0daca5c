// The C ABI (proxima.h) over proxima::client::Client.

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/proxima.h"

struct proxima_client {
  std::unique_ptr<proxima::client::Client> client;
  // Profiles by id, so calls can pass just the id across the C boundary.
  proxima::Mutex mu;
  absl::flat_hash_map<uint64_t, proxima::client::Profile> profiles ABSL_GUARDED_BY(mu);
};

namespace {

thread_local std::string g_last_error;

proxima_status Fail(const absl::Status& status) {
  g_last_error = std::string(status.message());
  return static_cast<int>(status.code());
}

proxima_status Fail(absl::StatusCode code, std::string message) {
  return Fail(absl::Status(code, message));
}

std::vector<proxima::client::BlockKey> Keys(size_t n, const uint8_t* keys) {
  std::vector<proxima::client::BlockKey> out(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(out[i].data(), keys + i * PROXIMA_KEY_BYTES, 32);
  return out;
}

// Finds the profile `id` registered through this handle.
bool FindProfile(proxima_client* c, uint64_t id, proxima::client::Profile* out) {
  proxima::MutexLock lock(&c->mu);
  auto it = c->profiles.find(id);
  if (it == c->profiles.end()) return false;
  *out = it->second;
  return true;
}

#define PROXIMA_C_REQUIRE(cond, what)                                   \
  do {                                                                  \
    if (!(cond)) return Fail(absl::StatusCode::kInvalidArgument, what); \
  } while (0)

#define PROXIMA_C_PROFILE(c, id, profile)                                                     \
  proxima::client::Profile profile;                                                           \
  if (!FindProfile(c, id, &profile)) {                                                        \
    return Fail(absl::StatusCode::kNotFound,                                                  \
                "profile " + std::to_string(id) + " was not registered through this client"); \
  }

}  // namespace

extern "C" {

int proxima_abi_version(void) { return PROXIMA_ABI_VERSION; }

const char* proxima_last_error(void) { return g_last_error.c_str(); }

proxima_status proxima_connect(const char* target, const char* namespace_name,
                               int64_t connect_timeout_ms, int64_t call_timeout_ms,
                               proxima_client** client_out) {
  proxima_connect_options options = {};
  options.size = sizeof(options);
  options.target = target;
  options.namespace_name = namespace_name;
  options.connect_timeout_ms = connect_timeout_ms;
  options.call_timeout_ms = call_timeout_ms;
  return proxima_connect_with(&options, client_out);
}

proxima_status proxima_connect_with(const proxima_connect_options* o, proxima_client** client_out) {
  PROXIMA_C_REQUIRE(o != nullptr && o->target != nullptr && client_out != nullptr,
                    "options, options->target and client_out are required");
  // The struct only grows: a caller built against the first version (without `transport`) passes
  // a smaller size, and the fields it does not have read as zero (their defaults).
  constexpr size_t kFirstVersionSize = offsetof(proxima_connect_options, transport);
  PROXIMA_C_REQUIRE(o->size >= kFirstVersionSize,
                    "options->size is " + std::to_string(o->size) + "; expected sizeof(" +
                        "proxima_connect_options) = " +
                        std::to_string(sizeof(proxima_connect_options)));
  // Read as the integer a C caller may have stored there: a value outside the enum must reach the
  // error below, and loading it as the enum type would be undefined behaviour.
  int transport = PROXIMA_TRANSPORT_AUTO;
  // Each later field is read only when the caller's struct has it (`size`).
  auto has = [o](size_t offset, size_t bytes) { return o->size >= offset + bytes; };
  if (has(offsetof(proxima_connect_options, transport), sizeof(o->transport))) {
    static_assert(sizeof(o->transport) == sizeof(int));
    std::memcpy(&transport, &o->transport, sizeof(transport));
  }
  auto str = [](const char* s) { return s == nullptr ? std::string() : std::string(s); };
  proxima::client::ClientOptions options;
  options.target = o->target;
  if (o->namespace_name != nullptr) options.namespace_name = o->namespace_name;
  options.token = str(o->token);
  options.tls_ca_file = str(o->tls_ca_file);
  options.tls_cert_file = str(o->tls_cert_file);
  options.tls_key_file = str(o->tls_key_file);
  options.tls_server_name = str(o->tls_server_name);
  if (has(offsetof(proxima_connect_options, token_file), sizeof(o->token_file))) {
    options.token_file = str(o->token_file);
  }
  switch (transport) {
    case PROXIMA_TRANSPORT_AUTO:
      options.transport = proxima::client::Transport::kAuto;
      break;
    case PROXIMA_TRANSPORT_UCX:
      options.transport = proxima::client::Transport::kUcx;
      break;
    case PROXIMA_TRANSPORT_INLINE:
      options.transport = proxima::client::Transport::kInline;
      break;
    default:
      return Fail(absl::StatusCode::kInvalidArgument,
                  "options->transport is " + std::to_string(transport) +
                      "; expected PROXIMA_TRANSPORT_AUTO (0), _UCX (1) or _INLINE (2)");
  }
  if (o->connect_timeout_ms > 0) {
    options.connect_timeout = absl::Milliseconds(o->connect_timeout_ms);
  }
  if (o->call_timeout_ms > 0) options.call_timeout = absl::Milliseconds(o->call_timeout_ms);
  auto client = proxima::client::Client::Connect(options);
  if (!client.ok()) return Fail(client.status());
  auto* handle = new proxima_client();
  handle->client = *std::move(client);
  *client_out = handle;
  return PROXIMA_OK;
}

void proxima_close(proxima_client* client) { delete client; }

struct proxima_memory_region {
  proxima::client::MemoryRegion region;
};

proxima_status proxima_transport_in_use(proxima_client* c, proxima_transport* transport_out) {
  PROXIMA_C_REQUIRE(c != nullptr && transport_out != nullptr,
                    "client and transport_out are required");
  *transport_out = c->client->transport() == proxima::client::Transport::kUcx
                       ? PROXIMA_TRANSPORT_UCX
                       : PROXIMA_TRANSPORT_INLINE;
  return PROXIMA_OK;
}

proxima_status proxima_register_memory(proxima_client* c, void* data, size_t size,
                                       proxima_memory_region** region_out) {
  PROXIMA_C_REQUIRE(c != nullptr && data != nullptr && size > 0 && region_out != nullptr,
                    "client, data, size > 0 and region_out are required");
  auto region = c->client->RegisterMemory(data, size);
  if (!region.ok()) return Fail(region.status());
  *region_out = new proxima_memory_region{*std::move(region)};
  return PROXIMA_OK;
}

void proxima_deregister_memory(proxima_memory_region* region) { delete region; }

proxima_status proxima_register_profile(proxima_client* c, const proxima_model_profile* p,
                                        uint64_t* profile_id_out, uint64_t* block_bytes_out) {
  PROXIMA_C_REQUIRE(c != nullptr && p != nullptr, "client and profile are required");
  proxima::v1::ModelProfile profile;
  profile.set_num_layers(p->num_layers);
  profile.set_num_kv_heads(p->num_kv_heads);
  profile.set_head_dim(p->head_dim);
  profile.set_tokens_per_block(p->tokens_per_block);
  profile.set_dtype(static_cast<proxima::v1::DType>(p->dtype));
  if (p->fingerprint != nullptr) profile.set_fingerprint(p->fingerprint);
  auto registered = c->client->RegisterProfile(profile);
  if (!registered.ok()) return Fail(registered.status());
  {
    proxima::MutexLock lock(&c->mu);
    c->profiles[registered->id] = *registered;
  }
  if (profile_id_out != nullptr) *profile_id_out = registered->id;
  if (block_bytes_out != nullptr) *block_bytes_out = registered->block_bytes;
  return PROXIMA_OK;
}

proxima_status proxima_put(proxima_client* c, uint64_t profile_id, size_t n, const uint8_t* keys,
                           const void* const* blocks, int32_t* outcomes_out) {
  PROXIMA_C_REQUIRE(c != nullptr && (n == 0 || (keys != nullptr && blocks != nullptr)),
                    "client, keys and blocks are required");
  PROXIMA_C_PROFILE(c, profile_id, profile);
  std::vector<proxima::client::BlockKey> k = Keys(n, keys);
  std::vector<std::span<const std::byte>> spans;
  for (size_t i = 0; i < n; ++i) {
    PROXIMA_C_REQUIRE(blocks[i] != nullptr, "blocks[" + std::to_string(i) + "] is NULL");
    spans.emplace_back(static_cast<const std::byte*>(blocks[i]), profile.block_bytes);
  }
  auto outcomes = c->client->Put(profile, k, spans);
  if (!outcomes.ok()) return Fail(outcomes.status());
  if (outcomes_out != nullptr) {
    for (size_t i = 0; i < n; ++i) {
      outcomes_out[i] = (*outcomes)[i] == proxima::client::PutOutcome::kStored
                            ? PROXIMA_PUT_STORED
                        : (*outcomes)[i] == proxima::client::PutOutcome::kAlreadyPresent
                            ? PROXIMA_PUT_ALREADY_PRESENT
                            : PROXIMA_PUT_NO_SPACE;
    }
  }
  return PROXIMA_OK;
}

proxima_status proxima_get(proxima_client* c, uint64_t profile_id, size_t n, const uint8_t* keys,
                           void* const* out, uint8_t* found_out) {
  PROXIMA_C_REQUIRE(c != nullptr && (n == 0 || (keys != nullptr && out != nullptr &&
                                                found_out != nullptr)),
                    "client, keys, out and found_out are required");
  PROXIMA_C_PROFILE(c, profile_id, profile);
  std::vector<proxima::client::BlockKey> k = Keys(n, keys);
  std::vector<std::span<std::byte>> spans;
  for (size_t i = 0; i < n; ++i) {
    PROXIMA_C_REQUIRE(out[i] != nullptr, "out[" + std::to_string(i) + "] is NULL");
    spans.emplace_back(static_cast<std::byte*>(out[i]), profile.block_bytes);
  }
  auto found = c->client->Get(profile, k, spans);
  if (!found.ok()) return Fail(found.status());
  for (size_t i = 0; i < n; ++i) found_out[i] = (*found)[i] ? 1 : 0;
  return PROXIMA_OK;
}

proxima_status proxima_lookup(proxima_client* c, uint64_t profile_id, size_t n,
                              const uint8_t* keys, size_t* num_present_out) {
  PROXIMA_C_REQUIRE(c != nullptr && num_present_out != nullptr && (n == 0 || keys != nullptr),
                    "client, keys and num_present_out are required");
  PROXIMA_C_PROFILE(c, profile_id, profile);
  auto present = c->client->Lookup(profile, Keys(n, keys));
  if (!present.ok()) return Fail(present.status());
  *num_present_out = *present;
  return PROXIMA_OK;
}

proxima_status proxima_delete(proxima_client* c, uint64_t profile_id, size_t n,
                              const uint8_t* keys, size_t* num_deleted_out) {
  PROXIMA_C_REQUIRE(c != nullptr && (n == 0 || keys != nullptr), "client and keys are required");
  PROXIMA_C_PROFILE(c, profile_id, profile);
  auto deleted = c->client->Delete(profile, Keys(n, keys));
  if (!deleted.ok()) return Fail(deleted.status());
  if (num_deleted_out != nullptr) *num_deleted_out = *deleted;
  return PROXIMA_OK;
}

proxima_status proxima_stats_json(proxima_client* c, char** json_out) {
  PROXIMA_C_REQUIRE(c != nullptr && json_out != nullptr, "client and json_out are required");
  auto stats = c->client->Stats();
  if (!stats.ok()) return Fail(stats.status());
  auto json_or = proxima::client::StatsToJson(*stats);
  if (!json_or.ok()) return Fail(json_or.status());
  const std::string& json = *json_or;
  char* out = static_cast<char*>(std::malloc(json.size() + 1));
  if (out == nullptr) return Fail(absl::StatusCode::kResourceExhausted, "out of memory");
  std::memcpy(out, json.c_str(), json.size() + 1);
  *json_out = out;
  return PROXIMA_OK;
}

void proxima_free_string(char* s) { std::free(s); }

}  // extern "C"
