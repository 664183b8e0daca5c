# Decides whether the CUDA kernels are built. AUTO: on when nvcc is found (in PATH, CUDACXX or
# /usr/local/cuda). Binaries built with CUDA still run without a GPU: they link the static CUDA
# runtime and fall back to the CPU path when no device is present.
set(PROXIMA_CUDA_ENABLED OFF)
if(NOT PROXIMA_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Short default list: every architecture multiplies kernel compile time. sm_90 covers H100/H200;
    # sm_80 covers A100 and (through PTX JIT) newer parts. Override with -DCMAKE_CUDA_ARCHITECTURES.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # CMake 3.25 cannot pass a C++20 dialect to nvcc; device code is C++17.
    set(CMAKE_CUDA_STANDARD 17)
    set(PROXIMA_CUDA_ENABLED ON)
  elseif(PROXIMA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PROXIMA_WITH_CUDA=ON but no CUDA compiler was found (set CUDACXX)")
  endif()
endif()
message(STATUS "Proxima: CUDA kernels ${PROXIMA_CUDA_ENABLED}")
