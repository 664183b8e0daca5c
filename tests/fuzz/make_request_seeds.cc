// Writes the seed corpus of the request fuzz target: valid requests of every method, for every
// caller of the harness (tests/fuzz/request_fuzz_body.h), in each namespace. Rerun when the API
// changes:
//   g++ -std=c++20 -I. -Ibuild/proto/gen tests/fuzz/make_request_seeds.cc \
//     build/proto/libproxima_proto.a $(pkg-config --libs protobuf grpc++) \
//     -o /tmp/make_request_seeds && /tmp/make_request_seeds tests/fuzz/corpus/request
#include <cstdio>
#include <fstream>
#include <string>

#include "proxima/v1/kvtier.pb.h"

namespace {

proxima::v1::ModelProfile SmallProfile() {  // 512-byte blocks: 2 x 4 x 2 x 8 x bf16 x (K, V)
  proxima::v1::ModelProfile p;
  p.set_num_layers(2);
  p.set_num_kv_heads(2);
  p.set_head_dim(8);
  p.set_tokens_per_block(4);
  p.set_dtype(proxima::v1::DTYPE_BF16);
  p.set_fingerprint("fuzz-model");
  return p;
}

// The daemon's profile id of SmallProfile() (FNV-1a, daemon/tier_service.cc ProfileId).
uint64_t SmallProfileId() {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const void* data, size_t n) {
    const auto* b = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  };
  const proxima::v1::ModelProfile p = SmallProfile();
  for (uint32_t v : {p.num_layers(), p.num_kv_heads(), p.head_dim(), p.tokens_per_block(),
                     static_cast<uint32_t>(p.dtype())}) {
    uint8_t le[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
                     static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
    mix(le, 4);
  }
  mix(p.fingerprint().data(), p.fingerprint().size());
  return h == 0 ? 1 : h;
}

int n = 0;
std::string dir;

void Write(int method, int caller, const google::protobuf::Message& m) {
  std::ofstream f(dir + "/seed_" + std::to_string(n++), std::ios::binary);
  f.put(static_cast<char>(method));
  f.put(static_cast<char>(caller));
  f << m.SerializeAsString();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  dir = argv[1];
  const uint64_t id = SmallProfileId();
  // Callers as in request_fuzz_body.h: 0 anonymous, 1 t read-write, 2 t read-only, 3 p.
  for (int caller = 0; caller < 4; ++caller) {
    const std::string ns = caller == 0 ? "open" : caller == 3 ? "p" : "t";
    for (const std::string& name : {ns, std::string(caller == 0 ? "t" : "open")}) {
      proxima::v1::RegisterProfileRequest reg;
      reg.set_namespace_name(name);
      *reg.mutable_profile() = SmallProfile();
      Write(1, caller, reg);
      proxima::v1::PutRequest put;
      put.set_namespace_name(name);
      put.set_profile_id(id);
      for (int b = 0; b < 2; ++b) {
        proxima::v1::PutBlock* block = put.add_blocks();
        block->set_key(std::string(32, static_cast<char>('a' + b)));
        block->set_data(std::string(512, static_cast<char>(b)));
      }
      Write(2, caller, put);
      proxima::v1::GetRequest get;
      get.set_namespace_name(name);
      get.set_profile_id(id);
      get.add_keys(std::string(32, 'a'));
      get.add_keys(std::string(32, 'z'));
      Write(3, caller, get);
      proxima::v1::LookupRequest lookup;
      lookup.set_namespace_name(name);
      lookup.set_profile_id(id);
      for (char k : {'a', 'b', 'c'}) lookup.add_keys(std::string(32, k));
      Write(4, caller, lookup);
      proxima::v1::DeleteRequest del;
      del.set_namespace_name(name);
      del.set_profile_id(id);
      del.add_keys(std::string(32, 'b'));
      Write(5, caller, del);
      proxima::v1::DecompressRequest decompress;
      decompress.set_namespace_name(name);
      decompress.set_profile_id(id);
      decompress.add_keys(std::string(32, 'a'));
      Write(7, caller, decompress);
    }
    Write(0, caller, proxima::v1::GetServerInfoRequest());
    Write(6, caller, proxima::v1::StatsRequest());
  }
  std::printf("wrote %d seeds\n", n);
  return 0;
}
