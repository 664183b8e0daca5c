// The model profile of unit tests, fuzz targets and their seeds: small enough that a block is a
// few hundred bytes (2 layers x 2 KV heads x head_dim 8 x 4 tokens x bf16 x K and V = 512 bytes),
// and encodable by every STAR-KV codec. Targets that include it link proxima_proto.
#ifndef PROXIMA_COMMON_TESTING_TINY_PROFILE_H_
#define PROXIMA_COMMON_TESTING_TINY_PROFILE_H_

#include <cstdint>
#include <string>

#include "proxima/v1/kvtier.pb.h"

namespace proxima::testing {

inline constexpr uint64_t kTinyBlockBytes = 512;

inline v1::ModelProfile TinyProfile(const std::string& fingerprint) {
  v1::ModelProfile p;
  p.set_num_layers(2);
  p.set_num_kv_heads(2);
  p.set_head_dim(8);
  p.set_tokens_per_block(4);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_fingerprint(fingerprint);
  return p;
}

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_TINY_PROFILE_H_
