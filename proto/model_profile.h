// The model profile (proxima.v1.ModelProfile) of a codec block geometry: what the replay tool and
// the benchmarks that register real KV (tierer_bench, gpu_tier_bench) send for the blocks they
// cut from a KV dump.
#ifndef PROXIMA_PROTO_MODEL_PROFILE_H_
#define PROXIMA_PROTO_MODEL_PROFILE_H_

#include "kernels/codec.h"
#include "proxima/v1/kvtier.pb.h"

namespace proxima {

// `geometry` as a proxima.v1.ModelProfile (no fingerprint).
inline v1::ModelProfile ProfileOf(const codec::BlockGeometry& geometry) {
  v1::ModelProfile p;
  p.set_num_layers(geometry.num_layers);
  p.set_num_kv_heads(geometry.num_kv_heads);
  p.set_head_dim(geometry.head_dim);
  p.set_tokens_per_block(geometry.tokens_per_block);
  p.set_dtype(geometry.dtype == codec::DType::kFp16 ? v1::DTYPE_FP16 : v1::DTYPE_BF16);
  return p;
}

}  // namespace proxima

#endif  // PROXIMA_PROTO_MODEL_PROFILE_H_
