#include "kernels/error_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/status_macros.h"
#include "kernels/internal/numeric.h"
#include "kernels/internal/segment_codecs.h"

namespace proxima::codec {
namespace {

double Ratio(double err, double ref) {
  if (ref > 0) return std::sqrt(err / ref);
  return err > 0 ? std::numeric_limits<double>::infinity() : 0.0;
}

// The segment as doubles, non-finite values as 0.
void ToDouble(uint8_t dtype, const std::byte* p, size_t n, std::vector<double>* out) {
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    float x = numeric::DtypeToFloat(dtype, internal::Load16(p, i));
    (*out)[i] = numeric::IsFiniteFloat(x) ? x : 0.0;
  }
}

}  // namespace

void ErrorSums::Add(const ErrorSums& o) {
  k_err += o.k_err;
  k_ref += o.k_ref;
  v_err += o.v_err;
  v_ref += o.v_ref;
  attn_err += o.attn_err;
  attn_ref += o.attn_ref;
}

ErrorFigures Finish(const ErrorSums& s) {
  return {Ratio(s.k_err, s.k_ref), Ratio(s.v_err, s.v_ref), Ratio(s.attn_err, s.attn_ref)};
}

absl::StatusOr<ErrorSums> MeasureBlockError(const BlockGeometry& g,
                                            std::span<const std::byte> original,
                                            std::span<const std::byte> reconstructed,
                                            uint32_t num_probes) {
  PROXIMA_RETURN_IF_ERROR(g.Validate());
  if (original.size() != g.RawBytes() || reconstructed.size() != g.RawBytes()) {
    return absl::InvalidArgumentError("blocks do not match the geometry's raw size");
  }
  const uint32_t T = g.tokens_per_block, H = g.num_kv_heads, D = g.head_dim;
  const uint32_t P = std::max<uint32_t>(1, std::min(num_probes, T));
  const size_t n = g.SegmentElements(), seg_bytes = 2 * n;
  const uint8_t dt = static_cast<uint8_t>(g.dtype);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));
  ErrorSums sums;
  std::vector<double> k, v, k2, v2, p(T), p2(T);
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const size_t k_off = (2 * size_t{l}) * seg_bytes, v_off = k_off + seg_bytes;
    ToDouble(dt, original.data() + k_off, n, &k);
    ToDouble(dt, original.data() + v_off, n, &v);
    ToDouble(dt, reconstructed.data() + k_off, n, &k2);
    ToDouble(dt, reconstructed.data() + v_off, n, &v2);
    for (size_t i = 0; i < n; ++i) {
      sums.k_err += (k2[i] - k[i]) * (k2[i] - k[i]);
      sums.k_ref += k[i] * k[i];
      sums.v_err += (v2[i] - v[i]) * (v2[i] - v[i]);
      sums.v_ref += v[i] * v[i];
    }
    for (uint32_t h = 0; h < H; ++h) {
      auto at = [&](uint32_t t) { return (size_t{t} * H + h) * D; };
      for (uint32_t j = 0; j < P; ++j) {
        const double* q = &k[at(static_cast<uint32_t>(uint64_t{j} * T / P))];
        double m = -std::numeric_limits<double>::infinity(), m2 = m;
        for (uint32_t t = 0; t < T; ++t) {
          double s = 0, s2 = 0;
          for (uint32_t d = 0; d < D; ++d) {
            s += q[d] * k[at(t) + d];
            s2 += q[d] * k2[at(t) + d];
          }
          p[t] = s * inv_sqrt_d;
          p2[t] = s2 * inv_sqrt_d;
          m = std::max(m, p[t]);
          m2 = std::max(m2, p2[t]);
        }
        double z = 0, z2 = 0;
        for (uint32_t t = 0; t < T; ++t) {
          p[t] = std::exp(p[t] - m);
          p2[t] = std::exp(p2[t] - m2);
          z += p[t];
          z2 += p2[t];
        }
        for (uint32_t d = 0; d < D; ++d) {
          double o = 0, o2 = 0;
          for (uint32_t t = 0; t < T; ++t) {
            o += p[t] * v[at(t) + d];
            o2 += p2[t] * v2[at(t) + d];
          }
          o /= z;
          o2 /= z2;
          sums.attn_err += (o2 - o) * (o2 - o);
          sums.attn_ref += o * o;
        }
      }
    }
  }
  return sums;
}

}  // namespace proxima::codec
