# Cross build for arm64 (DGX Spark's Grace CPU, any aarch64 Linux) with Debian's cross
# toolchain (g++-aarch64-linux-gnu) and the arm64 libraries installed multiarch
# (dpkg --add-architecture arm64; libfoo-dev:arm64 in /usr/lib/aarch64-linux-gnu):
#   scripts/install-deps.sh --arch arm64
#   cmake -S . -B build-arm64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
# scripts/cross-arm64.sh does this in a root of its own and runs the unit tests under
# qemu-user. ctest runs the test binaries through qemu-aarch64-static (the emulator below).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(SPARK_CROSS_TRIPLET aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${SPARK_CROSS_TRIPLET}-gcc)
set(CMAKE_CXX_COMPILER ${SPARK_CROSS_TRIPLET}-g++)
# Multiarch: libraries and CMake packages under lib/aarch64-linux-gnu of the usual prefixes.
set(CMAKE_LIBRARY_ARCHITECTURE ${SPARK_CROSS_TRIPLET})
# pkg-config must read the arm64 .pc files only, never the build machine's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/${SPARK_CROSS_TRIPLET}/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

find_program(SPARK_QEMU_AARCH64 NAMES qemu-aarch64-static qemu-aarch64)
if(SPARK_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${SPARK_QEMU_AARCH64})
endif()

# CUDA: the x86-64 nvcc builds device code for sm_121 but links host code for aarch64 only
# with NVIDIA's cross target (targets/sbsa-linux in the toolkit). Without it the arm64 build
# is the CPU path.
if(NOT DEFINED SPARK_CUDA)
  if(EXISTS /usr/local/cuda/targets/sbsa-linux)
    set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    set(CMAKE_CUDA_ARCHITECTURES 121)
    set(CMAKE_CUDA_FLAGS_INIT "--target-directory sbsa-linux")
  else()
    message(STATUS "sparkctl: no /usr/local/cuda/targets/sbsa-linux (NVIDIA's aarch64 cross "
                   "target): building the arm64 CPU path, without CUDA")
    set(SPARK_CUDA OFF CACHE BOOL "Build CUDA kernels when nvcc is found")
  endif()
endif()
