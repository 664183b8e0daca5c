// The one definition of "how wrong is a decoded block", shared by the codec tests, the codec
// benchmark, the daemon's quality guard and tools/eval (which must compute the same numbers):
//
//   K error  = sqrt( sum (K' - K)^2 / sum K^2 )   over all layers, tokens, heads, dims
//   V error  = the same for V
//   attention-output error = sqrt( sum ||o' - o||^2 / sum ||o||^2 ), where for every layer l,
//     kv head h and probe j = 0..P-1 (P = min(num_probes, T)), the probe query is the original
//     key of token t_j = floor(j * T / P): q = K[l][t_j][h], and
//     o  = sum_t softmax_t(q . K[l][t][h]  / sqrt(D)) V[l][t][h]
//     o' = sum_t softmax_t(q . K'[l][t][h] / sqrt(D)) V'[l][t][h]
//     (the same q for both: the probe asks what attention over the stored block returns).
// Sums are in double; non-finite elements count as 0 on both sides. Probes come from the block
// itself so the measure needs no model and no random numbers, and a Python port is exact.
//
// Thread-safety: pure functions; ErrorSums is a plain value (merge per-thread sums with Add).
#ifndef PROXIMA_KERNELS_ERROR_METRICS_H_
#define PROXIMA_KERNELS_ERROR_METRICS_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace proxima::codec {

inline constexpr uint32_t kDefaultProbeQueries = 8;

// Squared-error and squared-reference sums, so blocks can be aggregated before the ratio.
struct ErrorSums {
  double k_err = 0, k_ref = 0;
  double v_err = 0, v_ref = 0;
  double attn_err = 0, attn_ref = 0;
  void Add(const ErrorSums& other);
};

struct ErrorFigures {
  double k_rel_l2 = 0;
  double v_rel_l2 = 0;
  double attn_rel_l2 = 0;
};

// The ratios above; 0 where the reference sum is 0 and the error is 0, +inf where only the
// reference is 0.
ErrorFigures Finish(const ErrorSums& sums);

// `original`, `reconstructed`: RawBytes() each, canonical block layout.
absl::StatusOr<ErrorSums> MeasureBlockError(const BlockGeometry& geometry,
                                            std::span<const std::byte> original,
                                            std::span<const std::byte> reconstructed,
                                            uint32_t num_probes = kDefaultProbeQueries);

}  // namespace proxima::codec

#endif  // PROXIMA_KERNELS_ERROR_METRICS_H_
