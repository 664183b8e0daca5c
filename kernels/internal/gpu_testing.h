// Test helper for the kernels' GPU tests: skip (printing why) when no CUDA device is visible, so
// the same test binaries pass on the CPU-only build machines and run for real on a GPU one
// (scripts/gpu-check.sh).
#ifndef PROXIMA_KERNELS_INTERNAL_GPU_TESTING_H_
#define PROXIMA_KERNELS_INTERNAL_GPU_TESTING_H_

#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "kernels/device.h"

#define PROXIMA_SKIP_WITHOUT_GPU()                                        \
  do {                                                                    \
    std::string why;                                                      \
    if (::proxima::gpu::VisibleDevices(&why).empty()) {                   \
      std::printf("skipped: no CUDA device visible (%s)\n", why.c_str()); \
      GTEST_SKIP() << why;                                                \
    }                                                                     \
  } while (0)

#endif  // PROXIMA_KERNELS_INTERNAL_GPU_TESTING_H_
