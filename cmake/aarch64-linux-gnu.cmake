# Cross build for aarch64 Linux (Grace / GH200 nodes) with Debian's cross compiler, against a
# sysroot of Debian's arm64 packages that scripts/aarch64.sh downloads and unpacks (nothing arm64
# is installed into the host). Test binaries run under qemu-aarch64 (CMAKE_CROSSCOMPILING_EMULATOR,
# which ctest and gtest_discover_tests use). The sysroot's path comes from the environment
# (PROXIMA_AARCH64_SYSROOT), which CMake's try_compile projects see too.
if(NOT DEFINED ENV{PROXIMA_AARCH64_SYSROOT})
  message(FATAL_ERROR "PROXIMA_AARCH64_SYSROOT is not set: run scripts/aarch64.sh")
endif()
set(PROXIMA_AARCH64_SYSROOT $ENV{PROXIMA_AARCH64_SYSROOT})
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_SYSROOT ${PROXIMA_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH ${PROXIMA_AARCH64_SYSROOT})
# Build tools (protoc, grpc_cpp_plugin) are the host's; libraries, headers and packages the
# sysroot's only.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(ENV{PKG_CONFIG_SYSROOT_DIR} ${PROXIMA_AARCH64_SYSROOT})
set(ENV{PKG_CONFIG_LIBDIR}
  ${PROXIMA_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu/pkgconfig:${PROXIMA_AARCH64_SYSROOT}/usr/share/pkgconfig)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;${PROXIMA_AARCH64_SYSROOT})
