# CUDA is enabled when nvcc is found (PATH, CUDACXX, or /usr/local/cuda). Kernels build for
# sm_80 (A100), sm_86 (A10, RTX 30xx), sm_89 (L40S, RTX 40xx), sm_90a (H100/H200), sm_120
# (RTX 50xx) and sm_121a (GB10) unless CMAKE_CUDA_ARCHITECTURES says otherwise.
# The binaries never link libcuda or libnccl: cudart is linked statically (it loads the
# driver at run time) and NCCL is opened with dlopen, so a machine without a driver runs
# the CPU path instead of failing to start.
set(SPARK_HAVE_CUDA OFF)
if(SPARK_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "nvcc")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The "a" targets allow the architecture's own instructions (clusters, programmatic
    # launch); their code runs only on exactly that compute capability. The sm_90 paths are
    # chosen at run time (cuda_hopper_paths()), so the plain targets before it build them as
    # no-ops never launched. cuda_select_device() refuses a GPU outside the list at start.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 86 89 90a 120 121a)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(SPARK_HAVE_CUDA ON)
    message(STATUS "sparkctl: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
  else()
    message(STATUS "sparkctl: nvcc not found; building the CPU path only")
  endif()
endif()

# Where NCCL's header lives (NCCL_HOME hint, then the CUDA toolkit). Only the header is
# needed at build time; libnccl.so.2 is opened at run time.
find_path(SPARK_NCCL_INCLUDE_DIR nccl.h
  HINTS $ENV{NCCL_HOME}/include ${NCCL_HOME}/include ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
