// Run-time CPU feature checks for the SIMD paths. Compiled for the baseline ISA (never with the
// SIMD files' -m flags), so asking is safe on any x86-64 CPU.
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "kernels/internal/segment_codecs.h"

namespace proxima::codec::internal {
namespace {

// CPUID leaf 1 ECX.
constexpr uint32_t kOsxsave = 1u << 27;
constexpr uint32_t kF16c = 1u << 29;
// CPUID leaf 7 subleaf 0 EBX.
constexpr uint32_t kAvx512F = 1u << 16;
constexpr uint32_t kAvx512Bw = 1u << 30;
constexpr uint32_t kAvx512Vl = 1u << 31;
// XCR0 state components the OS must save for AVX-512: SSE (bit 1), AVX (bit 2), opmask (bit 5),
// the upper halves of zmm0-15 (bit 6) and zmm16-31 (bit 7).
constexpr uint64_t kXcr0Avx512 = (1u << 1) | (1u << 2) | (1u << 5) | (1u << 6) | (1u << 7);

}  // namespace

bool Avx512Usable(uint32_t leaf1_ecx, uint32_t leaf7_ebx, uint64_t xcr0) {
  if ((leaf1_ecx & kOsxsave) == 0 || (leaf1_ecx & kF16c) == 0) return false;
  constexpr uint32_t kAll = kAvx512F | kAvx512Bw | kAvx512Vl;
  if ((leaf7_ebx & kAll) != kAll) return false;
  return (xcr0 & kXcr0Avx512) == kXcr0Avx512;
}

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): not every compiler's __builtin_cpu_supports knows it.
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & kF16c) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return has;
#else
  return false;
#endif
}

bool CpuHasBmi2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("bmi2");
  }();
  return has;
#else
  return false;
#endif
}

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    if (!CpuHasAvx2()) return false;  // the AVX-512 path hands odd head_dims to the AVX2 path
    unsigned int eax = 0, ebx = 0, ecx1 = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx1, &edx)) return false;
    unsigned int ebx7 = 0, ecx7 = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx7, &ecx7, &edx)) return false;
    uint64_t xcr0 = 0;
    if ((ecx1 & kOsxsave) != 0) {
      // xgetbv with ECX = 0 reads XCR0; spelled as asm so this file needs no -mxsave.
      uint32_t lo = 0, hi = 0;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      xcr0 = (uint64_t{hi} << 32) | lo;
    }
    return Avx512Usable(ecx1, ebx7, xcr0);
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace proxima::codec::internal
