// The body of the request fuzz target, shared by the libFuzzer harness and by the unit test that
// replays the checked-in corpus (tests/fuzz/corpus/request) in ordinary builds.
//
// Input: one byte choosing the method, one byte choosing the caller, then the request message
// in proto3 wire format. The message is handled in process exactly as proximad's gRPC layer
// handles it (daemon/grpc_service.h: the Serve* functions for Put, Get, Lookup, Delete and
// Decompress; the parsed message into TierService for the others), by one TierService that lives
// across inputs and so accumulates blocks. Checked besides "no crash, no sanitizer report":
//  - tenant isolation: a call that succeeds acted in a namespace its caller may use (anonymous
//    callers only in the open namespace, token holders only in their own), and a read-only
//    token never succeeds in writing;
//  - namespace "t" never holds more than its max_bytes (1 MiB of the 4 MiB tier);
//  - every error carries a message.
// Thread-compatible (one fuzzing thread).
#ifndef PROXIMA_TESTS_FUZZ_REQUEST_FUZZ_BODY_H_
#define PROXIMA_TESTS_FUZZ_REQUEST_FUZZ_BODY_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "daemon/grpc_service.h"
#include "daemon/tier_service.h"
#include "proto/wire.h"

namespace proxima::daemon::fuzz {

enum RequestMethod : uint8_t {
  kFuzzGetServerInfo, kFuzzRegisterProfile, kFuzzPut, kFuzzGet, kFuzzLookup, kFuzzDelete,
  kFuzzStats, kFuzzDecompress, kFuzzMethods
};

// Callers: 0 anonymous, 1 read-write token of "t", 2 read-only token of "t", 3 token of "p"
// (private_prefixes), 4 a token no namespace has.
inline constexpr int kFuzzCallers = 5;
inline constexpr const char* kFuzzTokens[kFuzzCallers] = {
    "", "Bearer fuzz-token-t-read-write-0001", "Bearer fuzz-token-t-read-only-00002",
    "Bearer fuzz-token-p-private-0000003", "Bearer fuzz-token-nobody-has-this-4"};

// namespaces[].max_bytes of "t" (a quarter of the tier).
inline constexpr uint64_t kFuzzLimitedBytes = 1 << 20;

inline TierService& FuzzService() {
  static TierService* service = [] {
    setenv("PROXIMA_FUZZ_TOKEN_T_RW", kFuzzTokens[1] + 7, 1);
    setenv("PROXIMA_FUZZ_TOKEN_T_RO", kFuzzTokens[2] + 7, 1);
    setenv("PROXIMA_FUZZ_TOKEN_P", kFuzzTokens[3] + 7, 1);
    DaemonConfig config;
    config.host_tier.capacity_bytes = 4 << 20;
    config.server.max_message_bytes = 1 << 20;
    config.server.max_batch_blocks = 8;
    config.server.max_lookup_keys = 64;
    config.server.max_profiles_per_namespace = 4;
    config.namespaces = {
        {"open"},
        {"t",
         {{"rw", "", "PROXIMA_FUZZ_TOKEN_T_RW", TokenAccess::kReadWrite, ""},
          {"ro", "", "PROXIMA_FUZZ_TOKEN_T_RO", TokenAccess::kReadOnly, ""}}},
        {"p", {{"w", "", "PROXIMA_FUZZ_TOKEN_P", TokenAccess::kReadWrite, ""}}, true}};
    config.namespaces[1].max_bytes = kFuzzLimitedBytes;
    static metrics::Registry registry;
    absl::StatusOr<std::unique_ptr<TierService>> s = TierService::Create(config, &registry);
    if (!s.ok()) std::abort();
    return s->release();
  }();
  return *service;
}

// The namespace a request names, read the way the daemon reads it (empty when unparsable).
inline std::string NamespaceOf(RequestMethod method, const grpc::ByteBuffer& request,
                               const std::string& raw) {
  if (method == kFuzzPut) {
    wire::PutRequestReader reader;
    return reader.Parse(request, 1 << 20).ok() ? reader.namespace_name() : "";
  }
  if (method == kFuzzGet || method == kFuzzLookup || method == kFuzzDelete ||
      method == kFuzzDecompress) {
    wire::KeyedRequest keyed;
    return wire::ParseKeyedRequest(request, 1 << 20, "fuzz", &keyed).ok() ? keyed.namespace_name
                                                                          : "";
  }
  v1::RegisterProfileRequest r;
  return r.ParseFromString(raw) ? r.namespace_name() : "";
}

// Handles one input; returns true when the call succeeded.
inline bool RunRequestInput(const uint8_t* data, size_t size) {
  if (size < 2) return false;
  const auto method = static_cast<RequestMethod>(data[0] % kFuzzMethods);
  const int caller_index = data[1] % kFuzzCallers;
  const std::string raw(reinterpret_cast<const char*>(data + 2), size - 2);
  TierService& core = FuzzService();
  absl::StatusOr<Caller> caller = core.Authenticate(kFuzzTokens[caller_index]);
  if (!caller.ok()) {
    if (caller_index != 4 || caller.status().code() != absl::StatusCode::kUnauthenticated) {
      std::abort();
    }
    return false;
  }
  if (caller_index == 4) std::abort();  // an unknown token was accepted

  grpc::Slice slice(raw.data(), raw.size());
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Status status;
  switch (method) {
    case kFuzzPut:
      status = ServePut(core, *caller, request, &response);
      break;
    case kFuzzGet:
      status = ServeGet(core, *caller, request, &response);
      break;
    case kFuzzLookup:
      status = ServeLookup(core, *caller, request, &response);
      break;
    case kFuzzDelete:
      status = ServeDelete(core, *caller, request, &response);
      break;
    case kFuzzDecompress:
      status = ServeDecompress(core, *caller, request, &response);
      break;
    case kFuzzGetServerInfo: {
      v1::GetServerInfoRequest req;
      v1::GetServerInfoResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = core.GetServerInfo(*caller, req, &resp);
      break;
    }
    case kFuzzRegisterProfile: {
      v1::RegisterProfileRequest req;
      v1::RegisterProfileResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = core.RegisterProfile(*caller, req, &resp);
      break;
    }
    case kFuzzStats: {
      v1::StatsRequest req;
      v1::StatsResponse resp;
      if (!req.ParseFromString(raw)) return false;
      status = core.Stats(*caller, req, &resp);
      // Stats shows the caller's namespaces only, and no tier totals.
      for (const v1::NamespaceStats& n : resp.namespaces()) {
        const std::string allowed = caller_index == 0 ? "open" : caller_index == 3 ? "p" : "t";
        if (n.name() != allowed) std::abort();
      }
      if (resp.tiers_size() != 0) std::abort();
      break;
    }
    case kFuzzMethods:
      std::abort();
  }
  // "t" never holds more than its max_bytes once a call returns (calls here run one at a time).
  if (FuzzService().store().namespace_bytes(1) > kFuzzLimitedBytes) std::abort();
  if (!status.ok()) {
    if (status.message().empty()) std::abort();
    return false;
  }
  if (method == kFuzzGetServerInfo || method == kFuzzStats) return true;
  const std::string ns = NamespaceOf(method, request, raw);
  const bool writes = method == kFuzzPut || method == kFuzzDelete;
  const bool allowed = caller_index == 0   ? ns == "open"
                       : caller_index == 3 ? ns == "p"
                                           : ns == "t" && !(caller_index == 2 && writes);
  if (!allowed) std::abort();  // isolation broken: a call acted where its caller may not
  return true;
}

}  // namespace proxima::daemon::fuzz

#endif  // PROXIMA_TESTS_FUZZ_REQUEST_FUZZ_BODY_H_
