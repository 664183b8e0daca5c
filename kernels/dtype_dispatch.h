// The one place that turns a run-time dtype code into a compile-time constant for templated
// kernels and loops. The switch ends in an error default so a new dtype cannot fall through
// silently: `on_error` (a statement, e.g. `return cudaErrorInvalidValue;`) runs instead.
// Used by the CUDA launchers and the AVX2 path. Thread-safety: a macro, no state.
//
//   PROXIMA_DISPATCH_DTYPE(dtype, kDt, return cudaErrorInvalidValue, {
//     MyKernel<kDt><<<grid, block, 0, stream>>>(...);
//   });
#ifndef PROXIMA_KERNELS_DTYPE_DISPATCH_H_
#define PROXIMA_KERNELS_DTYPE_DISPATCH_H_

#include <cstdint>

#define PROXIMA_DISPATCH_DTYPE(dtype, kDt, on_error, ...) \
  switch (static_cast<uint8_t>(dtype)) {                  \
    case 1: {                                             \
      constexpr uint8_t kDt = 1; /* fp16 */               \
      __VA_ARGS__;                                        \
      break;                                              \
    }                                                     \
    case 2: {                                             \
      constexpr uint8_t kDt = 2; /* bf16 */               \
      __VA_ARGS__;                                        \
      break;                                              \
    }                                                     \
    default:                                              \
      on_error;                                           \
  }

#endif  // PROXIMA_KERNELS_DTYPE_DISPATCH_H_
