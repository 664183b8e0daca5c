# Cross build for aarch64 Linux (e.g. Grace/GH200 nodes) with Debian's cross compiler and
# multiarch arm64 libraries; test binaries run under qemu-aarch64 (CMAKE_CROSSCOMPILING_EMULATOR,
# which ctest and gtest_discover_tests use). scripts/aarch64.sh installs all of it and builds
# the codec library (-DPROXIMA_KERNELS_ONLY=ON).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# find_package looks in /usr/lib/aarch64-linux-gnu (multiarch), never at the host's libraries.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
set(CMAKE_IGNORE_PATH /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu)
