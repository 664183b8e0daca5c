// Writes the seed corpus of the request fuzz target: valid requests of every method, for every
// caller of the harness (tests/fuzz/request_fuzz_body.h), in each namespace. Rerun when the API
// changes:
//   ninja -C build make_request_seeds && build/tests/fuzz/make_request_seeds
//   tests/fuzz/corpus/request
#include <cstdio>
#include <fstream>
#include <string>

#include "daemon/tier_service.h"
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
  const uint64_t id = proxima::daemon::ProfileId(SmallProfile());
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
