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

// The scores of probe `q` against every token t < T of K and K' (rows `stride` apart, D dims):
// s[t] = sum_d q[d] K[t][d], s2[t] the same over K'. Four tokens at a time, so that eight
// independent sums overlap in the CPU; each sum adds its terms in dim order, as one loop would.
void Scores(const double* q, const double* k, const double* k2, size_t stride, uint32_t T,
            uint32_t D, double* s, double* s2) {
  uint32_t t = 0;
  for (; t + 4 <= T; t += 4) {
    const double *a0 = k + t * stride, *a1 = a0 + stride, *a2 = a1 + stride, *a3 = a2 + stride;
    const double *b0 = k2 + t * stride, *b1 = b0 + stride, *b2 = b1 + stride, *b3 = b2 + stride;
    double x0 = 0, x1 = 0, x2 = 0, x3 = 0, y0 = 0, y1 = 0, y2 = 0, y3 = 0;
    for (uint32_t d = 0; d < D; ++d) {
      x0 += q[d] * a0[d];
      x1 += q[d] * a1[d];
      x2 += q[d] * a2[d];
      x3 += q[d] * a3[d];
      y0 += q[d] * b0[d];
      y1 += q[d] * b1[d];
      y2 += q[d] * b2[d];
      y3 += q[d] * b3[d];
    }
    s[t] = x0, s[t + 1] = x1, s[t + 2] = x2, s[t + 3] = x3;
    s2[t] = y0, s2[t + 1] = y1, s2[t + 2] = y2, s2[t + 3] = y3;
  }
  for (; t < T; ++t) {
    double x = 0, y = 0;
    for (uint32_t d = 0; d < D; ++d) {
      x += q[d] * k[t * stride + d];
      y += q[d] * k2[t * stride + d];
    }
    s[t] = x, s2[t] = y;
  }
}

// The unnormalised outputs o[d] = sum_t p[t] V[t][d] and o2 over p2, V' (rows `stride` apart).
// Four dims at a time, each sum adding its terms in token order, as one loop would.
void Outputs(const double* p, const double* p2, const double* v, const double* v2, size_t stride,
             uint32_t T, uint32_t D, double* o, double* o2) {
  uint32_t d = 0;
  for (; d + 4 <= D; d += 4) {
    double x0 = 0, x1 = 0, x2 = 0, x3 = 0, y0 = 0, y1 = 0, y2 = 0, y3 = 0;
    for (uint32_t t = 0; t < T; ++t) {
      const double* a = v + t * stride + d;
      const double* b = v2 + t * stride + d;
      x0 += p[t] * a[0];
      x1 += p[t] * a[1];
      x2 += p[t] * a[2];
      x3 += p[t] * a[3];
      y0 += p2[t] * b[0];
      y1 += p2[t] * b[1];
      y2 += p2[t] * b[2];
      y3 += p2[t] * b[3];
    }
    o[d] = x0, o[d + 1] = x1, o[d + 2] = x2, o[d + 3] = x3;
    o2[d] = y0, o2[d + 1] = y1, o2[d + 2] = y2, o2[d + 3] = y3;
  }
  for (; d < D; ++d) {
    double x = 0, y = 0;
    for (uint32_t t = 0; t < T; ++t) {
      x += p[t] * v[t * stride + d];
      y += p2[t] * v2[t * stride + d];
    }
    o[d] = x, o2[d] = y;
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
  std::vector<double> k, v, k2, v2, p(T), p2(T), o(D), o2(D);
  // Scores() and Outputs() run independent sums side by side; each sum adds its terms in the
  // order of the plain nested loops, so the results are bit for bit theirs (and tools/eval's).
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const size_t k_off = (2 * size_t{l}) * seg_bytes, v_off = k_off + seg_bytes;
    ToDouble(dt, original.data() + k_off, n, &k);
    ToDouble(dt, original.data() + v_off, n, &v);
    ToDouble(dt, reconstructed.data() + k_off, n, &k2);
    ToDouble(dt, reconstructed.data() + v_off, n, &v2);
    // Running sums in locals (the compiler cannot keep members of `sums` in registers across
    // stores through the vectors' pointers); the same additions in the same order.
    double k_err = sums.k_err, k_ref = sums.k_ref, v_err = sums.v_err, v_ref = sums.v_ref;
    for (size_t i = 0; i < n; ++i) {
      k_err += (k2[i] - k[i]) * (k2[i] - k[i]);
      k_ref += k[i] * k[i];
      v_err += (v2[i] - v[i]) * (v2[i] - v[i]);
      v_ref += v[i] * v[i];
    }
    sums.k_err = k_err, sums.k_ref = k_ref, sums.v_err = v_err, sums.v_ref = v_ref;
    for (uint32_t h = 0; h < H; ++h) {
      auto at = [&](uint32_t t) { return (size_t{t} * H + h) * D; };
      for (uint32_t j = 0; j < P; ++j) {
        const double* q = &k[at(static_cast<uint32_t>(uint64_t{j} * T / P))];
        Scores(q, k.data() + at(0), k2.data() + at(0), size_t{H} * D, T, D, p.data(), p2.data());
        double m = -std::numeric_limits<double>::infinity(), m2 = m;
        for (uint32_t t = 0; t < T; ++t) {
          p[t] *= inv_sqrt_d;
          p2[t] *= inv_sqrt_d;
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
        Outputs(p.data(), p2.data(), v.data() + at(0), v2.data() + at(0), size_t{H} * D, T, D,
                o.data(), o2.data());
        for (uint32_t d = 0; d < D; ++d) {
          const double od = o[d] / z, o2d = o2[d] / z2;
          sums.attn_err += (o2d - od) * (o2d - od);
          sums.attn_ref += od * od;
        }
      }
    }
  }
  return sums;
}

}  // namespace proxima::codec
